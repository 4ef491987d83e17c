"""What every ``fedavg`` command shares: the consoles, one-line errors, signals, the entry.

A user mistake is one line on stderr and exit code 2 (a failed run: 1), whether it comes
from our checks (:func:`guard`) or from typer's own parsing (:func:`run_app`); Ctrl-C and
SIGTERM stop a command and its engine processes at once with exit code 130
(:func:`on_signal`).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from fedavg.util.errors import DISK_ERRNOS, CommandError, RunError, UserError

# soft_wrap: long lines are never broken up, so they read whole in a terminal of any width
# and in a log file; tables fold their cells instead of cutting them.
#: When this command started (``time.time()``): files older than this are a previous run's.
STARTED = time.time()

if os.environ.get("COLUMNS", "").strip() == "0":  # rich would print nothing at all
    del os.environ["COLUMNS"]


class _Console(Console):
    """A console whose reader may leave (``fedavg simulate | head``): the command goes on.

    Rich ends the program (exit code 1) at the first write into a closed pipe; a run would
    stop with its model unsaved. Here the rest of the output is dropped instead.
    """

    def on_broken_pipe(self) -> None:
        """Send what follows to ``os.devnull`` and go on (no ``SystemExit``)."""
        self.quiet = True  # and nothing more is written
        try:  # Python flushes the stream at exit: let that go to nothing, quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.file.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stream without a file descriptor
            pass

    def _check_buffer(self) -> None:
        """Write what is buffered; into a terminal that hung up, nothing, and go on.

        A terminal that hung up (an ssh session or a tmux pane closed) fails every write
        with ``EIO``, possibly before its SIGHUP reaches the main thread: a round line
        printed by the engine's thread then ended the run with exit code 1 instead of the
        hangup's clean stop (130). What follows goes to ``os.devnull``.
        """
        try:
            super()._check_buffer()
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            del self._buffer[:]
            self.quiet = True
            # lazy: loads with its command: `fedavg --help` stays fast
            from fedavg.util.interrupts import detach_lost_terminal

            detach_lost_terminal()


console = _Console(soft_wrap=True, emoji=False)  # a path like m.py:ok:x stays as written
err_console = _Console(stderr=True, soft_wrap=True, emoji=False)


#: Characters that ``str.splitlines`` breaks at: shown escaped, so an error stays one line.
_LINE_BREAKS = {c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(text: str) -> str:
    """Return ``text`` with its line-break characters escaped, as Python writes them."""
    return text.translate(str.maketrans(_LINE_BREAKS))


@contextlib.contextmanager
def guard(interrupted: str = "interrupted", failed: str = "run failed"):
    """Turn user mistakes into one line on stderr and exit code 2 (1 for failed runs).

    A Ctrl-C in a command without a signal handler of its own (:func:`on_signal`) says
    ``interrupted`` and exits 130. A failure (a ``RunError``: a full disk, a run that
    could not finish) is said after ``failed``, or after its own label (``CommandError``).
    """
    try:
        try:
            yield
        except Exception as exc:  # a full or read-only disk: a failed run, not a bug
            if too_long := name_too_long(exc):
                raise UserError(too_long) from None
            if isinstance(exc, RuntimeError) and "home directory" in str(exc):  # expanduser
                raise UserError("a path starts with ~NAME for a user this machine does not "
                                "know: give the folder itself") from None
            if isinstance(exc, ValueError) and "null byte" in str(exc):  # os and pathlib say so
                raise UserError("a path holds a NUL character (\\x00): give a path without "
                                "one") from None
            why = disk_full(exc)
            if why is None:
                raise
            verb = "access" if getattr(exc, "errno", None) == errno.EACCES else "write"
            raise RunError(f"cannot {verb} {why}") from None
    except KeyboardInterrupt:
        err_console.print(escape(interrupted), highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except UserError as exc:
        err_console.print(f"[bold red]error:[/] {escape(one_line(str(exc)))}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(2) from None
    except RunError as exc:
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.run.output import RUN_OUTPUT

        hint = resume_hint(RUN_OUTPUT[0], exc.resume_without) if RUN_OUTPUT else None
        label = exc.label if isinstance(exc, CommandError) else failed
        err_console.print(f"[bold red]{label}:[/] {escape(one_line(str(exc)))}"
                          + (f"; {escape(hint)}" if hint else ""), highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1) from None


def name_too_long(exc: BaseException) -> str | None:
    """Say which given path the system refused as too long (``ENAMETOOLONG``); else None.

    A name in a path holds at most 255 bytes on common file systems, a path 4,096: every
    command's path arguments and options, and the settings that name files, meet this
    here, in one place.
    """
    if not (isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG):
        return None
    name = str(exc.filename or "a path")
    shown = name if len(name) <= 80 else f"{name[:60]}...{name[-16:]}"
    return (f"{shown}: a name in this path is too long (at most 255 bytes a file or folder "
            "name, 4,096 a path): give a shorter one")


def disk_full(exc: BaseException) -> str | None:
    """Say which file could not be written and why, for a full or read-only disk; else None.

    (Model and JSON files say it themselves: see :func:`fedavg.util.atomic.atomic_write`.)
    """
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return f"{exc.filename or 'a file'}: {exc.strerror}"
    return None


def on_signal(message, cleanup=None):
    """Install the Ctrl-C / SIGTERM handler: say ``message``, clean up, exit 130.

    ``message`` is a string or a function returning one, called at signal time;
    ``cleanup`` defaults to stopping our Flower processes. Finished rounds are kept; a run
    folder this command made and left empty is removed.
    """
    stopping = []

    def _stop(signum, frame):
        if stopping:  # a second signal while stopping: the first one finishes the job
            return
        stopping.append(signum)
        # Whatever a step hits (a message that cannot be made or written, a cleanup that
        # fails), the process ends here with 130: an exception out of a signal handler would
        # surface in whatever the main thread was doing, as a traceback and exit code 1.
        try:
            _say_stopping(signum, message)
            if cleanup is not None:
                cleanup()
            else:
                # lazy: loads with its command: `fedavg --help` stays fast
                from fedavg.engines.deployment.processes import stop_all

                stop_all()
        finally:
            with contextlib.suppress(BaseException):
                # lazy: loads with its command: `fedavg --help` stays fast
                from fedavg.run.output import RUN_OUTPUT, remove_if_empty

                if RUN_OUTPUT:
                    remove_if_empty(RUN_OUTPUT[0])
            os._exit(130)

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.util.interrupts import stoppers

    for sig in stoppers():
        signal.signal(sig, _stop)


def _say_stopping(signum: int, message) -> None:
    """Print ``message`` (a string, or a function making one) as a signal stops the command.

    After a hangup the lost terminal is detached first (writes to it fail). The signal may
    land inside an import (rich loads its emoji table at the first print), or inside a write
    to the same stream: each step falls back, and what cannot be said is dropped.
    """
    if signum == signal.SIGHUP:  # the terminal is gone: writes to it would fail
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.util.interrupts import detach_lost_terminal

        detach_lost_terminal()
    console.quiet = True  # no round line printed by another thread after the message
    try:
        text = message() if callable(message) else message
    except Exception:  # noqa: BLE001 - a message that cannot be made: the plain word
        text = "interrupted"
    try:
        if err_console.is_terminal:  # the message on its own line, not after the bar's
            err_console.file.write("\r\x1b[2K")
        err_console.print(escape(text), soft_wrap=True)
    except Exception:  # noqa: BLE001
        with contextlib.suppress(Exception):
            os.write(2, f"{text}\n".encode(errors="replace"))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def resume_hint(output: Path | None, without: tuple[str, ...] = ()) -> str | None:
    """Say where the finished rounds are kept and how to resume, or ``None`` without any.

    A checkpoint counts when this command wrote it, or when this command resumes it.
    ``without``: options that made the run fail, left out of the command (and named).
    """
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.run.resume import CHECKPOINT, resume_command

    path = None if output is None else output / CHECKPOINT
    ours = path is not None and path.exists() and (
        path.stat().st_mtime >= STARTED or any(a == "--resume" or a.startswith("--resume=")
                                               for a in sys.argv[1:]))
    if not ours:
        return None
    how = "".join(f" a larger {o} or without it" for o in without)
    return (f"finished rounds are kept in {output}; resume with{how}: "
            f"{resume_command(sys.argv[1:], output, drop=without)}")


def interrupted(output: Path | None) -> str:
    """Return what to say on a signal: where the finished rounds are kept, and how to resume."""
    summary = None if output is None else Path(output) / "summary.json"
    if summary is not None and summary.is_file() and summary.stat().st_mtime >= STARTED:
        return f"interrupted after the run finished: its model and results are in {output}"
    hint = resume_hint(output)
    if hint:
        return f"interrupted: {hint}"
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.run.output import REPLACED

    return ("interrupted before the first round finished: nothing of this run was saved"
            + (", and the run it replaced (--overwrite) was removed as it began training"
               if output is not None and Path(output) in REPLACED else ""))


def _terminated(signum, frame) -> None:
    if signum == signal.SIGHUP:
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.util.interrupts import detach_lost_terminal

        detach_lost_terminal()
    raise KeyboardInterrupt


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (``poll`` says ``POLLERR``)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.__stdout__.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or no poll on this system
        return False


def _flush_stdout() -> None:
    """Write out what ``print`` left buffered; into a closed pipe, drop it quietly.

    Without this the interpreter flushes it at exit, after this module's handling, and a
    closed pipe there is "Exception ignored ... BrokenPipeError" and exit code 120.
    """
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the reader has gone, or stdout is closed
        try:  # what is still buffered goes nowhere, not into a second failed flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass


def run_app(app: typer.Typer) -> None:
    """Run ``app`` as the console script: a usage mistake is one line and exit code 2.

    Output into a pipe whose reader stopped early (``fedavg evaluate DIR --json | head -c1``)
    ends the command quietly with exit code 0.

    SIGTERM stops a command as Ctrl-C does (:func:`guard` says so, exit 130) unless the
    command installs a handler of its own (:func:`on_signal`).
    """
    import click

    # The CLI shows node failures and progress itself; keep library warnings off stderr.
    logging.getLogger("fedavg").addHandler(logging.NullHandler())
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.util.interrupts import stoppers

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig in stoppers():  # not one the process was started with ignored
            signal.signal(sig, _terminated)
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="fedavg", standalone_mode=False)
    except SystemExit as exc:  # click ends a command whose output pipe closed with code 1
        if exc.code != 1 or not _stdout_closed():
            raise
        code = 0  # the reader stopped early (`| head`): nothing failed here
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()  # the help text
        code = exc.exit_code
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "fedavg"
        if where == "fedavg" and len(sys.argv) > 1 and sys.argv[1] in command.commands:
            where = f"fedavg {sys.argv[1]}"
        message = exc.format_message()
        message = message[:1].lower() + message[1:]  # like our own errors
        err_console.print(f"[bold red]error:[/] {escape(one_line(message))} (see `{where} --help`)",
                          highlight=False)
        code = exc.exit_code
    except click.Abort:
        err_console.print("aborted")
        code = 1
    _flush_stdout()
    # The command is done: a Ctrl-C while the interpreter shuts down ends it at once, not
    # with a traceback from inside torch's exit hooks.
    if signal.SIGINT in stoppers():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    # The OS frees the heap (torch, Flower, Ray objects) at exit: without this, Python's own
    # last garbage collection of it took 1-2 s after every simulation.
    gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)
