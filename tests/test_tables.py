"""Parquet results' columns: set by the model's probe and the message, never by the
values, so that every file of a job (each shard's) has the same schema."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from structlog.testing import capture_logs

from stages.synthetic import samples
from tests.support.in_process import run_until_drained
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets import tables
from worker.datasets.tables import Tables, UnfitResults, footer_metadata, joined_schema
from worker.plugins.encoding import encoded_fields

PROBE = json.dumps({"label": "x", "score": 0.0, "rank": 0, "boxes": [], "note": None}).encode()


def _written(tmp_path: Path, lines: list[dict[str, object]], *, ids: bool) -> list[Path]:
    tables = Tables(file_bytes=2**20, row_group_bytes=2**20)
    tables.probed(PROBE, {})
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return tables.write(body, {}, tmp_path / str(len(list(tmp_path.iterdir()))), ids=ids)


def _record(index: int, **fields: object) -> dict[str, object]:
    return {"index": index, "input": f"s3://b/{index}", "id": str(index), **fields, "model": "m"}


def test_every_file_of_a_job_has_the_columns_the_probe_gave_whatever_its_rows(
    tmp_path: Path,
) -> None:
    """A shard whose inputs all failed, one whose answers hold nulls and empty lists, one
    with boxes: the same columns, in the same order, of the same types. A field the
    probe answered with a null or an empty list has no type there: it is JSON text."""
    failed = [{"index": 0, "input": "s3://b/0", "id": "0", "error": {"type": "E", "message": "m"}}]
    empty = [_record(1, label="cat", score=0.5, rank=1, boxes=[], note=None)]
    boxes = [_record(2, label="dog", score=0.25, rank=2, boxes=[[1, 2], [3, 4]], note="n")]
    schemas = []
    for lines in (failed, empty, boxes):
        (path,) = _written(tmp_path, lines, ids=True)
        schemas.append(pq.read_schema(path))
    assert schemas[0] == schemas[1] == schemas[2]
    assert [(field.name, str(field.type)) for field in schemas[0]][:3] == [
        ("index", "int64"),
        ("input", "string"),
        ("id", "string"),
    ]
    assert str(schemas[0].field("rank").type) == "int64"
    assert str(schemas[0].field("boxes").type) == "string"
    row = pq.read_table(path).to_pylist()[0]
    assert (json.loads(row["boxes"]), row["note"], row["rank"]) == ([[1, 2], [3, 4]], '"n"', 2)
    without_ids = [{name: value for name, value in empty[0].items() if name != "id"}]
    (path,) = _written(tmp_path, without_ids, ids=False)
    assert "id" not in pq.read_schema(path).names


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"rank": 0.5}, r"rank: int64.*couldn't parse:0\.5"),
        ({"rank": 1, "extra": 1}, r"the postprocessor gave extra, which its answer"),
    ],
)
def test_results_that_do_not_fit_the_probed_columns_are_refused_with_the_reason(
    tmp_path: Path, fields: dict[str, object], reason: str
) -> None:
    with pytest.raises(UnfitResults, match=reason):
        _written(tmp_path, [_record(0, label="a", score=0.1, **fields)], ids=True)


def test_a_job_whose_results_do_not_fit_its_columns_is_dead_lettered_not_retried(
    tmp_path: Path,
) -> None:
    """An integer field that holds a fraction is the postprocessor's fault, the same on
    every delivery: the job goes to the dead-letter queue with the reason, and leaves no
    job.json."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    for number, (_, data) in enumerate(samples(2, seed=5)):
        blobs.objects[f"s3://bkt/img/{number}"] = data
    inputs = ["s3://bkt/img/0", "s3://bkt/img/1"]
    body = {"job_id": "unfit", "inputs": inputs, "output": "s3://bkt/out/", "format": "parquet"}
    source.send(json.dumps(body))
    run_until_drained(
        source,
        blobs,
        tmp_path,
        model="tests.support.stagefns:pixel_embedder",
        postprocess="tests.support.stagefns:int_then_float",
    )
    ((_, reason),) = source.dead_letters
    assert "score: int64" in reason and "s3://bkt/out/job.json" not in blobs.objects


