"""`worker bench` with a model of one's own: the figures are measured, not assumed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.e2e
def test_bench_runs_the_overlap_figure_on_any_model(tmp_path: Path) -> None:
    """A model that takes 0.1 s a batch of 16 runs at 160 images/s alone; the daemon
    moves 300 images (3 jobs of 100) through it no faster than that, its ratio is the
    one reported, and the timeline shows every image in batches of at most 16."""
    bench = subprocess.run(
        [
            *(sys.executable, "-m", "worker", "bench", "--out", str(tmp_path)),
            *("--model", "tests.slow_model:tenth_of_a_second_on_any_batch", "--batch-size", "16"),
            *("--images", "300", "--device", "cpu"),
        ],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["model"] == "tests.slow_model:tenth_of_a_second_on_any_batch"
    assert (report["images"], report["batch_size"]) == (300, 16)
    assert 130 <= report["model_only_images_per_s"] <= 161
    assert 0.3 <= report["overlap_ratio"] <= 1.01
    daemon_rate = report["overlap_ratio"] * report["model_only_images_per_s"]
    assert report["daemon_images_per_s"] == pytest.approx(daemon_rate)
    assert 0.3 <= report["busy_fraction"] <= 1.0
    trace = json.loads((tmp_path / "timeline.json").read_text())
    batches = [e["args"]["items"] for e in trace["traceEvents"] if e["name"] == "inference"]
    assert sum(batches) == 300 and max(batches) <= 16
    assert (tmp_path / "timeline.png").stat().st_size > 0
