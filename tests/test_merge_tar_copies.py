"""The disk a sharded Parquet job's join claims (`worker.sharding.merging:JoinSpace`) is
of the budget tar copies claim too (--tar-disk-bytes): a tar shard that merges its job
at its finish gives its own tars' copies back first, in this process against the
in-memory fakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bench.harness import tar_of
from stages.synthetic import samples
from tests.support.in_process import job_file, planned, run_until_drained, sample_images
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.jobs.plan import shard_body
from worker.loops import results
from worker.message import TarMembers

KIB = 2**10
# A tar of a few images and a label file of 100 KiB, which the member suffix leaves out.
LABELS_BYTES = 100 * KIB
# Files and row groups of 64 KiB: a join claims the shard's file and 128 KiB.
PARQUET_BYTES = 64 * KIB
# Room for the tar's copy, or for the join, but not for both.
DISK_BYTES = 200 * KIB


def test_a_tar_shard_that_merges_its_job_gives_its_tars_copies_back_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one shard of a Parquet job of one tar commits and merges the job at its
    finish, its tar's copy (110 KiB) and the join (over 128 KiB) each within the
    budget of 200 KiB, not both together: the copy is given back before the join
    claims its disk, so the job is merged there and then, where its own copy left the
    join no room and the job was handed back to merge at its next delivery."""
    monkeypatch.setattr(results, "NO_DISK_ROOM_RETRY_S", 0)  # a hand-over comes back at once
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    probe = {"job_id": "probe", "inputs": sample_images(blobs, 1), "output": "s3://bkt/out/probe/"}
    source.send(json.dumps(probe))  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    images = [(f"{n}.png", data) for n, (_, data) in enumerate(samples(3, seed=9))]
    blobs.objects["s3://bkt/tars/0.tar"] = tar_of([*images, ("0.cls", b"\0" * LABELS_BYTES)])
    model = job_file(blobs, "probe", "job.json")["model"]
    spec, plan = planned(
        blobs, "copies", ["s3://bkt/tars/0.tar"], model, TarMembers(member_suffix=".png")
    )
    plan = plan.model_copy(update={"format": "parquet"})
    blobs.objects["s3://bkt/out/copies/plan.json"] = plan.model_dump_json().encode()
    source.send(shard_body(spec, plan, 0))
    with capture_logs() as logs:
        run_until_drained(
            source,
            blobs,
            tmp_path,
            tar_disk_bytes=DISK_BYTES,
            parquet_file_bytes=PARQUET_BYTES,
            parquet_row_group_bytes=PARQUET_BYTES,
        )
    assert [entry for entry in logs if entry["event"] == "job_released"] == []
    assert job_file(blobs, "copies", "job.json")["items"] == 3
