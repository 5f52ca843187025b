"""The kinds of input listing a message may name (`worker.datasets.inputs`), read from the
in-memory store: what each yields, in order, and what makes its message poison."""

from __future__ import annotations

import contextlib
import datetime
import gzip
import io
import json
import time
import tracemalloc
from collections.abc import Generator, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.hostile import gzipped_rows, megabyte_uri
from worker.adapters.fakes import FAKE_LIST_PAGE, InMemoryBlobStore
from worker.datasets.inputs import CSV_BLOCK_BYTES, MAX_ID_BYTES, Input, InputReader
from worker.message import PoisonMessage, parse_job_message
from worker.ports import S3_MAX_KEY_BYTES, S3Location

NO_LIMIT: frozenset[str] = frozenset()


def _read(
    blobs: InMemoryBlobStore, allowed: frozenset[str] = NO_LIMIT, **source: Any
) -> list[Input]:
    body = json.dumps({"output": "s3://out/job/", **source})
    spec = parse_job_message(body, allowed)
    return list(InputReader(blobs, allowed, 2**30).inputs(spec))


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=2)
    return sink.getvalue()


def test_a_prefix_is_listed_page_by_page_in_key_order_keeping_the_suffix_asked_for() -> None:
    blobs = InMemoryBlobStore()
    keys = [f"2026/{number:05d}.jpg" for number in range(FAKE_LIST_PAGE + 500)]
    for key in [*keys, "2026/notes.txt", "2026/sub/", "2025/00000.jpg"]:
        blobs.objects[f"s3://photos/{key}"] = b"x"
    listed = _read(blobs, inputs_prefix="s3://photos/2026/", inputs_suffix=".jpg")
    assert listed == [Input(f"s3://photos/{key}") for key in keys]
    with pytest.raises(PoisonMessage, match="lists no inputs"):
        _read(blobs, inputs_prefix="s3://photos/2027/")


@pytest.mark.parametrize("name", ["ids.csv", "ids.csv.gz", "IDS.CSV.GZ"])
def test_a_csv_table_gives_its_uri_column_and_its_ids_as_written(name: str) -> None:
    """Ids are read as text, as written ("007" stays "007"); other columns are ignored,
    a quoted line break in one too."""
    blobs = InMemoryBlobStore()
    text = b'photo_id,path,caption\n007,s3://photos/a.jpg,"two\nlines"\nx-2,s3://photos/b.jpg,\n'
    gzipped = name.lower().endswith(".gz")
    blobs.objects[f"s3://tables/{name}"] = gzip.compress(text) if gzipped else text
    table = {"uri": f"s3://tables/{name}", "uri_column": "path", "id_column": "photo_id"}
    assert _read(blobs, table=table) == [
        Input("s3://photos/a.jpg", "007"),
        Input("s3://photos/b.jpg", "x-2"),
    ]


def test_a_parquet_table_gives_its_rows_in_order_with_its_ids_as_text() -> None:
    """Whatever the id column's type (integers, timestamps), its ids come as the text
    Arrow writes them as, a null as None; a column that has no text (a struct) is
    refused with its type named."""
    blobs = InMemoryBlobStore()
    uris = [f"s3://photos/{number}.jpg" for number in range(5)]
    moments = [datetime.datetime(2026, 11, day) for day in range(1, 5)] + [None]
    blobs.objects["s3://tables/ids.parquet"] = _parquet(
        pa.table(
            {
                "uri": uris,
                "id": list(range(100, 105)),
                "taken": pa.array(moments, pa.timestamp("s")),
                "box": [{"x": number} for number in range(5)],
            }
        )
    )
    listed = _read(blobs, table={"uri": "s3://tables/ids.parquet", "id_column": "id"})
    assert listed == [Input(uri, str(100 + number)) for number, uri in enumerate(uris)]
    by_time = _read(blobs, table={"uri": "s3://tables/ids.parquet", "id_column": "taken"})
    assert [listed.id for listed in by_time] == [
        *(f"2026-11-0{day} 00:00:00.000" for day in range(1, 5)),
        None,
    ]
    no_ids = _read(blobs, table={"uri": "s3://tables/ids.parquet"})
    assert no_ids == [Input(uri) for uri in uris]
    with pytest.raises(PoisonMessage, match=r"id column box \(struct<x: int64>\) cannot be read"):
        _read(blobs, table={"uri": "s3://tables/ids.parquet", "id_column": "box"})


