"""Compressed node updates: what a node sends instead of its weights, and how it is read back.

A node that trains with ``--compress`` sends, for each floating tensor of at least
:data:`MIN_NUMEL` entries, its **update** (its weights minus the round's weights it received)
encoded by one codec; smaller tensors (biases, norms) and integer buffers travel as they are.
The coordinator rebuilds each model as the round's weights plus the decoded update
(:func:`decode_reply`) before any strategy sees it, so every strategy works unchanged. The
encoded arrays are what the reply's ``arrays`` record carries, so the bytes each round counts
are the compressed ones.

Codecs (each encoded tensor ``k`` becomes entries ``k#<part>`` of the record):

``int8``
    Symmetric 8-bit quantisation per block of :data:`BLOCK` entries: ``q = round(x / s)`` in
    ``[-127, 127]`` with ``s = max|x| / 127`` per block (``k#q8``: int8, ``k#s``: float32
    scales). Error at most ``s / 2`` per entry. About 25.1 % of float32's bytes.
``int4``
    The same with ``[-7, 7]`` and ``s = max|x| / 7``, two values per byte (``k#q4``: uint8).
    Error at most ``s / 2``. About 12.6 % of float32's bytes.
``topk``
    The ``ceil(f n)`` entries of largest magnitude, ``f`` = ``--topk-fraction`` (``k#i``:
    int32 flat indices, ``k#v``: float32 values); the rest is 0 (Aji and Heafield 2017,
    arXiv:1704.05021). 8 bytes per kept entry: 2 % of float32's bytes at ``f = 0.01``.

**Error feedback** (Seide et al. 2014; Karimireddy et al. 2019, arXiv:1901.09847): what the
codec left out, ``e = u - decode(encode(u))``, stays on the node (its ``Context.state``) and is
added to its next update, so nothing is lost, only delayed.

**The downlink** (``--compress-down int8``): the coordinator sends the round's weights
themselves encoded (:func:`compress_weights`; the node reads them with
:func:`decode_weights`) and keeps the exact ones. Each node trains from the quantised
weights ``q``; its model is then taken as what it trained moved onto the exact start ``w``,
``trained + (w - q)`` (:func:`rebase`; a compressed update is decoded onto ``w`` directly),
so the merge stays exact and the quantisation error does not build up over rounds.
"""

from __future__ import annotations

import math

import torch

from fedavg.config.settings import CODECS

__all__ = ["BLOCK", "CODECS", "MIN_NUMEL", "compress_update", "compress_weights",
           "compressible", "decode", "decode_reply", "decode_weights", "encode", "rebase"]
#: Entries per quantisation block (one float32 scale each: 0.1 % of float32's bytes more).
BLOCK = 1024
#: Floating tensors with fewer entries travel as they are (biases, norms, small heads).
MIN_NUMEL = 1024
SEP = "#"


