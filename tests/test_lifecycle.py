"""Worker faults never become the user's failure: the daemon as a subprocess against a
moto server, with faults injected from outside (a model that breaks, S3 throttling and
resets through a proxy, hanging SQS calls, a refusing dead-letter queue)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Aws
from tests.faultproxy import Fault, FaultProxy, Request
from tests.faults import BREAK_MODEL_FILE
from tests.test_faults import StartDaemon, _args, _assert_complete, _out, _send_jobs
from tests.test_fleet import _free_port, _get
from worker.demo import upload_samples
from worker.settings import MIN_SHUTDOWN_TAIL_S

pytestmark = pytest.mark.e2e


def _input_get(request: Request) -> bool:
    return request.method == "GET" and "/images/" in request.path


def test_a_model_that_breaks_opens_the_circuit_and_fails_no_job(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The model starts failing every batch (a sticky CUDA error, injected by a marker
    file): no job is written `failed`. The daemon says why on /healthz and in its log,
    gives back every job it holds unwritten, at the cost of one receive each, and
    exits 1."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=31))
    jobs = {f"job-{n:02d}": uris[n * 2 : n * 2 + 2] for n in range(20)}
    _send_jobs(aws, stack, jobs)
    marker = tmp_path / "cuda-error"
    port = _free_port()
    proxy = FaultProxy(aws.endpoint)
    with proxy.serving() as proxy_url:
        env = aws.with_endpoint(proxy_url).with_env(**{BREAK_MODEL_FILE: str(marker)}).env
        daemon = start_daemon(
            _args(
                stack,
                tmp_path,
                "--model",
                "tests.faults:breakable_classifier",
                "--batch-size",
                "2",
                "--max-jobs",
                "6",
                "--metrics-port",
                str(port),
            ),
            env=env,
        )
        daemon.wait_for("job_finished", 2)
        # Slow down the give-back so /healthz can be read while the circuit is open.
        proxy.add(
            Fault(
                "slow_release",
                lambda r: r.action == "ChangeMessageVisibilityBatch",
                kind="slow",
                delay_s=3,
            )
        )
        marker.touch()
        health: list[tuple[int, str]] = []
        while daemon.process.poll() is None:
            with contextlib.suppress(OSError):  # the server goes away as the daemon exits
                health.append(_get(f"http://127.0.0.1:{port}/healthz"))
            time.sleep(0.05)
    assert daemon.wait(10) == 1, daemon.stderr[-3000:]
    [broken] = daemon.events("worker_broken")
    assert "illegal memory access" in broken["cause"]
    assert any(
        status == 503 and "broken" in body and "illegal memory access" in body
        for status, body in health
    ), health[-3:]
    done = {job for job in jobs if "job.json" in aws.names(_out(stack, job))}
    assert all(aws.summary(_out(stack, job))["status"] == "succeeded" for job in done)
    assert all("results.jsonl" not in aws.names(_out(stack, job)) for job in set(jobs) - done)
    # A job whose job.json was written just before the circuit opened may not have been
    # deleted: its next delivery acks it unread. Every other job is back in the queue.
    acked = {event["job_id"] for event in daemon.events("job_finished")}
    assert acked <= done
    assert aws.queue_depth(stack.queue_url) == (len(jobs) - len(acked), 0)
    # The fault cost each job it held one receive (this receive is the next one), and
    # jobs it had not received yet none.
    counts = [
        int(message["Attributes"]["ApproximateReceiveCount"])
        for message in aws.sqs.receive_message(
            QueueUrl=stack.queue_url,
            MaxNumberOfMessages=10,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )["Messages"]
    ]
    assert counts and max(counts) == 2, counts


def test_throttled_and_reset_downloads_never_reach_the_results(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """60% of input downloads answered 503 SlowDown and a quarter of the rest reset
    mid-connection, with 3 tries per call: every job still succeeds, with no throttling
    or reset in any result. Downloads are retried under their own budgets; a job whose
    input stays unreachable goes back to the queue and is done on a later delivery."""
    stack = aws.stack(max_receive_count=20)
    uris = list(upload_samples(aws.s3, stack.bucket, 32, seed=32))
    jobs = {f"job-{n:02d}": uris[n * 4 : n * 4 + 4] for n in range(8)}
    _send_jobs(aws, stack, jobs)
    proxy = FaultProxy(aws.endpoint, seed=7)
    proxy.add(Fault("slow_down", _input_get, probability=0.6, status=503, code="SlowDown"))
    proxy.add(Fault("reset", _input_get, probability=0.25, kind="reset"))
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            _args(
                stack, tmp_path, "--drain", "--retry-delay-seconds", "1", "--aws-max-attempts", "3"
            ),
            env=aws.with_endpoint(proxy_url).env,
        )
        assert daemon.wait(180) == 0, daemon.stderr[-3000:]
    assert proxy.injected["slow_down"] > 20 and proxy.injected["reset"] > 3
    for job_id, inputs in jobs.items():
        _assert_complete(aws, stack, job_id, inputs)
        assert b"SlowDown" not in aws.read(_out(stack, job_id), "results.jsonl")
    # Some inputs stayed unreachable past a call's 3 tries and were fed again.
    assert any(
        event["event"] == "input_retried"
        for job in jobs
        for event in aws.log_events(_out(stack, job))
    )
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []


def test_shutdown_has_a_hard_deadline_when_calls_hang(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGTERM while every S3 upload and SQS give-back hangs: the daemon still exits 0
    within its grace period plus its shutdown tail, says it gave up waiting, and leaves
    no process behind; its jobs come back on the queue when their leases run out."""
    stack = aws.stack(visibility_timeout_s=10)
    uris = list(upload_samples(aws.s3, stack.bucket, 6, seed=33))
    jobs = {f"job-{n}": uris[n * 2 : n * 2 + 2] for n in range(3)}
    _send_jobs(aws, stack, jobs)
    proxy = FaultProxy(aws.endpoint)
    hangs = ("PUT", "ChangeMessageVisibility", "ChangeMessageVisibilityBatch")
    proxy.add(
        Fault("hang", lambda r: r.method in hangs or r.action in hangs, kind="slow", delay_s=120)
    )
    grace_s = 2
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            _args(
                stack,
                tmp_path,
                "--grace-seconds",
                str(grace_s),
                "--visibility-timeout-seconds",
                "10",
                "--heartbeat-interval-seconds",
                "5",
            ),
            env=aws.with_endpoint(proxy_url).env,
        )
        daemon.wait_for("job_received", 3)
        time.sleep(1.0)
        daemon.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
        stopped_s = time.monotonic() - signalled
    assert stopped_s < grace_s + MIN_SHUTDOWN_TAIL_S + 5, stopped_s  # the wait is 1 s
    assert daemon.events("shutdown_deadline_passed")
    deadline = time.monotonic() + 30
    while aws.queue_depth(stack.queue_url) != (len(jobs), 0):
        assert time.monotonic() < deadline, aws.queue_depth(stack.queue_url)
        time.sleep(0.5)


