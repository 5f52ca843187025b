"""The daemon: pull jobs on demand, push their items through the pipeline, finish them.

    puller thread      receive (when hungry) -> validate -> admit to ledger -> submit items
    pipeline           fetch (threads) -> preprocess (processes) -> inference (one process)
    regrouper thread   postprocess -> file result in the ledger -> job complete? -> finisher
    finisher threads   upload results.jsonl, job.log, job.json (last) -> ack
    lease keeper       renews every in-flight lease well before it runs out

    protection keeper  scale-in protection on while jobs are held (off after an idle grace)
    metrics server     /metrics and /healthz

The main thread only starts these, waits for a reason to stop (a signal, a drained
queue, a broken stage) and then shuts down in order.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import structlog

from worker import __version__
from worker.channel import Closed
from worker.engine import Item, Pipeline, ProcessStage, TensorArena, ThreadStage
from worker.joblog import JobLog
from worker.leases import LeaseKeeper
from worker.ledger import Job, Ledger, StageTiming
from worker.message import PoisonMessage, parse_job_message, parse_manifest
from worker.metrics import Metrics, serving
from worker.plugins import (
    Postprocessor,
    inference_setup,
    load_postprocessor,
    load_preprocessor,
    preprocess_setup,
)
from worker.ports import (
    BlobStore,
    JobSource,
    MissingObject,
    ReceivedMessage,
    S3Location,
    ScaleInGuard,
)
from worker.protection import ProtectionKeeper
from worker.settings import Settings
from worker.timeline import Timeline

log = structlog.get_logger()

RECEIVE_ERROR_BACKOFF_S = 5.0
# A healthy daemon takes or finishes something at least every long poll or every batch.
STALL_MARGIN_S = 60.0


class ExitCode(StrEnum):
    """Why the daemon stopped; `code` is the process exit status."""

    DRAINED = "drained"
    SIGNALLED = "signalled"
    BROKEN = "broken"

    @property
    def code(self) -> int:
        return 1 if self is ExitCode.BROKEN else 0


class Daemon:
    """One worker daemon: a job source, a blob store and a pipeline built from settings."""

    def __init__(
        self,
        settings: Settings,
        source: JobSource,
        blobs: BlobStore,
        *,
        guard: ScaleInGuard | None = None,
        notify: Callable[[str], None] | None = None,
        timeline: Timeline | None = None,
    ):
        self._settings = settings
        self._source = source
        self._blobs = blobs
        self._notify = notify
        self._timeline = timeline
        self._ledger = Ledger()
        self._metrics = Metrics()
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        self._preprocessor = load_preprocessor(settings.preprocess)
        self._postprocess: Postprocessor = load_postprocessor(settings.postprocess)
        self._pipeline = self._build_pipeline()
        self._leases = LeaseKeeper(
            self._ledger,
            source,
            settings.visibility_timeout_seconds,
            settings.heartbeat_interval_seconds,
            max_lease_s=settings.max_lease_seconds,
            on_ceiling=lambda job: self._release(job, "lease ceiling reached"),
            on_renewed=self._metrics.leases_renewed,
        )
        self._protection = (
            ProtectionKeeper(
                self._ledger,
                guard,
                settings.idle_grace_seconds,
                on_call=self._metrics.protection_called,
            )
            if guard
            else None
        )
        self._progress_at = time.monotonic()
        self._stall_after_s = (
            settings.inference_timeout_seconds + settings.receive_wait_seconds + STALL_MARGIN_S
        )
        self._admissions = itertools.count(1)
        # Each finished job is three sequential PUTs: with S3's tens of milliseconds per
        # request, one-input jobs need as many finishers as downloads to keep up.
        self._finishers = ThreadPoolExecutor(
            settings.fetch_concurrency, thread_name_prefix="finisher"
        )
        self._stopping = threading.Event()  # no more receiving
        self._hurry = threading.Event()  # cut the grace period short
        self._exit_reason: ExitCode | None = None
        self._exit = threading.Event()
        self._worker_info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
        }

    def _build_pipeline(self) -> Pipeline:
        settings = self._settings
        # Enough decoded images for the batch being inferred, the next two being
        # assembled, and one in the hands of each preprocessing worker.
        arena_slots = 3 * settings.batch_size + 2 * settings.preprocess_workers
        stages = [
            ThreadStage("fetch", self._fetch_all, workers=settings.fetch_concurrency),
            ProcessStage(
                "preprocess",
                functools.partial(preprocess_setup, settings.preprocess),
                workers=settings.preprocess_workers,
                timeout_s=settings.preprocess_timeout_seconds,
                arena_mode="write",
            ),
            ProcessStage(
                "inference",
                functools.partial(
                    inference_setup,
                    settings.model,
                    settings.device,
                    settings.precision,
                    settings.channels_last,
                ),
                batch_size=settings.batch_size,
                max_batch_wait_ms=settings.max_batch_wait_ms,
                timeout_s=settings.inference_timeout_seconds,
                arena_mode="read",
            ),
        ]
        arena = TensorArena(self._preprocessor.output_shape, arena_slots)
        observer = _JobObserver(
            self._ledger, self._metrics, self._timeline, lambda: self._stop(ExitCode.BROKEN)
        )
        pipeline = Pipeline(stages, observer=observer, arena=arena)
        for stage in stages:
            self._metrics.stage_queue_depth.labels(stage.name).set_function(
                functools.partial(lambda name: pipeline.queue_depths()[name], stage.name)
            )
        self._metrics.jobs_in_flight.set_function(lambda: len(self._ledger))
        return pipeline

    def _fetch_all(self, uris: list[str]) -> list[bytes]:
        return [self._blobs.get(S3Location.parse(uri)) for uri in uris]

    # The main thread ---------------------------------------------------------

    def run(self) -> ExitCode:
        """Serve until drained (with `drain`), signalled, or broken; then shut down."""
        self._install_signal_handlers()
        log.info("daemon_starting", settings=self._settings.model_dump(mode="json"))
        with contextlib.ExitStack() as running:
            if self._settings.metrics_port:
                running.enter_context(
                    serving(self._settings.metrics_port, self._metrics, self.health_problem)
                )
            self._pipeline.start()
            self._leases.start()
            if self._protection:
                self._protection.start()
            threads = [
                threading.Thread(target=self._pull_loop, name="puller", daemon=True),
                threading.Thread(target=self._regroup_loop, name="regrouper", daemon=True),
                threading.Thread(target=self._progress_loop, name="progress", daemon=True),
            ]
            for thread in threads:
                thread.start()
            log.info("daemon_started")
            self._exit.wait()
            reason = self._exit_reason or ExitCode.SIGNALLED
            self._shutdown(reason)
        log.info("daemon_stopped", reason=reason.value, exit_code=reason.code)
        return reason

    def health_problem(self) -> str | None:
        """Why the daemon is unhealthy (a stage down, no progress), or None."""
        dead = self._pipeline.dead_stages()
        if dead:
            return f"stage worker down: {', '.join(dead)}"
        idle_s = time.monotonic() - self._progress_at
        if idle_s > self._stall_after_s:
            return f"no progress for {idle_s:.0f} s"
        return None

    def stop(self) -> None:
        """Shut down as on SIGTERM (for a daemon embedded in another program)."""
        self._stop(ExitCode.SIGNALLED)

    def _stop(self, reason: ExitCode) -> None:
        if self._exit_reason is None:
            self._exit_reason = reason
        self._stopping.set()
        self._exit.set()
        self._ledger.wake()

    def _install_signal_handlers(self) -> None:
        def handle(signum: int, _frame: object) -> None:
            if self._stopping.is_set():
                self._hurry.set()
                self._ledger.wake()
                return
            self._stop(ExitCode.SIGNALLED)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handle)

    def _shutdown(self, reason: ExitCode) -> None:
        """Let in-flight jobs finish within the grace period, release the rest, stop."""
        if reason is ExitCode.SIGNALLED and len(self._ledger):
            grace_s = self._settings.grace_seconds
            log.info("draining_in_flight_jobs", jobs=len(self._ledger), grace_s=grace_s)
            self._ledger.wait_until(lambda: not len(self._ledger) or self._hurry.is_set(), grace_s)
        self._ledger.close()
        for job in self._ledger.jobs():
            self._release(job, "shutdown")
        self._pipeline.close()
        self._finishers.shutdown(wait=True)
        self._leases.stop()
        if self._protection:
            self._protection.stop()

    # Pulling -----------------------------------------------------------------

    def _room(self) -> int:
        """How many messages may be received now: 0 while enough work is waiting."""
        settings = self._settings
        if self._ledger.outstanding_items() >= settings.prefetch_batches * settings.batch_size:
            return 0
        return min(settings.receive_batch, settings.max_jobs - len(self._ledger))

    def _pull_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._progress_at = time.monotonic()
                self._ledger.wait_until(lambda: self._room() > 0 or self._stopping.is_set())
                if self._stopping.is_set():
                    return
                # Drained only if nothing was held for the whole receive: a job released
                # while it waited may be visible again without this receive seeing it.
                idle = not len(self._ledger)
                messages = self._receive(self._room())
                if messages is None:
                    continue
                if not messages and self._settings.drain and idle and not len(self._ledger):
                    self._stop(ExitCode.DRAINED)
                    return
                for message in messages:
                    self._admit(message)
        except Closed:
            return
        except Exception:
            log.exception("puller_failed")
            self._stop(ExitCode.BROKEN)

    def _receive(self, max_messages: int) -> list[ReceivedMessage] | None:
        """The messages received, or None when the receive failed (not an empty queue)."""
        settings = self._settings
        try:
            return self._source.receive(
                max_messages, settings.receive_wait_seconds, settings.visibility_timeout_seconds
            )
        except Exception as error:
            # botocore already retried; back off instead of hammering a failing API.
            log.warning("receive_failed", error=repr(error), retry_in_s=RECEIVE_ERROR_BACKOFF_S)
            self._stopping.wait(RECEIVE_ERROR_BACKOFF_S)
            return None

    def _admit(self, message: ReceivedMessage) -> None:
        """Validate a message, enter it in the ledger and feed its items in."""
        if self._ledger.renew_receipt(message.message_id, message.receipt_handle):
            log.warning("job_redelivered_while_in_flight", message_id=message.message_id)
            return
        settings = self._settings
        try:
            job_message = parse_job_message(message.body, settings.allowed_buckets)
            inputs = job_message.inputs or self._read_manifest(job_message.manifest or "")
            if len(inputs) > settings.max_items_per_job:
                raise PoisonMessage(
                    f"{len(inputs)} inputs is over the limit of {settings.max_items_per_job}"
                )
        except PoisonMessage as poison:
            self._reject(message, str(poison))
            return
        except Exception as error:
            log.warning("job_admission_failed", message_id=message.message_id, error=repr(error))
            self._source.release(message.receipt_handle)
            return
        job_id = job_message.job_id or message.message_id
        job = Job(
            # Items of an earlier admission of this message (released, then redelivered
            # here) may still be in the pipeline: they must not count for this one.
            key=f"{message.message_id}#{next(self._admissions)}",
            message_id=message.message_id,
            job_id=job_id,
            message=job_message,
            inputs=inputs,
            receipt_handle=message.receipt_handle,
            attempt=message.receive_count,
            log=JobLog(settings.log_dir / f"{job_id}.log", job_id),
        )
        if not self._ledger.admit(job):
            job.log.close()
            self._source.release(message.receipt_handle)  # shutting down: give it back now
            return
        job.log.info(
            "job_received", items=len(inputs), attempt=job.attempt, message_id=job.message_id
        )
        log.info("job_received", job_id=job_id, items=len(inputs), attempt=job.attempt)
        for index, uri in enumerate(inputs):
            self._pipeline.submit(Item(job.key, index, uri))

    def _read_manifest(self, uri: str) -> list[str]:
        try:
            text = self._blobs.get(S3Location.parse(uri))
        except MissingObject as missing:
            raise PoisonMessage(f"manifest {uri} does not exist") from missing
        return parse_manifest(
            text, self._settings.allowed_buckets, self._settings.max_items_per_job
        )

    def _reject(self, message: ReceivedMessage, reason: str) -> None:
        moved = self._source.dead_letter(message, reason)
        self._metrics.jobs.labels("poison").inc()
        log.warning(
            "poison_message",
            message_id=message.message_id,
            reason=reason,
            dead_lettered=moved,
        )

    # Regrouping and finishing -------------------------------------------------

    def _regroup_loop(self) -> None:
        try:
            while True:
                item = self._pipeline.next_result()
                self._progress_at = time.monotonic()
                job = self._ledger.get(item.job)
                if job is None:
                    continue
                result = self._result(job, item)
                self._metrics.item_finished(failed="error" in result)
                finished = self._ledger.record(item.job, item.index, result)
                if finished is not None:
                    self._finishers.submit(self._finish, finished)
        except Closed:
            return
        except Exception:
            log.exception("regrouper_failed")
            self._stop(ExitCode.BROKEN)

    def _progress_loop(self) -> None:
        """Publish each in-flight job's progress.json, for `enqueue --wait` and dashboards,
        and bring its local log file up to date."""
        while not self._exit.wait(self._settings.progress_interval_seconds):
            for job in self._ledger.jobs():
                job.log.flush()
                finished = job.finished_items
                if finished == job.progress_reported:
                    continue
                progress = {
                    "job_id": job.job_id,
                    "items": len(job.inputs),
                    "finished": finished,
                    "failed": job.failed,
                }
                try:
                    self._blobs.put(
                        job.message.output_location("progress.json"),
                        json.dumps(progress).encode(),
                        "application/json",
                    )
                except Exception as error:
                    log.warning("progress_upload_failed", job_id=job.job_id, error=repr(error))
                    continue
                job.progress_reported = finished

    def _result(self, job: Job, item: Item) -> dict[str, Any]:
        """The results.jsonl record of one item: prediction fields, or its error."""
        record: dict[str, Any] = {"index": item.index, "input": job.inputs[item.index]}
        error = item.error
        if error is None:
            try:
                return {**record, **self._postprocess(item.value, job.message.params)}
            except Exception as failure:
                error_fields = {"type": type(failure).__name__, "message": str(failure)[:1000]}
                stage = "postprocess"
        else:
            error_fields = {"type": error.type, "message": error.message}
            stage = error.stage
        job.log.error(
            "item_failed", index=item.index, input=record["input"], stage=stage, **error_fields
        )
        return {**record, "error": error_fields}

    def _finish(self, job: Job) -> None:
        """Upload the outputs, `job.json` last, then ack; release if that fails."""
        try:
            finished_at = time.time()
            results = b"".join(json.dumps(r).encode() + b"\n" for r in job.results)
            summary = self._summary(job, finished_at)
            # Compact: the indented encoder is pure Python and cost a tenth of a small job.
            summary_json = json.dumps(summary)
            self._blobs.put(
                job.message.output_location("results.jsonl"), results, "application/x-ndjson"
            )
            job.log.info(
                "job_finished",
                **{k: summary[k] for k in ("status", "items", "failed", "duration_s")},
            )
            job.log.info("stage_timings", **{name: vars(t) for name, t in job.timings.items()})
            self._blobs.put(
                job.message.output_location("job.log"), job.log.lines(), "application/x-ndjson"
            )
            self._blobs.put(
                job.message.output_location("job.json"),
                summary_json.encode() + b"\n",
                "application/json",
            )
        except Exception as error:
            log.exception("job_upload_failed", job_id=job.job_id)
            self._release(job, f"upload failed: {error!r}")
            return
        try:
            job.log.discard()
        except OSError as error:
            log.warning("job_log_not_removed", job_id=job.job_id, error=repr(error))
        if not self._ledger.claim(job.key):
            return  # released by shutdown meanwhile: its lease is no longer ours to ack
        self._metrics.jobs.labels(summary["status"]).inc()
        if self._notify:
            try:
                self._notify(summary_json)
            except Exception as error:
                log.warning("notify_failed", job_id=job.job_id, error=repr(error))
        try:
            if job.lease_lost:
                log.warning("job_not_acked_lease_lost", job_id=job.job_id)
                return
            self._source.ack(job.receipt_handle)
        except Exception as error:
            # The message comes back after its timeout; redoing it rewrites the same keys.
            log.warning("ack_failed", job_id=job.job_id, error=repr(error))
            return
        finally:
            self._ledger.remove(job.key)
        log.info(
            "job_finished",
            job_id=job.job_id,
            status=summary["status"],
            items=summary["items"],
            duration_s=summary["duration_s"],
        )

    def _summary(self, job: Job, finished_at: float) -> dict[str, Any]:
        return {
            "job_id": job.job_id,
            "status": job.status.value,
            "items": len(job.inputs),
            "succeeded": job.succeeded,
            "failed": job.failed,
            "received_at": _iso(job.received_at),
            "finished_at": _iso(finished_at),
            "duration_s": round(finished_at - job.received_at, 3),
            "attempt": job.attempt,
            "worker": self._worker_info,
        }

    def _release(self, job: Job, reason: str) -> None:
        """Give a job back to the queue at once (visibility 0) for another try."""
        if not self._ledger.claim(job.key):
            return
        self._metrics.jobs.labels("released").inc()
        job.log.info("job_released", reason=reason)
        job.log.close()
        log.warning("job_released", job_id=job.job_id, reason=reason)
        try:
            if not job.lease_lost:
                self._source.release(job.receipt_handle)
        except Exception as error:
            # It will come back on its own when the visibility timeout runs out.
            log.warning("release_failed", job_id=job.job_id, error=repr(error))
        finally:
            self._ledger.remove(job.key)


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")


class _JobObserver:
    """Turns engine reports into per-job timings and log lines."""

    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        timeline: Timeline | None,
        on_broken: Callable[[], None],
    ):
        self._ledger = ledger
        self._metrics = metrics
        self._timeline = timeline
        self._on_broken = on_broken

    def _jobs_of(self, items: Sequence[Item]) -> list[tuple[Job, int]]:
        counts = Counter(item.job for item in items)
        jobs = ((self._ledger.get(key), count) for key, count in counts.items())
        return [(job, count) for job, count in jobs if job is not None]

    def stage_ran(
        self, stage: str, items: Sequence[Item], duration_s: float, events: Sequence[dict[str, Any]]
    ) -> None:
        if self._timeline is not None:
            self._timeline.record(stage, len(items), duration_s)
        self._metrics.stage_ran(stage, len(items), duration_s)
        for job, count in self._jobs_of(items):
            job.timings.setdefault(stage, StageTiming()).add(count, duration_s)
            if len(items) > 1:
                job.log.info(
                    "batch_done",
                    stage=stage,
                    job_items=count,
                    batch_items=len(items),
                    duration_ms=round(duration_s * 1000, 2),
                )
            for event in events:
                job.log.info(**{"stage": stage, **event})

    def worker_lost(self, stage: str, items: Sequence[Item], reason: str) -> None:
        log.warning("worker_lost", stage=stage, reason=reason, items=len(items))
        self._metrics.worker_restarts.labels(stage).inc()
        for job, count in self._jobs_of(items):
            job.log.error("worker_lost", stage=stage, reason=reason, job_items=count)

    def stage_broken(self, stage: str, error: BaseException) -> None:
        log.error("stage_broken", stage=stage, error=str(error))
        self._on_broken()
