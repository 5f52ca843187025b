"""One job's fleet in one process, for the protocol's state machine
(`tests/test_protocol_properties.py`): one store with S3's conditional writes whose
ETags are not MD5s, one queue with SQS's delays and leases, a clock the test moves, and
daemons that take one message each with the daemon's own intake and finisher, their
calls made through a `Caller` (`tests.support.gated`). A job's results are JSON Lines
or Parquet files of two rows each, so that a merge's join writes several."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.gated import Caller, GatedQueue, GatedStore
from worker.adapters.fakes import InMemoryBlobStore
from worker.datasets.arrays import ArraySpool
from worker.datasets.disk import DiskBudget
from worker.datasets.tables import JSON_LINES, Tables
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job, JobState, Result
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Lifecycle, Outcomes
from worker.loops.intake import Intake
from worker.loops.results import Finisher
from worker.plugins.identity import ModelIdentity
from worker.ports import SQS_MAX_DELAY_S, ReceivedMessage, S3Location
from worker.settings import Settings
from worker.sharding.merging import JoinSpace, Merger
from worker.sharding.planning import Planner
from worker.sharding.shards import Shards
from worker.sharding.stragglers import Stragglers
from worker.telemetry.metrics import Metrics
from worker.telemetry.progress import Progress

OUTPUT = "s3://bkt/out/j/"
JOB_ID = "j"
MODEL = ModelIdentity(name="m", version="1", digest="sha256:" + "0" * 64)
LEASE_S = 30  # a received message's visibility, renewed while its daemon lives
MOST_DELIVERIES = 300  # a job whose messages, run one after another, take more never ends
START_S = 1_800_000_000.0
# The model's answer to zeros (the columns its Parquet results have), and the settings
# that cut them into files of two rows: a row group of two (a row's columns take about
# 50 bytes), a file closed after each.
PROBE = json.dumps({"label": ""}).encode()
PARQUET_ROW_GROUP_BYTES = 120


class ModelClock:
    """The time the protocol's modules read (`time.time`), moved on by the test: a
    watch comes due, a merge claim runs out, a shard straggles when it says so."""

    def __init__(self) -> None:
        self.now = START_S

    def time(self) -> float:
        return self.now


CLOCK = ModelClock()


def one_after_another(function: Callable[[Any], Any], arguments: Iterable[Any]) -> list[Any]:
    """`each_at_once` one call at a time, in order: calls side by side would make the
    order in which they reach the store the threads', not the test's."""
    return [function(argument) for argument in arguments]


@dataclass
class _Message:
    message_id: str
    body: str
    visible_at: float
    carried: dict[str, Any] = field(default_factory=dict)
    receive_count: int = 0
    handle: str = ""
    holder: str = ""  # the actor that holds its lease now, while it lives


class Queue:
    """A queue with SQS's semantics as far as the protocol goes: a delayed message is
    not delivered before its delay; a delivered one is hidden while its daemon lives
    (its lease renewed) and for a lease after it dies; a delete or release with a
    handle not the latest does nothing; a dead letter is kept."""

    def __init__(self) -> None:
        self.messages: dict[str, _Message] = {}
        self.dead_letters: list[str] = []
        self._ids = itertools.count(1)

    def send(self, body: str, delay_s: int = 0, **carried: Any) -> str:
        message_id = f"m{next(self._ids)}"
        self.messages[message_id] = _Message(message_id, body, CLOCK.now + delay_s, carried)
        return message_id

    def visible(self) -> list[str]:
        return [m.message_id for m in self.messages.values() if m.visible_at <= CLOCK.now]

    def deliver(self, message_id: str, holder: str) -> ReceivedMessage:
        message = self.messages[message_id]
        message.receive_count += 1
        message.handle = f"{message_id}#{message.receive_count}"
        message.holder, message.visible_at = holder, math.inf
        return ReceivedMessage(
            message_id, message.body, message.handle, message.receive_count, **message.carried
        )

    def let_go(self, holder: str) -> None:
        """The daemon `holder` ended or died: a message it still holds comes back once
        its lease runs out (nothing renews it now)."""
        for message in self.messages.values():
            if message.holder == holder:
                message.holder, message.visible_at = "", CLOCK.now + LEASE_S

    def _held(self, handle: str) -> _Message | None:
        message = self.messages.get(handle.split("#", 1)[0])
        return message if message is not None and message.handle == handle else None

    # JobSource, as the daemons call it:

    def ack(self, receipt_handle: str) -> None:
        if (message := self._held(receipt_handle)) is not None:
            del self.messages[message.message_id]

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        message = self._held(receipt_handle)
        if message is None:
            raise LookupError(f"ReceiptHandleIsInvalid: {receipt_handle}")
        message.holder, message.visible_at = "", CLOCK.now + delay_s

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        failures = {}
        for handle in receipt_handles:
            if (message := self._held(handle)) is None:
                failures[handle] = "ReceiptHandleIsInvalid"
            elif visibility_timeout_s == 0:
                message.holder, message.visible_at = "", CLOCK.now
        return failures

    def requeue(self, message: ReceivedMessage, *, delay_s: int = 0, **_: Any) -> None:
        """A continuation: what it carries of the message it replaces."""
        self.send(
            message.body,
            delay_s,
            earlier_attempts=message.attempt,
            first_message_id=message.job_message_id,
            handed_over_from=message.message_id,
        )

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        for body in bodies:
            self.send(body, delay_s)

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        self.dead_letters.append(f"{message.message_id}: {reason}")
        return True


def _result(index: int, uri: str) -> bytes:
    """What the model answers for an input, the same on every run of it."""
    return json.dumps({"index": index, "input": uri, "label": f"label-{index * 7 % 5}"}).encode()


class Daemon:
    """The parts of a daemon that take a message: its intake (and the planner, shards,
    merger and stragglers under it) and its finisher, each call to S3 and SQS made
    through `caller`."""

    def __init__(self, world: World, caller: Caller, name: str) -> None:
        blobs: Any = GatedStore(world.store, caller, OUTPUT)
        source: Any = GatedQueue(world.queue, caller)
        self._ledger = ledger = Ledger()
        metrics, progress = world.metrics, Progress(3600.0)
        self._checkpoints = checkpoints = Checkpoints(blobs, ledger)
        self._outcomes = outcomes = Outcomes(
            ledger,
            source,
            metrics,
            progress,
            retry_delay_s=1,
            checkpoints=checkpoints,
            lease_s=LEASE_S,
        )
        lifecycle = Lifecycle(ledger, outcomes, metrics, progress)
        worker_info = {"host": name}
        disk = DiskBudget(2**30)
        tables = world.tables
        self._shards = shards = Shards(
            blobs,
            source,
            checkpoints,
            lifecycle,
            Merger(
                blobs,
                checkpoints,
                tables,
                worker_info=worker_info,
                device_hour_price=None,
                join_space=JoinSpace(world.arrays, disk, progress.beat),
            ),
        )
        self._finisher = finisher = Finisher(
            blobs,
            checkpoints,
            shards,
            tables,
            lifecycle,
            worker_info=worker_info,
            notify=[world.notices.append],
            capacity=1,
            device_hour_price=None,
        )
        self._intake = Intake(
            world.settings,
            source,
            blobs,
            lifecycle,
            threading.Event(),
            model=world.model,
            checkpoints=checkpoints,
            planner=Planner(blobs, source, lifecycle),
            shards=shards,
            stragglers=Stragglers(
                blobs,
                source,
                shards,
                outcomes,
                announce_merged=finisher.notices.merged,
                lost_after_s=world.settings.max_lease_seconds + SQS_MAX_DELAY_S,
            ),
            finish=finisher._finish,
            notices=finisher.notices,
            on_drained=lambda: None,
            arrays=world.arrays,
            disk=disk,
        )

    def take(self, message: ReceivedMessage) -> None:
        """Admit the message as the intake does (a job is planned, a watch carried out);
        a shard admitted runs: its items' results, a checkpoint half-way, the check for
        another run's commit that a running shard makes, and its finish."""
        job = self._ledger.receive(message)
        assert job is not None
        job.received_at = CLOCK.now
        # The intake's and the finisher's own steps for one job, without their loops.
        self._intake._admission(job, [])
        if job.state is JobState.ADMITTED:
            self._run(job)
        assert not self._ledger.unsettled(), "a message taken was never settled"

    def _run(self, job: Job) -> None:
        job.started_at = CLOCK.now
        fed = []
        while job.unfed:
            fed += self._ledger.next_items(job.unfed)
        for number, (_, index) in enumerate(fed, 1):
            place = job.places[index]
            self._ledger.record(
                job.key, index, Result(_result(place.index, place.input) + b"\n", False)
            )
            if number == len(fed) // 2:
                self._checkpoints.save(job)
                if self._committed_elsewhere(job):
                    self._outcomes.duplicate(job)
                    return
        self._finisher._finish(job)

    def _committed_elsewhere(self, job: Job) -> bool:
        """As the progress reporter asks of a running shard: a check that fails is made
        again at its next interval."""
        try:
            return job.plan is not None and self._shards.committed_elsewhere(job)
        except Exception:
            return False


