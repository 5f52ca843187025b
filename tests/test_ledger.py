"""The ledger's job lifecycle, its round-robin feed, and the per-job log file."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from worker.engine.channel import Closed
from worker.jobs.job import TRANSITIONS, Job, JobState, Result
from worker.jobs.joblog import JobLog, local_log_path
from worker.jobs.ledger import IllegalTransition, Ledger
from worker.jobs.plan import Plan
from worker.message import TarMembers, parse_job_message
from worker.ports import ReceivedMessage

DONE = Result(b'{"label": "a"}\n', failed=False)
FAILED = Result(b'{"error": {}}\n', failed=True)

SETTLE = {
    JobState.ACKED: Ledger.ack,
    JobState.RELEASED: Ledger.release,
    JobState.DEAD_LETTERED: Ledger.dead_letter,
    JobState.SUPERSEDED: Ledger.supersede,
}


def _message(number: int) -> ReceivedMessage:
    return ReceivedMessage(f"m{number}", "{}", f"m{number}#handle", 1)


def _admit(ledger: Ledger, job: Job, items: int, log_dir: Path) -> None:
    inputs = [f"s3://bkt/{job.key}/{index}" for index in range(items)]
    spec = parse_job_message(json.dumps({"inputs": inputs, "output": "s3://bkt/o/"}), frozenset())
    ledger.admit(job, spec, inputs, JobLog(log_dir / f"{job.key}.log", job.key))


def _held(ledger: Ledger, number: int, items: int, log_dir: Path) -> Job:
    job = ledger.receive(_message(number))
    assert job is not None
    _admit(ledger, job, items, log_dir)
    return job


def _fed(ledger: Ledger, items: int) -> list[tuple[str, int]]:
    """The next `items` the ledger feeds, as (job key, index)."""
    return [(job.key, index) for job, index in (ledger.next_items(1)[0] for _ in range(items))]


def test_items_taken_many_at_a_time_come_in_the_same_turns_as_one_at_a_time(
    tmp_path: Path,
) -> None:
    """The feeder takes several items a lock: in the jobs' turns, as many as are there."""
    ledger = Ledger()
    first, second = _held(ledger, 1, 3, tmp_path), _held(ledger, 2, 2, tmp_path)
    fed = [(job.key, index) for job, index in ledger.next_items(10)]
    assert fed == [(first.key, 0), (second.key, 0), (first.key, 1), (second.key, 1), (first.key, 2)]
    assert ledger.outstanding_items() == 5


def test_a_job_goes_through_its_lifecycle_leased_until_settled(tmp_path: Path) -> None:
    """received (leased at once) -> admitted -> running (first item fed) -> finishing
    (last result) -> acked; the lease ends when the job is settled, and the job leaves
    the ledger only when forgotten."""
    ledger = Ledger()
    job = ledger.receive(_message(1))
    assert job is not None and job.state is JobState.RECEIVED
    assert ledger.leases() == {job.key: "m1#handle"}
    _admit(ledger, job, 2, tmp_path)
    assert job.state is JobState.ADMITTED and ledger.outstanding_items() == 2
    assert ledger.next_items(1)[0] == (job, 0) and job.state is JobState.RUNNING
    assert ledger.next_items(1)[0] == (job, 1)
    assert ledger.record(job.key, 1, DONE) is None
    assert ledger.record(job.key, 0, FAILED) is job
    assert job.state is JobState.FINISHING and (job.succeeded, job.failed) == (1, 1)
    assert ledger.items_recorded() == 2
    assert ledger.ack(job) and job.state is JobState.ACKED
    assert ledger.leases() == {} and len(ledger) == 1
    ledger.forget(job)
    assert len(ledger) == 0 and ledger.outstanding_items() == 0


