"""Pipelines of the engine's tests, and an observer that records what their stages
report."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tests.support import stagefns
from worker.engine import (
    Item,
    Pipeline,
    PrepareStep,
    ProcessStage,
    TensorArena,
)


class RecordingObserver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.events: list[str] = []
        self.lost: list[str] = []
        self.broken: list[str] = []
        self.suspects: list[frozenset[str] | None] = []
        self.workers: list[tuple[str, int]] = []
        self.counts: dict[tuple[str, str], int] = {}

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

    def stage_counted(self, stage: str, counts: Any) -> None:
        for name, count in counts.items():
            self.counts[(stage, name)] = self.counts.get((stage, name), 0) + count


def run_items(pipeline: Pipeline, items: list[Item]) -> list[Item]:
    pipeline.submit(*items)
    return results_out(pipeline, len(items))


def results_out(pipeline: Pipeline, count: int) -> list[Item]:
    """Items out of the pipeline, in the order they came, once at least `count` are."""
    out: list[Item] = []
    while len(out) < count:
        out += pipeline.next_results()
    return out


def process_pipeline(
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


def fetching_pipeline(
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
