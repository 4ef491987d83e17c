"""The run folder: its default name, creation, the overwrite rule, and one writer at a time.

A run folder is written by one command at a time: :func:`make_output` takes an exclusive
lock on it (``flock`` on the folder itself, so nothing is left behind and a killed process
lets go at once), :func:`release_output` gives it back.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
from pathlib import Path

from fedavg.errors import UserError

#: The run folder of the run going on in this process (for interrupt messages).
RUN_OUTPUT: list[Path] = []

#: The files a finished run folder holds; their presence means "a run is here".
RUN_FILES = ("model.safetensors", "model.json", "metrics.jsonl", "summary.json",
             "checkpoint.safetensors")

_LOCKS: dict[Path, int] = {}


def default_output(prefix: str = "") -> Path:
    """Create a new ``runs/<YYYYmmdd-HHMMSS>[-N]`` folder under the current folder, return it.

    Raises
    ------
    UserError
        No free name among 999 candidates.
    """
    base = Path("runs") / (prefix + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 1000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            continue
    raise UserError(f"cannot find a free run folder next to {base}; pass --output")


def make_output(output: str | Path | None, *, lock: bool = False) -> Path:
    """Create the run folder: ``output``, or a new :func:`default_output`.

    Parameters
    ----------
    output : path, optional
        The folder; ``None`` for a new ``runs/<timestamp>``.
    lock : bool
        Also take the folder's writer lock, until :func:`release_output` (or the end of
        the process).

    Raises
    ------
    UserError
        It cannot be created, or another command holds its lock (a run still going on).
    """
    out = Path(output) if output is not None else default_output()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output folder {out}: {exc.strerror}") from None
    if lock:
        _lock(out)
    RUN_OUTPUT[:] = [out]
    return out


def _lock(out: Path) -> None:
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UserError(f"another fedavg command is writing into {out} (a run still going "
                        "on?); wait for it to end or choose another folder") from None
    _LOCKS[out] = fd


def release_output(out: Path) -> None:
    """Give back the writer lock of :func:`make_output` (nothing if not held)."""
    fd = _LOCKS.pop(out, None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the lock


def remove_if_empty(out: Path) -> None:
    """Remove the run folder of a run that failed before writing anything into it.

    The ``runs/`` folder above it goes too when that is left empty. Its lock is released.
    """
    release_output(out)
    for folder in (out, out.parent) if out.parent.name == "runs" else (out,):
        try:
            folder.rmdir()  # only succeeds when empty
        except OSError:
            return


def clear_previous_run(out: Path) -> None:
    """Remove a previous run's files from ``out`` (``--overwrite``), all of them at once.

    Its :data:`RUN_FILES` and its saved node models (``nodes/node-*``) go together, so that
    a new run that then fails leaves no mix of the old run's files and its own. Other files
    in ``out`` stay.
    """
    import shutil

    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    nodes = out / "nodes"
    if nodes.is_dir():
        for folder in nodes.glob("node-*"):
            if folder.is_dir() and (folder / "model.safetensors").exists():
                shutil.rmtree(folder)
        try:
            nodes.rmdir()  # only when nothing else is in it
        except OSError:
            pass


def check_folder(out: Path, flag: str = "--output") -> None:
    """Refuse a folder path that is, or lies below, a file (it could never be made).

    Raises
    ------
    UserError
        Naming the file in the way.
    """
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == out else f"is below {path}, a file"
                raise UserError(f"{flag} {out} {where}; give a folder")
            return


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to write over a previous run's files unless ``overwrite``.

    Raises
    ------
    UserError
        ``out`` is a file, or holds a run and ``overwrite`` is false.
    """
    check_folder(out)
    if not overwrite and any((out / name).exists() for name in RUN_FILES):
        raise UserError(f"{out} already holds a run; choose another --output or pass "
                        "--overwrite to replace it")


