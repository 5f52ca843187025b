"""Decoding inputs on the model's device (`--decode gpu`): deferring the inputs in the
preprocessing processes, and decoding them in the model's process (whether to is
`worker.plugins.loading.decodes_on_device`'s, in the daemon's)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from worker.engine import ItemError, isolate_failures
from worker.plugins import PREPROCESS_STAGE, DecodesOnDevice, PluginError, Undecoded
from worker.plugins.loading import load_device_decoder

log = structlog.get_logger()


def decode_or_defer(preprocessor: DecodesOnDevice, data: bytes, out: torch.Tensor) -> Any:
    """Decode `data` into `out`; or, if the device decodes it and it fits, copy its bytes
    there for the model's process (`Undecoded`). A larger file is decoded here: the
    slot, the size of one decoded input, is all the room an input has on its way."""
    slot = out.view(-1)
    if len(data) <= slot.numel() and preprocessor.device_decodable(data):
        slot.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return Undecoded(len(data))
    return preprocessor(data, out)


@dataclass
class DecodedRows:
    """A batch's undecoded inputs, decoded: the rows they go to, their images stacked
    in that order on the device (None when there are none), and the errors of those
    neither decoder could decode (their rows are zeros, the model's probe input, so
    the batch's others still run), by position."""

    positions: list[int]
    images: torch.Tensor | None
    errors: dict[int, ItemError]

    def write(self, batch: torch.Tensor) -> None:
        """Into their rows of `batch`, on its device: one copy when the rows follow
        one another (a batch of JPEGs alone), else one indexed copy; never one per row
        (each a copy call of its own: 20 us of the host's time apiece on an H100)."""
        if self.images is None:
            return
        first, last = self.positions[0], self.positions[-1]
        if last - first + 1 == len(self.positions):
            batch[first : last + 1].copy_(self.images, non_blocking=True)
            return
        index = torch.tensor(self.positions, dtype=torch.long)
        if batch.is_cuda:  # from pinned memory, so the copy does not wait on the stream
            index = index.pin_memory().to(batch.device, non_blocking=True)
        batch.index_copy_(0, index, self.images)


def undecoded_lengths(values: Sequence[Any]) -> list[tuple[int, int]]:
    """The positions of a batch's items whose slots hold undecoded bytes, with how many."""
    return [
        (position, value[0].length)
        for position, value in enumerate(values)
        if isinstance(value, tuple) and isinstance(value[0], Undecoded)
    ]


def decode_undecoded(
    preprocessor: DecodesOnDevice,
    device: torch.device,
    batch: torch.Tensor,
    values: Sequence[Any],
) -> DecodedRows:
    """Decode the rows of `batch` (on the CPU: the gathered batch) whose slots hold
    undecoded bytes, together on the device, reading the bytes where they are (nvJPEG
    takes CPU tensors only, and copies each file to the device itself). A call that
    raises is bisected down to the inputs it fails on; those are decoded on the CPU
    here, by the same preprocessor; an input neither can decode is that item's error,
    as if it had failed in the preprocessing process. Every image is made before any is
    written (`DecodedRows.write`): on the CPU they go back into the rows they are read
    from."""
    undecoded = [
        (position, batch[position].view(-1)[:length])
        for position, length in undecoded_lengths(values)
    ]
    if not undecoded:
        return DecodedRows([], None, {})
    encoded = [data for _, data in undecoded]
    images = isolate_failures(
        lambda chosen: _decoded_on_device(preprocessor, [encoded[c] for c in chosen], device),
        len(encoded),
        PREPROCESS_STAGE,
    )
    failed = {}
    rows = []
    rejected = 0
    for (position, data), on_gpu in zip(undecoded, images, strict=True):
        image = on_gpu
        if isinstance(on_gpu, ItemError):
            rejected += 1
            image = _decoded_on_cpu(preprocessor, data)
        if isinstance(image, ItemError):
            failed[position] = image
            image = torch.zeros(preprocessor.output_shape, dtype=torch.uint8)
        rows.append(image.to(device))
    if rejected:
        log.warning("decoded_on_cpu", inputs=rejected, of=len(undecoded))
    return DecodedRows([position for position, _ in undecoded], torch.stack(rows), failed)


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


DeviceDecoder = Callable[[torch.Tensor, Sequence[Any]], DecodedRows]


def device_decoder(reference: str, device: torch.device) -> DeviceDecoder:
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
