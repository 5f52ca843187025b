"""No job is lost or half-written, whatever stops the work on it: a killed inference
process, AWS calls that fail (a job whose results can never be uploaded reaches the
dead-letter queue), SIGTERM, a second signal, SIGKILL of the daemon, the lease
ceiling. Each job ends complete once, or goes back to its queue, or reaches the
dead-letter queue. The daemon runs as a subprocess against a moto server
(docs/DESIGN.md section 4); every test also checks, through the `start_daemon` fixture
or `run_daemon`, that no process of the daemon outlives it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, run_daemon, slow_model_flags
from tests.support.faultproxy import FaultProxy, Request
from tests.support.jobs import assert_complete, job_output, send_jobs
from worker.demo import upload_samples
from worker.loops.results import FINISH_ATTEMPTS

pytestmark = pytest.mark.e2e


def _local_log(log_dir: Path, job_id: str) -> Path:
    """The job's log on this machine (named by its id and its output)."""
    [path] = log_dir.glob(f"{job_id}.*.log")
    return path


def test_transient_errors_are_retried_and_an_unuploadable_job_goes_to_the_dlq(
    aws: Aws, tmp_path: Path
) -> None:
    """Through a proxy that answers HTTP 500: every input download and some uploads and
    receives fail once and are retried (the jobs succeed on their first attempt); the
    job whose results can never be uploaded is tried again under its lease, then
    released each time, and after the queue's maxReceiveCount (3) SQS moves it to the
    dead-letter queue."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 20, seed=6))
    jobs = {f"flaky-{n}": uris[n * 5 : n * 5 + 5] for n in range(4)}
    send_jobs(aws, stack, {**jobs, "doomed": uris[:2]})

    proxy = FaultProxy(aws.endpoint)  # the first fault that matches a request applies
    proxy.fail("doomed_upload", _doomed_upload, times=None)
    proxy.fail("input_download", lambda r: r.method == "GET" and "/images/" in r.path, times=1)
    proxy.fail("upload", lambda r: r.method == "PUT" and r.path.endswith("results.jsonl"), times=1)
    proxy.fail("receive", lambda r: r.action == "ReceiveMessage", times=2)
    with proxy.serving() as proxy_url:
        run = run_daemon(
            aws.with_endpoint(proxy_url),
            daemon_args(
                stack,
                tmp_path,
                "--drain",
                "--aws-max-attempts",
                "3",
                "--retry-delay-seconds",
                "0",
            ),
        )
    assert run.returncode == 0, run.stderr[-3000:]

    assert proxy.injected["input_download"] == 20
    assert proxy.injected["upload"] == 4
    # Three deliveries, each finished FINISH_ATTEMPTS times, each write tried 3 times.
    assert proxy.injected["doomed_upload"] == 3 * FINISH_ATTEMPTS * 3
    assert proxy.injected["receive"] == 2
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        assert aws.summary(job_output(stack, job_id))["attempt"] == 1
    assert "job.json" not in aws.names(job_output(stack, "doomed"))
    [dead] = aws.dead_letters(stack.dlq_url)
    assert json.loads(dead["Body"])["job_id"] == "doomed"
    local_log = _local_log(tmp_path, "doomed").read_text()
    assert local_log.count('"job_released"') == 3 and "InternalError" in local_log
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def _doomed_upload(request: Request) -> bool:
    return request.method == "PUT" and request.path.endswith("/out/doomed/results.jsonl")


def test_sigterm_finishes_or_releases_everything_within_the_grace_period(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGTERM mid-run: exit 0 within the grace period; each job is either complete
    (job.json) or visible on the queue again, none left invisible. (A finish the grace
    cut short may have written results.jsonl before its job.json: job.json is what
    makes a job done, and the next delivery writes its outputs again.)"""
    stack = aws.stack(visibility_timeout_s=60)
    uris = list(upload_samples(aws.s3, stack.bucket, 24, seed=8))
    jobs = {f"job-{n}": uris[n * 4 : n * 4 + 4] for n in range(6)}
    send_jobs(aws, stack, jobs)
    grace_s = 3
    daemon = start_daemon(
        daemon_args(
            stack,
            tmp_path,
            *slow_model_flags(2),
            "--grace-seconds",
            str(grace_s),
            "--visibility-timeout-seconds",
            "60",
        ),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.5").env,
    )
    daemon.wait_for("job_received", 6)
    time.sleep(1.0)
    daemon.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert time.monotonic() - signalled < grace_s + 10

    done = {job for job in jobs if "job.json" in aws.names(job_output(stack, job))}
    # A job whose job.json was being written as the grace ran out can be both complete
    # and handed back: its next delivery finds it done and acks it.
    released = {e["job_id"] for e in daemon.events("job_released")}
    assert set(jobs) - done <= released and released
    assert aws.queue_depth(stack.queue_url) == (len(released), 0)
    assert daemon.events("daemon_stopped")[0]["reason"] == "signalled"
    # Nor anything of its own in the temporary directory (its fork server's socket's).
    assert not list(daemon.temporary_directory.iterdir())


