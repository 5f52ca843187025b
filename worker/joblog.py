"""Logging: the daemon's own JSON lines on stdout, and one JSON-lines file per job."""

from __future__ import annotations

import logging
import sys
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


class JobLog:
    """One job's own log file: every stage's events about the job, as JSON lines.

    The file is appended to, so when a job is released and tried again on this machine
    the local file keeps every attempt; `close` returns this attempt's part.
    """

    def __init__(self, path: Path, job_id: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._start = self._file.tell()
        self._logger: Any = structlog.wrap_logger(
            structlog.WriteLogger(self._file),
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

    def close(self) -> bytes:
        """Close the file and return this attempt's lines (idempotent)."""
        if not self._file.closed:
            self._file.close()
        with self.path.open("rb") as file:
            file.seek(self._start)
            return file.read()
