"""Admission: what admitting a job needs, read from its message and S3, or the job
settled instead.

A message is validated; its inputs are listed (a job over its shard size is planned into
shards instead, and its message settled); a shard's inputs are those its plan gives it; a
tar job's tars are copied here; and what earlier deliveries of the job left under its
output (checkpoints, a job.json, a cancel) is read. Whatever fails settles the job as
what failed says (`AdmissionReader.read`); the intake enters what is read in the ledger.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

import structlog

from worker.datasets.arrays import ArrayFiles, ArraySpool
from worker.datasets.disk import NO_DISK_ROOM_RETRY_S, DiskBudget, NoDiskRoom
from worker.datasets.inputs import Input, InputReader
from worker.datasets.table_ranges import listed_items
from worker.datasets.tables import JSON_LINES
from worker.datasets.tars import TarCopies
from worker.jobs.checkpoints import Checkpoints, Prior, RequestDigest, request_digest
from worker.jobs.job import Job, JobSettled, Place, item_places
from worker.jobs.outcomes import Lifecycle
from worker.jobs.plan import INPUTS_SUFFIX, MAX_SHARDS, Plan, shard_file
from worker.loops.notices import Notices
from worker.message import (
    JobMessage,
    PoisonMessage,
    TarMembers,
    at_most,
    check_buckets,
    parse_job_message,
)
from worker.plugins.identity import ModelIdentity
from worker.ports import SQS_MAX_DELAY_S, BlobStore, LocalPart, ReceivedMessage, S3Location
from worker.settings import Settings
from worker.sharding.merging import PoisonMerge
from worker.sharding.planning import Planner, Snapshot, replaced
from worker.sharding.shards import Shards
from worker.sharding.stragglers import Stragglers

log = structlog.get_logger()

# How far apart two workers' clocks may be (a continuation compares its sender's time).
CLOCK_SKEW_S = 5.0
WAITED_FOR_THE_REPLACED = "the message it replaces may be running until it sees it was replaced"
# Inputs read, while a job is admitted, between two beats of the clock of progress: a
# page of a listing.
LISTED_A_BEAT = 1000
# A table's files whose footers are read at planning, before any of its rows is listed,
# between two beats: a few seconds' GETs.
FOOTERS_A_BEAT = 10
# A job in the failing work of this many workers that broke (the last times run apart
# from other jobs) is dead-lettered: it breaks workers, whatever the cause.
MAX_BROKEN_WORKERS = 3


class Admission(NamedTuple):
    spec: JobMessage
    items: Items
    prior: Prior
    plan: Plan | None = None  # of a shard's job


class Items(NamedTuple):
    """A job's items as admission read them (`Job` holds them so)."""

    inputs: list[str]  # each item's URI (a member's: its tar's)
    ids: list[Any] | None  # each item's id, where its table gives them
    parts: list[LocalPart] | None  # each item's bytes, where the inputs are tars
    places: list[Place]