def test_illegal_moves_raise_and_settling_is_won_once(tmp_path: Path) -> None:
    """The table decides: a running job cannot be dead-lettered nor acked before its
    results are in, an unsettled one cannot be forgotten. Settling twice is a race that
    the first caller wins; the loser gets False, not an error."""
    ledger = Ledger()
    job = ledger.receive(_message(1))
    assert job is not None
    with pytest.raises(IllegalTransition):
        ledger.forget(job)
    _admit(ledger, job, 1, tmp_path)
    with pytest.raises(IllegalTransition):
        _admit(ledger, job, 1, tmp_path)
    late = ledger.receive(_message(2))
    assert late is not None and ledger.release(late)
    body = json.dumps({"inputs": ["s3://bkt/k"], "output": "s3://bkt/o/"})
    spec = parse_job_message(body, frozenset())
    assert not ledger.admit(late, spec, ["s3://bkt/k"], JobLog(tmp_path / "late.log", "late"))
    ledger.next_items(1)[0]
    with pytest.raises(IllegalTransition):
        ledger.dead_letter(job)
    with pytest.raises(IllegalTransition):
        ledger.ack(job)  # a job is acked only once its results are all in
    assert ledger.release(job) and not ledger.release(job) and not ledger.ack(job)
    assert ledger.record(job.key, 0, DONE) is None  # a result arriving after the release
    assert ledger.outstanding_items() == 0


def test_a_resumed_job_is_fed_only_what_is_left_and_counts_what_it_resumed(
    tmp_path: Path,
) -> None:
    ledger = Ledger()
    job = ledger.receive(_message(1))
    assert job is not None
    inputs = [f"s3://bkt/{index}" for index in range(4)]
    spec = parse_job_message(json.dumps({"inputs": inputs, "output": "s3://bkt/o/"}), frozenset())
    resumed = {0: DONE, 2: FAILED}
    assert ledger.admit(job, spec, inputs, JobLog(tmp_path / "j.log", "j"), resumed)
    assert (job.resumed, job.succeeded, job.failed) == (2, 1, 1)
    assert ledger.outstanding_items() == 2
    assert [ledger.next_items(1)[0][1] for _ in range(2)] == [1, 3]
    assert ledger.record(job.key, 3, DONE) is None
    assert ledger.take_unsaved(job) == [(3, DONE)]  # resumed ones are saved
    assert ledger.record(job.key, 1, DONE) is job
    assert job.state is JobState.FINISHING and job.status.value == "partial"

    everything = ledger.receive(_message(2))
    assert everything is not None
    log = JobLog(tmp_path / "k.log", "k")
    assert ledger.admit(everything, spec, inputs, log, dict.fromkeys(range(4), DONE))
    assert everything.state is JobState.FINISHING and ledger.outstanding_items() == 0


def test_a_cancelled_job_stops_feeding_and_drops_late_results(tmp_path: Path) -> None:
    ledger = Ledger()
    job = _held(ledger, 1, 3, tmp_path)
    assert ledger.next_items(1)[0] == (job, 0)
    assert ledger.cancel(job) and not ledger.cancel(job)
    assert job.state is JobState.FINISHING and job.status.value == "cancelled"
    assert ledger.outstanding_items() == 0
    assert ledger.record(job.key, 0, DONE) is None
    assert ledger.ack(job) and ledger.outstanding_items() == 0  # not counted twice
    ledger.forget(job)
    ledger.close()
    with pytest.raises(Closed):
        ledger.next_items(1)[0]  # nothing of it left to feed


def test_a_job_whose_last_result_lands_while_it_is_found_superseded_finishes(
    tmp_path: Path,
) -> None:
    """The progress loop sees a running job, finds its message handed over (an S3 read),
    and meanwhile the job's last result lands: the job is finishing, its outputs fenced
    against the continuation's, so it is not superseded, and nothing raises (which would
    stop the daemon and charge every held job a receive)."""
    ledger = Ledger()
    job = _held(ledger, 1, 1, tmp_path)
    assert ledger.next_items(1)[0] == (job, 0)
    assert job.state is JobState.RUNNING  # what the progress loop saw
    assert ledger.record(job.key, 0, DONE) is job
    assert not ledger.supersede(job)
    assert job.state is JobState.FINISHING and ledger.ack(job)


def test_the_feed_takes_jobs_in_turn(tmp_path: Path) -> None:
    """A one-item job admitted after a 100-item one is fed second, not 101st; a job
    released while it waits for its turn is skipped."""
    ledger = Ledger()
    big = _held(ledger, 1, 100, tmp_path)
    small = _held(ledger, 2, 1, tmp_path)
    gone = _held(ledger, 3, 5, tmp_path)
    ledger.release(gone)
    assert _fed(ledger, 4) == [
        (big.key, 0),
        (small.key, 0),
        (big.key, 1),
        (big.key, 2),
    ]


