"""A message's `request_id` (docs/jobs.md, "The job message"): a short plain name the
sender gives one submit, checked like the rest of the message, and echoed by the
job.json of the run it asked for, whether one worker ran it or the fleet ran it as
shards (and by each shard's and watch's message in between)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.in_process import job_file, run_until_drained, sample_images
from worker import cli
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import Job
from worker.message import PoisonMessage, parse_job_message

BODY = {"inputs": ["s3://bkt/a"], "output": "s3://bkt/out/j1/"}


@pytest.mark.parametrize("request_id", ["0f3a9c", "nightly:2026-11-26T01.00-a_b", "r" * 128])
def test_a_request_id_is_a_short_plain_name(request_id: str) -> None:
    message = parse_job_message(json.dumps({**BODY, "request_id": request_id}), frozenset())
    assert message.request_id == request_id


@pytest.mark.parametrize("request_id", ["", "r" * 129, "a b", "a/b", "é", 7])
def test_a_request_id_that_is_not_is_poison(request_id: object) -> None:
    """It is echoed and compared, never a path; anything else is refused with the field
    named."""
    with pytest.raises(PoisonMessage, match="request_id"):
        parse_job_message(json.dumps({**BODY, "request_id": request_id}), frozenset())


@pytest.mark.parametrize("shard_items", [None, 2])
def test_job_json_echoes_the_request_id_of_the_message_it_ran(
    tmp_path: Path, shard_items: int | None
) -> None:
    """Run whole, or as three shards merged by the last to commit: job.json says the
    request id its message gave; a message that gave none gets null."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 5)
    for job_id, named in (("asked", {"request_id": "r-1"}), ("plain", {})):
        body = {"job_id": job_id, "inputs": inputs, "output": f"s3://bkt/out/{job_id}/"}
        source.send(json.dumps({**body, **named}))
    settings = {} if shard_items is None else {"shard_items": shard_items}
    run_until_drained(source, blobs, tmp_path, **settings)
    asked, plain = job_file(blobs, "asked", "job.json"), job_file(blobs, "plain", "job.json")
    assert asked["request_id"] == "r-1" and asked["succeeded"] == 5
    assert "request_id" in plain and plain["request_id"] is None
    assert ("shards" in asked) is (shard_items is not None)


def test_a_cancel_stops_only_the_run_it_names(tmp_path: Path) -> None:
    """A `cancel` naming another run of the job (one an earlier run left behind) is not
    this run's: the job runs. One naming this run, or no job at all (`worker cancel`
    without `--job-id`), cancels it."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 2)
    cancels = {
        "other": {"job_id": "other", "request_id": "r-0"},
        "own": {"job_id": "own", "request_id": "r-1"},
        "bare": {},
    }
    for job_id, names in cancels.items():
        output = f"s3://bkt/out/{job_id}/"
        blobs.objects[output + "cancel"] = json.dumps({"reason": "", **names}).encode()
        body = {"job_id": job_id, "request_id": "r-1", "inputs": inputs, "output": output}
        source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path)
    statuses = {job_id: job_file(blobs, job_id, "job.json")["status"] for job_id in cancels}
    assert statuses == {"other": "succeeded", "own": "cancelled", "bare": "cancelled"}


def test_worker_cancel_with_a_request_id_stops_that_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`worker cancel --job-id j --request-id r-2` writes a cancel naming that run: the
    job sent to the output as run r-1 runs (the cancel stood when it came), and run r-2
    is cancelled; where the command cancelled the job by its id, any run. An id no
    message could give is a usage error (exit 2), nothing written."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    output = "s3://bkt/out/j/"

    def connect(cls: type[Job], output: str, *ids: str | None, **_: object) -> Job:
        return cls(blobs, output, *ids)

    monkeypatch.setattr(Job, "connect", classmethod(connect))
    for request_id, code in (("a b", 2), ("r-2", 0)):
        with pytest.raises(SystemExit) as exited:
            cli.main(["cancel", "--output", output, "--job-id", "j", "--request-id", request_id])
        assert exited.value.code == code
        assert (output + "cancel" in blobs.objects) is (code == 0)
    body = {"job_id": "j", "inputs": sample_images(blobs, 2), "output": output}
    statuses = []
    for request_id in ("r-1", "r-2"):
        source.send(json.dumps({**body, "request_id": request_id}))
        run_until_drained(source, blobs, tmp_path)
        statuses.append(job_file(blobs, "j", "job.json")["status"])
    assert statuses == ["succeeded", "cancelled"]


@pytest.mark.parametrize("shard_items", [None, 1])
def test_a_job_done_for_another_request_id_runs_again(
    tmp_path: Path, shard_items: int | None
) -> None:
    """job.json says which run it completes: the same job sent again with its request
    id (a copy of the message), or with none (a sender that gives none), is found done
    and acked; sent with another request id it runs again, whole or as shards, and its
    job.json echoes the new id."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    body = {"job_id": "j", "inputs": sample_images(blobs, 2), "output": "s3://bkt/out/j/"}
    settings = {} if shard_items is None else {"shard_items": shard_items}
    source.send(json.dumps({**body, "request_id": "r-0"}))
    run_until_drained(source, blobs, tmp_path, **settings)
    first = job_file(blobs, "j", "job.json")
    source.send(json.dumps({**body, "request_id": "r-0"}))
    source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path, **settings)
    assert job_file(blobs, "j", "job.json") == first
    source.send(json.dumps({**body, "request_id": "r-1"}))
    run_until_drained(source, blobs, tmp_path, **settings)
    again = job_file(blobs, "j", "job.json")
    assert again["request_id"] == "r-1" and again["succeeded"] == 2
    assert again["finished_at"] != first["finished_at"]
