"""The inference process alone on a GPU (`bench.gpu`'s steps that run no daemon): the
model looping over batches as the daemon's inference process runs it, the baseline of
every overlap figure; and where a batch's time goes in that process. Also the photos,
the model and the settings every GPU figure shares."""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from stages.model import Classifier
from stages.preprocess import ImagePreprocessor
from stages.synthetic import LABELS, draw_shape
from worker.engine import StageFunction
from worker.plugins.device_decoding import decode_or_defer
from worker.plugins.loading import load_device_decoder, load_preprocessor
from worker.plugins.setups import inference_setup
from worker.plugins.staging import resolved

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


def top_class(scores: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    """An ImageNet model's best class and its score (the shapes' labels do not apply)."""
    best = int(np.argmax(scores))
    return {"class_id": best, "score": round(float(scores[best]), 6)}


def resnet50() -> nn.Module:
    from torchvision.models import resnet50 as torchvision_resnet50

    return ResNet50(torchvision_resnet50()).eval()


# How the daemon runs the ResNet-50 in every figure but the decoding one.
MODEL_SETTINGS: dict[str, Any] = {
    "postprocess": "bench.gpu_inference:top_class",
    "decode": "gpu",
    "precision": "bfloat16",
    "channels_last": True,
    "batch_size": GPU_BATCH_SIZE,
}


def model_alone(
    batches: int, *, device: str, model: str, preprocess: str, **settings: Any
) -> dict[str, float]:
    """The model looping over batches the way the daemon's inference process runs it
    (`inference_setup` with the daemon's settings, `--compile` included): random pixels
    in a pinned batch as gathered, one copy to the device, each batch's outputs waited
    for only once the next is under way, as the finish step waits for them. Images/s,
    and what its warm-up spent compiling."""
    shape = load_preprocessor(preprocess).output_shape
    stage_fn = _stage_function(model, device, shape, settings)
    size = {**MODEL_SETTINGS, **settings}["batch_size"]
    batch = torch.randint(0, 256, (size, *shape), dtype=torch.uint8)
    if torch.device(device).type == "cuda":
        batch = batch.pin_memory()  # as `BatchGatherer` gathers it
    values: list[Any] = [(None, {})] * size
    one_batch_ahead(stage_fn, batch, values, 3)
    started = time.perf_counter()
    one_batch_ahead(stage_fn, batch, values, batches)
    return {
        "images_per_s": batches * size / (time.perf_counter() - started),
        "compile_s": stage_fn.about["warm_up"]["compile_s"],
    }


def inference_profile(
    out: Path, batches: int, *, device: str, model: str, preprocess: str, **settings: Any
) -> dict[str, float]:
    """Where the inference process's time goes on a batch of photos, each per batch with
    the device synchronised: its whole function (decoding on the device, then the
    model; compiled with `compile`) one batch at a time, and one batch ahead as the
    daemon runs it (the next decoded while the model runs this one); the same function
    on decoded images (the model alone, with their one copy in); the device decoding
    alone; nvJPEG alone (torchvision's `decode_jpeg`, in one call and split across four
    threads). torch.profiler's table of the whole function in `out/profile.txt`."""
    from torchvision.io import ImageReadMode, decode_jpeg

    on = torch.device(device)
    shape = load_preprocessor(preprocess).output_shape
    decoder = load_device_decoder(preprocess)
    size = {**MODEL_SETTINGS, **settings}["batch_size"]
    pool = photos()
    inputs = [pool[number % len(pool)] for number in range(size)]
    batch = torch.zeros((size, *shape), dtype=torch.uint8)
    values: list[tuple[Any, dict[str, Any]]] = [
        (decode_or_defer(decoder, data, row), {}) for data, row in zip(inputs, batch, strict=True)
    ]
    batch = batch.pin_memory()  # as `BatchGatherer` gathers it
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in inputs]
    decoded = torch.stack(decoder.decode_on_device(encoded, on)).cpu().pin_memory()
    stage_fn = _stage_function(model, device, shape, settings, decoder=preprocess)
    ready: list[Any] = [(None, {})] * size
    quarters = [encoded[start::4] for start in range(4)]

    def nvjpeg(chosen: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(decode_jpeg(chosen, mode=ImageReadMode.RGB, device=on))

    def per_batch_ms(call: Callable[[], object], *, calls: int = batches) -> float:
        call()
        torch.cuda.synchronize(on)
        started = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize(on)
        return 1000 * (time.perf_counter() - started) / calls

    with ThreadPoolExecutor(4) as threads:
        figures = {
            "batch_ms_decode_and_model": per_batch_ms(
                lambda: resolved(stage_fn.run(batch, values))
            ),
            "batch_ms_pipelined": per_batch_ms(
                lambda: one_batch_ahead(stage_fn, batch, values, batches), calls=1
            )
            / batches,
            "batch_ms_model": per_batch_ms(lambda: resolved(stage_fn.run(decoded, ready))),
            "batch_ms_device_decode": per_batch_ms(lambda: decoder.decode_on_device(encoded, on)),
            "batch_ms_nvjpeg": per_batch_ms(lambda: nvjpeg(encoded)),
            "batch_ms_nvjpeg_4_threads": per_batch_ms(lambda: list(threads.map(nvjpeg, quarters))),
        }
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # One cycle, so accumulating changes nothing but the warning that events are cleared.
    with torch.profiler.profile(activities=activities, acc_events=True) as profiler:
        for _ in range(batches):
            resolved(stage_fn.run(batch, values))
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    copies = sum(event.name == "cudaMemcpyAsync" for event in profiler.events())
    figures["memcpy_calls_per_batch"] = copies / batches
    (out / "profile.txt").write_text(table)
    print(table)
    return figures


def one_batch_ahead(
    stage_fn: StageFunction, batch: torch.Tensor, values: list[Any], count: int
) -> None:
    """Run `batch` `count` times as the daemon's inference process runs batches: each
    one's outputs waited for (as its finish step does) once the next is under way."""
    waiting: list[Any] = []
    for _ in range(count):
        outputs = stage_fn.run(batch, values)
        resolved(waiting)
        waiting = outputs
    resolved(waiting)


def _stage_function(
    model: str,
    device: str,
    shape: tuple[int, ...],
    settings: dict[str, Any],
    decoder: str | None = None,
) -> StageFunction:
    """The inference stage's function as the daemon sets it up with `MODEL_SETTINGS`
    and `settings` (its postprocessor included, so it runs one batch ahead)."""
    tuned = {**MODEL_SETTINGS, **settings}
    return inference_setup(
        model,
        device,
        shape,
        batch_size=tuned["batch_size"],
        precision=tuned["precision"],
        channels_last=tuned["channels_last"],
        postprocess=tuned["postprocess"],
        decoder=decoder,
        compile=tuned.get("compile", False),
    )
