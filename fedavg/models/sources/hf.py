"""Hugging Face ``transformers`` models from a local folder: ``--model hf:PATH``.

``PATH`` holds a ``config.json`` (and optionally ``model.safetensors``), as written by
``save_pretrained``. Images are classified with ``AutoModelForImageClassification``; text
(token ids, when the data give ``vocab_size`` and ``pad_id``) with
``AutoModelForSequenceClassification``; ``num_labels`` is the data's number of classes.

The whole configuration is stored in the model spec's ``hf_config`` argument, so nodes and
``fedavg predict`` rebuild the model with ``AutoConfig.for_model`` / ``from_config`` without
the folder. No remote code is ever run (``trust_remote_code=False``) and no pickle is loaded
(``model.safetensors`` only). Only the run's initial model loads the folder's weights.
Builder arguments (``--model-arg hidden_dropout_prob=0.2``) override configuration entries.
Needs the optional ``transformers`` package (the ``hf`` extra).
"""

from __future__ import annotations

import contextlib
import difflib
import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from fedavg.models.sources.args import DATA_ARGS, first_line
from fedavg.models.sources.images import adapt_images, trial
from fedavg.util.errors import UserError

#: The spec argument holding the model's configuration (``config.to_dict()``).
HF_CONFIG = "hf_config"
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")


def transformers_module():
    """Import ``transformers``.

    Raises
    ------
    UserError
        It is not installed (saying how to install it).
    """
    try:
        import transformers
    except ImportError:
        raise UserError("hf: models need the transformers package: pip install "
                        "transformers (the project's [hf] extra)") from None
    return transformers


def folder(name: str) -> Path:
    """Return the folder of ``hf:PATH``.

    Raises
    ------
    UserError
        No such folder, or no ``config.json`` in it.
    """
    path = Path(name[len("hf:"):]).expanduser()
    if not path.is_dir():
        raise UserError(f"--model {name}: no such folder; pass a local Hugging Face model "
                        "folder holding config.json (as save_pretrained writes it)")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {name}: {path} has no config.json; save the model there with "
                        "save_pretrained(), or point hf: at the folder holding config.json")
    return path


def weights_file(name: str) -> Path | None:
    """Return the safetensors weights of ``hf:PATH``, or ``None`` when it has none.

    Raises
    ------
    UserError
        The folder holds its weights only in a pickled format, which fedavg never loads.
    """
    path = folder(name)
    found = next((path / f for f in SAFE_WEIGHTS if (path / f).is_file()), None)
    if found is None:
        pickled = next((f for f in PICKLED_WEIGHTS if (path / f).is_file()), None)
        if pickled is not None:
            raise UserError(f"{path} holds its weights as {pickled}, which fedavg does not load "
                            "(pickle): save them with save_pretrained() as model.safetensors, "
                            "or remove the file to start from random weights")
    return found


@contextlib.contextmanager
def _quiet(tf):
    """Keep transformers' loading reports and progress bars off the console."""
    log = tf.utils.logging
    level, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            log.enable_progress_bar()


def _read_config(name: str) -> dict[str, Any]:
    tf = transformers_module()
    path = folder(name)
    try:
        with _quiet(tf):
            config = tf.AutoConfig.from_pretrained(str(path), trust_remote_code=False,
                                                   local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types (ImportError too)
        raise UserError(f"cannot read {path / 'config.json'}: {first_line(exc)}") from None
    return json.loads(json.dumps(config.to_dict(), default=str))


def config_dict(name: str, num_classes: int, args: Mapping[str, Any]) -> dict[str, Any]:
    """Return the configuration model ``name`` is built from, ``args`` and the data applied.

    Parameters
    ----------
    name : str
        ``hf:PATH``.
    num_classes : int
        ``num_labels``.
    args : mapping
        ``hf_config`` (stored configuration; else the folder's is read), configuration
        overrides, and for text ``vocab_size`` / ``pad_id`` of the data.

    Raises
    ------
    UserError
        An override that is no configuration entry, or a data vocabulary larger than the
        model's.
    """
    stored = args.get(HF_CONFIG)
    config = dict(stored) if isinstance(stored, Mapping) else _read_config(name)
    if not isinstance(config.get("model_type"), str):
        raise UserError(f"{name}: the configuration has no model_type")
    overrides = {k: v for k, v in args.items() if k != HF_CONFIG and k not in DATA_ARGS}
    unknown = [k for k in overrides if k not in config]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(config), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"model {name} does not take argument {unknown[0]!r}: hf: models take "
                        f"entries of their config.json; {hint}(it has {len(config)}, e.g. "
                        f"{', '.join(sorted(config)[:5])})")
    config.update(overrides)
    for key in ("id2label", "label2id"):
        config.pop(key, None)
    config["num_labels"] = int(num_classes)
    if "vocab_size" in args:
        model_vocab = config.get("vocab_size")
        if not isinstance(model_vocab, int):
            raise UserError(f"{name} is not a text model (its config has no vocab_size)")
        if int(args["vocab_size"]) > model_vocab:
            raise UserError(f"the data's vocabulary has {args['vocab_size']} token ids, model "
                            f"{name} only {model_vocab}: raise vocab_size in its config.json")
        config["pad_token_id"] = int(args.get("pad_id", 0))
    return config


