"""A batch's way onto the model's device and its answers' way back (issue 38).

On a GPU the inference process works on two batches at once: while the model runs one
on the compute stream (the process's current one), the next is brought in on two
streams of its own, so the device never waits for the host between batches:

- the rows decoded on the CPU cross from the gathered batch (pinned memory,
  `BatchGatherer`) in one copy, on the copy stream;
- the rows holding undecoded JPEGs are decoded by nvJPEG, which reads the bytes where
  they lie in the gathered batch (torchvision's `decode_jpeg` takes CPU tensors only
  and copies each file to the device itself), then resized, on the decode stream;
- both write into one of two device batches (`RING`), each written only once the
  model has read the batch it held before (an event);
- the model's outputs are copied back into pinned memory without the host waiting,
  and an event says when they are there (`PendingRows`): the stage's finish step waits
  for it, on its own thread, while the next batch comes in.

On the CPU there are no streams: every step runs at once, in order, on the gathered
batch itself, and the outputs are copied out at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.engine import ItemError
from worker.plugins.device_decoding import DeviceDecoder, undecoded_lengths

# Device batches the inputs are brought into: the model reads one while the next batch
# is written into the other (the engine sends a model's process at most two at a time).
RING = 2


def decoded_span(values: Sequence[Any]) -> slice | None:
    """The rows of a batch that cross to the device in one copy: from its first row
    decoded on the CPU to its last (undecoded rows between them come along, and the
    decoder writes over them), or None when the device decodes every row."""
    undecoded = {position for position, _ in undecoded_lengths(values)}
    decoded = [position for position in range(len(values)) if position not in undecoded]
    if not decoded:
        return None
    return slice(decoded[0], decoded[-1] + 1)


@dataclass(frozen=True)
class Staged:
    """A batch on the model's device: its inputs, decoded; the errors of the inputs
    neither decoder could decode, by position; which device batch of the ring holds
    them (None on the CPU, where the inputs are the gathered batch itself); and on a GPU
    the events after which they are all there (the current stream waits for them)."""

    inputs: torch.Tensor
    errors: dict[int, ItemError]
    turn: int | None = None
    ready: tuple[Any, ...] = ()


class PendingRows:
    """A batch's outputs on their way back to the host: `rows()` waits until they are
    there (on a GPU, for the event recorded after their copy) and gives each item's row
    as a numpy array, or its error. The host memory is the rows' own (a pinned block
    the caching allocator hands out again once they are gone), so later batches cannot
    change them."""

    def __init__(self, host: torch.Tensor, done: Any, errors: dict[int, ItemError]):
        self._host = host
        self._done = done
        self._errors = errors
        self._rows: list[Any] | None = None

    def rows(self) -> list[Any]:
        if self._rows is None:
            if self._done is not None:
                self._done.synchronize()  # releases the interpreter while it waits
            # Numpy rows: an embedding or a mask stays an array (as Python floats a
            # 512x512 mask would take milliseconds to make and more to encode).
            rows: list[Any] = list(self._host.numpy())
            for position, error in self._errors.items():
                rows[position] = error
            self._rows = rows
        return self._rows

    def handles(self) -> list[Any]:
        """An `AwaitedRow` per item, or its error if it already has one: what the stage
        function returns when a finish step waits for the rows."""
        return [
            self._errors.get(position, AwaitedRow(self, position))
            for position in range(len(self._host))
        ]


@dataclass(frozen=True, slots=True)
class AwaitedRow:
    """One item's output row, still on its way from the device (`PendingRows`)."""

    pending: PendingRows
    position: int

    def value(self) -> Any:
        return self.pending.rows()[self.position]


def resolved(outputs: Sequence[Any]) -> list[Any]:
    """Outputs with each `AwaitedRow` waited for; errors and ready rows as they are."""
    return [output.value() if isinstance(output, AwaitedRow) else output for output in outputs]


class Streams(Protocol):
    """What `Staging` asks of a GPU's streams (`CudaStreams`; a test's fake records
    who waits for what): two streams of its own, and the compute stream, the current
    one, on which the model runs."""

    copying: Any
    decoding: Any

    def compute(self) -> Any:
        """The current stream."""

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make `stream` the current one meanwhile."""

    def recorded(self, stream: Any) -> Any:
        """An event recorded on `stream` now (it has `synchronize()` and `query()`)."""

    def wait(self, stream: Any, event: Any) -> None:
        """Have `stream` wait for `event` (the host does not)."""

    def synchronize(self) -> None:
        """Wait for every stream of the device."""

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s shape and dtype in pinned memory."""


