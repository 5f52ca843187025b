"""Shared fixtures: a moto server on loopback, AWS clients pointed at it, a daemon runner."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.config import Config

from worker.demo import LOCAL_AWS_ENV, Stack, create_stack, local_moto_server, read_output

REPO = Path(__file__).resolve().parent.parent
ORPHAN_GRACE_S = 10.0

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (`make test-gpu` on a GPU host)"
)


def also_on_gpu(on_cpu: Any, on_gpu: Any) -> list[Any]:
    """Parameters for a test that runs on the CPU everywhere and, where there is a GPU,
    on it too: `on_gpu` is marked `gpu` (`make test-gpu` runs those alone). A tuple is
    the values of several parameters."""

    def values(given: Any) -> tuple[Any, ...]:
        return given if isinstance(given, tuple) else (given,)

    return [
        pytest.param(*values(on_cpu), id="cpu"),
        pytest.param(*values(on_gpu), id="gpu", marks=[pytest.mark.gpu, needs_gpu]),
    ]


@dataclass
class Aws:
    """Clients for the moto server, and the environment a daemon needs to reach it."""

    endpoint: str
    sqs: Any
    s3: Any
    env: dict[str, str]

    def stack(self, visibility_timeout_s: int = 30, max_receive_count: int = 3) -> Stack:
        name = f"t-{uuid.uuid4().hex[:12]}"
        return create_stack(self.sqs, self.s3, name, visibility_timeout_s, max_receive_count)

    def with_endpoint(self, endpoint: str) -> Aws:
        """The same clients; a daemon started with the result talks to `endpoint`."""
        return replace(self, env={**self.env, "AWS_ENDPOINT_URL": endpoint})

    def with_env(self, **more: str) -> Aws:
        return replace(self, env={**self.env, **more})

    def client(self, service: str) -> Any:
        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client(service, endpoint_url=self.endpoint)

    def send(self, queue_url: str, body: dict[str, Any] | str) -> None:
        text = body if isinstance(body, str) else json.dumps(body)
        self.sqs.send_message(QueueUrl=queue_url, MessageBody=text)

    def read(self, output: str, name: str) -> bytes:
        return read_output(self.s3, output, name)

    def results(self, output: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read(output, "results.jsonl").splitlines()]

    def summary(self, output: str) -> dict[str, Any]:
        return json.loads(self.read(output, "job.json"))  # type: ignore[no-any-return]

    def log_events(self, output: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read(output, "job.log").splitlines()]

    def names(self, output: str) -> list[str]:
        """The names of the objects under an output prefix."""
        bucket, _, prefix = output.removeprefix("s3://").partition("/")
        listing = self.s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return sorted(entry["Key"].removeprefix(prefix) for entry in listing)

    def dead_letters(self, dlq_url: str) -> list[dict[str, Any]]:
        """Every message on the dead-letter queue (left invisible for a minute)."""
        messages: list[dict[str, Any]] = []
        while batch := self.sqs.receive_message(
            QueueUrl=dlq_url,
            MaxNumberOfMessages=10,
            MessageAttributeNames=["All"],
            VisibilityTimeout=60,
        ).get("Messages", []):
            messages += batch
        return messages

    def auto_scaling_group(self, name: str) -> str:
        """An Auto Scaling group of one instance; returns the instance id."""
        ec2 = self.client("ec2")
        autoscaling = self.client("autoscaling")
        ec2.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "g5.xlarge"},
        )
        subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
        autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=name,
            LaunchTemplate={"LaunchTemplateName": name},
            MinSize=1,
            MaxSize=2,
            DesiredCapacity=1,
            VPCZoneIdentifier=subnet,
        )
        [instance] = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])[
            "AutoScalingGroups"
        ][0]["Instances"]
        return str(instance["InstanceId"])

    def protected(self, instance_id: str) -> bool:
        """Whether the instance is protected from scale-in."""
        [instance] = self.client("autoscaling").describe_auto_scaling_instances(
            InstanceIds=[instance_id]
        )["AutoScalingInstances"]
        return bool(instance["ProtectedFromScaleIn"])

    def queue_depth(self, queue_url: str) -> tuple[int, int]:
        """(visible, in flight) messages."""
        attributes = self.sqs.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attributes["ApproximateNumberOfMessages"]),
            int(attributes["ApproximateNumberOfMessagesNotVisible"]),
        )


@pytest.fixture(scope="session")
def aws() -> Iterator[Aws]:
    with local_moto_server() as endpoint:
        env = {
            **os.environ,
            **LOCAL_AWS_ENV,
            "AWS_ENDPOINT_URL": endpoint,
            "PYTHONUNBUFFERED": "1",
            "WORKER_METRICS_PORT": "0",  # tests that want the endpoint pick a free port
        }
        session = boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        yield Aws(
            endpoint,
            session.client("sqs", endpoint_url=endpoint),
            session.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=32)),
            env,
        )


@dataclass
class DaemonRun:
    returncode: int
    stdout: str
    stderr: str


class DaemonProcess:
    """`python -m worker run ARGS` as a real subprocess in its own process group, with
    its JSON log lines collected as they come so a test can act on them."""

    def __init__(self, env: dict[str, str], args: list[str], cwd: Path = REPO):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "worker", "run", *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._collect, args=(name,), daemon=True)
            for name in self._lines
        ]
        for reader in self._readers:
            reader.start()

    def _collect(self, name: str) -> None:
        for line in getattr(self.process, name):
            self._lines[name].append(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout(self) -> str:
        return "".join(self._lines["stdout"])

    @property
    def stderr(self) -> str:
        return "".join(self._lines["stderr"])

    def events(self, name: str) -> list[dict[str, Any]]:
        """The daemon's log events called `name`, so far."""
        events = []
        for line in list(self._lines["stdout"]):
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if event.get("event") == name:
                    events.append(event)
        return events

    def wait_for(self, name: str, count: int = 1, timeout_s: float = 120) -> list[dict[str, Any]]:
        """Wait until the daemon has logged `name` `count` times; its events."""
        deadline = time.monotonic() + timeout_s
        while len(events := self.events(name)) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                events_tail = "".join(self._lines["stdout"][-30:])
                raise AssertionError(
                    f"no {count} x {name}; last events:\n{events_tail}\n"
                    f"stderr:\n{self.stderr[-3000:]}"
                )
            time.sleep(0.05)
        return events

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """The daemon's exit status; on a time-out, an error that shows its last events."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            tail = "".join(self._lines["stdout"][-40:])
            raise AssertionError(
                f"still running after {timeout_s} s; last events:\n{tail}"
            ) from None

    def close(self) -> list[str]:
        """Kill whatever is left; returns what was still running of the daemon's group."""
        leftovers: list[str] = []
        if self.process.poll() is not None:
            # Children notice their parent's death by themselves; give them a moment.
            deadline = time.monotonic() + ORPHAN_GRACE_S
            while (leftovers := processes_in_group(self.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        for reader in self._readers:
            reader.join(5)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        return leftovers


def processes_in_group(pgid: int) -> list[str]:
    """`ps`-style lines of the live (not zombie) processes in process group `pgid`."""
    found = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            stat = stat_path.read_text()
            state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(group) == pgid and state not in "ZX":
                found.append(stat[: stat.rindex(")") + 1])
    return found


@pytest.fixture
def start_daemon(aws: Aws) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons as subprocesses; after the test none of their processes may remain."""
    started: list[DaemonProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(env or aws.env, args)
        started.append(daemon)
        return daemon

    yield start
    leftovers = [line for daemon in started for line in daemon.close()]
    assert not leftovers, f"processes left behind: {leftovers}"


def run_daemon(aws: Aws, args: list[str], timeout_s: float = 240) -> DaemonRun:
    """Run `python -m worker run ARGS` to completion; nothing of it may outlive it."""
    daemon = DaemonProcess(aws.env, args)
    try:
        returncode = daemon.wait(timeout_s)
    finally:
        leftovers = daemon.close()
    assert not leftovers, f"processes left behind: {leftovers}"
    return DaemonRun(returncode, daemon.stdout, daemon.stderr)


def enqueue_command(queue_url: str, job_id: str, output: str, *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker",
        "enqueue",
        "--queue-url",
        queue_url,
        "--job-id",
        job_id,
        "--output",
        output,
        *more,
    ]


@contextlib.contextmanager
def following(
    aws: Aws, queue_url: str, job_id: str, output: str, *more: str
) -> Iterator[subprocess.Popen[str]]:
    """`worker enqueue --wait`: sends a job and follows it to its summary; entered once
    the job is in the queue (a draining daemon started before would find it empty).
    However the test ends, the follower is stopped and its pipes closed."""
    queued = sum(aws.queue_depth(queue_url))
    follower = subprocess.Popen(
        enqueue_command(queue_url, job_id, output, "--wait", *more),
        env=aws.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while sum(aws.queue_depth(queue_url)) == queued and follower.poll() is None:
            assert time.monotonic() < deadline, "enqueue sent nothing in 60 s"
            time.sleep(0.1)
        yield follower
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.communicate()
