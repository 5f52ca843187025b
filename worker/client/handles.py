"""The producer's handles: `Jobs` sends jobs to a queue, `Job` follows one by its output
(its status, its results, its cancellation)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import pyarrow as pa
from pydantic_core import PydanticSerializationError

from worker.adapters import aws
from worker.client.outputs import JOB_JSON, Outputs, Summary
from worker.datasets.openai_batch import OPENAI_ERRORS_FILE, OPENAI_OUTPUT_FILE
from worker.datasets.tables import NDJSON
from worker.errors import MessageRefused, TransientError
from worker.message import (
    CANCEL_MARKER,
    JobMessage,
    PoisonMessage,
    TableSource,
    TarMembers,
    parse_job_message,
)
from worker.ports import SQS_UNSENDABLE, BlobStore, S3Location

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

# The daemon's allow-list (`Settings.allowed_buckets`), where the producer's environment
# has the daemon's settings.
ALLOWED_BUCKETS_ENV = "WORKER_ALLOWED_BUCKETS"
S3_CONNECTIONS = 2  # the client reads one object at a time
# Where `submit_openai_batch` puts a local batch file, under the job's output by default.
UPLOADED_REQUESTS = "openai-requests.jsonl"
Answer = TypeVar("Answer")


class InvalidJob(ValueError):
    """A job the daemon would refuse (dead-letter): nothing was sent."""


class JobNotFinished(Exception):
    """The job's job.json is not written yet: its results are not complete."""


class JobStalled(Exception):
    """Nothing left of a job split across the fleet can run: its shards left were
    dead-lettered, or their messages are gone. It ends once they are redriven."""


class JobRejected(Exception):
    """The daemon dead-lettered the job: its rejected.json says why (`reason`). It runs
    only if it is redriven from the DLQ (or sent again)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class CancelRefused(Exception):
    """The job is finished already, or the output is another job's."""


class Phase(StrEnum):
    QUEUED = "queued"  # nothing under its output says it started
    RUNNING = "running"  # its progress.json is written
    STALLED = "stalled"  # its progress.json says no shard left can run (`JobStatus.stalled`)
    REJECTED = "rejected"  # its rejected.json is written: dead-lettered (`JobStatus.rejected`)
    FINISHED = "finished"  # its job.json is written


@dataclass(frozen=True)
class JobStatus:
    """One look at a job: its phase, its counts so far, and job.json once finished."""

    phase: Phase
    items: int  # 0 until known
    finished: int  # items with a result, failed ones included
    failed: int
    summary: dict[str, Any] | None = None
    stalled: str | None = None  # why, while the phase is STALLED
    rejected: str | None = None  # why, once the phase is REJECTED


class JobQueue(Protocol):
    """Where jobs are sent (`JobSource.send_many`)."""

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None: ...


