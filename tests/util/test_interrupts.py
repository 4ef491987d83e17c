"""A terminal that hangs up: what a clean stop prints afterwards must not fail the stop."""

import os
import pty
import sys
import time

CHILD = r"""
import os, signal, sys, time
sys.path[:0] = {path!r}
from fedavg.cli.support import err_console
from fedavg.util.interrupts import detach_lost_terminal

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # stay alive past the hangup, as our handler does
os.write(1, b"ready\n")
time.sleep(2.0)  # the terminal hangs up meanwhile
if {how!r} == "detach":
    detach_lost_terminal()
try:
    if {how!r} == "raw":  # a plain write into the lost terminal
        sys.stderr.write("interrupted: finished rounds are kept\n")
        sys.stderr.flush()
    else:  # fedavg's console, which detaches the lost terminal itself
        err_console.print("interrupted: finished rounds are kept")
    sys.stdout.write("and a last line\n")
    sys.stdout.flush()
except OSError as exc:
    os._exit(10 + exc.errno)
os._exit(0)
"""


def _after_hangup(how: str) -> int:
    pid, master = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c",
                                  CHILD.format(path=sys.path, how=how)])
    deadline = time.monotonic() + 60
    while b"ready" not in os.read(master, 100):
        assert time.monotonic() < deadline
    os.close(master)  # the terminal hangs up
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_writing_to_a_terminal_that_hung_up_fails_with_eio():
    import errno

    assert _after_hangup("raw") == 10 + errno.EIO


def test_after_detaching_the_lost_terminal_a_stop_prints_without_error():
    assert _after_hangup("detach") == 0


def test_the_console_detaches_a_lost_terminal_it_writes_to():
    """A round line printed before the hangup's SIGHUP arrives: no EIO, nor after it."""
    assert _after_hangup("console") == 0


def test_a_log_file_is_not_detached(tmp_path):
    from fedavg.util.interrupts import detach_lost_terminal

    log = tmp_path / "out.log"
    saved = os.dup(1)
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 1)
        os.close(fd)
        detach_lost_terminal()
        os.write(1, b"kept\n")
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert log.read_text() == "kept\n"
