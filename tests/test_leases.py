"""The lease keeper: renew what is in flight, notice leases lost to another daemon."""

from __future__ import annotations

import json
from pathlib import Path

from worker.fakes import InMemoryJobSource
from worker.joblog import JobLog
from worker.leases import LeaseKeeper
from worker.ledger import Job, Ledger
from worker.message import parse_job_message


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admit(ledger: Ledger, source: InMemoryJobSource, tmp_path: Path) -> Job:
    [message] = source.receive(1, 0, 30)
    job = Job(
        key=message.message_id,
        job_id="j",
        inputs=["s3://bkt/a"],
        receipt_handle=message.receipt_handle,
        attempt=message.receive_count,
        log=JobLog(tmp_path / "j.log", "j"),
        message=parse_job_message(
            json.dumps({"inputs": ["s3://bkt/a"], "output": "s3://bkt/o/"}), frozenset()
        ),
    )
    ledger.admit(job)
    return job


def test_renewals_keep_a_message_invisible_past_its_timeout(tmp_path: Path) -> None:
    """Renewing every half timeout keeps the message hidden long after the first lease."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    keeper = LeaseKeeper(ledger, source, visibility_timeout_s=30, interval_s=15)
    for _ in range(10):
        clock.now += 15
        keeper.renew_all()
        assert source.receive(10, 0, 30) == []
    assert source.extend_calls == 10
    job.log.close()


def test_lost_lease_is_marked_and_no_longer_renewed(tmp_path: Path) -> None:
    """When the lease expired and another consumer took the message, the renewal fails:
    the job is marked lost, its log says so, and it is not renewed again."""
    clock = ManualClock()
    source, ledger = InMemoryJobSource(clock), Ledger()
    source.send("{}")
    job = _admit(ledger, source, tmp_path)
    clock.now += 31
    assert len(source.receive(1, 0, 30)) == 1  # someone else's receive
    keeper = LeaseKeeper(ledger, source, visibility_timeout_s=30, interval_s=15)
    keeper.renew_all()
    assert job.lease_lost and ledger.leases() == {}
    assert '"lease_lost"' in job.log.close().decode()
    keeper.renew_all()
    assert source.extend_calls == 1


def test_nothing_in_flight_means_no_calls(tmp_path: Path) -> None:
    """An idle daemon makes no renewal calls."""
    source = InMemoryJobSource()
    LeaseKeeper(Ledger(), source, 30, 15).renew_all()
    assert source.extend_calls == 0
