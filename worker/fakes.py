"""In-memory `JobSource` and `BlobStore`, for tests and quick local runs without AWS.

They keep SQS's semantics that the daemon relies on: a received message is invisible
until its lease expires, a renewal or ack with a stale handle fails, and a released
message is visible at once.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from worker.ports import MissingObject, ReceivedMessage, S3Location


@dataclass
class _Stored:
    message_id: str
    body: str
    visible_at: float = 0.0
    receipt_handle: str | None = None
    receive_count: int = 0


class InMemoryJobSource:
    """A queue with visibility leases; `clock` can be a manual clock in tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._messages: dict[str, _Stored] = {}
        self._handles = itertools.count()
        self._lock = threading.Condition()
        self.dead_letters: list[tuple[ReceivedMessage, str]] = []
        self.receive_calls = 0
        self.extend_calls = 0

    def send(self, body: str) -> str:
        """Enqueue a message; returns its id."""
        with self._lock:
            message_id = str(uuid.uuid4())
            self._messages[message_id] = _Stored(message_id, body)
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
            self._lock.wait_for(lambda: bool(self._visible()), timeout=wait_s)
            now = self._clock()
            received = []
            for stored in self._visible()[:max_messages]:
                stored.visible_at = now + visibility_timeout_s
                stored.receipt_handle = f"{stored.message_id}#{next(self._handles)}"
                stored.receive_count += 1
                received.append(
                    ReceivedMessage(
                        stored.message_id, stored.body, stored.receipt_handle, stored.receive_count
                    )
                )
            return received

    def _visible(self) -> list[_Stored]:
        now = self._clock()
        return [m for m in self._messages.values() if m.visible_at <= now]

    def _holder(self, receipt_handle: str) -> _Stored | None:
        stored = self._messages.get(receipt_handle.split("#", maxsplit=1)[0])
        return stored if stored is not None and stored.receipt_handle == receipt_handle else None

    def ack(self, receipt_handle: str) -> None:
        with self._lock:
            stored = self._holder(receipt_handle)
            if stored is not None:
                del self._messages[stored.message_id]

    def release(self, receipt_handle: str) -> None:
        if self.extend([receipt_handle], 0):
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
                    stored.visible_at = self._clock() + visibility_timeout_s
            self._lock.notify_all()
            return failures

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        with self._lock:
            self.dead_letters.append((message, reason))
        self.ack(message.receipt_handle)
        return True


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
