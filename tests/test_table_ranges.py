"""A Parquet table of texts over the shard size is planned as row ranges
(`worker.datasets.table_ranges`): planning reads the files' footers alone, the shards'
inputs files name spans of rows and hold no text, and each shard reads only its rows,
from the version of the table its plan saw."""

from __future__ import annotations

import io
import itertools
import json
import random
import string
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker.adapters.fakes import InMemoryBlobStore
from worker.datasets import table_ranges
from worker.datasets.disk import DiskBudget
from worker.datasets.inputs import Input, InputReader, shard_lines
from worker.errors import TransientError
from worker.jobs import checkpoints
from worker.jobs.checkpoints import RequestDigest
from worker.message import JobMessage, PoisonMessage, parse_job_message
from worker.ports import S3Location
from worker.sharding.planning import Snapshot, shards_of

NO_LIMIT: frozenset[str] = frozenset()
TEXT_CHARS = 60_000  # each text: a table's row group of three is 180 KB, its footer < 2 KB
FOOTER_READ_BYTES = 64 * 1024 + 4096  # the end of a file read for its footer, at most
FILES = {"a.parquet": (10, 3), "b.parquet": (7, 4)}  # rows, rows a row group
A_URI = "s3://bkt/table/a.parquet"


class _CountingStore(InMemoryBlobStore):
    """A store that counts the bytes read of each object, whole or by ranges, and the
    largest read; a.parquet is rewritten (its rows, other texts) once `replace_after`
    ranges of it are read (`replace_a_after`), and put back as it was once one more is
    asked for, if `put_back` holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read: Counter[str] = Counter()
        self.whole_reads: Counter[str] = Counter()
        self.ranges: list[tuple[int, int]] = []
        self.replace_after = 0
        self.replacement = b""
        self.put_back = b""

    def replace_a_after(self, reads: int, put_back: bool = False) -> None:
        # Made here, not in `get`: a shard's reads are called from pyarrow's own.
        rewritten = pq.read_table(io.BytesIO(self.objects[A_URI]))
        body = pa.array([f"other {row}" for row in range(rewritten.num_rows)])
        sink = io.BytesIO()
        pq.write_table(rewritten.set_column(1, "body", body), sink, row_group_size=3)
        self.replacement, self.replace_after = sink.getvalue(), reads
        self.put_back = self.objects[A_URI] if put_back else b""

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        try:
            data = super().get(location, *args, **kwargs)
        finally:
            if str(location) == A_URI and self.put_back and self.objects[A_URI] is self.replacement:
                self.objects[A_URI], self.put_back = self.put_back, b""
        self.bytes_read[str(location)] += len(data)
        if kwargs.get("byte_range"):
            self.ranges.append(kwargs["byte_range"])
        if self.replace_after and str(location) == A_URI:
            self.replace_after -= 1
            if not self.replace_after:
                self.objects[A_URI] = self.replacement
        return data

    def chunks(self, location: S3Location, *args: Any, **kwargs: Any) -> Generator[bytes]:
        self.whole_reads[str(location)] += 1
        return super().chunks(location, *args, **kwargs)


def _text(file: str, row: int) -> str:
    """A text that does not compress: a footer's size is then far below its file's."""
    drawn = random.Random(f"{file}{row}").choices(string.ascii_letters, k=TEXT_CHARS)
    return f"{file} row {row} " + "".join(drawn)


def _table_files(blobs: InMemoryBlobStore) -> None:
    for file, (rows, group_rows) in FILES.items():
        texts = [_text(file, row) for row in range(rows)]
        ids = [1000 * (1 + list(FILES).index(file)) + row for row in range(rows)]
        sink = io.BytesIO()
        pq.write_table(pa.table({"doc": ids, "body": texts}), sink, row_group_size=group_rows)
        blobs.objects[f"s3://bkt/table/{file}"] = sink.getvalue()


def _spec(shard_items: int | None = None, **table: Any) -> JobMessage:
    table = {"uri": "s3://bkt/table/", "text_column": "body", "id_column": "doc"} | table
    body = {"job_id": "texts", "table": table, "output": "s3://bkt/out/"}
    sizes = {"shard_items": shard_items} if shard_items else {}
    return parse_job_message(json.dumps(body | sizes), NO_LIMIT)


def _planned(
    blobs: InMemoryBlobStore, shard_items: int, tmp_path: Path, **table: Any
) -> list[bytes]:
    """The inputs files a planner writes for the table in shards of `shard_items`: its
    listing through a snapshot, cut into shards."""
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    with Snapshot(tmp_path, DiskBudget(2**30).claim()) as snapshot:
        for listed in reader.inputs(_spec(shard_items, **table)):
            snapshot.add(listed)
        shards = shards_of(snapshot.inputs(), shard_items)
        return [b"".join(shard_lines(listed)) for listed in shards]


def _shard(
    blobs: InMemoryBlobStore, data: bytes, shard_items: int, allowed: frozenset[str] = NO_LIMIT
) -> list[Input]:
    blobs.objects["s3://bkt/out/shard.inputs"] = data
    return InputReader(blobs, allowed, 2**30).shard("s3://bkt/out/shard.inputs", shard_items)


def test_a_tables_plan_holds_row_ranges_and_no_texts_read_from_its_footers_alone(
    tmp_path: Path,
) -> None:
    """Planning reads each file's end (its footer) and nothing before it; each shard's
    inputs file is a line a run of rows of one file: the file, its ETag, the rows."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)

    for file in FILES:
        uri = f"s3://bkt/table/{file}"
        assert blobs.whole_reads[uri] == 0
        assert blobs.bytes_read[uri] <= FOOTER_READ_BYTES < len(blobs.objects[uri]) / 3
    etags = {file: blobs.head(S3Location("bkt", f"table/{file}")).etag for file in FILES}
    spans = [[json.loads(line) for line in data.splitlines()] for data in files]
    assert [[(s["table"][-9:], s["etag"], s["rows"]) for s in shard] for shard in spans] == [
        [("a.parquet", etags["a.parquet"], [0, 4])],
        [("a.parquet", etags["a.parquet"], [4, 8])],
        [("a.parquet", etags["a.parquet"], [8, 10]), ("b.parquet", etags["b.parquet"], [0, 2])],
        [("b.parquet", etags["b.parquet"], [2, 6])],
        [("b.parquet", etags["b.parquet"], [6, 7])],
    ]
    assert all(len(data) < 1024 for data in files)


