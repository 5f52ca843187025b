"""Plug-ins that fail on purpose, for fault tests of the daemon as a subprocess.

Loaded by `--preprocess tests.faults:faulty_preprocessor` and
`--model tests.faults:fragile_classifier`; every other input gets the default pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stages.model import default_classifier
from stages.preprocess import default_preprocessor
from tests.stagefns import inject_fault

FAULT_PREFIX = b"FAULT:"
FRAGILE_MAX_BATCH = 8


class FaultyPreprocessor:
    """The default preprocessor, except that an input `FAULT:<name>` makes this process
    die (sigkill), crash (segfault) or hang, as `inject_fault` does."""

    output_shape = default_preprocessor.output_shape

    def __call__(self, data: bytes, out: torch.Tensor) -> Any:
        if data.startswith(FAULT_PREFIX):
            inject_fault(data.removeprefix(FAULT_PREFIX).decode().strip())
        return default_preprocessor(data, out)


faulty_preprocessor = FaultyPreprocessor()


class FragileClassifier(nn.Module):
    """The default classifier, but out of memory on batches over 8 images, and an
    exception on any batch holding an all-black image."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > FRAGILE_MAX_BATCH:
            raise torch.OutOfMemoryError(f"{len(batch)} images do not fit (test)")
        if bool((batch.flatten(1).amax(dim=1) == 0).any()):
            raise ValueError("the model cannot take an all-black image (test)")
        return self.inner(batch)  # type: ignore[no-any-return]


def fragile_classifier() -> nn.Module:
    return FragileClassifier(default_classifier())
