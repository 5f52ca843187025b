"""How a job this worker cannot go on with is given back (`Outcomes.hand_over`)."""

from __future__ import annotations

import json
from pathlib import Path

from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.joblog import JobLog
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Outcomes
from worker.message import parse_job_message
from worker.telemetry.metrics import Metrics
from worker.telemetry.progress import Progress


def test_a_job_handed_back_without_a_continuation_stays_hidden_for_the_delay(
    tmp_path: Path,
) -> None:
    """A job handed over through no fault of its own (a merge's join with no disk room
    for now) that ran without moving on gets no continuation: its own message is
    released, and stays hidden for the hand-over's delay, where it came back at once."""
    now = [0.0]
    source = InMemoryJobSource(clock=lambda: now[0])
    source.send("{}")
    [message] = source.receive(1, 0, 30)
    ledger = Ledger()
    job = ledger.receive(message)
    assert job is not None
    inputs = ["s3://bkt/a"]
    spec = parse_job_message(json.dumps({"inputs": inputs, "output": "s3://bkt/o/"}), frozenset())
    ledger.admit(job, spec, inputs, JobLog(tmp_path / "job.log", job.key))
    ledger.next_items(1)  # fed, never finished: it did not move on
    checkpoints = Checkpoints(InMemoryBlobStore(), ledger)
    outcomes = Outcomes(
        ledger,
        source,
        Metrics(),
        Progress(3600.0),
        retry_delay_s=1,
        checkpoints=checkpoints,
        lease_s=30,
    )
    outcomes.hand_over(job, "no room on the disk for now", 60)
    now[0] = 59
    assert source.receive(1, 0, 30) == []
    now[0] = 61
    assert [again.message_id for again in source.receive(1, 0, 30)] == [message.message_id]
