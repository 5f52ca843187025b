"""A job's inputs, read from whichever kind of listing its message names, as a stream
of `Input`s (a URI, and the id its table gives it), never held whole:

- `inputs`: the URIs in the message;
- `manifest`: a text file of URIs, one per line;
- `inputs_prefix`: every object under a prefix (`inputs_suffix` keeps those whose key
  ends so), listed a page (1,000 keys) at a time, in S3's order;
- `table`: a CSV (`.csv`, or gzipped `.csv.gz`), Parquet or JSON-lines table with a URI
  column (or a text column: `worker.datasets.texts`) and an optional id column, carried
  into every result line;
- `texts`: the texts in the message (`worker.datasets.texts`);
- `openai_batch`: the texts of an OpenAI Batch API file (`worker.datasets.openai_batch`);
- `inventory`: an S3 Inventory report's manifest.json, whose CSV or Parquet files list
  the objects (`inputs_suffix` applies; delete markers and old versions are skipped).

Everything read is untrusted: a listing that cannot be read, lacks a column, names a
bucket outside the allow-list or something that is not an S3 URI makes the message
poison, with the row or line named. Each file read is at most `--max-manifest-bytes`,
and no value is held before its size is checked: a URI's key is at most S3's 1,024
bytes, an id `MAX_ID_BYTES`; a Parquet file's row groups are weighed from its footer
first, and read a bounded batch at a time.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from worker.datasets.inventories import (
    INVENTORY_SKIPS,
    MAX_BUCKET_CHARS,
    MAX_FLAG_BYTES,
    MAX_INVENTORY_MANIFEST_BYTES,
    inventory_columns,
    inventory_name,
    inventory_report,
    truthy,
)
from worker.datasets.json_lines import json_lines_batches
from worker.datasets.openai_batch import batch_requests
from worker.datasets.streams import ChunkStream, unzipped
from worker.datasets.table_ranges import (
    Columns,
    PlannedFile,
    Span,
    TableRows,
    TextColumns,
    is_span_line,
    planned_file,
    planned_files,
    shard_span,
    span_batches,
    span_line,
    span_of_line,
    spooled_parquet_batches,
)
from worker.datasets.texts import (
    MAX_TEXT_BYTES,
    TextInput,
    column_texts,
    inline_texts,
    shard_text_line,
    text_from_shard_line,
)
from worker.errors import AccessDenied, MissingObject, ObjectTooLarge
from worker.message import (
    JobMessage,
    PoisonMessage,
    TableSource,
    check_buckets,
    lines,
    manifest_uris,
)
from worker.ports import S3_MAX_KEY_BYTES, S3_MAX_URI_BYTES, BlobStore, S3Location

# An id goes into every result line of its input: a longer one is refused.
MAX_ID_BYTES = 1024
# What a row of the columns read of a Parquet file (a URI and an id, or an inventory's
# bucket, key and flags) can take within their limits, with room for each value's
# framing; a row group whose footer says its rows take more on average holds a value
# over its limit, and is refused before it is read. (A batch of 65,536 rows of a value
# repeated on each would otherwise hold it 65,536 times.)
MAX_PARQUET_ROW_BYTES = S3_MAX_URI_BYTES + MAX_ID_BYTES + 64
PARQUET_LIMITS = f"a URI's key {S3_MAX_KEY_BYTES} bytes, an id {MAX_ID_BYTES}"
# A text table's row: a text over its limit is its item's error, not the table's, so the
# bound only says what no table of texts holds on average.
MAX_PARQUET_TEXT_ROW_BYTES = 2**20
# A CSV row longer than this is no input's: pyarrow reads blocks of this size.
CSV_BLOCK_BYTES = 2**20


class _Bound(NamedTuple):
    """The most bytes a column's values may have, and what a value over it is."""

    most: int
    over: str


