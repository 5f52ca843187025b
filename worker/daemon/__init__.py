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
docs/DESIGN.md ("Job lifecycle"), one method per row.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import structlog

from worker import __version__
from worker.daemon.host import Breakages, take_out_of_service
from worker.daemon.interruptions import InterruptionWatch
from worker.daemon.protection import ProtectionKeeper
from worker.daemon.shutdown import ExitCode, Shutdown
from worker.daemon.supervisor import Supervisor
from worker.engine import (
    PIPELINED_BATCHES,
    PIPELINED_PREPARING,
    Pipeline,
    PrepareStep,
    ProcessStage,
    StageObserver,
    TensorArena,
    ThreadStage,
    bisection_sizes,
)
from worker.jobs.arrays import ARRAYS_DIR, ArraySpool
from worker.jobs.checkpoints import Checkpointer, Checkpoints
from worker.jobs.intake import Feeder, Intake
from worker.jobs.leases import LeaseKeeper
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Lifecycle, Outcomes
from worker.jobs.reporting import JobObserver, ProgressReporter
from worker.jobs.results import Finisher, Regrouper
from worker.plugins import PluginError, on_payload
from worker.plugins.device_decoding import decodes_on_device
from worker.plugins.encoding import chain_postprocess_fault
from worker.plugins.identity import ModelIdentity, pipeline_identity
from worker.plugins.loading import (
    inference_devices,
    load_fan_out,
    load_postprocessor,
    load_preprocessor,
)
from worker.plugins.setups import fan_out_setup, inference_setup, preprocess_setup
from worker.plugins.spec import FAN_OUT_STAGE, ModelStep, PipelineSpec
from worker.ports import (
    BlobStore,
    JobSource,
    NoticeSource,
    ObjectReader,
    RemoteReader,
    S3Location,
    ScaleInGuard,
)
from worker.settings import Settings
from worker.telemetry.metrics import Metrics, serving
from worker.telemetry.progress import Progress
from worker.telemetry.timeline import Timeline, TimelineWriter

__all__ = ["Daemon", "ExitCode"]

log = structlog.get_logger()

