"""The job message: its schema, and the checks that make a message poison."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from worker.ports import JOB_ID_PATTERN, S3Location

S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]/.*$"

S3Uri = Annotated[str, Field(pattern=S3_URI_PATTERN)]
# A request id: what a sender names one submit of a job by (it is echoed, never a path).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
# A request digest (`worker.jobs.checkpoints.request_digest`): it names a plan's files.
DIGEST_PATTERN = r"^[0-9a-f]{16}$"


T = TypeVar("T")
INPUT_SOURCES = (
    "inputs",
    "manifest",
    "inputs_prefix",
    "table",
    "inventory",
    "texts",
    "openai_batch",
)
# What a job's float arrays (an embedding) are stored as: `params.array_dtype`, a worker's
# param, not the pipeline's, since the arrays' files are the worker's (float16: half the
# bytes, for an embedding's three significant digits).
ARRAY_DTYPES = ("float32", "float16")
# What SQS takes in one message body: inline `texts` must fit in it with the rest.
SQS_MAX_BODY_BYTES = 256 * 1024
# The object under a job's output that cancels it: a producer writes it, every run of
# the job (each of its shards) looks for it (`worker.jobs.checkpoints`).
CANCEL_MARKER = "cancel"


class PoisonMessage(Exception):
    """A message that can never succeed: it goes to the dead-letter queue with this reason."""


class ShardRef(BaseModel):
    """Which part of a planned job a shard message runs: its number in the job's
    plan.json, and that plan's request digest (`worker.sharding.shards`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    plan: str = Field(pattern=DIGEST_PATTERN)


class TableSource(BaseModel):
    """A table of inputs: a CSV (a header row; gzipped if its key ends `.gz`), a Parquet
    file or JSON lines, or the files under a prefix (a `uri` ending `/`: a Spark or Hive
    table's parts), its URI column (or, with `text_column`, each row's text is the
    input itself) and, optionally, an id column carried into results."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: S3Uri
    uri_column: str = Field(default="uri", min_length=1, max_length=256)
    text_column: str | None = Field(default=None, min_length=1, max_length=256)
    id_column: str | None = Field(default=None, min_length=1, max_length=256)
    # By default the key's suffix says: .parquet, .csv / .csv.gz, or .jsonl / .json (.gz):
    # Spark's `write.json` leaves JSON lines as part-*.json.
    format: Literal["csv", "parquet", "jsonl"] | None = None

    @model_validator(mode="after")
    def _known_format(self) -> TableSource:
        if not self.is_prefix:
            self.file_format()
        if self.text_column is not None and "uri_column" in self.model_fields_set:
            raise ValueError("a table's inputs are its 'uri_column' or its 'text_column'")
        if self.id_column is not None and self.id_column == self.text_column:
            raise ValueError("a table's 'id_column' is another column than its 'text_column'")
        return self

    @property
    def is_prefix(self) -> bool:
        return self.uri.endswith("/")

    def file_format(self, uri: str | None = None) -> str:
        """The format of the table's file at `uri` (its own `uri` by default)."""
        if self.format is not None:
            return self.format
        key = (uri or self.uri).lower()
        if key.endswith(".parquet"):
            return "parquet"
        if key.endswith((".csv", ".csv.gz")):
            return "csv"
        if key.endswith((".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz")):
            return "jsonl"
        raise ValueError(
            "a table's key ends .csv, .csv.gz or .parquet (JSON lines: .jsonl, .json, or "
            "either .gz), or 'format' says"
        )


