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
- A worker fault is not data: when every item of a call fails, the child runs its
  stage's probe (known-good input). If that fails too, the items are not blamed: the
  child is replaced and the call retried, and if the fresh child fails the same way the
  stage reports itself broken (`WorkerFault`). Items that kill or hang their child on
  every try are blamed only after a fresh child passes its probe.
- A process stage may `prepare` each item in its child before the function runs
  (fetch the input's bytes there, on threads of the child), so the bytes never cross a
  pipe and the work of getting them never holds this process's interpreter.
- Large values cross process boundaries through a `TensorArena`: preallocated shared
  memory whose slots one stage writes in place and a later stage reads, so only slot
  numbers travel through pipes.
- A fan-out stage turns each item into parts (an image into crops of what a detector
  found), each in a slot of another arena; later stages run the parts as items, and
  `Pipeline.next_result` puts each item back together from its parts, in order.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import structlog
import torch
import torch.multiprocessing as torch_mp

from worker.engine.channel import Channel, Closed
from worker.errors import TransientError, WorkerFault

ArenaMode = Literal["write", "read", "fan-out"] | None

# An item whose child died or hung while holding it gets this many tries before it is
# blamed, so one input that kills or hangs its worker cannot loop forever.
MAX_ITEM_ATTEMPTS = 3
# A child that dies before it is ready is started again this many times in all; a set-up
# that raises is not retried (it would raise again).
START_ATTEMPTS = 3
STOP_GRACE_S = 5.0
PROBE = "probe"  # the request that asks a child to run its stage's probe
FORKSERVER_PRELOAD = ("torch", "worker.engine")
OUTPUT_CAPACITY = 1024
PIPELINED_BATCHES = 2
# A stage that prepares (fetches) keeps more requests in each child, which starts
# preparing each as it arrives: a slow read then holds up the replies behind it, not the
# fetching of the requests after it.
PIPELINED_PREPARING = 4
_WHOLES = itertools.count()  # numbers the items a fan-out splits into parts
# After an out-of-memory error, batches stay at the size that fitted for this long:
# retrying the full size at once would only run out of memory again.
OOM_COOLDOWN_S = 300.0
# A stage that has never prepared an input (fetched it) stops once requests of this many
# jobs in a row failed every item (`_judged`, untold).
UNTOLD_JOBS_BEFORE_FAULT = 3
# The prepare step's probe: the latest values that passed it (from different requests);
# it blames the worker only when at least two are known and all fail, so one input its
# owner deleted since cannot.
KNOWN_GOOD_VALUES = 3
KNOWN_GOOD_REFRESH_S = 60.0  # a fan-out's known-good image is copied at most this often
# WorkerScaler: how often it looks, and the utilisation of a stage's workers (their
# time on requests over the wall time) above which it adds one when the next stage
# waits, and below which (counted as if one fewer did the work) it removes one.
SCALE_EVERY_S = 2.0
SHRINK_AFTER_S = 30.0
GROW_ABOVE_UTILISATION = 0.8
SHRINK_BELOW_UTILISATION = 0.6

log = structlog.get_logger()
# Where torch puts shared tensors on Linux (shm_open).
SHARED_MEMORY_DIR = Path("/dev/shm")
HOST_VMSTAT = Path("/proc/vmstat")  # its oom_kill counts the OOM killer's kills


@dataclass(frozen=True, slots=True)
class ItemError:
    """Why one item failed: recorded in the results instead of a prediction, unless it
    is `transient` (the surroundings failed, not the input: its job is to be retried)."""

    type: str
    message: str
    stage: str
    transient: bool = False

    @classmethod
    def from_exception(cls, error: BaseException, stage: str) -> ItemError:
        # Out of memory on one item is memory pressure, not the item: every item of a
        # stage has the same shape, and it fitted before. The host's memory likewise:
        # an input's bytes and pixels are bounded before it is decoded.
        transient = isinstance(error, TransientError | torch.OutOfMemoryError | MemoryError)
        return cls(type(error).__name__, str(error)[:1000], stage, transient)


@dataclass(frozen=True)
class StageFunction:
    """What a process stage's set-up may return instead of a bare function: the function,
    a probe that runs it on known-good input and raises if that fails, and what the
    set-up found out about itself (which model it loaded, how long it warmed up), which
    the stage hands to the daemon once its children are ready."""

    run: Callable[..., Any]
    probe: Callable[[], object] | None = None
    about: Mapping[str, Any] = field(default_factory=dict)
    prepare: Callable[[Any], Any] | None = None  # per item, before `run`: `PrepareStep`
    # `finish(outputs, values) -> outcomes`: each request's outputs (its errors apart) made
    # into what the items carry on, on a thread of the child while the next request runs,
    # so work that does not need the device (postprocessing) never keeps it waiting.
    finish: Callable[[list[Any], list[Any]], list[Any]] | None = None
    # Runs `finish` on known-good input and raises if that fails: when finish fails every
    # item of a request, it tells a broken worker from bad items, as `probe` does for `run`.
    finish_probe: Callable[[], object] | None = None


@dataclass(frozen=True)
class PrepareStep:
    """A step a process stage's children run on each item's value before the stage's
    function, several items at once on threads (the set-up's `StageFunction.prepare`:
    fetching the input, say). Its failures are the item's, reported as this step's
    (`name`); the child says when a request is prepared, so a request may take
    `timeout_s` to prepare and then the stage's own timeout to run."""

    name: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Part:
    """What makes an item part of another: it is part `number` of `count` that a fan-out
    made of the item it numbered `whole`, and `about` is what the fan-out said of it
    (the box a crop was cut from, say)."""

    whole: int
    number: int
    count: int
    about: Any


@dataclass(slots=True)
class Item:
    """One unit of work: `index` of job `job`, its current `value` or its `error`."""

    job: str
    index: int
    value: Any
    error: ItemError | None = None
    slot: int | None = None
    attempts: int = 0
    part: Part | None = None
    part_slots: tuple[int, ...] = ()  # slots a fan-out holds for this item's parts


# What a process stage runs once in each child: it makes the function the child runs.
StageSetup = Callable[[], "Callable[..., Any] | StageFunction"]


class StageObserver(Protocol):
    """What the engine reports; the daemon turns it into job logs and statistics."""

    def stage_ran(
        self, stage: str, items: Sequence[Item], duration_s: float, events: Sequence[dict[str, Any]]
    ) -> None:
        """A stage processed `items` (some may now carry errors) in `duration_s`."""

    def worker_lost(self, stage: str, items: Sequence[Item], reason: str) -> None:
        """A child process died or hung while holding `items`; it is being replaced."""

    def stage_broken(self, stage: str, error: BaseException, jobs: frozenset[str] | None) -> None:
        """A stage cannot go on (its set-up fails, its worker fails known-good input, its
        thread raised): the pipeline is unusable. `jobs` are those with items in the work
        that failed, which may be why; None when that is not known (a thread raised)."""

    def workers_changed(self, stage: str, workers: int, reason: str) -> None:
        """A process stage grew or shrank to `workers` (`WorkerScaler`)."""


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
            middle = _middle(len(positions))
            run(positions[:middle])
            run(positions[middle:])
            return
        for position, output in zip(positions, outputs, strict=True):
            outcomes[position] = output

    if count:
        run(list(range(count)))
    return outcomes


def bisection_sizes(count: int) -> list[int]:
    """Every batch size `isolate_failures` may call with when it bisects `count` items
    (largest first): the sizes a model must also run at after an error or an OOM."""
    sizes: set[int] = set()
    pending = {count}
    while pending:
        size = pending.pop()
        if size >= 1 and size not in sizes:
            sizes.add(size)
            pending |= {_middle(size), size - _middle(size)}
    return sorted(sizes, reverse=True)


def _middle(count: int) -> int:
    return count // 2


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

    def __init__(
        self,
        slot_shape: Sequence[int],
        slots: int,
        dtype: torch.dtype = torch.uint8,
        shared_memory: Path = SHARED_MEMORY_DIR,
    ):
        needed = slots * math.prod(slot_shape) * dtype.itemsize
        _check_shared_memory(shared_memory, needed, f"{slots} slots of {tuple(slot_shape)}")
        self.tensor = torch.empty((slots, *slot_shape), dtype=dtype).share_memory_()
        self._free: Channel[int] = Channel(slots)
        for slot in range(slots):
            self._free.put(slot)

    def acquire(self) -> int:
        """A free slot's number, waiting for one; raises `Closed` after `close`."""
        return self._free.get()

    def try_acquire(self, count: int) -> list[int] | None:
        """`count` free slots if there are that many now, else None (none taken)."""
        return self._free.take_now(count)

    def release(self, slot: int) -> None:
        """Give a slot back once its reader is done with it."""
        self._free.put(slot)

    def close(self) -> None:
        """Wake everyone waiting for a slot."""
        self._free.close()


def host_oom_kills() -> int:
    """How many processes the kernel's OOM killer has killed on this host since it
    booted (Linux 4.13 and later; 0 where it does not say)."""
    try:
        lines = HOST_VMSTAT.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, count = line.partition(" ")
        if name == "oom_kill":
            return int(count)
    return 0


class SharedMemoryTooSmall(Exception):
    """The shared-memory file system cannot hold the batch arena."""


def _check_shared_memory(where: Path, needed: int, what: str) -> None:
    """Refuse to start when shared memory cannot hold the arena. A shared tensor in a
    file system too small for it is no error when it is made: the first write past the
    space there kills the process with SIGBUS, mid-batch. (Docker's /dev/shm is 64 MiB
    unless the container is given more.)"""
    if not where.is_dir():
        return  # not Linux: torch shares memory another way
    stats = os.statvfs(where)
    free = stats.f_bavail * stats.f_frsize
    if needed > free:
        raise SharedMemoryTooSmall(
            f"{where} has {free / 2**20:.0f} MiB free and the batch arena ({what}) needs "
            f"{needed / 2**20:.0f} MiB: give the container more shared memory (docker run "
            "--shm-size, ECS LinuxParameters.SharedMemorySize) or lower the batch size "
            "(--batch-size, or batch_size and max_parts in the pipeline spec)"
        )


class BatchGatherer:
    """Gathers arena slots into one reused batch buffer (pinned when there is a GPU, so
    the copy to the device can be asynchronous).

    Indexing the arena would allocate a fresh batch every time, which costs about ten
    times the copy itself; the buffer is handed to the stage function as a view and is
    overwritten by the next batch.
    """

    def __init__(self, arena: torch.Tensor):
        self._arena = arena
        self._buffer: torch.Tensor | None = None

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        if self._buffer is None or len(self._buffer) < len(slots):
            buffer = torch.empty((len(slots), *self._arena.shape[1:]), dtype=self._arena.dtype)
            self._buffer = buffer.pin_memory() if torch.cuda.is_available() else buffer
        out = self._buffer[: len(slots)]
        torch.index_select(self._arena, 0, torch.tensor(slots), out=out)
        return out


class _Stage:
    """What thread and process stages share: pulling batches and passing errors through."""

    def __init__(self, name: str, workers: int, batch_size: int, max_batch_wait_ms: float):
        if workers < 1 or batch_size < 1:
            raise ValueError(f"stage {name}: workers and batch_size must be at least 1")
        self.name = name
        self.workers = workers
        self.max_workers = workers
        self.batch_size = batch_size
        self.max_batch_wait_s = max_batch_wait_ms / 1000
        self._threads: list[threading.Thread] = []
        self._lowered_batch_size: tuple[int, float] | None = None  # (size, until monotonic)
        self.stopping = threading.Event()

    def lower_batch_size(self, batch_size: int, for_s: float) -> None:
        """Take at most `batch_size` items at a time for the next `for_s` seconds."""
        self._lowered_batch_size = (batch_size, time.monotonic() + for_s)
        log.warning("batch_size_lowered", stage=self.name, batch_size=batch_size, for_s=for_s)

    def current_batch_size(self) -> int:
        lowered = self._lowered_batch_size
        if lowered is None:
            return self.batch_size
        batch_size, until = lowered
        if time.monotonic() >= until:
            self._lowered_batch_size = None
            log.info("batch_size_restored", stage=self.name, batch_size=self.batch_size)
            return self.batch_size
        return batch_size

    @property
    def inbox_capacity(self) -> int:
        return 2 * max(self.max_workers, self.batch_size)

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        finished: Channel[Item],
    ) -> None:
        """Serve `inbox` into `outbox`; an item with nothing left for the stages after
        this one goes straight to `finished`, the pipeline's output."""
        self._inbox, self._outbox, self._observer = inbox, outbox, observer
        self._finished = finished

    def stop(self) -> None:
        """Wait up to `STOP_GRACE_S` in all for the stage's threads (daemon threads: one
        stuck in a network call is left behind, not waited for)."""
        self.stopping.set()
        deadline = time.monotonic() + STOP_GRACE_S
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        """Whether every worker of the stage is up (False while one is being replaced)."""
        return all(thread.is_alive() for thread in self._threads)

    def _spawn_thread(self, target: Callable[[], None], suffix: str) -> None:
        thread = threading.Thread(
            target=self._supervised, args=(target,), name=f"{self.name}-{suffix}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _supervised(self, target: Callable[[], None]) -> None:
        """Run a stage thread; it ends quietly when its channels close, and a stage whose
        thread raised is reported broken rather than left silently short of a worker."""
        try:
            target()
        except Closed:
            return
        except Exception as error:
            if self.stopping.is_set():
                return  # its child or channel was closed under it: the stage is stopping
            log.exception("stage_thread_failed", stage=self.name)
            self._observer.stage_broken(self.name, error, None)

    def _next_batch(self, unless: Callable[[], bool] | None = None) -> list[Item]:
        return self._inbox.get_batch(self.current_batch_size(), self.max_batch_wait_s, unless)


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
        finished: Channel[Item],
    ) -> None:
        super().start(inbox, outbox, observer, finished)
        for number in range(self.workers):
            self._spawn_thread(self._serve, str(number))

    def _serve(self) -> None:
        """Take batches until the inbox closes; run the live items, forward them all."""
        while True:
            items = self._next_batch()
            live = _live(items)
            if live:
                self._run(live)
            for item in items:
                self._outbox.put(item)

    def _run(self, items: list[Item]) -> None:
        started = time.perf_counter()
        outcomes = isolate_failures(
            lambda positions: self._fn([items[p].value for p in positions]), len(items), self.name
        )
        _apply(items, outcomes)
        self._observer.stage_ran(self.name, items, time.perf_counter() - started, ())


