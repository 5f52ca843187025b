"""Admission off the receive path, in-process against the in-memory fakes: a message
that takes long to admit (a slow listing) neither holds up the others received with it
nor counts as a stall of the daemon."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.in_process import job_file, run_until_drained, sample_images, send_job
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.loops.intake import ADMISSION_LEADS, LEAD_MEMORY_S, AdmissionLead
from worker.ports import S3Location

PAGE = 1000  # keys in a page of a listing, as S3


class _SlowListing(InMemoryBlobStore):
    """Lists `slow/` a page every `page_s`, as S3 does a prefix under load."""

    def __init__(self, page_s: float) -> None:
        super().__init__()
        self._page_s = page_s

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        for number, key in enumerate(super().keys_under(prefix)):
            if number % PAGE == 0 and prefix.key.startswith("slow/"):
                time.sleep(self._page_s)
            yield key


def _slow_job_then_a_small_one() -> tuple[InMemoryJobSource, _SlowListing]:
    """A job whose prefix lists in 8 s (two pages, 4 s each), then a one-image job."""
    source, blobs = InMemoryJobSource(), _SlowListing(page_s=4.0)
    for number in range(PAGE + 1):
        blobs.objects[f"s3://bkt/slow/{number:05d}"] = b"not an image"
    source.send(
        '{"job_id": "slow", "inputs_prefix": "s3://bkt/slow/", "output": "s3://bkt/out/slow/"}'
    )
    send_job(source, "small", sample_images(blobs, 1))
    return source, blobs


def test_a_slow_listing_is_no_stall_and_holds_up_no_other_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose prefix lists in 8 s, received with a one-image job, on a daemon whose
    stall limit is 4 s (a step may take 3 s: a loaded machine's warm-up took over 1 s):
    the one-image job is done before the listing is, and the daemon neither stalls (a
    job being admitted is not work that moves no item) nor charges anyone; both jobs end."""
    monkeypatch.setattr("worker.daemon.wiring.STALL_MARGIN_S", 1.0)
    source, blobs = _slow_job_then_a_small_one()
    with capture_logs() as logs:
        run_until_drained(
            source, blobs, tmp_path, inference_timeout_seconds=3, preprocess_timeout_seconds=3
        )
    events = [entry["event"] for entry in logs]
    assert "daemon_stalled" not in events and "worker_broken" not in events
    finished = [entry["job_id"] for entry in logs if entry["event"] == "job_finished"]
    assert finished == ["small", "slow"]
    assert job_file(blobs, "slow", "job.json")["items"] == PAGE + 1
    assert job_file(blobs, "small", "job.json")["status"] == "succeeded"


def test_the_jobs_received_after_a_slow_listing_do_not_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs are admitted in the order they were received, but a job whose listing runs
    past a page is slow to admit: the one-image job received after it is admitted once
    that is known (a page, 4 s here), not when its listing ends (8 s), however long the
    patience with an earlier job slow for no reason known."""
    monkeypatch.setattr("worker.loops.intake.ADMISSION_PATIENCE_S", 60.0)
    source, blobs = _slow_job_then_a_small_one()
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    received = [entry["job_id"] for entry in logs if entry["event"] == "job_received"]
    assert received == ["small", "slow"]


def test_the_intake_holds_ahead_what_the_pipeline_goes_through_while_a_job_is_admitted() -> None:
    """The lead is the most items filed during any of the latest admissions, within its
    ceiling; an admission long past stops counting, by number or by age."""
    recorded, now = [0], [1000.0]
    lead = AdmissionLead(lambda: recorded[0], most=1000, clock=lambda: now[0])
    quick, slow = lead.start(), lead.start()
    recorded[0] += 120
    lead.admitted(quick)
    assert lead.items() == 120
    recorded[0] += 5000  # tars copied, admitted while thousands of items went through
    lead.admitted(slow)
    assert lead.items() == 1000
    for _ in range(ADMISSION_LEADS):
        started = lead.start()
        recorded[0] += 80
        lead.admitted(started)
    assert lead.items() == 80
    now[0] += LEAD_MEMORY_S + 1  # an idle while: what a busy hour measured is forgotten
    assert lead.items() == 0


class _CountingReads(InMemoryBlobStore):
    """Counts the GETs of each name."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        self.reads[location.key.rsplit("/", 1)[-1]] += 1
        return super().get(location, *args, **kwargs)


def test_a_job_with_no_rejection_under_its_output_is_admitted_without_reading_one(
    tmp_path: Path,
) -> None:
    """Admission withdraws an earlier run's rejected.json only where its listing of the
    output holds one: a GET at S3's latency on every admission, before, of an object
    that is almost never there."""
    source, blobs = InMemoryJobSource(), _CountingReads()
    send_job(source, "plain", sample_images(blobs, 2))
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "plain", "job.json")["status"] == "succeeded"
    # The one read is the finish's, which withdraws one written while the job ran.
    assert blobs.reads["rejected.json"] == 1
