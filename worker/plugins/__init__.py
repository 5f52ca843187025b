"""Loading the user's pieces: the model, the preprocessor and the postprocessor.

A reference is `module:attribute` (imported), or for the model also the path of a
TorchScript file. Each is resolved once at start-up so a typo fails before any message
is received.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import orjson
import structlog
import torch

from worker.engine import ItemError, StageFunction, bisection_sizes, isolate_failures
from worker.plugins.spec import DecodePlacement, PipelineSpec

POSTPROCESS_STAGE = "postprocess"  # what an item error of the postprocessor names
PREPROCESS_STAGE = "preprocess"  # ... and of the preprocessor, wherever it ran
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts")
EXPORT_SUFFIX = ".pt2"


class PluginError(Exception):
    """A reference that does not name a usable object."""


class Preprocessor(Protocol):
    """Turns one input's bytes into a uint8 tensor of `output_shape`, written into `out`.

    It may also have `samples`: inputs it must always decode. The daemon decodes them at
    start (a missing codec stops it there) and whenever an input fails, to tell a broken
    worker from a bad input; without them, every failure is the input's.
    """

    @property
    def output_shape(self) -> tuple[int, ...]: ...

    def __call__(self, data: bytes, out: torch.Tensor) -> Any: ...


@runtime_checkable
class DecodesOnDevice(Preprocessor, Protocol):
    """A preprocessor that can also decode some inputs in batches on the model's device
    (JPEGs with nvJPEG), for `--decode gpu`: the preprocessing processes leave those
    inputs' bytes in their arena slots, and the model's process decodes them there."""

    def device_decoding_unavailable(self) -> str | None:
        """Why it cannot decode on a device on this machine, or None."""

    def device_decodable(self, data: bytes) -> bool:
        """Whether this input is for the device (checked where it is fetched)."""

    def decode_on_device(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """Each input (a 1-D uint8 CPU tensor of its bytes) as a uint8 tensor of
        `output_shape` on `device`; raises if any of them cannot be."""


@dataclass(frozen=True, slots=True)
class Undecoded:
    """An item's payload when its slot holds its undecoded bytes, `length` of them, for
    the model's process to decode on its device."""

    length: int


class FanOut(Protocol):
    """Cuts one image into parts for the next model (`spec.FanOutStep`): writes each into
    one of `outs` (uint8 tensors of `output_shape`) and returns what each is about."""

    @property
    def output_shape(self) -> tuple[int, ...]: ...

    def __call__(
        self, image: torch.Tensor, found: Any, outs: Sequence[torch.Tensor]
    ) -> list[Any]: ...


Postprocessor = Callable[[Any, dict[str, Any]], dict[str, Any]]
InferenceFn = Callable[[torch.Tensor, Sequence[Any]], list[Any]]
ARRAY_TYPES = (np.ndarray, torch.Tensor)
# numpy scalars (and 0-d arrays) as numbers; non-str keys as strings, as `json` does.
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
# results.jsonl's own fields on every line; a postprocessor's fields go between them.
RECORD_FIELDS = frozenset({"index", "input", "model", "error"})

log = structlog.get_logger()

# It names a file under the job's output, where names starting "checkpoint-" are the
# checkpoints' (`worker.jobs.checkpoints`), removed once the job is finished.
_FIELD_NAME = re.compile(r"^(?!checkpoint-)[A-Za-z0-9_-]{1,100}$")


def check_field_name(field: object) -> str:
    """The array field's name, if it can name its file; ValueError if not."""
    if not isinstance(field, str) or not _FIELD_NAME.match(field):
        raise ValueError(
            f"the array field {field!r} cannot name a file: use letters, digits, _ and -, "
            "not starting checkpoint-"
        )
    return field


ArrayLayout = tuple[np.dtype[Any], tuple[int, ...]]
ArrayLayouts = Mapping[str, ArrayLayout]


def array_layouts(
    arrays: Mapping[str, np.ndarray],
) -> dict[str, ArrayLayout]:
    return {field: (array.dtype, array.shape) for field, array in arrays.items()}


