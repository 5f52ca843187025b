"""The figures `bench.gpu_shaped` reads off a run's timeline."""

from __future__ import annotations

import pytest

from bench.gpu_shaped import longest_stall_ms, steady_images_per_s
from worker.telemetry.timeline import Interval, Timeline


class Recorded(Timeline):
    """A timeline of the intervals given (a real one stamps them with the clock)."""

    def __init__(self, intervals: list[Interval]):
        super().__init__()
        self._given = intervals

    def intervals(self, stage: str | None = None) -> list[Interval]:
        return [i for i in self._given if stage is None or i.stage == stage]


def batch(start_s: float, end_s: float, items: int = 10) -> Interval:
    return Interval("inference", "inference-0", start_s, end_s, items)


def test_the_steady_rate_leaves_out_a_slow_start_and_a_slow_end() -> None:
    """Ten batches of 10 items: the first ends at 5 s (a run's start waits for its first
    inputs), the next eight one a second, the last 20 s later. From the batch past a
    tenth of the items to the one past nine tenths: 80 items in 8 s."""
    ends = [5.0, *(5.0 + n for n in range(1, 9)), 33.0]
    timeline = Recorded([batch(end - 0.5, end) for end in ends])
    assert steady_images_per_s(timeline) == pytest.approx(10.0)


def test_the_longest_stall_is_the_longest_gap_between_busy_spans() -> None:
    """Overlapping calls are one busy span; the gaps between spans are 0.1 s and 0.3 s,
    and the time before the first call and after the last is no stall."""
    timeline = Recorded([batch(1.0, 2.0), batch(1.5, 2.5), batch(2.6, 3.0), batch(3.3, 4.0)])
    assert longest_stall_ms(timeline) == pytest.approx(300.0)
