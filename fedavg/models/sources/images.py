"""Image models: the input adapter, and any torchvision classification model by name.

:class:`ImageAdapter` wraps torchvision and Hugging Face image models: it repeats a 1-channel
input to the 3 channels their stem takes (no new parameters) and resizes inputs (bilinear)
only when a trial forward pass at the data's size fails. Its ``fedavg_notes`` say which
adaptation happened.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from fedavg.models.sources.args import Takes, first_line
from fedavg.util.errors import UserError

#: Image size a model is resized to when it fails at the data's and declares none itself.
DEFAULT_IMAGE_SIZE = 224


class ImageAdapter(nn.Module):
    """Feed an image model the channels and size it takes; return its logits.

    Parameters
    ----------
    net : torch.nn.Module
        The image model (its weights are ``net.*`` in the state dict).
    channels : int, optional
        Repeat a 1-channel ``(N, 1, H, W)`` input to this many channels.
    size : tuple of int, optional
        Resize inputs to ``(H, W)`` (bilinear) before the model.
    """

    def __init__(self, net: nn.Module, channels: int | None = None,
                 size: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.net = net
        self.channels = channels
        self.size = size
        self.fedavg_notes: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` normalised images -> ``(N, K)`` logits."""
        if self.channels is not None and x.shape[1] == 1:
            x = x.repeat(1, self.channels, 1, 1)
        if self.size is not None and tuple(x.shape[-2:]) != tuple(self.size):
            x = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        out = self.net(x)
        return getattr(out, "logits", out)  # Hugging Face outputs, Inception / GoogLeNet


def stem_channels(net: nn.Module) -> int | None:
    """Input channels of the first ``Conv2d`` of ``net`` (its stem), or ``None`` without one."""
    return next((m.in_channels for m in net.modules() if isinstance(m, nn.Conv2d)), None)


def trial(model: nn.Module, shape: tuple[int, ...], dtype=torch.float32) -> str | None:
    """Run ``model`` on a ``(2, *shape)`` batch of zeros (eval mode, no gradients).

    Returns
    -------
    str or None
        The error's first line when the forward pass fails, else ``None``.
    """
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, *shape, dtype=dtype))
    except Exception as exc:  # noqa: BLE001 - any failure: the model cannot take the shape
        return first_line(exc)
    finally:
        model.train(was)
    return None


def adapt_images(net: nn.Module, input_shape: tuple[int, ...], what: str,
                 channels: int | None = None, size: Any = None) -> ImageAdapter:
    """Wrap image model ``net`` so that it takes ``input_shape`` inputs.

    Parameters
    ----------
    net : torch.nn.Module
        An image classifier.
    input_shape : tuple of int
        ``(C, H, W)`` of the data.
    what : str
        The model's name, for notes and errors.
    channels : int, optional
        Channels the model takes (default: its first ``Conv2d``'s).
    size : int or sequence of int, optional
        Size the model is made for, used when it fails at the data's size
        (default: ``net.image_size``, else :data:`DEFAULT_IMAGE_SIZE`).

    Raises
    ------
    UserError
        Inputs that are not images, channels other than the model's (other than 1 -> 3),
        or a model that fails at the data's size and at its own.
    """
    if len(input_shape) != 3:
        raise UserError(f"{what} takes images (C, H, W); the data are of shape "
                        f"{tuple(input_shape)}")
    c, h, w = input_shape
    wants = stem_channels(net) if channels is None else int(channels)
    notes, repeat = [], None
    if wants is not None and wants != c:
        if c != 1 or wants != 3:
            raise UserError(f"{what} takes {wants}-channel images; the data have {c} channel(s)")
        repeat = 3
        notes.append("1-channel inputs repeated to the model's 3 channels")
    adapter = ImageAdapter(net, repeat)
    if next((p.is_meta for p in net.parameters()), False):
        return adapter  # a weightless copy: the adapter holds no tensors, so no trial needed
    problem = trial(adapter, (c, h, w))
    if problem is not None:
        size = size if size is not None else getattr(net, "image_size", DEFAULT_IMAGE_SIZE)
        adapter.size = tuple(int(s) for s in size)[:2] if isinstance(size, (list, tuple)) \
            else (int(size), int(size))
        again = trial(adapter, (c, h, w))
        if again is not None:
            raise UserError(f"{what} cannot take inputs of shape {tuple(input_shape)} ({problem})"
                            f", nor resized to {adapter.size[0]}x{adapter.size[1]} ({again})")
        notes.append(f"inputs resized from {h}x{w} to {adapter.size[0]}x{adapter.size[1]} "
                     f"(at {h}x{w} the model fails: {problem})")
    adapter.fedavg_notes = [f"model {what}: {note}" for note in notes]
    return adapter


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models (``torchvision:NAME``)."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _torchvision_takes(name: str, builder: Callable, num_classes: int) -> Takes:
    """Return what ``get_model(name, **args)`` takes: the builder's and its class's arguments."""
    own = Takes.of(builder, f"torchvision:{name}", positional=0)
    probe = _probe(builder, num_classes)
    cls = Takes.of(type(probe).__init__, name, positional=1)
    params = inspect.signature(type(probe).__init__).parameters
    names = [n for n in (*own.names, *cls.names) if n not in ("weights", "progress",
                                                               "num_classes")
             and _settable(builder, num_classes, params.get(n))]
    numeric = tuple((n, d) for n, d in (*own.numeric, *cls.numeric) if n in names)
    return Takes(tuple(dict.fromkeys(names)), numeric=tuple(dict(numeric).items()))