def stored_config(name: str, num_classes: int, args: Mapping[str, Any]) -> dict[str, Any]:
    """Return the spec arguments of ``hf:PATH``: ``args`` plus its whole ``hf_config``.

    Raises
    ------
    UserError
        See :func:`folder`, :func:`weights_file` and :func:`config_dict`.
    """
    if not isinstance(args.get(HF_CONFIG), Mapping):
        weights_file(name)  # refuse pickled weights before anything runs
    return {**dict(args), HF_CONFIG: config_dict(name, num_classes, args)}


def token_ids(ids: torch.Tensor) -> torch.Tensor:
    """Return ``(N, L)`` token ids as int64.

    Raises
    ------
    TypeError
        Floating inputs (token ids must not be normalised).
    """
    if ids.is_floating_point():
        raise TypeError("the model takes (N, L) int64 token ids, got floating inputs")
    return ids.long()


class TextClassifier(nn.Module):
    """A sequence classifier that takes ``(N, L)`` int64 token ids and returns logits.

    Parameters
    ----------
    net : torch.nn.Module
        A ``transformers`` sequence classification model.
    pad_id : int
        The padding token id: the attention mask is ``ids != pad_id``.
    """

    def __init__(self, net: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.net = net
        self.pad_id = int(pad_id)
        self.fedavg_notes: list[str] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` int64 token ids -> ``(N, K)`` logits (:func:`token_ids`)."""
        ids = token_ids(ids)
        return self.net(input_ids=ids, attention_mask=(ids != self.pad_id).long()).logits


def build_hf(name: str, input_shape: tuple[int, ...], num_classes: int,
             args: Mapping[str, Any], initial: bool = False) -> nn.Module:
    """Build ``hf:PATH`` for images ``(C, H, W)`` or, with ``vocab_size``, token ids ``(L,)``.

    Parameters
    ----------
    name : str
        ``hf:PATH``.
    input_shape : tuple of int
        ``(C, H, W)`` images or ``(L,)`` token ids.
    num_classes : int
        ``num_labels``.
    args : mapping
        See :func:`config_dict`.
    initial : bool
        Load the folder's ``model.safetensors`` (when it has one): the run's initial model.

    Returns
    -------
    torch.nn.Module
        :class:`~fedavg.models.sources.ImageAdapter` or :class:`TextClassifier` around the
        ``transformers`` model, mapping a batch to ``(N, K)`` logits.

    Raises
    ------
    UserError
        transformers missing, a configuration it cannot build, or inputs the model cannot
        take (one line each).
    """
    tf = transformers_module()
    text = "vocab_size" in args
    config = config_dict(name, num_classes, args)
    rest = {k: v for k, v in config.items() if k != "model_type"}
    auto = tf.AutoModelForSequenceClassification if text else tf.AutoModelForImageClassification
    weights = weights_file(name) if initial else None
    try:
        with _quiet(tf):
            cfg = tf.AutoConfig.for_model(config["model_type"], **rest)
            if weights is None:
                net = auto.from_config(cfg, trust_remote_code=False)
            else:
                net, info = auto.from_pretrained(
                    str(weights.parent), config=cfg, ignore_mismatched_sizes=True,
                    use_safetensors=True, local_files_only=True, trust_remote_code=False,
                    output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types (ImportError too)
        raise UserError(f"{name}: {first_line(exc)}") from None
    if weights is not None:
        _check_loaded(name, weights, net, info)
    if text:
        if len(input_shape) != 1:
            raise UserError(f"{name} as a text model takes token ids (L,); the data are of "
                            f"shape {tuple(input_shape)}")
        model = TextClassifier(net, int(args.get("pad_id", 0)))
        on_meta = next((p.is_meta for p in net.parameters()), False)
        problem = None if on_meta else trial(model, tuple(input_shape), torch.int64)
        if problem is not None:
            raise UserError(f"{name} cannot take token sequences of length {input_shape[0]}: "
                            f"{problem}")
    else:
        model = adapt_images(net, tuple(input_shape), name,
                             channels=getattr(cfg, "num_channels", None),
                             size=getattr(cfg, "image_size", None))
    return model


def _check_loaded(name: str, weights, net, info: dict) -> None:
    """Refuse weights of which most of the model finds nothing: another architecture's.

    A task head beyond the last layer (DistilBERT's ``pre_classifier``, BERT's ``pooler``)
    may start random from a base model's file, as ``transformers`` allows; a file that
    leaves more than half of the model's tensors to start random is not its weights.

    Raises
    ------
    UserError
        Naming how many tensors the file does not give and the first few.
    """
    lost = sorted({str(k) for k in info.get("missing_keys", [])} | {
        str(m[0] if isinstance(m, (tuple, list)) else m)
        for m in info.get("mismatched_keys", [])})
    total = len(net.state_dict())
    if total and len(lost) > total / 2:
        raise UserError(f"{name}: {weights.name} does not fit its config.json: {len(lost)} of "
                        f"the model's {total} tensors would start random "
                        f"({', '.join(lost[:3])}); save the model and its config together "
                        "with save_pretrained(), or remove the weights to start from random")


def weights_note(name: str) -> str:
    """Say which weights the run's initial ``hf:PATH`` model starts from (one line)."""
    weights = weights_file(name)
    if weights is None:
        return f"model {name}: no model.safetensors in the folder: random initial weights"
    return (f"model {name}: the initial model loads {weights.name} (a classifier head of "
            "another size is initialised anew)")
