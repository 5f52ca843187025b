"""Supervision: every long-lived loop of the daemon runs under one supervisor.

A loop that raises, or a daemon that holds work and has moved none of it for longer than
its stall limit, stops the daemon as broken: half a daemon (a dead feeder, a hung
finisher) would keep renewing leases on jobs it will never finish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from worker.engine.channel import Closed
from worker.telemetry.progress import Progress

log = structlog.get_logger()


class Supervisor:
    """Runs named loops on daemon threads and watches for a stall while work is held;
    either failure is reported once, through `on_broken(cause)`."""

    def __init__(
        self,
        on_broken: Callable[[str, frozenset[str] | None], None],
        progress: Progress,
        at_work: Callable[[], frozenset[str]],
        stopped: threading.Event,
    ):
        """`on_broken(cause, suspects)`: the jobs that may be why (None: any held);
        `at_work()`: the keys of the jobs work is being done on, which a stall is about."""
        self._on_broken = on_broken
        self._progress = progress
        self._at_work = at_work
        self._stopped = stopped
        self._threads: dict[str, threading.Thread] = {}

    def spawn(self, name: str, run: Callable[[], object]) -> None:
        """Run `run()` on its own thread. It may end by returning or on `Closed` (its
        channel or the ledger closed at shutdown); any other exception breaks the daemon."""
        thread = threading.Thread(target=self._guard, args=(name, run), name=name, daemon=True)
        self._threads[name] = thread
        thread.start()

    def start_watching(self, check_every_s: float) -> None:
        self.spawn("watchdog", lambda: self._watch(check_every_s))

    def join(self, name: str, timeout_s: float) -> None:
        thread = self._threads.get(name)
        if thread is not None:
            thread.join(timeout_s)

    def stall(self) -> str | None:
        """Why the daemon counts as stalled now, or None."""
        if self._at_work() and self._progress.stalled():
            return f"no progress for {self._progress.idle_s():.0f} s while holding jobs"
        return None

    def _guard(self, name: str, run: Callable[[], object]) -> None:
        try:
            run()
        except Closed:
            return
        except Exception as error:
            log.exception("thread_failed", thread=name)
            self._on_broken(f"thread {name} failed: {error!r}", None)

    def _watch(self, check_every_s: float) -> None:
        while not self._stopped.wait(check_every_s):
            suspects = self._at_work()
            cause = self.stall()
            if cause is not None:
                log.error("daemon_stalled", cause=cause)
                self._on_broken(cause, suspects)
                return
