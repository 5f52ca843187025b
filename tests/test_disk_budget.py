"""The disk a daemon's tar copies take (`worker.datasets.disk`): claims grow within one
budget shared by every job's copies, are given back when the copies are removed, and
a job that cannot fit now is told apart from one that can never fit."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from collections.abc import Generator
from pathlib import Path

import pytest

from bench.harness import tar_of
from tests.support.in_process import run_until_drained
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets.disk import DiskBudget, NoDiskRoom
from worker.datasets.tars import TarCopies
from worker.errors import TransientError
from worker.message import PoisonMessage, TarMembers
from worker.ports import ObjectHead, S3Location

CHUNK_BYTES = 2**16


def test_claims_share_the_budget_and_give_it_back_when_released() -> None:
    """A claim that others leave no room for is `NoDiskRoom` (transient: for later),
    taking nothing; released room is claimable again."""
    budget = DiskBudget(1000)
    first, second = budget.claim(), budget.claim()
    first.grow(600)
    second.grow(300)
    with pytest.raises(NoDiskRoom, match="other jobs' copies hold 600 of its 1000 bytes"):
        second.grow(200)
    assert isinstance(NoDiskRoom("x"), TransientError)
    assert (budget.held_bytes, second.held_bytes) == (900, 300)
    first.release()
    second.grow(200)
    assert (budget.held_bytes, first.held_bytes, second.held_bytes) == (500, 0, 500)
    second.release()
    second.release()  # twice: nothing more given back
    assert budget.held_bytes == 0


def test_a_claim_over_the_whole_budget_is_poison_naming_the_limit() -> None:
    """Its tars could never fit on this machine, however long it waits."""
    budget = DiskBudget(1000)
    claim = budget.claim()
    claim.grow(900)
    with pytest.raises(PoisonMessage, match=r"--tar-disk-bytes, 1000 bytes"):
        claim.grow(101)
    assert budget.held_bytes == 900


def test_claims_at_once_never_hold_more_than_the_budget() -> None:
    """Eight claimers growing by random amounts at once, each releasing when it is
    refused (no room now, or its claim alone over the budget): what is held never passes
    the budget, and all of it comes back."""
    budget = DiskBudget(10_000)
    most_held = 0
    start = threading.Barrier(8)

    def claimer(seed: int) -> None:
        nonlocal most_held
        chooser, claim = random.Random(seed), budget.claim()
        start.wait()
        for _ in range(2000):
            try:
                claim.grow(chooser.randint(1, 700))
            except (NoDiskRoom, PoisonMessage):
                claim.release()
            most_held = max(most_held, budget.held_bytes)
        claim.release()

    claimers = [threading.Thread(target=claimer, args=(seed,)) for seed in range(8)]
    for thread in claimers:
        thread.start()
    for thread in claimers:
        thread.join()
    assert 0 < most_held <= 10_000
    assert budget.held_bytes == 0


def _tars(blobs: InMemoryBlobStore, *sizes: int) -> list[str]:
    """Tars of one member of about `size` bytes each, stored; their URIs."""
    uris = [f"s3://bkt/{number}.tar" for number in range(len(sizes))]
    for uri, size in zip(uris, sizes, strict=True):
        blobs.objects[uri] = tar_of([("a.jpg", bytes(size))])
    return uris


def test_every_jobs_tar_copies_claim_one_budget_until_they_are_removed(tmp_path: Path) -> None:
    """Two jobs' copies on one budget: the second finds no room while the first holds
    its tar (`NoDiskRoom`, having claimed and written nothing), and
    fits once the first's copies are removed; the budget is never passed."""
    blobs = InMemoryBlobStore(chunk_bytes=CHUNK_BYTES)
    big, small = _tars(blobs, 600_000, 300_000)
    budget = DiskBudget(800_000)

    def copies(name: str) -> TarCopies:
        return TarCopies(tmp_path / name, blobs, 2**30, 100, budget)

    first, second = copies("first"), copies("second")
    assert [member.name for member in first.members([big], TarMembers())] == ["a.jpg"]
    assert budget.held_bytes == len(blobs.objects[big])
    with pytest.raises(NoDiskRoom, match="--tar-disk-bytes"):
        second.members([small], TarMembers())
    assert budget.held_bytes <= budget.total_bytes
    second.remove()
    assert budget.held_bytes == len(blobs.objects[big])
    first.remove()
    assert budget.held_bytes == 0
    third = copies("third")
    assert len(third.members([small], TarMembers())) == 1
    assert budget.held_bytes == len(blobs.objects[small])
    third.remove()
    assert budget.held_bytes == 0


def test_a_job_whose_tars_are_over_the_whole_budget_is_poison(tmp_path: Path) -> None:
    """Two tars that together take more than the budget: poison naming the limit, with
    no other job holding anything."""
    blobs = InMemoryBlobStore(chunk_bytes=CHUNK_BYTES)
    tars = _tars(blobs, 300_000, 300_000)
    budget = DiskBudget(500_000)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100, budget)
    with pytest.raises(PoisonMessage, match=r"--tar-disk-bytes, 500000 bytes"):
        copies.members(tars, TarMembers())
    copies.remove()
    assert budget.held_bytes == 0


