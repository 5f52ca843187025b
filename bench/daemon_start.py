"""What one daemon's life costs each of its processes: `python -m worker run --drain`
over one job of 8 images against a moto server started here, every process of the
daemon's tree read from /proc while it runs (its CPU seconds, user and system, when
last seen). The test suite starts about a hundred daemons on a 2-core machine, so their
starts and stops are most of its CPU. With `--until-started`, its start alone: no job,
the daemon stopped once it logs `daemon_started`, its processes read as they were then.

    python -m bench.daemon_start [--runs 3] [--until-started]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3

from worker.demo import LOCAL_AWS_ENV, create_stack, local_moto_server, upload_samples

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
POLL_S = 0.05


def _tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """Each live process under `root` (itself included): its role and CPU seconds."""
    parents: dict[int, int] = {}
    seen: dict[int, tuple[str, float]] = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
            cmdline = (stat_path.parent / "cmdline").read_bytes()
        except OSError:
            continue
        pid = int(stat_path.parent.name)
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[pid] = int(fields[1])
        seen[pid] = (
            _role(pid, parents[pid], root, cmdline),
            (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
        )

    def under_root(pid: int) -> bool:
        while pid not in (root, 0, 1):
            pid = parents.get(pid, 0)
        return pid == root

    return {pid: value for pid, value in seen.items() if under_root(pid)}


def _role(pid: int, parent: int, root: int, cmdline: bytes) -> str:
    """The daemon's own process, its fork server, its resource tracker, or a stage's
    process (forked by the fork server: its command line is the server's)."""
    if pid == root:
        return "main"
    if b"resource_tracker" in cmdline:
        return "resource_tracker"
    return "forkserver" if parent == root else "stage"


def one_daemon(endpoint: str, log_dir: Path, until_started: bool) -> dict[str, float]:
    """CPU seconds by role (main, forkserver, stage processes summed) over one drain, or
    up to `daemon_started`."""
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    sqs = session.client("sqs", endpoint_url=endpoint)
    s3 = session.client("s3", endpoint_url=endpoint)
    stack = create_stack(sqs, s3, f"start-{time.monotonic_ns()}")
    if not until_started:
        uris = list(upload_samples(s3, stack.bucket, 8))
        job = {"job_id": "start", "inputs": uris, "output": f"s3://{stack.bucket}/out/start/"}
        sqs.send_message(QueueUrl=stack.queue_url, MessageBody=json.dumps(job))
    env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint, "WORKER_METRICS_PORT": "0"}
    flags = ["--queue-url", stack.queue_url, "--receive-wait-seconds", "1"]
    started = time.monotonic()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "worker", "run", *flags, "--log-dir", str(log_dir)]
        + ([] if until_started else ["--drain"]),
        env=env,
        stdout=subprocess.PIPE if until_started else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready = threading.Event()
    if until_started:
        threading.Thread(target=_set_when_started, args=(daemon, ready), daemon=True).start()
    last: dict[int, tuple[str, float]] = {}
    while daemon.poll() is None and not ready.is_set():
        last |= _tree_cpu(daemon.pid)
        time.sleep(POLL_S)
    by_role: dict[str, float] = {"wall_s": time.monotonic() - started}  # to its exit, or ready
    if ready.is_set():
        last |= _tree_cpu(daemon.pid)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()
    if daemon.returncode != 0:
        raise SystemExit(f"the daemon exited {daemon.returncode}")
    for role, seconds in last.values():
        by_role[role] = by_role.get(role, 0.0) + seconds
    return by_role


def _set_when_started(daemon: subprocess.Popen[str], ready: threading.Event) -> None:
    assert daemon.stdout is not None
    for line in daemon.stdout:
        if '"daemon_started"' in line:
            ready.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="daemons, one after another")
    parser.add_argument(
        "--until-started", action="store_true", help="no job; each stopped once started"
    )
    args = parser.parse_args()
    with local_moto_server() as endpoint, tempfile.TemporaryDirectory() as logs:
        figures = [
            one_daemon(endpoint, Path(logs) / str(run), args.until_started)
            for run in range(args.runs)
        ]
    roles = sorted({role for figure in figures for role in figure})
    medians = {
        role: round(statistics.median(f.get(role, 0.0) for f in figures), 2) for role in roles
    }
    print(json.dumps({"runs": figures, "median": medians}, indent=1))


if __name__ == "__main__":
    main()