def test_an_s3_inventory_lists_the_current_objects_of_its_files_in_order() -> None:
    """A CSV inventory (gzipped, no header, keys URL-encoded) and a Parquet one: delete
    markers and older versions are skipped, and the suffix filter applies."""
    blobs = InMemoryBlobStore()
    rows = (
        b'"photos","a%20b.jpg","true","false"\n'
        b'"photos","old.jpg","false","false"\n'
        b'"photos","gone.jpg","true","true"\n'
        b'"photos","notes.txt","true","false"\n'
    )
    blobs.objects["s3://inv/photos/data/1.csv.gz"] = gzip.compress(rows)
    blobs.objects["s3://inv/photos/data/2.parquet"] = _parquet(
        pa.table({"bucket": ["photos"], "key": ["c+d.jpg"], "is_latest": [True]})
    )
    for number, (file_format, key) in enumerate(
        [("CSV", "photos/data/1.csv.gz"), ("Parquet", "photos/data/2.parquet")]
    ):
        manifest = {
            "sourceBucket": "photos",
            "destinationBucket": "arn:aws:s3:::inv",
            "fileFormat": file_format,
            "fileSchema": "Bucket, Key, IsLatest, IsDeleteMarker",
            "files": [{"key": key, "size": 1, "MD5checksum": "x"}],
        }
        blobs.objects[f"s3://inv/photos/{number}/manifest.json"] = json.dumps(manifest).encode()
    csv = _read(blobs, inventory="s3://inv/photos/0/manifest.json", inputs_suffix=".jpg")
    assert csv == [Input("s3://photos/a b.jpg")]
    parquet = _read(blobs, inventory="s3://inv/photos/1/manifest.json")
    assert parquet == [Input("s3://photos/c+d.jpg")]