# An item's value on its way to the model, with its job's params, which the
# postprocessor in the model's process is given: (payload, params), the payload being
# the input's URI, then its bytes, then what the preprocessor returned. A plain tuple:
# pickle writes it in C (a named tuple goes through Python code, 13 times slower), and
# it crosses a pipe three times per item.
WithParams = tuple[Any, dict[str, Any]]


def on_payload(fn: Callable[..., Any]) -> Callable[..., WithParams]:
    """`fn` applied to an item's payload, its params kept."""

    def apply(value: WithParams, *rest: Any) -> WithParams:
        payload, params = value
        return fn(payload, *rest), params

    return apply


# What the model's process sends for an item: its fields, JSON-encoded (`encoded_fields`),
# and with them its array fields, if it has any.
Encoded = bytes | tuple[bytes, dict[str, np.ndarray]]


def encoded_fields(postprocess: Postprocessor, output: Any, params: dict[str, Any]) -> Encoded:
    """The postprocessor's fields for one model output, JSON-encoded as the members that
    follow `input` in the item's results.jsonl line (`,"label":"cat",...`); those whose
    value is an array (numpy or torch, not a scalar) apart, as arrays (`worker.jobs.arrays`)."""
    fields = postprocess(output, params)
    if not isinstance(fields, dict):
        raise TypeError(f"the postprocessor returned a {type(fields).__name__}, not a dict")
    clash = RECORD_FIELDS.intersection(fields)
    if clash:
        raise ValueError(
            f"the postprocessor returned {', '.join(sorted(clash))}: results.jsonl's own "
            "fields on every line"
        )
    arrays = {
        check_field_name(name): _as_numpy(value)
        for name, value in fields.items()
        if isinstance(value, ARRAY_TYPES) and value.ndim > 0
    }
    if arrays:
        fields = {name: value for name, value in fields.items() if name not in arrays}
    encoded = b"," + encode_json(fields)[1:-1] if fields else b""
    return (encoded, arrays) if arrays else encoded


def encode_json(value: Any) -> bytes:
    """Compact JSON, numpy scalars as numbers (orjson: twelve times the speed of the
    standard library's encoder, which cost the inference process more per item than
    the default postprocessor itself)."""
    return orjson.dumps(value, default=_scalar, option=JSON_OPTIONS)


