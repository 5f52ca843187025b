"""The figures that need a GPU (issues 12 and 26), in one call on a machine that has one:

    python -m bench.gpu --out bench-out-gpu

- `gpu_decode_speedup`: the daemon's images/s with the JPEGs decoded on the GPU
  (`--decode gpu`, nvJPEG) over decoded by Pillow in a preprocessing process per host
  core (`--decode cpu`), ~500x375 photos to 224 px, a model that costs nothing, so
  decoding is what is compared. The GPU run must have decoded on the device, and counts
  the jobs some of whose inputs it sent to the CPU after all (`gpu_decode_fallback_jobs`).
- `gpu_overlap`: the daemon's images/s over the model's alone, a ResNet-50 (torchvision's,
  random weights) in bfloat16 and channels-last on the same photos decoded on the GPU,
  S3 latency injected; with `gpu_busy_fraction` and the run's timeline. The daemon's
  device also decodes, and the model alone does not: decoding counts against it.
- `gpu_two_processes_ratio`: the same daemon with two inference processes on the one
  GPU (`--device cuda:0,cuda:0`) over one.
- `moto_images_per_s`: the same model and photos end to end, the daemon a subprocess
  with real boto3 against a moto server on this machine (S3 and SQS over HTTP), from
  the first job received to the last finished (their job.json); its timeline in
  `moto/`.
- `host_ceiling_items_per_s`: the control plane alone (`bench.run.host_ceiling`) with
  this machine's cores.

Not part of `make bench`, which runs on the CPU. `tests/test_bench.py` runs the steps
on the CPU with a stand-in for nvJPEG and a small model, for their correctness only.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from structlog.testing import capture_logs
from torch import nn

from bench.harness import NOOP_MODEL, OVERLAP_JOB_SIZE, run_daemon
from bench.processes import MOTO_UPLOADS, draining_daemon, moto_stack
from bench.run import host_ceiling, overlap
from stages.model import Classifier
from stages.preprocess import ImagePreprocessor
from stages.synthetic import LABELS, draw_shape
from worker.adapters.fakes import InMemoryBlobStore
from worker.demo import read_output
from worker.jobs.joblog import configure_daemon_logging
from worker.plugins.device_decoding import decode_or_defer
from worker.plugins.loading import load_device_decoder, load_preprocessor
from worker.plugins.setups import inference_setup

PHOTO_SIZE = (500, 375)
PHOTOS = 64  # distinct photos, reused under many keys
GPU_BATCH_SIZE = 128
CORES = os.cpu_count() or 1  # a preprocessing process each, in every figure here
photo_preprocessor = ImagePreprocessor(size=224)


def photos(count: int = PHOTOS, seed: int = 17) -> list[bytes]:
    """`count` 500x375 JPEGs (quality 90) of a shape on a noisy background: about the
    bytes and decoding work of a phone photo scaled for the web."""
    rng = random.Random(seed)
    made = []
    for number in range(count):
        side = PHOTO_SIZE[1]
        shape = draw_shape(LABELS[number % len(LABELS)], rng, side)
        noise = Image.effect_noise(PHOTO_SIZE, rng.uniform(20, 60)).convert("RGB")
        photo = Image.blend(noise, Image.new("RGB", PHOTO_SIZE, shape.getpixel((0, 0))), 0.6)
        photo.paste(shape, (rng.randrange(PHOTO_SIZE[0] - side + 1), 0))
        buffer = io.BytesIO()
        photo.save(buffer, format="JPEG", quality=90)
        made.append(buffer.getvalue())
    return made


class ResNet50(Classifier):
    """torchvision's ResNet-50 (random weights: speed is the point), taking uint8 batches."""

    model_name = "resnet50-random"


