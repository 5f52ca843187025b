"""`worker bench` with a model of one's own: the figures are measured, not assumed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.admission import admission
from bench.gpu import decode_speedup, gpu_overlap, moto_end_to_end
from bench.processes import exited_process_cpu_s, fetch_clients
from bench.run import array_output, host_ceiling
from bench.scaling import control_plane_scaling
from tests.support.paths import REPO
from worker.adapters.fakes import InMemoryBlobStore


@pytest.mark.bench
@pytest.mark.e2e
def test_bench_runs_the_overlap_figure_on_any_model(tmp_path: Path) -> None:
    """A model that takes 0.1 s a batch of 16 runs at 160 images/s alone; the daemon
    moves 200 images (2 jobs of 100) through it no faster than that, its ratio is the
    one reported, and the timeline shows every image in batches of at most 16."""
    bench = subprocess.run(
        [
            *(sys.executable, "-m", "worker", "bench", "--out", str(tmp_path)),
            *(
                "--model",
                "tests.support.slow_model:tenth_of_a_second_on_any_batch",
                "--batch-size",
                "16",
            ),
            *("--images", "200", "--device", "cpu"),
        ],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["model"] == "tests.support.slow_model:tenth_of_a_second_on_any_batch"
    assert (report["images"], report["batch_size"]) == (200, 16)
    assert 130 <= report["model_only_images_per_s"] <= 161
    assert 0.3 <= report["overlap_ratio"] <= 1.01
    daemon_rate = report["overlap_ratio"] * report["model_only_images_per_s"]
    assert report["daemon_images_per_s"] == pytest.approx(daemon_rate)
    assert 0.3 <= report["busy_fraction"] <= 1.0
    trace = json.loads((tmp_path / "timeline.json").read_text())
    batches = [e["args"]["items"] for e in trace["traceEvents"] if e["name"] == "inference"]
    assert sum(batches) == 200 and max(batches) <= 16
    assert (tmp_path / "timeline.png").stat().st_size > 0


BURNER = """
import subprocess, sys, time
def burn(seconds):
    while time.process_time() < seconds:
        pass
if sys.argv[1] == "child":
    burn(1.0)
else:
    burn(0.6)
    subprocess.run([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]], check=True)
"""


def test_a_process_cpu_is_its_own_not_its_childrens() -> None:
    """`host_cpu_ms_per_item` reads the daemon's own CPU at its exit: a process that
    burns 0.6 s of CPU and then waits for a child burning 1 s reads 0.6 s, not 1.6."""
    process = subprocess.Popen([sys.executable, "-c", BURNER, "parent", BURNER], text=True)
    cpu_s = exited_process_cpu_s(process)
    assert process.returncode == 0
    assert 0.55 <= cpu_s <= 0.95, cpu_s


@pytest.mark.bench
def test_the_host_ceiling_moves_every_item_of_its_jobs(tmp_path: Path) -> None:
    """The control-plane figure is a real run on the daemon's S3 path: both 500-item
    jobs finish, every item succeeded, the preprocessing processes read every input
    (this process none), and the rate and CPU per item it reports are positive."""
    blobs = InMemoryBlobStore(tmp_path / "objects")
    figures = host_ceiling(tmp_path, 1000, blobs)
    assert not [uri for uri in blobs.reads if uri.startswith("s3://bench/in/")]
    for job in ("job-0", "job-1"):
        summary = json.loads(blobs.objects[f"s3://bench/out/{job}/job.json"])
        assert (summary["status"], summary["succeeded"]) == ("succeeded", 500)
    assert figures["host_ceiling_items_per_s"] > 0 and figures["host_cpu_ms_per_item_fakes"] > 0


@pytest.mark.bench
def test_each_fetch_client_reads_every_object_whole() -> None:
    """The clients' figures come from real reads: each candidate, in a process of its
    own, reads every object back whole from a moto server (else the step raises)."""
    figures = fetch_clients(5)
    for client in ("boto3", "obstore"):
        assert figures[f"fetch_cpu_ms_per_get_{client}"] > 0
        assert figures[f"fetch_gets_per_s_{client}"] > 0


@pytest.mark.bench
def test_the_array_output_figure_checks_every_row_it_wrote(tmp_path: Path) -> None:
    """`array_output` runs the classifier and the embedding model over the same jobs and
    raises unless each job's embedding.npy holds a (non-zero) row per input."""
    report = array_output(tmp_path, 100)
    assert set(report) == {"array_output_ratio", "embedding_images_per_s"}
    assert report["array_output_ratio"] > 0


