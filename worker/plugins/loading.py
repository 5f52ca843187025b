"""Loading the user's pieces by reference: the model, the preprocessor, a fan-out and
the postprocessor, each resolved once at start-up so that a typo fails before any
message is received.

A reference is `module:attribute` (imported), or for the model also the path of a
TorchScript file or a `torch.export` archive.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.plugins import (
    DecodesOnDevice,
    FanOut,
    PluginError,
    Postprocessor,
    Preprocessor,
    TextPreprocessor,
    TokenSlots,
)
from worker.plugins.spec import DecodePlacement

if TYPE_CHECKING:  # torch is imported by the stages' processes only, which load models
    import torch

TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts")
EXPORT_SUFFIX = ".pt2"
# The dtypes a text preprocessor's ids may be (named so, its `output_dtype` is checked
# without importing torch in the daemon's process).
TOKEN_DTYPES = ("torch.int32", "torch.int64")
# Signs of a GPU torch may use: the NVIDIA driver's list of this host's GPUs, and in
# DEVICE_FILES NVIDIA's devices, WSL2's GPU (dxg) and ROCm's (kfd). Where there is none,
# torch is not imported to count none.
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
DEVICE_FILES = Path("/dev")
GPU_DEVICE_FILES = ("nvidia[0-9]*", "dxg", "kfd")


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
    if str(preprocessor.output_dtype) not in TOKEN_DTYPES:
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


def decodes_on_device(
    placement: DecodePlacement, preprocess: str, devices: Sequence[str], chained: bool
) -> tuple[bool, str]:
    """Whether inputs are decoded on the model's device (`--decode`), and why. `gpu`
    insists, and a pipeline that cannot (a preprocessor without device decoding, no
    torchvision, a chain whose fan-out reads the decoded image from shared memory) is
    refused at start; `auto` decodes on the device when every one is a GPU and nothing
    stands in the way, on the CPU otherwise, and says which."""
    if placement == "cpu":
        return False, "--decode cpu"
    if placement == "auto" and not all(device.startswith("cuda") for device in devices):
        return False, "the model does not run on a GPU"
    obstacle = _device_decoding_obstacle(preprocess, chained)
    if placement == "gpu":
        if obstacle is not None:
            raise PluginError(f"--decode gpu: {obstacle}; use --decode cpu or auto")
        return True, "--decode gpu"
    return obstacle is None, obstacle or "every model device is a GPU"


def _device_decoding_obstacle(preprocess: str, chained: bool) -> str | None:
    """Why inputs cannot be decoded on the model's device, or None."""
    if chained:
        return "a chain's fan-out reads each decoded image from shared memory"
    preprocessor = load_preprocessor(preprocess)
    if not isinstance(preprocessor, DecodesOnDevice):
        return no_device_decoding(preprocess)
    return preprocessor.device_decoding_unavailable()


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
    fork from a server process that never initialised it; torch is imported for it only
    where there may be GPUs to count.)"""
    if setting != "auto":
        return setting.split(",")
    gpus = visible_gpus() if _a_gpu_may_be_here() else 0
    return [f"cuda:{number}" for number in range(gpus)] or ["cpu"]


def visible_gpus() -> int:
    """How many GPUs torch sees (NVIDIA's, and AMD's through ROCm)."""
    import torch

    return torch.cuda.device_count()


def _a_gpu_may_be_here() -> bool:
    """Whether this host shows any sign of a GPU: torch alone can tell whether it is
    one it may use."""
    if NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir()):
        return True
    return any(any(DEVICE_FILES.glob(pattern)) for pattern in GPU_DEVICE_FILES)


def resolve_device(name: str) -> torch.device:
    """`auto` is the first GPU when there is one, else the CPU."""
    import torch  # a stage's process: it has torch already

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(reference: str, device: torch.device) -> torch.nn.Module:
    """A `torch.export` archive (.pt2), a TorchScript file, or a `module:factory`'s module."""
    import torch  # a stage's process: it has torch already

    from worker.plugins.exported import exported_module

    if reference.endswith((EXPORT_SUFFIX, *TORCHSCRIPT_SUFFIXES)) and not Path(reference).is_file():
        raise PluginError(f"model file {reference} does not exist")
    if reference.endswith(EXPORT_SUFFIX):
        return exported_module(reference, device)
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