class WorkerLost(Exception):
    """A stage's child process died or stopped answering."""

    # Lost while it prepared a request (`PrepareStep`: fetching inputs, whose reads have
    # their own time limits): the surroundings failed, not an input.
    preparing = False
    # Killed by the kernel's OOM killer: the host ran out of memory, whichever process
    # it chose to kill.
    out_of_memory = False


class WorkerDied(WorkerLost):
    """The child process exited (a crash, a kill) while it held work."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code


class WorkerHung(WorkerLost):
    """The child process did not answer within the stage's timeout."""


class WorkerFailedProbe(WorkerLost):
    """Every item of a call failed, and so did the stage's probe: the child is broken."""


class StageSetupError(Exception):
    """A stage's set-up (model load, ...) raised in its child process."""


class StageSetupTimeout(StageSetupError):
    """A stage's child did not finish its set-up within the stage's `setup_timeout_s`,
    each time it was started."""


class _ChildProcess:
    """One child of a `ProcessStage` and the pipe that feeds it: used by its driver
    thread, and stopped by `ProcessStage.stop` from another.

    Requests are written by a thread of their own: a request larger than the pipe holds
    waits for the child to read it, and a child that hangs never does. The driver must
    still be free to wait for the reply with its timeout, and see the hang."""

    def __init__(self, stage: ProcessStage, number: int):
        self._stage = stage
        self.number = number
        self.name = f"{stage.name}-{number}"
        self.retiring = threading.Event()  # set by `ProcessStage.shrink`
        self._process: Any = None
        self._conn: Connection | None = None
        self._requests: queue.SimpleQueue[Any] | None = None
        self._lifeline: Connection | None = None
        self._writer: threading.Thread | None = None
        self._ready = False
        self.about: Mapping[str, Any] = {}

    def start(self) -> None:
        """Spawn the child and wait until its set-up is done. A child that dies or hangs
        before it is ready is tried again, as one that dies later would be replaced."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._spawn()
                if self._stage.stopping.is_set():  # a restart that raced the stage's stop
                    self.stop(graceful=False)
                    raise Closed
                return
            except WorkerLost as lost:
                self.stop(graceful=False)
                log.warning(
                    "stage_worker_start_failed", worker=self.name, attempt=attempt, error=str(lost)
                )
                if attempt == START_ATTEMPTS:
                    failed = StageSetupTimeout if isinstance(lost, WorkerHung) else StageSetupError
                    raise failed(f"{self.name} did not start: {lost}") from lost

    def _spawn(self) -> None:
        context = _process_context()
        parent_conn, child_conn = context.Pipe()
        # Never written to: the child sees it close when this process dies, however it dies.
        lifeline_reader, self._lifeline = context.Pipe(duplex=False)
        stage = self._stage
        process = context.Process(
            target=_child_main,
            args=(
                child_conn,
                lifeline_reader,
                _ChildPlan(
                    stage.name,
                    stage.setup_of(self.number),
                    stage.mode,
                    stage.prepare,
                    stage.batch_size,
                    stage.max_parts,
                    stage.known_good(),
                ),
                stage.reads.tensor if stage.reads else None,
                stage.writes.tensor if stage.writes else None,
            ),
            name=self.name,
            daemon=True,
        )
        process.start()
        self._process = process
        child_conn.close()
        lifeline_reader.close()
        self._conn = parent_conn
        status, detail = self.receive(self._stage.setup_timeout_s)
        if status != "ready":
            self.stop(graceful=False)
            raise StageSetupError(f"{self.name} set-up failed:\n{detail}")
        pid, self.about = detail
        self._requests = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=_write_requests,
            args=(parent_conn, self._requests),
            name=f"{self.name}-writer",
            daemon=True,
        )
        self._writer.start()
        self._ready = True
        log.info("stage_worker_started", stage=self._stage.name, worker=self.name, pid=pid)

    def alive(self) -> bool:
        """Set up and running: False from a crash until its replacement is ready."""
        process = self._process
        return self._ready and process is not None and bool(process.is_alive())

    def send(self, request: Any) -> None:
        """Queue a request; the child answers requests in the order they were sent. A
        child that dies meanwhile is seen by `receive`."""
        if self._requests is None:
            raise WorkerDied(f"{self.name} was stopped")
        self._requests.put(request)

    def probe(self, timeout_s: float | None) -> str | None:
        """Run the stage's probe in the child: None if it passed (or there is none),
        else why not."""
        try:
            self.send(PROBE)
            fault: str | None = self.receive(timeout_s)
        except WorkerLost as lost:
            return str(lost)
        return fault

    def receive(self, timeout_s: float | None) -> Any:
        """The child's next message (about the oldest unanswered request); raises
        `WorkerLost` if the child died or hung."""
        # Its own references: `stop` (from another thread) may let go of them meanwhile.
        conn, process = self._conn, self._process
        if conn is None or process is None:
            raise WorkerDied(f"{self.name} was stopped")
        # A reply already waiting (the usual case with pipelined batches) needs no
        # selector over the pipe and the sentinel, which costs several times the poll.
        ready: Sequence[object] = (
            [conn] if conn.poll(0) else wait([conn, process.sentinel], timeout_s)
        )
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, ConnectionResetError):
                pass
        if not ready:
            raise WorkerHung(f"{self.name} gave no answer in {timeout_s} s")
        process.join(STOP_GRACE_S)
        raise WorkerDied(f"{self.name} exited with code {process.exitcode}", process.exitcode)

    def stop(self, graceful: bool = True) -> None:
        """Ask the child to exit (it ignores SIGTERM), and kill it if it does not."""
        self._ready = False
        if self._process is None:
            return
        requests, self._requests = self._requests, None
        if requests is not None:
            requests.put(None)  # after what is queued: the child exits when it reads it
        if graceful and requests is not None:
            self._process.join(STOP_GRACE_S)
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._process = None
        # With the child gone its writer's last write fails, or it writes the None above;
        # either way it ends. It must end before the pipe is closed: a new pipe (the
        # replacement's) may get the same descriptor numbers, and a late write of the
        # old writer would land there (the fresh child read None and exited 0; the
        # daemon read None where it waited for "ready").
        if self._writer is not None:
            self._writer.join(STOP_GRACE_S)
            if self._writer.is_alive():
                log.error("stage_writer_stuck", worker=self.name)
            self._writer = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None

    def restart(self) -> None:
        """Replace a child that died or hung: nothing it holds is worth waiting for."""
        self.stop(graceful=False)
        self.start()


class ProcessStage(_Stage):
    """Runs a function made by `setup()` in `workers` child processes.

    `setup` runs once per child (load the model there, once); it must be picklable
    (a module-level function or a `functools.partial` of one). A sequence of set-ups is
    one per child, a fixed number (one per GPU, say). A set-up returns the function,
    or a `StageFunction` with the function and its probe. The function's form depends
    on the arenas the stage `reads` and `writes`:

    - neither: `fn(values) -> outputs`
    - writes: `fn(value, out) -> output`, per item, writing into `out`, the item's
      arena slot, in place (decode an image straight into shared memory).
    - reads: `fn(batch, values) -> outputs`, where `batch` stacks the items' arena
      slots; the slots are given back once the call returns, unless `keeps_slots`
      (a fan-out after it still reads them).
    - both, a fan-out: `fn(read, value, outs) -> abouts`, per item, given its slot of
      the arena it reads, writing up to `max_parts` parts into the slots `outs` of the
      arena it writes and saying what each is about; the item goes on as its parts,
      each an item of its own, and one with no parts goes straight to the pipeline's
      output, with the value `[]`.

    With `prepare`, the set-up's `StageFunction.prepare` turns each value into what the
    function takes, in the child, before it runs (`PrepareStep`). `imports` are modules
    its set-up imports: imported once for every child, not by each as it starts.
    """

    def __init__(
        self,
        name: str,
        setup: StageSetup | Sequence[StageSetup],
        *,
        workers: int = 1,
        max_workers: int | None = None,
        batch_size: int = 1,
        max_batch_wait_ms: float = 0,
        timeout_s: float | None = None,
        reads: TensorArena | None = None,
        writes: TensorArena | None = None,
        keeps_slots: bool = False,
        max_parts: int = 1,
        prepare: PrepareStep | None = None,
        imports: Sequence[str] = (),
        setup_timeout_s: float = 300,
        oom_cooldown_s: float = OOM_COOLDOWN_S,
    ):
        setups = list(setup) if isinstance(setup, Sequence) else None
        if setups is not None:
            if max_workers or workers != 1:
                raise ValueError(f"stage {name}: one set-up per worker fixes their number")
            workers = len(setups)
        super().__init__(name, workers, batch_size, max_batch_wait_ms)
        self.max_workers = max(workers, max_workers or workers)
        self._setups = setups
        self._setup = setup
        self.timeout_s = timeout_s
        self.reads, self.writes = reads, writes
        self.mode: ArenaMode = (
            ("fan-out" if writes else "read") if reads else ("write" if writes else None)
        )
        self.keeps_slots = keeps_slots
        self.max_parts = max_parts
        self.prepare = prepare
        self.imports = imports
        self.pipelined = PIPELINED_PREPARING if prepare else PIPELINED_BATCHES
        self.setup_timeout_s = setup_timeout_s
        self.oom_cooldown_s = oom_cooldown_s
        self._children: list[_ChildProcess] = []
        self._numbers = itertools.count(workers)  # of children added later
        self._busy_s = 0.0  # the children's time on requests, all together
        self._oom_kills = host_oom_kills()
        self._known_good = _KnownGood()
        self._prepare_name = prepare.name if prepare else None
        # The jobs of the latest requests whose every item failed to prepare, untold.
        self._untold: set[str] = set()
        self._lock = threading.Lock()  # the above; drivers and the scaler share them

    def start(
        self,
        inbox: Channel[Item],
        outbox: Channel[Item],
        observer: StageObserver,
        finished: Channel[Item],
    ) -> None:
        super().start(inbox, outbox, observer, finished)
        self._children = [_ChildProcess(self, number) for number in range(self.workers)]
        # Children start in parallel: each imports torch and may load a model.
        try:
            with ThreadPoolExecutor(self.workers) as pool:
                list(pool.map(_ChildProcess.start, self._children))
        except BaseException:
            self.stop()
            raise
        for child in self._children:
            self._spawn_thread(functools.partial(self._serve_child, child), str(child.number))

    def alive(self) -> bool:
        return super().alive() and all(child.alive() for child in self._children)

    def setup_of(self, number: int) -> StageSetup:
        """The set-up of the child with this number."""
        if self._setups is not None:
            return self._setups[number]
        assert callable(self._setup)
        return self._setup

    def worker_count(self) -> int:
        with self._lock:
            return sum(not child.retiring.is_set() for child in self._children)

    def busy_s(self) -> float:
        """How long the children have spent on requests since the stage started."""
        with self._lock:
            return self._busy_s

    def grow(self) -> bool:
        """Start one more child (up to `max_workers`); False if there is no room or it
        could not start."""
        if self.worker_count() >= self.max_workers or self.stopping.is_set():
            return False
        child = _ChildProcess(self, next(self._numbers))
        try:
            child.start()
        except (StageSetupError, Closed) as error:
            log.warning("stage_worker_not_added", stage=self.name, error=str(error))
            return False
        with self._lock:  # `stop` sets `stopping`, then takes the children it stops
            added = not self.stopping.is_set()
            if added:
                self._children.append(child)
        if not added:
            child.stop(graceful=False)
            return False
        self._spawn_thread(functools.partial(self._serve_child, child), str(child.number))
        return True

    def shrink(self) -> bool:
        """Have one child (down to `workers`) finish what it holds and stop."""
        with self._lock:
            serving = [child for child in self._children if not child.retiring.is_set()]
            if len(serving) <= self.workers:
                return False
            serving[-1].retiring.set()
        self._inbox.wake()
        return True

    def about(self) -> Mapping[str, Any]:
        """What the set-up of its first child reported (`StageFunction.about`)."""
        return self._children[0].about if self._children else {}

    def _serve_child(self, child: _ChildProcess) -> None:
        """Feed `child` batches until the inbox closes.

        While the child works on one batch, the next already waits in its pipe
        (`pipelined` in all), so it goes from batch to batch without waiting for this
        thread to file results and gather the next batch: the GPU never idles on the
        host's bookkeeping. A batch is queued ahead only when a full one is waiting;
        otherwise the next is gathered once the child is free, and is fuller for it.
        """
        in_flight: deque[list[Item]] = deque()  # batches sent, oldest first
        while True:
            if not in_flight:
                if child.retiring.is_set():
                    self._retire(child)
                    return
                self._dispatch(child, in_flight, self._next_batch(child.retiring.is_set), [])
                continue
            ahead = self._batch_ahead() if len(in_flight) < self.pipelined else None
            if ahead is None:
                self._complete_oldest(child, in_flight)
            else:
                self._dispatch(child, in_flight, *ahead)

    def _batch_ahead(self) -> tuple[list[Item], list[int]] | None:
        """A full batch, and its slots, to send ahead of replies this driver has yet to
        collect, if both are there now (else None): it never waits with replies unread.
        Another driver may take the batch it saw waiting before it takes it."""
        batch_size = self.current_batch_size()
        if len(self._inbox) < batch_size:
            return None
        reserved = self._reserve_ahead(batch_size)
        if reserved is None:
            return None
        items = self._inbox.take_now(batch_size)
        if items is None:
            self._give_back(reserved)
            return None
        return items, reserved

    def _retire(self, child: _ChildProcess) -> None:
        """Stop a child that `shrink` chose, with this, its driver thread."""
        with self._lock:
            self._children.remove(child)
            self._threads.remove(threading.current_thread())
        child.stop()

    def stop(self) -> None:
        """Stop the children (killing those that do not stop within `STOP_GRACE_S`),
        then their driver threads, which the children's exit unblocks."""
        self.stopping.set()
        with self._lock:
            children = list(self._children)
        with ThreadPoolExecutor(max(1, len(children))) as pool:
            list(pool.map(_ChildProcess.stop, children))
        super().stop()

    def _reserve_ahead(self, batch_size: int) -> list[int] | None:
        """Slots for a request sent ahead of replies this driver has yet to collect, if
        they are free now (else None). Waiting for them could wait for ever: the items
        of those replies hold slots that only this driver, collecting them, hands on."""
        if self.mode != "write":
            return []
        assert self.writes is not None
        return self.writes.try_acquire(batch_size)

    def _dispatch(
        self,
        child: _ChildProcess,
        in_flight: deque[list[Item]],
        items: list[Item],
        reserved: list[int],
    ) -> None:
        live = _live(items)
        if not live:
            self._give_back(reserved)
            self._forward(items)
            return
        in_flight.append(items)
        try:
            child.send(self._request(live, reserved))
        except WorkerLost as lost:
            self._recover(child, in_flight, lost)

    def _complete_oldest(self, child: _ChildProcess, in_flight: deque[list[Item]]) -> None:
        live = _live(in_flight[0])
        try:
            reply = self._reply(child, live)
        except WorkerLost as lost:
            self._recover(child, in_flight, lost)
            return
        items = in_flight.popleft()
        self._file_reply(live, reply)
        self._forward(items)

    def _reply(self, child: _ChildProcess, live: list[Item]) -> _Reply:
        """The child's reply to the request of `live`; first, with a prepare step, its
        word that they are prepared, which the step's timeout waits for."""
        if self.prepare is not None:
            try:
                prepared: _Prepared = child.receive(self.prepare.timeout_s)
            except WorkerLost as lost:
                lost.preparing = True
                raise
            self._observer.stage_ran(self.prepare.name, live, prepared.duration_s, ())
        reply: _Reply = child.receive(self.timeout_s)
        if reply.fault is not None:
            raise WorkerFailedProbe(f"{child.name} failed its probe: {reply.fault}")
        return reply

    def arenas(self) -> list[TensorArena]:
        return [arena for arena in (self.reads, self.writes) if arena is not None]

    def _request(self, live: list[Item], reserved: Sequence[int] = ()) -> list[_WireTask]:
        """What the child is sent: each item's slot, value and the slots for its parts
        (plain tuples: pickle writes those in C, a named tuple through Python code);
        a writing stage gives them slots first, `reserved` ones or else as they come
        free (waiting while none is)."""
        spare = list(reserved)
        for item in live:
            if self.mode == "write" and item.slot is None:
                assert self.writes is not None
                item.slot = spare.pop() if spare else self.writes.acquire()
            elif self.mode == "fan-out" and not item.part_slots:
                assert self.writes is not None
                item.part_slots = tuple(self.writes.acquire() for _ in range(self.max_parts))
        self._give_back(spare)
        return [(item.slot, item.value, item.part_slots) for item in live]

    def _give_back(self, slots: Sequence[int]) -> None:
        for slot in slots:
            assert self.writes is not None
            self.writes.release(slot)

    def _file_reply(self, live: list[Item], reply: _Reply) -> None:
        with self._lock:
            self._busy_s += reply.duration_s
        if reply.fitting_batch_size is not None:
            self.lower_batch_size(reply.fitting_batch_size, self.oom_cooldown_s)
        self._learn_from(live, reply)
        _apply(live, reply.outcomes)
        self._observer.stage_ran(self.name, live, reply.duration_s, reply.events)

    def _forward(self, items: list[Item]) -> None:
        """Hand the batch on, giving back the arena slots a reading stage is done with.
        An item's tries are this stage's: the next stage gives it as many again."""
        for item in items:
            item.attempts = 0
            if self.reads is not None and not self.keeps_slots and item.slot is not None:
                self.reads.release(item.slot)
                item.slot = None
            if self.mode == "fan-out":
                self._fan_out(item)
            else:
                self._outbox.put(item)

    def _fan_out(self, item: Item) -> None:
        """Hand the item on as its parts, each in one of the slots taken for them."""
        assert self.writes is not None
        abouts: list[Any] = [] if item.error is not None else item.value
        slots, item.part_slots = item.part_slots, ()
        for slot in slots[len(abouts) :]:
            self.writes.release(slot)
        if item.error is not None:
            self._outbox.put(item)
        elif not abouts:
            item.value = []
            self._finished.put(item)
        else:
            whole = next(_WHOLES)
            for number, (about, slot) in enumerate(zip(abouts, slots, strict=False)):
                part = Part(whole, number, len(abouts), about)
                self._outbox.put(Item(item.job, item.index, about, slot=slot, part=part))

    def _recover(
        self, child: _ChildProcess, in_flight: deque[list[Item]], lost: WorkerLost
    ) -> None:
        """Replace the child, then redo what it held. Only the oldest batch was being
        worked on when it was lost: it is retried (`_retry`); the batches queued behind
        it are sent again."""
        batches = list(in_flight)
        in_flight.clear()
        held = [item for items in batches for item in _live(items)]
        self._restart(child, held, lost, working_on=_live(batches[0]))
        self._retry(child, _live(batches[0]), lost)
        for items in batches[1:]:
            self._run(child, _live(items))
        for items in batches:
            self._forward(items)

    def _restart(
        self,
        child: _ChildProcess,
        items: list[Item],
        lost: WorkerLost,
        working_on: list[Item] | None = None,
    ) -> None:
        """Replace a lost child that held `items`; one that cannot be replaced breaks the
        stage, naming the jobs of the items it was `working_on` (all it held if not
        given), not those of requests queued behind them."""
        if self.stopping.is_set():
            raise Closed
        if isinstance(lost, WorkerDied):
            lost.out_of_memory = self._oom_killed(lost)
        self._observer.worker_lost(self.name, items, str(lost))
        try:
            child.restart()
        except StageSetupError as error:
            self._break(error, items if working_on is None else working_on)

    def known_good(self) -> _KnownGood:
        """What a new child is told its stage handled well (`_KnownGood`)."""
        with self._lock:
            return self._known_good.copy()

    def _learn_from(self, live: list[Item], reply: _Reply) -> None:
        """Keep an item the reply shows handled well as the stage's known good, before
        its value is replaced by its outcome; and stop the stage once requests of more
        than one job, in a row, failed their prepare step with nothing prepared before
        (credentials that never worked), rather than fail every job's items."""
        outcomes = list(zip(live, reply.outcomes, strict=True))
        prepared = [
            item
            for item, outcome in outcomes
            if not (isinstance(outcome, ItemError) and outcome.stage == self._prepare_name)
        ]
        ran_well = [item for item, outcome in outcomes if not isinstance(outcome, ItemError)]
        with self._lock:
            if prepared and self.prepare is not None:
                self._known_good.remember(prepared[0].value)
                self._untold.clear()
            if reply.untold:
                self._untold |= {item.job for item in live}
            untold = frozenset(self._untold)
        if self.mode == "fan-out" and ran_well and self._known_good.fan_out_stale():
            assert self.reads is not None and ran_well[0].slot is not None
            image = self.reads.tensor[ran_well[0].slot].clone()
            with self._lock:
                self._known_good.cut(image, ran_well[0].value)
        if len(untold) >= UNTOLD_JOBS_BEFORE_FAULT:
            fault = (
                f"every input of requests of {len(untold)} jobs in a row failed to prepare, "
                f"and none was ever prepared: {reply.outcomes[0].message}"
            )
            self._observer.stage_broken(self.name, WorkerFault(fault), untold)
            raise Closed

    def _oom_killed(self, died: WorkerDied) -> bool:
        """Whether the kernel's OOM killer killed the child: it died of SIGKILL, and the
        host's count of such kills rose since this stage last looked."""
        kills = host_oom_kills()
        with self._lock:
            rose = kills > self._oom_kills
            self._oom_kills = kills
        return died.exit_code == -signal.SIGKILL and rose

    def _break(self, error: BaseException, items: Sequence[Item]) -> None:
        """The stage cannot go on: report it, naming the jobs of the `items` it failed
        on, and end this driver thread."""
        self._observer.stage_broken(self.name, error, frozenset(item.job for item in items))
        raise Closed from error

    def _run(self, child: _ChildProcess, live: list[Item], after: WorkerLost | None = None) -> None:
        """Run `live` on its own and wait for it (retries only); `after` is why the
        previous try was lost."""
        try:
            child.send(self._request(live))
            reply = self._reply(child, live)
        except WorkerLost as lost:
            if isinstance(lost, WorkerFailedProbe) and isinstance(after, WorkerFailedProbe):
                self._break(WorkerFault(f"a fresh worker failed the same way: {lost}"), live)
            self._restart(child, live, lost)
            self._retry(child, live, lost)
            return
        self._file_reply(live, reply)

    def _retry(self, child: _ChildProcess, live: list[Item], lost: WorkerLost) -> None:
        """Items the child was working on when it was lost. After a failed probe the
        whole batch goes to the fresh child; after a death or a hang, halves of the
        batch, or one item again while it has tries left."""
        if isinstance(lost, WorkerFailedProbe):
            self._run(child, live, after=lost)
            return
        if len(live) > 1:
            middle = _middle(len(live))
            self._run(child, live[:middle])
            self._run(child, live[middle:])
            return
        item = live[0]
        item.attempts += 1
        if item.attempts < MAX_ITEM_ATTEMPTS:
            self._run(child, live)
            return
        fault = child.probe(self.timeout_s)
        if fault is not None:
            self._break(WorkerFault(f"{lost}, and a fresh worker failed its probe: {fault}"), live)
        if lost.out_of_memory:  # on every try, alone, and a fresh child passes its probe
            message = (
                f"{lost}: killed by the kernel's OOM killer on each try with only this "
                "input: it needs more memory than this host gives it"
            )
            item.error = ItemError(type(lost).__name__, message, self.name)
        elif lost.preparing:
            assert self.prepare is not None
            message = f"{lost} while it prepared the item"
            item.error = ItemError(type(lost).__name__, message, self.prepare.name, transient=True)
        else:
            item.error = ItemError(type(lost).__name__, str(lost), self.name)