def test_each_shard_reads_exactly_its_rows_across_row_groups_and_files(tmp_path: Path) -> None:
    """Each shard's rows are the table's rows of its range, named and keyed as a read of
    the whole table names them, read by ranges: never a whole file."""
    blobs = _CountingStore()
    _table_files(blobs)
    whole = list(InputReader(blobs, NO_LIMIT, 2**30).inputs(_spec()))
    assert len(whole) == 17 and whole[12].uri == "s3://bkt/table/b.parquet#row=2"
    files = _planned(blobs, 4, tmp_path)
    blobs.bytes_read.clear()
    blobs.whole_reads.clear()

    read = [_shard(blobs, data, 4) for data in files]

    assert [len(rows) for rows in read] == [4, 4, 4, 4, 1]
    got = list(itertools.chain.from_iterable(read))
    assert [str(row.uri) for row in got] == [str(row.uri) for row in whole]
    assert [row.uri.text for row in got] == [row.uri.text for row in whole]  # type: ignore[attr-defined]
    assert [row.id for row in got] == [row.id for row in whole]
    assert got[10].id == "2000" and got[10].uri.text == _text("b.parquet", 0)  # type: ignore[attr-defined]
    for file in FILES:
        uri = f"s3://bkt/table/{file}"
        assert blobs.whole_reads[uri] == 0
    # Each row group is read by the shards whose ranges it overlaps (a's 3rd by two).
    size_a = len(blobs.objects["s3://bkt/table/a.parquet"])
    assert blobs.bytes_read["s3://bkt/table/a.parquet"] < 2 * size_a


def test_a_shard_reads_no_more_than_its_own_row_groups() -> None:
    """A shard of a few rows reads the row group holding them and the footer, not the
    rest of the file."""
    blobs = _CountingStore()
    _table_files(blobs)
    uri = "s3://bkt/table/a.parquet"
    etag = blobs.head(S3Location.parse(uri)).etag
    span = {"table": uri, "etag": etag, "rows": [4, 6], "text_column": "body", "id_column": None}
    rows = _shard(blobs, json.dumps(span).encode() + b"\n", 2)
    assert [(str(row.uri), row.id) for row in rows] == [
        (f"{uri}#row=4", None),
        (f"{uri}#row=5", None),
    ]
    assert blobs.bytes_read[uri] < len(blobs.objects[uri]) / 2


