"""A bounded, closable FIFO channel between pipeline stages, with a lane ahead.

`queue.Queue` cannot wake its blocked readers and writers on shutdown, so every stage
would need sentinels or timeouts. Closing a `Channel` wakes them all with `Closed`,
which is the one way threads of the engine learn that the pipeline is stopping.

Entries that `ahead` picks out are taken before the others, in the order they came: an
urgent item passes the background work queued before it at every stage.

A batch waits for company counting from when its oldest entry came in, not from when a
reader asked (as Triton's dynamic batcher does): entries that waited while the device
ran the batch before go at once, and one that just came waits at most as long.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

# Which entries to take (`Channel.get_chosen`): given the entries, when each came in and
# the time now, their positions, or the seconds it may wait at most for more.
Choose = Callable[[Sequence[T], Sequence[float], float], "list[int] | float"]


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
        # When each entry came in (`time.monotonic()`), beside it.
        self._first_at: deque[float] = deque()
        self._entries_at: deque[float] = deque()
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
        now = time.monotonic()
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
                (self._first_at if ahead else self._entries_at).append(now)
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

        Waits as long as needed for the first entry, then for the batch to fill until
        the oldest entry has waited `max_wait_s`, so a lone item is not held back waiting
        for company, and entries that waited already go at once. Returns nothing if
        `unless()` holds while it waits for the first (checked on `wake`).
        """
        with self._not_empty:
            if not self._first_came(unless):
                return []
            deadline = self._oldest_at() + max_wait_s
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

    def get_chosen(
        self, choose: Choose[T], window: int, unless: Callable[[], bool] | None = None
    ) -> list[T]:
        """Take the entries `choose` picks among the first `window` (those ahead first,
        then oldest first), waiting for the first entry and then until it picks some:
        it is given them, when each came in and the time now, and answers the positions
        to take, or how long it may wait at most (asked again as more come). Returns
        nothing if `unless()` holds while it waits for the first (checked on `wake`)."""
        with self._not_empty:
            while True:
                if not self._first_came(unless):
                    return []
                chosen = self._chosen(choose, window)
                if isinstance(chosen, list):
                    if self._held():
                        self._not_empty.notify()
                    return chosen
                self._not_empty.wait(chosen)

    def _first_came(self, unless: Callable[[], bool] | None) -> bool:
        """Wait for an entry (the lock held): False if `unless()` held first; raises
        `Closed` once closed."""
        while not self._held() and not self._closed:
            if unless is not None and unless():
                return False
            self._not_empty.wait()
        if self._closed:
            raise Closed
        return True

    def take_chosen_now(self, choose: Choose[T], window: int) -> list[T] | None:
        """Take the entries `choose` picks now (`get_chosen`), or none: never waits."""
        with self._lock:
            if self._closed:
                raise Closed
            if not self._held():
                return None
            chosen = self._chosen(choose, window)
            return chosen if isinstance(chosen, list) else None

    def _chosen(self, choose: Choose[T], window: int) -> list[T] | float:
        """The entries `choose` picks of the first `window`, taken; or how long it
        waits (the lock held, an entry there)."""
        lanes = ((self._first, self._first_at), (self._entries, self._entries_at))
        entries: list[T] = []
        arrived: list[float] = []
        for lane, lane_at in lanes:
            entries += itertools.islice(lane, window - len(entries))
            arrived += itertools.islice(lane_at, window - len(arrived))
        chosen = choose(entries, arrived, time.monotonic())
        if not isinstance(chosen, list):
            return chosen
        in_first = min(len(self._first), window)
        for position in sorted(chosen, reverse=True):
            lane, lane_at = lanes[0] if position < in_first else lanes[1]
            index = position if position < in_first else position - in_first
            del lane[index], lane_at[index]
        self._not_full.notify(len(chosen))
        return [entries[position] for position in chosen]

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

    def take_now(self, count: int, max_wait_s: float | None = None) -> list[T] | None:
        """Take `count` entries if that many are in now (or, with `max_wait_s`, as many
        as are in if the oldest has waited that long), else none: never waits."""
        with self._lock:
            if self._closed:
                raise Closed
            held = self._held()
            if held < count and (
                not held or max_wait_s is None or time.monotonic() - self._oldest_at() < max_wait_s
            ):
                return None
            return self._take(min(count, held))

    def take_up_to(self, count: int) -> list[T]:
        """Take up to `count` entries, those in now: never waits."""
        with self._lock:
            if self._closed:
                raise Closed
            return self._take(min(count, self._held())) if self._held() else []

    def _take(self, count: int) -> list[T]:
        """The first `count` entries, those ahead first (the lock held, `count` there)."""
        taken = []
        for _ in range(count):
            ahead = bool(self._first)
            taken.append((self._first if ahead else self._entries).popleft())
            (self._first_at if ahead else self._entries_at).popleft()
        self._not_full.notify(count)
        return taken

    def _oldest_at(self) -> float:
        """When the oldest entry held came in (the lock held, one there)."""
        return min(times[0] for times in (self._first_at, self._entries_at) if times)

    def wake(self) -> None:
        """Have every reader waiting for an entry check its `unless` again."""
        with self._lock:
            self._not_empty.notify_all()

    def close(self) -> None:
        """Wake every waiter with `Closed`; entries still inside are dropped."""
        with self._lock:
            self._closed = True
            for entries in (self._first, self._entries, self._first_at, self._entries_at):
                entries.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
