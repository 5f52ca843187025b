"""Models for the tests of how batches reach the device and come back (`test_staging`,
`test_compiled`): each answers what its rows were, so padding and mix-ups show."""

from __future__ import annotations

import torch

# About half a second of an H100's time (its clock is under 2 GHz): long enough that
# the host's work on the next batch is done well before the model is.
SLEEP_CYCLES = 1_000_000_000


class RowMeans(torch.nn.Module):
    """Each row's mean pixel, and the size of the batch it was run in."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        means = batch.float().flatten(1).mean(dim=1)
        return torch.stack([means, torch.full_like(means, batch.shape[0])], dim=1)


def row_means() -> torch.nn.Module:
    return RowMeans()


class SlowOnDevice(RowMeans):
    """`RowMeans` after keeping the GPU busy for `SLEEP_CYCLES` (no host time)."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return super().forward(batch)


def slow_on_device() -> torch.nn.Module:
    return SlowOnDevice()
