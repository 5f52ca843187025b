"""Train the default model on synthetic shapes and write its weights.

    python -m stages.train            # about a minute on two CPU cores

The images go through the same `ImagePreprocessor` the daemon uses, so the model sees
at training time exactly what it sees in production.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from stages.model import WEIGHTS, Classifier, ShapeNet
from stages.preprocess import default_preprocessor
from stages.synthetic import LABELS, samples


def make_dataset(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images and their class ids, decoded as the daemon decodes them."""
    images = torch.empty((count, *default_preprocessor.output_shape), dtype=torch.uint8)
    labels = torch.empty(count, dtype=torch.long)
    for number, (label, data) in enumerate(samples(count, seed)):
        default_preprocessor(data, images[number])
        labels[number] = LABELS.index(label)
    return images, labels


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.inference_mode():
        predictions = Classifier(model).eval()(images).argmax(dim=1)
    return float((predictions == labels).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-images", type=int, default=8000)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train_x, train_y = make_dataset(args.train_images, seed=args.seed)
    test_x, test_y = make_dataset(1000, seed=args.seed + 1000)
    net = ShapeNet()
    optimiser = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimiser, max_lr=1e-2, total_steps=args.epochs * ((len(train_x) + 63) // 64)
    )
    for epoch in range(args.epochs):
        net.train()
        for batch in torch.randperm(len(train_x)).split(64):
            x = train_x[batch].float().div_(127.5).sub_(1.0)
            flip = torch.rand(()) < 0.5
            x = x.flip(3) if flip else x
            loss = nn.functional.cross_entropy(net(x), train_y[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
        net.eval()
        print(
            f"epoch {epoch + 1}: loss {loss.item():.3f}, "
            f"test accuracy {accuracy(net, test_x, test_y):.3f}"
        )
    WEIGHTS.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), WEIGHTS)
    print(f"wrote {WEIGHTS} ({WEIGHTS.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