class TarMembers(BaseModel):
    """The listed inputs are tar shards (WebDataset's): each regular-file member, in
    order, is an input (`worker.datasets.tars`); those whose name ends `member_suffix`, if
    given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    member_suffix: str | None = Field(default=None, min_length=1, max_length=256)


class JobMessage(BaseModel):
    """The SQS body of a job (docs/jobs.md, "The job message")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    # Names one submit of the job (`worker.client` makes a new one each time): the job.json
    # of its run echoes it, so its sender tells that run from another to the same output.
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN)
    # The inputs: exactly one of these (`worker.datasets.inputs`).
    inputs: list[S3Uri] | None = Field(default=None, min_length=1)
    manifest: S3Uri | None = None
    inputs_prefix: S3Uri | None = None
    table: TableSource | None = None
    inventory: S3Uri | None = None  # an S3 Inventory report's manifest.json
    # The inputs are these texts themselves (`worker.datasets.texts`); with the rest of
    # the message, within what SQS takes (`SQS_MAX_BODY_BYTES`).
    texts: list[Any] | None = Field(default=None, min_length=1)
    # An OpenAI Batch API input file of /v1/embeddings requests, each text of each an
    # input; its results are written as that API's output and error files too
    # (`worker.datasets.openai_batch`).
    openai_batch: S3Uri | None = None
    # Of the objects under `inputs_prefix` or in the `inventory`, those whose key ends so.
    inputs_suffix: str | None = Field(default=None, min_length=1, max_length=1024)
    # The listed objects are tar shards, whose members are the inputs.
    tar: TarMembers | None = None
    output: S3Uri
    params: dict[str, Any] = Field(default_factory=dict)
    # How the results are written: results.jsonl (and a .npy per array field), or
    # Parquet files under results/ (`worker.datasets.tables`).
    format: Literal["jsonl", "parquet"] = "jsonl"
    # A job with more inputs than this is split across the fleet (`--shard-items`).
    shard_items: int | None = Field(default=None, ge=1)
    # Set by the worker that planned the job, on each of its shards' messages.
    shard: ShardRef | None = None
    # Set by workers on a planned job's timer: look for its straggling shards (the
    # digest of its plan), with the format of its results. Such a message names no inputs.
    watch: str | None = Field(default=None, pattern=DIGEST_PATTERN)

    @model_validator(mode="after")
    def _one_source(self) -> JobMessage:
        sources = [name for name in INPUT_SOURCES if getattr(self, name) is not None]
        if self.watch is not None:
            if self.job_id is None or sources or self.shard or self.tar:
                raise ValueError("a watch names its job's 'job_id', 'output' and 'format' alone")
            return self
        if len(sources) != 1:
            raise ValueError(f"give exactly one of {', '.join(map(repr, INPUT_SOURCES))}")
        if self.inputs_suffix is not None and not (self.inputs_prefix or self.inventory):
            raise ValueError("'inputs_suffix' filters an 'inputs_prefix' or an 'inventory'")
        if self.inputs_prefix is not None and self._output_is_listed(self.inputs_prefix):
            raise ValueError(
                "the 'output' is under the 'inputs_prefix': the job's own outputs would "
                "be listed as its inputs (and change them on every delivery)"
            )
        if self.table and self.table.is_prefix and self._output_is_listed(self.table.uri):
            raise ValueError("the 'output' is under the table's prefix: its files would be read")
        texts = self.texts or self.openai_batch or (self.table and self.table.text_column)
        if self.tar is not None and texts:
            raise ValueError("'tar' reads the objects listed: texts are inputs themselves")
        if self.texts is not None:
            check_texts_size(self.texts)
        if self.params.get("array_dtype", "float32") not in ARRAY_DTYPES:
            raise ValueError(f"params.array_dtype is one of {', '.join(map(repr, ARRAY_DTYPES))}")
        if self.shard is not None and (self.job_id is None or self.manifest is None):
            raise ValueError("a shard names its job's 'job_id' and its inputs' 'manifest'")
        return self

    def _output_is_listed(self, prefix: str) -> bool:
        """Whether a listing of the keys under `prefix` holds keys of the job's outputs."""
        listed, outputs = S3Location.parse(prefix), self.output_location("")
        return listed.bucket == outputs.bucket and (
            outputs.key.startswith(listed.key) or listed.key.startswith(outputs.key)
        )

    @property
    def array_floats(self) -> str | None:
        """What the job's float arrays are stored as, where it asks for other than the
        model gives (float16); None: as given."""
        dtype = self.params.get("array_dtype")
        return dtype if dtype == "float16" else None

    def output_location(self, name: str) -> S3Location:
        """Where the output file `name` of this job goes."""
        prefix = S3Location.parse(self.output)
        key = prefix.key if not prefix.key or prefix.key.endswith("/") else prefix.key + "/"
        return S3Location(prefix.bucket, key + name)

    def buckets(self) -> set[str]:
        """Every bucket the message names directly."""
        listings = [self.manifest, self.inputs_prefix, self.inventory, self.openai_batch]
        uris = [self.output, *(self.inputs or []), *filter(None, listings)]
        if self.table is not None:
            uris.append(self.table.uri)
        return {S3Location.parse(uri).bucket for uri in uris}


