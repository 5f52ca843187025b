"""A Parquet table of texts too big for one worker, split across the fleet by row ranges
rather than copied: planning reads each file's footer alone (its ETag, row count and row
groups) and lists its rows as one input (`TableRows`: their names, no text), cut where
shards end; a shard's inputs file holds a `Span` line for each run of its rows in one
file, never their texts:

    {"table": "s3://b/t.parquet", "etag": "\\"9b2c...\\"", "rows": [200000, 300000],
     "text_column": "text", "id_column": "id"}

A shard's daemon reads only its rows (`span_batches`): the row groups its span overlaps,
from the first's start to its last row, streamed by ranged GETs of at most
`PARQUET_READ_BYTES` (or of one page, where a page is larger), each on condition that
the file is still the version its plan saw (If-Match its ETag). A file replaced since
planning, or while its rows are read, is the shard's poison, naming it and both ETags,
so that no shard's results mix two versions of a table and the job's error says which
file changed; one replaced and put back as it was while they are read (its ETag the
planned one again) has them read again, on the shard's next try.

CSV and JSON-lines tables have no random access by row: reaching row n means parsing
every row before it, so their rows' texts are still copied into the shards' inputs
files (`worker.datasets.texts.shard_text_line`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from worker.datasets.tables import UnfitResults, read_footer
from worker.datasets.texts import TextInput
from worker.errors import PreconditionFailed, TransientError
from worker.message import PoisonMessage, check_buckets
from worker.ports import BlobStore, S3Location

# Rows of a table read at a time (a record batch), at most.
TABLE_BATCH_ROWS = 65_536
PARQUET_GROUP_SLACK_BYTES = 2**16  # a row group's own headers, however few its rows
# A Parquet record batch holds about this many bytes of those columns at most: fewer
# rows than TABLE_BATCH_ROWS where they are long.
PARQUET_BATCH_BYTES = 8 * 2**20
# A shard's read of a column chunk of a table's row group, at a time (a ranged GET): the
# chunk is streamed, never held whole (a row group of a million texts is gigabytes).
PARQUET_READ_BYTES = 8 * 2**20
# Which of a file's columns to read: those named, or those a function of the file's own
# column names picks (an inventory's, whose Parquet files name them their own way).
Columns = list[str] | Callable[[list[str]], list[str]]
TEXT_ROW_LIMIT = "a table of texts' row on average"
# A table's text column and its id column (if it has one), as its rows carry them.
TextColumns = tuple[str, str | None]


class ParquetRead(NamedTuple):
    """How a Parquet file's columns are read, once its footer is weighed."""

    columns: list[str]
    batch_rows: int  # rows in a record batch
    dictionaries: list[str]  # the columns read as dictionaries (text)


def weighed(
    metadata: pq.FileMetaData, columns: Columns, uri: str, row_bytes: int, limits: str
) -> ParquetRead:
    """How the `columns` of the Parquet file `uri` (its footer `metadata`) are read:
    poison if one is missing, or at a row group whose footer says they take over
    `row_bytes` a row (some value is over its limit, which `limits` says); else in
    batches of about `PARQUET_BATCH_BYTES`, text read as a dictionary (each value once,
    however many rows repeat it)."""
    names = metadata.schema.to_arrow_schema().names
    wanted = columns(names) if callable(columns) else columns
    missing = [name for name in wanted if name not in names]
    if missing:
        raise PoisonMessage(f"table {uri} has no column {missing[0]!r}")
    leaves = [metadata.schema.column(leaf).path for leaf in range(metadata.num_columns)]
    read = [
        leaf
        for leaf, path in enumerate(leaves)
        if any(path == name or path.startswith(f"{name}.") for name in wanted)
    ]
    widest_row_bytes, first_row = 1.0, 1
    for number in range(metadata.num_row_groups):
        group = metadata.row_group(number)
        size = sum(group.column(leaf).total_uncompressed_size for leaf in read)
        if size > group.num_rows * row_bytes + PARQUET_GROUP_SLACK_BYTES:
            raise PoisonMessage(
                f"table {uri} {_rows(first_row, group.num_rows)} take "
                f"{size} bytes of {', '.join(wanted)}, over {row_bytes} a row: "
                f"some value is over its limit ({limits})"
            )
        widest_row_bytes = max(widest_row_bytes, size / max(1, group.num_rows))
        first_row += group.num_rows
    batch_rows = max(1, min(TABLE_BATCH_ROWS, int(PARQUET_BATCH_BYTES / widest_row_bytes)))
    return ParquetRead(
        wanted, batch_rows, [leaves[leaf] for leaf in read if leaves[leaf] in wanted]
    )


