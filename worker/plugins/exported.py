"""A `torch.export` archive as a model: its module, its integer inputs cast to the dtypes
it was exported with (`worker.plugins.loading.load_model`, in a stage's process)."""

from __future__ import annotations

from typing import Any

import torch


def exported_module(reference: str, device: torch.device) -> torch.nn.Module:
    """A `torch.export` archive's module, called with its integer inputs in the dtypes
    it was exported with: an exported program refuses any other, and a text model
    exported with the int64 ids of a Hugging Face tokenizer is then fed the int32 ids
    of `stages.text:tokens` (a cast of a few kB a batch on the device)."""
    program = torch.export.load(reference)
    placeholders = {
        node.name: node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"
    }
    dtypes = [
        getattr(placeholders[name], "dtype", None) for name in program.graph_signature.user_inputs
    ]
    # Exported programs refuse .eval(); they are traced in inference mode already.
    return IntegersCast(program.module().to(device), dtypes)


def _integer(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not (
        dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
    )


class IntegersCast(torch.nn.Module):
    """`module`, each integer tensor it is given cast to the integer dtype `dtypes` names
    for its place (a tensor of any other dtype is left as it is, for the module to
    refuse)."""

    def __init__(self, module: torch.nn.Module, dtypes: list[torch.dtype | None]):
        super().__init__()
        self.module = module
        self.dtypes = dtypes

    def forward(self, *inputs: Any) -> Any:
        cast = [
            value.to(dtype)
            if isinstance(value, torch.Tensor) and _integer(value.dtype) and _integer(dtype)
            else value
            for value, dtype in zip(inputs, self.dtypes, strict=False)
        ]
        return self.module(*cast, *inputs[len(cast) :])