# A live daemon's timeline: how often it is written, and how many stage calls it keeps
# (about 100 bytes each).
TIMELINE_EVERY_S = 60.0
TIMELINE_KEEP = 100_000
# A healthy daemon moves something at least every batch, or replaces a hung worker.
STALL_MARGIN_S = 60.0
WATCHDOG_INTERVAL_S = 5.0


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
        notify: Sequence[Callable[[str], None]] = (),
        timeline: Timeline | None = None,
    ):
        self._settings = settings
        self.shutdown_tail_s = settings.shutdown_tail_s()
        settings.log_dir.mkdir(parents=True, exist_ok=True)
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
        self._timeline_writer = None
        if settings.timeline_dir:
            timeline = timeline or Timeline(keep=TIMELINE_KEEP)
            self._timeline_writer = TimelineWriter(
                timeline, settings.timeline_dir, TIMELINE_EVERY_S
            )
        self._spec = spec = settings.pipeline_spec()
        observer = JobObserver(
            ledger,
            metrics,
            progress,
            timeline,
            shutdown.broken,
            batching_stages=spec.model_stage_names(),
        )
        self._pipeline = _pipeline(spec, settings, blobs, observer)
        worker_info = {"host": socket.gethostname(), "pid": os.getpid(), "version": __version__}
        self._finisher = finisher = Finisher(
            blobs, checkpoints, lifecycle, worker_info, notify, capacity=settings.max_jobs
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
            settings.progress_interval_seconds,
            cancel=finisher.cancel,
            superseded=self._outcomes.superseded,
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
        self._arrays = ArraySpool(settings.log_dir / ARRAYS_DIR)
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
        self._model: Future[ModelIdentity] = Future()  # what the inference stage loaded
        intake = Intake(
            settings,
            source,
            blobs,
            lifecycle,
            shutdown.stopping,
            model=self._model,
            checkpoints=checkpoints,
            finish=finisher.submit,
            on_drained=shutdown.drained,
            arrays=self._arrays,
        )
        self._units: dict[str, Callable[[], object]] = {
            "intake": intake.run,
            "feeder": Feeder(ledger, self._pipeline).run,
            "regrouper": Regrouper(
                self._pipeline,
                lifecycle,
                finisher,
                postprocess if spec.fan_out else None,
                shutdown.broken,
            ).run,
            **{f"finisher-{n}": finisher.run for n in range(settings.fetch_concurrency)},
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
        self._supervisor = Supervisor(
            shutdown.broken, progress, lambda: len(ledger) > 0, shutdown.requested
        )
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
            take_out_of_service(self._breakages, self._guard, self._metrics)
            return ExitCode.BROKEN
        with contextlib.ExitStack() as running:
            running.enter_context(self._shutdown.signal_handlers())
            if self._settings.metrics_port:
                running.enter_context(
                    serving(self._settings.metrics_port, self._metrics, self.health_problem)
                )
            self._arrays.open()
            running.callback(self._arrays.close)
            self._pipeline.start()
            self._model_ready()
            if self._interruptions:  # a restarted daemon takes no work on a doomed machine
                self._interruptions.check()
            for name, unit in self._units.items():
                self._supervisor.spawn(name, unit)
            self._supervisor.start_watching(WATCHDOG_INTERVAL_S)
            log.info("daemon_started")
            reason = self._shutdown.wait()
            self._shutdown.let_held_jobs_finish()
            self._close_within_tail()
        if self._shutdown.broken_cause is not None:
            self._breakages.note(self._shutdown.broken_cause)
            if self._breakages.too_many():
                take_out_of_service(self._breakages, self._guard, self._metrics)
        log.info("daemon_stopped", reason=reason.value, exit_code=reason.code)
        return reason

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
            # From the model's process, where its postprocessor runs (not a chain's).
            self._arrays.layouts = about.get("arrays")
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
        # Meanwhile a long poll still under way may have brought messages: the intake
        # releases them once it sees the ledger closed.
        self._supervisor.join("intake", max(0.0, deadline - time.monotonic()))
        if closing.is_alive():
            log.error("shutdown_deadline_passed", tail_s=self.shutdown_tail_s)

    def _close(self) -> None:
        self._ledger.close()
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


def _pipeline(
    spec: PipelineSpec, settings: Settings, blobs: BlobStore, observer: StageObserver
) -> Pipeline:
    """fetch and preprocess (processes) -> a model (a process per device), or a model ->
    a fan-out (processes) -> a model; fetch on threads here where the store cannot be
    read from another process."""
    decode_ceiling = settings.preprocess_workers_ceiling
    images = load_preprocessor(spec.preprocess).output_shape
    first, *rest = spec.models
    names = spec.model_stage_names()
    fan_out = spec.fan_out
    # Enough decoded images, for each process of the model that reads them, for the
    # batch being inferred and the next two being assembled, and two in the hands of
    # each worker that writes or (a fan-out) still reads them; and for the inputs that
    # the floor's preprocessing processes fetch ahead, several requests each.
    image_arena = TensorArena(
        images,
        3 * first.batch_size * len(_devices(first, settings))
        + 2 * (decode_ceiling + (fan_out.workers if fan_out else 0))
        + PIPELINED_PREPARING * settings.fetch_concurrency,
    )
    reader = _remote_reader(settings, blobs)
    log.info("inputs_fetched_in", where="preprocess" if reader else "threads")
    on_device, why = decodes_on_device(
        settings.decode, spec.preprocess, _devices(first, settings), chained=bool(fan_out)
    )
    log.info("inputs_decoded_in", where="inference" if on_device else "preprocess", why=why)
    per_process = settings.fetched_per_process
    max_input_bytes = settings.max_input_bytes
    stages: list[ThreadStage | ProcessStage] = []
    if reader is None:
        fetch = on_payload(lambda uri: blobs.get(S3Location.parse(uri), max_input_bytes))
        stages.append(
            ThreadStage(
                "fetch",
                lambda values: [fetch(value) for value in values],
                workers=settings.fetch_concurrency,
            )
        )
    stages += [
        ProcessStage(
            "preprocess",
            functools.partial(
                preprocess_setup,
                spec.preprocess,
                functools.partial(open_fetch, reader.open, per_process, max_input_bytes)
                if reader
                else None,
                defer_to_device=on_device,
            ),
            workers=settings.preprocess_workers,
            max_workers=decode_ceiling,
            batch_size=per_process,
            timeout_s=settings.preprocess_timeout_seconds,
            setup_timeout_s=settings.setup_timeout_seconds,
            writes=image_arena,
            prepare=PrepareStep("fetch", reader.longest_s) if reader else None,
            imports=reader.imports if reader else (),
        ),
        _model_stage(
            names[0],
            first,
            settings,
            images,
            image_arena,
            keeps_slots=bool(fan_out),
            postprocess=None if fan_out else spec.postprocess,
            decoder=spec.preprocess if on_device else None,
        ),
    ]
    if fan_out:
        (second,) = rest
        parts = load_fan_out(fan_out.fan_out).output_shape
        part_arena = TensorArena(
            parts,
            3 * second.batch_size * len(_devices(second, settings))
            + PIPELINED_BATCHES * fan_out.workers * fan_out.max_parts,
        )
        stages += [
            ProcessStage(
                FAN_OUT_STAGE,
                functools.partial(fan_out_setup, fan_out.fan_out),
                workers=fan_out.workers,
                timeout_s=settings.preprocess_timeout_seconds,
                setup_timeout_s=settings.setup_timeout_seconds,
                reads=image_arena,
                writes=part_arena,
                max_parts=fan_out.max_parts,
            ),
            _model_stage(names[1], second, settings, parts, part_arena),
        ]
    return Pipeline(stages, observer=observer)


def _remote_reader(settings: Settings, blobs: BlobStore) -> RemoteReader | None:
    """How the preprocessing processes read inputs (`Settings.fetch_in`), or None if
    they are fetched on threads here."""
    if settings.fetch_in == "threads":
        return None
    reader = blobs.remote_reader()
    if reader is None and settings.fetch_in == "preprocess":
        raise ValueError(
            "fetch_in=preprocess: this blob store lives only in this process, so the "
            "preprocessing processes cannot read it; use fetch_in=threads (or auto)"
        )
    return reader


def open_fetch(
    open_reader: Callable[[int], ObjectReader], connections: int, max_bytes: int
) -> Callable[[str], bytes]:
    """A preprocessing process's fetcher of an input's bytes by its URI, with a reader
    of its own for `connections` reads at once; an input over `max_bytes` is not read."""
    get = open_reader(connections)
    return lambda uri: get(S3Location.parse(uri), max_bytes)


def _model_stage(
    name: str,
    step: ModelStep,
    settings: Settings,
    item_shape: Sequence[int],
    arena: TensorArena,
    *,
    keeps_slots: bool = False,
    postprocess: str | None = None,
    decoder: str | None = None,
) -> ProcessStage:
    """One model's stage: a process per device, each loading and warming up the model
    (and the postprocessor, if the model's outputs are the results; and the
    preprocessor, if it decodes inputs on the device)."""
    return ProcessStage(
        name,
        [
            functools.partial(
                inference_setup,
                step.model,
                device,
                tuple(item_shape),
                batch_size=step.batch_size,
                precision=step.precision or settings.precision,
                channels_last=settings.channels_last
                if step.channels_last is None
                else step.channels_last,
                model_name=step.name,
                model_version=step.version,
                postprocess=postprocess,
                decoder=decoder,
            )
            for device in _devices(step, settings)
        ],
        batch_size=step.batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
        timeout_s=settings.inference_timeout_seconds,
        # The warm-up runs a batch at each size bisection falls back to.
        setup_timeout_s=settings.setup_timeout_seconds
        + len(bisection_sizes(step.batch_size)) * settings.inference_timeout_seconds,
        reads=arena,
        keeps_slots=keeps_slots,
    )


def _devices(step: ModelStep, settings: Settings) -> list[str]:
    return inference_devices(step.device or settings.device)