def _write_requests(conn: Connection, requests: queue.SimpleQueue[Any]) -> None:
    """Write requests to a child in order, until the one that tells it to exit (None)
    or until the pipe breaks (the child died, or was stopped)."""
    while True:
        request = requests.get()
        try:
            conn.send(request)
        except (OSError, ValueError):  # broken, or closed by `stop`
            return
        if request is None:
            return


def _process_context() -> Any:
    """Children are forked from a server process that has imported torch once (CUDA is
    not initialised there, so forking is safe): a crashed child is replaced in a
    fraction of a second, where a fresh interpreter importing torch takes seconds."""
    return torch_mp.get_context("forkserver")


def _preload(imports: Sequence[str]) -> None:
    """What the server imports once, before it forks the first child; later calls
    change nothing (it runs for the life of this process)."""
    _process_context().set_forkserver_preload([*FORKSERVER_PRELOAD, *imports])


def _logging_failures(run: Callable[[], None], name: str) -> None:
    """A helper thread whose failure must not stop the pipeline (scaling is an
    optimisation): it is logged, and the stage keeps the workers it has."""
    try:
        run()
    except Exception:
        log.exception("pipeline_helper_failed", helper=name)


def _live(items: list[Item]) -> list[Item]:
    return [item for item in items if item.error is None]


