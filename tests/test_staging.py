"""A batch's way onto the model's device and its answers' way back
(`worker.plugins.staging`).

On the CPU every step runs at once, in order: what is checked here is what crosses in
how many copies, and that the stage function returns before its outputs are waited for
without a later batch changing them. On a GPU (`make test-gpu`) the same runs on
streams, and the next batch is brought in and decoded while the model runs the one
before it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stages.preprocess import default_preprocessor
from stages.synthetic import samples
from tests.support.device_models import row_means, slow_on_device
from tests.support.faults import standin_device_decoder
from tests.support.markers import needs_gpu
from worker.plugins import Undecoded
from worker.plugins.device_decoding import DecodedRows, decode_or_defer, device_decoder
from worker.plugins.setups import inference_setup
from worker.plugins.staging import AwaitedRow, Staging, decoded_span, resolved

SHAPE = default_preprocessor.output_shape
ROW_MEANS = "tests.support.device_models:row_means"
STANDIN = "tests.support.faults:standin_device_decoder"
CPU = torch.device("cpu")
ROW_FIELDS = "tests.support.device_models:row_fields"
DEFAULT = "stages.preprocess:default_preprocessor"


class _CountedOps(TorchDispatchMode):
    """Counts the aten operations run meanwhile, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_ops() -> Iterator[Counter[str]]:
    with _CountedOps() as mode:
        yield mode.counts


def _undecoded(length: int) -> tuple[Undecoded, dict[str, Any]]:
    return Undecoded(length), {}


def test_the_rows_decoded_on_the_cpu_cross_to_the_device_as_one_span() -> None:
    """A batch decoded on the CPU crosses whole; one the device decodes whole crosses
    not at all; a mixed one as the run from its first decoded row to its last."""
    decoded: tuple[Any, dict[str, Any]] = ({"width": 4}, {})
    assert decoded_span([decoded] * 4) == slice(0, 4)
    assert decoded_span([None] * 3) == slice(0, 3)  # the warm-up's zeros
    assert decoded_span([_undecoded(9)] * 4) is None
    mixed = [_undecoded(9), decoded, _undecoded(9), decoded, _undecoded(9)]
    assert decoded_span(mixed) == slice(1, 4)


@pytest.mark.parametrize(
    ("positions", "operation"), [([1, 2, 3], "copy_"), ([0, 2, 5], "index_copy_")]
)
def test_decoded_images_are_written_into_the_batch_in_one_copy(
    positions: list[int], operation: str
) -> None:
    """Images decoded on the device go into their rows in one copy (rows that follow
    one another) or one indexed copy, never one copy a row; the other rows are left."""
    batch = torch.zeros((6, 3, 4, 4), dtype=torch.uint8)
    images = torch.stack([torch.full((3, 4, 4), 10 + p, dtype=torch.uint8) for p in positions])
    with counted_ops() as counts:
        DecodedRows(positions, images, {}).write(batch)
    assert counts[operation] == 1
    assert counts["copy_"] + counts["index_copy_"] == 1
    assert [int(row[0, 0, 0]) for row in batch] == [
        10 + p if p in positions else 0 for p in range(6)
    ]


def test_a_batch_run_before_the_one_before_it_is_finished_keeps_its_own_answers() -> None:
    """With a postprocessor, the batch function returns rows still to be waited for
    (the finish step waits, on its own thread, while the next batch runs); a batch
    gathered into the same buffer and run before the first is finished leaves the
    first's answers as they were, though the model answers with a view of its input."""
    stage_fn = inference_setup(
        "tests.support.stagefns:echo_model",
        "cpu",
        SHAPE,
        batch_size=4,
        postprocess="stages.postprocess:embedding",
    )
    assert stage_fn.finish is not None
    gathered = torch.full((4, *SHAPE), 1, dtype=torch.uint8)  # the reused buffer
    values: list[Any] = [(None, {})] * 4
    first = stage_fn.run(gathered, values)
    assert all(isinstance(row, AwaitedRow) for row in first)
    gathered.fill_(2)
    second = stage_fn.run(gathered, values)
    assert [int(row[0]) for row in resolved(first)] == [1] * 4
    assert [int(row[0]) for row in resolved(second)] == [2] * 4
    assert len(stage_fn.finish(first, values)) == 4


