"""Plug-ins that fail on purpose, for fault tests of the daemon as a subprocess.

Loaded by `--preprocess tests.support.faults:faulty_preprocessor`, `--model
tests.support.faults:fragile_classifier` and the like; every other input gets the
default pipeline.
"""

from __future__ import annotations

import io
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn

from stages.boards import objects
from stages.model import default_classifier
from stages.preprocess import ImagePreprocessor, default_preprocessor
from tests.support.stagefns import inject_fault

FAULT_PREFIX = b"FAULT:"
FRAGILE_MAX_BATCH = 8
MAGENTA = (255, 0, 255)
CUDA_ERROR = "CUDA error: an illegal memory access was encountered (test)"
BREAK_MODEL_FILE = "BREAK_MODEL_FILE"  # the environment variable naming the marker file


class FaultyPreprocessor:
    """The default preprocessor, except that an input `FAULT:<name>` makes this process
    die (sigkill), crash (segfault) or hang, as `inject_fault` does."""

    output_shape = default_preprocessor.output_shape
    samples = default_preprocessor.samples

    def __call__(self, data: bytes, out: torch.Tensor) -> Any:
        if data.startswith(FAULT_PREFIX):
            inject_fault(data.removeprefix(FAULT_PREFIX).decode().strip())
        return default_preprocessor(data, out)


faulty_preprocessor = FaultyPreprocessor()


class CodeclessPreprocessor:
    """The default preprocessor on a machine whose JPEG codec is missing."""

    output_shape = default_preprocessor.output_shape
    samples = default_preprocessor.samples

    def __call__(self, data: bytes, out: torch.Tensor) -> Any:
        if data[:2] == b"\xff\xd8":
            raise OSError("decoder jpeg not available")
        return default_preprocessor(data, out)


codecless_preprocessor = CodeclessPreprocessor()


