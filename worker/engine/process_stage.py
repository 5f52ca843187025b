"""A stage run in child processes: its driver threads, one per child, which pipeline
requests, recover from a lost child, isolate the items at fault and tell a broken
worker from bad items.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import structlog

from worker.engine.arena import TensorArena
from worker.engine.channel import Closed
from worker.engine.child_handle import (
    ChildProcess,
    WorkerDied,
    WorkerFailedProbe,
    WorkerLost,
)
from worker.engine.feeding_as_prepared import FeedsAsPrepared
from worker.engine.items import (
    Item,
    ItemError,
    Part,
    PrepareStep,
    StageSetup,
    StageSetupError,
    apply_outcomes,
    half_of,
)
from worker.engine.lessons import StageLessons
from worker.engine.stage import live_items
from worker.engine.token_batches import TokenBudget
from worker.engine.wire import ArenaMode, ChildPlan, Reply, WireTask
from worker.errors import WorkerFault
from worker.host import host_cores

log = structlog.get_logger()


# An item whose child died or hung while holding it gets this many tries before it is
# blamed, so one input that kills or hangs its worker cannot loop forever.
MAX_ITEM_ATTEMPTS = 3


PIPELINED_BATCHES = 2


# The batch ahead goes to a child working on a batch once this share of the batch's
# expected time is left (or at once where that is under `AHEAD_MIN_LEAD_S`): the child
# still has it before it is done, and an urgent item that comes meanwhile is in it.
AHEAD_LEAD = 0.2


AHEAD_MIN_LEAD_S = 0.02


WHOLES = itertools.count()  # numbers the items a fan-out splits into parts


# After an out-of-memory error, batches stay at the size that fitted for this long:
# retrying the full size at once would only run out of memory again.
OOM_COOLDOWN_S = 300.0


class ProcessStage(FeedsAsPrepared):
    """Runs a function made by `setup()` in `workers` child processes.

    `setup` runs once per child (load the model there, once); it must be picklable
    (a module-level function or a `functools.partial` of one). A sequence of set-ups is
    one per child, a fixed number (one per GPU, say). A set-up returns the function,
    or a `StageFunction` with the function and its probe. The function's form depends
    on the arenas the stage `reads` and `writes`:

    - neither: `fn(values) -> outputs`
    - writes: `fn(value, out) -> output`, per item, writing into `out`, the item's
      arena slot, in place (decode an image straight into shared memory).
    - reads: `fn(batch, values) -> outputs`, where `batch` stacks the items' arena
      slots; the slots are given back once the call returns, unless `keeps_slots`
      (a fan-out after it still reads them).
    - both, a fan-out: `fn(read, value, outs) -> abouts`, per item, given its slot of
      the arena it reads, writing up to `max_parts` parts into the slots `outs` of the
      arena it writes and saying what each is about; the item goes on as its parts,
      each an item of its own, and one with no parts goes straight to the pipeline's
      output, with the value `[]`.

    With `prepare`, the set-up's `StageFunction.prepare` turns each value into what the
    function takes, in the child, before it runs (`PrepareStep`). `imports` are modules
    its set-up imports: imported once for every child, not by each as it starts.

    With `request_s`, a request holds as many items as would take about that long in a
    child with a core of its own, from their arrival there to their answer, at the pace
    of the latest two requests together (at least `batch_size`, at most
    `max_request_items`, fewer if fewer are waiting): a stage whose items take
    microseconds each (tar members read from this machine's disk) is not held to
    requests of a few, each costing this process more than their items cost the child,
    while one whose items take milliseconds, or wait for slow fetches, keeps its small
    requests, and an urgent item sent to a child waits about `request_s` (once the pace
    has caught up with a change of items: a request or two), as many times that as
    children share a core where they outnumber the host's cores.

    With `token_budget`, a batch is sized in tokens (`worker.engine.token_batches`):
    items of one padded length, at most `batch_size` of them.
    """

    def __init__(
        self,
        name: str,
        setup: StageSetup | Sequence[StageSetup],
        *,
        workers: int = 1,
        max_workers: int | None = None,
        batch_size: int = 1,
        max_batch_wait_ms: float = 0,
        timeout_s: float | None = None,
        reads: TensorArena | None = None,
        writes: TensorArena | None = None,
        keeps_slots: bool = False,
        max_parts: int = 1,
        prepare: PrepareStep | None = None,
        imports: Sequence[str] = (),
        setup_timeout_s: float = 300,
        oom_cooldown_s: float = OOM_COOLDOWN_S,
        request_s: float | None = None,
        max_request_items: int | None = None,
        niceness: int = 0,
        token_budget: TokenBudget | None = None,
    ):
        super().__init__(
            name,
            setup,
            workers=workers,
            max_workers=max_workers,
            batch_size=batch_size,
            max_batch_wait_ms=max_batch_wait_ms,
            setup_timeout_s=setup_timeout_s,
        )
        self.timeout_s = timeout_s
        self.reads, self.writes = reads, writes
        self.mode: ArenaMode = (
            ("fan-out" if writes else "read") if reads else ("write" if writes else None)
        )
        self.keeps_slots = keeps_slots
        self.max_parts = max_parts
        self.prepare = prepare
        self.imports = imports
        self.oom_cooldown_s = oom_cooldown_s
        self.request_s = request_s
        self.niceness = niceness
        self.token_budget = token_budget
        self.max_request_items = max(batch_size, max_request_items or batch_size)
        # The latest two requests' (time in a child, items): together they size the
        # next, so that a short request, whose time is mostly its wait behind a long
        # one, does not swing the size of the next.
        self._request_times: deque[tuple[float, int]] = deque(maxlen=2)
        self._tags = itertools.count()  # name each item sent to a child, in its answer
        self._lessons = StageLessons(prepare, reads if self.mode == "fan-out" else None)

    @property
    def inbox_capacity(self) -> int:
        """Room for two of its largest requests, and for every slot of the arena it
        reads: each item waiting holds one, so the arena bounds them already, and a
        smaller inbox would only hold up the stage before it with items that are ready
        (and an urgent one behind them)."""
        floor = max(super().inbox_capacity, 2 * self.max_request_items)
        if self.token_budget is not None:  # a window of items to choose batches among
            floor = max(floor, self.token_budget.window(self.batch_size))
        return max(floor, self.reads.slots) if self.reads is not None else floor

    def current_batch_size(self) -> int:
        """The items of its next request: its batch size (lowered after an out-of-memory
        error), or with `request_s`, what a child with a core of its own gets through in
        that long. Children beyond the host's cores share them, each going at its share
        of a core: sized by their own pace, their requests would shrink as they grow in
        number while each still costs this process a message to send and two to answer
        (16 children on 2 cores were sent 48 items a request where 2 were sent 140, and
        the drivers' CPU an item more than tripled)."""
        batch_size = super().current_batch_size()
        recent = list(self._request_times)
        items = sum(count for _, count in recent)
        if self.request_s is None or not items or batch_size < self.batch_size:
            return batch_size
        item_s = sum(seconds for seconds, _ in recent) / items
        if not item_s:
            return self.max_request_items
        core_share = min(1.0, host_cores() / max(1, self.worker_count()))
        own_core_items = int(self.request_s / (item_s * core_share))
        return max(batch_size, min(self.max_request_items, own_core_items))

    def _plan(self, number: int) -> ChildPlan:
        """What the child with this number is told when it starts."""
        return ChildPlan(
            self.name,
            self._setup_of(number),
            self.mode,
            self.prepare,
            self.batch_size,
            self.max_parts,
            self._lessons.known_good(),
            self.reads.shared if self.reads else None,
            self.writes.shared if self.writes else None,
            self.niceness,
        )

    def _serve_child(self, child: ChildProcess) -> None:
        """Feed `child` until the inbox closes: as it answers, items as they are prepared
        (a stage with a prepare step), or batches in order."""
        if self.prepare is not None:
            self._serve_as_prepared(child)
        else:
            self._serve_in_order(child)

    def _serve_in_order(self, child: ChildProcess) -> None:
        """Feed `child` batches until the inbox closes.

        While the child works on one batch, the next already waits in its pipe
        (`pipelined` in all), so it goes from batch to batch without waiting for this
        thread to file results and gather the next batch: the GPU never idles on the
        host's bookkeeping. A batch is queued ahead only when a full one is waiting;
        otherwise the next is gathered once the child is free, and is fuller for it.
        Without a prepare step, it is queued near the end of the batch before it
        (`_ahead_due`), so that an urgent item passes all but the batch being run.
        """
        in_flight: deque[list[Item]] = deque()  # batches sent, oldest first
        started = 0.0  # when the child began the oldest batch
        # Its last runs' times: the shorter is the next one's expected time, so one
        # slow batch (a warm-up, an out-of-memory retry) does not delay the next.
        recent: deque[float] = deque(maxlen=2)
        while True:
            if not in_flight:
                if child.retiring.is_set():
                    self._retire(child)
                    return
                self._dispatch(child, in_flight, self._next_batch(child.retiring.is_set), [])
                started = time.monotonic()
                continue
            ahead = None
            expected_s = min(recent, default=0.0)
            if len(in_flight) < PIPELINED_BATCHES and self._ahead_due(child, started, expected_s):
                ahead = self._batch_ahead()
            if ahead is None:
                reply = self._complete_oldest(child, in_flight)
                if reply is not None:
                    recent.append(reply.duration_s)
                    started = reply.ended_at
            else:
                self._dispatch(child, in_flight, *ahead)

    def _ahead_due(self, child: ChildProcess, started: float, expected_s: float) -> bool:
        """Whether a batch may be sent ahead now: once the batch the child began at
        `started` has `AHEAD_LEAD` of its `expected_s` left, waiting till then; False if
        the child answers first."""
        wait_s = started + expected_s * (1 - AHEAD_LEAD) - time.monotonic()
        if expected_s * AHEAD_LEAD < AHEAD_MIN_LEAD_S or wait_s <= 0:
            return True
        return not child.answers_within(wait_s)

    def _batch_ahead(self) -> tuple[list[Item], list[int]] | None:
        """A batch, and its slots, to send ahead of replies this driver has yet to
        collect, if both are there now (else None): it never waits with replies unread.
        A batch is full, or whatever has waited `max_batch_wait_s` since its oldest item
        came (the device must not wait for the batch to fill after it ends the one it
        runs). Another driver may take the batch it saw waiting before it takes it."""
        batch_size = self.current_batch_size()
        if not len(self._inbox):
            return None
        reserved = self._reserve_ahead(batch_size)
        if reserved is None:
            return None
        items = self._batch_now(batch_size)
        if items is None:
            self._give_back(reserved)
            return None
        return items, reserved

    def _reserve_ahead(self, batch_size: int) -> list[int] | None:
        """Slots for a request sent ahead of replies this driver has yet to collect, if
        they are free now (else None). Waiting for them could wait for ever: the items
        of those replies hold slots that only this driver, collecting them, hands on."""
        if self.mode != "write":
            return []
        assert self.writes is not None
        return self.writes.try_acquire(batch_size)

    def _dispatch(
        self,
        child: ChildProcess,
        in_flight: deque[list[Item]],
        items: list[Item],
        reserved: list[int],
    ) -> None:
        live = live_items(items)
        if not live:
            self._give_back(reserved)
            self._forward(items)
            return
        in_flight.append(items)
        try:
            child.send(self._request(live, reserved))
        except WorkerLost as lost:
            self._recover(child, in_flight, lost)

    def _complete_oldest(self, child: ChildProcess, in_flight: deque[list[Item]]) -> Reply | None:
        """File the child's reply to the oldest batch and hand the batch on; None if the
        child was lost instead (what it held is redone, and nothing is in flight)."""
        live = live_items(in_flight[0])
        try:
            reply = self._reply(child, live)
        except WorkerLost as lost:
            self._recover(child, in_flight, lost)
            return None
        items = in_flight.popleft()
        self._file_reply(live, reply)
        self._forward(items)
        return reply

    def _reply(self, child: ChildProcess, live: list[Item]) -> Reply:
        """The child's reply to the request of `live` (a stage without a prepare step:
        one reply a request, in order)."""
        reply: Reply = child.receive(self.timeout_s)
        if reply.fault is not None:
            raise WorkerFailedProbe(f"{child.name} failed its probe: {reply.fault}")
        return reply

    def arenas(self) -> list[TensorArena]:
        return [arena for arena in (self.reads, self.writes) if arena is not None]

    def _request(self, live: list[Item], reserved: Sequence[int] = ()) -> list[WireTask]:
        """What the child is sent: each item's slot, value and the slots for its parts
        (plain tuples: pickle writes those in C, a named tuple through Python code);
        a writing stage gives them slots first, `reserved` ones or else as they come
        free (waiting while none is)."""
        spare = list(reserved)
        if self.mode == "write":
            assert self.writes is not None
            unslotted = [item for item in live if item.slot is None]
            slots = spare + self.writes.acquire(len(unslotted) - len(spare))
            for item, slot in zip(unslotted, slots, strict=False):
                item.slot = slot
            spare = slots[len(unslotted) :]
        elif self.mode == "fan-out":
            assert self.writes is not None
            for item in live:
                if not item.part_slots:
                    item.part_slots = tuple(self.writes.acquire(self.max_parts))
        self._give_back(spare)
        return [(item.slot, item.value, item.part_slots, next(self._tags)) for item in live]

    def _give_back(self, slots: Sequence[int]) -> None:
        if slots:
            assert self.writes is not None
            self.writes.release(slots)

    def _file_reply(self, live: list[Item], reply: Reply) -> None:
        with self._lock:
            self._busy_s += reply.duration_s
        if reply.counts:  # its prepare step's
            self._observer.stage_counted(
                self.prepare.name if self.prepare else self.name, dict(reply.counts)
            )
        if live:
            self._request_times.append((reply.queued_s + reply.duration_s, len(live)))
        if reply.fitting_batch_size is not None:
            self.lower_batch_size(reply.fitting_batch_size, self.oom_cooldown_s)
        untold = self._lessons.learn(live, reply)
        if untold:
            fault = (
                f"every input of requests of {len(untold)} jobs in a row failed to prepare, "
                f"and none was ever prepared: {reply.outcomes[0].message}"
            )
            self._observer.stage_broken(self.name, WorkerFault(fault), untold)
            raise Closed
        apply_outcomes(live, reply.outcomes)
        self._observer.stage_ran(self.name, live, reply.duration_s, reply.events)

    def _forward(self, items: list[Item]) -> None:
        """Hand the batch on, giving back the arena slots a reading stage is done with.
        An item's tries and padded length are this stage's: the next stage gives it as
        many tries again, and reads its length from its value then."""
        done_with: list[int] = []
        for item in items:
            item.attempts, item.padded_length = 0, None
            if self.reads is not None and not self.keeps_slots and item.slot is not None:
                done_with.append(item.slot)
                item.slot = None
            if self.mode == "fan-out":
                self._fan_out(item)
        if done_with:
            assert self.reads is not None
            self.reads.release(done_with)
        if self.mode != "fan-out":
            self._outbox.put_all(items)

    def _fan_out(self, item: Item) -> None:
        """Hand the item on as its parts, each in one of the slots taken for them."""
        assert self.writes is not None
        abouts: list[Any] = [] if item.error is not None else item.value
        slots, item.part_slots = item.part_slots, ()
        self._give_back(slots[len(abouts) :])
        if item.error is not None:
            self._outbox.put(item)
        elif not abouts:
            item.value = []
            self._finished.put(item)
        else:
            whole = next(WHOLES)
            for number, (about, slot) in enumerate(zip(abouts, slots, strict=False)):
                part = Part(whole, number, len(abouts), about)
                part_item = Item(
                    item.job, item.index, about, slot=slot, part=part, urgent=item.urgent
                )
                self._outbox.put(part_item)

    def _recover(self, child: ChildProcess, in_flight: deque[list[Item]], lost: WorkerLost) -> None:
        """Replace the child, then redo what it held. Only the oldest batch was being
        worked on when it was lost: it is retried (`_retry`); the batches queued behind
        it are sent again."""
        batches = list(in_flight)
        in_flight.clear()
        held = [item for items in batches for item in live_items(items)]
        self._restart(child, held, lost, working_on=live_items(batches[0]))
        self._retry(child, live_items(batches[0]), lost)
        for items in batches[1:]:
            self._run(child, live_items(items))
        for items in batches:
            self._forward(items)

    def _restart(
        self,
        child: ChildProcess,
        items: list[Item],
        lost: WorkerLost,
        working_on: list[Item] | None = None,
    ) -> None:
        """Replace a lost child that held `items`; one that cannot be replaced breaks the
        stage, naming the jobs of the items it was `working_on` (all it held if not
        given), not those of requests queued behind them."""
        if self.stopping.is_set():
            raise Closed
        if isinstance(lost, WorkerDied):
            lost.out_of_memory = self._lessons.oom_killed(lost)
        self._observer.worker_lost(self.name, items, str(lost))
        try:
            child.restart()
        except StageSetupError as error:
            self._break(error, items if working_on is None else working_on)

    def _break(self, error: BaseException, items: Sequence[Item]) -> None:
        """The stage cannot go on: report it, naming the jobs of the `items` it failed
        on, and end this driver thread."""
        self._observer.stage_broken(self.name, error, frozenset(item.job for item in items))
        raise Closed from error

    def _run(self, child: ChildProcess, live: list[Item], after: WorkerLost | None = None) -> None:
        """Run `live` on its own and wait for it (retries only); `after` is why the
        previous try was lost."""
        request = self._request(live)
        held = dict(zip([task[3] for task in request], live, strict=True))
        try:
            child.send(request)
            if self.prepare is not None:  # answered in groups, as its items are prepared
                while held:
                    self._answered(child, held)
                return
            reply = self._reply(child, live)
        except WorkerLost as lost:
            if isinstance(lost, WorkerFailedProbe) and isinstance(after, WorkerFailedProbe):
                self._break(WorkerFault(f"a fresh worker failed the same way: {lost}"), live)
            unanswered = list(held.values())
            self._restart(child, unanswered, lost)
            self._retry(child, lost.working_on or unanswered, lost)
            others = [item for item in unanswered if item not in (lost.working_on or [])]
            if lost.working_on and others:
                self._run(child, others)
            return
        self._file_reply(live, reply)

    def _retry(self, child: ChildProcess, live: list[Item], lost: WorkerLost) -> None:
        """Items the child was working on when it was lost. After a failed probe the
        whole batch goes to the fresh child; after a death or a hang, halves of the
        batch, or one item again while it has tries left."""
        if isinstance(lost, WorkerFailedProbe):
            self._run(child, live, after=lost)
            return
        if len(live) > 1:
            middle = half_of(len(live))
            self._run(child, live[:middle])
            self._run(child, live[middle:])
            return
        item = live[0]
        item.attempts += 1
        if item.attempts < MAX_ITEM_ATTEMPTS:
            self._run(child, live)
            return
        fault = child.probe(self.timeout_s)
        if fault is not None:
            self._break(WorkerFault(f"{lost}, and a fresh worker failed its probe: {fault}"), live)
        if lost.out_of_memory:  # on every try, alone, and a fresh child passes its probe
            message = (
                f"{lost}: killed by the kernel's OOM killer on each try with only this "
                "input: it needs more memory than this host gives it"
            )
            item.error = ItemError(type(lost).__name__, message, self.name)
        elif lost.preparing:
            assert self.prepare is not None
            message = f"{lost} while it prepared the item"
            item.error = ItemError(type(lost).__name__, message, self.prepare.name, transient=True)
        else:
            item.error = ItemError(type(lost).__name__, str(lost), self.name)
