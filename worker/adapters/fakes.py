"""In-memory `JobSource` and `BlobStore`, for tests and quick local runs without AWS.

They keep SQS's semantics that the daemon relies on: a received message is invisible
until its lease expires, a renewal or ack with a stale handle fails, and a released
message is visible at once.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import os
import threading
import time
import urllib.parse
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import MissingObject, ObjectTooLarge, PreconditionFailed
from worker.ports import (
    ABSENT,
    ByteRange,
    ObjectHead,
    ObjectReader,
    QueueCounts,
    ReceivedMessage,
    RemoteReader,
    S3Location,
    breakage_carried,
)


@dataclass
class _Stored:
    message_id: str
    body: str
    visible_at: float = 0.0
    receipt_handle: str | None = None
    receive_count: int = 0
    ready: bool = True  # in the ready queue
    # What a continuation carries: `ReceivedMessage`'s fields of that name.
    carried: dict[str, Any] = field(default_factory=dict)


class InMemoryJobSource:
    """A queue with visibility leases; `clock` can be a manual clock in tests.

    A receive costs the same however long the queue is, as on SQS (the speed figures
    use this fake): visible messages wait in a FIFO, leased ones in a heap by the time
    they become visible again.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._messages: dict[str, _Stored] = {}
        self._ready: deque[_Stored] = deque()
        self._hidden: list[tuple[float, int, _Stored]] = []  # (visible_at, tie-break, message)
        self._handles = itertools.count()
        self._lock = threading.Condition()
        self.dead_letters: list[tuple[ReceivedMessage, str]] = []
        self.receive_calls = 0
        self.extend_calls = 0

    def send(self, body: str, *, delay_s: int = 0, **carried: Any) -> str:
        """Enqueue a message, visible after `delay_s`, with what a continuation carries
        (`ReceivedMessage`'s fields); returns its id."""
        with self._lock:
            message_id = str(uuid.uuid4())
            stored = _Stored(message_id, body, carried=carried)
            self._messages[message_id] = stored
            if delay_s:
                stored.ready = False
                self._hide(stored, self._clock() + delay_s)
            else:
                self._ready.append(stored)
            self._lock.notify_all()
            return message_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._messages)

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        with self._lock:
            self.receive_calls += 1
            self._lock.wait_for(self._any_visible, timeout=wait_s)
            now = self._clock()
            received: list[ReceivedMessage] = []
            while self._ready and len(received) < max_messages:
                stored = self._ready.popleft()
                stored.ready = False
                if stored.message_id not in self._messages or stored.visible_at > now:
                    continue  # deleted, or leased again by a late renewal: not visible
                stored.receipt_handle = f"{stored.message_id}#{next(self._handles)}"
                stored.receive_count += 1
                self._hide(stored, now + visibility_timeout_s)
                received.append(
                    ReceivedMessage(
                        stored.message_id,
                        stored.body,
                        stored.receipt_handle,
                        stored.receive_count,
                        **stored.carried,
                    )
                )
            return received

    def _any_visible(self) -> bool:
        """Move the messages whose lease ran out to the ready queue; any there?"""
        now = self._clock()
        while self._hidden and self._hidden[0][0] <= now:
            visible_at, _, stored = heapq.heappop(self._hidden)
            current = stored.message_id in self._messages and stored.visible_at == visible_at
            if current and not stored.ready:  # not a stale entry of an earlier lease
                stored.ready = True
                self._ready.append(stored)
        return bool(self._ready)

    def _hide(self, stored: _Stored, until: float) -> None:
        stored.visible_at = until
        heapq.heappush(self._hidden, (until, next(self._handles), stored))

    def _holder(self, receipt_handle: str) -> _Stored | None:
        stored = self._messages.get(receipt_handle.split("#", maxsplit=1)[0])
        return stored if stored is not None and stored.receipt_handle == receipt_handle else None

    def ack(self, receipt_handle: str) -> None:
        with self._lock:
            stored = self._holder(receipt_handle)
            if stored is not None:
                del self._messages[stored.message_id]

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        if self.extend([receipt_handle], delay_s):
            raise LookupError(f"ReceiptHandleIsInvalid: {receipt_handle}")

    def requeue(
        self,
        message: ReceivedMessage,
        *,
        delay_s: int = 0,
        lease_ends: float | None = None,
        breakage: str | None = None,
    ) -> None:
        broke_workers, cause = breakage_carried(message, breakage)
        self.send(
            message.body,
            delay_s=delay_s,
            earlier_attempts=message.attempt,
            first_message_id=message.job_message_id,
            handed_over_from=message.message_id,
            replaced_lease_ends=lease_ends,
            broke_workers=broke_workers,
            breakage=cause,
        )

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        with self._lock:
            self.extend_calls += 1
            failures = {}
            for handle in receipt_handles:
                stored = self._holder(handle)
                if stored is None:
                    failures[handle] = "ReceiptHandleIsInvalid"
                else:
                    self._hide(stored, self._clock() + visibility_timeout_s)
            self._lock.notify_all()
            return failures

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        for body in bodies:
            self.send(body, delay_s=delay_s)

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        with self._lock:
            self.dead_letters.append((message, reason))
        return True

    def counts(self) -> QueueCounts:
        with self._lock:
            now = self._clock()
            visible = sum(stored.visible_at <= now for stored in self._messages.values())
            return QueueCounts(visible, len(self._messages) - visible, 0)


