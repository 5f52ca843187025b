"""Reporting on jobs: engine events into per-job logs and timings, and each in-flight
job's progress.json."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import structlog

from worker.engine import Item
from worker.jobs.checkpoints import Checkpoints, Halt
from worker.jobs.job import FEEDABLE, Job
from worker.jobs.ledger import Ledger
from worker.ports import BlobStore
from worker.sharding.shards import Shards
from worker.telemetry.metrics import Metrics
from worker.telemetry.progress import Progress
from worker.telemetry.timeline import Timeline

log = structlog.get_logger()


class JobObserver:
    """Turns engine reports into per-job timings and log lines, metrics and progress.
    A job's log tells of each batch of `batching_stages` (the models) it had items in;
    other stages take several items at a time too, but say nothing a job needs."""

    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        progress: Progress,
        timeline: Timeline | None,
        on_broken: Callable[[str, frozenset[str] | None], None],
        *,
        batching_stages: Sequence[str],
    ):
        self._ledger = ledger
        self._batching_stages = frozenset(batching_stages)
        self._metrics = metrics
        self._progress = progress
        self._timeline = timeline
        self._on_broken = on_broken
        self._timings = threading.Lock()  # fetch threads report at once

    def _jobs_of(self, items: Sequence[Item]) -> list[tuple[Job, int]]:
        counts = Counter(item.job for item in items)
        return [
            (job, counts[job.key])
            for job in self._ledger.get_all(counts)
            if job is not None and job.log is not None
        ]

    def stage_ran(
        self, stage: str, items: Sequence[Item], duration_s: float, events: Sequence[dict[str, Any]]
    ) -> None:
        self._progress.beat()
        if self._timeline is not None:
            self._timeline.record(stage, len(items), duration_s)
        self._metrics.stage_ran(stage, len(items), duration_s)
        jobs, batching = self._jobs_of(items), stage in self._batching_stages
        with self._timings:
            for job, count in jobs:
                job.timings[stage].add(count, duration_s)
                if batching:
                    job.device_s += duration_s * count / len(items)
        for job, count in jobs:
            assert job.log is not None
            if batching:
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
        self._progress.beat()
        log.warning("worker_lost", stage=stage, reason=reason, items=len(items))
        self._metrics.worker_restarts.labels(stage).inc()
        for job, count in self._jobs_of(items):
            assert job.log is not None
            job.log.error("worker_lost", stage=stage, reason=reason, job_items=count)

    def workers_changed(self, stage: str, workers: int, reason: str) -> None:
        if self._timeline is not None:
            self._timeline.count(f"{stage} workers", workers)

    def stage_counted(self, stage: str, counts: Mapping[str, int]) -> None:
        for name, count in counts.items():
            total = self._metrics.stage_counted(stage, name, count)
            if self._timeline is not None:
                self._timeline.count(f"{stage} {name}", total)

    def stage_broken(self, stage: str, error: BaseException, jobs: frozenset[str] | None) -> None:
        log.error("stage_broken", stage=stage, error=str(error))
        self._on_broken(f"stage {stage} is broken: {error}", jobs)


class ProgressReporter:
    """Every `interval_s`, publishes each in-flight job's progress.json (for `enqueue
    --wait` and dashboards) if it changed (a shard, its count in its job's), brings its
    local log file up to date, and stops a job whose cancellation was asked for (its
    finish then writes what it has), whose message was handed over (its continuation
    runs it), or that is a shard another run has committed (a duplicate)."""

    def __init__(
        self,
        ledger: Ledger,
        blobs: BlobStore,
        checkpoints: Checkpoints,
        shards: Shards,
        interval_s: float,
        *,
        cancel: Callable[[Job], None],
        superseded: Callable[[Job], None],
        duplicate: Callable[[Job], None],
    ):
        self._ledger = ledger
        self._blobs = blobs
        self._checkpoints = checkpoints
        self._shards = shards
        self._interval_s = interval_s
        self._halts: dict[Halt | Literal["duplicate"], Callable[[Job], None]] = {
            "cancelled": cancel,
            "superseded": superseded,
            "duplicate": duplicate,
        }
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            for job in self._ledger.unsettled():
                if job.log is not None:
                    self._report(job)
                halt = self._halt(job) if job.state in FEEDABLE else None
                if halt is not None:
                    self._halts[halt](job)

    def stop(self) -> None:
        self._stopped.set()

    def _halt(self, job: Job) -> Halt | Literal["duplicate"] | None:
        try:
            if job.plan is not None and self._shards.committed_elsewhere(job):
                return "duplicate"
            return self._checkpoints.halt(job)
        except Exception as error:
            log.warning("halt_check_failed", job_id=job.job_id, error=repr(error))
            return None

    def _report(self, job: Job) -> None:
        assert job.log is not None and job.spec is not None
        try:
            job.log.flush()
        except OSError as error:
            log.warning("job_log_not_written", job_id=job.job_id, error=repr(error))
        finished = job.finished_items
        if finished == job.progress_reported:
            return
        if job.plan is not None:
            self._shards.report(job)
            job.progress_reported = finished
            return
        progress = {
            "job_id": job.job_id,
            "request_id": job.spec.request_id,
            "items": len(job.inputs),
            "finished": finished,
            "failed": job.failed,
        }
        try:
            self._blobs.put(
                job.spec.output_location("progress.json"),
                json.dumps(progress).encode(),
                "application/json",
            )
        except Exception as error:
            log.warning("progress_upload_failed", job_id=job.job_id, error=repr(error))
            return
        job.progress_reported = finished
