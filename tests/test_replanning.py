"""A planned job whose listing changes, whose plan is replaced, or which is merged while
one of its shards is admitted (`worker.sharding.planning`, `worker.loops.admission`),
in this process against the in-memory fakes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from tests.support.in_process import job_file, planned, run_until_drained, sample_images
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.datasets.tables import Tables
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.ledger import Ledger
from worker.jobs.plan import Plan, shard_body
from worker.message import parse_job_message
from worker.ports import S3Location
from worker.sharding.merging import Merger
from worker.sharding.shards import Shards


class _GrowingPrefix(InMemoryBlobStore):
    """A store whose prefix `img/` gains an object after each of its first `growths`
    listings (a prefix still receiving objects)."""

    def __init__(self, growths: int) -> None:
        super().__init__()
        self.growths = growths

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        yield from list(super().keys_under(prefix))
        if prefix.key == "img/" and self.growths:
            self.growths -= 1
            self.objects[f"s3://bkt/img/late-{self.growths}"] = self.objects["s3://bkt/img/0"]


def _send_prefix_job(source: InMemoryJobSource, job_id: str, shard_items: int) -> None:
    body = {
        "job_id": job_id,
        "inputs_prefix": "s3://bkt/img/",
        "output": f"s3://bkt/out/{job_id}/",
        "shard_items": shard_items,
    }
    source.send(json.dumps(body))


def test_a_prefix_that_grows_while_it_is_listed_is_planned_from_its_first_listing(
    tmp_path: Path,
) -> None:
    """The prefix gains an object after every listing: the job is planned from its one
    listing, kept on disk, and runs at once, where the second reading differed from the
    first on every delivery and the job was released each time (into the DLQ)."""
    source, blobs = InMemoryJobSource(), _GrowingPrefix(growths=3)
    sample_images(blobs, 5)
    _send_prefix_job(source, "growing", shard_items=2)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert not [entry for entry in logs if entry["event"] == "job_released"]
    summary = job_file(blobs, "growing", "job.json")
    assert (summary["status"], summary["items"], summary["shards"]["count"]) == ("succeeded", 5, 3)
    assert not source.dead_letters and not list(tmp_path.rglob("listing-*"))


class _SecondSendFails(_GrowingPrefix):
    """The prefix gains an object once listed; and the queue's second send of shards
    fails once (`source`)."""


class _SendFailsOnce(InMemoryJobSource):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("SendMessageBatch unreachable (fake)")
        super().send_many(bodies, group, delay_s)


def test_a_plan_whose_shards_were_sent_stands_when_the_listing_changes(tmp_path: Path) -> None:
    """The planner sends ten of twelve shards, then a send fails and the job's message
    comes back; the prefix gained an object meanwhile. The plan its first delivery sent
    shards of stands: the last two shards are sent, and the job ends as first listed,
    where the new listing replaced the plan and the ten shards sent were dead-lettered as
    another request's."""
    source, blobs = _SendFailsOnce(), _GrowingPrefix(growths=1)
    sample_images(blobs, 24)
    _send_prefix_job(source, "kept", shard_items=2)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert [entry["event"] for entry in logs].count("plan_kept") == 1
    summary = job_file(blobs, "kept", "job.json")
    assert (summary["status"], summary["items"], summary["shards"]["count"]) == (
        "succeeded",
        24,
        12,
    )
    assert not source.dead_letters


def _model(source: InMemoryJobSource, blobs: InMemoryBlobStore, tmp_path: Path) -> dict[str, Any]:
    """The worker's model identity, as a probe job's job.json gives it."""
    source.send(
        json.dumps(
            {"job_id": "probe", "inputs": ["s3://bkt/img/0"], "output": "s3://bkt/out/probe/"}
        )
    )
    run_until_drained(source, blobs, tmp_path)
    return dict(job_file(blobs, "probe", "job.json")["model"])


def _names_under(blobs: InMemoryBlobStore, prefix: str) -> list[str]:
    return sorted(uri for uri in blobs.objects if uri.startswith(prefix))