class Jobs:
    """Sends jobs to one queue, for daemons that read and write one store (and refuse
    buckets outside `allowed_buckets`, if it is not empty)."""

    def __init__(
        self, queue: JobQueue, blobs: BlobStore, allowed_buckets: frozenset[str] = frozenset()
    ):
        self._queue = queue
        self._blobs = blobs
        self._allowed_buckets = allowed_buckets

    @classmethod
    def connect(
        cls,
        queue_url: str,
        *,
        sqs: SQSClient | None = None,
        s3: S3Client | None = None,
        allowed_buckets: Iterable[str] | None = None,
    ) -> Jobs:
        """Jobs on an SQS queue and S3, with the clients given or ones from boto3's usual
        configuration (credentials, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL). A job naming
        a bucket outside `allowed_buckets` (by default the daemon's own setting,
        WORKER_ALLOWED_BUCKETS, where the environment has it) is refused before it is
        sent: the daemon would dead-letter it."""
        if allowed_buckets is None:  # as the daemon's settings read it
            listed = os.environ.get(ALLOWED_BUCKETS_ENV, "").split(",")
            allowed_buckets = (bucket.strip() for bucket in listed if bucket.strip())
        queue = aws.SqsJobSource(sqs or aws.sqs_client(), queue_url, dlq_url=None)
        blobs = aws.S3BlobStore(s3 or aws.s3_client(S3_CONNECTIONS))
        return cls(queue, blobs, frozenset(allowed_buckets))

    def submit(
        self,
        output: str,
        *,
        inputs: Sequence[str] | None = None,
        manifest: str | None = None,
        inputs_prefix: str | None = None,
        inputs_suffix: str | None = None,
        table: TableSource | dict[str, Any] | None = None,
        inventory: str | None = None,
        texts: Sequence[Any] | None = None,
        openai_batch: str | None = None,
        params: dict[str, Any] | None = None,
        format: Literal["jsonl", "parquet"] = "jsonl",
        job_id: str | None = None,
        shard_items: int | None = None,
        tar: TarMembers | dict[str, Any] | None = None,
    ) -> Job:
        """Send a job (docs/jobs.md, "The job message": exactly one source of inputs) and
        return its handle; `InvalidJob`, with every reason, if the daemon would refuse
        it, or SQS would. The job id is a new uuid unless given, the request id a new
        one always (the handle takes only the files this run writes); the job is its own
        message group, as its shards will be (the tenant, on an SQS fair queue)."""
        if isinstance(table, TableSource):
            table = table.model_dump(exclude_none=True, exclude_unset=True)
        if isinstance(tar, TarMembers):
            tar = tar.model_dump(exclude_none=True, exclude_unset=True)
        fields = {
            "job_id": job_id,
            "inputs": None if inputs is None else list(inputs),
            "manifest": manifest,
            "inputs_prefix": inputs_prefix,
            "inputs_suffix": inputs_suffix,
            "table": table,
            "inventory": inventory,
            "texts": None if texts is None else list(texts),
            "openai_batch": openai_batch,
            "output": output,
            "params": params,
            "format": format,
            "shard_items": shard_items,
            "tar": tar,
        }
        return self._send(self._message(fields))

    def submit_openai_batch(
        self,
        requests: str | Path,
        output: str,
        *,
        upload_to: str | None = None,
        job_id: str | None = None,
        params: dict[str, Any] | None = None,
        format: Literal["jsonl", "parquet"] = "jsonl",
        shard_items: int | None = None,
    ) -> Job:
        """Send a job of an OpenAI Batch API input file of /v1/embeddings requests (docs/
        jobs.md, "OpenAI batch files"): an s3:// URI, or a local file, uploaded first to
        `upload_to` (by default `<output>openai-requests.jsonl`). Its handle's
        `openai_batch_files` fetches the output and error files once it has finished.
        `InvalidJob`, and nothing uploaded, if the daemon would refuse the job."""
        local = not (isinstance(requests, str) and requests.startswith("s3://"))
        uploaded = upload_to or f"{output.rstrip('/')}/{UPLOADED_REQUESTS}"
        fields = {
            "job_id": job_id,
            "openai_batch": uploaded if local else str(requests),
            "output": output,
            "params": params,
            "format": format,
            "shard_items": shard_items,
        }
        message = self._message(fields)
        if local:
            assert message.openai_batch is not None
            location = S3Location.parse(message.openai_batch)
            self._blobs.put_file(location, Path(requests), NDJSON)
        return self._send(message)

    def _message(self, fields: dict[str, Any]) -> JobMessage:
        """The job message of `fields` (None: not given), with a job id (a new uuid
        unless given) and a new request id; `InvalidJob` if the daemon would refuse it."""
        fields = {
            **fields,
            "job_id": fields.get("job_id") or uuid.uuid4().hex,
            "request_id": uuid.uuid4().hex,
        }
        try:
            body = json.dumps({name: value for name, value in fields.items() if value is not None})
        except (TypeError, ValueError) as error:
            raise InvalidJob(f"invalid job message: params are not JSON: {error}") from error
        try:
            return parse_job_message(body, allowed_buckets=self._allowed_buckets)
        except PoisonMessage as error:
            raise InvalidJob(str(error)) from error

    def _send(self, message: JobMessage) -> Job:
        """Send a job's message, its own message group; its handle."""
        assert message.job_id is not None and message.request_id is not None
        try:
            self._queue.send_many([_sendable(message)], message.job_id)
        except MessageRefused as error:
            raise InvalidJob(f"invalid job message: {error}") from error
        return Job(self._blobs, message.output, message.job_id, message.request_id)

    def job(self, output: str, job_id: str | None = None, request_id: str | None = None) -> Job:
        """A handle on a job sent before, by its output (and its ids, if known)."""
        return Job(self._blobs, output, job_id, request_id)


class Job:
    """A job, by where its outputs go: its status, its results, its cancellation.

    With a `job_id`, files under the output that another job wrote (an output used
    again) are not taken for this job's; with a `request_id` too (a handle `submit`
    returned), nor are those an earlier run of the same job wrote."""

    def __init__(
        self,
        blobs: BlobStore,
        output: str,
        job_id: str | None = None,
        request_id: str | None = None,
    ):
        self._blobs = blobs
        self._outputs = Outputs(blobs, output)
        self.output = str(self._outputs.prefix)
        self.job_id = job_id
        self.request_id = request_id

    @classmethod
    def connect(
        cls,
        output: str,
        job_id: str | None = None,
        request_id: str | None = None,
        *,
        s3: S3Client | None = None,
    ) -> Job:
        """A job on S3, with the client given or one from boto3's usual configuration."""
        blobs = aws.S3BlobStore(s3 or aws.s3_client(S3_CONNECTIONS))
        return cls(blobs, output, job_id, request_id)

    def status(self) -> JobStatus:
        """Where the job is now: job.json's counts once it is finished, rejected.json's
        reason if it was dead-lettered, progress.json's counts while it runs, nothing
        while none of them is written (for this job: this run's, with a request id)."""
        finished = self._summary()
        if finished is not None:
            summary, read = finished
            done = read.succeeded + read.failed
            return JobStatus(Phase.FINISHED, read.items, done, read.failed, summary)
        rejection = self._outputs.rejection()
        if rejection is not None and self._ours(rejection.job_id, rejection.request_id):
            return JobStatus(Phase.REJECTED, 0, 0, 0, rejected=rejection.reason)
        # progress.json names the job alone: an earlier run's counts show until this
        # run's first.
        progress = self._outputs.progress()
        if progress is None or self.job_id not in (None, progress.job_id):
            return JobStatus(Phase.QUEUED, 0, 0, 0)
        counts = (progress.items, progress.finished, progress.failed)
        if progress.stalled is not None:
            stall = progress.stalled
            why = f"shards {stall.shards} cannot run: {stall.reason}"
            return JobStatus(Phase.STALLED, *counts, stalled=why)
        return JobStatus(Phase.RUNNING, *counts)

    def wait(
        self,
        timeout_s: float,
        poll_s: float = 1.0,
        on_status: Callable[[JobStatus], None] | None = None,
    ) -> dict[str, Any]:
        """Look at the job every `poll_s` (telling `on_status` what was seen) until it is
        finished; its job.json. `TimeoutError`, saying what it saw last, if it is not
        within `timeout_s`, however long a look takes (a look that fails for now,
        `TransientError`, is tried again); `JobRejected` if it was dead-lettered;
        `JobStalled` if nothing left of it can run (until its dead-lettered shards are
        redriven: wait again then)."""
        deadline = time.monotonic() + timeout_s
        seen = "nothing yet"
        while True:
            try:
                status = _within(self.status, deadline - time.monotonic())
            except TransientError as error:
                seen = f"a look that failed: {error}"
            except TimeoutError:
                seen = f"{seen}; then a look unanswered when the time was up"
            else:
                if on_status is not None:
                    on_status(status)
                if status.summary is not None:
                    return status.summary
                if status.rejected is not None:
                    raise JobRejected(f"{self.output} rejected: {status.rejected}", status.rejected)
                if status.stalled is not None:
                    raise JobStalled(f"{self.output} stalled: {status.stalled}")
                seen = f"{status.phase.value}, {status.finished} of {status.items} items"
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                awaited = self._outputs.location(JOB_JSON)
                raise TimeoutError(
                    f"timed out after {timeout_s} s waiting for {awaited}; last seen: {seen}"
                )
            time.sleep(min(poll_s, left_s))

    def lines(self) -> Iterator[dict[str, Any]]:
        """The finished job's results, one record per input in input order, whatever
        the format: results.jsonl's lines, or the Parquet files' rows (each without its
        null columns, as a line has no fields of a model that did not answer).
        `JobNotFinished` before job.json is written."""
        return self._outputs.records(self._finished())

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The finished job's results as record batches, whatever the format: the
        Parquet files' batches, with the job's columns; or results.jsonl read a block at
        a time, each batch with the columns of the batches before it (and their types)
        and any its lines add. `JobNotFinished` before job.json is written."""
        return self._outputs.batches(self._finished())

    def openai_batch_files(self, directory: Path) -> tuple[Path, Path]:
        """The finished job's OpenAI output file and error file (a job of an
        `openai_batch`), copied into `directory` as job.json names them (their ETags
        checked: `OutputReplaced` if a later run replaced them); their paths.
        `JobNotFinished` before job.json is written."""
        summary = self._finished()
        return (
            self._outputs.download(summary, OPENAI_OUTPUT_FILE, directory),
            self._outputs.download(summary, OPENAI_ERRORS_FILE, directory),
        )

    def cancel(self, reason: str = "") -> S3Location:
        """Write the `cancel` object a daemon stops the job for (docs/jobs.md), naming
        this job and run by the ids it has; returns where. `CancelRefused` if the job is
        finished already (also when it finished while the cancel was written: the cancel
        is withdrawn, nothing was cancelled), or, for a job with an id, if the output's
        progress.json is another's."""
        if self._summary() is not None:
            raise CancelRefused(
                f"{self._outputs.location(JOB_JSON)} exists: the job is finished, nothing to cancel"
            )
        running = self._outputs.progress() if self.job_id else None
        if running is not None and running.job_id != self.job_id:
            raise CancelRefused(
                f"{self.output} is job {running.job_id}'s output, not {self.job_id}'s"
            )
        request = {"requested_at": datetime.now(UTC).isoformat(), "reason": reason}
        names = {"job_id": self.job_id, "request_id": self.request_id}
        request.update((name, value) for name, value in names.items() if value)
        marker = self._outputs.location(CANCEL_MARKER)
        written = self._blobs.put(marker, json.dumps(request).encode(), "application/json")
        if self._summary() is not None:
            # Finished meanwhile: the cancel would only be left for a later run to find.
            # Withdrawn if it is still this one (not another producer's since).
            if self._blobs.objects_under(marker).get("") == written:
                self._blobs.delete([marker])
            raise CancelRefused(
                f"{self._outputs.location(JOB_JSON)} was written as the cancel was: the job "
                "finished, nothing was cancelled"
            )
        return marker

    def _ours(self, job_id: str | None, request_id: str | None) -> bool:
        """Whether a file naming these ids is this job's (this run's, with a request id)."""
        return self.job_id in (None, job_id) and self.request_id in (None, request_id)

    def _summary(self) -> tuple[dict[str, Any], Summary] | None:
        """This job's job.json, whole and as read; None until it is written."""
        summary = self._outputs.summary()
        if summary is None or not self._ours(summary[1].job_id, summary[1].request_id):
            return None
        return summary

    def _finished(self) -> Summary:
        finished = self._summary()
        if finished is None:
            raise JobNotFinished(
                f"{self._outputs.location(JOB_JSON)} is not written yet (not by this run)"
            )
        return finished[1]