def test_a_table_replaced_after_planning_is_its_shards_poison_naming_it(tmp_path: Path) -> None:
    """A file replaced since its job was planned, even by one of the same rows and ids,
    is never read as that plan's: the shard is poison naming the file (its job fails
    there); and the listing of the new version, whose names and ids are the first's,
    is another request (its file's ETag is in the digest)."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    before = _digest(blobs)
    sink = io.BytesIO()
    texts = [f"new {row}" for row in range(10)]
    pq.write_table(pa.table({"doc": list(range(1000, 1010)), "body": texts}), sink)
    blobs.objects["s3://bkt/table/a.parquet"] = sink.getvalue()

    with pytest.raises(PoisonMessage, match=r"table s3://bkt/table/a\.parquet was replaced"):
        _shard(blobs, files[0], 4)
    assert len(_shard(blobs, files[3], 4)) == 4  # b's rows: b is as planned
    assert _digest(blobs) != before


@pytest.mark.parametrize("reads", [1, 3])  # a shard of two row groups reads 5 ranges
def test_a_table_replaced_while_a_shard_reads_it_is_poison(tmp_path: Path, reads: int) -> None:
    """A file replaced while a shard reads its rows (after its footer, or after some of
    its row groups): its next read is refused (If-Match the planned ETag), and the
    shard's look at the ETag then finds it replaced, before any row runs."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    blobs.replace_a_after(reads)
    with pytest.raises(PoisonMessage, match=r"a\.parquet was replaced since its job was planned"):
        _shard(blobs, files[1], 4)


def test_a_table_replaced_and_put_back_while_a_shard_reads_it_is_read_again(
    tmp_path: Path,
) -> None:
    """A file replaced after a shard's third read and put back as it was at its fourth
    (its ETag the planned one again): that read is refused, not answered from the other
    version, and the shard is tried again (a transient fault); its next try reads the
    planned rows. Its rows mixed the two versions, the other's texts among them."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    expected = [row.uri for row in _shard(blobs, files[1], 4)]
    blobs.replace_a_after(3, put_back=True)
    with pytest.raises(TransientError, match=r"a\.parquet changed while its rows were read"):
        _shard(blobs, files[1], 4)
    assert not blobs.put_back
    got = [row.uri for row in _shard(blobs, files[1], 4)]
    assert [(name, name.text) for name in got] == [(name, name.text) for name in expected]


def _digest(blobs: InMemoryBlobStore, **table: Any) -> str:
    digest = RequestDigest()
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    listed: Iterator[Input] = reader.inputs(_spec(4, **table))
    for uri, input_id in listed:
        digest.add(uri, input_id)
    return digest.hexdigest({}, {}, "jsonl")


def test_a_table_whose_keys_name_no_format_is_planned_and_read_as_its_format_says(
    tmp_path: Path,
) -> None:
    """A Hive table's parts (`000000_0`, no `.parquet`) given with `"format": "parquet"`
    are planned as row ranges, and each shard reads its rows whatever the file's key."""
    blobs = _CountingStore()
    _table_files(blobs)
    for number, file in enumerate(FILES):
        blobs.objects[f"s3://bkt/hive/{number:06d}_0"] = blobs.objects.pop(f"s3://bkt/table/{file}")
    hive = {"uri": "s3://bkt/hive/", "format": "parquet"}
    whole = list(InputReader(blobs, NO_LIMIT, 2**30).inputs(_spec(**hive)))

    files = _planned(blobs, 4, tmp_path, **hive)

    assert all(data.startswith(b'{"table": "s3://bkt/hive/') for data in files)
    got = [row for data in files for row in _shard(blobs, data, 4)]
    assert [(str(row.uri), row.id) for row in got] == [(str(row.uri), row.id) for row in whole]
    assert got[10] == Input("s3://bkt/hive/000001_0#row=0", "2000")


def test_the_request_digest_covers_the_columns_a_planned_table_is_read_by() -> None:
    """A planned row is listed with its file's ETag and the columns its shard reads: the
    job sent again with no id column, or with its columns the other way round, is
    another request, not the first one's results, which have other ids."""
    blobs = _CountingStore()
    _table_files(blobs)
    with_ids = _digest(blobs)
    assert _digest(blobs) == with_ids
    assert _digest(blobs, id_column=None) != with_ids
    assert _digest(blobs, text_column="doc", id_column="body") != with_ids