def top_class(scores: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    """An ImageNet model's best class and its score (the shapes' labels do not apply)."""
    best = int(np.argmax(scores))
    return {"class_id": best, "score": round(float(scores[best]), 6)}


def resnet50() -> nn.Module:
    from torchvision.models import resnet50 as torchvision_resnet50

    return ResNet50(torchvision_resnet50()).eval()


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


# How the daemon runs the ResNet-50 in every figure but the decoding one.
MODEL_SETTINGS: dict[str, Any] = {
    "postprocess": "bench.gpu:top_class",
    "decode": "gpu",
    "precision": "bfloat16",
    "channels_last": True,
    "batch_size": GPU_BATCH_SIZE,
}


def gpu_overlap(
    work_dir: Path, images: int, out: Path, *, device: str, model: str, preprocess: str
) -> dict[str, float]:
    """The daemon over the model alone, photos decoded on the device, bf16, channels-last;
    then the daemon with two inference processes on the device over it with one."""
    common = {
        "pool": photos(),
        "model": model,
        "preprocess": preprocess,
        "in_files": True,
        "preprocess_workers": CORES,
        # 30 ms a GET: 32 a process keep about 1,000 images/s a process coming (512 at most).
        "fetch_concurrency": min(512, 32 * CORES),
        **MODEL_SETTINGS,
    }
    figures = overlap(work_dir, images, 1, out, device=device, **common)
    two = overlap(work_dir, images, 1, out / "two-processes", device=f"{device},{device}", **common)
    return {
        "gpu_overlap": figures["overlap_ratio"],
        "gpu_busy_fraction": figures["busy_fraction"],
        "gpu_daemon_images_per_s": figures["daemon_images_per_s"],
        "gpu_model_only_images_per_s": figures["model_only_images_per_s"],
        "gpu_two_processes_ratio": two["daemon_images_per_s"] / figures["daemon_images_per_s"],
        "gpu_two_processes_images_per_s": two["daemon_images_per_s"],
    }


def moto_end_to_end(
    work_dir: Path, images: int, out: Path, *, device: str, model: str, preprocess: str
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
            **{"preprocess_workers": CORES, "fetch_concurrency": 8 * CORES},
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
    """`python -m worker run`'s flags for the settings: a true one alone, others valued."""
    flags: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def inference_profile(
    out: Path, batches: int, *, device: str, model: str, preprocess: str
) -> dict[str, float]:
    """Where the inference process's time goes on a batch of photos: its whole function
    (decoding on the device, then the model) against the model alone on decoded images,
    the device decoding alone, and nvJPEG alone (torchvision's `decode_jpeg`, in one call
    and split across four threads), each per batch with the device synchronised;
    torch.profiler's table of the whole function in `out/profile.txt`."""
    from torchvision.io import ImageReadMode, decode_jpeg

    on = torch.device(device)
    shape = load_preprocessor(preprocess).output_shape
    decoder = load_device_decoder(preprocess)
    pool = photos()
    inputs = [pool[number % len(pool)] for number in range(GPU_BATCH_SIZE)]
    batch = torch.zeros((GPU_BATCH_SIZE, *shape), dtype=torch.uint8)
    values: list[tuple[Any, dict[str, Any]]] = [
        (decode_or_defer(decoder, data, row), {}) for data, row in zip(inputs, batch, strict=True)
    ]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in inputs]
    decoded = torch.stack(decoder.decode_on_device(encoded, on)).cpu()
    tuned = {k: MODEL_SETTINGS[k] for k in ("precision", "channels_last", "batch_size")}
    whole = inference_setup(model, device, shape, decoder=preprocess, **tuned).run
    model_alone = inference_setup(model, device, shape, **tuned).run
    quarters = [encoded[start::4] for start in range(4)]

    def nvjpeg(chosen: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(decode_jpeg(chosen, mode=ImageReadMode.RGB, device=on))

    def per_batch_ms(call: Callable[[], object]) -> float:
        call()
        torch.cuda.synchronize(on)
        started = time.perf_counter()
        for _ in range(batches):
            call()
        torch.cuda.synchronize(on)
        return 1000 * (time.perf_counter() - started) / batches

    with ThreadPoolExecutor(4) as threads:
        figures = {
            "batch_ms_decode_and_model": per_batch_ms(lambda: whole(batch, values)),
            "batch_ms_model": per_batch_ms(lambda: model_alone(decoded, [None] * len(inputs))),
            "batch_ms_device_decode": per_batch_ms(lambda: decoder.decode_on_device(encoded, on)),
            "batch_ms_nvjpeg": per_batch_ms(lambda: nvjpeg(encoded)),
            "batch_ms_nvjpeg_4_threads": per_batch_ms(lambda: list(threads.map(nvjpeg, quarters))),
        }
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(batches):
            whole(batch, values)
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (out / "profile.txt").write_text(table)
    print(table)
    return figures


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
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
    parser.add_argument("--model", default="bench.gpu:resnet50", help="for gpu_overlap")
    parser.add_argument("--preprocess", default="bench.gpu:photo_preprocessor")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    configure_daemon_logging(io.StringIO())  # the daemons' own logs are not the point here
    report: dict[str, Any] = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "images": args.images,
    }
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        common = {"device": args.device, "preprocess": args.preprocess}
        modelled = {"model": args.model, **common}
        steps: list[Callable[[], dict[str, float]]] = [
            lambda: decode_speedup(work_dir, args.images, **common),
            lambda: gpu_overlap(work_dir, args.images, args.out, **modelled),
            lambda: moto_end_to_end(work_dir, args.moto_images, args.out, **modelled),
            lambda: host_ceiling(work_dir / "host", args.host_items),
            lambda: inference_profile(args.out, args.profile_batches, **modelled),
        ]
        for step in steps:  # each step's figures written as they come: a later one may fail
            figures = step()
            print(json.dumps(figures), flush=True)
            report.update(figures)
            (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
