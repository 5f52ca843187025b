"""A model for end-to-end tests that is slow on purpose (loaded by `--model`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

GATE_WAIT_S = 120.0


class SlowUniform(nn.Module):
    """Sleeps on every batch of images, then answers 'circle' for everything. The
    daemon's own batches of zeros (its probe, the warm-up at each batch size) are
    answered at once unless `zeros_too`: a test pays for the items it sends, not for
    the warm-up. With a `gate`, each batch of images first waits for that file to exist
    (at most `GATE_WAIT_S`), so a test decides when the work can go on."""

    def __init__(self, seconds_per_batch: float, zeros_too: bool = False, gate: str = ""):
        super().__init__()
        self.seconds_per_batch = seconds_per_batch
        self.zeros_too = zeros_too
        self.gate = Path(gate) if gate else None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.zeros_too or batch.any():
            if self.gate:
                _wait_until(self.gate.exists)
            time.sleep(self.seconds_per_batch)
        return _circles(len(batch))


class SlowMeans(SlowUniform):
    """As `SlowUniform`, answering each image by its mean pixel: rows that tell the
    inputs apart (where an embedding must land in its input's row)."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        super().forward(batch)
        means = batch.float().flatten(1).mean(1)
        return torch.stack([means, means / 2, means / 3, means / 4], 1)


def _wait_until(condition: Callable[[], bool]) -> None:
    """Until `condition()` holds, or `GATE_WAIT_S` has passed: then on either way (a
    stage child, unlike a test, does not fail for it: `tests.support.timing`)."""
    deadline = time.monotonic() + GATE_WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _circles(count: int) -> torch.Tensor:
    scores = torch.zeros(count, 4)
    scores[:, 0] = 1.0
    return scores


def factory() -> nn.Module:
    """1 s per batch, or SLOW_MODEL_SECONDS_PER_BATCH, gated by SLOW_MODEL_GATE_FILE if
    set; made only once the file SLOW_MODEL_HOLD_FILE names, if set, is gone (at most
    `GATE_WAIT_S`), so a test holds a restarted inference process down. Stage children
    read them, and they fork from a server that keeps the environment it started with:
    tests running the daemon in their own process use the fixed speeds below instead."""
    hold = os.environ.get("SLOW_MODEL_HOLD_FILE", "")
    if hold:
        _wait_until(lambda: not Path(hold).exists())
    return SlowUniform(
        float(os.environ.get("SLOW_MODEL_SECONDS_PER_BATCH", "1")),
        gate=os.environ.get("SLOW_MODEL_GATE_FILE", ""),
    )


def tenth_of_a_second() -> nn.Module:
    return SlowUniform(0.1)


def tenth_of_a_second_on_any_batch() -> nn.Module:
    """Zeros too: the bench's model-only baseline runs it on batches of zeros."""
    return SlowUniform(0.1, zeros_too=True)


def five_seconds() -> nn.Module:
    return SlowUniform(5)


class SlowToWarmUp(nn.Module):
    """Answers one item at once (the probe, and the test's one-image job) and takes a
    second for a batch of more: only the warm-up sends one."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > 1:
            time.sleep(1.0)
        return _circles(len(batch))


def slow_to_warm_up() -> nn.Module:
    return SlowToWarmUp()


def slow_to_load() -> nn.Module:
    """Thirty seconds to load (a large model, or one compiled at load)."""
    time.sleep(30)
    return SlowToWarmUp()


def tenth_of_a_second_by_input() -> nn.Module:
    return SlowMeans(0.1)
