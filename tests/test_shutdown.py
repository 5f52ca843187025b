"""Shutdown: which reason to stop wins, and how long held jobs are given."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.daemons import DaemonProcess
from tests.support.in_process import breaking_settings, sample_images, send_job
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource, RecordingGuard
from worker.daemon.host import BREAKAGES_FILE, Breakages
from worker.daemon.shutdown import ExitCode, Shutdown
from worker.daemon.wiring import Daemon
from worker.jobs.ledger import Ledger
from worker.ports import Notice, NoticeKind, ReceivedMessage
from worker.telemetry.metrics import Metrics


def _holding_one_job() -> Shutdown:
    ledger = Ledger()
    assert ledger.receive(ReceivedMessage("m1", "{}", "m1#handle", 1)) is not None
    return Shutdown(ledger, Metrics(), grace_s=30.0, margin_s=1.0)


def _timed(run: Callable[[], None]) -> float:
    started = time.monotonic()
    run()
    return time.monotonic() - started


def test_the_first_reason_is_kept_unless_the_worker_breaks() -> None:
    ledger = Ledger()
    shutdown = Shutdown(ledger, Metrics(), grace_s=30.0, margin_s=1.0)
    shutdown.request(ExitCode.DRAINED)
    shutdown.request(ExitCode.SIGNALLED)
    assert shutdown.wait() is ExitCode.DRAINED
    shutdown.broken("a dead GPU")
    shutdown.broken("a second cause")
    assert shutdown.wait() is ExitCode.BROKEN
    assert shutdown.release_reason() == "worker broken: a dead GPU"


def test_a_termination_notice_brings_the_hand_back_time_before_the_grace_ends() -> None:
    shutdown = _holding_one_job()
    shutdown.interrupted(Notice(NoticeKind.TERMINATION, "spot-interruption", time.time() + 2.0))
    assert shutdown.wait() is ExitCode.INTERRUPTED
    waited_s = _timed(shutdown.let_held_jobs_finish)
    assert 0.7 < waited_s < 2.0, waited_s  # the notice's 2 s less the 1 s margin
    assert shutdown.release_reason() == "interrupted: spot-interruption"


def test_a_notice_arriving_during_the_grace_period_cuts_it_short() -> None:
    shutdown = _holding_one_job()
    shutdown.request(ExitCode.SIGNALLED)
    later = threading.Timer(
        0.3,
        shutdown.interrupted,
        [Notice(NoticeKind.TERMINATION, "spot-interruption", time.time() + 1.8)],
    )
    later.start()
    try:
        waited_s = _timed(shutdown.let_held_jobs_finish)
    finally:
        later.cancel()
    assert 0.5 < waited_s < 2.0, waited_s


def _sigterm_to_another_thread(after_s: float) -> None:
    """A SIGTERM, in `after_s`, given to a thread other than the main one, as the kernel
    may give a process's signal to any of its threads: no wait of the main thread is cut
    short for it."""
    threading.Timer(
        after_s, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    ).start()


def test_stop_signals_given_to_another_thread_are_acted_on_while_the_main_thread_waits() -> None:
    """A daemon went on for good after its SIGTERM, logging no shutdown at all: the
    kernel gave the signal to another thread, so Python ran the handler only once the
    main thread woke, and it waited for a reason to stop with no end. The first signal
    stops it, the second cuts the grace short, however long the main thread's waits."""
    shutdown = _holding_one_job()  # 30 s of grace
    woken_anyway = threading.Timer(10.0, shutdown.drained)  # what woke it before
    woken_anyway.start()
    try:
        with shutdown.signal_handlers():
            _sigterm_to_another_thread(0.5)
            assert shutdown.wait() is ExitCode.SIGNALLED
            _sigterm_to_another_thread(0.5)
            assert _timed(shutdown.let_held_jobs_finish) < 5.0
    finally:
        woken_anyway.cancel()


def test_a_rebalance_stops_intake_but_is_no_reason_to_exit() -> None:
    shutdown = _holding_one_job()
    shutdown.interrupted(Notice(NoticeKind.REBALANCE, "rebalance-recommendation"))
    assert shutdown.stopping.is_set()
    assert not shutdown.requested.is_set()


def test_a_drained_or_broken_daemon_gives_held_jobs_no_time() -> None:
    for stop in ("drained", "broken"):
        shutdown = _holding_one_job()
        shutdown.drained() if stop == "drained" else shutdown.broken("a dead GPU")
        assert _timed(shutdown.let_held_jobs_finish) < 0.1


def test_the_scale_in_hook_is_completed_even_when_a_spot_notice_follows() -> None:
    completed: list[str] = []
    shutdown = _holding_one_job()
    shutdown.interrupted(
        Notice(NoticeKind.TERMINATION, "scale-in", acknowledge=lambda: completed.append("hook"))
    )
    shutdown.interrupted(Notice(NoticeKind.TERMINATION, "spot-interruption", time.time() + 60))
    shutdown.handed_back(1)
    assert completed == ["hook"]