@dataclass(frozen=True)
class _ChildPlan:
    """What a child process is told about its stage (pickled across)."""

    stage: str
    setup: StageSetup
    mode: ArenaMode
    prepare: PrepareStep | None
    prepare_threads: int
    max_parts: int
    known_good: _KnownGood  # what the stage's children handled well so far


class _Task(NamedTuple):
    """One item of a request to a child."""

    slot: int | None
    value: Any
    part_slots: tuple[int, ...]


_WireTask = tuple[int | None, Any, tuple[int, ...]]  # a `_Task` as it crosses the pipe


class _Prepared(NamedTuple):
    """A child's word that it has prepared a request and now runs it."""

    duration_s: float


class _Reply(NamedTuple):
    """A child's answer to one request."""

    outcomes: list[Any]
    events: list[dict[str, Any]]
    fitting_batch_size: int | None  # after an out-of-memory error, the size that fitted
    duration_s: float
    fault: str | None  # every item failed, and so did the probe: why the probe failed
    # Every item failed its prepare step, and nothing was prepared before to tell a
    # worker's fault from the inputs' (their errors are made transient).
    untold: bool = False


@dataclass
class _KnownGood:
    """Input a stage handled well: the probe of a step that has none of its own. The
    latest values its prepare step prepared (a fetch probed by fetching them again), and
    for a fan-out a copy of an image it cut into parts, with what it was told of it."""

    unprepared: list[Any] = field(default_factory=list)  # the latest first
    fan_out: tuple[torch.Tensor, Any] | None = None
    fan_out_at: float = -math.inf  # monotonic

    def remember(self, value: Any) -> None:
        if value not in self.unprepared:
            self.unprepared = [value, *self.unprepared][:KNOWN_GOOD_VALUES]

    def fan_out_stale(self) -> bool:
        return time.monotonic() - self.fan_out_at > KNOWN_GOOD_REFRESH_S

    def cut(self, image: torch.Tensor, found: Any) -> None:
        self.fan_out, self.fan_out_at = (image, found), time.monotonic()

    def copy(self) -> _KnownGood:
        return replace(self, unprepared=list(self.unprepared))


