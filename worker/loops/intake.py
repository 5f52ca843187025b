"""Taking work in: the intake receives and admits jobs, the feeder feeds their items.

The intake never waits on the pipeline: a message is leased in the ledger the moment
it is received, then admitted (validated, its manifest read) or settled. The feeder is
the one loop that waits for room in the pipeline, and it takes held jobs in turn, so a
one-image job is not stuck behind a 100,000-image one received with it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from worker.datasets.arrays import ArraySpool
from worker.datasets.disk import DiskBudget
from worker.engine import Item, Pipeline
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job, JobState
from worker.jobs.joblog import JobLog, local_log_path
from worker.jobs.lanes import Lanes
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Lifecycle
from worker.loops.admission import CLOCK_SKEW_S, Admission, AdmissionReader
from worker.loops.notices import Notices
from worker.plugins.identity import ModelIdentity
from worker.ports import BlobStore, JobSource, ReceivedMessage
from worker.settings import Settings
from worker.sharding.planning import Planner
from worker.sharding.shards import Shards
from worker.sharding.stragglers import Stragglers

log = structlog.get_logger()

RECEIVE_ERROR_BACKOFF_S = 5.0
SHORT_POLL_PAUSE_S = 0.1  # after an empty receive that did not wait (receive_wait_seconds 0)
# `--drain` stops only after this many empty receives in a row, each followed by queue
# counters that read zero, with nothing held here in between.
DRAINED_READINGS = 2
SPARE_SHARD = "enough work is held here: another worker is to take this shard"
SPARE_WHILE_FULL_DELAY_S = 10
# How long a lane that may bring shards waits for a shard being admitted (what it brings
# decides the lane's room) before it goes on without a slow one.
ADMISSION_PATIENCE_S = 1.0
# Messages admitted at once: reading their listings and outputs, planning them, copying
# their tars. The intake receives no more while this many are.
MAX_ADMITTING = 16
ADMISSION_LEADS = 16  # the latest admissions whose lead sizes the prefetch
LEAD_MEMORY_S = 30.0  # and how long one counts


class Intake:
    """Receives messages while there is room, leases each in the ledger, admits it."""

    def __init__(
        self,
        settings: Settings,
        source: JobSource,
        blobs: BlobStore,
        lifecycle: Lifecycle,
        stopping: threading.Event,
        *,
        model: Future[ModelIdentity],
        checkpoints: Checkpoints,
        planner: Planner,
        shards: Shards,
        stragglers: Stragglers,
        finish: Callable[[Job], None],
        notices: Notices,
        on_drained: Callable[[], None],
        arrays: ArraySpool,
        disk: DiskBudget,
        lanes: Lanes | None = None,
    ):
        """With `lanes` (the same queues as `source`), `run` reads its jobs lane and
        `run_shards_lane` its shards lane; without, `run` reads the one queue."""
        self._settings = settings
        self._source = source
        self._lanes = lanes
        self._model = model  # known once the inference stage is set up, before the first receive
        self._shards = shards
        self._finish = finish
        self._ledger = lifecycle.ledger
        self._outcomes = lifecycle.outcomes
        self._progress = lifecycle.progress
        self._stopping = stopping
        self._on_drained = on_drained
        self._drained_readings = 0
        self._notices = notices
        self._reader = AdmissionReader(
            settings,
            blobs,
            lifecycle,
            stopping,
            model=model,
            checkpoints=checkpoints,
            planner=planner,
            shards=shards,
            stragglers=stragglers,
            notices=notices,
            arrays=arrays,
            disk=disk,
            claim_tar_shard=self._tar_shard_to_copy,
        )
        # Admissions run side by side, MAX_ADMITTING at most; one tar shard's tars are
        # copied at a time (its job's key).
        self._admitting_pool = ThreadPoolExecutor(MAX_ADMITTING, "admit")
        self._claim_lock = threading.Lock()
        self._admitting = 0
        self._tar_shard_claimed: str | None = None  # the key of the one whose tars are copied
        self._tar_shard_claimed_at = 0.0  # `time.monotonic()`
        self._copy_ahead_after = 0.0  # `time.monotonic()`: no copying ahead before
        # Enough items for the first model's next few batches, and for the fetches in
        # flight before them: with fewer, the fetches in flight are fewer than asked for
        # (a held item being fetched is not yet waiting for the model).
        first_batch = settings.pipeline_spec().models[0].batch_size
        self._prefetch_items = settings.prefetch_batches * first_batch + settings.fetch_concurrency
        self._lead = AdmissionLead(self._ledger.items_recorded, most=self._prefetch_items)

    def room(self) -> int:
        """How many messages may be received now: none while enough work is waiting (but
        one while a lone tar shard runs, to copy the next one's tars, and every other job
        held is fed whole); one at a time while a shard is held (the queue holds a
        planned job's shards: one may be more work than the prefetch, and the rest of
        the fleet is to share them)."""
        if self._tar_shard_being_copied():
            return 0
        if self._full(ahead=not self._ledger.shards_held()):
            return self._one_if(self._copy_ahead() and self._ledger.seat_free())
        return self._one_if(True) if self._ledger.shards_held() else self._free()

    def room_for_jobs(self) -> int:
        """How many messages the jobs lane may bring now, beside a lane of shards: as
        many as there is room for; and while enough work is waiting, one at a time, when
        every job held that is not a shard is fed whole (the rest waits for daemons with
        room, while a small job is not stuck behind the shards held here)."""
        return self._one_if(self._ledger.seat_free()) if self._full(ahead=True) else self._free()

    def room_for_a_shard(self) -> int:
        """How many messages the shards lane may bring now: one, while there is room.
        What it holds are shards and their watches: one is as much as a daemon is to
        take of a planned job, where ten taken at once are nine handed back."""
        if self._tar_shard_being_copied():
            return 0
        return self._one_if(not self._full() or self._copy_ahead())

    def _tar_shard_being_copied(self) -> bool:
        """Whether a tar shard's tars are being copied here, for a short while yet: how
        much work it is, and whether the next is to be held beside it, are known once
        they are, so the lane a shard may come by waits (a receive brought several,
        each but the first handed back at once, and taken again at once); a copy that
        takes long holds up nothing."""
        # Read without the claim's lock: room is asked under the ledger's, which an
        # admission takes under the claim's (a claim read a moment late waits a round).
        claimed_at = self._tar_shard_claimed_at
        if self._tar_shard_claimed is None:
            return False
        return time.monotonic() - claimed_at < ADMISSION_PATIENCE_S

    def _free(self) -> int:
        """As many messages as one receive brings, within `--max-jobs` held and
        `MAX_ADMITTING` being admitted."""
        settings = self._settings
        admitting = MAX_ADMITTING - self._admitting
        return max(0, min(settings.receive_batch, settings.max_jobs - len(self._ledger), admitting))

    def _one_if(self, allowed: bool) -> int:
        return min(1, self._free()) if allowed else 0

    def _copy_ahead(self) -> bool:
        """Whether the one shard held is a tar shard: then the next is taken while it
        runs, so that its tars are copied meanwhile, not while the device waits; it is
        fed once the first is (`Ledger`'s turns of shards). Not for a while after the
        next was not of tars: the queue may hold many such, each handed back."""
        if time.monotonic() < self._copy_ahead_after:
            return False
        return self._ledger.shards_held() == 1 and self._ledger.tar_shards_held() == 1

    def _full(self, *, ahead: bool = False) -> bool:
        """Whether enough work is waiting here for the next few batches; `ahead`: and
        for those the pipeline goes through while the next jobs are admitted (not where
        shards are concerned: a daemon holds one at a time, the rest for the fleet)."""
        lead = self._lead.items() if ahead else 0
        return self._ledger.outstanding_items() >= self._prefetch_items + lead

    def _full_of_shards(self, *, tar: bool) -> bool:
        """Whether a shard received now (of tars, `tar`) is more than this daemon is to
        hold: it holds one already, with enough work waiting, and it is not a tar shard
        to copy ahead."""
        copying_ahead = tar and self._copy_ahead()
        return self._ledger.shards_held() > 0 and self._full() and not copying_ahead

    def run(self) -> None:
        """Receive and admit from the jobs lane, or the one queue, until stopping (or
        drained, with `--drain`)."""
        if self._lanes is None:
            self._serve(
                self._source.receive,
                self.room,
                drains=True,
                paced=lambda: self._ledger.shards_held() > 0,
            )
        else:
            self._serve(self._lanes.receive, self.room_for_jobs, drains=True, paced=lambda: False)

    def run_shards_lane(self) -> None:
        """Receive and admit from the shards lane until stopping."""
        assert self._lanes is not None
        self._serve(
            self._lanes.receive_shards, self.room_for_a_shard, drains=False, paced=lambda: True
        )

    def _serve(
        self,
        receive: Callable[[int, int, int], list[ReceivedMessage]],
        room: Callable[[], int],
        *,
        drains: bool,
        paced: Callable[[], bool],
    ) -> None:
        """Receive up to `room()` messages at a time, whenever there is room; `drains`:
        this loop decides that the daemon is drained. Each message is admitted on a
        thread of its own (`_admission`): one that takes long (a prefix of millions of
        objects to plan, tars to copy) holds up neither the others nor the next receive;
        but while `paced()` (the lane brings shards one at a time) the next receive waits
        for this one's admission, as long as it is quick: whether there is room for
        another shard is known once this one is admitted, and one received before would
        be handed back as a spare and taken again, a receive, an admission's reads and
        a hand-back each time (`bench.fleet`'s requests per shard)."""
        while not self._stopping.is_set():
            # Looked at again as a tar shard's copy grows old (`_tar_shard_being_copied`).
            self._ledger.wait_until(
                lambda: room() > 0 or self._stopping.is_set(), ADMISSION_PATIENCE_S
            )
            if self._stopping.is_set():
                return
            idle = not len(self._ledger)
            messages = self._receive(receive, room())
            if messages is None:
                continue
            if not messages:
                if drains and self._settings.drain and self._drained(idle):
                    self._on_drained()
                    return
                if not self._settings.receive_wait_seconds:
                    # A short poll answers at once: asking again at once would spin,
                    # calling the queue and taking this process's CPU.
                    self._stopping.wait(SHORT_POLL_PAUSE_S)
                continue
            self._drained_readings = 0
            received: list[Job] = []
            for message in messages:
                job = self._hold(message)
                if job is not None:
                    self._admit_apart(job, list(received))
                    received.append(job)
            if paced():
                self._ledger.wait_until(
                    _past_admission(received, self._stopping), ADMISSION_PATIENCE_S
                )

    def _admit_apart(self, job: Job, before: list[Job]) -> None:
        """Have the job admitted on a thread of the admitting pool, after the jobs of its
        receive `before` it; handed over if the pool is closed (the daemon is
        stopping)."""
        with self._claim_lock:
            self._admitting += 1
        try:
            self._admitting_pool.submit(self._admission, job, before)
        except RuntimeError:  # closed: the daemon stops
            self._admitted(job)
            self._outcomes.hand_over(job, "shutting down")

    def _admission(self, job: Job, before: list[Job]) -> None:
        """Read what admitting the job needs and admit it, once the jobs received
        `before` it are (or a second has gone by), or settle it; a shard this daemon is
        not to hold is handed back. Never raises: what the job cannot be admitted for
        now releases it."""
        lead = self._lead.start()
        try:
            admission = self._reader.read(job)
            if admission is None:
                return
            # A new run of a rejected request: the rejection written before it came is old.
            if admission.prior.rejected:  # (one written since it was listed is this run's)
                self._notices.withdraw_rejection(admission.spec, job.received_at - CLOCK_SKEW_S)
            plan = admission.plan
            # In the order they came, so that they are fed in turn in that order; but not
            # after one that takes long (a listing past a page, tars to copy), nor for
            # long after one slow for another reason (a manifest S3 is slow to give).
            self._ledger.wait_until(_past_admission(before, self._stopping), ADMISSION_PATIENCE_S)
            # Whether a shard is one too many is decided with it admitted at once: of two
            # shards admitted side by side, the second sees the first.
            with self._claim_lock:
                spare = plan is not None and self._full_of_shards(tar=plan.tar is not None)
                if not spare:
                    self._admit(job, admission)
                    self._lead.admitted(lead)
            if spare:
                self._hand_back_spare(job)  # not to hoard a planned job's shards
                return
            if plan is not None and admission.spec is not None and not job.settled:
                self._shards.started(admission.spec, plan, held=self._ledger.waits_turn(job))
        except Exception as error:
            log.exception("job_admission_failed", message_id=job.message.message_id)
            self._outcomes.retry_later(job, f"admission failed: {error!r}")
        finally:
            self._admitted(job)

    def _admitted(self, job: Job) -> None:
        """An admission ended: the room it held is free again."""
        with self._claim_lock:
            self._admitting -= 1
            if self._tar_shard_claimed == job.key:
                self._tar_shard_claimed = None
        self._ledger.wake()

    def close(self) -> None:
        """Take no more admissions (shutdown): those under way end with their jobs,
        which shutdown hands back."""
        self._admitting_pool.shutdown(wait=False, cancel_futures=True)

    def _hand_back_spare(self, job: Job) -> None:
        """Hand back a shard this daemon is not to hold. One taken while this daemon,
        full, reads on (the jobs lane, where a worker without the shards lane sent it
        during a rollout; or the room kept to copy a tar shard ahead) waits a while: it
        would be taken again here at once."""
        on_jobs_lane = self._lanes is not None and not Lanes.of_shards(job.message)
        copying_ahead = self._full() and self._copy_ahead()
        if copying_ahead:
            self._copy_ahead_after = time.monotonic() + SPARE_WHILE_FULL_DELAY_S
        # Another shard is being admitted here (its tars copied), for longer than the
        # lane waits for it: until it is admitted this one would come back at every
        # receive.
        admitting = (
            self._tar_shard_claimed not in (None, job.key)
            and time.monotonic() - self._tar_shard_claimed_at >= ADMISSION_PATIENCE_S
        )
        waits = on_jobs_lane or copying_ahead or admitting

        delay_s = SPARE_WHILE_FULL_DELAY_S if waits else 0
        self._outcomes.hand_over(job, SPARE_SHARD, delay_s, runs_may_overlap=True)

    def _tar_shard_to_copy(self, job: Job) -> bool:
        """Whether to copy a tar shard's tars and hold it: not while full of shards, and
        one at a time (its members, how much work it is, are known only once its tars
        are copied); the others are handed back unread."""
        with self._claim_lock:
            claimed = self._tar_shard_claimed is None and not self._full_of_shards(tar=True)
            if claimed:
                self._tar_shard_claimed = job.key
                self._tar_shard_claimed_at = time.monotonic()
        if not claimed:
            self._hand_back_spare(job)
        return claimed

    def _receive(
        self, receive: Callable[[int, int, int], list[ReceivedMessage]], max_messages: int
    ) -> list[ReceivedMessage] | None:
        """The messages received, or None when the receive failed (not an empty queue)."""
        settings = self._settings
        try:
            return receive(
                max_messages, settings.receive_wait_seconds, settings.visibility_timeout_seconds
            )
        except Exception as error:
            # Its retries are spent: back off instead of hammering a failing API.
            log.warning("receive_failed", error=repr(error), retry_in_s=RECEIVE_ERROR_BACKOFF_S)
            self._stopping.wait(RECEIVE_ERROR_BACKOFF_S)
            return None

    def _drained(self, idle: bool) -> bool:
        """Whether nothing is left to do here or on the queue: nothing held (before and
        after the empty receive: a job released meanwhile may be visible again), and the
        queue's visible, in-flight and delayed counts at zero, twice in a row. In-flight
        messages may be a crashed worker's, coming back when their leases run out."""
        try:
            empty = idle and not len(self._ledger) and self._source.counts().empty
        except Exception as error:
            log.warning("queue_counts_failed", error=repr(error))
            empty = False
        self._drained_readings = self._drained_readings + 1 if empty else 0
        return self._drained_readings >= DRAINED_READINGS

    def _hold(self, message: ReceivedMessage) -> Job | None:
        """Enter a message in the ledger, leased from now; None if it is one already held
        (its lease ran out unnoticed and it came back here) or the daemon is stopping."""
        if self._ledger.adopt_redelivery(message):
            log.warning("job_redelivered_while_in_flight", message_id=message.message_id)
            return None
        # A shard's message does not wait for a seat beside the shards held.
        job = self._ledger.receive(message, seated=not Lanes.of_shards(message))
        if job is None:  # closed: nobody will renew its lease, so give it back now
            try:
                self._source.release(message.receipt_handle)
            except Exception as error:
                log.warning("release_failed", message_id=message.message_id, error=repr(error))
        return job

    def _admit(self, job: Job, admission: Admission) -> None:
        """Enter the job in the ledger, resuming from earlier deliveries' checkpoints."""
        spec, items, prior, plan = admission
        inputs = items.inputs
        job_id = spec.job_id or job.message.job_message_id
        job.ids, job.parts, job.places = items.ids, items.parts, items.places
        job.plan = plan
        log_dir = self._settings.log_dir
        job.model = self._model.result()
        job.request_digest, job.output_etags = prior.digest, prior.etags
        job.checkpoint.leftovers = prior.leftovers
        log_file = JobLog(local_log_path(log_dir, job_id, spec.output), job_id, prior.earlier_log)
        admitted = self._ledger.admit(
            job, spec, inputs, log_file, prior.resumed, cancelled=prior.cancel_requested
        )
        if not admitted:
            return  # released by shutdown meanwhile
        assert job.log is not None
        job.log.info(
            "job_received",
            items=len(inputs),
            resumed=job.resumed,
            attempt=job.attempt,
            message_id=job.message.message_id,
        )
        log.info(
            "job_received",
            job_id=job_id,
            items=len(inputs),
            resumed=job.resumed,
            attempt=job.attempt,
            message_id=job.message.message_id,
        )
        self._progress.beat()
        if job.cancelled:
            job.log.info("job_cancelled", finished=job.finished_items)
            log.info("job_cancelled", job_id=job_id, finished=job.finished_items)
        if job.state is JobState.FINISHING:  # cancelled, or every result resumed
            self._finish(job)


def _past_admission(jobs: list[Job], stopping: threading.Event) -> Callable[[], bool]:
    """Whether every one of `jobs` is admitted, settled or slow to admit, or the daemon
    is stopping."""
    return lambda: (
        stopping.is_set()
        or all(job.state is not JobState.RECEIVED or job.slow_to_admit for job in jobs)
    )


# Items the feeder takes from the ledger, and feeds in, at a time: a lock each, not one
# an item; a job admitted meanwhile waits for at most these to go in before its own.
FED_AT_ONCE = 32


class Feeder:
    """Feeds held jobs' items into the pipeline in the ledger's round-robin order; the
    one loop that waits on the pipeline."""

    def __init__(self, ledger: Ledger, pipeline: Pipeline):
        self._ledger = ledger
        self._pipeline = pipeline

    def run(self) -> None:
        while True:
            items = []
            for job, index in self._ledger.next_items(FED_AT_ONCE):
                assert job.spec is not None
                if job.started_at is None:  # its run's time counts from now (`Commit.seconds`)
                    job.started_at = time.time()
                # The params go with it to the model's process, which postprocesses (WithParams).
                value = (job.source(index), job.spec.params)
                items.append(Item(job.key, index, value, urgent=not job.background))
            self._pipeline.submit(*items)


class AdmissionLead:
    """The items the pipeline goes through while a job is admitted: the most of the
    latest `ADMISSION_LEADS` admissions of the last `LEAD_MEMORY_S`, at most `most`.
    The intake holds that many more than its prefetch. With the prefetch alone, the
    next receive came once it ran short, and the fetches in flight fell to a tenth while
    the jobs it brought were admitted (a listing at S3's latency, behind the slowest of
    its receive), twice a second at an H100's pace (`bench.gpu_shaped`). `most` and the
    memory keep an admission that took long (tars copied, a listing of pages) from
    having the daemon hold twice what it needs for long, after a busy hour too."""

    def __init__(
        self, recorded: Callable[[], int], most: int, clock: Callable[[], float] = time.monotonic
    ):
        self._recorded = recorded  # items whose results were filed so far
        self._most = most
        self._clock = clock
        self._leads: deque[tuple[float, int]] = deque(maxlen=ADMISSION_LEADS)  # (when, items)
        self._lock = threading.Lock()  # taken under the ledger's, never around it

    def start(self) -> int:
        """An admission starts: what to give `admitted` once it is."""
        return self._recorded()

    def admitted(self, started: int) -> None:
        lead = min(self._most, self._recorded() - started)
        with self._lock:
            self._leads.append((self._clock(), lead))

    def items(self) -> int:
        forgotten = self._clock() - LEAD_MEMORY_S
        with self._lock:
            while self._leads and self._leads[0][0] < forgotten:
                self._leads.popleft()
            return max((lead for _, lead in self._leads), default=0)