def _rows(first: int, count: int) -> str:
    return f"row {first}" if count == 1 else f"rows {first}-{first + count - 1}"


class Span(NamedTuple):
    """Rows `first` to `stop` (excluded) of the table file `file` as it was at planning
    (`etag`), with the columns to read."""

    file: str
    etag: str
    first: int
    stop: int
    columns: TextColumns

    def range(self) -> range:
        return range(self.first, self.stop)

    def listed_id(self) -> str:
        """What the request digest takes for each of its rows where a row's id would be:
        its file's ETag at planning and the columns read, so that the digest covers the
        version planned and what is read of it (another `id_column` is another request)."""
        return json.dumps([self.etag, *self.columns])


class TableRows(TextInput):
    """The rows of a `span` as planning lists them: one input of the listing for all of
    them, counted as its `row_count` items, so that planning a table of 20 million rows
    makes a few objects a file, not a few a row. Named for its rows
    (`s3://b/t.parquet#rows=0-999`, where a shard names each `...#row=17`); no text
    (`TextInput`'s `problem`): no run of rows is an item a pipeline runs."""

    __slots__ = ("span",)
    span: Span

    def __new__(cls, span: Span) -> TableRows:
        made = str.__new__(cls, f"{span.file}#rows={span.first}-{span.stop - 1}")
        made.text, made.problem = None, "its texts are read by its shards"
        made.span = span
        return made

    def __reduce__(self) -> Any:
        return type(self), (self.span,)

    @property
    def row_count(self) -> int:
        return self.span.stop - self.span.first

    def cut(self, rows: int) -> tuple[TableRows, TableRows]:
        """Its first `rows` rows, and the rest (both some)."""
        end = self.span.first + rows
        assert self.span.first < end < self.span.stop, "a cut leaves rows on each side"
        return TableRows(self.span._replace(stop=end)), TableRows(self.span._replace(first=end))


def listed_items(uri: str) -> int:
    """The items an input of a listing stands for: a `TableRows`' rows, else one."""
    return uri.row_count if isinstance(uri, TableRows) else 1


class PlannedFile(NamedTuple):
    """A Parquet table file as its footer showed it at planning."""

    uri: str
    etag: str
    rows: int
    columns: TextColumns

    def table_rows(self) -> TableRows:
        return TableRows(Span(self.uri, self.etag, 0, self.rows, self.columns))


def planned_file(
    blobs: BlobStore, uri: str, columns: TextColumns, max_bytes: int, row_bytes: int
) -> PlannedFile:
    """The Parquet table file at `uri` as its footer shows it, its columns weighed as a
    read of its rows weighs them, and its id column's type one that is read as text:
    poison now, rather than in every shard. (An id over its size limit is found only by
    the shard that reads it: a footer does not say.)"""
    location = S3Location.parse(uri)
    head = blobs.head(location)
    metadata = _footer(blobs, location, head.size, max_bytes, head.etag)
    weighed(metadata, _wanted(columns), uri, row_bytes, TEXT_ROW_LIMIT)
    id_column = columns[1]
    if id_column is not None:
        kind = metadata.schema.to_arrow_schema().field(id_column).type
        try:
            pa.array([], kind).cast(pa.string())  # Arrow's casts go by type, not by value
        except pa.ArrowException as error:
            raise PoisonMessage(
                f"table {uri}: its id column {id_column} ({kind}) cannot be read as text: {error}"
            ) from error
    return PlannedFile(uri, head.etag, metadata.num_rows, columns)


