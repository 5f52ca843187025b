"""The pipeline engine, which knows nothing of jobs or AWS: channels and batches; items
routed through thread and process stages and shared-memory arenas; a failing item
isolated by bisection; a child process that dies, hangs or runs out of memory
replaced, and its items retried or failed alone; a stage that fails known-good input
broken, with no item blamed; prepare, finish and fan-out steps; stages that grow and
shrink; and the stages overlapping in time."""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import stagefns
from tests.support.timing import wait_until
from worker import engine
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
    child_handle,
    isolate_failures,
)
from worker.engine.channel import Channel, Closed
from worker.engine.child_handle import ChildProcess
from worker.engine.wire import ChildPlan, KnownGood


class RecordingObserver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.events: list[str] = []
        self.lost: list[str] = []
        self.broken: list[str] = []
        self.suspects: list[frozenset[str] | None] = []
        self.workers: list[tuple[str, int]] = []

    def stage_ran(self, stage: str, items: Sequence[Item], duration_s: float, events: Any) -> None:
        self.calls.append((stage, len(items)))
        self.events += [event["event"] for event in events]

    def worker_lost(self, stage: str, items: Sequence[Item], reason: str) -> None:
        self.lost.append(reason)

    def stage_broken(self, stage: str, error: BaseException, jobs: frozenset[str] | None) -> None:
        self.broken.append(f"{type(error).__name__}: {error}")
        self.suspects.append(jobs)

    def workers_changed(self, stage: str, workers: int, reason: str) -> None:
        self.workers.append((stage, workers))


def run_items(pipeline: Pipeline, items: list[Item]) -> list[Item]:
    for item in items:
        pipeline.submit(item)
    return [pipeline.next_result() for _ in items]


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


def test_get_batch_returns_partial_batch_after_wait() -> None:
    """A lone item is handed out after max_wait, not held until the batch fills."""
    channel: Channel[int] = Channel(10)
    channel.put(1)
    started = time.monotonic()
    assert channel.get_batch(8, 0.05) == [1]
    assert 0.04 <= time.monotonic() - started < 1


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


def _process_pipeline(
    writer: Any,
    reader: Any,
    *,
    batch_size: int = 4,
    timeout_s: float = 30,
    observer: RecordingObserver | None = None,
) -> Pipeline:
    arena = TensorArena((2, 2), slots=16)
    stages = [
        ProcessStage("preprocess", writer, workers=2, writes=arena, timeout_s=timeout_s),
        ProcessStage("inference", reader, batch_size=batch_size, max_batch_wait_ms=5, reads=arena),
    ]
    return Pipeline(stages, observer or RecordingObserver())


def test_process_stages_move_tensors_through_the_arena() -> None:
    """A writer fills each item's shared slot in place; the reader sees those bytes."""
    pipeline = _process_pipeline(
        functools.partial(stagefns.sleepy_writer, 0.0),
        functools.partial(stagefns.sleepy_reader, 0.0),
    )
    with pipeline:
        results = run_items(pipeline, [Item("j", i, i * 7) for i in range(40)])
    assert sorted(r.value for r in results) == sorted((i * 7, (i * 7) % 256) for i in range(40))


@pytest.mark.parametrize("fault", ["sigkill", "segfault"])
def test_worker_that_dies_is_replaced_and_the_item_fails_alone(fault: str) -> None:
    """A writer process that dies on one input is restarted; that input fails after its
    retries, the others all succeed, and the reader's process is never restarted."""
    observer = RecordingObserver()
    pipeline = _process_pipeline(
        stagefns.faulty_writer, functools.partial(stagefns.sleepy_reader, 0.0), observer=observer
    )
    values = ["a", "b", fault, "c", "raise", "d"]
    with pipeline:
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    by_index = {r.index: r for r in results}
    assert by_index[2].error is not None and by_index[2].error.type == "WorkerDied"
    assert by_index[4].error is not None and by_index[4].error.message == "bad input"
    assert {by_index[i].value for i in (0, 1, 3, 5)} == {
        ("ok:a", 1),
        ("ok:b", 1),
        ("ok:c", 1),
        ("ok:d", 1),
    }
    assert len(observer.lost) == 3
    assert all("preprocess" in reason for reason in observer.lost)


