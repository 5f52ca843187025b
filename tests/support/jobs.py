"""Jobs for a stack on the moto server: inputs uploaded, jobs sent (straight to the
queue, or as a user does with `python -m worker enqueue` or the Python client, and
followed), and what a finished job left under its output."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from tests.support.aws import Aws
from tests.support.paths import REPO
from worker.demo import Stack


def job_output(stack: Stack, job_id: str) -> str:
    return f"s3://{stack.bucket}/out/{job_id}/"


def send_jobs(aws: Aws, stack: Stack, jobs: dict[str, list[str]]) -> None:
    """Each job (id: its inputs) sent to the stack's queue, its output `job_output`."""
    for job_id, inputs in jobs.items():
        aws.send(
            stack.queue_url,
            {"job_id": job_id, "inputs": inputs, "output": job_output(stack, job_id)},
        )


def upload(aws: Aws, stack: Stack, key: str, data: bytes) -> str:
    """`data` stored under `key` in the stack's bucket; its URI."""
    aws.s3.put_object(Bucket=stack.bucket, Key=key, Body=data)
    return f"s3://{stack.bucket}/{key}"


def assert_complete(aws: Aws, stack: Stack, job_id: str, inputs: list[str]) -> None:
    """One results line per input, in order, a log, and job.json: the job ran once."""
    output = job_output(stack, job_id)
    assert {"job.json", "job.log", "results.jsonl"} <= set(aws.names(output))
    assert [r["input"] for r in aws.results(output)] == inputs
    assert [r["index"] for r in aws.results(output)] == list(range(len(inputs)))
    assert aws.summary(output)["status"] == "succeeded"


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


def following(
    aws: Aws, queue_url: str, job_id: str, output: str, *more: str
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """`worker enqueue --wait`: sends a job and follows it to its summary (`sending`)."""
    return sending(aws, queue_url, enqueue_command(queue_url, job_id, output, "--wait", *more))


@contextlib.contextmanager
def sending(
    aws: Aws, queue_url: str, command: list[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`command`, a process that sends a job to `queue_url` and follows it, entered once
    the job is in the queue (a draining daemon started before would find it empty).
    However the test ends, the process is stopped and its pipes closed."""
    queued = sum(aws.queue_depth(queue_url))
    follower = subprocess.Popen(
        command,
        env=env or aws.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while sum(aws.queue_depth(queue_url)) == queued and follower.poll() is None:
            assert time.monotonic() < deadline, f"{command} sent nothing in 60 s"
            time.sleep(0.1)
        yield follower
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.communicate()