def test_without_a_finish_step_the_batch_function_gives_its_rows() -> None:
    """With no postprocessor (a chain's first model, the bench's model alone) nothing
    waits for the rows later: the batch function gives them, as numpy rows."""
    infer = inference_setup(ROW_MEANS, "cpu", SHAPE, batch_size=2).run
    rows = infer(torch.full((2, *SHAPE), 3, dtype=torch.uint8), [None] * 2)
    assert [row.tolist() for row in rows] == [[3.0, 2.0], [3.0, 2.0]]


class _Event:
    def __init__(self, label: str, log: list[str]):
        self.label, self._log = label, log

    def synchronize(self) -> None:
        self._log.append(f"host waits {self.label}")

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return self.label


class RecordingStreams:
    """`Streams` on the CPU: the copies run at once, and `log` says, in order, which
    stream (or the host) waited for which event, and where each event was recorded."""

    copying, decoding = "copy", "decode"

    def __init__(self) -> None:
        self.log: list[str] = []
        self._recorded: Counter[str] = Counter()

    def compute(self) -> str:
        return "compute"

    @contextmanager
    def on(self, stream: str) -> Iterator[None]:
        yield

    def recorded(self, stream: str) -> _Event:
        self._recorded[stream] += 1
        event = _Event(f"{stream}{self._recorded[stream]}", self.log)
        self.log.append(f"{stream} records {event}")
        return event

    def wait(self, stream: str, event: _Event) -> None:
        self.log.append(f"{stream} waits {event}")

    def synchronize(self) -> None:
        self.log.append("host waits all")

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)


def test_each_device_batch_is_written_once_the_model_has_read_it_and_never_waits_for_more() -> None:
    """The GPU's protocol, with streams that record it: a batch of JPEGs and PNGs is
    copied (its PNGs) and decoded (its JPEGs) into a device batch on streams of their
    own; the decoder writes after the copy; the model waits for both; a third batch
    reuses the first's device batch and waits for the model's event of the first batch
    only, not of the second, which may still run; the host waits for the copy out of
    the gathered batch, and for the model's outputs only when asked for them."""
    streams = RecordingStreams()
    staging = Staging(CPU, SHAPE, device_decoder(STANDIN, CPU), streams)
    model = row_means()
    answers = []
    for number in range(3):
        batch, values = _mixed_batch(seed=number)
        staged = staging.inputs(batch, values)
        streams.log.append(f"model runs batch {number + 1}")
        answers.append(staging.outputs(model(staged.inputs), staged))
    assert streams.log == [
        "host waits all",  # the device batches made, once
        *["copy records copy1", "decode waits copy1", "decode records decode1"],
        *["compute waits copy1", "compute waits decode1", "compute records compute1"],
        "host waits copy1",
        "model runs batch 1",
        "compute records compute2",
        *["copy records copy2", "decode waits copy2", "decode records decode2"],
        *["compute waits copy2", "compute waits decode2", "compute records compute3"],
        "host waits copy2",
        "model runs batch 2",
        "compute records compute4",
        *["copy waits compute2", "copy records copy3"],
        *["decode waits compute2", "decode waits copy3", "decode records decode3"],
        *["compute waits copy3", "compute waits decode3", "compute records compute5"],
        "host waits copy3",
        "model runs batch 3",
        "compute records compute6",
    ]
    for number, pending in enumerate(answers):
        batch, values = _mixed_batch(seed=number)
        expected = row_means()(_decoded_on_cpu(batch, values))
        assert np.allclose(np.stack(pending.rows()), expected.numpy(), atol=1)
    assert streams.log[-3:] == ["host waits compute2", "host waits compute4", "host waits compute6"]


