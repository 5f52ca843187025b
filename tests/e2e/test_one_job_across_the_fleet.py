"""One job across the fleet: a job over its shard size runs on every daemon of a fleet
of subprocesses against the moto server, daemons are SIGKILLed and started again while
it runs, and it still ends with every input exactly once, in order, nothing of its
shards left behind and nothing in the dead-letter queue."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import DaemonProcess, StartDaemon, daemon_args, slow_model_flags
from tests.support.jobs import job_output, upload
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e

FLEET_FLAGS = [
    *slow_model_flags(16),
    "--visibility-timeout-seconds",
    "6",
    "--heartbeat-interval-seconds",
    "1",
    "--progress-interval-seconds",
    "1",
    "--checkpoint-seconds",
    "2",
    "--retry-delay-seconds",
    "1",
]


def _run_across_the_fleet(
    aws: Aws,
    start_daemon: StartDaemon,
    tmp_path: Path,
    *,
    items: int,
    shard_items: int,
    daemons: int,
    kills: int,
    timeout_s: float,
) -> None:
    """The job's shards go to the stack's shards queue (`--shard-queue-url`), as the
    template deploys it."""
    stack = aws.stack(visibility_timeout_s=6, max_receive_count=10)
    images = list(upload_samples(aws.s3, stack.bucket, 40, seed=24))
    inputs = [images[n % len(images)] for n in range(items)]
    manifest = upload(aws, stack, "big-job.txt", ("\n".join(inputs) + "\n").encode())
    output = job_output(stack, "big")
    aws.send(
        stack.queue_url,
        {"job_id": "big", "manifest": manifest, "output": output, "shard_items": shard_items},
    )
    env = aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.05").env

    def started(number: int) -> DaemonProcess:
        lanes = ("--shard-queue-url", stack.shard_queue_url)
        return start_daemon(
            daemon_args(stack, tmp_path / str(number), *FLEET_FLAGS, *lanes), env=env
        )

    fleet = [started(n) for n in range(daemons)]
    everyone = list(fleet)  # the killed too: what they logged before they died counts
    chance = random.Random(items)
    deadline = time.monotonic() + timeout_s
    for kill in range(kills):
        while sum(len(daemon.events("shard_committed")) for daemon in fleet) <= kill:
            assert time.monotonic() < deadline, "no shard committed"
            time.sleep(0.2)
        victim = chance.randrange(len(fleet))
        fleet[victim].send_signal(signal.SIGKILL)
        fleet[victim].wait(30)
        fleet[victim] = started(daemons + kill)
        everyone.append(fleet[victim])
    # Done when merged, and every message of the job (a watch's timer too) is gone,
    # seen twice 2 s apart (a receive's wait and more): the server reads a queue's
    # counts one after another, and a timer coming due between two is in none.
    queues = (stack.queue_url, stack.shard_queue_url)
    readings = 0
    while True:
        assert time.monotonic() < deadline, (
            f"not merged, or messages left: {aws.names(output)[:20]}",
            [aws.queue_depth(queue) for queue in queues],
        )
        done = "job.json" in aws.names(output) and all(map(aws.queue_empty, queues))
        readings = readings + 1 if done else 0
        if readings == 2:
            break
        time.sleep(2 if done else 1)
    for daemon in fleet:
        daemon.send_signal(signal.SIGTERM)
    for daemon in fleet:
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]

    results = aws.results(output)
    assert [line["index"] for line in results] == list(range(items))
    assert [line["input"] for line in results] == inputs
    summary = aws.summary(output)
    assert (summary["status"], summary["items"], summary["succeeded"]) == (
        "succeeded",
        items,
        items,
    )
    assert summary["shards"]["count"] == -(-items // shard_items)
    assert set(aws.names(output)) <= {
        "job.json",
        "job.log",
        "results.jsonl",
        "plan.json",
        "progress.json",
    }
    assert [aws.queue_depth(queue) for queue in queues] == [(0, 0), (0, 0)]
    assert aws.dead_letters(stack.dlq_url) == []
    merged = [e for daemon in everyone for e in daemon.events("job_merged")]
    assert len({e["job_id"] for e in merged}) <= 1
    # Each shard was committed by some daemon: its run's own commit, or, where its daemon
    # died between the commit and its log line, found committed (or its job merged) by
    # its next delivery. Which daemons those were is the scheduler's business.
    committed = {
        e.get("shard")
        for daemon in everyone
        for event in ("shard_committed", "shard_committed_already", "job_already_done")
        for e in daemon.events(event)
    }
    assert committed - {None} == set(range(summary["shards"]["count"]))


def test_a_job_split_across_three_daemons_survives_one_killed(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """400 inputs in shards of 50 over three daemons, one SIGKILLed once a shard is
    committed and another started in its place."""
    _run_across_the_fleet(
        aws,
        start_daemon,
        tmp_path,
        items=400,
        shard_items=50,
        daemons=3,
        kills=1,
        timeout_s=240,
    )


@pytest.mark.fleet
@pytest.mark.timeout(1500)
def test_twenty_thousand_inputs_over_four_daemons_killed_at_random(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The issue's run (`make test-fleet`): 20,000 inputs over four daemons, random
    ones SIGKILLed and started again five times while it runs."""
    _run_across_the_fleet(
        aws,
        start_daemon,
        tmp_path,
        items=int(os.environ.get("FLEET_ITEMS", "20000")),
        shard_items=500,
        daemons=4,
        kills=5,
        timeout_s=1200,
    )


