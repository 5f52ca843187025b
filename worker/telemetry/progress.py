"""The daemon's clock of progress: when it last moved work forward, which the supervisor
watches for a stall and every loop that moves work beats."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """When the daemon last moved work forward (a stage ran, a result came back, a job
    was admitted or settled, a stage's worker was replaced)."""

    def __init__(self, stall_after_s: float, clock: Callable[[], float] = time.monotonic):
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._at = clock()

    def beat(self) -> None:
        self._at = self._clock()

    def idle_s(self) -> float:
        return self._clock() - self._at

    def stalled(self) -> bool:
        return self.idle_s() > self.stall_after_s
