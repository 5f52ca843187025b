"""Decoding and resizing images into uint8 tensors: on the CPU in the preprocessing
processes, or JPEGs in batches on the model's device (`--decode gpu`)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:  # imported where used: the daemon's process loads this module for its
    import torch  # shape only, and never imports torch (docs/performance.md)

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
# What nvJPEG decodes to RGB; CMYK and YCCK JPEGs are left to Pillow.
DEVICE_JPEG_MODES = frozenset({"RGB", "L"})
# Start-of-frame markers (all but DHT, JPG and DAC in 0xC0-0xCF), those of them that are
# progressive, and the markers that stand alone, without a length.
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
PROGRESSIVE_SOF_MARKERS = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})


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
        np.copyto(out.numpy(), np.asarray(rgb).transpose(2, 0, 1))
        return {"width": width, "height": height}

    def device_decoding_unavailable(self) -> str | None:
        """Why JPEGs cannot be decoded on a device here, or None: it takes nvJPEG, so a
        CUDA build of torch and torchvision's binding of it."""
        import torch

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
        headers read and hang together (nvJPEG pictures a scan that names a component
        the frame lacks, where Pillow fails), in a colour mode nvJPEG takes (not
        RGB-coded: Adobe transform 0), within the pixel limit (read from the header, as
        on the CPU). Anything else is decoded here, which names what is wrong with a bad
        one."""
        if not (data.startswith(JPEG_MAGIC) and data.endswith(JPEG_END)):
            return False
        if not jpeg_headers_consistent(data):
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
        and resized as `__call__` resizes; raises if any of them cannot be. Images of one
        size are resized together: a batch of photos costs a few kernels, not a few per
        photo."""
        import torch

        images = self._decode_jpegs(encoded, device)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for position, image in enumerate(images):
            by_size.setdefault(tuple(image.shape), []).append(position)
        fitted: dict[int, torch.Tensor] = {}
        for positions in by_size.values():
            resized = self.fit(torch.stack([images[p] for p in positions]))
            fitted.update(zip(positions, resized, strict=True))
        return [fitted[position] for position in range(len(images))]

    def _decode_jpegs(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        decoded = decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device)
        return list(decoded)

    def fit(self, images: torch.Tensor) -> torch.Tensor:
        """Decoded uint8 NCHW images of any one size as `size`x`size` ones, on their
        device, as `__call__` makes them: first reduced by the power of two Pillow's
        `draft` picks (a JPEG decoder's reduced-size decode averages each block), then
        resized bilinearly with antialiasing, as Pillow's resize is."""
        import torch
        from torch.nn import functional

        pixels = images.float()
        scale = draft_scale(tuple(images.shape[-2:]), self.size)
        if scale > 1:
            pixels = functional.avg_pool2d(pixels, scale, ceil_mode=True)
        resized = functional.interpolate(
            pixels,
            size=(self.size, self.size),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        return resized.round_().clamp_(0, 255).to(torch.uint8)


def draft_scale(height_width: tuple[int, ...], size: int) -> int:
    """The reduction Pillow's JPEG `draft` picks for a `size`x`size` target: the largest
    of 8, 4, 2 and 1 that leaves both sides at least `size`."""
    height, width = height_width
    most = min(width // size, height // size)
    return max((scale for scale in (8, 4, 2) if most >= scale), default=1)


def jpeg_headers_consistent(data: bytes) -> bool:
    """Whether a JPEG's headers, up to its first scan, hang together: each segment within
    the file, a frame before the scan, and a scan that names only the frame's components
    and Huffman tables that were defined, with the frame's quantisation tables defined.
    False sends the file to Pillow, which either decodes it (a Motion-JPEG frame that
    relies on the standard Huffman tables) or says what is wrong with it."""
    frame: set[int] = set()
    frame_quantisation: set[int] = set()
    quantisation: set[int] = set()
    huffman: set[tuple[int, int]] = set()  # (class: 0 DC, 1 AC; table id)
    progressive = False
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return False
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before the marker
            position += 1
            continue
        if marker in STANDALONE_MARKERS:
            position += 2
            continue
        length = int.from_bytes(data[position + 2 : position + 4], "big")
        segment = data[position + 4 : position + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return False
        if marker == 0xDB:
            quantisation |= _quantisation_table_ids(segment)
        elif marker == 0xC4:
            huffman |= _huffman_table_ids(segment)
        elif marker in SOF_MARKERS:
            components = segment[6 : 6 + 3 * segment[5]] if len(segment) > 5 else b""
            frame = set(components[0::3])
            frame_quantisation = set(components[2::3])
            progressive = marker in PROGRESSIVE_SOF_MARKERS
        elif marker == 0xDA:
            return _scan_fits_frame(segment, frame, huffman, progressive) and (
                frame_quantisation <= quantisation
            )
        position += 2 + length
    return False


def _quantisation_table_ids(segment: bytes) -> set[int]:
    ids, position = set(), 0
    while position < len(segment):
        precision, table = segment[position] >> 4, segment[position] & 0x0F
        ids.add(table)
        position += 1 + 64 * (2 if precision else 1)
    return ids


def _huffman_table_ids(segment: bytes) -> set[tuple[int, int]]:
    ids, position = set(), 0
    while position + 17 <= len(segment):
        ids.add((segment[position] >> 4, segment[position] & 0x0F))
        position += 17 + sum(segment[position + 1 : position + 17])
    return ids


def _scan_fits_frame(
    segment: bytes, frame: set[int], huffman: set[tuple[int, int]], progressive: bool
) -> bool:
    """Whether a scan header names only the frame's components and defined Huffman
    tables: DC tables for a sequential scan or a progressive DC scan (spectral start 0),
    AC tables for a sequential scan or a progressive AC scan."""
    count = segment[0] if segment else 0
    selectors = segment[1 : 1 + 2 * count]
    if not frame or len(selectors) != 2 * count or len(segment) < 2 * count + 2:
        return False
    spectral_start = segment[1 + 2 * count]
    needs_dc = not progressive or spectral_start == 0
    needs_ac = not progressive or spectral_start > 0
    for component, tables in zip(selectors[0::2], selectors[1::2], strict=True):
        if component not in frame:
            return False
        if needs_dc and (0, tables >> 4) not in huffman:
            return False
        if needs_ac and (1, tables & 0x0F) not in huffman:
            return False
    return True


default_preprocessor = ImagePreprocessor()
