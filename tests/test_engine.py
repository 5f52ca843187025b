"""The pipeline engine, which knows nothing of jobs or AWS: channels and batches; items
routed through thread and process stages and shared-memory arenas; a failing item
isolated by bisection; prepare, finish and fan-out steps; stages that grow and shrink;
and the stages overlapping in time. How it tells a broken worker from bad input is
specified in test_engine_worker_faults.py."""

from __future__ import annotations

import errno
import functools
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import stagefns
from tests.support.pipelines import (
    RecordingObserver,
    fetching_pipeline,
    process_pipeline,
    results_out,
    run_items,
)
from tests.support.timing import wait_until
from worker.engine import (
    Item,
    ItemError,
    Pipeline,
    PrepareStep,
    ProcessStage,
    SharedMemoryTooSmall,
    StageSetupError,
    TensorArena,
    ThreadStage,
    isolate_failures,
    process_stage,
)
from worker.engine.channel import Channel, Closed


def test_channel_close_wakes_blocked_reader() -> None:
    """A reader blocked on an empty channel gets Closed when the channel closes."""
    channel: Channel[int] = Channel(1)
    import threading

    outcome: list[str] = []

    def read() -> None:
        try:
            channel.get()
        except Closed:
            outcome.append("closed")

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)
    channel.close()
    reader.join(2)
    assert outcome == ["closed"]


def test_a_batch_put_larger_than_the_channel_goes_in_as_the_reader_makes_room() -> None:
    """The reader waiting for entries is woken for those put before the writer waits
    for room, and gets every one in order."""
    channel: Channel[int] = Channel(2)
    taken: list[int] = []
    reader = threading.Thread(target=lambda: taken.extend(channel.get() for _ in range(7)))
    reader.start()
    writer = threading.Thread(target=channel.put_all, args=(range(7),), daemon=True)
    writer.start()
    reader.join(5)
    channel.close()
    assert taken == list(range(7))


def test_slots_are_taken_together_so_that_a_taker_waiting_holds_none() -> None:
    """A taker waiting for more slots than are free takes none meanwhile: another that
    wants what is free gets it, and the first gets its own once they come back."""
    arena = TensorArena((2, 2), slots=4)
    held = arena.acquire(3)
    waiting: list[list[int]] = []
    taker = threading.Thread(target=lambda: waiting.append(arena.acquire(2)), daemon=True)
    taker.start()
    time.sleep(0.1)
    free = arena.try_acquire(1)
    assert not waiting and free is not None and free[0] not in held
    arena.release(held)
    taker.join(5)
    assert len(waiting) == 1 and len(waiting[0]) == 2 and free[0] not in waiting[0]


def test_get_batch_returns_partial_batch_after_wait() -> None:
    """A lone item is handed out after max_wait, not held until the batch fills."""
    channel: Channel[int] = Channel(10)
    channel.put(1)
    started = time.monotonic()
    assert channel.get_batch(8, 0.05) == [1]
    assert 0.04 <= time.monotonic() - started < 1


def test_entries_ahead_pass_the_others_in_the_order_they_came() -> None:
    """What `ahead` picks out is taken first, by `get_batch` and `take_now`, in the
    order it came; the rest in theirs; both count against the capacity."""
    channel: Channel[int] = Channel(6, ahead=lambda entry: entry >= 100)
    for entry in (1, 2, 100, 3, 101):
        channel.put(entry)
    assert len(channel) == 5
    assert channel.get_batch(3, 0) == [100, 101, 1]
    channel.put(102)
    assert channel.take_now(2) == [102, 2]
    assert channel.take_now(2) is None and channel.get() == 3


