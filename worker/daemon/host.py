"""A host that keeps breaking its workers is taken out of service.

Each time the daemon stops broken, it notes when and why in a file on the host: docker's
restart policy restarts the same container, so the notes outlive the process. Once
`limit` of them fall within the last `window_s`, the host is at fault, not the jobs
(each breakage handed its other jobs over uncharged): the daemon asks its platform to
replace the machine (`ScaleInGuard.take_out_of_service`: SetInstanceHealth Unhealthy on
EC2; on ECS the task's exit is all it takes), says why in a log line and a metric, and a
daemon restarted there takes no work.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from worker.ports import ScaleInGuard
from worker.telemetry.metrics import Metrics

log = structlog.get_logger()

BREAKAGES_FILE = "breakages.jsonl"
BREAKAGE_WINDOW_S = 3600.0


class Breakages:
    """The breakages noted on this host (`BREAKAGES_FILE` in the log directory)."""

    def __init__(
        self,
        directory: Path,
        limit: int,
        window_s: float = BREAKAGE_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ):
        self._path = directory / BREAKAGES_FILE
        self.limit = limit
        self._window_s = window_s
        self._clock = clock

    def note(self, cause: str) -> None:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("a") as notes:
                # On a line of its own even after a line cut short (the daemon killed
                # as it wrote): blank lines are skipped.
                notes.write("\n" + json.dumps({"at": self._clock(), "cause": cause}) + "\n")
        except OSError as error:  # a full disk: the daemon stops broken all the same
            log.error("breakage_not_noted", path=str(self._path), error=repr(error))

    def recent(self) -> list[str]:
        """The causes of the breakages within the window, oldest first."""
        try:
            lines = self._path.read_text().splitlines()
        except FileNotFoundError:
            return []
        since = self._clock() - self._window_s
        causes = []
        for line in lines:
            try:  # a line cut short (the daemon killed as it wrote) is skipped
                note = json.loads(line)
                if note["at"] >= since:
                    causes.append(str(note["cause"]))
            except (ValueError, KeyError, TypeError):
                continue
        return causes

    def too_many(self) -> bool:
        return self.limit > 0 and len(self.recent()) >= self.limit


def take_out_of_service(breakages: Breakages, guard: ScaleInGuard | None, metrics: Metrics) -> None:
    """Ask the platform to replace this machine, saying why; a failed call is logged (the
    daemon exits broken all the same, and tries again if it is restarted here)."""
    causes = breakages.recent()
    reason = (
        f"{len(causes)} breakages of this host's workers within "
        f"{BREAKAGE_WINDOW_S / 60:.0f} minutes; the last: {causes[-1] if causes else '?'}"
    )
    metrics.host_out_of_service.set(1)
    if guard is None:
        action = "none: no platform to tell (--protection off); the daemon exits"
    else:
        try:
            action = guard.take_out_of_service()
        except Exception as error:
            log.error("host_out_of_service_failed", reason=reason, error=repr(error))
            return
    log.error("host_out_of_service", reason=reason, action=action)
