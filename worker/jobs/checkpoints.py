"""What earlier deliveries of a job left under its output, and what this one leaves for
the next.

    output/
      results.jsonl, job.log, job.json       the finished job; job.json, written last, says so
      <field>.npy                            its array outputs, if any (`datasets.arrays`)
      results/part-*.parquet                 its results as Parquet instead (`datasets.tables`)
      cancel                                 a request to cancel the job (`worker cancel`)
      checkpoint-<request>-a<delivery>-<n>.jsonl  results one delivery finished, part n
      checkpoint-<request>-a<delivery>-<n>.log    that delivery's job.log lines, part n
      checkpoint-<request>-r<delivery>-<n>.{jsonl,log}  the same, of a job with arrays,
      checkpoint-<request>-r<delivery>-<n>.<field>.npy  and the rows of its lines
      checkpoint-<request>-s<shard>-{a,r}<delivery>-<n>.*  the same, of one shard
      checkpoint-superseded-<message id>     that message was handed over, but not deleted

`<request>` is a digest of the job's inputs (in order) and params, so what was written
for another request (an output prefix used again) is never taken for this one's; a
shard of a job split across the fleet (`worker.sharding.shards`) reads and removes its own
parts alone. One
listing of the prefix, at admission, says all of it: whether the job is done already,
whether it is to be cancelled, which results to resume from, and the ETag of each final
output, which the finish then writes on condition that it is unchanged (another
delivery that wrote first fences this one off). The final writes are separate, so
job.json records the ETags of the outputs it completes (array files, results.jsonl or the
Parquet files, job.log):
a job counts as done only if they are still the ones under the prefix, and a mix left by
two deliveries racing is redone whole. Checkpoint parts go once the job's job.json is written.

Anyone who may write the job's output may write anything there: everything read from
it is read within a bound, and what is over it is not this daemon's.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import structlog

from worker.datasets.arrays import ARRAY_FILE_SUFFIX, NPY_CONTENT_TYPE, ArrayFiles, npy_bytes
from worker.datasets.openai_batch import OPENAI_ERRORS_FILE, OPENAI_OUTPUT_FILE
from worker.datasets.table_ranges import Span, TableRows
from worker.datasets.tables import (
    JSON_LINES,
    NDJSON,
    PARQUET,
    RESULTS_DIR,
    stale_tables,
    table_name,
)
from worker.errors import MissingObject, ObjectTooLarge
from worker.jobs.checkpoint_rows import PartRows
from worker.jobs.job import Job, JobState, Place, Result
from worker.jobs.ledger import Ledger
from worker.message import CANCEL_MARKER, JobMessage, TarMembers
from worker.ports import BlobStore

if TYPE_CHECKING:
    from worker.plugins.identity import ModelIdentity

log = structlog.get_logger()

FINAL_OUTPUTS = ("results.jsonl", "job.log", "job.json", OPENAI_OUTPUT_FILE, OPENAI_ERRORS_FILE)
CHECKPOINT_PREFIX = "checkpoint-"
REJECTED = "rejected.json"  # a dead-lettered request's answer (`Notices`)
SUPERSEDED_PREFIX = f"{CHECKPOINT_PREFIX}superseded-"
Halt = Literal["superseded", "cancelled"]
REQUEST_DIGEST_CHARS = 16
# What a part holds: its lines (and log lines) alone, or its lines and their array rows
# (a worker from before there were rows does not read those parts: it would resume the
# lines without their rows).
LINES, ROWS = "a", "r"
# The most array rows a part holds (all fields; at least a row, which takes at most
# `MAX_ROW_BYTES`), so that they are read back within MAX_PART_BYTES.
PART_ROW_BYTES = 64 * 2**20
# Outputs every job.json of a format completes, with their ETags recorded in it (beside
# any array files, and a Parquet job's other files).
COMPLETED_OUTPUTS = {
    JSON_LINES: ("results.jsonl", "job.log"),
    PARQUET: (table_name(0, 0), "job.log"),
}
# How often the checkpointer looks for jobs due a checkpoint.
CHECK_EVERY_S = 1.0
# The most read of each object under a job's output: larger ones are not this daemon's.
MAX_SUMMARY_BYTES = 16 * 2**20  # job.json (the client reads it within the same)
MAX_MARKER_BYTES = 64 * 2**10  # `cancel`, and the shards' small notes
# A part holds at most `--checkpoint-items` results and their log lines, each object read
# within MAX_PART_BYTES (its array rows together); a line of results over
# MAX_RESUMED_LINE_BYTES is not resumed (the item is run again).
MAX_PART_BYTES = 256 * 2**20
MAX_RESUMED_LINE_BYTES = 2**20
DIGEST_ROWS = 2**16  # a planned table's rows digested at a time


def request_digest(
    listed: list[str], ids: list[Any] | None, spec: JobMessage, model: ModelIdentity
) -> str:
    """Names one request: the inputs it lists, in order (with their ids, if its table
    gives them), its params, the model that answers it, the format of its results and
    whether its inputs are tars (job.json records it as `request_digest`). Another
    model's results are another request's: they are neither resumed from nor taken as
    done."""
    digest = RequestDigest()
    for uri, input_id in zip(listed, [None] * len(listed) if ids is None else ids, strict=True):
        digest.add(uri, input_id)
    return digest.hexdigest(spec.params, model.as_dict(), spec.format, spec.tar)


class RequestDigest:
    """`request_digest` taken as the inputs stream past (a planned job's manifest is
    never held whole): the SHA-256 of `[inputs, params, model]` as compact JSON."""

    def __init__(self, progress: Callable[[], None] = lambda: None) -> None:
        """`progress`: told as a table's rows are digested, 65,536 at a time (`add`)."""
        self._hash = hashlib.sha256(b"[[")
        self._separator = b""
        self._progress = progress

    def add(self, uri: str, input_id: Any = None) -> None:
        """An input as listed; a table's rows (`TableRows`) each as a shard names it,
        `file#row=n`, with the span's listed id (as planners listed each row before)."""
        if isinstance(uri, TableRows):
            self._add_rows(uri.span)
            return
        entry = uri if input_id is None else [uri, input_id]
        self._hash.update(self._separator + json.dumps(entry).encode())
        self._separator = b","

    def _add_rows(self, span: Span) -> None:
        """What `add` takes of each row of `span`, made `DIGEST_ROWS` at a time (a row in
        half a microsecond, where listing each as an object took 10), the listing's
        `progress` told after each."""
        # ["<file>#row=  then the row's number, then  ", "<listed id>"]
        head = json.dumps([f"{span.file}#row="])[:-2]
        tail = json.dumps([f"{span.file}#row=0", span.listed_id()])[len(head) + 1 :]
        for start in range(span.first, span.stop, DIGEST_ROWS):
            numbers = range(start, min(start + DIGEST_ROWS, span.stop))
            entries = ",".join([f"{head}{number}{tail}" for number in numbers])
            self._hash.update(self._separator + entries.encode())
            self._separator = b","
            self._progress()

    def hexdigest(
        self,
        params: dict[str, Any],
        model: dict[str, Any],
        output_format: str,
        tar: TarMembers | None = None,
    ) -> str:
        """The digest of the inputs added so far, with `params`, the model's identity
        (`ModelIdentity.as_dict`), the results' format and the `tar` members taken: a
        format other than JSON lines, and a `tar`, are appended, so that a request of
        neither keeps the digest it had before there were (its checkpoints resume
        across the upgrade)."""
        formats = [] if output_format == JSON_LINES else [output_format]
        tars = [] if tar is None else [tar.model_dump()]
        rest = json.dumps([params, model, *formats, *tars], sort_keys=True, separators=(",", ":"))
        whole = self._hash.copy()
        whole.update(b"]," + rest[1:].encode())
        return whole.hexdigest()[:REQUEST_DIGEST_CHARS]


