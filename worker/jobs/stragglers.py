"""Stragglers: a planned job's shards that run far longer than the others (a slow or
stuck machine) get a duplicate that an idle worker runs, with no coordinator.

Each commit that leaves shards to run has a watch sent: a message for the job, delayed
by half a shard's time, one at a time per job (the `watch` marker under its shards).
Whoever receives it looks at the shards: once every shard has started (nothing of the
job waits in the queue: workers are coming free), a shard not committed whose run began
more than `STRAGGLER_FACTOR` median shard times ago gets one duplicate message (marked
`<n>.duplicated`, so once). An idle worker takes it and resumes from the straggler's
checkpoints; the first of the two to commit counts, and the other stops
(`Shards.committed_elsewhere`). While shards are left, the watch is sent again, but
for a job whose every shard left was dead-lettered (`<n>.dead`): nothing can end it
until one is redriven, whose commit sets a watch again.
"""

from __future__ import annotations

import json
import statistics
import time

import structlog

from worker.errors import MissingObject, PreconditionFailed
from worker.jobs.job import Job
from worker.jobs.message import JobMessage
from worker.jobs.outcomes import Outcomes
from worker.jobs.plan import (
    COMMIT_SUFFIX,
    DEAD_SUFFIX,
    DUPLICATED_SUFFIX,
    INPUTS_SUFFIX,
    STARTED_SUFFIX,
    Plan,
    shard_body,
    shard_directory,
    shard_file,
    shard_name,
    watch_body,
    watch_file,
)
from worker.jobs.shards import Shards, each_at_once, watch_delay_s
from worker.ports import ABSENT, BlobStore, JobSource, S3Location

log = structlog.get_logger()

# A shard whose run began this many median shard times ago, and has not committed, is a
# straggler.
STRAGGLER_FACTOR = 2.0
MEDIAN_SAMPLE = 51  # committed shards whose times give the median


