"""Hedged preparations: a fetch still running past the recent 95th percentile of fetches
is made again, and the first answer wins (`worker.engine.hedging`, the children of a
process stage with a prepare step); hedges are bounded, and counted."""

from __future__ import annotations

import functools
import multiprocessing
import queue
import threading
import time
from typing import Any

from tests.support import stagefns
from tests.support.pipelines import RecordingObserver, run_items
from worker.engine import Item, Pipeline, PrepareStep, ProcessStage, TensorArena
from worker.engine.hedging import HEDGE_FLOOR_S, TIMED_BEFORE_HEDGING, TailLatency
from worker.engine.items import StageFunction
from worker.engine.preparing import Preparing


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


def test_an_item_that_ended_while_waiting_for_a_hedge_holds_up_no_other() -> None:
    """Items due a hedge while the one hedge allowed is under way wait for it to end;
    one that ends by itself meanwhile gives its turn on to the next, which is hedged
    once the hedge ends, where it waited for its own slow call (a fetch in the tail
    waited out whole, beside a second suite)."""
    first_calls = {name: threading.Event() for name in ("a", "b", "c")}
    a_hedge = threading.Event()
    calls: dict[str, int] = {}

    def fetch(value: str) -> str:
        calls[value] = calls.get(value, 0) + 1
        wait = first_calls.get(value) if calls[value] == 1 else a_hedge if value == "a" else None
        if wait is not None:
            wait.wait(60)
        return value

    ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stage_fn = StageFunction(lambda value, out: value, prepare=fetch)
    preparing = Preparing(stage_fn, 8, ready, hedges=1)
    ours, theirs = multiprocessing.Pipe()
    reading = threading.Thread(target=preparing.read, args=(theirs,), daemon=True)
    reading.start()
    ours.send([(None, f"warm-{n}", (), n) for n in range(TIMED_BEFORE_HEDGING)])
    for _ in range(TIMED_BEFORE_HEDGING):
        ready.get(timeout=30)
    ours.send([(None, "a", (), 100), (None, "b", (), 101), (None, "c", (), 102)])
    time.sleep(1.0)  # each due its hedge: a's under way, b's and c's waiting for it
    first_calls["b"].set()  # b ends by itself
    assert ready.get(timeout=30).task.value == "b"
    a_hedge.set()  # a's hedge ends: c's turn
    answered = {ready.get(timeout=30).task.value for _ in range(2)}
    for release in first_calls.values():
        release.set()
    ours.send(None)
    reading.join(10)
    assert answered == {"a", "c"}
    assert calls["c"] == 2  # hedged: its first call was still held