def test_a_refusing_dead_letter_queue_leaves_poison_to_the_redrive_policy(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The dead-letter queue refuses every send (its KMS key is not usable): the daemon
    keeps running, a good job beside the poison finishes, and the poison message,
    released after each refusal, reaches the DLQ through the queue's redrive policy."""
    stack = aws.stack()
    [uri] = list(upload_samples(aws.s3, stack.bucket, 1, seed=34))
    aws.send(stack.queue_url, "{not json")
    _send_jobs(aws, stack, {"good": [uri]})
    proxy = FaultProxy(aws.endpoint)
    to_dlq = stack.dlq_url.rsplit("/", 1)[-1]
    proxy.add(
        Fault(
            "dlq_refused",
            lambda r: r.action == "SendMessage" and to_dlq in r.body,
            status=400,
            code="KMS.AccessDeniedException",
        )
    )
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            _args(stack, tmp_path, "--drain", "--retry-delay-seconds", "0"),
            env=aws.with_endpoint(proxy_url).env,
        )
        assert daemon.wait(120) == 0, daemon.stderr[-3000:]
    assert proxy.injected["dlq_refused"] == 3  # the queue's maxReceiveCount
    assert len(daemon.events("dead_letter_failed")) == 3
    _assert_complete(aws, stack, "good", [uri])
    [dead] = aws.dead_letters(stack.dlq_url)
    assert dead["Body"] == "{not json"
    assert aws.queue_depth(stack.queue_url) == (0, 0)
