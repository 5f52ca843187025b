"""Hedged preparations: a fetch still running past the recent 95th percentile of fetches
is made again, and the first answer wins (`worker.engine.hedging`, the children of a
process stage with a prepare step); hedges are bounded, and counted."""

from __future__ import annotations

import functools
import time

from tests.support import stagefns
from tests.support.pipelines import RecordingObserver, run_items
from worker.engine import Item, Pipeline, PrepareStep, ProcessStage, TensorArena
from worker.engine.hedging import HEDGE_FLOOR_S, TIMED_BEFORE_HEDGING, TailLatency


def test_the_hedge_waits_for_the_95th_percentile_of_the_latest_calls() -> None:
    """No hedge before enough calls are timed; then the 95th percentile of the latest,
    taken again as more are timed, and never under the floor."""
    tails = TailLatency()
    for _ in range(TIMED_BEFORE_HEDGING - 1):
        tails.timed(0.01)
    assert tails.hedge_after_s() is None
    tails.timed(0.01)
    assert tails.hedge_after_s() == 0.01
    for number in range(TIMED_BEFORE_HEDGING * 3):
        tails.timed(0.1 if number % 10 == 0 else 0.02)  # a tenth in the tail
    assert tails.hedge_after_s() == 0.1
    fast = TailLatency()
    for _ in range(TIMED_BEFORE_HEDGING):
        fast.timed(0.0001)
    assert fast.hedge_after_s() == HEDGE_FLOOR_S


# How long a slow fetch takes the first time: a hedge answers long before, even on a
# machine loaded enough to make the 95th percentile of the warm fetches seconds long.
HELD_S = 20.0


def _hedging_pipeline(observer: RecordingObserver, hedges: int, held_s: float = HELD_S) -> Pipeline:
    arena = TensorArena((2, 2), slots=64)
    fetch = ProcessStage(
        "preprocess",
        functools.partial(stagefns.hedgeable_fetcher, held_s),
        batch_size=8,
        writes=arena,
        prepare=PrepareStep("fetch", 60.0, hedges=hedges),
    )
    reader = ProcessStage(
        "inference", functools.partial(stagefns.sleepy_reader, 0.0), batch_size=8, reads=arena
    )
    return Pipeline([fetch, reader], observer)


def test_a_fetch_in_the_tail_is_made_again_and_the_first_answer_wins() -> None:
    """Once enough fetches are timed, one that takes 20 s the first time is answered by
    its hedge; the fetches and the hedge are counted."""
    observer = RecordingObserver()
    with _hedging_pipeline(observer, hedges=2) as pipeline:
        warm = [Item("j", i, f"v{i}") for i in range(2 * TIMED_BEFORE_HEDGING)]
        run_items(pipeline, warm)
        started = time.monotonic()
        [slow] = run_items(pipeline, [Item("j", 999, "slow-a")])
        took_s = time.monotonic() - started
    assert slow.error is None and slow.value == ("fetched:slow-a", 7)
    assert took_s < HELD_S / 2, took_s
    assert observer.counts[("fetch", "hedged")] >= 1  # (a warm fetch slowed by load too)
    assert observer.counts[("fetch", "calls")] == 2 * TIMED_BEFORE_HEDGING + 1


def test_without_hedges_a_fetch_in_the_tail_waits_for_its_answer() -> None:
    """The same fetch with no hedges allowed takes its time (5 s here)."""
    observer = RecordingObserver()
    with _hedging_pipeline(observer, hedges=0, held_s=5.0) as pipeline:
        run_items(pipeline, [Item("j", i, f"v{i}") for i in range(2 * TIMED_BEFORE_HEDGING)])
        started = time.monotonic()
        run_items(pipeline, [Item("j", 999, "slow-a")])
        assert time.monotonic() - started >= 5.0
    assert observer.counts.get(("fetch", "hedged"), 0) == 0


def test_hedges_past_the_bound_wait_for_one_to_end() -> None:
    """With one hedge at a time, three fetches in the tail at once are hedged one after
    another, each as the one before ends: none waits for its own 60 s (three times the
    others' test: three hedges one after another each wait for the 95th percentile, seconds
    long beside a second suite, where 20 s was once reached)."""
    observer = RecordingObserver()
    held_s = 3 * HELD_S
    with _hedging_pipeline(observer, hedges=1, held_s=held_s) as pipeline:
        run_items(pipeline, [Item("j", i, f"v{i}") for i in range(2 * TIMED_BEFORE_HEDGING)])
        started = time.monotonic()
        slow = run_items(pipeline, [Item("j", 900 + i, f"slow-{i}") for i in range(3)])
        took_s = time.monotonic() - started
    assert all(item.error is None for item in slow)
    assert took_s < held_s / 2, took_s
    assert observer.counts[("fetch", "hedged")] >= 3  # (a warm fetch slowed by load too)
