"""Running as a fleet: scale-in protection against moto's Auto Scaling API with a fake
instance metadata service, ECS task protection with a fake agent, three daemons on one
queue, and the health and metrics endpoints. Daemons run as subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, free_port, http_get, slow_model_flags
from tests.support.fakeaws import FakeEcsAgent, FakeImds
from tests.support.faultproxy import FaultProxy
from tests.support.jobs import assert_complete, job_output, send_jobs
from tests.support.timing import wait_until
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e


def test_asg_protection_is_on_while_busy_and_off_when_idle_or_stopped(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The instance (found through IMDSv2) is protected when the first job arrives, stays
    so through the idle grace, is unprotected after it, and again on SIGTERM: two
    SetInstanceProtection calls per busy period, counted at the HTTP level."""
    stack = aws.stack()
    instance_id = aws.auto_scaling_group(f"{stack.bucket}-workers")
    uris = list(upload_samples(aws.s3, stack.bucket, 6, seed=14))
    proxy, imds = FaultProxy(aws.endpoint), FakeImds(instance_id, f"{stack.bucket}-workers")
    with proxy.serving() as proxy_url, imds.serving() as imds_url:
        env = {
            **aws.with_endpoint(proxy_url).env,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url,
            "AWS_EC2_METADATA_DISABLED": "false",
        }
        daemon = start_daemon(daemon_args(stack, tmp_path, "--idle-grace-seconds", "3"), env=env)
        assert daemon.wait_for("scale_in_protection")[0]["mode"] == "asg"
        assert not aws.protected(instance_id)
        send_jobs(aws, stack, {"a": uris[:3], "b": uris[3:]})
        finished = daemon.wait_for("job_finished", 2)
        unset = daemon.wait_for("scale_in_protection_set", 2)[1]
        assert not aws.protected(instance_id)
        # Held through the idle grace, which starts once the last job is done (its time
        # from the daemon's own log: a loaded machine may look later than that).
        assert _at(unset) - max(map(_at, finished)) >= 3.0, (unset, finished)

        send_jobs(aws, stack, {"c": uris[:2]})
        daemon.wait_for("job_finished", 3)
        # On again for the second busy period (from the daemon's log: beside a second
        # suite the test asked AWS 3 s after, past the idle grace, and found it off).
        assert daemon.wait_for("scale_in_protection_set", 3)[2]["protected"] is True
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert not aws.protected(instance_id)
    states = [e["protected"] for e in daemon.events("scale_in_protection_set")]
    assert states == [True, False, True, False]
    assert proxy.actions["SetInstanceProtection"] == 4


def _at(event: dict[str, object]) -> float:
    """When the daemon logged `event`, in seconds."""
    return datetime.fromisoformat(str(event["timestamp"])).timestamp()


