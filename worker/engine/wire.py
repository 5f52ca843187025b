"""Everything that crosses between a process stage's driver and its child, as named
types: the plan a child is started with, its word that it is set up (or why not),
requests and the probe's request, its word that it prepared a request, and replies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import numpy as np

from worker.engine.arena import SharedSlots
from worker.engine.items import PrepareStep, StageSetup

ArenaMode = Literal["write", "read", "fan-out"] | None


PROBE = "probe"  # the request that asks a child to run its stage's probe


# The prepare step's probe: the latest values that passed it (from different requests);
# it blames the worker only when at least two are known and all fail, so one input its
# owner deleted since cannot.
KNOWN_GOOD_VALUES = 3


KNOWN_GOOD_REFRESH_S = 60.0  # a fan-out's known-good image is copied at most this often


@dataclass(frozen=True)
class ChildPlan:
    """What a child process is told about its stage (pickled across; the arenas as
    files of shared memory that the child maps)."""

    stage: str
    setup: StageSetup
    mode: ArenaMode
    prepare: PrepareStep | None
    prepare_threads: int
    max_parts: int
    known_good: KnownGood  # what the stage's children handled well so far
    reads: SharedSlots | None  # the arena its inputs are in
    writes: SharedSlots | None  # the arena it writes its outputs to
    niceness: int = 0  # how much less of the host's CPU it is given than the daemon (`nice`)


class Ready(NamedTuple):
    """A child's word that its set-up is done: its pid, and what the set-up reports."""

    pid: int
    about: Mapping[str, Any]


class SetupFailed(NamedTuple):
    """A child's word that its set-up raised, with the traceback."""

    traceback: str


class Task(NamedTuple):
    """One item of a request to a child: `tag` names it in the answer of a child that
    answers items as they are prepared (`Prepared.tags`)."""

    slot: int | None
    value: Any
    part_slots: tuple[int, ...]
    tag: int


WireTask = tuple[int | None, Any, tuple[int, ...], int]  # a `Task` as it crosses the pipe


class Prepared(NamedTuple):
    """A child's word that it has prepared items and now runs them: a stage with a
    prepare step answers its items as they are prepared, in groups, whatever request
    they came in (`tags`: which), so that none waits for the slowest of its request."""

    duration_s: float
    tags: tuple[int, ...]


class Reply(NamedTuple):
    """A child's answer to one request."""

    outcomes: list[Any]
    events: list[dict[str, Any]]
    fitting_batch_size: int | None  # after an out-of-memory error, the size that fitted
    duration_s: float
    fault: str | None  # every item failed, and so did the probe: why the probe failed
    # Every item failed its prepare step, and nothing was prepared before to tell a
    # worker's fault from the inputs' (their errors are made transient).
    untold: bool = False
    # When the run ended (`time.monotonic`, one clock for every process of the host):
    # the child began the request queued behind it then, though a finish step may
    # hold this reply back for a while longer.
    ended_at: float = 0.0
    # How long the request waited in the child before it ran: behind the requests sent
    # before it, and for its items to be prepared.
    queued_s: float = 0.0
    # What the stage function counted since the child's answer before (`counts`).
    counts: tuple[tuple[str, int], ...] = ()


@dataclass
class KnownGood:
    """Input a stage handled well: the probe of a step that has none of its own. The
    latest values its prepare step prepared (a fetch probed by fetching them again), and
    for a fan-out a copy of an image it cut into parts, with what it was told of it (an
    array: the daemon's process, which keeps it between children, has no torch)."""

    unprepared: list[Any] = field(default_factory=list)  # the latest first
    fan_out: tuple[np.ndarray[Any, Any], Any] | None = None
    fan_out_at: float = -math.inf  # monotonic

    def remember(self, value: Any) -> None:
        if value not in self.unprepared:
            self.unprepared = [value, *self.unprepared][:KNOWN_GOOD_VALUES]

    def fan_out_stale(self) -> bool:
        return time.monotonic() - self.fan_out_at > KNOWN_GOOD_REFRESH_S

    def cut(self, image: np.ndarray[Any, Any], found: Any) -> None:
        self.fan_out, self.fan_out_at = (image, found), time.monotonic()

    def copy(self) -> KnownGood:
        return replace(self, unprepared=list(self.unprepared))


class Preparation(NamedTuple):
    """What an item's preparation gave: the value it became, or the error it raised
    (which `result` raises again)."""

    value: Any
    error: BaseException | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Received(NamedTuple):
    """A request as a child's reader took it."""

    request: Any
    started: float


class ReadyItem(NamedTuple):
    """An item of a request whose preparation is done (`preparation` holds what it
    became, or the error), taken in the order preparations end."""

    task: Task
    preparation: Preparation
    arrived: float  # `time.perf_counter()` when its request came in
