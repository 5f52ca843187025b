"""The producers' client (`worker.client`) against the in-memory fakes: a job the daemon
would refuse is never sent; a job sent is followed to its job.json and its results read
back the same way whatever their format; a cancel writes what `worker cancel` writes and
refuses what it refuses; files under an output that are not the daemon's are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pydantic import BaseModel

from tests.support.in_process import assert_same_results, run_until_drained, sample_images
from worker import cli
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import (
    CancelRefused,
    InvalidJob,
    Job,
    JobNotFinished,
    Jobs,
    JobStalled,
    JobStatus,
    Phase,
    UnreadableOutput,
    outputs,
)
from worker.message import TableSource, TarMembers, parse_job_message
from worker.ports import S3Location

OUTPUT = "s3://bkt/out/j1/"


@pytest.fixture
def queue() -> InMemoryJobSource:
    return InMemoryJobSource()


@pytest.fixture
def blobs() -> InMemoryBlobStore:
    return InMemoryBlobStore()


def _write(blobs: InMemoryBlobStore, name: str, document: Any) -> None:
    data = document if isinstance(document, bytes) else json.dumps(document).encode()
    blobs.objects[OUTPUT + name] = data


def _finished(blobs: InMemoryBlobStore, results: bytes, **fields: Any) -> None:
    """A JSON-lines job's results.jsonl and job.json, as the daemon leaves them."""
    etag = blobs.put(S3Location.parse(OUTPUT + "results.jsonl"), results, "application/x-ndjson")
    summary = {"job_id": "j1", "status": "succeeded", "items": 3, "succeeded": 3, "failed": 0}
    _write(blobs, "job.json", {**summary, "outputs": {"results.jsonl": etag}, **fields})


def test_a_producer_imports_the_client_and_the_command_line_without_torch() -> None:
    """A service that sends jobs imports the client (and `enqueue`'s command line)
    without loading torch, which is the daemon's: 2.3 s and hundreds of MB before."""
    probe = (
        "import sys, worker.client, worker.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"inputs": ["s3://bkt/a"], "manifest": "s3://bkt/m.txt"}, "exactly one of"),
        ({"inputs": ["not a uri"]}, "inputs.0"),
        ({"inputs_prefix": "s3://bkt/img/", "table": {"uri": "s3://bkt/t.csv"}}, "exactly one"),
        ({"table": {"uri": "s3://bkt/t.xlsx"}}, "table"),
        ({"inputs": ["s3://bkt/a"], "inputs_suffix": ".jpg"}, "'inputs_suffix' filters"),
        ({"inputs": ["s3://bkt/a"], "params": {"when": object()}}, "not JSON serializable"),
        ({"inputs": ["s3://bkt/a"], "job_id": "no spaces"}, "job_id"),
        ({"inputs": ["s3://bkt/a"], "tar": {"member_suffix": ""}}, "tar.member_suffix"),
    ],
)
def test_a_job_the_daemon_would_refuse_is_refused_before_anything_is_sent(
    queue: InMemoryJobSource, blobs: InMemoryBlobStore, fields: dict[str, Any], reason: str
) -> None:
    """The daemon's own checks (`parse_job_message`) run first: `InvalidJob` names every
    field at fault, and the queue stays empty."""
    with pytest.raises(InvalidJob, match=reason):
        Jobs(queue, blobs).submit(OUTPUT, **fields)
    assert len(queue) == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"inputs": ["s3://bkt/a.jpg"]},
        {"table": {"uri": "s3://bkt/t.csv", "id_column": "key"}},
        {"table": {"uri": "s3://bkt/t.parquet", "text_column": "body", "id_column": "ticket"}},
        {"texts": ["a late train", ""]},
        {"inputs_prefix": "s3://bkt/tars/", "tar": {"member_suffix": ".jpg"}},
        {"table": TableSource(uri="s3://bkt/t.parquet", text_column="body")},
        {"inputs_prefix": "s3://bkt/tars/", "tar": TarMembers()},
    ],
)
def test_the_message_sent_is_one_the_daemon_takes_as_it_was_given(
    queue: InMemoryJobSource, blobs: InMemoryBlobStore, fields: dict[str, Any]
) -> None:
    """What `submit` sends parses on the daemon's side (`parse_job_message`) into the
    message it was given: a field's default is left to the daemon, not written out (a
    table of texts sent with its default URI column was refused as naming both)."""
    job = Jobs(queue, blobs).submit(OUTPUT, **fields)
    [message] = queue.receive(1, 0, 30)
    received = parse_job_message(message.body, allowed_buckets=frozenset())
    assert received.job_id == job.job_id and received.request_id is not None
    as_json = {
        name: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
        for name, value in fields.items()
    }
    given = parse_job_message(
        json.dumps({**as_json, "output": OUTPUT, "job_id": job.job_id}), allowed_buckets=frozenset()
    )
    assert received.model_copy(update={"request_id": None}) == given


