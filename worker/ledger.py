"""The ledger: the one record of every job in flight, read by every part of the daemon.

The puller admits jobs, the regrouper records results into them, the lease keeper reads
their receipt handles, shutdown releases what is left. All of it goes through here, under
one lock, so there is exactly one answer to "what is this daemon holding?".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from worker.joblog import JobLog
from worker.message import JobMessage


class JobStatus(StrEnum):
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"
    FAILED = "failed"


@dataclass
class StageTiming:
    """How long one stage spent on one job's items."""

    calls: int = 0
    items: int = 0
    busy_s: float = 0.0

    def add(self, items: int, duration_s: float) -> None:
        self.calls += 1
        self.items += items
        self.busy_s += duration_s


@dataclass
class Job:
    """One message being worked on."""

    key: str  # unique per admission: a redelivered message is a new admission
    message_id: str
    job_id: str
    message: JobMessage
    inputs: list[str]
    receipt_handle: str
    attempt: int
    log: JobLog
    received_at: float = field(default_factory=time.time)
    results: list[dict[str, Any] | None] = field(default_factory=list)
    succeeded: int = 0
    failed: int = 0
    lease_lost: bool = False
    claimed: bool = False  # being acked or released: no more renewals or results
    progress_reported: int = 0
    timings: dict[str, StageTiming] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)

    @property
    def finished_items(self) -> int:
        return self.succeeded + self.failed

    @property
    def complete(self) -> bool:
        return self.finished_items == len(self.inputs)

    @property
    def status(self) -> JobStatus:
        if self.failed == 0:
            return JobStatus.SUCCEEDED
        return JobStatus.FAILED if self.succeeded == 0 else JobStatus.PARTIAL


class Ledger:
    """Jobs in flight, keyed by admission; every method is thread-safe."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._changed = threading.Condition(threading.RLock())
        self._closed = False
        # Kept as a count: the puller asks after every change, with hundreds of jobs held.
        self._outstanding = 0

    def __len__(self) -> int:
        with self._changed:
            return len(self._jobs)

    def admit(self, job: Job) -> bool:
        """Enter a job; False once the ledger is closed (the daemon is shutting down)."""
        with self._changed:
            if self._closed:
                return False
            if job.key in self._jobs:
                raise KeyError(f"job {job.key} is already in flight")
            self._jobs[job.key] = job
            self._outstanding += len(job.inputs) - job.finished_items
            self._changed.notify_all()
            return True

    def close(self) -> None:
        """Refuse admissions from now on, so shutdown's list of jobs to release is final."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def get(self, key: str) -> Job | None:
        with self._changed:
            return self._jobs.get(key)

    def jobs(self) -> list[Job]:
        with self._changed:
            return list(self._jobs.values())

    def record(self, key: str, index: int, result: dict[str, Any]) -> Job | None:
        """File one item's result; returns the job if that completed it."""
        with self._changed:
            job = self._jobs.get(key)
            if job is None or job.claimed:
                return None  # released while its items were still inside
            if job.results[index] is not None:
                raise ValueError(f"job {job.job_id}: result {index} recorded twice")
            job.results[index] = result
            self._outstanding -= 1
            if "error" in result:
                job.failed += 1
            else:
                job.succeeded += 1
            self._changed.notify_all()
            return job if job.complete else None

    def claim(self, key: str) -> bool:
        """Reserve a job for its ack or release, which only one caller may make.

        Its lease stops being renewed at once (so a renewal never races the delete), but
        it stays in the ledger, and counts as held, until `remove`: the daemon is not
        idle, and not drained, while a release is still on its way to SQS.
        """
        with self._changed:
            job = self._jobs.get(key)
            if job is None or job.claimed:
                return False
            job.claimed = True
            self._outstanding -= len(job.inputs) - job.finished_items
            self._changed.notify_all()
            return True

    def remove(self, key: str) -> Job | None:
        """Take a job out, once its message has been acked or released."""
        with self._changed:
            job = self._jobs.pop(key, None)
            if job is not None and not job.claimed:
                self._outstanding -= len(job.inputs) - job.finished_items
            self._changed.notify_all()
            return job

    def renew_receipt(self, message_id: str, receipt_handle: str) -> bool:
        """A redelivery of a message already in flight here: keep the newer handle."""
        with self._changed:
            for job in self._jobs.values():
                if job.message_id == message_id:
                    job.receipt_handle, job.lease_lost = receipt_handle, False
                    return True
            return False

    def leases(self) -> dict[str, str]:
        """Receipt handle by job key, for every job whose lease is still ours."""
        with self._changed:
            return {
                key: job.receipt_handle
                for key, job in self._jobs.items()
                if not (job.lease_lost or job.claimed)
            }

    def mark_lease_lost(self, key: str) -> Job | None:
        with self._changed:
            job = self._jobs.get(key)
            if job is not None:
                job.lease_lost = True
            return job

    def outstanding_items(self) -> int:
        """Items admitted and not yet back from the pipeline."""
        with self._changed:
            return self._outstanding

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until `predicate()` holds (checked on every change or `wake`)."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)

    def wake(self) -> None:
        """Make waiters re-check their predicate (after an outside event, like a signal)."""
        with self._changed:
            self._changed.notify_all()
