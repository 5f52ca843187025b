"""Tar shards as inputs (`worker.datasets.tars`): each member an input, read from a local
copy of its tar made with one GET; what makes a tar unusable is poison, named; a job of
tars runs across shards of tars and resumes member by member."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from bench.harness import HOST_JOB_SIZE, tar_of
from bench.run import tar_shards
from stages.synthetic import samples
from tests.support.hostile import tar_of_empty_members
from tests.support.in_process import (
    draining_settings,
    planned,
    run_until_drained,
    run_while,
    sample_images,
)
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import Jobs
from worker.daemon.stages import fetcher
from worker.daemon.wiring import Daemon
from worker.datasets.arrays import ArrayFiles
from worker.datasets.tars import TarCopies, _checksum
from worker.errors import ObjectTooLarge, TransientError
from worker.jobs.checkpoints import Checkpoints, request_digest
from worker.jobs.job import Place
from worker.jobs.ledger import Ledger
from worker.jobs.plan import shard_body
from worker.message import JobMessage, PoisonMessage, TarMembers
from worker.plugins.identity import ModelIdentity
from worker.ports import S3Location

SLOW_MODEL = "tests.support.slow_model:tenth_of_a_second"

MAX_TAR_BYTES = 4 * 2**20


def _copies(tmp_path: Path, blobs: InMemoryBlobStore, max_members: int = 100) -> TarCopies:
    return TarCopies(tmp_path / "copies", blobs, MAX_TAR_BYTES, max_members)


def test_a_tars_members_are_its_inputs_in_order_keeping_the_suffix_asked_for(
    tmp_path: Path,
) -> None:
    """Members are read from the tar's copy; once the copy went with its job (a member
    the preprocessing processes remembered as known-good, read again), by a ranged GET
    of the tar."""
    blobs = InMemoryBlobStore()
    long_name = "deep/" * 30 + "c.jpg"  # over the 100 bytes of a plain header: a pax one
    blobs.objects["s3://bkt/0.tar"] = tar_of(
        [("a.jpg", b"A" * 700), ("a.cls", b"1"), ("b.jpg", b"B" * 10)]
    )
    blobs.objects["s3://bkt/1.tar"] = tar_of([(long_name, b"C" * 3000)])
    copies = _copies(tmp_path, blobs)

    members = copies.members(["s3://bkt/0.tar", "s3://bkt/1.tar"], TarMembers(member_suffix=".jpg"))

    assert [(member.row, member.name) for member in members] == [
        (0, "a.jpg"),
        (0, "b.jpg"),
        (1, long_name),
    ]
    fetch = fetcher(blobs.get, max_bytes=1000)
    assert [fetch(member.part) for member in members[:2]] == [b"A" * 700, b"B" * 10]
    with pytest.raises(ObjectTooLarge, match="3000 bytes, limit 1000"):
        fetch(members[2].part)
    everything = copies.members(["s3://bkt/0.tar"], TarMembers())
    assert [member.name for member in everything] == ["a.jpg", "a.cls", "b.jpg"]
    assert blobs.reads["s3://bkt/0.tar"] == 2  # copied twice, by these two calls
    copies.remove()
    assert not copies.directory.exists()
    assert fetch(members[1].part) == b"B" * 10
    assert blobs.reads["s3://bkt/0.tar"] == 3


def _varied_tar(tar_format: int) -> bytes:
    """Long names (over 100 bytes, and one not ASCII), a directory, links, an empty file,
    and a global header in pax: what tar writers write, each in its own way."""
    sink = io.BytesIO()
    shared = {"comment": "a global header"} if tar_format == tarfile.PAX_FORMAT else None
    with tarfile.open(fileobj=sink, mode="w", format=tar_format, pax_headers=shared) as archive:
        for name, kind, data in [
            ("top/", tarfile.DIRTYPE, b""),
            ("top/short.jpg", tarfile.REGTYPE, b"a" * 513),
            ("top/" + "d" * 90 + "/" + "e" * 60 + ".jpg", tarfile.REGTYPE, b"b" * 1000),
            ("top/" + "ü" * 120 + ".jpg", tarfile.REGTYPE, b"c"),
            ("top/link.jpg", tarfile.SYMTYPE, b""),
            ("top/hard.jpg", tarfile.LNKTYPE, b""),
            ("top/empty.jpg", tarfile.REGTYPE, b""),
            ("top/last.cls", tarfile.REGTYPE, b"7" * 512),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, len(data)
            info.linkname = "top/short.jpg" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            archive.addfile(info, io.BytesIO(data) if data else None)
    return sink.getvalue()


@pytest.mark.parametrize(
    "tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]
)
def test_members_are_read_as_pythons_tarfile_reads_them(tmp_path: Path, tar_format: int) -> None:
    """The headers are read here, not with `tarfile` (for speed): the same members, names,
    places and sizes as `tarfile` gives, in each format tar writers use."""
    if tar_format == tarfile.USTAR_FORMAT:  # no long names beyond its prefix field
        long_name = "top/" + "d" * 90 + "/" + "e" * 60 + ".jpg"
        data = tar_of([(long_name, b"b" * 700), ("x", b"")], tarfile.USTAR_FORMAT)
    else:
        data = _varied_tar(tar_format)
    blobs = InMemoryBlobStore()
    blobs.objects["s3://bkt/t.tar"] = data
    members = _copies(tmp_path, blobs).members(["s3://bkt/t.tar"], TarMembers())
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        expected = [(e.name, e.offset_data, e.size) for e in archive if e.isfile()]
    assert [(m.name, m.part.offset, m.part.size) for m in members] == expected
    assert len(expected) >= 2


def _sparse() -> bytes:
    """A tar whose member is a GNU sparse file (type S: its map of holes would be read
    as its bytes)."""
    data = bytearray(tar_of([("a.jpg", b"A" * 600)]))
    header = data[:512]
    header[156:157] = b"S"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    data[:512] = header
    return bytes(data)


def _huge_pax_header() -> bytes:
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("a.jpg")
        info.size, info.pax_headers = 1, {"comment": "x" * 2**21}
        archive.addfile(info, io.BytesIO(b"A"))
    return sink.getvalue()


def _cut_short() -> bytes:
    whole = tar_of([("a.jpg", b"A" * 5000)])
    return whole[:2048]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "tar s3://bkt/t.tar does not exist"),
        (gzip.compress(tar_of([("a.jpg", b"A")]), mtime=0), "is not a tar this worker reads"),
        (b"", "is not a tar this worker reads"),
        (_cut_short(), "is cut short in member a.jpg"),
        (tar_of([("a.jpg", b"A"), ("a.jpg", b"B")]), "holds member a.jpg twice"),
        (tar_of([("a.jpg", b"A" * MAX_TAR_BYTES)]), "is too large"),
        (tar_of([(f"{n}.jpg", b"A") for n in range(4)]), "hold more than 3 inputs, a shard's"),
        (_sparse(), "member a.jpg is sparse"),
        (_huge_pax_header(), "an extended header of 2097"),
        (tar_of([("n" * 4097, b"A")]), r"a member's name of 4097 bytes \(at most 4096\)"),
        (
            tar_of([("g" * 5000, b"A")], tarfile.GNU_FORMAT),
            r"a member's name of 5000 bytes \(at most 4096\)",
        ),
        (  # the review's: a name near 1 MiB, an extended header's most
            tar_of([("m" * (2**20 - 100), b"A")]),
            r"a member's name of 1048476 bytes \(at most 4096\)",
        ),
    ],
    # Each case by its reason: the bytes make ids that pytest-xdist's workers must agree on.
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_tar_that_cannot_be_used_is_poison_naming_it(
    tmp_path: Path, data: bytes | None, reason: str
) -> None:
    """Each thing that makes a tar unusable, its limit named where it is one: a member's
    name over 4 KiB (a pax name, a GNU long name, a megabyte-long one) among them."""
    blobs = InMemoryBlobStore()
    if data is not None:
        blobs.objects["s3://bkt/t.tar"] = data
    with pytest.raises(PoisonMessage, match=reason):
        _copies(tmp_path, blobs, max_members=3).members(["s3://bkt/t.tar"], TarMembers())


@given(st.binary(min_size=512, max_size=512))
@example(b"\xff" * 512)
@example(bytes(512))
def test_a_headers_checksum_is_the_sum_of_its_bytes_its_field_taken_as_spaces(
    header: bytes,
) -> None:
    assert _checksum(header) == sum(header[:148]) + 8 * ord(" ") + sum(header[156:])


def test_a_tar_job_is_another_request_than_one_of_the_same_objects() -> None:
    model = ModelIdentity(name="m", version="1", digest="d")
    listed = ["s3://bkt/0.tar"]
    plain = JobMessage(inputs=listed, output="s3://bkt/out/")
    tars = JobMessage(inputs=listed, output="s3://bkt/out/", tar=TarMembers())
    suffixed = JobMessage(
        inputs=listed, output="s3://bkt/out/", tar=TarMembers(member_suffix=".jpg")
    )
    digests = {request_digest(listed, None, spec, model) for spec in (plain, tars, suffixed)}
    assert len(digests) == 3


def test_checkpointed_members_resume_by_their_tar_and_name(tmp_path: Path) -> None:
    """A checkpoint line resumes the member it names, at that member's place now: a tar
    rewritten since with a member added before it moves it, and a member gone is not
    resumed (nor is a line of the same tar with no member)."""
    blobs = InMemoryBlobStore()
    spec = JobMessage(inputs=["s3://bkt/0.tar"], output="s3://bkt/out/", tar=TarMembers())
    lines = [
        {"index": 0, "input": "s3://bkt/0.tar", "member": "b.jpg", "label": "b"},
        {"index": 0, "input": "s3://bkt/0.tar", "member": "gone.jpg", "label": "x"},
        {"index": 0, "input": "s3://bkt/0.tar", "label": "no member"},
        {"index": True, "input": "s3://bkt/0.tar", "member": "a.jpg", "label": "forged"},
    ]
    blobs.objects["s3://bkt/out/checkpoint-0123456789abcdef-a0001-m1-00001.jsonl"] = b"\n".join(
        json.dumps(line).encode() for line in lines
    )
    places = [Place(0, "s3://bkt/0.tar", "new.jpg"), Place(0, "s3://bkt/0.tar", "b.jpg")]

    prior = Checkpoints(blobs, Ledger()).read(
        spec, "job", "0123456789abcdef", places, arrays=ArrayFiles(tmp_path, 2)
    )

    assert list(prior.resumed) == [1]
    assert json.loads(prior.resumed[1].line)["label"] == "b"


def test_a_tar_job_runs_as_shards_of_tars_with_one_get_per_tar_and_a_result_per_member(
    tmp_path: Path,
) -> None:
    """Three tars of sample images (with a label file beside each, which the suffix
    leaves out), a member that is no image and one over the size limit: split a tar a
    shard, each tar read with one GET and no member with one of its own; each member
    gets its own result or error, in order, in one table with a member column (sent and
    read back with the client)."""
    blobs, source = InMemoryBlobStore(), InMemoryJobSource()
    images = [data for _, data in samples(7, seed=9)]
    contents = [
        [("0.png", images[0]), ("0.cls", b"3"), ("1.png", b"no image"), ("2.png", images[1])],
        [("3.png", images[2]), ("4.png", images[3] + b"\0" * 60_000)],
        [(f"{n}.png", images[n]) for n in range(4, 7)],
    ]
    tars = []
    for number, members in enumerate(contents):
        tars.append(f"s3://bkt/tars/{number}.tar")
        blobs.objects[tars[-1]] = tar_of(members)
    job = Jobs(source, blobs).submit(
        "s3://bkt/out/tars/", inputs=tars, tar=TarMembers(member_suffix=".png"), format="parquet"
    )

    # A batch of one and one ahead: every daemon is full with one shard, and hands the
    # others back unread.
    settings = {"batch_size": 1, "prefetch_batches": 1}
    run_until_drained(source, blobs, tmp_path, shard_tars=1, max_input_bytes=50_000, **settings)

    summary = job.wait(timeout_s=5)
    assert (summary["items"], summary["failed"], summary["shards"]["count"]) == (8, 2, 3)
    assert {uri: blobs.reads[uri] for uri in tars} == dict.fromkeys(tars, 1)
    rows = pa.Table.from_batches(list(job.batches())).to_pylist()
    assert [(row["index"], row["input"], row["member"]) for row in rows] == [
        (0, tars[0], "0.png"),
        (0, tars[0], "1.png"),
        (0, tars[0], "2.png"),
        (1, tars[1], "3.png"),
        (1, tars[1], "4.png"),
        *((2, tars[2], f"{n}.png") for n in range(4, 7)),
    ]
    errors = {row["member"]: row["error"] for row in rows if row["error"]}
    assert errors["1.png"]["type"] == "UnidentifiedImageError"
    assert errors["4.png"] == {"type": "ObjectTooLarge", "message": errors["4.png"]["message"]}
    assert "limit 50000" in errors["4.png"]["message"]
    assert all(row["label"] for row in rows if not row["error"])


class TrickledTars(InMemoryBlobStore):
    """Streams each object in 4 KiB chunks, `chunk_s` apart (a slow network)."""

    def __init__(self, chunk_s: float) -> None:
        super().__init__(chunk_bytes=4096)
        self.chunk_s = chunk_s

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        for chunk in super().chunks(location, max_bytes, expect=expect):
            time.sleep(self.chunk_s)
            yield chunk


def _trickled(tmp_path: Path, tars: int) -> tuple[TrickledTars, list[str]]:
    """`tars` tars of about 40 KiB each, each taking about a second to copy."""
    blobs = TrickledTars(chunk_s=0.1)
    uris = [f"s3://bkt/tars/{number}.tar" for number in range(tars)]
    for number, uri in enumerate(uris):
        blobs.objects[uri] = tar_of([(f"{number}-{n}.bin", bytes(4000)) for n in range(9)])
    return blobs, uris


def test_a_tar_that_cannot_be_used_stops_the_copies_of_the_others(tmp_path: Path) -> None:
    """Four tars copied side by side, the second missing: the message is poison naming
    it within a chunk of the others' copies, not once they have all been read whole."""
    blobs, tars = _trickled(tmp_path, 4)
    del blobs.objects[tars[1]]
    started = time.monotonic()
    with pytest.raises(PoisonMessage, match=f"tar {tars[1]} does not exist"):
        _copies(tmp_path, blobs).members(tars, TarMembers())
    assert time.monotonic() - started < 0.6