def test_hung_worker_is_replaced_and_the_item_times_out() -> None:
    """An input that makes preprocessing hang becomes an item error after the timeout."""
    pipeline = _process_pipeline(
        stagefns.faulty_writer, functools.partial(stagefns.sleepy_reader, 0.0), timeout_s=1.0
    )
    with pipeline:
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(["a", "hang", "b"])])
    errors = {r.index: r.error for r in results if r.error}
    assert list(errors) == [1] and errors[1] is not None and errors[1].type == "WorkerHung"


def test_a_hang_is_caught_while_a_big_request_waits_for_the_hung_child() -> None:
    """The driver queues the next request behind the one the child hangs on; that one
    is larger than a pipe holds, so writing it waits for a child that never reads. The
    hang is still caught at the timeout, and the big inputs go through."""
    big = "x" * (4 << 20)
    values = ["hang", big, big, big, big]
    pipeline = _process_pipeline(
        stagefns.faulty_writer, functools.partial(stagefns.sleepy_reader, 0.0), timeout_s=1.0
    )
    results: list[Item] = []
    with pipeline:
        runner = threading.Thread(
            target=lambda: results.extend(
                run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
            ),
            daemon=True,
        )
        runner.start()
        runner.join(30)
        assert not runner.is_alive(), "the driver is stuck writing to a hung child"
    errors = {r.index: r.error for r in results if r.error}
    assert list(errors) == [0] and errors[0] is not None and errors[0].type == "WorkerHung"


def _fetching_pipeline(
    timeout_s: float, prepare_timeout_s: float, observer: RecordingObserver
) -> Pipeline:
    arena = TensorArena((2, 2), slots=16)
    preprocess = ProcessStage(
        "preprocess",
        functools.partial(stagefns.fetching_writer, 1.5),
        batch_size=4,
        writes=arena,
        timeout_s=timeout_s,
        prepare=PrepareStep("fetch", prepare_timeout_s),
    )
    reader = ProcessStage(
        "inference", functools.partial(stagefns.sleepy_reader, 0.0), batch_size=4, reads=arena
    )
    return Pipeline([preprocess, reader], observer)


def test_a_prepare_step_runs_in_the_child_first_and_its_errors_are_the_items() -> None:
    """Each item is fetched in the child, then written. A fetch's error is that item's,
    named after the step, transient where the error is; the others' go on. The stage's
    timeout starts once the request is fetched: a 1.5 s fetch passes a 1 s timeout, and
    a write that hangs is caught by it."""
    observer = RecordingObserver()
    values = ["a", "slow", "throttled", "missing", "b", "hang", "c"]
    with _fetching_pipeline(1.0, 60.0, observer) as pipeline:
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
    assert ("fetch", 4) in observer.calls


def test_a_child_lost_while_it_prepares_is_no_items_fault() -> None:
    """A fetch that outlasts the step's time limit (its reads have their own) hangs the
    child: it is replaced, the item tried again, and in the end its error is transient,
    so its job is tried again later rather than the input blamed."""
    observer = RecordingObserver()
    with _fetching_pipeline(60.0, 1.0, observer) as pipeline:
        results = run_items(
            pipeline, [Item("j", i, v) for i, v in enumerate(["a", "fetch-hang", "b"])]
        )
    errors = {r.index: r.error for r in results if r.error}
    assert list(errors) == [1]
    assert errors[1] is not None
    assert (errors[1].type, errors[1].stage, errors[1].transient) == ("WorkerHung", "fetch", True)
    assert {r.value for r in results if r.error is None} == {("fetched:a", 7), ("fetched:b", 7)}


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


def test_a_finish_step_runs_beside_the_next_request_and_keeps_errors_apart() -> None:
    """A stage's `finish` makes each output into the item's outcome on a thread of the
    child while the next request runs (0.2 s of run and 0.2 s of finish a request, six
    requests: well under the 2.4 s one after the other). An item whose run failed
    keeps its error and is not finished; a finish gives an item an error of its own, and
    one that raises gives its request's items its error; replies stay in order."""
    values = ["a", "bad-run", "b", "bad", "explode", "c"]
    stage = ProcessStage(
        "inference", functools.partial(stagefns.finishing_runner, 0.2, 0.2), batch_size=1
    )
    with Pipeline([stage], RecordingObserver()) as pipeline:
        started = time.perf_counter()
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
        elapsed_s = time.perf_counter() - started
    assert [r.index for r in results] == list(range(6))
    assert [r.value for r in results if r.error is None] == ["ran:a+", "ran:b+", "ran:c+"]
    errors = {r.index: (r.error.type, r.error.stage) for r in results if r.error}
    assert errors == {
        1: ("ValueError", "inference"),
        3: ("ValueError", "postprocess"),
        4: ("RuntimeError", "inference"),
    }
    assert elapsed_s < 2.0, elapsed_s


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


