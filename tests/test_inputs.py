"""The kinds of input listing a message may name (`worker.jobs.inputs`), read from the
in-memory store: what each yields, in order, and what makes its message poison."""

from __future__ import annotations

import datetime
import gzip
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker.adapters.fakes import FAKE_LIST_PAGE, InMemoryBlobStore
from worker.jobs.inputs import Input, InputReader
from worker.jobs.message import PoisonMessage, parse_job_message

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
    assert reader.shard("s3://out/job/shards/0.inputs") == [
        Input("s3://pix/a"),
        Input("s3://pix/b", "7"),
        Input("s3://pix/c", "x"),
    ]