def test_an_urgent_item_passes_the_items_queued_before_it() -> None:
    """An item the daemon waits for (`urgent`) is taken in a stage's next batch, before
    the background items queued ahead of it: out of the pipeline before the last."""

    def slow(values: list[int]) -> list[int]:
        time.sleep(0.1)
        return values

    with Pipeline([ThreadStage("slow", slow, batch_size=4)], RecordingObserver()) as pipeline:
        for index in range(8):  # the stage takes four; four wait
            pipeline.submit(Item("background", index, index))
        pipeline.submit(Item("waited-for", 0, 0, urgent=True))
        out = [item.job for item in results_out(pipeline, 9)]
    assert out.index("waited-for") < 8, out


def test_an_urgent_item_goes_in_the_batch_after_the_one_a_device_runs() -> None:
    """A model child gets its next batch near the end of the one it runs, not at its
    start: an urgent item that comes meanwhile is in that next batch, where before it
    waited behind a whole batch of background work already sent."""
    arena = TensorArena((2, 2), slots=32)
    stages = [
        ProcessStage("preprocess", functools.partial(stagefns.sleepy_writer, 0), writes=arena),
        ProcessStage(
            "inference", functools.partial(stagefns.sleepy_reader, 0.2), batch_size=4, reads=arena
        ),
    ]
    with Pipeline(stages, RecordingObserver()) as pipeline:
        for index in range(16):  # the first batch, then three waiting behind it
            pipeline.submit(Item("background", index, index))
        results_out(pipeline, 4)  # the first is done: the second runs, the others wait
        time.sleep(0.1)
        pipeline.submit(Item("waited-for", 0, 0, urgent=True))
        out: list[str] = []
        while "waited-for" not in out:
            out += [item.job for item in pipeline.next_results()]
    assert out[: out.index("waited-for")].count("background") < 8, out


def test_background_room_leaves_a_batch_of_the_arena_to_urgent_items() -> None:
    """What the ledger may feed of background work: the first arena's slots less a
    batch of the stage that reads it, and in a chain the later arenas' slots, where the
    items past the first wait; the reading stage's inbox holds every slot, so a stage
    in front of it never waits with items that are ready."""
    arena = TensorArena((2, 2), slots=40)
    reader = ProcessStage("inference", stagefns.echo_model, batch_size=8, reads=arena)
    pipeline = Pipeline(
        [ProcessStage("preprocess", stagefns.echo_model, writes=arena), reader],
        RecordingObserver(),
    )
    assert pipeline.background_room() == 32
    assert reader.inbox_capacity == 40
    parts = TensorArena((2, 2), slots=24)
    chain = Pipeline(
        [
            ProcessStage("preprocess", stagefns.echo_model, writes=arena),
            ProcessStage("first", stagefns.echo_model, batch_size=8, reads=arena, keeps_slots=True),
            ProcessStage("cut", stagefns.echo_model, reads=arena, writes=parts, max_parts=3),
            ProcessStage("second", stagefns.echo_model, batch_size=16, reads=parts),
        ],
        RecordingObserver(),
    )
    assert chain.background_room() == 32 + 24  # the parts past the first arena wait in
    plain = Pipeline([ThreadStage("slow", lambda values: values)], RecordingObserver())
    assert plain.background_room() is None


def test_isolate_failures_bisects_to_the_bad_items() -> None:
    """Only the items that fail on their own get errors; the rest get outputs."""
    calls: list[list[int]] = []

    def call(positions: list[int]) -> list[int]:
        calls.append(positions)
        if {3, 6} & set(positions):
            raise ValueError("boom")
        return [p * 10 for p in positions]

    outcomes = isolate_failures(call, 8, "model")
    assert [o for o in outcomes if not isinstance(o, ItemError)] == [0, 10, 20, 40, 50, 70]
    assert isinstance(outcomes[3], ItemError) and outcomes[3].message == "boom"
    assert isinstance(outcomes[6], ItemError) and outcomes[6].stage == "model"
    assert len(calls) < 16