class CountedReads(InMemoryBlobStore):
    """Counts the bytes its readers are given of each object's chunks."""

    def __init__(self) -> None:
        super().__init__(chunk_bytes=CHUNK_BYTES)
        self.read_bytes = 0

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        for chunk in super().chunks(location, max_bytes, expect=expect):
            self.read_bytes += len(chunk)
            yield chunk


def test_a_tar_over_the_whole_budget_is_poison_having_read_only_its_first_chunk(
    tmp_path: Path,
) -> None:
    """Its size, from its HEAD, is claimed once its first block is checked, before a
    byte is written: a 10 MB tar on a 1 MB budget is poison after its first chunk,
    where a claim as it was written read the budget's worth first."""
    blobs = CountedReads()
    [tar] = _tars(blobs, 10_000_000)
    budget = DiskBudget(1_000_000)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100, budget)
    with pytest.raises(PoisonMessage, match=r"--tar-disk-bytes, 1000000 bytes"):
        copies.members([tar], TarMembers())
    assert blobs.read_bytes == CHUNK_BYTES
    assert sum(path.stat().st_size for path in (tmp_path / "copies").iterdir()) == 0
    copies.remove()
    assert budget.held_bytes == 0


def test_a_tar_replaced_between_its_head_and_its_read_is_tried_again(tmp_path: Path) -> None:
    """The copy reads the tar whose size it claims (If-Match): one replaced meanwhile,
    by a bigger one say, is a transient error (the job's next delivery claims its new
    size), with nothing of the bigger one written or claimed."""
    blobs = InMemoryBlobStore(chunk_bytes=CHUNK_BYTES)
    [tar] = _tars(blobs, 1000)
    replace = blobs.head

    def head_then_replace(location: S3Location) -> ObjectHead:
        found = replace(location)
        blobs.objects[tar] = tar_of([("a.jpg", bytes(900_000))])
        return found

    blobs.head = head_then_replace  # type: ignore[method-assign]
    budget = DiskBudget(1_000_000)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100, budget)
    with pytest.raises(TransientError, match="was replaced while it was copied"):
        copies.members([tar], TarMembers())
    assert budget.held_bytes == 0
    assert sum(path.stat().st_size for path in (tmp_path / "copies").iterdir()) == 0
    copies.remove()


def test_what_is_not_a_tar_is_said_so_before_its_size_is_claimed(tmp_path: Path) -> None:
    """An object named as a tar that is none, bigger than the room others leave and than
    the whole budget: poison saying it is not a tar (its first block is checked before
    its size is claimed), not a wait for room nor a refusal for its size."""
    blobs = InMemoryBlobStore(chunk_bytes=CHUNK_BYTES)
    blobs.objects["s3://bkt/video.tar"] = os.urandom(3_000_000)
    budget = DiskBudget(1_000_000)
    budget.claim().grow(900_000)  # another job's copies
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100, budget)
    with pytest.raises(PoisonMessage, match="is not a tar this worker reads"):
        copies.members(["s3://bkt/video.tar"], TarMembers())
    assert budget.held_bytes == 900_000


def test_a_tar_that_ends_at_its_first_block_claims_only_what_it_wrote(tmp_path: Path) -> None:
    """A tar whose first block is its end (an empty tar, then padding) is copied no
    further: it holds of the budget only the chunk written, not its whole size."""
    blobs = InMemoryBlobStore(chunk_bytes=CHUNK_BYTES)
    blobs.objects["s3://bkt/empty.tar"] = bytes(2_000_000)
    budget = DiskBudget(1_000_000)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100, budget)
    assert copies.members(["s3://bkt/empty.tar"], TarMembers()) == []
    assert budget.held_bytes == CHUNK_BYTES
    copies.remove()
    assert budget.held_bytes == 0


def test_a_budget_by_default_is_three_quarters_of_the_free_space_of_its_disk(
    tmp_path: Path,
) -> None:
    """Measured on the disk of the directory, or its nearest parent that exists yet (the
    log directory is made at start)."""
    free = shutil.disk_usage(tmp_path).free
    budget = DiskBudget.of(tmp_path / "logs" / "not-yet", None)
    assert abs(budget.total_bytes - 0.75 * free) < 0.01 * free
    assert DiskBudget.of(tmp_path, 12345).total_bytes == 12345


def test_a_listing_planned_into_shards_claims_the_budget_for_its_snapshot(
    tmp_path: Path,
) -> None:
    """A job over its shard size is planned from a snapshot of its listing on this
    machine's disk: its bytes are claimed of the same budget as tar copies, so a prefix
    of more keys than the budget holds is poison naming the limit, where a sender could
    fill the disk; with a budget it fits in, the same job is planned and runs."""
    for budget in (2_000, 1_000_000):
        source, blobs = InMemoryJobSource(), InMemoryBlobStore()
        for number in range(300):  # about 7 kB of lines
            blobs.objects[f"s3://bkt/many/{number:05d}"] = b"not an image"
        body = {"job_id": "many", "inputs_prefix": "s3://bkt/many/", "output": "s3://bkt/out/"}
        source.send(json.dumps(body))
        run_until_drained(source, blobs, tmp_path, shard_items=100, tar_disk_bytes=budget)
        if budget == 2_000:
            [(_, reason)] = source.dead_letters
            assert "the snapshot of its listing would take more than the disk" in reason
            assert "--tar-disk-bytes, 2000 bytes" in reason
        else:
            assert source.dead_letters == []
            assert json.loads(blobs.objects["s3://bkt/out/job.json"])["items"] == 300
