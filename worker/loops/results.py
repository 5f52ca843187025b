"""Results: the regrouper files each item's result under its job, in its place; the
finisher writes a complete job's outputs (job.json last) and acks it."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from worker.datasets.arrays import NPY_CONTENT_TYPE
from worker.datasets.disk import NO_DISK_ROOM_RETRY_S, NoDiskRoom
from worker.datasets.openai_batch import BatchItem, write_batch_files
from worker.datasets.tables import (
    JSON_LINES,
    NDJSON,
    PARQUET_CONTENT_TYPE,
    Output,
    Tables,
    UnfitResults,
    table_name,
)
from worker.engine import Item, ItemError, Pipeline
from worker.engine.channel import Channel
from worker.errors import PreconditionFailed
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job, JobState, Result
from worker.jobs.outcomes import Lifecycle
from worker.jobs.summary import job_summary
from worker.loops.notices import Notices
from worker.plugins import POSTPROCESS_STAGE, Postprocessor
from worker.plugins.encoding import chain_postprocess_fault, encode_json, postprocessed
from worker.ports import ABSENT, BlobStore
from worker.retry import Backoff
from worker.sharding.merging import PoisonMerge, Written
from worker.sharding.shards import Shards

log = structlog.get_logger()

T = TypeVar("T")
U = TypeVar("U")

# An input that could not be read for now (its call's retries spent) is tried this many
# times in all per delivery, fed again after these delays, before its job is released.
INPUT_RETRIES = 4
INPUT_BACKOFF = Backoff(base_s=0.5, cap_s=10.0)
PARQUET_DIR = "parquet"  # in the job's directory of array files
# A finish whose writes failed (each after its own retries) is tried this many times in
# all, the lease kept meanwhile, before the job is released for a later delivery.
FINISH_ATTEMPTS = 3
# Threads a finisher keeps for what a finish does beside its own calls (its other
# outputs, the rejection's lookup), one for each thread finishing jobs (the daemon
# starts at most 32): started for each finish instead, they cost a job of one item a
# millisecond more.
BESIDE_THREADS = 32
FINISH_BACKOFF = Backoff(base_s=0.5, cap_s=5.0)


class Regrouper:
    """Takes each item out of the pipeline and files its result under its job. An item
    that failed for a transient reason is no fault of the input: it is fed again, and if
    it keeps failing its job goes back to the queue for a later delivery.

    Items come with their fields encoded by the model's process (`postprocessed`), or,
    given `postprocess` (a chain, whose parts come together only here), as the model's
    outputs to postprocess here; if that fails known-good input too, the worker is
    broken (`on_broken`), not the item."""

    def __init__(
        self,
        pipeline: Pipeline,
        lifecycle: Lifecycle,
        finisher: Finisher,
        postprocess: Postprocessor | None = None,
        on_broken: Callable[[str, frozenset[str]], None] | None = None,
    ):
        self._pipeline = pipeline
        self._ledger = lifecycle.ledger
        self._outcomes = lifecycle.outcomes
        self._metrics = lifecycle.metrics
        self._progress = lifecycle.progress
        self._finisher = finisher
        self._postprocess = postprocess
        self._on_broken = on_broken

    def run(self) -> None:
        while True:
            items = self._pipeline.next_results()
            self._progress.beat()
            keys = [item.job for item in items]
            self._ledger.back_from_pipeline(*keys)
            for item, job in zip(items, self._ledger.get_all(keys), strict=True):
                self._file(item, job)

    def _file(self, item: Item, job: Job | None) -> None:
        """Record an item's result in its job (None: no longer held), and have the job
        finished if it was its last."""
        if job is None or job.state is not JobState.RUNNING:
            return  # released while its items were inside
        result = self._result(job, item)
        if result is None:
            return  # fed again, or its job given back
        self._metrics.item_finished(failed=result.failed)
        finished = self._ledger.record(item.job, item.index, result)
        if finished is not None:
            self._finisher.submit(finished)

    def _retry(self, job: Job, item: Item, error: ItemError) -> None:
        """Feed the item again after a backoff; once it has had `INPUT_RETRIES` tries,
        give the job back for a later delivery."""
        assert job.log is not None
        retried = job.item_retries.get(item.index, 0)
        if retried + 1 >= INPUT_RETRIES:
            where = f"{error.stage} of input {item.index}"
            self._outcomes.retry_later(job, f"{where}: {error.message}")
            return
        job.log.info("input_retried", index=item.index, stage=error.stage, error=error.message)
        self._ledger.retry_item(job, item.index, INPUT_BACKOFF.delay_s(retried + 1))

    def _result(self, job: Job, item: Item) -> Result | None:
        """The results.jsonl line of one item: its prediction fields, or its error; None
        after an error of its surroundings (`_retry`), which no result may hold."""
        assert job.model is not None and job.spec is not None
        encoded = item.value
        if self._postprocess is not None and item.error is None:
            encoded = postprocessed(self._postprocess, item.value, job.spec.params)
            if self._worker_at_fault(job, encoded):
                return None
        outcome = item.error or self._fields(job, item.index, encoded)
        if isinstance(outcome, ItemError) and outcome.transient:
            self._retry(job, item, outcome)
            return None
        if isinstance(outcome, ItemError):
            return self._failed(job, item, outcome)
        place = job.places[item.index]
        line = b'{"index":%d,"input":%s%s%s%s,"model":%s}\n' % (
            place.index,
            encode_json(place.input),
            b"" if place.member is None else b',"member":' + encode_json(place.member),
            b"" if job.ids is None else b',"id":' + encode_json(job.ids[item.index]),
            outcome,
            job.model.encoded_label,
        )
        return Result(line, failed=False)

    def _worker_at_fault(self, job: Job, encoded: Any) -> bool:
        """Whether the chain's postprocessor failed the item because it fails known-good
        input too: the worker is then broken, with this job the suspect."""
        if not isinstance(encoded, ItemError) or encoded.transient:
            return False
        assert self._postprocess is not None and self._on_broken is not None
        fault = chain_postprocess_fault(self._postprocess)
        if fault is None:
            return False
        self._on_broken(f"the postprocessor fails known-good input: {fault}", frozenset({job.key}))
        return True

    def _fields(self, job: Job, index: int, encoded: Any) -> bytes | ItemError:
        """The item's fields, encoded, with its arrays written to the job's array files
        and referred to among them; or why there are none."""
        assert job.arrays is not None
        if isinstance(encoded, ItemError | bytes):
            return encoded
        fields: bytes = encoded[0]
        try:
            return fields + job.arrays.write(index, encoded[1])
        except ValueError as error:
            return ItemError.from_exception(error, POSTPROCESS_STAGE)
        except OSError as error:  # this machine's disk, not the input's fault
            return ItemError(type(error).__name__, str(error), "arrays", transient=True)

    def _failed(self, job: Job, item: Item, error: ItemError) -> Result:
        assert job.log is not None
        place = job.places[item.index]
        error_fields = {"type": error.type, "message": error.message}
        where = {"index": place.index, "input": place.input}
        if place.member is not None:
            where["member"] = place.member
        job.log.error("item_failed", **where, stage=error.stage, **error_fields)
        record: dict[str, Any] = dict(where)
        if job.ids is not None:
            record["id"] = job.ids[item.index]
        record["error"] = error_fields
        return Result(encode_json(record) + b"\n", failed=True)


class _Abandoned(Exception):
    """The job was released (shutdown, an open circuit, fenced off) while its outputs
    were written."""


class Finisher:
    """Writes finished jobs' outputs and acks them; each thread that runs `run` (the
    daemon starts as many as it fetches at once) finishes one job at a time."""

    def __init__(
        self,
        blobs: BlobStore,
        checkpoints: Checkpoints,
        shards: Shards,
        tables: Tables,
        lifecycle: Lifecycle,
        *,
        worker_info: dict[str, Any],
        notify: Sequence[Callable[[str], None]],
        capacity: int,
        device_hour_price: float | None,
    ):
        self._blobs = blobs
        self._checkpoints = checkpoints
        self._shards = shards
        self._tables = tables
        self._device_hour_price = device_hour_price
        self._ledger = lifecycle.ledger
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress
        self._worker_info = worker_info
        self.notices = Notices(blobs, checkpoints, lifecycle.metrics, notify)
        # Never full: it holds at most the jobs held, and it is sized for all of them.
        self._queue: Channel[Job] = Channel(capacity)
        self._closed = threading.Event()
        # Never shut down: a finish under way at shutdown still uses it. Its threads,
        # idle, end once it is collected.
        self._beside = futures.ThreadPoolExecutor(BESIDE_THREADS, "finish-beside")

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def cancel(self, job: Job) -> None:
        """Stop a running job (asked for with `worker cancel`) and finish it with the
        results it has: job.json says `cancelled`."""
        if not self._ledger.cancel(job):
            return  # finishing or settled already
        assert job.log is not None
        job.log.info("job_cancelled", finished=job.finished_items)
        log.info("job_cancelled", job_id=job.job_id, finished=job.finished_items)
        self.submit(job)

    def run(self) -> None:
        while True:
            self._finish(self._queue.get())

    def close(self) -> None:
        """Stop taking jobs and cut waits between tries short (shutdown)."""
        self._closed.set()
        self._queue.close()

    def _finish(self, job: Job) -> None:
        """Write the outputs, `job.json` last, and ack the job. A shard commits its
        results instead, and whoever commits a job's last shard writes its outputs."""
        summary = self._summary(job)
        lines = self._closing(job, summary)
        if job.tar_copies is not None:
            # Every member is read. The disk they hold is of the budget a merge's join
            # claims: a shard that commits its job's last merges it now, and its own
            # copies would leave the join no room.
            job.tar_copies.remove()
        write: Callable[[], Written]
        if job.plan is None:
            write = functools.partial(self._write, job, lines, summary)
        else:
            write = functools.partial(self._commit, job, summary, lines)
        written = self._written(job, write)
        if written is None:
            return
        assert job.log is not None
        try:
            job.log.discard()
        except OSError as error:
            log.warning("job_log_not_removed", job_id=job.job_id, error=repr(error))
        try:
            self._checkpoints.remove(job)
        except Exception as error:  # harmless left over: the next delivery sees job.json
            log.warning("checkpoint_not_removed", job_id=job.job_id, error=repr(error))
        assert job.spec is not None
        # Announced before the ack: a notice not sent (or a worker that dies first)
        # leaves the message, whose next delivery finds job.json and sends it.
        announced = written.summary is None or self.notices.announce(
            job.spec, written.summary, job.message.message_id
        )
        self._outcomes.settle_written(job, announced=announced, shards_left=written.shards_left)

    def _written(  # noqa: PLR0911 (one a way a finish ends)
        self, job: Job, write: Callable[[], Written]
    ) -> Written | None:
        """`write` the outputs, trying again while the lease is kept: what it wrote, or
        None if the job was settled instead (released, here or by shutdown meanwhile)."""
        for attempt in range(1, FINISH_ATTEMPTS + 1):
            try:
                return write()
            except _Abandoned:
                return None
            except PreconditionFailed as error:
                log.warning("job_fenced", job_id=job.job_id, error=str(error))
                self._outcomes.release(job, f"fenced: another delivery wrote first ({error})")
                return None
            except NoDiskRoom as error:  # a merge's join: others' copies hold the disk now
                self._outcomes.hand_over(job, str(error), NO_DISK_ROOM_RETRY_S)
                return None
            except (UnfitResults, PoisonMerge) as error:  # the same on every delivery
                assert job.spec is not None
                # A whole job is refused, and so is a shard's whose merge cannot be made
                # (its shards' files cannot be joined); a shard's own unfit results leave
                # its job waiting for it instead: it stalls, until the model changes.
                whole = job.plan is None or isinstance(error, PoisonMerge)
                if whole:
                    output = job.spec.output_location("")
                    self.notices.rejected(output, job.message.body, str(error))
                if self._outcomes.dead_letter(job, str(error)) and not whole:
                    assert job.plan is not None
                    self._shards.dead_lettered(job.spec, job.plan, str(error))
                return None
            except Exception as error:
                log.warning(
                    "job_upload_failed", job_id=job.job_id, attempt=attempt, error=repr(error)
                )
                self._progress.beat()
                if attempt == FINISH_ATTEMPTS or self._closed.wait(FINISH_BACKOFF.delay_s(attempt)):
                    self._outcomes.retry_later(job, f"upload failed: {error!r}")
                    return None
        return None

    def _closing(self, job: Job, summary: dict[str, Any]) -> bytes:
        """The job's last log lines, and its results.jsonl: the results it finished (a
        cancelled job's are those it has)."""
        assert job.log is not None
        job.log.info(
            "job_finished", **{k: summary[k] for k in ("status", "items", "failed", "duration_s")}
        )
        job.log.info("stage_timings", **{name: vars(t) for name, t in job.timings.items()})
        return b"".join(result.line for result in job.results if result is not None)

    def _results(self, job: Job, lines: bytes) -> list[Output]:
        """(name, content or the local file of it, content type) of each results file:
        the array files and results.jsonl that refers to them, or the Parquet files (a
        shard's named by its number); then, for a job of an OpenAI batch file, that
        API's output and error files. (job.json, written after them all, names them.)"""
        assert job.spec is not None and job.arrays is not None
        arrays = job.arrays.files()
        if job.spec.format == JSON_LINES:
            return [
                *((name, path, NPY_CONTENT_TYPE) for name, path in arrays.items()),
                ("results.jsonl", lines, NDJSON),
                *_openai_batch_files(job, arrays),
            ]
        shard = job.spec.shard.index if job.spec.shard else 0
        directory = job.arrays.directory / PARQUET_DIR
        files = self._tables.write(
            lines, arrays, directory, ids=job.ids is not None, members=job.parts is not None
        )
        return [
            *(
                (table_name(shard, number), path, PARQUET_CONTENT_TYPE)
                for number, path in enumerate(files)
            ),
            *_openai_batch_files(job, arrays),
        ]

    def _write(self, job: Job, lines: bytes, summary: dict[str, Any]) -> Written:
        """Each output on condition that it is as this delivery found it at admission (or
        as it last wrote it): a delivery that wrote first fences this one off. Then
        job.json, naming the outputs it completes by their ETags, which it returns, and
        beside it any rejection of the request withdrawn. Results files an earlier
        delivery left beyond these then go.

        The outputs are written two at a time, then job.json while a rejection is
        looked for, removed only once job.json has landed (a delivery fenced off, or
        stopped, leaves one written beside it in place): a finish takes two of S3's round
        trips, not four one after another (the job's end, and a run's last). Two deliveries
        finishing at the same moment may each be fenced off by one output of the
        other's; the message's next delivery writes the job."""
        assert job.log is not None and job.spec is not None
        spec = job.spec
        if job.settled:  # before its Parquet files are made
            raise _Abandoned
        outputs = [*self._results(job, lines), ("job.log", job.log.lines(), NDJSON)]
        # Two at a time: a job of many Parquet or array files holds a part (64 MiB) of
        # each in memory as it writes it.
        failed = threading.Event()  # the other half writes no more once one fails
        self._together(
            functools.partial(self._put_each, job, outputs[0::2], failed),
            functools.partial(self._put_each, job, outputs[1::2], failed),
        )
        summary["outputs"] = {name: job.output_etags[name] for name, _, _ in outputs}
        job_json = json.dumps(summary).encode() + b"\n"
        _, rejected = self._together(
            functools.partial(self._put, job, "job.json", job_json, "application/json"),
            functools.partial(self.notices.rejection_to_withdraw, spec),
        )
        if rejected:
            self.notices.remove_rejection(spec)
        self._checkpoints.remove_stale(spec, job.output_etags, summary["outputs"])
        return Written(summary)

    def _together(self, own: Callable[[], T], beside: Callable[[], U]) -> tuple[T, U]:
        """`own()` on this thread while `beside()` runs on one of the threads kept for
        it; both have ended when this returns or raises (own's error first)."""
        other = self._beside.submit(beside)
        try:
            mine = own()
        except BaseException:
            futures.wait([other])
            raise
        return mine, other.result()

    def _commit(self, job: Job, summary: dict[str, Any], lines: bytes) -> Written:
        """A shard's commit (`Shards.commit`), and the merge it made, if it did: then any
        rejection of the request is withdrawn."""
        assert job.spec is not None
        if job.settled:
            raise _Abandoned
        written = self._shards.commit(job, summary, self._results(job, lines))
        if written.summary is not None:
            self.notices.withdraw_rejection(job.spec)
        return written

    def _put_each(self, job: Job, outputs: list[Output], failed: threading.Event) -> None:
        """Each of `outputs` in turn, until one fails here or `failed` says one did
        elsewhere (a job of many files fenced off on one stops writing the rest)."""
        for name, data, content_type in outputs:
            if failed.is_set():
                return
            try:
                self._put(job, name, data, content_type)
            except BaseException:
                failed.set()
                raise

    def _put(self, job: Job, name: str, data: bytes | Path, content_type: str) -> None:
        assert job.spec is not None
        if job.settled:
            raise _Abandoned
        location, expect = job.spec.output_location(name), job.output_etags.get(name, ABSENT)
        if isinstance(data, Path):
            etag = self._blobs.put_file(location, data, content_type, expect=expect)
        else:
            etag = self._blobs.put(location, data, content_type, expect=expect)
        job.output_etags[name] = etag

    def _summary(self, job: Job) -> dict[str, Any]:
        assert job.model is not None and job.spec is not None
        return job_summary(
            job_id=job.job_id,
            request_id=job.spec.request_id,
            cancelled=job.cancelled,
            items=len(job.inputs),
            succeeded=job.succeeded,
            failed=job.failed,
            resumed=job.resumed,
            request_digest=job.request_digest,
            model=job.model.as_dict(),
            received_at=job.received_at,
            attempt=job.attempt,
            worker=self._worker_info,
            device_s=job.device_s,
            device_hour_price=self._device_hour_price,
            format=job.spec.format,
        )


def _openai_batch_files(job: Job, arrays: dict[str, Path]) -> list[Output]:
    """The output and error files of a job whose inputs are an OpenAI batch file, made
    of its results (a cancelled job's: those it has) and their embeddings."""
    assert job.spec is not None and job.arrays is not None
    if job.spec.openai_batch is None:
        return []
    assert job.ids is not None  # their custom_ids
    records = (None if result is None else orjson.loads(result.line) for result in job.results)
    items = map(BatchItem, job.inputs, job.ids, records)
    written = write_batch_files(items, arrays, job.arrays.directory, job.request_digest)
    return [(path.name, path, NDJSON) for path in written]
