"""Time in tests: a clock a test moves by hand, and waiting for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wait_until(
    condition: Callable[[], object], timeout_s: float = 60, every_s: float = 0.02
) -> None:
    """Return once `condition()` is true, looking every `every_s`; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every_s)
