"""Batches sized in tokens (issue 40, point 3): how much of what the model is given is
text, and how close the daemon comes to the model alone.

    python -m worker bench --only tokens

Texts of lengths drawn lognormally (median 64 tokens, clipped to 5..512, as product
descriptions or support tickets are), inline in jobs of `JOB_SIZE`, through the daemon
in this process with a stand-in device that is busy `DEVICE_PER_TOKEN_US` for every
token it is given, padding included (`TokenDeviceModel`), and writes down each text's
real tokens and the length its batch was padded to:

- `token_padding_efficiency`: real tokens over padded tokens with `--max-batch-tokens`;
  `item_padding_efficiency`: the same with batches of `--batch-size` texts, each padded
  to the model's longest sequence, as before; `item_longest_padding_efficiency`: what
  batches of as many texts in turn would give, each padded to its longest text (as a
  collator that pads dynamically does; worked out from the lengths, not run);
- `token_throughput_ratio`: the daemon's real tokens/s over the model's alone, called
  as the inference process calls it, on the same texts in the batches a budget makes
  of them all at once (every batch full but each length's last; the faster of two
  passes, as a loaded machine slows a pass); `token_device_busy_fraction`: the
  stand-in device's time for the tokens the daemon gave it over the daemon's wall time,
  the ratio to a device never idle and a host that costs nothing;
  `tokenized_throughput_ratio`: `token_throughput_ratio` with each text a string of
  words that the shipped tokenizer tokenizes in the preprocessing processes
  (`stages.text.Tokens`, its longest sequence 512), as a text job's are.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.harness import TimedSource
from stages.text import TOKENIZER, Tokens
from worker.adapters.fakes import InMemoryBlobStore
from worker.daemon.wiring import Daemon
from worker.engine import TokenBudget, bucket_lengths, bucket_of
from worker.plugins import tokens_of
from worker.plugins.loading import token_slots
from worker.plugins.setups import inference_setup
from worker.settings import Settings

LONGEST = 512
SHORTEST = 5
MEDIAN_TOKENS = 64
SIGMA = 0.9  # of the lengths' logarithm: a tenth of the texts under 20 tokens, 1% at 512
DEVICE_PER_TOKEN_US = 10.0  # ~100,000 tokens/s: about 1,000 texts/s, which 2 cores feed
MAX_BATCH_TOKENS = 8192
TOKEN_BATCH_ROWS = 256
ITEM_BATCH_ROWS = 64
JOB_SIZE = 100

PREPROCESS = "bench.tokens:length_tokens"
TOKENIZING = "bench.tokens:word_tokens"
WORD = "rain"  # a token of the shipped tokenizer's
MODEL = "bench.tokens:token_device_model"
POSTPROCESS = "bench.tokens:token_counts"


class LengthTokens:
    """A `TextPreprocessor` whose texts are their own lengths ("137"): that many tokens,
    marked in the mask, for no tokenizer's CPU (the figure is about batching)."""

    output_shape = (2, LONGEST)
    output_dtype = torch.int32
    notes: dict[str, Any] = {}  # noqa: RUF012 (read only: the contract's field defaults)

    def __call__(self, text: str, out: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]:
        tokens = int(text)
        out.zero_()
        out[:, :tokens] = 1
        return {}


length_tokens = LengthTokens()
word_tokens = Tokens(TOKENIZER, LONGEST)


def word_texts(lengths: list[int]) -> list[str]:
    """A text of `length` tokens each ([CLS] and [SEP] among them), for `word_tokens`."""
    return [" ".join([WORD] * (length - 2)) for length in lengths]


