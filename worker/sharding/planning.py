"""Planning a job too big for one worker into shards (`worker.sharding.shards` runs and
merges them): plan.json written once, then its inputs under its output as a file per
shard, as the plan that stands splits them, a message per shard, the job's own message
deleted last."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from worker.datasets.inputs import Input, shard_line
from worker.errors import MissingObject, PreconditionFailed, TransientError
from worker.jobs.checkpoints import RequestDigest
from worker.jobs.job import Job, JobSettled
from worker.jobs.outcomes import Lifecycle
from worker.jobs.plan import (
    COMMIT_SUFFIX,
    INPUTS_SUFFIX,
    MAX_PLAN_BYTES,
    PLAN,
    SENT_SUFFIX,
    Plan,
    each_at_once,
    shard_body,
    shard_directory,
    shard_file,
    shard_name,
)
from worker.message import JobMessage, PoisonMessage
from worker.ports import ABSENT, SQS_MAX_ENTRIES_PER_BATCH_CALL, BlobStore, JobSource

log = structlog.get_logger()


class Planner:
    """Plans a job into shards, or takes the plan written for it, and sends them."""

    def __init__(self, blobs: BlobStore, source: JobSource, lifecycle: Lifecycle):
        self._blobs = blobs
        self._source = source
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress

    def plan(
        self, job: Job, spec: JobMessage, new_plan: Plan, inputs: Callable[[], Iterator[Input]]
    ) -> None:
        """Plan the job (or take the plan written for it already), write the inputs
        files of the shards not yet sent or committed as the plan that stands splits
        them, send those shards, and delete the job's message. Raises if any of it fails:
        the message comes back, and its next delivery goes on from there.

        The files follow the plan, never this planner's own shard size: a second planner
        (a rollout of another `--shard-items`, a redelivery) that loses the race for
        plan.json writes the same files the first does, not files of other ranges."""
        plan, replaces = self._written_plan(spec, new_plan.request_digest)
        if plan is None:
            plan = self._publish(spec, new_plan, replaces)
        unsent = self._unsent(spec, plan)
        if unsent:
            self._write_inputs(spec, plan, inputs, frozenset(unsent))
        self._send(job, spec, plan, unsent)
        log.info(
            "job_planned",
            job_id=plan.job_id,
            items=plan.items,
            shards=plan.shards,
            sent_now=len(unsent),
            message_id=job.message.message_id,
        )
        self._outcomes.ack(job)

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

    def _write_inputs(
        self,
        spec: JobMessage,
        plan: Plan,
        inputs: Callable[[], Iterator[Input]],
        shards: frozenset[int],
    ) -> None:
        """The inputs files of `shards`, one each, as the job's inputs stream past (two
        shards' inputs held at most); the stream must still be the request planned (a
        manifest changed meanwhile is planned again on the next delivery)."""
        digest = RequestDigest()

        def taken(stream: Iterator[Input]) -> Iterator[Input]:
            for listed in stream:
                digest.add(*listed)
                yield listed

        def write(shard: int, listed: list[Input]) -> None:
            data = b"".join(map(shard_line, listed))
            location = shard_file(spec, plan.request_digest, shard, INPUTS_SUFFIX)
            self._blobs.put(location, data, "text/plain")
            self._progress.beat()

        stream = taken(inputs())
        # A shard's file is written while the next shard's inputs are read: two shards'
        # inputs held at most (writers side by side held one each, up to 17), and
        # reading, the slower (a listing's pages), never waits for more than one write.
        with ThreadPoolExecutor(1, thread_name_prefix="shard-inputs") as writer:
            writing: Future[None] | None = None
            for shard in range(plan.shards):
                listed = list(itertools.islice(stream, plan.shard_items))
                if writing is not None:
                    writing.result()
                writing = writer.submit(write, shard, listed) if shard in shards else None
            if writing is not None:
                writing.result()
        leftover = next(stream, None)
        listed_digest = digest.hexdigest(spec.params, plan.model, plan.format, plan.tar)
        if leftover is not None or listed_digest != plan.request_digest:
            raise TransientError("the job's inputs changed while it was planned")

    def _publish(self, spec: JobMessage, plan: Plan, replaces: str) -> Plan:
        """Write plan.json unless another planner was first; the plan that stands."""
        data = plan.model_dump_json(exclude_none=True).encode()  # no "tar" but for a tar job
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
        return [
            shard
            for shard in range(plan.shards)
            if f"{shard_name(shard)}{SENT_SUFFIX}" not in listing
            and f"{shard_name(shard)}{COMMIT_SUFFIX}" not in listing
        ]

    def _send(self, job: Job, spec: JobMessage, plan: Plan, unsent: list[int]) -> None:
        """Send the shards `unsent`, ten to a call, each call's shards then marked sent;
        none once the job's message is settled (handed back at shutdown: its next
        delivery sends them, where this one's would be duplicates)."""
        for start in range(0, len(unsent), SQS_MAX_ENTRIES_PER_BATCH_CALL):
            if job.settled:
                raise JobSettled(f"{plan.job_id} was settled while its shards were sent")
            chunk = unsent[start : start + SQS_MAX_ENTRIES_PER_BATCH_CALL]
            self._source.send_many([shard_body(spec, plan, shard) for shard in chunk], plan.job_id)
            each_at_once(
                lambda shard: self._blobs.put(
                    shard_file(spec, plan.request_digest, shard, SENT_SUFFIX), b"", "text/plain"
                ),
                chunk,
            )
            self._progress.beat()
