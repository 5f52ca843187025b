"""Admission off the receive path, end to end: a daemon subprocess against the moto
server, through a proxy that makes one prefix slow to list (S3 under load), plans a
job of that prefix while a one-image job received with it runs and finishes."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args
from tests.support.faultproxy import Fault, FaultProxy, Request
from tests.support.jobs import job_output
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e

LISTED = 1001  # two pages of a listing


def _events(stdout: str) -> list[dict[str, Any]]:
    """The daemon's JSON log events, in order."""
    events = []
    for line in stdout.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def _lists_slow_prefix(request: Request) -> bool:
    return (
        request.method == "GET"
        and "list-type=2" in request.query
        and "prefix=slow" in request.query
    )


def test_a_job_slow_to_plan_holds_up_no_job_received_with_it(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A job of a prefix each page of whose listing takes 3 s (planned into two shards,
    its two pages listed once: 6 s at least) and a one-image job, received together: the
    one-image job is finished before the other is planned, where it waited for it."""
    stack = aws.stack()
    [image] = upload_samples(aws.s3, stack.bucket, 1, seed=41)
    with ThreadPoolExecutor(16) as putting:
        for number in range(LISTED):
            key = f"slow/{number:05d}.png"
            putting.submit(aws.s3.put_object, Bucket=stack.bucket, Key=key, Body=b"x")
    slow = {"inputs_prefix": f"s3://{stack.bucket}/slow/", "shard_items": 1000}
    aws.send(stack.queue_url, {"job_id": "slow", "output": job_output(stack, "slow"), **slow})
    aws.send(
        stack.queue_url,
        {"job_id": "small", "output": job_output(stack, "small"), "inputs": [image]},
    )
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("slow_listing", _lists_slow_prefix, kind="slow", delay_s=3.0))
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            # Handed back at once when stopped: its shards are not what the test is about.
            daemon_args(stack, tmp_path, "--grace-seconds", "0"),
            env=aws.with_endpoint(proxy_url).env,
        )
        daemon.wait_for("job_planned", timeout_s=120)
        daemon.send_signal(15)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    order = [
        (event["event"], event["job_id"])
        for event in _events(daemon.stdout)
        if event.get("event") in ("job_finished", "job_planned")
    ]
    assert order.index(("job_finished", "small")) < order.index(("job_planned", "slow")), order
    assert proxy.injected["slow_listing"] >= 2
    assert aws.summary(job_output(stack, "small"))["status"] == "succeeded"
