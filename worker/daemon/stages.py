"""The pipeline's shape: which stages, in which order, on which processes and arenas.

The one place that knows it. A new stage is a `ThreadStage` or `ProcessStage` added to
`build_pipeline`'s list, with its set-up function (run once in each of its processes) in
`worker.plugins.setups` if it loads the user's code; the engine runs whatever list it is
given, and the jobs' loops see only the pipeline's ends.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from worker.datasets.texts import TextInput, text_of
from worker.engine import (
    PIPELINED_BATCHES,
    Pipeline,
    PrepareStep,
    ProcessStage,
    StageObserver,
    TensorArena,
    ThreadStage,
    TokenBudget,
    bisection_sizes,
    bucket_lengths,
)
from worker.errors import ObjectTooLarge, TransientError
from worker.plugins import TokenSlots, on_payload, tokens_of
from worker.plugins.loading import (
    decodes_on_device,
    inference_devices,
    load_fan_out,
    load_preprocessor,
    token_slots,
)
from worker.plugins.spec import FAN_OUT_STAGE, ModelStep, PipelineSpec
from worker.ports import BlobStore, LocalPart, ObjectReader, RemoteReader, S3Location

if TYPE_CHECKING:  # imported by the stages' fork server, which has no settings to read
    from worker.settings import Settings

log = structlog.get_logger()


# Reads hedged at once, at most, a share of those in flight: one in twenty is hedged.
HEDGED_SHARE = 4

# The preprocessing processes run at a lower priority than the daemon and the models'
# processes: they are many, and with the host's cores all busy with them, the model's
# process, which has the device wait while it waits for a core, came last.
PREPROCESS_NICENESS = 10

# A preprocessing request holds what a process gets through in about this long, from a
# request's arrival to its answer, up to a model's batch: a tar's members, read from this
# machine's disk, thousands a second; objects fetched from S3 or JPEGs decoded on the
# CPU, a few at a time. It is about what an urgent item waits in a process at most.
PREPROCESS_REQUEST_S = 0.04
# The stage processes' set-ups are this module's and those it imports (pickled to each
# child), and `worker.plugins.setups` (named, `set_up`): the fork server imports them
# once, where each child took a second of CPU to.
SET_UP_MODULES = (__name__, "worker.plugins.setups")


def build_pipeline(
    spec: PipelineSpec, settings: Settings, blobs: BlobStore, observer: StageObserver
) -> Pipeline:
    """fetch and preprocess (processes) -> a model (a process per device), or a model ->
    a fan-out (processes) -> a model; fetch on threads here where the store cannot be
    read from another process. A text preprocessor's slots hold token ids (`tokens`),
    for one model."""
    decode_ceiling = settings.preprocess_workers_ceiling
    preprocessor = load_preprocessor(spec.preprocess)
    tokens = token_slots(preprocessor)
    images = preprocessor.output_shape
    first, *rest = spec.models
    names = spec.model_stage_names()
    fan_out = spec.fan_out
    if tokens and fan_out:
        raise ValueError(f"{spec.preprocess} reads texts: a fan-out cuts images, not texts")
    budget = _token_budget(settings, tokens, images[-1])
    # Enough decoded images, for each process of the model that reads them, for the
    # batch being inferred and the next two being assembled, and two in the hands of
    # each worker that writes or (a fan-out) still reads them; for the inputs the
    # preprocessing processes hold, what they fetch at once and as many again, waiting
    # for a thread (larger requests, of cheap items, take slots as they come free); and
    # a batch that background work leaves to urgent items (`Pipeline.background_room`).
    image_arena = TensorArena(
        images,
        3 * first.batch_size * len(_devices(first, settings))
        + 2 * (decode_ceiling + (fan_out.workers if fan_out else 0))
        + 2 * settings.fetch_concurrency
        + first.batch_size
        + (budget.window(first.batch_size) if budget else 0),
        dtype=str(tokens.dtype).removeprefix("torch.") if tokens else "uint8",
    )
    reader = _remote_reader(settings, blobs)
    log.info("inputs_fetched_in", where="preprocess" if reader else "threads")
    on_device, why = decodes_on_device(
        settings.decode, spec.preprocess, _devices(first, settings), chained=bool(fan_out)
    )
    log.info("inputs_decoded_in", where="inference" if on_device else "preprocess", why=why)
    per_process = settings.fetched_per_process
    max_input_bytes = settings.max_input_bytes
    stages: list[ThreadStage | ProcessStage] = []
    if reader is None:
        fetch = on_payload(fetcher(blobs.get, max_input_bytes))
        stages.append(
            ThreadStage(
                "fetch",
                lambda values: [fetch(value) for value in values],
                workers=settings.fetch_concurrency,
            )
        )
    stages += [
        ProcessStage(
            "preprocess",
            functools.partial(
                set_up,
                "preprocess_setup",
                spec.preprocess,
                functools.partial(open_fetch, reader.open, per_process, max_input_bytes)
                if reader
                else None,
                local=on_this_machine,
                defer_to_device=on_device,
            ),
            workers=settings.preprocess_workers,
            max_workers=decode_ceiling,
            batch_size=per_process,
            request_s=PREPROCESS_REQUEST_S,
            max_request_items=first.batch_size,
            niceness=PREPROCESS_NICENESS,
            timeout_s=settings.preprocess_timeout_seconds,
            setup_timeout_s=settings.setup_timeout_seconds,
            writes=image_arena,
            # A read slower than the store's 95th percentile is made again (`TailLatency`).
            prepare=PrepareStep("fetch", reader.longest_s, hedges=hedged_reads(per_process))
            if reader
            else None,
            imports=(*SET_UP_MODULES, *(reader.imports if reader else ())),
        ),
        _model_stage(
            names[0],
            first,
            settings,
            images,
            image_arena,
            keeps_slots=bool(fan_out),
            postprocess=None if fan_out else spec.postprocess,
            decoder=spec.preprocess if on_device else None,
            tokens=tokens,
            budget=budget,
        ),
    ]
    if fan_out:
        (second,) = rest
        parts = load_fan_out(fan_out.fan_out).output_shape
        part_arena = TensorArena(
            parts,
            3 * second.batch_size * len(_devices(second, settings))
            + PIPELINED_BATCHES * fan_out.workers * fan_out.max_parts,
        )
        stages += [
            ProcessStage(
                FAN_OUT_STAGE,
                functools.partial(set_up, "fan_out_setup", fan_out.fan_out),
                workers=fan_out.workers,
                timeout_s=settings.preprocess_timeout_seconds,
                setup_timeout_s=settings.setup_timeout_seconds,
                reads=image_arena,
                writes=part_arena,
                max_parts=fan_out.max_parts,
                imports=SET_UP_MODULES,
            ),
            _model_stage(names[1], second, settings, parts, part_arena),
        ]
    return Pipeline(stages, observer=observer)


def set_up(name: str, *args: Any, **kwargs: Any) -> Any:
    """Runs the set-up `name` of `worker.plugins.setups` (`preprocess_setup`, say) in a
    stage's process. The daemon's process names it, and never imports it: the set-ups
    import torch, which only the stages' processes need (docs/performance.md)."""
    from worker.plugins import setups

    return getattr(setups, name)(*args, **kwargs)


