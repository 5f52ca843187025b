"""Scale-in protection: on with the first job, off after the idle grace, never left on."""

from __future__ import annotations

import threading
import time

from tests.support.timing import ManualClock
from worker.adapters.fakes import RecordingGuard
from worker.daemon.protection import RETRY_AFTER_FAILURE_S, ProtectionKeeper
from worker.jobs.job import Job
from worker.jobs.ledger import Ledger
from worker.ports import ReceivedMessage


def _hold(ledger: Ledger, key: str) -> Job:
    job = ledger.receive(ReceivedMessage(key, "{}", f"{key}#1", 1))
    assert job is not None
    return job


def _let_go(ledger: Ledger, job: Job) -> None:
    ledger.release(job)
    ledger.forget(job)


def test_one_busy_period_costs_two_calls_however_many_jobs_trickle_through() -> None:
    """Protected when the first job arrives; jobs that come and go within the idle grace
    make no calls; unprotected once the grace has passed with nothing held."""
    clock, ledger, guard = ManualClock(), Ledger(), RecordingGuard()
    keeper = ProtectionKeeper(ledger, guard, idle_grace_s=30, clock=clock)
    keeper.step()
    assert guard.calls == []
    for number in range(5):  # a trickle: a job every 20 s, each done in 5 s
        job = _hold(ledger, f"j{number}")
        keeper.step()
        clock.now += 5
        _let_go(ledger, job)
        keeper.step()
        clock.now += 15
        keeper.step()
    assert guard.calls == [True]
    clock.now += 15  # 30 s since the last job left
    keeper.step()
    assert guard.calls == [True, False] and not keeper.protected


def test_idle_grace_counts_from_when_the_last_job_left() -> None:
    """A job longer than the grace does not shorten the grace after it."""
    clock, ledger, guard = ManualClock(), Ledger(), RecordingGuard()
    keeper = ProtectionKeeper(ledger, guard, idle_grace_s=30, clock=clock)
    job = _hold(ledger, "long")
    keeper.step()
    clock.now += 100
    _let_go(ledger, job)
    keeper.step()
    clock.now += 29
    keeper.step()
    assert guard.calls == [True]
    clock.now += 1
    keeper.step()
    assert guard.calls == [True, False]


def test_a_failed_call_is_retried_and_never_fatal() -> None:
    """The protection API failing once is logged; the keeper tries again later."""
    clock, ledger, guard = ManualClock(), Ledger(), RecordingGuard(failures=1)
    keeper = ProtectionKeeper(ledger, guard, idle_grace_s=30, clock=clock)
    _hold(ledger, "j")
    assert keeper.step() == RETRY_AFTER_FAILURE_S
    assert guard.calls == [] and not keeper.protected
    clock.now += RETRY_AFTER_FAILURE_S / 2
    keeper.step()
    assert guard.calls == []
    clock.now += RETRY_AFTER_FAILURE_S / 2
    keeper.step()
    assert guard.calls == [True] and keeper.protected


def test_expiring_protection_is_renewed_while_busy() -> None:
    """ECS task protection expires by itself: it is renewed while jobs are held."""
    clock, ledger, guard = ManualClock(), Ledger(), RecordingGuard(renew_every_s=100)
    keeper = ProtectionKeeper(ledger, guard, idle_grace_s=30, clock=clock)
    _hold(ledger, "j")
    keeper.step()
    clock.now += 50
    keeper.step()
    assert guard.calls == [True]
    clock.now += 50
    keeper.step()
    assert guard.calls == [True, True]


def test_stop_drops_protection() -> None:
    """Stopping (shutdown, SIGTERM) never leaves the machine protected."""
    ledger, guard = Ledger(), RecordingGuard()
    keeper = ProtectionKeeper(ledger, guard, idle_grace_s=3600)
    loop = threading.Thread(target=keeper.run)
    loop.start()
    _hold(ledger, "j")
    deadline = time.monotonic() + 5
    while not keeper.protected and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.stop()
    loop.join(5)
    keeper.unprotect()
    assert not loop.is_alive()
    assert guard.calls == [True, False] and not keeper.protected
