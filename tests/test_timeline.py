"""The timeline: busy time as a union of intervals, and its two exports."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from worker.telemetry.timeline import LABEL_WIDTH, LANE_HEIGHT, PLOT_WIDTH, Interval, Timeline


def _timeline(*intervals: tuple[str, str, float, float]) -> Timeline:
    timeline = Timeline()
    timeline._intervals = [Interval(stage, worker, a, b, 4) for stage, worker, a, b in intervals]
    return timeline


def test_busy_time_counts_overlapping_workers_once_and_clips_to_the_window() -> None:
    timeline = _timeline(
        ("fetch", "fetch-0", 0.0, 2.0),
        ("fetch", "fetch-1", 1.0, 3.0),  # overlaps the first
        ("fetch", "fetch-2", 5.0, 6.0),
        ("inference", "inference-0", 0.0, 10.0),
    )
    assert timeline.busy_s("fetch", 0.0, 10.0) == 4.0
    assert timeline.busy_s("fetch", 2.5, 5.5) == 1.0
    assert timeline.stages() == ["fetch", "inference"]


def test_exports_a_chrome_trace_and_a_png_with_a_lane_per_stage(tmp_path: Path) -> None:
    timeline = Timeline()
    for stage in ("fetch", "preprocess", "inference"):
        timeline.record(stage, items=8, duration_s=0.01)
    timeline.write_chrome_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["fetch", "preprocess", "inference"]
    assert all(e["dur"] > 0 and e["args"] == {"items": 8} for e in spans)
    timeline.write_png(tmp_path / "timeline.png", "test")
    with Image.open(tmp_path / "timeline.png") as image:
        assert image.height >= 3 * 36


def _lane_fill(image: Image.Image, lane: int) -> float:
    """Share of the lane's plot area that is coloured (not white, not the grey frame)."""
    top = LANE_HEIGHT * (lane + 1) + 8
    pixels = [
        image.getpixel((x, y))
        for x in range(LABEL_WIDTH + 1, LABEL_WIDTH + PLOT_WIDTH - 1)
        for y in range(top, top + LANE_HEIGHT - 16)
    ]
    return sum(p not in {(255, 255, 255), (204, 204, 204)} for p in pixels) / len(pixels)


def test_png_lane_height_shows_the_busy_share_of_short_calls(tmp_path: Path) -> None:
    """Calls far shorter than a pixel still read as what they add up to: a stage busy a
    quarter of the time fills about a quarter of its lane; a busy one fills it all."""
    quarter_busy = [("preprocess", "p-0", n * 0.04, n * 0.04 + 0.01) for n in range(2500)]
    timeline = _timeline(("inference", "i-0", 0.0, 100.0), *quarter_busy)
    timeline.write_png(tmp_path / "timeline.png", "test")
    with Image.open(tmp_path / "timeline.png") as image:
        assert _lane_fill(image, 0) > 0.95
        assert 0.15 < _lane_fill(image, 1) < 0.35