def planned_files(
    files: Iterable[tuple[str, str]],
    footer: Callable[[str], PlannedFile],
    most: int,
    looked_at: Callable[[], None],
) -> Iterator[tuple[str, str, PlannedFile | None]]:
    """A table of texts' `files` (each with its format) in order, each with how its
    `footer` shows it where the table is planned as row ranges (its Parquet files hold
    over `most` rows), else None. Footers are read a file at a time, each `looked_at`,
    held only until their rows are over `most`, then read as each file's turn comes: a
    prefix of thousands of files lists its first rows after a few footers, not all."""
    held: list[tuple[str, str, PlannedFile | None]] | None = []
    rows = 0
    for uri, file_format in files:
        planned = footer(uri) if file_format == "parquet" else None
        looked_at()
        if held is None:
            yield uri, file_format, planned
            continue
        held.append((uri, file_format, planned))
        rows += planned.rows if planned is not None else 0
        if rows > most:
            yield from held
            held = None
    yield from ((uri, file_format, None) for uri, file_format, _ in held or [])


def spooled_parquet_batches(  # noqa: PLR0917 (a store's object, then how it is read)
    blobs: BlobStore,
    location: S3Location,
    max_bytes: int,
    columns: Columns,
    row_bytes: int,
    limits: str,
) -> Iterator[pa.RecordBatch]:
    """The record batches of a Parquet file's `columns`, read whole: spooled to a local
    file (its reader reads the footer, at the end, first), weighed (`weighed`) before
    any batch is read, text read as a dictionary."""
    with tempfile.TemporaryFile() as spool:
        for chunk in blobs.chunks(location, max_bytes):
            spool.write(chunk)
        spool.seek(0)
        metadata = pq.read_metadata(spool)
        read = weighed(metadata, columns, str(location), row_bytes, limits)
        parquet = pq.ParquetFile(spool, metadata=metadata, read_dictionary=read.dictionaries)
        yield from parquet.iter_batches(read.batch_rows, columns=read.columns)


def span_line(span: Span) -> bytes:
    """A span as a line of a shard's inputs file."""
    text_column, id_column = span.columns
    line = {
        "table": span.file,
        "etag": span.etag,
        "rows": [span.first, span.stop],
        "text_column": text_column,
        "id_column": id_column,
    }
    return json.dumps(line).encode() + b"\n"


def is_span_line(line: bytes) -> bool:
    return line.startswith(b"{")


def span_of_line(line: bytes) -> Span:
    """The span a `span_line` is; ValueError if it is not one (the file is read from S3),
    or holds no row (a planner writes none such, and each costs its shard a footer)."""
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not a span")
    first, stop = value["rows"]
    texts, ids, file, etag = (value[name] for name in ("text_column", "id_column", "table", "etag"))
    numbers = (first, stop)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) or first < 0:
        raise ValueError("its rows are not two row numbers")
    if stop <= first:
        raise ValueError(f"its rows [{first}, {stop}] are none")
    if not (isinstance(file, str) and isinstance(etag, str) and isinstance(texts, str)):
        raise ValueError("its table, etag or text column is not text")
    if not isinstance(ids, str | None):
        raise ValueError("its id column is not text")
    return Span(file, etag, first, stop, (texts, ids))


def shard_span(line: bytes, number: int, allowed: frozenset[str], spanned: set[str]) -> Span:
    """The span line `number` of a shard's inputs file is, checked: poison if it is none,
    names a bucket outside `allowed`, or a file `spanned` already in the shard (a planner
    writes a line a file a shard, its run of rows: each costs the shard a footer)."""
    try:
        span = span_of_line(line)
        bucket = S3Location.parse(span.file).bucket
    except (ValueError, KeyError, TypeError) as error:
        raise PoisonMessage(f"shard inputs line {number} is not a span: {error}") from error
    check_buckets({bucket}, allowed)
    if span.file in spanned:
        raise PoisonMessage(f"shard inputs line {number} spans {span.file} a second time")
    spanned.add(span.file)
    return span