def test_a_failing_hook_completion_does_not_stop_the_shutdown() -> None:
    def refuse() -> None:
        raise RuntimeError("AccessDenied")

    shutdown = _holding_one_job()
    shutdown.interrupted(Notice(NoticeKind.TERMINATION, "scale-in", acknowledge=refuse))
    with capture_logs() as logs:
        shutdown.handed_back(0)
    assert [entry["event"] for entry in logs] == [
        "interruption_handled",
        "lifecycle_action_not_completed",
    ]


def test_a_hosts_breakages_count_within_the_hour_and_a_limit_of_0_never_trips(
    tmp_path: Path,
) -> None:
    """Breakages noted on the host (a file that outlives the process) count towards
    taking it out of service only within the window, a line cut short is skipped, and
    a limit of 0 never trips."""
    now = [1000.0]
    breakages = Breakages(tmp_path, limit=2, window_s=60, clock=lambda: now[0])
    breakages.note("a dead GPU")
    now[0] += 61
    breakages.note("a dead GPU again")
    assert Breakages(tmp_path, 2, 60, lambda: now[0]).recent() == ["a dead GPU again"]
    assert not breakages.too_many()
    with (tmp_path / BREAKAGES_FILE).open("a") as notes:
        notes.write('{"at": 10')  # cut short as the daemon was killed
    breakages.note("and again")
    assert breakages.too_many()
    assert not Breakages(tmp_path, limit=0, window_s=60, clock=lambda: now[0]).too_many()


class _SignalledAsTakenOut(RecordingGuard):
    """A platform that takes seconds to answer, during which a second SIGTERM comes."""

    def take_out_of_service(self) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the main thread's handler runs meanwhile
        return super().take_out_of_service()


def test_a_stop_signal_while_a_broken_daemon_takes_its_host_out_is_counted_not_passed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that stops broken on a host over its breakages limit, and one restarted
    there, call their platform under their own signal handlers: a SIGTERM meanwhile
    reaches them, not the handler from before they ran (the command line's exits 0),
    and each stops broken."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    send_job(source, "held", sample_images(blobs, 1))
    settings = breaking_settings(tmp_path, monkeypatch, host_breakages_limit=1)
    passed_on: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: passed_on.append(signum))
    try:
        for _ in ("broken", "restarted"):
            guard = _SignalledAsTakenOut()
            assert Daemon(settings, source, blobs, guard=guard).run() is ExitCode.BROKEN
            assert guard.out_of_service
    finally:
        signal.signal(signal.SIGTERM, before)
    assert passed_on == []


def test_a_daemon_stopped_while_its_modules_import_exits_0() -> None:
    """SIGTERM a moment after `python -m worker run` starts (its imports take a second
    or more, torch's among them, on a loaded machine several): it holds nothing yet, and
    exits 0, not killed by the signal (as an orchestrator stopping a task that is still
    starting would see it); and so it does if its imports were done by then."""
    with contextlib.closing(DaemonProcess(STARTING_ENV, STARTING_ARGS)) as daemon:
        time.sleep(1)  # running `worker/__main__.py`, its imports likely under way
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(180) == 0, daemon.stderr[-2000:]


def test_a_daemon_stopped_as_its_command_line_imports_leaves_no_fork_server_directory() -> None:
    """Stopped once its fork server has started (first of all, for torch's seconds) and
    while the command line's modules import, the daemon exits 0 at once, and leaves
    nothing in its temporary directory: the server's socket directory, which the exit
    handlers it skips would have removed, each stop left there."""
    with contextlib.closing(DaemonProcess(STARTING_ENV, STARTING_ARGS)) as daemon:
        temporary = daemon.temporary_directory
        deadline = time.monotonic() + 60
        while not (sockets := list(temporary.glob("pymp-*/*"))):
            assert time.monotonic() < deadline, "no fork server's socket within 60 s"
            time.sleep(0.005)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(180) == 0, daemon.stderr[-2000:]
        assert sockets and not list(temporary.iterdir())


# A daemon on a queue nobody answers at: it holds nothing while it starts.
STARTING_ENV = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1"}
STARTING_ARGS = ["--queue-url", "http://127.0.0.1:9/q"]


def test_a_daemon_with_no_aws_region_says_so_in_one_line_and_exits_2() -> None:
    """Started where boto3 finds no region (EC2 sets none in the environment), the
    daemon exits 2 with one line naming the setting, not a traceback and 1."""
    unset = ("AWS_REGION", "AWS_DEFAULT_REGION")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    env["AWS_CONFIG_FILE"] = os.devnull  # (nor one from a developer's ~/.aws/config)
    done = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--queue-url", "http://127.0.0.1:9/q"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("cannot start: no AWS region")
