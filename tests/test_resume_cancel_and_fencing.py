"""Resumable, cancellable and fenced jobs, in-process against the in-memory fakes: what
a delivery finds under a job's output decides what it runs and what it may write."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.support.in_process import (
    job_file,
    run_until_drained,
    run_while,
    sample_images,
    send_job,
    serving_settings,
)
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.jobs.checkpoints import CHECKPOINT_PREFIX
from worker.loops import results
from worker.loops.admission import WAITED_FOR_THE_REPLACED
from worker.message import CANCEL_MARKER
from worker.ports import S3Location
from worker.retry import Backoff


class CountingBlobs(InMemoryBlobStore):
    """Can act just before a chosen object is written, or read."""

    def __init__(self) -> None:
        super().__init__()
        self.before_put: dict[str, Callable[[], None]] = {}
        self.before_get: dict[str, Callable[[], None]] = {}

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        act = self.before_get.pop(str(location), None)
        if act is not None:
            act()
        return super().get(location, *args, **kwargs)

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        act = self.before_put.pop(str(location), None)
        if act is not None:
            act()
        return super().put(location, data, content_type, expect=expect)

    def inputs_read(self, uris: list[str]) -> int:
        return sum(self.reads[uri] for uri in uris)

    def names(self, job_id: str) -> list[str]:
        prefix = f"s3://bkt/out/{job_id}/"
        return sorted(uri.removeprefix(prefix) for uri in self.objects if uri.startswith(prefix))


OUTPUTS = ("results.jsonl", "job.log")  # a JSON Lines job's, besides job.json


def _parts(blobs: CountingBlobs, job_id: str) -> list[str]:
    return [name for name in blobs.names(job_id) if name.startswith(CHECKPOINT_PREFIX)]


def test_an_interrupted_job_resumes_from_its_checkpoint_and_ends_as_if_uninterrupted(
    tmp_path: Path,
) -> None:
    """A 40-item job is stopped part-way (SIGTERM, no grace): what it finished is saved
    as checkpoint parts and the job handed over as a new message (its receive count starts
    again, so interruptions do not spend maxReceiveCount). The next delivery reads only the inputs
    not done; its results.jsonl is byte for byte an uninterrupted run's, its job.log
    holds both deliveries' lines, job.json counts the attempt and the resumed items, and
    the parts are gone."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 40)
    send_job(source, "long", uris)
    first = Daemon(serving_settings(tmp_path, checkpoint_items=5, grace_seconds=0), source, blobs)

    def drive() -> None:
        wait_until(lambda: len(_parts(blobs, "long")) >= 4)  # 2 parts of 5 (and 2 logs)
        first.stop()

    assert run_while(first, drive) is ExitCode.SIGNALLED
    assert "job.json" not in blobs.names("long") and len(source) == 1
    # Handed over as a continuation: a fresh message, which knows the attempt before it.
    [continuation] = source.receive(1, 0, 0)
    assert (continuation.receive_count, continuation.earlier_attempts) == (1, 1)
    read_first = blobs.inputs_read(uris)

    run_until_drained(
        source, blobs, tmp_path, model="tests.support.slow_model:tenth_of_a_second", batch_size=1
    )
    summary = job_file(blobs, "long", "job.json")
    read_again = blobs.inputs_read(uris) - read_first
    assert summary["resumed"] >= 10 and read_again == 40 - summary["resumed"]
    # Deliveries: the first, the test's look at the continuation, the one that finished.
    assert (summary["attempt"], summary["status"], summary["items"]) == (3, "succeeded", 40)
    assert _parts(blobs, "long") == []
    received = [
        json.loads(line)
        for line in job_file(blobs, "long", "job.log").splitlines()
        if '"job_received"' in line
    ]
    assert [event["attempt"] for event in received] == [1, 3]

    send_job(source, "whole", uris)
    run_until_drained(
        source, blobs, tmp_path, model="tests.support.slow_model:tenth_of_a_second", batch_size=4
    )
    whole = blobs.objects["s3://bkt/out/whole/results.jsonl"]
    assert blobs.objects["s3://bkt/out/long/results.jsonl"] == whole


