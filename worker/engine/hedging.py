"""When to hedge a call against its tail latency ("The Tail at Scale", Dean and Barroso):
a call still outstanding past the recent 95th percentile of its kind is made again, and
the first answer wins. S3's GETs take 30 ms at the median and 200 ms at the 99th
percentile; a fetch of thousands of inputs meets that tail on every batch. About one
call in twenty is hedged, the price the 95th percentile sets (a child of a process
stage makes the second call: `worker.engine.child_main`).
"""

from __future__ import annotations

import threading
from collections import deque

HEDGE_QUANTILE = 0.95
HEDGE_FLOOR_S = 0.005  # a call faster than this is no tail worth a second one
TIMED_CALLS = 256  # the latest calls whose times set the quantile
TIMED_BEFORE_HEDGING = 32  # no hedge before this many calls are timed


class TailLatency:
    """The latest calls' times, and from them how long a call may take before it is
    hedged: their 95th percentile, taken again every `TIMED_BEFORE_HEDGING` calls,
    never less than `HEDGE_FLOOR_S`; None until that many are timed. Every first call
    is timed when it ends, hedged or not, so the quantile is that of all the answers,
    their tail included."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=TIMED_CALLS)
        self._timed = 0
        self._hedge_after_s: float | None = None
        self._lock = threading.Lock()

    def timed(self, seconds: float) -> None:
        with self._lock:
            self._times.append(seconds)
            self._timed += 1
            if self._timed % TIMED_BEFORE_HEDGING:
                return
            ordered = sorted(self._times)
            quantile = ordered[min(len(ordered) - 1, int(HEDGE_QUANTILE * len(ordered)))]
            self._hedge_after_s = max(HEDGE_FLOOR_S, quantile)

    def hedge_after_s(self) -> float | None:
        return self._hedge_after_s
