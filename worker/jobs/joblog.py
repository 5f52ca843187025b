"""Logging: the daemon's own JSON lines on stdout, and one JSON-lines file per job."""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import structlog

_TIMESTAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)


def configure_daemon_logging(stream: TextIO = sys.stdout) -> None:
    """The daemon's log: JSON lines on stdout, which is what CloudWatch collects on ECS."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _TIMESTAMP,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


def local_log_path(log_dir: Path, job_id: str, output: str) -> Path:
    """Where a job's log is kept on this machine: named by its id and its output, so two
    jobs of one id (reused by a sender, or a first message id forged) never share it."""
    return log_dir / f"{job_id}.{hashlib.sha256(output.encode()).hexdigest()[:8]}.log"


class JobLog:
    """One job's own log: every stage's events about the job, as JSON lines.

    The lines are kept in memory: `lines` is what the daemon uploads as `job.log`. The
    local file (at `path`) is for the machine's operator: `flush` appends the lines not yet
    written (the daemon flushes every in-flight job with its progress, so a long job can
    be followed there), `close` writes the rest when the job is given back (the file
    names the fault; a redelivery here appends its own attempt), and `discard` removes
    the file once the job's outputs are in S3, so a daemon that runs for months does not
    fill its disk with millions of finished jobs' logs. A job that finishes between two
    flushes never touches the disk: a file write per event was a third of the daemon's
    CPU on one-image jobs.
    """

    def __init__(self, path: Path, job_id: str, earlier: bytes = b""):
        self._earlier = earlier  # earlier deliveries' lines, from their checkpoints
        self._lines = _Lines(path)
        self._logger: Any = structlog.wrap_logger(
            self._lines,
            processors=[
                structlog.processors.add_log_level,
                _TIMESTAMP,
                structlog.processors.JSONRenderer(),
            ],
            wrapper_class=structlog.BoundLogger,
            job_id=job_id,
        )

    def info(self, event: str, **fields: Any) -> None:
        self._logger.info(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._logger.error(event, **fields)

    def lines(self) -> bytes:
        """Earlier deliveries' lines, then this one's so far."""
        return self._earlier + self._lines.joined()

    def since(self, mark: int) -> tuple[bytes, int]:
        """This delivery's lines after the first `mark`, and the mark after them."""
        return self._lines.since(mark)

    def flush(self) -> None:
        self._lines.write()

    def close(self) -> bytes:
        """Write what is left to the local file; returns this attempt's lines."""
        self._lines.write()
        return self._lines.joined()

    def discard(self) -> None:
        """Remove the local file, earlier attempts' lines too: the job is done and its
        log is safe in S3."""
        self._lines.discard()


class _Lines:
    """structlog's logger for one job: the rendered lines, and how many are on disk."""

    def __init__(self, path: Path):
        self._path = path
        self._kept: list[str] = []
        self._written = 0
        self._discarded = False
        self._lock = threading.Lock()  # stage threads, the regrouper and finishers all log

    def msg(self, line: str) -> None:
        with self._lock:
            self._kept.append(line + "\n")

    info = error = msg

    def joined(self) -> bytes:
        with self._lock:
            return "".join(self._kept).encode()

    def since(self, mark: int) -> tuple[bytes, int]:
        with self._lock:
            return "".join(self._kept[mark:]).encode(), len(self._kept)

    def write(self) -> None:
        """Append the lines not yet in the file (none once discarded)."""
        with self._lock:
            if not self._discarded and self._written < len(self._kept):
                with self._path.open("a", encoding="utf-8") as file:
                    file.writelines(self._kept[self._written :])
                self._written = len(self._kept)

    def discard(self) -> None:
        with self._lock:
            self._discarded = True
            self._path.unlink(missing_ok=True)
