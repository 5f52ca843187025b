"""A planned job's plan.json, and the names of its shards' files under its output.

    output/
      plan.json                        the plan: written once, conditionally
      shards/<request>/
        <n>.inputs                     shard n's inputs, a JSON [uri, id] per line
        <n>.sent                       shard n's message is sent
        <n>.<run>.jsonl, <n>.<run>.log what one run of shard n wrote (results, log)
        commits/<n>.commit             the run whose results count: written once, conditionally
        <n>.started                    when the latest run of shard n was admitted
        <n>.duplicated                 a duplicate of shard n was sent (a straggler)
        <n>.dead                       shard n's message was dead-lettered, and why
        watch                          a watch of the job's shards is due (`sharding.stragglers`)
        merge                          who merges the shards, until when (`sharding.merging`)

`<request>` is the whole job's request digest, `<n>` the shard's number (six digits)
and `<run>` one delivery of its message. Everything under `shards/<request>/` goes once
the job's job.json is written.

The commit markers have a folder of their own: whoever commits a shard lists them to see
whether the job can be merged, a block of 1,000 (a page of a listing) at a time, and
stops at the first shard not committed; where they were beside the shards' files, each
commit listed all of them (at 10,000 shards, 80,000 keys in 80 pages a commit). Workers
from before wrote `<n>.commit` beside the shard's other files: a watch, which lists
those anyway, counts such a marker (a rolling upgrade: a job whose shards both kinds of
worker commit is merged by its next watch).
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from worker.message import DIGEST_PATTERN, JobMessage, PoisonMessage, TarMembers
from worker.ports import JOB_ID_PATTERN, BlobStore, S3Location

T = TypeVar("T")

PLAN = "plan.json"
# A plan is a few hundred bytes and the job's params (at most a message's size).
MAX_PLAN_BYTES = 2 * 2**20
# A job is split into at most this many shards (larger ones, if need be): S3's most
# parts of an upload, so a merge can copy every part.
MAX_SHARDS = 10_000
COMMIT_SUFFIX = ".commit"
COMMITS = "commits/"
INPUTS_SUFFIX = ".inputs"
SENT_SUFFIX = ".sent"
STARTED_SUFFIX = ".started"
DUPLICATED_SUFFIX = ".duplicated"
DEAD_SUFFIX = ".dead"
WATCH = "watch"
MERGE = "merge"
MAX_COMMIT_BYTES = 64 * 1024
RUN_FILE = re.compile(r"^[0-9]{6}\.[A-Za-z0-9._-]{1,200}\.(jsonl|log|parquet)$")
S3_THREADS = 16  # requests at once while planning and merging


class Plan(BaseModel):
    """How a job is split: shard n runs the job's inputs `range(n)` (the rows of its
    listing: the objects, or with `tar` the tar shards). Read back from S3, so checked
    like a message: a plan that does not parse is not this worker's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(pattern=JOB_ID_PATTERN)
    request_digest: str = Field(pattern=DIGEST_PATTERN)
    items: int = Field(ge=1)
    shard_items: int = Field(ge=1)
    model: dict[str, Any]
    params: dict[str, Any]  # every shard runs with these (they are part of the digest)
    received_at: float  # when the job's message was first received (the planner's clock)
    attempt: int = Field(ge=1)  # the delivery of the job's message that planned it
    # Defaults: what a plan written before there were formats and ids means.
    format: Literal["jsonl", "parquet"] = "jsonl"  # every shard writes its results so
    ids: bool = False  # whether the job's inputs have ids (a table's id column)
    # The job's inputs are tar shards (its ranges count tars), whose members it runs.
    tar: TarMembers | None = None

    @property
    def shards(self) -> int:
        return math.ceil(self.items / self.shard_items)

    def range(self, shard: int) -> range:
        """The job's input indexes shard `shard` runs."""
        start = shard * self.shard_items
        return range(start, min(start + self.shard_items, self.items))

    @classmethod
    def parse(cls, data: bytes) -> Plan:
        try:
            return cls.model_validate_json(data)
        except ValidationError as error:
            raise PoisonMessage(f"{PLAN} under its output is not a plan: {error}") from error


def shard_directory(spec: JobMessage, request_digest: str) -> S3Location:
    return spec.output_location(f"shards/{request_digest}/")


def shard_file(spec: JobMessage, request_digest: str, shard: int, suffix: str) -> S3Location:
    """Where a shard's file goes (`suffix` one of the names above, with its dot)."""
    directory = shard_directory(spec, request_digest)
    return S3Location(directory.bucket, f"{directory.key}{shard_name(shard)}{suffix}")


def commits_directory(spec: JobMessage, request_digest: str) -> S3Location:
    return spec.output_location(f"shards/{request_digest}/{COMMITS}")


def commit_file(spec: JobMessage, request_digest: str, shard: int) -> S3Location:
    """Shard `shard`'s commit marker."""
    directory = commits_directory(spec, request_digest)
    return S3Location(directory.bucket, f"{directory.key}{shard_name(shard)}{COMMIT_SUFFIX}")


