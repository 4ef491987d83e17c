"""The built-in model builders, registered with :func:`fedavg.models.register.register_model`.

Each maps a normalised ``(N, *input_shape)`` float batch to ``(N, num_classes)`` logits:
``mlp`` (images or tabular rows), ``cnn`` (grey images such as MNIST), ``cnn-cifar``
(NIID-Bench's CNN), ``cnn-dense`` (DENSE's larger CIFAR CNN) and ``resnet18``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedavg.models.register import register_model


def flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Return the number of features ``features`` makes of one ``input_shape`` input."""
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).numel())


@register_model("mlp", "2-layer perceptron, 200 units each (the FedAvg paper's 2NN)",
                kinds=("image", "tabular"))
def mlp(input_shape, num_classes, hidden: int = 200) -> nn.Module:
    """Two hidden layers of ``hidden`` ReLU units (McMahan et al. 2017, arXiv:1602.05629)."""
    d = 1
    for s in input_shape:
        d *= s
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


@register_model("cnn", "small CNN for grey images such as 28x28 MNIST (conv 32-64, fc 128)")
def cnn(input_shape, num_classes, width: int = 32) -> nn.Module:
    """Two 5x5 conv + max-pool blocks (``width``, ``2*width`` channels), then fc 128.

    A narrower version of the CNN of McMahan et al. 2017 (arXiv:1602.05629).
    """
    if len(input_shape) != 3:
        raise ValueError("cnn needs image inputs (C, H, W)")
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], width, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return nn.Sequential(
        features,
        nn.Linear(flat_size(features, input_shape), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


@register_model("cnn-cifar", "NIID-Bench CNN: two 5x5 convs (6, 16 channels), fc 120-84")
def cnn_cifar(input_shape, num_classes) -> nn.Module:
    """Build the simple CNN of NIID-Bench (Li et al. 2022, arXiv:2102.02079), LeNet-5 shaped."""
    if len(input_shape) != 3:
        raise ValueError("cnn-cifar needs image inputs (C, H, W)")
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return nn.Sequential(
        features,
        nn.Linear(flat_size(features, input_shape), 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


@register_model("cnn-dense", "DENSE's CIFAR CNN: three 3x3 convs of 128 channels, one linear layer")
def cnn_dense(input_shape, num_classes, width: int = 128) -> nn.Module:
    """Build the CNN that DENSE trains on CIFAR-10 (Zhang et al. 2022, arXiv:2112.12371).

    Three 3x3 convolutions of ``width`` channels without padding, each but the last
    followed by ReLU and a 2x2 max-pool (the last by ReLU only), then one linear layer. On
    ``(3, 32, 32)`` inputs with 10 classes: 319,242 parameters and about 30.4 M
    multiply-adds per image, against 62,006 and 0.65 M for ``cnn-cifar``.
    """
    if len(input_shape) != 3:
        raise ValueError("cnn-dense needs image inputs (C, H, W)")
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], width, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3),
        nn.ReLU(),
        nn.Flatten(),
    )
    return nn.Sequential(features, nn.Linear(flat_size(features, input_shape), num_classes))


@register_model("resnet18", "torchvision ResNet-18 with a 3x3 stem for 32x32 inputs (BatchNorm)")
def resnet18(input_shape, num_classes) -> nn.Module:
    """ResNet-18 (He et al. 2016, arXiv:1512.03385) from torchvision, CIFAR-style stem.

    The 7x7 stride-2 stem and max-pool are replaced by a 3x3 stride-1 conv, as is usual
    for 32x32 images.
    """
    from torchvision.models import resnet18 as tv_resnet18

    if len(input_shape) != 3:
        raise ValueError("resnet18 needs image inputs (C, H, W)")
    net = tv_resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net
