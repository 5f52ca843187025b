"""`python -m bench.gpu`'s new steps (issue 38, point 7): the model alone as the daemon
runs it, compiled when asked; the daemon's warm-up and compile time; the same run from
tar shards; `--quick` and `--only`. On the CPU these check the code, not a GPU's speed;
on a GPU (`make test-gpu`) a small run of the real steps, nvJPEG and all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import main
from bench.gpu_inference import model_alone
from tests.support.markers import needs_gpu

SMALL = {
    "model": "tests.support.device_models:row_means",
    "preprocess": "stages.preprocess:default_preprocessor",
    "batch_size": 4,
}


@pytest.mark.bench
def test_the_model_alone_runs_as_the_daemon_runs_it_and_compiled_when_asked() -> None:
    """The baseline of every overlap figure runs the inference process's own function,
    one batch ahead, and with `compile` the model compiled first: it says how long
    that took (nothing when not compiled)."""
    eager = model_alone(3, device="cpu", **SMALL)
    compiled = model_alone(3, device="cpu", compile=True, **SMALL)
    assert eager["images_per_s"] > 0 and compiled["images_per_s"] > 0
    assert eager["compile_s"] == 0 and compiled["compile_s"] > 0


@pytest.mark.bench
def test_quick_runs_what_a_cpu_can_and_writes_each_step_s_figures(tmp_path: Path) -> None:
    """`--quick` on the CPU: the model that costs nothing, decoding in the preprocessing
    processes, the steps that need nvJPEG left out; the daemon's images/s, its overlap
    with the model alone, its warm-up, and the same from tar shards, in report.json."""
    out = tmp_path / "out"
    assert (
        main(["--quick", "--device", "cpu", "--only", "overlap,tars,profile", "--out", str(out)])
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == ["overlap", "tars"]
    for figure in ("gpu_images_per_s", "gpu_overlap", "gpu_tar_images_per_s", "gpu_tar_overlap"):
        assert report[figure] > 0, figure
    assert report["gpu_warm_up_s"] >= 0 and report["gpu_compile_s"] == 0
    assert report["gpu_daemon_compiled"] == 0 and report["compiled"] is False
    assert (out / "timeline.png").is_file() and (out / "tar-shards/timeline.png").is_file()
    with pytest.raises(SystemExit):
        main(["--only", "overlap,nope", "--out", str(out)])


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_the_bench_s_steps_run_with_nvjpeg(tmp_path: Path) -> None:
    """A small run of the overlap, tar-shard and profile steps on the GPU with nvJPEG
    and the default model: every figure there, the profile's table written."""
    out = tmp_path / "out"
    args = ["--only", "overlap,tars,profile", "--images", "256", "--profile-batches", "3"]
    args += ["--model", "stages.model:default_classifier", "--batch-size", "32"]
    args += ["--out", str(out)]  # the photos to 224 px, left for nvJPEG
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    for figure in ("gpu_overlap", "gpu_tar_overlap", "batch_ms_pipelined", "batch_ms_model"):
        assert report[figure] > 0, figure
    assert (out / "profile.txt").is_file()
