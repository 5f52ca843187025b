"""The daemon: wires the job lifecycle's units together, runs them, and stops them.

    intake         receive (when there is room) -> lease in the ledger -> admit or settle
    feeder         held jobs' items, in turn -> pipeline
    pipeline       fetch (threads) -> preprocess (processes) -> inference (one process)
    regrouper      each result -> its job in the ledger -> complete? -> finisher
    finisher       results.jsonl, job.log, job.json (last) -> ack
    lease keeper   renews every held message's lease while work progresses
    progress       each in-flight job's progress.json and local log file
    protection     scale-in protection on while jobs are held
    interruptions  spot, scale-in and rebalance notices from instance metadata
    watchdog       a daemon that holds work and moves none of it is broken

Every loop runs under one `Supervisor`; the main thread starts them, waits for a reason
to stop (a signal, an interruption notice, a drained queue, a broken worker) and shuts
down within a hard deadline. What happens to a job when something fails is the table in
docs/DESIGN.md ("Job lifecycle"), one method per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from enum import StrEnum

import structlog

from worker import __version__
from worker.engine import Pipeline, ProcessStage, StageObserver, TensorArena, ThreadStage
from worker.intake import Feeder, Intake
from worker.interruptions import InterruptionWatch
from worker.leases import LeaseKeeper
from worker.ledger import Ledger
from worker.metrics import Metrics, serving
from worker.outcomes import Lifecycle, Outcomes
from worker.plugins import inference_setup, load_postprocessor, load_preprocessor, preprocess_setup
from worker.ports import (
    BlobStore,
    JobSource,
    Notice,
    NoticeKind,
    NoticeSource,
    S3Location,
    ScaleInGuard,
)
from worker.protection import ProtectionKeeper
from worker.reporting import JobObserver, ProgressReporter
from worker.results import Finisher, Regrouper
from worker.settings import Settings
from worker.supervisor import Progress, Supervisor
from worker.timeline import Timeline

log = structlog.get_logger()

# Shutdown's last steps (release what is held, stop the stage processes, drop scale-in
# protection, release what a last long poll brings) get the long poll's wait, and at
# least this long, after the grace period; then the daemon exits regardless.
MIN_SHUTDOWN_TAIL_S = 10.0
# A healthy daemon moves something at least every batch, or replaces a hung worker.
STALL_MARGIN_S = 60.0
WATCHDOG_INTERVAL_S = 5.0
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitCode(StrEnum):
    """Why the daemon stopped; `code` is the process exit status."""

    DRAINED = "drained"
    SIGNALLED = "signalled"
    INTERRUPTED = "interrupted"  # the platform announced the machine's end
    BROKEN = "broken"

    @property
    def code(self) -> int:
        return 1 if self is ExitCode.BROKEN else 0


class Daemon:
    """One worker daemon: a job source, a blob store and a pipeline built from settings."""

    def __init__(
        self,
        settings: Settings,
        source: JobSource,
        blobs: BlobStore,
        *,
        guard: ScaleInGuard | None = None,
        notices: NoticeSource | None = None,
        notify: Callable[[str], None] | None = None,
        timeline: Timeline | None = None,
    ):
        self._settings = settings
        self.shutdown_tail_s = max(float(settings.receive_wait_seconds), MIN_SHUTDOWN_TAIL_S)
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        self._ledger = ledger = Ledger()
        self._metrics = metrics = Metrics()
        stall_after_s = (
            max(settings.inference_timeout_seconds, settings.preprocess_timeout_seconds)
            + settings.receive_wait_seconds
            + STALL_MARGIN_S
        )
        progress = Progress(stall_after_s)
        self._outcomes = Outcomes(ledger, source, metrics, progress, settings.retry_delay_seconds)
        lifecycle = Lifecycle(ledger, self._outcomes, metrics, progress)
        self._stopping = threading.Event()  # no more receiving
        self._hurry = threading.Event()  # cut the grace period short
        self._exit = threading.Event()
        self._exit_reason: ExitCode | None = None
        self._broken_cause: str | None = None
        self._notice: Notice | None = None  # the termination notice acted on
        self._signalled = False
        self._hand_back_at = float("inf")  # (monotonic) the notice's end less the margin
        observer = JobObserver(ledger, metrics, progress, timeline, self._break)
        self._pipeline = _pipeline(settings, blobs, observer)
        worker_info = {"host": socket.gethostname(), "pid": os.getpid(), "version": __version__}
        self._finisher = Finisher(blobs, lifecycle, worker_info, notify, capacity=settings.max_jobs)
        self._leases = LeaseKeeper(
            ledger,
            source,
            settings.visibility_timeout_seconds,
            settings.heartbeat_interval_seconds,
            max_lease_s=settings.max_lease_seconds,
            on_ceiling=lambda job: self._outcomes.release(job, "lease ceiling reached"),
            progress=progress,
            on_renewed=metrics.leases_renewed,
        )
        self._reporter = ProgressReporter(ledger, blobs, settings.progress_interval_seconds)
        self._protection = (
            ProtectionKeeper(ledger, guard, settings.idle_grace_seconds, metrics.protection_called)
            if guard
            else None
        )
        postprocess = load_postprocessor(settings.postprocess)
        intake = Intake(
            settings, source, blobs, lifecycle, self._stopping, on_drained=self._drained
        )
        self._units: dict[str, Callable[[], object]] = {
            "intake": intake.run,
            "feeder": Feeder(ledger, self._pipeline).run,
            "regrouper": Regrouper(self._pipeline, lifecycle, self._finisher, postprocess).run,
            **{f"finisher-{n}": self._finisher.run for n in range(settings.fetch_concurrency)},
            "lease-keeper": self._leases.run,
            "progress": self._reporter.run,
        }
        if self._protection:
            self._units["protection"] = self._protection.run
        self._interruptions = (
            InterruptionWatch(notices, settings.notice_poll_seconds, self._interrupted)
            if notices
            else None
        )
        if self._interruptions:
            self._units["interruptions"] = self._interruptions.run
        self._supervisor = Supervisor(self._break, progress, lambda: len(ledger) > 0, self._exit)
        metrics.follow(jobs_held=lambda: len(ledger), queue_depths=self._pipeline.queue_depths)

    def run(self) -> ExitCode:
        """Serve until drained (with `drain`), signalled, or broken; then shut down."""
        log.info("daemon_starting", settings=self._settings.model_dump(mode="json"))
        with contextlib.ExitStack() as running:
            running.enter_context(self._signal_handlers())
            if self._settings.metrics_port:
                running.enter_context(
                    serving(self._settings.metrics_port, self._metrics, self.health_problem)
                )
            self._pipeline.start()
            if self._interruptions:  # a restarted daemon takes no work on a doomed machine
                self._interruptions.check()
            for name, unit in self._units.items():
                self._supervisor.spawn(name, unit)
            self._supervisor.start_watching(WATCHDOG_INTERVAL_S)
            log.info("daemon_started")
            self._exit.wait()
            reason = self._exit_reason or ExitCode.SIGNALLED
            self._shutdown(reason)
        log.info("daemon_stopped", reason=reason.value, exit_code=reason.code)
        return reason

    def health_problem(self) -> str | None:
        """Why the daemon is unhealthy (broken, a stage down, stalled), or None."""
        if self._broken_cause is not None:
            return f"broken: {self._broken_cause}"
        dead = self._pipeline.dead_stages()
        if dead:
            return f"stage worker down: {', '.join(dead)}"
        return self._supervisor.stall()

    def stop(self) -> None:
        """Shut down as on SIGTERM (for a daemon embedded in another program)."""
        self._stop(ExitCode.SIGNALLED)

    def _drained(self) -> None:
        self._stop(ExitCode.DRAINED)

    def _interrupted(self, notice: Notice) -> None:
        """The platform says this machine is going away. Take no more work; on a
        termination also shut down, handing back what cannot finish before it goes."""
        left_s = None if notice.deadline is None else notice.deadline - time.time()
        if notice.kind is NoticeKind.REBALANCE:  # at risk, not yet going: finish what is held
            self._stopping.set()
            self._ledger.wake()
        else:
            previous = self._notice  # a scale-in seen first still wants its hook completed
            if previous is not None and notice.acknowledge is None:
                notice = dataclasses.replace(notice, acknowledge=previous.acknowledge)
            self._notice = notice
            if left_s is not None:
                margin_s = self._settings.interruption_margin_seconds
                self._hand_back_at = time.monotonic() + left_s - margin_s
            self._stop(ExitCode.INTERRUPTED)
        self._metrics.interruption_notices.labels(notice.kind.value, notice.cause).inc()
        log.warning(
            "interruption_notice",
            kind=notice.kind.value,
            cause=notice.cause,
            seconds_left=None if left_s is None else round(left_s, 1),
            jobs_held=len(self._ledger),
        )

    def _break(self, cause: str) -> None:
        """The worker itself is at fault: stop taking jobs and give back what is held,
        unwritten, so the orchestrator replaces this worker (the circuit opens)."""
        if self._broken_cause is None:
            self._broken_cause = cause
            log.error("worker_broken", cause=cause)
        self._stop(ExitCode.BROKEN)

    def _stop(self, reason: ExitCode) -> None:
        if self._exit_reason is None or reason is ExitCode.BROKEN:
            self._exit_reason = reason
        self._stopping.set()
        self._exit.set()
        self._ledger.wake()

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """SIGTERM or SIGINT: shut down; a second one: cut the grace short. The handlers
        only set flags, and the previous ones are back once the daemon has stopped."""

        def handle(signum: int, _frame: object) -> None:
            if self._signalled:
                self._hurry.set()
                self._ledger.wake()
                return
            self._signalled = True
            self._stop(ExitCode.SIGNALLED)

        previous = {signum: signal.signal(signum, handle) for signum in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _shutdown(self, reason: ExitCode) -> None:
        """Let held jobs finish (on a signal or a notice), then give back the rest and
        stop everything, within `shutdown_tail_s` more whatever hangs."""
        if reason in (ExitCode.SIGNALLED, ExitCode.INTERRUPTED):
            self._finish_held_jobs()
        deadline = time.monotonic() + self.shutdown_tail_s
        closing = threading.Thread(target=self._close, name="shutdown", daemon=True)
        closing.start()
        closing.join(self.shutdown_tail_s)
        # Meanwhile a long poll still under way may have brought messages: the intake
        # releases them once it sees the ledger closed.
        self._supervisor.join("intake", max(0.0, deadline - time.monotonic()))
        if closing.is_alive():
            log.error("shutdown_deadline_passed", tail_s=self.shutdown_tail_s)

    def _finish_held_jobs(self) -> None:
        """Wait for held jobs to finish until the grace period ends, or until the time a
        notice gives the machine (less the margin) if that comes first; a notice may
        arrive, and bring that time closer, while this waits."""

        def finished() -> bool:
            return not len(self._ledger) or self._hurry.is_set() or self._broken_cause is not None

        def finished_or_moved(hand_back_at: float) -> bool:
            return finished() or self._hand_back_at != hand_back_at

        if finished():
            return
        log.info("draining_in_flight_jobs", jobs=len(self._ledger))
        grace_ends = time.monotonic() + self._settings.grace_seconds
        while not finished():
            hand_back_at = self._hand_back_at
            left_s = min(grace_ends, hand_back_at) - time.monotonic()
            if left_s <= 0:
                return
            self._ledger.wait_until(functools.partial(finished_or_moved, hand_back_at), left_s)

    def _close(self) -> None:
        self._ledger.close()
        if self._interruptions:
            self._interruptions.stop()
        if self._protection:  # first: protection of an instance never expires by itself
            self._protection.stop()
            self._supervisor.join("protection", self.shutdown_tail_s)
            self._protection.unprotect()
        handed_back = self._outcomes.release_all(self._release_reason())
        if self._notice is not None:
            self._interruption_handled(self._notice, handed_back)
        elif handed_back:
            reason = (self._exit_reason or ExitCode.SIGNALLED).value
            self._metrics.jobs_handed_back.labels(reason).inc(handed_back)
        self._finisher.close()
        self._pipeline.close()
        self._leases.stop()
        self._reporter.stop()

    def _interruption_handled(self, notice: Notice, handed_back: int) -> None:
        """Say what was handed back; let a waiting lifecycle hook go on at once, before
        the rest of the shutdown, which may hang past its deadline."""
        self._metrics.jobs_handed_back.labels(ExitCode.INTERRUPTED.value).inc(handed_back)
        log.warning(
            "interruption_handled",
            kind=notice.kind.value,
            cause=notice.cause,
            handed_back=handed_back,
        )
        if notice.acknowledge is None:
            return
        try:
            notice.acknowledge()
        except Exception as error:
            log.error("lifecycle_action_not_completed", error=repr(error))

    def _release_reason(self) -> str:
        if self._broken_cause is not None:
            return f"worker broken: {self._broken_cause}"
        if self._notice is not None:
            return f"interrupted: {self._notice.cause}"
        return "shutdown"


def _pipeline(settings: Settings, blobs: BlobStore, observer: StageObserver) -> Pipeline:
    """fetch (threads) -> preprocess (processes) -> inference (one process)."""
    item_shape = load_preprocessor(settings.preprocess).output_shape
    stages = [
        ThreadStage(
            "fetch",
            lambda uris: [blobs.get(S3Location.parse(uri)) for uri in uris],
            workers=settings.fetch_concurrency,
        ),
        ProcessStage(
            "preprocess",
            functools.partial(preprocess_setup, settings.preprocess),
            workers=settings.preprocess_workers,
            timeout_s=settings.preprocess_timeout_seconds,
            arena_mode="write",
        ),
        ProcessStage(
            "inference",
            functools.partial(
                inference_setup,
                settings.model,
                settings.device,
                tuple(item_shape),
                settings.precision,
                settings.channels_last,
            ),
            batch_size=settings.batch_size,
            max_batch_wait_ms=settings.max_batch_wait_ms,
            timeout_s=settings.inference_timeout_seconds,
            arena_mode="read",
        ),
    ]
    # Enough decoded images for the batch being inferred, the next two being assembled,
    # and one in the hands of each preprocessing worker.
    arena_slots = 3 * settings.batch_size + 2 * settings.preprocess_workers
    return Pipeline(stages, observer=observer, arena=TensorArena(item_shape, arena_slots))