class FragileClassifier(nn.Module):
    """The default classifier, but out of memory on batches over 8 images, and an
    exception on any batch holding an all-magenta image."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > FRAGILE_MAX_BATCH:
            raise torch.OutOfMemoryError(f"{len(batch)} images do not fit (test)")
        if _any_magenta(batch):
            raise ValueError("the model cannot take an all-magenta image (test)")
        return self.inner(batch)  # type: ignore[no-any-return]


def fragile_classifier() -> nn.Module:
    return FragileClassifier(default_classifier())


def _any_magenta(batch: torch.Tensor) -> bool:
    magenta = torch.tensor(MAGENTA, dtype=batch.dtype, device=batch.device).view(1, 3, 1, 1)
    return bool((batch == magenta).flatten(1).all(dim=1).any())


class PoisonableClassifier(nn.Module):
    """The default classifier, until a batch holds an all-magenta image: from then on
    its process fails every batch (its probe's too), as one whose input left the GPU in
    a sticky error state would. A fresh process is well again."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.poisoned = False

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.poisoned = self.poisoned or _any_magenta(batch)
        if self.poisoned:
            raise RuntimeError(CUDA_ERROR)
        return self.inner(batch)  # type: ignore[no-any-return]


def poisonable_classifier() -> nn.Module:
    return PoisonableClassifier(default_classifier())


class MemoryHungryClassifier(nn.Module):
    """The default classifier, after taking a twelfth of its GPU's memory per image of
    the batch: batches of up to 8 fit, larger ones run out of memory for real."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        per_image = torch.cuda.get_device_properties(batch.device).total_memory // 12
        scratch = torch.empty(len(batch) * per_image, dtype=torch.uint8, device=batch.device)
        del scratch
        return self.inner(batch)  # type: ignore[no-any-return]


def memory_hungry_classifier() -> nn.Module:
    return MemoryHungryClassifier(default_classifier())


class BreakableClassifier(nn.Module):
    """The default classifier, until the file named by $BREAK_MODEL_FILE exists: from
    then on it fails every batch, as after a sticky CUDA error or an Xid. Each batch of
    images takes at least $SLOW_MODEL_SECONDS_PER_BATCH (default 0)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.marker = os.environ.get(BREAK_MODEL_FILE, "")
        self.seconds_per_batch = float(os.environ.get("SLOW_MODEL_SECONDS_PER_BATCH", "0"))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.any():  # the daemon's probe and warm-up (zeros) pay no stand-in time
            time.sleep(self.seconds_per_batch)
        if self.marker and os.path.exists(self.marker):
            raise RuntimeError(CUDA_ERROR)
        return self.inner(batch)  # type: ignore[no-any-return]


def breakable_classifier() -> nn.Module:
    return BreakableClassifier(default_classifier())


def broken_classifier() -> nn.Module:
    """A model that fails everything from the start."""
    model = BreakableClassifier(default_classifier())
    model.marker = __file__  # a file that exists
    return model


@dataclass(frozen=True)
class StandInDeviceDecoder(ImagePreprocessor):
    """The default preprocessor with a stand-in for nvJPEG (which needs torchvision and
    a GPU): JPEGs are decoded whole by Pillow, moved to the device and resized there as
    on a GPU. Like nvJPEG with some files, it refuses progressive JPEGs, which Pillow
    on the CPU decodes; it fails broken ones, as Pillow does too."""

    def device_decoding_unavailable(self) -> str | None:
        return None

    def _decode_jpegs(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        images = []
        for data in encoded:
            with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
                if image.info.get("progressive"):
                    raise RuntimeError("nvjpegDecode failed: progressive JPEG (stand-in)")
                rgb = image.convert("RGB")
            pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
            images.append(pixels.view(rgb.height, rgb.width, 3).permute(2, 0, 1).to(device))
        return images


standin_device_decoder = StandInDeviceDecoder()
standin_photo_decoder = StandInDeviceDecoder(size=224)  # bench.gpu's photos, on the CPU


def broken_scan(jpeg: bytes) -> bytes:
    """The JPEG with its scan header naming a component the frame does not have: whole
    to look at (header, end marker), and nothing decodes it."""
    start = jpeg.index(b"\xff\xda")
    return jpeg[: start + 5] + b"\x09" + jpeg[start + 6 :]


def reencoded(data: bytes, **options: Any) -> bytes:
    """The image in `data` saved again as a JPEG (`progressive=True`, `mode="CMYK"`)."""
    with Image.open(io.BytesIO(data)) as image:
        buffer = io.BytesIO()
        image.convert(options.pop("mode", "RGB")).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def png_bytes(image: Image.Image) -> bytes:
    """`image` saved as a PNG (an all-magenta one; a huge blank one, a decompression
    bomb that is small to send)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def blank_png(width: int, height: int) -> bytes:
    """A black grayscale PNG of `width`x`height`, a decompression bomb that is small to
    send, built without encoding it: Pillow took 5.5 CPU-s to save one of 900 Mpx.
    Its rows deflated 256 at a time, each run flushed fully so that it compresses to
    the same bytes: deflated once and repeated."""
    row = bytes(width + 1)  # the filter byte (none), then the pixels
    deflate = zlib.compressobj(9, wbits=-15)  # raw deflate: the zlib frame is added below
    rows = deflate.compress(row * 256) + deflate.flush(zlib.Z_FULL_FLUSH)
    last = deflate.compress(row * (height % 256)) + deflate.flush()
    # The Adler-32 of n zero bytes: its sum stays 1, its sum of sums is n.
    checksum = struct.pack(">I", ((len(row) * height) % 65521) << 16 | 1)
    pixels = b"\x78\xda" + rows * (height // 256) + last + checksum
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    chunks = [(b"IHDR", header), (b"IDAT", pixels), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        for kind, data in chunks
    )


def breakable_objects(parts: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The shape boards' postprocessor, until the file named by $BREAK_MODEL_FILE
    exists: from then on it fails every input, its known-good one too."""
    marker = os.environ.get(BREAK_MODEL_FILE, "")
    if marker and os.path.exists(marker):
        raise RuntimeError("the postprocessor's library is gone (test)")
    return objects(parts, params)