def test_a_shard_streams_its_rows_in_reads_of_a_bounded_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard's column chunks are streamed in ranged GETs of `PARQUET_READ_BYTES` at
    most (pages here smaller), never a chunk a GET, and no further than its last row:
    a row group of 2,000 texts (400 KB) is read 16 KiB at a time, a few reads for a
    shard of its rows 10-30."""
    monkeypatch.setattr(table_ranges, "PARQUET_READ_BYTES", 16 * 1024)
    blobs = _CountingStore()
    drawn = random.Random(2).choices(string.ascii_letters, k=2000 * 200)
    texts = ["".join(drawn[row * 200 : (row + 1) * 200]) for row in range(2000)]
    sink = io.BytesIO()
    table = pa.table({"body": texts})
    pq.write_table(table, sink, data_page_size=4096, write_batch_size=4, use_dictionary=False)
    uri = "s3://bkt/table/c.parquet"
    blobs.objects[uri] = sink.getvalue()
    etag = blobs.head(S3Location.parse(uri)).etag
    span = {"table": uri, "etag": etag, "rows": [10, 30], "text_column": "body", "id_column": None}

    rows = _shard(blobs, json.dumps(span).encode() + b"\n", 20)

    assert [row.uri.text for row in rows] == texts[10:30]  # type: ignore[attr-defined]
    size = len(blobs.objects[uri])
    data_reads = [length for first, length in blobs.ranges if first + length < size]
    assert data_reads and max(data_reads) <= 16 * 1024
    assert sum(data_reads) < size / 20


def test_a_prefix_of_many_files_lists_its_first_rows_after_the_footers_it_needs() -> None:
    """A planned prefix's footers are read file by file, each told (`looked_at`: its
    daemon's clock of progress beats): its first rows are listed once the footers read
    hold more rows than the shard size, before the other files' are read, a file's rows
    as one input."""
    blobs = _CountingStore()
    for number in range(6):
        sink = io.BytesIO()
        pq.write_table(pa.table({"doc": [1, 2, 3], "body": ["x", "y", "z"]}), sink)
        blobs.objects[f"s3://bkt/table/{number}.parquet"] = sink.getvalue()
    looked_at: list[int] = []
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    listed = reader.inputs(_spec(4), lambda: looked_at.append(len(blobs.bytes_read)))

    first = next(listed)

    etag = blobs.head(S3Location("bkt", "table/0.parquet")).etag
    span = table_ranges.Span("s3://bkt/table/0.parquet", etag, 0, 3, ("body", "doc"))
    assert isinstance(first.uri, table_ranges.TableRows) and first.uri.span == span
    assert looked_at == [1, 2] and len(blobs.bytes_read) == 2
    assert len(list(listed)) == 5
    assert looked_at == [1, 2, 3, 4, 5, 6]


def test_a_planned_tables_id_column_that_is_no_text_is_poison_at_planning() -> None:
    """An id column of a type no id is read as (a list) is found from the footers, and
    the job refused as a whole, as an unsharded run refuses it: not shard by shard."""
    blobs = _CountingStore()
    sink = io.BytesIO()
    pq.write_table(pa.table({"doc": [[row] for row in range(10)], "body": ["x"] * 10}), sink)
    blobs.objects["s3://bkt/table/a.parquet"] = sink.getvalue()
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    with pytest.raises(PoisonMessage, match=r"its id column doc \(list<.*cannot be read as text"):
        next(reader.inputs(_spec(4)))


class _StrictRangesStore(_CountingStore):
    """A store that answers a range starting past its object's end as S3 does (416
    InvalidRange, an error of its own), not with what is left."""

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        first, _ = kwargs.get("byte_range") or (0, 0)
        if first and first >= len(self.objects[str(location)]):
            raise RuntimeError("InvalidRange: the requested range is not satisfiable")
        return super().get(location, *args, **kwargs)


def test_a_table_shortened_while_a_shard_reads_it_is_poison_at_its_first_try(
    tmp_path: Path,
) -> None:
    """A read past the end of a file made shorter since its footer was read fails as
    the store fails it; the shard asks for the file's ETag then, whatever the error, and
    is poison at once, not retried until a later delivery's look finds it."""
    blobs = _StrictRangesStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    blobs.replace_a_after(1)  # after its footer: its row groups' offsets are past the end
    with pytest.raises(PoisonMessage, match=r"a\.parquet was replaced since its job was planned"):
        _shard(blobs, files[1], 4)


