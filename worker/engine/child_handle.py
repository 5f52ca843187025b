"""A process stage's child as the daemon sees it: starting it, feeding it requests,
waiting for its answers and its death, replacing it; and why a child was lost.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import structlog

from worker.engine.channel import Closed
from worker.engine.items import StageSetupError, StageSetupTimeout
from worker.engine.stage import STOP_GRACE_S
from worker.engine.wire import PROBE, ChildPlan, Ready

log = structlog.get_logger()


# A child that dies before it is ready is started again this many times in all; a set-up
# that raises is not retried (it would raise again).
START_ATTEMPTS = 3


# Torch and the child's side of the engine, imported once by the server, never by the
# daemon's own process (`worker run` names them in `worker.entry`'s list, with the rest
# its server imports, as it starts it before importing this); `fork_server` first.
FORKSERVER_PRELOAD = (
    "worker.engine.fork_server",
    "torch",
    "worker.engine",
    "worker.engine.child_main",
)


HOST_VMSTAT = Path("/proc/vmstat")  # its oom_kill counts the OOM killer's kills


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


class WorkerLost(Exception):
    """A stage's child process died or stopped answering."""

    # Lost while it prepared a request (`PrepareStep`: fetching inputs, whose reads have
    # their own time limits): the surroundings failed, not an input.
    preparing = False
    # Killed by the kernel's OOM killer: the host ran out of memory, whichever process
    # it chose to kill.
    out_of_memory = False
    # The items it was running when it was lost, where it was running some of those it
    # held (a stage that answers items as they are prepared); None: all it held.
    working_on: list[Any] | None = None


class WorkerDied(WorkerLost):
    """The child process exited (a crash, a kill) while it held work."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code


class WorkerHung(WorkerLost):
    """The child process did not answer within the stage's timeout."""


class WorkerFailedProbe(WorkerLost):
    """Every item of a call failed, and so did the stage's probe: the child is broken."""


class ChildProcess:
    """One child of a `ProcessStage` and the pipe that feeds it: used by its driver
    thread, and stopped by `ProcessStage.stop` from another. Each start asks `plan` for
    what the child is told (what its stage has learned changes between starts); one
    that races its stage's `stopping` is stopped again at once.

    Requests are written by a thread of their own: a request larger than the pipe holds
    waits for the child to read it, and a child that hangs never does. The driver must
    still be free to wait for the reply with its timeout, and see the hang."""

    def __init__(
        self,
        name: str,
        plan: Callable[[], ChildPlan],
        setup_timeout_s: float | None,
        stopping: threading.Event,
    ):
        self.name = name
        self._plan = plan
        self._setup_timeout_s = setup_timeout_s
        self._stopping = stopping
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
                if self._stopping.is_set():  # a restart that raced the stage's stop
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
        context = process_context()
        parent_conn, child_conn = context.Pipe()
        # Never written to: the child sees it close when this process dies, however it dies.
        lifeline_reader, self._lifeline = context.Pipe(duplex=False)
        plan = self._plan()
        process = context.Process(
            target=run_child,
            args=(child_conn, lifeline_reader, plan),
            name=self.name,
            daemon=True,
        )
        process.start()
        self._process = process
        child_conn.close()
        lifeline_reader.close()
        self._conn = parent_conn
        ready = self.receive(self._setup_timeout_s)
        if not isinstance(ready, Ready):  # `SetupFailed`, with the traceback
            self.stop(graceful=False)
            raise StageSetupError(f"{self.name} set-up failed:\n{ready.traceback}")
        self.about = ready.about
        self._requests = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=write_requests,
            args=(parent_conn, self._requests),
            name=f"{self.name}-writer",
            daemon=True,
        )
        self._writer.start()
        self._ready = True
        log.info("stage_worker_started", stage=plan.stage, worker=self.name, pid=ready.pid)

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

    def answers_within(self, timeout_s: float) -> bool:
        """Whether the child says something (or exits) within `timeout_s`: `receive`
        then returns, or raises, at once."""
        conn, process = self._conn, self._process
        if conn is None or process is None:
            return True
        return bool(wait([conn, process.sentinel], timeout_s))

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
        # daemon read None where it waited for `Ready`).
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


def run_child(conn: Connection, lifeline: Connection, plan: ChildPlan) -> None:
    """A child's life (`child_main`), named here so that the daemon's process, which
    pickles it by name, never imports the child's side (torch)."""
    from worker.engine.child_main import child_main

    child_main(conn, lifeline, plan)


def write_requests(conn: Connection, requests: queue.SimpleQueue[Any]) -> None:
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


def process_context() -> Any:
    """Children are forked from a server process that has imported torch once (CUDA is
    not initialised there, so forking is safe): a crashed child is replaced in a
    fraction of a second, where a fresh interpreter importing torch takes seconds.

    The server, and so every child, starts with OpenMP's idle threads asleep, unless the
    environment says otherwise: by default each spins on a core for a while after every
    parallel region, and the children share the host's cores with each other and with
    this process. The model's process spun away a fifth of all the CPU the daemon spent
    in the host ceiling run (docs/performance.md)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return multiprocessing.get_context("forkserver")


def preload(imports: Sequence[str]) -> None:
    """What the server imports once, before it forks the first child; later calls
    change nothing (it runs for the life of this process)."""
    process_context().set_forkserver_preload([*FORKSERVER_PRELOAD, *imports])