def _child_main(
    conn: Connection,
    lifeline: Connection,
    plan: _ChildPlan,
    reads: torch.Tensor | None,
    writes: torch.Tensor | None,
) -> None:
    """A stage's child process: set up once, then answer requests until told to stop."""
    # The daemon decides when children stop; a Ctrl-C or a SIGTERM sent to the whole
    # process group must not kill them mid-batch. If the daemon itself dies (SIGKILL),
    # the lifeline closes and the child goes too, even in the middle of a hung call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True).start()
    logs = _LogCapture()
    try:
        made = plan.setup()
        stage_fn = made if isinstance(made, StageFunction) else StageFunction(made)
        if plan.prepare is not None and stage_fn.prepare is None:
            raise StageSetupError(f"the set-up gave no function for {plan.prepare.name}")
    except BaseException:
        conn.send(("setup_failed", traceback.format_exc()))
        return
    known_good = plan.known_good.copy()
    probe = stage_fn.probe
    if probe is None and plan.mode == "fan-out":
        assert writes is not None
        probe = functools.partial(
            _fan_out_probe, stage_fn.run, known_good, writes.shape[1:], plan.max_parts
        )
    gatherer = BatchGatherer(reads) if plan.mode == "read" and reads is not None else None
    threads = ThreadPoolExecutor(plan.prepare_threads) if stage_fn.prepare else None
    requests: queue.SimpleQueue[_Received] = queue.SimpleQueue()
    finishing = ThreadPoolExecutor(1, "finish") if stage_fn.finish else None

    def send(message: Any, values: Sequence[Any] | None = None) -> bool:
        """Send at once; or, with a finish step, in turn on the thread that finishes
        each reply (given its items' `values`), while the next request runs."""
        if finishing is None:
            return _sent(conn, message)
        finishing.submit(
            _finish_and_send, conn, message, values, stage_fn, stage=plan.stage, logs=logs
        )
        return True

    conn.send(("ready", (os.getpid(), stage_fn.about)))
    threading.Thread(
        target=_read_requests, args=(conn, requests, stage_fn.prepare, threads), daemon=True
    ).start()
    while True:
        request, preparations, started = requests.get()
        if request is None:  # told to stop, or the daemon is gone
            return
        values = None
        if request == PROBE:
            answer: Any = _probe(probe)
        else:
            logs.events.clear()
            failed: dict[int, ItemError] = {}
            judged: _Judged | None = None
            if preparations is not None:
                assert plan.prepare is not None and stage_fn.prepare is not None
                unprepared = [task.value for task in request]
                request, failed = _prepared(request, preparations, plan.prepare)
                judged = _judged(failed, unprepared, known_good, stage_fn.prepare, plan.prepare)
                failed = judged.failed
                if not send(_Prepared(time.perf_counter() - started)):
                    return
            answer = _run_request(
                replace(stage_fn, probe=probe),
                plan,
                (reads, writes),
                gatherer,
                request,
                failed=failed,
                known_good=known_good,
            )
            answer = answer._replace(events=list(logs.events))
            if judged is not None:
                answer = answer._replace(fault=answer.fault or judged.fault, untold=judged.untold)
            values = [task.value for task in request]
        if not send(answer, values):
            return


