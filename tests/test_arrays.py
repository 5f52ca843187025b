"""Array outputs: a postprocessor's array fields land in .npy files beside results.jsonl."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow
import pyarrow.dataset
import pytest
import torch

from stages.postprocess import embedding
from stages.preprocess import default_preprocessor
from stages.synthetic import samples
from tests.support.in_process import run_until_drained
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets import arrays
from worker.datasets.arrays import ArrayFiles, ArraySpool
from worker.loops import results
from worker.plugins.encoding import encoded_fields
from worker.ports import S3Location
from worker.retry import Backoff


def test_array_fields_are_kept_apart_from_the_json_ones() -> None:
    """Numpy and torch arrays (bfloat16 too) travel as numpy arrays; numpy scalars and
    0-d arrays are JSON numbers; the JSON fields encode as before."""
    fields = {
        "label": "cat",
        "score": np.float32(0.5),
        "count": torch.tensor(3),
        "embedding": np.arange(4, dtype=np.float32),
        "mask": torch.ones(2, 2, dtype=torch.bfloat16),
    }
    encoded, arrays = encoded_fields(lambda *_: fields, None, {})  # type: ignore[misc]
    assert json.loads(b"{" + encoded[1:] + b"}") == {"label": "cat", "score": 0.5, "count": 3}
    assert arrays["embedding"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert arrays["mask"].dtype == np.float32 and arrays["mask"].shape == (2, 2)
    only_arrays = encoded_fields(embedding, np.zeros(3, dtype=np.float16), {})
    assert isinstance(only_arrays, tuple) and only_arrays[0] == b""
    with pytest.raises(TypeError, match="not JSON serializable: set"):
        encoded_fields(lambda *_: {"tags": {"a"}}, None, {})


def test_rows_land_in_place_and_a_row_that_does_not_fit_is_refused_whole(
    tmp_path: Path,
) -> None:
    """The first row of a field makes its file (rows x its shape, its dtype); each row
    goes where its index says, unwritten rows stay zeros; a row of another shape or
    dtype, a field that cannot name a file, or arrays over `MAX_ROW_BYTES` (which a
    checkpoint part must hold), are refused with nothing written; after
    `remove` the files are gone and writes are dropped."""
    files = ArrayFiles(tmp_path / "job", rows=4)
    references = files.write(2, {"embedding": np.full(3, 2.0, np.float32)})
    assert json.loads(b"{" + references[1:] + b"}") == {
        "embedding": {"array": "embedding.npy", "row": 2}
    }
    files.write(0, {"embedding": np.full(3, 7.0, np.float32), "mask": np.ones((2, 2), np.uint8)})
    with pytest.raises(ValueError, match=r"float64\[3\], where this job's embedding.npy takes"):
        files.write(1, {"mask": np.ones((2, 2), np.uint8), "embedding": np.zeros(3)})
    with pytest.raises(ValueError, match="cannot name a file"):
        files.write(3, {"../escape": np.zeros(3)})
    with pytest.raises(ValueError, match=f"over the {arrays.MAX_ROW_BYTES} an input's may take"):
        files.write(3, {"huge": np.zeros(arrays.MAX_ROW_BYTES + 1, np.uint8)})
    written = files.files()
    assert set(written) == {"embedding.npy", "mask.npy"}
    assert np.load(written["embedding.npy"]).tolist() == [
        [7.0] * 3,
        [0.0] * 3,
        [2.0] * 3,
        [0.0] * 3,
    ]
    assert np.load(written["mask.npy"])[1].sum() == 0  # the refused row wrote nothing
    files.remove()
    assert not (tmp_path / "job").exists()
    files.write(3, {"embedding": np.zeros(3, np.float32)})
    assert not (tmp_path / "job").exists()


def test_rows_take_the_probes_layout_and_their_disk_space_as_they_come(tmp_path: Path) -> None:
    """With the layouts the postprocessor's answer to zeros gave at start, a field's
    file has that shape and dtype whichever row comes first: a first row of another
    shape is refused, not made the rule; a field the probe did not give is refused. A
    file of 1,000 rows of 64 KiB takes the disk space of the rows written, not of all."""
    files = ArrayFiles(
        tmp_path / "job", rows=1000, layouts={"mask": (np.dtype(np.uint8), (256, 256))}
    )
    with pytest.raises(
        ValueError, match=r"uint8\[128, 128\], where this job's mask.npy takes uint8\[256"
    ):
        files.write(7, {"mask": np.ones((128, 128), np.uint8)})
    with pytest.raises(ValueError, match="gave no embedding array for the model's answer"):
        files.write(7, {"embedding": np.zeros(3, np.float32)})
    for row in (3, 900):
        files.write(row, {"mask": np.full((256, 256), row % 251, np.uint8)})
    path = files.files()["mask.npy"]
    assert os.stat(path).st_blocks * 512 < 4 * 256 * 256  # two rows and the header
    mask = np.load(path, mmap_mode="r")
    assert mask.shape == (1000, 256, 256) and mask[900].max() == 900 % 251
    assert mask[7].max() == 0  # the refused rows wrote nothing
    files.remove()


def test_an_embedding_job_leaves_its_rows_in_input_order_beside_results(tmp_path: Path) -> None:
    """With an embedding model and `stages.postprocess:embedding`, each input's line
    refers to its row of embedding.npy, which holds what the model made of it; a
    corrupt input's line is its error and its row zeros. job.json completes the array
    file by its ETag, and nothing is left in the local spool."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    images = [data for _, data in samples(5, seed=3)]
    inputs = []
    for number, data in enumerate(images):
        blobs.objects[f"s3://bkt/img/{number}"] = data
        inputs.append(f"s3://bkt/img/{number}")
    blobs.objects["s3://bkt/img/corrupt"] = b"not an image"
    inputs.insert(2, "s3://bkt/img/corrupt")
    _embed(tmp_path, inputs, source, blobs)

    lines = [
        json.loads(line) for line in blobs.objects["s3://bkt/out/emb/results.jsonl"].splitlines()
    ]
    assert [line["input"] for line in lines] == inputs
    assert "error" in lines[2] and "embedding" not in lines[2]
    for index in (0, 1, 3, 4, 5):
        assert lines[index]["embedding"] == {"array": "embedding.npy", "row": index}
    rows = np.load(io.BytesIO(blobs.objects["s3://bkt/out/emb/embedding.npy"]))
    assert rows.shape == (6, 32) and rows.dtype == np.float32
    decoded = torch.empty(default_preprocessor.output_shape, dtype=torch.uint8)
    for index, data in zip((0, 1, 3, 4, 5), images, strict=True):
        default_preprocessor(data, decoded)
        assert rows[index].tolist() == decoded.flatten()[:32].float().tolist()
    assert not rows[2].any()
    summary = json.loads(blobs.objects["s3://bkt/out/emb/job.json"])
    assert summary["status"] == "partial"
    listing = blobs.objects_under(S3Location.parse("s3://bkt/out/emb/"))
    assert summary["outputs"]["embedding.npy"] == listing["embedding.npy"]
    assert not any((tmp_path / "arrays").iterdir())


