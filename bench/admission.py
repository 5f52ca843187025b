"""Admission off the receive path (issue 39, point 4): how long a one-image job takes
when it comes in the same receive as a job naming a prefix of 300,000 objects, over
the same job on an idle daemon.

The daemon runs in this process over the in-memory fakes, with S3's latency on every
call (`LatentBlobStore`) and a listing that takes `LIST_PAGE_S` a page of 1,000 keys,
as S3's does: the prefix takes about 20 s to list once, and its job is planned into
shards (listed twice). Each time runs from the daemon's first receive to the one-image
job's job.json.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench.harness import BATCH_SIZE, DEVICE_MODEL, LatentBlobStore, image_pool
from worker.adapters.fakes import FAKE_LIST_PAGE, InMemoryJobSource
from worker.daemon.wiring import Daemon
from worker.ports import ReceivedMessage, S3Location
from worker.settings import Settings

PREFIX_OBJECTS = 300_000
LIST_PAGE_S = 0.06  # a page of 1,000 keys: S3's ListObjectsV2 takes 30-100 ms
SMALL_JOB = "s3://bench/out/small/job.json"
POLL_S = 0.01


class _ListedSlowly(LatentBlobStore):
    """S3's latency, and its listing's: a page every `LIST_PAGE_S`."""

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        for number, key in enumerate(super().keys_under(prefix)):
            if number % FAKE_LIST_PAGE == 0:
                time.sleep(LIST_PAGE_S)
            yield key


class _FirstReceive(InMemoryJobSource):
    """Notes when the daemon first receives a message."""

    def __init__(self) -> None:
        super().__init__(clock=time.monotonic)
        self.first_receive = threading.Event()
        self.first_receive_at = 0.0  # `time.perf_counter()`

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        messages = super().receive(max_messages, wait_s, visibility_timeout_s)
        if messages and not self.first_receive.is_set():
            self.first_receive_at = time.perf_counter()
            self.first_receive.set()
        return messages


def small_job_s(work_dir: Path, *, beside_a_prefix: bool) -> float:
    """Seconds from the daemon's first receive to the one-image job's job.json, sent
    (with `beside_a_prefix`) after a job naming a prefix of `PREFIX_OBJECTS`, so that
    both come in one receive."""
    source, blobs = _FirstReceive(), _ListedSlowly()
    blobs.objects["s3://bench/in/small.img"] = image_pool()[0]
    if beside_a_prefix:
        for number in range(PREFIX_OBJECTS):
            blobs.objects[f"s3://bench/prefix/{number:06d}.img"] = b""
        source.send(
            '{"job_id": "prefix", "inputs_prefix": "s3://bench/prefix/",'
            ' "output": "s3://bench/out/prefix/"}'
        )
    source.send(
        '{"job_id": "small", "inputs": ["s3://bench/in/small.img"],'
        ' "output": "s3://bench/out/small/"}'
    )
    settings = Settings(
        queue_url="bench",
        receive_wait_seconds=0,
        model=DEVICE_MODEL,
        batch_size=BATCH_SIZE,
        log_dir=work_dir / "logs",
        metrics_port=0,
        grace_seconds=0,  # stopped once the one-image job is done: the plan is not the point
    )
    daemon = Daemon(settings, source, blobs)
    took_s: list[float] = []

    def watch() -> None:
        source.first_receive.wait()
        while SMALL_JOB not in blobs.objects:
            time.sleep(POLL_S)
        took_s.append(time.perf_counter() - source.first_receive_at)
        daemon.stop()

    threading.Thread(target=watch, daemon=True).start()
    daemon.run()
    return took_s[0]


def admission(work_dir: Path, runs: int) -> dict[str, float]:
    """`small_job_idle_s` and `small_job_beside_a_prefix_s` (the medians of `runs`), and
    their ratio, `small_job_beside_a_prefix_ratio` (target: at most 2)."""
    idle = statistics.median(small_job_s(work_dir, beside_a_prefix=False) for _ in range(runs))
    beside = statistics.median(small_job_s(work_dir, beside_a_prefix=True) for _ in range(runs))
    return {
        "small_job_idle_s": round(idle, 3),
        "small_job_beside_a_prefix_s": round(beside, 3),
        "small_job_beside_a_prefix_ratio": round(beside / idle, 3),
    }