URI_BOUND = _Bound(
    S3_MAX_URI_BYTES, f"its URI's key is over S3's limit of {S3_MAX_KEY_BYTES} bytes"
)
ID_BOUND = _Bound(MAX_ID_BYTES, f"its id is over the limit of {MAX_ID_BYTES} bytes")
BUCKET_BOUND = _Bound(MAX_BUCKET_CHARS, f"its bucket is over {MAX_BUCKET_CHARS} characters")
FLAG_BOUND = _Bound(MAX_FLAG_BYTES, f"a flag of its is over {MAX_FLAG_BYTES} bytes")


# A shard's inputs file's line: a URI and an id (and a text) as JSON, each escaped
# character six.
MAX_SHARD_LINE_BYTES = 16 * 1024 + 6 * MAX_TEXT_BYTES


class Input(NamedTuple):
    uri: str
    id: str | None = None  # a table's id for it, as text


class InputReader:
    """Reads the inputs a message names, checked against the allow-list and limits."""

    def __init__(
        self,
        blobs: BlobStore,
        allowed_buckets: frozenset[str],
        max_file_bytes: int,
        shard_items: int | None = None,
    ):
        """With `shard_items` (the worker's `--shard-items`), a Parquet table of texts of
        more rows than a job's shard size is listed as `TableRows`, read by its shards."""
        self._blobs = blobs
        self._allowed = allowed_buckets
        self._max_file_bytes = max_file_bytes
        self._shard_items = shard_items

    def inputs(
        self, spec: JobMessage, looked_at: Callable[[], None] = lambda: None
    ) -> Iterator[Input]:
        """The job's inputs in order, as they are read; `PoisonMessage` at the first thing
        that makes its listing unusable, or if it lists none. `looked_at` is called as
        each file of a table has its footer read at planning, before its rows are listed."""
        listed = False
        for listed_input in self._listed(spec, looked_at):
            listed = True
            yield listed_input
        if not listed:
            raise PoisonMessage("the job lists no inputs")

    def _listed(  # noqa: PLR0911 (one per source)
        self, spec: JobMessage, looked_at: Callable[[], None]
    ) -> Iterator[Input]:
        if spec.inputs:
            return (Input(uri) for uri in spec.inputs)
        if spec.manifest:
            return self._read(
                "manifest", spec.manifest, lambda chunks: _manifest(chunks, self._allowed)
            )
        if spec.inputs_prefix:
            return self._prefix(S3Location.parse(spec.inputs_prefix), spec.inputs_suffix or "")
        if spec.texts is not None:
            return (Input(text) for text in inline_texts(spec.texts))
        if spec.table:
            return self._table(spec.table, spec.shard_items, looked_at)
        if spec.openai_batch:
            uri = spec.openai_batch
            return self._read(
                "OpenAI batch", uri, lambda chunks: (Input(*t) for t in batch_requests(chunks, uri))
            )
        assert spec.inventory is not None
        return self._inventory(spec.inventory, spec.inputs_suffix or "")

    def shard(self, uri: str, most: int) -> list[Input]:
        """A planned shard's inputs: its inputs file, a JSON `[uri, id]` per line, read as
        it streams in, and no more than one line past `most` (a file under the job's
        output is anyone's who may write there)."""
        parse = functools.partial(_shard_inputs, allowed=self._allowed, spans=self._span_inputs)
        return list(itertools.islice(self._read("shard inputs", uri, parse), most + 1))

    def _read(
        self, kind: str, uri: str, parse: Callable[[Iterator[bytes]], Iterator[Input]]
    ) -> Iterator[Input]:
        """`parse` of the bytes of the `kind` of listing at `uri` as they stream in;
        poison if it cannot be read."""
        chunks = self._blobs.chunks(S3Location.parse(uri), self._max_file_bytes)
        with unreadable_is_poison(f"{kind} {uri}"), contextlib.closing(chunks):
            yield from parse(chunks)

    def _prefix(self, prefix: S3Location, suffix: str) -> Iterator[Input]:
        with unreadable_is_poison(f"prefix {prefix}"):
            for key in self._blobs.keys_under(prefix):
                if key.endswith(suffix) and not key.endswith("/"):
                    yield Input(f"s3://{prefix.bucket}/{key}")

    def _table(
        self, table: TableSource, shard_items: int | None, looked_at: Callable[[], None]
    ) -> Iterator[Input]:
        """A table's rows, file by file (a prefix's in key order), each a URI or a text;
        a table of texts whose Parquet files hold more rows than the job's shard size
        (`shard_items`, at most the worker's) has their rows listed as `TableRows` from
        their footers, their texts left for their shards to read."""
        rows_of = self._text_rows if table.text_column else self._uri_rows
        files = ((uri, _file_format(table, uri)) for uri in self._table_files(table))
        if table.text_column is None or self._shard_items is None:
            for uri, file_format in files:
                yield from rows_of(table, uri, file_format)
            return
        most = min(shard_items or self._shard_items, self._shard_items)
        footer = functools.partial(self._planned_file, (table.text_column, table.id_column))
        for uri, file_format, planned in planned_files(files, footer, most, looked_at):
            if planned is None:
                yield from rows_of(table, uri, file_format)
            elif planned.rows:  # its shards read its ids and texts
                yield Input(planned.table_rows())

    def _planned_file(self, columns: TextColumns, uri: str) -> PlannedFile:
        with unreadable_is_poison(f"table {uri}"):
            read = (self._max_file_bytes, MAX_PARQUET_TEXT_ROW_BYTES)
            return planned_file(self._blobs, uri, columns, *read)

    def _table_files(self, table: TableSource) -> Iterator[str]:
        """The table's file, or the files under its prefix in key order, but what Spark or
        Hive leave beside their parts (`_SUCCESS`, `.crc`, `_temporary/`, `_delta_log/`)."""
        if not table.is_prefix:
            yield table.uri
            return
        prefix = S3Location.parse(table.uri)
        for key in self._blobs.keys_under(prefix):
            below = key[len(prefix.key) :].split("/")
            if not key.endswith("/") and not any(n.startswith(("_", ".")) for n in below):
                yield f"s3://{prefix.bucket}/{key}"

    def _uri_rows(self, table: TableSource, uri: str, file_format: str) -> Iterator[Input]:
        columns = [table.uri_column, *([table.id_column] if table.id_column else [])]
        rows = 0
        for batch in self._batches(uri, file_format, columns, header=True):
            uris = _bounded(batch.column(table.uri_column), URI_BOUND, uri, rows)
            ids = _ids_as_text(table.id_column, uri, batch, rows)
            for number, (listed, input_id) in enumerate(zip(uris, ids, strict=True), rows + 1):
                self._check(listed, f"{uri} row {number}")
                yield Input(listed, input_id)
            rows += len(uris)

    def _text_rows(self, table: TableSource, uri: str, file_format: str) -> Iterator[Input]:
        """A table file's rows as text inputs, a record batch at a time (no GET per input)."""
        assert table.text_column is not None
        columns = [table.text_column, *([table.id_column] if table.id_column else [])]
        rows = 0
        text_rows = MAX_PARQUET_TEXT_ROW_BYTES
        batches = self._batches(
            uri, file_format, columns, header=True, row_bytes=text_rows, text=table.text_column
        )
        for batch in batches:
            yield from _text_inputs((table.text_column, table.id_column), uri, batch, rows)
            rows += batch.num_rows

    def _span_inputs(self, span: Span) -> Iterator[Input]:
        """A shard's rows of a Parquet table of texts (`table_ranges.span_batches`),
        whatever its file's key (its planner knew it for Parquet)."""
        with unreadable_is_poison(f"table {span.file}"):
            batches = span_batches(
                self._blobs, span, self._max_file_bytes, MAX_PARQUET_TEXT_ROW_BYTES
            )
            for first_row, batch in batches:
                yield from _text_inputs(span.columns, span.file, batch, first_row)

    def _inventory(self, manifest_uri: str, suffix: str) -> Iterator[Input]:
        """The objects an S3 Inventory report lists, file by file in its manifest's order."""
        with unreadable_is_poison(f"inventory {manifest_uri}"):
            data = self._blobs.get(S3Location.parse(manifest_uri), MAX_INVENTORY_MANIFEST_BYTES)
        report = inventory_report(manifest_uri, data)
        check_buckets({report.bucket}, self._allowed)
        for key in report.files:
            uri = f"s3://{report.bucket}/{key}"
            columns = report.columns if report.file_format == "csv" else inventory_columns
            rows = 0
            for batch in self._batches(uri, report.file_format, columns, header=False):
                csv = report.file_format == "csv"
                yield from self._inventory_rows(uri, batch, rows, suffix, csv)
                rows += batch.num_rows

    def _inventory_rows(
        self, uri: str, batch: pa.RecordBatch, rows_before: int, suffix: str, url_encoded: bool
    ) -> Iterator[Input]:
        names = {inventory_name(name): name for name in batch.schema.names}
        if not {"bucket", "key"} <= names.keys():
            raise PoisonMessage(f"inventory file {uri} has no Bucket and Key columns")
        where = f"inventory file {uri}"
        # A key is URL-encoded in a CSV inventory: up to three bytes a byte.
        key_bound = URI_BOUND._replace(most=S3_MAX_KEY_BYTES * (3 if url_encoded else 1))

        def column(name: str, bound: _Bound) -> list[Any]:
            return _bounded(batch.column(names[name]), bound, where, rows_before)

        buckets, keys = column("bucket", BUCKET_BOUND), column("key", key_bound)
        skips = [
            (column(name, FLAG_BOUND), value)
            for name, value in INVENTORY_SKIPS.items()
            if name in names
        ]
        for row, (bucket, listed_key) in enumerate(zip(buckets, keys, strict=True)):
            if any(truthy(values[row]) == value for values, value in skips):
                continue
            where = f"inventory file {uri} row {rows_before + row + 1}"
            if not isinstance(bucket, str) or not isinstance(listed_key, str):
                raise PoisonMessage(f"{where} has no bucket or key")
            key = urllib.parse.unquote_plus(listed_key) if url_encoded else listed_key
            if key.endswith(suffix) and not key.endswith("/"):
                input_uri = f"s3://{bucket}/{key}"
                self._check(input_uri, where)
                yield Input(input_uri)

    def _batches(
        self,
        uri: str,
        file_format: str,
        columns: Columns,
        *,
        header: bool,
        row_bytes: int = MAX_PARQUET_ROW_BYTES,
        text: str | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """A CSV, Parquet or JSON-lines file's record batches, of its `columns` (a CSV's
        are named; without a `header` they name its columns), each read as strings in a
        CSV, but its `text` column, as bytes (one that is not UTF-8 is its row's error,
        not the table's); a Parquet row group over `row_bytes` a row is refused unread."""
        location = S3Location.parse(uri)
        with unreadable_is_poison(f"table {uri}"):
            if file_format == "parquet":
                store = (self._blobs, location, self._max_file_bytes)
                read = (columns, row_bytes, PARQUET_LIMITS)
                yield from spooled_parquet_batches(*store, *read)
            elif file_format == "jsonl":
                assert isinstance(columns, list)
                yield from self._json_lines_batches(location, columns, text)
            else:
                assert isinstance(columns, list)
                yield from self._csv_batches(location, columns, header, text)

    def _json_lines_batches(
        self, location: S3Location, columns: list[str], text: str | None
    ) -> Iterator[pa.RecordBatch]:
        chunks = self._blobs.chunks(location, self._max_file_bytes)
        with contextlib.closing(chunks):
            stream = io.BufferedReader(ChunkStream(unzipped(chunks, location)))
            yield from json_lines_batches(
                stream, str(location), columns, text_column=text, batch_bytes=CSV_BLOCK_BYTES
            )

    def _csv_batches(
        self, location: S3Location, columns: list[str], header: bool, text: str | None
    ) -> Iterator[pa.RecordBatch]:
        chunks = self._blobs.chunks(location, self._max_file_bytes)
        stream = io.BufferedReader(ChunkStream(unzipped(chunks, location)), CSV_BLOCK_BYTES)
        # The stream is closed first: pyarrow reads blocks ahead on a thread of its own
        # (up to 32), and closing the stream waits for a read under way and refuses the
        # next (`ChunkStream`), so once this ends nothing reads or inflates the object
        # any more, a refused table's included.
        with contextlib.closing(chunks), stream:
            # Parsed a block at a time: with threads the reader parses as many blocks
            # ahead as it has threads, and what a table holds is a sender's to choose.
            read = pa_csv.ReadOptions(
                block_size=CSV_BLOCK_BYTES,
                column_names=None if header else columns,
                use_threads=False,
            )
            convert = pa_csv.ConvertOptions(
                include_columns=columns if header else None,
                column_types={
                    name: pa.binary() if name == text else pa.string() for name in columns
                },
            )
            # A quoted value of another column (a caption) may hold a line break.
            parse = pa_csv.ParseOptions(newlines_in_values=True)
            yield from pa_csv.open_csv(
                stream, read_options=read, parse_options=parse, convert_options=convert
            )

    def _check(self, uri: Any, where: str) -> None:
        if not isinstance(uri, str):
            raise PoisonMessage(f"{where} has no input URI")
        try:
            bucket = S3Location.parse(uri).bucket
        except ValueError as error:
            raise PoisonMessage(f"{where}: {error}") from error
        check_buckets({bucket}, self._allowed)


def _bounded(column: pa.Array, bound: _Bound, where: str, rows_before: int) -> list[Any]:
    """A column's values, once none is over `bound`: poison naming the first row (after
    `rows_before` of the file `where`) that is, before any value is made a Python object."""
    over = _first_over(column, bound.most)
    if over is not None:
        row, size = over
        raise PoisonMessage(f"{where} row {rows_before + row + 1}: {bound.over} ({size} bytes)")
    values: list[Any] = column.to_pylist()
    return values


def _first_over(column: pa.Array, most: int) -> tuple[int, int] | None:
    """The first row of a column of text (or bytes) whose value is over `most` bytes,
    and its size; None if there is none, or the column is not text. A dictionary's
    values are measured once each."""
    dictionary = pa.types.is_dictionary(column.type)
    values = column.dictionary if dictionary else column
    kind = values.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)) and not (
        pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    ):
        return None
    lengths = pc.binary_length(values)
    if dictionary:
        lengths = lengths.take(column.indices)
    row: int = pc.index(pc.greater(lengths, most), True).as_py()
    return None if row < 0 else (row, lengths[row].as_py())