def _shard(ledger: Ledger, number: int, items: int, log_dir: Path, broke_workers: int = 0) -> Job:
    """A held job that is a shard of a planned job of tars."""
    job = ledger.receive(dataclasses.replace(_message(number), broke_workers=broke_workers))
    assert job is not None
    job.plan = Plan(
        job_id="planned",
        request_digest="0123456789abcdef",
        items=10,
        shard_items=5,
        model={},
        params={},
        received_at=0.0,
        attempt=1,
        tar=TarMembers(),
    )
    _admit(ledger, job, items, log_dir)
    return job


def test_shards_are_fed_one_after_another_and_other_jobs_in_turn(tmp_path: Path) -> None:
    """A shard taken while another runs (a tar shard's, copied ahead) waits for the
    first to be fed whole, while other jobs are fed in turn beside them; a shard settled
    before it is fed whole gives the next its turn."""
    ledger = Ledger()
    first = _shard(ledger, 1, 2, tmp_path)
    second = _shard(ledger, 2, 2, tmp_path)
    other = _held(ledger, 3, 3, tmp_path)
    assert (ledger.shards_held(), ledger.tar_shards_held()) == (2, 2)
    assert _fed(ledger, 5) == [
        (first.key, 0),
        (other.key, 0),
        (first.key, 1),
        (second.key, 0),
        (other.key, 1),
    ]
    third = _shard(ledger, 4, 2, tmp_path)
    ledger.release(second)
    assert ledger.tar_shards_held() == 2
    assert _fed(ledger, 2) == [(other.key, 2), (third.key, 0)]


def test_background_items_are_fed_only_while_there_is_room_for_them(tmp_path: Path) -> None:
    """With room for two background items (a shard's), a third waits until one is back
    from the pipeline, while a job users wait for is fed meanwhile: background work
    never fills the pipeline in front of it."""
    ledger = Ledger()
    ledger.bound_background(2)
    shard = _shard(ledger, 1, 5, tmp_path)
    assert _fed(ledger, 2) == [(shard.key, 0), (shard.key, 1)]
    waited_for = _held(ledger, 2, 2, tmp_path)
    assert _fed(ledger, 2) == [(waited_for.key, 0), (waited_for.key, 1)]
    later: queue.Queue[tuple[Job, int]] = queue.Queue()
    threading.Thread(target=lambda: later.put(ledger.next_items(1)[0]), daemon=True).start()
    ledger.back_from_pipeline(waited_for.key)  # not background: no room made
    with pytest.raises(queue.Empty):
        later.get(timeout=0.2)
    ledger.back_from_pipeline(shard.key)
    assert later.get(timeout=5) == (shard, 2)


def test_items_taken_many_at_a_time_keep_within_the_room_and_come_back_together(
    tmp_path: Path,
) -> None:
    """Taken several at a time, background items stop at the room there is; given back
    several at a time, they make room as given back one by one would."""
    ledger = Ledger()
    ledger.bound_background(3)
    shard = _shard(ledger, 1, 8, tmp_path)
    assert [index for _, index in ledger.next_items(32)] == [0, 1, 2]
    later: queue.Queue[list[int]] = queue.Queue()
    threading.Thread(
        target=lambda: later.put([index for _, index in ledger.next_items(32)]), daemon=True
    ).start()
    with pytest.raises(queue.Empty):
        later.get(timeout=0.2)
    ledger.back_from_pipeline(shard.key, shard.key)
    assert later.get(timeout=5) == [3, 4]


def test_a_suspect_shard_waiting_its_turn_is_fed_apart_all_the_same(tmp_path: Path) -> None:
    """A shard taken while another runs, whose message broke a worker before (a
    suspect): fed apart once the first shard's items are back, though it is not its turn
    yet, where the turn and the suspect's apartness waited for each other for ever."""
    ledger = Ledger()
    first = _shard(ledger, 1, 2, tmp_path)
    suspect = _shard(ledger, 2, 1, tmp_path, broke_workers=1)
    fed: queue.Queue[tuple[Job, int]] = queue.Queue()
    threading.Thread(target=lambda: fed.put(ledger.next_items(1)[0]), daemon=True).start()
    job, index = fed.get(timeout=5)
    assert (job, index) == (suspect, 0) and first.fed == 0