def test_a_job_sent_is_followed_and_read_back_the_same_in_either_format(
    queue: InMemoryJobSource, blobs: InMemoryBlobStore, tmp_path: Path
) -> None:
    """Two jobs of the same inputs (one missing), one in each format, run by the daemon:
    `wait` gives each job.json, `lines` the same records in input order (the missing
    input's with its error; scores but for their batches' last digits), and `batches`
    the same rows."""
    jobs = Jobs(queue, blobs)
    inputs = [*sample_images(blobs, 4), "s3://bkt/img/missing"]
    sent = {
        format: jobs.submit(f"s3://bkt/out/{format}/", inputs=inputs, format=format)
        for format in ("jsonl", "parquet")
    }
    assert sent["jsonl"].status() == JobStatus(Phase.QUEUED, 0, 0, 0)
    run_until_drained(queue, blobs, tmp_path)

    records = {}
    for format, job in sent.items():
        summary = job.wait(timeout_s=5)
        assert summary["job_id"] == job.job_id and summary["status"] == "partial"
        assert summary["format"] == format
        assert job.status() == JobStatus(Phase.FINISHED, 5, 5, 1, summary)
        records[format] = list(job.lines())
        assert [r["input"] for r in records[format]] == inputs
        assert [r["index"] for r in records[format]] == list(range(5))
        assert "error" in records[format][-1] and "label" not in records[format][-1]
        table = pa.Table.from_batches(list(job.batches()))
        assert table.column("input").to_pylist() == inputs
        assert table.column("label").to_pylist()[:4] == [r["label"] for r in records[format][:4]]
    assert_same_results(records["jsonl"], records["parquet"])


def test_status_follows_progress_json_and_takes_no_other_job_s_files(
    blobs: InMemoryBlobStore,
) -> None:
    """Queued while nothing is written; running with progress.json's counts; progress.json
    or job.json of another job under the same output is not this job's."""
    job = Job(blobs, OUTPUT, "j1")
    assert job.status() == JobStatus(Phase.QUEUED, 0, 0, 0)
    _write(blobs, "progress.json", {"job_id": "j1", "items": 9, "finished": 4, "failed": 1})
    assert job.status() == JobStatus(Phase.RUNNING, 9, 4, 1)
    assert Job(blobs, OUTPUT, "j2").status().phase is Phase.QUEUED
    _finished(blobs, b"", job_id="j0")
    assert job.status().phase is Phase.RUNNING
    assert Job(blobs, OUTPUT).status().phase is Phase.FINISHED  # no id: whatever is there


def test_a_stalled_job_is_told_apart_and_enqueue_wait_says_why(
    blobs: InMemoryBlobStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """progress.json's stall (a watch wrote it): the status says why, `wait` raises at
    once rather than at its timeout, and `enqueue --wait` exits 1 with the reason; a
    stall written for another job is not this one's."""
    progress = {"job_id": "j1", "items": 9, "finished": 4, "failed": 0}
    stall = {"shards": [2], "reason": "3 workers broke"}
    _write(blobs, "progress.json", {**progress, "stalled": stall})
    job = Job(blobs, OUTPUT, "j1")
    assert job.status() == JobStatus(
        Phase.STALLED, 9, 4, 0, stalled="shards [2] cannot run: 3 workers broke"
    )
    with pytest.raises(JobStalled, match="3 workers broke"):
        job.wait(60, poll_s=0.01)
    assert cli._wait(job, 60) == 1
    assert "shards [2] cannot run: 3 workers broke" in capsys.readouterr().err
    assert Job(blobs, OUTPUT, "j2").status().phase is Phase.QUEUED


def test_wait_gives_up_at_its_timeout_naming_the_job_json_it_waited_for(
    blobs: InMemoryBlobStore,
) -> None:
    """Every look is reported; the timeout names the file that did not appear."""
    seen: list[JobStatus] = []
    with pytest.raises(TimeoutError, match=r"s3://bkt/out/j1/job\.json"):
        Job(blobs, "s3://bkt/out/j1", "j1").wait(0.2, poll_s=0.05, on_status=seen.append)
    assert len(seen) >= 3 and {status.phase for status in seen} == {Phase.QUEUED}


def test_results_are_not_read_before_the_job_is_finished(blobs: InMemoryBlobStore) -> None:
    """`lines` and `batches` refuse at once, not at the first record."""
    _write(blobs, "results.jsonl", b'{"index": 0}\n')  # a checkpoint's worth, say
    job = Job(blobs, OUTPUT, "j1")
    with pytest.raises(JobNotFinished, match=r"job\.json is not written yet"):
        job.lines()
    with pytest.raises(JobNotFinished):
        job.batches()


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("progress.json", b"{not json", "progress.json is not JSON"),
        ("progress.json", b"[1, 2]", "progress.json is not a JSON object"),
        ("progress.json", {"job_id": "j1", "items": -1, "finished": 0}, "items: .*; failed"),
        ("job.json", {"job_id": "j1", "status": "succeeded"}, "job.json: items"),
        ("job.json", {"job_id": "j1", "status": "succeeded", "items": "many"}, "items"),
    ],
)
def test_a_malformed_progress_or_summary_is_named_not_a_key_error(
    blobs: InMemoryBlobStore, name: str, content: Any, reason: str
) -> None:
    """Anything in S3 is untrusted: the file and the fields at fault are named."""
    _write(blobs, name, content)
    with pytest.raises(UnreadableOutput, match=reason):
        Job(blobs, OUTPUT, "j1").status()