class _Objects(dict[str, bytes]):
    """Objects by `s3://bucket/key`, also filed under the prefix they sit directly in, so
    a listing costs what S3's does however many objects there are (the speed figures
    use this fake, and the daemon lists each job's output prefix); and with a
    `directory`, each also a file there."""

    def __init__(self, directory: Path | None) -> None:
        super().__init__()
        self.under: defaultdict[str, set[str]] = defaultdict(set)
        self._directory = directory

    def __setitem__(self, uri: str, data: bytes) -> None:
        super().__setitem__(uri, data)
        self.under[uri.rsplit("/", 1)[0] + "/"].add(uri)
        if self._directory is not None:
            _file_of(self._directory, uri).write_bytes(data)

    def __delitem__(self, uri: str) -> None:
        super().__delitem__(uri)
        self.under[uri.rsplit("/", 1)[0] + "/"].discard(uri)
        if self._directory is not None:
            _file_of(self._directory, uri).unlink()


def _file_of(directory: Path, uri: str) -> Path:
    return directory / urllib.parse.quote(uri, safe="")


def read_files(directory: Path, connections: int) -> ObjectReader:
    """Another process's reader of an `InMemoryBlobStore` kept in `directory`."""

    def get(
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
    ) -> bytes:
        path = _file_of(directory, str(location))
        try:
            with open(path, "rb") as file:
                first, size = byte_range or (0, os.fstat(file.fileno()).st_size)
                _check_size(size, max_bytes)
                return os.pread(file.fileno(), size, first)
        except FileNotFoundError:
            raise MissingObject(f"{location} does not exist") from None

    return get


FAKE_CHUNK_BYTES = 1000  # small, so a reader meets lines split between pieces
FAKE_LIST_PAGE = 1000  # keys in a page of a listing, as S3


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLarge(size, max_bytes)