@dataclass(frozen=True)
class Prior:
    """What earlier deliveries left under a job's output, as read at its admission."""

    digest: str
    etags: dict[str, str]  # of the final outputs written so far
    summary: dict[str, Any] | None  # job.json, if it completes this same request
    cancel_requested: bool
    superseded: frozenset[str] = frozenset()  # messages continued as another
    resumed: dict[int, Result] = field(default_factory=dict)  # by index
    earlier_log: bytes = b""
    leftovers: bool = False  # checkpoint objects to remove once the job is done
    # A rejected.json under the output (an earlier run's, redriven since, or one
    # beside this): only then is there one to withdraw, a GET at S3's latency.
    rejected: bool = False


class Checkpoints:
    """Reads and writes a job's state under its output prefix."""

    def __init__(self, blobs: BlobStore, ledger: Ledger):
        self._blobs = blobs
        self._ledger = ledger

    def read(
        self,
        spec: JobMessage,
        job_id: str,
        digest: str,
        places: list[Place],
        *,
        arrays: ArrayFiles,
        shard: int | None = None,
    ) -> Prior:
        """One listing of the output prefix, then job.json, `cancel` and checkpoint parts
        as needed, for request `digest`, whose items are at `places` (a shard's, `shard`,
        its part of its job's: its own parts alone are read); the resumed results' array
        rows are written to `arrays`."""
        positions = {place: position for position, place in enumerate(places)}
        listing = self.outputs(spec)
        cancelled = self._cancel_stands(spec, job_id, listing)
        summary = self._completed(spec, digest, listing, cancelled)
        own = (part_prefix(digest, shard, LINES), part_prefix(digest, shard, ROWS))
        # In the order they were written (by attempt), whatever their kind's letter.
        kind_at = len(part_prefix(digest, shard, ""))
        own_parts = sorted(
            (
                name
                for name in listing
                if name.startswith(own) and name.endswith((".log", ".jsonl"))
            ),
            key=lambda name: name[kind_at:].lstrip(LINES + ROWS),
        )
        resumed: dict[int, Result] = {}
        earlier_log = []
        for name in own_parts:
            try:
                data = self._blobs.get(spec.output_location(name), MAX_PART_BYTES)
            except (MissingObject, ObjectTooLarge) as error:  # removed since, or not ours
                log.warning("checkpoint_part_skipped", name=name, error=str(error))
                continue
            if name.endswith(".log"):
                earlier_log.append(data)
                continue
            lines = data.splitlines()
            part = name.removesuffix(".jsonl")
            rows = PartRows(self._blobs, spec, part, listing, lines=len(lines), room=MAX_PART_BYTES)
            for number, line in enumerate(lines):
                record = (len(line) <= MAX_RESUMED_LINE_BYTES and _json(line, name)) or {}
                place = _place(record)
                position = None if place is None else positions.get(place)
                if position is None or position in resumed:
                    continue
                if rows.resume(record, number, position, arrays):
                    resumed[position] = Result(line + b"\n", "error" in record)
        return Prior(
            digest,
            {name: etag for name, etag in listing.items() if _final_output(name)},
            summary,
            cancelled,
            frozenset(
                name.removeprefix(SUPERSEDED_PREFIX)
                for name in listing
                if name.startswith(SUPERSEDED_PREFIX)
            ),
            resumed,
            b"".join(earlier_log),
            any(name.startswith(CHECKPOINT_PREFIX) for name in listing),
            REJECTED in listing,
        )

    def finished(self, spec: JobMessage, job_id: str, digest: str) -> dict[str, Any] | None:
        """The job.json under the output if it completes request `digest`."""
        return self.completed(spec, job_id, digest, self.outputs(spec))

    def completed(
        self, spec: JobMessage, job_id: str, digest: str, listing: dict[str, str]
    ) -> dict[str, Any] | None:
        """The job.json of the outputs `listing` (`outputs`) if it completes request
        `digest`."""
        return self._completed(spec, digest, listing, self._cancel_stands(spec, job_id, listing))

    def outputs(self, spec: JobMessage) -> dict[str, str]:
        """What is under the job's output, by name with its ETag: the objects at its top,
        and a Parquet job's results files."""
        listing = self._blobs.objects_under(spec.output_location(""))
        if spec.format != JSON_LINES:
            tables = self._blobs.objects_under(spec.output_location(RESULTS_DIR))
            listing.update((RESULTS_DIR + name, etag) for name, etag in tables.items())
        return listing

    def _completed(
        self, spec: JobMessage, digest: str, listing: dict[str, str], cancelled: bool
    ) -> dict[str, Any] | None:
        if "job.json" not in listing:
            return None
        try:
            data = self._blobs.get(spec.output_location("job.json"), MAX_SUMMARY_BYTES)
        except (MissingObject, ObjectTooLarge):  # replaced since, or not ours
            return None
        written = _json(data, "job.json")
        if not written or not _completes(written, spec.format, digest, listing, cancelled):
            return None
        # A message that names its request counts only the job.json of its own: sent
        # again with another, the job runs again (its sender waits for that run's).
        return written if spec.request_id in (None, written.get("request_id")) else None

    def remove_stale(
        self, spec: JobMessage, listing: Iterable[str], written: Iterable[str]
    ) -> None:
        """Delete the results files an earlier run left (it wrote more of them) beyond
        those the job.json this worker just wrote names (not where a job is found done:
        another request's merge may be writing its files there); never raises."""
        stale = stale_tables(listing, written)
        try:
            self._blobs.delete([spec.output_location(name) for name in stale])
        except Exception as error:
            log.warning("stale_results_not_removed", output=spec.output, error=repr(error))

    def halt(self, job: Job) -> Halt | None:
        """Why a running job must stop, if it must: its message was handed over (marked
        superseded: a continuation runs the job), or a `cancel` object for it has
        appeared."""
        assert job.spec is not None
        # Two listings of a name each, not one of the whole output: a job split across
        # the fleet has every running shard's checkpoint parts there.
        superseded = f"{SUPERSEDED_PREFIX}{job.message.message_id}"
        if self._blobs.objects_under(job.spec.output_location(superseded)):
            return "superseded"
        cancel = self._blobs.objects_under(job.spec.output_location(CANCEL_MARKER)).get("")
        if cancel and self._cancel_stands(job.spec, job.job_id, {CANCEL_MARKER: cancel}):
            return "cancelled"
        return None

    def _cancel_stands(self, spec: JobMessage, job_id: str, listing: dict[str, str]) -> bool:
        """A `cancel` object is for whatever job writes to its prefix, or, if it names a
        `job_id` (`worker cancel --job-id`), for that job alone, and if it names a
        `request_id` too (`worker.client`'s `Job.cancel`), for that run of it alone."""
        if CANCEL_MARKER not in listing:
            return False
        try:
            data = self._blobs.get(spec.output_location(CANCEL_MARKER), MAX_MARKER_BYTES)
        except MissingObject:  # withdrawn since the listing
            return False
        except ObjectTooLarge:  # not what `worker cancel` writes: for whatever job is there
            data = b""
        request = _json(data, CANCEL_MARKER) if data else None
        meant_for = (request or {}).get("job_id")
        run = (request or {}).get("request_id")
        if meant_for not in (None, job_id) or run not in (None, spec.request_id):
            log.warning(
                "cancel_for_another_job", job_id=job_id, cancel_job_id=meant_for, cancel_run=run
            )
            return False
        return True

    def save(self, job: Job) -> None:
        """Write the results recorded since the last part (and the log lines with them)
        as the next parts, each within PART_ROW_BYTES of array rows; on failure the rest
        stay due for the next save. Never raises."""
        if job.spec is None or job.log is None:
            return  # not admitted: nothing done
        with job.checkpoint.lock:
            if job.checkpoint.removed:
                return  # finished meanwhile: its outputs are written
            results = self._ledger.take_unsaved(job)
            if not results:
                return
            most = (job.arrays.rows_within(PART_ROW_BYTES) if job.arrays else None) or len(results)
            for start in range(0, len(results), most):
                if not self._save_part(job, results[start : start + most]):
                    self._ledger.keep_unsaved(job, [index for index, _ in results[start:]])
                    return

    def _save_part(self, job: Job, results: list[tuple[int, Result]]) -> bool:
        """Write `results`, their array rows and the log lines since the last part, as
        the next part; whether it was written."""
        assert job.spec is not None and job.log is not None
        rows = job.arrays.rows([index for index, _ in results]) if job.arrays else {}
        if rows is None:  # settled meanwhile: its rows are gone
            return False
        log_lines, log_mark = job.log.since(job.checkpoint.log_mark)
        part = job.checkpoint.parts + 1
        prefix = part_prefix(job.request_digest, _shard(job.spec), ROWS if rows else LINES)
        name = f"{prefix}{job.attempt:04d}-{job.message.message_id}-{part:05d}"
        try:
            # The lines last: a part whose lines are written has its rows.
            for field, field_rows in rows.items():
                location = job.spec.output_location(f"{name}.{field}{ARRAY_FILE_SUFFIX}")
                self._blobs.put(location, npy_bytes(field_rows), NPY_CONTENT_TYPE)
            self._blobs.put(job.spec.output_location(f"{name}.log"), log_lines, "text/plain")
            records = b"".join(result.line for _, result in results)
            self._blobs.put(job.spec.output_location(f"{name}.jsonl"), records, NDJSON)
        except Exception as error:
            log.warning("checkpoint_failed", job_id=job.job_id, error=repr(error))
            return False
        job.checkpoint.parts, job.checkpoint.log_mark = part, log_mark
        job.checkpoint.saved_at = time.monotonic()
        job.log.info("checkpoint_saved", part=part, items=len(results))
        return True

    def supersede(self, spec: JobMessage | None, message_id: str) -> None:
        """Mark a message of the job as handed over: its continuation runs the job, and
        whoever receives the message acks it unread. Never raises (without the mark both
        may run, and fenced writes keep the outputs whole)."""
        if spec is None:
            return
        marker = spec.output_location(f"{SUPERSEDED_PREFIX}{message_id}")
        try:
            self._blobs.put(marker, b"", "text/plain")
        except Exception as error:
            log.warning("superseded_mark_failed", message_id=message_id, error=repr(error))

    def remove(self, job: Job) -> None:
        """Remove every checkpoint object under the job's output (its job.json is
        written); a shard's own parts alone (the merge removes the rest)."""
        assert job.spec is not None
        with job.checkpoint.lock:
            job.checkpoint.removed = True
            if not (job.checkpoint.parts or job.checkpoint.leftovers):
                return
            shard = _shard(job.spec)
            own = CHECKPOINT_PREFIX if shard is None else part_prefix(job.request_digest, shard, "")
            parts = self._blobs.objects_under(job.spec.output_location(own))
            self._blobs.delete([job.spec.output_location(own + name) for name in parts])


