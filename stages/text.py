"""The shipped text model: a tokenizer and a small network that give each text a topic
label and an embedding (trained by `python -m stages.text_train` on generated sentences,
`stages.sentences`; its weights and tokenizer.json are committed).

    python -m worker run --preprocess stages.text:tokens \\
        --model stages.text:text_model --postprocess stages.text:labelled

- `tokens` (a `TextPreprocessor`) runs in the preprocessing processes: Hugging Face
  `tokenizers` turns a text into ids and an attention mask in the item's slot, cut to
  the model's longest sequence unless the job's params say `"truncate": false`; its
  result notes whether it was cut and its tokens, [CLS] and [SEP] included.
- `text_model` takes `(input_ids, attention_mask)`, as a sentence-transformers model
  does, and answers a row per text: the topics' probabilities, then the embedding
  (mean-pooled over the text's tokens, normalised).
- `labelled` makes a row a result: label, score and embedding; `embedding` (for a
  model that answers embeddings alone, any sentence-transformers-shaped one) the
  embedding only.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from stages.sentences import TOPICS

WEIGHTS = Path(__file__).parent / "weights" / "text_model.pt"
TOKENIZER = Path(__file__).parent / "weights" / "text_tokenizer.json"
MAX_TOKENS = 64  # the model's longest sequence, [CLS] and [SEP] included
WIDTH = 64  # the embedding's size
PAD_ID = 0  # "[PAD]", the first of the tokenizer's special tokens


class TextTooLong(ValueError):
    """A text over the model's longest sequence, in a job that asks for no cutting."""


class Tokens:
    """A `TextPreprocessor` of a tokenizer.json: a text's ids and mask, as int32."""

    output_dtype = torch.int32
    # Whether the text was cut, and its tokens (an OpenAI batch's usage counts them).
    notes = {"truncated": False, "tokens": 0}  # noqa: RUF012 (read only: the contract's defaults)
    samples = ("the forecast says rain",)

    def __init__(self, path: Path, max_tokens: int):
        self._path = path
        self.output_shape = (2, max_tokens)

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        """Loaded where it is first used: each preprocessing process has its own."""
        tokenizer = Tokenizer.from_file(str(self._path))
        tokenizer.enable_truncation(self.output_shape[1])
        tokenizer.no_padding()
        return tokenizer

    def __call__(self, text: str, out: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]:
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"params.truncate must be true or false, not {truncate!r}")
        encoding = self._tokenizer.encode(text)
        truncated = bool(encoding.overflowing)
        if truncated and not truncate:
            raise TextTooLong(
                f"its text is over the model's {self.output_shape[1]} tokens "
                '(params: "truncate": false)'
            )
        ids = encoding.ids
        # Through numpy: torch's indexing cost more than the tokenizer (14 µs a text).
        slot = out.numpy()
        slot.fill(0)
        slot[0, : len(ids)] = ids
        slot[1, : len(ids)] = 1
        return {"truncated": truncated, "tokens": len(ids)}


tokens = Tokens(TOKENIZER, MAX_TOKENS)


class TextNet(nn.Module):
    """Token embeddings, a convolution over each three neighbours, and a mean over the
    text's own tokens: the embedding; a linear head on it: the topics' scores."""

    def __init__(self, vocabulary: int, width: int = WIDTH, classes: int = len(TOPICS)):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width, padding_idx=PAD_ID)
        self.mix = nn.Conv1d(width, width, 3, padding=1)
        self.head = nn.Linear(width, classes)

    def pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each text's tokens, mixed with their neighbours, averaged over its mask."""
        tokens = self.embed(ids.long())
        mixed = nn.functional.gelu(self.mix(tokens.transpose(1, 2))).transpose(1, 2)
        weights = mask.unsqueeze(-1).to(mixed.dtype)
        return (mixed * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(ids, mask))  # type: ignore[no-any-return]


class LabelledEmbedding(nn.Module):
    """`(input_ids, attention_mask)` in; per text, the topics' probabilities and then
    the normalised embedding, in one row."""

    model_name = "topics-text"

    def __init__(self, net: TextNet):
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = self.net.pooled(ids, mask)
        probabilities = torch.softmax(self.net.head(pooled), dim=1)
        return torch.cat([probabilities, nn.functional.normalize(pooled, dim=1)], dim=1)


def text_model() -> nn.Module:
    """The shipped TextNet with its trained weights."""
    state = torch.load(WEIGHTS, map_location="cpu", weights_only=True)
    net = TextNet(vocabulary=state["embed.weight"].shape[0])
    net.load_state_dict(state)
    return LabelledEmbedding(net).eval()


def labelled(output: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    """A `text_model` row as a result: the likeliest topic, its probability, and the
    embedding (a float32 array: a fixed-size list column in Parquet)."""
    probabilities, vector = output[: len(TOPICS)], output[len(TOPICS) :]
    best = int(np.argmax(probabilities))
    return {
        "label": TOPICS[best],
        "score": round(float(probabilities[best]), 6),
        "embedding": vector.astype(np.float32),
    }


def embedding(output: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    """A row of embeddings alone (a sentence-transformers-shaped model's) as a result."""
    return {"embedding": output.astype(np.float32)}
