"""A job as this daemon holds it (`Job`), its lifecycle's states and the moves between
them (`JobState`, `TRANSITIONS`), and an item's result. The ledger (`worker.jobs.ledger`)
makes the moves, one method each.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from worker.datasets.arrays import ArrayFiles
from worker.datasets.tars import Member, TarCopies
from worker.jobs.joblog import JobLog
from worker.message import JobMessage
from worker.ports import LocalPart, ReceivedMessage

if TYPE_CHECKING:
    from worker.jobs.plan import Plan
    from worker.plugins.identity import ModelIdentity


class JobSettled(Exception):
    """The job was settled (handed back at shutdown, say) while this daemon was still
    admitting it: what admits it stops."""


class JobState(StrEnum):
    # Leased from the moment it is received (the lease keeper renews every job that is
    # not settled), not yet validated.
    RECEIVED = "received"
    ADMITTED = "admitted"  # valid, its inputs known (a manifest read), waiting to be fed
    # Its items are being fed into the pipeline or are inside it (an input that could not
    # be read for now is fed again, `retry_item`).
    RUNNING = "running"
    # Every item's result is in (or the job was cancelled): its outputs are being written.
    FINISHING = "finishing"
    # Settled:
    ACKED = "acked"  # deleted from the queue: its outputs are complete
    RELEASED = "released"  # handed back to the queue, or continued as a new message
    DEAD_LETTERED = "dead_lettered"  # moved to the dead-letter queue, with the reason
    SUPERSEDED = "superseded"  # deleted unfinished: a continuation (another message) runs it


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.RECEIVED: frozenset(
        {JobState.ADMITTED, JobState.ACKED, JobState.RELEASED, JobState.DEAD_LETTERED}
    ),
    JobState.ADMITTED: frozenset(
        {JobState.RUNNING, JobState.FINISHING, JobState.RELEASED, JobState.SUPERSEDED}
    ),
    JobState.RUNNING: frozenset({JobState.FINISHING, JobState.RELEASED, JobState.SUPERSEDED}),
    # Dead-lettered while finishing: results its model's columns cannot hold (`UnfitResults`).
    JobState.FINISHING: frozenset({JobState.ACKED, JobState.RELEASED, JobState.DEAD_LETTERED}),
}


class Result(NamedTuple):
    """One item's line of results.jsonl (its newline included), and whether it records
    the item's error."""

    line: bytes
    failed: bool


SETTLED = frozenset(
    {JobState.ACKED, JobState.RELEASED, JobState.DEAD_LETTERED, JobState.SUPERSEDED}
)
FEEDABLE = frozenset({JobState.ADMITTED, JobState.RUNNING})


class JobStatus(StrEnum):
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"


def job_status(*, cancelled: bool, succeeded: int, failed: int) -> JobStatus:
    """How a job's items went (job.json's `status`)."""
    if cancelled:
        return JobStatus.CANCELLED
    if failed == 0:
        return JobStatus.SUCCEEDED
    return JobStatus.FAILED if succeeded == 0 else JobStatus.PARTIAL


@dataclass(frozen=True, slots=True)
class Place:
    """Where an item is in its job: the row of the job's listing (a result line's
    `index`), the input there, and, where that is a tar, the member."""

    index: int
    input: str
    member: str | None = None


def item_places(inputs: list[str], members: list[Member] | None, first_index: int) -> list[Place]:
    """Each item's place: one per input, or one per member of the tars that the inputs
    are (`inputs` holding each member's tar)."""
    if members is None:
        return [Place(first_index + row, uri) for row, uri in enumerate(inputs)]
    return [
        Place(first_index + member.row, uri, member.name)
        for uri, member in zip(inputs, members, strict=True)
    ]


@dataclass
class StageTiming:
    """How long one stage spent on one job's items."""

    calls: int = 0
    items: int = 0
    busy_s: float = 0.0

    def add(self, items: int, duration_s: float) -> None:
        self.calls += 1
        self.items += items
        self.busy_s += duration_s


