"""A user's text model as the tests build one: a tiny sentence-transformers-shaped
encoder (token embeddings, a mean over the attention mask, normalised), and its files
in each form `--model` takes (module-level, so a stage's process imports the factory)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from stages.text import TOKENIZER, tokens

WIDTH = 16


class MeanPooledEncoder(nn.Module):
    """`(input_ids, attention_mask)` in, one normalised embedding per text out."""

    def __init__(self, vocabulary: int, seed: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, WIDTH)
        nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(input_ids)
        weights = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return nn.functional.normalize(pooled, dim=1)


def encoder() -> MeanPooledEncoder:
    """The factory: an encoder over the shipped tokenizer's vocabulary."""
    return MeanPooledEncoder(Tokenizer.from_file(str(TOKENIZER)).get_vocab_size()).eval()


def tokenized(texts: list[str]) -> torch.Tensor:
    """The texts' slots as the preprocessing processes write them: int32 ids and mask."""
    slots = torch.zeros((len(texts), *tokens.output_shape), dtype=tokens.output_dtype)
    for text, slot in zip(texts, slots, strict=True):
        tokens(text, slot, {})
    return slots


def encoder_answers(ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """The encoder's own embeddings of the texts of those ids and mask."""
    with torch.inference_mode():
        return encoder()(ids.long(), mask.long()).numpy()  # type: ignore[no-any-return]


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and a mask as a Hugging Face tokenizer gives them: int64, two texts of 8."""
    return torch.ones((2, 8), dtype=torch.int64), torch.ones((2, 8), dtype=torch.int64)


def save_export(path: Path) -> None:
    """A `torch.export` archive, its batch and sequence lengths dynamic."""
    dynamic = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    program = torch.export.export(encoder(), _example(), dynamic_shapes=(dynamic, dynamic))
    torch.export.save(program, str(path))


def save_script(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated in 2.13
        torch.jit.script(encoder()).save(str(path))


def save_trace(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.trace(encoder(), _example()).save(str(path))


SAVERS: dict[str, Callable[[Path], None]] = {
    "encoder.pt2": save_export,
    "scripted.pt": save_script,
    "traced.pt": save_trace,
}