def commit_markers(
    spec: JobMessage, plan: Plan, listing: dict[str, str], commits: dict[str, str]
) -> dict[int, S3Location]:
    """The committed shards of `plan`, each with its marker: in the commits' folder
    (listed as `commits`), or beside the shard's files, where a worker from before the
    folder wrote it (in the shards' directory's `listing`)."""
    directory = shard_directory(spec, plan.request_digest)
    markers = {}
    for shard in range(plan.shards):
        name = f"{shard_name(shard)}{COMMIT_SUFFIX}"
        if name in commits:
            markers[shard] = commit_file(spec, plan.request_digest, shard)
        elif name in listing:
            markers[shard] = S3Location(directory.bucket, directory.key + name)
    return markers


def watch_file(spec: JobMessage, request_digest: str) -> S3Location:
    directory = shard_directory(spec, request_digest)
    return S3Location(directory.bucket, directory.key + WATCH)


def shard_name(shard: int) -> str:
    return f"{shard:06d}"


def shard_body(spec: JobMessage, plan: Plan, shard: int) -> str:
    """The message that runs shard `shard` of the job `spec` asks for."""
    inputs = shard_file(spec, plan.request_digest, shard, INPUTS_SUFFIX)
    return json.dumps(
        {
            "job_id": plan.job_id,
            "manifest": str(inputs),
            "output": spec.output,
            "params": spec.params,
            "format": plan.format,
            "shard": {"index": shard, "plan": plan.request_digest},
            **({"tar": plan.tar.model_dump()} if plan.tar else {}),
            **_request(spec),
        }
    )


def watch_body(spec: JobMessage, plan: Plan) -> str:
    """The message that has a worker look for the job's straggling shards."""
    return json.dumps(
        {
            "job_id": plan.job_id,
            "output": spec.output,
            "format": plan.format,
            "watch": plan.request_digest,
            **_request(spec),
        }
    )


def _request(spec: JobMessage) -> dict[str, str]:
    """The request id a job's shards and watches carry on (the merge's job.json echoes
    it), if its message gave one."""
    return {} if spec.request_id is None else {"request_id": spec.request_id}


class RunFile(BaseModel):
    """A file one run of a shard wrote, in the shards' directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=RUN_FILE.pattern)
    bytes: int = Field(ge=0)


class Commit(BaseModel):
    """A shard's commit marker: the run whose files count, and what it counted. Read
    back from S3 by the merger, so checked: its files must be its shard's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    results: list[RunFile]  # its results.jsonl, or its Parquet files in order
    log: RunFile
    cancelled: bool
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    resumed: int = Field(ge=0)
    attempt: int = Field(ge=1)
    device_s: float = Field(ge=0)
    seconds: float = Field(ge=0)  # from the run's first item fed to its commit
    items: int | None = Field(default=None, ge=0)  # a tar job's: the members of its tars

    @model_validator(mode="before")
    @classmethod
    def _from_before_parquet(cls, fields: Any) -> Any:
        """A marker a worker wrote before there were Parquet results (a rolling upgrade):
        one results file, and each file's size beside its name."""
        if not isinstance(fields, dict) or not isinstance(fields.get("results"), str):
            return fields
        fields = dict(fields)
        results = {"name": fields.pop("results"), "bytes": fields.pop("results_bytes", None)}
        fields["log"] = {"name": fields.get("log"), "bytes": fields.pop("log_bytes", None)}
        return {**fields, "results": [results]}


def read_commit(blobs: BlobStore, marker: S3Location) -> Commit:
    """The commit marker at `marker`; poison if it is not one."""
    data = blobs.get(marker, MAX_COMMIT_BYTES)
    try:
        return Commit.model_validate_json(data)
    except ValidationError as error:
        raise PoisonMessage(f"commit marker {marker} is not one: {error}") from error


def each_at_once(function: Callable[[Any], T], arguments: Iterable[Any]) -> list[T]:
    """`function` of each argument, `S3_THREADS` at a time, taking arguments only as
    threads free up (a planner's stream of shards is never held whole); raises the
    first error."""
    results: list[T] = []
    with ThreadPoolExecutor(S3_THREADS, thread_name_prefix="s3-calls") as pool:
        pending: deque[Future[T]] = deque()
        for argument in arguments:
            if len(pending) == S3_THREADS:
                results.append(pending.popleft().result())
            pending.append(pool.submit(function, argument))
        results.extend(future.result() for future in pending)
    return results


def shards_files(blobs: BlobStore, spec: JobMessage, request_digest: str) -> list[S3Location]:
    """Every file under plan `request_digest`'s shards' directory, its commit markers'
    folder's too."""
    directories = (shard_directory(spec, request_digest), commits_directory(spec, request_digest))
    return [
        S3Location(directory.bucket, directory.key + name)
        for directory in directories
        for name in blobs.objects_under(directory)
    ]


def merge_file(spec: JobMessage, request_digest: str) -> S3Location:
    directory = shard_directory(spec, request_digest)
    return S3Location(directory.bucket, directory.key + MERGE)