def test_an_array_field_that_cannot_name_its_file_is_refused_where_it_is_made() -> None:
    """A field name that is not a file name (not a string, a path, or one of the
    checkpoints' `checkpoint-` names, which are removed after the finish) is refused in
    the model's process, where it becomes that input's error."""
    for name in (1, "../escape", "checkpoint-0-1"):
        with pytest.raises(ValueError, match="cannot name a file"):
            encoded_fields(lambda *_, n=name: {n: np.zeros(2)}, None, {})


def test_a_float16_job_refuses_a_value_beyond_float16_s_range_and_writes_the_rest(
    tmp_path: Path,
) -> None:
    """A job storing its floats as float16: a row over 65,504 is refused (the item's
    error, as a `ValueError`), nothing of it written, where it would have been an
    infinity; a row within range is stored as float16."""
    files = ArrayFiles(tmp_path, 2, {"embedding": (np.dtype(np.float32), (2,))}, "float16")
    with pytest.raises(ValueError, match="beyond float16's range"):
        files.write(0, {"embedding": np.array([1.0, 1e6], dtype=np.float32)})
    files.write(1, {"embedding": np.array([0.5, -2.0], dtype=np.float32)})
    rows = np.load(files.files()["embedding.npy"])
    assert rows.dtype == np.float16 and rows.tolist() == [[0.0, 0.0], [0.5, -2.0]]


# A daemon's spool with a job's array file in it, and the daemon SIGKILLed holding it.
KILLED_WITH_ARRAYS = """
import os, signal, sys
from pathlib import Path
from worker.datasets.arrays import ArraySpool
spool = ArraySpool(Path(sys.argv[1]))
spool.open()
(spool.directory / "job#1").mkdir()
(spool.directory / "job#1" / "embedding.npy").write_bytes(b"left behind")
print(spool.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_disk_that_cannot_take_a_row_is_no_fault_of_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the local disk cannot take a row of a job's array file (no space: a row's
    blocks are taken as it is written, not on its page's write-back), the input is fed again
    rather than failed, and the job ends succeeded once the disk has room. Array files
    that a killed daemon left behind are removed at start; those of a daemon that lives
    (sharing the log directory) are not."""
    monkeypatch.setattr(results, "INPUT_BACKOFF", Backoff(base_s=0.01, cap_s=0.01))
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WITH_ARRAYS, str(tmp_path / "arrays")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left_behind = Path(killed.stdout.strip())
    assert (left_behind / "job#1" / "embedding.npy").is_file()
    living = ArraySpool(tmp_path / "arrays")
    living.open()
    (living.directory / "job#2").mkdir()
    full_disk = [OSError(errno.ENOSPC, "No space left on device")]
    allocate = os.posix_fallocate

    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        # The arenas' shared memory is reserved this way too: only an array file's
        # disk is full.
        spooled = Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(tmp_path / "arrays")
        if full_disk and spooled:
            raise full_disk.pop()
        allocate(fd, offset, length)

    monkeypatch.setattr(arrays.os, "posix_fallocate", posix_fallocate)
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = []
    for number, (_, data) in enumerate(samples(3, seed=3)):
        blobs.objects[f"s3://bkt/img/{number}"] = data
        inputs.append(f"s3://bkt/img/{number}")
    _embed(tmp_path, inputs, source, blobs)
    assert not full_disk and not left_behind.exists()
    assert [path.name for path in (tmp_path / "arrays").iterdir()] == [living.directory.name]
    assert (living.directory / "job#2").is_dir()
    living.close()
    summary = json.loads(blobs.objects["s3://bkt/out/emb/job.json"])
    assert (summary["status"], summary["succeeded"]) == ("succeeded", 3)
    retried = [
        json.loads(line)
        for line in blobs.objects["s3://bkt/out/emb/job.log"].splitlines()
        if b'"input_retried"' in line
    ]
    assert [(event["stage"], "No space left" in event["error"]) for event in retried] == [
        ("arrays", True)
    ]
    rows = np.load(io.BytesIO(blobs.objects["s3://bkt/out/emb/embedding.npy"]))
    assert rows.shape == (3, 32) and all(rows.any(axis=1))