def span_batches(
    blobs: BlobStore, span: Span, max_bytes: int, row_bytes: int
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The rows of `span` as record batches of its columns, each with its first row's
    number in the file: only the row groups the span overlaps are read, up to its last
    row, each column chunk streamed by ranged GETs of `PARQUET_READ_BYTES` (a page at
    least), each on condition that the file is the version planned (`span.etag`).
    Poison if it is not, asked before the rows are read and where a read fails, whatever
    it fails with (S3 answers a range past a shortened file's end with InvalidRange)."""
    location = S3Location.parse(span.file)
    head = blobs.head(location)
    _same_version(span, head.etag)
    metadata = _footer(blobs, location, head.size, max_bytes, span.etag)
    if metadata.num_rows < span.stop:
        raise PoisonMessage(
            f"table {span.file} has {metadata.num_rows} rows, not the {span.stop} it had when "
            "its job was planned"
        )
    read = weighed(metadata, _wanted(span.columns), span.file, row_bytes, TEXT_ROW_LIMIT)
    groups, row, first_row = [], 0, 0
    for number in range(metadata.num_row_groups):
        group_rows = metadata.row_group(number).num_rows
        if row + group_rows <= span.first:
            first_row = row + group_rows  # a group before the span's: not read
        elif row < span.stop:
            groups.append(number)
        row += group_rows
    row = first_row
    parquet = pq.ParquetFile(
        _RangedObject(blobs, location, head.size, span.etag),
        metadata=metadata,
        read_dictionary=read.dictionaries,
        pre_buffer=False,
        buffer_size=PARQUET_READ_BYTES,
    )
    # Batches of no more rows than the span's: the rows after its last are not read.
    batch_rows = min(read.batch_rows, len(span.range()))
    batches = parquet.iter_batches(batch_rows, row_groups=groups, columns=read.columns)
    try:
        for batch in batches:
            start, stop = max(span.first - row, 0), min(span.stop - row, batch.num_rows)
            if stop > start:
                yield row + start, batch.slice(start, stop - start)
            row += batch.num_rows
            if row >= span.stop:
                break  # the rest of its last row group is another shard's
    except Exception as error:
        # A read past a replaced file's end, or of what its offsets no longer point at,
        # is the replacement's, not a fault to retry.
        _same_version(span, blobs.head(location).etag)
        if isinstance(error, PreconditionFailed):  # and put back since
            raise TransientError(f"table {span.file} changed while its rows were read") from error
        raise
    finally:
        batches.close()


def _wanted(columns: TextColumns) -> list[str]:
    text_column, id_column = columns
    return [text_column, *([id_column] if id_column else [])]


def _same_version(span: Span, etag: str) -> None:
    if etag != span.etag:
        raise PoisonMessage(
            f"table {span.file} was replaced since its job was planned (ETag {span.etag}, "
            f"now {etag}): its rows would mix two versions; send the job again"
        )


def _footer(
    blobs: BlobStore, location: S3Location, size: int, max_bytes: int, etag: str
) -> pq.FileMetaData:
    if size > max_bytes:
        raise PoisonMessage(f"table {location} is {size} bytes, over {max_bytes}")
    try:
        return read_footer(blobs, location, size, etag)
    except UnfitResults as error:
        raise PoisonMessage(
            f"table {location} is not a table this worker reads: {error}"
        ) from error


class _RangedObject:
    """An S3 object as the random-access file pyarrow reads a Parquet file from: each
    read a ranged GET."""

    def __init__(self, blobs: BlobStore, location: S3Location, size: int, etag: str):
        self._blobs, self._location, self._size, self._etag = blobs, location, size, etag
        self._position = 0
        self.closed = False
        self.mode = "rb"

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._size)[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1) -> bytes:
        end = self._size if size < 0 else min(self._size, self._position + size)
        if end <= self._position:
            return b""
        wanted = (self._position, end - self._position)
        data = self._blobs.get(self._location, byte_range=wanted, expect=self._etag)
        self._position += len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def size(self) -> int:
        return self._size
