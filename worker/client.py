"""The producer's side of a job: send it, follow it, read its results, cancel it.

    jobs = Jobs.connect(queue_url)
    job = jobs.submit("s3://bucket/results/j1/", manifest="s3://bucket/list.txt")
    summary = job.wait(timeout_s=3600)
    for record in job.lines():
        ...

The message is the daemon's own `JobMessage`, validated as the daemon validates a body
(`parse_job_message`) before it is sent, so the two cannot disagree. What a job leaves
under its output (progress.json, job.json, results.jsonl or Parquet files under
results/, `cancel`) is read as docs/jobs.md describes it, and as untrusted as anything
else in S3: a file that does not say what it should raises `UnreadableOutput`.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import orjson
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, ValidationError

from worker.adapters import aws
from worker.datasets.tables import (
    JSON_BLOCK_BYTES,
    PARQUET,
    RECORD_SCHEMA,
    RESULTS_DIR,
)
from worker.errors import MissingObject
from worker.message import (
    CANCEL_MARKER,
    PoisonMessage,
    TableSource,
    TarMembers,
    parse_job_message,
    validation_problems,
)
from worker.ports import BlobStore, S3Location

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

JOB_JSON = "job.json"
PROGRESS_JSON = "progress.json"
RESULTS_JSONL = "results.jsonl"
# job.json and progress.json are small; a bigger one is not the daemon's.
MAX_DOCUMENT_BYTES = 16 * 2**20
S3_MAX_OBJECT_BYTES = 5 * 2**40  # a results file is read to its end, however big
LINES_BLOCK_BYTES = 2**20  # results.jsonl is parsed this much at a time by `lines`
S3_CONNECTIONS = 2  # the client reads one object at a time
Read = TypeVar("Read", bound=BaseModel)


class InvalidJob(ValueError):
    """A job the daemon would refuse (dead-letter): nothing was sent."""


class JobNotFinished(Exception):
    """The job's job.json is not written yet: its results are not complete."""


class UnreadableOutput(Exception):
    """A file under the job's output is not what the daemon writes there."""


class JobStalled(Exception):
    """Nothing left of a job split across the fleet can run: its shards left were
    dead-lettered, or their messages are gone. It ends once they are redriven."""


class CancelRefused(Exception):
    """The job is finished already, or the output is another job's."""


class Phase(StrEnum):
    QUEUED = "queued"  # nothing under its output says it started
    RUNNING = "running"  # its progress.json is written
    STALLED = "stalled"  # its progress.json says no shard left can run (`JobStatus.stalled`)
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


class JobQueue(Protocol):
    """Where jobs are sent (`JobSource.send_many`)."""

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None: ...


class _Stall(BaseModel):
    """progress.json's note that a job split across the fleet stalled."""

    shards: list[int]
    reason: str


class _Progress(BaseModel):
    """The fields of progress.json the client reads."""

    job_id: str | None = None
    items: int = Field(ge=0)
    finished: int = Field(ge=0)
    failed: int = Field(ge=0)
    stalled: _Stall | None = None


class _Summary(BaseModel):
    """The fields of job.json the client reads."""

    job_id: str | None = None
    status: str
    items: int = Field(ge=0)
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    format: Literal["jsonl", "parquet"] = "jsonl"
    outputs: dict[str, str] = Field(default_factory=dict)


class Jobs:
    """Sends jobs to one queue, for daemons that read and write one store."""

    def __init__(self, queue: JobQueue, blobs: BlobStore):
        self._queue = queue
        self._blobs = blobs

    @classmethod
    def connect(
        cls, queue_url: str, *, sqs: SQSClient | None = None, s3: S3Client | None = None
    ) -> Jobs:
        """Jobs on an SQS queue and S3, with the clients given or ones from boto3's usual
        configuration (credentials, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL)."""
        queue = aws.SqsJobSource(sqs or aws.sqs_client(), queue_url, dlq_url=None)
        return cls(queue, aws.S3BlobStore(s3 or aws.s3_client(S3_CONNECTIONS)))

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
        params: dict[str, Any] | None = None,
        format: Literal["jsonl", "parquet"] = "jsonl",
        job_id: str | None = None,
        shard_items: int | None = None,
        tar: TarMembers | dict[str, Any] | None = None,
    ) -> Job:
        """Send a job (docs/jobs.md, "The job message": exactly one source of inputs) and
        return its handle; `InvalidJob`, with every reason, if the daemon would refuse
        it. The job id is a new uuid unless given; the job is its own message group, as
        its shards will be (the tenant, on an SQS fair queue)."""
        if isinstance(table, TableSource):
            table = table.model_dump(exclude_none=True)
        if isinstance(tar, TarMembers):
            tar = tar.model_dump(exclude_none=True)
        fields = {
            "job_id": job_id or uuid.uuid4().hex,
            "inputs": None if inputs is None else list(inputs),
            "manifest": manifest,
            "inputs_prefix": inputs_prefix,
            "inputs_suffix": inputs_suffix,
            "table": table,
            "inventory": inventory,
            "output": output,
            "params": params,
            "format": format,
            "shard_items": shard_items,
            "tar": tar,
        }
        try:
            body = json.dumps({name: value for name, value in fields.items() if value is not None})
        except (TypeError, ValueError) as error:
            raise InvalidJob(f"invalid job message: params are not JSON: {error}") from error
        try:
            message = parse_job_message(body, allowed_buckets=frozenset())
        except PoisonMessage as error:
            raise InvalidJob(str(error)) from error
        assert message.job_id is not None
        self._queue.send_many([message.model_dump_json(exclude_none=True)], message.job_id)
        return Job(self._blobs, message.output, message.job_id)

    def job(self, output: str, job_id: str | None = None) -> Job:
        """A handle on a job sent before, by its output (and its id, if known)."""
        return Job(self._blobs, output, job_id)


