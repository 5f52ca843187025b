"""Merging a job's committed shards into the outputs an unsharded run writes.

Whoever sees every shard committed may merge: the last committer, a watch, a committed
shard's redelivery. Only one merges at a time: a merge first takes the job's `merge`
claim (opened, held by none, by the job's planner; written on condition that it is as
read: held by none, expired, or the merger's own from an earlier delivery of the same
message; found gone, the job was merged and it is not written again), renews it
before each write, and a merger whose claim was taken over is fenced off by that
renewal. So two mergers never interleave their writes: with ETags that are not MD5s of
the bytes (SSE-KMS buckets, other S3 stores), the same bytes written twice would leave
job.json naming ETags no longer there, and the job would never count as done.

A merger then lists the outputs, and writes results.jsonl (or the Parquet files) and
job.log, joined from the shards' files in shard order, then job.json, each on
condition that it is as listed: a write refused (another request wrote to the same
output) stops the merge, to be tried again. Only a merge that wrote job.json (or finds
it written) removes the shards' files; a merge fenced off, refused, or one that finds
another merging, leaves everything for the one that can finish. Each answer is a type
of its own: a `None` that means three things is where such protocols lose data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import structlog

from worker.datasets.arrays import ArraySpool
from worker.datasets.disk import DiskBudget, NoDiskRoom
from worker.datasets.streams import COMPARED_BYTES, same_bytes
from worker.datasets.tables import (
    JSON_LINES,
    NDJSON,
    PARQUET,
    PARQUET_CONTENT_TYPE,
    TABLE_NAME,
    Tables,
    UnfitResults,
    joined_schema,
    read_footer,
    table_name,
)
from worker.errors import MissingObject, ObjectTooLarge, PreconditionFailed
from worker.jobs.checkpoints import CHECKPOINT_PREFIX, Checkpoints
from worker.jobs.plan import (
    COMMIT_SUFFIX,
    Commit,
    Plan,
    RunFile,
    commits_directory,
    each_at_once,
    merge_file,
    read_commit,
    shard_directory,
    shard_name,
    shards_files,
)
from worker.jobs.summary import job_summary
from worker.message import JobMessage, PoisonMessage
from worker.ports import ABSENT, BlobStore, ObjectHead, S3Location
from worker.sharding.claims import Claim, ClaimLost, MergingElsewhere, NoClaim, put_once

log = structlog.get_logger()

# An output found written is compared with what a merger would write this much at a
# time between renewals of its claim: tens of GB take minutes.
RENEW_COMPARED_BYTES = 2**30
# Commit markers are read a block of shards at a time, a page of S3's listing (1,000
# keys): a power of ten, so that the names of a block's markers share a prefix.
MARKERS_A_BLOCK = 1000


@dataclass(frozen=True)
class Merged:
    """This merge wrote the job's job.json; `shards_left` if its shards' files could not
    be removed then."""

    summary: dict[str, Any]
    shards_left: bool = False


@dataclass(frozen=True)
class AlreadyMerged:
    """The job's job.json was written (by another merge) for this same request."""

    summary: dict[str, Any]


@dataclass(frozen=True)
class Incomplete:
    """Not every shard is committed yet."""


@dataclass(frozen=True)
class Fenced:
    """Another merger took the claim over: it merges. Nothing is removed."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """A write of this merge's outputs was refused: the output changed since it was
    listed (another request wrote there; or a try of this merge's own compose, retried
    after its answer was lost, found the first try's, which it cannot read back). Nothing
    is removed, and the merge is to be tried again: it lists the outputs anew, as a
    whole job fenced off is released and runs again."""

    reason: str


MergeOutcome = Merged | AlreadyMerged | Incomplete | MergingElsewhere | Fenced | Refused


@dataclass(frozen=True)
class Written:
    """What a job's finish leaves the delivery that made it: the job.json it wrote, to
    announce (None where it wrote none: a shard's commit that did not merge the job, or
    a merge another delivery made), and whether the job is merged with its shards'
    files left (`shards_left`): they could not be removed, so the delivery's message
    must come back to remove them, not be deleted, as no other delivery of the job may
    be left."""

    summary: dict[str, Any] | None = None
    shards_left: bool = False


@dataclass(frozen=True)
class JoinSpace:
    """Where a merge joins a sharded Parquet job's files on this machine: in a directory
    of the daemon's spool (`spool`, swept as a daemon starts: what a merge killed
    midway left goes with it), its bytes claimed of the daemon's disk budget (`disk`)
    before they are written, beating the daemon's clock of progress (`beat`) as it goes:
    a join of tens of GB takes minutes, and a daemon that seems still is taken for hung."""

    spool: ArraySpool
    disk: DiskBudget
    beat: Callable[[], None]


class PoisonMerge(PoisonMessage):
    """The shards' results files cannot be joined into the job's, on any delivery: the
    job as a whole is refused, its producer told why (`rejected.json`), where a shard's
    own poison leaves its job waiting for the shard's redrive."""


