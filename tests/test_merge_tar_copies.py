"""The disk a sharded Parquet job's join claims (`worker.sharding.merging:JoinSpace`) is
of the budget tar copies claim too (--tar-disk-bytes): a tar shard gives its own tars'
copies back as it finishes, before its commit may merge its job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness import tar_of
from stages.synthetic import samples
from tests.support.in_process import planned
from worker.adapters.fakes import InMemoryBlobStore
from worker.datasets.arrays import ArrayFiles
from worker.datasets.disk import DiskBudget
from worker.datasets.tables import Tables
from worker.datasets.tars import TarCopies
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job, Result
from worker.jobs.joblog import JobLog
from worker.jobs.ledger import Ledger
from worker.jobs.outcomes import Lifecycle
from worker.jobs.plan import shard_body
from worker.loops.results import Finisher
from worker.message import TarMembers, parse_job_message
from worker.plugins.identity import ModelIdentity
from worker.ports import ReceivedMessage
from worker.sharding.merging import Written
from worker.telemetry.metrics import Metrics
from worker.telemetry.progress import Progress

TAR = "s3://bkt/tars/0.tar"
MODEL = ModelIdentity(name="m", version="1", digest="sha256:" + "0" * 64)


class _Shards:
    """Shards whose commit notes what the disk budget holds as it is made: a commit
    of a job's last shard merges the job, its join claiming that budget."""

    def __init__(self, disk: DiskBudget):
        self._disk = disk
        self.held_at_commit: list[int] = []

    def commit(self, job: Job, summary: dict[str, Any], outputs: list[Any]) -> Written:
        self.held_at_commit.append(self._disk.held_bytes)
        return Written()


class _Outcomes:
    def __init__(self) -> None:
        self.settled: list[tuple[Job, bool, bool]] = []

    def settle_written(self, job: Job, *, announced: bool, shards_left: bool = False) -> None:
        self.settled.append((job, announced, shards_left))


def test_a_tar_shard_gives_its_tars_copies_back_before_it_commits(tmp_path: Path) -> None:
    """A tar shard, every member's result in, holds its tar's copy of the disk budget
    until it finishes: it gives it back before its commit, which may merge its job, so
    the join finds the room the copy held, where the shard's own copy left a join no
    room on a budget that holds either, not both, and the job was handed back."""
    blobs = InMemoryBlobStore()
    images = [(f"{n}.png", data) for n, (_, data) in enumerate(samples(3, seed=9))]
    blobs.objects[TAR] = tar_of(images)
    spec, plan = planned(blobs, "copies", [TAR], MODEL.as_dict(), TarMembers(member_suffix=".png"))
    body = shard_body(spec, plan, 0)
    disk = DiskBudget(2**30)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 10, disk)
    members = copies.members([TAR], TarMembers(member_suffix=".png"))
    assert disk.held_bytes > 0
    job = Job("k", ReceivedMessage("m", body, "h", 1))
    job.plan, job.tar_copies, job.model = plan, copies, MODEL
    job.arrays = ArrayFiles(tmp_path / "arrays", len(members))
    ledger = Ledger()
    resumed = {n: Result(json.dumps({"index": n}).encode() + b"\n", False) for n in range(3)}
    log = JobLog(tmp_path / "job.log", "copies")
    ledger.admit(job, parse_job_message(body, frozenset()), [TAR] * 3, log, resumed)
    shards, outcomes = _Shards(disk), _Outcomes()
    lifecycle = Lifecycle(ledger, outcomes, Metrics(), Progress(3600.0))
    finisher = Finisher(
        blobs,
        Checkpoints(blobs, ledger),
        shards,
        Tables(2**20, 2**20),
        lifecycle,
        worker_info={},
        notify=[],
        capacity=1,
        device_hour_price=None,
    )
    finisher._finish(job)
    assert shards.held_at_commit == [0]
    assert outcomes.settled == [(job, True, False)]
