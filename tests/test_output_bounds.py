"""What a job's output holds is read within bounds (review H6): anyone who may cancel a
job may write there, so a checkpoint part, a job.json or a plan.json larger than any
this daemon writes is not taken for one, and never held whole."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.support.in_process import run_while, sample_images, serving_settings
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.datasets.arrays import NPY_HEADER_MOST, ArrayFiles, npy_bytes
from worker.jobs import checkpoints
from worker.jobs.checkpoints import (
    MAX_PART_BYTES,
    MAX_RESUMED_LINE_BYTES,
    MAX_SUMMARY_BYTES,
    ROWS,
    Checkpoints,
    part_prefix,
)
from worker.jobs.job import Place, Result
from worker.jobs.joblog import JobLog
from worker.jobs.ledger import Ledger
from worker.jobs.plan import Plan, shard_body
from worker.message import JobMessage, parse_job_message

DIGEST = "0123456789abcdef"


class _Sized(InMemoryBlobStore):
    """Keeps the largest read each GET allowed: a read without a bound is unbounded."""

    def __init__(self) -> None:
        super().__init__()
        self.bounds: dict[str, int | None] = {}

    def get(self, location, max_bytes=None, byte_range=None):  # type: ignore[no-untyped-def]
        self.bounds[location.key.rsplit("/", 1)[-1]] = max_bytes
        return super().get(location, max_bytes, byte_range)


def test_checkpoint_parts_and_lines_over_their_bounds_are_not_resumed(tmp_path: Path) -> None:
    """A part over `MAX_PART_BYTES` is skipped unread, and a line over
    `MAX_RESUMED_LINE_BYTES` in a part is not resumed (its item runs again); the line
    within bounds beside it is."""
    blobs = _Sized()
    spec = JobMessage(inputs=["s3://bkt/a", "s3://bkt/b"], output="s3://bkt/out/")
    places = [Place(0, "s3://bkt/a"), Place(1, "s3://bkt/b")]
    prefix = f"s3://bkt/out/{part_prefix(DIGEST, None)}"
    huge_line = {"index": 1, "input": "s3://bkt/b", "label": "x" * MAX_RESUMED_LINE_BYTES}
    lines = [{"index": 0, "input": "s3://bkt/a", "label": "a"}, huge_line]
    blobs.objects[f"{prefix}0001-m-00001.jsonl"] = b"\n".join(json.dumps(x).encode() for x in lines)
    blobs.objects[f"{prefix}0001-m-00002.jsonl"] = b" " * (MAX_PART_BYTES + 1)
    prior = Checkpoints(blobs, Ledger()).read(
        spec, "job", DIGEST, places, arrays=ArrayFiles(tmp_path, 2)
    )
    assert list(prior.resumed) == [0]
    assert blobs.bounds["checkpoint-0123456789abcdef-a0001-m-00002.jsonl"] == MAX_PART_BYTES


def test_a_parts_array_rows_are_resumed_only_where_they_are_the_lines_own(
    tmp_path: Path,
) -> None:
    """Row n of a part's `<field>.npy` is line n's: a line is resumed with its row
    written to the job's array file only where the part has a row for each of its
    lines, of the job's layout, at the row the line's reference names; an .npy whose
    header claims more than it holds is refused unallocated, and each is read within
    the part's bound."""
    blobs = _Sized()
    uris = [f"s3://bkt/{n}" for n in range(8)]
    spec = JobMessage(inputs=uris, output="s3://bkt/out/")
    places = [Place(n, uri) for n, uri in enumerate(uris)]
    prefix = f"s3://bkt/out/{part_prefix(DIGEST, None, ROWS)}"

    def line(index: int, row: object, field: str = "embedding") -> bytes:
        reference = {"array": f"{field}.npy", "row": row}
        return json.dumps({"index": index, "input": uris[index], field: reference}).encode()

    saved = np.arange(20, dtype=np.float32).reshape(5, 4)
    # Line 1 names another row, line 3 a row of no file, line 4 a row that is no number.
    lines = [line(0, 0), line(1, 4), line(2, 2), line(3, 3, "mask"), line(4, [4])]
    blobs.objects[f"{prefix}0001-m-00001.jsonl"] = b"\n".join(lines)
    blobs.objects[f"{prefix}0001-m-00001.embedding.npy"] = npy_bytes(saved)
    blobs.objects[f"{prefix}0001-m-00002.jsonl"] = line(5, 5)  # rows of another layout
    blobs.objects[f"{prefix}0001-m-00002.embedding.npy"] = npy_bytes(np.zeros((1, 5), np.float32))
    claims_more = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**40, 4)}
    np.lib.format.write_array_header_1_0(claims_more, header)
    claims_more.write(bytes(16))  # one row
    blobs.objects[f"{prefix}0001-m-00003.jsonl"] = line(6, 6)
    blobs.objects[f"{prefix}0001-m-00003.embedding.npy"] = claims_more.getvalue()
    blobs.objects[f"{prefix}0001-m-00004.jsonl"] = line(7, 7)  # two rows for its one line
    blobs.objects[f"{prefix}0001-m-00004.embedding.npy"] = npy_bytes(np.ones((2, 4), np.float32))
    arrays = ArrayFiles(tmp_path, 8, {"embedding": (np.dtype(np.float32), (4,))})

    prior = Checkpoints(blobs, Ledger()).read(spec, "job", DIGEST, places, arrays=arrays)

    assert sorted(prior.resumed) == [0, 2]
    written = np.load(arrays.files()["embedding.npy"])
    assert (written[[0, 2]] == saved[[0, 2]]).all() and not written[[1, 3, 4, 5, 6, 7]].any()
    assert blobs.bounds["checkpoint-0123456789abcdef-r0001-m-00001.embedding.npy"] == MAX_PART_BYTES