def test_an_item_fed_again_comes_first_once_due(tmp_path: Path) -> None:
    """An item whose input could not be read for now is fed again once its delay has
    passed, ahead of the jobs' turns; one whose job was released meanwhile is dropped."""
    ledger = Ledger()
    job = _held(ledger, 1, 3, tmp_path)
    other = _held(ledger, 2, 1, tmp_path)
    assert ledger.next_items(1)[0] == (job, 0)
    ledger.retry_item(job, 0, delay_s=0.2)
    assert ledger.next_items(1)[0] == (other, 0)
    assert ledger.next_items(1)[0] == (job, 1)
    assert ledger.next_items(1)[0] == (job, 2)
    started = time.monotonic()
    assert ledger.next_items(1)[0] == (job, 0)  # waited for it to be due
    assert time.monotonic() - started > 0.1 and job.item_retries == {0: 1}
    ledger.retry_item(job, 2, delay_s=0)
    ledger.release(job)
    ledger.close()
    with pytest.raises(Closed):
        ledger.next_items(1)[0]


def test_the_feed_stops_when_the_ledger_closes(tmp_path: Path) -> None:
    """After `close` nothing more is received and the feeder's wait ends with Closed."""
    ledger = Ledger()
    ledger.close()
    assert ledger.receive(_message(1)) is None
    with pytest.raises(Closed):
        ledger.next_items(1)[0]


def test_a_redelivery_of_a_held_message_renews_its_handle(tmp_path: Path) -> None:
    """A message that came back while still held here (its lease ran out unnoticed) is
    not a second job: the held one carries on under the new receipt handle."""
    ledger = Ledger()
    job = _held(ledger, 1, 1, tmp_path)
    ledger.mark_lease_lost(job.key)
    assert ledger.leases() == {}
    assert ledger.adopt_redelivery(ReceivedMessage("m1", "{}", "m1#new", 2))
    assert ledger.leases() == {job.key: "m1#new"}
    ledger.release(job)
    assert not ledger.adopt_redelivery(ReceivedMessage("m1", "{}", "m1#newer", 3))


