"""Where the time goes: each stage's busy intervals, as a Chrome trace and a PNG.

The daemon records an interval every time a stage worker finishes a call. The trace
opens in Perfetto (ui.perfetto.dev) or chrome://tracing with one track per worker; the
PNG has one lane per stage, so a gap in the inference lane (the GPU idle) shows at once.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import structlog
from PIL import Image, ImageDraw

log = structlog.get_logger()

LANE_HEIGHT = 36
LABEL_WIDTH = 110
PLOT_WIDTH = 1200
COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948"]


@dataclass(frozen=True, slots=True)
class Interval:
    stage: str
    worker: str
    start_s: float  # time.perf_counter()
    end_s: float
    items: int


class Timeline:
    """Busy intervals of every stage worker (the last `keep` of them, or all); thread-safe."""

    def __init__(self, keep: int | None = None) -> None:
        self._intervals: deque[Interval] = deque(maxlen=keep)
        self._counts: deque[tuple[str, float, int]] = deque(maxlen=keep)  # (name, at_s, value)
        self._lock = threading.Lock()

    def record(self, stage: str, items: int, duration_s: float) -> None:
        """A call of `stage` on `items` items that took `duration_s` and ended now."""
        end_s = time.perf_counter()
        interval = Interval(
            stage, threading.current_thread().name, end_s - duration_s, end_s, items
        )
        with self._lock:
            self._intervals.append(interval)

    def count(self, name: str, value: int) -> None:
        """A value that changed now, such as a stage's number of workers (a counter
        track in the trace)."""
        with self._lock:
            self._counts.append((name, time.perf_counter(), value))

    def counts(self, name: str) -> list[tuple[float, int]]:
        with self._lock:
            return [(at_s, value) for counted, at_s, value in self._counts if counted == name]

    def intervals(self, stage: str | None = None) -> list[Interval]:
        with self._lock:
            return [i for i in self._intervals if stage is None or i.stage == stage]

    def stages(self) -> list[str]:
        """Stage names in the order they first ran."""
        return list(dict.fromkeys(i.stage for i in self.intervals()))

    def busy_s(self, stage: str, start_s: float, end_s: float) -> float:
        """How long at least one worker of `stage` was busy between `start_s` and `end_s`."""
        return sum(
            max(0.0, min(finish, end_s) - max(begin, start_s))
            for begin, finish in self._busy_spans(stage)
        )

    def _busy_spans(self, stage: str) -> list[tuple[float, float]]:
        """The union of the stage's intervals: overlapping workers count once."""
        spans: list[tuple[float, float]] = []
        for interval in sorted(self.intervals(stage), key=lambda i: i.start_s):
            if spans and interval.start_s <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], interval.end_s))
            else:
                spans.append((interval.start_s, interval.end_s))
        return spans

    def write(self, directory: Path, title: str) -> None:
        """timeline.json (the Chrome trace) and timeline.png in `directory`, each put in
        place whole, so a reader never opens half of one."""
        directory.mkdir(parents=True, exist_ok=True)
        for name, write in (
            ("timeline.json", self.write_chrome_trace),
            ("timeline.png", lambda path: self.write_png(path, title)),
        ):
            partial = directory / f".{name}.partial{Path(name).suffix}"
            write(partial)
            os.replace(partial, directory / name)

    def write_chrome_trace(self, path: Path) -> None:
        """Chrome trace event format: one complete ('X') event per interval."""
        intervals = self.intervals()
        origin = min((i.start_s for i in intervals), default=0.0)
        threads = {
            name: number for number, name in enumerate(sorted({i.worker for i in intervals}))
        }
        events: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            for name, tid in threads.items()
        ]
        events += [
            {
                "name": i.stage,
                "cat": "stage",
                "ph": "X",
                "pid": 1,
                "tid": threads[i.worker],
                "ts": round((i.start_s - origin) * 1e6, 1),
                "dur": round((i.end_s - i.start_s) * 1e6, 1),
                "args": {"items": i.items},
            }
            for i in intervals
        ]
        with self._lock:
            counts = list(self._counts)
        events += [
            {
                "name": name,
                "ph": "C",
                "pid": 1,
                "ts": round((at_s - origin) * 1e6, 1),
                "args": {"value": value},
            }
            for name, at_s, value in counts
        ]
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def write_png(self, path: Path, title: str) -> None:
        """One lane per stage. Each pixel column is filled to the share of its time that at
        least one of the stage's workers was busy: a busy lane is solid, an idle one low,
        however short its calls are next to a pixel's width."""
        intervals, stages = self.intervals(), self.stages()
        origin = min((i.start_s for i in intervals), default=0.0)
        span_s = max((i.end_s for i in intervals), default=1.0) - origin or 1.0
        height = LANE_HEIGHT * (len(stages) + 2)
        image = Image.new("RGB", (LABEL_WIDTH + PLOT_WIDTH + 20, height), "white")
        draw = ImageDraw.Draw(image)
        draw.text((10, 8), f"{title}  ({span_s:.2f} s)", fill="black")
        bar_height = LANE_HEIGHT - 14
        for lane, stage in enumerate(stages):
            top = LANE_HEIGHT * (lane + 1) + 6
            bottom = top + bar_height
            spans = self._busy_spans(stage)
            busy = sum(finish - begin for begin, finish in spans)
            draw.text((10, top + 8), f"{stage} {busy / span_s:.0%}", fill="black")
            draw.rectangle(
                (LABEL_WIDTH, top, LABEL_WIDTH + PLOT_WIDTH, bottom + 1), outline="#cccccc"
            )
            shares = _column_shares(spans, origin, span_s)
            for column, share in enumerate(shares):
                if share > 0:
                    left = LABEL_WIDTH + column
                    draw.line(
                        (left, bottom - max(1, round(share * bar_height)) + 1, left, bottom),
                        fill=COLOURS[lane % len(COLOURS)],
                    )
        axis = LANE_HEIGHT * (len(stages) + 1) + 10
        for tick in range(11):
            x = LABEL_WIDTH + tick * PLOT_WIDTH / 10
            draw.line((x, axis, x, axis + 5), fill="black")
            draw.text((x - 10, axis + 8), f"{span_s * tick / 10:.1f}s", fill="black")
        image.save(path)


def _column_shares(spans: list[tuple[float, float]], origin: float, span_s: float) -> list[float]:
    """For each of the plot's pixel columns, the busy share of the time it stands for."""
    shares = [0.0] * PLOT_WIDTH
    for begin, finish in spans:
        left = (begin - origin) / span_s * PLOT_WIDTH
        right = min((finish - origin) / span_s * PLOT_WIDTH, PLOT_WIDTH)
        for column in range(int(left), math.ceil(right)):
            shares[column] += min(right, column + 1) - max(left, column)
    return [min(share, 1.0) for share in shares]


class TimelineWriter:
    """Writes a running daemon's timeline to `directory` every `every_s`, and once more
    when stopped."""

    def __init__(self, timeline: Timeline, directory: Path, every_s: float):
        self._timeline = timeline
        self._directory = directory
        self._every_s = every_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._every_s):
            self.write()

    def stop(self) -> None:
        self._stopped.set()
        self.write()

    def write(self) -> None:
        """Never raises: a full disk is no reason to stop serving."""
        calls = len(self._timeline.intervals())
        try:
            self._timeline.write(self._directory, f"worker pid {os.getpid()}, last {calls} calls")
        except OSError as error:
            log.warning("timeline_not_written", directory=str(self._directory), error=repr(error))