def compressible(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is encoded (floating, at least :data:`MIN_NUMEL` entries)."""
    return tensor.is_floating_point() and tensor.numel() >= MIN_NUMEL


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, BLOCK)


def _quantise(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(x)
    scale = blocks.abs().amax(dim=1) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / scale[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q.reshape(-1), scale


def encode(x: torch.Tensor, codec: str, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """Encode one tensor (any shape, floating) by ``codec``; return its parts by name.

    Parameters
    ----------
    x : torch.Tensor
        The update of one tensor.
    codec : {"int8", "int4", "topk"}
    fraction : float
        Share of the entries ``topk`` keeps, in ``(0, 1]``.

    Returns
    -------
    dict of str to torch.Tensor
        ``{"q8", "s"}``, ``{"q4", "s"}`` or ``{"i", "v"}``, all 1-d.
    """
    if codec == "int8":
        q, scale = _quantise(x, 127)
        return {"q8": q, "s": scale}
    if codec == "int4":
        q, scale = _quantise(x, 7)
        nibbles = (q + 8).to(torch.uint8)  # 1 .. 15
        packed = nibbles[0::2] | (nibbles[1::2] << 4)  # BLOCK is even: pairs within blocks
        return {"q4": packed, "s": scale}
    if codec == "topk":
        flat = x.detach().reshape(-1).to(torch.float32)
        k = max(1, math.ceil(fraction * flat.numel()))
        index = flat.abs().topk(k, sorted=False).indices
        index = index.sort().values  # in order: the same bytes whichever order topk gave
        return {"i": index.to(torch.int32), "v": flat[index]}
    raise ValueError(f"unknown codec {codec!r} (one of {', '.join(CODECS[1:])})")


def _checked(parts: dict[str, torch.Tensor], name: str, dtype: torch.dtype,
             size: int | None = None) -> torch.Tensor:
    if name not in parts:
        raise ValueError(f"compressed update lacks its {name!r} part")
    t = parts[name]
    if t.dtype != dtype or t.dim() != 1 or (size is not None and t.numel() != size):
        raise ValueError(f"compressed part {name!r} is {t.dtype} of shape {tuple(t.shape)}, "
                         f"not {dtype}" + (f" of {size} entries" if size is not None else ""))
    return t


def decode(parts: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Decode the parts of one tensor into a tensor shaped and typed as ``like``.

    Raises
    ------
    ValueError
        Parts of another codec mixed in, missing, of the wrong type or size, indices out of
        range, or non-finite values: a malformed update.
    """
    n = like.numel()
    blocks = -(-n // BLOCK)
    if "q8" in parts or "q4" in parts:
        scale = _checked(parts, "s", torch.float32, blocks)
        if "q8" in parts:
            q = _checked(parts, "q8", torch.int8, blocks * BLOCK).to(torch.float32)
        else:
            packed = _checked(parts, "q4", torch.uint8, blocks * BLOCK // 2)
            q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).to(torch.float32) - 8
        if not torch.isfinite(scale).all() or q.abs().max() > 127:
            raise ValueError("compressed update has non-finite scales or values out of range")
        flat = (q.reshape(blocks, BLOCK) * scale[:, None]).reshape(-1)[:n]
    elif "i" in parts:
        index = _checked(parts, "i", torch.int32).to(torch.int64)
        values = _checked(parts, "v", torch.float32, index.numel())
        if index.numel() and (index.min() < 0 or index.max() >= n):
            raise ValueError(f"compressed update has indices outside 0..{n - 1}")
        flat = torch.zeros(n, dtype=torch.float32)
        flat[index] = values
    else:
        raise ValueError(f"compressed update has unknown parts {sorted(parts)}")
    return flat.reshape(like.shape).to(like.dtype)


def compress_update(state: dict[str, torch.Tensor], received: dict[str, torch.Tensor],
                    codec: str, fraction: float = 0.01,
                    residual: dict[str, torch.Tensor] | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return what a node sends for its trained ``state``, and what the codec left out.

    Parameters
    ----------
    state : dict of str to torch.Tensor
        The node's trained weights (the reply's state dict).
    received : dict of str to torch.Tensor
        The round's weights the node started from; keys it lacks travel as they are.
    codec : str
        One of :data:`CODECS`; ``none`` returns ``state`` itself.
    fraction : float
        ``topk``'s share of entries.
    residual : dict of str to torch.Tensor, optional
        Error feedback: last round's leftover per key, added to this round's update.

    Returns
    -------
    (dict, dict)
        The reply's arrays (``k#<part>`` for encoded tensors, the others as they are) and
        the new leftover ``update - decode(encode(update))`` per encoded key (float32).
    """
    if codec == "none":
        return state, {}
    sent: dict[str, torch.Tensor] = {}
    left: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        base = received.get(key)
        if base is None or base.shape != value.shape or not compressible(value):
            sent[key] = value
            continue
        update = value.detach().to(torch.float32) - base.to(torch.float32)
        if residual is not None and key in residual and residual[key].shape == update.shape:
            update = update + residual[key]
        parts = encode(update, codec, fraction)
        sent.update({f"{key}{SEP}{name}": part for name, part in parts.items()})
        left[key] = update - decode(parts, update)
    return sent, left


def decode_reply(arrays: dict[str, torch.Tensor],
                 received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rebuild a node's weights from a reply's arrays: the round's weights plus each update.

    A reply without encoded entries is returned as it is.

    Raises
    ------
    ValueError
        An encoded entry of a key the round did not send, or a malformed one (see
        :func:`decode`).
    """
    if not any(SEP in key for key in arrays):
        return arrays
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for key, value in arrays.items():
        name, sep, part = key.rpartition(SEP)
        if sep:
            grouped.setdefault(name, {})[part] = value
        else:
            state[key] = value
    for key, parts in grouped.items():
        base = received.get(key)
        if base is None or not base.is_floating_point():
            raise ValueError(f"compressed update of {key!r}, which the round did not send")
        state[key] = (base.to(torch.float32) + decode(parts, base).to(torch.float32)
                      ).to(base.dtype)
    return state


def compress_weights(state: dict[str, torch.Tensor], codec: str
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return the round's weights as sent to the nodes, and what each encoded one lost.

    Parameters
    ----------
    state : dict of str to torch.Tensor
        The round's exact weights.
    codec : {"int8", "int4"}
        A quantising codec (top-k of weights would drop most of the model).

    Returns
    -------
    (dict, dict)
        The message's arrays (``k#<part>`` for the encoded tensors, the others as they are)
        and ``w - decode(encode(w))`` per encoded key (float32): what :func:`rebase` adds
        back to a node's reply.
    """
    sent: dict[str, torch.Tensor] = {}
    lost: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not compressible(value):
            sent[key] = value
            continue
        parts = encode(value, codec)
        sent.update({f"{key}{SEP}{name}": part for name, part in parts.items()})
        lost[key] = value.detach().to(torch.float32) - decode(parts, value).to(torch.float32)
    return sent, lost


def decode_weights(arrays: dict[str, torch.Tensor],
                   like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read the round's weights a node received: encoded ones decoded, shaped as ``like``.

    ``like`` is the node's own model state (shapes and dtypes). Arrays without encoded
    entries are returned as they are.

    Raises
    ------
    ValueError
        An encoded entry of a key the model lacks, or a malformed one (:func:`decode`).
    """
    if not any(SEP in key for key in arrays):
        return arrays
    return decode_reply(arrays, {k: torch.zeros_like(v) for k, v in like.items()})


def rebase(arrays: dict[str, torch.Tensor],
           lost: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Move a node's weights sent whole from the quantised start onto the exact one.

    Each tensor ``k`` of ``arrays`` that :func:`compress_weights` encoded for the round
    becomes ``arrays[k] + lost[k]``; encoded entries (a compressed update, decoded onto the
    exact weights) and the other tensors are left as they are.
    """
    if not lost:
        return arrays
    out = dict(arrays)
    for key, value in arrays.items():
        gap = lost.get(key)
        if gap is not None and value.is_floating_point() and value.shape == gap.shape:
            out[key] = (value.to(torch.float32) + gap).to(value.dtype)
    return out
