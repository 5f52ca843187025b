"""Interruption notices: EC2 says an instance is going away before anything signals it.

A spot interruption is a two-minute notice in instance metadata, and then the instance
stops; a rebalance recommendation comes earlier; an Auto Scaling lifecycle hook holds a
terminating instance until the daemon says it is done. None of them is a SIGTERM, so
this loop reads them and hands each new one to the daemon: a rebalance, a termination,
and a termination that names the time (a spot notice may follow a scale-in seen first).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from worker.ports import Notice, NoticeKind, NoticeSource

log = structlog.get_logger()


class InterruptionWatch:
    """Polls a `NoticeSource` and calls `on_notice` with each notice that says more
    than the ones before it."""

    def __init__(
        self, notices: NoticeSource, interval_s: float, on_notice: Callable[[Notice], None]
    ):
        self._notices = notices
        self._interval_s = interval_s
        self._on_notice = on_notice
        self._reported: list[Notice] = []
        self._failing = False
        self._stopped = threading.Event()

    def check(self) -> None:
        """Poll once (before the daemon takes work: a notice may already stand)."""
        try:
            notice = self._notices.poll()
        except Exception as error:  # the service may blink; the next poll tries again
            if not self._failing:
                log.warning("interruption_notices_unreadable", error=repr(error))
            self._failing = True
            return
        self._failing = False
        if notice is not None and self._news(notice):
            self._reported.append(notice)
            self._on_notice(notice)

    def run(self) -> None:
        while not self._final() and not self._stopped.wait(self._interval_s):
            self.check()

    def stop(self) -> None:
        self._stopped.set()

    def _news(self, notice: Notice) -> bool:
        if notice.kind is NoticeKind.REBALANCE:
            return not self._reported
        terminations = [n for n in self._reported if n.kind is NoticeKind.TERMINATION]
        return not terminations or (notice.deadline is not None and not self._final())

    def _final(self) -> bool:
        """Nothing more can change once a termination with its time is known."""
        return any(
            n.kind is NoticeKind.TERMINATION and n.deadline is not None for n in self._reported
        )