def test_a_reply_that_cannot_be_sent_is_a_lost_worker_not_a_shifted_answer() -> None:
    """An outcome the finish step makes that cannot cross the pipe (it cannot be
    pickled) ends the child: its item is retried and, killing every fresh child, failed
    alone; the items before and after it keep their own answers."""
    stage = ProcessStage(
        "inference",
        functools.partial(stagefns.finishing_runner, 0.0, 0.0),
        batch_size=1,
        timeout_s=5,
    )
    observer = RecordingObserver()
    with Pipeline([stage], observer) as pipeline:
        values = ["a", "unsendable", "b", "c"]
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    answers = {r.index: r.value for r in results if r.error is None}
    assert answers == {0: "ran:a+", 2: "ran:b+", 3: "ran:c+"}
    (failed,) = [r for r in results if r.error is not None]
    assert failed.index == 1 and failed.error is not None and failed.error.type == "WorkerDied"
    assert len(observer.lost) == engine.MAX_ITEM_ATTEMPTS


def test_a_finish_step_that_fails_known_good_input_is_a_broken_worker(tmp_path: Path) -> None:
    """A finish that fails every item of a request is the items' fault while its probe
    passes (bad params); once the probe fails too (a broken postprocessor), no item is
    blamed: a fresh child fails the same way and the stage reports itself broken."""
    marker = tmp_path / "broken"
    observer = RecordingObserver()
    stage = ProcessStage(
        "inference", functools.partial(stagefns.failing_finisher, str(marker)), batch_size=2
    )
    with Pipeline([stage], observer) as pipeline:
        blamed = run_items(pipeline, [Item("j", i, i) for i in range(2)])
        assert [(r.error.type, r.error.stage) for r in blamed if r.error] == [
            ("KeyError", "postprocess")
        ] * 2
        marker.touch()
        for index in range(2):
            pipeline.submit(Item("k", index, index))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert [broken.startswith("WorkerFault") for broken in observer.broken] == [True]
    assert "libpostprocess.so" in observer.broken[0]


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


