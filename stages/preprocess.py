"""Decoding and resizing images into uint8 tensors: on the CPU in the preprocessing
processes, or JPEGs in batches on the model's device (`--decode gpu`)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from PIL import Image
from torch.nn import functional

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
# What nvJPEG decodes to RGB; CMYK and YCCK JPEGs are left to Pillow.
DEVICE_JPEG_MODES = frozenset({"RGB", "L"})


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

    def device_decoding_unavailable(self) -> str | None:
        """Why JPEGs cannot be decoded on a device here, or None: it takes nvJPEG, so a
        CUDA build of torch and torchvision's binding of it."""
        if torch.version.cuda is None:
            return "this torch has no CUDA, so no nvJPEG: install its CUDA build and torchvision"
        try:
            from torchvision.io import decode_jpeg  # noqa: F401
        # A torchvision built for another torch raises more than ImportError.
        except Exception as error:
            return f"torchvision.io.decode_jpeg does not import ({type(error).__name__}: {error})"
        return None

    def device_decodable(self, data: bytes) -> bool:
        """Whether the device should decode this input: a whole JPEG (it ends where a
        JPEG ends: a decoder may make a picture of a truncated one without a word) whose
        header reads, in a colour mode nvJPEG takes (not RGB-coded: Adobe transform 0),
        within the pixel limit (read from the header, as on the CPU). Anything else is
        decoded here, which names what is wrong with a bad one."""
        if not (data.startswith(JPEG_MAGIC) and data.endswith(JPEG_END)):
            return False
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                return (
                    image.format == "JPEG"
                    and image.mode in DEVICE_JPEG_MODES
                    and image.info.get("adobe_transform") != 0
                    and width * height <= self.max_pixels
                )
        except Exception:
            return False

    def decode_on_device(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """JPEGs (each a 1-D uint8 CPU tensor of the file) decoded together on `device`
        and resized as `__call__` resizes; raises if any of them cannot be."""
        return [self.fit(image) for image in self._decode_jpegs(encoded, device)]

    def _decode_jpegs(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        decoded = decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device)
        return list(decoded)

    def fit(self, image: torch.Tensor) -> torch.Tensor:
        """A decoded uint8 CHW image of any size as a `size`x`size` one, on its device
        (bilinear with antialiasing, as Pillow's resize)."""
        resized = functional.interpolate(
            image[None].float(),
            size=(self.size, self.size),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        return resized[0].round_().clamp_(0, 255).to(torch.uint8)


default_preprocessor = ImagePreprocessor()
