"""What each stage's process runs once at its start (a stage function's set-up): load
the plug-in, check it answers its probe, warm it up."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from worker.engine import StageFunction, TokenBudget, bisection_sizes, bucket_of
from worker.plugins import (
    InferenceFn,
    PluginError,
    Preprocessor,
    TextPreprocessor,
    TokenSlots,
    WithParams,
    on_payload,
    tokens_of,
)
from worker.plugins.compiled import CompiledModel, CompileReport
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
from worker.plugins.staging import PendingRows, Staging, resolved


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
    compile: bool = False,
    tokens: TokenSlots | None = None,
    budget: TokenBudget | None = None,
) -> StageFunction:
    """Runs once in the inference process: load the model, check that it answers a
    batch of zeros, warm it up (with `compile`, compiled at every warm-up size first:
    `CompiledModel`), and return the batch function with that check as its probe and
    the model's identity and warm-up as what it reports. With `decoder` (the
    preprocessor), the inputs left undecoded are decoded on the device first
    (`decode_undecoded`). With `postprocess`, each output is postprocessed and encoded
    here, where it already is (`postprocessed`), while the next batch runs (the stage's
    `finish`, which waits for the batch's outputs): the batch function returns once
    the device has the batch's work, so the next batch is brought in while the model
    runs this one (`Staging`). Only the encoded fields and the arrays cross to the
    daemon. With `tokens`, the slots hold a text preprocessor's token ids and mask: the
    model is called with the two, and each result carries the preprocessor's notes;
    with a `budget` too (batches sized in tokens), each batch cut to the shortest of
    its lengths that holds its longest text (`cut_to_length`), each length tried at
    start, and compiled at the sizes a batch of that length may have."""
    device = resolve_device(device_name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the streams and events of `Staging` are on it
    decode = device_decoder(decoder, device) if decoder else None
    model = load_model(model_reference, device)
    identity = identify(model_reference, model, model_name, model_version)
    if channels_last:
        # Module.to takes memory_format (torch documents it); its type stubs omit it.
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    dtype = tokens.dtype if tokens else torch.uint8
    lengths = budget.lengths if budget else ()
    infer = _Inference(
        _forward(model, device, precision == "bfloat16", channels_last, tokens=bool(tokens)),
        Staging(device, item_shape, decode, dtype=dtype),
        lengths,
    )
    zeros = torch.zeros((1, *item_shape), dtype=dtype)

    def probe() -> None:
        infer.now(zeros, [None])

    _try_lengths(infer, zeros, lengths)
    try:
        (answer_to_zeros,) = infer.now(zeros, [None])
    except Exception as error:
        raise PluginError(
            f"the model fails on a batch of zeros ({type(error).__name__}: {error}); the "
            "daemon runs one at start, and again whenever a whole batch fails, to tell a "
            "broken worker from bad inputs"
        ) from error
    sizes = bisection_sizes(batch_size)
    shapes = _compiled_shapes(sizes, budget)
    compiled = infer.compile(device, item_shape, shapes, dtype) if compile else None
    warm_up = _warm_up(infer.now, item_shape, sizes, compiled, dtype)
    about: dict[str, Any] = {"model": identity.as_dict(), "warm_up": warm_up}
    if postprocess is None:
        return StageFunction(infer.now, probe, about)
    notes = tokens.notes if tokens else None
    finish, finish_probe, probed = _finishing(postprocess, answer_to_zeros, device, notes)
    # Each input's array fields must be these, of these shapes and dtypes; its other
    # fields' types are those of these (Parquet results' columns, `worker.datasets.tables`).
    about["fields"], about["arrays"] = probed_columns(probed)
    return StageFunction(infer.ahead, probe, about, finish=finish, finish_probe=finish_probe)


class _Inference:
    """The inference process's batch function: the batch in through `staging`, the
    model (`forward`, compiled once `compile` has run), its outputs out."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        staging: Staging,
        lengths: tuple[int, ...] = (),
    ):
        self.forward = forward
        self.staging = staging
        self.lengths = lengths

    def __call__(self, batch: torch.Tensor, values: Sequence[Any]) -> PendingRows:
        with torch.inference_mode():
            length = cut_to_length(values, self.lengths) if self.lengths else None
            staged = self.staging.inputs(batch, values)
            inputs = staged.inputs if length is None else staged.inputs[..., :length]
            return self.staging.outputs(self.forward(inputs), staged)

    def now(self, batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        """The batch's rows, waited for."""
        return self(batch, values).rows()

    def ahead(self, batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        """The batch's rows to be waited for by the finish step (`AwaitedRow`)."""
        return self(batch, values).handles()

    def compile(
        self,
        device: torch.device,
        item_shape: tuple[int, ...],
        sizes: list[int] | dict[int, list[int]],
        dtype: torch.dtype,
    ) -> CompileReport:
        """From now on, the model compiled at `sizes`, or at each length's
        (`CompiledModel`)."""
        compiled = CompiledModel(self.forward, device, item_shape, sizes, dtype)
        try:
            report = compiled.compile()
        except Exception as error:
            raise PluginError(
                f"the model does not compile ({type(error).__name__}: {str(error)[:2000]}); "
                "run it without --compile"
            ) from error
        self.forward = compiled
        return report


def _compiled_shapes(
    sizes: list[int], budget: TokenBudget | None
) -> list[int] | dict[int, list[int]]:
    """The sizes the model is compiled at: those its warm-up runs, or, for batches sized
    in tokens, at each length those a batch of that length may have (its rows within
    the budget, and the sizes error bisection falls back to from there)."""
    if budget is None:
        return sizes
    return {length: bisection_sizes(budget.rows(length, sizes[0])) for length in budget.lengths}


def cut_to_length(values: Sequence[WithParams | None], lengths: Sequence[int]) -> int:
    """The length a batch of tokenized texts is cut to: the shortest of `lengths` that
    holds each text's tokens (`tokens_of`; none for the probe's and warm-up's zeros).
    Read from the values, not the mask: a reduction over the batch took 20-50 ms of a
    loaded host's CPU with torch's threads (0.2 ms on one)."""
    tokens = (tokens_of(value) for value in values if value is not None)
    return bucket_of(max(tokens, default=0), lengths)


def _marked_up_to(mask: torch.Tensor) -> int:
    """The tokens of a mask: up to its last marked one (none: 0)."""
    marked = np.flatnonzero(mask.numpy())  # numpy's: a few µs a text less than torch's
    return int(marked[-1]) + 1 if len(marked) else 0


def _try_lengths(infer: _Inference, zeros: torch.Tensor, lengths: Sequence[int]) -> None:
    """Run the model once at each length a batch may be cut to, longest first: a model
    that takes only its longest sequence (exported at that shape) stops the start, not
    a job. One that fails at the longest too is left to the probe of zeros to name."""
    for length in sorted(lengths, reverse=True):
        try:
            infer.now(zeros, [((None, length), {})])  # a text of that many tokens
        except Exception as error:
            if length == max(lengths):
                return
            raise PluginError(
                f"the model fails on texts cut to {length} tokens ({type(error).__name__}: "
                f"{error}); run it without --max-batch-tokens, which cuts batches to "
                f"the lengths {list(lengths)}"
            ) from error


def _finishing(
    postprocess: str, answer_to_zeros: Any, device: torch.device, notes: dict[str, Any] | None
) -> tuple[Callable[[list[Any], list[Any]], list[Any]], Callable[[], Encoded], Encoded]:
    """The finish step that postprocesses a batch's outputs once they are there (each
    with its text preprocessor's `notes`, what it returned for the item, where the
    inputs are texts), its probe, and what the postprocessor made of the model's answer
    to zeros; a postprocessor that fails on that answer stops the start."""
    postprocessor = load_postprocessor(postprocess)

    def postprocess_all(outputs: list[Any], values: list[WithParams]) -> list[Any]:
        return [
            postprocessed(postprocessor, output, params, payload[0] if notes else None)
            for output, (payload, params) in zip(resolved(outputs), values, strict=True)
        ]

    def finish_probe() -> Encoded:
        # An error the device met after the batch function returned (a sticky CUDA
        # error) shows here, as the worker's, not in the items' outputs alone.
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return encoded_fields(postprocessor, answer_to_zeros, {}, notes)

    try:
        probed = encoded_fields(postprocessor, answer_to_zeros, {}, notes)
    except Exception as error:
        raise PluginError(
            f"{postprocess} fails on the model's answer to a batch of zeros with no params "
            f"({type(error).__name__}: {error}); the daemon runs it whenever it fails a "
            "whole batch, to tell a broken worker from bad inputs"
        ) from error
    return postprocess_all, finish_probe, probed


def _forward(
    model: torch.nn.Module,
    device: torch.device,
    bfloat16: bool,
    channels_last: bool,
    *,
    tokens: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model on a batch on its device (uint8 images, or with `tokens` the ids and
    masks it is called with apart), as `inference_setup` was asked to run it: what is
    compiled and captured with `--compile`."""

    def forward(batch: torch.Tensor) -> torch.Tensor:
        if channels_last and batch.dim() == 4:  # the only rank it is defined for
            batch = batch.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, torch.bfloat16, enabled=bfloat16):
            outputs: torch.Tensor = model(batch[:, 0], batch[:, 1]) if tokens else model(batch)
        return outputs.float() if outputs.dtype == torch.bfloat16 else outputs  # numpy has none

    return forward


def _warm_up(
    infer: InferenceFn,
    item_shape: tuple[int, ...],
    sizes: list[int],
    compiled: CompileReport | None = None,
    dtype: torch.dtype = torch.uint8,
) -> dict[str, Any]:
    """Run a batch of zeros at each size the stage will meet first: the batch size, and
    the sizes that error bisection and OOM recovery fall back to. The first real jobs
    then do not pay for lazy CUDA init, cuDNN's autotuning or a compile step (with
    `--compile`, done before: its seconds are `compile_s`, part of `seconds`). A size
    that does not fit in memory is noted, not fatal: the stage bisects such batches and
    lowers its batch size, as it would for any batch that runs out of memory."""
    started = time.perf_counter()
    out_of_memory = list(compiled.out_of_memory) if compiled else []
    for size in sizes:
        batch = torch.zeros((size, *item_shape), dtype=dtype)
        try:
            infer(batch, [None] * size)
        except torch.OutOfMemoryError:
            if size not in out_of_memory:
                out_of_memory.append(size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception as error:
            raise PluginError(
                f"the model fails on a batch of {size} zeros ({type(error).__name__}: "
                f"{error}); lower the batch size to what it takes (--batch-size, or the "
                "step's batch_size in the pipeline spec)"
            ) from error
    compile_s = compiled.seconds if compiled else 0.0
    return {
        "batch_sizes": sizes,
        "out_of_memory": sorted(out_of_memory, reverse=True),
        "seconds": round(time.perf_counter() - started + compile_s, 3),
        "compiled": compiled is not None,
        "compile_s": compile_s,
    }


def fan_out_setup(reference: str) -> StageFunction:
    """Runs once in each fan-out process."""
    torch.set_num_threads(1)
    return StageFunction(load_fan_out(reference))


def preprocess_setup(
    reference: str,
    open_fetch: Callable[[], Callable[[Any], bytes | str]] | None = None,
    *,
    local: Callable[[Any], bool] | None = None,
    defer_to_device: bool = False,
) -> StageFunction:
    """Runs once in each preprocessing process: load the preprocessor and decode its
    samples, which are its probe; with `open_fetch`, make the process's own fetcher of
    an input's bytes by its URI (or a text input's text), which prepares each item
    (those that `local` says are at hand as their request comes in). They work on the
    payload of the item's `WithParams`; a `TextPreprocessor` is given the params too.
    With `defer_to_device`, the inputs the device decodes are left undecoded in their
    slots (`decode_or_defer`)."""
    torch.set_num_threads(1)
    preprocessor = load_preprocessor(reference)
    fetch = on_payload(open_fetch()) if open_fetch is not None else None
    at_hand = functools.partial(_payload_is, local) if local is not None else None
    if isinstance(preprocessor, TextPreprocessor):
        preprocess, probe = _tokenizing(preprocessor)
    else:
        decode = (
            functools.partial(decode_or_defer, load_device_decoder(reference))
            if defer_to_device
            else preprocessor
        )
        preprocess, probe = on_payload(decode), _decoding_samples(preprocessor)
    if probe is None:
        return StageFunction(preprocess, prepare=fetch, at_hand=at_hand)
    try:
        probe()
    except Exception as error:
        raise PluginError(
            f"{reference} cannot decode its own samples ({type(error).__name__}: {error})"
        ) from error
    return StageFunction(preprocess, probe, prepare=fetch, at_hand=at_hand)


def _decoding_samples(preprocessor: Preprocessor) -> Callable[[], None] | None:
    """The probe that decodes the preprocessor's samples; None if it has none."""
    samples = tuple(getattr(preprocessor, "samples", ()))
    if not samples:
        return None
    scratch = torch.empty(preprocessor.output_shape, dtype=torch.uint8)

    def probe() -> None:
        for sample in samples:
            preprocessor(sample, scratch)

    return probe


def _tokenizing(
    preprocessor: TextPreprocessor,
) -> tuple[Callable[[WithParams, torch.Tensor], WithParams], Callable[[], None] | None]:
    """A text preprocessor's stage function, on an item's text and its job's params
    (its notes on the item go on as the item's payload, to its result, with the text's
    tokens: `tokens_of`), and the probe that tokenizes its samples, if it has them."""

    def tokenize(value: WithParams, out: torch.Tensor) -> WithParams:
        text, params = value
        notes = preprocessor(text, out, params)
        return (notes, _marked_up_to(out[1])), params

    samples = tuple(getattr(preprocessor, "samples", ()))
    if not samples:
        return tokenize, None
    scratch = torch.empty(preprocessor.output_shape, dtype=preprocessor.output_dtype)

    def probe() -> None:
        for sample in samples:
            preprocessor(sample, scratch, {})

    return tokenize, probe


def _payload_is(test: Callable[[Any], bool], value: WithParams) -> bool:
    return test(value[0])
