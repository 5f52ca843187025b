"""What runs in a process stage's child: set up once, then take requests, prepare their
items on threads, run the stage's function, finish and answer in order.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import structlog
import torch

from worker.engine.child_arenas import BatchGatherer, tensor_of
from worker.engine.items import (
    ItemError,
    PrepareStep,
    StageFunction,
    StageSetupError,
    isolate_failures,
)
from worker.engine.preparing import STOP, Preparing
from worker.engine.wire import (
    PROBE,
    ChildPlan,
    KnownGood,
    Preparation,
    Prepared,
    Ready,
    ReadyItem,
    Received,
    Reply,
    SetupFailed,
    Task,
)
from worker.errors import MissingObject, ObjectTooLarge, TransientError

log = structlog.get_logger()

# Errors of a prepare step that are the input's for sure, whatever else fails: the store
# told its size, or that it does not exist.
CERTAINLY_THE_INPUTS = frozenset({ObjectTooLarge.__name__, MissingObject.__name__})


class Arenas(NamedTuple):
    """The child's arenas as tensors over their shared memory (`ChildPlan`)."""

    reads: torch.Tensor | None
    writes: torch.Tensor | None


def child_main(conn: Connection, lifeline: Connection, plan: ChildPlan) -> None:
    """A stage's child process: set up once, then answer requests until told to stop."""
    # The daemon decides when children stop; a Ctrl-C or a SIGTERM sent to the whole
    # process group must not kill them mid-batch. If the daemon itself dies (SIGKILL),
    # the lifeline closes and the child goes too, even in the middle of a hung call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # What the fork server imported (torch and the rest: 200,000 objects) lives as long
    # as the child: frozen before anything runs, no collection walks it. The first full
    # one did, for a tenth of a second, copying each page it touched from the server.
    # The server imported it with its collector off (`fork_server`): on again here.
    gc.freeze()
    gc.enable()
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True).start()
    if plan.niceness:
        os.nice(plan.niceness)
    logs = _LogCapture()
    try:
        made = plan.setup()
        stage_fn = made if isinstance(made, StageFunction) else StageFunction(made)
        if plan.prepare is not None and stage_fn.prepare is None:
            raise StageSetupError(f"the set-up gave no function for {plan.prepare.name}")
    except BaseException:
        conn.send(SetupFailed(traceback.format_exc()))
        return
    known_good = plan.known_good.copy()
    arenas = Arenas(tensor_of(plan.reads), tensor_of(plan.writes))
    if stage_fn.probe is None and plan.mode == "fan-out":
        assert arenas.writes is not None
        probe = functools.partial(
            _fan_out_probe, stage_fn.run, known_good, arenas.writes.shape[1:], plan.max_parts
        )
        stage_fn = replace(stage_fn, probe=probe)
    reads = arenas.reads if plan.mode == "read" else None
    gatherer = BatchGatherer(reads) if reads is not None else None
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

    # What its set-up made (its model) lives as long as it does too: frozen as well,
    # once its garbage is collected (a full collection paused the child for tens of ms).
    gc.collect()
    gc.freeze()
    conn.send(Ready(os.getpid(), stage_fn.about))
    run = functools.partial(_run_request, stage_fn, plan, arenas, gatherer, known_good=known_good)
    if stage_fn.prepare is None:
        requests: queue.SimpleQueue[Received] = queue.SimpleQueue()
        threading.Thread(target=_read_requests, args=(conn, requests), daemon=True).start()
        _serve_in_order(requests, run, send, stage_fn, logs)
    else:
        ready: queue.SimpleQueue[ReadyItem | Any] = queue.SimpleQueue()
        hedges = plan.prepare.hedges if plan.prepare else 0
        preparing = Preparing(stage_fn, plan.prepare_threads, ready, hedges)
        threading.Thread(target=preparing.read, args=(conn,), daemon=True).start()
        _serve_as_prepared(
            preparing, run, send, stage_fn=stage_fn, plan=plan, known_good=known_good, logs=logs
        )


def _serve_in_order(
    requests: queue.SimpleQueue[Received],
    run: Callable[..., Reply],
    send: Callable[..., bool],
    stage_fn: StageFunction,
    logs: _LogCapture,
) -> None:
    """Answer each request in the order it came, until told to stop."""
    while True:
        request, started = requests.get()
        if request is None:  # told to stop, or the daemon is gone
            return
        if request == PROBE:
            if not send(_probe(stage_fn.probe)):
                return
            continue
        logs.events.clear()
        answer = run(request, failed={}, arrived=started)
        answer = answer._replace(events=list(logs.events))
        if not send(answer, [task.value for task in request]):
            return


def _serve_as_prepared(
    preparing: Preparing,
    run: Callable[..., Reply],
    send: Callable[..., bool],
    *,
    stage_fn: StageFunction,
    plan: ChildPlan,
    known_good: KnownGood,
    logs: _LogCapture,
) -> None:
    """Answer items as their preparation ends, in groups of those prepared by then (a
    request's items are not held for the slowest of them), until told to stop."""
    assert plan.prepare is not None and stage_fn.prepare is not None
    while True:
        group, marker = preparing.next_group()
        if group:
            tasks = [entry.task for entry in group]
            arrived = min(entry.arrived for entry in group)
            logs.events.clear()
            preparations = [entry.preparation for entry in group]
            prepared, failed = _prepared(tasks, preparations, plan.prepare)
            unprepared = [task.value for task in tasks]
            judged = _judged(failed, unprepared, known_good, stage_fn.prepare, plan.prepare)
            tags = tuple(task.tag for task in tasks)
            if not send(Prepared(time.perf_counter() - arrived, tags)):
                return
            answer = run(prepared, failed=judged.failed, arrived=arrived)
            answer = answer._replace(
                events=list(logs.events),
                fault=answer.fault or judged.fault,
                untold=judged.untold,
                counts=preparing.counts(),
            )
            if not send(answer, [task.value for task in prepared]):
                return
        if marker is STOP:
            return
        if marker == PROBE and not send(_probe(stage_fn.probe)):
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
    reply: Reply, values: Sequence[Any], stage_fn: StageFunction, stage: str, logs: _LogCapture
) -> Reply:
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


