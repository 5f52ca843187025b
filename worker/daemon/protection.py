"""Scale-in protection: keep the instance (or task) from being scaled in while busy.

Protection is a lease on the machine, as visibility is a lease on a message: on when the
first job arrives, renewed while busy where it expires by itself (ECS), and off only
after the pipeline has been empty for the idle grace, so a trickle of jobs does not flap
the API. A failing call is logged and retried; it never stops the daemon. The guards
that make the calls are adapters in `worker/adapters/aws/`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import structlog

from worker.jobs.ledger import Ledger
from worker.ports import ScaleInGuard

log = structlog.get_logger()

RETRY_AFTER_FAILURE_S = 10.0


class ProtectionKeeper:
    """Protects the machine while the ledger holds jobs, on its own thread."""

    def __init__(
        self,
        ledger: Ledger,
        guard: ScaleInGuard,
        idle_grace_s: float,
        on_call: Callable[[bool, bool], None] = lambda protected, ok: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ledger = ledger
        self._guard = guard
        self._idle_grace_s = idle_grace_s
        self._on_call = on_call
        self._clock = clock
        self._protected = False
        self._last_set_at = 0.0
        self._busy_until = float("-inf")  # protection is wanted until then
        self._was_busy = False
        self._retry_at = float("-inf")
        self._stopped = threading.Event()

    @property
    def protected(self) -> bool:
        return self._protected

    def run(self) -> None:
        log.info("scale_in_protection", mode=self._guard.name)
        while not self._stopped.is_set():
            timeout_s = self.step()
            was_busy = bool(len(self._ledger))
            self._ledger.wait_until(functools.partial(self._should_wake, was_busy), timeout_s)

    def stop(self) -> None:
        """End `run`'s loop; the daemon then calls `unprotect`, once the loop is over."""
        self._stopped.set()
        self._ledger.wake()

    def unprotect(self) -> None:
        """Drop protection: it is never left on after the daemon exits."""
        for _ in range(3):
            if not self._protected or self._set(False):
                return

    def _should_wake(self, was_busy: bool) -> bool:
        return self._stopped.is_set() or bool(len(self._ledger)) != was_busy

    def step(self) -> float:
        """Make one decision; returns how long until the next one is due."""
        now = self._clock()
        busy = bool(len(self._ledger))
        if busy or self._was_busy:  # the idle grace counts from when the last job left
            self._busy_until = now + self._idle_grace_s
        self._was_busy = busy
        wanted = now < self._busy_until
        renew_every_s = self._guard.renew_every_s
        due_renewal = (
            wanted
            and self._protected
            and renew_every_s is not None
            and now - self._last_set_at >= renew_every_s
        )
        if (wanted != self._protected or due_renewal) and now >= self._retry_at:
            self._set(wanted)
        deadlines = [self._retry_at]
        if self._protected:
            deadlines.append(self._busy_until)
            if renew_every_s is not None:
                deadlines.append(self._last_set_at + renew_every_s)
        upcoming = [deadline - now for deadline in deadlines if deadline > now]
        return min(upcoming, default=self._idle_grace_s)

    def _set(self, protected: bool) -> bool:
        try:
            self._guard.set_protected(protected)
        except Exception as error:
            self._retry_at = self._clock() + RETRY_AFTER_FAILURE_S
            log.warning(
                "scale_in_protection_failed",
                protected=protected,
                error=repr(error),
                retry_in_s=RETRY_AFTER_FAILURE_S,
            )
            self._on_call(protected, False)
            return False
        self._protected = protected
        self._last_set_at = self._clock()
        log.info("scale_in_protection_set", protected=protected, mode=self._guard.name)
        self._on_call(protected, True)
        return True
