"""Batches sized in tokens (issue 40, `worker.engine.token_batches`): the lengths a batch
is padded to, which ready items a batch takes (a pure function, with a manual clock),
the channel's bounded window, a stage forming them, the model called cut to a batch's
length, and a text job whose results are the same with and without a token budget."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stages.sentences import sentences
from stages.text import MAX_TOKENS
from stages.text import tokens as text_tokens
from tests.support.in_process import job_file, run_until_drained
from tests.support.pipelines import RecordingObserver, run_items
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.stages import _token_budget
from worker.engine import Channel, Item, Pipeline, ThreadStage, TokenBudget, bucket_lengths
from worker.engine.token_batches import choose_batch
from worker.plugins import PluginError, tokens_of
from worker.plugins.compiled import CompiledModel
from worker.plugins.loading import token_slots
from worker.plugins.setups import _Inference, cut_to_length, inference_setup
from worker.plugins.staging import Staging
from worker.settings import Settings

LENGTHS = bucket_lengths(64)  # 16, 20, 24, 28, 32, 40, 48, 56, 64
BUDGET = TokenBudget(64, LENGTHS, tokens_of)  # 4 texts of 16 tokens, one of 64


def _rows(budget: int, max_rows: int = 64) -> Any:
    return lambda length: TokenBudget(budget, LENGTHS, int).rows(length, max_rows)


def test_lengths_are_a_few_fixed_ones_and_a_text_takes_the_shortest_that_holds_it() -> None:
    """Four lengths per doubling from 16 to the model's longest, which is always one:
    21 to 512, 9 to 64; a text goes to the shortest length that holds its tokens."""
    assert LENGTHS == (16, 20, 24, 28, 32, 40, 48, 56, 64)
    assert len(bucket_lengths(512)) == 21 and bucket_lengths(512)[-1] == 512
    assert bucket_lengths(100)[-2:] == (96, 100)
    budget = TokenBudget(1000, LENGTHS, int)
    sizes = [0, 5, 16, 17, 33, 64]
    assert [budget.length_of(Item("j", 0, size)) for size in sizes] == [16, 16, 16, 20, 40, 64]


def test_a_batch_holds_texts_of_one_length_within_the_budget_of_padded_tokens() -> None:
    """With no text due yet, a length whose texts fill a batch (rows x length within the
    budget) is taken, only its texts, oldest first; the first such length in the
    window's order goes first; a budget under one row's length still takes one row."""
    lengths = [16, 64, 16, 32, 16, 64, 16, 16]
    arrived = [0.0] * len(lengths)
    chosen = choose_batch(lengths, arrived, 0.01, rows=_rows(64), max_wait_s=1.0, window_full=False)
    assert chosen == [0, 2, 4, 6]  # 4 rows of 16 = 64 tokens; the fifth waits
    assert choose_batch(
        [64, 16, 64], arrived[:3], 0.01, rows=_rows(128), max_wait_s=1.0, window_full=False
    ) == [0, 2]
    assert _rows(10)(64) == 1
    assert _rows(10_000, max_rows=8)(16) == 8  # at most the stage's batch size of rows


def test_the_oldest_text_waits_no_longer_than_the_batch_wait_even_beside_full_batches() -> None:
    """Until the oldest text has waited `max_wait_s` nothing is taken and the answer is
    how long until it is due; once due, its length's batch goes however few it holds,
    ahead of a full batch of another length."""
    lengths = [32, 16, 16, 16, 16]
    rows = _rows(64)
    arrived = [0.0, 0.3, 0.3, 0.3, 0.3]
    assert (
        choose_batch(lengths[:1], arrived[:1], 0.25, rows=rows, max_wait_s=1.0, window_full=False)
        == 0.75
    )
    assert choose_batch(lengths, arrived, 0.5, rows=rows, max_wait_s=1.0, window_full=False) == [
        1,
        2,
        3,
        4,
    ]
    assert choose_batch(lengths, arrived, 1.0, rows=rows, max_wait_s=1.0, window_full=False) == [0]


def test_a_full_window_takes_the_length_holding_most_tokens_rather_than_idle() -> None:
    """When the window is full and no length fills a batch, nothing behind it can help:
    the length whose texts hold the most padded tokens goes at once."""
    lengths = [16, 64, 32, 16]
    chosen = choose_batch(
        lengths, [0.0] * 4, 0.0, rows=_rows(256), max_wait_s=1.0, window_full=True
    )
    assert chosen == [1]  # 64 tokens, against 32 of each other length
    assert choose_batch(
        [16, 32, 32, 32], [0.0] * 4, 0.0, rows=_rows(256), max_wait_s=1.0, window_full=True
    ) == [1, 2, 3]


def test_an_urgent_text_beside_background_ones_goes_at_once_ahead_of_their_full_batches() -> None:
    """A one-text job's text (urgent: the channel's lane ahead puts it first) beside a
    giant job's shard, whose texts fill a batch of another length and none is due: the
    urgent text's length goes now, filled with the background texts of its length
    within the budget; urgent texts alone are chosen among as any (the full length)."""
    budget = TokenBudget(128, LENGTHS, int)
    assert (budget.rows(40, 8), budget.rows(16, 8)) == (3, 8)
    chooser = budget.chooser(max_rows=8, max_wait_s=1.0)
    urgent = Item("small", 0, 40, urgent=True)
    shard = [Item("giant", index, 16) for index in range(8)]
    arrived = [0.5] * 10
    assert chooser([urgent, *shard], arrived, 0.6) == [0]
    assert chooser([urgent, *shard, Item("giant", 8, 40)], arrived, 0.6) == [0, 9]
    alone = [Item("small", index, 16, urgent=True) for index in range(1, 9)]
    assert chooser([urgent, *alone], arrived, 0.6) == list(range(1, 9))
    behind = Item("small", 9, 16, urgent=True)  # shown after the shard: it goes all the same
    assert chooser([*shard, behind], arrived, 0.6) == [*range(7), 8]


@given(
    st.lists(
        st.tuples(st.sampled_from(LENGTHS), st.floats(0, 2), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.integers(16, 512),
    st.booleans(),
)
def test_every_choice_is_one_length_within_budget_and_the_first_urgent_or_due_goes_first(
    ready: list[tuple[int, float, bool]], budget: int, window_full: bool
) -> None:
    """Whatever is ready (urgent or not, in any order): a batch holds one length, at
    most its rows, in window order; if urgent and background texts are both there, the
    first urgent's length goes, its urgent texts first, else if a text is due, its
    length goes, the first of that length first; if none is taken, none is due, no
    length is full, the window is not, and the wait ends when the oldest is due."""
    lengths, arrived = [length for length, _, _ in ready], [at for _, at, _ in ready]
    urgent = [is_urgent for _, _, is_urgent in ready]
    rows, now, max_wait_s = _rows(budget, max_rows=8), 2.0, 1.0
    chosen = choose_batch(
        lengths,
        arrived,
        now,
        rows=rows,
        max_wait_s=max_wait_s,
        window_full=window_full,
        urgent=urgent,
    )
    passing = any(urgent) and not all(urgent)
    due = [position for position, at in enumerate(arrived) if now - at >= max_wait_s]
    if isinstance(chosen, float):
        assert not passing and not due and not window_full
        assert all(lengths.count(length) < rows(length) for length in lengths)
        assert chosen == pytest.approx(min(arrived) + max_wait_s - now)
        return
    (length,) = {lengths[position] for position in chosen}
    assert chosen == sorted(set(chosen)) and 1 <= len(chosen) <= rows(length)
    same = [position for position, other in enumerate(lengths) if other == length]
    if passing:
        assert length == lengths[urgent.index(True)] and len(chosen) == min(len(same), rows(length))
        same_urgent = [position for position in same if urgent[position]]
        assert sum(urgent[position] for position in chosen) == min(len(same_urgent), rows(length))
    elif due:
        assert length == lengths[due[0]] and chosen == same[: rows(length)]


def test_the_channel_shows_its_chooser_a_bounded_window_and_keeps_the_rest_in_order() -> None:
    """The chooser sees only the first `window` entries (those ahead first); the ones it
    picks are taken in its order, the others stay, in theirs."""
    channel: Channel[int] = Channel(20, ahead=lambda entry: entry >= 100)
    channel.put_all([1, 2, 3, 4, 5, 100])
    seen: list[list[int]] = []

    def choose(entries: Any, arrived: Any, now: float) -> list[int] | float:
        seen.append(list(entries))
        return [2, 0]

    assert channel.get_chosen(choose, 4) == [2, 100]
    assert seen == [[100, 1, 2, 3]]
    assert channel.take_chosen_now(lambda entries, arrived, now: 1.0, 4) is None
    assert channel.take_up_to(10) == [1, 3, 4, 5]


def test_a_stage_with_a_token_budget_runs_batches_of_one_length_each() -> None:
    """Items of three lengths, interleaved, through a stage with a budget of 128 tokens:
    each batch its stage function sees holds one length, within the budget, and every
    item comes out with its own value."""
    sizes = [10, 30, 60, 10, 30, 10, 60, 10, 30, 10, 10, 30, 10, 10]
    batches: list[list[int]] = []

    def record(values: list[int]) -> list[int]:
        batches.append(values)
        return values

    stage = ThreadStage("model", record, batch_size=8, max_batch_wait_ms=60_000)
    stage.token_budget = TokenBudget(128, LENGTHS, int)
    items = [Item("job", index, size) for index, size in enumerate(sizes)]
    with Pipeline([stage], RecordingObserver()) as pipeline:
        out = run_items(pipeline, items)
    assert sorted((item.index, item.value) for item in out) == list(enumerate(sizes))
    assert sorted(batches) == sorted([[10] * 8, [30] * 4, [60] * 2])


def test_the_model_is_called_cut_to_the_shortest_length_holding_the_batchs_longest_text() -> None:
    """A batch's longest text (the tokens its preprocessing counted, up to its mask's
    last) decides its length: 17 tokens go to 20; the probe's zeros to the shortest."""
    texts = [((notes, tokens), {}) for notes, tokens in (({}, 3), ({}, 17), ({}, 9))]
    assert cut_to_length(texts, LENGTHS) == 20
    assert cut_to_length([None], LENGTHS) == 16