@pytest.mark.parametrize(
    ("objects", "source", "reason"),
    [
        ({"s3://tbl/a.csv": b"path\ns3://pix/a\n"}, {"table": {"uri": "s3://tbl/a.csv"}}, "uri"),
        (
            {"s3://tbl/a.parquet": b"not parquet"},
            {"table": {"uri": "s3://tbl/a.parquet"}},
            "not a table",
        ),
        ({"s3://tbl/a.csv": b"uri\nnot-a-uri\n"}, {"table": {"uri": "s3://tbl/a.csv"}}, "row 1"),
        (
            {"s3://tbl/a.csv": b"uri\ns3://secret/a\n"},
            {"table": {"uri": "s3://tbl/a.csv"}},
            "secret",
        ),
        ({}, {"table": {"uri": "s3://tbl/missing.csv"}}, "does not exist"),
        (
            {"s3://tbl/a.csv.gz": b"uri\ns3://pix/a\n"},
            {"table": {"uri": "s3://tbl/a.csv.gz"}},
            "not gzip",
        ),
        (
            {"s3://tbl/a.csv.gz": gzip.compress(b"uri\n" + b"s3://pix/a\n" * 100)[:-30]},
            {"table": {"uri": "s3://tbl/a.csv.gz"}},
            "cut short",
        ),
        ({"s3://tbl/m.json": b"{}"}, {"inventory": "s3://tbl/m.json"}, "not an S3 Inventory"),
        (
            {
                "s3://tbl/m.json": b'{"fileFormat": "ORC", "destinationBucket": "tbl", '
                b'"fileSchema": "Bucket, Key", "files": []}'
            },
            {"inventory": "s3://tbl/m.json"},
            "only CSV and Parquet",
        ),
    ],
)
def test_a_listing_that_cannot_be_used_makes_its_message_poison_with_the_reason(
    objects: dict[str, bytes], source: dict[str, Any], reason: str
) -> None:
    blobs = InMemoryBlobStore()
    blobs.objects.update(objects)
    with pytest.raises(PoisonMessage, match=reason):
        _read(blobs, frozenset({"tbl", "pix", "out"}), **source)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ({"inputs": ["s3://pix/a"], "inputs_prefix": "s3://pix/"}, "exactly one of"),
        ({"inputs": ["s3://pix/a"], "inputs_suffix": ".jpg"}, "filters an 'inputs_prefix'"),
        ({"inputs_prefix": "s3://out/"}, "under the 'inputs_prefix'"),
        ({"inputs_prefix": "s3://out/job/"}, "under the 'inputs_prefix'"),
        ({"inputs_prefix": "s3://out/job/r"}, "under the 'inputs_prefix'"),  # results.jsonl
        ({"table": {"uri": "s3://pix/ids.tsv"}}, "ends .csv, .csv.gz or .parquet"),
        ({"table": {"uri": "s3://pix/ids.csv", "sheet": 1}}, "Extra inputs"),
        (
            {"table": {"uri": "s3://pix/t.jsonl", "text_column": "b", "id_column": "b"}},
            "another column than its 'text_column'",
        ),
    ],
)
def test_a_message_naming_its_inputs_wrongly_is_poison(source: dict[str, Any], reason: str) -> None:
    with pytest.raises(PoisonMessage, match=reason):
        parse_job_message(json.dumps({"output": "s3://out/job/", **source}), NO_LIMIT)


def test_a_shard_inputs_file_an_older_planner_wrote_still_reads() -> None:
    """Bare URIs (before ids), and numbers as ids (before ids were text) as the text
    they are now."""
    blobs = InMemoryBlobStore()
    blobs.objects["s3://out/job/shards/0.inputs"] = (
        b's3://pix/a\n["s3://pix/b", 7]\n["s3://pix/c", "x"]\n'
    )
    reader = InputReader(blobs, NO_LIMIT, 2**30)
    assert reader.shard("s3://out/job/shards/0.inputs", 10) == [
        Input("s3://pix/a"),
        Input("s3://pix/b", "7"),
        Input("s3://pix/c", "x"),
    ]


def test_a_shard_inputs_file_is_read_no_further_than_one_line_past_the_shard(
    traced: None,
) -> None:
    """A shard's inputs file under the job's output is anyone's who may write there: one
    of a million lines (or one endless line) is read a line past the shard's size, or
    to the line's bound, never whole."""
    blobs = InMemoryBlobStore()
    blobs.objects["s3://out/job/0.inputs"] = b'["s3://pix/a", null]\n' * 1_000_000
    blobs.objects["s3://out/job/1.inputs"] = b"s" * 10**7
    reader = InputReader(blobs, NO_LIMIT, 2**30)
    with _peak_bytes() as peak:
        assert len(reader.shard("s3://out/job/0.inputs", 10)) == 11
        with pytest.raises(PoisonMessage, match=r"shard inputs line 1 is over \d+ bytes"):
            reader.shard("s3://out/job/1.inputs", 10)
    assert peak[0] < 2**20, f"{peak[0] / 2**20:.0f} MiB"


MEGABYTE_URI = megabyte_uri("pix")  # as a table's cell may hold: about 1 KB gzipped
OVER_A_KEY = "k" * (S3_MAX_KEY_BYTES + 1)


def _manifest_of(*lines: str) -> bytes:
    return "".join(f"{line}\n" for line in lines).encode()


