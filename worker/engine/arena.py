"""Shared memory for large values: arenas of preallocated slots that one stage writes in
place and a later stage reads, made in the daemon's process without torch and handed to
the children as a file each maps (`worker.engine.child_arenas` makes tensors of it).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import numpy as np

from worker.engine.channel import Channel

# Where shared memory is on Linux (a tmpfs).
SHARED_MEMORY_DIR = Path("/dev/shm")


class SharedFile:
    """A file in shared memory, mapped, and unlinked as soon as it is made: its memory
    lives while a process holds it open or mapped, so none is left behind however the
    daemon and its children end, a SIGKILL included (as torch's shared tensors did, its
    `file_descriptor` strategy). Pickled for a child, its descriptor is duplicated into
    the child (as `multiprocessing.heap` hands its arenas on).

    Its memory is reserved as it is made, every page of it, as torch's `share_memory_`
    did: a file only sized would take its pages as they are first written, and one that
    finds the file system full then dies with SIGBUS, mid-batch. A file system too full
    for it raises `OSError` (ENOSPC) here instead."""

    def __init__(self, size: int, directory: Path | None = None, fd: int | None = None):
        if fd is None:
            fd = _reserved_file(size, directory)
        self.size = size
        self.fd = fd
        weakref.finalize(self, os.close, fd)  # before the map, which may fail
        self.map = mmap.mmap(fd, size)

    def __reduce__(self) -> tuple[Any, ...]:
        return _mapped_again, (self.size, reduction.DupFd(self.fd))


def _reserved_file(size: int, directory: Path | None) -> int:
    """The descriptor of an unlinked file of `size` bytes, all of them allocated."""
    fd, name = tempfile.mkstemp(prefix="worker-arena-", dir=directory)
    try:
        os.unlink(name)
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):  # not on macOS, whose arenas are files on disk
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mapped_again(size: int, duplicated: Any) -> SharedFile:
    return SharedFile(size, fd=duplicated.detach())


@dataclass(frozen=True)
class SharedSlots:
    """An arena's memory as its children are told of it: the file, and the shape (the
    number of slots first) and numpy dtype of the slots in it."""

    memory: SharedFile
    shape: tuple[int, ...]
    dtype: str

    def array(self) -> np.ndarray[Any, Any]:
        """The slots as one array over the shared memory (no copy)."""
        return np.ndarray(self.shape, self.dtype, buffer=self.memory.map)


class TensorArena:
    """Preallocated shared-memory slots of one shape, handed out and given back.

    Acquiring blocks while every slot is in use, which bounds memory and pushes back on
    the stages before the reader, however large the backlog. The slots are of a numpy
    `dtype` (`"uint8"`, `"int32"`): the children see them as torch tensors of the same.
    """

    def __init__(
        self,
        slot_shape: Sequence[int],
        slots: int,
        dtype: str = "uint8",
        shared_memory: Path = SHARED_MEMORY_DIR,
    ):
        shape = (slots, *slot_shape)
        needed = math.prod(shape) * np.dtype(dtype).itemsize
        what = f"{slots} slots of {tuple(slot_shape)}"
        directory = _shared_memory_directory(shared_memory)
        if directory is not None:
            _check_shared_memory(directory, needed, what)
        try:
            memory = SharedFile(needed, directory)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EFBIG):
                raise
            # Another arena, or another process, took the space since it was measured.
            raise SharedMemoryTooSmall(
                f"{shared_memory} has no room left for the batch arena ({what}, "
                f"{needed / 2**20:.0f} MiB): {SHARED_MEMORY_ADVICE}"
            ) from error
        self.slots = slots
        self.shared = SharedSlots(memory, shape, dtype)
        self.array = self.shared.array()
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


# What to do about an arena that shared memory cannot hold.
SHARED_MEMORY_ADVICE = (
    "give the container more shared memory (docker run --shm-size, ECS "
    "LinuxParameters.SharedMemorySize) or lower the batch size (--batch-size, or "
    "batch_size and max_parts in the pipeline spec)"
)


def _shared_memory_directory(where: Path) -> Path | None:
    """Where the arenas' files are made: `where`, or on a system without it (not Linux)
    the temporary directory. Linux without it is refused: a file on a disk would be
    written back to it, every batch."""
    if where.is_dir():
        return where
    if sys.platform == "linux":
        raise SharedMemoryTooSmall(
            f"{where} is not a directory: the batch arenas are files of shared memory "
            "there; mount a tmpfs there (a container has one unless told otherwise)"
        )
    return None


def _check_shared_memory(where: Path, needed: int, what: str) -> None:
    """Refuse to start when shared memory cannot hold the arena, with what it has free
    (Docker's /dev/shm is 64 MiB unless the container is given more); space taken after
    this is found as the arena's file reserves its memory."""
    stats = os.statvfs(where)
    free = stats.f_bavail * stats.f_frsize
    if needed > free:
        raise SharedMemoryTooSmall(
            f"{where} has {free / 2**20:.0f} MiB free and the batch arena ({what}) needs "
            f"{needed / 2**20:.0f} MiB: {SHARED_MEMORY_ADVICE}"
        )