@dataclass
class CheckpointState:
    """How far this delivery has checkpointed its job (`worker.jobs.checkpoints`)."""

    parts: int = 0
    log_mark: int = 0  # job log lines saved so far
    saved_at: float = field(default_factory=time.monotonic)  # the last part, or admission
    leftovers: bool = False  # earlier deliveries' checkpoint objects are under the output
    removed: bool = False  # the job is done and its checkpoints gone: save no more
    lock: threading.Lock = field(default_factory=threading.Lock)  # saving or removing


@dataclass(eq=False)
class Job:
    """One message held by this daemon, from its receive until it is settled."""

    key: str  # unique per delivery: a redelivered message is a new job here
    message: ReceivedMessage
    state: JobState = JobState.RECEIVED
    receipt_handle: str = ""
    received_at: float = field(default_factory=time.time)
    started_at: float | None = None  # when its first item was fed
    # Its admission takes long (a listing past a page, tars to copy): the jobs received
    # after it do not wait for it to be admitted before their own admission.
    slow_to_admit: bool = False
    lease_lost: bool = False
    # Known once admitted:
    job_id: str = ""
    spec: JobMessage | None = None
    inputs: list[str] = field(default_factory=list)  # each item's (a member's: its tar)
    ids: list[Any] | None = None  # each item's id, where its table gives them
    places: list[Place] = field(default_factory=list)  # each item's
    parts: list[LocalPart] | None = None  # each item's bytes, where the inputs are tars
    tar_copies: TarCopies | None = None  # from admission, where the inputs are tars
    log: JobLog | None = None
    results: list[Result | None] = field(default_factory=list)
    arrays: ArrayFiles | None = None  # its array outputs, from admission
    fed: int = 0  # the feed's place in `inputs`
    unfed: int = 0  # items not fed yet
    item_retries: dict[int, int] = field(default_factory=dict)  # fed again, by index
    release_delay_s: int = 0  # once released: how long it is to stay hidden
    succeeded: int = 0
    failed: int = 0
    resumed: int = 0  # results an earlier delivery checkpointed
    cancelled: bool = False
    unsaved: list[int] = field(default_factory=list)  # results not yet checkpointed
    model: ModelIdentity | None = None  # the model it runs on, part of its request
    request_digest: str = ""
    output_etags: dict[str, str] = field(default_factory=dict)  # as seen at admission
    checkpoint: CheckpointState = field(default_factory=CheckpointState)
    progress_reported: int = 0
    timings: defaultdict[str, StageTiming] = field(default_factory=lambda: defaultdict(StageTiming))
    device_s: float = 0.0  # its share of the batches it was in, on the models' devices
    plan: Plan | None = None  # of the job it is a shard of
    committed: bool = False  # its commit marker is written: a finish tried again merges only

    def __post_init__(self) -> None:
        self.receipt_handle = self.receipt_handle or self.message.receipt_handle
        self.job_id = self.job_id or self.message.job_message_id

    def source(self, position: int) -> str | LocalPart:
        """Where the item's bytes are read: its object, or its member's in a tar's copy."""
        return self.parts[position] if self.parts is not None else self.inputs[position]

    @property
    def attempt(self) -> int:
        return self.message.attempt

    @property
    def background(self) -> bool:
        """A shard of a planned job: work nobody waits on item by item, which the jobs
        users wait for pass (`Item.urgent`, `Ledger.bound_background`)."""
        return self.plan is not None

    @property
    def suspect(self) -> bool:
        """Whether it was in the failing work of a worker that broke: it is run apart."""
        return self.message.broke_workers > 0

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    @property
    def finished_items(self) -> int:
        return self.succeeded + self.failed

    @property
    def outstanding_items(self) -> int:
        """Items admitted and not yet back from the pipeline."""
        return len(self.inputs) - self.finished_items

    @property
    def status(self) -> JobStatus:
        return job_status(cancelled=self.cancelled, succeeded=self.succeeded, failed=self.failed)
