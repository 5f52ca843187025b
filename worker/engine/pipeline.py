"""Stages joined by bounded channels: items in, results out, an item split by a fan-out
put back together.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import structlog

from worker.engine.channel import Channel
from worker.engine.child_handle import preload
from worker.engine.items import Item, Part, StageObserver
from worker.engine.process_stage import ProcessStage
from worker.engine.scaler import SCALE_EVERY_S, SHRINK_AFTER_S, WorkerScaler
from worker.engine.stage import Stage

log = structlog.get_logger()


OUTPUT_CAPACITY = 1024


def logging_failures(run: Callable[[], None], name: str) -> None:
    """A helper thread whose failure must not stop the pipeline (scaling is an
    optimisation): it is logged, and the stage keeps the workers it has."""
    try:
        run()
    except Exception:
        log.exception("pipeline_helper_failed", helper=name)


class Pipeline:
    """Stages joined by bounded channels: `submit` items in, take `next_results` out."""

    def __init__(
        self,
        stages: Sequence[Stage],
        observer: StageObserver,
        *,
        scale_every_s: float = SCALE_EVERY_S,
        shrink_after_s: float = SHRINK_AFTER_S,
    ):
        self._stages = list(stages)
        self._scaling = {"every_s": scale_every_s, "shrink_after_s": shrink_after_s}
        self._observer = observer
        self._channels: list[Channel[Item]] = [
            Channel(stage.inbox_capacity, _urgent) for stage in stages
        ]
        self._channels.append(Channel(OUTPUT_CAPACITY))
        self._closing = threading.Event()
        self._wholes: dict[int, list[tuple[Part, Item]]] = {}  # parts come out in any order

    def start(self) -> None:
        """Start every stage (children included), all at once: each child imports torch
        and may load a model. Raises `StageSetupError` if one cannot start."""

        def start(stage: Stage, inbox: Channel[Item], outbox: Channel[Item]) -> None:
            stage.start(inbox, outbox, self._observer, self._channels[-1])

        preload(
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
                    target=logging_failures,
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

    def background_room(self) -> int | None:
        """How many items that are not urgent may be inside at once: the slots of the
        first arena, less a batch of the stage that reads it, kept for urgent items;
        and, in a chain, the slots of each arena after it, where the items past the
        first wait (as parts, a slot each), so the later model has its batches too.
        Background work within that never fills the first arena or its reader's inbox,
        so an urgent item waits only for the batches a device already has (in a chain
        whose items make several parts each, it may take some of the slots kept).
        None: no arena, no bound."""
        processes = [stage for stage in self._stages if isinstance(stage, ProcessStage)]
        arenas = [stage.writes for stage in processes if stage.writes is not None]
        if not arenas:
            return None
        first, *later = arenas
        reader = next(stage for stage in processes if stage.reads is first)
        return max(1, first.slots - reader.batch_size) + sum(arena.slots for arena in later)

    def submit(self, *items: Item) -> None:
        """Feed items in, in order, waiting while the first stage is full; `Closed` when
        stopping."""
        self._channels[0].put_all(items)

    def next_results(self) -> list[Item]:
        """The items out of the last stage by now, waiting for one, in completion order,
        an item made of parts once all of them are out; `Closed` when stopping."""
        results: list[Item] = []
        while not results:
            for item in self._channels[-1].get_batch(OUTPUT_CAPACITY, 0.0):
                if item.part is None:
                    results.append(item)
                    continue
                parts = self._wholes.setdefault(item.part.whole, [])
                parts.append((item.part, item))
                if len(parts) == item.part.count:
                    del self._wholes[item.part.whole]
                    results.append(whole_of(parts))
        return results

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


def _urgent(item: Item) -> bool:
    return item.urgent


def whole_of(parts: list[tuple[Part, Item]]) -> Item:
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