class LedgerMachine(RuleBasedStateMachine):
    """Any order of receives, admissions, feeds, results and settlements keeps the
    lifecycle legal and the bookkeeping true."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = tempfile.TemporaryDirectory()
        self.ledger = Ledger()
        self.jobs: list[Job] = []
        self.fed: list[tuple[Job, int]] = []
        self.history: dict[str, list[JobState]] = {}

    def teardown(self) -> None:
        self.scratch.cleanup()

    def _job(self, number: int) -> Job | None:
        return self.jobs[number % len(self.jobs)] if self.jobs else None

    @rule()
    def receive(self) -> None:
        job = self.ledger.receive(_message(len(self.jobs)))
        assert job is not None
        self.jobs.append(job)

    @rule(number=st.integers(0, 50), items=st.integers(1, 4))
    def admit(self, number: int, items: int) -> None:
        job = self._job(number)
        if job is not None and job.state is JobState.RECEIVED:
            _admit(self.ledger, job, items, Path(self.scratch.name))

    @rule()
    def feed(self) -> None:
        if any(job.fed < len(job.inputs) and not job.settled for job in self.jobs):
            self.fed.append(self.ledger.next_items(1)[0])

    @rule(number=st.integers(0, 50), failed=st.booleans())
    def result(self, number: int, failed: bool) -> None:
        if self.fed:
            job, index = self.fed.pop(number % len(self.fed))
            self.ledger.record(job.key, index, FAILED if failed else DONE)

    @rule(number=st.integers(0, 50))
    def feed_again(self, number: int) -> None:
        if self.fed:
            job, index = self.fed.pop(number % len(self.fed))
            self.ledger.retry_item(job, index, delay_s=0)
            if job.state is JobState.RUNNING:
                self.fed.append(self.ledger.next_items(1)[0])

    @rule(number=st.integers(0, 50), state=st.sampled_from(sorted(SETTLE)))
    def settle(self, number: int, state: JobState) -> None:
        job = self._job(number)
        if job is not None and not job.settled and state in TRANSITIONS[job.state]:
            assert SETTLE[state](self.ledger, job)

    @rule(number=st.integers(0, 50))
    def forget(self, number: int) -> None:
        job = self._job(number)
        if job is not None and job.settled:
            self.ledger.forget(job)

    @invariant()
    def states_move_only_as_the_table_says(self) -> None:
        for job in self.jobs:
            seen = self.history.setdefault(job.key, [JobState.RECEIVED])
            if seen[-1] is not job.state:
                assert job.state in TRANSITIONS[seen[-1]]
                seen.append(job.state)

    @invariant()
    def bookkeeping_is_true(self) -> None:
        unsettled = [job for job in self.jobs if not job.settled]
        assert self.ledger.outstanding_items() == sum(job.outstanding_items for job in unsettled)
        assert set(self.ledger.leases()) == {job.key for job in unsettled}


LedgerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


def test_job_log_file_keeps_released_attempts_and_goes_when_the_job_is_done(
    tmp_path: Path,
) -> None:
    """A released attempt's lines stay on the machine (they name the fault); the next
    attempt appends its own; once the job is done and uploaded, the file goes."""
    path = tmp_path / "j.log"
    first = JobLog(path, "j")
    first.info("job_received", attempt=1)
    first.error("job_released", reason="upload failed")
    assert b'"job_released"' in first.close()
    second = JobLog(path, "j")
    second.info("job_received", attempt=2)
    second.info("job_finished")
    lines = [json.loads(line) for line in second.lines().decode().splitlines()]
    assert [(line["event"], line["level"], line["job_id"]) for line in lines] == [
        ("job_received", "info", "j"),
        ("job_finished", "info", "j"),
    ]
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == [
        "job_received",
        "job_released",
    ]
    second.discard()
    assert not path.exists()
    second.flush()
    assert not path.exists()


def test_job_log_reaches_the_file_only_when_flushed(tmp_path: Path) -> None:
    """A short job never touches the disk; a long one can be followed at each flush."""
    log = JobLog(tmp_path / "j.log", "j")
    log.info("batch_done", items=3)
    assert not (tmp_path / "j.log").exists()
    log.flush()
    log.info("batch_done", items=5)
    log.flush()
    lines = (tmp_path / "j.log").read_text().splitlines()
    assert [json.loads(line)["items"] for line in lines] == [3, 5]
    log.discard()


def test_a_suspect_is_fed_apart_once_the_others_items_are_back(tmp_path: Path) -> None:
    """A job that was in the failing work of a broken worker is fed only once no other
    job's items are inside the pipeline, and nothing else until its last result is in:
    if it breaks this worker too, it is the only suspect. Another job's item due to be
    fed again waits meanwhile, and the suspect's own retry does not wait behind it."""
    ledger = Ledger()
    plain = _held(ledger, 1, 3, tmp_path)
    suspect = ledger.receive(dataclasses.replace(_message(2), broke_workers=1))
    assert suspect is not None and suspect.suspect and not plain.suspect
    fed: queue.SimpleQueue[tuple[Job, int]] = queue.SimpleQueue()

    def feed() -> None:
        with contextlib.suppress(Closed):
            while True:
                fed.put(ledger.next_items(1)[0])

    def fed_within(timeout_s: float) -> tuple[Job, int] | None:
        try:
            return fed.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def back(job: Job, index: int, result: Result | None = None) -> None:
        ledger.back_from_pipeline(job.key)
        if result is None:
            ledger.retry_item(job, index, 0.0)
        else:
            ledger.record(job.key, index, result)

    assert ledger.next_items(1)[0] == (plain, 0)  # fed before the suspect came
    _admit(ledger, suspect, 2, tmp_path)
    threading.Thread(target=feed, daemon=True).start()
    assert fed_within(0.2) is None  # plain's item is inside: the suspect waits, others too
    back(plain, 0)  # to be fed again at once, but a suspect is held
    assert fed_within(1) == (suspect, 0)
    assert fed_within(1) == (suspect, 1)
    assert fed_within(0.2) is None  # the suspect's items are inside
    back(suspect, 0, DONE)
    back(suspect, 1)
    assert fed_within(1) == (suspect, 1)
    assert fed_within(0.2) is None
    back(suspect, 1, FAILED)
    assert suspect.state is JobState.FINISHING
    assert [fed_within(1) for _ in range(3)] == [(plain, 0), (plain, 1), (plain, 2)]
    ledger.close()


def test_two_jobs_of_one_id_never_share_a_local_log(tmp_path: Path) -> None:
    """A job id is the sender's (or a first message id anyone can forge): the local log
    is named by the output too, and one job's finish removes only its own file."""
    first = local_log_path(tmp_path, "j", "s3://bkt/out/a/")
    second = local_log_path(tmp_path, "j", "s3://bkt/out/b/")
    assert first != second and first == local_log_path(tmp_path, "j", "s3://bkt/out/a/")
    logs = [JobLog(path, "j") for path in (first, second)]
    for log in logs:
        log.info("job_received")
        log.flush()
    logs[0].discard()
    assert not first.exists() and second.read_text().count('"job_received"') == 1