def _remote_reader(settings: Settings, blobs: BlobStore) -> RemoteReader | None:
    """How the preprocessing processes read inputs (`Settings.fetch_in`), or None if
    they are fetched on threads here."""
    if settings.fetch_in == "threads":
        return None
    reader = blobs.remote_reader()
    if reader is None and settings.fetch_in == "preprocess":
        raise ValueError(
            "fetch_in=preprocess: this blob store lives only in this process, so the "
            "preprocessing processes cannot read it; use fetch_in=threads (or auto)"
        )
    return reader


def open_fetch(
    open_reader: Callable[[int], ObjectReader], connections: int, max_bytes: int
) -> Callable[[str | LocalPart], bytes | str]:
    """A preprocessing process's fetcher, with a reader of its own for `connections`
    reads at once (and those the hedges of the slowest add, `hedged_reads`)."""
    return fetcher(open_reader(connections + hedged_reads(connections)), max_bytes)


def hedged_reads(connections: int) -> int:
    """Reads hedged at once, at most, beside `connections` (about one in twenty is: a
    store slow for every read is not asked for each twice)."""
    return max(2, connections // HEDGED_SHARE)


def on_this_machine(source: str | LocalPart) -> bool:
    """Whether `fetcher` has the input here: a text, or a member of a tar copied here
    (the copy still there), not an object in S3."""
    if isinstance(source, TextInput):
        return True
    return isinstance(source, LocalPart) and os.path.exists(source.path)


def fetcher(get: ObjectReader, max_bytes: int) -> Callable[[str | LocalPart], bytes | str]:
    """The fetcher of an input's bytes: an object's by its URI, or a member's of a tar
    copied here; an input over `max_bytes` is not read (`ObjectTooLarge`). A text input
    is its text, with no read (`NotText` if it has none)."""

    def fetch(source: str | LocalPart) -> bytes | str:
        if isinstance(source, TextInput):
            return text_of(source)
        if isinstance(source, LocalPart):
            return _read_part(source, get, max_bytes)
        return get(S3Location.parse(source), max_bytes)

    return fetch


def _read_part(part: LocalPart, get: ObjectReader, max_bytes: int) -> bytes:
    """A tar member's bytes from the tar's local copy; once that is gone with its job
    (a known-good input read again, `worker.engine.child_main`), from the tar in S3."""
    if part.size > max_bytes:
        raise ObjectTooLarge(part.size, max_bytes)
    try:
        with open(part.path, "rb") as file:
            data = os.pread(file.fileno(), part.size, part.offset)
    except FileNotFoundError:
        data = get(S3Location.parse(part.tar), max_bytes, (part.offset, part.size))
    except OSError as error:  # this machine's disk: never the input's fault
        raise TransientError(f"the local copy of its tar cannot be read: {error}") from error
    if len(data) != part.size:
        raise TransientError(f"{part.size} bytes asked of {part.tar}, {len(data)} read")
    return data


def _model_stage(
    name: str,
    step: ModelStep,
    settings: Settings,
    item_shape: Sequence[int],
    arena: TensorArena,
    *,
    keeps_slots: bool = False,
    postprocess: str | None = None,
    decoder: str | None = None,
    tokens: TokenSlots | None = None,
    budget: TokenBudget | None = None,
) -> ProcessStage:
    """One model's stage: a process per device, each loading and warming up the model
    (and the postprocessor, if the model's outputs are the results; and the
    preprocessor, if it decodes inputs on the device; `tokens` if it reads texts, in
    batches sized in tokens with a `budget`)."""
    return ProcessStage(
        name,
        [
            functools.partial(
                set_up,
                "inference_setup",
                step.model,
                device,
                tuple(item_shape),
                batch_size=step.batch_size,
                precision=step.precision or settings.precision,
                channels_last=settings.channels_last
                if step.channels_last is None
                else step.channels_last,
                model_name=step.name,
                model_version=step.version,
                postprocess=postprocess,
                decoder=decoder,
                compile=settings.compile,
                tokens=tokens,
                budget=budget,
            )
            for device in _devices(step, settings)
        ],
        batch_size=step.batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
        timeout_s=settings.inference_timeout_seconds,
        # The warm-up runs a batch at each size bisection falls back to.
        setup_timeout_s=settings.setup_timeout_seconds
        + len(bisection_sizes(step.batch_size)) * settings.inference_timeout_seconds,
        reads=arena,
        keeps_slots=keeps_slots,
        token_budget=budget,
        imports=SET_UP_MODULES,
    )


def _token_budget(
    settings: Settings, tokens: TokenSlots | None, longest: int
) -> TokenBudget | None:
    """Batches of texts sized in tokens (`--max-batch-tokens`), or None: by items."""
    if tokens is None or not settings.max_batch_tokens:
        return None
    return TokenBudget(settings.max_batch_tokens, bucket_lengths(longest), tokens_of)


def _devices(step: ModelStep, settings: Settings) -> list[str]:
    return inference_devices(step.device or settings.device)
