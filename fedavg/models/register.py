"""The table of registered model builders: :func:`register_model` fills it.

The built-in builders (:mod:`fedavg.models.images`, :mod:`fedavg.models.text`) register
themselves here on import; :mod:`fedavg.models.registry` imports them and builds from it.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

_MODELS: dict[str, tuple[Callable[..., nn.Module], str, tuple[str, ...]]] = {}

#: Kinds of input: ``image`` ``(C, H, W)``, ``tabular`` ``(D,)`` floats, ``text`` ``(L,)`` ids.
INPUT_KINDS = ("image", "tabular", "text")


def register_model(name: str, description: str, kinds: tuple[str, ...] = ("image",)):
    """Register a builder ``fn(input_shape, num_classes, **args) -> nn.Module`` under ``name``.

    ``kinds`` are the :data:`INPUT_KINDS` it takes; text builders also get ``vocab_size``
    and ``pad_id`` from the tokenizer.
    """

    def deco(fn):
        _MODELS[name] = (fn, description, tuple(kinds))
        return fn

    return deco
