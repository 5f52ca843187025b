"""A seeded random schedule of faults against daemons that an orchestrator keeps
restarting: SIGKILL, SIGTERM, a stall (SIGSTOP past the visibility timeout), a model
that breaks for a while, and S3 throttling and resets throughout.

Whatever the schedule, every job ends exactly once with its true outcome: the results
its inputs deserve, no transient or worker fault in any result, nothing stranded on
either queue, no process left behind.

The default test run plays one seed for 20 s of faults. `make chaos` plays more seeds for
longer (CHAOS_SEEDS=1,2,3,... CHAOS_SECONDS=...).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import DaemonProcess, StartDaemon, daemon_args
from tests.support.faultproxy import Fault, FaultProxy, input_download
from tests.support.faults import BREAK_MODEL_FILE
from tests.support.jobs import job_output, send_jobs, upload
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e

FAULTS = ("kill", "term", "stall", "break")
# Exit statuses an orchestrator sees: SIGKILL, a clean stop, an open circuit, and a
# start refused while the model is broken (its warm-up batch fails).
EXPECTED_EXITS = {-9, 0, 1, 2}
# A SIGTERM that lands while Python is still importing the CLI (before any handler can
# be installed) ends the process by the signal: it held nothing yet.
KILLED_BEFORE_START = -signal.SIGTERM
# Error types that would mean a fault of the worker or its surroundings was blamed on
# an input.
WORKER_FAULTS = {"TransientError", "WorkerFault", "WorkerFailedProbe", "SlowDown", "InternalError"}


def _seeds() -> list[int]:
    return [int(seed) for seed in os.environ.get("CHAOS_SEEDS", "3").split(",")]


@dataclass
class Expected:
    inputs: list[str]
    failing: set[int]  # indices of inputs that are bad in themselves

    @property
    def status(self) -> str:
        if not self.failing:
            return "succeeded"
        return "failed" if len(self.failing) == len(self.inputs) else "partial"


class Orchestrator:
    """Keeps one daemon running, as ECS would: starts another whenever one exits."""

    def __init__(self, start: StartDaemon, args: list[str], env: dict[str, str]):
        self._start, self._args, self._env = start, args, env
        self.exits: list[int] = []
        self.daemons = [self._start(self._args, env=self._env)]

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    def keep_running(self) -> None:
        code = self.daemon.process.poll()
        if code is not None:
            self._exited(code)
            self.daemons.append(self._start(self._args, env=self._env))

    def stop(self) -> None:
        if self.daemon.process.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self._exited(self.daemon.wait(60))

    def _exited(self, code: int) -> None:
        started = bool(self.daemon.events("daemon_starting"))
        self.exits.append(code if started or code != KILLED_BEFORE_START else 0)


def _apply(fault: str, daemon: DaemonProcess, marker: Path, rng: random.Random) -> None:
    if fault == "kill":
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
    elif fault == "term":
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    elif fault == "stall":
        daemon.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(5, 7))  # past the 4 s visibility timeout
        daemon.send_signal(signal.SIGCONT)
    else:
        marker.touch()
        time.sleep(rng.uniform(2, 4))
        marker.unlink()


@pytest.mark.parametrize("seed", _seeds())
def test_random_faults_never_change_a_jobs_outcome(
    seed: int, aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    # Interruptions spend receives; a generous redrive keeps them from dead-lettering.
    stack = aws.stack(visibility_timeout_s=4, max_receive_count=50)
    good = list(upload_samples(aws.s3, stack.bucket, 40, seed=40 + seed))
    corrupt = [upload(aws, stack, f"bad/{n}", b"not an image %d" % n) for n in range(3)]
    jobs = {f"job-{n:02d}": Expected(good[n * 3 : n * 3 + 3], set()) for n in range(12)}
    jobs["partial-a"] = Expected([good[36], corrupt[0], good[37]], {1})
    jobs["partial-b"] = Expected([corrupt[1], good[38], good[39]], {0})
    jobs["failed"] = Expected([corrupt[2]], {0})
    send_jobs(aws, stack, {job_id: expected.inputs for job_id, expected in jobs.items()})

    marker = tmp_path / "cuda-error"
    proxy = FaultProxy(aws.endpoint, seed=seed)
    proxy.add(Fault("slow_down", input_download, probability=0.3, status=503, code="SlowDown"))
    proxy.add(Fault("reset", input_download, probability=0.05, kind="reset"))
    chaos_s = float(os.environ.get("CHAOS_SECONDS", "20"))
    with proxy.serving() as proxy_url:
        env = (
            aws.with_endpoint(proxy_url)
            .with_env(**{BREAK_MODEL_FILE: str(marker), "SLOW_MODEL_SECONDS_PER_BATCH": "0.3"})
            .env
        )
        args = daemon_args(
            stack,
            tmp_path,
            "--model",
            "tests.support.faults:breakable_classifier",
            "--batch-size",
            "2",
            "--visibility-timeout-seconds",
            "4",
            "--heartbeat-interval-seconds",
            "1",
            "--retry-delay-seconds",
            "1",
            "--grace-seconds",
            "2",
        )
        fleet = Orchestrator(start_daemon, args, env)
        applied: list[str] = []
        deadline = time.monotonic() + chaos_s
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.5, 4))
            fleet.keep_running()
            fault = rng.choice(FAULTS)
            applied.append(fault)
            _apply(fault, fleet.daemon, marker, rng)
        fleet.stop()
        last = start_daemon([*args, "--drain"], env=env)
        assert last.wait(240) == 0, last.stderr[-3000:]

    assert set(fleet.exits) <= EXPECTED_EXITS, (fleet.exits, applied)
    assert proxy.injected["slow_down"] > 0
    for job_id, expected in jobs.items():
        output = job_output(stack, job_id)
        assert aws.summary(output)["status"] == expected.status, (job_id, applied)
        results = aws.results(output)
        assert [r["input"] for r in results] == expected.inputs
        errors = {r["index"]: r["error"]["type"] for r in results if "error" in r}
        assert set(errors) == expected.failing, (job_id, errors, applied)
        assert not set(errors.values()) & WORKER_FAULTS, (job_id, errors, applied)
    # A daemon logs job_finished after the delete succeeded: at most once per job (a
    # daemon killed between its delete and its log line leaves none).
    acked = Counter(e["job_id"] for d in [*fleet.daemons, last] for e in d.events("job_finished"))
    assert max(acked.values()) == 1, acked
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []
