"""What a job's producer is told once the job ends: a finished job's notices (the
`--notify-*` targets), sent at least once, and a dead-lettered job's `rejected.json`.

A notice is sent before the job's message is deleted, and once every target took it,
the `announced` marker beside job.json says so. Whoever finds a job.json that no such
marker names (a redelivery of a job whose worker died before its notice went, or whose
send failed; a watch or a shard's redelivery finding its job merged) sends it: notices
are at least once, where a notice lost with its worker was never sent. A notice that is
not sent keeps the message: it comes back, and its next delivery sends it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import structlog

from worker.errors import MissingObject, ObjectTooLarge
from worker.jobs.checkpoints import MAX_MARKER_BYTES, REJECTED, Checkpoints
from worker.jobs.job import Job
from worker.jobs.plan import Plan
from worker.message import JobMessage
from worker.ports import BlobStore, S3Location
from worker.telemetry.metrics import Metrics

log = structlog.get_logger()

ANNOUNCED = "announced"
# The fields of a job.json that name one writing of it (a job sent again writes another).
ANNOUNCED_FIELDS = ("job_id", "request_id", "request_digest", "finished_at")


class Notices:
    """Sends finished jobs' notices, marks them sent, and writes rejections."""

    def __init__(
        self,
        blobs: BlobStore,
        checkpoints: Checkpoints,
        metrics: Metrics,
        notify: Sequence[Callable[[str], None]],
    ):
        self._blobs = blobs
        self._checkpoints = checkpoints
        self._metrics = metrics
        self._notify = notify

    def announce(self, spec: JobMessage, finished: dict[str, Any], message_id: str) -> bool:
        """Count and log a job whose job.json (`finished`) this delivery wrote (and with
        it withdrew any rejection: `withdraw_rejection`), and send its notices; False if
        one was not sent (its message is to come back for it)."""
        self._metrics.jobs.labels(finished["status"]).inc()
        log.info(
            "job_finished",
            **{key: finished[key] for key in ("job_id", "status", "items", "duration_s")},
            message_id=message_id,
        )
        return self._send(spec, finished)

    def announce_found(self, spec: JobMessage, finished: dict[str, Any]) -> bool:
        """Send the notices of a job.json found written (`finished`) unless the marker
        says they were sent; False if one was not sent."""
        if not self._notify or self._announced(spec, finished):
            return True
        log.info("job_announced_late", job_id=finished.get("job_id"))
        return self._send(spec, finished)

    def merged(self, spec: JobMessage, plan: Plan, merged: dict[str, Any] | None, job: Job) -> bool:
        """For whoever merged a planned job, or tried to, before it acks its message
        (`job`): the notices of the job.json this merge wrote (`merged`), or else of one
        written for the plan's request and not announced; False if one was not sent."""
        if merged is not None:
            self.withdraw_rejection(spec)
            return self.announce(spec, merged, job.message.message_id)
        if not self._notify:
            return True
        found = self._checkpoints.finished(spec, plan.job_id, plan.request_digest)
        return found is None or self.announce_found(spec, found)

    def rejected(self, output: S3Location, body: str, reason: str) -> None:
        """Write `rejected.json` under a dead-lettered job's `output` (its `job_id` and
        `request_id` as the message `body` gives them, if it does) for its producer,
        whose wait has no job.json to end it. Never raises: the message goes to the
        DLQ with its reason whatever happens here."""
        try:
            document = json.loads(body)
        except ValueError:
            document = {}
        fields = document if isinstance(document, dict) else {}
        rejection = {
            "job_id": _text(fields.get("job_id")),
            "request_id": _text(fields.get("request_id")),
            "reason": reason,
            "rejected_at": datetime.now(UTC).isoformat(),
        }
        location = S3Location(output.bucket, output.key + REJECTED)
        try:
            self._blobs.put(location, json.dumps(rejection).encode(), "application/json")
        except Exception as error:
            log.warning("rejection_not_written", output=str(output), error=repr(error))

    def withdraw_rejection(self, spec: JobMessage, since: float | None = None) -> None:
        """Remove the `rejected.json` an earlier run of this same request left (its
        message redriven from the DLQ), as a new run of it is admitted (`since`: when
        its delivery came, less the clocks' skew; one written since is this run's own,
        by a delivery beside it) or has written its job.json (any: the job is done):
        the producer's wait follows the new run, where it raised at once with the old
        reason. One naming another request (or job) is left: it is that request's
        answer. Never raises: a rejection left answers for the request only until its
        job.json, which the client reads first."""
        if self.rejection_to_withdraw(spec, since):
            self.remove_rejection(spec)

    def rejection_to_withdraw(self, spec: JobMessage, since: float | None = None) -> bool:
        """Whether `withdraw_rejection` would remove a rejected.json now (a GET): read
        beside a job.json's write, and removed once that has landed."""
        location = spec.output_location(REJECTED)
        try:
            rejection = json.loads(self._blobs.get(location, MAX_MARKER_BYTES))
            if (rejection.get("job_id"), rejection.get("request_id")) != (
                spec.job_id,
                spec.request_id,
            ):
                return False
            return since is None or rejected_at(rejection) < since  # else this run's own
        except (MissingObject, ObjectTooLarge, ValueError, AttributeError, KeyError, TypeError):
            return False  # none, or none of a rejection's
        except Exception as error:
            log.warning("rejection_not_withdrawn", job_id=spec.job_id, error=repr(error))
            return False

    def remove_rejection(self, spec: JobMessage) -> None:
        """Delete the request's rejected.json (`rejection_to_withdraw` said so); never raises."""
        try:
            self._blobs.delete([spec.output_location(REJECTED)])
            log.info("rejection_withdrawn", job_id=spec.job_id, request_id=spec.request_id)
        except Exception as error:
            log.warning("rejection_not_withdrawn", job_id=spec.job_id, error=repr(error))

    def _send(self, spec: JobMessage, finished: dict[str, Any]) -> bool:
        """Each notice; then, if every one was sent, the marker."""
        if not self._notify:
            return True
        notice = json.dumps(finished)
        sent = True
        for notify in self._notify:
            try:
                notify(notice)
            except Exception as error:
                log.warning("notify_failed", job_id=finished["job_id"], error=repr(error))
                sent = False
        if not sent:
            return False
        marker = {key: finished.get(key) for key in ANNOUNCED_FIELDS}
        try:
            self._blobs.put(
                spec.output_location(ANNOUNCED), json.dumps(marker).encode(), "application/json"
            )
        except Exception as error:  # sent: a later finder may send it again
            log.warning("announced_not_marked", job_id=finished["job_id"], error=repr(error))
        return True

    def _announced(self, spec: JobMessage, finished: dict[str, Any]) -> bool:
        """Whether the marker names this job.json (not an earlier run's, to the same
        output)."""
        try:
            marker = json.loads(self._blobs.get(spec.output_location(ANNOUNCED), MAX_MARKER_BYTES))
        except (MissingObject, ObjectTooLarge, ValueError):
            return False
        return isinstance(marker, dict) and all(
            marker.get(key) == finished.get(key) for key in ANNOUNCED_FIELDS
        )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def rejected_at(rejection: dict[str, Any]) -> float:
    """When a rejection was written (seconds since the epoch); ValueError if it says
    not."""
    return datetime.fromisoformat(str(rejection.get("rejected_at"))).timestamp()
