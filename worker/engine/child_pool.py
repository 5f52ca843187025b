"""A stage whose function runs in a pool of child processes: started side by side, grown
and shrunk by the scaler, stopped together. How the children are fed is its subclass's
(`ProcessStage`)."""

from __future__ import annotations

import abc
import functools
import itertools
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from worker.engine.channel import Channel, Closed
from worker.engine.child_handle import ChildProcess
from worker.engine.items import Item, StageObserver, StageSetup, StageSetupError
from worker.engine.stage import Stage
from worker.engine.wire import ChildPlan

log = structlog.get_logger()


class ChildPoolStage(Stage, abc.ABC):
    """`workers` child processes (up to `max_workers`), each set up by `setup`, or one
    per set-up where `setup` is a sequence of them; a driver thread each."""

    def __init__(
        self,
        name: str,
        setup: StageSetup | Sequence[StageSetup],
        *,
        workers: int,
        max_workers: int | None,
        batch_size: int,
        max_batch_wait_ms: float,
        setup_timeout_s: float,
    ):
        setups = list(setup) if isinstance(setup, Sequence) else None
        if setups is not None:
            if max_workers or workers != 1:
                raise ValueError(f"stage {name}: one set-up per worker fixes their number")
            workers = len(setups)
        super().__init__(name, workers, batch_size, max_batch_wait_ms)
        self.max_workers = max(workers, max_workers or workers)
        self._setups = setups
        self._setup = setup
        self.setup_timeout_s = setup_timeout_s
        self._children: list[ChildProcess] = []
        self._numbers = itertools.count(workers)  # of children added later
        self._busy_s = 0.0  # the children's time on requests, all together
        self._lock = threading.Lock()  # the above; drivers and the scaler share them

    @abc.abstractmethod
    def _plan(self, number: int) -> ChildPlan:
        """What the child with this number is told when it starts."""

    @abc.abstractmethod
    def _serve_child(self, child: ChildProcess) -> None:
        """Feed `child` until the inbox closes (its driver thread)."""

    def _setup_of(self, number: int) -> StageSetup:
        if self._setups is not None:
            return self._setups[number]
        assert callable(self._setup)
        return self._setup

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        finished: Channel[Item],
    ) -> None:
        super().start(inbox, outbox, observer, finished)
        self._children = [self._child(number) for number in range(self.workers)]
        # Children start in parallel: each imports torch and may load a model.
        try:
            with ThreadPoolExecutor(self.workers) as pool:
                list(pool.map(ChildProcess.start, self._children))
        except BaseException:
            self.stop()
            raise
        for number, child in enumerate(self._children):
            self._spawn_thread(functools.partial(self._serve_child, child), str(number))

    def alive(self) -> bool:
        return super().alive() and all(child.alive() for child in self._children)

    def _child(self, number: int) -> ChildProcess:
        return ChildProcess(
            f"{self.name}-{number}",
            functools.partial(self._plan, number),
            self.setup_timeout_s,
            self.stopping,
        )

    def worker_count(self) -> int:
        with self._lock:
            return sum(not child.retiring.is_set() for child in self._children)

    def busy_s(self) -> float:
        """How long the children have spent on requests since the stage started."""
        with self._lock:
            return self._busy_s

    def grow(self) -> bool:
        """Start one more child (up to `max_workers`); False if there is no room or it
        could not start."""
        if self.worker_count() >= self.max_workers or self.stopping.is_set():
            return False
        number = next(self._numbers)
        child = self._child(number)
        try:
            child.start()
        except (StageSetupError, Closed) as error:
            log.warning("stage_worker_not_added", stage=self.name, error=str(error))
            return False
        with self._lock:  # `stop` sets `stopping`, then takes the children it stops
            added = not self.stopping.is_set()
            if added:
                self._children.append(child)
        if not added:
            child.stop(graceful=False)
            return False
        self._spawn_thread(functools.partial(self._serve_child, child), str(number))
        return True

    def shrink(self) -> bool:
        """Have one child (down to `workers`) finish what it holds and stop."""
        with self._lock:
            serving = [child for child in self._children if not child.retiring.is_set()]
            if len(serving) <= self.workers:
                return False
            serving[-1].retiring.set()
        self._inbox.wake()
        return True

    def about(self) -> Mapping[str, Any]:
        """What the set-up of its first child reported (`StageFunction.about`)."""
        return self._children[0].about if self._children else {}

    def _retire(self, child: ChildProcess) -> None:
        """Stop a child that `shrink` chose, with this, its driver thread."""
        with self._lock:
            self._children.remove(child)
            self._threads.remove(threading.current_thread())
        child.stop()

    def stop(self) -> None:
        """Stop the children (killing those that do not stop within `STOP_GRACE_S`),
        then their driver threads, which the children's exit unblocks."""
        self.stopping.set()
        with self._lock:
            children = list(self._children)
        with ThreadPoolExecutor(max(1, len(children))) as pool:
            list(pool.map(ChildProcess.stop, children))
        super().stop()