@pytest.mark.parametrize(
    ("spans", "reason"),
    [
        ([[4, 4]], r"line 1 is not a span: its rows \[4, 4\] are none"),
        ([[0, 2], [2, 4]], r"line 2 spans s3://bkt/table/a\.parquet a second time"),
        ([[0, 2, 3]], "line 1 is not a span"),
    ],
)
def test_a_shard_inputs_file_no_planner_writes_is_poison(
    spans: list[list[int]], reason: str
) -> None:
    """A span of no rows, or a file spanned twice in a shard (a planner writes a line a
    file a shard), each of which would cost a footer and a row group, is refused."""
    blobs = _CountingStore()
    _table_files(blobs)
    etag = blobs.head(S3Location.parse(A_URI)).etag
    columns = {"text_column": "body", "id_column": None}
    data = b"".join(
        json.dumps({"table": A_URI, "etag": etag, "rows": rows} | columns).encode() + b"\n"
        for rows in spans
    )
    with pytest.raises(PoisonMessage, match=reason):
        _shard(blobs, data, 4)


def test_a_span_of_a_bucket_outside_the_allow_list_is_poison_unread(tmp_path: Path) -> None:
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    blobs.bytes_read.clear()
    with pytest.raises(PoisonMessage, match=r"bucket\(s\) not allowed: bkt"):
        _shard(blobs, files[0], 4, frozenset({"other"}))
    assert blobs.bytes_read[A_URI] == 0


def test_a_mixed_prefix_copies_its_csv_rows_and_plans_its_parquet_rows_as_ranges(
    tmp_path: Path,
) -> None:
    """A prefix of CSV and Parquet files: the CSV rows' texts are copied into the
    inputs files (text lines beside span lines), the Parquet rows planned as ranges
    when they alone are over the shard size, copied too when they are not; either way
    each shard's rows are the whole table's."""
    blobs = _CountingStore()
    _table_files(blobs)
    blobs.objects["s3://bkt/table/ab.csv"] = b"doc,body\n1,one\n2,two\n3,three\n"
    whole = list(InputReader(blobs, NO_LIMIT, 2**30).inputs(_spec()))
    assert len(whole) == 20
    for shard_items, spans in ((6, 4), (18, 0)):  # 17 Parquet rows: over 6, not over 18
        files = _planned(blobs, shard_items, tmp_path)
        lines = b"".join(files).splitlines()
        assert sum(line.startswith(b'{"table"') for line in lines) == spans
        got = [row for data in files for row in _shard(blobs, data, shard_items)]
        assert [(str(row.uri), row.id) for row in got] == [(str(r.uri), r.id) for r in whole]
        assert [row.uri.text for row in got] == [r.uri.text for r in whole]  # type: ignore[attr-defined]


@pytest.mark.parametrize("id_column", ["doc", None])
def test_a_planned_tables_rows_digest_as_they_did_listed_one_by_one(
    monkeypatch: pytest.MonkeyPatch, id_column: str | None
) -> None:
    """Planning lists a file's rows as one input (`TableRows`) and digests them a chunk
    at a time, each chunk progress; the request's digest is the one the rows listed one
    by one give (`file#row=n` and the span's listed id, as planners listed each row
    before), whatever the file's name holds, so a request keeps its digest and its
    checkpoints."""
    monkeypatch.setattr(checkpoints, "DIGEST_ROWS", 3)
    name = 's3://bkt/t\u00e9 "x"#row=5\\.parquet'
    span = table_ranges.Span(name, '"e\u00f1"', 3, 11, ("b\u00f6dy", id_column))
    before, after = Input("s3://bkt/a.png"), Input("s3://bkt/b.png", "9")
    told: list[None] = []
    at_once, by_rows = RequestDigest(lambda: told.append(None)), RequestDigest()
    for listed in (before, Input(table_ranges.TableRows(span)), after):
        at_once.add(*listed)
    rows = [Input(f"{name}#row={row}", span.listed_id()) for row in span.range()]
    for listed in (before, *rows, after):
        by_rows.add(*listed)
    assert at_once.hexdigest({}, {}, "jsonl") == by_rows.hexdigest({}, {}, "jsonl")
    assert len(told) == 3  # 8 rows, 3 at a time


def test_a_run_of_rows_is_cut_where_each_shard_ends() -> None:
    """Shards of 4 from inputs, a run of 10 rows, and an input: every shard holds 4
    items, the run cut into spans that cover its rows once, in order."""
    span = table_ranges.Span(A_URI, "e", 0, 10, ("body", None))
    listed = [Input("s3://bkt/x"), Input(table_ranges.TableRows(span)), Input("s3://bkt/y")]
    cut = [[each.uri for each in shard] for shard in shards_of(listed, 4)]
    assert cut == [
        ["s3://bkt/x", f"{A_URI}#rows=0-2"],
        [f"{A_URI}#rows=3-6"],
        [f"{A_URI}#rows=7-9", "s3://bkt/y"],
    ]
