"""When the daemon stops, why, and how long the jobs it holds may still run.

Every reason to stop comes here: a signal, an interruption notice, a drained queue, a
broken worker. `Shutdown` keeps the first reason (a broken worker overrides the others),
and times the end: held jobs may finish until the grace period ends or, after a
termination notice, until the notice's time less a margin, whichever comes first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Iterator
from enum import StrEnum

import structlog

from worker.jobs.ledger import Ledger
from worker.ports import Notice, NoticeKind
from worker.telemetry.metrics import Metrics

log = structlog.get_logger()

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How often the main thread looks for a stop signal while it waits. The kernel may give a
# process's signal to any of its threads, and then Python runs the handler only once the
# main thread wakes: blocked for good, it never would.
SIGNAL_CHECK_S = 0.2


class ExitCode(StrEnum):
    """Why the daemon stopped; `code` is the process exit status."""

    DRAINED = "drained"
    SIGNALLED = "signalled"
    INTERRUPTED = "interrupted"  # the platform announced the machine's end
    BROKEN = "broken"

    @property
    def code(self) -> int:
        return 1 if self is ExitCode.BROKEN else 0


class Shutdown:
    """The daemon's reason to stop, and the time held jobs have left."""

    def __init__(self, ledger: Ledger, metrics: Metrics, grace_s: float, margin_s: float):
        self._ledger = ledger
        self._metrics = metrics
        self._grace_s = grace_s
        self._margin_s = margin_s
        self.stopping = threading.Event()  # no more receiving
        self.requested = threading.Event()
        self._reason: ExitCode | None = None
        self.broken_cause: str | None = None
        # The jobs that may have broken it (with items in the work that failed); None:
        # any held job may have.
        self.suspects: frozenset[str] | None = frozenset()
        self._notice: Notice | None = None  # the termination notice acted on
        self._signals = 0  # stop signals caught: the first stops, a second cuts the grace
        self._hand_back_at = float("inf")  # (monotonic) the notice's end less the margin

    def request(self, reason: ExitCode) -> None:
        if self._reason is None or reason is ExitCode.BROKEN:
            self._reason = reason
        self.stopping.set()
        self.requested.set()
        self._ledger.wake()

    def drained(self) -> None:
        self.request(ExitCode.DRAINED)

    def broken(self, cause: str, suspects: frozenset[str] | None = None) -> None:
        """The worker itself is at fault: stop taking jobs and give back what is held,
        unwritten, so the orchestrator replaces this worker (the circuit opens). The
        jobs that may be why are `suspects` (None: any held job)."""
        if self.broken_cause is None:
            self.broken_cause = cause
            log.error("worker_broken", cause=cause, suspects=sorted(suspects or ()) or "all")
        if self.suspects is not None:
            self.suspects = None if suspects is None else self.suspects | suspects
        self.request(ExitCode.BROKEN)

    def interrupted(self, notice: Notice) -> None:
        """The platform says this machine is going away. Take no more work; on a
        termination also stop, handing back what cannot finish before it goes."""
        left_s = None if notice.deadline is None else notice.deadline - time.time()
        if notice.kind is NoticeKind.REBALANCE:  # at risk, not yet going: finish what is held
            self.stopping.set()
            self._ledger.wake()
        else:
            previous = self._notice  # a scale-in seen first still wants its hook completed
            if previous is not None and notice.acknowledge is None:
                notice = dataclasses.replace(notice, acknowledge=previous.acknowledge)
            self._notice = notice
            if left_s is not None:
                self._hand_back_at = time.monotonic() + left_s - self._margin_s
            self.request(ExitCode.INTERRUPTED)
        self._metrics.interruption_notices.labels(notice.kind.value, notice.cause).inc()
        log.warning(
            "interruption_notice",
            kind=notice.kind.value,
            cause=notice.cause,
            seconds_left=None if left_s is None else round(left_s, 1),
            jobs_held=len(self._ledger),
        )

    @contextlib.contextmanager
    def signal_handlers(self) -> Iterator[None]:
        """SIGTERM or SIGINT: stop; a second one: cut the grace short. The handler only
        counts them, for the main thread's waits to act on (a handler takes no lock: it
        runs between two steps of the main thread, which may hold that very lock, as an
        `Event`'s wait does as it wakes), and the previous handlers are back once the
        daemon has stopped."""

        def handle(signum: int, _frame: object) -> None:
            self._signals += 1

        previous = {signum: signal.signal(signum, handle) for signum in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def wait(self) -> ExitCode:
        """Block until there is a reason to stop, and say which (on the main thread, the
        only one whose waits act on a signal)."""
        while not self.requested.is_set():
            self.act_on_signals()
            self.requested.wait(SIGNAL_CHECK_S)
        return self._reason or ExitCode.SIGNALLED

    def act_on_signals(self) -> None:
        """Stop if a stop signal came (on the main thread, where the handler runs)."""
        if self._signals and not self.requested.is_set():
            self.request(ExitCode.SIGNALLED)

    def let_held_jobs_finish(self) -> None:
        """After a signal or a termination notice, wait for held jobs to finish until the
        grace period ends, or until the notice's time less the margin if that comes first;
        a notice may arrive, and bring that time closer, while this waits."""
        if self._reason not in (ExitCode.SIGNALLED, ExitCode.INTERRUPTED):
            return

        def finished() -> bool:
            hurried = self._signals > 1
            return not len(self._ledger) or hurried or self.broken_cause is not None

        def finished_or_moved(hand_back_at: float) -> bool:
            return finished() or self._hand_back_at != hand_back_at

        if finished():
            return
        log.info("draining_in_flight_jobs", jobs=len(self._ledger))
        grace_ends = time.monotonic() + self._grace_s
        while not finished():
            hand_back_at = self._hand_back_at
            left_s = min(grace_ends, hand_back_at) - time.monotonic()
            if left_s <= 0:
                return
            self._ledger.wait_until(
                functools.partial(finished_or_moved, hand_back_at), min(left_s, SIGNAL_CHECK_S)
            )

    def release_reason(self) -> str:
        """What a job handed back at shutdown is told."""
        if self.broken_cause is not None:
            return f"worker broken: {self.broken_cause}"
        if self._notice is not None:
            return f"interrupted: {self._notice.cause}"
        return "shutdown"

    def handed_back(self, count: int) -> None:
        """Count what was handed back; after a notice, say so and let a waiting lifecycle
        hook go on at once, before the rest of the shutdown, which may hang."""
        notice = self._notice
        reason = ExitCode.INTERRUPTED if notice else (self._reason or ExitCode.SIGNALLED)
        if count:
            self._metrics.jobs_handed_back.labels(reason.value).inc(count)
        if notice is None:
            return
        log.warning(
            "interruption_handled", kind=notice.kind.value, cause=notice.cause, handed_back=count
        )
        if notice.acknowledge is None:
            return
        try:
            notice.acknowledge()
        except Exception as error:
            log.error("lifecycle_action_not_completed", error=repr(error))
