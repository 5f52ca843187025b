"""Watching a planned job's shards, with no coordinator: stragglers (a slow or stuck
machine) get a duplicate that an idle worker runs; shards whose messages are gone get
one too; a job none of whose shards left can run is said to have stalled.

A watch is a message for the job, delayed, one due at a time per job: the `watch`
marker under its shards says when the one that counts is due. Each commit arms one due
half a shard's time later, and each shard dead-lettered one due at once, either
replacing a watch due later (or one long overdue: its message was lost); a watch that
finds the marker due later than itself was superseded and ends. Whoever receives the
one that counts looks at the shards:

- every shard left dead-lettered (`<n>.dead`): the job stalled (progress.json says so
  and why), and the watch stops until one is redriven, whose commit or death arms one;
- once every shard has started (nothing of the job waits in the queue: workers are
  coming free), a shard not committed whose run began more than `STRAGGLER_FACTOR`
  median shard times ago (before any commit: longer than a run can last) gets one
  duplicate message (marked `<n>.duplicated`, so once). An idle worker takes it and
  resumes from the straggler's checkpoints; the first of the two to commit counts, and
  the other stops (`Shards.committed_elsewhere`);
- a shard that never started, while nothing else of the job runs and the job was
  planned longer ago than that, gets a duplicate too: its message was moved to the DLQ
  by the queue's redrive policy before any run of it began, so no worker noted it;
- duplicated shards none of whose runs started for longer than a run can last, with
  nothing else left: their messages are gone too, and the job stalled.

While shards are left, the watch is armed again: half a median shard time on, or,
before any commit, `UNTIMED_WATCH_S`.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog

from worker.errors import MissingObject, PreconditionFailed
from worker.jobs.checkpoints import MAX_MARKER_BYTES
from worker.jobs.job import Job
from worker.jobs.outcomes import Outcomes
from worker.jobs.plan import (
    DEAD_SUFFIX,
    DUPLICATED_SUFFIX,
    INPUTS_SUFFIX,
    STARTED_SUFFIX,
    WATCH,
    Plan,
    commit_markers,
    commits_directory,
    each_at_once,
    read_commit,
    shard_body,
    shard_directory,
    shard_file,
    shard_name,
    watch_file,
)
from worker.message import JobMessage, PoisonMessage
from worker.ports import ABSENT, SQS_MAX_DELAY_S, BlobStore, JobSource, S3Location
from worker.sharding.planning import replaced
from worker.sharding.shards import WATCH_SLACK_S, Shards, watch_delay_s

log = structlog.get_logger()

# A shard whose run began this many median shard times ago, and has not committed, is a
# straggler.
STRAGGLER_FACTOR = 2.0
MEDIAN_SAMPLE = 51  # committed shards whose times give the median
# Before any shard commits there is no shard time to pace watches by.
UNTIMED_WATCH_S = SQS_MAX_DELAY_S
# A watch re-arms the chain at least this far ahead: more than twice the slack a watch
# counts within, so that of two chains at once (a commit armed a sooner watch, the
# later one's message still comes), the later finds the marker due past its slack and
# ends, where with watches 2 s apart both counted and re-armed in turn for ever.
CHAIN_MIN_S = math.ceil(2 * WATCH_SLACK_S) + 1


class Stragglers:
    """Takes a job's watch messages: duplicates its stragglers, and watches again."""

    def __init__(
        self,
        blobs: BlobStore,
        source: JobSource,
        shards: Shards,
        outcomes: Outcomes,
        *,
        announce_merged: Callable[[JobMessage, Plan, dict[str, Any] | None, Job], bool],
        lost_after_s: float,
    ):
        """A duplicated shard none of whose runs started for `lost_after_s` (longer than
        any run lasts before it is handed over) is taken for lost: its messages are
        gone, moved to the DLQ by the queue's redrive policy."""
        self._blobs = blobs
        self._source = source
        self._shards = shards
        self._outcomes = outcomes
        # The notices of a job merged, or found merged and not announced, by a watch
        # (`Notices.merged`): False if one was not sent.
        self._announce_merged = announce_merged
        self._lost_after_s = lost_after_s

    def watch(self, job: Job, spec: JobMessage) -> None:
        """Look at the job's shards once: say it stalled, or send duplicates and the next
        watch (none once every shard is committed), then delete the message. Raises if
        S3 or SQS fail: the watch comes back later."""
        plan = self._plan(job, spec)
        if plan is None:
            return
        # A watch sent before watches carried the job's format (a rolling upgrade).
        spec = spec.model_copy(update={"format": plan.format})
        listing = self._blobs.objects_under(shard_directory(spec, plan.request_digest))
        commits = self._blobs.objects_under(commits_directory(spec, plan.request_digest))
        markers = commit_markers(spec, plan, listing, commits)

        def has(shard: int, suffix: str) -> bool:
            return f"{shard_name(shard)}{suffix}" in listing

        left = [shard for shard in range(plan.shards) if shard not in markers]
        if not left or not any(name.endswith(INPUTS_SUFFIX) for name in listing):
            self._merge(job, spec, plan, markers)
            return
        armed = self._shards.armed_watch(spec, plan, listing.get(WATCH))
        if armed is None or (armed.due is not None and armed.due > time.time() + WATCH_SLACK_S):
            # Superseded by a watch due sooner, or the job stalled meanwhile.
            log.info("watch_superseded", job_id=plan.job_id)
            self._outcomes.ack(job)
            return
        alive = [shard for shard in left if not has(shard, DEAD_SUFFIX)]
        if not alive:
            self._stall(spec, plan, left, self._dead_reason(spec, plan, left[0]))
            self._outcomes.ack(job)
            return
        sample = each_at_once(
            lambda marker: read_commit(self._blobs, marker),
            list(markers.values())[:MEDIAN_SAMPLE],
        )
        shard_s = statistics.median(commit.seconds for commit in sample) if sample else None
        # How long a shard may take before it is taken for stuck: before any commit there
        # is nothing to compare with, but a run's longest.
        patience_s = STRAGGLER_FACTOR * shard_s if shard_s is not None else self._lost_after_s
        runs = self._notes(spec, plan, [s for s in alive if has(s, STARTED_SUFFIX)], STARTED_SUFFIX)
        ages = {shard: age for shard, (age, _) in runs.items()}
        # A run holding a shard behind another's turn waits for about one shard first.
        held = {shard for shard, (_, holding) in runs.items() if holding}
        waiting = [shard for shard in alive if shard not in ages]
        duplicated = [shard for shard in alive if has(shard, DUPLICATED_SUFFIX)]
        # A duplicate's age counts from when it was sent, if no run of it began since.
        ages |= {
            shard: age
            for shard, (age, _) in self._notes(spec, plan, duplicated, DUPLICATED_SUFFIX).items()
            if age < ages.get(shard, age + 1)
        }
        unsent = [shard for shard in waiting if shard not in duplicated]
        if unsent:
            planned_s = time.time() - plan.received_at
            if len(waiting) == len(alive) and planned_s > patience_s:
                # Nothing of the job runs, yet shards never started: their messages are
                # gone (dead-lettered by the queue's redrive policy before any run
                # began). One a watch: a fleet merely busy loses little by it.
                self._duplicate(spec, plan, unsent[0], "never started")
        else:
            lost = [shard for shard in duplicated if ages.get(shard, 0) > self._lost_after_s]
            if lost and set(lost) == set(alive):
                reason = (
                    f"no run of shards {lost} started for over {self._lost_after_s:.0f} s, a "
                    "duplicate's included: their messages are gone (the queue's redrive policy)"
                )
                self._stall(spec, plan, left, reason)
                self._outcomes.ack(job)
                return
            for shard, age in ages.items():
                waited_s = (shard_s or 0.0) if shard in held else 0.0
                if age > patience_s + waited_s and shard not in duplicated:
                    self._duplicate(spec, plan, shard, f"running {age:.0f} s")
        delay_s = watch_delay_s(shard_s) if shard_s is not None else UNTIMED_WATCH_S
        with contextlib.suppress(PreconditionFailed):  # another was armed meanwhile
            # Raises if the send fails: the marker names this watch again, whose message
            # comes back and goes on.
            self._shards.arm_watch(spec, plan, max(delay_s, CHAIN_MIN_S), armed)
        self._outcomes.ack(job)

    def _plan(self, job: Job, spec: JobMessage) -> Plan | None:
        """The plan the watch is of; None if another request's replaced it (the watch
        is acked: there is nothing of it to watch)."""
        assert spec.watch is not None
        try:
            return self._shards.plan_for(spec, spec.watch)
        except PoisonMessage:
            if not replaced(self._blobs, spec, spec.watch):
                raise
        log.info("watch_superseded", job_id=spec.job_id, plan=spec.watch, why="replaced")
        self._outcomes.ack(job)
        return None

    def _merge(
        self, job: Job, spec: JobMessage, plan: Plan, markers: dict[int, S3Location]
    ) -> None:
        """Every shard committed (each with its marker, `markers`): merge the job (the
        last committer's merge may have failed for good), or find it merged; its notices
        go before the ack: a watch whose send failed comes back, and finds the job
        merged and not announced."""
        written = self._shards.merge(spec, plan, job.message.job_message_id, markers=markers)
        announced = self._announce_merged(spec, plan, written.summary, job)
        self._outcomes.settle_written(job, announced=announced, shards_left=written.shards_left)

    def _stall(self, spec: JobMessage, plan: Plan, left: list[int], reason: str | None) -> None:
        """No shard left can run: they were dead-lettered, or their messages are gone.
        Nothing can end the job until one is redriven (or the job sent again), so the
        watch stops, and progress.json says why; the marker goes, so that the next
        commit or death (a redriven shard's) arms a watch again."""
        reason = reason or "its shards left were dead-lettered"
        log.warning("job_stalled", job_id=plan.job_id, shards_left=left, reason=reason)
        self._shards.stalled(spec, plan, left, reason)
        self._blobs.delete([watch_file(spec, plan.request_digest)])

    def _dead_reason(self, spec: JobMessage, plan: Plan, shard: int) -> str | None:
        """Why a worker dead-lettered the shard, as it noted it."""
        try:
            marker = shard_file(spec, plan.request_digest, shard, DEAD_SUFFIX)
            dead = self._blobs.get(marker, MAX_MARKER_BYTES)
            reason = json.loads(dead).get("reason")
        except (MissingObject, ValueError, AttributeError):
            # Removed meanwhile (redriven), or not what a worker writes (too large too).
            return None
        return reason if isinstance(reason, str) else None

    def _notes(
        self, spec: JobMessage, plan: Plan, shards: list[int], suffix: str
    ) -> dict[int, tuple[float, bool]]:
        """How long ago each of `shards` was last noted with `suffix` (its latest run
        began or took the shard, or a duplicate was sent), where the note says when; and
        whether the run holds it waiting for another shard's turn (`Shards.started`)."""

        def note(shard: int) -> tuple[float, bool] | None:
            marker = shard_file(spec, plan.request_digest, shard, suffix)
            try:
                fields = json.loads(self._blobs.get(marker, MAX_MARKER_BYTES))
                return time.time() - float(fields["at"]), fields.get("held") is True
            except MissingObject:
                return None  # committed and removed meanwhile
            except (ValueError, KeyError, TypeError, AttributeError):
                # Not what a worker writes (too large too), or before duplicates said when.
                return None

        noted = each_at_once(note, shards)
        return {shard: value for shard, value in zip(shards, noted, strict=True) if value}

    def _duplicate(self, spec: JobMessage, plan: Plan, shard: int, why: str) -> None:
        """Send the shard once more, marked first: a watch that fails between the two
        (and comes back) sends none at all, where one sending first sent another on each
        try while the mark failed; the mark is taken back if the send fails."""
        marker: S3Location = shard_file(spec, plan.request_digest, shard, DUPLICATED_SUFFIX)
        note = json.dumps({"at": time.time()}).encode()
        try:
            self._blobs.put(marker, note, "application/json", expect=ABSENT)
        except PreconditionFailed:
            return  # another watch sent one
        try:
            self._source.send_many([shard_body(spec, plan, shard)], plan.job_id)
        except Exception:
            # Left marked, the shard would wait to be taken for lost instead.
            with contextlib.suppress(Exception):
                self._blobs.delete([marker])
            raise
        log.info("shard_duplicated", job_id=plan.job_id, shard=shard, why=why)
