"""Hold Ctrl-C / SIGTERM while a library imports: an import cut short leaves it broken.

An interrupt inside ``import torch`` can abort the process (torch's C++ import code), and
one inside any large import leaves half-initialised modules behind, so that every later
import of it in the same Python process fails ("partially initialized module 'torch'").
"""

from __future__ import annotations

import contextlib
import signal
import threading


def stoppers() -> tuple[int, ...]:
    """SIGINT, SIGTERM and SIGHUP, less one this process was started with ignored.

    A shell starts a script's background job (``fedavg simulate ... &``) with SIGINT
    ignored, so that a Ctrl-C meant for the script does not stop it, and ``nohup`` ignores
    SIGHUP; Python keeps that, and so do fedavg's own handlers. SIGHUP is the hangup of the
    terminal (an ssh session or a tmux pane closed): it stops a command as Ctrl-C does.
    """
    return tuple(sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                 if signal.getsignal(sig) is not signal.SIG_IGN)


@contextlib.contextmanager
def held_interrupts(raise_after: bool = True):
    """Hold SIGINT and SIGTERM within the block; yield the list of those that came.

    Only in the main thread (elsewhere signals are not delivered; the block runs as is).
    With ``raise_after``, the first held signal is raised again once the block ends, for
    the handler that was there before (Ctrl-C: ``KeyboardInterrupt``).
    """
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in stoppers()}
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held and raise_after:
        signal.raise_signal(held[0])
