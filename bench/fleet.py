"""One job across a fleet: daemons as processes of their own against a moto server, with
a stand-in model that sleeps per batch as a GPU would, so the machine's cores are not
what limits them. How much faster four daemons end one job than one, and how long a
one-image job takes while a giant job's shards fill the fleet, against an idle fleet."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import FLEET_DEVICE_BATCH_S, NOOP_MODEL, NOOP_PREPROCESSOR, image_pool
from bench.processes import moto_stack
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.wiring import Daemon
from worker.demo import Stack, upload_samples
from worker.jobs.joblog import configure_daemon_logging
from worker.settings import Settings

# The stand-in device (`fleet_device_model`) takes half a second a batch of BATCH: 32
# images/s a daemon.
BATCH = 16
SHARD_ITEMS = 200
FLEET = 4
POLL_S = 0.1
# The small job's figures are the median of this many, each sent once the last is done.
SMALL_JOBS = 3
# Every fleet daemon's: short polls, no metrics port for several on one machine.
DAEMON_FLAGS = (
    *("--receive-wait-seconds", "1", "--metrics-port", "0"),
    *("--progress-interval-seconds", "2"),
)
FLEET_FLAGS = (
    *("--model", "bench.harness:fleet_device_model", "--batch-size", str(BATCH)),
    *DAEMON_FLAGS,
)


def fleet(work_dir: Path, items: int, one_queue: bool = False) -> dict[str, float]:
    """`fleet_scaling`: one job of `items` inputs in shards of `SHARD_ITEMS`, its wall
    time (sent to job.json) on one daemon over that on `FLEET`. `small_job_wait_s`: a
    one-image job's wall time sent while the giant job runs on the fleet, and
    `small_job_wait_idle_s` on the idle fleet (each the median of `SMALL_JOBS`). The
    shards go to a queue of their own, or, with `one_queue`, to the jobs queue."""
    with moto_stack("fleet") as (env, sqs, s3, stack):
        images = list(upload_samples(s3, stack.bucket, 40, seed=31))
        manifest = "\n".join(images[n % len(images)] for n in range(items)) + "\n"
        s3.put_object(Bucket=stack.bucket, Key="giant.txt", Body=manifest.encode())

        def giant(job_id: str) -> dict[str, Any]:
            return {
                "job_id": job_id,
                "manifest": f"s3://{stack.bucket}/giant.txt",
                "output": f"s3://{stack.bucket}/out/{job_id}/",
                "shard_items": SHARD_ITEMS,
            }

        def small(job_id: str) -> dict[str, Any]:
            return {
                "job_id": job_id,
                "inputs": images[:1],
                "output": f"s3://{stack.bucket}/out/{job_id}/",
            }

        flags = FLEET_FLAGS if one_queue else (*FLEET_FLAGS, *shard_lane(stack))
        with running_daemons(env, stack, work_dir / "one", 1, *flags):
            one_s = sent_until_done(sqs, s3, stack, giant("one"))
        with running_daemons(env, stack, work_dir / "fleet", FLEET, *flags):
            all_s = sent_until_done(sqs, s3, stack, giant("all"))
            idle_s = statistics.median(
                sent_until_done(sqs, s3, stack, small(f"idle-{n}")) for n in range(SMALL_JOBS)
            )
            _send(sqs, stack, giant("busy-giant"))
            time.sleep(SHARD_ITEMS / BATCH * FLEET_DEVICE_BATCH_S / 2)  # every daemon busy
            busy = []
            for n in range(SMALL_JOBS):  # one after another, at any point of a batch
                busy.append(sent_until_done(sqs, s3, stack, small(f"busy-{n}")))
                time.sleep(FLEET_DEVICE_BATCH_S * random.random())
            busy_s = statistics.median(busy)
    return {
        "fleet_scaling": one_s / all_s,
        "fleet_job_seconds_1": one_s,
        "fleet_job_seconds_4": all_s,
        "small_job_wait_s": busy_s,
        "small_job_wait_idle_s": idle_s,
        "small_job_wait_ratio": busy_s / idle_s,
    }


def shard_lane(stack: Stack) -> tuple[str, ...]:
    """The flags that give shards a queue of their own, as the template deploys a fleet."""
    return ("--shard-queue-url", stack.shard_queue_url)


def _send(sqs: Any, stack: Stack, job: dict[str, Any]) -> None:
    sqs.send_message(QueueUrl=stack.queue_url, MessageBody=json.dumps(job))


def sent_until_done(
    sqs: Any,
    s3: Any,
    stack: Stack,
    job: dict[str, Any],
    *,
    fleet: Sequence[FleetDaemon] = (),
    timeout_s: float = math.inf,
) -> float:
    """Send `job`; the seconds until its job.json is written. Raises where it is
    rejected, a daemon of `fleet` exits, or `timeout_s` passes first."""
    started = time.perf_counter()
    _send(sqs, stack, job)
    output = f"out/{job['job_id']}/"
    while not _written(s3, stack, f"{output}job.json"):
        if _written(s3, stack, f"{output}rejected.json"):
            rejected = s3.get_object(Bucket=stack.bucket, Key=f"{output}rejected.json")
            raise RuntimeError(f"the job was rejected: {rejected['Body'].read().decode()}")
        if exited := [d.process.returncode for d in fleet if d.process.poll() is not None]:
            raise RuntimeError(f"a daemon exited {exited[0]} before the job was done")
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"job {job['job_id']} not done in {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return time.perf_counter() - started


def _written(s3: Any, stack: Stack, key: str) -> bool:
    return bool(s3.list_objects_v2(Bucket=stack.bucket, Prefix=key).get("KeyCount"))


@dataclass
class FleetDaemon:
    """A daemon of a running fleet: its process, and the shards it committed (their
    `shard_committed` log events: `shard` and `items`), as they come."""

    process: subprocess.Popen[str]
    started: threading.Event = field(default_factory=threading.Event)
    committed: list[dict[str, Any]] = field(default_factory=list)


@contextlib.contextmanager
def running_daemons(
    env: dict[str, str], stack: Stack, log_dir: Path, count: int, *flags: str
) -> Iterator[list[FleetDaemon]]:
    """`count` daemons on the stack's queue (with `flags`), started and ready; stopped
    after."""
    fleet: list[FleetDaemon] = []
    readers = []
    try:
        for number in range(count):
            daemon = FleetDaemon(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "worker", "run", "--queue-url", stack.queue_url),
                        *("--log-dir", str(log_dir / str(number)), *flags),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            fleet.append(daemon)
            readers.append(threading.Thread(target=_read, args=(daemon,), daemon=True))
            readers[-1].start()
        for daemon in fleet:
            while not daemon.started.wait(1):
                if daemon.process.poll() is not None:
                    raise RuntimeError(f"a daemon exited {daemon.process.returncode} at start")
        yield fleet
    finally:
        for daemon in fleet:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon.process.pid, signal.SIGTERM)
        for daemon in fleet:
            daemon.process.wait(120)
        for reader in readers:  # to the end of its daemon's log, which it closes
            reader.join(30)  # bounded: a stage process left behind may hold the pipe


def _read(daemon: FleetDaemon) -> None:
    """Drain the daemon's log, noting when it has started and the shards it committed."""
    assert daemon.process.stdout is not None
    with daemon.process.stdout as log:
        for line in log:
            if '"daemon_started"' in line:
                daemon.started.set()
            elif '"shard_committed"' in line:
                daemon.committed.append(json.loads(line))
            elif not daemon.started.is_set() and not line.startswith("{"):
                print(line, end="", file=sys.stderr)  # why it did not start