def test_a_malformed_results_line_or_a_missing_results_file_is_named(
    blobs: InMemoryBlobStore,
) -> None:
    _finished(blobs, b'{"index": 0}\n\n[1]\n')
    job = Job(blobs, OUTPUT, "j1")
    with pytest.raises(UnreadableOutput, match=r"results\.jsonl line 3 is not a JSON object"):
        list(job.lines())
    del blobs.objects[OUTPUT + "results.jsonl"]
    with pytest.raises(UnreadableOutput, match=r"results\.jsonl, which job\.json names, is gone"):
        list(job.batches())
    _finished(blobs, b"", outputs={})
    with pytest.raises(UnreadableOutput, match=r"job\.json names no results\.jsonl"):
        job.lines()


def test_json_lines_batches_keep_their_columns_and_take_new_ones(
    blobs: InMemoryBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """results.jsonl read a block at a time: a block of failed inputs only, then one of
    answers, then one whose field is null: each batch keeps the columns of those before
    it and adds its own, a null-only field takes a type once it has one, and an integer
    field that holds a fraction later is a double from then on."""
    monkeypatch.setattr(outputs, "JSON_BLOCK_BYTES", 1)  # a block per line
    failed = {"index": 0, "input": "s3://bkt/a", "error": {"type": "E", "message": "m"}}
    answered = {"index": 1, "input": "s3://bkt/b", "model": "m@1", "label": "x", "box": None}
    late = {"index": 2, "input": "s3://bkt/c", "model": "m@1", "label": None, "box": [1, 2]}
    rounded = {"index": 3, "input": "s3://bkt/d", "model": "m@1", "score": 0}
    fraction = {"index": 4, "input": "s3://bkt/e", "model": "m@1", "score": 0.5}
    records = (failed, answered, late, rounded, fraction)
    _finished(blobs, b"".join(json.dumps(r).encode() + b"\n" for r in records))
    first, second, third, fourth, fifth = Job(blobs, OUTPUT, "j1").batches()
    assert fourth.schema.field("score").type == pa.int64()
    assert fifth.schema.field("score").type == pa.float64()
    assert fifth.column("score").to_pylist() == [0.5]
    assert first.schema.names == ["index", "input", "model", "error"]
    assert second.schema.names == [*first.schema.names, "label", "box"]
    assert second.schema.field("box").type == pa.null()
    assert third.schema.names == [*first.schema.names, "label", "box"]
    assert third.schema.field("label").type == pa.string()
    assert third.schema.field("box").type == pa.list_(pa.int64())


def test_cancel_writes_what_worker_cancel_writes_and_refuses_what_it_refuses(
    blobs: InMemoryBlobStore,
) -> None:
    """The `cancel` object names the job and the reason; another job's progress.json, or
    a job.json (the job is finished), is a refusal, and nothing is written."""
    _write(blobs, "progress.json", {"job_id": "j0", "items": 9, "finished": 4, "failed": 0})
    with pytest.raises(CancelRefused, match="is job j0's output, not j1's"):
        Job(blobs, OUTPUT, "j1").cancel()
    assert OUTPUT + "cancel" not in blobs.objects

    marker = Job(blobs, OUTPUT, "j0").cancel("wrong model")
    assert str(marker) == OUTPUT + "cancel"
    request = json.loads(blobs.objects[OUTPUT + "cancel"])
    assert request["job_id"] == "j0" and request["reason"] == "wrong model"
    assert "requested_at" in request
    Job(blobs, OUTPUT).cancel()  # no id: for whatever job writes there
    assert "job_id" not in json.loads(blobs.objects[OUTPUT + "cancel"])

    _finished(blobs, b"")
    with pytest.raises(CancelRefused, match="the job is finished, nothing to cancel"):
        Job(blobs, OUTPUT, "j1").cancel()
