"""The model, the data and the training loop, as in Flower's PyTorch quickstart.

The model is the same network as ``fedavg``'s ``cnn`` (two 5x5 conv + max-pool blocks of 32
and 64 channels, fc 128; a test checks that their parameter shapes agree). Images are
decoded once per process and kept as tensors, so that the benchmark compares orchestration,
not data pipelines.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

MEAN, STD = 0.1307, 0.3081  # MNIST's training pixels (0-1)


class Net(nn.Module):
    """Two 5x5 conv + max-pool blocks (32, 64 channels), fc 128, 10 classes; (N, 1, 28, 28)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, 10) of images (N, 1, 28, 28)."""
        return self.head(self.features(x))


_CACHE: dict[tuple, TensorDataset] = {}


def _tensors(rows) -> TensorDataset:
    """Decode a split's PNG bytes to normalised float images (N, 1, 28, 28) and labels."""
    from PIL import Image

    images = np.stack([np.asarray(Image.open(io.BytesIO(r["bytes"]))) for r in rows["image"]])
    x = (torch.from_numpy(images).float().div_(255.0).sub_(MEAN).div_(STD)).unsqueeze(1)
    return TensorDataset(x, torch.as_tensor(rows["label"]))


def load_partition(path: str, partition_id: int, num_partitions: int) -> TensorDataset:
    """Return IID partition ``partition_id`` of the train split (flwr-datasets), cached."""
    key = ("train", path, partition_id, num_partitions)
    if key not in _CACHE:
        from datasets import Image, load_dataset
        from flwr_datasets.partitioner import IidPartitioner

        train = load_dataset(path, split="train").cast_column("image", Image(decode=False))
        partitioner = IidPartitioner(num_partitions=num_partitions)
        partitioner.dataset = train
        _CACHE[key] = _tensors(partitioner.load_partition(partition_id)[:])
    return _CACHE[key]


def load_test(path: str) -> TensorDataset:
    """Return the test split as tensors, cached."""
    key = ("test", path)
    if key not in _CACHE:
        from datasets import Image, load_dataset

        test = load_dataset(path, split="test").cast_column("image", Image(decode=False))
        _CACHE[key] = _tensors(test[:])
    return _CACHE[key]


def train(net: Net, data: TensorDataset, epochs: int, batch_size: int, lr: float,
          momentum: float) -> float:
    """SGD over ``data`` for ``epochs``; return the mean training loss of the last epoch."""
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    total, seen = 0.0, 0
    for _ in range(epochs):
        total, seen = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
    return total / max(seen, 1)


@torch.no_grad()
def evaluate(net: Net, data: TensorDataset, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``net`` on ``data``."""
    net.eval()
    loss, correct = 0.0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        logits = net(x)
        loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
    return loss / len(data), correct / len(data)