@pytest.mark.parametrize("name", ["index", "input", "id", "model", "error"])
def test_a_postprocessor_may_not_give_a_field_of_the_record_s_own(name: str) -> None:
    """`id` too: a job's table puts its ids there."""
    with pytest.raises(ValueError, match=f"returned {name}: results.jsonl's own fields"):
        encoded_fields(lambda _output, _params: {name: 1}, None, {})


def test_a_struct_given_keys_its_probe_did_not_have_does_not_fit(tmp_path: Path) -> None:
    """pyarrow would widen the struct, and that file's schema would differ from the
    job's others."""
    tables = Tables(file_bytes=2**20, row_group_bytes=2**20)
    tables.probed(json.dumps({"box": {"x": 0}}).encode(), {})
    line = {"index": 0, "input": "s3://b/0", "box": {"x": 1, "y": 2}, "model": "m"}
    with pytest.raises(UnfitResults, match=r"box: struct<x: int64, y: int64>, not struct"):
        tables.write(json.dumps(line).encode() + b"\n", {}, tmp_path, ids=False)


def test_a_parquet_jobs_finish_removes_only_the_results_files_it_names(tmp_path: Path) -> None:
    """A job's finish removes the results files an earlier run of it left, and nothing
    else under `results/`: a downstream tool's `_SUCCESS`, another job's output there."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    for number, (_, data) in enumerate(samples(2, seed=3)):
        blobs.objects[f"s3://bkt/img/{number}"] = data
    neighbours = {
        "s3://bkt/out/team/results/_SUCCESS": b"",
        "s3://bkt/out/team/results/job.json": b"{}",
        "s3://bkt/out/team/results/results.jsonl": b"{}\n",
    }
    blobs.objects.update(neighbours)
    blobs.objects["s3://bkt/out/team/results/part-000000-0007.parquet"] = b"an earlier run's"
    body = {
        "inputs": ["s3://bkt/img/0", "s3://bkt/img/1"],
        "output": "s3://bkt/out/team/",
        "format": "parquet",
    }
    source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path)
    under = {uri for uri in blobs.objects if uri.startswith("s3://bkt/out/team/results/")}
    assert under == {*neighbours, "s3://bkt/out/team/results/part-000000-0000.parquet"}


def _parquet_file(path: Path, groups: list[pa.Table], **options: Any) -> Path:
    with pq.ParquetWriter(path, groups[0].schema, **options) as writer:
        for group in groups:
            writer.write_table(group)
    return path


def test_a_join_cuts_row_groups_by_their_decoded_bytes_not_their_files(tmp_path: Path) -> None:
    """Text that repeats takes a few bytes a row group in its file (a footer's sizes
    are encoded) and hundreds of KiB decoded: the join holds and writes row groups of
    about --parquet-row-group-bytes decoded, never the whole of a shard's at once."""
    text = pa.table({"label": pa.array(["a label that repeats " * 50] * 256)})  # 256 KiB decoded
    source = _parquet_file(tmp_path / "shard.parquet", [text] * 4, compression="zstd")
    footer = pq.ParquetFile(source).metadata
    assert all(footer.row_group(n).total_byte_size < text.nbytes // 20 for n in range(4))
    row_group_bytes = 64 * 2**10
    tables = Tables(file_bytes=2**30, row_group_bytes=row_group_bytes)
    [joined] = tables.join([source], text.schema, tmp_path / "joined", beat=lambda: None)
    written = pq.ParquetFile(joined)
    assert written.read() == pa.concat_tables([text] * 4)
    assert written.num_row_groups >= 16
    for group in range(written.num_row_groups):
        assert written.read_row_group(group).nbytes <= row_group_bytes


def test_a_value_that_does_not_fit_its_joined_column_is_unfit_not_retried(
    tmp_path: Path,
) -> None:
    """A value the joined column's type cannot hold (an integer past 2^53 cast to a
    float) fails the join as `UnfitResults`, the same on every delivery, not an error
    retried for ever."""
    numbers = pa.table({"rank": pa.array([1, 2**60])})
    source = _parquet_file(tmp_path / "shard.parquet", [numbers])
    joining = Tables(2**20, 2**20).join(
        [source], pa.schema([("rank", pa.float64())]), tmp_path / "joined", beat=lambda: None
    )
    with pytest.raises(UnfitResults, match="rank"):
        list(joining)


def test_integers_without_statistics_do_not_join_with_floats(tmp_path: Path) -> None:
    """Integers among another file's floats join as floats only where the footer's
    statistics show every one within +-2^53: a file written without statistics is
    refused, naming the column."""
    integers = _parquet_file(
        tmp_path / "0.parquet", [pa.table({"rank": pa.array([1, 2])})], write_statistics=False
    )
    floats = _parquet_file(tmp_path / "1.parquet", [pa.table({"rank": pa.array([0.5])})])
    footers = [pq.read_metadata(integers), pq.read_metadata(floats)]
    with pytest.raises(UnfitResults, match="column 'rank' holds integers"):
        joined_schema(footers)
    with_statistics = _parquet_file(tmp_path / "2.parquet", [pa.table({"rank": pa.array([1, 2])})])
    assert joined_schema([pq.read_metadata(with_statistics), footers[1]]) == pa.schema(
        [("rank", pa.float64())]
    )


def test_a_footer_this_machine_has_no_memory_to_read_is_not_the_files_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A footer that cannot be read is the file's fault (unfit, the merge poison), but
    not when this machine ran out of memory reading it: that is raised as it is."""
    sink = io.BytesIO()
    pq.write_table(pa.table({"index": [1, 2]}), sink)
    footer = sink.getvalue()[4:]  # as `footer_bytes` gives it: after the leading magic
    assert footer_metadata(footer).num_rows == 2

    def no_memory(source: object) -> pq.FileMetaData:
        raise pa.ArrowMemoryError("malloc of 8 GiB failed")

    monkeypatch.setattr(tables.pq, "read_metadata", no_memory)
    with pytest.raises(pa.ArrowMemoryError):
        footer_metadata(footer)


def test_results_files_are_named_in_input_order_up_to_the_ten_thousandth() -> None:
    """A job's results files' names sort as their numbers do, up to the 10,000th file
    (part-000000-9999), where part-000000-10000 sorted before part-000000-2000: no file
    is made past it (`test_the_last_results_file_holds_the_rows_past_the_files_a_job_has`)."""
    names = [tables.table_name(3, file) for file in (0, 1, 999, 2000, 9999)]
    assert sorted(names) == names and names[-1] == "results/part-000003-9999.parquet"
    with pytest.raises(ValueError, match="10000"):
        tables.table_name(0, 10_000)


def test_the_last_results_file_holds_the_rows_past_the_files_a_job_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Results that --parquet-file-bytes would cut into more files than a job has
    (10,000, here 3) are not refused for the worker's setting: the last file holds the
    rows left past its size, logged, and every row is written in order."""
    monkeypatch.setattr(tables, "MAX_RESULTS_FILES", 3)
    tiny = Tables(file_bytes=1, row_group_bytes=1)
    tiny.probed(PROBE, {})
    lines = [_record(n, label="cat", score=0.5, rank=n, boxes=[], note=None) for n in range(10)]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    with capture_logs() as logs:
        files = tiny.write(body, {}, tmp_path, ids=True)
    assert [pq.read_metadata(path).num_rows for path in files] == [1, 1, 8]
    indexes = pa.concat_tables(pq.read_table(path) for path in files).column("index")
    assert indexes.to_pylist() == list(range(10))
    [overfull] = [entry for entry in logs if entry["event"] == "results_file_holds_the_rest"]
    assert overfull["file"] == 2


def test_a_job_too_large_for_the_file_size_is_joined_into_larger_files() -> None:
    """A join of shards' files cuts files of --parquet-file-bytes, or, for a job of
    more than 9,000 of them, of its bytes over 9,000: it never needs more than the
    10,000 files a job has, whatever the merging worker's setting."""
    mib = Tables(file_bytes=2**20, row_group_bytes=2**20)
    assert mib.joined_file_bytes(100 * 2**20) == 2**20
    assert mib.joined_file_bytes(9_000 * 2**20) == 2**20
    huge = 80 * 10**12  # 80 TB: about 9,000 files of 8.9 GB
    assert mib.joined_file_bytes(huge) * (tables.JOINED_FILES - 1) < huge
    assert mib.joined_file_bytes(huge) * tables.JOINED_FILES >= huge