def test_ecs_task_protection_is_renewable_and_dropped_on_sigterm(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """With ECS_AGENT_URI set, `auto` picks ECS task protection: on with an expiry when
    the job arrives, off on SIGTERM even inside the idle grace; the job is released."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 3, seed=15))
    agent = FakeEcsAgent()
    with agent.serving() as agent_uri:
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                *slow_model_flags(1),
                "--grace-seconds",
                "0",
                "--idle-grace-seconds",
                "600",
            ),
            env={**aws.env, "ECS_AGENT_URI": agent_uri},
        )
        assert daemon.wait_for("scale_in_protection")[0]["mode"] == "ecs"
        send_jobs(aws, stack, {"slow": uris})
        daemon.wait_for("scale_in_protection_set")
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert agent.states == [
        {"ProtectionEnabled": True, "ExpiresInMinutes": 60},
        {"ProtectionEnabled": False},
    ]
    assert aws.queue_depth(stack.queue_url) == (1, 0)


def test_three_daemons_share_a_queue_and_survive_losing_one(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Three daemons on one queue; one is SIGKILLed mid-run. The other two pick up its
    jobs when their leases run out: every job is done, each output written once, the
    work was shared, and both queues end empty."""
    stack = aws.stack(visibility_timeout_s=4)
    uris = list(upload_samples(aws.s3, stack.bucket, 180, seed=16))
    jobs = {f"job-{n:02d}": uris[n * 4 : n * 4 + 4] for n in range(45)}
    send_jobs(aws, stack, jobs)
    env = aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.2").env
    args = [
        *slow_model_flags(4),
        "--visibility-timeout-seconds",
        "4",
        "--heartbeat-interval-seconds",
        "1",
        "--max-jobs",
        "8",
    ]
    daemons = [
        start_daemon(daemon_args(stack, tmp_path / str(n), *args), env=env) for n in range(3)
    ]
    daemons[0].wait_for("job_finished", 2)
    daemons[0].send_signal(signal.SIGKILL)

    deadline = time.monotonic() + 180
    # The killed daemon may have written a job's summary and died before its delete: that
    # message is still due, so the fleet is done only when the queue is empty too.
    while not (
        all("job.json" in aws.names(job_output(stack, job)) for job in jobs)
        and aws.queue_depth(stack.queue_url) == (0, 0)
    ):
        assert time.monotonic() < deadline, "jobs left undone"
        time.sleep(1)
    for daemon in daemons[1:]:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]

    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
    # Every daemon did some of the work. (The killed one may have acked a job and died
    # before its log line, so the lines need not name every job: the outputs do.)
    finished = [{e["job_id"] for e in daemon.events("job_finished")} for daemon in daemons]
    assert all(finished), [len(f) for f in finished]
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    """`python -m worker healthcheck`, as the container's HEALTHCHECK runs it."""
    return subprocess.run(
        [sys.executable, "-m", "worker", "healthcheck", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_health_follows_the_inference_process_and_metrics_count_the_jobs(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """/healthz is 503 while the killed inference process is down (its replacement held
    in its set-up until the test has seen it, however slowly a loaded machine answers)
    and 200 again once it is back; /metrics reports the jobs, items and restart of the
    run."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 32, seed=17))
    jobs = {f"job-{n}": uris[n * 8 : n * 8 + 8] for n in range(4)}
    port = free_port()
    hold = tmp_path / "hold-the-inference-process"
    daemon = start_daemon(
        daemon_args(
            stack,
            tmp_path,
            *slow_model_flags(4),
            "--metrics-port",
            str(port),
        ),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.3", SLOW_MODEL_HOLD_FILE=str(hold)).env,
    )
    daemon.wait_for("daemon_started")
    health = f"http://127.0.0.1:{port}/healthz"
    assert http_get(health) == (200, "ok\n")
    [inference] = [e for e in daemon.events("stage_worker_started") if e["stage"] == "inference"]
    send_jobs(aws, stack, jobs)
    daemon.wait_for("job_received")
    hold.touch()
    os.kill(inference["pid"], signal.SIGKILL)
    wait_until(lambda: http_get(health)[0] == 503, timeout_s=60)
    assert "inference" in http_get(health)[1]
    hold.unlink()
    wait_until(lambda: http_get(health) == (200, "ok\n"), timeout_s=60)
    healthcheck = _healthcheck(port)
    assert (healthcheck.returncode, healthcheck.stdout) == (0, "ok\n")

    daemon.wait_for("job_finished", 4)
    status, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert 'worker_jobs_total{outcome="succeeded"} 4.0' in metrics
    assert 'worker_items_total{outcome="succeeded"} 32.0' in metrics
    assert 'worker_stage_restarts_total{stage="inference"} 1.0' in metrics
    assert 'worker_batch_items_count{stage="inference"}' in metrics
    assert 'worker_stage_queue_depth{stage="preprocess"}' in metrics
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    stopped = _healthcheck(port)
    assert stopped.returncode == 1 and "no answer" in stopped.stderr


def test_protection_asked_for_but_unavailable_stops_the_start(aws: Aws, tmp_path: Path) -> None:
    """`--protection asg` where no instance metadata answers is a configuration error:
    exit 2 at start, naming the problem, rather than a fleet that cannot protect itself."""
    closed_port = free_port()
    started = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--queue-url", "q", "--protection", "asg"],
        env={
            **aws.env,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{closed_port}",
            "AWS_EC2_METADATA_DISABLED": "false",
            "WORKER_LOG_DIR": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert started.returncode == 2
    assert "cannot start: --protection asg, but the instance metadata service" in started.stderr


@pytest.mark.parametrize("taken", ["metrics-port", "log-dir"])
def test_a_resource_it_cannot_take_at_start_stops_it_with_one_line(
    aws: Aws, tmp_path: Path, taken: str
) -> None:
    """Another process holds its metrics port, or its log directory cannot be written:
    exit 2 at start with one line naming the resource and the setting, no traceback (1
    is a worker found broken while it ran)."""
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        unwritable = tmp_path / "a-file"
        unwritable.write_text("not a directory")
        flags = {
            "metrics-port": ["--metrics-port", str(port), "--log-dir", str(tmp_path)],
            "log-dir": ["--metrics-port", "0", "--log-dir", str(unwritable / "logs")],
        }[taken]
        started = subprocess.run(
            [sys.executable, "-m", "worker", "run", "--queue-url", "q", *flags],
            env=aws.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert started.returncode == 2, started.stderr[-3000:]
    [line] = [line for line in started.stderr.splitlines() if line.startswith("cannot start")]
    assert f"--{taken}" in line and "Traceback" not in started.stderr
    if taken == "metrics-port":
        assert f"port {port}" in line and "in use" in line
