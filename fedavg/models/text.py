"""Built-in text classifiers over ``(N, L)`` int64 token ids (see :mod:`fedavg.data.text`).

Registered in :mod:`fedavg.models.registry` on import. Both take ``vocab_size`` (embedding rows) and
``pad_id`` (the padding id, ignored), which :func:`fedavg.run.lifecycle.prepare` passes from the
tokenizer, and return ``(N, num_classes)`` logits.
"""

from __future__ import annotations

import torch
from torch import nn

from fedavg.models.register import register_model


class BagOfEmbeddings(nn.Module):
    """fastText-style classifier: the sum of a text's token embeddings, then a linear layer.

    Joulin et al. 2016, "Bag of Tricks for Efficient Text Classification"
    (arXiv:1607.01759). The embeddings are summed rather than averaged: with mini-batch
    SGD at the usual learning rates a mean gives each embedding row a gradient about L
    times smaller, and trains far slower.

    Parameters
    ----------
    vocab_size : int
        Token ids ``0..vocab_size-1``.
    num_classes : int
        Output width.
    pad_id : int
        Padding id (its embedding is zero and never trained).
    dim : int
        Embedding width.
    """

    def __init__(self, vocab_size: int, num_classes: int, pad_id: int = 0, dim: int = 32):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, dim, mode="sum", padding_idx=pad_id)
        nn.init.normal_(self.embedding.weight, 0.0, 0.1 / dim**0.5)
        with torch.no_grad():
            self.embedding.weight[pad_id].zero_()
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` int64 ids -> ``(N, num_classes)`` logits."""
        return self.fc(self.embedding(ids))


class TextTransformer(nn.Module):
    """Small Transformer encoder (torch's own layers), mean-pooled over the real tokens.

    Vaswani et al. 2017 (arXiv:1706.03762); learned positions, pre-norm layers, padding
    masked out of attention and of the pooling.

    Parameters
    ----------
    vocab_size, max_length : int
        Token ids ``0..vocab_size-1``; positions ``0..max_length-1``.
    num_classes : int
        Output width.
    pad_id : int
        Padding id.
    dim, layers, heads : int
        Model width (a multiple of ``heads``), encoder layers, attention heads.
    """

    def __init__(self, vocab_size: int, max_length: int, num_classes: int, pad_id: int = 0,
                 dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.pad_id = pad_id
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.position = nn.Embedding(max_length, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` int64 ids -> ``(N, num_classes)`` logits."""
        pad = ids == self.pad_id
        pad[:, 0] = False  # an empty text still attends to one position
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.encoder(self.embedding(ids) + self.position(pos), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.fc(self.norm((h * keep).sum(1) / keep.sum(1)))


def _length(input_shape) -> int:
    if len(input_shape) != 1:
        raise ValueError("text models need token-id inputs (L,)")
    return int(input_shape[0])


@register_model("fasttext", "bag of word + bigram embeddings, summed, then linear (fastText)",
                kinds=("text",))
def fasttext(input_shape, num_classes, vocab_size: int, pad_id: int = 0,
             dim: int = 32) -> nn.Module:
    """:class:`BagOfEmbeddings` (Joulin et al. 2016, arXiv:1607.01759)."""
    _length(input_shape)
    return BagOfEmbeddings(vocab_size, num_classes, pad_id, dim)


@register_model("text-transformer", "2-layer Transformer encoder, 64 wide, mean-pooled",
                kinds=("text",))
def text_transformer(input_shape, num_classes, vocab_size: int, pad_id: int = 0,
                     dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    """:class:`TextTransformer` (Vaswani et al. 2017, arXiv:1706.03762)."""
    return TextTransformer(vocab_size, _length(input_shape), num_classes, pad_id, dim,
                           layers, heads)