class AdmissionReader:
    """Reads what admitting a job needs, or settles the job instead."""

    def __init__(
        self,
        settings: Settings,
        blobs: BlobStore,
        lifecycle: Lifecycle,
        stopping: threading.Event,
        *,
        model: Future[ModelIdentity],
        checkpoints: Checkpoints,
        planner: Planner,
        shards: Shards,
        stragglers: Stragglers,
        notices: Notices,
        arrays: ArraySpool,
        disk: DiskBudget,
        claim_tar_shard: Callable[[Job], bool],
    ):
        """`claim_tar_shard(job)`: whether this daemon is to copy a tar shard's tars and
        hold it now (the intake's decision, which hands it back if not)."""
        self._settings = settings
        self._blobs = blobs
        self._arrays = arrays  # where admitted jobs' array files go
        self._disk = disk  # what their tar copies may take of this machine's disk
        self._model = model  # known once the inference stage is set up, before the first receive
        self._checkpoints = checkpoints
        self._planner = planner
        self._inputs = InputReader(
            blobs, settings.allowed_buckets, settings.max_manifest_bytes, settings.shard_items
        )
        self._shards = shards
        self._stragglers = stragglers
        self._notices = notices  # of jobs found finished, or merged here; rejections
        self._ledger = lifecycle.ledger
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress
        self._stopping = stopping
        self._claim_tar_shard = claim_tar_shard
        # Two progress intervals: a running delivery of a replaced message has seen the
        # mark and stopped by then (`_handed_over`).
        self._defer_s = min(
            SQS_MAX_DELAY_S, math.ceil(2 * settings.progress_interval_seconds + CLOCK_SKEW_S)
        )

    def read(self, job: Job) -> Admission | None:
        """Validate the message, read its manifest and what earlier deliveries left under
        its output: what admitting it needs, or None if it is settled instead (poison,
        unreadable for now, done already, handed over already, or the daemon stopping)."""
        settings = self._settings
        if self._stopping.is_set():
            self._outcomes.hand_over(job, "shutting down")
            return None
        try:
            if job.message.attributes_problem:
                raise PoisonMessage(job.message.attributes_problem)
            spec = parse_job_message(job.message.body, settings.allowed_buckets)
            if spec.shard is None:  # a shard's is checked once its plan is known
                _check_breakages(job.message)
            job_id = spec.job_id or job.message.job_message_id
            model = self._model.result()
            admission = self._read_kind(job, spec, job_id, model)
        except Exception as error:
            self._not_admitted(job, error)
            return None
        if (
            admission is None
            or self._done_already(job, spec, admission.prior.summary, job_id)
            or self._handed_over(job, spec, admission.prior, job_id)
        ):
            return None
        return admission

    def _not_admitted(self, job: Job, error: Exception) -> None:
        """Settle a job whose admission failed, as what failed says: poison is
        dead-lettered; a job whose tars the disk has no room for now goes back,
        uncharged, for later; anything else (transient, or not understood) is never the
        sender's fault, and is retried later. A job settled meanwhile (handed back at
        shutdown) needs nothing more."""
        if isinstance(error, PoisonMessage):
            output = self._rejected_output(job.message.body, error)
            if output is not None and not job.settled:
                self._notices.rejected(output, job.message.body, str(error))
            self._outcomes.dead_letter(job, str(error))
        elif job.settled:
            return
        elif isinstance(error, NoDiskRoom):
            self._outcomes.hand_over(job, str(error), NO_DISK_ROOM_RETRY_S)
        else:
            log.warning(
                "job_admission_failed", message_id=job.message.message_id, error=repr(error)
            )
            self._outcomes.retry_later(job, f"admission failed: {error!r}")

    def _rejected_output(self, body: str, poison: PoisonMessage) -> S3Location | None:
        """Where a whole job's message that is poison asks its outputs to go, if that is
        an output it may have (a valid URI, in an allowed bucket), to write its
        `rejected.json` there; None for a shard (its `.dead` note and its job's stall
        say it) or a watch, unless their job's merge is the `poison` (the job as a
        whole is refused), and for a body that names no such output."""
        try:
            document = json.loads(body)
            if not isinstance(document, dict):
                return None
            if {"shard", "watch"} & document.keys() and not isinstance(poison, PoisonMerge):
                return None
            output = JobMessage.model_construct(output=document["output"]).output_location("")
            check_buckets({output.bucket}, self._settings.allowed_buckets)
        except (ValueError, KeyError, AttributeError, TypeError, PoisonMessage):
            return None
        return output

    def _prior(
        self,
        job: Job,
        spec: JobMessage,
        job_id: str,
        digest: str,
        items: Items,
        *,
        shard: int | None = None,
    ) -> Prior:
        """What earlier deliveries left (`Checkpoints.read`), the array rows of their
        results written to the job's array files, made here."""
        job.arrays = ArrayFiles(
            self._arrays.directory / job.key,
            len(items.inputs),
            self._arrays.layouts,
            spec.array_floats,
        )
        return self._checkpoints.read(
            spec, job_id, digest, items.places, arrays=job.arrays, shard=shard
        )

    def _items(self, job: Job, tar: TarMembers | None, listed: _Listed, first_index: int) -> Items:
        """The items of the inputs `listed` (from the job's `first_index` on): the
        inputs, or, where they are tars, their members, once each tar is copied here."""
        uris, ids = listed
        if tar is None:
            return Items(uris, ids, None, item_places(uris, None, first_index))
        settings = self._settings
        self._slow_to_admit(job)
        job.tar_copies = TarCopies(
            self._arrays.directory / f"{job.key}.tars",
            self._blobs,
            settings.max_tar_bytes,
            settings.shard_items,
            self._disk,
        )
        members = job.tar_copies.members(uris, tar)
        inputs = [uris[member.row] for member in members]
        member_ids = None if ids is None else [ids[member.row] for member in members]
        parts = [member.part for member in members]
        return Items(inputs, member_ids, parts, item_places(inputs, members, first_index))

    def _followed(self, job: Job, inputs: Iterator[Input]) -> Iterator[Input]:
        """`inputs` as they are read, each page's worth beating the daemon's clock of
        progress (a listing of millions of objects is progress), and stopping once the
        job is settled meanwhile (handed back at shutdown)."""
        for count, listed in enumerate(inputs, 1):
            if count % LISTED_A_BEAT == 0:
                self._listing_beat(job)
            yield listed

    def _listing_beat(self, job: Job) -> None:
        """The job's listing goes on: its admission is slow, and progress, unless the
        job is settled meanwhile."""
        self._slow_to_admit(job)
        if job.settled:
            raise JobSettled(f"{job.job_id} was settled while its inputs were read")
        self._progress.beat()

    def _slow_to_admit(self, job: Job) -> None:
        """The job's admission takes long: those received after it go on without it."""
        if not job.slow_to_admit:
            job.slow_to_admit = True
            self._ledger.wake()

    def _finished(self, job: Job, spec: JobMessage, job_id: str, request: str) -> bool:
        """Settle a job whose job.json is written for request `request` already."""
        summary = self._checkpoints.finished(spec, job_id, request)
        return self._done_already(job, spec, summary, job_id)

    def _done_already(
        self, job: Job, spec: JobMessage, summary: dict[str, Any] | None, job_id: str
    ) -> bool:
        """Settle a delivery of a job whose job.json (`summary`, if written) is for this
        same request: acked, once its notices are sent if none were (its worker died,
        or a send failed, before they were)."""
        if summary is None:
            return False
        log.info("job_already_done", job_id=job_id, status=summary.get("status"))
        self._outcomes.settle_written(job, announced=self._notices.announce_found(spec, summary))
        return True

    def _read_kind(
        self, job: Job, spec: JobMessage, job_id: str, model: ModelIdentity
    ) -> Admission | None:
        """What admitting a job, or a shard of one, needs; a watch of a job's shards is
        carried out instead (and settled)."""
        if spec.watch is not None:
            self._stragglers.watch(job, spec)
            return None
        if spec.shard is not None:
            return self._read_shard(job, spec, model)
        return self._read_whole(job, spec, job_id, model)

    def _read_whole(
        self, job: Job, spec: JobMessage, job_id: str, model: ModelIdentity
    ) -> Admission | None:
        """A job's inputs and what earlier deliveries left; None if it is over its shard
        size: it is then planned, and its message settled."""
        settings = self._settings
        # A message may ask for smaller shards, not larger: the worker's size bounds
        # what it holds of a job. A tar job's shards count tars.
        most = settings.shard_tars if spec.tar else settings.shard_items
        shard_items = min(spec.shard_items or most, most)

        footers = itertools.count(1)

        def looked_at() -> None:
            if next(footers) % FOOTERS_A_BEAT == 0:
                self._listing_beat(job)

        def listed() -> Iterator[Input]:
            inputs = self._inputs.inputs(spec, looked_at)
            most = settings.max_items_per_job
            counted = at_most(inputs, most, lambda each: listed_items(each.uri))
            return self._followed(job, counted)

        stream = listed()
        first, counted = _first_items(stream, shard_items + 1)
        # A table's rows listed as one input (`TableRows`) come only past the shard size.
        if counted <= shard_items:
            whole = _split(first, _with_ids(spec))
            request = request_digest(*whole, spec, model)
            if spec.tar and self._finished(job, spec, job_id, request):
                return None  # before its tars are copied: they may be large
            items = self._items(job, spec.tar, whole, 0)
            if spec.tar and not items.inputs:
                raise PoisonMessage(f"its tars hold no members (ending {spec.tar.member_suffix!r})")
            prior = self._prior(job, spec, job_id, request, items)
            return Admission(spec, items, prior)
        if spec.openai_batch is not None:  # its output and error files are one run's
            raise PoisonMessage(
                f"its OpenAI batch file holds over {shard_items} texts, the shard size: split "
                "it into files of fewer (OpenAI's own batches hold at most 50,000)"
            )
        # A chain's are not known: it may write arrays.
        if spec.format == JSON_LINES and self._arrays.layouts != {}:
            raise PoisonMessage(
                f"over {shard_items} inputs, the shard size, and its pipeline writes (or may "
                "write) array outputs, which are merged across shards only as Parquet "
                'columns: give "format": "parquet", or a larger \'shard_items\' to run '
                "it whole"
            )
        with Snapshot(
            self._arrays.directory, self._disk.claim("the snapshot of its listing")
        ) as snapshot:
            listing = itertools.chain(first, stream)
            self._plan(
                job, spec, listing, snapshot, job_id=job_id, model=model, shard_items=shard_items
            )
        return None

    def _plan(
        self,
        job: Job,
        spec: JobMessage,
        listed: Iterator[Input],
        snapshot: Snapshot,
        *,
        job_id: str,
        model: ModelIdentity,
        shard_items: int,
    ) -> None:
        """Plan a job over its shard size from its listing, read through once into a
        `snapshot` (never held whole): the plan is of what it held then, whatever the
        listing says later; or settle it, if done already."""
        # A table's rows listed as one input are digested a chunk at a time, each progress.
        digest, count = RequestDigest(lambda: self._listing_beat(job)), 0
        for uri, input_id in listed:
            count += listed_items(uri)
            digest.add(uri, input_id)
            snapshot.add(Input(uri, input_id))
        request = digest.hexdigest(spec.params, model.as_dict(), spec.format, spec.tar)
        summary = self._planner.finished(spec, job_id, request)
        if self._done_already(job, spec, summary, job_id):
            return
        if spec.tar and count > shard_items * MAX_SHARDS:  # its shards would hold more tars
            raise PoisonMessage(
                f"{count} tars: over {MAX_SHARDS} shards of {shard_items} (--shard-tars)"
            )
        plan = Plan(
            job_id=job_id,
            request_digest=request,
            items=count,
            shard_items=max(shard_items, -(-count // MAX_SHARDS)),
            params=spec.params,
            model=model.as_dict(),
            received_at=job.received_at,
            attempt=job.attempt,
            format=spec.format,
            ids=_with_ids(spec),
            tar=spec.tar,
        )
        # A new run of a rejected request, as a run admitted whole withdraws it (intake):
        # its shards' admissions would, but only once one is.
        self._notices.withdraw_rejection(spec, job.received_at - CLOCK_SKEW_S)
        self._planner.plan(job, spec, plan, snapshot.inputs)

    def _read_shard(self, job: Job, spec: JobMessage, model: ModelIdentity) -> Admission | None:
        """A shard's inputs (the part of its job's that its plan gives it) and what its
        earlier runs left; None if it is settled instead: committed already (then the
        job is merged, if this run was to merge it and died), or its job done."""
        assert spec.shard is not None
        plan = self._open(job, spec, model)
        if plan is None or self._merged_already(job, spec, plan):
            return None
        if self._shards.committed(spec, plan):
            log.info("shard_committed_already", job_id=plan.job_id, shard=spec.shard.index)
            written = self._shards.merge(spec, plan, job.message.job_message_id)
            announced = self._notices.merged(spec, plan, written.summary, job)
            self._outcomes.settle_written(job, announced=announced, shards_left=written.shards_left)
            return None
        if plan.tar is not None and not self._claim_tar_shard(job):
            return None  # handed back, before its tars are copied
        span = plan.range(spec.shard.index)
        try:
            _check_breakages(job.message)
            listed = self._inputs.shard(spec.manifest or "", len(span))
            if len(listed) != len(span):
                more = "more than " if len(listed) > len(span) else ""
                raise PoisonMessage(
                    f"shard {spec.shard.index} lists {more}{len(listed)} inputs, not {len(span)}"
                )
            items = self._items(job, plan.tar, _split(listed, plan.ids), span.start)
        except PoisonMessage as poison:  # a shard of a real plan: its job waits for it
            if self._shards.committed(spec, plan):  # its inputs went with another run's merge
                log.info("shard_committed_already", job_id=plan.job_id, shard=spec.shard.index)
                self._outcomes.ack(job)
                return None
            if self._merged_already(job, spec, plan):  # merged since it was looked at
                return None
            self._shards.dead_lettered(spec, plan, str(poison))
            raise
        prior = self._prior(
            job, spec, plan.job_id, plan.request_digest, items, shard=spec.shard.index
        )
        return Admission(spec, items, prior, plan)

    def _open(self, job: Job, spec: JobMessage, model: ModelIdentity) -> Plan | None:
        """The plan a shard belongs to (`Shards.open`); None if it belongs to a plan
        replaced by another request, and is acked: a listing that changed, or a job sent
        again, are no fault of the shard's (a forged one does nothing either)."""
        assert spec.shard is not None
        settings = self._settings
        # A job of the most inputs this worker takes may need larger shards than its own
        # to fit MAX_SHARDS; a tar job of more tars is refused at planning.
        largest = max(settings.shard_items, math.ceil(settings.max_items_per_job / MAX_SHARDS))
        try:
            return self._shards.open(spec, model.as_dict(), largest, settings.shard_tars)
        except PoisonMessage:
            own = str(shard_file(spec, spec.shard.plan, spec.shard.index, INPUTS_SUFFIX))
            if spec.manifest != own or not replaced(self._blobs, spec, spec.shard.plan):
                raise
        log.info("shard_superseded", job_id=spec.job_id, shard=spec.shard.index)
        self._outcomes.ack(job)
        return None

    def _merged_already(self, job: Job, spec: JobMessage, plan: Plan) -> bool:
        """Settle a shard whose job is merged already (what a merger that died left
        removed), once its notices are sent."""
        summary = self._checkpoints.finished(spec, plan.job_id, plan.request_digest)
        if summary is None:
            return False
        assert spec.shard is not None
        log.info("job_already_done", job_id=plan.job_id, shard=spec.shard.index)
        removed = self._shards.merger.remove(spec, plan)
        announced = self._notices.announce_found(spec, summary)
        self._outcomes.settle_written(job, announced=announced, shards_left=not removed)
        return True

    def _handed_over(self, job: Job, spec: JobMessage, prior: Prior, job_id: str) -> bool:
        """Settle a delivery that is not to run: its message was handed over already
        (acked unread), or it is a continuation and the message it replaces may still be
        running (handed over again, to wait). A continuation first marks the message it
        replaces, which comes back if the daemon that handed it over died before deleting
        it: marked, it is acked unread, or, running already, stopped within a progress
        interval; this one waits that long if that may have happened."""
        if job.message.message_id in prior.superseded:
            log.info("job_handed_over_already", job_id=job_id, message_id=job.message.message_id)
            self._outcomes.ack(job)
            return True
        if not job.message.handed_over_from:
            return False
        self._checkpoints.supersede(spec, job.message.handed_over_from)
        lease_ends = job.message.replaced_lease_ends
        if lease_ends is None or time.time() <= lease_ends - CLOCK_SKEW_S:
            return False
        log.info("job_deferred", job_id=job_id, for_s=self._defer_s)
        self._outcomes.hand_over(job, WAITED_FOR_THE_REPLACED, delay_s=self._defer_s)
        return True


class _Listed(NamedTuple):
    uris: list[str]
    ids: list[Any] | None  # where the job's table gives them


def _first_items(listed: Iterator[Input], most: int) -> tuple[list[Input], int]:
    """The first inputs of `listed` up to `most` items (or past them by the last one's),
    and the items they are."""
    first: list[Input] = []
    items = 0
    for each in listed:
        first.append(each)
        items += listed_items(each.uri)
        if items >= most:
            break
    return first, items


def _split(listed: list[Input], with_ids: bool) -> _Listed:
    return _Listed([uri for uri, _ in listed], [i for _, i in listed] if with_ids else None)


def _with_ids(spec: JobMessage) -> bool:
    """Whether the job's inputs have ids (its table's id column, an OpenAI batch file's
    custom_ids)."""
    has_id_column = spec.table is not None and spec.table.id_column is not None
    return has_id_column or spec.openai_batch is not None


def _check_breakages(message: ReceivedMessage) -> None:
    """Poison if the message's items were in the failing work of too many workers."""
    if message.broke_workers >= MAX_BROKEN_WORKERS:
        raise PoisonMessage(
            f"{message.broke_workers} workers broke with its items in the work that "
            f"failed; the last: {message.breakage}"
        )
