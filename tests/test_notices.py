"""What a job's producer is told once the job ends (`worker.loops.notices`), in this
process against the in-memory fakes: a dead-lettered job's rejected.json, and a
progress.json write that gives up says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from tests.support.in_process import job_file, planned, run_until_drained, sample_images
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client.handles import Job as ClientJob
from worker.client.handles import Phase
from worker.datasets.tables import Tables
from worker.errors import PreconditionFailed
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.job import Job
from worker.jobs.ledger import Ledger
from worker.jobs.plan import shard_body
from worker.loops.notices import Notices, rejected_at
from worker.message import parse_job_message
from worker.ports import ReceivedMessage, S3Location
from worker.sharding.merging import Merger
from worker.sharding.shards import Shards
from worker.telemetry.metrics import Metrics


def _rejection(blobs: InMemoryBlobStore, output: str) -> dict[str, Any] | None:
    data = blobs.objects.get(f"{output}rejected.json")
    return None if data is None else dict(json.loads(data))


def test_a_dead_lettered_job_with_an_output_it_may_have_says_why_there(tmp_path: Path) -> None:
    """Poison whose output is valid and in an allowed bucket (an input bucket not
    allowed, a field of the wrong type, a job that broke three workers) gets a
    rejected.json with its ids and the reason before its message goes to the DLQ; one
    whose output is in another bucket, or that is not JSON, or a shard, gets none."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 1)
    source.send(
        json.dumps(
            {
                "job_id": "outside",
                "request_id": "r-1",
                "inputs": ["s3://elsewhere/a.jpg"],
                "output": "s3://bkt/out/outside/",
            }
        )
    )
    source.send(json.dumps({"inputs": inputs, "output": "s3://bkt/out/typed/", "shard_items": "x"}))
    broke = {"job_id": "breaks", "inputs": inputs, "output": "s3://bkt/out/breaks/"}
    source.send(json.dumps(broke), broke_workers=3, breakage="CUDA error")
    source.send(json.dumps({"job_id": "theirs", "inputs": inputs, "output": "s3://other/out/"}))
    source.send("not json")
    run_until_drained(source, blobs, tmp_path, allowed_buckets=["bkt"])

    assert len(source.dead_letters) == 5
    outside = _rejection(blobs, "s3://bkt/out/outside/")
    assert outside is not None
    assert (outside["job_id"], outside["request_id"]) == ("outside", "r-1")
    assert "elsewhere" in outside["reason"] and outside["rejected_at"].startswith("20")
    typed = _rejection(blobs, "s3://bkt/out/typed/")
    assert typed is not None and typed["job_id"] is None and "shard_items" in typed["reason"]
    breaks = _rejection(blobs, "s3://bkt/out/breaks/")
    assert breaks is not None and "3 workers broke" in breaks["reason"]
    assert not [uri for uri in blobs.objects if uri.endswith("rejected.json")][3:]
    assert "s3://other/out/rejected.json" not in blobs.objects


