"""What the shipped text model answers for texts, tokenized as the daemon does: what a
text job's results are checked against."""

from __future__ import annotations

import numpy as np
import torch

from stages.text import text_model, tokens


def model_answers(texts: list[str]) -> np.ndarray:
    """`stages.text:text_model`'s row for each text: the topics' probabilities, then the
    embedding."""
    slots = torch.zeros((len(texts), *tokens.output_shape), dtype=tokens.output_dtype)
    for text, slot in zip(texts, slots, strict=True):
        tokens(text, slot, {})
    with torch.inference_mode():
        return text_model()(slots[:, 0], slots[:, 1]).numpy()  # type: ignore[no-any-return]