class CudaStreams:
    """`Streams` on a CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copying = torch.cuda.Stream(device)
        self.decoding = torch.cuda.Stream(device)

    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def on(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def recorded(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        # From torch's caching host allocator: the block is handed out again once the
        # tensor is gone and the copies recorded on it are done.
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


class Staging:
    """Brings batches onto the model's device and their outputs back (the module's
    docstring says how), decoding their undecoded inputs with `decode` if given. On a
    GPU it works with `streams` (`CudaStreams` by default); on the CPU with none."""

    def __init__(
        self,
        device: torch.device,
        item_shape: Sequence[int],
        decode: DeviceDecoder | None,
        streams: Streams | None = None,
        dtype: torch.dtype = torch.uint8,
    ):
        self.device = device
        self._item_shape = tuple(item_shape)
        self._dtype = dtype
        self._decode = decode
        if streams is None and device.type == "cuda":
            streams = CudaStreams(device)
        self._streams = streams
        self._turn = 0
        self._buffers: list[torch.Tensor] = []
        # Per device batch, the event after which nothing reads it any more.
        self._free: list[Any] = [None] * RING

    def inputs(self, batch: torch.Tensor, values: Sequence[Any]) -> Staged:
        """`batch` (the gathered batch) on the device, decoded, ready for the model on
        the current stream. On a GPU, the host waits here only for nvJPEG (which waits
        for its own work) and for the copy out of `batch`, which the next gather
        overwrites: never for the model's work on the batch before."""
        streams = self._streams
        if streams is None:
            decoded = self._decode(batch, values) if self._decode else None
            if decoded is not None:
                decoded.write(batch)
            return Staged(batch, decoded.errors if decoded else {})
        turn = self._next_turn(streams, len(batch))
        inputs = self._buffers[turn][: len(batch)]
        free = self._free[turn]
        copied = self._copy_decoded(streams, batch, values, inputs, free=free)
        errors, written = self._decode_undecoded(
            streams, batch, values, inputs, free=free, copied=copied
        )
        compute = streams.compute()
        ready = tuple(event for event in (copied, written) if event is not None)
        for event in ready:
            streams.wait(compute, event)
        # Until the model's own event replaces it (`outputs`): a model that raises must
        # still leave the writes of this batch before those of the next into this buffer.
        self._free[turn] = streams.recorded(compute)
        if copied is not None:
            copied.synchronize()
        return Staged(inputs, errors, turn, ready)

    def outputs(self, outputs: torch.Tensor, staged: Staged) -> PendingRows:
        """The model's outputs for `staged`, on their way to the host: on a GPU copied
        into pinned memory after the model on the current stream, without waiting."""
        streams = self._streams
        if streams is None:
            # A copy on the CPU too: a model may answer with a view of its input, the
            # gathered batch, which the next batch is gathered into.
            return PendingRows(outputs.to("cpu", copy=True), None, staged.errors)
        host = streams.pinned(outputs)
        host.copy_(outputs, non_blocking=True)
        done = streams.recorded(streams.compute())
        if staged.turn is not None:
            self._free[staged.turn] = done
        return PendingRows(host, done, staged.errors)

    def _next_turn(self, streams: Streams, rows: int) -> int:
        if not self._buffers or len(self._buffers[0]) < rows:
            streams.synchronize()  # nothing may still read the old ones
            shape = (rows, *self._item_shape)
            self._buffers = [
                torch.empty(shape, dtype=self._dtype, device=self.device) for _ in range(RING)
            ]
            self._free = [None] * RING
        turn, self._turn = self._turn, (self._turn + 1) % RING
        return turn

    def _copy_decoded(
        self,
        streams: Streams,
        batch: torch.Tensor,
        values: Sequence[Any],
        inputs: torch.Tensor,
        *,
        free: Any,
    ) -> Any:
        """The rows decoded on the CPU, in one copy on the copy stream: its event."""
        span = decoded_span(values)
        if span is None:
            return None
        with streams.on(streams.copying):
            if free is not None:
                streams.wait(streams.copying, free)
            inputs[span].copy_(batch[span], non_blocking=True)
            return streams.recorded(streams.copying)

    def _decode_undecoded(
        self,
        streams: Streams,
        batch: torch.Tensor,
        values: Sequence[Any],
        inputs: torch.Tensor,
        *,
        free: Any,
        copied: Any,
    ) -> tuple[dict[int, ItemError], Any]:
        """The undecoded rows decoded and resized on the decode stream (nvJPEG makes
        the current stream wait for its own), then written into `inputs` once the
        model has read what they held before and the copy stream has written its rows
        there: their errors, and the event after the write (None if nothing was)."""
        if self._decode is None:
            return {}, None
        with streams.on(streams.decoding):
            decoded = self._decode(batch, values)
            if decoded.images is None:
                return decoded.errors, None
            for earlier in (free, copied):
                if earlier is not None:
                    streams.wait(streams.decoding, earlier)
            decoded.write(inputs)
            return decoded.errors, streams.recorded(streams.decoding)