def test_a_shard_dead_lettered_writes_no_rejection(tmp_path: Path) -> None:
    """A shard's death is its `.dead` note and its job's stall, not the job's rejection:
    the rest of the job may still run, and a redriven shard ends it whole."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    probe = {"job_id": "probe", "inputs": inputs[:1], "output": "s3://bkt/out/probe/"}
    source.send(json.dumps(probe))  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    spec, plan = planned(blobs, "dying", inputs, job_file(blobs, "probe", "job.json")["model"])
    for shard in range(plan.shards):
        source.send(shard_body(spec, plan, shard), broke_workers=3, breakage="CUDA error")
    run_until_drained(source, blobs, tmp_path)
    assert len(source.dead_letters) == 2 and _rejection(blobs, "s3://bkt/out/dying/") is None


class _Contended(InMemoryBlobStore):
    """A store on which every conditional write of progress.json is beaten."""

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        if location.key.endswith("progress.json"):
            raise PreconditionFailed("another shard wrote it first (fake)")
        return super().put(location, data, content_type, **kwargs)


def test_a_shards_count_that_is_beaten_every_try_is_logged(tmp_path: Path) -> None:
    """Every try of a shard's progress.json write is beaten by another shard's: it gives
    up, saying so, where it gave up silently and the counts lagged unseen."""
    blobs = _Contended()
    spec, plan = planned(blobs, "busy", ["s3://bkt/a", "s3://bkt/b"], {"name": "m"})
    checkpoints = Checkpoints(blobs, Ledger())
    merger = Merger(
        blobs, checkpoints, Tables(2**20, 2**20), worker_info={}, device_hour_price=None
    )
    lifecycle: Any = type("Lifecycle", (), {"outcomes": None, "progress": None})
    shards = Shards(blobs, InMemoryJobSource(), checkpoints, lifecycle, merger)
    shard_spec = parse_job_message(shard_body(spec, plan, 0), frozenset())
    job = Job("k", ReceivedMessage("m", shard_body(spec, plan, 0), "h", 1))
    job.spec, job.plan = shard_spec, plan
    with capture_logs() as logs:
        shards.report(job)
    assert [entry["event"] for entry in logs] == ["progress_not_updated"]


class _WatchedAsJobJsonIsWritten(InMemoryBlobStore):
    """A store that notes, as each job.json is written, what the client's `status`
    of that run (its ids) says of it just before."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: dict[str, Phase] = {}

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        if location.key.endswith("/job.json"):
            output = f"s3://{location.bucket}/{location.key.removesuffix('job.json')}"
            ids = json.loads(data)
            handle = ClientJob(self, output, ids["job_id"], ids["request_id"])
            self.phases[output] = handle.status().phase
        return super().put(location, data, content_type, **kwargs)


def test_a_new_run_of_a_rejected_request_withdraws_its_rejection(tmp_path: Path) -> None:
    """A job redriven after its rejection (the same request: its job id and request
    id) runs again: its old rejected.json is removed as it is admitted, so the client's
    wait follows the new run (running until its job.json), where it raised
    `JobRejected` at once with the old reason. A rejection of another request of the
    same job stays: it is that request's answer."""
    blobs = _WatchedAsJobJsonIsWritten()
    source, inputs = InMemoryJobSource(), sample_images(blobs, 1)
    old = {"reason": "a setting since changed", "rejected_at": "2026-01-01T00:00:00+00:00"}
    for job_id, rejected_request in (("redriven", "r-1"), ("sent-again", "r-0")):
        output = f"s3://bkt/out/{job_id}/"
        rejection = {**old, "job_id": job_id, "request_id": rejected_request}
        blobs.objects[f"{output}rejected.json"] = json.dumps(rejection).encode()
        body = {"job_id": job_id, "request_id": "r-1", "inputs": inputs, "output": output}
        source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path)

    assert blobs.phases["s3://bkt/out/redriven/"] is not Phase.REJECTED
    assert _rejection(blobs, "s3://bkt/out/redriven/") is None
    assert ClientJob(blobs, "s3://bkt/out/redriven/", "redriven", "r-1").wait(5)["items"] == 1
    kept = _rejection(blobs, "s3://bkt/out/sent-again/")
    assert kept is not None and kept["request_id"] == "r-0"


class _SeesRejectionAsShardsAreSent(InMemoryJobSource):
    """A queue that notes, as each batch of shards is sent, whether the job's
    rejected.json is still there."""

    def __init__(self, blobs: InMemoryBlobStore, output: str) -> None:
        super().__init__()
        self._blobs, self._output = blobs, output
        self.rejected_as_sent: list[bool] = []

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        self.rejected_as_sent.append(_rejection(self._blobs, self._output) is not None)
        super().send_many(bodies, group, delay_s)


