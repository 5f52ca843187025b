"""The daemon: wires the job lifecycle's units together, runs them, and stops them.

    intake         receive (when there is room) -> lease in the ledger -> admit or settle
    feeder         held jobs' items, in turn -> pipeline
    pipeline       fetch and preprocess (processes) -> inference (one per device), or a
                   chain: -> inference-1 -> fan-out (processes) -> inference-2
    regrouper      each result -> its job in the ledger -> complete? -> finisher
    finisher       results.jsonl, job.log, job.json (last) -> ack
    lease keeper   renews every held message's lease while work progresses
    progress       each in-flight job's progress.json and local log file; cancellations
    checkpointer   each running job's finished results, in parts, for a later delivery
    protection     scale-in protection on while jobs are held
    interruptions  spot, scale-in and rebalance notices from instance metadata
    watchdog       a daemon that holds work and moves none of it is broken

Every loop runs under one `Supervisor`; the main thread starts them, waits for a reason
to stop (a signal, an interruption notice, a drained queue, a broken worker) and shuts
down within a hard deadline. What happens to a job when something fails is the table in
docs/failures.md; its lifecycle, a ledger method per move, is in docs/jobs.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import structlog

from worker import __version__
from worker.daemon.host import Breakages, take_out_of_service
from worker.daemon.interruptions import InterruptionWatch
from worker.daemon.protection import ProtectionKeeper
from worker.daemon.shutdown import ExitCode, Shutdown
from worker.daemon.stages import build_pipeline
from worker.daemon.supervisor import Supervisor
from worker.datasets.arrays import ARRAYS_DIR, ArraySpool
from worker.datasets.disk import DiskBudget
from worker.datasets.tables import Tables
from worker.errors import CannotStart
from worker.jobs.checkpoints import Checkpointer, Checkpoints
from worker.jobs.lanes import Lanes
from worker.jobs.leases import LeaseKeeper
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Lifecycle, Outcomes
from worker.loops.intake import Feeder, Intake
from worker.loops.reporting import JobObserver, ProgressReporter
from worker.loops.results import Finisher, Regrouper
from worker.plugins import PluginError
from worker.plugins.artifacts import MODEL_CACHE_DIR, ModelCache, with_local_models
from worker.plugins.encoding import chain_postprocess_fault, encoded_fields, probed_columns
from worker.plugins.identity import ModelIdentity, pipeline_identity
from worker.plugins.loading import load_postprocessor
from worker.ports import SQS_MAX_DELAY_S, BlobStore, JobSource, NoticeSource, ScaleInGuard
from worker.settings import Settings
from worker.sharding.merging import JoinSpace, Merger
from worker.sharding.planning import Planner
from worker.sharding.shards import Shards
from worker.sharding.stragglers import Stragglers
from worker.telemetry.metrics import Metrics, serving
from worker.telemetry.pauses import started_heap_frozen
from worker.telemetry.progress import Progress
from worker.telemetry.timeline import Timeline, TimelineWriter

log = structlog.get_logger()

# A live daemon's timeline: how often it is written, and how many stage calls it keeps
# (about 100 bytes each).
TIMELINE_EVERY_S = 60.0
TIMELINE_KEEP = 100_000
# A healthy daemon moves something at least every batch, or replaces a hung worker.
STALL_MARGIN_S = 60.0
WATCHDOG_INTERVAL_S = 5.0


# Jobs whose outputs are written at once, at most: each a few writes one after another,
# so 32 finish several hundred jobs a second, where a thread for each of 512 fetches in
# flight only made the daemon's one interpreter switch between them.
MAX_FINISHERS = 32


def _finishers(settings: Settings) -> int:
    return min(settings.fetch_concurrency, MAX_FINISHERS)


def _usable_directory(path: Path, setting: str) -> None:
    """Make `path` if need be; `CannotStart` naming `setting` if it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise CannotStart(
            f"cannot write to {path} ({setting}): {error.strerror or error}"
        ) from None


