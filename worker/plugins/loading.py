"""Loading the user's pieces by reference: the model, the preprocessor, a fan-out and
the postprocessor, each resolved once at start-up so that a typo fails before any
message is received.

A reference is `module:attribute` (imported), or for the model also the path of a
TorchScript file or a `torch.export` archive.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import torch

from worker.plugins import (
    DecodesOnDevice,
    FanOut,
    PluginError,
    Postprocessor,
    Preprocessor,
    TextPreprocessor,
    TokenSlots,
)

TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts")
EXPORT_SUFFIX = ".pt2"


def load_object(reference: str) -> Any:
    """The object named by `module:attribute`."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise PluginError(f"{reference!r} is not of the form module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise PluginError(f"cannot import {module_name!r} for {reference!r}: {error}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise PluginError(f"module {module_name!r} has no attribute {attribute!r}") from None


def load_preprocessor(reference: str) -> Preprocessor:
    return _load_shaped(reference, "callable(data, out)")  # type: ignore[no-any-return]


def token_slots(preprocessor: Preprocessor | TextPreprocessor) -> TokenSlots | None:
    """What the model's process is to know of a text preprocessor's slots; None for one
    of images."""
    if not isinstance(preprocessor, TextPreprocessor):
        return None
    if preprocessor.output_dtype not in (torch.int32, torch.int64):
        raise PluginError(
            f"a text preprocessor writes int32 or int64 ids, not {preprocessor.output_dtype}"
        )
    return TokenSlots(preprocessor.output_dtype, dict(preprocessor.notes))


def load_device_decoder(reference: str) -> DecodesOnDevice:
    preprocessor = load_preprocessor(reference)
    if not isinstance(preprocessor, DecodesOnDevice):
        raise PluginError(no_device_decoding(reference))
    return preprocessor


def no_device_decoding(reference: str) -> str:
    return f"{reference} does not decode on a device (it has no decode_on_device)"


def load_fan_out(reference: str) -> FanOut:
    return _load_shaped(reference, "callable(image, found, outs)")  # type: ignore[no-any-return]


def _load_shaped(reference: str, form: str) -> Any:
    """A callable that writes uint8 tensors of its `output_shape`."""
    loaded = load_object(reference)
    if not callable(loaded) or not getattr(loaded, "output_shape", None):
        raise PluginError(f"{reference} must be {form} with an output_shape")
    return loaded


def load_postprocessor(reference: str) -> Postprocessor:
    postprocessor = load_object(reference)
    if not callable(postprocessor):
        raise PluginError(f"{reference} is not callable")
    return postprocessor  # type: ignore[no-any-return]


def inference_devices(setting: str) -> list[str]:
    """The devices named by `--device`, one inference process each; `auto` is every
    visible GPU, else the CPU. (Counting GPUs here leaves CUDA to the children: they
    fork from a server process that never initialised it.)"""
    if setting == "auto":
        return [f"cuda:{number}" for number in range(torch.cuda.device_count())] or ["cpu"]
    return setting.split(",")


def resolve_device(name: str) -> torch.device:
    """`auto` is the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(reference: str, device: torch.device) -> torch.nn.Module:
    """A `torch.export` archive (.pt2), a TorchScript file, or a `module:factory`'s module."""
    if reference.endswith((EXPORT_SUFFIX, *TORCHSCRIPT_SUFFIXES)) and not Path(reference).is_file():
        raise PluginError(f"model file {reference} does not exist")
    if reference.endswith(EXPORT_SUFFIX):
        return _exported(reference, device)
    if reference.endswith(TORCHSCRIPT_SUFFIXES):
        with warnings.catch_warnings():
            # torch 2.13 deprecates TorchScript, but models exported with it are common.
            warnings.simplefilter("ignore", DeprecationWarning)
            model = torch.jit.load(reference, map_location=device)
    else:
        factory = load_object(reference)
        if not callable(factory):
            raise PluginError(f"{reference} is not callable")
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"{reference} gave a {type(model).__name__}, not a torch.nn.Module")
    return model.to(device).eval()


def _exported(reference: str, device: torch.device) -> torch.nn.Module:
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
    return _IntegersCast(program.module().to(device), dtypes)


def _integer(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not (
        dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
    )


class _IntegersCast(torch.nn.Module):
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
