"""What a child makes of the arenas it is told of: torch tensors over their shared
memory, and the gatherer that batches their slots. Only the children import torch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.arena import SharedSlots


def tensor_of(slots: SharedSlots | None) -> torch.Tensor | None:
    """The arena's slots as one tensor over its shared memory (no copy)."""
    return None if slots is None else torch.from_numpy(slots.array())


class BatchGatherer:
    """Gathers arena slots into one reused batch buffer (pinned when there is a GPU, so
    the copy to the device can be asynchronous).

    Indexing the arena would allocate a fresh batch every time, which costs about ten
    times the copy itself; the buffer is handed to the stage function as a view and is
    overwritten by the next batch. So a stage function that copies from it to a device
    without waiting (`non_blocking`) must wait for that copy before it returns; what it
    leaves on the device to finish later must not read the buffer
    (`worker.plugins.staging`).
    """

    def __init__(self, arena: torch.Tensor):
        self._arena = arena
        self._buffer: torch.Tensor | None = None

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        if self._buffer is None or len(self._buffer) < len(slots):
            buffer = torch.empty((len(slots), *self._arena.shape[1:]), dtype=self._arena.dtype)
            self._buffer = buffer.pin_memory() if torch.cuda.is_available() else buffer
        out = self._buffer[: len(slots)]
        torch.index_select(self._arena, 0, torch.tensor(slots), out=out)
        return out