def _file_format(table: TableSource, uri: str) -> str:
    try:
        return table.file_format(uri)
    except ValueError as error:
        raise PoisonMessage(f"table file {uri}: {error}") from error


def _text_inputs(
    columns: TextColumns, uri: str, batch: pa.RecordBatch, rows_before: int
) -> Iterator[Input]:
    """A record batch of a table of texts (from row `rows_before` of file `uri` on, its
    text and id `columns`) as inputs."""
    text_column, id_column = columns
    texts = column_texts(batch.column(text_column), uri, rows_before)
    ids = _ids_as_text(id_column, uri, batch, rows_before)
    return map(Input, texts, ids)


def _ids_as_text(
    id_column: str | None, uri: str, batch: pa.RecordBatch, rows_before: int
) -> list[str | None]:
    """A batch's ids (of the table file `uri`) as text, whatever their column's type (an
    integer, a date, a decimal): every file of a job's results then has the same `id`
    column, and every id can be written on a JSON line. Each is at most `MAX_ID_BYTES`;
    None each, without an `id_column`."""
    if id_column is None:
        return [None] * batch.num_rows
    column = batch.column(id_column)
    try:
        if pa.types.is_dictionary(column.type):  # its values cast, not copied to each row
            text = pa.DictionaryArray.from_arrays(
                column.indices, column.dictionary.cast(pa.string())
            )
        else:
            text = column.cast(pa.string())
        text.validate(full=True)  # UTF-8, which a writer may not have checked
    except pa.ArrowException as error:
        raise PoisonMessage(
            f"table {uri}: its id column {id_column} ({column.type}) cannot be read as text: "
            f"{error}"
        ) from error
    return _bounded(text, ID_BOUND, uri, rows_before)