def test_settling_a_job_stops_its_tars_copies_and_takes_them_away(tmp_path: Path) -> None:
    """A job settled while its tars are copied (a shutdown): the copies stop within a
    chunk, with an error that is not the input's, and nothing is left on disk."""
    blobs, tars = _trickled(tmp_path, 4)
    copies = _copies(tmp_path, blobs)
    outcome: list[BaseException] = []

    def copy() -> None:
        try:
            copies.members(tars, TarMembers())
        except BaseException as error:
            outcome.append(error)

    copying = threading.Thread(target=copy)
    copying.start()
    wait_until(lambda: len(list(copies.directory.glob("*.tar"))) == 4)
    copies.remove()
    copying.join(timeout=0.6)
    assert not copying.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransientError), outcome
    assert not copies.directory.exists()


class SlowTars(InMemoryBlobStore):
    """Reads a tar in `copy_s` (S3's bandwidth), noting when each copy began, and notes
    when each commit marker is written."""

    def __init__(self, copy_s: float) -> None:
        super().__init__()
        self.copy_s = copy_s
        self.copied_at: dict[str, float] = {}
        self.committed_at: dict[str, float] = {}

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        if str(location).endswith(".tar"):
            self.copied_at[str(location)] = time.monotonic()
            time.sleep(self.copy_s)
        yield from super().chunks(location, max_bytes, expect=expect)

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        if str(location).endswith(".commit"):
            self.committed_at[str(location).rsplit("/", 1)[1]] = time.monotonic()
        return super().put(location, data, content_type, expect=expect)