def _sendable(message: JobMessage) -> str:
    """The message's body, as SQS takes it: the fields given, defaults left to the
    daemon (a table's default `uri_column` written out beside a `text_column` names
    two sources of inputs); `InvalidJob` if it holds a character SQS refuses in a
    message (U+FFFE, U+FFFF, a lone surrogate...), which no retry of the send would get
    past."""
    try:
        body = message.model_dump_json(exclude_none=True, exclude_unset=True)
    except PydanticSerializationError as error:  # a lone surrogate is not UTF-8 at all
        raise InvalidJob(f"invalid job message: it is not UTF-8: {error}") from error
    refused = SQS_UNSENDABLE.search(body)
    if refused is not None:
        raise InvalidJob(
            f"invalid job message: it holds U+{ord(refused.group()):04X}, a character SQS "
            "refuses in a message body"
        )
    return body


def _within(look: Callable[[], Answer], timeout_s: float) -> Answer:
    """`look()`'s answer or error, if it comes within `timeout_s`; else `TimeoutError`
    (the look goes on, on a thread of its own, its answer dropped)."""
    answer: Future[Answer] = Future()

    def run() -> None:
        try:
            answer.set_result(look())
        except BaseException as error:
            answer.set_exception(error)

    threading.Thread(target=run, name="job-status", daemon=True).start()
    return answer.result(timeout=max(timeout_s, 0.0))
