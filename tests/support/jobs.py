"""Sending jobs as a user does, with `python -m worker enqueue`, and following them."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from tests.support.aws import Aws
from tests.support.paths import REPO


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
