"""Quantities as people read them: byte counts in decimal units."""

from __future__ import annotations


def size(num_bytes: int) -> str:
    """``num_bytes`` in decimal units: ``812 B``, ``45.3 kB``, ``91.2 MB``, ``1.20 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{int(num_bytes)} B"
