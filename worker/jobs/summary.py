"""job.json: what a finished job says of itself, the same whether one worker ran it or
the fleet ran it as shards (`worker.sharding.shards`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from worker.jobs.job import job_status


def job_summary(
    *,
    job_id: str,
    request_id: str | None,
    cancelled: bool,
    items: int,
    succeeded: int,
    failed: int,
    resumed: int,
    request_digest: str,
    model: dict[str, Any],
    received_at: float,
    attempt: int,
    worker: dict[str, Any],
    device_s: float,
    device_hour_price: float | None,
    format: str,
) -> dict[str, Any]:
    """job.json's fields but `outputs` (the finish adds them once they are written):
    `device_s` is the time the job's items kept a device busy (each batch's time shared
    among the jobs in it by their items), and `cost` that at `device_hour_price`."""
    finished_at = time.time()
    summary = {
        "job_id": job_id,
        "request_id": request_id,
        "status": job_status(cancelled=cancelled, succeeded=succeeded, failed=failed).value,
        "items": items,
        "succeeded": succeeded,
        "failed": failed,
        "resumed": resumed,
        "request_digest": request_digest,
        "model": model,
        "received_at": _iso(received_at),
        "finished_at": _iso(finished_at),
        "duration_s": round(finished_at - received_at, 3),
        "attempt": attempt,
        "worker": worker,
        "device_s": round(device_s, 3),
        "format": format,
    }
    if device_hour_price is not None:
        summary["cost"] = round(device_s / 3600 * device_hour_price, 6)
    return summary


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")
