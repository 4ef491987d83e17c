"""Images: decoded to one ``(N, C, H, W)`` uint8 array, fitted to a model, and noted.

:func:`decode_images` reads image bytes, paths or PIL images at one mode and size (the most
common, or a model's), scales 16/32-bit and float images by one range per type, and counts
what it converted, resized or found transparent. :func:`fit_images` converts images already
decoded to another model's shape (``evaluate`` on other images). No Flower import.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np

from fedavg.util.errors import UserError, first_line

#: PIL modes read as grey (a palette image is grey unless its palette is RGB).
GREY_MODES = ("L", "1", "I", "I;16", "I;16B", "I;16L", "F", "LA", "P")


def _own_mode(img) -> str:
    """``"L"`` for a grey image, ``"RGB"`` for a colour one (a palette of greys is grey)."""
    if img.mode == "P" and "RGB" in img.palette.mode:
        rgb = np.asarray(img.convert("RGB"))
        return "L" if (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all() \
            else "RGB"
    return "L" if img.mode in GREY_MODES else "RGB"


def _transparent(img) -> bool:
    """Whether an 8-bit image has a pixel that is not fully opaque (alpha or transparent colour)."""
    if img.mode in ("RGBA", "LA", "PA"):
        return img.getchannel("A").getextrema()[0] < 255
    if "transparency" in img.info and img.mode in ("P", "L", "RGB"):
        return img.convert("RGBA").getchannel("A").getextrema()[0] < 255
    return False


def _open_image(item, i: int, source: str):
    """Open and decode one item of :func:`decode_images`.

    Returns ``(image, None)`` for an 8-bit PIL image, ``(values, mode)`` for a 16/32-bit or
    float grey one (``I;16``, ``I``, ``F``), which :func:`_scale_wide` scales.
    """
    from PIL import Image

    try:
        if isinstance(item, Image.Image):
            img = item
        elif isinstance(item, dict):
            img = Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"])
        elif isinstance(item, (bytes, bytearray)):
            img = Image.open(io.BytesIO(item))
        else:
            img = Image.open(item)
        if img.mode.startswith("I;16") or img.mode in ("I", "F"):  # scaled by the caller
            return np.asarray(img), img.mode[:4]  # its own dtype: 2-4 bytes a pixel
        img.load()
        return img, None
    except Exception as exc:
        path = item.get("path") if isinstance(item, dict) else None
        where = item if isinstance(item, (str, Path)) else path or f"row {i}"
        reason = first_line(exc, 300)
        raise UserError(f"cannot decode image {where} of {source}: {reason}") from None


def _scale_wide(out: list, wide: dict) -> None:
    """Scale 16/32-bit and float grey images to 8 bits, each type over all its images.

    ``I;16`` by 65535; ``F`` as 0..1 if no value passes 1, else 0..255; ``I`` as 8-bit
    values if none passes 255, 16-bit ones if none passes 65535, else by the largest value
    (PIL's own conversion would clip at 255). One range per type: the same value reads the
    same in every image.
    """
    peaks: dict[str, float] = {}
    for values, kind in wide.values():
        peaks[kind] = max(peaks.get(kind, 0.0), float(values.max()) if values.size else 0.0)
    for i, (values, kind) in wide.items():
        peak = peaks[kind]
        top = 65535.0 if kind == "I;16" else (1.0 if peak <= 1.0 else 255.0) if kind == "F" \
            else 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else peak
        out[i] = np.clip(values * (255.0 / top), 0, 255).astype(np.uint8)


def fit_images(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Convert decoded images to a model's grey or colour ``shape`` and resize them (bilinear).

    ``x`` is ``(N, C, H, W)`` uint8 with C 1 or 3, ``shape`` ``(C', H', W')``; anything else,
    or images already of ``shape``, comes back as it is.
    """
    shape = tuple(shape)
    if x.dtype != np.uint8 or x.ndim != 4 or len(shape) != 3 or x.shape[1] not in (1, 3) \
            or shape[0] not in (1, 3) or tuple(x.shape[1:]) == shape:
        return x
    from PIL import Image

    return decode_images((Image.fromarray(i[0] if len(i) == 1 else i.transpose(1, 2, 0))
                          for i in x), size=shape[1:], mode="L" if shape[0] == 1 else "RGB")


def fitted_note(before: tuple[int, ...], after: tuple[int, ...], what: str) -> str | None:
    """Say that images of ``(C, H, W)`` ``before`` were made ``after`` for the model, if so."""
    if tuple(before) == tuple(after):
        return None

    def kind(s):
        return f"{s[2]}x{s[1]} {'grey' if s[0] == 1 else 'colour'}"

    done = " and ".join(w for w, changed in (("converted", before[0] != after[0]),
                                             ("resized", before[1:] != after[1:])) if changed)
    return (f"{what} are {kind(before)} images, the model takes {kind(after)} ones: they were "
            f"{done}; results may be unreliable: use images like the training data")


@contextlib.contextmanager
def large_images_quiet():
    """Keep Pillow's ``DecompressionBombWarning`` (images over ~89 megapixels) off stderr.

    Its two lines name Pillow's source file; an image over twice that size is still refused
    (``DecompressionBombError``, one line naming the image).
    """
    import warnings

    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def decode_images(raw, source: str = "", size: tuple[int, int] | None = None,
                  mode: str | None = None, notes: list[str] | None = None) -> np.ndarray:
    """Decode images (bytes, paths or PIL images) into one ``(N, C, H, W)`` uint8 array.

    Parameters
    ----------
    raw : sequence
        Items as stored by ``datasets.Image(decode=False)`` (``{"bytes", "path"}``), file
        paths, or PIL images.
    source : str
        What the user asked for, for messages.
    size : (int, int), optional
        ``(H, W)`` to resize to (bilinear); default the most common size (the first of
        equally common ones).
    mode : str, optional
        ``"L"`` or ``"RGB"``; default RGB if any image has colour, else grey.
    notes : list of str, optional
        Where to add one line each, when there are any, for the images converted to
        ``mode`` and those resized to ``size``.

    Raises
    ------
    UserError
        When an item cannot be decoded as an image, or there is none.
    """
    from collections import Counter

    from PIL import Image

    out, own, wide, transparent = [], [], {}, 0
    with large_images_quiet():
        for i, item in enumerate(raw):
            img, kind = _open_image(item, i, source)
            if kind is not None:  # 16/32-bit or float grey: scaled below, over all the images
                wide[i] = img, kind
                own.append(("L", *img.shape[:2]))
                out.append(img)
                continue
            own.append((_own_mode(img), img.height, img.width))
            transparent += notes is not None and _transparent(img)
            img = img.convert(mode or own[-1][0])
            if size is not None and (img.height, img.width) != tuple(size):
                img = img.resize((size[1], size[0]), Image.BILINEAR)
            out.append(np.asarray(img, dtype=np.uint8))
    if not out:
        raise UserError(f"no images in {source}")
    _scale_wide(out, wide)
    to_mode = mode or ("RGB" if any(m == "RGB" for m, _, _ in own) else "L")
    to_size = tuple(size) if size is not None else \
        Counter((h, w) for _, h, w in own).most_common(1)[0][0]
    for i, arr in enumerate(out):
        if arr.ndim != (2 if to_mode == "L" else 3):
            arr = np.asarray(Image.fromarray(arr).convert(to_mode), dtype=np.uint8)
        if arr.shape[:2] != to_size:
            arr = np.asarray(Image.fromarray(arr).resize(to_size[::-1], Image.BILINEAR),
                             dtype=np.uint8)
        out[i] = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    converted = sum(m != to_mode for m, _, _ in own)
    resized = sum((h, w) != to_size for _, h, w in own)
    if notes is not None and converted:
        notes.append(f"{converted} of {len(out)} images of {source} converted to "
                     f"{'grey' if to_mode == 'L' else 'RGB'}")
    if notes is not None and transparent:
        notes.append(f"{transparent} of {len(out)} images of {source} have transparent pixels: "
                     "read as the colour stored under them (the alpha channel is dropped); to "
                     "choose the background, flatten them onto it first")
    if notes is not None and resized:
        notes.append(f"{resized} of {len(out)} images of {source} resized to "
                     f"{to_size[1]}x{to_size[0]}" + (", the most common size" if size is None
                                                     else ""))
    return np.stack(out)
