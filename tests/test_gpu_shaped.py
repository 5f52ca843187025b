"""The figures `bench.gpu_shaped` reads off a run's timeline."""

from __future__ import annotations

import pytest

from bench.gpu_shaped import ending_ms, longest_stall_ms, steady_images_per_s
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
    inputs), the second 2 s later, the next seven one a second, the last 20 s later.
    From the batch that reaches a tenth of the items to the one that reaches nine
    tenths: 80 items in 9 s (marks at a fifth and four fifths would read 60 in 6)."""
    ends = [5.0, 7.0, *(7.0 + n for n in range(1, 8)), 34.0]
    timeline = Recorded([batch(end - 0.5, end) for end in ends])
    assert steady_images_per_s(timeline) == pytest.approx(80 / 9)


def test_a_run_too_short_for_a_steady_rate_says_so() -> None:
    """One batch holds both marks: there is no pace between them to read."""
    with pytest.raises(ValueError, match="too few batches"):
        steady_images_per_s(Recorded([batch(0.0, 1.0, items=100)]))
    with pytest.raises(ValueError, match="too few batches"):
        steady_images_per_s(Recorded([]))


def test_the_longest_stall_is_the_longest_gap_between_busy_spans() -> None:
    """A call inside an earlier one is part of its busy span: the gaps between spans are
    0.2 s and 0.1 s, and the time before the first call and after the last is no stall
    (a call's start less the one before's end would read 1.2 s)."""
    timeline = Recorded([batch(1.0, 3.0), batch(1.5, 2.0), batch(3.2, 3.4), batch(3.5, 4.0)])
    assert longest_stall_ms(timeline) == pytest.approx(200.0)


def test_the_ending_runs_from_the_last_batch_to_the_last_ack() -> None:
    """The last batch to end (not the last to start) ends at 4.0 s; the last message is
    acked at 4.25 s: the run's ending is 250 ms."""
    timeline = Recorded([batch(1.0, 4.0), batch(3.5, 3.75)])
    assert ending_ms(timeline, last_ack_s=4.25) == pytest.approx(250.0)
