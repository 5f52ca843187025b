"""Planning a job into shards (`worker.sharding.planning`): what the planner holds while it
writes the shards' inputs files."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets.inputs import Input
from worker.jobs.checkpoints import RequestDigest
from worker.jobs.job import Job, JobSettled, JobState
from worker.jobs.plan import INPUTS_SUFFIX, Plan
from worker.message import parse_job_message
from worker.ports import ReceivedMessage, S3Location
from worker.sharding.planning import Planner


class _SlowInputsFiles(InMemoryBlobStore):
    """A store whose writes of shards' inputs files take a while, counting the inputs
    they hold once each is written."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs_written = 0
        self._count_lock = threading.Lock()

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        etag = super().put(location, data, content_type, **kwargs)
        if location.key.endswith(INPUTS_SUFFIX):
            time.sleep(0.005)
            with self._count_lock:
                self.inputs_written += data.count(b"\n")
        return etag


def _plan(job_id: str, items: int, shard_items: int) -> Plan:
    """A plan of `items` inputs in shards of `shard_items`."""
    return Plan(
        job_id=job_id,
        request_digest="0123456789abcdef",
        items=items,
        shard_items=shard_items,
        model={"name": "m"},
        params={},
        received_at=time.time(),
        attempt=1,
    )


def test_a_planner_holds_at_most_two_shards_inputs_while_it_writes_them(tmp_path: Path) -> None:
    """The inputs read but not yet in a written file are at most two shards' worth (one
    shard's file written while the next is read), however many shards there are and
    however slow the writes; every file is written, in order."""
    shard_items, shards = 50, 20
    blobs, source = _SlowInputsFiles(), InMemoryJobSource()
    uris = [f"s3://pix/{number:05d}.jpg" for number in range(shard_items * shards)]
    body = {"job_id": "big", "inputs": uris[:1], "output": "s3://bkt/out/big/"}
    spec = parse_job_message(json.dumps(body), frozenset())
    digest = RequestDigest()
    for uri in uris:
        digest.add(uri, None)
    model = {"name": "m", "version": "1", "digest": "d"}
    plan = Plan(
        job_id="big",
        request_digest=digest.hexdigest({}, model, "jsonl", None),
        items=len(uris),
        shard_items=shard_items,
        model=model,
        params={},
        received_at=time.time(),
        attempt=1,
    )
    most_held = 0

    def listed() -> Iterator[Input]:
        nonlocal most_held
        for number, uri in enumerate(uris, start=1):
            most_held = max(most_held, number - blobs.inputs_written)
            yield Input(uri)

    outcomes, progress = SimpleNamespace(ack=lambda job: None), SimpleNamespace(beat=lambda: None)
    lifecycle: Any = SimpleNamespace(outcomes=outcomes, progress=progress, ledger=None)
    job = Job("big", ReceivedMessage("m", json.dumps(body), "handle", 1))
    Planner(blobs, source, lifecycle).plan(job, spec, plan, listed)

    assert most_held <= 2 * shard_items, most_held
    assert blobs.inputs_written == len(uris) and len(source) == shards


def test_a_planner_whose_job_is_handed_back_writes_and_sends_no_more(tmp_path: Path) -> None:
    """The job's message is handed back (shutdown) while its shards' inputs files are
    written from its snapshot: the planner stops at the next file and sends no shard, so
    the continuation's shards are the only ones, where it wrote on to the last file
    (its listing, read again, was what stopped it once settled)."""
    blobs, source = _SlowInputsFiles(), InMemoryJobSource()
    uris = [f"s3://pix/{number:05d}.jpg" for number in range(40)]
    body = {"job_id": "stopped", "inputs": uris[:1], "output": "s3://bkt/out/stopped/"}
    spec = parse_job_message(json.dumps(body), frozenset())
    plan = _plan("stopped", len(uris), shard_items=4)
    job = Job("stopped", ReceivedMessage("m", json.dumps(body), "handle", 1))

    def listed() -> Iterator[Input]:
        for number, uri in enumerate(uris):
            if number == 8:
                job.state = JobState.RELEASED  # handed back meanwhile
            yield Input(uri)

    outcomes, progress = SimpleNamespace(ack=lambda job: None), SimpleNamespace(beat=lambda: None)
    lifecycle: Any = SimpleNamespace(outcomes=outcomes, progress=progress, ledger=None)
    with pytest.raises(JobSettled):
        Planner(blobs, source, lifecycle).plan(job, spec, plan, listed)
    assert blobs.inputs_written < len(uris) and len(source) == 0


def test_a_job_sent_again_while_another_run_of_it_has_its_shards_out_waits_for_that_run(
    tmp_path: Path,
) -> None:
    """The same job (the same inputs: the same plan) sent again with another request id
    while its first run's shards are out: its planner finds them sent by another
    message and hands its message over for later, sending nothing, where it was acked
    and never answered (job.json names the first run). A redelivery of the first run's
    own message goes on as before. Once the first run is merged (its shards' files
    gone), the continuation plans and sends the shards anew, with its request id."""
    blobs, source = InMemoryBlobStore(), InMemoryJobSource()
    uris = [f"s3://pix/{number}.jpg" for number in range(8)]
    body = {"job_id": "again", "inputs": uris, "output": "s3://bkt/out/again/"}
    plan = _plan("again", len(uris), shard_items=4)
    settled: list[tuple[str, str]] = []
    outcomes = SimpleNamespace(
        ack=lambda job: settled.append(("acked", job.message.job_message_id)),
        hand_over=lambda job, reason, delay_s: settled.append(
            ("handed over", job.message.job_message_id)
        ),
    )
    lifecycle: Any = SimpleNamespace(
        outcomes=outcomes, progress=SimpleNamespace(beat=lambda: None), ledger=None
    )
    planner = Planner(blobs, source, lifecycle)

    def deliver(request_id: str, message: ReceivedMessage) -> None:
        text = json.dumps({**body, "request_id": request_id})
        planner.plan(
            Job("again", dataclasses.replace(message, body=text)),
            parse_job_message(text, frozenset()),
            plan,
            lambda: iter(map(Input, uris)),
        )

    deliver("r-1", ReceivedMessage("first", "", "h1", 1))
    deliver("r-2", ReceivedMessage("second", "", "h2", 1))
    deliver("r-1", ReceivedMessage("first", "", "h3", 2))  # the first run's, again
    assert settled == [("acked", "first"), ("handed over", "second"), ("acked", "first")]
    assert len(source) == plan.shards
    for uri in [uri for uri in blobs.objects if "/shards/" in uri]:  # merged
        del blobs.objects[uri]
    deliver("r-2", ReceivedMessage("later", "", "h4", 1, first_message_id="second"))
    assert settled[-1] == ("acked", "second") and len(source) == 2 * plan.shards
    sent = [json.loads(message.body) for message in source.receive(10, 0, 60)]
    assert sorted(message["request_id"] for message in sent) == ["r-1", "r-1", "r-2", "r-2"]
