"""The pipeline engine: stages joined by bounded channels.

Generic on purpose: it moves `Item`s (a job key, an index, a value) through stage
functions and knows nothing of images, models, S3 or SQS.

- A `ThreadStage` runs a function on threads of this process (I/O-bound work).
- A `ProcessStage` runs it in child processes (CPU- or GPU-bound work). Each child is
  fed by one driver thread here, which waits on the child's pipe *and* its process
  sentinel, so a crash is seen the moment it happens, without polling. The child is
  restarted and the items it held are retried; a stage's other children, and other
  stages, are untouched (a dead CPU worker never reloads the model).
- Errors are data: an item whose function raised carries an `ItemError` and flows on to
  the end of the pipeline like any other; stages pass such items through untouched.
- Large values cross process boundaries through a `TensorArena`: preallocated shared
  memory whose slots one stage writes in place and a later stage reads, so only slot
  numbers travel through pipes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, Protocol

import structlog
import torch
import torch.multiprocessing as torch_mp

from worker.channel import Channel, Closed

ArenaMode = Literal["write", "read"] | None

# A child that died holding an item gets this many tries at it before the item fails,
# so one input that kills its worker (a decoder segfault) cannot loop forever.
MAX_ATTEMPTS_AFTER_CRASH = 3
STOP_GRACE_S = 5.0
OUTPUT_CAPACITY = 1024


@dataclass(frozen=True, slots=True)
class ItemError:
    """Why one item failed: recorded in the results instead of a prediction."""

    type: str
    message: str
    stage: str

    @classmethod
    def from_exception(cls, error: BaseException, stage: str) -> ItemError:
        return cls(type(error).__name__, str(error)[:1000], stage)


@dataclass(slots=True)
class Item:
    """One unit of work: `index` of job `job`, its current `value` or its `error`."""

    job: str
    index: int
    value: Any
    error: ItemError | None = None
    slot: int | None = None
    attempts: int = 0


class StageObserver(Protocol):
    """What the engine reports; the daemon turns it into job logs and statistics."""

    def stage_ran(
        self, stage: str, items: Sequence[Item], duration_s: float, events: Sequence[dict[str, Any]]
    ) -> None:
        """A stage processed `items` (some may now carry errors) in `duration_s`."""

    def worker_lost(self, stage: str, items: Sequence[Item], reason: str) -> None:
        """A child process died or hung while holding `items`; it is being replaced."""

    def stage_broken(self, stage: str, error: BaseException) -> None:
        """A stage cannot go on (its set-up fails): the pipeline is unusable."""


def isolate_failures(
    call: Callable[[list[int]], Sequence[Any]], count: int, stage: str
) -> list[Any]:
    """Run `call` over item positions `0..count-1`, bisecting when it raises.

    Returns one outcome per position: the output, or an `ItemError` for exactly the
    positions that fail on their own. A batch with one bad item costs about
    2*log2(batch) extra calls instead of failing every item in it.
    """
    outcomes: list[Any] = [None] * count

    def run(positions: list[int]) -> None:
        try:
            outputs = call(positions)
            if len(outputs) != len(positions):
                raise ValueError(
                    f"stage returned {len(outputs)} outputs for {len(positions)} inputs"
                )
        except Exception as error:
            if len(positions) == 1:
                outcomes[positions[0]] = ItemError.from_exception(error, stage)
                return
            middle = len(positions) // 2
            run(positions[:middle])
            run(positions[middle:])
            return
        for position, output in zip(positions, outputs, strict=True):
            outcomes[position] = output

    if count:
        run(list(range(count)))
    return outcomes


def _apply(items: Sequence[Item], outcomes: Sequence[Any]) -> None:
    for item, outcome in zip(items, outcomes, strict=True):
        if isinstance(outcome, ItemError):
            item.error = outcome
        else:
            item.value = outcome


class TensorArena:
    """Preallocated shared-memory slots of one shape, handed out and given back.

    Acquiring blocks while every slot is in use, which bounds memory and pushes back on
    the stages before the reader, however large the backlog.
    """

    def __init__(self, slot_shape: Sequence[int], slots: int, dtype: torch.dtype = torch.uint8):
        self.tensor = torch.empty((slots, *slot_shape), dtype=dtype).share_memory_()
        self._free: Channel[int] = Channel(slots)
        for slot in range(slots):
            self._free.put(slot)

    def acquire(self) -> int:
        """A free slot's number, waiting for one; raises `Closed` after `close`."""
        return self._free.get()

    def release(self, slot: int) -> None:
        """Give a slot back once its reader is done with it."""
        self._free.put(slot)

    def close(self) -> None:
        """Wake everyone waiting for a slot."""
        self._free.close()


