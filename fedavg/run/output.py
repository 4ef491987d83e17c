"""Where results go: the run folder and the predictions file of ``fedavg predict``.

A run folder has a default name and an overwrite rule, and is written by one command at a
time: :func:`make_output` takes an exclusive lock on it (``flock`` on the folder itself, so
nothing is left behind and a killed process lets go at once), :func:`release_output` gives
it back.
"""

from __future__ import annotations

import csv
import datetime as _dt
import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fedavg.data.text import TOKENIZER_FILE
from fedavg.util.atomic import atomic_write
from fedavg.util.errors import UserError

#: The run folder of the run going on in this process (for interrupt messages).
RUN_OUTPUT: list[Path] = []
#: Folders whose previous run this process removed (``--overwrite``; interrupt messages).
REPLACED: list[Path] = []

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
        RUN_OUTPUT[:] = [candidate]  # before it exists: see make_output
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            RUN_OUTPUT.clear()  # another command's
            continue
        except BaseException:
            RUN_OUTPUT.clear()
            raise
    raise UserError(f"cannot find a free run folder next to {base}; pass --output")


def make_output(output: str | Path | None, *, lock: bool = False,
                overwrite: bool | None = None) -> Path:
    """Create the run folder: ``output``, or a new :func:`default_output`.

    Parameters
    ----------
    output : path, optional
        The folder; ``None`` for a new ``runs/<timestamp>``.
    lock : bool
        Also take the folder's writer lock, until :func:`release_output` (or the end of
        the process).
    overwrite : bool, optional
        With ``lock``: check again, holding the lock, that the folder holds no run unless
        ``overwrite`` (:func:`check_output`). A command that checked at its start and then
        loaded data for a while would otherwise replace a run another command finished
        meanwhile. ``None`` (a resume, which writes into its run) checks nothing.

    Raises
    ------
    UserError
        It cannot be created, another command holds its lock (a run still going on), or
        it now holds a run and ``overwrite`` is false.
    """
    out = Path(output) if output is not None else default_output()
    if not out.exists():  # recorded before it is made: a Ctrl-C or SIGTERM right after would
        RUN_OUTPUT[:] = [out]  # otherwise leave the new folder behind, empty
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        RUN_OUTPUT.clear()
        why = exc.strerror
        if out.is_symlink() and not out.exists():  # mkdir said "File exists"
            why = (f"it links to {os.readlink(out)}, which does not exist; create that or "
                   "pass another --output")
        raise UserError(f"cannot create output folder {out}: {why}") from None
    if lock:
        _lock(out)
        for name in (*RUN_FILES, "tokenizer.json"):  # a killed command's half-written run
            for tmp in out.glob(f".{name}.*.tmp"):  # file (atomic_write's): no other command
                tmp.unlink(missing_ok=True)  # writes here while we hold the lock
        if overwrite is not None:
            try:
                check_output(out, overwrite)
            except UserError:
                release_output(out)
                raise
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


#: With ``--save-node-models``: the folder beside ``nodes/`` holding the model the last
#: round's nodes started from.
START = "start"


def clear_previous_run(out: Path) -> None:
    """Remove a previous run's files from ``out`` (``--overwrite``), all of them at once.

    Its :data:`RUN_FILES`, its saved node models (``nodes/node-*``) and their start
    (:data:`START`) go together, so that
    a new run that then fails leaves no mix of the old run's files and its own. Other files
    in ``out`` stay.

    Raises
    ------
    UserError
        A file that cannot be removed (another user's, read-only folder), naming it.
    """
    import shutil

    nodes = out / "nodes"
    if any((out / name).exists() for name in RUN_FILES):
        REPLACED.append(out)
    try:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        for folder in [*(nodes.glob("node-*") if nodes.is_dir() else ()), out / START]:
            if folder.is_dir() and (folder / "model.safetensors").exists():
                shutil.rmtree(folder)
    except OSError as exc:
        raise UserError(f"--overwrite cannot remove the previous run's {exc.filename}: "
                        f"{exc.strerror}; remove it yourself or choose another --output") \
            from None
    try:
        nodes.rmdir()  # only when it is there with nothing else in it
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
        try:
            exists, is_dir = path.exists(), path.is_dir()
        except OSError as exc:  # a name too long, a loop of links
            raise UserError(f"{flag} {out}: {exc.strerror}; give another folder") from None
        if exists:
            if not is_dir:
                where = "is a file" if path == out else f"is below {path}, a file"
                raise UserError(f"{flag} {out} {where}; give a folder")
            return


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to write over a previous run's files unless ``overwrite``.

    Raises
    ------
    UserError
        ``out`` is a file or a sweep's folder, or holds a run and ``overwrite`` is false.
    """
    check_folder(out)
    if (out / "sweep.json").is_file():  # its points' folders are in it, not a run
        raise UserError(f"{out} is a sweep's folder (sweep.json); choose another --output")
    if not overwrite and any((out / name).exists() for name in RUN_FILES):
        stopped = (out / "checkpoint.safetensors").is_file() and not (
            out / "summary.json").exists()  # fedavg.run.resume.CHECKPOINT: resumable
        raise UserError(f"{out} already holds a run; choose another --output or pass "
                        "--overwrite to replace it" + (
                            f" (or --resume {out} to finish it)" if stopped else ""))


def check_predictions_output(path: str | Path, model_dir: str | Path,
                             inputs: Sequence[str] = ()) -> None:
    """Refuse a predictions file that would replace an input or a file of the model's folder.

    Raises
    ------
    UserError
        Not ``.csv`` / ``.json``; one of ``inputs``; a file named as fedavg's run files
        (model, settings, metrics, checkpoint, tokenizer) that exists or is ``model_dir``'s;
        below a file.
    """
    path = Path(path)
    if path.suffix.lower() not in (".csv", ".json"):
        raise UserError(f"--output must end in .csv or .json (got {path.name})")
    where = path.expanduser().resolve()
    if any(Path(i).exists() and Path(i).resolve() == where for i in inputs):
        raise UserError(f"--output {path} is one of the inputs; write the predictions to "
                        "another file")
    if where.name in (*RUN_FILES, TOKENIZER_FILE) and (
            where.exists() or where.parent == Path(model_dir).expanduser().resolve()):
        raise UserError(f"--output {path} would replace a run's or model's own {where.name}; "
                        "write the predictions to another file")
    check_folder(path.parent, f"--output {path}: its folder")


PREDICTION_COLUMNS = ("input", "prediction", "class_index", "confidence")


def write_predictions_csv(rows: list[dict[str, Any]], stream: TextIO) -> None:
    """Write rows as CSV (a header, then one line per input) to an open text stream."""
    writer = csv.DictWriter(stream, fieldnames=list(PREDICTION_COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def write_predictions(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as CSV (``.csv``) or JSON (``.json``), atomically.

    Raises
    ------
    UserError
        Another suffix, or a folder that cannot be written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise UserError(f"--output must end in .csv or .json (got {path.name})")
    check_folder(path.parent, f"--output {path}: its folder")

    def _write(tmp: Path) -> None:
        if suffix == ".json":
            Path(tmp).write_text(json.dumps(rows, indent=2) + "\n")
            return
        with open(tmp, "w", newline="") as fh:
            write_predictions_csv(rows, fh)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, _write)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    return path
