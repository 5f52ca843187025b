"""A model for end-to-end tests that is slow on purpose (loaded by `--model`)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class SlowUniform(nn.Module):
    """Sleeps, then answers 'circle' for everything."""

    def __init__(self, seconds_per_batch: float):
        super().__init__()
        self.seconds_per_batch = seconds_per_batch

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds_per_batch)
        scores = torch.zeros(len(batch), 4)
        scores[:, 0] = 1.0
        return scores


def factory() -> nn.Module:
    """1 s per batch, or SLOW_MODEL_SECONDS_PER_BATCH. Stage children read it, and they
    fork from a server that keeps the environment it started with: tests running the
    daemon in their own process use the fixed speeds below instead."""
    return SlowUniform(float(os.environ.get("SLOW_MODEL_SECONDS_PER_BATCH", "1")))


def tenth_of_a_second() -> nn.Module:
    return SlowUniform(0.1)


def five_seconds() -> nn.Module:
    return SlowUniform(5)


class SlowToWarmUp(SlowUniform):
    """Answers one item at once (the probe, and the test's one-image job) and takes a
    second for a batch of more: only the warm-up sends one."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return super().forward(batch) if len(batch) > 1 else torch.tensor([[1.0, 0, 0, 0]])


def slow_to_warm_up() -> nn.Module:
    return SlowToWarmUp(1.0)
