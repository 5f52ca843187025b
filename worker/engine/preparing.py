"""A child's items being prepared as their requests come in, each answered once its own
preparation ends (not its request's slowest), and hedged when it runs long."""

from __future__ import annotations

import heapq
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from worker.engine.hedging import TailLatency
from worker.engine.items import StageFunction
from worker.engine.wire import Preparation, ReadyItem, Task

# After an item is prepared, the child waits this long at most for others being prepared
# to answer with it: one message to the daemon for several items, for an item's wait of
# a few milliseconds where its read took tens.
GROUP_WAIT_S = 0.05
# Items a group waits for at most (`GROUP_WAIT_S`); those prepared already go with it,
# up to `GROUP_MOST` (a tar's members, read from this machine's disk, hundreds at once).
GROUP_ITEMS = 16
GROUP_MOST = 256
# The hedger looks at what came due this often at most: most items end before they are
# due (19 in 20), and waking for each one's due time cost a child 12 µs an item.
HEDGE_TICK_S = 0.005


STOP = object()  # what `Preparing.next_group` gives for the daemon's word to stop


class Preparing:
    """A child's items being prepared: its reader starts each item's preparation as its
    request comes in, on the first of `threads` free, and each item is taken, in the
    order preparations end, in groups (`next_group`). With `hedges`, a preparation still
    running past the 95th percentile of the latest (`TailLatency`) is started again on
    one of `hedges` threads kept for it, and the first to end without an error is the
    item's.

    The threads are its own, each taking the next item off a queue and handing on what
    it became, where an executor's futures, their conditions and callbacks, and a wake
    of the group's thread for each item, cost a child 152-163 µs of CPU an item read at
    S3's latency against 92-94 now (`bench.preparing`): with 16 children sharing the
    host's cores, that CPU is what the feed runs on."""

    def __init__(
        self,
        stage_fn: StageFunction,
        threads: int,
        ready: queue.SimpleQueue[ReadyItem | Any],
        hedges: int = 0,
    ):
        assert stage_fn.prepare is not None
        self._stage_fn = stage_fn
        self._ready = ready
        self._lock = threading.Lock()
        self._outstanding = 0  # items taken in, not yet taken out
        # `next_group`'s wait: how many more items would complete its group (None: it
        # is not waiting), and markers (the probe, the word to stop) not yet taken.
        self._group_wants: int | None = None
        self._markers = 0
        self._group_complete_now = threading.Condition(self._lock)
        self._counts = {"calls": 0, "hedged": 0}  # since `counts` was last asked
        self._waiting: queue.SimpleQueue[_Running] = queue.SimpleQueue()  # for a thread
        _start_threads(threads, "prepare", self._prepare_each, self._waiting, first=True)
        # Hedging: the preparations under way by tag, when each is due a hedge.
        self._tails = TailLatency()
        self._running: dict[int, _Running] = {}
        self._due: list[tuple[float, int]] = []  # a heap
        self._due_changed = threading.Condition(self._lock)
        self._hedges = hedges
        self._hedging_now = 0
        self._waiting_for_hedge: deque[int] = deque()  # due, in the order they came due
        if hedges:
            self._hedged: queue.SimpleQueue[_Running] = queue.SimpleQueue()
            _start_threads(hedges, "hedge", self._prepare_each, self._hedged, first=False)
            threading.Thread(target=self._hedge_when_due, name="hedging", daemon=True).start()

    def read(self, conn: Connection) -> None:
        """Take requests off the pipe as they come, and start preparing their items at
        once: a slow read holds up nothing but its own item."""
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):  # the daemon is gone: nobody is left to answer
                request = None
            if not isinstance(request, list):  # the probe, or the word to stop
                with self._lock:
                    self._put_ready(STOP if request is None else request)
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
        at_once = _prepared_at_once(self._stage_fn, task.value)
        if at_once is not None:
            with self._lock:
                self._put_ready(ReadyItem(task, at_once, arrived))
            return
        started = time.perf_counter()
        running = _Running(task, arrived, started)
        with self._lock:
            self._running[task.tag] = running
            after_s = self._tails.hedge_after_s() if self._hedges else None
            if after_s is not None:
                heapq.heappush(self._due, (started + after_s, task.tag))
                # Woken only when it comes due sooner than what the hedger waits for:
                # once per item, it was a third thread woken for each.
                if self._due[0][1] == task.tag:
                    self._due_changed.notify()
        self._waiting.put(running)

    def _prepare_each(self, waiting: queue.SimpleQueue[_Running], *, first: bool) -> None:
        """Prepare each item `waiting` in turn (its `first` call: timed; or a hedge)."""
        prepare = self._stage_fn.prepare
        assert prepare is not None
        while True:
            running = waiting.get()
            try:
                preparation = Preparation(prepare(running.task.value))
            except BaseException as error:  # the item's; `result` raises it again
                preparation = Preparation(None, error)
            try:
                if first:
                    self._tails.timed(time.perf_counter() - running.started)
                else:
                    self._hedge_ended()
                self._ended(running, preparation)
            except BaseException:
                # A thread gone would leave its item unanswered, unseen: the child ends
                # instead, and the daemon redoes what it held.
                traceback.print_exc()
                os._exit(1)

    def _ended(self, running: _Running, preparation: Preparation) -> None:
        """A preparation of the item `running` ended: the item is ready, unless the
        other is still running and this one failed, or the other ended first."""
        tag = running.task.tag
        with self._lock:
            if self._running.get(tag) is not running:
                return
            running.calls -= 1
            if running.calls and preparation.error is not None:
                return  # the other may still answer
            del self._running[tag]
            self._put_ready(ReadyItem(running.task, preparation, running.arrived))

    def _hedge_when_due(self) -> None:
        """Start a second preparation of each item due a hedge, while threads are free."""
        while True:
            with self._due_changed:
                while (running := self._next_to_hedge()) is None:
                    self._due_changed.wait(self._next_due_in_s())
                running.calls += 1
                self._hedging_now += 1
                self._counts["hedged"] += 1
            self._hedged.put(running)

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
        woken (a hedge ends, or an item comes due sooner)."""
        if not self._due or self._hedging_now >= self._hedges:
            return None
        return max(HEDGE_TICK_S, self._due[0][0] - time.perf_counter())

    def _hedge_ended(self) -> None:
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
        `GROUP_WAIT_S` after it (until `GROUP_ITEMS` are): several a message to the
        daemon, whose one process reads every child's. And the probe or the word to stop,
        if one came meanwhile, which ends the group. It waits for the group as a whole,
        woken once it is complete (`_put_ready`), not by each item of it."""
        first = self._ready.get()
        if not isinstance(first, ReadyItem):
            with self._lock:
                self._markers -= 1
            return [], first
        group, marker = [first], None
        deadline = time.perf_counter() + GROUP_WAIT_S
        with self._lock:
            self._outstanding -= 1
            self._group_wants = GROUP_ITEMS - 1
            while not self._group_complete() and (left_s := deadline - time.perf_counter()) > 0:
                self._group_complete_now.wait(left_s)
            self._group_wants = None
            while len(group) < GROUP_MOST:
                try:
                    entry = self._ready.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(entry, ReadyItem):
                    marker, self._markers = entry, self._markers - 1
                    break
                group.append(entry)
            self._outstanding -= len(group) - 1
        return group, marker

    def _put_ready(self, entry: ReadyItem | Any) -> None:
        """(Under the lock.) Hand `entry` (an item, or a marker) to `next_group`, waking
        it if the group it waits for is complete."""
        self._ready.put(entry)
        if not isinstance(entry, ReadyItem):
            self._markers += 1
        if self._group_wants is not None and self._group_complete():
            self._group_complete_now.notify()

    def _group_complete(self) -> bool:
        """(Under the lock.) Whether the group `next_group` waits for is: as many items
        ready as it wants, none still being prepared, or a marker came."""
        ready = self._ready.qsize()
        assert self._group_wants is not None
        return ready >= self._group_wants or self._outstanding <= ready or self._markers > 0


@dataclass
class _Running:
    """An item whose preparation is under way (its first call since `started`), with
    how many calls of it are running."""

    task: Task
    arrived: float
    started: float
    calls: int = 1


def _start_threads(
    count: int,
    name: str,
    run: Callable[..., None],
    waiting: queue.SimpleQueue[_Running],
    *,
    first: bool,
) -> None:
    for number in range(count):
        threading.Thread(
            target=run,
            args=(waiting,),
            kwargs={"first": first},
            name=f"{name}-{number}",
            daemon=True,
        ).start()


def _prepared_at_once(stage_fn: StageFunction, value: Any) -> Preparation | None:
    """A value's preparation, done here if the value is at hand (what `at_hand` or the
    step raises here is the item's error); None if it is to wait for a thread."""
    assert stage_fn.prepare is not None
    if stage_fn.at_hand is None:
        return None
    try:
        return Preparation(stage_fn.prepare(value)) if stage_fn.at_hand(value) else None
    except Exception as error:
        return Preparation(None, error)
