"""The example chain of models (stages/boards.toml): a detector finds the shapes on a
board, a fan-out cuts a crop around each, and the default classifier names them.

The detector, `tile-finder`, is the project's second model: a small CNN that says, for
each tile of a 2x2 board, how likely it is to hold a shape (trained by
`python -m stages.train --model tile-finder`, weights committed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages.model import conv_block, normalise
from stages.postprocess import top_k
from stages.preprocess import ImagePreprocessor
from stages.synthetic import TILE_SIDE, TILES

TILE_FINDER_WEIGHTS = Path(__file__).parent / "weights" / "tile_finder.pt"
# A tile whose probability of holding a shape is at least this is cut out.
FOUND_AT = 0.5

board_decoder = ImagePreprocessor(size=TILES * TILE_SIDE)


class TileNet(nn.Module):
    """Three conv blocks, then the strongest feature in each tile: one logit per tile,
    row by row. About 20k parameters, 128x128 RGB input."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 16), conv_block(16, 32), conv_block(32, 48))
        self.head = nn.Conv2d(48, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_tile = nn.functional.adaptive_max_pool2d(self.features(x), TILES)
        return self.head(per_tile).flatten(1)  # type: ignore[no-any-return]


class TileFinder(nn.Module):
    """uint8 NCHW boards in, each tile's probability of holding a shape out."""

    model_name = "tile-finder"

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(normalise(batch)))


def tile_finder() -> nn.Module:
    """The shipped TileNet with its trained weights."""
    net = TileNet()
    net.load_state_dict(torch.load(TILE_FINDER_WEIGHTS, map_location="cpu", weights_only=True))
    return TileFinder(net).eval()


class FoundTiles:
    """The fan-out: a crop of each tile the tile finder found a shape in, at the size
    the classifier takes, and where it was cut from (in fractions of the board)."""

    output_shape = (3, TILE_SIDE, TILE_SIDE)

    def __call__(
        self, board: torch.Tensor, found: Sequence[float], outs: Sequence[torch.Tensor]
    ) -> list[dict[str, Any]]:
        side = board.shape[-1] // TILES
        tiles = [tile for tile, score in enumerate(found) if score >= FOUND_AT]
        if len(tiles) > len(outs):  # the input's error, not a result missing shapes
            raise ValueError(f"{len(tiles)} shapes found, room for {len(outs)} (max_parts)")
        abouts = []
        for tile, out in zip(tiles, outs, strict=False):
            row, column = divmod(tile, TILES)
            crop = board[:, row * side : (row + 1) * side, column * side : (column + 1) * side]
            if crop.shape != out.shape:
                crop = nn.functional.interpolate(crop[None].float(), out.shape[1:])[0]
            out.copy_(crop)
            box = [column / TILES, row / TILES, (column + 1) / TILES, (row + 1) / TILES]
            abouts.append({"tile": tile, "box": box, "found_score": round(float(found[tile]), 6)})
        return abouts


found_tiles = FoundTiles()


def objects(
    parts: Sequence[tuple[dict[str, Any], Sequence[float]]], params: dict[str, Any]
) -> dict[str, Any]:
    """Each shape found, where it is and what the classifier says it is."""
    found = [{**about, **top_k(probabilities, params)} for about, probabilities in parts]
    return {"count": len(found), "objects": found}