def test_a_job_over_its_shard_size_with_array_files_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    """.npy files are not merged across shards: a job that would be planned into shards
    is dead-lettered with what to do instead, not run with rows out of place; its output
    holds the reason (rejected.json) and nothing else."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    blobs.objects["s3://bkt/img/0"] = next(iter(samples(1, seed=3)))[1]
    _embed(tmp_path, ["s3://bkt/img/0"] * 3, source, blobs, shard_items=2)
    [(_, reason)] = source.dead_letters
    assert 'merged across shards only as Parquet columns: give "format": "parquet"' in reason
    under = [uri for uri in blobs.objects if uri.startswith("s3://bkt/out/emb/")]
    assert under == ["s3://bkt/out/emb/rejected.json"]


def test_a_sharded_job_s_arrays_come_back_as_parquet_columns_equal_to_the_npy_rows(
    tmp_path: Path,
) -> None:
    """The same job, once whole as JSON lines and .npy, once in shards of two as Parquet:
    one row per input in input order, each embedding the .npy's row, the missing input's
    an error and a null embedding; the files read as one dataset."""
    inputs = []
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    for number, (_, data) in enumerate(samples(5, seed=4)):
        blobs.objects[f"s3://bkt/img/{number}"] = data
        inputs.append(f"s3://bkt/img/{number}")
    inputs.insert(3, "s3://bkt/img/missing")
    _embed(tmp_path / "whole", inputs, source, blobs)
    rows = np.load(io.BytesIO(blobs.objects["s3://bkt/out/emb/embedding.npy"]))
    parquet = {"shard_items": 2, "format": "parquet", "output": "s3://bkt/out/parquet/"}
    _embed(tmp_path / "sharded", inputs, source, blobs, **parquet)
    summary = json.loads(blobs.objects["s3://bkt/out/parquet/job.json"])
    names = [name for name in summary["outputs"] if name.startswith("results/")]
    assert names == ["results/part-000000-0000.parquet"]  # the shards' joined
    assert (summary["format"], summary["shards"]["count"], summary["failed"]) == ("parquet", 3, 1)
    local = tmp_path / "results"
    local.mkdir()
    for name in names:
        (local / name.split("/")[1]).write_bytes(blobs.objects[f"s3://bkt/out/parquet/{name}"])
    table = pyarrow.dataset.dataset(local, format="parquet").to_table()
    assert table.column("index").to_pylist() == list(range(6))
    assert table.column("input").to_pylist() == inputs
    assert table.schema.field("embedding").type == pyarrow.list_(pyarrow.float32(), 32)
    embeddings = table.column("embedding").to_pylist()
    assert embeddings[3] is None and table.column("error").to_pylist()[3]["type"]
    for row, column_row in enumerate(embeddings):
        if row != 3:
            assert np.array_equal(np.array(column_row, np.float32), rows[row])
    counted = duckdb.sql(f"SELECT count(*), count(error) FROM read_parquet('{local}/*.parquet')")
    assert counted.fetchall() == [(6, 1)]


def _embed(
    log_dir: Path,
    inputs: list[str],
    source: InMemoryJobSource,
    blobs: InMemoryBlobStore,
    **fields: Any,
) -> None:
    """Run job `emb` of `inputs` through an embedding model until the queue is drained;
    `fields` join the message's."""
    body = {"job_id": "emb", "inputs": inputs, "output": "s3://bkt/out/emb/"} | fields
    source.send(json.dumps(body))
    run_until_drained(
        source,
        blobs,
        log_dir,
        model="tests.support.stagefns:pixel_embedder",
        postprocess="stages.postprocess:embedding",
        batch_size=4,
    )
