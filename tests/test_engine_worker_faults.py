"""How the engine tells a broken worker from bad input: a child process that dies, hangs
or runs out of memory is replaced and its items retried, then failed alone; a stage that
fails known-good input (its probe; for a fetch, inputs fetched before; for a fan-out, an
image it cut up before) is broken with no item blamed, naming only the jobs in the work
that failed; an OOM kill is blamed on an input only once it is alone."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support import stagefns
from tests.support.pipelines import (
    RecordingObserver,
    fetching_pipeline,
    process_pipeline,
    run_items,
)
from tests.support.timing import wait_until
from worker import engine
from worker.engine import (
    Item,
    Pipeline,
    PrepareStep,
    ProcessStage,
    StageSetupError,
    TensorArena,
    ThreadStage,
    child_handle,
)
from worker.engine.child_handle import ChildProcess
from worker.engine.wire import ChildPlan, KnownGood


@pytest.mark.parametrize("fault", ["sigkill", "segfault"])
def test_worker_that_dies_is_replaced_and_the_item_fails_alone(fault: str) -> None:
    """A writer process that dies on one input is restarted; that input fails after its
    retries, the others all succeed, and the reader's process is never restarted."""
    observer = RecordingObserver()
    pipeline = process_pipeline(
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
    pipeline = process_pipeline(
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
    pipeline = process_pipeline(
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


def test_a_child_lost_while_it_prepares_is_no_items_fault() -> None:
    """A fetch that outlasts the step's time limit (its reads have their own) hangs the
    child: it is replaced, the item tried again, and in the end its error is transient,
    so its job is tried again later rather than the input blamed."""
    observer = RecordingObserver()
    with fetching_pipeline(60.0, 1.0, observer) as pipeline:
        results = run_items(
            pipeline, [Item("j", i, v) for i, v in enumerate(["a", "fetch-hang", "b"])]
        )
    errors = {r.index: r.error for r in results if r.error}
    assert list(errors) == [1]
    assert errors[1] is not None
    assert (errors[1].type, errors[1].stage, errors[1].transient) == ("WorkerHung", "fetch", True)
    assert {r.value for r in results if r.error is None} == {("fetched:a", 7), ("fetched:b", 7)}


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
    child.send([(None, "x", (), 0)])
    assert child.receive(5).outcomes == ["x"]
    child.stop(graceful=False)
    assert not writer.is_alive()


def test_batch_retried_after_inference_process_dies(tmp_path: Any) -> None:
    """When the batch process dies, it is restarted and every item still gets its result."""
    pipeline = process_pipeline(
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
    pipeline = process_pipeline(
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
    pipeline = process_pipeline(
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
    pipeline = process_pipeline(
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


def test_inputs_over_the_size_limit_are_their_own_errors_whatever_was_fetched_before(
    tmp_path: Path,
) -> None:
    """A request of inputs that are all over the size limit fails for their size alone
    (the store, or a tar's header, told it): their errors stand even when the inputs
    fetched before cannot be read for now (a tar's local copy taken with its job). The
    others of a request are judged as ever: with nothing to tell by, theirs are made
    transient."""
    marker = tmp_path / "revoked"
    observer = RecordingObserver()
    with Pipeline([_fetching_stage(marker, 4)], observer) as pipeline:
        for index, value in enumerate("ab"):
            [fetched] = run_items(pipeline, [Item("j", index, value)])
            assert fetched.error is None
        (tmp_path / "gone-a").touch()
        (tmp_path / "gone-b").touch()
        huge = run_items(pipeline, [Item("j", 2 + i, "huge") for i in range(4)])
        mixed = run_items(pipeline, [Item("k", i, v) for i, v in enumerate(["huge", "denied"])])
    assert [(r.error.type, r.error.transient) for r in huge if r.error] == [
        ("ObjectTooLarge", False)
    ] * 4
    # Answered as each is fetched, in either order.
    mixed.sort(key=lambda result: result.index)
    assert [(r.error.type, r.error.transient) for r in mixed if r.error] == [
        ("ObjectTooLarge", False),
        ("PermissionError", True),
    ]
    assert observer.broken == []


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
