"""Resumed, cancelled and fenced jobs with real daemons: each a subprocess against a
moto server, stopped by signals, raced by another daemon, or told to cancel by
`worker cancel`. (In-process, against the fakes: tests/test_resume_cancel_and_fencing.py.)"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, run_daemon, slow_model_flags
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.jobs import following, job_output, send_jobs
from tests.support.paths import REPO
from tests.support.timing import wait_until
from worker.demo import upload_samples
from worker.jobs.checkpoints import CHECKPOINT_PREFIX

pytestmark = pytest.mark.e2e


def _gets_of(proxy: FaultProxy, uris: list[str]) -> int:
    paths = {"/" + uri.removeprefix("s3://") for uri in uris}
    return sum(path in paths for path in proxy.paths("GET"))


def _finished(aws: Aws, output: str) -> int:
    """The items its progress.json counts finished (0 before there is one)."""
    try:
        return int(json.loads(aws.read(output, "progress.json"))["finished"])
    except aws.s3.exceptions.NoSuchKey:
        return 0


def test_a_job_stopped_by_sigterm_resumes_without_spending_a_receive(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Against a moto server whose queue dead-letters a message on its second receive:
    a daemon stopped by SIGTERM with no grace checkpoints what it finished and hands the
    job over as a new message; the next daemon reads (through a counting proxy) only the
    inputs not done, nothing is dead-lettered, and no checkpoint is left."""
    stack = aws.stack(max_receive_count=1)
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=21))
    send_jobs(aws, stack, {"long": uris})
    # Its intake receives again only once fewer than 8 items are outstanding (prefetch:
    # 4 batches of 1, and 4 fetched at once), 33 results in.
    args = daemon_args(
        stack,
        tmp_path,
        *slow_model_flags(1),
        *("--grace-seconds", "0", "--fetch-concurrency", "4"),
        *("--progress-interval-seconds", "0.2"),
    )
    first, again = FaultProxy(aws.endpoint), FaultProxy(aws.endpoint)
    tenth = {"SLOW_MODEL_SECONDS_PER_BATCH": "0.1"}  # each daemon's model (not 1 s a batch)
    with first.serving() as first_url:
        daemon = start_daemon(args, env={**aws.with_endpoint(first_url).env, **tenth})
        daemon.wait_for("job_received")
        received = time.monotonic()
        # Stopped with some results to hand over (with none, the job is released, not
        # continued), as its progress.json says however loaded the machine, and past
        # the receive its intake began as the job came (a 1 s wait): a receive in flight
        # as the daemon stops takes the continuation it sends and gives it back, a
        # receive spent (docs/failures.md).
        wait_until(lambda: _finished(aws, job_output(stack, "long")) >= 3)
        time.sleep(max(0.0, received + 2 - time.monotonic()))
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.stderr[-3000:]
    output = job_output(stack, "long")
    assert "job.json" not in aws.names(output)
    assert any(name.startswith(CHECKPOINT_PREFIX) for name in aws.names(output))
    with again.serving() as again_url:
        # Short polls: it drains (two empty receives) without waiting 1 s on each.
        short_polls = ["--drain", "--receive-wait-seconds", "0"]
        run = run_daemon(aws.with_endpoint(again_url).with_env(**tenth), [*args, *short_polls])
    assert run.returncode == 0, run.stderr[-3000:]
    summary = aws.summary(output)
    assert (summary["status"], summary["attempt"]) == ("succeeded", 2)
    assert summary["resumed"] > 0
    assert _gets_of(again, uris) == 40 - summary["resumed"]
    assert _gets_of(first, uris) >= summary["resumed"]
    assert [r["input"] for r in aws.results(output)] == uris
    assert not any(name.startswith(CHECKPOINT_PREFIX) for name in aws.names(output))
    assert aws.dead_letters(stack.dlq_url) == []