def test_a_stopped_childs_writer_ends_before_its_pipe_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replacement's pipe may get the descriptors the old one had, so a late write
    of the old writer would reach the fresh child (it read the stop request and exited
    0) or the daemon (it read None where it waited for "ready"). `stop` returns only
    once the writer has ended, here one held up between taking a request and writing it."""
    write_requests = child_handle.write_requests

    class Late:
        def __init__(self, requests: Any):
            self._requests = requests

        def get(self) -> Any:
            request = self._requests.get()
            time.sleep(0.5)
            return request

    monkeypatch.setattr(
        child_handle, "write_requests", lambda conn, requests: write_requests(conn, Late(requests))
    )
    plan = ChildPlan("echo", stagefns.faulty_runner, None, None, 1, 0, KnownGood(), None, None)
    child = ChildProcess("echo-0", lambda: plan, None, threading.Event())
    child.start()
    writer = next(t for t in threading.enumerate() if t.name == "echo-0-writer")
    child.send([(None, "x", ())])
    assert child.receive(5).outcomes == ["x"]
    child.stop(graceful=False)
    assert not writer.is_alive()


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
        results = [pipeline.next_result() for _ in items]
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


def test_batch_retried_after_inference_process_dies(tmp_path: Any) -> None:
    """When the batch process dies, it is restarted and every item still gets its result."""
    pipeline = _process_pipeline(
        functools.partial(stagefns.sleepy_writer, 0.0),
        functools.partial(stagefns.kill_once_reader, str(tmp_path / "died")),
    )
    with pipeline:
        results = run_items(pipeline, [Item("j", i, i) for i in range(8)])
    assert sorted(r.value for r in results) == list(range(8))
    assert all(r.error is None for r in results)


def test_out_of_memory_splits_the_batch_and_lowers_the_batch_size_for_a_while() -> None:
    """A batch that does not fit is retried in halves (no item fails), and the next
    batches are no larger than what fitted until the cool-down ends."""
    observer = RecordingObserver()
    stage = ProcessStage(
        "inference",
        functools.partial(stagefns.memory_limited, 4),
        batch_size=16,
        max_batch_wait_ms=300,
        oom_cooldown_s=1.5,
    )
    with Pipeline([stage], observer) as pipeline:
        results = run_items(pipeline, [Item("j", i, i) for i in range(48)])
        assert [r.value for r in sorted(results, key=lambda r: r.index)] == list(range(48))
        assert all(r.error is None for r in results)
        sizes = [size for _, size in observer.calls]
        # The batch queued behind the first (pipelining) was gathered before the lesson.
        assert sizes[0] == 16 and max(sizes[2:]) <= 4, sizes
        assert "out_of_memory" in observer.events
        time.sleep(1.6)
        observer.calls.clear()
        run_items(pipeline, [Item("j", i, i) for i in range(20)])
        # The batch already being gathered when the cool-down ended is still small.
        assert max(size for _, size in observer.calls) == 16, observer.calls


def test_out_of_memory_on_a_single_item_is_not_the_items_fault() -> None:
    """An item that does not fit even alone is memory pressure (every item of a stage
    has the same shape): its error is transient, so its job retries it, never fails it."""
    stage = ProcessStage("inference", functools.partial(stagefns.memory_limited, 0))
    with Pipeline([stage], RecordingObserver()) as pipeline:
        [result] = run_items(pipeline, [Item("j", 0, 0)])
    assert result.error is not None
    assert (result.error.type, result.error.transient) == ("OutOfMemoryError", True)


def test_setup_failure_is_reported_at_start() -> None:
    """A stage whose set-up raises (a bad model) stops the pipeline from starting."""
    pipeline = _process_pipeline(
        stagefns.broken_setup, functools.partial(stagefns.sleepy_reader, 0.0)
    )
    with pytest.raises(StageSetupError, match="model file is corrupt"):
        pipeline.start()


def test_a_stage_failing_known_good_input_is_broken_and_no_item_is_blamed(
    tmp_path: Path,
) -> None:
    """Once the model fails everything, its probe included (a sticky CUDA error), the
    batch is not turned into item errors: a fresh process is tried, fails the same way,
    and the stage reports itself broken with the cause."""
    marker = tmp_path / "broken"
    observer = RecordingObserver()
    pipeline = _process_pipeline(
        functools.partial(stagefns.sleepy_writer, 0.0),
        functools.partial(stagefns.breakable_reader, str(marker)),
        observer=observer,
    )
    with pipeline:
        assert all(
            r.error is None for r in run_items(pipeline, [Item("j", i, i) for i in range(4)])
        )
        marker.touch()
        for index in range(4):
            pipeline.submit(Item("k", index, index))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert [broken.startswith("WorkerFault") for broken in observer.broken] == [True]
    assert observer.suspects == [frozenset({"k"})]
    assert "a fresh worker failed the same way" in observer.broken[0]
    assert "illegal memory access" in observer.broken[0]
    assert len(observer.lost) == 1 and "failed its probe" in observer.lost[0]


def test_items_that_fail_while_the_probe_passes_are_the_inputs_fault() -> None:
    """A batch in which every item fails is still the items' fault when the stage's
    probe passes: each gets its error, and no process is replaced."""
    observer = RecordingObserver()
    pipeline = _process_pipeline(
        functools.partial(stagefns.sleepy_writer, 0.0), stagefns.picky_reader, observer=observer
    )
    values = ["bad", "bad", "bad"]
    with pipeline:
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    assert [r.error.type if r.error else None for r in results] == ["ValueError"] * 3
    assert observer.lost == [] and observer.broken == []


def test_an_item_that_kills_every_worker_is_blamed_only_if_the_probe_passes() -> None:
    """A process that dies on every input and on its probe (a dead GPU) is the worker's
    fault: after the item's tries, the fresh process's probe dies too, and the stage is
    reported broken instead of failing the item."""
    observer = RecordingObserver()
    stages = [ProcessStage("preprocess", stagefns.doomed_writer, writes=TensorArena((2,), slots=4))]
    with Pipeline(stages, observer) as pipeline:
        pipeline.submit(Item("j", 0, 0))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert "WorkerFault" in observer.broken[0] and "failed its probe" in observer.broken[0]


def test_a_worker_that_dies_during_start_up_is_started_again(tmp_path: Path) -> None:
    """A child that dies before it is ready is retried like one that dies later; one
    that dies at every start stops the pipeline from starting."""
    once = functools.partial(stagefns.dies_at_first_start, str(tmp_path / "once"))
    with Pipeline(
        [ProcessStage("preprocess", once, writes=TensorArena((2,), slots=4))], RecordingObserver()
    ) as pipeline:
        assert [r.value for r in run_items(pipeline, [Item("j", 0, 3)])] == [3]
    always = functools.partial(stagefns.dies_at_first_start, str(tmp_path / "always"), 99)
    pipeline = Pipeline(
        [ProcessStage("preprocess", always, writes=TensorArena((2,), slots=4))], RecordingObserver()
    )
    with pytest.raises(StageSetupError, match="did not start"):
        pipeline.start()


def test_an_items_tries_are_counted_per_stage(tmp_path: Path) -> None:
    """An item that killed two preprocessing processes has its three tries again at the
    next stage: one death there is retried, not blamed on the item."""
    arena = TensorArena((2,), slots=4)
    writer = functools.partial(stagefns.dies_while_writing, str(tmp_path / "writer"), 2)
    reader = functools.partial(stagefns.kill_once_reader, str(tmp_path / "reader"))
    stages = [
        ProcessStage("preprocess", writer, writes=arena),
        ProcessStage("inference", reader, reads=arena),
    ]
    with Pipeline(stages, RecordingObserver()) as pipeline:
        [result] = run_items(pipeline, [Item("j", 0, 5)])
    assert result.error is None and result.value == 5
    assert (tmp_path / "writer").read_text() == "2" and (tmp_path / "reader").exists()


def test_a_stage_thread_that_raises_reports_the_stage_broken() -> None:
    """A driver thread that raises (a bug, not an input) does not die silently and
    leave the stage short of a worker: the stage is reported broken."""

    class Exploding(RecordingObserver):
        def stage_ran(
            self, stage: str, items: Sequence[Item], duration_s: float, events: Any
        ) -> None:
            raise RuntimeError("bookkeeping bug")

    observer = Exploding()
    with Pipeline([ThreadStage("fetch", lambda values: values)], observer) as pipeline:
        pipeline.submit(Item("j", 0, 0))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert observer.broken == ["RuntimeError: bookkeeping bug"]


def test_stages_overlap() -> None:
    """Three stages of equal cost run concurrently: the wall time is close to one
    stage's total, not the sum of the three."""
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
    slowest_stage_s, all_stages_s = per_item_s * count, 3 * per_item_s * count
    assert wall_s < 1.5 * slowest_stage_s, (wall_s, slowest_stage_s)
    assert wall_s < 0.5 * all_stages_s


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
    assert TensorArena((3, 8, 8), 4, shared_memory=tmp_path).tensor.shape == (4, 3, 8, 8)