# An idle daemon's calls (polls, `--drain`'s readings of the queue), not a job's.
IDLE_CALLS = frozenset({"sqs.receive", "sqs.counts"})


class _Counted:
    """A port whose calls are counted by method (each is one AWS request, or one per
    ten entries for SQS's batch calls and per chunk of a streamed object)."""

    def __init__(self, port: Any) -> None:
        self._port = port
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._port, name)
        if not callable(method) or name.startswith("_") or name == "remote_reader":
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted


def request_counts(work_dir: Path, items: int, shard_items: int) -> dict[str, Any]:
    """S3 and SQS requests of one job of `items` inputs, run whole and as shards of
    `shard_items`, through the daemon's own code against counting in-memory ports: the
    requests sharding adds, per shard (the model of a fleet's cost in
    docs/performance.md is made from them). Receives and queue readings are left out
    of the SQS figure: an idle daemon's polls are not the job's (a busy fleet's long
    polls take one message each)."""
    calls: dict[str, dict[str, int]] = {}
    for label, size in (("whole", items + 1), ("sharded", shard_items)):
        blobs, source = _Counted(InMemoryBlobStore()), _Counted(InMemoryJobSource())
        pool = image_pool()
        uris = []
        for number in range(items):
            uri = f"s3://bench/in/{number}"
            blobs.objects[uri] = pool[number % len(pool)]
            uris.append(uri)
        blobs.objects["s3://bench/job.txt"] = ("\n".join(uris) + "\n").encode()
        source.send(
            '{"job_id": "counted", "manifest": "s3://bench/job.txt", '
            f'"output": "s3://bench/out/{label}/", "shard_items": {size}}}'
        )
        settings = Settings(
            queue_url="bench",
            drain=True,
            receive_wait_seconds=0,
            log_dir=work_dir / f"counted-{label}",
            metrics_port=0,
            model=NOOP_MODEL,
            preprocess=NOOP_PREPROCESSOR,
            batch_size=BATCH * 4,
        )
        Daemon(settings, source, blobs).run()
        source.calls.pop("send", None)  # the test's own, not the daemon's
        calls[label] = {
            **{f"s3.{name}": count for name, count in blobs.calls.items()},
            **{f"sqs.{name}": count for name, count in source.calls.items()},
        }
    shards = -(-items // shard_items)

    def added_per_shard(service: str) -> float:
        def total(label: str) -> int:
            return sum(
                count
                for name, count in calls[label].items()
                if name.startswith(service) and name not in IDLE_CALLS
            )

        return (total("sharded") - total("whole")) / shards

    return {
        "shard_s3_requests": added_per_shard("s3."),
        "shard_sqs_requests": added_per_shard("sqs."),
        "fleet_requests": calls,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--items", type=int, default=3200, help="the giant job's inputs")
    parser.add_argument(
        "--one-queue",
        action="store_true",
        help="send shards to the jobs queue, as without --shard-queue-url",
    )
    return parser


def main() -> None:
    """`python -m bench.fleet [--items N] [--one-queue]`: the fleet's figures, as JSON
    on stdout."""
    args = build_parser().parse_args()
    configure_daemon_logging(io.StringIO())
    with tempfile.TemporaryDirectory() as scratch:
        figures = {
            **fleet(Path(scratch), args.items, args.one_queue),
            **request_counts(Path(scratch), 2000, 200),
        }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