def _manifest(chunks: Iterable[bytes], allowed: frozenset[str]) -> Iterator[Input]:
    return (Input(uri) for uri in manifest_uris(chunks, allowed))


def _shard_inputs(
    chunks: Iterable[bytes], allowed: frozenset[str], spans: Callable[[Span], Iterator[Input]]
) -> Iterator[Input]:
    """A shard's inputs file: written by a planner, but read from S3, so checked. A line
    that is not JSON is a URI alone, as planners wrote before there were ids; a span's
    (`table_ranges`) is its rows, read by `spans`."""
    spanned: set[str] = set()
    for number, line in enumerate(lines(chunks, "shard inputs", MAX_SHARD_LINE_BYTES), 1):
        if is_span_line(line):
            yield from spans(shard_span(line, number, allowed, spanned))
            continue
        if not line.startswith(b"["):
            uri, input_id = line.decode(errors="replace"), None
        else:
            try:
                uri, input_id = shard_line_input(line)
            except (ValueError, TypeError) as error:
                raise PoisonMessage(f"shard inputs line {number} is not [uri, id]") from error
        if isinstance(input_id, int | float) and not isinstance(input_id, bool):
            input_id = str(input_id)  # as planners wrote a number before ids were text
        if not isinstance(input_id, str | None):
            raise PoisonMessage(f"shard inputs line {number}: its id is not text")
        if input_id is not None and len(input_id.encode(errors="replace")) > MAX_ID_BYTES:
            raise PoisonMessage(f"shard inputs line {number}: {ID_BOUND.over}")
        if not isinstance(uri, TextInput):
            try:
                bucket = S3Location.parse(uri).bucket
            except (ValueError, AttributeError) as error:
                raise PoisonMessage(f"shard inputs line {number}: {error}") from error
            check_buckets({bucket}, allowed)
        yield Input(uri, input_id)


