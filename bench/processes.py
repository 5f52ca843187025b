"""The figures of daemons run as processes of their own against a moto server, and of
what such a process costs: the host's CPU per item, fetch clients compared, memory
under a backlog.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from bench.fetch_clients import CLIENTS, FETCH_CONCURRENCY
from bench.harness import (
    HOST_JOB_SIZE,
    run_daemon,
)
from worker.adapters.fakes import InMemoryBlobStore
from worker.demo import LOCAL_AWS_ENV, Stack, create_stack, local_moto_server, upload_samples


def host_cpu(work_dir: Path, jobs: int) -> dict[str, float]:
    """The daemon's main-process CPU per item with real boto3 calls against a moto
    server, inputs fetched in the preprocessing processes (the default) and, the
    baseline, on threads of the main process."""
    fetched_in_preprocess = _host_cpu_ms_per_item(work_dir, jobs, "preprocess")
    fetched_on_threads = _host_cpu_ms_per_item(work_dir, jobs, "threads")
    return {
        "host_cpu_ms_per_item": fetched_in_preprocess,
        "host_cpu_ms_per_item_fetch_threads": fetched_on_threads,
        "host_cpu_fetch_threads_ratio": fetched_on_threads / fetched_in_preprocess,
    }


def _host_cpu_ms_per_item(work_dir: Path, jobs: int, fetch_in: str) -> float:
    """The default model and preprocessor: the daemon a subprocess, its own CPU (not its
    stage processes', not moto's) from its `daemon_started` to its exit."""
    with moto_stack(f"host-cpu-{fetch_in}") as (env, sqs, s3, stack):
        uris = list(upload_samples(s3, stack.bucket, HOST_JOB_SIZE, seed=31))
        for job in range(jobs):
            output = f"s3://{stack.bucket}/out/{job}/"
            sqs.send_message(
                QueueUrl=stack.queue_url,
                MessageBody=json.dumps({"inputs": uris, "output": output}),
            )
        daemon = subprocess.Popen(
            draining_daemon(stack, work_dir / "host-cpu-logs", "--fetch-in", fetch_in),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert daemon.stdout is not None
        started_cpu_s = None
        for line in daemon.stdout:
            if '"daemon_started"' in line:
                started_cpu_s = process_cpu_s(daemon.pid)
                break
        daemon.stdout.read()
        finished_cpu_s = exited_process_cpu_s(daemon)
        if daemon.returncode != 0 or started_cpu_s is None:
            raise RuntimeError(f"the daemon exited {daemon.returncode}")
    return 1000 * (finished_cpu_s - started_cpu_s) / (jobs * len(uris))


@contextlib.contextmanager
def moto_stack(name: str) -> Iterator[tuple[dict[str, str], Any, Any, Stack]]:
    """A moto server on this machine holding a queue and bucket named `name`: yields the
    environment a daemon subprocess reaches it with, SQS and S3 clients, and the stack."""
    with local_moto_server() as endpoint:
        env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint}
        session = boto3.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        sqs = session.client("sqs", endpoint_url=endpoint)
        s3 = session.client(
            "s3", endpoint_url=endpoint, config=Config(max_pool_connections=MOTO_UPLOADS)
        )
        # moto's state outlives its server in this process: a stack of this run's own.
        yield env, sqs, s3, create_stack(sqs, s3, name)


MOTO_UPLOADS = 32  # parallel puts that fill a moto stack's bucket


def draining_daemon(stack: Stack, log_dir: Path, *more: str) -> list[str]:
    """The command that runs the daemon on the stack's queue until it is empty."""
    return [
        *(sys.executable, "-m", "worker", "run", "--queue-url", stack.queue_url),
        *("--drain", "--receive-wait-seconds", "1", "--metrics-port", "0"),
        *("--log-dir", str(log_dir), *more),
    ]


FETCHED_OBJECT_BYTES = 12_000  # about one of the sample JPEGs


def fetch_clients(objects: int, threads: int = FETCH_CONCURRENCY) -> dict[str, float]:
    """Each S3 client candidate in a process of its own reading the same `objects`
    small objects from a moto server, as a preprocessing process reads a request's
    inputs on `threads` threads: its CPU per GET and GETs per second
    (`bench.fetch_clients`), and boto3's CPU per GET over obstore's (alone, and as the
    daemon's reader)."""
    figures: dict[str, float] = {}
    with local_moto_server() as endpoint:
        s3 = boto3.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("s3", endpoint_url=endpoint)
        bucket = "fetch-clients"
        s3.create_bucket(Bucket=bucket)
        body = random.Random(5).randbytes(FETCHED_OBJECT_BYTES)
        for number in range(objects):
            s3.put_object(Bucket=bucket, Key=f"objects/{number}", Body=body)
        env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint}
        for client in CLIENTS:
            run = subprocess.run(
                [
                    *(sys.executable, "-m", "bench.fetch_clients", client),
                    *(endpoint, bucket, "objects/", str(objects), str(FETCHED_OBJECT_BYTES)),
                    str(threads),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                raise RuntimeError(f"{client} failed ({run.returncode}):\n{run.stderr[-3000:]}")
            measured = json.loads(run.stdout.splitlines()[-1])
            figures[f"fetch_cpu_ms_per_get_{client}"] = measured["cpu_ms_per_get"]
            figures[f"fetch_gets_per_s_{client}"] = measured["gets_per_s"]
    for client in ("obstore", "obstore_reader"):
        figures[f"fetch_cpu_boto3_{client}_ratio"] = (
            figures["fetch_cpu_ms_per_get_boto3"] / figures[f"fetch_cpu_ms_per_get_{client}"]
        )
    return figures


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process `pid` itself: all its threads, none of
    its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exited_process_cpu_s(process: subprocess.Popen[str]) -> float:
    """`process_cpu_s` of a child at its exit: waited for without reaping it, so its
    /proc entry still holds its final counts; then reaped."""
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    cpu_s = process_cpu_s(process.pid)
    process.wait()
    return cpu_s


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total_kb, pending = 0, [pid]
    while pending:
        current = pending.pop()
        pending += children.get(current, [])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


@contextlib.contextmanager
def peak_rss(pid: int, every_s: float = 0.25) -> Iterator[list[float]]:
    """The most resident memory (MB) of `pid`'s process tree, sampled while inside."""
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], tree_rss_mb(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def backlog(work_dir: Path, seconds: float) -> dict[str, float]:
    """10,000 queued jobs, each lasting several visibility timeouts: memory stays that of
    the jobs in flight (compared with a backlog of 100), no message is redelivered."""
    results = {}
    for queued in (100, 10_000):
        with peak_rss(os.getpid()) as peak:
            daemon = run_daemon(
                [4] * queued,
                InMemoryBlobStore(),
                work_dir,
                stop_after_s=seconds,
                model="bench.harness:slow_device_model",
                batch_size=8,
                prefetch_batches=2,
                visibility_timeout_seconds=2,
                heartbeat_interval_seconds=0.5,
                grace_seconds=0,
            )
        results[queued] = (peak[0], daemon.source)
    peak_mb, source = results[10_000]
    return {
        "peak_rss_mb": peak_mb,
        "peak_rss_mb_backlog_100": results[100][0],
        "redeliveries": float(source.redeliveries),
        "heartbeat_calls_per_job_minute": source.extend_calls / (source.held_s / 60),
    }