def _probe(builder: Callable, num_classes: int, **args: Any) -> nn.Module:
    """Build a weightless copy of the model (meta device), which tells its class.

    On the CPU for a builder that computes with tensors first (regnet's widths).
    """
    try:
        with torch.device("meta"):
            return builder(weights=None, num_classes=num_classes, **args)
    except NotImplementedError:
        return builder(weights=None, num_classes=num_classes, **args)


def _settable(builder: Callable, num_classes: int, param: inspect.Parameter | None) -> bool:
    """Whether ``--model-arg`` can set the model class's argument ``param``.

    Not a callable (``norm_layer``: a ``--model-arg`` value is JSON), nor one the builder
    fills itself (``resnet18``'s ``block`` and ``layers``: "got multiple values"; regnet's
    ``block_params``).
    """
    if param is None:
        return True
    if "Callable" in str(param.annotation):
        return False
    if param.default is not param.empty:
        return True
    try:
        _probe(builder, num_classes, **{param.name: None})
    except TypeError as exc:  # the builder sets it, or passes it where it is unknown
        return not any(said in str(exc) for said in ("multiple values", "unexpected keyword"))
    except Exception:  # noqa: BLE001 - None is no value for it; it is the caller's to give
        return True
    return True


def build_torchvision(name: str, input_shape: tuple[int, ...], num_classes: int,
                      args: Mapping[str, Any], pretrained: str | None = None) -> nn.Module:
    """Build ``torchvision:NAME`` with ``num_classes`` outputs, adapted to ``input_shape``.

    Parameters
    ----------
    name : str
        A torchvision classification model (see :func:`torchvision_names`).
    input_shape : tuple of int
        ``(C, H, W)``.
    num_classes : int
        Output width K.
    args : mapping
        Arguments of the model (``dropout``, ``width_per_group`` ...).
    pretrained : str, optional
        ``default``: ``weights="DEFAULT"`` (downloaded when not cached); a path: that local
        weights file (:func:`load_weights_file`); then a new last ``Linear`` with K outputs.
        ``None``: random initialisation, nothing downloaded.

    Raises
    ------
    UserError
        An unknown name (with close matches), arguments it does not take, no ``Linear``
        head to replace, or inputs it cannot take.
    """
    import torchvision

    what = f"torchvision:{name}"
    names = torchvision_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"unknown torchvision model {name!r}; {hint}({len(names)} models: "
                        "python -c 'import torchvision; print(torchvision.models.list_models("
                        "module=torchvision.models))')")
    builder = torchvision.models.get_model_builder(name)
    kwargs = _torchvision_takes(name, builder, num_classes).kwargs(what, args)
    if pretrained not in (None, "default", True):
        net = _from_file(builder, kwargs, num_classes, pretrained, what)
    elif pretrained:
        try:
            net = builder(weights="DEFAULT", **kwargs)
        except (TypeError, ValueError) as exc:
            raise UserError(f"{what} with {dict(kwargs)}: {first_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - a download that failed, a damaged cache
            raise UserError(f"{what}: could not load its pretrained weights ({first_line(exc)})"
                            "; check the network or train without --pretrained") from None
        _replace_head(net, num_classes, what)
    else:
        try:
            net = builder(weights=None, num_classes=num_classes, **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UserError(f"{what} with {dict(kwargs)}: {first_line(exc)}") from None
    return adapt_images(net, input_shape, what)


def load_weights_file(path: str) -> dict[str, Any]:
    """Read a state dict from ``path``: safetensors, else ``torch.load(weights_only=True)``.

    Never unpickles anything but tensors and containers of them.

    Raises
    ------
    UserError
        No such file, or a file that is neither (one line naming it).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--pretrained {path}: no such file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file, or objects beyond tensors
        why = first_line(exc)
        if type(exc).__name__ == "UnpicklingError":  # weights_only refused: never unpickled
            why = ("it pickles other objects, which fedavg never loads: save "
                   "model.state_dict() with safetensors or torch.save")
        raise UserError(f"--pretrained {path}: not a safetensors file or state dict of tensors "
                        f"({why})") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise UserError(f"--pretrained {path}: holds no state dict of tensors")
    return state


def _from_file(builder: Callable, kwargs: dict, num_classes: int, path: str,
               what: str) -> nn.Module:
    """Build the model with K outputs and load every tensor of ``path`` but the head's.

    Raises
    ------
    UserError
        A tensor of the model (other than its head) missing from the file or of another
        shape, or a tensor the model does not have.
    """
    state = load_weights_file(path)
    net = builder(weights=None, num_classes=num_classes, **kwargs)
    head = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)][-1:]
    own = net.state_dict()
    skip = tuple(f"{h}." for h in head)
    lost = [k for k in own if not k.startswith(skip)
            and (k not in state or state[k].shape != own[k].shape)]
    extra = [k for k in state if k not in own]
    if lost or extra:
        first = f"{lost[0]} missing or of another shape" if lost else f"unexpected {extra[0]}"
        raise UserError(f"--pretrained {path} does not fit {what} ({first}; {len(lost)} "
                        f"missing or mis-shaped, {len(extra)} unexpected)")
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    net.load_state_dict(fits, strict=False)
    return net


def _replace_head(net: nn.Module, num_classes: int, what: str) -> None:
    """Replace the last ``nn.Linear`` of ``net`` by a freshly initialised one with K outputs."""
    last = None
    for module_name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            last = (module_name, module)
    if last is None:
        raise UserError(f"{what} has no Linear classifier head to size for {num_classes} "
                        "classes; train it without --pretrained")
    parent, _, attr = last[0].rpartition(".")
    old = last[1]
    setattr(net.get_submodule(parent) if parent else net, attr,
            nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