class Job:
    """A job, by where its outputs go: its status, its results, its cancellation.

    With a `job_id`, files under the output that another job wrote (an output used
    again) are not taken for this job's."""

    def __init__(self, blobs: BlobStore, output: str, job_id: str | None = None):
        self._blobs = blobs
        self._prefix = _prefix(output)
        self.output = str(self._prefix)
        self.job_id = job_id

    @classmethod
    def connect(cls, output: str, job_id: str | None = None, *, s3: S3Client | None = None) -> Job:
        """A job on S3, with the client given or one from boto3's usual configuration."""
        return cls(aws.S3BlobStore(s3 or aws.s3_client(S3_CONNECTIONS)), output, job_id)

    def status(self) -> JobStatus:
        """Where the job is now: job.json's counts once it is finished, progress.json's
        while it runs, nothing while neither is written."""
        finished = self._summary()
        if finished is not None:
            summary, read = finished
            done = read.succeeded + read.failed
            return JobStatus(Phase.FINISHED, read.items, done, read.failed, summary)
        progress = self._progress()
        if progress is None or not self._ours(progress.job_id):
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
        finished; its job.json. `TimeoutError` if it is not within `timeout_s`;
        `JobStalled` if nothing left of it can run (until its dead-lettered shards are
        redriven: wait again then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if on_status is not None:
                on_status(status)
            if status.summary is not None:
                return status.summary
            if status.stalled is not None:
                raise JobStalled(f"{self.output} stalled: {status.stalled}")
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(
                    f"timed out after {timeout_s} s waiting for {self._location(JOB_JSON)}"
                )
            time.sleep(min(poll_s, left_s))

    def lines(self) -> Iterator[dict[str, Any]]:
        """The finished job's results, one record per input in input order, whatever
        the format: results.jsonl's lines, or the Parquet files' rows (each without its
        null columns, as a line has no fields of a model that did not answer).
        `JobNotFinished` before job.json is written."""
        summary = self._finished()
        if summary.format == PARQUET:
            return _rows(self._parquet_batches(summary))
        return self._json_records(self._results_jsonl(summary))

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The finished job's results as record batches, whatever the format: the
        Parquet files' batches, with the job's columns; or results.jsonl read a block at
        a time, each batch with the columns of the batches before it (and their types)
        and any its lines add. `JobNotFinished` before job.json is written."""
        summary = self._finished()
        if summary.format == PARQUET:
            return self._parquet_batches(summary)
        return self._json_batches(self._results_jsonl(summary))

    def cancel(self, reason: str = "") -> S3Location:
        """Write the `cancel` object a daemon stops the job for (docs/jobs.md), naming
        this job if it has an id; returns where. `CancelRefused` if the job is finished
        already, or, for a job with an id, if the output's progress.json is another's."""
        listing = self._blobs.objects_under(self._prefix)
        if JOB_JSON in listing:
            raise CancelRefused(
                f"{self._location(JOB_JSON)} exists: the job is finished, nothing to cancel"
            )
        running = self._progress() if self.job_id and PROGRESS_JSON in listing else None
        if running is not None and running.job_id != self.job_id:
            raise CancelRefused(
                f"{self.output} is job {running.job_id}'s output, not {self.job_id}'s"
            )
        request = {"requested_at": datetime.now(UTC).isoformat(), "reason": reason}
        if self.job_id:
            request["job_id"] = self.job_id
        marker = self._location(CANCEL_MARKER)
        self._blobs.put(marker, json.dumps(request).encode(), "application/json")
        return marker

    def _ours(self, job_id: str | None) -> bool:
        return self.job_id is None or job_id == self.job_id

    def _location(self, name: str) -> S3Location:
        return S3Location(self._prefix.bucket, self._prefix.key + name)

    def _document(self, name: str) -> dict[str, Any] | None:
        """The JSON object `name` under the output; None if there is none."""
        location = self._location(name)
        try:
            data = self._blobs.get(location, MAX_DOCUMENT_BYTES)
        except MissingObject:
            return None
        try:
            document = json.loads(data)
        except ValueError as error:
            raise UnreadableOutput(f"{location} is not JSON: {error}") from error
        if not isinstance(document, dict):
            raise UnreadableOutput(f"{location} is not a JSON object")
        return document

    def _progress(self) -> _Progress | None:
        progress = self._document(PROGRESS_JSON)
        if progress is None:
            return None
        return _validated(_Progress, progress, self._location(PROGRESS_JSON))

    def _summary(self) -> tuple[dict[str, Any], _Summary] | None:
        """This job's job.json, whole and as read; None until it is written."""
        summary = self._document(JOB_JSON)
        if summary is None:
            return None
        read = _validated(_Summary, summary, self._location(JOB_JSON))
        return (summary, read) if self._ours(read.job_id) else None

    def _finished(self) -> _Summary:
        finished = self._summary()
        if finished is None:
            raise JobNotFinished(f"{self._location(JOB_JSON)} is not written yet")
        return finished[1]

    def _results_jsonl(self, summary: _Summary) -> S3Location:
        if RESULTS_JSONL not in summary.outputs:
            raise UnreadableOutput(f"{self._location(JOB_JSON)} names no {RESULTS_JSONL}")
        return self._location(RESULTS_JSONL)

    def _json_records(self, location: S3Location) -> Iterator[dict[str, Any]]:
        number = 0
        for block in _line_blocks(self._chunks(location), LINES_BLOCK_BYTES):
            for line in block.splitlines():
                number += 1
                if not line.strip():
                    continue
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError as error:
                    raise UnreadableOutput(f"{location} line {number}: {error}") from error
                if not isinstance(record, dict):
                    raise UnreadableOutput(f"{location} line {number} is not a JSON object")
                yield record

    def _json_batches(self, location: S3Location) -> Iterator[pa.RecordBatch]:
        # The record's own columns first; then each block has the columns of the blocks
        # before it and its own, each of the widest type seen so far (an integer field
        # that holds a fraction later is a double from then on).
        schema = RECORD_SCHEMA
        for block in _line_blocks(self._chunks(location), JSON_BLOCK_BYTES):
            try:
                table = pa_json.read_json(io.BytesIO(block))
                schema = pa.unify_schemas([schema, table.schema], promote_options="permissive")
                missing = [name for name in schema.names if name not in table.schema.names]
                for name in missing:
                    table = table.append_column(name, pa.nulls(len(table), schema.field(name).type))
                table = table.select(schema.names).cast(schema)
            except pa.ArrowException as error:
                raise UnreadableOutput(f"{location}: {error}") from error
            yield from table.to_batches()

    def _parquet_batches(self, summary: _Summary) -> Iterator[pa.RecordBatch]:
        # A Parquet file is read from its footer: each is copied to a local file first.
        for name in [name for name in summary.outputs if name.startswith(RESULTS_DIR)]:
            location = self._location(name)
            with tempfile.TemporaryFile() as spool:
                for chunk in self._chunks(location):
                    spool.write(chunk)
                spool.seek(0)
                try:
                    yield from pq.ParquetFile(spool).iter_batches()
                except pa.ArrowException as error:
                    raise UnreadableOutput(f"{location}: {error}") from error

    def _chunks(self, location: S3Location) -> Iterator[bytes]:
        try:
            yield from self._blobs.chunks(location, S3_MAX_OBJECT_BYTES)
        except MissingObject as error:
            raise UnreadableOutput(f"{location}, which job.json names, is gone") from error


def _prefix(output: str) -> S3Location:
    """An output prefix, ending "/" (`JobMessage.output_location`)."""
    prefix = S3Location.parse(output)
    return (
        prefix
        if not prefix.key or prefix.key.endswith("/")
        else S3Location(prefix.bucket, f"{prefix.key}/")
    )


def _validated(model: type[Read], document: dict[str, Any], location: S3Location) -> Read:
    """`document` (the file at `location`) as `model` reads it; `UnreadableOutput`, with
    every field that does not fit, if it cannot."""
    try:
        return model.model_validate(document)
    except ValidationError as error:
        raise UnreadableOutput(f"{location}: {validation_problems(error)}") from error


def _line_blocks(chunks: Iterable[bytes], block_bytes: int) -> Iterator[bytes]:
    """The stream's bytes in blocks of whole lines, each cut at its first newline from
    `block_bytes` on (the last block ends where the stream does)."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while end := pending.find(b"\n", block_bytes - 1) + 1:
            yield bytes(pending[:end])
            del pending[:end]
    if pending:
        yield bytes(pending)


def _rows(batches: Iterable[pa.RecordBatch]) -> Iterator[dict[str, Any]]:
    for batch in batches:
        for row in batch.to_pylist():
            yield {name: value for name, value in row.items() if value is not None}