def _inventory(blobs: InMemoryBlobStore, rows: bytes) -> str:
    """An S3 Inventory report of one gzipped CSV file of `rows`; its manifest's URI."""
    blobs.objects["s3://tbl/inv/1.csv.gz"] = gzip.compress(rows)
    manifest = {
        "destinationBucket": "arn:aws:s3:::tbl",
        "fileFormat": "CSV",
        "fileSchema": "Bucket, Key",
        "files": [{"key": "inv/1.csv.gz"}],
    }
    blobs.objects["s3://tbl/inv/manifest.json"] = json.dumps(manifest).encode()
    return "s3://tbl/inv/manifest.json"


@pytest.mark.parametrize(
    ("key", "where"),
    [
        (OVER_A_KEY, "row 3"),
        ("é" * (S3_MAX_KEY_BYTES // 2 + 1), "row 3"),  # 513 characters, 1,026 bytes of UTF-8
        (MEGABYTE_URI.removeprefix("s3://pix/"), "row 3"),
    ],
    ids=["1025-bytes", "1026-bytes-of-utf8", "a-megabyte"],
)
def test_a_table_row_whose_key_is_over_s3s_limit_makes_the_message_poison_naming_row_and_limit(
    key: str, where: str
) -> None:
    """A CSV row, a Parquet row and an inventory row whose key is over 1,024 bytes of
    UTF-8 (S3's most) are refused at that row, with the limit named."""
    blobs = InMemoryBlobStore()
    uris = ["s3://pix/a", "s3://pix/b", f"s3://pix/{key}"]
    blobs.objects["s3://tbl/a.csv"] = _manifest_of("uri", *uris)
    blobs.objects["s3://tbl/a.parquet"] = _parquet(pa.table({"uri": uris}))
    inventory = _inventory(blobs, _manifest_of(*(f'"pix","{uri[9:]}"' for uri in uris)))
    for source in (
        {"table": {"uri": "s3://tbl/a.csv"}},
        {"table": {"uri": "s3://tbl/a.parquet"}},
        {"inventory": inventory},
    ):
        with pytest.raises(PoisonMessage, match=f"{where}[: ].*limit.* 1024 bytes") as refused:
            _read(blobs, **source)
        assert len(str(refused.value)) < 500  # the URI is not quoted whole


def test_a_manifest_line_or_shard_inputs_line_whose_key_is_over_s3s_limit_is_poison() -> None:
    blobs = InMemoryBlobStore()
    blobs.objects["s3://tbl/m.txt"] = _manifest_of("s3://pix/a", f"s3://pix/{OVER_A_KEY}")
    blobs.objects["s3://out/job/0.inputs"] = _manifest_of(
        '["s3://pix/a", null]', f'["s3://pix/{OVER_A_KEY}", null]'
    )
    with pytest.raises(PoisonMessage, match="manifest line 2: a key over S3's limit of 1024"):
        _read(blobs, manifest="s3://tbl/m.txt")
    with pytest.raises(PoisonMessage, match="line 2: a key over S3's limit of 1024"):
        InputReader(blobs, NO_LIMIT, 2**30).shard("s3://out/job/0.inputs", 10)


@pytest.mark.parametrize("field", ["inputs", "manifest", "output"])
def test_a_message_naming_a_key_over_s3s_limit_is_poison(field: str) -> None:
    """A key of 1,025 bytes in the message itself names no object S3 can hold."""
    body: dict[str, Any] = {"inputs": ["s3://pix/a"], "output": "s3://out/job/"}
    long_uri = f"s3://pix/{OVER_A_KEY}"
    if field == "manifest":
        body = {"manifest": long_uri, "output": "s3://out/job/"}
    else:
        body[field] = [long_uri] if field == "inputs" else long_uri
    with pytest.raises(PoisonMessage, match="S3's limit of 1024 bytes"):
        parse_job_message(json.dumps(body), NO_LIMIT)


def test_an_id_over_its_limit_makes_the_message_poison_naming_row_and_limit() -> None:
    """In a CSV, in a Parquet file (read as a dictionary there: measured before it is
    copied to each row), and in a shard's inputs file."""
    blobs = InMemoryBlobStore()
    long_id = "i" * (MAX_ID_BYTES + 1)
    blobs.objects["s3://tbl/a.csv"] = _manifest_of(
        "uri,id", "s3://pix/a,1", f"s3://pix/b,{long_id}"
    )
    ids = pa.DictionaryArray.from_arrays(pa.array([0, 1, 1], pa.int32()), ["1", long_id])
    table = pa.table({"uri": ["s3://pix/a"] * 3, "id": ids})
    blobs.objects["s3://tbl/a.parquet"] = _parquet(table)
    blobs.objects["s3://out/job/0.inputs"] = _manifest_of(f'["s3://pix/a", "{long_id}"]')
    for name in ("a.csv", "a.parquet"):
        with pytest.raises(PoisonMessage, match="row 2: its id is over the limit of 1024 bytes"):
            _read(blobs, table={"uri": f"s3://tbl/{name}", "id_column": "id"})
    with pytest.raises(PoisonMessage, match="line 1: its id is over the limit of 1024 bytes"):
        InputReader(blobs, NO_LIMIT, 2**30).shard("s3://out/job/0.inputs", 10)


_COUNTING_POOLS: list[pa.MemoryPool] = []


@pytest.fixture(scope="module")
def traced() -> Iterator[None]:
    """Python's allocations traced until the module's tests are done, not stopped as a
    test ends: pyarrow's threads may still be calling into Python then, and stopping
    tracemalloc beside them crashed this interpreter (3.11.7: 4 runs of the megabyte
    test in 20, and none in 20 without tracemalloc; CPython's gh-128679, fixed in
    3.12.9). A thread refused a read makes that call at once: stopped a moment after."""
    tracemalloc.start()
    yield
    time.sleep(0.5)
    tracemalloc.stop()


@contextlib.contextmanager
def _peak_bytes() -> Iterator[list[int]]:
    """The most bytes Arrow's default pool handed out meanwhile, and the most Python's
    objects grew by (`traced`), the two peaks added: `[bytes]` once the block is left."""
    assert tracemalloc.is_tracing()
    default = pa.default_memory_pool()
    counted = pa.proxy_memory_pool(default)
    _COUNTING_POOLS.append(counted)  # arrays it gave may be freed through it later
    pa.set_memory_pool(counted)
    tracemalloc.reset_peak()
    held_before = tracemalloc.get_traced_memory()[0]
    peak = [0]
    try:
        yield peak
    finally:
        peak[0] = counted.max_memory() + tracemalloc.get_traced_memory()[1] - held_before
        pa.set_memory_pool(default)


def _table_bombs() -> dict[str, bytes]:
    """The review's table bomb, a thousand rows each a megabyte-long URI: as a gzipped CSV
    (a gzip member a row, about 1 MB in all), as a Parquet file that writes the value
    once in its dictionary (4 KB), and, each URI its own, as a plain-encoded one."""
    csv_gz = gzipped_rows("uri", MEGABYTE_URI, 1000)
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * 1000, pa.int32()), [MEGABYTE_URI])
    dictionary = io.BytesIO()  # without Arrow's schema: read as text unless asked otherwise
    pq.write_table(pa.table({"uri": repeated}), dictionary, store_schema=False, compression="zstd")
    distinct = pa.table({"uri": [f"{MEGABYTE_URI[:-6]}{n:06d}" for n in range(64)]})
    plain = io.BytesIO()
    pq.write_table(distinct, plain, use_dictionary=False, compression="zstd")
    return {"csv.gz": csv_gz, "parquet": dictionary.getvalue(), "plain.parquet": plain.getvalue()}


