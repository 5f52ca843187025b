"""One job across the fleet, with SQS and S3 as the only engine: no coordinator.

Whoever receives a job with more inputs than its shard size plans it: the inputs go
under its output as one file per shard, then plan.json (written once: a second planner
finds it and uses it), then one message per shard on the same queue, each marked sent;
the job's own message is deleted last, so a redelivery sends only the shards not yet
sent or committed. A shard runs like any job (batched with others, leased,
checkpointed, handed over) and commits once: its results and log under a name of its
run's own, then a commit marker written on condition that none exists. A duplicate run
finds the marker there, removes what it wrote and stops. Whoever commits the last shard
sees every marker (S3 lists what is written, at once) and merges: the parts in input
order into results.jsonl and job.log (copied by S3 where it can), then job.json, fenced
like any job's final writes, then removes the shards' files. A merger that dies is
replaced by its shard's redelivery, which finds its marker written and merges
(`worker.sharding.merging`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from worker.datasets.tables import JSON_LINES, NDJSON, PARQUET, Output
from worker.errors import MissingObject, ObjectTooLarge, PreconditionFailed, TransientError
from worker.jobs.checkpoints import MAX_MARKER_BYTES, Checkpoints
from worker.jobs.job import Job
from worker.jobs.outcomes import Lifecycle
from worker.jobs.plan import (
    DEAD_SUFFIX,
    INPUTS_SUFFIX,
    MAX_PLAN_BYTES,
    PLAN,
    STARTED_SUFFIX,
    Commit,
    Plan,
    RunFile,
    commit_file,
    each_at_once,
    read_commit,
    shard_file,
    watch_body,
    watch_file,
)
from worker.message import JobMessage, PoisonMessage
from worker.ports import ABSENT, SQS_MAX_DELAY_S, BlobStore, JobSource, S3Location
from worker.sharding.claims import MERGE_CLAIM_S, MergingElsewhere, json_object
from worker.sharding.merging import (
    AlreadyMerged,
    Fenced,
    Incomplete,
    Merged,
    Merger,
    Refused,
    Written,
)
from worker.sharding.planning import sweep_replaced

log = structlog.get_logger()

PROGRESS_TRIES = 3  # a progress.json write that another shard beats is tried again
# progress.json holds a count for each shard: at most MAX_SHARDS of about 30 bytes each.
MAX_PROGRESS_BYTES = 4 * 2**20
WATCH_MIN_S = 2  # a watch of a job's stragglers is due at least this far apart
# A watch not taken this long after it was due is lost (its message was dead-lettered):
# the next commit or death arms another.
WATCH_OVERDUE_S = SQS_MAX_DELAY_S
# A watch is the one that counts if the marker says it is due by now, give or take the
# clocks of the worker that armed it and the one that took it.
WATCH_SLACK_S = 5.0


class ModelMismatch(TransientError):
    """A shard planned for another model than this worker's (a rollout): another worker
    runs it, or its redrive ends it in the DLQ."""


class ShardTooLarge(TransientError):
    """A shard whose plan holds more inputs a shard than this worker holds of a job (a
    rollout of a larger --shard-items, or a plan.json forged under the output): left for
    a worker that takes it, or to the queue's redrive."""


class ArmedWatch(NamedTuple):
    """A job's watch marker: its ETag, and when the watch it names is due."""

    etag: str
    due: float | None  # None: written by a worker from before due times

    def later_than(self, due: float) -> bool:
        """Whether a watch due at `due` is to replace this one: this is due later, or
        overdue for so long that its message is taken for lost."""
        if self.due is None:
            return False  # a chain from before due times: it watches on
        now = time.time()
        return self.due > due + WATCH_MIN_S or self.due < now - WATCH_OVERDUE_S


