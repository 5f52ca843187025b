"""The supervisor: a loop that raises or a daemon that stalls while holding work is
reported broken, once; loops that end on `Closed` are not."""

from __future__ import annotations

import threading
import time

from tests.support.timing import ManualClock
from worker.daemon.supervisor import Supervisor
from worker.engine.channel import Closed
from worker.telemetry.progress import Progress


def _supervisor(
    busy: bool, progress: Progress, suspects: list[frozenset[str] | None] | None = None
) -> tuple[Supervisor, list[str], threading.Event]:
    """A supervisor whose daemon has one job at work (`busy`) or none; each cause it
    reports goes to the list it returns, and its suspects to `suspects`."""
    causes: list[str] = []
    stopped = threading.Event()

    def broken(cause: str, of: frozenset[str] | None) -> None:
        causes.append(cause)
        if suspects is not None:
            suspects.append(of)

    at_work = frozenset({"job-at-work"}) if busy else frozenset()
    return Supervisor(broken, progress, lambda: at_work, stopped), causes, stopped


def _wait_for(causes: list[str], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not causes and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_loop_that_raises_breaks_the_daemon_and_one_that_closes_does_not() -> None:
    """An unexpected exception in any loop is reported with the loop's name; `Closed`
    (its channel closed at shutdown) and a plain return are normal ends."""
    supervisor, causes, _ = _supervisor(busy=False, progress=Progress(60))

    def closes() -> None:
        raise Closed

    def fails() -> None:
        raise KeyError("job-7")

    supervisor.spawn("feeder", closes)
    supervisor.spawn("finisher-0", lambda: None)
    supervisor.spawn("regrouper", fails)
    _wait_for(causes)
    for name in ("feeder", "finisher-0", "regrouper"):
        supervisor.join(name, 5)
    assert causes == ["thread regrouper failed: KeyError('job-7')"]


def test_a_stall_while_holding_work_breaks_the_daemon() -> None:
    """Jobs at work and none of them moving for longer than the stall limit is a stall;
    a daemon with none at work (idle, or only admitting jobs) is not stalled however
    long it waits, and progress resets the clock."""
    clock = ManualClock()
    progress = Progress(stall_after_s=60, clock=clock)
    idle, _, _ = _supervisor(busy=False, progress=progress)
    busy, _, _ = _supervisor(busy=True, progress=progress)
    clock.now += 61
    assert idle.stall() is None
    assert busy.stall() == "no progress for 61 s while holding jobs"
    progress.beat()
    assert busy.stall() is None


def test_the_watchdog_reports_a_stall_once_and_stops_with_the_daemon() -> None:
    """The watchdog thread checks every interval and reports a stall through the same
    path as a failed loop, the jobs at work its suspects (a job being admitted is none
    of them); it ends when the daemon stops."""
    suspects: list[frozenset[str] | None] = []
    supervisor, causes, stopped = _supervisor(True, Progress(stall_after_s=0.1), suspects)
    supervisor.start_watching(0.02)
    _wait_for(causes)
    assert len(causes) == 1 and causes[0].startswith("no progress for")
    assert suspects == [frozenset({"job-at-work"})]
    calm, quiet, calm_stopped = _supervisor(busy=False, progress=Progress(stall_after_s=0.1))
    calm.start_watching(0.02)
    time.sleep(0.3)
    calm_stopped.set()
    calm.join("watchdog", 5)
    stopped.set()
    assert quiet == []
