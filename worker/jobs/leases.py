"""The lease keeper: keeps every held message invisible until its job is settled.

One ticker renews all leases in batched calls (as aws-dotnet-messaging does) rather than
one timer per message. A job is settled in the ledger *before* its message is deleted,
and settled jobs are not renewed, so a renewal never races a delete
(bbc/sqs-consumer#260); a release that lands while a renewal is on its way is made
again after it. Leases are renewed only while the daemon makes progress: a
stuck daemon lets its jobs go back to the queue rather than hold them for 12 hours.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from worker.jobs.job import Job, JobState
from worker.jobs.ledger import Ledger
from worker.ports import RENEWAL_FAILED, JobSource
from worker.telemetry.progress import Progress

log = structlog.get_logger()

LEASE_LOST_CODES = frozenset(
    {"ReceiptHandleIsInvalid", "InvalidParameterValue", "MessageNotInflight"}
)


class LeaseKeeper:
    """Renews the leases of the ledger's jobs every `interval_s`, on its own thread.

    SQS keeps a message invisible for at most 12 hours after it was received, renewals
    included. A job whose next renewal would pass `max_lease_s` is handed to
    `on_ceiling` (which releases it) instead of being renewed into a silent redelivery.
    """

    def __init__(
        self,
        ledger: Ledger,
        source: JobSource,
        visibility_timeout_s: int,
        interval_s: float,
        *,
        max_lease_s: float,
        on_ceiling: Callable[[Job], None],
        progress: Progress,
        on_renewed: Callable[[int, int], None] = lambda ok, failed: None,
        clock: Callable[[], float] = time.time,
    ):
        self._ledger = ledger
        self._source = source
        self._visibility_timeout_s = visibility_timeout_s
        self._interval_s = interval_s
        self._max_lease_s = max_lease_s
        self._on_ceiling = on_ceiling
        self._progress = progress
        self._on_renewed = on_renewed
        self._clock = clock
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.renew_all()

    def stop(self) -> None:
        self._stopped.set()

    def renew_all(self) -> None:
        """Extend every lease still ours; mark the ones SQS says we no longer hold."""
        self._release_at_ceiling()
        leases = self._ledger.leases()
        if not leases:
            return
        if self._progress.stalled():
            log.error("lease_renewal_withheld", leases=len(leases), idle_s=self._progress.idle_s())
            return
        held = [job for key in leases if (job := self._ledger.get(key)) is not None]
        try:
            # Done before the leases renewed a tick ago run out: a late renewal is none.
            failures = self._source.extend(
                list(leases.values()),
                self._visibility_timeout_s,
                within_s=self._visibility_timeout_s - self._interval_s,
            )
        except Exception as error:
            # Half the timeout is still left: the next tick tries again.
            log.warning("lease_renewal_failed", error=repr(error), leases=len(leases))
            return
        finally:
            self._redo_releases(held)
        log.info("leases_extended", leases=len(leases) - len(failures), failed=len(failures))
        self._on_renewed(len(leases) - len(failures), len(failures))
        for key, handle in leases.items():
            code = failures.get(handle)
            if code is None:
                continue
            if code in LEASE_LOST_CODES:
                job = self._ledger.mark_lease_lost(key)
                if job is not None:
                    if job.log is not None:
                        job.log.error("lease_lost", code=code)
                    log.warning("lease_lost", job_id=job.job_id, code=code)
            elif code != RENEWAL_FAILED:  # a failed call is logged once, by the source
                log.warning("lease_renewal_failed", message_id=key, code=code)

    def _redo_releases(self, renewed: list[Job]) -> None:
        """A job released while this renewal was on its way may just have been hidden
        again for a whole visibility timeout: release it again, with its delay."""
        for job in renewed:
            if job.state is not JobState.RELEASED or job.lease_lost:
                continue
            try:
                self._source.release(job.receipt_handle, job.release_delay_s)
            except Exception as error:
                log.warning("release_failed", job_id=job.job_id, error=repr(error))

    def _release_at_ceiling(self) -> None:
        now = self._clock()
        for job in self._ledger.unsettled():
            if job.lease_lost:
                continue
            held_s = now - job.received_at
            if held_s + self._visibility_timeout_s > self._max_lease_s:
                if job.log is not None:
                    job.log.error("lease_ceiling_reached", held_s=round(held_s, 1))
                log.warning(
                    "lease_ceiling_reached",
                    job_id=job.job_id,
                    held_s=round(held_s, 1),
                    max_lease_s=self._max_lease_s,
                )
                self._on_ceiling(job)