def _finish_and_send(
    conn: Connection,
    message: Any,
    values: Sequence[Any] | None,
    stage_fn: StageFunction,
    *,
    stage: str,
    logs: _LogCapture,
) -> None:
    """Send `message`; a reply (with its items' `values`) once it is `_finished`. A reply
    that cannot be made or sent ends the child: the driver takes replies in order, and a
    missing one would have it take the next request's for this one's."""
    try:
        if values is not None:
            message = _finished(message, values, stage_fn, stage, logs)
        _sent(conn, message)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _finished(
    reply: _Reply, values: Sequence[Any], stage_fn: StageFunction, stage: str, logs: _LogCapture
) -> _Reply:
    """The reply with each output that is not an error made into the item's outcome by
    `finish`, and the events it logged. If finish fails every item it was given, or
    fails as a whole, and fails its probe too, the worker is at fault, not the items."""
    assert stage_fn.finish is not None
    ran = [p for p, outcome in enumerate(reply.outcomes) if not isinstance(outcome, ItemError)]
    outcomes = list(reply.outcomes)
    with logs.own() as events:
        try:
            finished = stage_fn.finish([outcomes[p] for p in ran], [values[p] for p in ran])
            if len(finished) != len(ran):
                raise ValueError(f"finish gave {len(finished)} outcomes for {len(ran)} outputs")
        except Exception as error:
            finished = [ItemError.from_exception(error, stage)] * len(ran)
        fault = _fault_if_all_failed(finished, stage_fn.finish_probe)
    for position, outcome in zip(ran, finished, strict=True):
        outcomes[position] = outcome
    return reply._replace(
        outcomes=outcomes, events=[*reply.events, *events], fault=reply.fault or fault
    )


class _Received(NamedTuple):
    """A request as a child's reader took it: its items' preparations under way."""

    request: Any
    preparations: list[Future[Any]] | None
    started: float


