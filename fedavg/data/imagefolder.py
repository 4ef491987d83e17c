"""Image folders: ``root/<class>/<image>`` or ``root/<split>/<class>/<image>``, read by us.

``datasets``' ``imagefolder`` builder guesses splits from file names (``test_3.png`` and
``scan_val_1.png`` become splits, and every other image is dropped), labels an image by its
innermost folder (``cat/session1/a.png`` becomes class ``session1``), and reads ``Test/`` as
a class, not a split. :func:`read_image_folder` lists the images itself: a split is a
top-level folder with a split name (any case), a class is a folder right under the root
or under a split, and every image below a class folder (sub-folders and links to folders
included) is of that class. Its notes name what it skips: class folders without images,
images outside class folders, files that are not images or are hidden. No Flower import.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedavg.data.formats import FILE_BUILDERS, IMAGE_SUFFIXES
from fedavg.util.errors import UserError

#: Top-level folder names (any case) read as splits (``root/train/<class>/...``), and the
#: split each one is.
SPLIT_FOLDERS = {"train": "train", "training": "train", "test": "test", "testing": "test",
                 "eval": "test", "evaluation": "test", "validation": "validation",
                 "valid": "validation", "val": "validation", "dev": "validation"}


def _image_extensions() -> set[str]:
    """Suffixes the ``imagefolder`` builder reads as images (ours if it does not say)."""
    try:
        from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

        return {e.lower() for e in ImageFolder.EXTENSIONS}
    except (ImportError, AttributeError):  # pragma: no cover - layout of another version
        return set(IMAGE_SUFFIXES)


def is_hidden(rel: Path) -> bool:
    """Whether a part of ``rel`` is hidden (``.git``, ``__MACOSX``): the reader skips it."""
    return any(part.startswith((".", "__")) for part in rel.parts)


def files_below(root: Path) -> list[Path]:
    """Every file below ``root`` (relative paths, sorted), following links to folders once."""
    found, seen = [], set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found += [Path(top, n).relative_to(root) for n in names if Path(top, n).is_file()]
    return sorted(found)


def read_image_folder(path: Path, source: str):
    """Read ``path`` as an image folder, or return ``None`` when it is not one.

    Parameters
    ----------
    path : pathlib.Path
        A folder.
    source : str
        How the user named it, for notes and messages.

    Returns
    -------
    tuple or None
        ``(dataset_dict, notes)``: a ``datasets.DatasetDict`` of ``image`` (file paths,
        decoded later) and ``label`` (a ``ClassLabel`` of every class folder's name, sorted)
        per split, and at most three lines on what was skipped; for a folder whose
        ``metadata.csv`` / ``.jsonl`` / ``.parquet`` tables label its images, ``image`` and
        the tables' columns. ``None`` when ``path`` holds other data files (``.csv``,
        ``.parquet`` ...) or no image.

    Raises
    ------
    UserError
        Images, but none inside a class folder; split folders beside class folders; a
        metadata table that cannot label the images.
    """
    import datasets

    files = files_below(path)
    extensions = _image_extensions()
    images = [f for f in files if f.suffix.lower() in extensions and not is_hidden(f)]
    if images and any(f.name.lower() in METADATA_FILES and not is_hidden(f) for f in files):
        return _labelled_by_metadata(path, source, files, images)
    if not images or any(f.suffix.lower() in FILE_BUILDERS for f in files):
        return None  # data files (tables, README figures beside them): datasets'
    tops = sorted({f.parts[0] for f in images if len(f.parts) > 1})
    splits = {t: SPLIT_FOLDERS[t.lower()] for t in tops if t.lower() in SPLIT_FOLDERS}
    if splits and (classes := [t for t in tops if t not in splits and not is_hidden(Path(t))]):
        raise UserError(f"{source} holds split folders ({', '.join(splits)}) beside class "
                        f"folders ({_listing([Path(c) for c in classes])}): move the class "
                        "folders into a train/ folder")
    depth = 1 if splits else 0  # parts before the class folder
    per_split: dict[str, list[tuple[str, str]]] = {}
    loose = []
    for f in images:
        if len(f.parts) < depth + 2 or (splits and f.parts[0] not in splits):
            loose.append(f)
            continue
        name = splits[f.parts[0]] if splits else "train"
        per_split.setdefault(name, []).append((str(path / f), f.parts[depth]))
    if not per_split:
        raise UserError(f"{source} holds images but no class folders: put each class's "
                        f"images in a folder named after it ({_listing(loose)} ...)")
    classes = sorted({c for items in per_split.values() for _, c in items})
    index = {c: i for i, c in enumerate(classes)}
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=classes)})
    dsdict = datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"image": [p for p, _ in items],
                                          "label": [index[c] for _, c in items]},
                                         features=features)
        for name, items in sorted(per_split.items(), key=lambda kv: kv[0] != "train")})
    return dsdict, _notes(path, source, files, images, loose, splits, depth)


#: Tables that label the images of a folder (``datasets``' names): a ``file_name`` column
#: gives each image's path relative to the table, the other columns are the images' own.
METADATA_FILES = {"metadata.csv": "csv", "metadata.jsonl": "json", "metadata.parquet": "parquet"}


def _split_of(rel: Path) -> str | None:
    """Return the split of a path under a split folder (``test/a.png``: ``test``), or None."""
    return SPLIT_FOLDERS.get(rel.parts[0].lower()) if len(rel.parts) > 1 else None


def _labelled_by_metadata(path: Path, source: str, files: list[Path], images: list[Path]):
    """Read an image folder labelled by ``metadata.*`` tables: ``(dataset_dict, notes)``.

    See :func:`read_image_folder`. A table in a split folder (``test/metadata.csv``) makes
    that split; a table at the root makes ``train``, but for images under a split folder.
    Images no table lists are skipped with a note.

    Raises
    ------
    UserError
        A table without ``file_name``, one naming an image that is not there, tables of one
        split with other columns.
    """
    import datasets

    per_split: dict[str, list] = {}
    listed: set[Path] = set()
    for meta in (f for f in files if f.name.lower() in METADATA_FILES and not is_hidden(f)):
        where = f"{source}: {meta.as_posix()}"
        try:
            table = getattr(datasets.Dataset, f"from_{METADATA_FILES[meta.name.lower()]}")(
                str(path / meta))
        except Exception as exc:  # noqa: BLE001 - pyarrow's and pandas' parse errors
            raise UserError(f"cannot read {where}: {str(exc).splitlines()[0]}") from None
        if "file_name" not in table.column_names:
            raise UserError(f"{where} has no file_name column (each image's path relative to "
                            f"it; columns: {', '.join(table.column_names)})")
        if "image" in table.column_names:
            raise UserError(f"{where} has an image column beside file_name: the images go "
                            "there; rename that column")
        rel = [(meta.parent / str(name)) for name in table["file_name"]]
        missing = [r for r in rel if not (path / r).is_file()]
        if missing:
            raise UserError(f"{where} names {len(missing)} image(s) that are not there: "
                            f"{_listing(missing)}; fix its file_name column")
        listed.update(Path(os.path.normpath(r)) for r in rel)
        split_of = [_split_of(meta) or _split_of(r) or "train" for r in rel]
        table = table.remove_columns("file_name").add_column(
            "image", [str(path / r) for r in rel]).cast_column("image", datasets.Image())
        for name in sorted(set(split_of)):
            rows = [i for i, s in enumerate(split_of) if s == name]
            per_split.setdefault(name, []).append(table.select(rows))
    try:
        dsdict = datasets.DatasetDict({
            name: datasets.concatenate_datasets(parts)
            for name, parts in sorted(per_split.items(), key=lambda kv: kv[0] != "train")})
    except ValueError as exc:
        raise UserError(f"the metadata tables of {source} have other columns or types: "
                        f"{str(exc).splitlines()[0]}") from None
    unlisted = [f for f in images if f not in listed]
    notes = [f"skipped {len(unlisted)} image(s) of {source} that no metadata table lists: "
             f"{_listing(unlisted)}"] if unlisted else []
    return dsdict, notes


def _notes(path: Path, source: str, files, images, loose, splits, depth) -> list[str]:
    """Return the lines on what :func:`read_image_folder` skipped."""
    chosen = set(images)
    skipped = [f for f in files if f not in chosen]
    outside = set(loose)
    with_images = {f.parts[:depth + 1] for f in images if f not in outside}
    roots = [path / s for s in splits] if splits else [path]
    class_dirs = [c.relative_to(path) for r in roots for c in sorted(r.iterdir()) if c.is_dir()]
    empty = [d for d in class_dirs if d.parts not in with_images and not is_hidden(d)]
    notes = []
    if empty:
        notes.append(f"skipped {len(empty)} class folder(s) of {source} with no images: "
                     f"{_listing(empty)}")
    if loose:
        notes.append(f"skipped {len(loose)} image(s) of {source} outside class folders: "
                     f"{_listing(loose)}")
    if skipped:
        notes.append(f"skipped {len(skipped)} file(s) of {source} that are not images or "
                     f"are hidden: {_listing(skipped)}")
    return notes


def _listing(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(p.as_posix() for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
