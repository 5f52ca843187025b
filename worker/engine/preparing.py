"""A child's items being prepared as their requests come in, each answered once its own
preparation ends (not its request's slowest), and hedged when it runs long."""

from __future__ import annotations

import functools
import heapq
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from worker.engine.hedging import TailLatency
from worker.engine.items import StageFunction
from worker.engine.wire import PreparedAtOnce, ReadyItem, Task

# After an item is prepared, the child waits this long at most for others being prepared
# to answer with it: one message to the daemon for several items, for an item's wait of
# a few milliseconds where its read took tens.
GROUP_WAIT_S = 0.05
# Items a group waits for at most (`GROUP_WAIT_S`); those prepared already go with it,
# up to `GROUP_MOST` (a tar's members, read from this machine's disk, hundreds at once).
GROUP_ITEMS = 16
GROUP_MOST = 256


STOP = object()  # what `Preparing.next_group` gives for the daemon's word to stop


class Preparing:
    """A child's items being prepared: its reader starts each item's preparation as its
    request comes in, and each item is taken, in the order preparations end, in
    groups (`next_group`). With `hedges`, a preparation still running past the 95th
    percentile of the latest (`TailLatency`) is started again on a thread kept for it,
    up to `hedges` at once, and the first to end without an error is the item's."""

    def __init__(
        self,
        stage_fn: StageFunction,
        threads: ThreadPoolExecutor,
        ready: queue.SimpleQueue[ReadyItem | Any],
        hedges: int = 0,
    ):
        self._stage_fn = stage_fn
        self._threads = threads
        self._ready = ready
        self._lock = threading.Lock()
        self._outstanding = 0  # items taken in, not yet taken out
        self._counts = {"calls": 0, "hedged": 0}  # since `counts` was last asked
        # Hedging: the preparations under way by tag, when each is due a hedge.
        self._tails = TailLatency()
        self._running: dict[int, _Running] = {}
        self._due: list[tuple[float, int]] = []  # a heap
        self._due_changed = threading.Condition(self._lock)
        self._hedges = hedges
        self._hedging_now = 0
        self._waiting_for_hedge: deque[int] = deque()  # due, in the order they came due
        if hedges:
            self._hedging = ThreadPoolExecutor(hedges, "hedge")
            threading.Thread(target=self._hedge_when_due, daemon=True).start()

    def read(self, conn: Connection) -> None:
        """Take requests off the pipe as they come, and start preparing their items at
        once: a slow read holds up nothing but its own item."""
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):  # the daemon is gone: nobody is left to answer
                request = None
            if not isinstance(request, list):  # the probe, or the word to stop
                self._ready.put(STOP if request is None else request)
                if request is None:
                    return
                continue
            arrived = time.perf_counter()
            with self._lock:
                self._outstanding += len(request)
                self._counts["calls"] += len(request)
            for wire_task in request:
                self._start(Task._make(wire_task), arrived)

    def _start(self, task: Task, arrived: float) -> None:
        preparation = _preparation(self._stage_fn, self._threads, task.value)
        if isinstance(preparation, PreparedAtOnce):
            self._ready.put(ReadyItem(task, preparation, arrived))
            return
        started = time.perf_counter()
        with self._lock:
            self._running[task.tag] = _Running(task, arrived)
            after_s = self._tails.hedge_after_s() if self._hedges else None
            if after_s is not None:
                heapq.heappush(self._due, (started + after_s, task.tag))
                self._due_changed.notify()
        preparation.add_done_callback(functools.partial(self._ended, task.tag, started=started))

    def _ended(self, tag: int, preparation: Future[Any], *, started: float | None) -> None:
        """A preparation of the item `tag` ended (the first one, timed: `started`): the
        item is ready, unless the other is still running and this one failed, or the
        other ended first."""
        if started is not None:
            self._tails.timed(time.perf_counter() - started)
        with self._lock:
            running = self._running.get(tag)
            if running is None:
                return
            running.calls -= 1
            if running.calls and preparation.exception() is not None:
                return  # the other may still answer
            del self._running[tag]
        self._ready.put(ReadyItem(running.task, preparation, running.arrived))

    def _hedge_when_due(self) -> None:
        """Start a second preparation of each item due a hedge, while threads are free."""
        assert self._stage_fn.prepare is not None
        while True:
            with self._due_changed:
                while (running := self._next_to_hedge()) is None:
                    self._due_changed.wait(self._next_due_in_s())
                running.calls += 1
                self._hedging_now += 1
                self._counts["hedged"] += 1
            hedge = self._hedging.submit(self._stage_fn.prepare, running.task.value)
            hedge.add_done_callback(self._hedge_ended)
            hedge.add_done_callback(functools.partial(self._ended, running.task.tag, started=None))

    def _next_to_hedge(self) -> _Running | None:
        """The item to hedge now, if a thread is free: the longest due of those still
        running unhedged. Items come due while every thread is busy, and wait for one in
        the order they came due; those that end meanwhile are passed over here, in the
        one place that picks, so a free thread never goes to an item that needs none."""
        now = time.perf_counter()
        while self._due and self._due[0][0] <= now:
            tag = heapq.heappop(self._due)[1]
            if tag in self._running:  # (while every hedge hangs, none piles up here)
                self._waiting_for_hedge.append(tag)
        while self._waiting_for_hedge and self._hedging_now < self._hedges:
            running = self._running.get(self._waiting_for_hedge.popleft())
            if running is not None and running.calls == 1:
                return running
        return None

    def _next_due_in_s(self) -> float | None:
        """How long until an item comes due that a free thread could take; None: until
        woken (a hedge ends, or an item is started)."""
        if not self._due or self._hedging_now >= self._hedges:
            return None
        return max(0.0, self._due[0][0] - time.perf_counter())

    def _hedge_ended(self, _: Future[Any]) -> None:
        """A hedge's thread is free for the next item waiting for one."""
        with self._lock:
            self._hedging_now -= 1
            self._due_changed.notify()

    def counts(self) -> tuple[tuple[str, int], ...]:
        """Items prepared, and of those hedged, since this was last asked."""
        with self._lock:
            counts, self._counts = self._counts, {"calls": 0, "hedged": 0}
        return tuple(counts.items())

    def next_group(self) -> tuple[list[ReadyItem], Any]:
        """Prepared items: the first to be, then those prepared by then (up to
        `GROUP_MOST`), and while others are still being prepared, those prepared within
        `GROUP_WAIT_S` after it (up to `GROUP_ITEMS`): several a message to the daemon,
        whose one process reads every child's. And the probe or the word to stop, if one
        came meanwhile, which ends the group."""
        group: list[ReadyItem] = []
        deadline = 0.0  # set by the first item
        while len(group) < GROUP_MOST:
            try:
                if not group:
                    entry = self._ready.get()
                elif len(group) < GROUP_ITEMS and self._outstanding_after(len(group)):
                    entry = self._ready.get(timeout=max(0.0, deadline - time.perf_counter()))
                else:
                    entry = self._ready.get_nowait()
            except queue.Empty:
                break
            if not isinstance(entry, ReadyItem):
                self._taken(len(group))
                return group, entry
            if not group:
                deadline = time.perf_counter() + GROUP_WAIT_S
            group.append(entry)
        self._taken(len(group))
        return group, None

    def _outstanding_after(self, taken: int) -> bool:
        with self._lock:
            return self._outstanding > taken

    def _taken(self, count: int) -> None:
        with self._lock:
            self._outstanding -= count


@dataclass
class _Running:
    """An item whose preparation is under way, with how many calls of it are running."""

    task: Task
    arrived: float
    calls: int = 1


def _preparation(
    stage_fn: StageFunction, threads: ThreadPoolExecutor, value: Any
) -> Future[Any] | PreparedAtOnce:
    """A value's preparation: done here if the value is at hand, else under way on a
    thread. What `at_hand` or the step raises here is the item's error."""
    assert stage_fn.prepare is not None
    if stage_fn.at_hand is not None:
        try:
            if stage_fn.at_hand(value):
                return PreparedAtOnce(stage_fn.prepare(value))
        except Exception as error:
            return PreparedAtOnce(None, error)
    return threads.submit(stage_fn.prepare, value)
