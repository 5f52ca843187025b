"""The lease keeper: renew what is in flight, notice leases lost to another daemon."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.support.timing import ManualClock
from worker.adapters.fakes import InMemoryJobSource
from worker.jobs.job import Job
from worker.jobs.joblog import JobLog
from worker.jobs.leases import LeaseKeeper
from worker.jobs.ledger import Ledger
from worker.message import parse_job_message
from worker.telemetry.progress import Progress


def _admit(ledger: Ledger, source: InMemoryJobSource, tmp_path: Path) -> Job:
    [message] = source.receive(1, 0, 30)
    job = ledger.receive(message)
    assert job is not None
    body = json.dumps({"job_id": "j", "inputs": ["s3://bkt/a"], "output": "s3://bkt/o/"})
    spec = parse_job_message(body, frozenset())
    ledger.admit(job, spec, ["s3://bkt/a"], JobLog(tmp_path / "j.log", "j"))
    return job


def test_renewals_keep_a_message_invisible_past_its_timeout(tmp_path: Path) -> None:
    """Renewing every half timeout keeps the message hidden long after the first lease."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    keeper = _keeper(ledger, source, clock)
    for _ in range(10):
        clock.now += 15
        keeper.renew_all()
        assert source.receive(10, 0, 30) == []
    assert source.extend_calls == 10
    assert job.log is not None
    job.log.close()


def test_leases_are_not_renewed_while_nothing_progresses(tmp_path: Path) -> None:
    """A daemon that holds jobs but has moved none of them past its stall limit stops
    renewing: its messages go back to the queue for a healthy worker instead of being
    held for hours; renewals resume once work moves again."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    _admit(ledger, source, tmp_path)
    progress = Progress(stall_after_s=60, clock=clock)
    keeper = _keeper(ledger, source, clock, progress=progress)
    clock.now += 15
    keeper.renew_all()
    assert source.extend_calls == 1
    clock.now += 60
    keeper.renew_all()
    assert source.extend_calls == 1
    assert len(source.receive(10, 0, 30)) == 1  # its lease ran out: visible to others
    progress.beat()
    keeper.renew_all()
    assert source.extend_calls == 2


def test_lost_lease_is_marked_and_no_longer_renewed(tmp_path: Path) -> None:
    """When the lease expired and another consumer took the message, the renewal fails:
    the job is marked lost, its log says so, and it is not renewed again."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    clock.now += 31
    assert len(source.receive(1, 0, 30)) == 1  # someone else's receive
    keeper = _keeper(ledger, source, clock)
    keeper.renew_all()
    assert job.lease_lost and ledger.leases() == {}
    assert job.log is not None and '"lease_lost"' in job.log.close().decode()
    keeper.renew_all()
    assert source.extend_calls == 1


def test_nothing_in_flight_means_no_calls(tmp_path: Path) -> None:
    """An idle daemon makes no renewal calls."""
    source = InMemoryJobSource()
    _keeper(Ledger(), source, ManualClock()).renew_all()
    assert source.extend_calls == 0


def test_a_job_nearing_the_lease_ceiling_is_released_not_renewed(tmp_path: Path) -> None:
    """SQS hides a message for at most 12 hours from its receive: the keeper renews until
    the next renewal would pass the ceiling, then hands the job over to be released
    (and says so in the job's log) instead of letting SQS redeliver it silently."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    job.received_at = clock.now
    released: list[Job] = []

    def release(job: Job) -> None:
        released.append(job)
        ledger.release(job)

    keeper = _keeper(ledger, source, clock, max_lease_s=100, on_ceiling=release)
    for _ in range(4):  # at 15, 30, 45, 60 s: 60 + 30 still fits in 100
        clock.now += 15
        keeper.renew_all()
    assert released == [] and source.extend_calls == 4
    clock.now += 15  # 75 + 30 would pass the ceiling
    keeper.renew_all()
    assert released == [job] and source.extend_calls == 4
    assert job.log is not None and '"lease_ceiling_reached"' in job.log.close().decode()


def _keeper(
    ledger: Ledger,
    source: InMemoryJobSource,
    clock: ManualClock,
    *,
    max_lease_s: float = 12 * 3600,
    on_ceiling: Callable[[Job], None] = lambda job: None,
    progress: Progress | None = None,
) -> LeaseKeeper:
    return LeaseKeeper(
        ledger,
        source,
        visibility_timeout_s=30,
        interval_s=15,
        max_lease_s=max_lease_s,
        on_ceiling=on_ceiling,
        progress=progress or Progress(stall_after_s=float("inf"), clock=clock),
        clock=clock,
    )


class ReleaseDuringRenewal(InMemoryJobSource):
    """Releases the job (as the daemon's `Outcomes` would, from another thread) after the
    keeper took its list of leases and before its renewal call reaches SQS."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.release_first: tuple[Ledger, Job] | None = None

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        if self.release_first is not None:
            ledger, job = self.release_first
            self.release_first = None
            ledger.release(job, 0)
            self.release(job.receipt_handle, 0)
        return super().extend(receipt_handles, visibility_timeout_s)


def test_a_release_that_lands_during_a_renewal_is_not_undone(tmp_path: Path) -> None:
    """The renewal carried the released job's handle: it would hide the message for a
    whole visibility timeout. The keeper releases it again, with the delay it was given."""
    clock = ManualClock()
    source, ledger = ReleaseDuringRenewal(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    source.release_first = (ledger, job)
    _keeper(ledger, source, clock).renew_all()
    [again] = source.receive(10, 0, 30)
    assert again.message_id == job.message.message_id
