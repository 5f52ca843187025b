"""What a job's output holds is read within bounds (review H6): anyone who may cancel a
job may write there, so a checkpoint part, a job.json or a plan.json larger than any
this daemon writes is not taken for one, and never held whole."""

from __future__ import annotations

import json
from pathlib import Path

from structlog.testing import capture_logs

from tests.support.in_process import run_while, sample_images, serving_settings
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.jobs.checkpoints import (
    MAX_PART_BYTES,
    MAX_RESUMED_LINE_BYTES,
    MAX_SUMMARY_BYTES,
    Checkpoints,
    part_prefix,
)
from worker.jobs.job import Place
from worker.jobs.ledger import Ledger
from worker.jobs.plan import Plan, shard_body
from worker.message import JobMessage

DIGEST = "0123456789abcdef"


class _Sized(InMemoryBlobStore):
    """Keeps the largest read each GET allowed: a read without a bound is unbounded."""

    def __init__(self) -> None:
        super().__init__()
        self.bounds: dict[str, int | None] = {}

    def get(self, location, max_bytes=None, byte_range=None):  # type: ignore[no-untyped-def]
        self.bounds[location.key.rsplit("/", 1)[-1]] = max_bytes
        return super().get(location, max_bytes, byte_range)


def test_checkpoint_parts_and_lines_over_their_bounds_are_not_resumed() -> None:
    """A part over `MAX_PART_BYTES` is skipped unread, and a line over
    `MAX_RESUMED_LINE_BYTES` in a part is not resumed (its item runs again); the line
    within bounds beside it is."""
    blobs = _Sized()
    spec = JobMessage(inputs=["s3://bkt/a", "s3://bkt/b"], output="s3://bkt/out/")
    places = [Place(0, "s3://bkt/a"), Place(1, "s3://bkt/b")]
    prefix = f"s3://bkt/out/{part_prefix(DIGEST, None)}"
    huge_line = {"index": 1, "input": "s3://bkt/b", "label": "x" * MAX_RESUMED_LINE_BYTES}
    lines = [{"index": 0, "input": "s3://bkt/a", "label": "a"}, huge_line]
    blobs.objects[f"{prefix}0001-m-00001.jsonl"] = b"\n".join(json.dumps(x).encode() for x in lines)
    blobs.objects[f"{prefix}0001-m-00002.jsonl"] = b" " * (MAX_PART_BYTES + 1)
    prior = Checkpoints(blobs, Ledger()).read(spec, "job", DIGEST, places)
    assert list(prior.resumed) == [0]
    assert blobs.bounds["checkpoint-0123456789abcdef-a0001-m-00002.jsonl"] == MAX_PART_BYTES


def test_a_job_json_over_its_bound_does_not_complete_the_job() -> None:
    """A job.json larger than any a worker writes is no worker's: the job is not done."""
    blobs = _Sized()
    spec = JobMessage(inputs=["s3://bkt/a"], output="s3://bkt/out/")
    summary = {"request_digest": DIGEST, "outputs": {}, "padding": "x" * MAX_SUMMARY_BYTES}
    blobs.objects["s3://bkt/out/job.json"] = json.dumps(summary).encode()
    assert Checkpoints(blobs, Ledger()).finished(spec, "job", DIGEST) is None
    assert blobs.bounds["job.json"] == MAX_SUMMARY_BYTES


def test_a_plan_in_shards_larger_than_the_worker_holds_is_left_alone(tmp_path: Path) -> None:
    """A plan.json under the output (anyone's who may write there) whose shards hold more
    inputs than this worker holds of a job: its shard is released for another worker,
    with a delay, not run and not dead-lettered; nothing is written."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    spec = JobMessage(job_id="big", inputs=inputs, output="s3://bkt/out/big/")
    plan = Plan(
        job_id="big",
        request_digest=DIGEST,
        items=4,
        shard_items=20_000,
        model={"name": "any"},
        params={},
        received_at=0.0,
        attempt=1,
    )
    blobs.objects["s3://bkt/out/big/plan.json"] = plan.model_dump_json().encode()
    source.send(shard_body(spec, plan, 0))
    written = dict(blobs.objects)
    # A worker of shards of 2, taking jobs of at most 10,000 x 2 inputs.
    daemon = Daemon(
        serving_settings(tmp_path, shard_items=2, max_items_per_job=20_000), source, blobs
    )
    with capture_logs() as logs:

        def drive() -> None:
            wait_until(lambda: any(entry["event"] == "job_released" for entry in logs))
            daemon.stop()

        assert run_while(daemon, drive) is ExitCode.SIGNALLED
    (released,) = [entry for entry in logs if entry["event"] == "job_released"]
    assert "over the 2 this worker holds" in released["reason"] and released["retry_in_s"] > 0
    assert len(source) == 1 and not source.dead_letters
    assert blobs.objects == written