# `bench.gpu` on the CPU, with a stand-in for nvJPEG (no GPU here), and a model that
# costs nothing: these tests are about the steps, not the speed of a model (the device
# stand-in's sleeps, in its warm-ups and the model-only baselines, were most of their time).
PHOTO_DECODER = "tests.support.faults:standin_photo_decoder"
MODELLED = {"device": "cpu", "model": "bench.harness:noop_model", "preprocess": PHOTO_DECODER}


@pytest.mark.bench
def test_the_gpu_decode_figure_compares_runs_that_decoded_where_they_were_asked(
    tmp_path: Path,
) -> None:
    """A run that decoded every photo in the preprocessing processes against one that
    decoded them in the model's process, none sent back to the CPU."""
    report = decode_speedup(tmp_path, 100, device="cpu", preprocess=PHOTO_DECODER)
    assert report["gpu_decode_fallback_jobs"] == 0
    assert report["decode_cpu_images_per_s"] > 0 and report["decode_gpu_images_per_s"] > 0


@pytest.mark.bench
def test_the_gpu_overlap_figure_runs_one_and_two_inference_processes(tmp_path: Path) -> None:
    """In bfloat16 and channels-last on photos decoded in the model's process, with one
    inference process and with two, each run's timeline drawn."""
    out = tmp_path / "out"
    figures = gpu_overlap(tmp_path, 100, out, **MODELLED)
    assert figures["gpu_overlap"] > 0 and 0 < figures["gpu_busy_fraction"] <= 1
    assert figures["gpu_two_processes_ratio"] > 0
    assert (out / "timeline.png").is_file() and (out / "two-processes/timeline.png").is_file()


@pytest.mark.bench
def test_the_gpu_end_to_end_figure_runs_the_daemon_against_moto(tmp_path: Path) -> None:
    """One job of 16 photos (fewer than a job holds at most) through the daemon subprocess."""
    out = tmp_path / "out"
    assert moto_end_to_end(tmp_path, 16, out, **MODELLED)["moto_images_per_s"] > 0
    assert (out / "moto/timeline.png").is_file()


@pytest.mark.bench
def test_the_admission_figure_times_the_small_job_from_the_first_receive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-image job alone and beside a prefix job (of 3,000 objects here, listed a
    page every 0.2 s): each timed to its job.json, the daemon stopped then."""
    monkeypatch.setattr("bench.admission.PREFIX_OBJECTS", 3000)
    monkeypatch.setattr("bench.admission.LIST_PAGE_S", 0.2)
    figures = admission(tmp_path, 1)
    assert figures["small_job_idle_s"] > 0 and figures["small_job_beside_a_prefix_s"] > 0


@pytest.mark.bench
def test_the_scaling_figure_runs_the_control_plane_at_each_process_count(
    tmp_path: Path,
) -> None:
    """One and two preprocessing processes over a job of 500 items: each count's rate and
    CPU per item, and the main process's growth between them."""
    figures = control_plane_scaling(tmp_path, 500, counts=(1, 2))
    for count in (1, 2):
        assert figures[f"scaling_{count}_items_per_s"] > 0
        assert figures[f"scaling_{count}_main_cpu_ms_per_item"] > 0
    assert figures["main_cpu_growth"] > 0