class _Stage:
    """What thread and process stages share: pulling batches and passing errors through."""

    def __init__(self, name: str, workers: int, batch_size: int, max_batch_wait_ms: float):
        if workers < 1 or batch_size < 1:
            raise ValueError(f"stage {name}: workers and batch_size must be at least 1")
        self.name = name
        self.workers = workers
        self.batch_size = batch_size
        self.max_batch_wait_s = max_batch_wait_ms / 1000
        self._threads: list[threading.Thread] = []

    @property
    def inbox_capacity(self) -> int:
        return 2 * max(self.workers, self.batch_size)

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        arena: TensorArena | None,
    ) -> None:
        self._inbox, self._outbox, self._observer, self._arena = inbox, outbox, observer, arena

    def stop(self) -> None:
        for thread in self._threads:
            thread.join(STOP_GRACE_S)

    def _spawn_thread(self, target: Callable[[], None], suffix: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.name}-{suffix}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _serve(self, run: Callable[[list[Item]], None]) -> None:
        """Take batches until the inbox closes; run the live items, forward them all."""
        try:
            while True:
                items = self._inbox.get_batch(self.batch_size, self.max_batch_wait_s)
                live = [item for item in items if item.error is None]
                if live:
                    run(live)
                self._after_batch(items)
                for item in items:
                    self._outbox.put(item)
        except Closed:
            return

    def _after_batch(self, items: Sequence[Item]) -> None:
        """Hook for stages that hold resources per item (arena readers)."""


class ThreadStage(_Stage):
    """Runs `fn(values) -> outputs` on `workers` threads of this process."""

    def __init__(
        self,
        name: str,
        fn: Callable[[list[Any]], Sequence[Any]],
        workers: int = 1,
        batch_size: int = 1,
        max_batch_wait_ms: float = 0,
    ):
        super().__init__(name, workers, batch_size, max_batch_wait_ms)
        self._fn = fn

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        arena: TensorArena | None,
    ) -> None:
        super().start(inbox, outbox, observer, arena)
        for number in range(self.workers):
            self._spawn_thread(lambda: self._serve(self._run), str(number))

    def _run(self, items: list[Item]) -> None:
        started = time.perf_counter()
        outcomes = isolate_failures(
            lambda positions: self._fn([items[p].value for p in positions]), len(items), self.name
        )
        _apply(items, outcomes)
        self._observer.stage_ran(self.name, items, time.perf_counter() - started, ())


class WorkerLost(Exception):
    """A stage's child process died or stopped answering."""


class WorkerDied(WorkerLost):
    """The child process exited (a crash, a kill) while it held work."""


class WorkerHung(WorkerLost):
    """The child process did not answer within the stage's timeout."""


class StageSetupError(Exception):
    """A stage's set-up (model load, ...) raised in its child process."""


