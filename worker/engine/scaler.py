"""Keeps a process stage's worker count between its floor and its ceiling, following
demand.
"""

from __future__ import annotations

import threading
import time

import structlog

from worker.engine.channel import Channel
from worker.engine.items import Item, StageObserver
from worker.engine.process_stage import ProcessStage

log = structlog.get_logger()


# WorkerScaler: how often it looks, and the utilisation of a stage's workers (their
# time on requests over the wall time) above which it adds one when the next stage
# waits, and below which (counted as if one fewer did the work) it removes one.
SCALE_EVERY_S = 2.0


SHRINK_AFTER_S = 30.0


GROW_ABOVE_UTILISATION = 0.8


SHRINK_BELOW_UTILISATION = 0.6


class WorkerScaler:
    """Keeps a process stage's worker count between its `workers` and `max_workers` as
    demand goes: one more when the stage after it waits for input (fewer items ahead
    of it than a batch) while this stage's workers are nearly all busy, and one fewer
    once the workers left would have had time to spare for `shrink_after_s`."""

    def __init__(
        self,
        stage: ProcessStage,
        downstream: Channel[Item],
        downstream_batch_size: int,
        observer: StageObserver,
        *,
        every_s: float,
        shrink_after_s: float,
    ):
        self._stage = stage
        self._downstream = downstream
        self._downstream_batch_size = downstream_batch_size
        self._observer = observer
        self._every_s = every_s
        self._shrink_after_s = shrink_after_s

    def run(self, stopping: threading.Event) -> None:
        busy_s, at = self._stage.busy_s(), time.monotonic()
        spare_since: float | None = None
        while not stopping.wait(self._every_s):
            workers = self._stage.worker_count()
            now, now_busy_s = time.monotonic(), self._stage.busy_s()
            utilisation = (now_busy_s - busy_s) / (workers * (now - at))
            busy_s, at = now_busy_s, now
            starving = len(self._downstream) < self._downstream_batch_size
            if starving and utilisation >= GROW_ABOVE_UTILISATION:
                spare_since = None
                if self._stage.grow():
                    self._changed(f"the next stage waits, workers {utilisation:.0%} busy")
            elif utilisation * workers <= (workers - 1) * SHRINK_BELOW_UTILISATION:
                spare_since = spare_since if spare_since is not None else now
                if now - spare_since >= self._shrink_after_s and self._stage.shrink():
                    spare_since = None
                    self._changed(f"workers {utilisation:.0%} busy")
            else:
                spare_since = None

    def _changed(self, reason: str) -> None:
        workers = self._stage.worker_count()
        log.info("stage_workers_changed", stage=self._stage.name, workers=workers, reason=reason)
        self._observer.workers_changed(self._stage.name, workers, reason)