def test_a_tar_shard_s_tars_are_copied_while_the_shard_before_it_runs(tmp_path: Path) -> None:
    """Three tars a shard each, each copied in half a second, each shard a second of
    work: a daemon running a tar shard takes the next one and copies its tars while the
    first runs (and feeds it once the first is fed whole), so the device does not wait
    for the copy. Before, the next shard was taken only as the first ended."""
    blobs, source = SlowTars(copy_s=0.5), InMemoryJobSource()
    tars = _three_tars(blobs, sample_images(blobs, 10))
    job = Jobs(source, blobs).submit("s3://bkt/out/tars/", inputs=tars, tar=TarMembers())
    run_until_drained(
        source, blobs, tmp_path, shard_tars=1, batch_size=1, model=SLOW_MODEL, prefetch_batches=1
    )
    summary = job.wait(timeout_s=5)
    assert (summary["items"], summary["failed"], summary["shards"]["count"]) == (30, 0, 3)
    # The second tar's copy began well before the first shard's commit (its second of
    # work less the copy's half), not as it ended.
    assert blobs.copied_at[tars[1]] < blobs.committed_at["000000.commit"] - 0.3, (
        blobs.copied_at,
        blobs.committed_at,
    )
    assert {uri: blobs.reads[uri] for uri in tars} == dict.fromkeys(tars, 1)