def test_second_signal_cuts_the_grace_period_short(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGTERM, then SIGINT: the daemon does not wait out its 60 s grace; it releases
    the jobs at once and exits 0."""
    stack = aws.stack(visibility_timeout_s=60)
    uris = list(upload_samples(aws.s3, stack.bucket, 8, seed=9))
    send_jobs(aws, stack, {"a": uris[:4], "b": uris[4:]})
    daemon = start_daemon(
        daemon_args(stack, tmp_path, *slow_model_flags(1)),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="2.0").env,
    )
    daemon.wait_for("job_received", 2)
    daemon.send_signal(signal.SIGTERM)
    daemon.wait_for("draining_in_flight_jobs")
    daemon.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert time.monotonic() - signalled < 10
    assert aws.queue_depth(stack.queue_url) == (2, 0)


def test_sigkill_of_the_daemon_or_of_its_inference_process_loses_nothing(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGKILL the daemon with 30 jobs in flight; its children go with it. A new daemon
    started at once with `--drain` does the rest, the dead one's jobs included once
    their leases run out. SIGKILL that one's inference process mid-run: it sees it die,
    starts a new one and retries the batch it held. Every job has exactly one complete,
    in-order results.jsonl and job.json, and both queues are empty. (One test: the
    second daemon's run serves both kills, one daemon's start fewer.)"""
    # Leases longer than a daemon's start, so the new daemon's first receive finds the
    # dead one's messages still in flight.
    stack = aws.stack(visibility_timeout_s=12)
    uris = list(upload_samples(aws.s3, stack.bucket, 180, seed=10))
    jobs = {f"job-{n:02d}": uris[n * 6 : n * 6 + 6] for n in range(30)}
    send_jobs(aws, stack, jobs)
    lease = ["--visibility-timeout-seconds", "12", "--heartbeat-interval-seconds", "3"]
    model = slow_model_flags(4)
    first = start_daemon(
        daemon_args(stack, tmp_path, *lease, *model),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.1").env,
    )
    first.wait_for("job_finished", 5)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert first.close() == []  # its children noticed and exited
    assert aws.queue_depth(stack.queue_url)[1] > 0  # the dead daemon's leases

    # Slower batches: its inference process holds one when it is killed.
    second = start_daemon(
        daemon_args(stack, tmp_path, "--drain", *lease, *model),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.3").env,
    )
    [inference] = [
        e for e in second.wait_for("stage_worker_started", 3) if e["stage"] == "inference"
    ]
    second.wait_for("job_received")
    time.sleep(1.0)
    os.kill(inference["pid"], signal.SIGKILL)
    assert second.wait(120) == 0, second.stderr[-3000:]

    attempts = []
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        assert set(aws.names(job_output(stack, job_id))) <= {
            "job.json",
            "job.log",
            "results.jsonl",
            "progress.json",
        }
        attempts.append(aws.summary(job_output(stack, job_id))["attempt"])
    assert max(attempts) >= 2  # the kill did interrupt jobs in flight
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []

    [lost] = second.events("worker_lost")
    assert lost["stage"] == "inference" and "exited with code -9" in lost["reason"]
    started = [e for e in second.events("stage_worker_started") if e["stage"] == "inference"]
    assert len(started) == 2 and started[1]["pid"] != inference["pid"]
    logged = [e for job in jobs for e in aws.log_events(job_output(stack, job))]
    assert any(e["event"] == "worker_lost" and e["stage"] == "inference" for e in logged)


def test_job_reaching_the_lease_ceiling_is_released_with_a_reason(aws: Aws, tmp_path: Path) -> None:
    """A job that no delivery can move forward within the longest lease (one input
    slower than the ceiling, shrunk to 4 s here from SQS's 12 h) is released with a log
    line instead of being renewed; each delivery meets the same fate until the redrive
    policy moves it to the dead-letter queue. (One that moves forward is handed over:
    `tests/test_resume_cancel_and_fencing.py`.)"""
    stack = aws.stack(visibility_timeout_s=2)
    uris = list(upload_samples(aws.s3, stack.bucket, 1, seed=12))
    send_jobs(aws, stack, {"endless": uris})
    run = run_daemon(
        aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="6"),
        daemon_args(
            stack,
            tmp_path,
            "--drain",
            *slow_model_flags(1),
            "--visibility-timeout-seconds",
            "2",
            "--heartbeat-interval-seconds",
            "0.5",
            "--max-lease-seconds",
            "4",
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ceilings = [json.loads(line) for line in run.stdout.splitlines() if "lease_ceiling" in line]
    assert len(ceilings) == 3 and all(e["job_id"] == "endless" for e in ceilings)
    assert _local_log(tmp_path, "endless").read_text().count('"lease_ceiling_reached"') == 3
    [dead] = aws.dead_letters(stack.dlq_url)
    assert json.loads(dead["Body"])["job_id"] == "endless"
    assert "job.json" not in aws.names(job_output(stack, "endless"))
    assert aws.queue_depth(stack.queue_url) == (0, 0)
