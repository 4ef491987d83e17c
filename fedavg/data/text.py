"""Tokenizers: text columns become ``(N, L)`` int64 token ids that every node makes alike.

Two kinds, both deterministic and local to each node (no data is shared to build them):

- :class:`HashedTokenizer` (the default, ``--tokenizer hashed``): lower-cased words and
  word bigrams hashed into a fixed number of buckets, the hashing trick of fastText
  (Joulin et al. 2016, arXiv:1607.01759). No vocabulary, so nothing to agree on but its
  three settings.
- :class:`FileTokenizer` (``--tokenizer PATH``): a Hugging Face ``tokenizers`` JSON file,
  or a local ``transformers`` tokenizer folder (its fast tokenizer's JSON is used). The run
  folder keeps a copy (``tokenizer.json``), so ``fedavg predict`` needs nothing else.

Id ``pad_id`` pads every text to ``max_length`` tokens; longer texts are cut. A tokenizer's
:meth:`spec` is the ``tokenizer`` entry of the run's input description (``model.json``).
No torch import.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedavg.data.sources import BUILTIN, IMAGE_SUFFIXES, looks_like_path
from fedavg.util.atomic import atomic_write
from fedavg.util.errors import UserError, first_line

#: Most tokens per text (``--max-tokens``): an (N, L) int64 batch must fit in memory.
MAX_TOKENS = 8192
#: Name of the tokenizer file kept in a run folder.
TOKENIZER_FILE = "tokenizer.json"
#: Words: runs of letters and digits, or single punctuation marks.
WORD = re.compile(r"\w+|[^\w\s]")
_BIGRAM_SEED = 0x9E3779B9  # bigram hashes differ from word hashes of the same text
#: The JSON of every file tokenizer built in this process, by SHA-256 (see :func:`save_for`).
_KNOWN: dict[str, str] = {}


class HashedTokenizer:
    """Word and word-bigram ids hashed into ``buckets`` (the fastText hashing trick).

    Text is lower-cased and split into words (:data:`WORD`); word ``w`` gets id
    ``1 + crc32(w) % (buckets - 1)`` and bigram ``(a, b)`` a differently seeded hash of
    ``"a b"``. A text's ids are its word ids, then its bigram ids, cut to ``max_length``
    and padded with ``pad_id = 0`` (Joulin et al. 2016, arXiv:1607.01759).

    Parameters
    ----------
    buckets : int
        Number of ids, padding included (the embedding table's rows); >= 2.
    max_length : int
        Tokens per text; >= 1.
    ngrams : int
        1 (words) or 2 (words and bigrams).

    Raises
    ------
    UserError
        A setting out of range.
    """

    kind = "hashed"
    pad_id = 0

    def __init__(self, buckets: int = 131072, max_length: int = 256, ngrams: int = 2) -> None:
        if buckets < 2:
            raise UserError(f"--hash-buckets must be >= 2 (got {buckets})")
        if not 1 <= max_length <= MAX_TOKENS:
            raise UserError(f"--max-tokens must be in 1..{MAX_TOKENS} (got {max_length})")
        if ngrams not in (1, 2):
            raise UserError(f"hashed tokenizer ngrams must be 1 or 2 (got {ngrams})")
        self.buckets, self.max_length, self.ngrams = int(buckets), int(max_length), int(ngrams)

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids (``buckets``)."""
        return self.buckets

    def ids(self, text: str) -> list[int]:
        """Token ids of one text, uncut and unpadded."""
        words = WORD.findall(text.lower())
        mod = self.buckets - 1
        out = [1 + zlib.crc32(w.encode()) % mod for w in words]
        if self.ngrams == 2:
            out += [1 + zlib.crc32(f"{a} {b}".encode(), _BIGRAM_SEED) % mod
                    for a, b in zip(words, words[1:])]
        return out

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Tokenize ``texts`` into an ``(N, max_length)`` int64 array (``None`` as empty)."""
        out = np.zeros((len(texts), self.max_length), dtype=np.int64)
        for i, text in enumerate(texts):
            ids = self.ids(text or "")[: self.max_length]
            out[i, : len(ids)] = ids
        return out

    def spec(self) -> dict[str, Any]:
        """Return the settings that rebuild this tokenizer (:func:`from_spec`)."""
        return {"kind": self.kind, "buckets": self.buckets, "max_length": self.max_length,
                "ngrams": self.ngrams}

    def save(self, folder: str | Path) -> None:
        """Nothing to save: the settings in :meth:`spec` are the whole tokenizer."""


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, padded and cut to ``max_length`` ids.

    Parameters
    ----------
    json_text : str
        The tokenizer's serialised form (the content of a ``tokenizer.json``).
    max_length : int
        Tokens per text; >= 1.
    source : str
        Where it came from, for messages.
    pad_id : int, optional
        The id that pads (a saved run's); default: the tokenizer's pad token (``[PAD]``,
        ``<pad>``), or, without one, an id of ours one past its vocabulary, which the
        models then ignore: no word is taken for padding.

    Raises
    ------
    UserError
        ``tokenizers`` not installed, or text it cannot read as a tokenizer.
    """

    kind = "file"

    def __init__(self, json_text: str, max_length: int = 256, source: str = "",
                 pad_id: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--tokenizer PATH needs the tokenizers package: "
                            "pip install tokenizers (the project's [text] extra)") from None
        if not 1 <= max_length <= MAX_TOKENS:
            raise UserError(f"--max-tokens must be in 1..{MAX_TOKENS} (got {max_length})")
        try:
            self._tok = Tokenizer.from_str(json_text)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            first = first_line(exc)
            raise UserError(f"{source or 'the tokenizer'} is not a tokenizers JSON file "
                            f"({first})") from None
        self.json_text, self.max_length, self.source = json_text, int(max_length), source
        self.sha256 = hashlib.sha256(json_text.encode()).hexdigest()
        _KNOWN[self.sha256] = json_text
        self._ids = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.pad_id = self._pad_id() if pad_id is None else int(pad_id)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()
                   if t.special}
        words = set(self._tok.get_vocab(with_added_tokens=True)) - special
        if len(words) < 2:  # a model folder's config alone builds one of special tokens only
            raise UserError(f"{source or 'the tokenizer'} has no vocabulary (only "
                            f"{len(words)} word(s) beside its special tokens: every word would "
                            "be one id): give a tokenizer.json or a folder with its "
                            "vocabulary (vocab.txt, merges)")
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_length)

    def _pad_id(self) -> int:
        padding = self._tok.padding
        if padding and padding.get("pad_id") is not None:
            return int(padding["pad_id"])
        for name in ("[PAD]", "<pad>", "<PAD>", "[pad]"):
            found = self._tok.token_to_id(name)
            if found is not None:
                return int(found)
        return self._ids  # no pad token: one id past the vocabulary, no real token's

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids, added tokens (and a pad id of ours, if any) included."""
        return max(self._ids, self.pad_id + 1)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Tokenize ``texts`` into an ``(N, max_length)`` int64 array padded with ``pad_id``."""
        out = np.full((len(texts), self.max_length), self.pad_id, dtype=np.int64)
        for i, enc in enumerate(self._tok.encode_batch([t or "" for t in texts])):
            ids = enc.ids[: self.max_length]
            out[i, : len(ids)] = ids
        return out

    def spec(self) -> dict[str, Any]:
        """Return the settings, the file name and its SHA-256 (:func:`from_spec`)."""
        return {"kind": self.kind, "file": TOKENIZER_FILE, "sha256": self.sha256,
                "max_length": self.max_length, "pad_id": self.pad_id,
                "vocab_size": self.vocab_size}

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` into ``folder`` (atomically)."""
        atomic_write(Path(folder) / TOKENIZER_FILE,
                     lambda tmp: Path(tmp).write_text(self.json_text))


def save_for(input_spec: dict[str, Any], folder: str | Path) -> None:
    """Keep the tokenizer of a model with ``input_spec`` in its artifact ``folder``.

    A file tokenizer's ``tokenizer.json`` is written unless it is there already; the
    hashed tokenizer needs no file. The tokenizer must have been built in this process
    (by the run's data loading, or :func:`from_spec` of the models being merged).

    Raises
    ------
    RuntimeError
        A file tokenizer this process has not built (a bug, not a user error).
    """
    spec = input_spec.get("tokenizer") if input_spec.get("kind") == "text" else None
    if not spec or spec.get("kind") != "file":
        return
    path = Path(folder) / str(spec.get("file", TOKENIZER_FILE))
    sha = spec.get("sha256")
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha:
        return
    if sha not in _KNOWN:
        raise RuntimeError(f"tokenizer {sha} was not loaded in this process")

    atomic_write(path, lambda tmp: Path(tmp).write_text(_KNOWN[sha]))


Tokenizer = HashedTokenizer | FileTokenizer


def make_tokenizer(name: str, max_length: int = 256, buckets: int = 131072) -> Tokenizer:
    """Build the tokenizer ``--tokenizer`` names.

    Parameters
    ----------
    name : str
        ``hashed``; a ``tokenizers`` JSON file; a folder holding ``tokenizer.json``; or a
        local ``transformers`` tokenizer folder (needs ``transformers`` and a fast tokenizer).
    max_length : int
        Tokens per text.
    buckets : int
        Ids of the hashed tokenizer.

    Raises
    ------
    UserError
        A missing path, or one that holds no readable tokenizer.
    """
    if name == "hashed":
        return HashedTokenizer(buckets, max_length)
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(f"--tokenizer {name}: no such file or folder (use hashed, a "
                        "tokenizer.json file or a transformers tokenizer folder)")
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        path = path / TOKENIZER_FILE
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--tokenizer {name}: cannot read it ({exc})") from None
        return FileTokenizer(text, max_length, source=str(path))
    if not path.is_dir():  # a device, a pipe, a socket
        raise UserError(f"--tokenizer {name}: not a file or folder (use hashed, a "
                        "tokenizer.json file or a transformers tokenizer folder)")
    return FileTokenizer(_transformers_json(path), max_length, source=str(path))


def _transformers_json(folder: Path) -> str:
    """Return the fast-tokenizer JSON of a local ``transformers`` tokenizer folder."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"--tokenizer {folder}: it has no tokenizer.json, and reading a "
                        "transformers tokenizer folder needs: pip install transformers") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
    except Exception as exc:  # transformers raises many types for unusable folders
        first = first_line(exc)
        raise UserError(f"--tokenizer {folder}: not a tokenizer folder ({first})") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"--tokenizer {folder}: it has only a slow tokenizer; save a fast "
                        "one (tokenizer.json) with transformers first")
    return backend.to_str()


def from_spec(spec: dict[str, Any], folder: str | Path | None = None) -> Tokenizer:
    """Rebuild the tokenizer of a saved run from its ``model.json`` input entry.

    Parameters
    ----------
    spec : dict
        ``model.json``'s ``input.tokenizer`` (:meth:`HashedTokenizer.spec` or
        :meth:`FileTokenizer.spec`).
    folder : path, optional
        The run folder, holding ``tokenizer.json`` for a file tokenizer.

    Raises
    ------
    UserError
        An unknown kind, a missing or changed ``tokenizer.json``.
    """
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "hashed":
        try:
            return HashedTokenizer(int(spec["buckets"]), int(spec["max_length"]),
                                   int(spec.get("ngrams", 2)))
        except (KeyError, TypeError, ValueError, UserError):
            raise UserError(f"the hashed tokenizer in model.json ({spec}) is unusable; the "
                            "artifact is damaged") from None
    if kind != "file":
        raise UserError(f"unknown tokenizer {spec!r} in model.json; the artifact is damaged")
    path = Path(folder or ".") / str(spec.get("file", TOKENIZER_FILE))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        raise UserError(f"{path} is missing or unreadable: the model's tokenizer is kept "
                        "there; copy the whole run folder") from None
    pad = spec.get("pad_id")  # a run before pads past the vocabulary: its own (id 0)
    tok = FileTokenizer(text, int(spec["max_length"]), source=str(path),
                        pad_id=pad if isinstance(pad, int) else None)
    if tok.sha256 != spec.get("sha256") or tok.vocab_size != spec.get("vocab_size"):
        raise UserError(f"{path} differs from the tokenizer the model was trained with "
                        "(SHA-256 mismatch); the artifact is damaged")
    return tok


def same_tokenization(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Say how two tokenizer specs would tokenize differently, or ``None`` when alike."""
    keys = ("kind", "buckets", "ngrams", "max_length", "sha256", "pad_id")
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if not diff:
        return None
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in diff)


def text_inputs(inputs: Sequence[str], literal: bool) -> list[tuple[str, str]]:
    """Turn ``fedavg predict`` inputs for a text model into ``("text", ...)`` items.

    Parameters
    ----------
    inputs : sequence of str
        With ``literal``: the texts themselves. Otherwise ``.txt`` files (one text per
        non-empty line), dataset files, folders, names or hub ids.
    literal : bool
        ``--text``: take every input as a text.

    Returns
    -------
    list of (str, str)
        ``("text", text)`` with the text's name in :func:`text_name`, or
        ``("dataset", source)``.

    Raises
    ------
    UserError
        A missing path, an image, a ``.txt`` file that cannot be read or holds no text.
    """
    if literal:
        return [("text", t) for t in inputs]
    items: list[tuple[str, str]] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.suffix.lower() in IMAGE_SUFFIXES:
            raise UserError(f"{raw} is an image and this model takes text: pass texts with "
                            "--text, a .txt file (one text per line) or a dataset")
        if path.is_file() and path.suffix.lower() == ".txt":
            try:
                lines = [ln.strip() for ln in path.read_text(encoding="utf-8-sig").splitlines()]
            except (OSError, UnicodeDecodeError) as exc:
                raise UserError(f"cannot read {raw} as text: {exc}") from None
            if not any(lines):
                raise UserError(f"{raw} holds no text (one text per line)")
            items += [("text", ln) for ln in lines if ln]
        elif path.exists() or raw in BUILTIN or (not looks_like_path(raw) and "/" in raw):
            items.append(("dataset", raw))
        else:
            raise UserError(f"no such file or folder: {raw} (to classify it as text, pass "
                            "--text)")
    return items


def tokenized(tokenizer, texts, source: str) -> np.ndarray:
    """Return ``tokenizer.encode(texts)``; text that is not UTF-8 is one line naming the data.

    Raises
    ------
    UserError
        ``texts`` holds bytes that are not UTF-8.
    """
    try:
        return tokenizer.encode(texts)
    except UnicodeDecodeError as exc:
        raise _not_utf8(exc, source) from None


def read_texts(read, source: str) -> list:
    """Return ``read()``, a text column; text that is not UTF-8 is one line naming the data.

    Raises
    ------
    UserError
        The column holds bytes that are not UTF-8.
    """
    try:
        return list(read())  # a lazy column decodes as it is read
    except UnicodeDecodeError as exc:
        raise _not_utf8(exc, source) from None


def _not_utf8(exc: UnicodeDecodeError, source: str) -> UserError:
    return UserError(f"{source} holds text that is not UTF-8 ({exc.reason} at byte "
                     f"{exc.start}): save it as UTF-8")


def model_tokenizer(meta: dict[str, Any], directory: str | Path) -> Tokenizer | str:
    """Return the tokenizer a text model's inputs need (from its run folder), else ``hashed``.

    ``meta`` is the model's ``model.json``. ``hashed`` is what :func:`fedavg.data.load.load`
    tokenizes text with for other models, so that text given to an image model is reported
    as text.

    Raises
    ------
    UserError
        A file tokenizer missing from ``directory`` or changed since training.
    """
    if meta["input"].get("kind") != "text":
        return "hashed"
    return from_spec(meta["input"]["tokenizer"], directory)
