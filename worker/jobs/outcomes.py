"""Every way a job leaves this daemon: acked, released (now or later), handed over,
superseded (deleted, a continuation running it), dead-lettered.

Each one moves the job's state in the ledger first (which stops its lease renewals, and
which only one caller can win), then makes the SQS call, then forgets the job. None of
them raises: a failed SQS call is logged, and the message comes back by itself when its
visibility timeout runs out.

A job given back because this worker was interrupted (a signal, a spot or scale-in
notice, the lease ceiling), not because it failed, is handed over: what it finished is
checkpointed, and it goes back as a continuation message that carries its attempts, so
interruptions never spend the queue's maxReceiveCount. Failures still do.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job
from worker.jobs.ledger import Ledger
from worker.ports import SQS_MAX_ENTRIES_PER_BATCH_CALL, JobSource
from worker.retry import Backoff
from worker.settings import MAX_RETRY_DELAY_S
from worker.telemetry.metrics import Metrics
from worker.telemetry.progress import Progress

log = structlog.get_logger()

HAND_OVER_THREADS = 16


class Outcomes:
    """Settles jobs: the ledger transition, then the SQS call, then `forget`."""

    def __init__(
        self,
        ledger: Ledger,
        source: JobSource,
        metrics: Metrics,
        progress: Progress,
        *,
        retry_delay_s: float,
        checkpoints: Checkpoints,
        lease_s: float,
    ):
        self._ledger = ledger
        self._source = source
        self._checkpoints = checkpoints
        self._metrics = metrics
        self._progress = progress
        self._retry_backoff = Backoff(base_s=retry_delay_s, cap_s=MAX_RETRY_DELAY_S)
        self._lease_s = lease_s

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

    def settle_written(self, job: Job, *, announced: bool, shards_left: bool = False) -> None:
        """Ack a job whose job.json is written once its message has nothing left to come
        back for: its notices sent (`announced`), and, merged, its shards' files removed
        (`shards_left` if not: this may be the last delivery of the job left to remove
        them). Else it is retried later, for what is left."""
        if not announced:
            self.retry_later(job, "a notice of the finished job was not sent")
        elif shards_left:
            self.retry_later(job, "the shards' files were not removed")
        else:
            self.ack(job)

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

    def dead_letter(self, job: Job, reason: str) -> bool:
        """Move a poison message to the dead-letter queue. If that fails (or there is no
        DLQ) it is released with a growing delay, left to the queue's redrive policy.
        False if the job was settled already (handed over by shutdown, say)."""
        if not self._ledger.dead_letter(job):
            return False
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
        return True

    def hand_over(
        self, job: Job, reason: str, delay_s: int = 0, *, runs_may_overlap: bool = False
    ) -> None:
        """Give back a job this worker cannot go on with through no fault of the job's:
        its results so far checkpointed, as a continuation message (visible after
        `delay_s`). `runs_may_overlap` (a shard, whose runs commit once): the
        continuation need not wait for this message to stop, should it come back."""
        if not self._ledger.release(job):
            return
        self._note_released(job, reason, delay_s)
        try:
            waits = not runs_may_overlap
            if not self._continued(job, delay_s, waits=waits) and not job.lease_lost:
                self._source.release(job.receipt_handle, delay_s)
        except Exception as error:
            log.warning("release_failed", job_id=job.job_id, error=repr(error))
        finally:
            self._forget(job)

    def superseded(self, job: Job) -> None:
        """The job's message was handed over, and the daemon that did so died before
        deleting it: its continuation runs the job now. Delete this one, unfinished,
        writing nothing (what it wrote meanwhile is fenced off by the outputs' etags)."""
        self._delete_unfinished(job, "job_handed_over_already")

    def duplicate(self, job: Job) -> None:
        """The job is a shard another run has committed (or whose job is merged): delete
        this one unfinished, and the checkpoint parts of the shard written since."""
        self._delete_unfinished(job, "shard_committed_elsewhere")
        try:
            self._checkpoints.remove(job)
        except Exception as error:  # the merge removes every checkpoint
            log.warning("checkpoint_not_removed", job_id=job.job_id, error=repr(error))

    def _delete_unfinished(self, job: Job, event: str) -> None:
        if not self._ledger.supersede(job):
            return
        self._metrics.jobs.labels("superseded").inc()
        log.info(
            event, job_id=job.job_id, message_id=job.message.message_id, finished=job.finished_items
        )
        try:
            if not job.lease_lost:
                self._source.ack(job.receipt_handle)
        except Exception as error:  # it comes back, and is acked unread at its admission
            log.warning("ack_failed", job_id=job.job_id, error=repr(error))
        finally:
            self._forget(job)

    def lease_ceiling_reached(self, job: Job) -> None:
        """The job has been held as long as SQS allows: handed over, or released if it
        did not move (one input slower than the ceiling must reach the DLQ)."""
        if _moved_or_untouched(job):
            self.hand_over(job, "lease ceiling reached")
        else:
            self.release(job, "lease ceiling reached, no progress")

    def release_all(
        self,
        reason: str,
        *,
        breakage: str | None = None,
        suspects: frozenset[str] | None = frozenset(),
    ) -> int:
        """Give back every unsettled job at once (shutdown), each one's results so far
        checkpointed, as continuations. With `breakage` (why this worker broke), those
        that may be why (`suspects`, by key; None: all) carry one more broken worker and
        are run apart from other jobs next time, or dead-lettered (`Intake`); the others
        could not be why, and go uncharged. A job not handed over is released, in
        batched calls. Returns how many."""
        jobs = [job for job in self._ledger.unsettled() if self._ledger.release(job)]
        for job in jobs:
            self._note_released(job, reason, 0)

        def give_back(job: Job) -> bool:
            if breakage is None:
                return self._continued(job)
            suspect = suspects is None or job.key in suspects
            return self._continued(job, breakage=breakage if suspect else None, surely=True)

        # At once: hundreds of jobs must not take hundreds of round trips in a row.
        with ThreadPoolExecutor(HAND_OVER_THREADS, thread_name_prefix="hand-over") as pool:
            continued = list(pool.map(give_back, jobs))
        released = [job for job, done in zip(jobs, continued, strict=True) if not done]
        handles = [job.receipt_handle for job in released if not job.lease_lost]
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

    def _continued(
        self,
        job: Job,
        delay_s: int = 0,
        breakage: str | None = None,
        *,
        surely: bool = False,
        waits: bool = True,
    ) -> bool:
        """Checkpoint the job, send its continuation (with `breakage`, one more broken
        worker), delete this message; False if no continuation was sent (the job is to
        be released instead): it did not move (`_moved_or_untouched`), unless `surely`
        (a breakage's suspects' tries are bounded by their count, and the others are
        cleared). Never raises."""
        self._checkpoints.save(job)
        if job.lease_lost:  # another delivery has it now
            return True
        if not (surely or _moved_or_untouched(job)):
            return False
        # If this worker dies before the delete, this message comes back once its lease
        # ends: the continuation is told when, to wait for it to stop if it was late.
        # (A delayed continuation is such a wait already: it is not told again.)
        lease_ends = None if delay_s or not waits else time.time() + self._lease_s
        try:
            self._source.requeue(
                job.message, delay_s=delay_s, lease_ends=lease_ends, breakage=breakage
            )
        except Exception as error:
            log.warning("continuation_not_sent", job_id=job.job_id, error=repr(error))
            return False
        try:
            self._source.ack(job.receipt_handle)
        except Exception as error:
            # The old message comes back after its lease: it is marked, so that whoever
            # receives it acks it instead of running the job beside its continuation.
            log.warning("handed_over_message_not_deleted", job_id=job.job_id, error=repr(error))
            self._checkpoints.supersede(job.spec, job.message.message_id)
        return True

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
        for local_files in (job.arrays, job.tar_copies):  # uploaded, or to be made again
            if local_files is not None:
                local_files.remove()
        self._progress.beat()


def _moved_or_untouched(job: Job) -> bool:
    """Whether giving the job back should not count against it: this delivery moved it
    forward (results a checkpoint keeps), or ran none of it. One that ran without moving
    may be why the worker stops (say, a health check that fails while it runs), so it
    counts, and cannot go round forever without reaching the DLQ."""
    return job.finished_items > job.resumed or job.fed == 0


@dataclass(frozen=True)
class Lifecycle:
    """What every loop that moves jobs shares: the ledger, the one place jobs are
    settled, the metrics, and the clock of progress the supervisor watches."""

    ledger: Ledger
    outcomes: Outcomes
    metrics: Metrics
    progress: Progress
