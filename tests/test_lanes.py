"""The shards of jobs split across the fleet in a queue of their own (`--shard-queue-url`,
`worker.jobs.lanes`): each message settled on its own queue, and a small job not stuck
behind a giant one's shards."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.in_process import (
    draining_settings,
    job_file,
    run_while,
    sample_images,
    serving_settings,
)
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.jobs.lanes import SHARDS_LANE, Lanes
from worker.jobs.plan import Plan, shard_body
from worker.loops import intake
from worker.loops.intake import SPARE_SHARD
from worker.message import JobMessage


def test_each_message_is_settled_on_the_queue_it_came_from() -> None:
    """Acks, renewals, releases, hand-overs and dead letters go to the message's own
    queue; what the daemon sends of its own goes to the shards queue; the counts are
    both queues'."""
    jobs, shards = InMemoryJobSource(), InMemoryJobSource()
    lanes = Lanes(jobs, shards)
    jobs.send("job")
    shards.send("shard")
    (job,) = lanes.receive(10, 0, 60)
    (shard,) = lanes.receive_shards(10, 0, 60)
    assert shard.receipt_handle.startswith(SHARDS_LANE)
    assert not job.receipt_handle.startswith(SHARDS_LANE)
    assert lanes.extend([job.receipt_handle, shard.receipt_handle, SHARDS_LANE + "gone#1"], 60) == {
        SHARDS_LANE + "gone#1": "ReceiptHandleIsInvalid"
    }
    lanes.requeue(shard, delay_s=0)  # a shard handed over goes back among shards
    lanes.ack(shard.receipt_handle)
    assert [m.body for m in shards.receive(10, 0, 60)] == ["shard"] and len(jobs) == 1
    assert lanes.dead_letter(job, "poison") and jobs.dead_letters[0][0] == job
    lanes.release(job.receipt_handle)
    lanes.send_many(["watch"], "tenant")
    assert [m.body for m in jobs.receive(10, 0, 60)] == ["job"]
    assert [m.body for m in shards.receive(10, 0, 60)] == ["watch"]
    counts = lanes.counts()
    assert (counts.visible, counts.in_flight) == (0, 3)


def test_a_small_job_sent_behind_a_giant_job_s_shards_ends_first(tmp_path: Path) -> None:
    """A job of 40 inputs in shards of 10 (a tenth of a second an input), then a
    one-image job sent once the first shard runs: the daemon, full with the shard, still
    takes the small job from the jobs queue, and its item passes the shard's queued in
    the stages, so it ends before the shard does; the giant job ends whole, its shards
    and watches sent to the shards queue. On one queue the small job waited behind
    every shard; taken, but behind the shard's items, it ended with the shard."""
    jobs, shards, blobs = InMemoryJobSource(), InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 40)
    giant = {"job_id": "giant", "inputs": inputs, "output": "s3://bkt/out/giant/"}
    jobs.send(json.dumps({**giant, "shard_items": 10}))
    daemon = Daemon(serving_settings(tmp_path), jobs, blobs, shard_source=shards)
    small = {"job_id": "small", "inputs": inputs[:1], "output": "s3://bkt/out/small/"}

    def written(suffix: str) -> bool:
        return any(uri.endswith(suffix) for uri in list(blobs.objects))

    def drive() -> None:
        wait_until(lambda: written(".started"))
        # The giant job's message: planned and deleted (a shard may start before that).
        wait_until(lambda: len(jobs) == 0)
        jobs.send(json.dumps(small))
        wait_until(lambda: written("/small/job.json") or written(".commit"), every_s=0.01)
        assert not written(".commit"), "the shard running when the small job came ended first"
        wait_until(lambda: written("/giant/job.json"), timeout_s=60)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    summary = job_file(blobs, "giant", "job.json")
    assert (summary["status"], summary["shards"]["count"]) == ("succeeded", 4)
    assert [line["input"] for line in job_file(blobs, "giant", "results.jsonl")] == inputs
    assert job_file(blobs, "small", "job.json")["status"] == "succeeded"
    assert len(jobs) == 0 and not jobs.dead_letters and not shards.dead_letters


def test_a_shard_on_the_jobs_queue_is_handed_back_with_a_delay(tmp_path: Path) -> None:
    """A shard sent to the jobs queue (by a worker without the shards queue, during a
    rollout), taken by a daemon full with a shard: handed back once, and not visible
    again for a while, where the daemon took it again at once, round after round."""
    jobs, shards, blobs = InMemoryJobSource(), InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 40)
    giant = {"job_id": "giant", "inputs": inputs, "output": "s3://bkt/out/giant/"}
    jobs.send(json.dumps({**giant, "shard_items": 10}))
    daemon = Daemon(serving_settings(tmp_path), jobs, blobs, shard_source=shards)

    def drive() -> None:
        wait_until(lambda: any(uri.endswith(".started") for uri in list(blobs.objects)))
        plan = Plan.model_validate_json(blobs.objects["s3://bkt/out/giant/plan.json"])
        jobs.send(shard_body(JobMessage.model_validate(giant), plan, 3))
        wait_until(lambda: len(jobs) == 1 and jobs.counts().visible == 0)
        time.sleep(1)
        daemon.stop()

    with capture_logs() as logs:
        assert run_while(daemon, drive) is ExitCode.SIGNALLED
    spares = [e for e in logs if e["event"] == "job_released" and "another worker" in e["reason"]]
    on_jobs_lane = [e for e in spares if e["retry_in_s"] > 0]
    assert len(on_jobs_lane) == 1 and on_jobs_lane[0]["retry_in_s"] >= 10, spares


def test_a_daemon_alone_on_a_job_s_shards_hands_none_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of 30 inputs in shards of 5, on one daemon that holds about a shard's work
    (a batch of 1 and 4 fetches ahead): the shards lane takes a shard only once the one
    before is admitted, so each shard it takes is one it holds. A shard taken while the
    one before was still being admitted was found one too many once admitted, and
    handed back to be taken again at once (9 hand-backs for these 6 shards), each a
    receive, an admission's S3 reads and two SQS calls (`bench.fleet`'s requests per
    shard). However long an admission takes here (a loaded machine), the lane waits."""
    monkeypatch.setattr(intake, "ADMISSION_PATIENCE_S", 60.0)
    jobs, shards, blobs = InMemoryJobSource(), InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 30)
    giant = {"job_id": "giant", "inputs": inputs, "output": "s3://bkt/out/giant/"}
    jobs.send(json.dumps({**giant, "shard_items": 5}))
    settings = draining_settings(tmp_path, batch_size=1, prefetch_batches=1, fetch_concurrency=4)
    with capture_logs() as logs:
        assert Daemon(settings, jobs, blobs, shard_source=shards).run() is ExitCode.DRAINED
    assert job_file(blobs, "giant", "job.json")["shards"]["count"] == 6
    spares = [e for e in logs if e["event"] == "job_released" and e["reason"] == SPARE_SHARD]
    assert spares == []
