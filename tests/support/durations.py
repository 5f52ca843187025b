"""The suite's order for `make test`: the tests known to be long dealt out so that each
pytest-xdist worker starts with its share of them, from the durations of a full run
(`tests/durations.json`).

`--dist worksteal` hands each of N workers a contiguous run of the collection, a
count's worth each, and an idle worker then takes the back half of the longest queue.
In the order tests are written, the longest ones could end up in one worker's run, or
start last and run long after every other worker is done (the tail). Here each run
holds about an Nth of the known time, its longest tests first, so the end of every
queue is short tests that stealing evens out.

    python -m tests.support.durations LOG   # LOG: a full run's `--durations=0` output

writes `tests/durations.json` again from a run with every test's durations."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

DURATIONS_FILE = Path(__file__).parent.parent / "durations.json"
# Tests shorter than this keep the order they are written in, after the longer ones of
# their worker's run: what they take is evened out by stealing.
KEPT_FROM_S = 1.0
_DURATION_LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$", re.M)


def read_durations(log: str) -> dict[str, float]:
    """Each test's seconds (setup, call and teardown together) in a `--durations=0`
    report, for the tests that took at least KEPT_FROM_S."""
    seconds: Counter[str] = Counter()
    for match in _DURATION_LINE.finditer(log):
        seconds[match.group(2)] += float(match.group(1))
    return {test: round(s, 1) for test, s in sorted(seconds.items()) if s >= KEPT_FROM_S}


def balanced_order(tests: Sequence[str], seconds: dict[str, float], workers: int) -> list[str]:
    """`tests` reordered into `workers` contiguous runs of the sizes worksteal hands out
    (len // workers for the first, and so on), each holding about an equal share of the
    seconds, its longest tests first: every test, longest first, goes to the run with
    the least time so far that still has room."""
    sizes = []
    left = len(tests)
    for worker in range(workers):
        sizes.append(left // (workers - worker))
        left -= sizes[-1]
    runs: list[list[str]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for test in sorted(tests, key=lambda test: -seconds.get(test, 0.0)):
        run = min((r for r in range(workers) if len(runs[r]) < sizes[r]), key=loads.__getitem__)
        runs[run].append(test)
        loads[run] += seconds.get(test, 0.0)
    return [test for run in runs for test in run]


def known_durations() -> dict[str, float]:
    return json.loads(DURATIONS_FILE.read_text())  # type: ignore[no-any-return]


if __name__ == "__main__":
    DURATIONS_FILE.write_text(
        json.dumps(read_durations(Path(sys.argv[1]).read_text()), indent=0) + "\n"
    )