class Shards:
    """Checks a shard against its plan, commits a shard's run, has a job whose shards
    are all committed merged (`Merger`), and keeps its one progress.json (planning:
    `Planner`)."""

    def __init__(
        self,
        blobs: BlobStore,
        source: JobSource,
        checkpoints: Checkpoints,
        lifecycle: Lifecycle,
        merger: Merger,
    ):
        self._blobs = blobs
        self._source = source
        self._checkpoints = checkpoints
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress
        self.merger = merger

    # Running a shard ---------------------------------------------------------

    def open(
        self, spec: JobMessage, model: dict[str, Any], largest: int, largest_tars: int
    ) -> Plan:
        """The plan a shard message belongs to. Poison if it belongs to none (forged, or
        its job was planned again as another request); `ShardTooLarge` if its shards
        hold more inputs than `largest` (tars than `largest_tars`), the most this
        worker holds of a job; `ModelMismatch` if it was planned for another model."""
        assert spec.shard is not None
        plan = self.plan_for(spec, spec.shard.plan)
        most = largest_tars if plan.tar is not None else largest
        if plan.shard_items > most:
            # A plan under the output is anyone's who may write there.
            raise ShardTooLarge(
                f"its plan's shards hold {plan.shard_items} inputs, over the {most} this "
                "worker holds of a job (--shard-items, --shard-tars)"
            )
        index = spec.shard.index
        expected_inputs = str(shard_file(spec, plan.request_digest, index, INPUTS_SUFFIX))
        if (
            plan.job_id != spec.job_id
            or index >= plan.shards
            or spec.manifest != expected_inputs
            or spec.params != plan.params
        ):
            raise PoisonMessage(f"not a shard of the job {PLAN} plans: {spec.shard}")
        if plan.model != model:
            raise ModelMismatch(f"planned for model {plan.model}, this worker runs {model}")
        return plan

    def plan_for(self, spec: JobMessage, digest: str) -> Plan:
        """The plan under the job's output, if it is plan `digest` and the message asks
        for its format (whose outputs it looks for); else poison."""
        try:
            plan = Plan.parse(self._blobs.get(spec.output_location(PLAN), MAX_PLAN_BYTES))
        except MissingObject:
            raise PoisonMessage(f"a shard of a job with no {PLAN} under its output") from None
        if plan.request_digest != digest:
            raise PoisonMessage(f"a shard of plan {digest}, replaced by another request")
        legacy_watch = spec.watch is not None and "format" not in spec.model_fields_set
        if spec.format != plan.format and not legacy_watch:
            raise PoisonMessage(f"a {spec.format} message for a job planned as {plan.format}")
        if spec.shard is not None and spec.tar != plan.tar:
            raise PoisonMessage(f"a shard whose 'tar' ({spec.tar}) is not its plan's ({plan.tar})")
        return plan

    def committed(self, spec: JobMessage, plan: Plan) -> bool:
        """Whether the shard's commit marker is written: a run of it counts already."""
        assert spec.shard is not None
        marker = commit_file(spec, plan.request_digest, spec.shard.index)
        return bool(self._blobs.objects_under(marker))

    def committed_elsewhere(self, job: Job) -> bool:
        """Whether another run of the shard this job runs has committed, or the whole job
        is merged (its shards' files gone): this run is then of no use, and its message
        is deleted. Not a run of another delivery of this same message (SQS delivers at
        least once): that run may be merging, and should it die, this message is what
        brings its merge back; this run goes on instead, and its commit, finding the
        other's marker, sees to the merge (`commit`)."""
        spec, plan = job.spec, job.plan
        assert spec is not None and spec.shard is not None and plan is not None
        index, digest = spec.shard.index, plan.request_digest
        if not self._blobs.objects_under(shard_file(spec, digest, index, INPUTS_SUFFIX)):
            return True
        try:
            committed = read_commit(self._blobs, commit_file(spec, digest, index))
        except MissingObject:
            return False  # or merged since the inputs were listed: its commit finds out
        return not committed.run.endswith(f"-{job.message.message_id}")

    def commit(self, job: Job, summary: dict[str, Any], results: list[Output]) -> Written:
        """Write this run's results (results.jsonl, or its Parquet files) and log, then
        its commit marker if no run of the shard has one; then merge the job if every
        shard is committed (whichever run's commit counts), as `merge` does."""
        spec, plan = job.spec, job.plan
        assert spec is not None and spec.shard is not None and plan is not None
        assert job.log is not None
        merger = job.message.job_message_id
        if job.committed:  # a finish tried again after its merge failed
            return self.merge(spec, plan, merger)
        index, digest = spec.shard.index, plan.request_digest
        run = f"a{job.attempt:04d}-{job.message.message_id}"
        suffixes = [
            JSON_LINES if plan.format == JSON_LINES else f"{number:04d}.{PARQUET}"
            for number in range(len(results))
        ]
        outputs = [
            (shard_file(spec, digest, index, f".{run}.{suffix}"), data, content_type)
            for suffix, (_, data, content_type) in zip(suffixes, results, strict=True)
        ]
        outputs.append((shard_file(spec, digest, index, f".{run}.log"), job.log.lines(), NDJSON))
        written = each_at_once(lambda output: self._put(*output), outputs)
        files = [
            RunFile(name=_name(location), bytes=size)
            for (location, _, _), size in zip(outputs, written, strict=True)
        ]
        commit = Commit(
            run=run,
            results=files[:-1],
            log=files[-1],
            cancelled=job.cancelled,
            succeeded=summary["succeeded"],
            failed=summary["failed"],
            resumed=summary["resumed"],
            attempt=job.attempt,
            device_s=job.device_s,
            seconds=time.time() - (job.started_at or job.received_at),
            items=len(job.inputs) if plan.tar else None,
        )
        marker = commit_file(spec, digest, index)
        try:
            self._blobs.put(
                # Without `items` but for a tar job: a worker of before tars reads it.
                marker,
                commit.model_dump_json(exclude_none=True).encode(),
                "application/json",
                expect=ABSENT,
            )
        except PreconditionFailed:
            # Either another run's marker, or our own: a try whose answer was lost.
            if read_commit(self._blobs, marker).run != run:
                log.info("shard_duplicate", job_id=job.job_id, shard=index, run=run)
                self._blobs.delete([location for location, _, _ in outputs])
                # Before its message goes, as a redelivery of a committed shard does: the
                # other run may be of this same message, and have died merging.
                return self.merge(spec, plan, merger)
        job.committed = True
        log.info("shard_committed", job_id=job.job_id, shard=index, run=run, items=len(job.inputs))
        return self.merge(spec, plan, merger, watch_in_s=watch_delay_s(commit.seconds))

    def merge(
        self,
        spec: JobMessage,
        plan: Plan,
        merger: str,
        *,
        watch_in_s: int = WATCH_MIN_S,
        markers: dict[int, S3Location] | None = None,
    ) -> Written:
        """Merge the job if every shard is committed (`Merger.merge`, as `merger`, with
        the `markers` a watch found), and see to what the answer leaves: the job.json
        this merge wrote, to announce, and what replaced plans left, swept; a watch due
        in `watch_in_s` while shards are left, or while another merger's claim stands
        (should its merger be lost), by when it runs out; the shards' files removed once
        the job is done; a merge fenced off leaves everything to the one that fenced it,
        watched as another's claim, and one refused (its output changed) raises, to be
        tried again."""
        outcome = self.merger.merge(spec, plan, merger, markers)
        match outcome:
            case Merged(summary, shards_left):
                sweep_replaced(self._blobs, spec, plan)
                return Written(summary, shards_left)
            case AlreadyMerged():  # what a merger that died, or a late run, left
                return Written(shards_left=not self.merger.remove(spec, plan))
            case Incomplete():
                self.watch(spec, plan, watch_in_s)
            case MergingElsewhere(until):
                self._watch_claim(spec, plan, until, watch_in_s)
            case Fenced():
                # The merger that took the claim over may be another delivery of this
                # same message, which this one's deletion leaves nothing to bring back
                # should it die: watched as a claim just renewed.
                self._watch_claim(spec, plan, time.time() + MERGE_CLAIM_S, watch_in_s)
            case Refused(reason):  # raised: its message comes back, and merges again
                raise TransientError(f"a write of the merge was refused: {reason}")
        return Written()

    def _watch_claim(self, spec: JobMessage, plan: Plan, until: float, soonest_s: int) -> None:
        """Have a watch due while another merger's claim stands (until `until`), in place
        of one due by now: that one may be the watch merging now, or one that merged and
        ended, the marker naming it still. Were it kept, no watch would follow, and a
        claim whose merger died with its message gone (one delivery of two, the other
        deleting it) would stand unmerged for ever. A watch that finds the claim
        standing again watches again, until the merge ends or the claim runs out and it
        merges: in `soonest_s` while the claim was renewed lately (its merger is at
        work), and later the longer it was not, a few times over a dead merger's
        claim. Never raises."""
        unrenewed_s = math.ceil(MERGE_CLAIM_S - (until - time.time()))
        delay_s = min(claim_watch_delay_s(until), max(soonest_s, unrenewed_s))

        def still_to_come(armed: ArmedWatch) -> bool:
            # Taken at most the clocks' slack early, and no later than this one would be.
            now = time.time()
            soonest, latest = now + WATCH_SLACK_S, now + delay_s + WATCH_MIN_S
            return armed.due is not None and soonest < armed.due <= latest

        self._arm_watch_unless(spec, plan, delay_s, still_to_come)

    def started(self, spec: JobMessage, plan: Plan, *, held: bool) -> None:
        """Note when this run of the shard began, as admitted (a watch compares it with
        the others'); `held`: it waits for a shard before it on this worker (whose tars
        it was copied beside), and the watch gives it a shard's time more before it is a
        straggler. And the shard is alive again if it was dead-lettered (redriven).
        Never raises: without it, the shard is not watched for straggling."""
        assert spec.shard is not None
        started = shard_file(spec, plan.request_digest, spec.shard.index, STARTED_SUFFIX)
        dead = shard_file(spec, plan.request_digest, spec.shard.index, DEAD_SUFFIX)
        note = {"at": time.time(), "held": held}
        try:
            self._blobs.put(started, json.dumps(note).encode(), "application/json")
            self._blobs.delete([dead])
            # Looked at after the note is written: a merge writes job.json before it
            # lists the shards' files to remove, so a note it did not list is seen here.
            if self._checkpoints.finished(spec, plan.job_id, plan.request_digest) is not None:
                self._blobs.delete([started])
        except Exception as error:
            log.warning("shard_start_not_noted", job_id=plan.job_id, error=repr(error))

    def dead_lettered(self, spec: JobMessage, plan: Plan, reason: str) -> None:
        """Note that the shard's message was dead-lettered, and why, and have the job
        watched: a watch that finds only such shards left says the job stalled
        (`worker.sharding.stragglers`) until one is redriven. Never raises: without the note,
        the job's watch goes on."""
        assert spec.shard is not None
        dead = shard_file(spec, plan.request_digest, spec.shard.index, DEAD_SUFFIX)
        note = json.dumps({"at": time.time(), "reason": reason}).encode()
        try:
            self._blobs.put(dead, note, "application/json")
        except Exception as error:
            log.warning("shard_death_not_noted", job_id=plan.job_id, error=repr(error))
            return
        # A watch finds whether every shard left is dead: none may have committed yet.
        self.watch(spec, plan, WATCH_MIN_S)

    def watch(self, spec: JobMessage, plan: Plan, delay_s: int) -> None:
        """Have a worker look at the job's shards `delay_s` from now
        (`worker.sharding.stragglers`), unless a watch is due no later; never raises (without
        one, a straggler only holds the job's end back)."""
        self._arm_watch_unless(
            spec, plan, delay_s, lambda armed: not armed.later_than(time.time() + delay_s)
        )

    def _arm_watch_unless(
        self,
        spec: JobMessage,
        plan: Plan,
        delay_s: int,
        serves: Callable[[ArmedWatch], bool],
    ) -> None:
        """Arm a watch of the job due `delay_s` from now, unless the one the marker names
        `serves` in its place; never raises. The marker is read as listed, and the new
        watch written on condition that it is still that one: one armed meanwhile by
        another worker stands."""
        try:
            marker = watch_file(spec, plan.request_digest)
            armed = self.armed_watch(spec, plan, self._blobs.objects_under(marker).get(""))
            if armed is not None and serves(armed):
                return
            self.arm_watch(spec, plan, delay_s, armed)
        except PreconditionFailed:
            return  # another was armed meanwhile
        except Exception as error:
            log.warning("watch_not_armed", job_id=plan.job_id, error=repr(error))

    def armed_watch(self, spec: JobMessage, plan: Plan, etag: str | None) -> ArmedWatch | None:
        """The job's watch marker, listed with `etag` (None: it is not there): its ETag
        and when the watch it names is due (None for a marker a worker from before due
        times wrote); None if there is none."""
        if etag is None:
            return None
        try:
            marker = self._blobs.get(watch_file(spec, plan.request_digest), MAX_MARKER_BYTES)
        except MissingObject:
            return None
        except ObjectTooLarge:  # not what a worker writes
            marker = b""
        due = json_object(marker).get("due")
        if not isinstance(due, int | float) or isinstance(due, bool):
            return ArmedWatch(etag, None)
        return ArmedWatch(etag, float(due))

    def arm_watch(
        self, spec: JobMessage, plan: Plan, delay_s: int, replaced: ArmedWatch | None
    ) -> None:
        """Name a watch of the job due `delay_s` from now in the marker, on condition
        that the marker is still the watch it replaces as read (`replaced`, None: there
        was none), then send it: `PreconditionFailed` if another was armed meanwhile;
        raises if S3 or SQS fail (a watch not sent is taken out of the marker again,
        `_disarm`)."""
        marker = watch_file(spec, plan.request_digest)
        # Due from before the send: the message is visible no sooner than the marker says.
        note = json.dumps({"due": time.time() + delay_s}).encode()
        expect = replaced.etag if replaced is not None else ABSENT
        etag = self._blobs.put(marker, note, "application/json", expect=expect)
        try:
            self._source.send_many([watch_body(spec, plan)], plan.job_id, delay_s)
        except Exception:
            self._disarm(spec, plan, etag, replaced)
            raise

    def _disarm(self, spec: JobMessage, plan: Plan, etag: str, replaced: ArmedWatch | None) -> None:
        """Put the marker back as it was before a watch whose message was not sent named
        itself there (unless another was armed since): the watch it named before counts
        again, so the chain goes on (a watch re-arming the chain is its own message,
        which comes back); with none before, the marker goes, and the next commit or
        death arms one."""
        marker = watch_file(spec, plan.request_digest)
        try:
            if replaced is None:
                self._blobs.delete([marker])
                return
            due = {} if replaced.due is None else {"due": replaced.due}
            self._blobs.put(marker, json.dumps(due).encode(), "application/json", expect=etag)
        except Exception as error:  # another was armed meanwhile, or S3 fails too
            log.warning("watch_not_disarmed", job_id=plan.job_id, error=repr(error))

    def report(self, job: Job) -> None:
        """Put this shard's count in the job's one progress.json, on condition that it is
        unchanged since read (shards on other workers write it too); never raises. A
        stall noted there goes: the job runs again."""
        spec, plan = job.spec, job.plan
        assert spec is not None and spec.shard is not None and plan is not None
        index = str(spec.shard.index)
        # A tar job's third count: its members (a worker from before tars reads two; it
        # reads no tar job's).
        count = [job.finished_items, job.failed] + ([len(job.inputs)] if plan.tar else [])
        self._update_progress(spec, plan, lambda counts: {**counts, index: count})

    def stalled(self, spec: JobMessage, plan: Plan, shards: list[int], reason: str) -> None:
        """Say in the job's progress.json that nothing left of it can run (`shards`, and
        why), for those who follow it (`worker.client`); never raises."""
        stall = {"shards": shards, "reason": reason}
        self._update_progress(spec, plan, lambda counts: counts, stall)

    def _update_progress(
        self,
        spec: JobMessage,
        plan: Plan,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        stall: dict[str, Any] | None = None,
    ) -> None:
        """Write the job's progress.json with its shards' counts as `change` makes them,
        on condition that it is unchanged since read, tried again if another shard wrote
        first."""
        location = spec.output_location("progress.json")
        for _ in range(PROGRESS_TRIES):
            try:
                etag = self._blobs.objects_under(location).get("", ABSENT)
                current = {} if etag == ABSENT else self._progress_read(location)
                counts = current.get("shards") if current.get("job_id") == plan.job_id else None
                counts = change(counts if isinstance(counts, dict) else {})
                # A tar job's items are its tars' members: those of the shards started.
                items = sum(_count(c, 2) for c in counts.values()) if plan.tar else plan.items
                progress = {
                    "job_id": plan.job_id,
                    "items": items,
                    "finished": sum(_count(value, 0) for value in counts.values()),
                    "failed": sum(_count(value, 1) for value in counts.values()),
                    "shards": counts,
                    **({"stalled": stall} if stall else {}),
                }
                self._blobs.put(
                    location, json.dumps(progress).encode(), "application/json", expect=etag
                )
                return
            except (PreconditionFailed, MissingObject):
                continue  # another shard wrote it between the read and the write
            except Exception as error:
                log.warning("progress_upload_failed", job_id=plan.job_id, error=repr(error))
                return
        # Beaten every time: the next report (this shard's, or another's) carries it.
        log.warning("progress_not_updated", job_id=plan.job_id, tries=PROGRESS_TRIES)

    def _progress_read(self, location: S3Location) -> dict[str, Any]:
        """The job's progress.json as an object; empty if it is not one a worker wrote
        (over a size no count of its shards reaches)."""
        try:
            return json_object(self._blobs.get(location, MAX_PROGRESS_BYTES))
        except ObjectTooLarge:
            return {}

    def _put(self, location: S3Location, data: bytes | Path, content_type: str) -> int:
        """Write one file of a run; its size."""
        if isinstance(data, Path):
            self._blobs.put_file(location, data, content_type)
            return data.stat().st_size
        self._blobs.put(location, data, content_type)
        return len(data)


def _name(location: S3Location) -> str:
    return location.key.rsplit("/", 1)[1]


def _count(value: Any, position: int) -> int:
    """A shard's count in progress.json, which anyone may have written: 0 if not one."""
    if not isinstance(value, list) or len(value) not in (2, 3) or position >= len(value):
        return 0
    count = value[position]
    return max(0, count) if isinstance(count, int) and not isinstance(count, bool) else 0


def claim_watch_delay_s(until: float) -> int:
    """How long from now a watch is due that finds whether a merge claim held until
    `until` (epoch seconds) ended in a merge: just after it runs out, within SQS's
    delays."""
    return min(SQS_MAX_DELAY_S, max(WATCH_MIN_S, math.ceil(until - time.time()) + 1))


def watch_delay_s(shard_s: float) -> int:
    """How long after a commit, or a watch, the next watch of the job is due: half a
    shard's time, within SQS's delays."""
    return min(SQS_MAX_DELAY_S, max(WATCH_MIN_S, round(shard_s / 2)))