def test_shards_of_a_replaced_plan_are_acked_and_their_files_swept_at_merge(
    tmp_path: Path,
) -> None:
    """The job is sent again with other inputs while its first plan's shards wait: the
    new request's plan replaces it and runs, its merge sweeps what the first plan left
    under shards/, and the first plan's shard messages, coming later, are acked (they
    are no one's fault), where they were dead-lettered and their files stayed for ever."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 6)
    model = _model(source, blobs, tmp_path)
    spec, first = planned(blobs, "again", inputs[:4], model)
    blobs.objects[f"s3://bkt/out/again/shards/{first.request_digest}/000000.started"] = b"{}"
    source.send(
        json.dumps(
            {"job_id": "again", "inputs": inputs, "output": "s3://bkt/out/again/", "shard_items": 2}
        )
    )
    run_until_drained(source, blobs, tmp_path)
    summary = job_file(blobs, "again", "job.json")
    assert (summary["items"], summary["shards"]["count"]) == (6, 3)
    assert _names_under(blobs, "s3://bkt/out/again/shards/") == []

    for shard in range(first.shards):
        source.send(shard_body(spec, first, shard))
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [entry["event"] for entry in logs].count("shard_superseded") == 2
    assert not source.dead_letters and len(source) == 0
    assert _names_under(blobs, "s3://bkt/out/again/shards/") == []


class _MergedUnseen(InMemoryBlobStore):
    """A store whose first listing of `out/<job>/` does not show job.json: the shard
    admitted looks before the merge writes it, and reads its inputs after the merge
    removed them."""

    def __init__(self) -> None:
        super().__init__()
        self.hide: str | None = None

    def objects_under(self, location: S3Location) -> dict[str, str]:
        listing = super().objects_under(location)
        if self.hide is not None and location.key == self.hide:
            self.hide = None
            listing.pop("job.json", None)
        return listing


def _merged_job(
    source: InMemoryJobSource, blobs: InMemoryBlobStore, tmp_path: Path, job_id: str
) -> tuple[Any, Plan]:
    inputs = sample_images(blobs, 4)
    body = {
        "job_id": job_id,
        "inputs": inputs,
        "output": f"s3://bkt/out/{job_id}/",
        "shard_items": 2,
    }
    source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path)
    plan = Plan.model_validate_json(blobs.objects[f"s3://bkt/out/{job_id}/plan.json"])
    spec = parse_job_message(json.dumps({**body, "shard_items": None}), frozenset())
    return spec, plan


def test_a_shard_admitted_while_its_job_is_merged_is_acked_not_dead_lettered(
    tmp_path: Path,
) -> None:
    """A straggler's duplicate finds no job.json, then its inputs gone with the merge:
    the job is looked at again and the shard acked, where it was dead-lettered as
    "manifest missing" and left a `.dead` note and a watch."""
    source, blobs = InMemoryJobSource(), _MergedUnseen()
    spec, plan = _merged_job(source, blobs, tmp_path, "merging")
    blobs.hide = "out/merging/"
    source.send(shard_body(spec, plan, 0))
    run_until_drained(source, blobs, tmp_path)
    assert not source.dead_letters and len(source) == 0
    assert _names_under(blobs, "s3://bkt/out/merging/shards/") == []


def test_a_run_noted_started_after_its_job_is_merged_leaves_no_note(tmp_path: Path) -> None:
    """A shard admitted just before its job's merge notes its start after the merge
    removed the shards' files: the note is taken back, where it stayed for ever."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    spec, plan = _merged_job(source, blobs, tmp_path, "late")
    shard_spec = parse_job_message(shard_body(spec, plan, 1), frozenset())
    checkpoints = Checkpoints(blobs, Ledger())
    merger = Merger(
        blobs, checkpoints, Tables(2**20, 2**20), worker_info={}, device_hour_price=None
    )
    lifecycle: Any = type("Lifecycle", (), {"outcomes": None, "progress": None})
    Shards(blobs, source, checkpoints, lifecycle, merger).started(shard_spec, plan, held=False)
    assert _names_under(blobs, "s3://bkt/out/late/shards/") == []
