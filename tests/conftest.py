"""Shared fixtures: a moto server on loopback with AWS clients pointed at it, and a
daemon starter that checks no daemon leaves a process behind. The helpers they use
are in tests/support."""

from __future__ import annotations

import os
from collections.abc import Iterator

import boto3
import pytest
from botocore.config import Config

# The helpers' asserts explain their failures as a test's own do: pytest rewrites a
# module's asserts only if told before it is imported.
pytest.register_assert_rewrite("tests.support")

from tests.support.aws import Aws  # noqa: E402
from tests.support.daemons import DaemonProcess, StartDaemon  # noqa: E402
from worker.demo import LOCAL_AWS_ENV, local_moto_server  # noqa: E402


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


@pytest.fixture
def start_daemon(aws: Aws) -> Iterator[StartDaemon]:
    """Start daemons as subprocesses; after the test none of their processes may remain."""
    started: list[DaemonProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(env or aws.env, args)
        started.append(daemon)
        return daemon

    yield start
    leftovers = [line for daemon in started for line in daemon.close()]
    assert not leftovers, f"processes left behind: {leftovers}"