def test_a_continuation_runs_alone_when_its_sender_died_before_deleting_the_old_message(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGKILL between handing a job over and deleting its message: a daemon stopped by
    SIGTERM sends the continuation, its delete is held at the proxy, and the test kills
    it there, so both messages are in the queue, the old one visible again. The next
    daemon runs the continuation, which marks the message it replaces: that one,
    received after the mark, is acked unread; received before it, it is stopped within a
    progress interval (`job_handed_over_already`), and the continuation, seeing that the
    old lease has ended, waits that long before it runs. The job runs once, never two
    deliveries at the same time."""
    stack = aws.stack(visibility_timeout_s=3)
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=24))
    send_jobs(aws, stack, {"split": uris})
    common = ["--visibility-timeout-seconds", "3", "--heartbeat-interval-seconds", "1"]
    proxy = FaultProxy(aws.endpoint)
    held = Fault("held_delete", lambda r: r.action == "DeleteMessage", kind="reset", delay_s=5)
    proxy.add(held)
    with proxy.serving() as proxy_url:
        first = start_daemon(
            [
                *daemon_args(
                    stack, tmp_path / "first", *slow_model_flags(1), *common, "--grace-seconds", "0"
                ),
                *("--progress-interval-seconds", "0.2"),
            ],
            env={**aws.with_endpoint(proxy_url).env, "SLOW_MODEL_SECONDS_PER_BATCH": "0.1"},
        )
        first.wait_for("job_received")  # (a daemon that died at start says why here)
        # Some results to hand over (with none, the job is released, not continued), as
        # its progress.json says, however loaded the machine.
        wait_until(lambda: _finished(aws, job_output(stack, "split")) >= 3)
        first.send_signal(signal.SIGTERM)
        wait_until(lambda: proxy.requests("SendMessage") and proxy.requests("DeleteMessage"))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    gate = tmp_path / "old-message-acked"
    second = start_daemon(
        [
            *daemon_args(stack, tmp_path / "second", *slow_model_flags(4), *common),
            "--drain",
            "--progress-interval-seconds",
            "0.5",
            # Short polls: it drains (two empty receives) without waiting 1 s on each.
            "--receive-wait-seconds",
            "0",
        ],
        env={
            **aws.env,
            "SLOW_MODEL_SECONDS_PER_BATCH": "0.05",
            "SLOW_MODEL_GATE_FILE": str(gate),
        },
    )
    [old] = second.wait_for("job_handed_over_already", timeout_s=60)
    gate.touch()
    assert second.wait(60) == 0, second.stderr[-3000:]
    assert len(second.events("job_handed_over_already")) == 1
    [done] = second.events("job_finished")
    # Never two at once: if the old message ran at all, it had stopped before the
    # delivery that finished the job started (which waited for it: `job_deferred`).
    received = {event["message_id"]: event["timestamp"] for event in second.events("job_received")}
    if old["message_id"] in received:
        assert received[done["message_id"]] > old["timestamp"]
    summary = aws.summary(job_output(stack, "split"))
    waited = len(second.events("job_deferred"))  # a delivery of its own, counted
    # Its deliveries: the first, its continuation, and one for each wait; a message the
    # first daemon's last long poll brought as it stopped is given back, and counts too.
    assert summary["status"] == "succeeded" and summary["attempt"] >= 2 + waited
    assert [r["input"] for r in aws.results(job_output(stack, "split"))] == uris
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def test_a_daemon_that_lost_its_lease_is_fenced_off_by_the_newer_delivery(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The first daemon cannot renew its lease (every renewal answers 500), so the
    message reappears and a second daemon finishes the job first (the first one's model
    waits for it). When the slow first one gets to its writes, they are refused
    (If-None-Match): it logs `job_fenced`, and the outputs stay the second daemon's."""
    stack = aws.stack(visibility_timeout_s=2)
    uris = list(upload_samples(aws.s3, stack.bucket, 4, seed=22))
    send_jobs(aws, stack, {"raced": uris})
    proxy = FaultProxy(aws.endpoint)
    proxy.fail("renewals", lambda request: request.action == "ChangeMessageVisibilityBatch", None)
    common = ["--visibility-timeout-seconds", "2", "--heartbeat-interval-seconds", "0.5"]
    gate = tmp_path / "fast-daemon-done"
    with proxy.serving() as proxy_url:
        slow = start_daemon(
            # One job at most: it does not take the message back when it reappears.
            daemon_args(stack, tmp_path / "slow", *slow_model_flags(4), *common, "--max-jobs", "1"),
            env={
                **aws.with_endpoint(proxy_url).env,
                "SLOW_MODEL_SECONDS_PER_BATCH": "0.5",
                "SLOW_MODEL_GATE_FILE": str(gate),
            },
        )
        slow.wait_for("job_received")
        fast = run_daemon(aws, [*daemon_args(stack, tmp_path / "fast", *common), "--drain"])
        assert fast.returncode == 0, fast.stderr[-3000:]
        gate.touch()
        [fenced] = slow.wait_for("job_fenced", timeout_s=60)
        slow.send_signal(signal.SIGTERM)
        assert slow.wait(30) == 0, slow.stderr[-3000:]
    assert fenced["job_id"] == "raced"
    summary = aws.summary(job_output(stack, "raced"))
    assert summary["worker"]["pid"] != slow.pid and summary["attempt"] == 2
    assert [r["input"] for r in aws.results(job_output(stack, "raced"))] == uris


def test_worker_cancel_stops_a_running_job_and_a_queued_one(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """`worker cancel --output` on a running job: the daemon stops it within a progress
    interval, writes job.json `cancelled` with what it finished, and deletes its message;
    `enqueue --wait` shows it. A job cancelled before it is received is acked unread.
    `--job-id` is refused for an output another job is writing."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 60, seed=23))  # 48 s of work
    running, queued = job_output(stack, "running"), job_output(stack, "queued")
    with following(aws, stack.queue_url, "running", running, *uris) as follower:
        # Few inputs fetched ahead of the slow model: those inside still run after a cancel.
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                *slow_model_flags(1),
                *("--progress-interval-seconds", "0.5", "--fetch-concurrency", "2", "--drain"),
            ),
            env={**aws.env, "SLOW_MODEL_SECONDS_PER_BATCH": "0.8"},
        )
        daemon.wait_for("job_received")
        _cancel(aws, queued)
        send_jobs(aws, stack, {"queued": uris})
        _wait_for_progress(aws, running)
        wrong_job = _cancel(aws, running, "--job-id", "queued", check=False)
        assert wrong_job.returncode == 1 and "job running's output" in wrong_job.stderr
        cancelled = _cancel(aws, running, "--job-id", "running", check=False)
        assert cancelled.returncode == 0, cancelled.stderr
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
        followed, _ = follower.communicate(timeout=30)
    assert follower.returncode == 1  # not succeeded
    assert json.loads(followed[followed.index("{") :])["status"] == "cancelled"
    summary = aws.summary(running)
    assert summary["status"] == "cancelled" and 0 < summary["succeeded"] < 60
    assert len(aws.results(running)) == summary["succeeded"]
    assert aws.summary(queued)["succeeded"] == 0 and aws.summary(queued)["status"] == "cancelled"
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    finished = _cancel(aws, running, check=False)
    assert finished.returncode == 1 and "nothing to cancel" in finished.stderr


def _cancel(
    aws: Aws, output: str, *flags: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", "cancel", "--output", output, "--reason", "test", *flags],
        env=aws.env,
        cwd=REPO,
        check=check,
        capture_output=True,
        text=True,
    )


def _wait_for_progress(aws: Aws, output: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(aws.s3.exceptions.NoSuchKey):
            aws.read(output, "progress.json")
            return
        time.sleep(0.2)
    raise AssertionError(f"no progress.json under {output}")