def test_a_job_s_tars_are_copied_at_once_and_their_members_kept_in_order(
    tmp_path: Path,
) -> None:
    """Three tars of one job, each copied in half a second: copied side by side, not one
    after another (a second and a half before its first member could run), their
    members still in the order of the tars."""
    blobs, source = SlowTars(copy_s=0.5), InMemoryJobSource()
    tars = _three_tars(blobs, sample_images(blobs, 4))
    job = Jobs(source, blobs).submit("s3://bkt/out/side/", inputs=tars, tar=TarMembers())
    run_until_drained(source, blobs, tmp_path)
    assert job.wait(timeout_s=5)["succeeded"] == 12
    began = sorted(blobs.copied_at[uri] for uri in tars)
    assert began[-1] - began[0] < 0.25, began
    rows = [
        json.loads(line) for line in blobs.objects["s3://bkt/out/side/results.jsonl"].splitlines()
    ]
    assert [row["member"] for row in rows] == [f"{t}-{n}.png" for t in range(3) for n in range(4)]


def _three_tars(blobs: InMemoryBlobStore, images: list[str]) -> list[str]:
    """Three tars of `images` each (named `<tar>-<n>.png`), stored; their URIs."""
    tars = [f"s3://bkt/tars/{number}.tar" for number in range(3)]
    for number, uri in enumerate(tars):
        members = [(f"{number}-{n}.png", blobs.objects[image]) for n, image in enumerate(images)]
        blobs.objects[uri] = tar_of(members)
    return tars


