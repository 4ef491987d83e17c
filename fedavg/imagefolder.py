"""Image folders (one subfolder per class): say what reading one leaves out.

``datasets``' ``imagefolder`` builder reads ``root/<class>/<image>`` (or
``root/<split>/<class>/<image>``) and silently passes over class folders without images and
files that are not images or are hidden. :func:`image_folder_notes` names them, so that the
run's notes (console and ``model.json``) say what was skipped. No Flower import.
"""

from __future__ import annotations

from pathlib import Path

from fedavg.datasources import FILE_BUILDERS, IMAGE_SUFFIXES

#: Folder names the ``imagefolder`` builder reads as splits (``root/train/<class>/...``).
SPLIT_FOLDERS = {"train", "training", "test", "testing", "eval", "evaluation", "validation",
                 "valid", "val", "dev"}


def _image_extensions() -> set[str]:
    """Suffixes the ``imagefolder`` builder reads as images (ours if it does not say)."""
    try:
        from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

        return {e.lower() for e in ImageFolder.EXTENSIONS}
    except (ImportError, AttributeError):  # pragma: no cover - layout of another version
        return set(IMAGE_SUFFIXES)


def image_folder_notes(path: Path, source: str) -> list[str] | None:
    """Say what reading ``path`` as an image folder (one subfolder per class) leaves out.

    Parameters
    ----------
    path : pathlib.Path
        A folder.
    source : str
        How the user named it, for the notes.

    Returns
    -------
    list of str or None
        ``None`` when ``path`` is not an image folder (it holds data files such as
        ``.csv`` or ``.parquet``, or no image at all). Otherwise at most two lines: the
        class folders that hold no image (they are not classes), and the files that are
        not images or are hidden (names starting with ``.`` or ``__``), which the reader
        skips; an empty list when nothing is skipped.
    """
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    if any(f.suffix.lower() in FILE_BUILDERS for f in files):
        return None
    extensions = _image_extensions()

    def hidden(rel: Path) -> bool:
        return any(part.startswith((".", "__")) for part in rel.parts)

    images = [f for f in files if f.suffix.lower() in extensions and not hidden(f)]
    if not images:
        return None
    chosen = set(images)
    skipped = [f for f in files if f not in chosen]
    with_images = {parent for f in images for parent in f.parents}
    tops = [d.relative_to(path) for d in sorted(path.iterdir()) if d.is_dir()]
    splits = [d for d in tops if d.name.lower() in SPLIT_FOLDERS and d in with_images]
    class_dirs = [c.relative_to(path) for d in splits for c in sorted((path / d).iterdir())
                  if c.is_dir()] if splits else tops
    empty = [d for d in class_dirs if d not in with_images and not hidden(d)]
    notes = []
    if empty:
        notes.append(f"skipped {len(empty)} class folder(s) of {source} with no images: "
                     f"{_listing(empty)}")
    if skipped:
        notes.append(f"skipped {len(skipped)} file(s) of {source} that are not images or "
                     f"are hidden: {_listing(skipped)}")
    return notes


def _listing(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(p.as_posix() for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
