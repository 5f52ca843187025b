"""A child's items answered in groups (`Preparing.next_group`): a group goes as soon as
it is complete, not at its deadline, and never waits for nothing."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from worker.engine import preparing as preparing_module
from worker.engine.items import StageFunction
from worker.engine.preparing import GROUP_ITEMS, Preparing
from worker.engine.wire import PROBE

LONG_WAIT_S = 60.0  # a group's deadline here: a group back before it was not kept to it


@pytest.fixture
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, threading.Event]]:
    """Each item's read, held until its gate opens; groups wait `LONG_WAIT_S`."""
    monkeypatch.setattr(preparing_module, "GROUP_WAIT_S", LONG_WAIT_S)
    opened: dict[int, threading.Event] = {}
    yield opened
    for gate in opened.values():
        gate.set()


def _started(gates: dict[int, threading.Event], values: range) -> tuple[Preparing, Any]:
    def read(value: int) -> int:
        gates[value].wait(LONG_WAIT_S)
        return value

    for value in values:
        gates[value] = threading.Event()
    ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
    preparing = Preparing(StageFunction(lambda *_: None, prepare=read), 64, ready)
    ours, theirs = multiprocessing.Pipe()
    threading.Thread(target=preparing.read, args=(theirs,), daemon=True).start()
    ours.send([(None, value, (), value) for value in values])
    return preparing, ours


def _group(preparing: Preparing) -> tuple[list[int], Any, float]:
    started = time.monotonic()
    group, marker = preparing.next_group()
    return [entry.task.value for entry in group], marker, time.monotonic() - started


def _open_one_at_a_time(gates: dict[int, threading.Event], values: range) -> None:
    """Open the gates of `values` one by one, as reads end, while a group waits."""

    def open_them() -> None:
        for value in values:
            time.sleep(0.05)
            gates[value].set()

    threading.Thread(target=open_them, daemon=True).start()


def test_a_group_goes_once_it_holds_its_items_while_others_are_still_read(
    gates: dict[int, threading.Event],
) -> None:
    preparing, _ = _started(gates, range(GROUP_ITEMS + 8))
    _open_one_at_a_time(gates, range(GROUP_ITEMS))
    values, marker, took_s = _group(preparing)
    assert sorted(values) == list(range(GROUP_ITEMS)) and marker is None
    assert took_s < LONG_WAIT_S / 2


def test_a_group_waits_for_no_item_once_none_is_being_read(
    gates: dict[int, threading.Event],
) -> None:
    preparing, _ = _started(gates, range(3))
    _open_one_at_a_time(gates, range(3))
    values, marker, took_s = _group(preparing)
    assert sorted(values) == [0, 1, 2] and marker is None
    assert took_s < LONG_WAIT_S / 2


def test_the_probe_ends_a_group_waiting_for_more(gates: dict[int, threading.Event]) -> None:
    preparing, daemon = _started(gates, range(5))
    gates[0].set()
    time.sleep(0.2)  # read, and the group is waiting for more
    daemon.send(PROBE)
    values, marker, took_s = _group(preparing)
    assert values == [0] and marker == PROBE
    assert took_s < LONG_WAIT_S / 2


def test_a_group_short_of_its_items_goes_at_its_deadline(
    gates: dict[int, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preparing_module, "GROUP_WAIT_S", 0.3)
    preparing, _ = _started(gates, range(5))
    gates[0].set()
    gates[1].set()
    values, marker, took_s = _group(preparing)
    if len(values) == 1:  # the second was read after the first's group was taken
        more, marker, more_s = _group(preparing)
        values, took_s = values + more, more_s
    assert sorted(values) == [0, 1] and marker is None
    assert took_s >= 0.3


def test_a_probe_to_an_idle_child_leaves_its_later_groups_whole(
    gates: dict[int, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe taken as a group's first entry is counted off: groups after it still
    wait for their items (a marker counted for ever ended every group at once, an
    answer an item)."""
    monkeypatch.setattr(preparing_module, "GROUP_WAIT_S", 0.5)
    preparing, daemon = _started(gates, range(0))
    daemon.send(PROBE)
    assert _group(preparing)[:2] == ([], PROBE)
    for value in range(10, 15):
        gates[value] = threading.Event()
    daemon.send([(None, value, (), value) for value in range(10, 15)])
    _open_one_at_a_time(gates, range(10, 13))
    values, marker, _ = _group(preparing)
    assert sorted(values) == [10, 11, 12] and marker is None