def test_a_new_run_of_a_rejected_request_too_big_for_one_worker_withdraws_it_as_planned(
    tmp_path: Path,
) -> None:
    """A rejected job redriven whose inputs are over the shard size is planned, not
    admitted: its planner withdraws the old rejected.json before it sends the shards,
    so the client follows the new run from then, not once a shard is admitted."""
    blobs = InMemoryBlobStore()
    output = "s3://bkt/out/planned/"
    source = _SeesRejectionAsShardsAreSent(blobs, output)
    rejection = {"reason": "a setting since changed", "rejected_at": "2026-01-01T00:00:00+00:00"}
    ids = {"job_id": "planned", "request_id": "r-1"}
    blobs.objects[f"{output}rejected.json"] = json.dumps({**rejection, **ids}).encode()
    source.send(json.dumps({**ids, "inputs": sample_images(blobs, 3), "output": output}))
    run_until_drained(source, blobs, tmp_path, shard_items=2)

    assert source.rejected_as_sent and not any(source.rejected_as_sent)
    assert job_file(blobs, "planned", "job.json")["items"] == 3


def test_a_job_json_merged_for_a_rejected_request_withdraws_its_rejection() -> None:
    """A run of a rejected request that was never admitted as one (its watch redriven,
    which merges the job) withdraws the old rejected.json as its job.json is
    announced, at the latest."""
    blobs = InMemoryBlobStore()
    spec, plan = planned(blobs, "watched", ["s3://bkt/a"], {"name": "m"})
    rejection = {"job_id": "watched", "request_id": spec.request_id, "reason": "r"}
    blobs.objects[f"{spec.output}rejected.json"] = json.dumps(rejection).encode()
    ledger = Ledger()
    watch = ledger.receive(ReceivedMessage("m-1", "{}", "m-1#handle", 1))
    assert watch is not None
    notices = Notices(blobs, Checkpoints(blobs, ledger), Metrics(), notify=[])
    finished = {"job_id": "watched", "status": "succeeded", "items": 1, "duration_s": 1.0}
    assert notices.merged(spec, plan, finished, watch)
    assert _rejection(blobs, spec.output) is None


class _RejectedMeanwhile(InMemoryBlobStore):
    """A store where, as the job's input is first read (after its admission), a delivery
    of the same request beside this one leaves a rejected.json under its output."""

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        if location.key.startswith("img/") and "meanwhile" not in self.__dict__:
            self.meanwhile = True
            rejection = {"job_id": "j", "request_id": "r-1", "reason": "r", "rejected_at": "t"}
            self.objects["s3://bkt/out/j/rejected.json"] = json.dumps(rejection).encode()
        return super().get(location, *args, **kwargs)


def test_a_job_that_writes_its_job_json_withdraws_a_rejection_left_while_it_ran(
    tmp_path: Path,
) -> None:
    """A rejection of the request written after the run was admitted (by a delivery
    beside it) goes as the run writes its job.json: the job is done."""
    blobs = _RejectedMeanwhile()
    source, inputs = InMemoryJobSource(), sample_images(blobs, 1)
    body = {"job_id": "j", "request_id": "r-1", "inputs": inputs, "output": "s3://bkt/out/j/"}
    source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path)
    assert blobs.meanwhile
    assert job_file(blobs, "j", "job.json")["status"] == "succeeded"
    assert _rejection(blobs, "s3://bkt/out/j/") is None


def test_a_rejection_written_since_a_run_came_is_its_own_and_stays() -> None:
    """A run of the request admitted withdraws a rejection written before its delivery
    came, not one written since: that is this run's, by a delivery of the job beside it
    (its last shard's merge found poison), and the producer's only answer."""
    blobs = InMemoryBlobStore()
    output = "s3://bkt/out/raced/"
    spec = parse_job_message(
        json.dumps(
            {"job_id": "raced", "request_id": "r-1", "inputs": ["s3://bkt/a"], "output": output}
        ),
        frozenset(),
    )
    notices = Notices(blobs, Checkpoints(blobs, Ledger()), Metrics(), notify=[])
    notices.rejected(
        S3Location.parse(output), json.dumps({"job_id": "raced", "request_id": "r-1"}), "poison"
    )
    written = rejected_at(_rejection(blobs, output) or {})
    notices.withdraw_rejection(spec, since=written - 60)  # the run came a minute before
    assert _rejection(blobs, output) is not None
    notices.withdraw_rejection(spec, since=written + 60)  # it came a minute after
    assert _rejection(blobs, output) is None
