"""Shared memory for large values: arenas of preallocated slots that one stage writes in
place and a later stage reads, and the gatherer that batches them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from worker.engine.channel import Channel

# Where torch puts shared tensors on Linux (shm_open).
SHARED_MEMORY_DIR = Path("/dev/shm")


class TensorArena:
    """Preallocated shared-memory slots of one shape, handed out and given back.

    Acquiring blocks while every slot is in use, which bounds memory and pushes back on
    the stages before the reader, however large the backlog.
    """

    def __init__(
        self,
        slot_shape: Sequence[int],
        slots: int,
        dtype: torch.dtype = torch.uint8,
        shared_memory: Path = SHARED_MEMORY_DIR,
    ):
        needed = slots * math.prod(slot_shape) * dtype.itemsize
        _check_shared_memory(shared_memory, needed, f"{slots} slots of {tuple(slot_shape)}")
        self.slots = slots
        self.tensor = torch.empty((slots, *slot_shape), dtype=dtype).share_memory_()
        self._free: Channel[int] = Channel(slots)
        self._free.put_all(range(slots))

    def acquire(self, count: int) -> list[int]:
        """`count` free slots' numbers, taken together once that many are free: a
        taker that held some while it waited for the rest could, with others doing the
        same, hold every slot with none of them done. Raises `Closed` after `close`."""
        return self._free.take(count) if count > 0 else []

    def try_acquire(self, count: int) -> list[int] | None:
        """`count` free slots if there are that many now, else None (none taken)."""
        return self._free.take_now(count)

    def acquire_now(self, most: int) -> list[int]:
        """Up to `most` slots, those free now: never waits."""
        return self._free.take_up_to(most)

    def release(self, slots: Iterable[int]) -> None:
        """Give slots back once their reader is done with them."""
        self._free.put_all(slots)

    def close(self) -> None:
        """Wake everyone waiting for a slot."""
        self._free.close()


class SharedMemoryTooSmall(Exception):
    """The shared-memory file system cannot hold the batch arena."""


def _check_shared_memory(where: Path, needed: int, what: str) -> None:
    """Refuse to start when shared memory cannot hold the arena. A shared tensor in a
    file system too small for it is no error when it is made: the first write past the
    space there kills the process with SIGBUS, mid-batch. (Docker's /dev/shm is 64 MiB
    unless the container is given more.)"""
    if not where.is_dir():
        return  # not Linux: torch shares memory another way
    stats = os.statvfs(where)
    free = stats.f_bavail * stats.f_frsize
    if needed > free:
        raise SharedMemoryTooSmall(
            f"{where} has {free / 2**20:.0f} MiB free and the batch arena ({what}) needs "
            f"{needed / 2**20:.0f} MiB: give the container more shared memory (docker run "
            "--shm-size, ECS LinuxParameters.SharedMemorySize) or lower the batch size "
            "(--batch-size, or batch_size and max_parts in the pipeline spec)"
        )


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
