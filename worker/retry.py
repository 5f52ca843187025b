"""Retries with exponential backoff and full jitter, one budget per call.

botocore's standard retry mode shares one retry quota among every thread using a
client; under sustained throttling it runs dry and every later call fails at once
(boto/botocore#1952 added that quota). Here each call has its own budget of attempts,
so a throttled fetch waits its turn instead of failing an input.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from worker.errors import TransientError

T = TypeVar("T")
_RNG = random.Random()


@dataclass(frozen=True)
class Backoff:
    """Delays that double from `base_s` up to `cap_s`, each drawn uniformly below that
    bound ("full jitter"), so clients that failed together do not retry together."""

    base_s: float
    cap_s: float

    def bound_s(self, retry: int) -> float:
        """The longest wait before retry number `retry` (0 for the first)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(retry, 62))

    def delay_s(self, retry: int, rng: random.Random | None = None) -> float:
        return (rng or _RNG).uniform(0, self.bound_s(retry))


# An AWS call: 10 tries wait about 8 s on average, 17 s at most.
CALL_BACKOFF = Backoff(base_s=0.05, cap_s=5.0)
DEFAULT_AWS_MAX_ATTEMPTS = 10  # tries per AWS call (--aws-max-attempts)


def call_with_retries(
    call: Callable[[], T],
    attempts: int,
    backoff: Backoff = CALL_BACKOFF,
    sleep: Callable[[float], None] = time.sleep,
    *,
    deadline: float | None = None,
    longest_try_s: float = 0.0,
) -> T:
    """`call()`, tried up to `attempts` times while it raises `TransientError`; the last
    error is raised as it came. Any other exception is raised at once. With a `deadline`
    (a `time.monotonic()` time), no try starts after it, and a retry only if it can end
    before it (a try takes up to `longest_try_s`): the last error is raised instead, or
    a `TransientError` if no time was left for a first try."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    if deadline is not None and time.monotonic() >= deadline:
        raise TransientError("no time was left to try the call")
    for retry in range(attempts - 1):
        try:
            return call()
        except TransientError:
            delay_s = backoff.delay_s(retry)
            if deadline is not None and time.monotonic() + delay_s + longest_try_s > deadline:
                raise
            sleep(delay_s)
    return call()
