"""The figures that need a GPU (issue 12), in one call on a machine that has one:

    python -m bench.gpu --out bench-out-gpu

- `gpu_decode_speedup`: the daemon's images/s with the JPEGs decoded on the GPU
  (`--decode gpu`, nvJPEG) over decoded by Pillow in two preprocessing processes
  (`--decode cpu`), ~500x375 photos to 224 px, a model that costs nothing, so decoding
  is what is compared. The GPU run must have decoded on the device, and counts the
  jobs some of whose inputs it sent to the CPU after all (`gpu_decode_fallback_jobs`).
- `gpu_overlap`: the daemon's images/s over the model's alone, a ResNet-50 (torchvision's,
  random weights) in bfloat16 and channels-last on the same photos decoded on the GPU,
  S3 latency injected; with `gpu_busy_fraction` and the run's timeline. The daemon's
  device also decodes, and the model alone does not: decoding counts against it.

Not part of `make bench`, which runs on the CPU. `tests/test_bench.py` runs both steps
on the CPU with a stand-in for nvJPEG and a small model, for their correctness only.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image
from structlog.testing import capture_logs
from torch import nn

from bench.run import NOOP_MODEL, OVERLAP_JOB_SIZE, _run_daemon, overlap
from stages.model import Classifier
from stages.preprocess import ImagePreprocessor
from stages.synthetic import LABELS, draw_shape
from worker.fakes import InMemoryBlobStore
from worker.joblog import configure_daemon_logging

PHOTO_SIZE = (500, 375)
PHOTOS = 64  # distinct photos, reused under many keys
GPU_BATCH_SIZE = 128
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


def resnet50() -> nn.Module:
    from torchvision.models import resnet50 as torchvision_resnet50

    return ResNet50(torchvision_resnet50()).eval()


def decode_speedup(
    work_dir: Path, images: int, *, device: str, preprocess: str
) -> dict[str, float]:
    """`--decode gpu` over `--decode cpu`: images/s of the same photos, the model free."""
    pool, jobs = photos(), [OVERLAP_JOB_SIZE] * (images // OVERLAP_JOB_SIZE)
    rates, fallback_jobs = {}, 0
    for placement in ("cpu", "gpu"):
        blobs = InMemoryBlobStore()
        with capture_logs() as logs:
            daemon = _run_daemon(
                jobs,
                blobs,
                work_dir,
                pool=pool,
                model=NOOP_MODEL,
                preprocess=preprocess,
                device=device,
                decode=placement,
                batch_size=GPU_BATCH_SIZE,
                preprocess_workers=2,
                preprocess_workers_max=2,
                fetch_concurrency=32,
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
    }


def gpu_overlap(
    work_dir: Path, images: int, out: Path, *, device: str, model: str, preprocess: str
) -> dict[str, float]:
    """The daemon over the model alone, photos decoded on the device, bf16, channels-last."""
    figures = overlap(
        work_dir,
        images,
        1,
        out,
        pool=photos(),
        model=model,
        preprocess=preprocess,
        device=device,
        decode="gpu",
        precision="bfloat16",
        channels_last=True,
        batch_size=GPU_BATCH_SIZE,
    )
    return {
        "gpu_overlap": figures["overlap_ratio"],
        "gpu_busy_fraction": figures["busy_fraction"],
        "gpu_daemon_images_per_s": figures["daemon_images_per_s"],
        "gpu_model_only_images_per_s": figures["model_only_images_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out-gpu"))
    parser.add_argument("--images", type=int, default=6000, help="per run (default 6000)")
    parser.add_argument("--device", default="cuda", help="the model's device (default cuda)")
    parser.add_argument("--model", default="bench.gpu:resnet50", help="for gpu_overlap")
    parser.add_argument("--preprocess", default="bench.gpu:photo_preprocessor")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    configure_daemon_logging(io.StringIO())  # the daemons' own logs are not the point here
    report: dict[str, Any] = {"device": args.device, "images": args.images}
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        common = {"device": args.device, "preprocess": args.preprocess}
        report.update(decode_speedup(work_dir, args.images, **common))
        report.update(gpu_overlap(work_dir, args.images, args.out, model=args.model, **common))
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
