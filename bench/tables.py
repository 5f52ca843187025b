"""Parquet results against JSON lines (issue 25): the daemon's images/s writing each
(`parquet_output_ratio`), and the size of a results file of a million rows in each;
and the time and memory a merge takes to join a sharded job's Parquet files into the
files a run alone writes (issue 40).

    python -m bench.tables --images 3000 --join-mib 200
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path

import numpy
import pyarrow
import pyarrow.parquet

from bench.harness import OVERLAP_JOB_SIZE, OVERLAP_SETTINGS, LatentBlobStore, run_daemon
from worker.datasets.tables import Tables, table_name
from worker.jobs.joblog import configure_daemon_logging
from worker.settings import Settings

JOB_SIZE = OVERLAP_JOB_SIZE
# The default pipeline's fields, as its postprocessor writes them for zeros.
PROBED_FIELDS = (
    b'{"label":"x","class_id":0,"score":0.0,"topk":[{"label":"x","class_id":0,"score":0.0}]}'
)
# The join figure's embeddings, and the daemon's file and row group sizes.
JOIN_DIMENSIONS = 384
DEFAULT_FILE_BYTES = Settings.model_fields["parquet_file_bytes"].default
DEFAULT_ROW_GROUP_BYTES = Settings.model_fields["parquet_row_group_bytes"].default
LABELS = ["circle", "square", "triangle", "star", "cross", "ring", "bar", "dot"]


def parquet_output(work_dir: Path, images: int) -> dict[str, float]:
    """Images/s of the same jobs written as Parquet over as JSON lines (same device
    stand-in, inputs and S3 latency); every Parquet job is read back whole."""
    rates = {}
    jobs = images // JOB_SIZE
    for output_format in ("jsonl", "parquet"):
        blobs = LatentBlobStore(seed=7)
        daemon = run_daemon(
            [JOB_SIZE] * jobs,
            blobs,
            work_dir,
            message={"format": output_format},
            **OVERLAP_SETTINGS,
        )
        rates[output_format] = daemon.items / daemon.wall_s
    for job in range(jobs):
        data = blobs.objects[f"s3://bench/out/job-{job}/{table_name(0, 0)}"]
        rows = pyarrow.parquet.read_table(io.BytesIO(data)).column("index").to_pylist()
        if rows != list(range(JOB_SIZE)):
            raise RuntimeError(f"job-{job}'s Parquet results hold {len(rows)} rows, not each")
    return {
        "parquet_output_ratio": rates["parquet"] / rates["jsonl"],
        "parquet_images_per_s": rates["parquet"],
    }


def results_file_sizes(work_dir: Path, rows: int) -> dict[str, float]:
    """The bytes of a results file of `rows` top-3 classifications in each format, and
    the seconds the finish takes to turn the lines into Parquet."""
    chance = random.Random(rows)

    def line(index: int) -> bytes:
        top = [
            {"label": label, "class_id": LABELS.index(label), "score": round(chance.random(), 6)}
            for label in chance.sample(LABELS, 3)
        ]
        fields = {"label": top[0]["label"], "class_id": top[0]["class_id"]}
        record = {
            "index": index,
            "input": f"s3://photos/2026/11/{index:09d}.jpg",
            **fields,
            "score": top[0]["score"],
            "topk": top,
            "model": "shapes-cnn@22ea4db09406",
        }
        return json.dumps(record, separators=(",", ":")).encode() + b"\n"

    lines = b"".join(line(index) for index in range(rows))
    tables = Tables(file_bytes=2**40, row_group_bytes=64 * 2**20)
    tables.probed(PROBED_FIELDS, {})
    started = time.perf_counter()
    files = tables.write(lines, {}, work_dir / "sizes", ids=False)
    seconds = time.perf_counter() - started
    return {
        "results_jsonl_mib_1m": len(lines) / 2**20 * 1_000_000 / rows,
        "results_parquet_mib_1m": sum(f.stat().st_size for f in files) / 2**20 * 1_000_000 / rows,
        "parquet_finish_us_per_row": seconds / rows * 1e6,
    }


def join_figures(work_dir: Path, mib: int, shards: int = 8) -> dict[str, float]:
    """`Tables.join` of `shards` shards' files holding `mib` MiB of float32 embeddings
    in all (384 a row, as sentence-transformers' small models give, beside an id), with
    the daemon's default sizes, in a process of its own: its seconds, and how much its
    memory grew over what it held before (at its peak)."""
    rows = mib * 2**20 // (JOIN_DIMENSIONS * 4) // shards
    sources = []
    for shard in range(shards):
        first = shard * rows
        embeddings = numpy.random.default_rng(shard).random((rows, JOIN_DIMENSIONS), "float32")
        table = pyarrow.table(
            {
                "index": pyarrow.array(range(first, first + rows), pyarrow.int64()),
                "id": [f"doc-{index:09d}" for index in range(first, first + rows)],
                "embedding": pyarrow.FixedSizeListArray.from_arrays(
                    embeddings.reshape(-1), JOIN_DIMENSIONS
                ),
            }
        )
        sources.append(work_dir / f"shard-{shard}.parquet")
        # In row groups of the daemon's size, as a shard's run writes them.
        group_rows = DEFAULT_ROW_GROUP_BYTES // (JOIN_DIMENSIONS * 4)
        pyarrow.parquet.write_table(table, sources[-1], group_rows, compression="zstd")
    spawned = multiprocessing.get_context("spawn")
    with spawned.Pool(1) as pool:
        seconds, grown, arrow_bytes, files = pool.apply(_timed_join, (sources, work_dir / "joined"))
    return {
        "join_shard_files_mib": sum(path.stat().st_size for path in sources) / 2**20,
        "join_s": seconds,
        "join_peak_rss_mib": grown / 2**20,
        "join_peak_arrow_mib": arrow_bytes / 2**20,
        "join_files": files,
    }


def _timed_join(sources: list[Path], directory: Path) -> tuple[float, int, int, int]:
    """In a fresh process: the seconds `Tables.join` takes, its peak resident memory
    over the process's before it, the most pyarrow's allocator held at once (what the
    rows took, less what the allocator keeps once freed), and the files it wrote."""
    before = _memory_bytes("VmRSS")
    tables = Tables(DEFAULT_FILE_BYTES, DEFAULT_ROW_GROUP_BYTES)
    started = time.perf_counter()
    schema = pyarrow.parquet.read_schema(sources[0])
    files = len(list(tables.join(sources, schema, directory, beat=lambda: None)))
    seconds = time.perf_counter() - started
    arrow_bytes = pyarrow.default_memory_pool().max_memory() or 0
    return seconds, _memory_bytes("VmHWM") - before, arrow_bytes, files


def _memory_bytes(name: str) -> int:
    """A figure of this process's memory from /proc (VmHWM, its peak, is this
    process's own: getrusage's peak carries over from the process that spawned it)."""
    with open("/proc/self/status") as status:
        [kib] = [line.split()[1] for line in status if line.startswith(f"{name}:")]
    return int(kib) * 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000, help="images per format")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the size figure")
    parser.add_argument(
        "--join-mib", type=int, default=200, help="MiB of shards' files the join figure joins"
    )
    return parser


def main() -> None:
    arguments = build_parser().parse_args()
    configure_daemon_logging(io.StringIO())
    with tempfile.TemporaryDirectory() as scratch:
        figures = {
            **parquet_output(Path(scratch), arguments.images),
            **results_file_sizes(Path(scratch), arguments.rows),
            **join_figures(Path(scratch), arguments.join_mib),
        }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
