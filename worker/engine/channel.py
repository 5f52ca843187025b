"""A bounded, closable FIFO channel between pipeline stages, with a lane ahead.

`queue.Queue` cannot wake its blocked readers and writers on shutdown, so every stage
would need sentinels or timeouts. Closing a `Channel` wakes them all with `Closed`,
which is the one way threads of the engine learn that the pipeline is stopping.

Entries that `ahead` picks out are taken before the others, in the order they came: an
urgent item passes the background work queued before it at every stage.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Closed(Exception):
    """The channel was closed: the reader or writer should stop."""


class Channel(Generic[T]):
    """A FIFO of at most `capacity` entries, those `ahead` picks out first; `put` blocks
    when full, `get` when empty."""

    def __init__(self, capacity: int, ahead: Callable[[T], bool] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._ahead = ahead
        self._first: deque[T] = deque()  # the entries `ahead` picked out
        self._entries: deque[T] = deque()
        self._closed = False
        self._taking = 0  # readers waiting in `take`
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)

    def __len__(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return len(self._first) + len(self._entries)

    def put(self, entry: T) -> None:
        """Append `entry`, waiting for room; raises `Closed` once closed."""
        self.put_all((entry,))

    def put_all(self, entries: Iterable[T]) -> None:
        """Append `entries` in order, each once there is room for it, under one lock
        while there is (a batch handed on at once); raises `Closed` once closed."""
        added = 0
        with self._not_full:
            for entry in entries:
                while self._held() >= self._capacity and not self._closed:
                    self._wake_readers(added)  # they take what is in first
                    added = 0
                    self._not_full.wait()
                if self._closed:
                    raise Closed
                ahead = self._ahead is not None and self._ahead(entry)
                (self._first if ahead else self._entries).append(entry)
                added += 1
            self._wake_readers(added)

    def _wake_readers(self, added: int) -> None:
        """After `added` entries came in: a reader each, or every reader while one waits
        for several (`take`), which a wake-up meant for another could leave waiting."""
        if self._taking:
            self._not_empty.notify_all()
        elif added:
            self._not_empty.notify(added)

    def get(self) -> T:
        """Take the oldest entry, waiting for one; raises `Closed` once closed."""
        return self.get_batch(1, 0.0)[0]

    def get_batch(
        self, max_entries: int, max_wait_s: float, unless: Callable[[], bool] | None = None
    ) -> list[T]:
        """Take 1 to `max_entries` entries.

        Waits as long as needed for the first entry, then at most `max_wait_s` more for
        the batch to fill, so a lone item is not held back waiting for company. Returns
        nothing if `unless()` holds while it waits for the first (checked on `wake`).
        """
        with self._not_empty:
            while not self._held() and not self._closed:
                if unless is not None and unless():
                    return []
                self._not_empty.wait()
            deadline = time.monotonic() + max_wait_s
            while self._held() < max_entries and not self._closed:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    break
                self._not_empty.wait(remaining_s)
            if self._closed:
                raise Closed
            batch = self._take(min(max_entries, self._held()))
            if self._held():
                self._not_empty.notify()
            return batch

    def take(self, count: int) -> list[T]:
        """Take `count` entries together, waiting until that many are in (none taken
        meanwhile); raises `Closed` once closed."""
        if count > self._capacity:
            raise ValueError(f"{count} entries asked of a channel of {self._capacity}")
        with self._not_empty:
            self._taking += 1
            try:
                while self._held() < count and not self._closed:
                    self._not_empty.wait()
            finally:
                self._taking -= 1
            if self._closed:
                raise Closed
            taken = self._take(count)
            if self._held():
                self._not_empty.notify()
            return taken

    def take_now(self, count: int) -> list[T] | None:
        """Take `count` entries if that many are in now, else none: never waits."""
        with self._lock:
            if self._closed:
                raise Closed
            if self._held() < count:
                return None
            return self._take(count)

    def _take(self, count: int) -> list[T]:
        """The first `count` entries, those ahead first (the lock held, `count` there)."""
        taken = [(self._first if self._first else self._entries).popleft() for _ in range(count)]
        self._not_full.notify(count)
        return taken

    def wake(self) -> None:
        """Have every reader waiting for an entry check its `unless` again."""
        with self._lock:
            self._not_empty.notify_all()

    def close(self) -> None:
        """Wake every waiter with `Closed`; entries still inside are dropped."""
        with self._lock:
            self._closed = True
            self._first.clear()
            self._entries.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
