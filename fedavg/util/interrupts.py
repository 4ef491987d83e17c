"""Hold Ctrl-C / SIGTERM while a library imports: an import cut short leaves it broken.

An interrupt inside ``import torch`` can abort the process (torch's C++ import code), and
one inside any large import leaves half-initialised modules behind, so that every later
import of it in the same Python process fails ("partially initialized module 'torch'").
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
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


def detach_lost_terminal() -> None:
    """After a hangup, send standard output and error that went to the terminal to /dev/null.

    A terminal that hung up (an ssh session or a tmux pane closed) fails every later write
    with ``EIO``; what a clean stop prints after SIGHUP (its "interrupted" line, a progress
    bar's last refresh) would then end the stop with a traceback and exit code 1. Streams
    that are not a terminal (a log file, a pipe) are left as they are.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (isatty fails once hung up)
                os.dup2(devnull, fd)
    os.close(devnull)


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
