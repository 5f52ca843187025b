"""The figures that need a GPU (issues 12, 26 and 38), in one call on a machine that has
one:

    python -m bench.gpu --out bench-out-gpu [--compile]

- `gpu_decode_speedup`: the daemon's images/s with the JPEGs decoded on the GPU
  (`--decode gpu`, nvJPEG) over decoded by Pillow in a preprocessing process per host
  core (`--decode cpu`), ~500x375 photos to 224 px, a model that costs nothing, so
  decoding is what is compared. The GPU run must have decoded on the device, and counts
  the jobs some of whose inputs it sent to the CPU after all (`gpu_decode_fallback_jobs`).
- `gpu_images_per_s` and `gpu_overlap`: the daemon's images/s, and that over the
  model's alone (`gpu_model_only_images_per_s`), a ResNet-50 (torchvision's, random
  weights) in bfloat16 and channels-last on the same photos decoded on the GPU, S3
  latency injected; with `gpu_busy_fraction`, the warm-up's seconds (`gpu_warm_up_s`,
  `gpu_compile_s`: model_ready's) and the run's timeline. The model alone runs as the
  daemon's inference process runs it (`model_alone`): random pixels in a pinned batch,
  one copy in, compiled with `--compile`, each batch's outputs waited for while the
  next is brought in. The daemon's device also decodes, and the model alone does not:
  decoding counts against it.
- `gpu_tar_images_per_s`, `gpu_tar_overlap`: the same from tar shards (a job of 500
  photos a tar, each tar a GET with the injected latency).
- `gpu_two_processes_ratio`: the same daemon with two inference processes on the one
  GPU (`--device cuda:0,cuda:0`) over one.
- `moto_images_per_s`: the same model and photos end to end, the daemon a subprocess
  with real boto3 against a moto server on this machine (S3 and SQS over HTTP), from
  the first job received to the last finished (their job.json); its timeline in
  `moto/`.
- `host_ceiling_items_per_s`: the control plane alone (`bench.run.host_ceiling`) with
  this machine's cores.
- `batch_ms_*` (`inference_profile`): the inference stage's function alone on a batch
  of photos, decoding then the model, one batch at a time and one ahead as the daemon
  runs it; torch.profiler's table in `profile.txt`.

`--only` picks steps (`STEPS`); `--quick` runs small sizes, and on a machine without a
GPU the model that costs nothing, decoding on the CPU, skipping the steps that need
nvJPEG: a smoke test of the code, not a figure. Not part of `make bench`, which runs on
the CPU. `tests/test_bench.py` and `tests/test_bench_gpu.py` run the steps on the CPU
with a stand-in for nvJPEG and a small model, for their correctness only.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs

from bench.gpu_inference import (
    GPU_BATCH_SIZE,
    MODEL_SETTINGS,
    inference_profile,
    model_alone,
    photos,
)
from bench.harness import NOOP_MODEL, OVERLAP_JOB_SIZE, LatentBlobStore, run_daemon
from bench.processes import MOTO_UPLOADS, draining_daemon, moto_stack
from bench.run import host_ceiling
from worker.adapters.fakes import InMemoryBlobStore
from worker.demo import read_output
from worker.jobs.joblog import configure_daemon_logging

CORES = os.cpu_count() or 1  # a preprocessing process each, in every figure here


def decode_speedup(
    work_dir: Path, images: int, *, device: str, preprocess: str
) -> dict[str, float]:
    """`--decode gpu` over `--decode cpu`: images/s of the same photos, the model free,
    a preprocessing process per core either way."""
    pool, jobs = photos(), [OVERLAP_JOB_SIZE] * (images // OVERLAP_JOB_SIZE)
    rates, fallback_jobs = {}, 0
    for placement in ("cpu", "gpu"):
        blobs = InMemoryBlobStore(work_dir / f"decode-{placement}")  # read where decoded
        with capture_logs() as logs:
            daemon = run_daemon(
                jobs,
                blobs,
                work_dir,
                pool=pool,
                model=NOOP_MODEL,
                preprocess=preprocess,
                device=device,
                decode=placement,
                batch_size=GPU_BATCH_SIZE,
                preprocess_workers=CORES,
                preprocess_workers_max=CORES,
                fetch_concurrency=8 * CORES,
            )
        (decided,) = [event for event in logs if event["event"] == "inputs_decoded_in"]
        if (decided["where"] == "inference") != (placement == "gpu"):
            raise RuntimeError(f"--decode {placement}: decoded in {decided}")
        rates[placement] = daemon.items / daemon.wall_s
        if placement == "gpu":  # a batch's fallbacks are in the log of each job it held
            fallback_jobs = sum(
                b'"decoded_on_cpu"' in data
                for uri, data in blobs.objects.items()
                if uri.endswith("/job.log")
            )
    return {
        "gpu_decode_speedup": rates["gpu"] / rates["cpu"],
        "decode_cpu_images_per_s": rates["cpu"],
        "decode_gpu_images_per_s": rates["gpu"],
        "gpu_decode_fallback_jobs": float(fallback_jobs),
        "decode_cpu_processes": float(CORES),
    }


TAR_JOB_SIZE = 500  # photos a tar shard


def daemon_run(
    work_dir: Path, images: int, out: Path, *, tars: bool = False, **settings: Any
) -> dict[str, Any]:
    """One run of the daemon over `images` photos from S3 with latency injected (inputs
    fetched in the preprocessing processes, or as tar shards): its images/s, the
    inference lane's busy fraction, and its model's warm-up (model_ready's); its
    timeline written to `out`."""
    job_size = TAR_JOB_SIZE if tars else OVERLAP_JOB_SIZE
    objects = work_dir / f"objects-{'tars' if tars else 'photos'}-{time.monotonic_ns()}"
    with capture_logs() as logs:
        daemon = run_daemon(
            [job_size] * max(1, images // job_size),
            LatentBlobStore(directory=None if tars else objects),
            work_dir,
            tars=tars,
            **settings,
        )
    ready = next(event for event in logs if event["event"] == "model_ready")
    start = daemon.source.first_receive_s
    busy = daemon.timeline.busy_s("inference", start, start + daemon.wall_s) / daemon.wall_s
    kind = "tar shards" if tars else "objects"
    daemon.timeline.write(out, f"{daemon.items} images from {kind}, S3 latency injected")
    return {"images_per_s": daemon.items / daemon.wall_s, "busy": busy, "warm_up": ready["warm_up"]}


def gpu_overlap(
    work_dir: Path,
    images: int,
    out: Path,
    *,
    device: str,
    model: str,
    preprocess: str,
    two_processes: bool = True,
    model_only: dict[str, float] | None = None,
    **settings: Any,
) -> dict[str, float]:
    """The daemon, and it over the model alone, photos decoded on the device, bf16,
    channels-last (`settings` change those, `compile` among them); then the daemon with
    two inference processes on the device over it with one."""
    common = _daemon_settings(model, preprocess, settings)
    run = daemon_run(work_dir, images, out, device=device, **common)
    alone = model_only or _model_only(images, device, model, preprocess, settings)
    warm_up = run["warm_up"]
    figures = {
        "gpu_images_per_s": run["images_per_s"],
        "gpu_overlap": run["images_per_s"] / alone["images_per_s"],
        "gpu_busy_fraction": run["busy"],
        "gpu_daemon_images_per_s": run["images_per_s"],
        "gpu_model_only_images_per_s": alone["images_per_s"],
        "gpu_model_only_compile_s": alone["compile_s"],
        "gpu_warm_up_s": warm_up["seconds"],
        "gpu_compile_s": warm_up.get("compile_s", 0.0),
        # Whether the daemon's model was compiled as asked (the setting reached it).
        "gpu_daemon_compiled": float(bool(warm_up.get("compiled"))),
    }
    if two_processes:
        two = daemon_run(
            work_dir, images, out / "two-processes", device=f"{device},{device}", **common
        )
        figures["gpu_two_processes_ratio"] = two["images_per_s"] / run["images_per_s"]
        figures["gpu_two_processes_images_per_s"] = two["images_per_s"]
    return figures


def gpu_tar_shards(
    work_dir: Path,
    images: int,
    out: Path,
    *,
    device: str,
    model: str,
    preprocess: str,
    model_only: dict[str, float] | None = None,
    **settings: Any,
) -> dict[str, float]:
    """`gpu_overlap`'s run with its photos in tar shards (a GET a tar of 500)."""
    common = _daemon_settings(model, preprocess, settings)
    run = daemon_run(work_dir, images, out / "tar-shards", tars=True, device=device, **common)
    alone = model_only or _model_only(images, device, model, preprocess, settings)
    return {
        "gpu_tar_images_per_s": run["images_per_s"],
        "gpu_tar_overlap": run["images_per_s"] / alone["images_per_s"],
        "gpu_tar_busy_fraction": run["busy"],
    }


def _daemon_settings(model: str, preprocess: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "pool": photos(),
        "model": model,
        "preprocess": preprocess,
        "preprocess_workers": CORES,
        # 30 ms a GET: 32 a process keep about 1,000 images/s a process coming (512 at most).
        "fetch_concurrency": min(512, 32 * CORES),
        **MODEL_SETTINGS,
        **settings,
    }


def _model_only(
    images: int, device: str, model: str, preprocess: str, settings: dict[str, Any]
) -> dict[str, float]:
    size = settings.get("batch_size", GPU_BATCH_SIZE)
    batches = max(10, images // size // 2)
    return model_alone(batches, device=device, model=model, preprocess=preprocess, **settings)


def moto_end_to_end(
    work_dir: Path,
    images: int,
    out: Path,
    *,
    device: str,
    model: str,
    preprocess: str,
    **more: Any,
) -> dict[str, float]:
    """The daemon as a subprocess, real boto3 against a moto server here, the overlap
    figure's model and photos: images/s from the first job's receive to the last job's
    finish, as their job.json files say."""
    pool = photos()
    with moto_stack("gpu-end-to-end") as (env, sqs, s3, stack):
        keys = [f"photos/{number}.jpg" for number in range(images)]
        with ThreadPoolExecutor(MOTO_UPLOADS) as uploads:
            for number, key in enumerate(keys):
                uploads.submit(
                    s3.put_object, Bucket=stack.bucket, Key=key, Body=pool[number % len(pool)]
                )
        outputs = []
        for job, first in enumerate(range(0, images, OVERLAP_JOB_SIZE)):
            outputs.append(f"s3://{stack.bucket}/out/{job}/")
            inputs = [
                f"s3://{stack.bucket}/{key}" for key in keys[first : first + OVERLAP_JOB_SIZE]
            ]
            sqs.send_message(
                QueueUrl=stack.queue_url,
                MessageBody=json.dumps({"inputs": inputs, "output": outputs[-1]}),
            )
        settings = {
            **{"device": device, "model": model, "preprocess": preprocess, **MODEL_SETTINGS},
            **{"preprocess_workers": CORES, "fetch_concurrency": 8 * CORES, **more},
            "timeline_dir": out / "moto",
        }
        command = draining_daemon(stack, work_dir / "moto-logs", *as_flags(settings))
        run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"the daemon exited {run.returncode}: {run.stderr[-2000:]}")
        summaries = [json.loads(read_output(s3, output, "job.json")) for output in outputs]
    if any(summary["status"] != "succeeded" for summary in summaries):
        raise RuntimeError(f"not every job succeeded: {[s['status'] for s in summaries]}")
    began = min(datetime.fromisoformat(summary["received_at"]) for summary in summaries)
    ended = max(datetime.fromisoformat(summary["finished_at"]) for summary in summaries)
    return {"moto_images_per_s": images / (ended - began).total_seconds()}


def as_flags(settings: dict[str, Any]) -> list[str]:
    """`python -m worker run`'s flags for the settings: a true one alone, a false one
    not at all (its default), others valued."""
    flags: list[str] = []
    for name, value in settings.items():
        if value is False:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return device


# The steps `--only` picks from, in the order they run.
STEPS = ("decode", "overlap", "two", "tars", "moto", "host", "profile")
# Those that need nvJPEG (and so a GPU): skipped by `--quick` without one.
NVJPEG_STEPS = frozenset({"decode", "profile"})
QUICK = {"images": 400, "moto_images": 16, "host_items": 1000, "profile_batches": 3}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out-gpu"))
    parser.add_argument("--images", type=int, default=10000, help="per run (default 10000)")
    parser.add_argument("--moto-images", type=int, default=2000, help="through moto (default 2000)")
    parser.add_argument(
        "--host-items", type=int, default=20000, help="for the host ceiling (default 20000)"
    )
    parser.add_argument(
        "--profile-batches", type=int, default=20, help="timed per step (default 20)"
    )
    parser.add_argument("--device", default="cuda", help="the model's device (default cuda)")
    parser.add_argument("--model", default="bench.gpu_inference:resnet50", help="for gpu_overlap")
    parser.add_argument("--preprocess", default="bench.gpu_inference:photo_preprocessor")
    parser.add_argument(
        "--batch-size", type=int, default=GPU_BATCH_SIZE, help=f"default {GPU_BATCH_SIZE}"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the model compiled (the daemon's --compile), in every step that runs it",
    )
    parser.add_argument(
        "--only",
        default=",".join(STEPS),
        help=f"the steps to run, comma-separated (default all: {','.join(STEPS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes; without a GPU, the model that costs nothing on the CPU, decoding "
        "there, and no step that needs nvJPEG (a smoke test)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = [step.strip() for step in args.only.split(",") if step.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--only: no step {', '.join(unknown)} (the steps: {', '.join(STEPS)})")
    settings: dict[str, Any] = {"batch_size": args.batch_size, "compile": args.compile}
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, min(getattr(args, name), value))
        if not (args.device.startswith("cuda") and torch.cuda.is_available()):
            args.device, args.model = "cpu", NOOP_MODEL
            settings["decode"] = "auto"  # the CPU, where nvJPEG is not
            steps = [step for step in steps if step not in NVJPEG_STEPS]
    args.out.mkdir(parents=True, exist_ok=True)
    configure_daemon_logging(io.StringIO())  # the daemons' own logs are not the point here
    report: dict[str, Any] = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "images": args.images,
        "batch_size": args.batch_size,
        "compiled": args.compile,
        "steps": steps,
    }
    # A daemon past its shutdown tail (slowed by a profiler sampling every process) can
    # return while its closing thread still writes objects here, as one profiled run's
    # cleanup found: the figures are out by then, and a scratch file must not fail it.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as scratch:
        work_dir = Path(scratch)
        modelled = {
            "device": args.device,
            "model": args.model,
            "preprocess": args.preprocess,
            **settings,
        }
        alone = functools.cache(
            lambda: _model_only(args.images, args.device, args.model, args.preprocess, settings)
        )
        runs: dict[str, Callable[[], dict[str, float]]] = {
            "decode": lambda: decode_speedup(
                work_dir, args.images, device=args.device, preprocess=args.preprocess
            ),
            "overlap": lambda: gpu_overlap(
                work_dir,
                args.images,
                args.out,
                two_processes="two" in steps,
                model_only=alone(),
                **modelled,
            ),
            "tars": lambda: gpu_tar_shards(
                work_dir, args.images, args.out, model_only=alone(), **modelled
            ),
            "moto": lambda: moto_end_to_end(work_dir, args.moto_images, args.out, **modelled),
            "host": lambda: host_ceiling(work_dir / "host", args.host_items),
            "profile": lambda: inference_profile(args.out, args.profile_batches, **modelled),
        }
        for step in [step for step in STEPS if step in steps and step in runs]:
            # Each step's figures written as they come: a later one may fail.
            figures = runs[step]()
            print(json.dumps({step: figures}), flush=True)
            report.update(figures)
            (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
