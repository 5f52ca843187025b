"""Marks for tests that need a GPU, or run on one too where there is one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (`make test-gpu` on a GPU host)"
)


def also_on_gpu(on_cpu: Any, on_gpu: Any) -> list[Any]:
    """Parameters for a test that runs on the CPU everywhere and, where there is a GPU,
    on it too: `on_gpu` is marked `gpu` (`make test-gpu` runs those alone). A tuple is
    the values of several parameters."""

    def values(given: Any) -> tuple[Any, ...]:
        return given if isinstance(given, tuple) else (given,)

    return [
        pytest.param(*values(on_cpu), id="cpu"),
        pytest.param(*values(on_gpu), id="gpu", marks=[pytest.mark.gpu, needs_gpu]),
    ]