def _read_requests(conn: Connection, requests: queue.SimpleQueue[Received]) -> None:
    """Take requests off the pipe as they come: a child with several queued goes from one
    to the next without waiting for the daemon."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the daemon is gone: nobody is left to answer
            request = None
        if isinstance(request, list):
            request = [Task._make(task) for task in request]
        requests.put(Received(request, time.perf_counter()))
        if request is None:
            return


def _run_request(
    stage_fn: StageFunction,
    plan: ChildPlan,
    arenas: Arenas,
    gatherer: BatchGatherer | None,
    request: list[Task],
    *,
    failed: Mapping[int, ItemError],
    known_good: KnownGood,
    arrived: float,
) -> Reply:
    """Run the request's items but those that `failed` to be prepared; if every item
    run fails, run the probe too. A fan-out keeps an item it cut up as its known good.
    The request came in at `arrived` (`time.perf_counter`)."""
    started = time.perf_counter()
    runnable = [task for position, task in enumerate(request) if position not in failed]
    ran, fitting_batch_size = _serve_request(stage_fn.run, plan, arenas, gatherer, runnable)
    if plan.mode == "fan-out" and known_good.fan_out_stale():
        assert arenas.reads is not None
        for task, outcome in zip(runnable, ran, strict=True):
            if not isinstance(outcome, ItemError):
                known_good.cut(arenas.reads[task.slot].numpy().copy(), task.value)
                break
    fault = _fault_if_all_failed(ran, stage_fn.probe)
    duration_s = time.perf_counter() - started
    outcomes = iter(ran)
    return Reply(
        [failed[p] if p in failed else next(outcomes) for p in range(len(request))],
        [],
        fitting_batch_size,
        duration_s,
        fault,
        ended_at=time.monotonic(),
        queued_s=started - arrived,
    )


def _sent(conn: Connection, message: Any) -> bool:
    """False if the daemon stopped this child while it worked (nobody reads the pipe)."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def _prepared(
    request: list[Task], preparations: list[Preparation], step: PrepareStep
) -> tuple[list[Task], dict[int, ItemError]]:
    """The request with each item's value prepared, and the errors of those that could
    not be, by position."""
    prepared, failed = [], {}
    for position, (task, preparation) in enumerate(zip(request, preparations, strict=True)):
        try:
            prepared.append(task._replace(value=preparation.result()))
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
    known_good: KnownGood,
    prepare: Callable[[Any], Any],
    step: PrepareStep,
) -> _Judged:
    """When every item of a request failed its prepare step for a reason retrying will
    not cure (access denied to every input, say), whether the worker is to blame: it
    prepares again the values it prepared before. One that passes clears the worker
    (the errors stand); one that fails is forgotten (its owner may have deleted it). If
    two or more fail, all of them, the worker is at fault. With fewer to tell by (or a
    failure for now: throttled), nobody can tell: the errors are made transient, and
    `untold` when nothing was ever prepared. An input over the size limit is its own
    fault for sure: the store (or the tar's header) told its size; so is one the store
    says does not exist: it answered, for an object the worker may ask about (a role
    that may not read it gets a refusal, which is judged)."""
    if len(failed) < len(unprepared):
        known_good.remember(next(v for p, v in enumerate(unprepared) if p not in failed))
        return _Judged(failed, None, False)
    if not failed or any(error.transient for error in failed.values()):
        return _Judged(failed, None, False)
    # The inputs over the size limit, or missing, are their own fault for sure; the rest
    # are judged.
    sized = {p: e for p, e in failed.items() if e.type in CERTAINLY_THE_INPUTS}
    judged = {p: e for p, e in failed.items() if p not in sized}
    if not judged:
        return _Judged(failed, None, False)
    if not known_good.unprepared:
        never = f"no input passed {step.name} before, to tell the worker's fault from the input's"
        return _Judged({**sized, **_made_transient(judged, never)}, None, True)
    fault, why = _prepared_again(known_good, prepare, step)
    if why is not None:
        return _Judged({**sized, **_made_transient(judged, why)}, None, False)
    return _Judged(failed, fault, False)


def _prepared_again(
    known_good: KnownGood, prepare: Callable[[Any], Any], step: PrepareStep
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
    known_good: KnownGood,
    part_shape: Sequence[int],
    max_parts: int,
) -> None:
    """Cut up again an image a fan-out cut up before (none yet: nothing to tell by)."""
    if known_good.fan_out is None:
        return
    image, found = known_good.fan_out
    outs = list(torch.empty((max_parts, *part_shape), dtype=torch.uint8))
    fan_out(torch.from_numpy(image), found, outs)


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
    plan: ChildPlan,
    arenas: Arenas,
    gatherer: BatchGatherer | None,
    request: list[Task],
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
