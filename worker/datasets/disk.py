"""The disk what jobs copy to this machine may take, all of it together
(`--tar-disk-bytes`): whole tar jobs and tar shards copy their tars here
(`worker.datasets.tars`), and a job planned into shards its listing (a snapshot read back
to write the shards' inputs files); each claims its bytes of one budget before it
writes them (a tar's copy its whole size, a snapshot each piece), and gives them back
when its copy is removed.

A claim that others' copies leave no room for now is `NoDiskRoom`, transient: the job
goes back to the queue, uncharged, to run when room is made (here or elsewhere); one
whose own copy is over the whole budget can never fit here, and is poison.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from worker.errors import TransientError
from worker.message import PoisonMessage

# The budget when none is set: this share of the space free at start on the disk of
# --log-dir (which holds the job logs and array files too).
FREE_SPACE_SHARE = 0.75
# How long a job handed back for want of room waits before it is received again.
NO_DISK_ROOM_RETRY_S = 60


class NoDiskRoom(TransientError):
    """The copies of other jobs held here take the disk budget now: hand the job back to
    run later, without charging it (it did nothing wrong)."""


class DiskBudget:
    """Bytes of disk that a daemon's copies may hold at once, shared by all of them."""

    def __init__(self, total_bytes: int):
        self.total_bytes = total_bytes
        self._held_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, directory: Path, total_bytes: int | None) -> DiskBudget:
        """A budget of `total_bytes`, or, if None, `FREE_SPACE_SHARE` of the space free
        now on the disk that holds `directory` (or its nearest parent that exists)."""
        if total_bytes is None:
            existing = next(path for path in (directory, *directory.parents) if path.exists())
            total_bytes = int(shutil.disk_usage(existing).free * FREE_SPACE_SHARE)
        return cls(max(1, total_bytes))

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def claim(self, copies: str = "the copies of its tars") -> DiskClaim:
        """A claim holding nothing yet: one job's `copies`, as its errors name them."""
        return DiskClaim(self, copies)

    def take(self, claim: DiskClaim, size: int) -> None:
        """`size` more bytes for `claim`: poison if the claim alone would then be over
        the whole budget, `NoDiskRoom` if others hold the room now (nothing is taken)."""
        with self._lock:
            if claim.held_bytes + size > self.total_bytes:
                raise PoisonMessage(
                    f"{claim.copies} would take more than the disk this worker gives jobs' "
                    f"copies (--tar-disk-bytes, {self.total_bytes} bytes)"
                )
            if self._held_bytes + size > self.total_bytes:
                raise NoDiskRoom(
                    f"no room for {claim.copies} on this machine's disk now: other jobs' "
                    f"copies hold {self._held_bytes - claim.held_bytes} of its "
                    f"{self.total_bytes} bytes (--tar-disk-bytes)"
                )
            self._held_bytes += size
            claim.held_bytes += size

    def give_back(self, claim: DiskClaim) -> None:
        """Everything `claim` holds."""
        with self._lock:
            self._held_bytes -= claim.held_bytes
            claim.held_bytes = 0


class DiskClaim:
    """What one job's copies hold of a budget: grown before what it holds is written,
    given back whole when the copies are removed."""

    def __init__(self, budget: DiskBudget, copies: str):
        self._budget = budget
        self.copies = copies  # what they are, as the claim's errors name them
        self.held_bytes = 0  # changed under the budget's lock

    def grow(self, size: int) -> None:
        """Claim `size` more bytes (`DiskBudget.take`)."""
        self._budget.take(self, size)

    def release(self) -> None:
        self._budget.give_back(self)
