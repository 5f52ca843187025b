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
from worker.datasets.disk import DiskBudget
from worker.datasets.inputs import Input, InputReader, shard_lines
from worker.jobs.checkpoints import RequestDigest
from worker.message import JobMessage, PoisonMessage, parse_job_message
from worker.ports import S3Location
from worker.sharding.planning import Snapshot

NO_LIMIT: frozenset[str] = frozenset()
TEXT_CHARS = 60_000  # each text: a table's row group of three is 180 KB, its footer < 2 KB
FOOTER_READ_BYTES = 64 * 1024 + 4096  # the end of a file read for its footer, at most
FILES = {"a.parquet": (10, 3), "b.parquet": (7, 4)}  # rows, rows a row group


class _CountingStore(InMemoryBlobStore):
    """A store that counts the bytes read of each object, whole or by ranges; a.parquet
    is rewritten (its rows, other texts) once `replace_after` ranges of it are read."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read: Counter[str] = Counter()
        self.whole_reads: Counter[str] = Counter()
        self.replace_after = 0

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        data = super().get(location, *args, **kwargs)
        self.bytes_read[str(location)] += len(data)
        if self.replace_after and location.key == "table/a.parquet":
            self.replace_after -= 1
            if not self.replace_after:
                rewritten = pq.read_table(io.BytesIO(self.objects[str(location)]))
                body = pa.array([f"other {row}" for row in range(rewritten.num_rows)])
                sink = io.BytesIO()
                pq.write_table(rewritten.set_column(1, "body", body), sink, row_group_size=3)
                self.objects[str(location)] = sink.getvalue()
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


def _spec(shard_items: int | None = None) -> JobMessage:
    table = {"uri": "s3://bkt/table/", "text_column": "body", "id_column": "doc"}
    body = {"job_id": "texts", "table": table, "output": "s3://bkt/out/"}
    sizes = {"shard_items": shard_items} if shard_items else {}
    return parse_job_message(json.dumps(body | sizes), NO_LIMIT)


def _planned(blobs: InMemoryBlobStore, shard_items: int, tmp_path: Path) -> list[bytes]:
    """The inputs files a planner writes for the table in shards of `shard_items`: its
    listing through a snapshot, cut into shards."""
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    with Snapshot(tmp_path, DiskBudget(2**30).claim()) as snapshot:
        for listed in reader.inputs(_spec(shard_items)):
            snapshot.add(listed)
        inputs = snapshot.inputs()
        shards = iter(lambda: list(itertools.islice(inputs, shard_items)), [])
        return [b"".join(shard_lines(listed)) for listed in shards]


def _shard(blobs: InMemoryBlobStore, data: bytes, shard_items: int) -> list[Input]:
    blobs.objects["s3://bkt/out/shard.inputs"] = data
    return InputReader(blobs, NO_LIMIT, 2**30).shard("s3://bkt/out/shard.inputs", shard_items)


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
    """A file replaced since its job was planned, even by one with the same rows, is
    never read as that plan's: the shard is poison naming the file (its job fails
    there); and the listing of the new version is another request."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    before = _digest(blobs)
    sink = io.BytesIO()
    texts = [f"new {row}" for row in range(10)]
    pq.write_table(pa.table({"doc": list(range(10)), "body": texts}), sink)
    blobs.objects["s3://bkt/table/a.parquet"] = sink.getvalue()

    with pytest.raises(PoisonMessage, match=r"table s3://bkt/table/a\.parquet was replaced"):
        _shard(blobs, files[0], 4)
    assert len(_shard(blobs, files[3], 4)) == 4  # b's rows: b is as planned
    assert _digest(blobs) != before


@pytest.mark.parametrize("reads", [1, 3, 5])  # a shard of two row groups reads 5 ranges
def test_a_table_replaced_while_a_shard_reads_it_is_poison(tmp_path: Path, reads: int) -> None:
    """A file replaced while a shard reads its rows (after its footer, or after some of
    its row groups): the shard's look at its ETag, as a read fails or once they are all
    read, finds it before any of them runs."""
    blobs = _CountingStore()
    _table_files(blobs)
    files = _planned(blobs, 4, tmp_path)
    blobs.replace_after = reads
    with pytest.raises(PoisonMessage, match=r"a\.parquet was replaced since its job was planned"):
        _shard(blobs, files[1], 4)


def _digest(blobs: InMemoryBlobStore) -> str:
    digest = RequestDigest()
    reader = InputReader(blobs, NO_LIMIT, 2**30, shard_items=1000)
    listed: Iterator[Input] = reader.inputs(_spec(4))
    for uri, input_id in listed:
        digest.add(uri, input_id)
    return digest.hexdigest({}, {}, "jsonl")