def _as_numpy(array: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if array.dtype == torch.bfloat16:  # numpy has no bfloat16
        array = array.float()
    return array.detach().cpu().numpy()


def _scalar(value: Any) -> Any:
    """A torch scalar as the Python number JSON can encode (orjson's `default`)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    raise TypeError(f"a {type(value).__name__} is not JSON serializable")


def postprocessed(
    postprocess: Postprocessor, output: Any, params: dict[str, Any]
) -> Encoded | ItemError:
    """One output's encoded fields, or why the postprocessor failed on it."""
    try:
        return encoded_fields(postprocess, output, params)
    except Exception as error:
        return ItemError.from_exception(error, POSTPROCESS_STAGE)


def chain_postprocess_fault(postprocess: Postprocessor) -> str | None:
    """Why a chain's postprocessor fails known-good input (the parts of an input its
    fan-out found nothing in, with no params), or None: it tells a broken worker from
    bad inputs, as a model's probe does."""
    outcome = postprocessed(postprocess, [], {})
    return f"{outcome.type}: {outcome.message}" if isinstance(outcome, ItemError) else None


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


def load_device_decoder(reference: str) -> DecodesOnDevice:
    preprocessor = load_preprocessor(reference)
    if not isinstance(preprocessor, DecodesOnDevice):
        raise PluginError(_no_device_decoding(reference))
    return preprocessor


def _no_device_decoding(reference: str) -> str:
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


@dataclass(frozen=True)
class ModelIdentity:
    """Which model produced a result: a name and a version people choose, and the
    sha256 of what was loaded (the model file, or the module's state dict), which
    changes whenever the weights do even if nobody bumped the version."""

    name: str
    version: str
    digest: str
    steps: tuple[ModelIdentity, ...] = ()  # a chain's models, in order

    @functools.cached_property
    def label(self) -> str:
        """`name@version`, on every line of results.jsonl: made once, not per item."""
        return f"{self.name}@{self.version}"

    @functools.cached_property
    def encoded_label(self) -> bytes:
        return encode_json(self.label)

    def labels(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "digest": self.digest}

    def as_dict(self) -> dict[str, Any]:
        """What job.json records: the labels, and a chain's models."""
        if not self.steps:
            return self.labels()
        return {**self.labels(), "steps": [step.as_dict() for step in self.steps]}


def pipeline_identity(spec: PipelineSpec, models: Sequence[ModelIdentity]) -> ModelIdentity:
    """What produced a pipeline's results: its one model, or for a chain its name and
    version and a digest over its models' digests and the steps around them, which
    change the results as much as the weights do."""
    if len(models) == 1 and spec.fan_out is None:
        return models[0]
    fan_out = spec.fan_out
    around = [spec.preprocess, spec.postprocess, fan_out.fan_out if fan_out else None]
    cut = fan_out.max_parts if fan_out else None
    made_of = json.dumps([around, cut, [model.digest for model in models]])
    digest = hashlib.sha256(made_of.encode()).hexdigest()
    return ModelIdentity(
        name=spec.name or "pipeline",
        version=spec.version or digest[:12],
        digest=f"sha256:{digest}",
        steps=tuple(models),
    )


def identify(
    reference: str, model: torch.nn.Module, name: str | None, version: str | None
) -> ModelIdentity:
    """The model's identity: the name and version given, else the module's own
    `model_name` / `model_version` attributes, else the file's name or the factory's
    reference and the digest's first 12 digits."""
    if reference.endswith((EXPORT_SUFFIX, *TORCHSCRIPT_SUFFIXES)):
        with open(reference, "rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        default_name = Path(reference).name
    else:
        digest = _state_digest(model)
        default_name = reference
    return ModelIdentity(
        name=name or getattr(model, "model_name", None) or default_name,
        version=version or getattr(model, "model_version", None) or digest[:12],
        digest=f"sha256:{digest}",
    )


def _state_digest(model: torch.nn.Module) -> str:
    """sha256 over the state dict's names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
        # Exported programs refuse .eval(); they are traced in inference mode already.
        return torch.export.load(reference).module().to(device)
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


def inference_setup(
    model_reference: str,
    device_name: str,
    item_shape: tuple[int, ...],
    *,
    batch_size: int = 1,
    precision: str = "float32",
    channels_last: bool = False,
    model_name: str | None = None,
    model_version: str | None = None,
    postprocess: str | None = None,
    decoder: str | None = None,
) -> StageFunction:
    """Runs once in the inference process: load the model, check that it answers a
    batch of zeros, warm it up, and return the batch function with that check as its
    probe and the model's identity and warm-up time as what it reports. With
    `postprocess`, each output is postprocessed and encoded here, where it already is
    (`postprocessed`), while the next batch runs (the stage's `finish`): only the encoded
    fields and the arrays cross to the daemon. With `decoder` (the preprocessor), the
    inputs left undecoded are decoded on the device first (`decode_undecoded`)."""
    device = resolve_device(device_name)
    decode = _device_decoder(decoder, device) if decoder else None
    model = load_model(model_reference, device)
    identity = identify(model_reference, model, model_name, model_version)
    if channels_last:
        # Module.to takes memory_format (torch documents it); its type stubs omit it.
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=precision == "bfloat16")

    def infer(batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        on_device = batch.to(device, non_blocking=True)
        with torch.inference_mode():
            undecodable = decode(batch, values, on_device) if decode else {}
        if channels_last and on_device.dim() == 4:  # the only rank it is defined for
            on_device = on_device.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), autocast:
            outputs = model(on_device)
        if outputs.dtype == torch.bfloat16:  # numpy has no bfloat16
            outputs = outputs.float()
        # Numpy rows: an embedding or a mask stays an array (as Python floats a 512x512
        # mask would take milliseconds to make and more to encode), and unlike a tensor
        # one is not sent through shared memory if it crosses to the daemon (a chain).
        # A copy, on the CPU too: the rows are postprocessed while the next batch is
        # gathered, and a model may answer with a view of its input (that batch buffer).
        rows: list[Any] = list(outputs.to("cpu", copy=True).numpy())
        for position, error in undecodable.items():
            rows[position] = error
        return rows

    zeros = torch.zeros((1, *item_shape), dtype=torch.uint8)

    def probe() -> None:
        infer(zeros, [None])

    try:
        (answer_to_zeros,) = infer(zeros, [None])
    except Exception as error:
        raise PluginError(
            f"the model fails on a batch of zeros ({type(error).__name__}: {error}); the "
            "daemon runs one at start, and again whenever a whole batch fails, to tell a "
            "broken worker from bad inputs"
        ) from error
    warm_up = _warm_up(infer, item_shape, bisection_sizes(batch_size))
    about = {"model": identity.as_dict(), "warm_up": warm_up}
    if postprocess is None:
        return StageFunction(infer, probe, about)
    postprocessor = load_postprocessor(postprocess)

    def postprocess_all(outputs: list[Any], values: list[WithParams]) -> list[Any]:
        return [
            postprocessed(postprocessor, output, params)
            for output, (_, params) in zip(outputs, values, strict=True)
        ]

    def postprocess_probe() -> Encoded:
        return encoded_fields(postprocessor, answer_to_zeros, {})

    try:
        probed = postprocess_probe()
    except Exception as error:
        raise PluginError(
            f"{postprocess} fails on the model's answer to a batch of zeros with no params "
            f"({type(error).__name__}: {error}); the daemon runs it whenever it fails a "
            "whole batch, to tell a broken worker from bad inputs"
        ) from error
    # Each input's array fields must be these, of these shapes and dtypes.
    about["arrays"] = array_layouts(probed[1] if isinstance(probed, tuple) else {})
    return StageFunction(
        infer, probe, about, finish=postprocess_all, finish_probe=postprocess_probe
    )


def _device_decoder(
    reference: str, device: torch.device
) -> Callable[[torch.Tensor, Sequence[Any], torch.Tensor], dict[int, ItemError]]:
    """`decode_undecoded` with the preprocessor named, once it has decoded its samples
    on the device: a decoder that cannot (no nvJPEG, a broken binding) stops the start
    rather than sending every input to the CPU fallback unseen."""
    preprocessor = load_device_decoder(reference)
    samples = [
        torch.frombuffer(bytearray(sample), dtype=torch.uint8)
        for sample in getattr(preprocessor, "samples", ())
        if preprocessor.device_decodable(sample)
    ]
    try:
        if samples:
            _decoded_on_device(preprocessor, samples, device)
    except Exception as error:
        raise PluginError(
            f"{reference} cannot decode its own samples on {device} ({type(error).__name__}: "
            f"{error}); use --decode cpu"
        ) from error
    return functools.partial(decode_undecoded, preprocessor, device)


def _warm_up(infer: InferenceFn, item_shape: tuple[int, ...], sizes: list[int]) -> dict[str, Any]:
    """Run a batch of zeros at each size the stage will meet first: the batch size, and
    the sizes that error bisection and OOM recovery fall back to. The first real jobs
    then do not pay for lazy CUDA init, cuDNN's autotuning or a compile step. A size
    that does not fit in memory is noted, not fatal: the stage bisects such batches and
    lowers its batch size, as it would for any batch that runs out of memory."""
    started = time.perf_counter()
    out_of_memory = []
    for size in sizes:
        batch = torch.zeros((size, *item_shape), dtype=torch.uint8)
        try:
            infer(batch, [None] * size)
        except torch.OutOfMemoryError:
            out_of_memory.append(size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception as error:
            raise PluginError(
                f"the model fails on a batch of {size} zeros ({type(error).__name__}: "
                f"{error}); lower the batch size to what it takes (--batch-size, or the "
                "step's batch_size in the pipeline spec)"
            ) from error
    return {
        "batch_sizes": sizes,
        "out_of_memory": out_of_memory,
        "seconds": round(time.perf_counter() - started, 3),
    }


def fan_out_setup(reference: str) -> StageFunction:
    """Runs once in each fan-out process."""
    torch.set_num_threads(1)
    return StageFunction(load_fan_out(reference))


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
        return _no_device_decoding(preprocess)
    return preprocessor.device_decoding_unavailable()


def decode_or_defer(preprocessor: DecodesOnDevice, data: bytes, out: torch.Tensor) -> Any:
    """Decode `data` into `out`; or, if the device decodes it and it fits, copy its bytes
    there for the model's process (`Undecoded`). A larger file is decoded here: the
    slot, the size of one decoded input, is all the room an input has on its way."""
    slot = out.view(-1)
    if len(data) <= slot.numel() and preprocessor.device_decodable(data):
        slot.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return Undecoded(len(data))
    return preprocessor(data, out)


def decode_undecoded(
    preprocessor: DecodesOnDevice,
    device: torch.device,
    batch: torch.Tensor,
    values: Sequence[Any],
    on_device: torch.Tensor,
) -> dict[int, ItemError]:
    """Decode the rows of `batch` whose slots hold undecoded bytes into `on_device`,
    together on the device. A call that raises is bisected down to the inputs it fails
    on; those are decoded on the CPU here, by the same preprocessor; an input neither
    can decode is that item's error, as if it had failed in the preprocessing process,
    and its row is zeroed (the model's probe input) so the batch's others still run.
    Returns those errors by position."""
    undecoded = [
        (position, batch[position].view(-1)[: value[0].length])
        for position, value in enumerate(values)
        if isinstance(value, tuple) and isinstance(value[0], Undecoded)
    ]
    if not undecoded:
        return {}
    encoded = [data for _, data in undecoded]
    images = isolate_failures(
        lambda chosen: _decoded_on_device(preprocessor, [encoded[c] for c in chosen], device),
        len(encoded),
        PREPROCESS_STAGE,
    )
    failed = {}
    rejected = 0
    for (position, data), on_gpu in zip(undecoded, images, strict=True):
        image = on_gpu
        if isinstance(on_gpu, ItemError):
            rejected += 1
            image = _decoded_on_cpu(preprocessor, data)
        if isinstance(image, ItemError):
            failed[position] = image
            on_device[position].zero_()
        else:
            on_device[position].copy_(image)
    if rejected:
        log.warning("decoded_on_cpu", inputs=rejected, of=len(undecoded))
    return failed


def _decoded_on_device(
    preprocessor: DecodesOnDevice, encoded: list[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """`decode_on_device`, refusing an image of another shape than the preprocessor's
    (it would be broadcast into the batch's row, not fail)."""
    images = preprocessor.decode_on_device(encoded, device)
    shape = tuple(preprocessor.output_shape)
    misfits = [tuple(image.shape) for image in images if tuple(image.shape) != shape]
    if misfits:
        raise ValueError(f"decode_on_device made images of {misfits[0]}, not {shape}")
    return images


def _decoded_on_cpu(preprocessor: DecodesOnDevice, data: torch.Tensor) -> torch.Tensor | ItemError:
    scratch = torch.empty(preprocessor.output_shape, dtype=torch.uint8)
    try:
        preprocessor(data.numpy().tobytes(), scratch)
    except Exception as error:
        return ItemError.from_exception(error, PREPROCESS_STAGE)
    return scratch


def preprocess_setup(
    reference: str,
    open_fetch: Callable[[], Callable[[str], bytes]] | None = None,
    *,
    defer_to_device: bool = False,
) -> StageFunction:
    """Runs once in each preprocessing process: load the preprocessor and decode its
    samples, which are its probe; with `open_fetch`, make the process's own fetcher of
    an input's bytes by its URI, which prepares each item. Both work on the payload of
    the item's `WithParams`. With `defer_to_device`, the inputs the device decodes are
    left undecoded in their slots (`decode_or_defer`)."""
    torch.set_num_threads(1)
    preprocessor = load_preprocessor(reference)
    fetch = on_payload(open_fetch()) if open_fetch is not None else None
    decode = (
        functools.partial(decode_or_defer, load_device_decoder(reference))
        if defer_to_device
        else preprocessor
    )
    preprocess = on_payload(decode)
    samples = tuple(getattr(preprocessor, "samples", ()))
    if not samples:
        return StageFunction(preprocess, prepare=fetch)
    scratch = torch.empty(preprocessor.output_shape, dtype=torch.uint8)

    def probe() -> None:
        for sample in samples:
            preprocessor(sample, scratch)

    try:
        probe()
    except Exception as error:
        raise PluginError(
            f"{reference} cannot decode its own samples ({type(error).__name__}: {error})"
        ) from error
    return StageFunction(preprocess, probe, prepare=fetch)