def shard_lines(listed: Iterable[Input]) -> Iterator[bytes]:
    """`listed` as lines of a shard's inputs file: a `shard_line` each, a run of a
    Parquet table's rows planned as a range (`TableRows`) a line of its span."""
    for each in listed:
        yield span_line(each.uri.span) if isinstance(each.uri, TableRows) else shard_line(each)


def shard_line_listed(line: bytes) -> Input:
    """The input a line of `shard_lines` is, its values unchecked (a planner's own)."""
    if is_span_line(line):
        return Input(TableRows(span_of_line(line)))
    return shard_line_input(line)


def shard_line(listed: Input) -> bytes:
    """`listed` as a line of a shard's inputs file."""
    if isinstance(listed.uri, TextInput):
        return shard_text_line(listed.uri, listed.id)
    return json.dumps([listed.uri, listed.id]).encode() + b"\n"


def shard_line_input(line: bytes) -> Input:
    """The input a `shard_line` is (a text input's text with it), its values unchecked;
    ValueError or TypeError if it is not one."""
    uri, input_id, *text = json.loads(line)
    if text:  # [name, id, {text}]: its text, checked as its table's row was
        uri = text_from_shard_line(uri, *text)
    return Input(uri, input_id)


@contextlib.contextmanager
def unreadable_is_poison(what: str) -> Iterator[None]:
    """What makes a listing (`what`: "<kind> <uri>") unusable for good, as poison."""
    try:
        yield
    except MissingObject as missing:
        raise PoisonMessage(f"{what} does not exist") from missing
    except AccessDenied as denied:
        raise PoisonMessage(f"{what} cannot be read: {denied}") from denied
    except ObjectTooLarge as too_large:
        raise PoisonMessage(f"{what} is {too_large}") from too_large
    except pa.ArrowException as error:  # a file it cannot parse (a local disk's error is not)
        raise PoisonMessage(f"{what} is not a table this worker reads: {error}") from error
