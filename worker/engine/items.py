"""Items, their failures, and what stage functions are: the engine's data, and bisection
to the items that fail on their own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.errors import TransientError


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
        torch_out_of_memory = torch_class("OutOfMemoryError", MemoryError)
        transient = isinstance(error, (TransientError, MemoryError, torch_out_of_memory))
        return cls(type(error).__name__, str(error)[:1000], stage, transient)


def torch_class(name: str, otherwise: type) -> type:
    """torch's class `name` (`Tensor`, `OutOfMemoryError`) in a process that has imported
    torch, else `otherwise`: one that has not (the daemon's, for a CPU pipeline) has no
    tensors and no torch errors, and is not to import torch to look for them."""
    torch = sys.modules.get("torch")
    return otherwise if torch is None else getattr(torch, name)


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
    # The values `prepare` takes no time for (their bytes are on this machine): prepared
    # as their request comes in, not handed to a thread each (which costs more than that).
    at_hand: Callable[[Any], bool] | None = None
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
    # With hedges, a call still running past the 95th percentile of the latest is made
    # again, up to this many at once, and the first answer wins (`TailLatency`): the
    # step must be safe to run twice on a value (a read).
    hedges: int = 0


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
    # Taken before the items that are not at every stage (its job is waited for; the
    # others are background work).
    urgent: bool = False
    # The length a stage sizing its batches in tokens pads it to, read from its value
    # once there (`TokenBudget.length_of`): its batches are chosen again and again.
    padded_length: int | None = None


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

    def stage_counted(self, stage: str, counts: Mapping[str, int]) -> None:
        """A stage's children did what `counts` counts since they last said (a prepare
        step's calls, and of those hedged)."""


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
            middle = half_of(len(positions))
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
            pending |= {half_of(size), size - half_of(size)}
    return sorted(sizes, reverse=True)


def half_of(count: int) -> int:
    return count // 2


def apply_outcomes(items: Sequence[Item], outcomes: Sequence[Any]) -> None:
    for item, outcome in zip(items, outcomes, strict=True):
        if isinstance(outcome, ItemError):
            item.error = outcome
        else:
            item.value = outcome


class StageSetupError(Exception):
    """A stage's set-up (model load, ...) raised in its child process."""


class StageSetupTimeout(StageSetupError):
    """A stage's child did not finish its set-up within the stage's `setup_timeout_s`,
    each time it was started."""
