"""Decoding and resizing images into uint8 tensors (runs in preprocessing processes)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from PIL import Image


class ImageTooLarge(ValueError):
    """The image's pixel count is over the limit (a decompression bomb, or a mistake)."""


@dataclass(frozen=True)
class ImagePreprocessor:
    """Decodes any image Pillow reads into an RGB `size`x`size` uint8 CHW tensor.

    The pixel-count check reads only the header, so a decompression bomb is refused
    before it is decoded. Normalising to float is left to the model, on the device,
    so four times fewer bytes cross from here to the inference process.
    """

    size: int = 64
    max_pixels: int = 50_000_000

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (3, self.size, self.size)

    @cached_property
    def samples(self) -> tuple[bytes, ...]:
        """A small JPEG and PNG that must always decode: the daemon's probe of this
        stage (a missing codec is the worker's fault, never the input's)."""
        encoded = []
        for image_format in ("JPEG", "PNG"):
            buffer = io.BytesIO()
            Image.new("RGB", (16, 16), (200, 30, 30)).save(buffer, format=image_format)
            encoded.append(buffer.getvalue())
        return tuple(encoded)

    def __call__(self, data: bytes, out: torch.Tensor) -> dict[str, Any]:
        try:
            opened = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as error:  # Pillow's own guard, at 2x its limit
            raise ImageTooLarge(str(error)) from error
        with opened as image:
            width, height = image.size
            if width * height > self.max_pixels:
                raise ImageTooLarge(
                    f"{width}x{height} pixels is over the limit of {self.max_pixels}"
                )
            image.draft("RGB", (self.size, self.size))
            rgb = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        out.copy_(pixels.view(self.size, self.size, 3).permute(2, 0, 1))
        return {"width": width, "height": height}


default_preprocessor = ImagePreprocessor()
