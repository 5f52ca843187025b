"""What every stage shares (pulling batches, passing errors through), and the stage that
runs its function on threads of this process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from worker.engine.channel import Channel, Closed
from worker.engine.items import Item, StageObserver, apply_outcomes, isolate_failures
from worker.engine.token_batches import TokenBudget

log = structlog.get_logger()


STOP_GRACE_S = 5.0


class Stage:
    """What thread and process stages share: pulling batches and passing errors through."""

    def __init__(self, name: str, workers: int, batch_size: int, max_batch_wait_ms: float):
        if workers < 1 or batch_size < 1:
            raise ValueError(f"stage {name}: workers and batch_size must be at least 1")
        self.name = name
        self.workers = workers
        self.max_workers = workers
        self.batch_size = batch_size
        self.max_batch_wait_s = max_batch_wait_ms / 1000
        self._threads: list[threading.Thread] = []
        self._lowered_batch_size: tuple[int, float] | None = None  # (size, until monotonic)
        # With one, batches are sized in tokens, `batch_size` their most rows.
        self.token_budget: TokenBudget | None = None
        self.stopping = threading.Event()

    def lower_batch_size(self, batch_size: int, for_s: float) -> None:
        """Take at most `batch_size` items at a time for the next `for_s` seconds."""
        self._lowered_batch_size = (batch_size, time.monotonic() + for_s)
        log.warning("batch_size_lowered", stage=self.name, batch_size=batch_size, for_s=for_s)

    def current_batch_size(self) -> int:
        lowered = self._lowered_batch_size
        if lowered is None:
            return self.batch_size
        batch_size, until = lowered
        if time.monotonic() >= until:
            self._lowered_batch_size = None
            log.info("batch_size_restored", stage=self.name, batch_size=self.batch_size)
            return self.batch_size
        return batch_size

    @property
    def inbox_capacity(self) -> int:
        return 2 * max(self.max_workers, self.batch_size)

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        finished: Channel[Item],
    ) -> None:
        """Serve `inbox` into `outbox`; an item with nothing left for the stages after
        this one goes straight to `finished`, the pipeline's output."""
        self._inbox, self._outbox, self._observer = inbox, outbox, observer
        self._finished = finished

    def stop(self) -> None:
        """Wait up to `STOP_GRACE_S` in all for the stage's threads (daemon threads: one
        stuck in a network call is left behind, not waited for)."""
        self.stopping.set()
        deadline = time.monotonic() + STOP_GRACE_S
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        """Whether every worker of the stage is up (False while one is being replaced)."""
        return all(thread.is_alive() for thread in self._threads)

    def _spawn_thread(self, target: Callable[[], None], suffix: str) -> None:
        thread = threading.Thread(
            target=self._supervised, args=(target,), name=f"{self.name}-{suffix}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _supervised(self, target: Callable[[], None]) -> None:
        """Run a stage thread; it ends quietly when its channels close, and a stage whose
        thread raised is reported broken rather than left silently short of a worker."""
        try:
            target()
        except Closed:
            return
        except Exception as error:
            if self.stopping.is_set():
                return  # its child or channel was closed under it: the stage is stopping
            log.exception("stage_thread_failed", stage=self.name)
            self._observer.stage_broken(self.name, error, None)

    def _next_batch(self, unless: Callable[[], bool] | None = None) -> list[Item]:
        """The next batch, waiting for it: of `current_batch_size()` items, or sized in
        tokens (`token_budget`); less once its oldest item has waited `max_batch_wait_s`."""
        batch_size = self.current_batch_size()
        if self.token_budget is None:
            return self._inbox.get_batch(batch_size, self.max_batch_wait_s, unless)
        choose = self.token_budget.chooser(batch_size, self.max_batch_wait_s)
        return self._inbox.get_chosen(choose, self.token_budget.window(batch_size), unless)

    def _batch_now(self, batch_size: int) -> list[Item] | None:
        """A batch of the items in now if it is full, or its oldest item has waited
        `max_batch_wait_s` (as `_next_batch` forms it), else None: never waits."""
        if self.token_budget is None:
            return self._inbox.take_now(batch_size, self.max_batch_wait_s)
        choose = self.token_budget.chooser(batch_size, self.max_batch_wait_s)
        return self._inbox.take_chosen_now(choose, self.token_budget.window(batch_size))


class ThreadStage(Stage):
    """Runs `fn(values) -> outputs` on `workers` threads of this process."""

    def __init__(
        self,
        name: str,
        fn: Callable[[list[Any]], Sequence[Any]],
        workers: int = 1,
        batch_size: int = 1,
        max_batch_wait_ms: float = 0,
    ):
        super().__init__(name, workers, batch_size, max_batch_wait_ms)
        self._fn = fn

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        finished: Channel[Item],
    ) -> None:
        super().start(inbox, outbox, observer, finished)
        for number in range(self.workers):
            self._spawn_thread(self._serve, str(number))

    def _serve(self) -> None:
        """Take batches until the inbox closes; run the live items, forward them all."""
        while True:
            items = self._next_batch()
            live = live_items(items)
            if live:
                self._run(live)
            self._outbox.put_all(items)

    def _run(self, items: list[Item]) -> None:
        started = time.perf_counter()
        outcomes = isolate_failures(
            lambda positions: self._fn([items[p].value for p in positions]), len(items), self.name
        )
        apply_outcomes(items, outcomes)
        self._observer.stage_ran(self.name, items, time.perf_counter() - started, ())


def live_items(items: list[Item]) -> list[Item]:
    return [item for item in items if item.error is None]
