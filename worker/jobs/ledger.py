"""The ledger: the one record of every job this daemon holds, and each job's lifecycle.

A job's life is a small state machine (`JobState`, `TRANSITIONS`; docs/jobs.md draws
it, and a test holds that drawing to this table). Every part of the daemon asks the
ledger for a transition instead of flipping flags, one method per transition. A settled
job stays in the ledger until its SQS call has returned (`forget`), so the daemon is not
idle, nor `--drain` done, while a release is still on its way.

A suspect (a job that was in the failing work of a worker that broke) is fed apart:
once nothing else is inside the pipeline, and nothing else until its last item is back,
so that if it breaks this worker too, no other job is in the failing work.

Settling is a race that one caller wins (the finisher's ack against shutdown's release,
say): the others get None. Any move the table does not allow is a bug, and raises
`IllegalTransition`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from worker.engine.channel import Closed
from worker.jobs.job import FEEDABLE, TRANSITIONS, Job, JobState, Result
from worker.jobs.joblog import JobLog
from worker.message import JobMessage
from worker.ports import ReceivedMessage

NOTHING_RESUMED: Mapping[int, Result] = MappingProxyType({})


class IllegalTransition(RuntimeError):
    """A move the lifecycle does not allow: a bug in the daemon, not a fault outside it."""


class Ledger:
    """Jobs held by this daemon, keyed by delivery; every method is thread-safe."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._by_message: dict[str, Job] = {}  # unsettled jobs only
        self._feeding: deque[Job] = deque()  # jobs with items not yet fed, round robin
        self._again: list[tuple[float, int, Job, int]] = []  # (due, tie-break, job, index)
        self._changed = threading.Condition(threading.RLock())
        self._closed = False
        self._deliveries = itertools.count(1)
        # Kept as a count: the intake asks after every change, with hundreds of jobs held.
        self._outstanding = 0
        self._recorded = 0  # items whose results were filed, ever
        # Items fed and not yet back, by job key: counted until they come back, whether
        # their job is still held or not.
        self._inside: Counter[str] = Counter()
        # Of those, how many are background ones (`Job.background`), at most
        # `_background_room`, and the keys of their jobs.
        self._background_inside = 0
        self._background_keys: set[str] = set()
        self._background_room: int | None = None
        self._suspects: set[Job] = set()  # feedable ones
        self._shards = 0  # unsettled jobs that are shards of a planned job
        self._tar_shards = 0  # of which, shards of tars
        # Shards with items to feed, in the order admitted: fed one after another (a tar
        # shard taken while another runs, to copy its tars meanwhile, waits its turn).
        self._shard_turns: deque[Job] = deque()
        # Unsettled jobs, other than shards, not fed whole yet (admitted or not).
        self._unfed_jobs: set[str] = set()
        self._apart: Job | None = None  # the suspect being fed, apart from the others

    def __len__(self) -> int:
        """Jobs held, settling ones included."""
        with self._changed:
            return len(self._jobs)

    # Transitions -------------------------------------------------------------

    def receive(self, message: ReceivedMessage, *, seated: bool = True) -> Job | None:
        """Hold a message just received (RECEIVED); None once the ledger is closed.
        `seated`: until it is known to be a shard, it counts as a job not fed whole
        (`seat_free`)."""
        with self._changed:
            if self._closed:
                return None
            job = Job(f"{message.message_id}#{next(self._deliveries)}", message)
            self._jobs[job.key] = job
            self._by_message[message.message_id] = job
            if seated:
                self._unfed_jobs.add(job.key)
            self._changed.notify_all()
            return job

    def admit(
        self,
        job: Job,
        spec: JobMessage,
        inputs: list[str],
        log: JobLog,
        resumed: Mapping[int, Result] = NOTHING_RESUMED,
        *,
        cancelled: bool = False,
    ) -> bool:
        """RECEIVED -> ADMITTED: the message is valid; its items not in `resumed` (results
        an earlier delivery checkpointed) may be fed. With none left, or `cancelled`, it
        is FINISHING at once. False if it was settled meanwhile (released by shutdown
        while it was being validated)."""
        with self._changed:
            if job.settled:
                return False
            self._move(job, JobState.ADMITTED)
            job.spec, job.inputs, job.log = spec, inputs, log
            job.job_id = spec.job_id or job.message.job_message_id
            job.results = [None] * len(inputs)
            for index, result in resumed.items():
                job.results[index] = result
                job.failed += result.failed
            job.resumed = len(resumed)
            job.succeeded = job.resumed - job.failed
            job.cancelled = cancelled
            self._shards += job.plan is not None
            self._tar_shards += job.plan is not None and job.plan.tar is not None
            job.unfed = 0 if cancelled else job.outstanding_items
            if job.plan is not None or not job.unfed:
                self._unfed_jobs.discard(job.key)
            if job.plan is not None and job.unfed:
                self._shard_turns.append(job)
            if job.unfed:
                self._outstanding += job.unfed
                self._feeding.append(job)
            else:
                self._move(job, JobState.FINISHING)
            self._changed.notify_all()
            return True

    def cancel(self, job: Job) -> bool:
        """ADMITTED | RUNNING -> FINISHING: stop feeding it; results still in the pipeline
        are dropped. False if it is finishing or settled already."""
        with self._changed:
            if job.state not in FEEDABLE:
                return False
            self._outstanding -= job.outstanding_items
            self._unfed_jobs.discard(job.key)
            self._end_turn(job)
            job.cancelled = True
            self._move(job, JobState.FINISHING)
            self._changed.notify_all()
            return True

    def next_items(self, most: int) -> list[tuple[Job, int]]:
        """The next items to feed, up to `most`, in turn: one due to be fed again, else
        the next of the jobs in turn, so a small job is not stuck behind a big one; a
        job moves ADMITTED -> RUNNING with its first item. Waits for one; raises
        `Closed` once closed."""
        picked: list[tuple[Job, int]] = []
        with self._changed:
            while not self._closed:
                while len(picked) < most and (pick := self._pick()) is not None:
                    job = pick[0]
                    self._inside[job.key] += 1
                    if job.background:
                        self._background_inside += 1
                        self._background_keys.add(job.key)
                    picked.append(pick)
                if picked:
                    return picked
                self._changed.wait(self._next_due_in_s())
            raise Closed

    def _pick(self) -> tuple[Job, int] | None:
        """The next item `next_items` may feed now, if any."""
        now = time.monotonic()
        held_back = []  # items due again whose job may not be fed now (a suspect is)
        picked = None
        while picked is None and self._again and self._again[0][0] <= now:
            entry = heapq.heappop(self._again)
            job = entry[2]
            if job.state is not JobState.RUNNING:
                continue
            if self._may_feed(job):
                picked = job, entry[3]
            else:
                held_back.append(entry)
        for entry in held_back:
            heapq.heappush(self._again, entry)
        if picked is not None:
            return picked
        for _ in range(len(self._feeding)):
            job = self._feeding.popleft()
            if job.state not in FEEDABLE:
                continue  # released while it waited for its turn
            if not self._may_feed(job) or not self._has_turn(job):
                self._feeding.append(job)
                continue
            if job.state is JobState.ADMITTED:
                self._move(job, JobState.RUNNING)
            return job, self._feed_next(job)
        return None

    def _feed_next(self, job: Job) -> int:
        """The index of the job's next item, counted fed; the job back in turn if it has
        more."""
        while job.results[job.fed] is not None:  # resumed from a checkpoint
            job.fed += 1
        index = job.fed
        job.fed += 1
        job.unfed -= 1
        if job.unfed:
            self._feeding.append(job)
        elif job.key in self._unfed_jobs:
            self._unfed_jobs.discard(job.key)
            self._changed.notify_all()  # the jobs lane may take one more
        else:
            self._end_turn(job)
        return index

    def _has_turn(self, job: Job) -> bool:
        """Whether the job may be fed now as far as the order of shards goes (a suspect
        fed apart may: the others wait for it)."""
        if job.plan is None or job is self._apart or not self._shard_turns:
            return True
        return self._shard_turns[0] is job

    def _end_turn(self, job: Job) -> None:
        """The shard is fed whole, or settled: the next shard's turn."""
        if job in self._shard_turns:
            self._shard_turns.remove(job)
            self._changed.notify_all()

    def _next_due_in_s(self) -> float | None:
        """How long until an item is due to be fed again (None: none is); one that is due
        but held back waits for a change, not for a time."""
        now = time.monotonic()
        future = [due for due, *_ in self._again if due > now]
        return min(future) - now if future else None

    def bound_background(self, items: int | None) -> None:
        """Feed at most `items` background items at a time (None: any number), so that
        no stage is full of background work when an urgent item comes: the pipeline's
        room less what it keeps for urgent ones (`Pipeline.background_room`)."""
        with self._changed:
            self._background_room = items
            self._changed.notify_all()

    def _may_feed(self, job: Job) -> bool:
        """Whether the job's items may go into the pipeline now: background ones while
        there is room for them; while a suspect is held, only its own, and those only
        once the others' are all back."""
        room = self._background_room
        if job.background and room is not None and self._background_inside >= room:
            return False
        if self._apart is None:
            if not self._suspects:
                return True
            suspect = next(iter(self._suspects))
            others_inside = self._inside.total() - self._inside[suspect.key]
            if job is not suspect or others_inside:
                return False
            self._apart = suspect
        return job is self._apart

    def back_from_pipeline(self, *keys: str) -> None:
        """Items the feeder gave out came back, of these jobs' keys (one for each; the
        jobs may be settled by now)."""
        with self._changed:
            room_made = False
            for key in keys:
                self._inside[key] -= 1
                if self._inside[key] <= 0:
                    del self._inside[key]
                if key in self._background_keys:
                    self._background_inside -= 1
                    room_made |= self._background_inside + 1 == self._background_room
                    if key not in self._inside:
                        self._background_keys.discard(key)
            # A suspect waits for the others' items to be back, background work for room.
            if self._suspects or room_made:
                self._changed.notify_all()

    def retry_item(self, job: Job, index: int, delay_s: float) -> None:
        """Feed a running job's item again after `delay_s`: its input could not be read
        for now. Its result is still outstanding."""
        with self._changed:
            if job.state is not JobState.RUNNING:
                return
            job.item_retries[index] = job.item_retries.get(index, 0) + 1
            due = time.monotonic() + delay_s
            heapq.heappush(self._again, (due, next(self._deliveries), job, index))
            self._changed.notify_all()

    def record(self, key: str, index: int, result: Result) -> Job | None:
        """File one item's result; the job if that was its last (RUNNING -> FINISHING).
        A result for a job settled meanwhile is dropped."""
        with self._changed:
            job = self._jobs.get(key)
            if job is None or job.state is not JobState.RUNNING:
                return None
            if job.results[index] is not None:
                raise ValueError(f"job {job.job_id}: result {index} recorded twice")
            job.results[index] = result
            self._recorded += 1
            job.unsaved.append(index)
            self._outstanding -= 1
            if result.failed:
                job.failed += 1
            else:
                job.succeeded += 1
            complete = job.finished_items == len(job.inputs)
            if complete:
                self._move(job, JobState.FINISHING)
            self._changed.notify_all()
            return job if complete else None

    def ack(self, job: Job) -> bool:
        """FINISHING -> ACKED: its outputs are written. False if settled meanwhile."""
        return self._settle(job, JobState.ACKED)

    def supersede(self, job: Job) -> bool:
        """ADMITTED | RUNNING -> SUPERSEDED: a continuation of the job (another message)
        runs it, so this message is deleted unfinished. False if it is finishing (its
        last result came while the continuation was being looked for: its outputs are
        fenced against the continuation's) or settled meanwhile."""
        with self._changed:
            if job.state not in FEEDABLE:
                return False
            return self._settle(job, JobState.SUPERSEDED)

    def release(self, job: Job, delay_s: int = 0) -> bool:
        """-> RELEASED: hand it back to the queue unfinished, visible again after
        `delay_s`. False if settled already."""
        with self._changed:
            released = self._settle(job, JobState.RELEASED)
            if released:
                job.release_delay_s = delay_s
            return released

    def take_unsaved(self, job: Job) -> list[tuple[int, Result]]:
        """The results recorded since the last call, for a checkpoint."""
        with self._changed:
            indices, job.unsaved = job.unsaved, []
            return [(index, result) for index in indices if (result := job.results[index])]

    def keep_unsaved(self, job: Job, indices: list[int]) -> None:
        """Results taken for a checkpoint that could not be written: due for the next."""
        with self._changed:
            job.unsaved.extend(indices)

    def dead_letter(self, job: Job) -> bool:
        """RECEIVED | FINISHING -> DEAD_LETTERED: a poison message, or one whose results
        cannot be written. False if settled already."""
        return self._settle(job, JobState.DEAD_LETTERED)

    def forget(self, job: Job) -> None:
        """Drop a settled job, once its SQS call has returned."""
        with self._changed:
            if not job.settled:
                raise IllegalTransition(f"job {job.job_id} is {job.state}, not settled")
            self._jobs.pop(job.key, None)
            self._changed.notify_all()

    def _settle(self, job: Job, state: JobState) -> bool:
        with self._changed:
            if job.settled:
                return False
            was_feedable = job.state in FEEDABLE
            self._move(job, state)
            if was_feedable:
                self._outstanding -= job.outstanding_items
            self._shards -= job.plan is not None
            self._tar_shards -= job.plan is not None and job.plan.tar is not None
            self._unfed_jobs.discard(job.key)
            self._end_turn(job)
            if self._by_message.get(job.message.message_id) is job:
                del self._by_message[job.message.message_id]
            self._changed.notify_all()
            return True

    def _move(self, job: Job, state: JobState) -> None:
        if state not in TRANSITIONS.get(job.state, frozenset()):
            raise IllegalTransition(f"job {job.job_id}: {job.state} -> {state} is not allowed")
        if job.state in FEEDABLE and state not in FEEDABLE:
            self._suspects.discard(job)
            if self._apart is job:
                self._apart = None
        elif state is JobState.ADMITTED and job.suspect:
            self._suspects.add(job)
        job.state = state

    # Leases ------------------------------------------------------------------

    def adopt_redelivery(self, message: ReceivedMessage) -> bool:
        """A new delivery of a message this daemon still works on (its lease ran out
        unnoticed): keep working under the new receipt handle. False if not held."""
        with self._changed:
            job = self._by_message.get(message.message_id)
            if job is None:
                return False
            job.receipt_handle, job.lease_lost = message.receipt_handle, False
            return True

    def leases(self) -> dict[str, str]:
        """Receipt handle by job key, for every unsettled job whose lease is still ours."""
        with self._changed:
            return {
                key: job.receipt_handle
                for key, job in self._jobs.items()
                if not (job.lease_lost or job.settled)
            }

    def mark_lease_lost(self, key: str) -> Job | None:
        with self._changed:
            job = self._jobs.get(key)
            if job is not None:
                job.lease_lost = True
            return job

    # Reading -----------------------------------------------------------------

    def get(self, key: str) -> Job | None:
        with self._changed:
            return self._jobs.get(key)

    def get_all(self, keys: Iterable[str]) -> list[Job | None]:
        """`get` of each key, under one lock."""
        with self._changed:
            return [self._jobs.get(key) for key in keys]

    def unsettled(self) -> list[Job]:
        with self._changed:
            return [job for job in self._jobs.values() if not job.settled]

    def at_work(self) -> frozenset[str]:
        """Keys of the jobs work is being done on: with items inside the pipeline, or
        their outputs being written. A job still being admitted (planned, its tars
        copied) is not among them: a stall of the pipeline is never its doing."""
        with self._changed:
            finishing = {key for key, job in self._jobs.items() if job.state is JobState.FINISHING}
            return frozenset(self._inside.keys() | finishing)

    def shards_held(self) -> int:
        """How many unsettled jobs are shards of a planned job."""
        with self._changed:
            return self._shards

    def waits_turn(self, job: Job) -> bool:
        """Whether the shard waits for another held here to be fed whole first."""
        with self._changed:
            return job in self._shard_turns and self._shard_turns[0] is not job

    def tar_shards_held(self) -> int:
        """How many unsettled jobs are shards of a planned job of tars."""
        with self._changed:
            return self._tar_shards

    def seat_free(self) -> bool:
        """Whether every unsettled job that is not a shard is fed whole (`Intake`'s jobs
        lane takes one more while the pipeline is full, but not a second before)."""
        with self._changed:
            return not self._unfed_jobs

    def outstanding_items(self) -> int:
        """Items of unsettled jobs not yet back from the pipeline (fed or not)."""
        with self._changed:
            return self._outstanding

    def items_recorded(self) -> int:
        """Items whose results were filed since the daemon started."""
        with self._changed:
            return self._recorded

    def close(self) -> None:
        """Refuse new messages and stop the feeder: shutdown's list of jobs is final."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until `predicate()` holds (checked on every change or `wake`)."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)

    def wake(self) -> None:
        """Make waiters re-check their predicate (after an outside event, like a signal)."""
        with self._changed:
            self._changed.notify_all()