def test_a_job_already_done_is_acked_without_running_it_again(tmp_path: Path) -> None:
    """A second delivery of a finished job (the ack was lost, or the job was sent twice)
    reads no input and leaves job.json as it was; the same output with other inputs is
    a new job, and runs."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 6)
    send_job(source, "once", uris[:3])
    run_until_drained(source, blobs, tmp_path)
    summary = blobs.objects["s3://bkt/out/once/job.json"]
    read = blobs.inputs_read(uris)

    send_job(source, "once", uris[:3])
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_already_done"] == ["once"]
    assert blobs.inputs_read(uris) == read and len(source) == 0
    assert blobs.objects["s3://bkt/out/once/job.json"] == summary

    send_job(source, "once", uris[3:])
    run_until_drained(source, blobs, tmp_path)
    assert blobs.inputs_read(uris) == read + 3
    assert [r["input"] for r in job_file(blobs, "once", "results.jsonl")] == uris[3:]

    source.send(
        json.dumps(
            {
                "job_id": "once",
                "inputs": uris[3:],
                "output": "s3://bkt/out/once/",
                "params": {"top_k": 1},
            }
        )
    )
    run_until_drained(source, blobs, tmp_path)  # other params: another request
    assert blobs.inputs_read(uris) == read + 6
    assert len(job_file(blobs, "once", "results.jsonl")[0]["topk"]) == 1


def test_outputs_left_mixed_by_two_deliveries_are_redone_whole(tmp_path: Path) -> None:
    """job.json names the results.jsonl and job.log it completes by their ETags: when
    another delivery's results.jsonl has landed since (two deliveries raced, each fenced
    on one file), the job does not count as done, and the next delivery redoes it."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 3)
    send_job(source, "mixed", uris)
    run_until_drained(source, blobs, tmp_path)
    blobs.objects["s3://bkt/out/mixed/results.jsonl"] = b'{"index": 0, "from": "elsewhere"}\n'
    send_job(source, "mixed", uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert not [entry for entry in logs if entry["event"] == "job_already_done"]
    assert [r["input"] for r in job_file(blobs, "mixed", "results.jsonl")] == uris
    recorded = job_file(blobs, "mixed", "job.json")["outputs"]
    listed = blobs.objects_under(S3Location.parse("s3://bkt/out/mixed/"))
    assert recorded == {name: listed[name] for name in OUTPUTS}


def test_a_finish_writes_its_outputs_at_once_then_job_json_beside_the_withdrawal(
    tmp_path: Path,
) -> None:
    """results.jsonl and job.log are written at once (each waits for the other to be
    under way), job.json only once both are written, and the read of a rejected.json to
    withdraw goes beside it: a finish takes two of S3's round trips, not four."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    send_job(source, "meet", sample_images(blobs, 2))
    output = "s3://bkt/out/meet/"
    outputs, last = threading.Barrier(2, timeout=5), threading.Barrier(2, timeout=5)
    written_before_job_json: list[bool] = []

    def job_json() -> None:
        written_before_job_json.append(all(output + name in blobs.objects for name in OUTPUTS))
        last.wait()

    blobs.before_put.update({output + name: outputs.wait for name in OUTPUTS})
    blobs.before_put[output + "job.json"] = job_json
    blobs.before_get[output + "rejected.json"] = last.wait
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert not outputs.broken and not last.broken
    assert written_before_job_json == [True]
    assert not [entry for entry in logs if entry["event"] == "job_upload_failed"]
    assert job_file(blobs, "meet", "job.json")["status"] == "succeeded"


def test_a_rejection_left_beside_a_run_stays_until_its_job_json_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rejection of the request written while the run went on (by a delivery beside
    it that dead-lettered the message) is left in place while the run's job.json cannot
    be written (here S3 refuses it, every try): no job.json and no rejection would leave
    the producer waiting. The run is tried again later; its next delivery finishes the
    job and withdraws the rejection once its job.json has landed."""
    monkeypatch.setattr(results, "FINISH_BACKOFF", Backoff(base_s=0.0, cap_s=0.0))
    source, blobs = InMemoryJobSource(), CountingBlobs()
    send_job(source, "late", sample_images(blobs, 2))
    output = "s3://bkt/out/late/"
    rejection = {"job_id": "late", "request_id": None, "reason": "r", "rejected_at": "t"}
    refusals = [results.FINISH_ATTEMPTS]

    def refused() -> None:
        blobs.objects[output + "rejected.json"] = json.dumps(rejection).encode()
        refusals[0] -= 1
        if refusals[0]:
            blobs.before_put[output + "job.json"] = refused
        raise ConnectionError("S3 refuses job.json (test)")

    blobs.before_put[output + "job.json"] = refused
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    events = [entry["event"] for entry in logs]
    second_delivery = events.index("job_received", events.index("job_released"))
    assert "rejection_withdrawn" not in events[:second_delivery]
    assert "rejection_withdrawn" in events[second_delivery:]
    assert job_file(blobs, "late", "job.json")["status"] == "succeeded"
    assert output + "rejected.json" not in blobs.objects


def test_a_job_stopped_without_moving_is_released_and_counts(tmp_path: Path) -> None:
    """A delivery that ran some of a job but finished none of it may be why the worker
    stops (a health check failing while it runs): its job is released, not handed over,
    so its receive counts and a job that can never move reaches the DLQ."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 2)
    send_job(source, "stuck", uris)
    daemon = Daemon(
        serving_settings(tmp_path, grace_seconds=0).model_copy(
            update={"model": "tests.support.slow_model:five_seconds"}
        ),
        source,
        blobs,
    )

    def drive() -> None:
        wait_until(lambda: blobs.inputs_read(uris) >= 1)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    [again] = source.receive(1, 0, 30)
    assert (again.receive_count, again.earlier_attempts) == (2, 0)


def test_an_embedding_job_resumes_its_array_rows_from_its_checkpoint(tmp_path: Path) -> None:
    """A 60-item job whose postprocessor gives an array (each input's its own) is
    stopped part-way: each part saves its items' rows as `<part>.embedding.npy` beside
    their lines, so the job is handed over as having moved; the next delivery runs only
    the items not done, and its embedding.npy and results.jsonl are byte for byte an
    uninterrupted run's."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 60)
    by_input = {"model": "tests.support.slow_model:tenth_of_a_second_by_input"}
    settings = serving_settings(
        tmp_path, checkpoint_items=5, grace_seconds=0, postprocess="stages.postprocess:embedding"
    ).model_copy(update=by_input)
    send_job(source, "arrays", uris)
    first = Daemon(settings, source, blobs)
    saved_rows: list[str] = []

    def drive() -> None:
        wait_until(lambda: len([n for n in _parts(blobs, "arrays") if n.endswith(".jsonl")]) >= 2)
        saved_rows.extend(n for n in _parts(blobs, "arrays") if n.endswith(".embedding.npy"))
        first.stop()

    assert run_while(first, drive) is ExitCode.SIGNALLED
    assert len(saved_rows) >= 2
    [continuation] = source.receive(1, 0, 0)  # it moved: handed over, not released
    assert (continuation.receive_count, continuation.earlier_attempts) == (1, 1)
    read_first = blobs.inputs_read(uris)

    slow = {**by_input, "batch_size": 4}
    run_until_drained(source, blobs, tmp_path, postprocess="stages.postprocess:embedding", **slow)
    summary = job_file(blobs, "arrays", "job.json")
    assert summary["status"] == "succeeded" and summary["resumed"] >= 10
    assert blobs.inputs_read(uris) - read_first == 60 - summary["resumed"]
    assert _parts(blobs, "arrays") == []

    send_job(source, "whole", uris)
    run_until_drained(source, blobs, tmp_path, postprocess="stages.postprocess:embedding", **slow)
    rows = np.load(io.BytesIO(blobs.objects["s3://bkt/out/whole/embedding.npy"]))
    assert len(np.unique(rows, axis=0)) == 60  # a row out of place would show
    for name in ("embedding.npy", "results.jsonl"):
        assert (
            blobs.objects[f"s3://bkt/out/arrays/{name}"]
            == blobs.objects[f"s3://bkt/out/whole/{name}"]
        )


def test_a_delivery_beaten_to_its_outputs_is_fenced_off_and_overwrites_nothing(
    tmp_path: Path,
) -> None:
    """Another delivery of the job (its lease had run out here unnoticed) writes the
    job's outputs while this one runs: this one's conditional write fails, it logs
    `job_fenced` and writes nothing more; its message, given back, is then found done."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 2)
    send_job(source, "other", uris)
    run_until_drained(
        source, blobs, tmp_path
    )  # "other" is what the newer delivery will have written
    theirs = {
        name: blobs.objects[f"s3://bkt/out/other/{name}"]
        for name in ("results.jsonl", "job.log", "job.json")
    }

    def newer_delivery_writes() -> None:
        for name, data in theirs.items():
            blobs.objects[f"s3://bkt/out/raced/{name}"] = data

    blobs.before_put["s3://bkt/out/raced/results.jsonl"] = newer_delivery_writes
    send_job(source, "raced", uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_fenced"] == ["raced"]
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_already_done"] == ["raced"]
    for name, data in theirs.items():
        assert blobs.objects[f"s3://bkt/out/raced/{name}"] == data
    assert len(source) == 0


def test_a_job_cancelled_while_queued_is_acked_without_work(tmp_path: Path) -> None:
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 5)
    blobs.objects[f"s3://bkt/out/queued/{CANCEL_MARKER}"] = b"{}"
    send_job(source, "queued", uris)
    run_until_drained(source, blobs, tmp_path)
    summary = job_file(blobs, "queued", "job.json")
    assert (summary["status"], summary["items"], summary["succeeded"]) == ("cancelled", 5, 0)
    assert blobs.objects["s3://bkt/out/queued/results.jsonl"] == b""
    assert blobs.inputs_read(uris) == 0 and len(source) == 0

    send_job(source, "queued", uris)  # sent again while the cancel stands: cancelled again
    run_until_drained(source, blobs, tmp_path)
    assert blobs.inputs_read(uris) == 0 and len(source) == 0
    del blobs.objects[f"s3://bkt/out/queued/{CANCEL_MARKER}"]
    send_job(source, "queued", uris)  # the cancel withdrawn: it runs
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "queued", "job.json")["status"] == "succeeded"


def test_a_cancel_that_names_a_job_id_is_for_that_job_alone(tmp_path: Path) -> None:
    """`worker cancel --job-id`: a `cancel` naming another job is no cancel for this one
    (it runs, and the daemon logs it); one naming it is."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 3)
    for job_id, meant_for in (("other", "someone-else"), ("named", "named")):
        blobs.objects[f"s3://bkt/out/{job_id}/{CANCEL_MARKER}"] = json.dumps(
            {"job_id": meant_for}
        ).encode()
        send_job(source, job_id, uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "other", "job.json")["status"] == "succeeded"
    assert job_file(blobs, "named", "job.json")["status"] == "cancelled"
    ignored = [e for e in logs if e["event"] == "cancel_for_another_job"]
    assert ignored and ignored[0]["cancel_job_id"] == "someone-else"


def test_a_running_job_is_cancelled_within_one_progress_interval(tmp_path: Path) -> None:
    """The job stops being fed; job.json says `cancelled` with what was finished, those
    results are in results.jsonl in input order, and the message is deleted."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 60)
    send_job(source, "running", uris)
    # Few inputs fetched ahead of the model, so the cancel lands before all are read.
    settings = serving_settings(tmp_path, progress_interval_seconds=0.2, fetch_concurrency=2)
    daemon = Daemon(settings, source, blobs)
    asked_at: list[float] = []

    def drive() -> None:
        wait_until(lambda: blobs.inputs_read(uris) >= 5)
        blobs.objects[f"s3://bkt/out/running/{CANCEL_MARKER}"] = b"{}"
        asked_at.append(time.monotonic())
        wait_until(lambda: "s3://bkt/out/running/job.json" in blobs.objects)
        asked_at.append(time.monotonic())
        wait_until(lambda: len(source) == 0)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    assert asked_at[1] - asked_at[0] < 1.5  # one 0.2 s interval, and the writes
    summary = job_file(blobs, "running", "job.json")
    results = job_file(blobs, "running", "results.jsonl")
    assert summary["status"] == "cancelled" and 0 < summary["succeeded"] < 60
    assert len(results) == summary["succeeded"]
    assert [r["index"] for r in results] == sorted(r["index"] for r in results)
    assert blobs.inputs_read(uris) < 60


def test_a_job_that_reaches_the_lease_ceiling_moving_forward_is_handed_over(
    tmp_path: Path,
) -> None:
    """Each delivery may hold the job for 3 s (SQS's 12 h, shrunk: a renewal may not pass
    4 s, and each renews for 1 s): what it finished is checkpointed and the job handed
    over, so deliveries add up to the whole job of 4 s of batches. (Few fetch threads:
    items of a handed-over delivery already inside the stages still run, and with a 3 s
    lease they would eat much of the next delivery's time.)"""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 40)
    send_job(source, "endless", uris)
    with capture_logs() as logs:
        run_until_drained(
            source,
            blobs,
            tmp_path,
            model="tests.support.slow_model:tenth_of_a_second",
            batch_size=1,
            visibility_timeout_seconds=1,
            heartbeat_interval_seconds=0.2,
            max_lease_seconds=4,
            fetch_concurrency=2,
            progress_interval_seconds=0.5,
        )
    summary = job_file(blobs, "endless", "job.json")
    # Each continuation comes within the 1 s lease (and 5 s of clock skew) of the
    # delivery it replaces, so it waits once before it runs (`Intake._handed_over`).
    handed_over = [entry["reason"] for entry in logs if entry["event"] == "job_released"]
    assert len(handed_over) == summary["attempt"] - 1
    assert set(handed_over) == {"lease ceiling reached", WAITED_FOR_THE_REPLACED}
    assert summary["status"] == "succeeded" and summary["resumed"] > 0