@pytest.mark.parametrize("kind", ["csv.gz", "parquet", "plain.parquet"])
def test_a_table_of_megabyte_uris_is_refused_holding_a_few_megabytes(
    kind: str, traced: None
) -> None:
    """The review's table bomb (1,000 rows of 1,000,000-character URIs, 1 MB gzipped) is
    poison at its first row, with the daemon's memory grown by a few MB, not the GB it
    held before: a CSV is parsed a 1 MiB block at a time, a Parquet file's dictionary
    value is measured once, a row group of long rows is refused from its footer."""
    blobs = InMemoryBlobStore()
    blobs.objects[f"s3://tbl/bomb.{kind}"] = _table_bombs()[kind]
    reason = "row 1: its URI's key is over S3's limit of 1024 bytes"
    if kind == "plain.parquet":
        reason = r"rows 1-64 take \d+ bytes of uri, over \d+ a row: .* 1024 bytes"
    with _peak_bytes() as peak, pytest.raises(PoisonMessage, match=reason):
        _read(blobs, table={"uri": f"s3://tbl/bomb.{kind}"})
    # A CSV's reader parses one 1 MiB block at a time, reading at most 32 ahead (7 MiB
    # seen); the rest, 3 MiB. The measure is the process's: threads an earlier test left
    # in this worker count too.
    assert peak[0] < 64 * 2**20, f"{peak[0] / 2**20:.0f} MiB"


