"""What tokenizing a text costs a preprocessing process, in CPU time (issue 40, point 2):

    python -m bench.tokenizing

- `tokenizing_cpu_us_per_text`: the text preprocessor's stage function as the
  preprocessing processes run it (`stages.text:tokens` into an int32 slot, and the
  tokens counted from its mask), a text at a time;
- `encode_cpu_us_per_text`: the tokenizer's `encode` alone, a text a call;
- `encode_batch_cpu_us_per_text`: its `encode_batch`, `BATCH` texts a call, as a
  request's texts could be given it.

Texts of `stages.sentences` (one to ten sentences, 7 to 64 tokens), each figure the
least of `ROUNDS` passes over them, the three in turn. CPU time, not wall time: the
preprocessing processes share the host's cores, and a batch encoded on several threads
(the tokenizer's own, unless TOKENIZERS_PARALLELISM=false) takes less wall time for
the same or more CPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from tokenizers import Tokenizer

from stages.sentences import sentences
from stages.text import MAX_TOKENS, TOKENIZER
from worker.plugins.setups import preprocess_setup

TEXTS = 4096
BATCH = 32
ROUNDS = 9


def measure() -> dict[str, float]:
    torch.set_num_threads(1)  # as in a preprocessing process
    texts = [text for _, text in sentences(TEXTS, seed=1)]
    stage = preprocess_setup("stages.text:tokens")
    slots = [torch.empty((2, MAX_TOKENS), dtype=torch.int32) for _ in texts]
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.enable_truncation(MAX_TOKENS)

    def tokenizing() -> None:
        for text, slot in zip(texts, slots, strict=True):
            stage.run((text, {}), slot)

    def encode() -> None:
        for text in texts:
            tokenizer.encode(text)

    def encode_batch() -> None:
        for start in range(0, len(texts), BATCH):
            tokenizer.encode_batch(texts[start : start + BATCH])

    passes: dict[str, Callable[[], None]] = {
        "tokenizing_cpu_us_per_text": tokenizing,
        "encode_cpu_us_per_text": encode,
        "encode_batch_cpu_us_per_text": encode_batch,
    }
    least = dict.fromkeys(passes, float("inf"))
    for _ in range(ROUNDS):
        for name, run in passes.items():
            started = time.process_time()
            run()
            least[name] = min(least[name], time.process_time() - started)
    return {name: round(seconds / len(texts) * 1e6, 1) for name, seconds in least.items()}


if __name__ == "__main__":
    print(json.dumps(measure()))
