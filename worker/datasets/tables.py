"""Parquet results (a job's `"format": "parquet"`): the fields of its results.jsonl
lines as typed columns, each array field a fixed-size list column (a row of shape
(4, 3) a list of 4 lists of 3), an item's error its `error` column, in files of about
`--parquet-file-bytes` with row groups of about `--parquet-row-group-bytes`.

    output/results/part-000000-<file>.parquet

`<file>` counts the job's files, whether it ran whole or as shards: a sharded job's
shards' files are joined into the files a run alone writes as it is merged (`join`).
The names sort in input order, and job.json lists them in that order. (`000000` is
a shard's number: a version that kept each shard's files as they were named them
`part-<shard>-<file>`, names an output of that version may still hold.)

Every file of a job has the same columns, whatever its rows, so that they read as one
dataset: they are set by the model and the message, never by the values. The record's
own (index, input, the member where the inputs are tars, the id where the job's table
gives ids, model, error), then the postprocessor's fields with the types of its answer
to the model's output for zeros, probed at start (`about["fields"]`). A field whose
answer holds a null (None, an empty list) has no type to take from it: it is written
as JSON text. Results that do not fit these columns (a field the probe did not give, an
integer field holding 0.5) are the model's fault, found only at the finish:
`UnfitResults`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import re
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import structlog

from worker.datasets.pyarrow_support import check_pyarrow
from worker.plugins.fields import ArrayLayouts
from worker.ports import BlobStore, S3Location

log = structlog.get_logger()

PARQUET = "parquet"
JSON_LINES = "jsonl"
PARQUET_CONTENT_TYPE = "application/vnd.apache.parquet"
NDJSON = "application/x-ndjson"  # results.jsonl's and job.log's content type
RESULTS_DIR = "results/"
# An array field's value in a results line: which file, which row (`worker.datasets.arrays`).
ARRAY_REFERENCE = pa.struct([("array", pa.string()), ("row", pa.int64())])
ERROR_TYPE = pa.struct([("type", pa.string()), ("message", pa.string())])
RECORD_SCHEMA = pa.schema(
    [("index", pa.int64()), ("input", pa.string()), ("model", pa.string()), ("error", ERROR_TYPE)]
)
# A job's ids, from its table, are text whatever their column's type (`worker.datasets.inputs`).
ID_FIELD = pa.field("id", pa.string())
MEMBER_FIELD = pa.field("member", pa.string())  # a tar's (`worker.datasets.tars`)
# A Parquet file starts with the magic and ends with its footer, the footer's length
# (4 bytes, little-endian) and the magic again.
PARQUET_MAGIC = b"PAR1"
PARQUET_FOOTER_END = 8
# A footer is a few KiB a column for each row group: one claiming more is no results file's.
MAX_FOOTER_BYTES = 64 * 2**20
# How much of a Parquet file's end is read for its footer at first: a footer is a few
# KiB a column (its statistics and offsets) for each row group.
FOOTER_GUESS_BYTES = 64 * 2**10
# Every integer of at most this size is a float64 exactly (its 53 bits of mantissa).
FLOAT_INTEGERS = 2**53
# pyarrow's JSON reader parses this much at a time, on its threads.
JSON_BLOCK_BYTES = 16 * 2**20
# An output before job.json: its name, its content (or the local file of it), its type.
Output = tuple[str, bytes | Path, str]


TABLE_NAME = re.compile(rf"{RESULTS_DIR}part-[0-9]{{6}}-[0-9]{{4}}\.{PARQUET}")
# A job's files are numbered in four digits (`table_name`), so that their names sort in
# input order: it has at most this many, the last holding whatever rows are left.
MAX_RESULTS_FILES = 10_000
# A join cuts its files so that they come to about this many at most: its shards' bytes
# reckon its files' only about (another compression of the same rows), and the rest of
# `MAX_RESULTS_FILES` is the margin that keeps the last from having to take the rest.
JOINED_FILES = 9_000


def table_name(shard: int, file: int) -> str:
    """A Parquet results file's name under the job's output: its number has four
    digits, so that the names sort in input order (`Tables` makes no file past
    `MAX_RESULTS_FILES`)."""
    if not 0 <= file < MAX_RESULTS_FILES:
        raise ValueError(f"results file {file} is past the {MAX_RESULTS_FILES} a job has")
    return f"{RESULTS_DIR}part-{shard:06d}-{file:04d}.{PARQUET}"


class UnfitResults(Exception):
    """A job's results do not fit the columns its model's probe set: retrying cannot
    help, the postprocessor has to change."""


def stale_tables(listed: Iterable[str], written: Iterable[str]) -> list[str]:
    """The results files an earlier run left (it wrote more of them) that a job.json
    naming `written` does not complete: files of the names a run writes alone, never
    another's object beside them (a downstream tool's `_SUCCESS`, another job's output
    under `results/`)."""
    kept = set(written)
    return [name for name in listed if TABLE_NAME.fullmatch(name) and name not in kept]


class Tables:
    """Writes a job's results as Parquet files, with the columns its model's probe gave."""

    def __init__(self, file_bytes: int, row_group_bytes: int):
        check_pyarrow()  # `CannotStart` on one that loses a failed item's null array row
        self._file_bytes = file_bytes
        self._row_group_bytes = row_group_bytes
        self._fields = pa.schema([])
        self._text_fields: frozenset[str] = frozenset()
        self._layouts: ArrayLayouts = {}

    @property
    def cut(self) -> tuple[int, int]:
        """Where it cuts files and row groups: (file bytes, row group bytes)."""
        return (self._file_bytes, self._row_group_bytes)

    def cut_at(self, cut: tuple[int, int]) -> Tables:
        """The same writer, cutting at `cut` (`cut`'s form)."""
        if cut == self.cut:
            return self
        other = copy.copy(self)
        other._file_bytes, other._row_group_bytes = cut
        return other

    def joined_file_bytes(self, sources_bytes: int) -> int:
        """The bytes a join of shards' files of `sources_bytes` in all cuts its files
        at: `--parquet-file-bytes`, or for a job of more than `JOINED_FILES` such files,
        its bytes over `JOINED_FILES`: a huge job gets fewer, larger files, whatever
        the merging worker's setting, never more than its names sort for."""
        return max(self._file_bytes, -(-sources_bytes // JOINED_FILES))

    def largest_file_bytes(self, file_bytes: int) -> int:
        """About the most a file cut at `file_bytes` takes: it is closed once it holds
        them, after the row group that took it there."""
        return file_bytes + self._row_group_bytes

    def probed(self, fields: bytes | None, layouts: ArrayLayouts | None) -> None:
        """Take the columns from the postprocessor's answer to zeros: its fields as a
        JSON object, its arrays' layouts (None where there is no such probe: a chain's
        postprocessor runs on the regrouper's side)."""
        self._layouts = dict(layouts or {})
        probe = pa_json.read_json(io.BytesIO(fields)).schema if fields else pa.schema([])
        self._text_fields = frozenset(column.name for column in probe if holds_null(column.type))
        self._fields = pa.schema(
            [
                pa.field(column.name, pa.string()) if column.name in self._text_fields else column
                for column in probe
            ]
        )

    def write(
        self,
        lines: bytes,
        arrays: dict[str, Path],
        directory: Path,
        *,
        ids: bool,
        members: bool = False,
    ) -> list[Path]:
        """The job's results (its results.jsonl lines) as Parquet files in `directory`,
        in order; `arrays` are its array files by name (`<field>.npy`); with `ids`, the
        lines carry an id each, with `members` a tar's member each. `UnfitResults` if
        they do not fit the probed columns."""
        sources = self._array_sources(arrays)
        table = self._table(lines, sources, ids, members)
        row_bytes = max(1, math.ceil(_row_bytes(table, sources) or 1))
        rows_per_group = max(1, self._row_group_bytes // row_bytes)
        schema = _output_schema(table.schema, sources)
        with contextlib.closing(_Files(directory, schema, self._file_bytes)) as files:
            for start in range(0, max(table.num_rows, 1), rows_per_group):
                files.write(_with_arrays(table.slice(start, rows_per_group), sources).cast(schema))
        return files.paths

    def join(
        self,
        sources: Iterable[Path],
        schema: pa.Schema,
        directory: Path,
        beat: Callable[[], None],
        file_bytes: int | None = None,
    ) -> Generator[Path]:
        """The Parquet files `sources` (a sharded job's, in order) joined into files of
        `schema` (`joined_schema`) in `directory`, as `write` cuts them, at `file_bytes`
        (`joined_file_bytes`: larger for a job too large for `--parquet-file-bytes`, the
        default): each yielded
        once it is written, the last once `sources` are spent (none if there are no
        `sources`). Read a row group at a time and written again in row groups of
        `--parquet-row-group-bytes` of their decoded columns (a shard's small ones
        together, a larger one cut, the rest carried to the next), so that a job's
        results are the files a run of it alone would write, never with a whole file in
        memory: about two row groups at most, the one read and the rows before it not
        yet written. `beat` is called as each row group is read (a join of tens of GB
        takes minutes). `UnfitResults` if a row group's values do not fit `schema`."""
        files: _Files | None = None
        pending = schema.empty_table()  # rows read, not yet written
        try:
            for source in sources:
                with pq.ParquetFile(source) as parquet:
                    if files is None:
                        files = _Files(directory, schema, file_bytes or self._file_bytes)
                    for group in range(parquet.num_row_groups):
                        rows = _conformed(parquet.read_row_group(group), schema)
                        beat()
                        pending = pa.concat_tables([pending, rows])
                        while (full := self._full_group_rows(pending)) is not None:
                            yield from files.write(pending.slice(0, full))
                            pending = pending.slice(full)
            if files is None:
                return
            if pending.num_rows or not files.paths:  # an empty job's one file
                yield from files.write(pending)
            yield from files.close()
        finally:
            if files is not None:
                with contextlib.suppress(OSError, pa.ArrowException):  # the error is the join's
                    files.close()

    def _full_group_rows(self, rows: pa.Table) -> int | None:
        """How many of `rows` (as held, decoded: a footer's sizes are encoded, many times
        smaller for repetitive columns) make a row group of `--parquet-row-group-bytes`;
        None while they are fewer."""
        if not rows.num_rows or rows.nbytes < self._row_group_bytes:
            return None
        return max(1, int(self._row_group_bytes * rows.num_rows // rows.nbytes))

    def _array_sources(self, arrays: dict[str, Path]) -> dict[str, np.ndarray]:
        """Each array field's rows by its name, memory-mapped from its file; a field
        the probe gave that no item wrote, one row of zeros of its layout."""
        sources = {
            name: np.zeros((1, *shape), dtype) for name, (dtype, shape) in self._layouts.items()
        }
        for name, path in arrays.items():
            sources[name.removesuffix(".npy")] = np.load(path, mmap_mode="r")
        return dict(sorted(sources.items()))

    def _table(
        self, lines: bytes, sources: dict[str, np.ndarray], ids: bool, members: bool
    ) -> pa.Table:
        """The lines as a table of the record's columns, the probed fields' and an array
        reference for each array field, in that order, typed so."""
        record = list(RECORD_SCHEMA)
        record[2:2] = [*([MEMBER_FIELD] if members else []), *([ID_FIELD] if ids else [])]
        schema = pa.schema([*record, *self._fields, *((name, ARRAY_REFERENCE) for name in sources)])
        if not lines:
            return schema.empty_table()
        if self._text_fields:
            lines = _with_text(lines, self._text_fields)
        try:
            table = pa_json.read_json(
                io.BytesIO(lines),
                read_options=pa_json.ReadOptions(block_size=JSON_BLOCK_BYTES),
                parse_options=pa_json.ParseOptions(
                    explicit_schema=schema, unexpected_field_behavior="infer"
                ),
            )
        except pa.ArrowInvalid as error:
            raise UnfitResults(
                f"the results do not fit the columns the model's answer to zeros typed "
                f"({_described(self._fields)}): {error}"
            ) from error
        unprobed = table.schema.names[len(schema) :]
        widened = [
            f"{field.name}: {table.schema.field(field.name).type}, not {field.type}"
            for field in schema
            if table.schema.field(field.name).type != field.type
        ]
        if widened:  # a struct the probe gave, with keys it did not
            raise UnfitResults(
                f"the results do not fit the columns the model's answer to zeros typed: "
                f"{'; '.join(widened)}"
            )
        if unprobed:
            raise UnfitResults(
                f"the postprocessor gave {', '.join(unprobed)}, which its answer to the "
                "model's output for zeros did not: a Parquet job's columns are set at "
                "start, so every answer has to give every field (None where it has no value)"
            )
        return table


def footer_bytes(tail: bytes, size: int) -> int:
    """How many bytes at the end of a Parquet file of `size` bytes its footer takes (with
    its length and the closing magic), from the file's last 8 or more (`tail`).
    `UnfitResults` if it is no Parquet file's end, or claims more than the file or
    `MAX_FOOTER_BYTES`."""
    end = tail[-PARQUET_FOOTER_END:]
    if len(end) < PARQUET_FOOTER_END or end[-len(PARQUET_MAGIC) :] != PARQUET_MAGIC:
        raise UnfitResults("it does not end as a Parquet file does")
    footer = int.from_bytes(end[: -len(PARQUET_MAGIC)], "little") + PARQUET_FOOTER_END
    if footer > min(size - len(PARQUET_MAGIC), MAX_FOOTER_BYTES):
        raise UnfitResults(f"its footer claims {footer} bytes, of a file of {size}")
    return footer


def read_footer(
    blobs: BlobStore, location: S3Location, size: int, etag: str | None = None
) -> pq.FileMetaData:
    """The columns and row groups of the Parquet file at `location` (of `size` bytes),
    from its footer: its end, read by a ranged GET (two where the footer is over
    `FOOTER_GUESS_BYTES`), on condition that it has `etag`, if given. `UnfitResults` if
    it has none."""
    tail_bytes = min(size, FOOTER_GUESS_BYTES)
    tail = blobs.get(location, byte_range=(size - tail_bytes, tail_bytes), expect=etag)
    footer = footer_bytes(tail, size)
    if footer > len(tail):
        tail = blobs.get(location, footer, byte_range=(size - footer, footer), expect=etag)
    return footer_metadata(tail[-footer:])


def footer_metadata(footer: bytes) -> pq.FileMetaData:
    """The columns and row groups a Parquet file's footer (`footer_bytes` of its end)
    gives. `UnfitResults` if it is none."""
    try:
        metadata = pq.read_metadata(pa.BufferReader(PARQUET_MAGIC + footer))
        metadata.schema.to_arrow_schema()  # its columns as Arrow's: read here, or never
    except pa.ArrowMemoryError:
        raise  # this machine's memory, no fault of the file's
    except (OSError, pa.ArrowException) as error:
        raise UnfitResults(f"its footer cannot be read: {error}") from error
    return metadata


def joined_schema(footers: list[pq.FileMetaData]) -> pa.Schema:
    """The columns a sharded job's files (their `footers`, in order) join into: one
    shard's run may have given its fields other types (or more of them) than another's,
    its postprocessor mended between them (a shard dead-lettered and redriven). Only
    what joins without losing or failing a value is joined: a field some lack, or hold
    only nulls of, is null there; integers among floats are floats where every row
    group's statistics show them within +-2^53 (a float holds every integer there).
    `UnfitResults`, naming the column, for anything else (text in one file, numbers in
    another; arrays of other shapes; integers the statistics do not bound)."""
    fields: dict[str, list[tuple[pa.DataType, pq.FileMetaData]]] = {}
    for footer in footers:
        for field in footer.schema.to_arrow_schema():
            fields.setdefault(field.name, []).append((field.type, footer))
    return pa.schema([pa.field(name, _joined_type(name, typed)) for name, typed in fields.items()])


def _joined_type(name: str, typed: list[tuple[pa.DataType, pq.FileMetaData]]) -> pa.DataType:
    types = {data_type for data_type, _ in typed if not pa.types.is_null(data_type)}
    if len(types) <= 1:
        return types.pop() if types else pa.null()
    if all(_is_list(data_type) for data_type in types):
        raise UnfitResults(
            f"the shards' results files cannot be joined: column {name!r}: shards gave arrays "
            f"of different shapes ({', '.join(sorted(map(str, types)))})"
        )
    integers = {data_type for data_type in types if pa.types.is_integer(data_type)}
    if types - integers != {pa.float64()}:
        raise UnfitResults(
            f"the shards' results files cannot be joined: column {name!r} has types "
            f"{', '.join(sorted(map(str, types)))}"
        )
    for data_type, footer in typed:
        if data_type in integers and not _within_float_integers(footer, name):
            raise UnfitResults(
                f"the shards' results files cannot be joined: column {name!r} holds "
                f"integers in one file and floats in another, and the integers' statistics "
                f"do not show them all within +-2^53, where a float holds every integer"
            )
    return pa.float64()


def _is_list(data_type: pa.DataType) -> bool:
    return any(
        is_kind(data_type)
        for is_kind in (pa.types.is_list, pa.types.is_fixed_size_list, pa.types.is_large_list)
    )


def _within_float_integers(footer: pq.FileMetaData, name: str) -> bool:
    """Whether every row group's statistics of column `name` bound its values within
    +-`FLOAT_INTEGERS` (a group of nulls only has none, and holds no value to lose)."""
    [column] = [i for i in range(footer.num_columns) if footer.schema.column(i).path == name]
    for group in range(footer.num_row_groups):
        if not footer.row_group(group).num_rows:
            continue  # an empty shard's one row group: no statistics, no value to lose
        chunk = footer.row_group(group).column(column)
        statistics = chunk.statistics
        if statistics is not None and statistics.has_min_max:
            if max(abs(statistics.min), abs(statistics.max)) > FLOAT_INTEGERS:
                return False
        elif statistics is None or statistics.null_count != chunk.num_values:
            return False
    return True


def _conformed(group: pa.Table, schema: pa.Schema) -> pa.Table:
    """`group` with `schema`'s columns: each cast to its type, null where it has none.
    `UnfitResults` if a value does not fit its column's type."""
    if group.schema == schema:
        return group
    names = set(group.column_names)
    return pa.Table.from_arrays(
        [
            _cast(group.column(field.name), field)
            if field.name in names
            else pa.nulls(group.num_rows, field.type)
            for field in schema
        ],
        schema=schema,
    )


def _cast(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    try:
        return column.cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise UnfitResults(
            f"the shards' results files cannot be joined: column {field.name!r}: {error}"
        ) from error


class _Files:
    """Row groups written into Parquet files of about `file_bytes` each, in
    `directory`, named by their number in order; a file is closed once it reaches its
    size (or at the end), and its path given then. The `MAX_RESULTS_FILES`th is never
    closed early: it holds whatever rows are left (logged as it passes its size), where
    a file past it would have a name that sorts out of order. Only a tiny
    `--parquet-file-bytes` for a run's results comes to that (a join cuts larger files
    for a larger job: `Tables.joined_file_bytes`): the worker's setting, not the job's
    fault."""

    def __init__(self, directory: Path, schema: pa.Schema, file_bytes: int):
        directory.mkdir(parents=True, exist_ok=True)
        self._directory = directory
        self.schema = schema
        self._file_bytes = file_bytes
        self.paths: list[Path] = []
        self._sink: pa.OSFile | None = None
        self._writer: pq.ParquetWriter | None = None
        self._overfull = False  # the last file passed its size: logged once

    def write(self, group: pa.Table) -> list[Path]:
        """Write a row group; the file it filled, if it did."""
        if self._writer is None:
            self.paths.append(self._directory / f"{len(self.paths):04d}.{PARQUET}")
            self._sink = pa.OSFile(str(self.paths[-1]), "wb")
            self._writer = pq.ParquetWriter(self._sink, self.schema, compression="zstd")
        self._writer.write_table(group)
        assert self._sink is not None
        if self._sink.tell() < self._file_bytes:
            return []
        if len(self.paths) < MAX_RESULTS_FILES:
            return self.close()
        if not self._overfull:
            self._overfull = True
            log.warning(
                "results_file_holds_the_rest",
                file=len(self.paths) - 1,
                file_bytes=self._file_bytes,
                reason=f"a job's results are at most {MAX_RESULTS_FILES} files, so that their "
                "names sort in input order: the last holds the rows left past its size",
            )
        return []

    def close(self) -> list[Path]:
        """Close the file being written; it, if there was one."""
        if self._writer is None:
            return []
        try:
            self._writer.close()
        finally:
            assert self._sink is not None
            self._sink.close()
            self._writer = self._sink = None
        return self.paths[-1:]


def holds_null(data_type: pa.DataType) -> bool:
    """Whether a type read from JSON is partly unknown: a null, an empty list."""
    if pa.types.is_null(data_type):
        return True
    return any(holds_null(data_type.field(i).type) for i in range(data_type.num_fields))


def _with_text(lines: bytes, names: frozenset[str]) -> bytes:
    """`lines` with the values of the fields `names` as JSON text."""
    rewritten = []
    for line in lines.splitlines():
        record = orjson.loads(line)
        for name in names & record.keys():
            if record[name] is not None:
                record[name] = orjson.dumps(record[name]).decode()
        rewritten.append(orjson.dumps(record))
    return b"\n".join(rewritten) + b"\n"


def _described(fields: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in fields) or "none"


def _output_schema(schema: pa.Schema, sources: dict[str, np.ndarray]) -> pa.Schema:
    """`schema` with each array reference's column typed as its rows."""
    types = {name: _list_type(rows.dtype, rows.shape[1:]) for name, rows in sources.items()}
    return pa.schema([pa.field(f.name, types[f.name]) if f.name in types else f for f in schema])


def _with_arrays(group: pa.Table, sources: dict[str, np.ndarray]) -> pa.Table:
    """`group` with each array reference replaced by the row it refers to (null for an
    item that has none: it failed)."""
    for name, source in sources.items():
        rows = pc.struct_field(group.column(name).combine_chunks(), "row")
        values = source[rows.fill_null(0).to_numpy()]
        position = group.schema.get_field_index(name)
        group = group.set_column(position, name, _fixed_lists(values, rows.is_null()))
    return group


def _list_type(dtype: np.dtype[Any], shape: tuple[int, ...]) -> pa.DataType:
    value_type = pa.from_numpy_dtype(dtype)
    for size in reversed(shape):
        value_type = pa.list_(value_type, size)
    return value_type


def _fixed_lists(values: np.ndarray, missing: pa.Array) -> pa.Array:
    """Rows of `values` (n, *shape) as nested fixed-size lists, null where `missing`."""
    column: pa.Array = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[2:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    return pa.FixedSizeListArray.from_arrays(column, values.shape[1], mask=missing)


def _row_bytes(table: pa.Table, sources: dict[str, np.ndarray]) -> float:
    """About how many bytes a row of the results takes, its arrays included."""
    per_row: float = table.nbytes / max(table.num_rows, 1)
    for rows in sources.values():
        per_row += rows.dtype.itemsize * math.prod(rows.shape[1:])
    return per_row