class RecordingStore(InMemoryBlobStore):
    """The store, with ETags that are not MD5s; it counts its changes, and the writes of
    job.json."""

    def __init__(self) -> None:
        super().__init__(opaque_etags=True)
        self.changes = 0
        self.job_json_writes = 0

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        etag = super().put(location, data, content_type, expect=expect)
        self.changes += 1
        if str(location) == OUTPUT + "job.json":
            self.job_json_writes += 1
        return etag

    def delete(self, locations: list[S3Location]) -> None:
        super().delete(locations)
        self.changes += 1

    def copy(self) -> RecordingStore:
        """Another store holding the same objects, with the same ETags."""
        store = RecordingStore()
        for uri, data in self.objects.items():  # filed under their prefixes too
            store.objects[uri] = data
        store._etags, store._writes = copy.copy(self._etags), self._writes
        store.changes, store.job_json_writes = self.changes, self.job_json_writes
        return store


class World:
    """One store, one queue, and what the daemons share besides."""

    def __init__(self, settings: Settings, arrays: ArraySpool, tables: Tables) -> None:
        self.settings = settings
        self.arrays = arrays
        self.tables = tables  # the daemons' writer of Parquet results, its columns probed
        self.store = RecordingStore()
        self.queue = Queue()
        self.notices: list[str] = []
        self.metrics = Metrics()
        self.model: Future[ModelIdentity] = Future()
        self.model.set_result(MODEL)

    def copy(self) -> World:
        """Another world as this one is now: the same objects and messages."""
        world = World(self.settings, self.arrays, self.tables)
        world.store = self.store.copy()
        world.queue = copy.deepcopy(self.queue)
        world.notices = list(self.notices)
        return world

    def names(self) -> set[str]:
        return {uri.removeprefix(OUTPUT) for uri in self.store.objects if uri.startswith(OUTPUT)}

    def run_to_end(self) -> None:
        """Deliver the messages one after another, each run to its end on a daemon of its
        own, time passing as the earliest one comes due, until none is left."""
        for number in itertools.count(1):
            if not self.queue.messages:
                return
            assert number <= MOST_DELIVERIES, f"messages still coming: {self.queue.messages}"
            due = min(message.visible_at for message in self.queue.messages.values())
            CLOCK.now = max(CLOCK.now, due)
            message_id = min(self.queue.visible(), key=lambda m: int(m.removeprefix("m")))
            name = f"end-{number}"
            Daemon(self, Caller(), name).take(self.queue.deliver(message_id, name))
            self.queue.let_go(name)


