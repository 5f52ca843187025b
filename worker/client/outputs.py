"""What a job leaves under its output, read as docs/jobs.md describes it and as
untrusted as anything else in S3: its documents (progress.json, job.json, rejected.json)
and its results, read at the ETags job.json names them with."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, ValidationError

from worker.datasets.tables import JSON_BLOCK_BYTES, PARQUET, RECORD_SCHEMA, RESULTS_DIR
from worker.errors import MissingObject, PreconditionFailed
from worker.message import validation_problems
from worker.ports import BlobStore, S3Location

JOB_JSON = "job.json"
PROGRESS_JSON = "progress.json"
REJECTED_JSON = "rejected.json"
RESULTS_JSONL = "results.jsonl"
# job.json and progress.json are small; a bigger one is not the daemon's.
MAX_DOCUMENT_BYTES = 16 * 2**20
S3_MAX_OBJECT_BYTES = 5 * 2**40  # a results file is read to its end, however big
LINES_BLOCK_BYTES = 2**20  # results.jsonl is parsed this much at a time by `lines`
Read = TypeVar("Read", bound=BaseModel)


class UnreadableOutput(Exception):
    """A file under the job's output is not what the daemon writes there."""


class OutputReplaced(UnreadableOutput):
    """A results file job.json names is no longer the one it names (its ETag differs,
    or it is gone): a later run to the same output replaced it. It is not read on."""


class Stall(BaseModel):
    """progress.json's note that a job split across the fleet stalled."""

    shards: list[int]
    reason: str


class Progress(BaseModel):
    """The fields of progress.json the client reads."""

    job_id: str | None = None
    items: int = Field(ge=0)
    finished: int = Field(ge=0)
    failed: int = Field(ge=0)
    stalled: Stall | None = None


class Summary(BaseModel):
    """The fields of job.json the client reads."""

    job_id: str | None = None
    request_id: str | None = None
    status: str
    items: int = Field(ge=0)
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    format: Literal["jsonl", "parquet"] = "jsonl"
    outputs: dict[str, str] = Field(default_factory=dict)


class Rejection(BaseModel):
    """rejected.json: a job the daemon dead-lettered (its message held these ids)."""

    job_id: str | None = None
    request_id: str | None = None
    reason: str
    rejected_at: str


class Outputs:
    """The files under one job's output prefix."""

    def __init__(self, blobs: BlobStore, output: str):
        self._blobs = blobs
        self.prefix = _prefix(output)

    def location(self, name: str) -> S3Location:
        return S3Location(self.prefix.bucket, self.prefix.key + name)

    def progress(self) -> Progress | None:
        """progress.json; None if there is none."""
        return self._read(Progress, PROGRESS_JSON)

    def summary(self) -> tuple[dict[str, Any], Summary] | None:
        """job.json, whole and as read; None if there is none."""
        summary = self._document(JOB_JSON)
        if summary is None:
            return None
        return summary, _validated(Summary, summary, self.location(JOB_JSON))

    def rejection(self) -> Rejection | None:
        """rejected.json; None if there is none."""
        return self._read(Rejection, REJECTED_JSON)

    def records(self, summary: Summary) -> Iterator[dict[str, Any]]:
        """The results job.json `summary` names, one record per input, whatever the
        format (a Parquet row without its null columns)."""
        if summary.format == PARQUET:
            return _rows(self._parquet_batches(summary))
        return self._json_records(*self._results_jsonl(summary))

    def batches(self, summary: Summary) -> Iterator[pa.RecordBatch]:
        """The results job.json `summary` names, as record batches, whatever the format."""
        if summary.format == PARQUET:
            return self._parquet_batches(summary)
        return self._json_batches(*self._results_jsonl(summary))

    def download(self, summary: Summary, name: str, directory: Path) -> Path:
        """The output `name` job.json `summary` names, copied into `directory` (as it
        names it, or `OutputReplaced`); its path."""
        if name not in summary.outputs:
            raise UnreadableOutput(f"{self.location(JOB_JSON)} names no {name}")
        path = directory / name
        with path.open("wb") as copy:
            for chunk in self._chunks(self.location(name), summary.outputs[name]):
                copy.write(chunk)
        return path

    def _read(self, model: type[Read], name: str) -> Read | None:
        document = self._document(name)
        return None if document is None else _validated(model, document, self.location(name))

    def _document(self, name: str) -> dict[str, Any] | None:
        """The JSON object `name` under the output; None if there is none."""
        location = self.location(name)
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

    def _results_jsonl(self, summary: Summary) -> tuple[S3Location, str]:
        """Where results.jsonl is, and the ETag job.json names it with."""
        if RESULTS_JSONL not in summary.outputs:
            raise UnreadableOutput(f"{self.location(JOB_JSON)} names no {RESULTS_JSONL}")
        return self.location(RESULTS_JSONL), summary.outputs[RESULTS_JSONL]

    def _json_records(self, location: S3Location, etag: str) -> Iterator[dict[str, Any]]:
        number = 0
        for block in _line_blocks(self._chunks(location, etag), LINES_BLOCK_BYTES):
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

    def _json_batches(self, location: S3Location, etag: str) -> Iterator[pa.RecordBatch]:
        # The record's own columns first; then each block has the columns of the blocks
        # before it and its own, each of the widest type seen so far (an integer field
        # that holds a fraction later is a double from then on).
        schema = RECORD_SCHEMA
        for block in _line_blocks(self._chunks(location, etag), JSON_BLOCK_BYTES):
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

    def _parquet_batches(self, summary: Summary) -> Iterator[pa.RecordBatch]:
        # Every file is checked before the first is read (a later run's files are not
        # read in part), and each is read on condition that it is still as job.json
        # says; a Parquet file is read from its footer: each is copied to a local file.
        files = {
            name: etag for name, etag in summary.outputs.items() if name.startswith(RESULTS_DIR)
        }
        listed = self._blobs.objects_under(self.location(RESULTS_DIR))
        for name, etag in files.items():
            if listed.get(name.removeprefix(RESULTS_DIR)) != etag:
                raise OutputReplaced(_replaced(self.location(name)))
        for name, etag in files.items():
            location = self.location(name)
            with tempfile.TemporaryFile() as spool:
                for chunk in self._chunks(location, etag):
                    spool.write(chunk)
                spool.seek(0)
                try:
                    yield from pq.ParquetFile(spool).iter_batches()
                except pa.ArrowException as error:
                    raise UnreadableOutput(f"{location}: {error}") from error

    def _chunks(self, location: S3Location, etag: str) -> Iterator[bytes]:
        """The file's bytes, if it is still the one job.json names with `etag`."""
        try:
            yield from self._blobs.chunks(location, S3_MAX_OBJECT_BYTES, expect=etag)
        except (MissingObject, PreconditionFailed) as error:
            raise OutputReplaced(_replaced(location)) from error


def _replaced(location: S3Location) -> str:
    return (
        f"{location}, which job.json names, is gone or no longer the file it names: a "
        "later run to the same output replaced it (wait for that run's job.json)"
    )


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
