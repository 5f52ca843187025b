"""The order `make test` runs the suite in (`tests/support/durations.py`): each
pytest-xdist worker's share of the collection starts with its share of the long tests."""

from __future__ import annotations

import os

import pytest

from tests.support.durations import balanced_order, known_durations, read_durations


def test_each_workers_run_holds_an_equal_share_of_the_known_time_longest_first() -> None:
    """Worksteal hands 3 workers runs of 4, 4 and 5 of 13 tests. In the written order
    the first run would hold 160 of the 195 s; here each holds at most the average
    (65 s) plus its longest test, and starts with that test."""
    seconds = {"a": 60.0, "b": 40.0, "c": 30.0, "d": 30.0, "e": 20.0, "f": 10.0, "g": 5.0}
    tests = [*seconds, "h", "i", "j", "k", "l", "m"]
    order = balanced_order(tests, seconds, 3)
    assert sorted(order) == sorted(tests)
    runs = [order[:4], order[4:8], order[8:]]
    loads = [sum(seconds.get(test, 0.0) for test in run) for run in runs]
    average = sum(seconds.values()) / 3
    for run, load in zip(runs, loads, strict=True):
        longest = max(seconds.get(test, 0.0) for test in run)
        assert load <= average + longest
        assert [seconds.get(test, 0.0) for test in run] == sorted(
            (seconds.get(test, 0.0) for test in run), reverse=True
        )
    assert max(loads) <= 70.0


def test_durations_are_read_from_a_report_summing_each_tests_phases() -> None:
    report = (
        "12.50s call     tests/e2e/test_x.py::test_long[3]\n"
        "0.50s setup    tests/e2e/test_x.py::test_long[3]\n"
        "0.40s call     tests/test_y.py::test_short\n"
        "2.00s call     tests/test_z.py::test_named[fields0-exactly one of]\n"
    )
    assert read_durations(report) == {
        "tests/e2e/test_x.py::test_long[3]": 13.0,
        "tests/test_z.py::test_named[fields0-exactly one of]": 2.0,
    }


def test_the_known_durations_are_of_tests_by_their_ids() -> None:
    known = known_durations()
    assert known and all("::" in test and seconds > 0 for test, seconds in known.items())


def test_under_pytest_xdist_the_suite_starts_with_its_longest_known_test(
    request: pytest.FixtureRequest,
) -> None:
    """The deal is made where pytest-xdist's workers collect (`tests/conftest.py`): the
    first worker's run starts with the longest known test of those collected."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        pytest.skip("the suite is dealt out only to pytest-xdist's workers (`make test`)")
    known = known_durations()
    collected = [item.nodeid for item in request.session.items]
    longest = max(known.get(test, 0.0) for test in collected)
    assert known.get(collected[0], 0.0) == longest
