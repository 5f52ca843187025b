"""The ledger's bookkeeping and the per-job log file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from worker.joblog import JobLog
from worker.ledger import Job, Ledger
from worker.message import parse_job_message


def _job(key: str, items: int, log_dir: Path) -> Job:
    inputs = [f"s3://bkt/{key}/{index}" for index in range(items)]
    return Job(
        key=key,
        message_id=key,
        job_id=key,
        message=parse_job_message(
            json.dumps({"inputs": inputs, "output": "s3://bkt/o/"}), frozenset()
        ),
        inputs=inputs,
        receipt_handle=f"{key}#1",
        attempt=1,
        log=JobLog(log_dir / f"{key}.log", key),
    )


def _outstanding_by_hand(ledger: Ledger) -> int:
    return sum(len(job.inputs) - job.finished_items for job in ledger.jobs() if not job.claimed)


@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    steps=st.lists(st.tuples(st.sampled_from("rcx"), st.integers(0, 5), st.booleans())),
)
def test_outstanding_items_counts_what_is_still_inside(
    sizes: list[int], steps: list[tuple[str, int, bool]]
) -> None:
    """Whatever order results, claims and removals come in, the running count equals the
    items of unclaimed jobs not yet back."""
    with tempfile.TemporaryDirectory() as scratch:
        ledger = Ledger()
        jobs = [_job(f"j{number}", size, Path(scratch)) for number, size in enumerate(sizes)]
        for job in jobs:
            ledger.admit(job)
        for action, number, failed in steps:
            job = jobs[number % len(jobs)]
            if action == "r" and None in job.results:
                result = {"error": {}} if failed else {}
                ledger.record(job.key, job.results.index(None), result)
            elif action == "c":
                ledger.claim(job.key)
            elif action == "x":
                ledger.remove(job.key)
            assert ledger.outstanding_items() == _outstanding_by_hand(ledger)
        for job in jobs:
            job.log.close()


def test_job_log_file_keeps_released_attempts_and_goes_when_the_job_is_done(
    tmp_path: Path,
) -> None:
    """A released attempt's lines stay on the machine (they name the fault); the next
    attempt appends its own; once the job is done and uploaded, the file goes."""
    path = tmp_path / "j.log"
    first = JobLog(path, "j")
    first.info("job_received", attempt=1)
    first.error("job_released", reason="upload failed")
    assert b'"job_released"' in first.close()
    second = JobLog(path, "j")
    second.info("job_received", attempt=2)
    second.info("job_finished")
    lines = [json.loads(line) for line in second.lines().decode().splitlines()]
    assert [(line["event"], line["level"], line["job_id"]) for line in lines] == [
        ("job_received", "info", "j"),
        ("job_finished", "info", "j"),
    ]
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == [
        "job_received",
        "job_released",
    ]
    second.discard()
    assert not path.exists()
    second.flush()
    assert not path.exists()


def test_job_log_reaches_the_file_only_when_flushed(tmp_path: Path) -> None:
    """A short job never touches the disk; a long one can be followed at each flush."""
    log = JobLog(tmp_path / "j.log", "j")
    log.info("batch_done", items=3)
    assert not (tmp_path / "j.log").exists()
    log.flush()
    log.info("batch_done", items=5)
    log.flush()
    lines = (tmp_path / "j.log").read_text().splitlines()
    assert [json.loads(line)["items"] for line in lines] == [3, 5]
    log.discard()