def test_a_shard_not_of_tars_is_not_kept_in_the_room_for_copying_ahead(tmp_path: Path) -> None:
    """A daemon running a lone tar shard keeps room for the next shard, to copy its tars;
    a shard of another job, not of tars, taken through that room is handed back (with a
    delay: the daemon would take it again at once), not held waiting its turn."""
    blobs, source = InMemoryBlobStore(), InMemoryJobSource()
    images = sample_images(blobs, 10)
    tars = [f"s3://bkt/tars/{number}.tar" for number in range(2)]
    for uri in tars:
        blobs.objects[uri] = tar_of([(f"{n}.png", blobs.objects[i]) for n, i in enumerate(images)])
    # Full with the ten members of one tar shard: a batch of one, and two fetches.
    settings = draining_settings(
        tmp_path, model=SLOW_MODEL, batch_size=1, prefetch_batches=1, fetch_concurrency=2
    )
    source.send(json.dumps({"inputs": images[:1], "output": "s3://bkt/out/probe/"}))
    Daemon(settings, source, blobs).run()  # for the worker's model identity
    model = json.loads(blobs.objects["s3://bkt/out/probe/job.json"])["model"]
    spec, plan = planned(blobs, "objects", images, model)
    # A tar job's first shard only (the other's message is elsewhere): the room stays.
    tar_spec, tar_plan = planned(blobs, "tars", tars, model, tar=TarMembers())
    source.send(shard_body(tar_spec, tar_plan, 0))
    daemon = Daemon(settings, source, blobs)

    def drive() -> None:
        wait_until(lambda: any(uri.endswith(".started") for uri in list(blobs.objects)))
        source.send(shard_body(spec, plan, 0))
        wait_until(spares)
        daemon.stop()

    def spares() -> list[dict[str, Any]]:
        """Shards handed back unread."""
        return [e for e in logs if e["event"] == "job_released" and "another" in e["reason"]]

    with capture_logs() as logs:
        run_while(daemon, drive)
    assert spares()[0]["retry_in_s"] >= 10, spares()