class InMemoryBlobStore:
    """A dict of objects keyed by `s3://bucket/key`, with S3's ETags and conditions.

    With a `directory`, every object is also a file there, and other processes read the
    store from it (`remote_reader`) as the preprocessing processes read S3: the speed
    figures then run the path the daemon takes against S3.

    Its ETags are the MD5s of the bytes, as S3's are under SSE-S3; with `opaque_etags`,
    each write's is new, even of the same bytes, as under SSE-KMS (and in other
    S3-compatible stores): two writes of the same bytes are then told apart, as a
    protocol must expect."""

    def __init__(
        self,
        directory: Path | None = None,
        chunk_bytes: int = FAKE_CHUNK_BYTES,
        *,
        opaque_etags: bool = False,
    ) -> None:
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.objects = _Objects(directory)
        # Where ETags are opaque: each object's bytes as written, and its ETag, by URI.
        self._etags: dict[str, tuple[bytes, str]] | None = {} if opaque_etags else None
        self._writes = 0
        self._directory = directory
        self._chunk_bytes = chunk_bytes  # `chunks`' pieces: S3's size, for the speed figures
        self._lock = threading.Lock()
        # Each object's reads in this process (a GET each, whole, streamed or ranged),
        # which tests and figures count.
        self.reads: Counter[str] = Counter()

    def head(self, location: S3Location) -> ObjectHead:
        with self._lock:
            uri = str(location)
            if uri not in self.objects:
                raise MissingObject(f"{location} does not exist")
            return ObjectHead(self._etag(uri), len(self.objects[uri]))

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
        *,
        expect: str | None = None,
    ) -> bytes:
        with self._lock:
            uri = str(location)
            if expect is not None and uri in self.objects and self._etag(uri) != expect:
                raise PreconditionFailed(f"{location} changed since it was listed")  # unread
            self.reads[uri] += 1
            try:
                data = self.objects[uri]
            except KeyError:
                raise MissingObject(f"{location} does not exist") from None
        if byte_range is not None:
            first, size = byte_range
            data = data[first : first + size]
        _check_size(len(data), max_bytes)
        return data

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        data = self.get(location, max_bytes, expect=expect)
        for start in range(0, len(data), self._chunk_bytes):
            yield data[start : start + self._chunk_bytes]

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        uri = str(location)
        with self._lock:
            current = ABSENT if uri not in self.objects else self._etag(uri)
            if expect is not None and expect != current:
                raise PreconditionFailed(f"{location} changed since it was read")
            self.objects[uri] = data
            if self._etags is None:
                return _etag(data)
            self._writes += 1
            etag = f'"{_etag(data)[1:-1]}-w{self._writes}"'
            self._etags[uri] = (data, etag)
            return etag

    def put_file(
        self, location: S3Location, path: Path, content_type: str, *, expect: str | None = None
    ) -> str:
        return self.put(location, path.read_bytes(), content_type, expect=expect)

    def compose(
        self,
        location: S3Location,
        sources: list[tuple[S3Location, int]],
        content_type: str,
        *,
        expect: str | None = None,
    ) -> str:
        data = b"".join(self.get(source, size) for source, size in sources)
        return self.put(location, data, content_type, expect=expect)

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        start = str(prefix)
        folder = start.rsplit("/", 1)[0] + "/"
        with self._lock:
            return {
                uri[len(start) :]: self._etag(uri)
                for uri in self.objects.under[folder]
                if uri.startswith(start)
            }

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        start = str(prefix)
        bucket = f"s3://{prefix.bucket}/"
        with self._lock:
            uris = sorted(uri for uri in self.objects if uri.startswith(start))
        for page in range(0, len(uris), FAKE_LIST_PAGE):
            yield from (uri[len(bucket) :] for uri in uris[page : page + FAKE_LIST_PAGE])

    def delete(self, locations: list[S3Location]) -> None:
        with self._lock:
            for location in locations:
                if str(location) in self.objects:
                    del self.objects[str(location)]

    def _etag(self, uri: str) -> str:
        """An object's ETag (of one a test wrote into `objects` directly: its MD5)."""
        data = self.objects[uri]
        written, etag = (self._etags or {}).get(uri, (None, ""))
        return etag if written is data else _etag(data)

    def remote_reader(self) -> RemoteReader | None:
        """Reads of the files in its directory; None without one (the objects live in
        this process's memory alone)."""
        if self._directory is None:
            return None
        return RemoteReader(functools.partial(read_files, self._directory), longest_s=60.0)


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


class RecordingGuard:
    """A scale-in guard that records the states asked for; it can be told to fail."""

    name = "fake"

    def __init__(self, renew_every_s: float | None = None, failures: int = 0):
        self.renew_every_s = renew_every_s
        self.calls: list[bool] = []
        self.out_of_service = False
        self._failures = failures

    def set_protected(self, protected: bool) -> None:
        if self._failures:
            self._failures -= 1
            raise ConnectionError("protection API unreachable (fake)")
        self.calls.append(protected)

    def take_out_of_service(self) -> str:
        self.out_of_service = True
        return "recorded (fake)"