def job_body(inputs: list[str], shard_items: int | None, results_format: str) -> str:
    """The job's message: `inputs`, split in shards of `shard_items` (None: whole), its
    results in `results_format` ("jsonl" or "parquet")."""
    body: dict[str, Any] = {
        "job_id": JOB_ID,
        "inputs": inputs,
        "output": OUTPUT,
        "format": results_format,
    }
    if shard_items is not None:
        body["shard_items"] = shard_items
    return json.dumps(body)


def world_at(directory: Path) -> World:
    """A world whose daemons keep their files in `directory` (its `arrays` to close)."""
    arrays = ArraySpool(directory / "arrays")
    arrays.open()
    arrays.layouts = {}  # the model writes no array files
    settings = Settings(
        queue_url="q",
        log_dir=directory,
        metrics_port=0,
        parquet_file_bytes=1,
        parquet_row_group_bytes=PARQUET_ROW_GROUP_BYTES,
    )
    tables = Tables(settings.parquet_file_bytes, settings.parquet_row_group_bytes)
    tables.probed(PROBE, {})  # once for the game: it reads the answer as JSON, in ms
    return World(settings, arrays, tables)


@functools.cache
def unsharded(items: int, results_format: str) -> tuple[list[Any], dict[str, Any]]:
    """The results (`results`) and job.json of the job of `items` inputs run whole, on
    one daemon."""
    now = CLOCK.now
    with tempfile.TemporaryDirectory() as directory:
        world = world_at(Path(directory))
        world.queue.send(job_body(inputs(items), None, results_format))
        try:
            world.run_to_end()
        finally:
            world.arrays.close()
            CLOCK.now = now
        summary = json.loads(world.store.objects[OUTPUT + "job.json"])
        return results(world, summary), summary


def results(world: World, summary: dict[str, Any]) -> list[Any]:
    """The results of the job.json `summary`: results.jsonl's bytes, or the rows of the
    Parquet files it names, read in the order it names them."""
    if summary["format"] == JSON_LINES:
        return [world.store.objects[OUTPUT + "results.jsonl"]]
    rows = []
    for name in summary["outputs"]:
        if name.endswith(".parquet"):
            rows += _rows(world.store.objects[OUTPUT + name])
    return rows


@functools.cache
def _rows(parquet: bytes) -> tuple[dict[str, Any], ...]:
    """A Parquet file's rows (read once: a game's runs write the same files many times)."""
    return tuple(pq.read_table(pa.BufferReader(parquet)).to_pylist())


def inputs(items: int) -> list[str]:
    """The job's inputs (never read: the model's answers are made up, `_result`)."""
    return [f"s3://bkt/img/{index}" for index in range(items)]
