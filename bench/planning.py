"""Planning a Parquet table of texts into row ranges (issue 40): the CPU a planner
spends on a table of `--rows` rows in `--files` files, from its listing to its shards'
inputs files, the path admission takes (`InputReader` over the footers,
`RequestDigest`, the `Snapshot`, `shards_of` and `shard_lines`), over the in-memory
fakes: S3's latency is not in it, only the work that grows with the rows.

    python -m bench.planning --rows 20000000 --files 20
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from worker.adapters.fakes import InMemoryBlobStore
from worker.datasets.disk import DiskBudget
from worker.datasets.inputs import InputReader, shard_lines
from worker.jobs.checkpoints import RequestDigest
from worker.message import parse_job_message
from worker.sharding.planning import Snapshot, shards_of

SHARD_ITEMS = 10_000


def planning_cpu_s(rows: int, files: int) -> dict[str, float]:
    """CPU seconds to plan a table of `rows` rows in `files` files (as equal as they
    divide), and the bytes of the shards' inputs files written."""
    blobs = InMemoryBlobStore()
    file_rows = rows // files
    sink = io.BytesIO()
    table = pa.table({"id": range(file_rows), "body": pa.repeat("a text", file_rows)})
    pq.write_table(table, sink, row_group_size=2**20)
    for number in range(files):
        blobs.objects[f"s3://bkt/table/{number:05d}.parquet"] = sink.getvalue()
    message = {
        "job_id": "planned",
        "table": {"uri": "s3://bkt/table/", "text_column": "body", "id_column": "id"},
        "output": "s3://bkt/out/",
        "shard_items": SHARD_ITEMS,
    }
    spec = parse_job_message(json.dumps(message), frozenset())
    reader = InputReader(blobs, frozenset(), 2**30, shard_items=SHARD_ITEMS)
    started = time.process_time()
    digest = RequestDigest()
    with (
        tempfile.TemporaryDirectory() as directory,
        Snapshot(Path(directory), DiskBudget(2**32).claim()) as snapshot,
    ):
        for listed in reader.inputs(spec):
            digest.add(*listed)
            snapshot.add(listed)
        listed_s = time.process_time() - started
        written = sum(
            len(b"".join(shard_lines(shard))) for shard in shards_of(snapshot.inputs(), SHARD_ITEMS)
        )
    total_s = time.process_time() - started
    return {
        "rows": float(file_rows * files),
        "planning_cpu_s": total_s,
        "listing_and_digest_cpu_s": listed_s,
        "planning_us_per_row": total_s / (file_rows * files) * 1e6,
        "inputs_files_bytes": float(written),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000, help="the table's rows")
    parser.add_argument("--files", type=int, default=20, help="the Parquet files holding them")
    args = parser.parse_args()
    print(json.dumps(planning_cpu_s(args.rows, args.files), indent=2))


if __name__ == "__main__":
    main()
