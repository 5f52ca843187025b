"""Senders cannot exhaust a worker: the hostile inputs of the review of 2026-11-26 (H4,
H5 and H6), sent with boto3 beside an ordinary job to a daemon subprocess against the
moto server, are each dead-lettered naming the limit they pass (or, a huge `cancel`
under a job's output, honoured unread), the ordinary job runs, and the daemon's memory
stays that of an idle daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.harness import tar_of
from bench.processes import peak_rss, tree_rss_mb
from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args
from tests.support.hostile import gzipped_rows, megabyte_uri, parquet_rows, tar_of_empty_members
from tests.support.jobs import assert_complete, job_output, send_jobs, upload
from worker.demo import upload_samples
from worker.message import CANCEL_MARKER
from worker.ports import S3Location

pytestmark = pytest.mark.e2e

SHARD_ITEMS = 1000


def test_senders_cannot_exhaust_a_worker(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A table of 1 MB URIs (a .csv.gz of 1 MB that held 1 GB; and a Parquet file of 47
    KB, the value stored once), a tar of 20 times the
    members a shard holds, a tar whose member has a 1 MiB pax name, and 32 MiB of random
    bytes named as a tar: each dead-lettered with the limit it passes named; a job whose
    output holds a `cancel` of 300 MiB cancelled without reading it; the one-image job
    beside them done, and the daemon's process tree never 200 MB over what it was
    idle."""
    stack = aws.stack()
    [image] = upload_samples(aws.s3, stack.bucket, 1, seed=41)
    table = gzipped_rows("uri", megabyte_uri(stack.bucket), 1000)  # 1 MB; 1 GB held before
    parquet = parquet_rows("uri", megabyte_uri(stack.bucket), 1000)  # the same, in Parquet
    hostile = {
        "megabyte-uris": {"table": {"uri": upload(aws, stack, "bomb.csv.gz", table)}},
        "megabyte-uris-parquet": {"table": {"uri": upload(aws, stack, "bomb.parquet", parquet)}},
        "many-members": {
            "inputs": [upload(aws, stack, "many.tar", tar_of_empty_members(20 * SHARD_ITEMS))],
            "tar": {},
        },
        "long-name": {
            "inputs": [upload(aws, stack, "long.tar", tar_of([("n" * (2**20 - 100), b"x")]))],
            "tar": {},
        },
        "not-a-tar": {
            "inputs": [upload(aws, stack, "video.tar", os.urandom(32 * 2**20))],
            "tar": {},
        },
    }
    for job_id, source in hostile.items():
        aws.send(stack.queue_url, {"job_id": job_id, "output": job_output(stack, job_id), **source})
    send_jobs(aws, stack, {"ordinary": [image]})
    # Anyone who may cancel a job may write its output: a `cancel` of 300 MiB there (H6)
    # is honoured, never read.
    cancel_bomb = job_output(stack, "cancel-bomb")
    output_key = S3Location.parse(cancel_bomb).key
    upload(aws, stack, f"{output_key}{CANCEL_MARKER}", bytes(300 * 2**20))
    send_jobs(aws, stack, {"cancel-bomb": [image]})

    daemon = start_daemon(
        daemon_args(stack, tmp_path, "--drain", "--shard-items", str(SHARD_ITEMS))
    )
    daemon.wait_for("daemon_started")
    idle_mb = tree_rss_mb(daemon.pid)
    with peak_rss(daemon.pid, every_s=0.05) as peak_mb:
        assert daemon.wait(120) == 0, daemon.stderr[-3000:]
    print(f"daemon tree: {idle_mb:.0f} MB idle, peak {peak_mb[0]:.0f} MB")
    assert peak_mb[0] - idle_mb < 200, (idle_mb, peak_mb)

    assert_complete(aws, stack, "ordinary", [image])
    assert aws.summary(cancel_bomb)["status"] == "cancelled"
    reasons = {
        json.loads(dead["Body"])["job_id"]: dead["MessageAttributes"]["reason"]["StringValue"]
        for dead in aws.dead_letters(stack.dlq_url)
    }
    assert sorted(reasons) == sorted(hostile), reasons
    assert "row 1: its URI's key is over S3's limit of 1024 bytes" in reasons["megabyte-uris"]
    assert (
        "row 1: its URI's key is over S3's limit of 1024 bytes" in reasons["megabyte-uris-parquet"]
    )
    assert f"hold more than {SHARD_ITEMS} inputs" in reasons["many-members"]
    assert "a member's name of 1048476 bytes (at most 4096)" in reasons["long-name"]
    assert "video.tar is not a tar this worker reads" in reasons["not-a-tar"]
