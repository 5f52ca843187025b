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
from tests.support.durations import balanced_order, known_durations  # noqa: E402
from worker.demo import LOCAL_AWS_ENV, local_moto_server  # noqa: E402

# What an end-to-end test not yet in tests/durations.json is taken to last (most take
# 7 to 25 s): it starts before the unit tests, not last.
UNMEASURED_E2E_S = 10.0


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected what they do
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, each worker's share of the collection starts with its share
    of the long tests (`tests/support/durations.py`): in the order they are written the
    longest could start last and run on alone, a minute after the rest."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    # The runs below are worksteal's first deal (`make test`); `load`'s round-robin
    # still starts the long tests first. Not read from the `dist` option: pytest-xdist
    # sets it to "no" in its workers, where this runs.
    seconds = known_durations()
    for item in items:
        if item.nodeid not in seconds and item.get_closest_marker("e2e"):
            seconds[item.nodeid] = UNMEASURED_E2E_S
    by_id = {item.nodeid: item for item in items}
    if len(by_id) < len(items):
        return  # a test collected twice (its file named twice): left as it is
    items[:] = [by_id[test] for test in balanced_order(list(by_id), seconds, workers)]


def _list_moto_modules_once() -> None:
    """moto's server routes each request by looking its host up among moto's modules,
    which it lists from its package directory every time (two hundred `stat` calls),
    holding the lock every request takes: the test process spent a tenth of its CPU
    there, and the daemons' calls waited in line for it. The directory stays as it is."""
    import moto.backends

    listed = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: listed


@pytest.fixture(scope="session")
def aws() -> Iterator[Aws]:
    _list_moto_modules_once()
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
