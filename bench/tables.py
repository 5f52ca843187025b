"""Parquet results against JSON lines (issue 25): the daemon's images/s writing each
(`parquet_output_ratio`), and the size of a results file of a million rows in each.

    python -m bench.tables --images 3000
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow.parquet

from bench.harness import OVERLAP_JOB_SIZE, OVERLAP_SETTINGS, LatentBlobStore, run_daemon
from worker.datasets.tables import Tables, table_name
from worker.jobs.joblog import configure_daemon_logging

JOB_SIZE = OVERLAP_JOB_SIZE
# The default pipeline's fields, as its postprocessor writes them for zeros.
PROBED_FIELDS = (
    b'{"label":"x","class_id":0,"score":0.0,"topk":[{"label":"x","class_id":0,"score":0.0}]}'
)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000, help="images per format")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the size figure")
    return parser


def main() -> None:
    arguments = build_parser().parse_args()
    configure_daemon_logging(io.StringIO())
    with tempfile.TemporaryDirectory() as scratch:
        figures = {
            **parquet_output(Path(scratch), arguments.images),
            **results_file_sizes(Path(scratch), arguments.rows),
        }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