class Merger:
    """Merges a job whose shards are all committed, one merger at a time."""

    def __init__(
        self,
        blobs: BlobStore,
        checkpoints: Checkpoints,
        tables: Tables,
        *,
        worker_info: dict[str, Any],
        device_hour_price: float | None,
        join_space: JoinSpace | None = None,
    ):
        """`join_space`: where Parquet jobs' files are joined; None for a merger of JSON
        Lines jobs only."""
        self._blobs = blobs
        self._join_space = join_space
        self._checkpoints = checkpoints
        self._tables = tables
        self._worker_info = worker_info
        self._device_hour_price = device_hour_price

    def merge(
        self,
        spec: JobMessage,
        plan: Plan,
        merger: str,
        markers: dict[int, S3Location] | None = None,
    ) -> MergeOutcome:
        """Merge the job if every shard is committed, as `merger` (what names the message
        chain doing it: its redeliveries and continuations resume its claim); `markers`:
        each committed shard's marker, as a watch found them (`commit_markers`), else
        the commit markers' folder is listed."""
        if markers is None:
            markers = self._committed(spec, plan)
        if len(markers) < plan.shards:
            done = self._checkpoints.finished(spec, plan.job_id, plan.request_digest)
            return Incomplete() if done is None else AlreadyMerged(done)
        location = merge_file(spec, plan.request_digest)
        claim = Claim(self._blobs, location, merger, self._tables.cut)
        holder = claim.take(self._blobs.objects_under(location).get(""))
        if isinstance(holder, NoClaim):
            # The claim stands from the job's planning to its merge's removal: gone, the
            # job was merged (job.json is written before the removal). A claim written
            # anew now, by a merger whose message another delivery deleted, would be
            # left for ever were that merger to die before it saw the job done.
            done = self._checkpoints.finished(spec, plan.job_id, plan.request_digest)
            if done is not None:
                return AlreadyMerged(done)
            holder = claim.take_anew()  # planned by a worker that opened none
        if holder is not None:
            return holder
        try:
            return self._merge(spec, plan, markers, claim)
        except ClaimLost as lost:
            log.info("merge_fenced", job_id=plan.job_id, error=str(lost))
            return Fenced(str(lost))
        except MissingObject:
            # A shard's file gone: a merger that took the claim over finished and
            # removed them.
            done = self._checkpoints.finished(spec, plan.job_id, plan.request_digest)
            if done is None:
                raise
            return AlreadyMerged(done)

    def _committed(self, spec: JobMessage, plan: Plan) -> dict[int, S3Location]:
        """Every shard's commit marker if all are committed; else fewer. The markers are
        read a block of shards at a time (a page of a listing), the block of the shard
        the message is of first (the one a run just committed: the shards after it are
        the likeliest left), each no further than its first shard not committed, and
        none after a block that has one: a commit that leaves shards to run reads a
        page of markers, not every shard's files."""
        blocks = range(math.ceil(plan.shards / MARKERS_A_BLOCK))
        first = spec.shard.index // MARKERS_A_BLOCK if spec.shard is not None else 0
        markers: dict[int, S3Location] = {}
        for block in [*blocks[first:], *blocks[:first]]:
            start = block * MARKERS_A_BLOCK
            shards = range(start, min(plan.shards, start + MARKERS_A_BLOCK))
            found = self._committed_in(spec, plan, shards)
            markers |= found
            if len(found) < len(shards):
                break
        return markers

    def _committed_in(self, spec: JobMessage, plan: Plan, shards: range) -> dict[int, S3Location]:
        """The markers of a block's `shards`, in order, up to the first shard not
        committed (their names sort in shard order)."""
        folder = commits_directory(spec, plan.request_digest)
        digits = len(str(MARKERS_A_BLOCK)) - 1  # those that differ within a block
        block = S3Location(folder.bucket, folder.key + shard_name(shards.start)[:-digits])
        wanted = iter(shards)
        shard = next(wanted)
        markers: dict[int, S3Location] = {}
        for key in self._blobs.keys_under(block):
            expected = f"{shard_name(shard)}{COMMIT_SUFFIX}"
            name = key.removeprefix(folder.key)
            if name > expected:
                break  # shard `shard` is not committed
            if name == expected:  # else not a marker a worker writes
                markers[shard] = S3Location(folder.bucket, key)
                if (shard := next(wanted, -1)) < 0:
                    break
        return markers

    def _merge(
        self, spec: JobMessage, plan: Plan, markers: dict[int, S3Location], claim: Claim
    ) -> MergeOutcome:
        # Listed once, under the claim, before anything is read: what is written after
        # this is another's, and fences this merge off.
        top = self._checkpoints.outputs(spec)
        done = self._checkpoints.completed(spec, plan.job_id, plan.request_digest, top)
        if done is not None:
            self.remove(spec, plan)
            return AlreadyMerged(done)
        shards = range(plan.shards)
        commits = each_at_once(lambda shard: read_commit(self._blobs, markers[shard]), shards)
        for shard, commit in zip(shards, commits, strict=True):
            name = shard_name(shard)
            if not all(file.name.startswith(f"{name}.") for file in [*commit.results, commit.log]):
                raise PoisonMessage(f"commit marker {markers[shard]} names another shard's files")
        directory = shard_directory(spec, plan.request_digest)

        def part(file: RunFile) -> tuple[S3Location, int]:
            return S3Location(directory.bucket, directory.key + file.name), file.bytes

        def compose(name: str, files: list[RunFile], content_type: str) -> tuple[str, str]:
            parts = [part(file) for file in files]
            claim.renew()
            location, expect = spec.output_location(name), top.get(name, ABSENT)
            joined = (chunk for at, size in parts for chunk in self._blobs.chunks(at, size))
            if self._holds(location, expect, sum(size for _, size in parts), joined, claim):
                return name, expect
            return name, self._blobs.compose(location, parts, content_type, expect=expect)

        results = [file for commit in commits for file in commit.results]
        try:
            if plan.format == JSON_LINES:
                outputs = dict([compose("results.jsonl", results, NDJSON)])
            else:
                outputs = self._joined(spec, [part(file) for file in results], top, claim)
            outputs.update([compose("job.log", [commit.log for commit in commits], NDJSON)])
            summary = self._summary(plan, commits, spec.request_id)
            summary["outputs"] = outputs
            claim.renew()
            written = json.dumps(summary).encode() + b"\n"  # its finished_at its own
            put_once(
                self._blobs,
                spec.output_location("job.json"),
                written,
                expect=top.get("job.json", ABSENT),
            )
        except PreconditionFailed as error:
            log.info("merge_refused", job_id=plan.job_id, error=str(error))
            return Refused(str(error))
        log.info("job_merged", job_id=plan.job_id, shards=plan.shards, status=summary["status"])
        self._checkpoints.remove_stale(spec, top, outputs)
        return Merged(summary, shards_left=not self.remove(spec, plan))

    def _joined(
        self,
        spec: JobMessage,
        files: list[tuple[S3Location, int]],
        top: dict[str, str],
        claim: Claim,
    ) -> dict[str, str]:
        """The shards' Parquet `files` (each with its size) joined in order into the
        files a run of the job alone writes (`Tables.join`; larger ones for a job too
        large for this worker's --parquet-file-bytes, `Tables.joined_file_bytes`, never
        refused for the setting), each written on condition
        that it is as listed in `top`: their names and ETags, in order. The files are
        copied here one at a time, and each joined one is written here and then sent,
        the claim renewed before each; the disk they take (the largest shard file and
        a joined file) claimed first: `NoDiskRoom` if others' copies hold it now."""
        space = self._join_space
        assert space is not None, "a merger of Parquet jobs is given where to join them"
        # As the job's first merger cut it, where that one wrote any of its files (with
        # none there, nothing is to match, and this one cuts as it is set to); the claim
        # says which from its next renewal, before any file is written.
        if not any(TABLE_NAME.fullmatch(name) for name in top):
            claim.cut = self._tables.cut
        tables = self._tables.cut_at(claim.cut)
        written: dict[str, str] = {}
        disk = space.disk.claim("a join of its shards' results files")
        directory = Path(tempfile.mkdtemp(prefix="join-", dir=space.spool.directory))
        try:
            file_bytes = tables.joined_file_bytes(sum(size for _, size in files))
            schema = joined_schema(each_at_once(lambda file: self._footer(*file), files))
            largest = tables.largest_file_bytes(file_bytes)
            needed = max((size for _, size in files), default=0) + largest
            if needed > space.disk.total_bytes:  # the worker's setting: not the job's fault
                raise NoDiskRoom(
                    f"a join of its shards' results files needs {needed} bytes of disk, more "
                    f"than this worker gives jobs' copies (--tar-disk-bytes, "
                    f"{space.disk.total_bytes} bytes): a worker with more may merge it"
                )
            disk.grow(needed)

            def copied() -> Iterator[Path]:
                copy = directory / f"shard.{PARQUET}"
                for location, size in files:
                    claim.renew()
                    space.beat()
                    with copy.open("wb") as sink:
                        for chunk in self._blobs.chunks(location, size):
                            sink.write(chunk)
                    yield copy

            joined_at = directory / "joined"
            joining = tables.join(copied(), schema, joined_at, space.beat, file_bytes)
            with contextlib.closing(joining) as joined:
                for path in joined:
                    name = table_name(0, len(written))
                    claim.renew()
                    location, expect = spec.output_location(name), top.get(name, ABSENT)
                    with path.open("rb") as file:
                        pieces = iter(functools.partial(file.read, COMPARED_BYTES), b"")
                        kept = self._holds(location, expect, path.stat().st_size, pieces, claim)
                    written[name] = (
                        expect
                        if kept
                        else self._blobs.put_file(
                            location, path, PARQUET_CONTENT_TYPE, expect=expect
                        )
                    )
                    space.beat()
                    path.unlink()  # the disk holds one joined file at a time
        except UnfitResults as error:
            raise PoisonMerge(str(error)) from error
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            disk.release()
        return written

    def _holds(
        self, location: S3Location, listed: str, size: int, ours: Iterable[bytes], claim: Claim
    ) -> bool:
        """Whether the output at `location` is still as listed (`listed`, its ETag) and
        holds the `size` bytes `ours`: an earlier merger's write of what this one would
        write (both cut the join as the claim says: `Claim.cut`), which it keeps as it
        is: written again, it would be another version where ETags are not MD5s, and a
        merger stalled past its claim may have named this one in job.json already. Read
        only where it is there and of that size, the claim renewed as it goes."""
        if listed == ABSENT:
            return False
        try:
            if self._blobs.head(location) != ObjectHead(listed, size):
                return False
            theirs = self._blobs.chunks(location, size, expect=listed)
            return same_bytes(theirs, _renewing(ours, claim))
        except (MissingObject, PreconditionFailed, ObjectTooLarge):
            return False

    def _footer(self, location: S3Location, size: int) -> pq.FileMetaData:
        """A shard's Parquet file's columns and row groups, from its footer
        (`read_footer`). `UnfitResults` naming the file if it has none."""
        try:
            return read_footer(self._blobs, location, size)
        except UnfitResults as error:
            raise UnfitResults(f"shard file {location}: {error}") from error

    def _summary(self, plan: Plan, commits: list[Commit], request_id: str | None) -> dict[str, Any]:
        summary = job_summary(
            job_id=plan.job_id,
            request_id=request_id,
            cancelled=any(commit.cancelled for commit in commits),
            items=_items(plan, commits),
            succeeded=sum(commit.succeeded for commit in commits),
            failed=sum(commit.failed for commit in commits),
            resumed=sum(commit.resumed for commit in commits),
            request_digest=plan.request_digest,
            model=plan.model,
            received_at=plan.received_at,
            attempt=plan.attempt,
            worker=self._worker_info,
            device_s=sum(commit.device_s for commit in commits),
            device_hour_price=self._device_hour_price,
            format=plan.format,
        )
        summary["shards"] = {
            "count": plan.shards,
            "attempts": sum(commit.attempt for commit in commits),
        }
        return summary

    def remove(self, spec: JobMessage, plan: Plan) -> bool:
        """The shards' files (the claim with them) and every checkpoint under the output:
        the job is done. Whether they are gone; never raises: whoever removes them
        settles its message only once they are (`Written.shards_left`)."""
        try:
            checkpoints = self._blobs.objects_under(spec.output_location(CHECKPOINT_PREFIX))
            self._blobs.delete(
                shards_files(self._blobs, spec, plan.request_digest)
                + [spec.output_location(CHECKPOINT_PREFIX + name) for name in checkpoints]
            )
        except Exception as error:
            log.warning("shards_not_removed", job_id=plan.job_id, error=repr(error))
            return False
        return True


def _renewing(pieces: Iterable[bytes], claim: Claim) -> Iterator[bytes]:
    """`pieces`, the claim renewed each `RENEW_COMPARED_BYTES` of them."""
    since = 0
    for piece in pieces:
        since += len(piece)
        if since >= RENEW_COMPARED_BYTES:
            claim.renew()
            since = 0
        yield piece


def _items(plan: Plan, commits: list[Commit]) -> int:
    """A merged job's items: its plan's, or the members of every shard's tars."""
    if plan.tar is None:
        return plan.items
    return sum(commit.items or 0 for commit in commits)