def test_a_json_lines_table_whose_ids_are_its_uris_lists_each_row_once() -> None:
    blobs = InMemoryBlobStore()
    lines = [{"uri": "s3://pix/a.jpg"}, {"uri": "s3://pix/b.jpg"}]
    blobs.objects["s3://tbl/t.jsonl"] = "".join(json.dumps(line) + "\n" for line in lines).encode()
    listed = _read(blobs, table={"uri": "s3://tbl/t.jsonl", "id_column": "uri"})
    assert listed == [("s3://pix/a.jpg", "s3://pix/a.jpg"), ("s3://pix/b.jpg", "s3://pix/b.jpg")]


class _SlowAfter(InMemoryBlobStore):
    """Serves an object's first `fast` chunks at once and each later one after `wait_s`,
    noting when each of those reads ended."""

    def __init__(self, fast: int, wait_s: float):
        super().__init__(chunk_bytes=2**18)
        self._fast, self._wait_s = fast, wait_s
        self.slow_reads_ended: list[float] = []

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        for number, chunk in enumerate(super().chunks(location, max_bytes, expect=expect)):
            if number >= self._fast:
                time.sleep(self._wait_s)
                self.slow_reads_ended.append(time.monotonic())
            yield chunk


def test_a_refused_csv_table_is_read_no_further_once_its_refusal_returns() -> None:
    """pyarrow reads a CSV's blocks ahead on a thread of its own. A table refused at a
    row of its third block, while that thread waits for the chunks of a later one,
    returns once the read under way has ended, and no read starts after: nothing is
    left reading (or inflating) a sender's object, and the refusal is what it says."""
    valid, over = f"s3://pix/{'k' * 1000}", f"s3://pix/{OVER_A_KEY}"
    rows = CSV_BLOCK_BYTES // len(valid)  # about a block's worth
    body = "uri\n" + f"{valid}\n" * (2 * rows) + f"{over}\n" * (4 * rows)
    # The first three blocks at once: the reader's thread runs ahead of the rows'
    # checks, and waits on the fourth's chunks when the refusal comes.
    blobs = _SlowAfter(fast=3 * CSV_BLOCK_BYTES // 2**18, wait_s=0.3)
    blobs.objects["s3://tbl/long.csv"] = body.encode()
    with pytest.raises(PoisonMessage, match=f"row {2 * rows + 1}: a key over S3's limit"):
        _read(blobs, table={"uri": "s3://tbl/long.csv"})
    returned = time.monotonic()
    assert blobs.slow_reads_ended, "pyarrow read nothing ahead: the test shows nothing"
    time.sleep(1)  # a read still under way (the first of them) would end meanwhile
    assert max(blobs.slow_reads_ended) <= returned