class Stragglers:
    """Takes a job's watch messages: duplicates its stragglers, and watches again."""

    def __init__(
        self,
        blobs: BlobStore,
        source: JobSource,
        shards: Shards,
        outcomes: Outcomes,
        *,
        lost_after_s: float,
    ):
        """A duplicated shard none of whose runs started for `lost_after_s` (longer than
        any run lasts before it is handed over) is taken for lost: its messages are
        gone, moved to the DLQ by the queue's redrive policy."""
        self._blobs = blobs
        self._source = source
        self._shards = shards
        self._outcomes = outcomes
        self._lost_after_s = lost_after_s

    def watch(self, job: Job, spec: JobMessage) -> None:
        """Look at the job's shards once, send duplicates of its stragglers and the next
        watch (or none, once every shard is committed), then delete the message. Raises
        if S3 or SQS fail: the watch comes back later."""
        assert spec.watch is not None
        plan = self._shards.plan_for(spec, spec.watch)
        # A watch sent before watches carried the job's format (a rolling upgrade).
        spec = spec.model_copy(update={"format": plan.format})
        directory = shard_directory(spec, plan.request_digest)
        listing = self._blobs.objects_under(directory)

        def has(shard: int, suffix: str) -> bool:
            return f"{shard_name(shard)}{suffix}" in listing

        left = [shard for shard in range(plan.shards) if not has(shard, COMMIT_SUFFIX)]
        if not left or not any(name.endswith(INPUTS_SUFFIX) for name in listing):
            # Merged, or to merge: the last committer's merge may have failed for good.
            if self._shards.merge_if_complete(spec, plan) is None:
                self._shards.remove(spec, plan)
            self._outcomes.ack(job)
            return
        if all(has(shard, DEAD_SUFFIX) for shard in left):
            self._stall(spec, plan, left, self._dead_reason(spec, plan, left[0]))
            self._outcomes.ack(job)
            return
        committed = [shard for shard in range(plan.shards) if has(shard, COMMIT_SUFFIX)]
        commits = each_at_once(
            lambda shard: self._shards.commit_at(directory, f"{shard_name(shard)}{COMMIT_SUFFIX}"),
            committed[:MEDIAN_SAMPLE],
        )
        if not commits:  # a watch no commit set (forged): nothing to compare with
            self._outcomes.ack(job)
            return
        shard_s = statistics.median(commit.seconds for commit in commits)
        # A dead shard may never have started: it runs no more either way.
        if all(has(s, STARTED_SUFFIX) or has(s, DEAD_SUFFIX) for s in range(plan.shards)):
            running = self._running_s(spec, plan, [s for s in left if not has(s, DEAD_SUFFIX)])
            lost = [
                shard
                for shard, running_s in running.items()
                if has(shard, DUPLICATED_SUFFIX) and running_s > self._lost_after_s
            ]
            if lost and all(has(shard, DEAD_SUFFIX) or shard in lost for shard in left):
                reason = (
                    f"no run of shards {lost} started for over {self._lost_after_s:.0f} s, a "
                    "duplicate's included: their messages are gone (the queue's redrive policy)"
                )
                self._stall(spec, plan, left, reason)
                self._outcomes.ack(job)
                return
            for shard, running_s in running.items():
                late = running_s > STRAGGLER_FACTOR * shard_s
                if late and not has(shard, DUPLICATED_SUFFIX):
                    self._duplicate(spec, plan, shard, running_s, shard_s)
        self._source.send_many([watch_body(spec, plan)], plan.job_id, watch_delay_s(shard_s))
        self._outcomes.ack(job)

    def _stall(self, spec: JobMessage, plan: Plan, left: list[int], reason: str | None) -> None:
        """No shard left can run: they were dead-lettered, or their messages are gone.
        Nothing can end the job until one is redriven (or the job sent again), so the
        watch stops; its marker goes, so that the next commit (a redriven shard's) sets
        one again."""
        log.warning("job_stalled", job_id=plan.job_id, shards_left=left, reason=reason)
        self._blobs.delete([watch_file(spec, plan.request_digest)])

    def _dead_reason(self, spec: JobMessage, plan: Plan, shard: int) -> str | None:
        """Why a worker dead-lettered the shard, as it noted it."""
        try:
            dead = self._blobs.get(shard_file(spec, plan.request_digest, shard, DEAD_SUFFIX))
            reason = json.loads(dead).get("reason")
        except (MissingObject, ValueError, AttributeError):
            return None  # removed meanwhile (redriven), or not what a worker writes
        return reason if isinstance(reason, str) else None

    def _running_s(self, spec: JobMessage, plan: Plan, shards: list[int]) -> dict[int, float]:
        """How long ago the latest run of each of `shards` started, where one noted it."""

        def since_start(shard: int) -> float | None:
            marker = shard_file(spec, plan.request_digest, shard, STARTED_SUFFIX)
            try:
                return time.time() - float(json.loads(self._blobs.get(marker))["at"])
            except MissingObject:
                return None  # committed and removed meanwhile
            except (ValueError, KeyError, TypeError):
                return None  # not what a run writes: nothing to go by

        started = each_at_once(since_start, shards)
        return {shard: s for shard, s in zip(shards, started, strict=True) if s is not None}

    def _duplicate(
        self, spec: JobMessage, plan: Plan, shard: int, running_s: float, shard_s: float
    ) -> None:
        digest = plan.request_digest
        # Sent, then marked: a watch that dies between the two sends another at most.
        self._source.send_many([shard_body(spec, plan, shard)], plan.job_id)
        marker: S3Location = shard_file(spec, digest, shard, DUPLICATED_SUFFIX)
        try:
            self._blobs.put(marker, b"", "text/plain", expect=ABSENT)
        except PreconditionFailed:
            return  # another watch sent one too: the commit keeps one result
        log.info(
            "straggler_duplicated",
            job_id=plan.job_id,
            shard=shard,
            running_s=round(running_s, 1),
            median_shard_s=round(shard_s, 1),
        )
