"""Datasets in, tables out, end to end: a daemon subprocess against the moto server runs
one job of each kind of input listing (a prefix, a CSV table with ids, a Parquet table,
an S3 Inventory report, tar shards under a prefix, sent with `enqueue --tar`), two of
them as shards, one with Parquet results, which read back as one table with pyarrow and
DuckDB; a table without its URI column is dead-lettered."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq
import pytest

from bench.harness import tar_of
from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args
from tests.support.jobs import enqueue_command, job_output, upload
from worker.demo import upload_samples
from worker.ports import S3Location

pytestmark = pytest.mark.e2e


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_each_kind_of_input_listing_runs_and_parquet_results_read_as_one_table(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    stack = aws.stack()
    images = sorted(upload_samples(aws.s3, stack.bucket, 10, seed=31))
    upload(aws, stack, "images/notes.txt", b"not an image")
    ids = [f"photo-{number:03d}" for number in range(len(images))]
    csv = "id,uri\n" + "".join(f"{i},{uri}\n" for i, uri in zip(ids, images, strict=True))
    inventory_rows = "".join(
        f'"{stack.bucket}","{S3Location.parse(uri).key}","true","false"\n' for uri in images[:4]
    )
    upload(aws, stack, "inventory/data/1.csv.gz", gzip.compress(inventory_rows.encode()))
    manifest = {
        "sourceBucket": stack.bucket,
        "destinationBucket": f"arn:aws:s3:::{stack.bucket}",
        "fileFormat": "CSV",
        "fileSchema": "Bucket, Key, IsLatest, IsDeleteMarker",
        "files": [{"key": "inventory/data/1.csv.gz", "size": 1, "MD5checksum": "x"}],
    }
    pixels = [aws.read(f"s3://{stack.bucket}/", S3Location.parse(uri).key) for uri in images]
    shards = [
        [(f"{n}.png", pixels[n]) for n in range(3)] + [("3.cls", b"7"), ("3.png", b"no image")],
        [(f"{n}.png", pixels[n]) for n in range(4, 10)],
    ]
    for number, members in enumerate(shards):
        upload(aws, stack, f"tars/{number:04d}.tar", tar_of(members))
    jobs = {
        "prefix": {"inputs_prefix": f"s3://{stack.bucket}/images/", "inputs_suffix": ".img"},
        "csv": {
            "table": {"uri": upload(aws, stack, "ids.csv", csv.encode()), "id_column": "id"},
            "format": "parquet",
            "shard_items": 4,
        },
        "parquet": {
            "table": {
                "uri": upload(
                    aws,
                    stack,
                    "ids.parquet",
                    _parquet(pa.table({"uri": images[:3], "n": [7, 8, 9]})),
                ),
                "id_column": "n",
            }
        },
        "inventory": {
            "inventory": upload(
                aws, stack, "inventory/manifest.json", json.dumps(manifest).encode()
            )
        },
        "no-column": {"table": {"uri": upload(aws, stack, "bad.csv", b"path\ns3://x/y\n")}},
    }
    for job_id, source in jobs.items():
        aws.send(stack.queue_url, {"job_id": job_id, "output": job_output(stack, job_id), **source})
    tar_flags = ["--inputs-prefix", f"s3://{stack.bucket}/tars/", "--tar"]
    tar_flags += ["--member-suffix", ".png", "--shard-items", "1"]
    command = enqueue_command(stack.queue_url, "tars", job_output(stack, "tars"), *tar_flags)
    subprocess.run(command, env=aws.env, check=True, capture_output=True, timeout=180)
    daemon = start_daemon(daemon_args(stack, tmp_path, "--drain"))
    assert daemon.wait(180) == 0, daemon.stderr[-3000:]

    prefix = aws.results(job_output(stack, "prefix"))
    assert [line["input"] for line in prefix] == images
    assert [line["id"] for line in aws.results(job_output(stack, "parquet"))] == ["7", "8", "9"]
    assert [line["input"] for line in aws.results(job_output(stack, "inventory"))] == images[:4]
    tars = aws.results(job_output(stack, "tars"))
    assert [(line["index"], line["member"]) for line in tars] == [
        *((0, f"{n}.png") for n in range(4)),
        *((1, f"{n}.png") for n in range(4, 10)),
    ]
    assert tars[3]["error"]["type"] == "UnidentifiedImageError"
    labels = [line["label"] for line in prefix]
    assert [line.get("label") for line in tars] == [*labels[:3], None, *labels[4:]]
    assert aws.summary(job_output(stack, "tars"))["items"] == 10
    [dead] = aws.dead_letters(stack.dlq_url)
    assert json.loads(dead["Body"])["job_id"] == "no-column"
    assert "'uri'" in dead["MessageAttributes"]["reason"]["StringValue"]

    output = job_output(stack, "csv")
    summary = aws.summary(output)
    assert (summary["format"], summary["shards"]["count"]) == ("parquet", 3)
    files = [name for name in summary["outputs"] if name.startswith("results/")]
    assert files == ["results/part-000000-0000.parquet"]  # the shards' joined
    local = tmp_path / "csv-results"
    local.mkdir()
    for name in files:
        (local / name.removeprefix("results/")).write_bytes(aws.read(output, name))
    table = pyarrow.dataset.dataset(local, format="parquet").to_table()
    assert table.column("index").to_pylist() == list(range(len(images)))
    assert table.column("input").to_pylist() == images
    assert table.column("id").to_pylist() == ids
    assert table.column("label").to_pylist() == [line["label"] for line in prefix]
    counted = duckdb.sql(
        f"SELECT count(*), count(DISTINCT id), count(error) FROM read_parquet('{local}/*.parquet')"
    )
    assert counted.fetchall() == [(len(images), len(images), 0)]