@settings(max_examples=60, deadline=None)
@given(
    job_sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    batch_size=st.integers(1, 17),
    workers=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_packing_and_splitting_route_every_result_home(
    job_sizes: list[int], batch_size: int, workers: int, seed: int
) -> None:
    """Items of many jobs, interleaved, packed and split into batches that finish out of
    order, still land at their own job and index, once each."""
    rng = random.Random(seed)

    def shuffled_compute(values: list[tuple[str, int]]) -> list[str]:
        time.sleep(rng.random() / 2000)  # finish batches out of order across workers
        return [f"{job}/{index}" for job, index in values]

    stage = ThreadStage(
        "infer", shuffled_compute, workers=workers, batch_size=batch_size, max_batch_wait_ms=1
    )
    items = [
        Item(f"job{j}", i, (f"job{j}", i)) for j, size in enumerate(job_sizes) for i in range(size)
    ]
    rng.shuffle(items)
    with Pipeline([stage], RecordingObserver()) as pipeline:
        results = run_items(pipeline, items)

    regrouped: dict[str, list[str | None]] = {
        f"job{j}": [None] * size for j, size in enumerate(job_sizes)
    }
    for item in results:
        assert regrouped[item.job][item.index] is None
        regrouped[item.job][item.index] = item.value
    for key, values in regrouped.items():
        assert values == [f"{key}/{i}" for i in range(len(values))]


def test_error_items_flow_to_the_end_untouched() -> None:
    """An item that failed in one stage passes the later stages as an error record."""

    def fail_odd(values: list[int]) -> list[int]:
        if any(v % 2 for v in values):
            raise ValueError("odd")
        return values

    later_saw: list[int] = []

    def later(values: list[int]) -> list[int]:
        later_saw.extend(values)
        return values

    stages = [ThreadStage("first", fail_odd), ThreadStage("second", later)]
    with Pipeline(stages, RecordingObserver()) as pipeline:
        results = run_items(pipeline, [Item("j", i, i) for i in range(6)])
    errors = {r.index: r.error for r in results if r.error}
    assert set(errors) == {1, 3, 5}
    assert all(e.stage == "first" and e.type == "ValueError" for e in errors.values() if e)
    assert sorted(later_saw) == [0, 2, 4]


def test_process_stages_move_tensors_through_the_arena() -> None:
    """A writer fills each item's shared slot in place; the reader sees those bytes."""
    pipeline = process_pipeline(
        functools.partial(stagefns.sleepy_writer, 0.0),
        functools.partial(stagefns.sleepy_reader, 0.0),
    )
    with pipeline:
        results = run_items(pipeline, [Item("j", i, i * 7) for i in range(40)])
    assert sorted(r.value for r in results) == sorted((i * 7, (i * 7) % 256) for i in range(40))


def test_children_start_with_openmps_idle_threads_asleep() -> None:
    """A child's torch threads do not spin on the cores the other children need, unless
    the environment the daemon was started with says otherwise."""
    given = os.environ.get("OMP_WAIT_POLICY")
    stage = ProcessStage("inference", stagefns.environment_reader)
    with Pipeline([stage], RecordingObserver()) as pipeline:
        (result,) = run_items(pipeline, [Item("j", 0, "OMP_WAIT_POLICY")])
    assert result.value == (given or "PASSIVE")


def test_what_the_fork_server_imports_is_never_walked_by_a_collection() -> None:
    """The fork server imports torch and the rest without collecting (each full
    collection walked all it had imported so far: a third of a second of CPU at each
    start), and a child never walks them either (a full collection over them was a tenth
    of a second of each child's start, and copied every page it touched): it has them
    frozen before its set-up, and collects what it makes itself."""
    stage = ProcessStage("inference", stagefns.collector_at_setup)
    with Pipeline([stage], RecordingObserver()) as pipeline:
        (result,) = run_items(pipeline, [Item("j", 0, None)])
    frozen, collecting, full_collections = result.value
    assert full_collections == 0
    assert frozen > 10_000  # torch alone is 100,000 objects
    assert collecting


def test_a_prepare_step_runs_in_the_child_first_and_its_errors_are_the_items() -> None:
    """Each item is fetched in the child, then written. A fetch's error is that item's,
    named after the step, transient where the error is; the others' go on. The stage's
    timeout starts once the request is fetched: a 1.5 s fetch passes a 1 s timeout, and
    a write that hangs is caught by it."""
    observer = RecordingObserver()
    values = ["a", "slow", "throttled", "missing", "b", "hang", "c"]
    with fetching_pipeline(1.0, 60.0, observer) as pipeline:
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    by_index = {r.index: r for r in results}
    for index in (0, 1, 4, 6):
        assert by_index[index].value == (f"fetched:{values[index]}", 7)
    errors = {r.index: r.error for r in results if r.error}
    assert errors == {
        2: ItemError("TransientError", "SlowDown: reduce your request rate", "fetch", True),
        3: ItemError("FileNotFoundError", "no object missing", "fetch", False),
        5: ItemError("WorkerHung", "preprocess-0 gave no answer in 1.0 s", "preprocess", False),
    }
    # Answered as each is fetched: every item reported fetched, in groups of any size.
    assert sum(count for stage, count in observer.calls if stage == "fetch") >= len(values)


def test_an_item_goes_on_once_it_is_fetched_not_once_its_request_is() -> None:
    """A request of four, one of whose inputs takes 1.5 s to fetch: the three others come
    out of the pipeline (fetched, written, inferred) while it is still being fetched,
    where they waited for it before."""
    observer = RecordingObserver()
    out_after_s: dict[int, float] = {}
    with fetching_pipeline(30.0, 60.0, observer) as pipeline:
        started = time.monotonic()
        pipeline.submit(*[Item("j", i, v) for i, v in enumerate(["slow", "a", "b", "c"])])
        while len(out_after_s) < 4:
            for result in pipeline.next_results():
                out_after_s[result.index] = time.monotonic() - started
                assert result.error is None
    assert max(out_after_s[index] for index in (1, 2, 3)) < 1.0 < out_after_s[0]


def test_a_driver_never_waits_for_slots_while_it_holds_replies() -> None:
    """Two fetching children, four requests of four in flight each, and an arena of
    eight slots: a driver that waited for slots for a request ahead would hold replies
    whose slots only it can hand on, and with both drivers so, nothing would move."""
    arena = TensorArena((2, 2), slots=8)
    preprocess = ProcessStage(
        "preprocess",
        functools.partial(stagefns.fetching_writer, 0.0),
        workers=2,
        batch_size=4,
        writes=arena,
        prepare=PrepareStep("fetch", 30.0),
    )
    reader = ProcessStage(
        "inference", functools.partial(stagefns.sleepy_reader, 0.0), batch_size=4, reads=arena
    )
    results: list[Item] = []
    with Pipeline([preprocess, reader], RecordingObserver()) as pipeline:
        runner = threading.Thread(
            target=lambda: results.extend(
                run_items(pipeline, [Item("j", i, f"v{i}") for i in range(60)])
            ),
            daemon=True,
        )
        runner.start()
        runner.join(60)
        assert not runner.is_alive(), "the stages are stuck waiting for slots"
    assert sorted(r.value[0] for r in results) == sorted(f"fetched:v{i}" for i in range(60))


class RacedInbox(Channel[Item]):
    """An inbox whose full batch, the first time a driver looks and sees exactly one
    waiting, another driver takes before this one can: the race of two drivers of one
    stage, forced."""

    def __init__(self, batch_size: int):
        super().__init__(64)
        self.batch_size = batch_size
        self.taken_by_another: list[Item] = []

    def __len__(self) -> int:
        length = super().__len__()
        if length == self.batch_size and not self.taken_by_another:
            self.taken_by_another = self.take_now(length) or []
        return length


def _take(channel: Channel[Item], count: int, within_s: float) -> list[Item]:
    taken: list[Item] = []
    reader = threading.Thread(target=lambda: taken.extend(channel.get() for _ in range(count)))
    reader.daemon = True
    reader.start()
    reader.join(within_s)
    return taken


def test_a_driver_that_loses_the_batch_it_saw_collects_its_replies_first() -> None:
    """A driver with a request in flight sees a full batch waiting, and another driver
    takes it first: the driver collects its child's reply rather than wait for more
    items with the reply unread (which held results until unrelated work came)."""
    stage = ProcessStage(
        "inference", functools.partial(stagefns.finishing_runner, 0.0, 0.0), batch_size=4
    )
    inbox, outbox, finished = RacedInbox(4), Channel[Item](64), Channel[Item](64)
    for number in range(8):
        inbox.put(Item("j", number, f"v{number}"))
    stage.start(inbox, outbox, RecordingObserver(), finished)
    try:
        first = _take(outbox, 4, within_s=20)
        assert [item.value for item in first] == [f"ran:v{n}+" for n in range(4)]
        assert [item.index for item in inbox.taken_by_another] == [4, 5, 6, 7]
        for item in inbox.taken_by_another:
            inbox.put(item)
        assert len(_take(outbox, 4, within_s=20)) == 4
    finally:
        inbox.close()
        stage.stop()


def test_a_finish_step_runs_beside_the_next_request_and_keeps_errors_apart(
    tmp_path: Path,
) -> None:
    """A stage's `finish` makes each output into the item's outcome on a thread of the
    child while the next request runs (0.2 s of run and 0.2 s of finish a request,
    twelve requests): some request runs while the one before it is being finished,
    which none did when the request ahead was sent only once the reply came (the finish
    held it back). An item whose run failed keeps its error and is not finished; a
    finish gives an item an error of its own, and one that raises gives its request's
    items its error; replies stay in order."""
    values = ["a", "bad-run", "b", "bad", "explode", "c", *"defghi"]
    spans = tmp_path / "spans"
    stage = ProcessStage(
        "inference",
        functools.partial(stagefns.finishing_runner, 0.2, 0.2, str(spans)),
        batch_size=1,
    )
    with Pipeline([stage], RecordingObserver()) as pipeline:
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    assert [r.index for r in results] == list(range(12))
    assert [r.value for r in results if r.error is None] == [f"ran:{v}+" for v in "abcdefghi"]
    errors = {r.index: (r.error.type, r.error.stage) for r in results if r.error}
    assert errors == {
        1: ("ValueError", "inference"),
        3: ("ValueError", "postprocess"),
        4: ("RuntimeError", "inference"),
    }
    lines = [line.split() for line in spans.read_text().splitlines()]
    runs = [(float(start), float(end)) for kind, start, end in lines if kind == "run"]
    finishes = [(float(start), float(end)) for kind, start, end in lines if kind == "finish"]
    assert len(runs) == 12 and finishes
    assert any(
        run_start < finish_end and finish_start < run_end
        for run_start, run_end in runs
        for finish_start, finish_end in finishes
    ), (runs, finishes)


class EventsByItem(RecordingObserver):
    """Which item values each stage call's events name (the events a finish logged)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_and_events: list[tuple[list[int], list[int]]] = []

    def stage_ran(self, stage: str, items: Sequence[Item], duration_s: float, events: Any) -> None:
        super().stage_ran(stage, items, duration_s, events)
        named = [int(event["value"]) for event in events if event["event"] == "finished"]
        self.calls_and_events.append(([int(item.index) for item in items], named))


def test_what_a_finish_step_logs_goes_with_its_own_request() -> None:
    """Events logged while a request is finished (a postprocessor's) are filed with that
    request's items, although the next request runs meanwhile: a job's log never gets
    another job's lines."""
    observer = EventsByItem()
    stage = ProcessStage(
        "inference", functools.partial(stagefns.finishing_runner, 0.05, 0.1), batch_size=2
    )
    with Pipeline([stage], observer) as pipeline:
        run_items(pipeline, [Item("j", i, str(i)) for i in range(8)])
    assert observer.calls_and_events
    for indices, named in observer.calls_and_events:
        assert named == indices


def test_values_at_hand_are_prepared_as_their_request_comes_in_with_their_own_errors() -> None:
    """A value the set-up says is at hand is prepared on the child's reader thread, not
    handed to a thread of its own; its error is still the item's, named after the step."""
    arena = TensorArena((2, 2), slots=16)
    preprocess = ProcessStage(
        "preprocess",
        stagefns.local_fetching_writer,
        batch_size=4,
        writes=arena,
        prepare=PrepareStep("fetch", 30.0),
    )
    reader = ProcessStage(
        "inference", functools.partial(stagefns.sleepy_reader, 0.0), batch_size=4, reads=arena
    )
    values = ["local:a", "b", "local:missing", "local:c", "d"]
    with Pipeline([preprocess, reader], RecordingObserver()) as pipeline:
        results = {
            r.index: r for r in run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
        }
    threads = {index: results[index].value[0][1] for index in (0, 1, 3, 4)}
    assert not any(threads[index].startswith("prepare-") for index in (0, 3))
    assert all(threads[index].startswith("prepare-") for index in (1, 4))
    assert results[2].error == ItemError("FileNotFoundError", "no object missing", "fetch", False)


@pytest.mark.parametrize(
    ("item_s", "items", "children_and_cores", "largest"),
    [
        (0.0, 300, (1, 1), (32, 32)),
        (0.02, 16, (1, 1), (2, 2)),
        (0.02, 96, (4, 4), (2, 2)),
        (0.02, 96, (4, 1), (4, 32)),
    ],
)
def test_a_stage_sized_by_time_sends_cheap_items_in_large_requests_and_costly_ones_few_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
    item_s: float,
    items: int,
    children_and_cores: tuple[int, int],
    largest: tuple[int, int],
) -> None:
    """Requests of what a child with a core of its own gets through in about
    `request_s`: items that cost nothing go many at a time, up to `max_request_items`;
    items that take 20 ms each (and 20 ms more waiting behind the request before) go two
    at a time (the batch size) in 50 ms. Four children on one core each go at a quarter
    of a core, and are sent four times as many: sized by what each does at its share,
    the requests would shrink as the children grow in number, and add to the messages
    an item costs the daemon's one process."""
    children, cores = children_and_cores
    monkeypatch.setattr(process_stage, "host_cores", lambda: cores)
    observer = RecordingObserver()
    arena = TensorArena((2, 2), slots=128)
    writer = ProcessStage(
        "preprocess",
        functools.partial(stagefns.sleepy_writer, item_s),
        workers=children,
        batch_size=2,
        writes=arena,
        request_s=0.05,
        max_request_items=32,
    )
    reader = ProcessStage(
        "inference", functools.partial(stagefns.sleepy_reader, 0.0), batch_size=32, reads=arena
    )
    with Pipeline([writer, reader], observer) as pipeline:
        results = run_items(pipeline, [Item("j", i, i) for i in range(items)])
    assert sorted(result.index for result in results) == list(range(items))
    sizes = [count for stage, count in observer.calls if stage == "preprocess"]
    least, most = largest
    assert least <= max(sizes) <= most


def test_a_stage_that_prepares_needs_a_set_up_that_gives_the_step() -> None:
    pipeline = Pipeline(
        [
            ProcessStage(
                "preprocess",
                functools.partial(stagefns.sleepy_writer, 0.0),
                writes=TensorArena((2, 2), slots=4),
                prepare=PrepareStep("fetch", 1.0),
            )
        ],
        RecordingObserver(),
    )
    with pytest.raises(StageSetupError, match="the set-up gave no function for fetch"):
        pipeline.start()


def test_a_fan_out_splits_items_into_parts_that_come_back_whole_and_in_order() -> None:
    """decode -> detector -> fan-out -> classifier, each a process stage. The detector
    keeps each image's slot for the fan-out, which cuts `found % 4` parts into slots of
    a second arena. Items come out whole: their parts' results in part order, none for
    an item with no parts. Per-item errors are caught at every stage (the detector,
    the fan-out, and one part at the classifier, which makes its whole an error), the
    classifier recovers from running out of memory by bisecting, and small arenas with
    a second wave of items show that no slot leaks."""
    images = TensorArena((2,), slots=12)
    crops = TensorArena((2,), slots=10)
    stages = [
        ProcessStage("decode", functools.partial(stagefns.sleepy_writer, 0.0), writes=images),
        ProcessStage(
            "detector",
            functools.partial(stagefns.fill_reader, 9),
            batch_size=4,
            max_batch_wait_ms=5,
            reads=images,
            keeps_slots=True,
        ),
        ProcessStage(
            "crops",
            functools.partial(stagefns.numbered_parts, 7),
            reads=images,
            writes=crops,
            max_parts=3,
        ),
        ProcessStage(
            "classifier",
            functools.partial(stagefns.part_reader, 2, "10.1"),
            batch_size=6,
            max_batch_wait_ms=5,
            reads=crops,
        ),
    ]
    with Pipeline(stages, RecordingObserver()) as pipeline:
        for wave in range(2):
            results = run_items(pipeline, [Item("j", i, i) for i in range(40)])
            assert sorted(item.index for item in results) == list(range(40)), wave
            by_index = {item.index: item for item in results}
            for index, item in by_index.items():
                if index in (7, 9, 10):
                    continue
                assert item.error is None, (index, item.error)
                expected = [(f"{index}.{k}", (f"{index}.{k}", k)) for k in range(index % 4)]
                assert item.value == expected
            assert by_index[9].error and by_index[9].error.stage == "detector"
            assert by_index[7].error and by_index[7].error.stage == "crops"
            assert by_index[10].error and by_index[10].error.stage == "classifier"
            assert by_index[10].error.message == "part 2 of 2: cannot read 10.1"
        assert stages[3].current_batch_size() == 2  # lowered after running out of memory


def test_a_stage_grows_while_the_next_one_waits_and_shrinks_back_once_idle() -> None:
    """Decoding at 20 ms an item (sleeping, so that two cores are no limit) feeds an
    inference stage that waits for it: the preprocess stage grows from its floor of 1
    to its ceiling of 3, every item comes through once and in one piece, and once the
    input stops it shrinks back to 1, its extra processes gone."""
    observer = RecordingObserver()
    arena = TensorArena((2, 2), slots=32)
    stages = [
        ProcessStage(
            "preprocess",
            functools.partial(stagefns.sleepy_writer, 0.02),
            workers=1,
            max_workers=3,
            writes=arena,
        ),
        ProcessStage(
            "inference",
            functools.partial(stagefns.sleepy_reader, 0.0),
            batch_size=8,
            max_batch_wait_ms=5,
            reads=arena,
        ),
    ]
    pipeline = Pipeline(stages, observer, scale_every_s=0.2, shrink_after_s=1.0)
    items = [Item("j", i, i) for i in range(400)]
    with pipeline:
        feeder = threading.Thread(target=lambda: [pipeline.submit(i) for i in items])
        feeder.start()
        results = results_out(pipeline, len(items))
        feeder.join()
        assert ("preprocess", 3) in observer.workers
        # A shrink counts at once; the scaler reports it to the observer just after.
        wait_until(
            lambda: (
                pipeline.worker_counts()["preprocess"] == 1
                and observer.workers[-1] == ("preprocess", 1)
            ),
            timeout_s=20,
            every_s=0.05,
        )
        assert pipeline.worker_counts() == {"preprocess": 1, "inference": 1}
        assert pipeline.dead_stages() == []
    assert sorted(r.value for r in results) == [(i, i % 256) for i in range(400)]
    assert not observer.lost and not observer.broken


def test_stages_overlap() -> None:
    """Three stages of equal cost run concurrently: the wall time is well under the sum
    of the three (two thirds of it: one stage's total with room for a loaded machine's
    wake-ups, which made a bound of 1.5 times one stage's fail under CI's load)."""
    per_item_s, count = 0.02, 40

    def fetch(values: list[int]) -> list[int]:
        time.sleep(per_item_s * len(values))
        return values

    arena = TensorArena((2,), slots=16)
    stages = [
        ThreadStage("fetch", fetch),
        ProcessStage(
            "preprocess", functools.partial(stagefns.sleepy_writer, per_item_s), writes=arena
        ),
        ProcessStage(
            "inference",
            functools.partial(stagefns.sleepy_reader, per_item_s),
            batch_size=4,
            max_batch_wait_ms=50,
            reads=arena,
        ),
    ]
    with Pipeline(stages, RecordingObserver()) as pipeline:
        started = time.perf_counter()
        results = run_items(pipeline, [Item("j", i, i) for i in range(count)])
        wall_s = time.perf_counter() - started
    assert len(results) == count
    all_stages_s = 3 * per_item_s * count
    assert wall_s < 2 / 3 * all_stages_s, (wall_s, all_stages_s)


def test_an_arena_larger_than_shared_memory_is_refused_before_it_is_made(
    tmp_path: Path,
) -> None:
    """A shared tensor bigger than the space left where it lives is no error when made:
    the first write past the space kills the process with SIGBUS. The arena is measured
    against the free space first, and refused with what to do."""
    stats = os.statvfs(tmp_path)
    slot_bytes = 3 * 1024 * 1024
    slots = stats.f_bavail * stats.f_frsize // slot_bytes + 1
    with pytest.raises(SharedMemoryTooSmall, match="--shm-size"):
        TensorArena((3, 1024, 1024), slots, shared_memory=tmp_path)
    assert TensorArena((3, 8, 8), 4, shared_memory=tmp_path).array.shape == (4, 3, 8, 8)


def test_an_arenas_file_is_unlinked_as_it_is_made(tmp_path: Path) -> None:
    """An arena's file is unlinked as it is made: its memory goes with the last process
    that maps it, a SIGKILLed daemon's and its children's too, and none is left where
    shared memory is (/dev/shm)."""
    arena = TensorArena((2, 2), 4, shared_memory=tmp_path)
    arena.array[1] = 7
    assert list(tmp_path.iterdir()) == []
    assert os.fstat(arena.shared.memory.fd).st_nlink == 0
    assert arena.shared.array()[1].tolist() == [[7, 7], [7, 7]]  # the same memory


def test_an_arenas_memory_is_reserved_as_it_is_made() -> None:
    """Every page of an arena is allocated in shared memory when it is made: a file only
    sized would take them as first written, and one that found the file system full
    then would die with SIGBUS, mid-batch, where the arena's start passed its check."""
    arena = TensorArena((64, 1024), 16)
    stats = os.fstat(arena.shared.memory.fd)
    assert stats.st_blocks * 512 >= stats.st_size == 16 * 64 * 1024


def test_shared_memory_with_no_room_left_refuses_an_arena_and_keeps_no_file_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Space taken after the free space was measured (by the arena before, by another
    process) is found as the arena's memory is reserved: refused with what to do, its
    file closed."""

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(SharedMemoryTooSmall, match="--shm-size"):
        TensorArena((64, 1024), 16)
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_an_arena_is_refused_on_linux_without_its_shared_memory(tmp_path: Path) -> None:
    """Where /dev/shm is missing, the arena would be a file on a disk, written back to it
    every batch: refused, where not Linux it is a temporary file."""
    if sys.platform != "linux":
        pytest.skip("elsewhere the arenas are temporary files")
    with pytest.raises(SharedMemoryTooSmall, match="mount a tmpfs"):
        TensorArena((2, 2), 4, shared_memory=tmp_path / "shm")
