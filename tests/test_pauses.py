"""The garbage collector's pauses (`worker.telemetry.pauses`): what the daemon holds once
started is frozen out of the collector's reach, so a full collection while it serves
stops every thread for a few milliseconds, not the tens to hundreds it took when it
walked the modules, clients and models of the whole process."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from structlog.testing import capture_logs

from tests.support.in_process import run_while, serving_settings
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon

# A full collection's pause the daemon may take while it serves; one that walked all it
# holds took 70-200 ms on an H100 host's daemon (and tens of ms in this test's process).
MAX_FULL_COLLECTION_S = 0.025


def test_a_full_collection_while_the_daemon_serves_walks_what_it_did_since_it_started(
    tmp_path: Path,
) -> None:
    """Once the daemon has started, a full collection of its process pauses it for
    under 25 ms (the best of five, the machine's load aside); once it stops, the
    collector is as it was (a program embedding it is left as it found it)."""
    daemon = Daemon(serving_settings(tmp_path), InMemoryJobSource(), InMemoryBlobStore())
    pauses: list[float] = []

    def collect_while_serving() -> None:
        wait_until(lambda: any(entry["event"] == "daemon_started" for entry in logs))
        for _ in range(5):
            started = time.perf_counter()
            gc.collect()
            pauses.append(time.perf_counter() - started)
        daemon.stop()

    with capture_logs() as logs:
        assert run_while(daemon, collect_while_serving) is ExitCode.SIGNALLED
    assert min(pauses) < MAX_FULL_COLLECTION_S, pauses
    assert gc.get_freeze_count() == 0


def test_a_daemon_started_with_its_collector_off_collects_once_it_has_started(
    tmp_path: Path,
) -> None:
    """`worker run` starts with the collector off (what it makes as it starts lives as
    long as it does); the daemon turns it on once started, and on its way out leaves it
    as it found it."""
    daemon = Daemon(serving_settings(tmp_path), InMemoryJobSource(), InMemoryBlobStore())
    collecting: list[bool] = []

    def look_then_stop() -> None:
        wait_until(lambda: any(entry["event"] == "daemon_started" for entry in logs))
        collecting.append(gc.isenabled())
        daemon.stop()

    gc.disable()
    try:
        with capture_logs() as logs:
            assert run_while(daemon, look_then_stop) is ExitCode.SIGNALLED
        assert collecting == [True]
        assert not gc.isenabled()
    finally:
        gc.enable()