class TokenDeviceModel(nn.Module):
    """Busy `DEVICE_PER_TOKEN_US` for every token of the batch it is given (rows x
    length), CPU idle, as a GPU is; answers each row's real tokens and its length."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        time.sleep(ids.numel() * DEVICE_PER_TOKEN_US / 1e6)
        real = mask.sum(dim=1, dtype=torch.float32)
        return torch.stack([real, torch.full_like(real, ids.shape[1])], dim=1)


def token_device_model() -> nn.Module:
    return TokenDeviceModel()


def token_counts(output: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    # Not "tokens": a tokenizing preprocessor's note of that name would stand for it.
    return {"seen_tokens": int(output[0]), "padded": int(output[1])}


def text_lengths(count: int, seed: int = 40) -> list[int]:
    chance = random.Random(seed)
    drawn = (chance.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA) for _ in range(count))
    return [min(LONGEST, max(SHORTEST, round(length))) for length in drawn]


def token_batches(work_dir: Path, texts: int, item_texts: int) -> dict[str, float]:
    """The module's figures: `texts` through the daemon in batches sized in tokens, and
    the first `item_texts` of them in batches of texts."""
    lengths = text_lengths(texts)
    tokens = _daemon_run(work_dir / "tokens", lengths, TOKEN_BATCH_ROWS, MAX_BATCH_TOKENS)
    items = _daemon_run(work_dir / "items", lengths[:item_texts], ITEM_BATCH_ROWS, 0)
    tokenized = _daemon_run(
        work_dir / "tokenized", lengths, TOKEN_BATCH_ROWS, MAX_BATCH_TOKENS, TOKENIZING
    )
    alone = max(_model_alone_tokens_per_s(lengths) for _ in range(2))
    return {
        "token_padding_efficiency": tokens["real"] / tokens["padded"],
        "item_padding_efficiency": items["real"] / items["padded"],
        "item_longest_padding_efficiency": _padded_to_each_batchs_longest(lengths),
        "token_throughput_ratio": tokens["real"] / tokens["wall_s"] / alone,
        "tokenized_throughput_ratio": tokenized["real"] / tokenized["wall_s"] / alone,
        "token_device_busy_fraction": tokens["padded"]
        * DEVICE_PER_TOKEN_US
        / 1e6
        / tokens["wall_s"],
        "daemon_tokens_per_s": tokens["real"] / tokens["wall_s"],
        "model_only_tokens_per_s": alone,
    }


def _daemon_run(
    work_dir: Path,
    lengths: list[int],
    batch_size: int,
    max_batch_tokens: int,
    preprocess: str = PREPROCESS,
) -> dict[str, float]:
    """The daemon over jobs of `JOB_SIZE` texts of `lengths`, drained: the real and
    padded tokens its results count (every text succeeded, its length its real
    tokens), and its wall time from the first receive to the last ack."""
    source, blobs = TimedSource(), InMemoryBlobStore()
    jobs = [lengths[start : start + JOB_SIZE] for start in range(0, len(lengths), JOB_SIZE)]
    for number, job in enumerate(jobs):
        texts = word_texts(job) if preprocess == TOKENIZING else [str(length) for length in job]
        output = f"s3://bench/out/job-{number}/"
        source.send(json.dumps({"job_id": f"job-{number}", "texts": texts, "output": output}))
    config = Settings(
        queue_url="bench",
        drain=True,
        receive_wait_seconds=0,
        log_dir=work_dir / "logs",
        metrics_port=0,
        preprocess=preprocess,
        model=MODEL,
        postprocess=POSTPROCESS,
        device="cpu",
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
    )
    Daemon(config, source, blobs).run()
    real = padded = 0
    for number, job in enumerate(jobs):
        lines = blobs.objects[f"s3://bench/out/job-{number}/results.jsonl"].splitlines()
        results = [json.loads(line) for line in lines]
        seen = [result.get("seen_tokens") for result in results]
        if seen != job or any(result["padded"] < result["seen_tokens"] for result in results):
            raise RuntimeError(f"job-{number}'s model did not see each text's tokens, padded")
        real += sum(result["seen_tokens"] for result in results)
        padded += sum(result["padded"] for result in results)
    return {"real": real, "padded": padded, "wall_s": source.wall_s}


def _padded_to_each_batchs_longest(lengths: list[int]) -> float:
    batches = [
        lengths[start : start + ITEM_BATCH_ROWS]
        for start in range(0, len(lengths), ITEM_BATCH_ROWS)
    ]
    return sum(lengths) / sum(max(batch) * len(batch) for batch in batches)


def _model_alone_tokens_per_s(lengths: list[int]) -> float:
    """Real tokens/s of the model called as the inference process calls it (set up,
    warmed up, each batch cut to its length), on the batches a budget makes of all the
    texts at once: each length's texts in full batches, then its last."""
    buckets = bucket_lengths(LONGEST)
    budget = TokenBudget(MAX_BATCH_TOKENS, buckets, tokens_of)
    infer = inference_setup(
        MODEL,
        "cpu",
        LengthTokens.output_shape,
        batch_size=TOKEN_BATCH_ROWS,
        tokens=token_slots(length_tokens),
        budget=budget,
    ).run
    by_length: dict[int, list[int]] = {}
    for length in lengths:
        by_length.setdefault(bucket_of(length, buckets), []).append(length)
    batches = []
    for bucket, members in by_length.items():
        rows = budget.rows(bucket, TOKEN_BATCH_ROWS)
        batches += [members[start : start + rows] for start in range(0, len(members), rows)]
    slots: list[tuple[torch.Tensor, list[Any]]] = [
        (_slots(batch), [((None, length), {}) for length in batch]) for batch in batches
    ]
    started = time.perf_counter()
    for batch, values in slots:
        infer(batch, values)
    return sum(lengths) / (time.perf_counter() - started)


def _slots(lengths: list[int]) -> torch.Tensor:
    slots = torch.zeros((len(lengths), *LengthTokens.output_shape), dtype=torch.int32)
    for row, length in enumerate(lengths):
        slots[row, :, :length] = 1
    return slots
