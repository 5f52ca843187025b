"""What a process stage learns from its children's replies and deaths, for the children
it starts next and for telling a broken worker from bad input.

Shared by the stage's driver threads (one per child), hence the lock.
"""

from __future__ import annotations

import signal
import threading

from worker.engine.arena import TensorArena
from worker.engine.child_handle import WorkerDied, host_oom_kills
from worker.engine.items import Item, ItemError, PrepareStep
from worker.engine.wire import KnownGood, Reply

# A stage that has never prepared an input (fetched it) stops once requests of this many
# jobs in a row failed every item (`_judged`, untold).
UNTOLD_JOBS_BEFORE_FAULT = 3


class StageLessons:
    """A stage's known good (`KnownGood`): for a prepare step, the latest values it
    prepared; for a fan-out (which reads `reads`), a copy of an image it cut up. And the
    jobs whose requests failed every item with nothing prepared to tell by, and the
    host's count of OOM kills when the stage last looked."""

    def __init__(self, prepare: PrepareStep | None, fan_out_reads: TensorArena | None):
        self._prepare = prepare
        self._fan_out_reads = fan_out_reads
        self._known_good = KnownGood()
        self._untold: set[str] = set()
        self._oom_kills = host_oom_kills()
        self._lock = threading.Lock()

    def known_good(self) -> KnownGood:
        """What a new child is told its stage handled well."""
        with self._lock:
            return self._known_good.copy()

    def learn(self, live: list[Item], reply: Reply) -> frozenset[str]:
        """Keep an item the reply shows handled well, before its value is replaced by its
        outcome. Returns the jobs of requests in a row that failed every input with none
        ever prepared, once there are `UNTOLD_JOBS_BEFORE_FAULT` of them (credentials
        that never worked: the stage is broken), else nothing."""
        if self._fan_out_reads is not None and self._known_good.fan_out_stale():
            self._learn_cut(live, reply)
        if self._prepare is None:
            return frozenset()
        step = self._prepare.name
        prepared = next(
            (
                item
                for item, outcome in zip(live, reply.outcomes, strict=True)
                if not (isinstance(outcome, ItemError) and outcome.stage == step)
            ),
            None,
        )
        with self._lock:
            if prepared is not None:
                self._known_good.remember(prepared.value)
                self._untold.clear()
            if reply.untold:
                self._untold |= {item.job for item in live}
            untold = frozenset(self._untold)
        return untold if len(untold) >= UNTOLD_JOBS_BEFORE_FAULT else frozenset()

    def _learn_cut(self, live: list[Item], reply: Reply) -> None:
        """Keep a copy of the first image the fan-out cut up, with what it was told."""
        cut = next(
            (
                item
                for item, outcome in zip(live, reply.outcomes, strict=True)
                if not isinstance(outcome, ItemError)
            ),
            None,
        )
        if cut is None:
            return
        assert self._fan_out_reads is not None and cut.slot is not None
        image = self._fan_out_reads.array[cut.slot].copy()
        with self._lock:
            self._known_good.cut(image, cut.value)

    def oom_killed(self, died: WorkerDied) -> bool:
        """Whether the kernel's OOM killer killed the child: it died of SIGKILL, and the
        host's count of such kills rose since this stage last looked."""
        kills = host_oom_kills()
        with self._lock:
            rose = kills > self._oom_kills
            self._oom_kills = kills
        return died.exit_code == -signal.SIGKILL and rose