class _Streams:
    """A GPU's streams on the CPU (`worker.plugins.staging.Streams`): each copy runs at
    once, every wait is already over."""

    copying, decoding = "copy", "decode"

    def compute(self) -> str:
        return "compute"

    def on(self, stream: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def recorded(self, stream: str) -> Any:
        return SimpleNamespace(synchronize=lambda: None, query=lambda: True)

    def wait(self, stream: str, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)


def test_on_a_gpus_path_a_batch_crosses_whole_and_the_model_is_given_it_cut() -> None:
    """On a GPU the batch is copied to the device at the slot's shape (the device
    batches keep one shape) and the model is given it cut to its length there."""
    shapes: list[tuple[int, ...]] = []

    def forward(batch: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(batch.shape))
        return batch[:, 1].sum(dim=1, keepdim=True).float()

    staging = Staging(torch.device("cpu"), (2, 64), None, _Streams(), dtype=torch.int32)
    infer = _Inference(forward, staging, LENGTHS)
    batch = torch.zeros((3, 2, 64), dtype=torch.int32)
    batch[0, :, :17], batch[1, :, :5] = 1, 1
    rows = infer.now(batch, [((None, 17), {}), ((None, 5), {}), ((None, 0), {})])
    assert shapes == [(3, 2, 20)]
    assert [row.tolist() for row in rows] == [[17.0], [5.0], [0.0]]


def _tokens_and_length(batch: torch.Tensor) -> torch.Tensor:
    """Each text's tokens, and the length the batch was cut to, per row."""
    tokens = batch[:, 1].sum(dim=1, keepdim=True).float()
    return torch.cat([tokens, torch.full_like(tokens, batch.shape[-1])], dim=1)


def test_a_compiled_model_is_compiled_at_each_lengths_sizes_and_answers_as_eager() -> None:
    """Compiled at sizes 4, 2, 1 for length 16 and 1 for 64: a batch of 3 texts cut to
    16 runs at 4 and answers its 3 rows, one of 64 runs compiled, and a batch of a
    length or size not compiled runs eagerly; each is given its batch at its length."""
    compiled = CompiledModel(
        _tokens_and_length, torch.device("cpu"), (2, 64), {16: [4, 2, 1], 64: [1]}, torch.int32
    )
    report = compiled.compile()
    assert report.out_of_memory == [] and compiled.sizes == [1, 2, 4]
    batch = torch.zeros((3, 2, 64), dtype=torch.int32)
    for row, tokens in enumerate((3, 16, 9)):
        batch[row, :, :tokens] = 1
    with torch.inference_mode():
        for count, length in ((3, 16), (1, 64), (2, 64), (2, 20)):
            cut = batch[:count, :, :length]
            answers = compiled(cut).tolist()
            assert answers == _tokens_and_length(cut).tolist(), (count, length)
            assert [length for _, length in answers] == [float(length)] * count


class LongestOnly(torch.nn.Module):
    """A text model that takes only its longest sequence, as one exported at that shape."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] != MAX_TOKENS:
            raise RuntimeError(f"expected {MAX_TOKENS} tokens, got {ids.shape[1]}")
        return mask.float()


def longest_only() -> torch.nn.Module:
    return LongestOnly()


def test_a_model_that_takes_only_its_longest_sequence_stops_the_start_with_a_budget() -> None:
    """Set up for batches cut to lengths, a model that fails on a shorter one stops its
    start, saying which and what to do, rather than failing every short text's batch;
    without the lengths it starts."""
    reference = "tests.test_token_batches:longest_only"
    slots = token_slots(text_tokens)
    with pytest.raises(PluginError, match=r"cut to 56 tokens.*without --max-batch-tokens"):
        inference_setup(reference, "cpu", text_tokens.output_shape, tokens=slots, budget=BUDGET)
    assert inference_setup(reference, "cpu", text_tokens.output_shape, tokens=slots).probe


def test_only_a_text_pipeline_is_batched_in_tokens() -> None:
    """The budget sizes a text model's batches, to the preprocessor's longest sequence;
    an image pipeline's batches stay counted in images."""
    settings = Settings(queue_url="q", max_batch_tokens=4096)
    slots = token_slots(text_tokens)
    budget = _token_budget(settings, slots, MAX_TOKENS)
    assert budget is not None and (budget.max_tokens, budget.lengths) == (4096, LENGTHS)
    assert _token_budget(settings, None, MAX_TOKENS) is None
    assert _token_budget(Settings(queue_url="q"), slots, MAX_TOKENS) is None


def test_a_text_job_in_token_batches_answers_in_input_order_as_in_item_batches(
    tmp_path: Path,
) -> None:
    """Texts of many lengths, one job run in batches of four texts and again in batches
    of at most 64 padded tokens: both results are in input order, each line naming its
    text, with the same labels and embeddings (the model cut to a batch's length
    answers as at the longest: its padding is masked out)."""
    texts = [text for _, text in sentences(10, seed=3)]
    texts = [" ".join(texts[: 1 + n % 5]) for n in range(len(texts))]  # 8 to 60 tokens
    blobs = InMemoryBlobStore()
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, budget in (("items", 0), ("tokens", 64)):
        source = InMemoryJobSource()
        output = f"s3://bkt/out/{name}/"
        source.send(json.dumps({"job_id": name, "texts": texts, "output": output}))
        run_until_drained(
            source,
            blobs,
            tmp_path / name,
            preprocess="stages.text:tokens",
            model="stages.text:text_model",
            postprocess="stages.text:labelled",
            batch_size=4,
            max_batch_tokens=budget,
        )
        runs[name] = job_file(blobs, name, "results.jsonl")
    for lines in runs.values():
        assert [line["index"] for line in lines] == list(range(len(texts)))
        assert [line["input"] for line in lines] == texts
    assert [line["label"] for line in runs["tokens"]] == [line["label"] for line in runs["items"]]
    embeddings = {
        name: np.load(io.BytesIO(blobs.objects[f"s3://bkt/out/{name}/embedding.npy"]))
        for name in runs
    }
    assert [line["embedding"]["row"] for line in runs["tokens"]] == list(range(len(texts)))
    assert np.allclose(embeddings["tokens"], embeddings["items"], atol=1e-5)