def _fetching_stage(marker: Path, batch_size: int) -> ProcessStage:
    return ProcessStage(
        "preprocess",
        functools.partial(stagefns.revocable_fetcher, str(marker)),
        batch_size=batch_size,
        writes=TensorArena((2, 2), slots=16),
        prepare=PrepareStep("fetch", 30.0),
    )


def test_a_fetch_that_fails_inputs_fetched_before_too_is_a_broken_worker(
    tmp_path: Path,
) -> None:
    """An object the worker may not read is that input's error, even in a request of
    only such, while an input fetched before still reads (one deleted since is
    forgotten, not taken for the worker's fault). Once every input fails (credentials
    revoked), so do two fetched before: no item is blamed, a fresh child fails the same
    way, and the stage is broken with the failing request's job the suspect."""
    marker = tmp_path / "revoked"
    observer = RecordingObserver()
    with Pipeline([_fetching_stage(marker, 4)], observer) as pipeline:
        for index, value in enumerate("ab"):  # two requests: two inputs known good
            [fetched] = run_items(pipeline, [Item("j", index, value)])
            assert fetched.error is None
        (tmp_path / "deleted-b").touch()
        denied = run_items(pipeline, [Item("j", 2 + i, "denied") for i in range(4)])
        assert [(r.error.type, r.error.transient) for r in denied if r.error] == [
            ("PermissionError", False)
        ] * 4
        assert observer.broken == []
        [fetched] = run_items(pipeline, [Item("j", 6, "c")])
        marker.touch()
        for index in range(4):
            pipeline.submit(Item("k", index, f"v{index}"))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert observer.broken[0].startswith("WorkerFault"), observer.broken
    assert "inputs that passed fetch before fail too: PermissionError" in observer.broken[0]
    assert observer.suspects == [frozenset({"k"})]


