"""How a stage with a prepare step feeds a child: items as they are prepared, not
batches in order (`ProcessStage` puts it together with the rest)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from worker.engine.arena import TensorArena
from worker.engine.child_handle import ChildProcess, WorkerFailedProbe, WorkerLost
from worker.engine.child_pool import ChildPoolStage
from worker.engine.items import Item, PrepareStep
from worker.engine.stage import live_items
from worker.engine.wire import ArenaMode, Prepared, Reply, WireTask


class FeedsAsPrepared(ChildPoolStage, abc.ABC):
    """Keeps each child holding enough items that none of its fetch threads idles, and
    hands on each group of items as the child answers it."""

    prepare: PrepareStep | None
    writes: TensorArena | None
    mode: ArenaMode
    timeout_s: float | None

    @abc.abstractmethod
    def _request(self, live: list[Item], reserved: Sequence[int] = ()) -> list[WireTask]:
        """What the child is sent for `live`, in the slots `reserved` first."""

    @abc.abstractmethod
    def _give_back(self, slots: Sequence[int]) -> None:
        """Free slots of the arena the stage writes."""

    @abc.abstractmethod
    def _file_reply(self, live: list[Item], reply: Reply) -> None:
        """Take in the child's answer for `live`."""

    @abc.abstractmethod
    def _forward(self, items: list[Item]) -> None:
        """Hand `items` on to the next stage."""

    @abc.abstractmethod
    def _restart(
        self,
        child: ChildProcess,
        items: list[Item],
        lost: WorkerLost,
        working_on: list[Item] | None = None,
    ) -> None:
        """Replace a lost child that held `items`."""

    @abc.abstractmethod
    def _retry(self, child: ChildProcess, live: list[Item], lost: WorkerLost) -> None:
        """Run again the items a lost child was working on."""

    @abc.abstractmethod
    def _run(self, child: ChildProcess, live: list[Item], after: WorkerLost | None = None) -> None:
        """Run `live` on its own and wait for it."""

    def _serve_as_prepared(self, child: ChildProcess) -> None:
        """Keep `child` holding `_held_target()` items (their inputs fetched at once, each
        on a thread of its own), and hand on each group it answers, as its items are
        prepared: no item waits for the slowest of the request it came in, and the
        fetches in flight stay at the number asked for. New items go to it as answers
        come back, taking only the arena slots that are free then (its held items'
        slots go on only as this driver collects them)."""
        held: dict[int, Item] = {}  # by tag, sent and not yet answered
        while True:
            if not held:
                if child.retiring.is_set():
                    self._retire(child)
                    return
                self._send_held(child, held, self._next_batch(child.retiring.is_set), [])
                continue
            if not child.retiring.is_set():
                self._top_up(child, held)
            try:
                group = self._answered(child, held)
            except WorkerLost as lost:
                self._recover_held(child, held, lost)
                continue
            self._forward(group)

    def _held_target(self) -> int:
        """How many items a child of a preparing stage holds: those it prepares at once
        (`batch_size`, a thread each) and a request's worth more, waiting for a thread,
        so that none idles while an answer travels."""
        return self.batch_size + self.current_batch_size()

    def _top_up(self, child: ChildProcess, held: dict[int, Item]) -> None:
        """Send `child` the items waiting now, up to its `_held_target()`, and only as
        many as there are free slots for now: never waits."""
        room = min(self._held_target() - len(held), len(self._inbox))
        if room <= 0:
            return
        reserved = self.writes.acquire_now(room) if self.mode == "write" and self.writes else []
        if self.mode == "write" and not reserved:
            return
        items = self._inbox.take_up_to(len(reserved) if self.mode == "write" else room)
        if not items:
            self._give_back(reserved)
            return
        self._send_held(child, held, items, reserved)

    def _send_held(
        self, child: ChildProcess, held: dict[int, Item], items: list[Item], reserved: list[int]
    ) -> None:
        """Send `items` to `child` (those with an error already go straight on)."""
        live = live_items(items)
        self._forward([item for item in items if item.error is not None])
        if not live:
            self._give_back(reserved)
            return
        request = self._request(live, reserved)
        held.update(zip([task[3] for task in request], live, strict=True))
        try:
            child.send(request)
        except WorkerLost as lost:
            self._recover_held(child, held, lost)

    def _answered(self, child: ChildProcess, held: dict[int, Item]) -> list[Item]:
        """The next group of `held` items the child answers, filed (not yet handed on):
        first its word that they are prepared, which the prepare step's timeout waits
        for, then its answer, which the stage's does. A child lost before it answers
        says which items it was running (`WorkerLost.working_on`)."""
        assert self.prepare is not None
        try:
            prepared: Prepared = child.receive(self.prepare.timeout_s)
        except WorkerLost as lost:
            lost.preparing = True
            raise
        group = [held[tag] for tag in prepared.tags]
        self._observer.stage_ran(self.prepare.name, group, prepared.duration_s, ())
        try:
            reply: Reply = child.receive(self.timeout_s)
            if reply.fault is not None:
                raise WorkerFailedProbe(f"{child.name} failed its probe: {reply.fault}")
        except WorkerLost as lost:
            lost.working_on = group
            raise
        for tag in prepared.tags:
            del held[tag]
        self._file_reply(group, reply)
        return group

    def _recover_held(self, child: ChildProcess, held: dict[int, Item], lost: WorkerLost) -> None:
        """Replace the child, then redo what it held: the items it was running when it
        was lost are retried (`_retry`), the others sent again; all are handed on."""
        items = list(held.values())
        held.clear()
        working_on = lost.working_on or items
        others = [item for item in items if item not in working_on]
        self._restart(child, items, lost, working_on=working_on)
        self._retry(child, working_on, lost)
        if others:
            self._run(child, others)
        self._forward(items)