def _read_requests(
    conn: Connection,
    requests: queue.SimpleQueue[_Received],
    prepare: Callable[[Any], Any] | None,
    threads: ThreadPoolExecutor | None,
) -> None:
    """Take requests off the pipe as they come and start preparing each at once, so the
    inputs of a request are fetched while the one before it still runs (or waits on a
    slow read): a slow input holds up the replies behind it, not the fetching."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the daemon is gone: nobody is left to answer
            request = None
        preparations = None
        if isinstance(request, list):
            request = [_Task._make(task) for task in request]
            if prepare is not None and threads is not None:
                preparations = [threads.submit(prepare, task.value) for task in request]
        requests.put(_Received(request, preparations, time.perf_counter()))
        if request is None:
            return


def _run_request(
    stage_fn: StageFunction,
    plan: _ChildPlan,
    arenas: tuple[torch.Tensor | None, torch.Tensor | None],
    gatherer: BatchGatherer | None,
    request: list[_Task],
    *,
    failed: Mapping[int, ItemError],
    known_good: _KnownGood,
) -> _Reply:
    """Run the request's items but those that `failed` to be prepared; if every item
    run fails, run the probe too. A fan-out keeps an item it cut up as its known good."""
    started = time.perf_counter()
    runnable = [task for position, task in enumerate(request) if position not in failed]
    ran, fitting_batch_size = _serve_request(stage_fn.run, plan, arenas, gatherer, runnable)
    if plan.mode == "fan-out" and known_good.fan_out_stale():
        reads = arenas[0]
        assert reads is not None
        for task, outcome in zip(runnable, ran, strict=True):
            if not isinstance(outcome, ItemError):
                known_good.cut(reads[task.slot].clone(), task.value)
                break
    fault = _fault_if_all_failed(ran, stage_fn.probe)
    duration_s = time.perf_counter() - started
    outcomes = iter(ran)
    return _Reply(
        [failed[p] if p in failed else next(outcomes) for p in range(len(request))],
        [],
        fitting_batch_size,
        duration_s,
        fault,
    )


def _sent(conn: Connection, message: Any) -> bool:
    """False if the daemon stopped this child while it worked (nobody reads the pipe)."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def _prepared(
    request: list[_Task], preparations: list[Future[Any]], step: PrepareStep
) -> tuple[list[_Task], dict[int, ItemError]]:
    """The request with each item's value prepared, and the errors of those that could
    not be, by position."""
    prepared, failed = [], {}
    for position, (task, future) in enumerate(zip(request, preparations, strict=True)):
        try:
            prepared.append(task._replace(value=future.result()))
        except Exception as error:
            failed[position] = ItemError.from_exception(error, step.name)
            prepared.append(task)
    return prepared, failed


class _Judged(NamedTuple):
    """What a request's preparation says of the worker (`_judged`)."""

    failed: dict[int, ItemError]
    fault: str | None
    untold: bool


def _judged(
    failed: dict[int, ItemError],
    unprepared: Sequence[Any],
    known_good: _KnownGood,
    prepare: Callable[[Any], Any],
    step: PrepareStep,
) -> _Judged:
    """When every item of a request failed its prepare step for a reason retrying will
    not cure (access denied to every input, say), whether the worker is to blame: it
    prepares again the values it prepared before. One that passes clears the worker
    (the errors stand); one that fails is forgotten (its owner may have deleted it). If
    two or more fail, all of them, the worker is at fault. With fewer to tell by (or a
    failure for now: throttled), nobody can tell: the errors are made transient, and
    `untold` when nothing was ever prepared."""
    succeeded = [value for position, value in enumerate(unprepared) if position not in failed]
    if succeeded:
        known_good.remember(succeeded[0])
        return _Judged(failed, None, False)
    if not failed or any(error.transient for error in failed.values()):
        return _Judged(failed, None, False)
    if not known_good.unprepared:
        never = f"no input passed {step.name} before, to tell the worker's fault from the input's"
        return _Judged(_made_transient(failed, never), None, True)
    fault, why = _prepared_again(known_good, prepare, step)
    if why is not None:
        return _Judged(_made_transient(failed, why), None, False)
    return _Judged(failed, fault, False)


def _prepared_again(
    known_good: _KnownGood, prepare: Callable[[Any], Any], step: PrepareStep
) -> tuple[str | None, str | None]:
    """Prepare the known-good values again (`_judged`): (None, None) if one passes; a
    fault if two or more all fail; else why nobody can tell."""
    tried, errors = list(known_good.unprepared), []
    for value in tried:
        try:
            prepare(value)
        except TransientError as error:
            return None, f"an input that passed {step.name} before fails for now too ({error})"
        except Exception as error:
            errors.append(f"{type(error).__name__}: {str(error)[:300]}")
            known_good.unprepared.remove(value)
            continue
        return None, None
    if len(tried) < 2:
        return None, f"the one input that passed {step.name} before fails too ({errors[0]})"
    return f"{len(tried)} inputs that passed {step.name} before fail too: {errors[-1]}", None


def _made_transient(failed: dict[int, ItemError], why: str) -> dict[int, ItemError]:
    return {
        position: replace(error, message=f"{error.message} ({why})", transient=True)
        for position, error in failed.items()
    }


def _fan_out_probe(
    fan_out: Callable[..., Any],
    known_good: _KnownGood,
    part_shape: Sequence[int],
    max_parts: int,
) -> None:
    """Cut up again an image a fan-out cut up before (none yet: nothing to tell by)."""
    if known_good.fan_out is None:
        return
    image, found = known_good.fan_out
    outs = list(torch.empty((max_parts, *part_shape), dtype=torch.uint8))
    fan_out(image, found, outs)


def _fault_if_all_failed(outcomes: Sequence[Any], probe: Callable[[], object] | None) -> str | None:
    """When every outcome is an error, whether the worker is to blame: why its probe
    (known-good input) fails, or None if it passes (the items are at fault)."""
    failed_all = bool(outcomes) and all(isinstance(outcome, ItemError) for outcome in outcomes)
    return _probe(probe) if failed_all else None


def _probe(probe: Callable[[], object] | None) -> str | None:
    """None if a stage's probe passes (or it has none), else why it failed."""
    if probe is None:
        return None
    try:
        probe()
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:500]}"
    return None


