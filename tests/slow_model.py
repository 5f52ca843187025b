"""A model for end-to-end tests that is slow on purpose (loaded by `--model`)."""

from __future__ import annotations

import time

import torch
from torch import nn

SECONDS_PER_BATCH = 1.0


class SlowUniform(nn.Module):
    """Sleeps, then answers 'circle' for everything."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(SECONDS_PER_BATCH)
        scores = torch.zeros(len(batch), 4)
        scores[:, 0] = 1.0
        return scores


def factory() -> nn.Module:
    return SlowUniform()
