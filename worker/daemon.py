"""The daemon: wires the job lifecycle's units together, runs them, and stops them.

    intake         receive (when there is room) -> lease in the ledger -> admit or settle
    feeder         held jobs' items, in turn -> pipeline
    pipeline       fetch (threads) -> preprocess (processes) -> inference (one process)
    regrouper      each result -> its job in the ledger -> complete? -> finisher
    finisher       results.jsonl, job.log, job.json (last) -> ack
    lease keeper   renews every held message's lease while work progresses
    progress       each in-flight job's progress.json and local log file
    protection     scale-in protection on while jobs are held
    watchdog       a daemon that holds work and moves none of it is broken

Every loop runs under one `Supervisor`; the main thread starts them, waits for a reason
to stop (a signal, a drained queue, a broken worker) and shuts down within a hard
deadline. What happens to a job when something fails is the table in docs/DESIGN.md
("Job lifecycle"), one method per row.
"""

from __future__ import annotations

import contextlib
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
from worker.leases import LeaseKeeper
from worker.ledger import Ledger
from worker.metrics import Metrics, serving
from worker.outcomes import Lifecycle, Outcomes
from worker.plugins import inference_setup, load_postprocessor, load_preprocessor, preprocess_setup
from worker.ports import BlobStore, JobSource, S3Location, ScaleInGuard
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
            if self._stopping.is_set():
                self._hurry.set()
                self._ledger.wake()
                return
            self._stop(ExitCode.SIGNALLED)

        previous = {signum: signal.signal(signum, handle) for signum in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _shutdown(self, reason: ExitCode) -> None:
        """Let held jobs finish within the grace period (on a signal), then give back the
        rest and stop everything, within `shutdown_tail_s` more whatever hangs."""
        if reason is ExitCode.SIGNALLED and len(self._ledger):
            grace_s = self._settings.grace_seconds
            log.info("draining_in_flight_jobs", jobs=len(self._ledger), grace_s=grace_s)
            self._ledger.wait_until(
                lambda: (
                    not len(self._ledger) or self._hurry.is_set() or self._broken_cause is not None
                ),
                grace_s,
            )
        deadline = time.monotonic() + self.shutdown_tail_s
        closing = threading.Thread(target=self._close, name="shutdown", daemon=True)
        closing.start()
        closing.join(self.shutdown_tail_s)
        # Meanwhile a long poll still under way may have brought messages: the intake
        # releases them once it sees the ledger closed.
        self._supervisor.join("intake", max(0.0, deadline - time.monotonic()))
        if closing.is_alive():
            log.error("shutdown_deadline_passed", tail_s=self.shutdown_tail_s)

    def _close(self) -> None:
        self._ledger.close()
        if self._protection:  # first: protection of an instance never expires by itself
            self._protection.stop()
            self._supervisor.join("protection", self.shutdown_tail_s)
            self._protection.unprotect()
        cause = self._broken_cause
        self._outcomes.release_all(f"worker broken: {cause}" if cause else "shutdown")
        self._finisher.close()
        self._pipeline.close()
        self._leases.stop()
        self._reporter.stop()


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
