"""A sharded job whose merge can never be made (its shards' results files cannot be
joined) tells its producer so, in this process against the in-memory fakes: the
rejected.json a dead-lettered whole job leaves, which the client's wait answers at once."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.in_process import run_until_drained, sample_images
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client.handles import Job, JobRejected
from worker.ports import S3Location
from worker.sharding import claims

OUTPUT = "s3://bkt/out/unjoinable/"
BODY = {
    "job_id": "unjoinable",
    "request_id": "r-1",
    "output": OUTPUT,
    "format": "parquet",
    "shard_items": 2,
}
SHARD_0_RESULTS = re.compile(r"/shards/[0-9a-f]+/000000\.[^/]+\.parquet$")
# A client waits no longer than this for the answer a rejection gives at once.
WAIT_S = 20.0


class _FooterlessFirstShard(InMemoryBlobStore):
    """A store in which shard 0's Parquet results file loses its footer's end as it is
    written (its length kept): a file no merge can join, on every delivery."""

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        if SHARD_0_RESULTS.search(location.key):
            data = data[:-8] + b"12345678"
        return super().put(location, data, content_type, **kwargs)


class _RejectionsCounted(_FooterlessFirstShard):
    """The same store, counting the puts of the job's rejected.json."""

    def __init__(self) -> None:
        super().__init__()
        self.rejections_put = 0

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        if location.key.endswith("/rejected.json"):
            self.rejections_put += 1
        return super().put(location, data, content_type, **kwargs)


def _waited_for_rejection(blobs: InMemoryBlobStore) -> str:
    """The reason the client's wait gives, which it must give well within its timeout."""
    started = time.monotonic()
    with pytest.raises(JobRejected) as rejected:
        Job(blobs, OUTPUT, "unjoinable", "r-1").wait(timeout_s=WAIT_S, poll_s=0.1)
    assert time.monotonic() - started < WAIT_S / 2
    return rejected.value.reason


def test_a_merge_found_poison_leaves_the_reason_where_the_clients_wait_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge of the job finds its shards' files cannot be joined (shard 0's has no
    Parquet footer), whichever finds it first: the last shard's commit, dead-lettered at
    once (where it was released and dead-lettered at its next delivery), or the job's
    watch at its admission (then the shard finds the merge elsewhere and is acked).
    Each merge dead-lettered, the watch's always, writes a rejected.json with the
    job's ids and the reason under the output, so the client's wait raises
    `JobRejected` naming the file, where nothing was written and it waited out its
    timeout. (Merge claims run out in a second here, so that the job's watch merges
    soon after the committing shard's claim.)"""
    monkeypatch.setattr(claims, "MERGE_CLAIM_S", 1)
    source, blobs = InMemoryJobSource(), _RejectionsCounted()
    source.send(json.dumps({**BODY, "inputs": sample_images(blobs, 4)}))
    run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    [reason] = {why for _, why in source.dead_letters}
    assert "does not end as a Parquet file does" in reason
    # The watch ends only by merging the job: it is dead-lettered at its admission
    # whichever merged first, its rejected.json put as the shard's is.
    assert any('"watch"' in message.body for message, _ in source.dead_letters)
    assert blobs.rejections_put == len(source.dead_letters)
    for message, _ in source.dead_letters:
        if '"shard"' in message.body:  # dead-lettered by the finish that merged
            assert message.receive_count == 1
    rejection = dict(json.loads(blobs.objects[f"{OUTPUT}rejected.json"]))
    assert (rejection["job_id"], rejection["request_id"], rejection["reason"]) == (
        "unjoinable",
        "r-1",
        reason,
    )
    assert "000000." in _waited_for_rejection(blobs)