class Checkpointer:
    """Saves a part of each running job's results every `every_items` results or every
    `every_s` seconds, whichever comes first."""

    def __init__(self, ledger: Ledger, checkpoints: Checkpoints, every_items: int, every_s: float):
        self._ledger = ledger
        self._checkpoints = checkpoints
        self._every_items = every_items
        self._every_s = every_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(min(CHECK_EVERY_S, self._every_s)):
            for job in self._ledger.unsettled():
                if self._due(job):
                    self._checkpoints.save(job)

    def stop(self) -> None:
        self._stopped.set()

    def _due(self, job: Job) -> bool:
        if job.state is not JobState.RUNNING or not job.unsaved:
            return False
        waited_s = time.monotonic() - job.checkpoint.saved_at
        return len(job.unsaved) >= self._every_items or waited_s >= self._every_s


def _completes(
    summary: dict[str, Any], format: str, digest: str, listing: dict[str, str], cancelled: bool
) -> bool:
    """Whether a job.json says this request is done: written for it, in this format,
    with the outputs it completed still in place, and not a cancelled run whose cancel
    was since withdrawn (to run it again)."""
    completed = summary.get("outputs")
    return (
        summary.get("request_digest") == digest
        and summary.get("format", JSON_LINES) == format
        and isinstance(completed, dict)
        and completed.keys() >= set(COMPLETED_OUTPUTS[format])
        and all(listing.get(name) == etag for name, etag in completed.items())
        and (summary.get("status") != "cancelled" or cancelled)
    )