def test_a_straggling_shard_is_run_again_by_an_idle_daemon(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Three daemons and one forty times slower, four shards (a margin wide enough for a
    loaded machine, where the fast daemons are slow to start: with more shards the slow
    one took a second before they had taken them all, and could finish it first): once
    every shard has started, a watch of the job finds the slow daemon's shard running
    past twice the median shard's time and sends a duplicate, which a fast daemon runs;
    the first commit counts, and the job ends whole, before the slow daemon's own run of
    that shard could."""
    stack = aws.stack(visibility_timeout_s=6, max_receive_count=10)
    images = list(upload_samples(aws.s3, stack.bucket, 16, seed=25))
    inputs = [images[n % len(images)] for n in range(256)]
    manifest = upload(aws, stack, "job.txt", ("\n".join(inputs) + "\n").encode())
    output = job_output(stack, "straggled")
    slow = start_daemon(
        daemon_args(stack, tmp_path / "slow", *FLEET_FLAGS),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="8.0").env,
    )
    slow.wait_for("daemon_started")
    aws.send(
        stack.queue_url,
        {"job_id": "straggled", "manifest": manifest, "output": output, "shard_items": 64},
    )
    slow.wait_for("job_received", 2)  # the plan, and the shard it holds
    fast = [
        start_daemon(
            daemon_args(stack, tmp_path / str(n), *FLEET_FLAGS),
            env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.2").env,
        )
        for n in range(3)
    ]
    deadline = time.monotonic() + 180
    while "job.json" not in aws.names(output):
        assert time.monotonic() < deadline, f"not merged: {aws.names(output)[:20]}"
        time.sleep(0.5)
    fleet = [slow, *fast]
    duplicated = [e for daemon in fleet for e in daemon.events("shard_duplicated")]
    slow_shards = {e["shard"] for e in slow.events("shard_committed")}
    for daemon in fleet:
        daemon.send_signal(signal.SIGTERM)
    for daemon in fleet:
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert duplicated, "no straggler was run again"
    assert {e["shard"] for e in duplicated} - slow_shards, "the slow daemon's run counted"
    results = aws.results(output)
    assert [line["index"] for line in results] == list(range(256))
    assert aws.summary(output)["status"] == "succeeded"
    assert aws.dead_letters(stack.dlq_url) == []
