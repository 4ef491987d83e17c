"""Temporary folders of ours: private, removed on every exit path, and after a kill too.

A node's or coordinator's Flower home (with its SuperExec secret) and a simulation's data and
Ray session are each a :class:`PrivateDir`. Its owner removes it when it ends (normally, on
an error, or in the CLI's signal handlers through :func:`remove_all`); one whose process was
killed outright (SIGKILL, out of memory) is removed by the next ``fedavg`` process that makes
a folder with the same prefix: a folder's lock file stays locked for as long as its process
lives, so a free lock marks an abandoned folder.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from pathlib import Path

_DIRS: list[PrivateDir] = []
_LOCK = ".lock"


class PrivateDir:
    """A temporary folder only this user can read (mode 700), locked while its process lives.

    Parameters
    ----------
    prefix : str
        Start of the folder's name, e.g. ``fedavg-node-``; abandoned ``prefix*`` folders in
        ``base`` are removed first.
    base : str, optional
        Where to make it (default: the system temporary folder, ``TMPDIR``).
    tag : str
        Put after ``prefix`` in the name (e.g. the pid), not part of the abandoned-folder match.

    """

    def __init__(self, prefix: str, base: str | None = None, tag: str = "") -> None:
        base = base or tempfile.gettempdir()
        remove_abandoned(prefix, base)
        self.name = tempfile.mkdtemp(prefix=prefix + tag, dir=base)
        staged = Path(self.name) / ".lock.new"
        self._lock = open(staged, "w")  # not inherited by the programs we start (PEP 446)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        staged.rename(Path(self.name) / _LOCK)  # visible only once locked
        _DIRS.append(self)

    def cleanup(self) -> None:
        """Remove the folder (again: nothing)."""
        if self in _DIRS:
            _DIRS.remove(self)
        self._lock.close()
        shutil.rmtree(self.name, ignore_errors=True)

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc) -> None:
        self.cleanup()


def remove_all() -> None:
    """Remove every folder this process made (for signal handlers, before ``os._exit``)."""
    for folder in list(_DIRS):
        folder.cleanup()


def remove_abandoned(prefix: str, base: str | None = None) -> None:
    """Remove this user's ``prefix*`` folders in ``base`` whose process is gone (lock free)."""
    for folder in Path(base or tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            with open(folder / _LOCK) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # in use, another user's, or not one of ours
            continue
