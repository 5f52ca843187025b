"""The default model: a small CNN that tells four shapes apart, in plain torch."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stages.synthetic import LABELS

WEIGHTS = Path(__file__).parent / "weights" / "shapes_cnn.pt"


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    """3x3 convolution, batch norm, ReLU, then half the size."""
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ShapeNet(nn.Module):
    """Three conv blocks and a linear head: about 53k parameters, 64x64 RGB input."""

    def __init__(self, classes: int = len(LABELS)):
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 24), conv_block(24, 48), conv_block(48, 96))
        self.head = nn.Linear(96, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))  # type: ignore[no-any-return]


class Classifier(nn.Module):
    """uint8 NCHW batch in, class probabilities out: normalisation runs on the device."""

    # Its version is left to the digest of its weights, which retraining changes.
    model_name = "shapes-cnn"

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(normalise(batch)), dim=1)


def normalise(batch: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to floats in [-1, 1], as the models were trained."""
    return batch.float().div_(127.5).sub_(1.0)


def default_classifier() -> nn.Module:
    """The shipped ShapeNet with its trained weights, wrapped to take uint8 batches."""
    net = ShapeNet()
    net.load_state_dict(torch.load(WEIGHTS, map_location="cpu", weights_only=True))
    return Classifier(net).eval()