def _final_output(name: str) -> bool:
    """Whether `name`, under a job's output, is one of the outputs a finish writes."""
    return (
        name in FINAL_OUTPUTS
        or name.startswith(RESULTS_DIR)
        or (name.endswith(ARRAY_FILE_SUFFIX) and not name.startswith(CHECKPOINT_PREFIX))
    )


def _json(data: bytes, name: str) -> dict[str, Any] | None:
    """A JSON object, or None (logged) for anything else: something other than this
    daemon wrote it, and it is no reason to refuse the job."""
    try:
        value = json.loads(data)
    except ValueError as error:
        log.warning("output_unreadable", name=name, error=str(error))
        return None
    return value if isinstance(value, dict) else None


def _place(record: dict[str, Any]) -> Place | None:
    """A checkpoint line's item's place, if it names one (it is read back from S3)."""
    index, uri, member = record.get("index"), record.get("input"), record.get("member")
    if type(index) is not int or not isinstance(uri, str):
        return None
    return Place(index, uri, member) if isinstance(member, str | None) else None


def part_prefix(digest: str, shard: int | None, kind: str = LINES) -> str:
    """What the names of a request's checkpoint parts of `kind` start with (LINES, ROWS;
    "": either): a shard's own, or, unsharded, the job's (which no shard's part name
    starts with, but for kind "")."""
    if shard is None:
        return f"{CHECKPOINT_PREFIX}{digest}-{kind}"
    return f"{CHECKPOINT_PREFIX}{digest}-s{shard:06d}-{kind}"


def _shard(spec: JobMessage) -> int | None:
    return None if spec.shard is None else spec.shard.index
