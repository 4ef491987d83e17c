"""What every layer may use: user errors, atomic files, private temp folders, interrupts."""