class _ChildProcess:
    """One child of a `ProcessStage` and the pipe that feeds it (used by one thread)."""

    def __init__(self, stage: ProcessStage, number: int):
        self._stage = stage
        self._name = f"{stage.name}-{number}"
        self._process: Any = None
        self._conn: Connection | None = None

    def start(self) -> None:
        """Spawn the child and wait until its set-up is done."""
        context = torch_mp.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        arena_tensor = self._stage.arena.tensor if self._stage.arena else None
        process = context.Process(
            target=_child_main,
            args=(
                child_conn,
                self._stage.setup,
                self._stage.arena_mode,
                arena_tensor,
                self._stage.name,
            ),
            name=self._name,
            daemon=True,
        )
        process.start()
        self._process = process
        child_conn.close()
        self._conn = parent_conn
        try:
            status, detail = self._receive(self._stage.setup_timeout_s)
        except WorkerLost as lost:
            raise StageSetupError(f"{self._name} did not start: {lost}") from lost
        if status != "ready":
            raise StageSetupError(f"{self._name} set-up failed:\n{detail}")

    def call(self, request: Any, timeout_s: float | None) -> Any:
        """Send `request` and wait for the reply, the child's death, or the timeout."""
        assert self._conn is not None
        try:
            self._conn.send(request)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise WorkerDied(f"{self._name} pipe broke: {error}") from error
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float | None) -> Any:
        assert self._conn is not None
        ready = wait([self._conn, self._process.sentinel], timeout_s)
        if self._conn in ready:
            try:
                return self._conn.recv()
            except (EOFError, ConnectionResetError):
                pass
        if not ready:
            raise WorkerHung(f"{self._name} gave no answer in {timeout_s} s")
        self._process.join(STOP_GRACE_S)
        raise WorkerDied(f"{self._name} exited with code {self._process.exitcode}")

    def stop(self) -> None:
        """Ask the child to exit; terminate it, then kill it, if it does not."""
        if self._process is None:
            return
        if self._conn is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
                self._conn.send(None)
            self._conn.close()
            self._conn = None
        for escalate in (lambda: None, self._process.terminate, self._process.kill):
            escalate()
            self._process.join(STOP_GRACE_S)
            if not self._process.is_alive():
                break
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()


class ProcessStage(_Stage):
    """Runs a function made by `setup()` in `workers` child processes.

    `setup` runs once per child (load the model there, once); it must be picklable
    (a module-level function or a `functools.partial` of one). The function it returns
    depends on `arena_mode`:

    - `None`: `fn(values) -> outputs`
    - `"write"`: `fn(value, out) -> output`, per item, writing into `out`, the item's
      arena slot, in place (decode an image straight into shared memory).
    - `"read"`: `fn(batch, values) -> outputs`, where `batch` stacks the items' arena
      slots; the slots are given back once the call returns.
    """

    def __init__(
        self,
        name: str,
        setup: Callable[[], Callable[..., Any]],
        *,
        workers: int = 1,
        batch_size: int = 1,
        max_batch_wait_ms: float = 0,
        timeout_s: float | None = None,
        arena_mode: ArenaMode = None,
        setup_timeout_s: float = 300,
    ):
        super().__init__(name, workers, batch_size, max_batch_wait_ms)
        self.setup = setup
        self.timeout_s = timeout_s
        self.arena_mode = arena_mode
        self.setup_timeout_s = setup_timeout_s
        self.arena: TensorArena | None = None
        self._children: list[_ChildProcess] = []
        self._stopping = threading.Event()

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        arena: TensorArena | None,
    ) -> None:
        super().start(inbox, outbox, observer, arena)
        if self.arena_mode and arena is None:
            raise ValueError(f"stage {self.name} needs a TensorArena")
        self.arena = arena
        self._children = [_ChildProcess(self, number) for number in range(self.workers)]
        # Children start in parallel: each imports torch and may load a model.
        try:
            with ThreadPoolExecutor(self.workers) as pool:
                list(pool.map(_ChildProcess.start, self._children))
        except BaseException:
            self.stop()
            raise
        for number, child in enumerate(self._children):
            self._spawn_thread(functools.partial(self._serve_child, child), str(number))

    def _serve_child(self, child: _ChildProcess) -> None:
        self._serve(functools.partial(self._run, child))

    def stop(self) -> None:
        self._stopping.set()
        super().stop()
        for child in self._children:
            child.stop()

    def _run(self, child: _ChildProcess, items: list[Item]) -> None:
        started = time.perf_counter()
        if self.arena_mode == "write":
            assert self.arena is not None
            for item in items:
                if item.slot is None:
                    item.slot = self.arena.acquire()
        request = [(item.slot, item.value) for item in items]
        try:
            outcomes, events = child.call(request, self.timeout_s)
        except WorkerLost as lost:
            self._recover(child, items, lost)
            return
        _apply(items, outcomes)
        self._observer.stage_ran(self.name, items, time.perf_counter() - started, events)

    def _recover(self, child: _ChildProcess, items: list[Item], lost: WorkerLost) -> None:
        """Replace the child, then retry: halves of a batch, or a single item again."""
        if self._stopping.is_set():
            raise Closed
        self._observer.worker_lost(self.name, items, str(lost))
        try:
            child.restart()
        except StageSetupError as error:
            self._observer.stage_broken(self.name, error)
            raise Closed from error
        if len(items) > 1:
            middle = len(items) // 2
            self._run(child, items[:middle])
            self._run(child, items[middle:])
            return
        item = items[0]
        item.attempts += 1
        if isinstance(lost, WorkerDied) and item.attempts < MAX_ATTEMPTS_AFTER_CRASH:
            self._run(child, items)
        else:
            item.error = ItemError(type(lost).__name__, str(lost), self.name)

    def _after_batch(self, items: Sequence[Item]) -> None:
        if self.arena_mode != "read":
            return
        assert self.arena is not None
        for item in items:
            if item.slot is not None:
                self.arena.release(item.slot)
                item.slot = None


