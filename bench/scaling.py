"""A control plane that scales with cores (issue 38, point 4): the daemon's rate and
CPU per item as its preprocessing processes grow, the control plane alone (a null
model, a preprocess that decodes nothing, in-process fakes, inputs read from files in
the preprocessing processes as they would be from S3).

`main_cpu_ms_per_item` is the daemon's own process (the one that receives, feeds,
regroups and finishes); `machine_cpu_ms_per_item` is every process on the machine
(the stage processes too), from /proc/stat, so run it on a quiet machine. Both from
the first receive to the last ack, so the processes' start is not counted.
`items_per_answer` is how many items a preprocessing process's answer holds on
average (each answer is two messages to the daemon's process, each request one): a
count, which a loaded machine distorts less than it does CPU time. Each figure is the
median of `runs`, the counts taken in turn in each round, so that the load of a
shared machine falls on all of them alike.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from bench.harness import HOST_JOB_SIZE, NOOP_MODEL, NOOP_PREPROCESSOR, run_daemon
from worker.adapters.fakes import InMemoryBlobStore

PROCESS_COUNTS = (2, 4, 8, 16)


def control_plane_scaling(
    work_dir: Path, items: int, counts: tuple[int, ...] = PROCESS_COUNTS, runs: int = 1
) -> dict[str, float]:
    """Per count of preprocessing processes: items/s, the main process's and the whole
    machine's CPU per item, items per answer; and how much the main process's CPU grows
    from the fewest processes to the most (`main_cpu_growth`, 1.0 where it does not)."""
    measured: dict[str, list[float]] = defaultdict(list)
    for run in range(runs):
        for count in counts:
            blobs = InMemoryBlobStore(work_dir / f"scaling-{count}-{run}")
            daemon = run_daemon(
                [HOST_JOB_SIZE] * max(1, items // HOST_JOB_SIZE),
                blobs,
                work_dir,
                model=NOOP_MODEL,
                preprocess=NOOP_PREPROCESSOR,
                batch_size=256,
                preprocess_workers=count,
                preprocess_workers_max=count,
            )
            source, done = daemon.source, daemon.items
            answers = len(daemon.timeline.intervals("preprocess"))
            measured[f"scaling_{count}_items_per_s"].append(done / daemon.wall_s)
            measured[f"scaling_{count}_main_cpu_ms_per_item"].append(1000 * source.cpu_s / done)
            measured[f"scaling_{count}_machine_cpu_ms_per_item"].append(
                1000 * source.machine_cpu_s / done
            )
            measured[f"scaling_{count}_items_per_answer"].append(done / max(1, answers))
    figures = {name: statistics.median(values) for name, values in measured.items()}
    fewest, most = min(counts), max(counts)
    figures["main_cpu_growth"] = (
        figures[f"scaling_{most}_main_cpu_ms_per_item"]
        / figures[f"scaling_{fewest}_main_cpu_ms_per_item"]
    )
    return figures
