"""The small interfaces the daemon talks to; AWS and in-memory versions implement them."""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple, Protocol

# SQS quotas (https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/quotas-messages.html)
SQS_MAX_VISIBILITY_TIMEOUT_S = 12 * 60 * 60
SQS_MAX_RECEIVE_WAIT_S = 20
SQS_MAX_MESSAGES_PER_RECEIVE = 10
SQS_MAX_ENTRIES_PER_BATCH_CALL = 10
SQS_MAX_DELAY_S = 15 * 60
# What a name that reaches a file path (a job id, a message id naming a job) may be.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(?P<key>.*)$")
# S3's longest key, in bytes of UTF-8
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/object-keys.html), and so the
# longest URI (a bucket name is at most 63 characters): a longer one names no object.
S3_MAX_KEY_BYTES = 1024
S3_MAX_URI_BYTES = len("s3://") + 63 + len("/") + S3_MAX_KEY_BYTES
# How much of a URI that is refused its message quotes (it may be a megabyte long).
_SHOWN_CHARS = 100


@dataclass(frozen=True, slots=True)
class S3Location:
    """A bucket and key (or key prefix)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """Split `s3://bucket/key`; raises ValueError for anything else, a key over
        `S3_MAX_KEY_BYTES` included (the message quotes the URI's start only)."""
        match = _S3_URI.match(uri)
        if not match:
            raise ValueError(f"not an s3://bucket/key URI: {_shown(uri)}")
        key = match["key"]
        # Counted in characters first: a long one is not encoded to be measured.
        if len(key) > S3_MAX_KEY_BYTES or len(key.encode()) > S3_MAX_KEY_BYTES:
            raise ValueError(f"a key over S3's limit of {S3_MAX_KEY_BYTES} bytes: {_shown(uri)}")
        return cls(match["bucket"], key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def _shown(text: str) -> str:
    """`text` as an error quotes it: its start, and its length if that is cut."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


class LocalPart(NamedTuple):
    """Bytes of a file on this machine: a member of a tar copied here
    (`worker.datasets.tars`), which the fetchers read in place of an object, or, once the
    copy is gone (its job settled), from the tar itself by a ranged GET. (A tuple: it
    crosses to the preprocessing processes with every member, and a frozen dataclass
    pickles field by field, several times slower.)"""

    path: str
    offset: int
    size: int
    tar: str  # the tar's URI


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """A queue's approximate message counts, as SQS reports them."""

    visible: int
    in_flight: int  # received and not yet deleted, or hidden by a delayed release
    delayed: int  # sent with a delay that has not yet passed

    @property
    def empty(self) -> bool:
        return self.visible == self.in_flight == self.delayed == 0


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """A message as received, with what the lease and the summary need."""

    message_id: str
    body: str
    receipt_handle: str
    receive_count: int
    # Set on a continuation (`JobSource.requeue`): the deliveries before it, the
    # message the job was first sent as, which names it when its body does not, and
    # the message it replaces.
    earlier_attempts: int = 0
    first_message_id: str = ""
    handed_over_from: str = ""
    # By when (epoch seconds, the sender's clock) the message it replaces can have come
    # back, if its worker died before deleting it; None: it cannot.
    replaced_lease_ends: float | None = None
    # How many workers broke with the job's items in the work that failed, and why the
    # last one did: a suspect, run apart from other jobs (`JobSource.requeue`).
    broke_workers: int = 0
    breakage: str = ""
    # Why those attributes cannot be taken (they did not parse): the message is poison.
    attributes_problem: str = ""

    @property
    def attempt(self) -> int:
        """Deliveries of the job so far, this one included."""
        return self.earlier_attempts + self.receive_count

    @property
    def job_message_id(self) -> str:
        return self.first_message_id or self.message_id


MAX_BREAKAGE_CHARS = 500
# Characters an SQS message attribute may not hold.
SQS_UNSENDABLE = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def breakage_carried(message: ReceivedMessage, breakage: str | None) -> tuple[int, str]:
    """How many broken workers, and the last one's cause, a continuation of `message`
    carries (`JobSource.requeue`)."""
    if breakage is None:
        return message.broke_workers, message.breakage
    breakage = SQS_UNSENDABLE.sub("?", breakage)
    if len(breakage) > MAX_BREAKAGE_CHARS:  # its start says where, its end what (a traceback)
        head = MAX_BREAKAGE_CHARS // 5
        breakage = f"{breakage[:head]} ... {breakage[head + 5 - MAX_BREAKAGE_CHARS :]}"
    return message.broke_workers + 1, breakage


class JobSource(Protocol):
    """A queue of job messages with leases (SQS)."""

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        """Long-poll for up to `max_messages`, leased for `visibility_timeout_s`."""

    def ack(self, receipt_handle: str) -> None:
        """Delete a finished message."""

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        """Make a message visible again after `delay_s` (0: at once) for another try."""

    def requeue(
        self,
        message: ReceivedMessage,
        *,
        delay_s: int = 0,
        lease_ends: float | None = None,
        breakage: str | None = None,
    ) -> None:
        """Send the job again as a new message, visible after `delay_s`, that carries its
        attempts so far, the id of the message it replaces and when that one's lease
        ends (the caller then acks the old one): a continuation starts at receive count
        1, so an interruption does not spend the queue's maxReceiveCount. With
        `breakage` (why this worker broke, with the job's items in the work that
        failed), it carries one more broken worker and that cause; else as many as
        the message did."""

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        """Renew leases, no call started after `within_s` where it is given, and no retry
        that could not end by then; returns the error code of each handle that could not
        be renewed (a call that failed is reported so, never raised)."""

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        """Send new messages (a planned job's shards), in the message group `group` (the
        tenant a fair queue balances), visible after `delay_s`; raises if any could not
        be sent."""

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        """Copy a message to the dead-letter queue with `reason` (the caller then acks
        it); False if there is none."""

    def counts(self) -> QueueCounts:
        """The queue's visible, in-flight and delayed message counts."""


ABSENT = ""  # `BlobStore.put(expect=ABSENT)`: the object must not exist yet
RENEWAL_FAILED = "RenewalFailed"  # `JobSource.extend`'s code for a lease whose call failed
# Bytes of an object from a first byte: (offset, size).
ByteRange = tuple[int, int]


class ObjectReader(Protocol):
    """`BlobStore.get`, in another process."""

    def __call__(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
    ) -> bytes: ...


@dataclass(frozen=True)
class RemoteReader:
    """How another process (a stage's child) reads a store with a client of its own:
    there, `open(n)` gives `get(location, max_bytes) -> bytes` (`BlobStore.get`) for up
    to `n` reads at once, each within `longest_s` however it is retried. `open` must be
    picklable; it needs the modules `imports` (which a server process forking readers
    may import once)."""

    open: Callable[[int], ObjectReader]
    longest_s: float
    imports: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ObjectHead:
    """What S3 says of an object without its bytes (HEAD)."""

    etag: str
    size: int


class BlobStore(Protocol):
    """Object storage (S3)."""

    def head(self, location: S3Location) -> ObjectHead:
        """The object's ETag and size; raises as `get` does."""

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
        *,
        expect: str | None = None,
    ) -> bytes:
        """The object's bytes (those of `byte_range` only, a ranged GET, if given);
        raises `MissingObject`, `AccessDenied` or `TransientError` (after its own
        retries), `ObjectTooLarge` (without reading it) if they are over `max_bytes`, or
        another error that retrying will not cure. With `expect`, read only if the
        object still has that ETag (If-Match): `PreconditionFailed` if it was replaced."""

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        """The object's bytes in pieces as they are read, never more than `max_bytes` of
        it in all; raises as `get` does. With `expect`, read only if the object still has
        that ETag (If-Match): `PreconditionFailed` if it was replaced."""

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        """Write (or overwrite) an object; returns its new ETag. With `expect` the write
        is conditional: `ABSENT` if the object must not exist yet, else the ETag it must
        still have; `PreconditionFailed` if it does not hold (another writer was first)."""

    def put_file(
        self, location: S3Location, path: Path, content_type: str, *, expect: str | None = None
    ) -> str:
        """`put` of a local file's content, which may be too big to hold in memory."""

    def compose(
        self,
        location: S3Location,
        sources: list[tuple[S3Location, int]],
        content_type: str,
        *,
        expect: str | None = None,
    ) -> str:
        """Write the concatenation of `sources` (each with its size in bytes), in order,
        as one object, on `expect`'s condition as `put`; returns its ETag. S3 copies
        what it can on its side; the rest is streamed through this process."""

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        """The objects directly under `prefix` (names after it, none with a "/"), each
        with its ETag."""

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        """The key of every object whose key starts with `prefix`'s, in S3's order (by
        UTF-8 bytes), one page of the listing read at a time."""

    def delete(self, locations: list[S3Location]) -> None:
        """Remove objects; one that is already gone is no error."""

    def remote_reader(self) -> RemoteReader | None:
        """How another process reads this store, or None if only this one can."""


class ScaleInGuard(Protocol):
    """Turns scale-in protection of this machine (instance or task) on or off."""

    name: str
    renew_every_s: float | None  # protection that expires by itself is renewed this often

    def set_protected(self, protected: bool) -> None: ...

    def take_out_of_service(self) -> str:
        """Have the platform replace this machine (it keeps breaking its workers); says
        what was done."""


class NoticeKind(StrEnum):
    REBALANCE = "rebalance"  # the instance is at risk: take no new work
    TERMINATION = "termination"  # the instance is going away: hand back what cannot finish


@dataclass(frozen=True)
class Notice:
    """Word from the platform that this machine is going away, before any signal.

    `deadline` is when it goes (epoch seconds), where the notice says; `acknowledge`,
    where the platform waits for one (a lifecycle hook), tells it the daemon is done."""

    kind: NoticeKind
    cause: str  # spot-interruption, scale-in, rebalance-recommendation
    deadline: float | None = None
    acknowledge: Callable[[], None] | None = None


class NoticeSource(Protocol):
    """Where interruption notices appear (instance metadata)."""

    def poll(self) -> Notice | None:
        """The most serious notice standing now, or None."""
