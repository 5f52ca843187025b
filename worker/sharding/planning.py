"""Planning a job too big for one worker into shards (`worker.sharding.shards` runs and
merges them): its listing taken once, as a snapshot on this machine's disk, then
plan.json written once, then its inputs under its output as a file per shard, as the
plan that stands splits the snapshot, a message per shard, the job's own message
deleted last.

A listing may change while it is read, or between two deliveries of the job's message
(a prefix still receiving objects): the plan is of the snapshot alone, and a plan whose
shards this same message sent already stands whatever the listing says now. A plan is
replaced only by another request (another message, or one that sent none of its
shards): the replaced plan's shards are acked where they come (`replaced`), and what
they left under `shards/` is swept once the job is merged (`sweep_replaced`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from worker.datasets.disk import DiskClaim
from worker.datasets.inputs import Input, shard_line_listed, shard_lines
from worker.datasets.table_ranges import TableRows, listed_items
from worker.datasets.texts import TextInput
from worker.errors import MissingObject, PreconditionFailed, TransientError
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job, JobSettled
from worker.jobs.outcomes import Lifecycle
from worker.jobs.plan import (
    INPUTS_SUFFIX,
    MAX_PLAN_BYTES,
    PLAN,
    SENT_SUFFIX,
    Plan,
    commit_markers,
    commits_directory,
    each_at_once,
    shard_body,
    shard_directory,
    shard_file,
    shard_name,
    shards_files,
)
from worker.message import JobMessage, PoisonMessage
from worker.ports import ABSENT, SQS_MAX_ENTRIES_PER_BATCH_CALL, BlobStore, JobSource, S3Location
from worker.sharding.claims import open_claim

log = structlog.get_logger()

SHARDS_DIR = "shards/"
MAX_SENT_NOTE_BYTES = 1024  # a `.sent` note: the id of the message that sent the shard
SNAPSHOT_WRITE_BYTES = 2**16  # written (and claimed of the disk budget) at a time
# A job whose plan another run of it is running looks again this long after.
RUN_WAIT_S = 60


class Snapshot:
    """A job's listing as it was read once, in a file of this machine's disk (a line an
    input, as a shard's inputs file holds them: a line a run of rows of a Parquet table
    of texts planned as row ranges), read back as often as planning needs; removed once
    the job is planned. Its bytes are claimed of the daemon's disk budget (`claim`)
    before they are written, about `SNAPSHOT_WRITE_BYTES` at a time."""

    def __init__(self, directory: Path, claim: DiskClaim):
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix="listing-", dir=directory)
        self._path = Path(name)
        self._file = os.fdopen(descriptor, "wb")
        self._claim = claim
        self._pending: list[Input] = []
        self._pending_bytes = 0  # about what they hold: their names and texts

    def add(self, listed: Input) -> None:
        self._pending.append(listed)
        text = listed.uri.text if isinstance(listed.uri, TextInput) else None
        self._pending_bytes += len(listed.uri) + len(text or "")
        if self._pending_bytes >= SNAPSHOT_WRITE_BYTES:
            self._write_pending()

    def _write_pending(self) -> None:
        data = b"".join(shard_lines(self._pending))
        self._claim.grow(len(data))
        self._file.write(data)
        self._pending, self._pending_bytes = [], 0

    def inputs(self) -> Iterator[Input]:
        """The inputs added, in order (the file is this daemon's own, so not checked)."""
        self._write_pending()
        self._file.flush()
        with self._path.open("rb") as lines:
            yield from map(shard_line_listed, lines)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._file.close()
        self._path.unlink(missing_ok=True)
        self._claim.release()


class Planner:
    """Plans a job into shards, or takes the plan written for it, and sends them."""

    def __init__(self, blobs: BlobStore, source: JobSource, lifecycle: Lifecycle):
        self._blobs = blobs
        self._source = source
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress
        self._checkpoints = Checkpoints(blobs, lifecycle.ledger)

    def plan(
        self, job: Job, spec: JobMessage, new_plan: Plan, inputs: Callable[[], Iterator[Input]]
    ) -> None:
        """Plan the job (or take the plan written for it already), write the inputs
        files of the shards not yet sent or committed as the plan that stands splits
        the job's `inputs` (its `Snapshot`), send those shards, and delete the job's message.
        Raises if any of it fails: the message comes back, and its next delivery goes on
        from there.

        The files follow the plan, never this planner's own shard size: a second planner
        (a rollout of another `--shard-items`, a redelivery) that loses the race for
        plan.json writes the same files the first does, not files of other ranges."""
        sender = job.message.job_message_id
        plan, replaces = self._written_plan(spec, new_plan.request_digest)
        if plan is None and replaces != ABSENT:
            plan = self._sent_by(spec, sender)
        if plan is None:
            plan = self._publish(spec, new_plan, replaces)
        elif plan.request_digest != new_plan.request_digest:
            # Its listing changed since this message sent shards of the plan.
            log.info("plan_kept", job_id=plan.job_id, listed=new_plan.request_digest)
        unsent = self._unsent(spec, plan)
        if len(unsent) < plan.shards and self._sender(spec, plan) not in (None, sender):
            # Another message sent its shards: another run of this same request (the job
            # sent again, with another request id, while that run goes on), whose
            # job.json will name that run. This one waits for it to end, then finds its
            # job.json (a copy of that message) or runs again, where it was acked and
            # never answered (or sent the shards left, with its own request id).
            log.info("plan_running_for_another_message", job_id=plan.job_id)
            self._outcomes.hand_over(job, "another run of the job is running", RUN_WAIT_S)
            return
        if unsent and plan.request_digest == new_plan.request_digest:
            self._write_inputs(job, spec, plan, inputs(), frozenset(unsent))
            # Another delivery of the message may have sent the shards, and they merged.
            if self._merged_meanwhile(job, spec, plan):
                return
        self._send(job, spec, plan, unsent, sender)
        # The shards sent may have merged before they were marked sent.
        if self._merged_meanwhile(job, spec, plan):
            return
        log.info(
            "job_planned",
            job_id=plan.job_id,
            items=plan.items,
            shards=plan.shards,
            sent_now=len(unsent),
            message_id=job.message.message_id,
        )
        self._outcomes.ack(job)

    def _merged_meanwhile(self, job: Job, spec: JobMessage, plan: Plan) -> bool:
        """Ack the job if it is merged, having removed what this planner wrote under its
        shards since: looked at after the writes, as a merge writes job.json before it
        lists the shards' files to remove, so a file it did not list is seen here."""
        if self.finished(spec, plan.job_id, plan.request_digest) is None:
            return False
        log.info("job_merged_while_planned", job_id=plan.job_id)
        self._outcomes.ack(job)
        return True

    def finished(self, spec: JobMessage, job_id: str, digest: str) -> dict[str, Any] | None:
        """The job.json under the output if it completes request `digest`, what a planner
        wrote under its shards after their merge removed first: a delivery of the job's
        message that wrote its inputs files late and died before it saw the job merged
        left them for the next delivery, which finds the job done."""
        summary = self._checkpoints.finished(spec, job_id, digest)
        if summary is not None:
            self._blobs.delete(shards_files(self._blobs, spec, digest))
        return summary

    def _written_plan(self, spec: JobMessage, digest: str) -> tuple[Plan | None, str]:
        """The plan under the job's output if it is this request's; else None and the
        ETag a new plan must replace (`ABSENT` if there is none)."""
        etag = self._blobs.objects_under(spec.output_location(PLAN)).get("", ABSENT)
        if etag == ABSENT:
            return None, ABSENT
        try:
            plan = Plan.parse(self._blobs.get(spec.output_location(PLAN), MAX_PLAN_BYTES))
        except (MissingObject, PoisonMessage):
            return None, etag
        return (plan, etag) if plan.request_digest == digest else (None, etag)

    def _sent_by(self, spec: JobMessage, sender: str) -> Plan | None:
        """The plan under the output if an earlier delivery of this same message (its
        first id, `sender`) sent any of its shards: the listing changed since, and the
        plan stands (its inputs files were all written before any shard was sent).
        Else, with nothing of it running, it is replaced at no cost."""
        try:
            plan = Plan.parse(self._blobs.get(spec.output_location(PLAN), MAX_PLAN_BYTES))
        except (MissingObject, PoisonMessage):
            return None
        return plan if self._sender(spec, plan) == sender else None

    def _sender(self, spec: JobMessage, plan: Plan) -> str | None:
        """The first id of the job's message that sent `plan`'s shards (as its first
        shard marked sent names it); None if none is marked."""
        directory = shard_directory(spec, plan.request_digest)
        listing = self._blobs.objects_under(directory)
        sent = next((name for name in sorted(listing) if name.endswith(SENT_SUFFIX)), None)
        if sent is None:
            return None
        try:
            note = self._blobs.get(
                S3Location(directory.bucket, directory.key + sent), MAX_SENT_NOTE_BYTES
            )
        except Exception:  # gone (merged meanwhile), or not a planner's
            return None
        return note.decode(errors="replace")

    def _write_inputs(
        self,
        job: Job,
        spec: JobMessage,
        plan: Plan,
        inputs: Iterator[Input],
        shards: frozenset[int],
    ) -> None:
        """The inputs files of `shards`, one each, as the job's snapshot streams past
        (two shards' inputs held at most); none more once the job's message is settled
        (handed back at shutdown)."""

        def write(shard: int, listed: list[Input]) -> None:
            data = b"".join(shard_lines(listed))
            location = shard_file(spec, plan.request_digest, shard, INPUTS_SUFFIX)
            self._blobs.put(location, data, "text/plain")
            self._progress.beat()

        # A shard's file is written while the next shard's inputs are read: two shards'
        # inputs held at most (writers side by side held one each, up to 17).
        cut = shards_of(inputs, plan.shard_items)
        with ThreadPoolExecutor(1, thread_name_prefix="shard-inputs") as writer:
            writing: Future[None] | None = None
            for shard in range(plan.shards):
                listed = next(cut, [])
                if writing is not None:
                    writing.result()
                if job.settled:
                    raise JobSettled(f"{plan.job_id} was settled while its shards were written")
                writing = writer.submit(write, shard, listed) if shard in shards else None
            if writing is not None:
                writing.result()

    def _publish(self, spec: JobMessage, plan: Plan, replaces: str) -> Plan:
        """Write plan.json unless another planner was first; the plan that stands."""
        data = plan.model_dump_json(exclude_none=True).encode()  # no "tar" but for a tar job
        open_claim(self._blobs, spec, plan.request_digest)
        try:
            self._blobs.put(spec.output_location(PLAN), data, "application/json", expect=replaces)
            return plan
        except PreconditionFailed:
            written, _ = self._written_plan(spec, plan.request_digest)
            if written is None:
                raise TransientError("another request's plan was written meanwhile") from None
            return written

    def _unsent(self, spec: JobMessage, plan: Plan) -> list[int]:
        """The shards neither marked sent nor committed."""
        listing = self._blobs.objects_under(shard_directory(spec, plan.request_digest))
        commits = self._blobs.objects_under(commits_directory(spec, plan.request_digest))
        committed = commit_markers(spec, plan, listing, commits)
        return [
            shard
            for shard in range(plan.shards)
            if f"{shard_name(shard)}{SENT_SUFFIX}" not in listing and shard not in committed
        ]

    def _send(self, job: Job, spec: JobMessage, plan: Plan, unsent: list[int], sender: str) -> None:
        """Send the shards `unsent`, ten to a call, each call's shards then marked sent
        by `sender` (the job's message, whose redelivery keeps the plan); none once the
        job's message is settled (handed back at shutdown: its next delivery sends them,
        where this one's would be duplicates)."""
        for start in range(0, len(unsent), SQS_MAX_ENTRIES_PER_BATCH_CALL):
            if job.settled:
                raise JobSettled(f"{plan.job_id} was settled while its shards were sent")
            chunk = unsent[start : start + SQS_MAX_ENTRIES_PER_BATCH_CALL]
            self._source.send_many([shard_body(spec, plan, shard) for shard in chunk], plan.job_id)
            each_at_once(
                lambda shard: self._blobs.put(
                    shard_file(spec, plan.request_digest, shard, SENT_SUFFIX),
                    sender.encode(),
                    "text/plain",
                ),
                chunk,
            )
            self._progress.beat()


def shards_of(listed: Iterable[Input], shard_items: int) -> Iterator[list[Input]]:
    """`listed` cut into shards of `shard_items` items (the last may hold fewer), a run
    of a table's rows (`TableRows`) cut where a shard ends."""
    shard: list[Input] = []
    room = shard_items
    for each in listed:
        left = each
        while isinstance(left.uri, TableRows) and left.uri.row_count > room:
            filled, rest = left.uri.cut(room)
            yield [*shard, Input(filled)]
            shard, room, left = [], shard_items, Input(rest)
        shard.append(left)
        room -= listed_items(left.uri)
        if room == 0:
            yield shard
            shard, room = [], shard_items
    if shard:
        yield shard


def standing_plan(blobs: BlobStore, spec: JobMessage) -> str | None:
    """The request whose plan stands under the job's output, if one does."""
    with contextlib.suppress(MissingObject, PoisonMessage):
        return Plan.parse(blobs.get(spec.output_location(PLAN), MAX_PLAN_BYTES)).request_digest
    return None


def replaced(blobs: BlobStore, spec: JobMessage, digest: str) -> bool:
    """Whether plan `digest` was replaced by another request's: a message of it (a
    shard, a watch) is then of no use, and acked, not dead-lettered."""
    return standing_plan(blobs, spec) not in (None, digest)


def sweep_replaced(blobs: BlobStore, spec: JobMessage, plan: Plan) -> None:
    """Remove what plans replaced by `plan` left under the output's `shards/` (the
    inputs files, runs, commits and notes of their shards), once `plan`'s job is
    merged; never raises. Listed first, then the plan read: a later request's plan is
    written before its shards' files, so none of its files is in the listing. Nothing
    listed but `plan`'s own (what a job's merge leaves, most often nothing): no plan to
    read, nothing to remove."""
    try:
        shards = spec.output_location(SHARDS_DIR)
        own = f"{shards.key}{plan.request_digest}/"
        listing = [key for key in blobs.keys_under(shards) if not key.startswith(own)]
        if not listing:
            return
        standing = standing_plan(blobs, spec) or plan.request_digest
        swept = [
            S3Location(shards.bucket, key)
            for key in listing
            if not key.startswith(f"{shards.key}{standing}/")
        ]
        if swept:
            blobs.delete(swept)
            log.info("replaced_plans_swept", job_id=plan.job_id, objects=len(swept))
    except Exception as error:
        log.warning("replaced_plans_not_swept", job_id=plan.job_id, error=repr(error))
