"""What each stage's process runs once at its start (a stage function's set-up): load
the plug-in, check it answers its probe, warm it up."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.engine import StageFunction, bisection_sizes
from worker.plugins import InferenceFn, PluginError, WithParams, on_payload
from worker.plugins.device_decoding import decode_or_defer, device_decoder
from worker.plugins.encoding import Encoded, encoded_fields, postprocessed, probed_columns
from worker.plugins.identity import identify
from worker.plugins.loading import (
    load_device_decoder,
    load_fan_out,
    load_model,
    load_postprocessor,
    load_preprocessor,
    resolve_device,
)


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
    decode = device_decoder(decoder, device) if decoder else None
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
    about: dict[str, Any] = {"model": identity.as_dict(), "warm_up": warm_up}
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
    # Each input's array fields must be these, of these shapes and dtypes; its other
    # fields' types are those of these (Parquet results' columns, `worker.jobs.tables`).
    about["fields"], about["arrays"] = probed_columns(probed)
    return StageFunction(
        infer, probe, about, finish=postprocess_all, finish_probe=postprocess_probe
    )


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


def preprocess_setup(
    reference: str,
    open_fetch: Callable[[], Callable[[Any], bytes]] | None = None,
    *,
    local: Callable[[Any], bool] | None = None,
    defer_to_device: bool = False,
) -> StageFunction:
    """Runs once in each preprocessing process: load the preprocessor and decode its
    samples, which are its probe; with `open_fetch`, make the process's own fetcher of
    an input's bytes by its URI, which prepares each item (those that `local` says are
    on this machine's disk as their request comes in). They work on the payload of the
    item's `WithParams`. With `defer_to_device`, the inputs the device decodes are
    left undecoded in their slots (`decode_or_defer`)."""
    torch.set_num_threads(1)
    preprocessor = load_preprocessor(reference)
    fetch = on_payload(open_fetch()) if open_fetch is not None else None
    at_hand = functools.partial(_payload_is, local) if local is not None else None
    decode = (
        functools.partial(decode_or_defer, load_device_decoder(reference))
        if defer_to_device
        else preprocessor
    )
    preprocess = on_payload(decode)
    samples = tuple(getattr(preprocessor, "samples", ()))
    if not samples:
        return StageFunction(preprocess, prepare=fetch, at_hand=at_hand)
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
    return StageFunction(preprocess, probe, prepare=fetch, at_hand=at_hand)


def _payload_is(test: Callable[[Any], bool], value: WithParams) -> bool:
    return test(value[0])
