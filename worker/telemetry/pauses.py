"""The garbage collector's pauses: what stops every thread of a process at once.

A full collection walks every object the interpreter tracks; the daemon's main process
holds torch's, boto3's and pydantic's modules, a few hundred thousand objects, and
such a collection stopped every loop of it for 70-200 ms, a few times a second at an
H100's pace (the feeder, every stage's driver, the regrouper: the device waited). What
exists once the daemon has started lives as long as it does: frozen
(`gc.freeze`), the collector no longer walks it, and a full collection walks what the
work since allocated alone. Each pause is timed (`gc.callbacks`): a metric, and a lane
of the timeline.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

OnPause = Callable[[int, float], None]  # (generation, seconds)


@contextlib.contextmanager
def started_heap_frozen(on_pause: OnPause | None = None) -> Iterator[None]:
    """Collect once, freeze what is left (the process as started), and report each
    collection's pause to `on_pause` while inside, the collector on (`worker run` starts
    with it off); unfrozen, and off again if it was, on the way out (a daemon embedded
    in another program, or a test, leaves its collector as it found it)."""
    was_on = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.enable()
    timer = _PauseTimer(on_pause) if on_pause is not None else None
    if timer is not None:
        gc.callbacks.append(timer)
    try:
        yield
    finally:
        if timer is not None:
            gc.callbacks.remove(timer)
        gc.unfreeze()
        if not was_on:
            gc.disable()


class _PauseTimer:
    """A `gc.callbacks` entry: times each collection from its start to its stop."""

    def __init__(self, on_pause: OnPause):
        self._on_pause = on_pause
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._on_pause(info["generation"], time.perf_counter() - self._started)
