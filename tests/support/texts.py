"""What the shipped text model answers for texts, tokenized as the daemon does: what a
text job's results are checked against; the flags a daemon runs it with; a request of
an OpenAI batch file."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from stages.text import text_model, tokens

# The settings of a daemon running the shipped text model in a test's process.
TEXT_PIPELINE = {
    "preprocess": "stages.text:tokens",
    "model": "stages.text:text_model",
    "postprocess": "stages.text:labelled",
    "batch_size": 4,
}
# `worker run` flags for the shipped text model, its tokenizer and its labels.
TEXT_MODEL_FLAGS = [
    "--preprocess",
    "stages.text:tokens",
    "--model",
    "stages.text:text_model",
    "--postprocess",
    "stages.text:labelled",
]


class _TenthOfASecond(nn.Module):
    """The shipped text model, a tenth of a second a batch of texts (not of the
    daemon's own batches of zeros): a job a test can stop part-way."""

    def __init__(self) -> None:
        super().__init__()
        self.model = text_model()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.any():
            time.sleep(0.1)
        return self.model(ids, mask)  # type: ignore[no-any-return]


def slow_text_model() -> nn.Module:
    return _TenthOfASecond().eval()


def model_answers(texts: list[str]) -> np.ndarray:
    """`stages.text:text_model`'s row for each text: the topics' probabilities, then the
    embedding."""
    slots = torch.zeros((len(texts), *tokens.output_shape), dtype=tokens.output_dtype)
    for text, slot in zip(texts, slots, strict=True):
        tokens(text, slot, {})
    with torch.inference_mode():
        return text_model()(slots[:, 0], slots[:, 1]).numpy()  # type: ignore[no-any-return]


def embeddings_request(custom_id: str, text: object, **body: object) -> dict[str, object]:
    """A line of an OpenAI batch input file: an embeddings request of `text` (a text or
    a list of them), with more of its `body`."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "text-embedding-3-small", "input": text, **body},
    }
