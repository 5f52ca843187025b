"""Synthetic labelled images (coloured shapes) to train and check the default model.

Nothing can be downloaded at run time, so the demo, the tests and the training script
draw their own images; a seed makes every set reproducible.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator

from PIL import Image, ImageDraw

LABELS = ("circle", "square", "triangle", "cross")


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return (rng.randrange(256), rng.randrange(256), rng.randrange(256))


def _contrasting(rng: random.Random, background: tuple[int, int, int]) -> tuple[int, int, int]:
    while True:
        colour = _colour(rng)
        if sum(abs(a - b) for a, b in zip(colour, background, strict=True)) > 200:
            return colour


def draw_shape(
    label: str,
    rng: random.Random,
    side: int | None = None,
    background: tuple[int, int, int] | None = None,
) -> Image.Image:
    """One RGB image of a `label` shape at a random place, size, colour and rotation
    (on a square of `side` pixels in `background`, when given)."""
    side = side or rng.randrange(48, 160)
    background = background or _colour(rng)
    image = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(image)
    fill = _contrasting(rng, background)
    radius = side * rng.uniform(0.28, 0.42)
    cx = rng.uniform(radius, side - radius)
    cy = rng.uniform(radius, side - radius)
    angle = rng.uniform(0, 2 * math.pi)

    def polygon(corners: int, scale: float = 1.0) -> list[tuple[float, float]]:
        return [
            (
                cx + radius * scale * math.cos(angle + 2 * math.pi * k / corners),
                cy + radius * scale * math.sin(angle + 2 * math.pi * k / corners),
            )
            for k in range(corners)
        ]

    if label == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    elif label == "square":
        draw.polygon(polygon(4), fill=fill)
    elif label == "triangle":
        draw.polygon(polygon(3), fill=fill)
    elif label == "cross":
        width = max(2, int(radius * 0.45))
        for a, b in zip(polygon(4)[:2], polygon(4)[2:], strict=True):
            draw.line((a, b), fill=fill, width=width)
    else:
        raise ValueError(f"unknown shape {label!r}")
    return image


def encode(image: Image.Image, rng: random.Random) -> bytes:
    """The image as JPEG or PNG bytes, picked at random, as uploads would be."""
    buffer = io.BytesIO()
    if rng.random() < 0.7:
        image.save(buffer, format="JPEG", quality=rng.randrange(75, 96))
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


def samples(count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """`count` (label, encoded image) pairs, labels in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    for number in range(count):
        label = LABELS[number % len(LABELS)]
        yield label, encode(draw_shape(label, rng), rng)


# Boards: a square of TILES x TILES tiles, each empty or holding one shape.
TILES = 2
TILE_SIDE = 64


def draw_board(rng: random.Random) -> tuple[Image.Image, list[tuple[int, str]]]:
    """A board on one background colour, and the (tile, label) of each shape on it, in
    tile order (row by row)."""
    background = _colour(rng)
    board = Image.new("RGB", (TILES * TILE_SIDE, TILES * TILE_SIDE), background)
    shapes = []
    for tile in range(TILES * TILES):
        if rng.random() < 0.4:
            continue
        label = rng.choice(LABELS)
        row, column = divmod(tile, TILES)
        shape = draw_shape(label, rng, TILE_SIDE, background)
        board.paste(shape, (column * TILE_SIDE, row * TILE_SIDE))
        shapes.append((tile, label))
    return board, shapes


def boards(count: int, seed: int) -> Iterator[tuple[list[tuple[int, str]], bytes]]:
    """`count` (shapes, encoded board) pairs, reproducible from `seed`."""
    rng = random.Random(seed)
    for _ in range(count):
        board, shapes = draw_board(rng)
        yield shapes, encode(board, rng)