class RecordedPuts(InMemoryBlobStore):
    """Keeps every object written, as written (a shard's commit marker goes at the merge)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[str, bytes]] = []

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        self.written.append((str(location), data))
        return super().put(location, data, content_type, expect=expect)


def test_a_job_of_objects_writes_its_plan_and_commits_as_workers_before_tars_did(
    tmp_path: Path,
) -> None:
    """A rolling upgrade: a job that is no tar job is planned and committed without the
    fields tar jobs add (`tar`, `items`), which workers from before tars refuse."""
    blobs, source = RecordedPuts(), InMemoryJobSource()
    inputs = sample_images(blobs, 3)
    output = "s3://bkt/out/plain/"
    source.send(json.dumps({"inputs": inputs, "output": output, "shard_items": 2}))
    run_until_drained(source, blobs, tmp_path, batch_size=2, preprocess_workers=1)
    plan = json.loads(blobs.objects[output + "plan.json"])
    commits = [json.loads(data) for uri, data in blobs.written if uri.endswith(".commit")]
    assert plan["items"] == 3 and "tar" not in plan
    assert len(commits) == 2 and not any("items" in commit for commit in commits)


@pytest.mark.bench
def test_the_tar_figure_runs_every_member_reading_each_tar_once(tmp_path: Path) -> None:
    """The bench's tar-shard figure (`bench.run.tar_shards`) is a real run of both kinds
    of input, every item of which succeeds (it raises otherwise): one GET per input
    against one per tar of `HOST_JOB_SIZE` members."""
    figures = tar_shards(tmp_path, HOST_JOB_SIZE, runs=1)
    assert figures["s3_gets_per_item_objects"] == 1.0
    assert figures["s3_gets_per_item_tar_shards"] == 1 / HOST_JOB_SIZE
    assert all(value > 0 for value in figures.values())


def test_members_past_the_limit_are_not_listed(tmp_path: Path) -> None:
    """A tar of 20,000 empty members where a shard holds 100: poison at the 101st, the
    rest never listed (Python's heap peaked at 56 KB, where listing all 20,000 first
    took 7.6 MB: a 16 GiB tar of 33 million, about 10 GB)."""
    blobs = InMemoryBlobStore()
    blobs.objects["s3://bkt/t.tar"] = tar_of_empty_members(20_000)
    copies = TarCopies(tmp_path / "copies", blobs, 2**30, 100)
    tracemalloc.start()
    try:
        with pytest.raises(PoisonMessage, match="hold more than 100 inputs, a shard's most"):
            copies.members(["s3://bkt/t.tar"], TarMembers())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


@pytest.mark.parametrize(
    "data",
    [
        os.urandom(3 * 2**20),
        gzip.compress(tar_of([(f"{n}.jpg", os.urandom(2**14)) for n in range(200)])),
    ],
    ids=["random-bytes", "a-gzipped-tar"],
)
def test_an_object_that_is_not_a_tar_is_refused_after_its_first_chunk(
    tmp_path: Path, data: bytes
) -> None:
    """Another tenant's video or a gzipped tar named as a tar: poison once its first
    512 bytes are in, the rest not read, and nothing copied (before, the whole object,
    up to --max-tar-bytes, was copied first)."""
    blobs = InMemoryBlobStore(chunk_bytes=2**16)
    blobs.objects["s3://bkt/t.tar"] = data
    copies = _copies(tmp_path, blobs)
    with pytest.raises(PoisonMessage, match=r"is not a tar this worker reads: .*header"):
        copies.members(["s3://bkt/t.tar"], TarMembers())
    assert (copies.directory / "000000.tar").stat().st_size == 0


def test_a_tar_whose_first_block_is_zeros_has_no_members_and_is_read_no_further(
    tmp_path: Path,
) -> None:
    """As before, a tar ends at a zero block, so one that starts with one has no members
    (the job's message is poison if none of its tars has any); what follows is not
    copied."""
    blobs = InMemoryBlobStore(chunk_bytes=2**16)
    blobs.objects["s3://bkt/t.tar"] = bytes(512) + tar_of([("a.jpg", os.urandom(2**20))])
    copies = _copies(tmp_path, blobs)
    assert copies.members(["s3://bkt/t.tar"], TarMembers()) == []
    assert (copies.directory / "000000.tar").stat().st_size == 2**16