def _exit_when_closed(lifeline: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os._exit(1)


def _serve_request(
    fn: Callable[..., Any],
    plan: _ChildPlan,
    arenas: tuple[torch.Tensor | None, torch.Tensor | None],
    gatherer: BatchGatherer | None,
    request: list[_Task],
) -> tuple[list[Any], int | None]:
    """Every item's outcome, and after an out-of-memory error the largest size that fitted."""
    reads, writes = arenas
    slots: list[Any] = [task.slot for task in request]  # set for every item in arena modes
    values = [task.value for task in request]
    out_of_memory = False
    fitted_sizes = [1]

    def fan_out(position: int) -> list[Any]:
        assert reads is not None and writes is not None
        outs = [writes[slot] for slot in request[position].part_slots]
        abouts = list(fn(reads[slots[position]], values[position], outs))
        if len(abouts) > len(outs):
            raise ValueError(f"the fan-out made {len(abouts)} parts of at most {len(outs)}")
        return abouts

    def run(positions: list[int]) -> Sequence[Any]:
        chosen = [values[p] for p in positions]
        if plan.mode == "write":
            assert writes is not None
            return [fn(values[p], writes[slots[p]]) for p in positions]
        if plan.mode == "fan-out":
            return [fan_out(p) for p in positions]
        if plan.mode == "read":
            assert gatherer is not None
            return fn(gatherer.gather([slots[p] for p in positions]), chosen)  # type: ignore[no-any-return]
        return fn(chosen)  # type: ignore[no-any-return]

    def call(positions: list[int]) -> Sequence[Any]:
        nonlocal out_of_memory
        try:
            outputs = run(positions)
        except torch.OutOfMemoryError:
            # Bisection retries the halves; free the cached blocks the failed try left.
            out_of_memory = True
            log.warning("out_of_memory", batch_items=len(positions))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise
        fitted_sizes.append(len(positions))
        return outputs

    outcomes = isolate_failures(call, len(values), plan.stage)
    return outcomes, max(fitted_sizes) if out_of_memory else None


class _LogCapture:
    """A child's structlog events, kept for the daemon to file in job logs: `events`, but
    those of a thread in `own()` apart, so the finish thread's go with the reply they
    are about rather than with whichever request runs meanwhile."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._own = threading.local()
        structlog.configure(processors=[structlog.contextvars.merge_contextvars, self._capture])

    def _capture(self, _: Any, level: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        events: list[dict[str, Any]] = getattr(self._own, "events", self.events)
        events.append({**event, "level": level, "pid": os.getpid()})
        raise structlog.DropEvent

    @contextlib.contextmanager
    def own(self) -> Iterator[list[dict[str, Any]]]:
        """The events this thread logs meanwhile."""
        outer = getattr(self._own, "events", self.events)
        events: list[dict[str, Any]] = []
        self._own.events = events
        try:
            yield events
        finally:
            self._own.events = outer


class WorkerScaler:
    """Keeps a process stage's worker count between its `workers` and `max_workers` as
    demand goes: one more when the stage after it waits for input (fewer items ahead
    of it than a batch) while this stage's workers are nearly all busy, and one fewer
    once the workers left would have had time to spare for `shrink_after_s`."""

    def __init__(
        self,
        stage: ProcessStage,
        downstream: Channel[Item],
        downstream_batch_size: int,
        observer: StageObserver,
        *,
        every_s: float,
        shrink_after_s: float,
    ):
        self._stage = stage
        self._downstream = downstream
        self._downstream_batch_size = downstream_batch_size
        self._observer = observer
        self._every_s = every_s
        self._shrink_after_s = shrink_after_s

    def run(self, stopping: threading.Event) -> None:
        busy_s, at = self._stage.busy_s(), time.monotonic()
        spare_since: float | None = None
        while not stopping.wait(self._every_s):
            workers = self._stage.worker_count()
            now, now_busy_s = time.monotonic(), self._stage.busy_s()
            utilisation = (now_busy_s - busy_s) / (workers * (now - at))
            busy_s, at = now_busy_s, now
            starving = len(self._downstream) < self._downstream_batch_size
            if starving and utilisation >= GROW_ABOVE_UTILISATION:
                spare_since = None
                if self._stage.grow():
                    self._changed(f"the next stage waits, workers {utilisation:.0%} busy")
            elif utilisation * workers <= (workers - 1) * SHRINK_BELOW_UTILISATION:
                spare_since = spare_since if spare_since is not None else now
                if now - spare_since >= self._shrink_after_s and self._stage.shrink():
                    spare_since = None
                    self._changed(f"workers {utilisation:.0%} busy")
            else:
                spare_since = None

    def _changed(self, reason: str) -> None:
        workers = self._stage.worker_count()
        log.info("stage_workers_changed", stage=self._stage.name, workers=workers, reason=reason)
        self._observer.workers_changed(self._stage.name, workers, reason)


class Pipeline:
    """Stages joined by bounded channels: `submit` items in, take `next_result` out."""

    def __init__(
        self,
        stages: Sequence[_Stage],
        observer: StageObserver,
        *,
        scale_every_s: float = SCALE_EVERY_S,
        shrink_after_s: float = SHRINK_AFTER_S,
    ):
        self._stages = list(stages)
        self._scaling = {"every_s": scale_every_s, "shrink_after_s": shrink_after_s}
        self._observer = observer
        self._channels: list[Channel[Item]] = [Channel(stage.inbox_capacity) for stage in stages]
        self._channels.append(Channel(OUTPUT_CAPACITY))
        self._closing = threading.Event()
        self._wholes: dict[int, list[tuple[Part, Item]]] = {}  # parts come out in any order

    def start(self) -> None:
        """Start every stage (children included), all at once: each child imports torch
        and may load a model. Raises `StageSetupError` if one cannot start."""

        def start(stage: _Stage, inbox: Channel[Item], outbox: Channel[Item]) -> None:
            stage.start(inbox, outbox, self._observer, self._channels[-1])

        _preload(
            [
                module
                for stage in self._stages
                if isinstance(stage, ProcessStage)
                for module in stage.imports
            ]
        )

        try:
            with ThreadPoolExecutor(len(self._stages)) as pool:
                started = [
                    pool.submit(start, stage, inbox, outbox)
                    for stage, inbox, outbox in zip(
                        self._stages, self._channels, self._channels[1:], strict=False
                    )
                ]
                for future in started:
                    future.result()
        except BaseException:
            self.close()
            raise
        for number, stage in enumerate(self._stages):
            if isinstance(stage, ProcessStage) and stage.max_workers > stage.workers:
                after = self._stages[number + 1] if number + 1 < len(self._stages) else None
                scaler = WorkerScaler(
                    stage,
                    self._channels[number + 1],
                    after.batch_size if after else 1,
                    self._observer,
                    **self._scaling,
                )
                threading.Thread(
                    target=_logging_failures,
                    args=(functools.partial(scaler.run, self._closing), f"{stage.name}-scaler"),
                    name=f"{stage.name}-scaler",
                    daemon=True,
                ).start()

    def queue_depths(self) -> dict[str, int]:
        """Items waiting in front of each stage, by stage name."""
        return {
            stage.name: len(inbox)
            for stage, inbox in zip(self._stages, self._channels, strict=False)
        }

    def about(self, stage_name: str) -> Mapping[str, Any]:
        """What a started process stage's set-up reported about itself."""
        for stage in self._stages:
            if stage.name == stage_name and isinstance(stage, ProcessStage):
                return stage.about()
        raise KeyError(f"no process stage named {stage_name!r}")

    def worker_counts(self) -> dict[str, int]:
        """Child processes serving each process stage now, by stage name."""
        return {
            stage.name: stage.worker_count()
            for stage in self._stages
            if isinstance(stage, ProcessStage)
        }

    def dead_stages(self) -> list[str]:
        """Stages with a worker down (crashed, or being restarted right now)."""
        return [stage.name for stage in self._stages if not stage.alive()]

    def submit(self, item: Item) -> None:
        """Feed an item in, waiting while the first stage is full; `Closed` when stopping."""
        self._channels[0].put(item)

    def next_result(self) -> Item:
        """The next item out of the last stage, in completion order, an item made of
        parts once all of them are out; `Closed` when stopping."""
        while True:
            item = self._channels[-1].get()
            if item.part is None:
                return item
            parts = self._wholes.setdefault(item.part.whole, [])
            parts.append((item.part, item))
            if len(parts) == item.part.count:
                del self._wholes[item.part.whole]
                return _whole(parts)

    def close(self) -> None:
        """Stop every stage and child process, all at once, within about two
        `STOP_GRACE_S`; items still inside are dropped."""
        self._closing.set()
        for channel in self._channels:
            channel.close()
        for stage in self._stages:
            if isinstance(stage, ProcessStage):
                for arena in stage.arenas():
                    arena.close()
        with ThreadPoolExecutor(len(self._stages)) as pool:
            list(pool.map(lambda stage: stage.stop(), self._stages))

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _whole(parts: list[tuple[Part, Item]]) -> Item:
    """The item that parts were made of: its value is each part's `(about, value)`, in
    order. A part's error is the whole's, a transient one first (the whole is then
    tried again)."""
    parts.sort(key=lambda pair: pair[0].number)
    first = parts[0][1]
    errors = [(part, item.error) for part, item in parts if item.error is not None]
    if not errors:
        return Item(first.job, first.index, [(part.about, item.value) for part, item in parts])
    part, error = min(errors, key=lambda pair: not pair[1].transient)
    message = f"part {part.number + 1} of {part.count}: {error.message}"
    return Item(first.job, first.index, None, error=replace(error, message=message))
