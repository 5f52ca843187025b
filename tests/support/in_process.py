"""The daemon in the test's own process against the in-memory fakes
(`worker.adapters.fakes`): sample images, jobs sent, settings, runs, the files a job
left under its output, and two runs' results compared."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stages.synthetic import samples
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.datasets.inputs import Input, shard_line
from worker.jobs.job import Job
from worker.jobs.plan import INPUTS_SUFFIX, Plan, shard_file
from worker.loops.reporting import ProgressReporter
from worker.message import JobMessage, TarMembers, parse_job_message
from worker.settings import Settings


def sample_images(blobs: InMemoryBlobStore, count: int) -> list[str]:
    """`count` sample images stored at s3://bkt/img/0, 1, ...; their URIs."""
    uris = []
    for number, (_, data) in enumerate(samples(count, seed=5)):
        uri = f"s3://bkt/img/{number}"
        blobs.objects[uri] = data
        uris.append(uri)
    return uris


def send_job(source: InMemoryJobSource, job_id: str, inputs: list[str]) -> None:
    """A job whose output is s3://bkt/out/JOB_ID/."""
    source.send(
        json.dumps({"job_id": job_id, "inputs": inputs, "output": f"s3://bkt/out/{job_id}/"})
    )


def job_file(blobs: InMemoryBlobStore, job_id: str, name: str) -> Any:
    """A file under the job's output: results.jsonl as its lines, job.json as its
    object, anything else as text."""
    data = blobs.objects[f"s3://bkt/out/{job_id}/{name}"]
    if name == "results.jsonl":
        return [json.loads(line) for line in data.splitlines()]
    return json.loads(data) if name == "job.json" else data.decode()


def assert_same_results(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same result lines, their scores but for the last digits: a score's last digits
    depend on which inputs shared its batch (the kernels sum in another order), and two
    runs of the same inputs may batch them otherwise (shards, formats, jobs run
    together)."""
    assert got == _scores_near(expected)


def _scores_near(value: Any) -> Any:
    """`value` with each score (nested ones too) one that compares equal to any within
    1e-5 of it."""
    if isinstance(value, dict):
        return {
            key: pytest.approx(item, abs=1e-5) if key == "score" else _scores_near(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_scores_near(item) for item in value]
    return value


def draining_settings(tmp_path: Path, **fields: Any) -> Settings:
    """Settings for a daemon that empties its queue and exits."""
    return Settings(
        queue_url="q",
        drain=True,
        receive_wait_seconds=0,
        log_dir=tmp_path,
        metrics_port=0,
        **fields,
    )


def run_until_drained(
    source: InMemoryJobSource, blobs: InMemoryBlobStore, tmp_path: Path, **fields: Any
) -> None:
    assert Daemon(draining_settings(tmp_path, **fields), source, blobs).run() is ExitCode.DRAINED


def serving_settings(tmp_path: Path, **fields: object) -> Settings:
    """Settings for a daemon that serves until stopped: a tenth of a second a batch of
    one item (unless `fields` name another model), and notices polled every 0.05 s."""
    defaults: dict[str, object] = {
        "queue_url": "q",
        "receive_wait_seconds": 0,
        "log_dir": tmp_path,
        "metrics_port": 0,
        "model": "tests.support.slow_model:tenth_of_a_second",
        "batch_size": 1,
        "notice_poll_seconds": 0.05,
    }
    return Settings(**{**defaults, **fields})  # type: ignore[arg-type]


def breaking_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: object
) -> Settings:
    """Settings for a daemon that breaks once it holds a job: its progress reporter
    raises half a second in (a loop of the daemon that dies), while the job's batch
    takes five seconds."""

    def crash(self: ProgressReporter, job: Job) -> None:
        raise RuntimeError("progress bug (test)")

    monkeypatch.setattr(ProgressReporter, "_report", crash)
    return serving_settings(
        tmp_path,
        model="tests.support.slow_model:five_seconds",
        progress_interval_seconds=0.5,
        **fields,
    )


def run_while(daemon: Daemon, drive: Callable[[], None]) -> ExitCode:
    """Run the daemon on this thread (its signal handlers need the main one) while
    `drive` acts on it from another; a failure of `drive` stops the daemon and is raised."""
    failures: list[BaseException] = []

    def guarded() -> None:
        try:
            drive()
        except BaseException as failure:
            failures.append(failure)
            daemon.stop()

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    reason = daemon.run()
    thread.join(30)
    if failures:
        raise failures[0]
    return reason


def planned(
    blobs: InMemoryBlobStore,
    job_id: str,
    inputs: list[str],
    model: dict[str, Any],
    tar: TarMembers | None = None,
) -> tuple[JobMessage, Plan]:
    """A plan of `inputs` in shards of two (of one, with `tar`: the inputs are tars), for
    `model`, as a planner writes it."""
    body = {"job_id": job_id, "inputs": inputs, "output": f"s3://bkt/out/{job_id}/"}
    spec = parse_job_message(json.dumps(body), frozenset())
    per_shard = 1 if tar else 2
    plan = Plan(
        job_id=job_id,
        request_digest="0123456789abcdef",
        items=len(inputs),
        shard_items=per_shard,
        model=model,
        params={},
        received_at=time.time(),
        attempt=1,
        tar=tar,
    )
    blobs.objects[f"s3://bkt/out/{job_id}/plan.json"] = plan.model_dump_json().encode()
    for shard in range(plan.shards):
        listed = b"".join(shard_line(Input(inputs[index])) for index in plan.range(shard))
        blobs.objects[str(shard_file(spec, plan.request_digest, shard, INPUTS_SUFFIX))] = listed
    return spec, plan