def _child_main(
    conn: Connection,
    setup: Callable[[], Callable[..., Any]],
    arena_mode: ArenaMode,
    arena: torch.Tensor | None,
    stage: str,
) -> None:
    """A stage's child process: set up once, then answer requests until told to stop."""
    # The daemon decides when children stop; a Ctrl-C or a SIGTERM sent to the whole
    # process group must not kill them mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    events = _capture_logs()
    try:
        fn = setup()
    except BaseException:
        conn.send(("setup_failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the daemon is gone: nobody is left to answer
            return
        if request is None:
            return
        events.clear()
        outcomes = _serve_request(fn, arena_mode, arena, request, stage)
        conn.send((outcomes, list(events)))


def _serve_request(
    fn: Callable[..., Any],
    arena_mode: ArenaMode,
    arena: torch.Tensor | None,
    request: list[tuple[int | None, Any]],
    stage: str,
) -> list[Any]:
    slots = [slot for slot, _ in request]
    values = [value for _, value in request]

    def call(positions: list[int]) -> Sequence[Any]:
        chosen = [values[p] for p in positions]
        if arena_mode is None:
            return fn(chosen)  # type: ignore[no-any-return]
        assert arena is not None
        if arena_mode == "write":
            return [fn(values[p], arena[slots[p]]) for p in positions]
        return fn(arena[torch.tensor([slots[p] for p in positions])], chosen)  # type: ignore[no-any-return]

    return isolate_failures(call, len(values), stage)


def _capture_logs() -> list[dict[str, Any]]:
    """Collect a child's structlog events so the daemon can file them in job logs."""
    events: list[dict[str, Any]] = []

    def capture(_: Any, level: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        events.append({**event, "level": level, "pid": os.getpid()})
        raise structlog.DropEvent

    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    return events


class Pipeline:
    """Stages joined by bounded channels: `submit` items in, take `next_result` out."""

    def __init__(
        self,
        stages: Sequence[_Stage],
        observer: StageObserver,
        arena: TensorArena | None = None,
    ):
        self._stages = list(stages)
        self._observer = observer
        self._arena = arena
        self._channels: list[Channel[Item]] = [Channel(stage.inbox_capacity) for stage in stages]
        self._channels.append(Channel(OUTPUT_CAPACITY))

    def start(self) -> None:
        """Start every stage (children included); raises `StageSetupError` if one cannot."""
        try:
            for stage, inbox, outbox in zip(
                self._stages, self._channels, self._channels[1:], strict=False
            ):
                stage.start(inbox, outbox, self._observer, self._arena)
        except BaseException:
            self.close()
            raise

    def submit(self, item: Item) -> None:
        """Feed an item in, waiting while the first stage is full; `Closed` when stopping."""
        self._channels[0].put(item)

    def next_result(self) -> Item:
        """The next item out of the last stage, in completion order; `Closed` when stopping."""
        return self._channels[-1].get()

    def close(self) -> None:
        """Stop every stage and child process; items still inside are dropped."""
        for channel in self._channels:
            channel.close()
        if self._arena is not None:
            self._arena.close()
        for stage in self._stages:
            stage.stop()

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
