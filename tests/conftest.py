"""Shared fixtures: a moto server on loopback, AWS clients pointed at it, a daemon runner."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from worker.demo import LOCAL_AWS_ENV, Stack, create_stack, local_moto_server

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Aws:
    """Clients for the moto server, and the environment a daemon needs to reach it."""

    endpoint: str
    sqs: Any
    s3: Any
    env: dict[str, str]

    def stack(self, visibility_timeout_s: int = 30) -> Stack:
        return create_stack(self.sqs, self.s3, f"t-{uuid.uuid4().hex[:12]}", visibility_timeout_s)

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
        env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint, "PYTHONUNBUFFERED": "1"}
        session = boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        yield Aws(
            endpoint,
            session.client("sqs", endpoint_url=endpoint),
            session.client("s3", endpoint_url=endpoint),
            env,
        )


@dataclass
class DaemonRun:
    returncode: int
    stdout: str
    stderr: str


def run_daemon(aws: Aws, args: list[str], timeout_s: float = 240, cwd: Path = REPO) -> DaemonRun:
    """Run `python -m worker run ARGS` to completion as a real subprocess."""
    process = subprocess.Popen(
        [sys.executable, "-m", "worker", "run", *args],
        env=aws.env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        # Whatever happened, nothing of the daemon's outlives the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return DaemonRun(process.returncode, stdout, stderr)
