"""Atomic files: written to a temporary file beside the target, then renamed over it."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from fedavg.util.errors import DISK_ERRNOS, RunError


def atomic_write(path: Path, write) -> None:
    """Write ``path`` all at once: ``write(tmp)`` fills a temporary file beside it, renamed over it.

    A crash or kill at any moment leaves either the old file or the new one, never a part.

    Raises
    ------
    RunError
        The disk is full, read-only or forbids writing there (``cannot write PATH: No space
        left on device``); the old file, if any, is kept.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        _raise_if_disk(exc, path)
        raise
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would create it (mkstemp: 0600)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        _raise_if_disk(exc, path)
        raise


def _raise_if_disk(exc: BaseException, path: Path) -> None:
    """Raise RunError naming ``path`` if ``exc`` is a full or read-only disk.

    Covers Python's ``OSError`` and safetensors' own error, which carries the OS error in
    its text (``Os { code: 28, ... }`` or ``(os error 28)``).
    """
    code = exc.errno if isinstance(exc, OSError) else None
    if type(exc).__name__ == "SafetensorError":
        found = re.search(r"(?:code: |os error )(\d+)", str(exc))
        code = int(found.group(1)) if found else None
    if code in DISK_ERRNOS:
        raise RunError(f"cannot write {path}: {os.strerror(code)}") from None
