"""Worker faults never become the user's failure: the daemon as a subprocess against a
moto server, with faults injected from outside (a model that breaks, S3 throttling and
resets through a proxy, S3 and SQS calls that hang at shutdown, a refusing dead-letter
queue, an input that breaks every worker it reaches). No job is written `failed` for
them: the work goes back to the queue; only a job whose items keep breaking workers
is dead-lettered, and a host where workers keep breaking is taken out of service."""

from __future__ import annotations

import contextlib
import http.client
import signal
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.support.aws import Aws, ec2_env
from tests.support.daemons import DaemonProcess, StartDaemon, daemon_args, free_port, http_get
from tests.support.fakeaws import FakeImds
from tests.support.faultproxy import Fault, FaultProxy, input_download
from tests.support.faults import BREAK_MODEL_FILE, MAGENTA, png_bytes
from tests.support.jobs import assert_complete, job_output, send_jobs, upload
from worker.demo import upload_samples
from worker.settings import MIN_SHUTDOWN_TAIL_S

pytestmark = pytest.mark.e2e


def test_a_model_that_breaks_opens_the_circuit_and_fails_no_job(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The model starts failing every batch (a sticky CUDA error, injected by a marker
    file): no job is written `failed`. The daemon says why on /healthz and in its log,
    gives back every job it holds unwritten, charging only the jobs of the batch that
    failed, and exits 1."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=31))
    jobs = {f"job-{n:02d}": uris[n * 2 : n * 2 + 2] for n in range(20)}
    send_jobs(aws, stack, jobs)
    marker = tmp_path / "cuda-error"
    port = free_port()
    proxy = FaultProxy(aws.endpoint)
    with proxy.serving() as proxy_url:
        env = aws.with_endpoint(proxy_url).with_env(**{BREAK_MODEL_FILE: str(marker)}).env
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                "--model",
                "tests.support.faults:breakable_classifier",
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
            # The server goes away as the daemon exits, a reply cut short with it.
            with contextlib.suppress(OSError, http.client.HTTPException):
                health.append(http_get(f"http://127.0.0.1:{port}/healthz"))
            time.sleep(0.05)
    assert daemon.wait(10) == 1, daemon.stderr[-3000:]
    [broken] = daemon.events("worker_broken")
    assert "illegal memory access" in broken["cause"]
    assert any(
        status == 503 and "broken" in body and "illegal memory access" in body
        for status, body in health
    ), health[-3:]
    done = {job for job in jobs if "job.json" in aws.names(job_output(stack, job))}
    assert all(aws.summary(job_output(stack, job))["status"] == "succeeded" for job in done)
    # A job settled as its finish's writes were in flight may have its results.jsonl
    # and no job.json (no result: its next delivery writes over it). Any results.jsonl
    # is whole: every input of its job labelled, none an error.
    for job, inputs in jobs.items():
        if "results.jsonl" in aws.names(job_output(stack, job)):
            results = aws.results(job_output(stack, job))
            assert [line["input"] for line in results] == inputs
            assert all("label" in line and "error" not in line for line in results)
    # A job whose job.json was written just before the circuit opened may not have been
    # deleted: its next delivery acks it unread. A job finished (its job.json written,
    # `job_finished`) is acked unless the circuit's give-back settled it first
    # (`job_released`). Every other job is back in the queue.
    released = {event["job_id"] for event in daemon.events("job_released")}
    acked = {event["job_id"] for event in daemon.events("job_finished")} - released
    assert acked <= done
    assert aws.queue_depth(stack.queue_url) == (len(jobs) - len(acked), 0)
    # Only the jobs with items in the batch that failed (two images: one or two jobs)
    # are charged, as suspects; the others it held went back uncharged, as
    # continuations, and the jobs it had not received are untouched.
    suspects, uncharged = [], []
    for message in aws.dead_letters(stack.queue_url):
        attributes = message.get("MessageAttributes", {})
        if "worker.broke-workers" in attributes:
            assert attributes["worker.broke-workers"]["StringValue"] == "1"
            assert "illegal memory access" in attributes["worker.breakage"]["StringValue"]
            suspects.append(message)
        elif "worker.handed-over-from" in attributes:
            uncharged.append(message)
    assert 1 <= len(suspects) <= 2 and uncharged, (len(suspects), len(uncharged))


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
    send_jobs(aws, stack, jobs)
    proxy = FaultProxy(aws.endpoint, seed=7)
    proxy.add(Fault("slow_down", input_download, probability=0.6, status=503, code="SlowDown"))
    proxy.add(Fault("reset", input_download, probability=0.25, kind="reset"))
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            daemon_args(
                stack, tmp_path, "--drain", "--retry-delay-seconds", "1", "--aws-max-attempts", "3"
            ),
            env=aws.with_endpoint(proxy_url).env,
        )
        assert daemon.wait(180) == 0, daemon.stderr[-3000:]
    assert proxy.injected["slow_down"] > 20 and proxy.injected["reset"] > 3
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        assert b"SlowDown" not in aws.read(job_output(stack, job_id), "results.jsonl")
    # Some inputs stayed unreachable past a call's 3 tries and were fed again.
    assert any(
        event["event"] == "input_retried"
        for job in jobs
        for event in aws.log_events(job_output(stack, job))
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
    send_jobs(aws, stack, jobs)
    proxy = FaultProxy(aws.endpoint)
    hangs = ("PUT", "ChangeMessageVisibility", "ChangeMessageVisibilityBatch")
    proxy.add(
        Fault("hang", lambda r: r.method in hangs or r.action in hangs, kind="slow", delay_s=120)
    )
    grace_s = 2
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            daemon_args(
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
    send_jobs(aws, stack, {"good": [uri]})
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
            daemon_args(stack, tmp_path, "--drain", "--retry-delay-seconds", "0"),
            env=aws.with_endpoint(proxy_url).env,
        )
        assert daemon.wait(120) == 0, daemon.stderr[-3000:]
    assert proxy.injected["dlq_refused"] == 3  # the queue's maxReceiveCount
    assert len(daemon.events("dead_letter_failed")) == 3
    assert_complete(aws, stack, "good", [uri])
    [dead] = aws.dead_letters(stack.dlq_url)
    assert dead["Body"] == "{not json"
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def test_an_input_that_breaks_workers_is_dead_lettered_alone_and_its_host_taken_out(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """One job holds an image that leaves the model's process failing everything (a
    sticky device error). Daemons on one host (one log directory), restarted as
    docker's restart policy would: each breakage hands the jobs that were not in the
    failing batch over uncharged and sends the suspects on with a count of the workers
    they broke. Suspects run apart, so the culprit breaks the next workers alone while
    its batch-mates finish. The third breakage on the host sets the instance Unhealthy
    and a daemon restarted there takes no work; a daemon on another host dead-letters
    the culprit with the reason, and every other job succeeds."""
    stack = aws.stack()
    group = f"{stack.bucket}-workers"
    instance_id = aws.auto_scaling_group(group)
    uris = list(upload_samples(aws.s3, stack.bucket, 18, seed=41))
    magenta = upload(aws, stack, "bad/magenta.png", png_bytes(Image.new("RGB", (64, 64), MAGENTA)))
    jobs = {f"job-{n}": uris[n * 2 : n * 2 + 2] for n in range(8)}
    send_jobs(aws, stack, {**jobs, "culprit": [uris[16], magenta, uris[17]]})

    def run(log_dir: Path, *more: str, env: dict[str, str] | None = None) -> DaemonProcess:
        # Five daemons started: one preprocessing process each is enough for 20 images.
        args = ["--drain", "--model", "tests.support.faults:poisonable_classifier", *more]
        args += ["--preprocess-workers", "1"]
        daemon = start_daemon(daemon_args(stack, log_dir, "--batch-size", "4", *args), env=env)
        daemon.wait(120)
        return daemon

    host = tmp_path / "host-a"
    fake = FakeImds(instance_id, group)
    with fake.serving() as imds_url:
        on_ec2 = ec2_env(aws, imds_url)
        broke = [run(host, env=on_ec2) for _ in range(3)]
        restarted = run(host, env=on_ec2)
    assert [daemon.process.returncode for daemon in broke] == [1, 1, 1]
    suspects = [daemon.events("worker_broken")[0]["suspects"] for daemon in broke]
    assert all("illegal memory access" in d.events("worker_broken")[0]["cause"] for d in broke)
    assert len(suspects[0]) >= 1 and len(suspects[1]) == len(suspects[2]) == 1, suspects
    [taken_out] = broke[2].events("host_out_of_service")
    assert "3 breakages" in taken_out["reason"] and instance_id in taken_out["action"]
    [instance] = aws.client("autoscaling").describe_auto_scaling_instances(
        InstanceIds=[instance_id]
    )["AutoScalingInstances"]
    assert instance["HealthStatus"].upper() == "UNHEALTHY"
    assert restarted.process.returncode == 1
    assert restarted.events("host_out_of_service") and not restarted.events("job_received")

    # Short polls: it drains (two empty receives) without waiting 1 s on each.
    elsewhere = run(tmp_path / "host-b", "--protection", "off", "--receive-wait-seconds", "0")
    assert elsewhere.process.returncode == 0, elsewhere.stderr[-3000:]
    [dead] = aws.dead_letters(stack.dlq_url)
    assert '"culprit"' in dead["Body"]
    reason = dead["MessageAttributes"]["reason"]["StringValue"]
    assert "3 workers broke with its items in the work that failed" in reason, reason
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
    assert aws.queue_depth(stack.queue_url) == (0, 0)
