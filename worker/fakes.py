"""In-memory `JobSource` and `BlobStore`, for tests and quick local runs without AWS.

They keep SQS's semantics that the daemon relies on: a received message is invisible
until its lease expires, a renewal or ack with a stale handle fails, and a released
message is visible at once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from worker.errors import MissingObject
from worker.ports import QueueCounts, ReceivedMessage, S3Location


@dataclass
class _Stored:
    message_id: str
    body: str
    visible_at: float = 0.0
    receipt_handle: str | None = None
    receive_count: int = 0
    ready: bool = True  # in the ready queue


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

    def send(self, body: str) -> str:
        """Enqueue a message; returns its id."""
        with self._lock:
            message_id = str(uuid.uuid4())
            stored = _Stored(message_id, body)
            self._messages[message_id] = stored
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
                        stored.message_id, stored.body, stored.receipt_handle, stored.receive_count
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

    def extend(self, receipt_handles: list[str], visibility_timeout_s: int) -> dict[str, str]:
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

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        with self._lock:
            self.dead_letters.append((message, reason))
        return True

    def counts(self) -> QueueCounts:
        with self._lock:
            now = self._clock()
            visible = sum(stored.visible_at <= now for stored in self._messages.values())
            return QueueCounts(visible, len(self._messages) - visible, 0)


class InMemoryBlobStore:
    """A dict of objects keyed by `s3://bucket/key`."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, location: S3Location) -> bytes:
        with self._lock:
            try:
                return self.objects[str(location)]
            except KeyError:
                raise MissingObject(f"{location} does not exist") from None

    def put(self, location: S3Location, data: bytes, content_type: str) -> None:
        with self._lock:
            self.objects[str(location)] = data


class RecordingGuard:
    """A scale-in guard that records the states asked for; it can be told to fail."""

    name = "fake"

    def __init__(self, renew_every_s: float | None = None, failures: int = 0):
        self.renew_every_s = renew_every_s
        self.calls: list[bool] = []
        self._failures = failures

    def set_protected(self, protected: bool) -> None:
        if self._failures:
            self._failures -= 1
            raise ConnectionError("protection API unreachable (fake)")
        self.calls.append(protected)
