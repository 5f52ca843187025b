"""Text jobs through the whole daemon, in this process against the in-memory fakes: a
Parquet table of texts sharded into Parquet embeddings equal to the shipped text model's
own answers, and inline texts whose bad values and over-long texts are their items'
errors or cut as the job's params say."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq
import pytest

from stages.sentences import sentences
from stages.text import MAX_TOKENS
from tests.support.in_process import (
    job_file,
    run_until_drained,
    run_while,
    serving_settings,
)
from tests.support.markers import also_on_gpu
from tests.support.texts import TEXT_PIPELINE, model_answers
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon

LONG = " ".join(["rain"] * (2 * MAX_TOKENS))  # over the model's longest sequence


def _run(tmp_path: Path, blobs: InMemoryBlobStore, device: str = "auto", **message: Any) -> None:
    source = InMemoryJobSource()
    source.send(json.dumps({"output": f"s3://bkt/out/{message['job_id']}/", **message}))
    run_until_drained(source, blobs, tmp_path, device=device, **TEXT_PIPELINE)


@pytest.mark.parametrize(("device", "tolerance"), also_on_gpu(("cpu", 1e-5), ("cuda", 1e-4)))
def test_a_table_of_texts_is_sharded_into_parquet_embeddings_equal_to_the_models(
    tmp_path: Path, device: str, tolerance: float
) -> None:
    """Seven rows in shards of three, keyed by their ids in table order: each row's
    label and embedding (a float32 fixed-size list) are the model's own answer to its
    text, run on the CPU here (within `tolerance` of it on a GPU, where one is: its sums
    are made in another order); the row whose text is null is that row's error, the job
    goes on."""
    drawn = list(sentences(7, seed=11))
    texts: list[str | None] = [text for _, text in drawn]
    texts[4] = None
    blobs = InMemoryBlobStore()
    sink = io.BytesIO()
    ids = [f"doc-{row}" for row in range(len(texts))]
    pq.write_table(pa.table({"id": ids, "body": texts}), sink)
    blobs.objects["s3://bkt/texts.parquet"] = sink.getvalue()
    table = {"uri": "s3://bkt/texts.parquet", "text_column": "body", "id_column": "id"}
    _run(
        tmp_path, blobs, job_id="table", table=table, format="parquet", shard_items=3, device=device
    )

    summary = job_file(blobs, "table", "job.json")
    assert (summary["shards"]["count"], summary["succeeded"], summary["failed"]) == (3, 6, 1)
    local = tmp_path / "results"
    local.mkdir()
    for name in (name for name in summary["outputs"] if name.startswith("results/")):
        (local / name.split("/")[1]).write_bytes(blobs.objects[f"s3://bkt/out/table/{name}"])
    results = pyarrow.dataset.dataset(local, format="parquet").to_table()
    assert results.column("id").to_pylist() == ids
    assert results.column("input").to_pylist()[:2] == [
        "s3://bkt/texts.parquet#row=0",
        "s3://bkt/texts.parquet#row=1",
    ]
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    errors = results.column("error").to_pylist()
    assert errors[4]["message"] == "its value is null, not text"
    expected = model_answers([text for text in texts if text is not None])
    got = [row for row in results.to_pylist() if row["error"] is None]
    for row, answer in zip(got, expected, strict=True):
        assert row["label"] == ("weather", "sport", "food", "travel")[int(np.argmax(answer[:4]))]
        assert np.allclose(row["embedding"], answer[4:], atol=tolerance)
        assert row["truncated"] is False
    assert [row["label"] for row in got[:4]] == ["weather", "sport", "food", "travel"]


def test_inline_texts_that_are_empty_not_text_or_too_long_are_their_items_errors_or_cut(
    tmp_path: Path,
) -> None:
    """An empty text and a number are their items' errors; a text over the model's
    longest sequence is cut by default, the result saying so, and refused where the
    job's params say `"truncate": false`."""
    blobs = InMemoryBlobStore()
    texts: list[Any] = ["the forecast says rain", "", 42, LONG]
    _run(tmp_path / "cut", blobs, job_id="cut", texts=texts)
    _run(tmp_path / "kept", blobs, job_id="kept", texts=texts, params={"truncate": False})
    cut, kept = job_file(blobs, "cut", "results.jsonl"), job_file(blobs, "kept", "results.jsonl")
    assert [line["input"] for line in cut] == ["the forecast says rain", "", "42", LONG]
    assert (cut[0]["label"], cut[0]["truncated"]) == ("weather", False)
    assert cut[1]["error"]["message"] == "its text is empty"
    assert cut[2]["error"]["message"] == "its value is a number, not text"
    assert (cut[3]["label"], cut[3]["truncated"]) == ("weather", True)
    assert kept[3]["error"]["type"] == "TextTooLong"
    assert kept[0]["truncated"] is False


