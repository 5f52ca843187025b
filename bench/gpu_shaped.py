"""Issue 38's shape on this machine: the daemon feeding a device at an H100's speed
(`H100_BASE_MS` + `H100_PER_ITEM_MS` a batch, holding no core: ResNet-50 compiled does
about 11 ms a batch of 128 there) from an S3 with its tail latency (median 30 ms, p99
200 ms), inputs read in 16 preprocessing processes, 512 GETs in flight, a preprocessor
that decodes nothing (nvJPEG decodes on the device there), jobs of 100, batches of 128.

`fetch_efficiency` is the daemon's images/s over the least of what could bound it: the
GETs in flight over the store's mean latency (Little's law), the stand-in device's
rate, and the same run with no latency at all. `longest_stall_ms` is the longest the
device waits, between its first batch and its last, for the next: with inputs in
flight all that time, a wait is the pipeline's doing. The machine's CPU an image, with
latency and without, says how near the run is to the CPU it has (two cores here hold
16 processes reading and answering; every process's counts, so run it on a quiet
machine). The steady rates leave out a run's two ends, which latency lengthens: the
first batch waits for a listing and a GET, the last job for its uploads (the ending:
from the last batch to the last ack).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from bench.harness import (
    NOOP_PREPROCESSOR,
    OVERLAP_JOB_SIZE,
    S3_MEDIAN_MS,
    S3_P99_MS,
    DaemonRun,
    LatentBlobStore,
    run_daemon,
)
from worker.adapters.fakes import InMemoryBlobStore
from worker.telemetry.timeline import Timeline

H100_BASE_MS = 8.0
H100_PER_ITEM_MS = 0.03
SHAPED_BATCH = 128
SHAPED_PROCESSES = 16
SHAPED_IN_FLIGHT = 512
SHAPED_SETTINGS: dict[str, Any] = {
    "model": "bench.harness:h100_device_model",
    "preprocess": NOOP_PREPROCESSOR,
    "batch_size": SHAPED_BATCH,
    "preprocess_workers": SHAPED_PROCESSES,
    "fetch_concurrency": SHAPED_IN_FLIGHT,
    "fetch_in": "preprocess",
}


def gpu_shaped(work_dir: Path, images: int, runs: int, out: Path) -> dict[str, float]:
    """The daemon's images/s at an H100's pace with S3's latency, its fetch efficiency,
    the device's longest wait, the share of GETs hedged, the machine's CPU an image, and
    the steady rate; the same without latency; each the median of `runs`, a run with
    latency and one without taken in turn, so that both medians cover the same stretch
    of the machine's drifting pace; the first run with latency's timeline in
    `out`/gpu-shaped."""
    jobs = [OVERLAP_JOB_SIZE] * max(1, images // OVERLAP_JOB_SIZE)
    with_latency_runs: list[dict[str, float]] = []
    no_latency_runs: list[dict[str, float]] = []
    for run in range(runs):
        latent_store = LatentBlobStore(seed=run, directory=work_dir / f"gpu-shaped-{run}")
        daemon = run_daemon(jobs, latent_store, work_dir, **SHAPED_SETTINGS)
        with_latency_runs.append(
            {
                **_figures(daemon),
                "hedged": _counted(daemon.timeline, "fetch hedged")
                / _counted(daemon.timeline, "fetch calls"),
                "stall_ms": longest_stall_ms(daemon.timeline),
            }
        )
        if run == 0:
            title = f"gpu-shaped: {daemon.items} images, an H100's pace, S3's latency"
            daemon.timeline.write(out / "gpu-shaped", title)
        instant_store = InMemoryBlobStore(work_dir / f"gpu-shaped-no-latency-{run}")
        no_latency_runs.append(
            _figures(run_daemon(jobs, instant_store, work_dir, **SHAPED_SETTINGS))
        )
    with_latency, no_latency = _medians(with_latency_runs), _medians(no_latency_runs)
    bounds = {
        "little": SHAPED_IN_FLIGHT / (mean_latency_ms(S3_MEDIAN_MS, S3_P99_MS) / 1000),
        "device": SHAPED_BATCH / ((H100_BASE_MS + H100_PER_ITEM_MS * SHAPED_BATCH) / 1000),
        "no_latency": no_latency["images_per_s"],
    }
    return {
        "gpu_shaped_images_per_s": with_latency["images_per_s"],
        "gpu_shaped_no_latency_images_per_s": no_latency["images_per_s"],
        "gpu_shaped_littles_law_images_per_s": bounds["little"],
        "gpu_shaped_device_images_per_s": bounds["device"],
        "fetch_efficiency": with_latency["images_per_s"] / min(bounds.values()),
        "longest_stall_ms": with_latency["stall_ms"],
        # GETs made again (the slowest, past the store's 95th percentile) of all made.
        "fetch_hedged_share": with_latency["hedged"],
        # Every process's CPU on this machine, from the first receive to the last delete.
        "gpu_shaped_machine_cpu_ms_per_image": with_latency["machine_cpu_ms_per_image"],
        "gpu_shaped_no_latency_machine_cpu_ms_per_image": no_latency["machine_cpu_ms_per_image"],
        "gpu_shaped_steady_images_per_s": with_latency["steady_images_per_s"],
        "gpu_shaped_no_latency_steady_images_per_s": no_latency["steady_images_per_s"],
        # From the device's last batch to the last job acked: its uploads.
        "gpu_shaped_ending_ms": with_latency["ending_ms"],
        "gpu_shaped_no_latency_ending_ms": no_latency["ending_ms"],
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(figures[name] for figures in runs) for name in runs[0]}


def _figures(daemon: DaemonRun) -> dict[str, float]:
    """What a run gives, with latency or without."""
    return {
        "images_per_s": daemon.items / daemon.wall_s,
        "machine_cpu_ms_per_image": 1000 * daemon.source.machine_cpu_s / daemon.items,
        "steady_images_per_s": steady_images_per_s(daemon.timeline),
        "ending_ms": ending_ms(daemon.timeline, daemon.source.last_ack_s),
    }


def ending_ms(timeline: Timeline, last_ack_s: float, stage: str = "inference") -> float:
    """How long the run went on after the stage's last call ended (`last_ack_s`, when
    its last message was acked, on the timeline's clock: `time.perf_counter`)."""
    return 1000 * (last_ack_s - max(interval.end_s for interval in timeline.intervals(stage)))