def check_texts_size(texts: list[Any]) -> None:
    """Refuse inline texts SQS could not carry: their JSON alone over a message's limit."""
    size = len(json.dumps(texts, ensure_ascii=False, default=repr).encode())
    if size > SQS_MAX_BODY_BYTES:
        raise ValueError(
            f"its 'texts' take {size} bytes, over the {SQS_MAX_BODY_BYTES} bytes SQS takes in a "
            "message: give them in a 'table' with a 'text_column' instead"
        )


def validation_problems(error: ValidationError) -> str:
    """Each field a document got wrong, and how: "field.sub: reason; ..."."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()
    )


def parse_job_message(body: str | bytes, allowed_buckets: frozenset[str]) -> JobMessage:
    """Validate a message body; raises `PoisonMessage` with a readable reason."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else body
        document = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PoisonMessage(f"body is not UTF-8 JSON: {error}") from error
    try:
        message = JobMessage.model_validate(document)
    except ValidationError as error:
        details = validation_problems(error)
        raise PoisonMessage(f"invalid job message: {details}") from error
    try:
        buckets = message.buckets()
    except ValueError as error:  # a URI S3 cannot hold (a key over its 1,024 bytes)
        raise PoisonMessage(f"invalid job message: {error}") from error
    check_buckets(buckets, allowed_buckets)
    return message


def check_buckets(buckets: set[str], allowed_buckets: frozenset[str]) -> None:
    """Raise `PoisonMessage` if a bucket is outside a non-empty allow-list."""
    outside = sorted(buckets - allowed_buckets) if allowed_buckets else []
    if outside:
        raise PoisonMessage(f"bucket(s) not allowed: {', '.join(outside)}")


# Longer than any S3 URI (a bucket name and a key of up to 1,024 bytes).
MAX_MANIFEST_LINE_BYTES = 2048


def at_most(
    inputs: Iterable[T], max_items: int, items: Callable[[T], int] = lambda _: 1
) -> Iterator[T]:
    """`inputs`, refused (poison) at the first one past `max_items`, before it is read on;
    each counted as its `items`."""
    count = 0
    for listed in inputs:
        count += items(listed)
        if count > max_items:
            raise PoisonMessage(f"more than {max_items} inputs, over the limit")
        yield listed


def manifest_uris(chunks: Iterable[bytes], allowed_buckets: frozenset[str]) -> Iterator[str]:
    """The input URIs a manifest lists, one per line (blank lines and '#' comments
    skipped), as its bytes are read; `PoisonMessage` at the first line that is not one,
    is longer than any URI can be, or names a bucket outside the allow-list, or if it
    lists none."""
    listed = False
    for number, raw in enumerate(lines(chunks), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise PoisonMessage(f"manifest line {number} is not UTF-8: {error}") from error
        if not line or line.startswith("#"):
            continue
        try:
            bucket = S3Location.parse(line).bucket
        except ValueError as error:
            raise PoisonMessage(f"manifest line {number}: {error}") from error
        check_buckets({bucket}, allowed_buckets)
        listed = True
        yield line
    if not listed:
        raise PoisonMessage("manifest lists no inputs")


def lines(
    chunks: Iterable[bytes], kind: str = "manifest", most_bytes: int = MAX_MANIFEST_LINE_BYTES
) -> Iterator[bytes]:
    """The lines of a stream of pieces (of a `kind` of listing), each at most
    `most_bytes`: the pieces are searched once, so one endless line costs no more than
    many short ones."""
    pending = bytearray()
    number = 0
    for chunk in chunks:
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            number += 1
            _check_line(kind, number, end - start, most_bytes)
            yield bytes(pending[start:end]).rstrip(b"\r")
            start = end + 1
        del pending[:start]
        _check_line(kind, number + 1, len(pending), most_bytes)
    if pending:
        yield bytes(pending)


def _check_line(kind: str, number: int, length: int, most_bytes: int) -> None:
    if length > most_bytes:
        raise PoisonMessage(f"{kind} line {number} is over {most_bytes} bytes: no input's")
