"""A job's watch chain (`worker.sharding.stragglers`), driven on a clock of the test's
own: each watch message is taken as it falls due, as a worker takes it (acked, or given
back for later if the watch raises), and the shards' own messages are dropped (lost,
which is what watches are for)."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.in_process import planned
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets.tables import Tables
from worker.errors import TransientError
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Outcomes
from worker.jobs.plan import Commit, Plan, commit_file, shard_file, watch_body, watch_file
from worker.message import JobMessage, parse_job_message
from worker.ports import S3Location
from worker.sharding.merging import Merger
from worker.sharding.shards import Shards
from worker.sharding.stragglers import Stragglers

MODEL = {"name": "m", "version": "1", "digest": "d"}
RUN = "a0001-m"  # the committed shard's run
SHARD_S = 4.0  # the committed shard's time: a straggler after 8 s, watches 2 s apart before
RETRY_S = 1  # how long a watch that raised waits before it comes back


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class _Watched:
    """A planned job of three shards, shard 0 committed and 1 and 2 running elsewhere,
    and the parts of a worker that take its watches."""

    def __init__(self, clock: _Clock, source: InMemoryJobSource, blobs: InMemoryBlobStore):
        self.clock, self.source, self.blobs = clock, source, blobs
        self.spec, self.plan = planned(blobs, "watched", [f"s3://bkt/{n}" for n in range(6)], MODEL)
        self.commit(0, commit_file(self.spec, self.plan.request_digest, 0))
        for shard in (1, 2):
            self.put(shard, ".started", json.dumps({"at": clock.now, "held": False}).encode())
        self.blobs.objects[str(watch_file(self.spec, self.plan.request_digest))] = json.dumps(
            {"due": clock.now}
        ).encode()
        outcomes: Any = SimpleNamespace(ack=self._ack, retry_later=self._retry_later)
        # What the daemon decides, over the fake's SQS calls.
        outcomes.settle_written = functools.partial(Outcomes.settle_written, outcomes)
        lifecycle: Any = SimpleNamespace(outcomes=outcomes, progress=None)
        checkpoints = Checkpoints(blobs, Ledger())
        merger = Merger(
            blobs, checkpoints, Tables(2**20, 2**20), worker_info={}, device_hour_price=None
        )
        shards = Shards(blobs, source, checkpoints, lifecycle, merger)
        self.stragglers = Stragglers(
            blobs, source, shards, outcomes, announce_merged=_no_notices, lost_after_s=3600
        )
        self.duplicates: list[int] = []

    def commit(self, shard: int, marker: S3Location) -> None:
        """Shard `shard` committed (its run's files empty), its marker at `marker`."""
        files = {
            "results": [{"name": f"{shard:06d}.{RUN}.jsonl", "bytes": 0}],
            "log": {"name": f"{shard:06d}.{RUN}.log", "bytes": 0},
        }
        for name in (files["results"][0]["name"], files["log"]["name"]):
            self.put(shard, name.removeprefix(f"{shard:06d}"), b"")
        counts = {"succeeded": 2, "failed": 0, "resumed": 0, "attempt": 1, "device_s": 0.0}
        commit = Commit.model_validate(
            {"run": RUN, **files, **counts, "cancelled": False, "seconds": SHARD_S}
        )
        self.blobs.objects[str(marker)] = commit.model_dump_json().encode()

    def put(self, shard: int, suffix: str, data: bytes) -> None:
        self.blobs.objects[str(shard_file(self.spec, self.plan.request_digest, shard, suffix))] = (
            data
        )

    def send_watch(self, delay_s: int = 0) -> None:
        self.source.send(watch_body(self.spec, self.plan), delay_s=delay_s)

    def run_until(self, end_s: float) -> None:
        """Take every message as it falls due, the clock moving half a second at a time,
        for `end_s` seconds."""
        end = self.clock.now + end_s
        while self.clock.now < end:
            for message in self.source.receive(10, 0, 600):
                spec = parse_job_message(message.body, frozenset())
                job = Job(message.message_id, message)
                if spec.shard is not None:
                    self.duplicates.append(spec.shard.index)
                    self.source.ack(message.receipt_handle)  # lost
                    continue
                try:
                    self.stragglers.watch(job, spec)
                except TransientError:
                    self.source.release(message.receipt_handle, RETRY_S)
            self.clock.now += 0.5

    def watches_waiting(self) -> int:
        return len(self.source)

    def _ack(self, job: Job) -> bool:
        self.source.ack(job.message.receipt_handle)
        return True

    def _retry_later(self, job: Job, reason: str) -> None:
        self.source.release(job.message.receipt_handle, RETRY_S)


def _no_notices(spec: JobMessage, plan: Plan, merged: dict[str, Any] | None, job: Job) -> bool:
    return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr("time.time", clock)
    return clock


class _FailingDelayedSends(InMemoryJobSource):
    """A queue whose first `failures` delayed sends (a watch's) fail."""

    def __init__(self, clock: _Clock, failures: int) -> None:
        super().__init__(clock)
        self.failures = failures

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        if delay_s and self.failures:
            self.failures -= 1
            raise TransientError("SendMessageBatch failed (fake)")
        super().send_many(bodies, group, delay_s)


def test_a_watch_whose_next_watch_was_not_sent_comes_back_and_goes_on(clock: _Clock) -> None:
    """The watch's re-arming send fails: it comes back (given back for later) and still
    counts, where the marker it had named itself in was deleted and it took itself for
    superseded, ending the chain; so the running shards, whose messages are lost, are
    each duplicated once they run past a straggler's time, and a watch still waits."""
    watched = _Watched(clock, _FailingDelayedSends(clock, failures=1), InMemoryBlobStore())
    watched.send_watch()
    watched.run_until(30)
    assert sorted(watched.duplicates) == [1, 2]
    assert watched.watches_waiting() == 1


class _FailingMarks(InMemoryBlobStore):
    """A store whose first write of a `.duplicated` mark fails."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        if location.key.endswith(".duplicated") and self.failures:
            self.failures -= 1
            raise TransientError("PutObject failed (fake)")
        return super().put(location, data, content_type, **kwargs)


def test_a_watch_that_fails_to_mark_a_duplicate_sends_it_once(clock: _Clock) -> None:
    """The mark of a straggler's duplicate fails once: the watch comes back and sends it
    then, once, where it sent one on each try, marked or not."""
    watched = _Watched(clock, InMemoryJobSource(clock), _FailingMarks())
    clock.now += 60  # both running shards are stragglers at once
    watched.send_watch()
    watched.run_until(5)
    assert sorted(watched.duplicates) == [1, 2]


def test_two_watches_of_a_job_due_within_the_slack_become_one(clock: _Clock) -> None:
    """Two watch chains at once (a commit armed a sooner watch, the later one's message
    still comes), three seconds apart: the later finds the marker due past its slack and
    ends, where with watches two seconds apart both counted and re-armed in turn."""
    watched = _Watched(clock, InMemoryJobSource(clock), InMemoryBlobStore())
    watched.send_watch()
    watched.send_watch(delay_s=3)
    watched.run_until(60)
    assert watched.watches_waiting() == 1


def test_a_job_whose_shards_workers_from_before_the_commits_folder_committed_is_merged(
    clock: _Clock,
) -> None:
    """A rolling upgrade: shard 0's marker is in the commit markers' folder, shards 1
    and 2's beside their files, where workers from before the folder wrote them. The
    watch counts all three committed and merges the job, and what the shards left goes,
    markers of both kinds with it."""
    watched = _Watched(clock, InMemoryJobSource(clock), InMemoryBlobStore())
    for shard in (1, 2):
        watched.commit(
            shard, shard_file(watched.spec, watched.plan.request_digest, shard, ".commit")
        )
    watched.send_watch()
    watched.run_until(5)
    names = {uri.removeprefix("s3://bkt/out/watched/") for uri in watched.blobs.objects}
    assert "job.json" in names and not watched.duplicates
    assert not [name for name in names if name.startswith("shards/")]