def test_embeddings_are_written_as_float16_where_the_job_asks(tmp_path: Path) -> None:
    """`params.array_dtype: "float16"` halves the embeddings' bytes: embedding.npy of a
    JSON-lines job and the Parquet column of another hold float16 rows, each the model's
    own answer within float16's precision."""
    texts = [text for _, text in sentences(3, seed=12)]
    answers = model_answers(texts)[:, 4:]
    blobs, source = InMemoryBlobStore(), InMemoryJobSource()
    for job_id, format in (("npy", "jsonl"), ("pq", "parquet")):
        message = {"job_id": job_id, "texts": texts, "output": f"s3://bkt/out/{job_id}/"}
        source.send(json.dumps({**message, "format": format, "params": {"array_dtype": "float16"}}))
    run_until_drained(source, blobs, tmp_path, **TEXT_PIPELINE)

    rows = np.load(io.BytesIO(blobs.objects["s3://bkt/out/npy/embedding.npy"]))
    assert rows.dtype == np.float16 and np.allclose(rows, answers, atol=2e-3)
    [part] = [name for name in job_file(blobs, "pq", "job.json")["outputs"] if ".parquet" in name]
    column = pq.read_table(io.BytesIO(blobs.objects[f"s3://bkt/out/pq/{part}"])).column("embedding")
    assert column.type == pa.list_(pa.float16(), 64)
    assert np.allclose(np.array(column.to_pylist(), dtype=np.float32), answers, atol=2e-3)


def test_a_planned_tables_rows_count_each_against_the_limit_of_a_jobs_inputs(
    tmp_path: Path,
) -> None:
    """A Parquet table over the shard size is listed a file at a time, not a row at a
    time (`TableRows`), yet each of its rows counts against --max-items-per-job: seven
    rows over a limit of five is refused before anything is planned."""
    blobs = InMemoryBlobStore()
    sink = io.BytesIO()
    pq.write_table(pa.table({"body": [text for _, text in sentences(7, seed=3)]}), sink)
    blobs.objects["s3://bkt/texts.parquet"] = sink.getvalue()
    table = {"uri": "s3://bkt/texts.parquet", "text_column": "body"}
    source = InMemoryJobSource()
    source.send(json.dumps({"job_id": "big", "output": "s3://bkt/out/big/", "table": table}))
    run_until_drained(source, blobs, tmp_path, shard_items=3, max_items_per_job=5, **TEXT_PIPELINE)

    assert "more than 5 inputs" in json.loads(job_file(blobs, "big", "rejected.json"))["reason"]
    assert not [uri for uri in blobs.objects if uri.startswith("s3://bkt/out/big/shards/")]


def test_a_table_of_texts_stopped_part_way_resumes_and_ends_as_if_uninterrupted(
    tmp_path: Path,
) -> None:
    """A Parquet table of 60 texts with ids, run as a Parquet job, is stopped part-way:
    its checkpoint parts carry the embeddings of the rows done, so the next delivery
    runs only the rest, and its results (rows, ids, labels, embeddings) are an
    uninterrupted run's."""
    texts = [text for _, text in sentences(60, seed=21)]
    ids = [f"doc-{row}" for row in range(len(texts))]
    blobs, source = InMemoryBlobStore(), InMemoryJobSource()
    sink = io.BytesIO()
    pq.write_table(pa.table({"id": ids, "body": texts}), sink)
    blobs.objects["s3://bkt/texts.parquet"] = sink.getvalue()
    table = {"uri": "s3://bkt/texts.parquet", "text_column": "body", "id_column": "id"}
    slow = {**TEXT_PIPELINE, "model": "tests.support.texts:slow_text_model"}

    def send(job_id: str) -> None:
        output = f"s3://bkt/out/{job_id}/"
        source.send(
            json.dumps({"job_id": job_id, "table": table, "output": output, "format": "parquet"})
        )

    send("stopped")
    first = Daemon(
        serving_settings(tmp_path, checkpoint_items=5, grace_seconds=0).model_copy(
            update={**slow, "batch_size": 1}
        ),
        source,
        blobs,
    )

    def parts() -> list[str]:
        return [u for u in blobs.objects if "/stopped/checkpoint-" in u and u.endswith(".npy")]

    def drive() -> None:
        wait_until(lambda: len(parts()) >= 2)
        first.stop()

    assert run_while(first, drive) is ExitCode.SIGNALLED
    send("whole")
    run_until_drained(source, blobs, tmp_path, **slow)

    summary = job_file(blobs, "stopped", "job.json")
    assert summary["status"] == "succeeded" and summary["resumed"] >= 10
    tables = {
        job_id: pq.read_table(io.BytesIO(blobs.objects[f"s3://bkt/out/{job_id}/{name}"]))
        for job_id in ("stopped", "whole")
        for name in job_file(blobs, job_id, "job.json")["outputs"]
        if name.endswith(".parquet")
    }
    stopped, whole = tables["stopped"].to_pylist(), tables["whole"].to_pylist()
    assert [row["id"] for row in stopped] == ids
    assert [row["input"] for row in stopped] == [
        f"s3://bkt/texts.parquet#row={n}" for n in range(60)
    ]
    assert [row["label"] for row in stopped] == [row["label"] for row in whole]
    assert np.allclose(
        [row["embedding"] for row in stopped], [row["embedding"] for row in whole], atol=1e-6
    )