def steady_images_per_s(timeline: Timeline, stage: str = "inference") -> float:
    """Items a second through the stage from the batch that brought the run to a tenth
    of its items to the one that brought it to nine tenths: its pace, less its two
    ends. A ValueError if one batch (or none) holds both."""
    ends = sorted(timeline.intervals(stage), key=lambda interval: interval.end_s)
    total = sum(interval.items for interval in ends)
    through, marks = 0, {}
    for interval in ends:
        through += interval.items
        for share in (0.1, 0.9):
            if share not in marks and through >= share * total:
                marks[share] = (interval.end_s, through)
    if len(marks) < 2 or marks[0.1] == marks[0.9]:
        raise ValueError(f"{stage}: too few batches for a steady rate ({len(ends)})")
    (start_s, start_items), (end_s, end_items) = marks[0.1], marks[0.9]
    return (end_items - start_items) / (end_s - start_s)


def _counted(timeline: Timeline, name: str) -> int:
    """A count a stage's processes made (`StageObserver.stage_counted`), at its last."""
    counts = timeline.counts(name)
    return counts[-1][1] if counts else 0


def mean_latency_ms(median_ms: float, p99_ms: float) -> float:
    """The mean of the lognormal latency `LatentBlobStore` draws (its median and 99th
    percentile given): exp(mu + sigma^2 / 2)."""
    sigma = math.log(p99_ms / median_ms) / 2.326
    return median_ms * math.exp(sigma**2 / 2)


def longest_stall_ms(timeline: Timeline, stage: str = "inference") -> float:
    """The longest the stage stood idle between its first call and its last."""
    intervals = sorted(timeline.intervals(stage), key=lambda interval: interval.start_s)
    longest, busy_until = 0.0, None
    for interval in intervals:
        if busy_until is not None and interval.start_s > busy_until:
            longest = max(longest, interval.start_s - busy_until)
        busy_until = max(busy_until or interval.end_s, interval.end_s)
    return 1000 * longest