def _jpeg_batch(count: int, *, pinned: bool = False) -> tuple[torch.Tensor, list[Any]]:
    """`count` JPEGs left undecoded in the rows of a batch, as `--decode gpu` leaves them."""
    jpegs = [data for _, data in samples(count * 3, 7) if data[:2] == b"\xff\xd8"][:count]
    batch = torch.zeros((count, *SHAPE), dtype=torch.uint8)
    values: list[Any] = [
        (decode_or_defer(default_preprocessor, d, r), {}) for d, r in zip(jpegs, batch, strict=True)
    ]
    assert all(isinstance(payload, Undecoded) for payload, _ in values)
    return (batch.pin_memory() if pinned else batch), values


def _mixed_batch(seed: int) -> tuple[torch.Tensor, list[Any]]:
    """Two JPEGs left undecoded and two PNGs decoded, in the rows of a gathered batch."""
    pairs = list(samples(40, seed))
    jpegs = [data for _, data in pairs if data[:2] == b"\xff\xd8"][:2]
    pngs = [data for _, data in pairs if data[:4] == b"\x89PNG"][:2]
    batch = torch.zeros((4, *SHAPE), dtype=torch.uint8)
    inputs = [jpegs[0], pngs[0], jpegs[1], pngs[1]]
    values: list[Any] = [
        (decode_or_defer(standin_device_decoder, data, row), {})
        for data, row in zip(inputs, batch, strict=True)
    ]
    return batch, values


def _decoded_on_cpu(batch: torch.Tensor, values: list[Any]) -> torch.Tensor:
    """The batch with its undecoded rows decoded by Pillow, as the CPU would."""
    decoded = batch.clone()
    for position, (payload, _) in enumerate(values):
        if isinstance(payload, Undecoded):
            data = batch[position].view(-1)[: payload.length].numpy().tobytes()
            default_preprocessor(data, decoded[position])
    return decoded


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_the_next_batch_is_decoded_while_the_model_runs_the_one_before() -> None:
    """The model keeps the GPU busy for about half a second a batch: the stage
    function returns within a fraction of that, and the next batch's JPEGs are decoded
    by nvJPEG and in their device batch while the model still runs the first; each
    batch's answers are then its own."""
    device = torch.device("cuda")
    staging = Staging(device, SHAPE, device_decoder(DEFAULT, device))
    slow = slow_on_device().to(device)
    first, values = _jpeg_batch(8, pinned=True)
    second = first.clone().pin_memory()  # the same JPEGs, in another gathered batch
    with torch.inference_mode():
        began = time.perf_counter()
        staged = staging.inputs(first, values)
        pending = staging.outputs(slow(staged.inputs), staged)
        returned_s = time.perf_counter() - began
        staged_next = staging.inputs(second, values)
        for event in staged_next.ready:
            event.synchronize()
        decoded_while_busy = not torch.cuda.current_stream(device).query()
        pending_next = staging.outputs(slow(staged_next.inputs), staged_next)
    assert returned_s < 0.2
    assert decoded_while_busy
    assert np.allclose(np.stack(pending.rows()), np.stack(pending_next.rows()))


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_a_batch_decoded_on_the_cpu_crosses_in_one_copy_each_way() -> None:
    """A batch of decoded images goes to the device in one copy and its answers come
    back in one, into pinned memory (the profile of the H100 run counted 311 copies a
    batch with nvJPEG's, 130 of them the worker's own)."""
    infer = inference_setup(ROW_MEANS, "cuda", SHAPE, batch_size=16).run
    batch = torch.randint(0, 256, (16, *SHAPE), dtype=torch.uint8).pin_memory()
    infer(batch, [None] * 16)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, acc_events=True) as profile:
        rows = infer(batch, [None] * 16)
    copies = Counter(event.name for event in profile.events() if event.name.startswith("Memcpy"))
    assert sum(n for name, n in copies.items() if "HtoD" in name) == 1, copies
    assert sum(n for name, n in copies.items() if "DtoH" in name) == 1, copies
    expected = batch.float().flatten(1).mean(dim=1)
    assert np.allclose(np.stack(rows)[:, 0], expected.numpy(), atol=1e-3)