def test_earlier_deliveries_log_lines_come_back_in_the_order_they_were_written(
    tmp_path: Path,
) -> None:
    """By attempt, whatever letter names the part's kind (and the previous release's
    `aa` of its first attempt)."""
    blobs = InMemoryBlobStore()
    spec = JobMessage(inputs=["s3://bkt/a"], output="s3://bkt/out/")
    written = {"aa0001": b"first\n", "r0002": b"second\n", "a0003": b"third\n"}
    for delivery, lines in written.items():
        blobs.objects[f"s3://bkt/out/checkpoint-{DIGEST}-{delivery}-m-00001.log"] = lines
    prior = Checkpoints(blobs, Ledger()).read(
        spec, "job", DIGEST, [Place(0, "s3://bkt/a")], arrays=ArrayFiles(tmp_path, 1)
    )
    assert prior.earlier_log == b"first\nsecond\nthird\n"


def test_one_save_writes_parts_within_their_rows_bound_that_come_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part takes as many results as their array rows fit in `PART_ROW_BYTES` (here 3
    rows of 16 bytes beside the .npy's header), and one save writes as many parts as
    its results need (a hand-over saves once); read back, every result is resumed with
    its rows where they were."""
    monkeypatch.setattr(checkpoints, "PART_ROW_BYTES", NPY_HEADER_MOST + 3 * 16 + 15)
    source = InMemoryJobSource()
    source.send("{}")
    [message] = source.receive(1, 0, 30)
    ledger, blobs = Ledger(), InMemoryBlobStore()
    job = ledger.receive(message)
    assert job is not None
    uris = [f"s3://bkt/{n}" for n in range(5)]
    spec = parse_job_message(json.dumps({"inputs": uris, "output": "s3://bkt/out/"}), frozenset())
    layouts = {"embedding": (np.dtype(np.float32), (4,))}
    job.arrays = ArrayFiles(tmp_path / "first", 5, layouts)
    job.request_digest = DIGEST
    ledger.admit(job, spec, uris, JobLog(tmp_path / "job.log", job.key))
    ledger.next_items(5)
    rows = np.arange(20, dtype=np.float32).reshape(5, 4)
    for index, uri in enumerate(uris):
        fields = job.arrays.write(index, {"embedding": rows[index]})
        line = b'{"index":%d,"input":"%s"%s}\n' % (index, uri.encode(), fields)
        ledger.record(job.key, index, Result(line, False))
    Checkpoints(blobs, ledger).save(job)
    parts = sorted(uri for uri in blobs.objects if uri.endswith(".npy"))
    assert [len(np.load(io.BytesIO(blobs.objects[uri]))) for uri in parts] == [3, 2]
    assert all(f"/{part_prefix(DIGEST, None, ROWS)}" in uri for uri in parts)

    resumed_rows = ArrayFiles(tmp_path / "again", 5, layouts)
    places = [Place(n, uri) for n, uri in enumerate(uris)]
    prior = Checkpoints(blobs, Ledger()).read(spec, "job", DIGEST, places, arrays=resumed_rows)
    assert sorted(prior.resumed) == list(range(5))
    assert (np.load(resumed_rows.files()["embedding.npy"]) == rows).all()


def test_a_job_json_over_its_bound_does_not_complete_the_job() -> None:
    """A job.json larger than any a worker writes is no worker's: the job is not done."""
    blobs = _Sized()
    spec = JobMessage(inputs=["s3://bkt/a"], output="s3://bkt/out/")
    summary = {"request_digest": DIGEST, "outputs": {}, "padding": "x" * MAX_SUMMARY_BYTES}
    blobs.objects["s3://bkt/out/job.json"] = json.dumps(summary).encode()
    assert Checkpoints(blobs, Ledger()).finished(spec, "job", DIGEST) is None
    assert blobs.bounds["job.json"] == MAX_SUMMARY_BYTES


def test_a_plan_in_shards_larger_than_the_worker_holds_is_left_alone(tmp_path: Path) -> None:
    """A plan.json under the output (anyone's who may write there) whose shards hold more
    inputs than this worker holds of a job: its shard is released for another worker,
    with a delay, not run and not dead-lettered; nothing is written."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    spec = JobMessage(job_id="big", inputs=inputs, output="s3://bkt/out/big/")
    plan = Plan(
        job_id="big",
        request_digest=DIGEST,
        items=4,
        shard_items=20_000,
        model={"name": "any"},
        params={},
        received_at=0.0,
        attempt=1,
    )
    blobs.objects["s3://bkt/out/big/plan.json"] = plan.model_dump_json().encode()
    source.send(shard_body(spec, plan, 0))
    written = dict(blobs.objects)
    # A worker of shards of 2, taking jobs of at most 10,000 x 2 inputs.
    daemon = Daemon(
        serving_settings(tmp_path, shard_items=2, max_items_per_job=20_000), source, blobs
    )
    with capture_logs() as logs:

        def drive() -> None:
            wait_until(lambda: any(entry["event"] == "job_released" for entry in logs))
            daemon.stop()

        assert run_while(daemon, drive) is ExitCode.SIGNALLED
    (released,) = [entry for entry in logs if entry["event"] == "job_released"]
    assert "over the 2 this worker holds" in released["reason"] and released["retry_in_s"] > 0
    assert len(source) == 1 and not source.dead_letters
    assert blobs.objects == written