class Daemon:
    """One worker daemon: a job source, a blob store and a pipeline built from settings."""

    def __init__(
        self,
        settings: Settings,
        source: JobSource,
        blobs: BlobStore,
        *,
        shard_source: JobSource | None = None,
        guard: ScaleInGuard | None = None,
        notices: NoticeSource | None = None,
        notify: Sequence[Callable[[str], None]] = (),
        timeline: Timeline | None = None,
    ):
        self._settings = settings
        self.shutdown_tail_s = settings.shutdown_tail_s()
        # With a queue of shards, every part of the daemon settles a message on its own
        # queue through the lanes, and sends shards and watches to that queue.
        lanes = Lanes(source, shard_source) if shard_source is not None else None
        source = lanes or source
        _usable_directory(settings.log_dir, "--log-dir")
        # Before a model is fetched: it refuses a pyarrow that cannot keep its results.
        self._tables = Tables(settings.parquet_file_bytes, settings.parquet_row_group_bytes)
        self._ledger = ledger = Ledger()
        self._metrics = metrics = Metrics()
        stall_after_s = (
            max(settings.inference_timeout_seconds, settings.preprocess_timeout_seconds)
            + settings.receive_wait_seconds
            + STALL_MARGIN_S
        )
        progress = Progress(stall_after_s)
        checkpoints = Checkpoints(blobs, ledger)
        self._outcomes = Outcomes(
            ledger,
            source,
            metrics,
            progress,
            retry_delay_s=settings.retry_delay_seconds,
            checkpoints=checkpoints,
            lease_s=settings.visibility_timeout_seconds,
        )
        lifecycle = Lifecycle(ledger, self._outcomes, metrics, progress)
        self._shutdown = shutdown = Shutdown(
            ledger, metrics, settings.grace_seconds, settings.interruption_margin_seconds
        )
        if settings.timeline_dir:
            timeline = timeline or Timeline(keep=TIMELINE_KEEP)
        self._timeline = timeline
        self._timeline_writer = (
            TimelineWriter(timeline, settings.timeline_dir, TIMELINE_EVERY_S)
            if settings.timeline_dir and timeline is not None
            else None
        )
        # Models in S3 are fetched here, once, before the processes that load them start.
        self._spec = spec = with_local_models(
            settings.pipeline_spec(),
            ModelCache(settings.model_cache_dir or settings.log_dir / MODEL_CACHE_DIR, blobs),
            "--pipeline" if settings.pipeline else "--model",
        )
        observer = JobObserver(
            ledger,
            metrics,
            progress,
            timeline,
            shutdown.broken,
            batching_stages=spec.model_stage_names(),
        )
        self._pipeline = build_pipeline(spec, settings, blobs, observer)
        ledger.bound_background(self._pipeline.background_room())
        # job.json's `worker`; its models' warm-up (and compile) times are added once known.
        self._worker_info = worker_info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
        }
        # Jobs' copies here (tars, listings, a merge's files): one disk budget, one spool.
        self._arrays, disk = (
            ArraySpool(settings.log_dir / ARRAYS_DIR),
            DiskBudget.of(settings.log_dir, settings.tar_disk_bytes),
        )
        shards = Shards(
            blobs,
            source,
            checkpoints,
            lifecycle,
            Merger(
                blobs,
                checkpoints,
                self._tables,
                worker_info=worker_info,
                device_hour_price=settings.device_hour_price,
                join_space=JoinSpace(self._arrays, disk, progress.beat),
            ),
        )
        self._finisher = finisher = Finisher(
            blobs,
            checkpoints,
            shards,
            self._tables,
            lifecycle,
            worker_info=worker_info,
            notify=notify,
            capacity=settings.max_jobs,
            device_hour_price=settings.device_hour_price,
        )
        self._checkpointer = Checkpointer(
            ledger, checkpoints, settings.checkpoint_items, settings.checkpoint_seconds
        )
        self._leases = LeaseKeeper(
            ledger,
            source,
            settings.visibility_timeout_seconds,
            settings.heartbeat_interval_seconds,
            max_lease_s=settings.max_lease_seconds,
            on_ceiling=self._outcomes.lease_ceiling_reached,
            progress=progress,
            on_renewed=metrics.leases_renewed,
        )
        self._reporter = ProgressReporter(
            ledger,
            blobs,
            checkpoints,
            shards,
            settings.progress_interval_seconds,
            cancel=finisher.cancel,
            superseded=self._outcomes.superseded,
            duplicate=self._outcomes.duplicate,
        )
        self._protection = (
            ProtectionKeeper(ledger, guard, settings.idle_grace_seconds, metrics.protection_called)
            if guard
            else None
        )
        self._interruptions = (
            InterruptionWatch(notices, settings.notice_poll_seconds, shutdown.interrupted)
            if notices
            else None
        )
        self._guard = guard
        self._breakages = Breakages(settings.log_dir, settings.host_breakages_limit)
        # Loaded here too so that a wrong reference stops the daemon before it starts.
        # A single model's postprocessor runs in its process; a chain's parts come
        # together only here, so its postprocessor runs here.
        postprocess = load_postprocessor(spec.postprocess)
        fault = chain_postprocess_fault(postprocess) if spec.fan_out else None
        if fault is not None:
            raise PluginError(
                f"{spec.postprocess} fails on an input with no parts and no params ({fault}); "
                "the daemon runs that whenever it fails an input, to tell a broken worker "
                "from bad inputs"
            )
        if spec.fan_out:  # its answer for no parts gives its fields' columns
            self._tables.probed(*probed_columns(encoded_fields(postprocess, [], {})))
        self._model: Future[ModelIdentity] = Future()  # what the inference stage loaded
        self._intake = intake = Intake(
            settings,
            source,
            blobs,
            lifecycle,
            shutdown.stopping,
            model=self._model,
            checkpoints=checkpoints,
            planner=Planner(blobs, source, lifecycle),
            shards=shards,
            # A run lasts at most the lease ceiling before it is handed over (and the
            # next one starts), handed over with a delay of at most SQS's.
            stragglers=Stragglers(
                blobs,
                source,
                shards,
                self._outcomes,
                announce_merged=finisher.notices.merged,
                lost_after_s=settings.max_lease_seconds + SQS_MAX_DELAY_S,
            ),
            finish=finisher.submit,
            notices=finisher.notices,
            on_drained=shutdown.drained,
            arrays=self._arrays,
            disk=disk,
            lanes=lanes,
        )
        self._units: dict[str, Callable[[], object]] = {
            "intake": intake.run,
            **({"shards-intake": intake.run_shards_lane} if lanes else {}),
            "feeder": Feeder(ledger, self._pipeline).run,
            "regrouper": Regrouper(
                self._pipeline,
                lifecycle,
                finisher,
                postprocess if spec.fan_out else None,
                shutdown.broken,
            ).run,
            **{f"finisher-{n}": finisher.run for n in range(_finishers(settings))},
            "lease-keeper": self._leases.run,
            "progress": self._reporter.run,
            "checkpointer": self._checkpointer.run,
        }
        if self._protection:
            self._units["protection"] = self._protection.run
        if self._interruptions:
            self._units["interruptions"] = self._interruptions.run
        if self._timeline_writer:
            self._units["timeline"] = self._timeline_writer.run
        self._supervisor = Supervisor(shutdown.broken, progress, ledger.at_work, shutdown.requested)
        metrics.follow(
            jobs_held=lambda: len(ledger),
            queue_depths=self._pipeline.queue_depths,
            worker_counts=self._pipeline.worker_counts,
        )

    def run(self) -> ExitCode:
        """Serve until drained (with `drain`), signalled, interrupted or broken; then
        shut down within `shutdown_tail_s` more than the time held jobs are given."""
        log.info("daemon_starting", settings=self._settings.model_dump(mode="json"))
        if self._breakages.too_many():  # restarted on a host that is to be replaced
            with self._shutdown.signal_handlers():  # a stop meanwhile: still broken (below)
                take_out_of_service(self._breakages, self._guard, self._metrics)
            return ExitCode.BROKEN
        with contextlib.ExitStack() as running:
            running.enter_context(self._shutdown.signal_handlers())
            if self._settings.metrics_port:
                running.enter_context(
                    serving(self._settings.metrics_port, self._metrics, self.health_problem)
                )
            try:
                self._arrays.open()
            except OSError as error:
                raise CannotStart(f"cannot keep job files under --log-dir: {error}") from None
            running.callback(self._arrays.close)
            self._pipeline.start()
            self._model_ready()
            # What is here now lives as long as the daemon: no collection walks it again.
            running.enter_context(started_heap_frozen(self._paused))
            if self._interruptions:  # a restarted daemon takes no work on a doomed machine
                self._interruptions.check()
            # Nor one stopped while it started: its intake would receive before `wait`.
            self._shutdown.act_on_signals()
            for name, unit in self._units.items():
                self._supervisor.spawn(name, unit)
            self._supervisor.start_watching(WATCHDOG_INTERVAL_S)
            log.info("daemon_started")
            reason = self._shutdown.wait()
            self._shutdown.let_held_jobs_finish()
            self._close_within_tail()
            # Still under the daemon's signal handlers: a second stop signal while the
            # platform is called (seconds) is counted, where the handler they give back
            # (the command line's, for a stop during its imports) would exit 0.
            if self._shutdown.broken_cause is not None:
                self._breakages.note(self._shutdown.broken_cause)
                if self._breakages.too_many():
                    take_out_of_service(self._breakages, self._guard, self._metrics)
            log.info("daemon_stopped", reason=reason.value, exit_code=reason.code)
        return reason

    def _paused(self, generation: int, seconds: float) -> None:
        """A garbage collection stopped every thread for `seconds`."""
        self._metrics.gc_paused(generation, seconds)
        if self._timeline is not None:
            self._timeline.record("gc", 0, seconds)

    def health_problem(self) -> str | None:
        """Why the daemon is not serving (starting, broken, a stage down, stalled), or None."""
        if self._shutdown.broken_cause is not None:
            return f"broken: {self._shutdown.broken_cause}"
        if not self._model.done():
            return "starting: the pipeline is being set up and the model warmed up"
        dead = self._pipeline.dead_stages()
        if dead:
            return f"stage worker down: {', '.join(dead)}"
        return self._supervisor.stall()

    def _model_ready(self) -> None:
        """Take the models' identities from their stages, set up and warmed up."""
        spec = self._spec
        models = []
        for name in spec.model_stage_names():
            about = self._pipeline.about(name)
            models.append(ModelIdentity(**about["model"]))
            log.info("model_ready", **about["model"], warm_up=about["warm_up"])
            # job.json says how long this worker took to be ready (a chain: its models').
            for field, took_s in (("warm_up_s", "seconds"), ("compile_s", "compile_s")):
                earlier_s = self._worker_info.get(field, 0.0)
                self._worker_info[field] = round(earlier_s + about["warm_up"].get(took_s, 0.0), 3)
            # From the model's process, where its postprocessor runs (not a chain's).
            if "fields" in about:
                self._arrays.layouts = about["arrays"]
                self._tables.probed(about["fields"], about["arrays"])
        identity = pipeline_identity(spec, models)
        self._metrics.model.info(identity.labels())
        if identity.steps:
            log.info("pipeline_ready", **identity.labels())
        self._model.set_result(identity)

    def stop(self) -> None:
        """Shut down as on SIGTERM (for a daemon embedded in another program)."""
        self._shutdown.request(ExitCode.SIGNALLED)

    def _close_within_tail(self) -> None:
        deadline = time.monotonic() + self.shutdown_tail_s
        closing = threading.Thread(target=self._close, name="shutdown", daemon=True)
        closing.start()
        closing.join(self.shutdown_tail_s)
        # Meanwhile a long poll still under way (either lane's) may have brought
        # messages: the intake releases them once it sees the ledger closed. One left
        # unjoined would leave what its poll brings leased to a daemon gone.
        for lane in ("intake", "shards-intake"):
            self._supervisor.join(lane, max(0.0, deadline - time.monotonic()))
        if closing.is_alive():
            log.error("shutdown_deadline_passed", tail_s=self.shutdown_tail_s)

    def _close(self) -> None:
        self._ledger.close()
        self._intake.close()
        if self._interruptions:
            self._interruptions.stop()
        if self._protection:  # first: protection of an instance never expires by itself
            self._protection.stop()
            self._supervisor.join("protection", self.shutdown_tail_s)
            self._protection.unprotect()
        self._checkpointer.stop()
        shutdown = self._shutdown
        handed_back = self._outcomes.release_all(
            shutdown.release_reason(), breakage=shutdown.broken_cause, suspects=shutdown.suspects
        )
        shutdown.handed_back(handed_back)
        self._finisher.close()
        self._pipeline.close()
        self._leases.stop()
        self._reporter.stop()
        if self._timeline_writer:
            self._timeline_writer.stop()
