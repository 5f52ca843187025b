"""Train the shipped models on synthetic images and write their weights.

    python -m stages.train                        # the default classifier, about a minute
    python -m stages.train --model tile-finder    # the example chain's detector, ~9 minutes

The images go through the same preprocessor the daemon uses, so a model sees at
training time exactly what it sees in production.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from stages.boards import TILE_FINDER_WEIGHTS, TileFinder, TileNet, board_decoder
from stages.model import WEIGHTS, Classifier, ShapeNet, normalise
from stages.preprocess import default_preprocessor
from stages.synthetic import LABELS, TILES, boards, samples

Dataset = tuple[torch.Tensor, torch.Tensor]


def make_dataset(count: int, seed: int) -> Dataset:
    """uint8 shapes and their class ids, decoded as the daemon decodes them."""
    images = torch.empty((count, *default_preprocessor.output_shape), dtype=torch.uint8)
    labels = torch.empty(count, dtype=torch.long)
    for number, (label, data) in enumerate(samples(count, seed)):
        default_preprocessor(data, images[number])
        labels[number] = LABELS.index(label)
    return images, labels


def make_boards(count: int, seed: int) -> Dataset:
    """uint8 boards and, per tile, 1.0 where it holds a shape."""
    images = torch.empty((count, *board_decoder.output_shape), dtype=torch.uint8)
    occupied = torch.zeros((count, TILES * TILES))
    for number, (shapes, data) in enumerate(boards(count, seed)):
        board_decoder(data, images[number])
        occupied[number, [tile for tile, _ in shapes]] = 1.0
    return images, occupied


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.inference_mode():
        predictions = Classifier(model).eval()(images).argmax(dim=1)
    return float((predictions == labels).float().mean())


def tile_accuracy(model: nn.Module, images: torch.Tensor, occupied: torch.Tensor) -> float:
    """The fraction of boards whose every tile is called right."""
    with torch.inference_mode():
        found = TileFinder(model).eval()(images) >= 0.5
    return float((found == occupied.bool()).all(dim=1).float().mean())


def fit(
    net: nn.Module,
    train: Dataset,
    test: Dataset,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    score: Callable[[nn.Module, torch.Tensor, torch.Tensor], float],
    *,
    epochs: int,
    flips: bool,
) -> None:
    """AdamW with a one-cycle schedule, batches of 64; `flips` mirrors half the batches."""
    images, targets = train
    optimiser = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimiser, max_lr=1e-2, total_steps=epochs * ((len(images) + 63) // 64)
    )
    for epoch in range(epochs):
        net.train()
        for batch in torch.randperm(len(images)).split(64):
            x = normalise(images[batch])
            if flips and torch.rand(()) < 0.5:
                x = x.flip(3)
            error = loss(net(x), targets[batch])
            optimiser.zero_grad()
            error.backward()
            optimiser.step()
            schedule.step()
        net.eval()
        print(f"epoch {epoch + 1}: loss {error.item():.3f}, test score {score(net, *test):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("shapes-cnn", "tile-finder"), default="shapes-cnn")
    parser.add_argument("--train-images", type=int, help="default: 8000, tile-finder 6000")
    parser.add_argument("--epochs", type=int, help="default: 16, tile-finder 8")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tiles = args.model == "tile-finder"
    count = args.train_images or (6000 if tiles else 8000)
    epochs = args.epochs or (8 if tiles else 16)

    torch.manual_seed(args.seed)
    net: nn.Module
    weights: Path
    if tiles:
        # Mirroring a board would move its shapes to other tiles than its targets say.
        net, weights = TileNet(), TILE_FINDER_WEIGHTS
        train = make_boards(count, seed=args.seed)
        test = make_boards(1000, seed=args.seed + 1000)
        loss = nn.functional.binary_cross_entropy_with_logits
        fit(net, train, test, loss, tile_accuracy, epochs=epochs, flips=False)
    else:
        net, weights = ShapeNet(), WEIGHTS
        train = make_dataset(count, seed=args.seed)
        test = make_dataset(1000, seed=args.seed + 1000)
        fit(net, train, test, nn.functional.cross_entropy, accuracy, epochs=epochs, flips=True)
    weights.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), weights)
    print(f"wrote {weights} ({weights.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