def test_a_fetch_step_that_never_fetched_an_input_blames_none_and_stops_on_a_third_job(
    tmp_path: Path,
) -> None:
    """With nothing fetched before to tell by, inputs that all fail are not blamed: their
    errors are transient (fed again, then the job given back). Requests of three jobs in
    a row failing so make the stage broken (credentials that never worked), all three
    jobs its suspects."""
    marker = tmp_path / "revoked"
    marker.touch()
    observer = RecordingObserver()
    with Pipeline([_fetching_stage(marker, 1)], observer) as pipeline:
        untold = run_items(pipeline, [Item("j", i, f"v{i}") for i in range(2)])
        untold += run_items(pipeline, [Item("k", 0, "v0")])
        assert all(r.error and r.error.transient for r in untold)
        assert all("no input passed fetch before" in r.error.message for r in untold if r.error)
        assert observer.broken == []
        pipeline.submit(Item("l", 0, "v0"))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert "none was ever prepared" in observer.broken[0]
    assert observer.suspects == [frozenset({"j", "k", "l"})]


def test_a_fan_out_that_fails_an_image_it_cut_up_before_is_a_broken_worker(
    tmp_path: Path,
) -> None:
    """A fan-out has no probe of its own: it is probed with an image it cut up before.
    Once it fails every image and that one too, no item is blamed and the stage is
    broken, with the job of the image it failed on the suspect."""
    marker = tmp_path / "broken"
    images = TensorArena((2,), slots=8)
    crops = TensorArena((2,), slots=8)
    stages = [
        ProcessStage("decode", functools.partial(stagefns.sleepy_writer, 0.0), writes=images),
        ProcessStage(
            "detector", functools.partial(stagefns.fill_reader, -1), reads=images, keeps_slots=True
        ),
        ProcessStage(
            "crops",
            functools.partial(stagefns.revocable_parts, str(marker)),
            reads=images,
            writes=crops,
            max_parts=3,
        ),
        ProcessStage("classifier", functools.partial(stagefns.part_reader, 8, "none"), reads=crops),
    ]
    observer = RecordingObserver()
    with Pipeline(stages, observer) as pipeline:
        cut = run_items(pipeline, [Item("j", i, i) for i in (1, 2, 3)])
        assert all(r.error is None for r in cut)
        marker.touch()
        pipeline.submit(Item("k", 0, 5))
        wait_until(lambda: observer.broken, every_s=0.05)
    assert observer.broken[0].startswith("WorkerFault"), observer.broken
    assert "the fan-out's process is broken" in observer.broken[0]
    assert observer.suspects == [frozenset({"k"})]


def test_an_oom_kill_is_decided_only_once_the_input_is_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input whose child the kernel's OOM killer kills is decided on only once it has
    been isolated alone: killed on every try with a fresh child that passes its probe,
    the error says it needs more memory than the host gives it. One killed by SIGKILL
    from anyone else is a plain death."""
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 12\noom_kill 0\n")
    monkeypatch.setattr(child_handle, "HOST_VMSTAT", vmstat)
    stage = ProcessStage(
        "decode",
        functools.partial(stagefns.oom_killed_writer, str(vmstat)),
        writes=TensorArena((2,), slots=4),
    )
    with Pipeline([stage], RecordingObserver()) as pipeline:
        values = ["oom", "sigkill", 5]
        results = run_items(pipeline, [Item("j", i, v) for i, v in enumerate(values)])
    errors = {r.index: r.error for r in results}
    assert errors[0] is not None and not errors[0].transient
    assert "killed by the kernel's OOM killer on each try with only this input" in (
        errors[0].message
    )
    assert errors[1] is not None and (errors[1].type, errors[1].transient) == ("WorkerDied", False)
    assert "OOM" not in errors[1].message
    assert errors[2] is None
