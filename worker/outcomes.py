"""Every way a job leaves this daemon: acked, released (now or later), dead-lettered.

Each one moves the job's state in the ledger first (which stops its lease renewals, and
which only one caller can win), then makes the SQS call, then forgets the job. None of
them raises: a failed SQS call is logged, and the message comes back by itself when its
visibility timeout runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from worker.ledger import Job, Ledger
from worker.metrics import Metrics
from worker.ports import JobSource
from worker.retry import Backoff
from worker.settings import MAX_RETRY_DELAY_S, SQS_MAX_ENTRIES_PER_BATCH_CALL
from worker.supervisor import Progress

log = structlog.get_logger()


class Outcomes:
    """Settles jobs: the ledger transition, then the SQS call, then `forget`."""

    def __init__(
        self,
        ledger: Ledger,
        source: JobSource,
        metrics: Metrics,
        progress: Progress,
        retry_delay_s: float,
    ):
        self._ledger = ledger
        self._source = source
        self._metrics = metrics
        self._progress = progress
        self._retry_backoff = Backoff(base_s=retry_delay_s, cap_s=MAX_RETRY_DELAY_S)

    def retry_delay_s(self, attempt: int) -> int:
        """How long a job that could not progress stays hidden: doubled per delivery."""
        return round(self._retry_backoff.bound_s(attempt - 1))

    def ack(self, job: Job) -> bool:
        """Delete a job whose outputs are written; False if it was released meanwhile or
        the delete failed (it comes back, and its redo rewrites the same keys)."""
        if not self._ledger.ack(job):
            return False
        try:
            if job.lease_lost:
                log.warning("job_not_acked_lease_lost", job_id=job.job_id)
                return False
            self._source.ack(job.receipt_handle)
            return True
        except Exception as error:
            log.warning("ack_failed", job_id=job.job_id, error=repr(error))
            return False
        finally:
            self._forget(job)

    def release(self, job: Job, reason: str, delay_s: int = 0) -> None:
        """Give a job back unfinished, visible again after `delay_s`."""
        if not self._ledger.release(job, delay_s):
            return
        self._note_released(job, reason, delay_s)
        try:
            if not job.lease_lost:
                self._source.release(job.receipt_handle, delay_s)
        except Exception as error:
            log.warning("release_failed", job_id=job.job_id, error=repr(error))
        finally:
            self._forget(job)

    def retry_later(self, job: Job, reason: str) -> None:
        """Give back a job that cannot progress now (transient errors), with a delay that
        grows with each delivery, so it is neither finished with those errors nor retried
        in a tight loop."""
        self.release(job, reason, self.retry_delay_s(job.attempt))

    def dead_letter(self, job: Job, reason: str) -> None:
        """Move a poison message to the dead-letter queue. If that fails (or there is no
        DLQ) it is released with a growing delay, left to the queue's redrive policy."""
        if not self._ledger.dead_letter(job):
            return
        self._metrics.jobs.labels("poison").inc()
        try:
            moved = self._source.dead_letter(job.message, reason)
        except Exception as error:
            log.warning("dead_letter_failed", message_id=job.message.message_id, error=repr(error))
            moved = False
        log.warning(
            "poison_message",
            message_id=job.message.message_id,
            reason=reason,
            dead_lettered=moved,
        )
        try:
            if moved:  # with the job's handle: the message may have come back since
                self._source.ack(job.receipt_handle)
            else:
                self._source.release(job.receipt_handle, self.retry_delay_s(job.attempt))
        except Exception as error:
            log.warning("settle_failed", message_id=job.message.message_id, error=repr(error))
        finally:
            self._forget(job)

    def release_all(self, reason: str) -> int:
        """Give back every unsettled job at once (shutdown, an open circuit), in batched
        calls: hundreds of jobs must not take hundreds of round trips. Returns how many."""
        jobs = [job for job in self._ledger.unsettled() if self._ledger.release(job)]
        for job in jobs:
            self._note_released(job, reason, 0)
        handles = [job.receipt_handle for job in jobs if not job.lease_lost]
        for start in range(0, len(handles), SQS_MAX_ENTRIES_PER_BATCH_CALL):
            chunk = handles[start : start + SQS_MAX_ENTRIES_PER_BATCH_CALL]
            try:
                failures = self._source.extend(chunk, 0)
            except Exception as error:
                log.warning("release_failed", jobs=len(chunk), error=repr(error))
                continue
            if failures:
                log.warning("release_failed", jobs=len(failures), codes=sorted(failures.values()))
        for job in jobs:
            self._forget(job)
        return len(jobs)

    def _note_released(self, job: Job, reason: str, delay_s: int) -> None:
        self._metrics.jobs.labels("released").inc()
        log.warning("job_released", job_id=job.job_id, reason=reason, retry_in_s=delay_s)
        if job.log is None:
            return
        job.log.info("job_released", reason=reason, retry_in_s=delay_s)
        try:
            job.log.close()  # the machine's copy names the fault
        except OSError as error:
            log.warning("job_log_not_written", job_id=job.job_id, error=repr(error))

    def _forget(self, job: Job) -> None:
        self._ledger.forget(job)
        self._progress.beat()


@dataclass(frozen=True)
class Lifecycle:
    """What every loop that moves jobs shares: the ledger, the one place jobs are
    settled, the metrics, and the clock of progress the supervisor watches."""

    ledger: Ledger
    outcomes: Outcomes
    metrics: Metrics
    progress: Progress
