"""Merging a job's committed shards (`worker.sharding.merging`), with two mergers at once,
over a store whose ETags are not MD5s (as under SSE-KMS): one merges, the others leave
everything to it; a merger that died is replaced; a merger whose claim was taken over
writes nothing more."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker.adapters import fakes
from worker.adapters.fakes import InMemoryBlobStore
from worker.datasets import tables
from worker.datasets.arrays import SPOOL_LOCK, ArraySpool
from worker.datasets.disk import DiskBudget, NoDiskRoom
from worker.datasets.tables import ERROR_TYPE, Tables, stale_tables
from worker.errors import MissingObject
from worker.jobs.checkpoints import Checkpoints
from worker.jobs.ledger import Ledger
from worker.jobs.plan import (
    COMMIT_SUFFIX,
    Commit,
    Plan,
    RunFile,
    commit_file,
    merge_file,
    shard_file,
)
from worker.message import JobMessage, PoisonMessage, ShardRef, parse_job_message
from worker.ports import S3Location
from worker.sharding import claims, merging
from worker.sharding.claims import MergingElsewhere
from worker.sharding.merging import (
    AlreadyMerged,
    Fenced,
    Incomplete,
    JoinSpace,
    Merged,
    Merger,
    Refused,
)

DIGEST = "0123456789abcdef"
OUTPUT = "s3://bkt/out/j/"
MIB_TABLES = Tables(file_bytes=2**20, row_group_bytes=2**20)
# The most disk a joined file of MIB_TABLES' takes.
MIB_LARGEST = MIB_TABLES.largest_file_bytes(2**20)
# A Parquet job's columns, as a shard's run writes them: an embedding a fixed-size list.
RESULTS_SCHEMA = pa.schema(
    [
        ("index", pa.int64()),
        ("id", pa.string()),
        ("error", ERROR_TYPE),
        ("embedding", pa.list_(pa.float32(), 4)),
    ]
)


class _PausingStore(InMemoryBlobStore):
    """Opaque ETags; a write of a chosen name by a chosen thread waits until let go, and
    a thread told to die raises instead of writing (a merger killed between writes)."""

    def __init__(self) -> None:
        super().__init__(opaque_etags=True)
        self.pause_at: dict[str, str] = {}  # thread name -> output name it stops before
        self.reached = threading.Event()
        self.go_on = threading.Event()
        self.dies: set[str] = set()

    def _stop_before(self, location: S3Location) -> None:
        name = threading.current_thread().name
        if location.key.endswith("/" + self.pause_at.get(name, "\0")):
            self.reached.set()
            self.go_on.wait(10)
            if name in self.dies:
                raise _Killed(name)

    def put(self, location: S3Location, data: bytes, content_type: str, **kwargs: Any) -> str:
        self._stop_before(location)
        return super().put(location, data, content_type, **kwargs)

    def compose(self, location: S3Location, sources: Any, content_type: str, **kwargs: Any) -> str:
        self._stop_before(location)
        return super().compose(location, sources, content_type, **kwargs)


class _Killed(BaseException):
    """A merger's process died here."""


def _committed_job(
    blobs: InMemoryBlobStore, shards: int = 2, tables: list[list[list[pa.Table]]] | None = None
) -> tuple[JobMessage, Plan]:
    """A job of `shards` shards of two items, every shard committed with its files; with
    `tables`, a Parquet job of a shard each, shard n's files those of `tables[n]`, each
    of its row groups."""
    message = {"job_id": "j", "inputs": ["s3://bkt/a"], "output": OUTPUT}
    if tables is not None:
        message["format"], shards = "parquet", len(tables)
    spec = parse_job_message(json.dumps(message), frozenset())
    plan = Plan(
        job_id="j",
        request_digest=DIGEST,
        items=2 * shards,
        shard_items=2,
        model={"name": "m"},
        params={},
        received_at=0.0,
        attempt=1,
        format=spec.format,
    )
    blobs.objects[f"{OUTPUT}plan.json"] = plan.model_dump_json().encode()
    for shard in range(shards):
        run = f"a0001-m{shard}"
        if tables is None:
            results = {f".{run}.jsonl": _lines(plan.range(shard))}
        else:
            results = {
                f".{run}.{n}.parquet": _parquet(groups) for n, groups in enumerate(tables[shard])
            }
        log = json.dumps({"event": "job_received", "shard": shard}).encode() + b"\n"
        for suffix, data in {**results, f".{run}.log": log}.items():
            blobs.put(shard_file(spec, DIGEST, shard, suffix), data, "text/plain")
        commit = Commit(
            run=run,
            results=[
                RunFile(name=f"{shard:06d}{suffix}", bytes=len(data))
                for suffix, data in results.items()
            ],
            log=RunFile(name=f"{shard:06d}.{run}.log", bytes=len(log)),
            cancelled=False,
            succeeded=2,
            failed=0,
            resumed=0,
            attempt=1,
            device_s=0.0,
            seconds=1.0,
        )
        marker = commit_file(spec, DIGEST, shard)
        blobs.put(marker, commit.model_dump_json().encode(), "application/json")
    claims.open_claim(blobs, spec, DIGEST)  # as its planner does
    return spec, plan


def _lines(indexes: range) -> bytes:
    return b"".join(
        json.dumps({"index": index, "input": f"s3://bkt/{index}"}).encode() + b"\n"
        for index in indexes
    )


def _parquet(groups: list[pa.Table]) -> bytes:
    """A Parquet file of `groups`, a row group each, as a shard's run writes it."""
    sink = io.BytesIO()
    schema = groups[0].schema if groups else RESULTS_SCHEMA
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for group in groups:
            writer.write_table(group)
    return sink.getvalue()


def _merger(
    blobs: InMemoryBlobStore, tables: Tables = MIB_TABLES, join_space: JoinSpace | None = None
) -> tuple[Merger, Checkpoints]:
    checkpoints = Checkpoints(blobs, Ledger())
    merger = Merger(
        blobs,
        checkpoints,
        tables,
        worker_info={},
        device_hour_price=None,
        join_space=join_space,
    )
    return merger, checkpoints


class _Beats:
    """A daemon's clock of progress, counting its beats."""

    def __init__(self) -> None:
        self.count = 0

    def beat(self) -> None:
        self.count += 1


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[ArraySpool]:
    arrays = ArraySpool(tmp_path / "arrays")
    arrays.open()
    yield arrays
    arrays.close()


def _join_space(spool: ArraySpool, disk: DiskBudget | None = None) -> JoinSpace:
    return JoinSpace(spool, disk or DiskBudget(2**30), _Beats().beat)


def _left_in(spool: ArraySpool) -> list[str]:
    """What a merge left in the daemon's spool (but its lock)."""
    return [path.name for path in spool.directory.iterdir() if path.name != SPOOL_LOCK]


def _names(blobs: InMemoryBlobStore) -> set[str]:
    return {uri.removeprefix(OUTPUT) for uri in blobs.objects if uri.startswith(OUTPUT)}


@pytest.fixture
def store() -> Iterator[_PausingStore]:
    blobs = _PausingStore()
    yield blobs
    blobs.go_on.set()


def _merge_on_thread(
    merger: Merger,
    spec: JobMessage,
    plan: Plan,
    name: str,
    markers: dict[int, S3Location] | None = None,
) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(merger.merge(spec, plan, name, markers))
        except _Killed:
            outcome.append("killed")

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, outcome


def test_a_merger_that_finds_another_merging_leaves_everything_to_it(
    store: _PausingStore,
) -> None:
    """A watch that sees every shard committed while the last committer is merging (it
    has written results.jsonl, not yet job.log) neither writes nor removes anything: the
    merger finishes, and job.json names the outputs as they are (with ETags that are not
    MD5s, the same bytes written twice would leave it naming one no longer there)."""
    spec, plan = _committed_job(store)
    merger, checkpoints = _merger(store)
    store.pause_at = {"last-committer": "job.log"}
    thread, outcome = _merge_on_thread(merger, spec, plan, "last-committer")
    assert store.reached.wait(10)
    written = dict(store.objects)
    assert isinstance(merger.merge(spec, plan, "watch"), MergingElsewhere)
    assert dict(store.objects) == written  # nothing written, nothing removed
    store.go_on.set()
    thread.join(10)
    assert isinstance(outcome[0], Merged)
    assert checkpoints.finished(spec, "j", DIGEST) == outcome[0].summary
    assert _names(store) == {"plan.json", "results.jsonl", "job.log", "job.json"}


def test_a_merge_found_done_is_not_merged_again(store: _PausingStore) -> None:
    """A late merger (a committed shard's redelivery) after the merge finds job.json
    written for the request: it writes nothing, and says so, so nobody announces the job
    twice."""
    spec, plan = _committed_job(store)
    merger, _ = _merger(store)
    assert isinstance(merger.merge(spec, plan, "first"), Merged)
    written = dict(store.objects)
    assert isinstance(merger.merge(spec, plan, "late"), AlreadyMerged)
    assert dict(store.objects) == written


def test_a_merger_that_finds_the_claim_gone_writes_none(store: _PausingStore) -> None:
    """A watch that saw every shard committed comes to the claim after the merge
    removed it with the shards' files: it finds the job merged, and writes no claim (a
    claim written anew then, by a merger whose message another delivery deleted, was
    left for ever where that merger died before it saw the job done)."""
    spec, plan = _committed_job(store)
    merger, _ = _merger(store)
    markers = {shard: commit_file(spec, DIGEST, shard) for shard in range(plan.shards)}
    assert isinstance(merger.merge(spec, plan, "last-committer"), Merged)
    store.pause_at, store.dies = {"late-watch": "merge"}, {"late-watch"}
    store.go_on.set()
    thread, outcome = _merge_on_thread(merger, spec, plan, "late-watch", markers)
    thread.join(10)
    assert isinstance(outcome[0], AlreadyMerged)
    assert _names(store) == {"plan.json", "results.jsonl", "job.log", "job.json"}


def test_a_job_planned_by_a_worker_that_opened_no_claim_is_merged(store: _PausingStore) -> None:
    """A job planned before claims were opened at planning (a rolling upgrade) has none
    until its merger writes one: it merges, and the claim goes with the shards' files."""
    spec, plan = _committed_job(store)
    del store.objects[str(merge_file(spec, DIGEST))]
    merger, _ = _merger(store)
    assert isinstance(merger.merge(spec, plan, "last-committer"), Merged)
    assert _names(store) == {"plan.json", "results.jsonl", "job.log", "job.json"}


def test_a_merger_that_died_is_resumed_by_its_messages_next_delivery(
    store: _PausingStore,
) -> None:
    """The merger dies between results.jsonl and job.log, holding the claim: another
    merger waits for the claim to run out, and the same message's next delivery takes it
    at once and merges."""
    spec, plan = _committed_job(store)
    merger, checkpoints = _merger(store)
    store.pause_at, store.dies = {"shard-1-msg": "job.log"}, {"shard-1-msg"}
    thread, outcome = _merge_on_thread(merger, spec, plan, "shard-1-msg")
    assert store.reached.wait(10)
    store.go_on.set()
    thread.join(10)
    assert outcome == ["killed"]
    assert isinstance(merger.merge(spec, plan, "watch"), MergingElsewhere)
    store.pause_at = {}
    assert isinstance(merger.merge(spec, plan, "shard-1-msg"), Merged)
    assert checkpoints.finished(spec, "j", DIGEST) is not None


def test_a_merger_whose_claim_was_taken_over_writes_nothing_more(
    store: _PausingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merger stalls past its claim (a claim of no time at all here): another takes
    the claim over and merges; the first, going on, is fenced off at its next write and
    writes no job.json; the job counts as done with the outputs job.json names."""
    monkeypatch.setattr(claims, "MERGE_CLAIM_S", 0.0)
    spec, plan = _committed_job(store)
    merger, checkpoints = _merger(store)
    store.pause_at = {"stalled": "job.log"}
    thread, outcome = _merge_on_thread(merger, spec, plan, "stalled")
    assert store.reached.wait(10)
    taken_over = merger.merge(spec, plan, "watch")
    assert isinstance(taken_over, Merged)
    store.go_on.set()
    thread.join(10)
    assert isinstance(outcome[0], Fenced | AlreadyMerged)
    assert checkpoints.finished(spec, "j", DIGEST) == taken_over.summary


def test_a_merge_refused_by_another_requests_write_removes_nothing_and_merges_again(
    store: _PausingStore,
) -> None:
    """Another request writes the job's output while the merge runs (its job.log
    first): the merge is refused, writes no job.json, and leaves the shards' files and
    markers where they are; tried again (its message comes back), it lists the outputs
    anew and merges, as a whole job fenced off is released and runs again."""
    spec, plan = _committed_job(store)
    merger, _ = _merger(store)
    store.pause_at = {"merger": "job.log"}
    thread, outcome = _merge_on_thread(merger, spec, plan, "merger")
    assert store.reached.wait(10)
    store.put(S3Location("bkt", "out/j/job.log"), b"another request's\n", "text/plain")
    store.go_on.set()
    thread.join(10)
    assert isinstance(outcome[0], Refused)
    assert "job.json" not in _names(store)
    assert {f"shards/{DIGEST}/commits/{shard:06d}{COMMIT_SUFFIX}" for shard in (0, 1)} <= _names(
        store
    )
    store.pause_at = {}
    assert isinstance(merger.merge(spec, plan, "merger"), Merged)
    assert not any(name.startswith("shards/") for name in _names(store))


def test_an_incomplete_job_is_not_merged(store: _PausingStore) -> None:
    """With a shard's marker missing there is nothing to merge, and nothing is claimed."""
    spec, plan = _committed_job(store, shards=3)
    del store.objects[str(commit_file(spec, DIGEST, 2))]
    merger, _ = _merger(store)
    before = dict(store.objects)
    assert isinstance(merger.merge(spec, plan, "early"), Incomplete)
    assert dict(store.objects) == before


class _CountedListings(InMemoryBlobStore):
    """Counts the keys listed under a job's shards, and the pages (S3's LIST calls,
    1,000 keys each) that brought them: a page read at all is read whole."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = self.pages = 0

    def _listed(self, prefix: S3Location, keys: int) -> None:
        if "/shards/" in prefix.key:
            self.pages += max(1, -(-keys // fakes.FAKE_LIST_PAGE))
            self.keys += keys

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        listed = super().objects_under(prefix)
        self._listed(prefix, len(listed))
        return listed

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        keys = list(super().keys_under(prefix))
        for start in range(0, max(len(keys), 1), fakes.FAKE_LIST_PAGE):
            page = keys[start : start + fakes.FAKE_LIST_PAGE]
            self._listed(prefix, len(page))
            yield from page


def test_a_commit_lists_a_page_of_commit_markers_not_every_shards_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review L4. A job of 240 shards, each with its inputs file, sent and started notes
    and its run's results and log beside its marker, committed one after another as a
    queue hands them out, with pages of 100 keys (S3's 1,000, scaled down with the job):
    each commit's merge (incomplete but the last) lists one page, of the markers of its
    block up to its own (two at a block's end: the next block's, empty), where it
    listed all of the shards' files (1,440 keys, 15 pages) each time; the last merges
    the job, across its three blocks."""
    monkeypatch.setattr(fakes, "FAKE_LIST_PAGE", 100)
    monkeypatch.setattr(merging, "MARKERS_A_BLOCK", 100)
    store = _CountedListings()
    spec, plan = _committed_job(store, shards=240)
    markers = [store.objects.pop(str(commit_file(spec, DIGEST, n))) for n in range(plan.shards)]
    for shard in range(plan.shards):
        for suffix in (".inputs", ".sent", ".started"):
            store.objects[str(shard_file(spec, DIGEST, shard, suffix))] = b"{}"
    merger, _ = _merger(store)
    most_keys = most_pages = 0
    for shard, marker in enumerate(markers):
        store.objects[str(commit_file(spec, DIGEST, shard))] = marker
        store.keys = store.pages = 0
        shard_spec = spec.model_copy(update={"shard": ShardRef(index=shard, plan=DIGEST)})
        outcome = merger.merge(shard_spec, plan, f"m{shard}")
        if shard < plan.shards - 1:
            assert isinstance(outcome, Incomplete)
            most_keys, most_pages = max(most_keys, store.keys), max(most_pages, store.pages)
    assert isinstance(outcome, Merged)
    assert most_pages <= 2 and most_keys <= 100, (most_keys, most_pages)


def _rows(first: int, count: int) -> pa.Table:
    """`count` rows of results from index `first`, of the same size in bytes."""
    indexes = list(range(first, first + count))
    embeddings = [[index + part / 4 for part in range(4)] for index in indexes]
    columns = [indexes, [f"id-{i:04d}" for i in indexes], [None] * count, embeddings]
    return pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(columns, RESULTS_SCHEMA, strict=True)],
        schema=RESULTS_SCHEMA,
    )


def _shard_tables() -> list[list[list[pa.Table]]]:
    """Three shards' files: two row groups of 3 rows; none but an empty file; two
    files, each of a row group of 3 rows."""
    return [[[_rows(0, 3), _rows(3, 3)]], [[]], [[_rows(6, 3)], [_rows(9, 3)]]]


def _results(blobs: InMemoryBlobStore, summary: dict[str, Any]) -> list[pq.ParquetFile]:
    names = [name for name in summary["outputs"] if name.startswith("results/")]
    return [pq.ParquetFile(io.BytesIO(blobs.objects[OUTPUT + name])) for name in names]


def test_a_sharded_parquet_job_is_one_file_as_a_run_alone_writes_it(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """Three shards' Parquet files (several row groups; one shard with no rows) join,
    in shard order, into the one file a run of the job alone writes,
    part-000000-0000.parquet, of the same columns (the embedding a fixed-size list), in
    one row group: the rows in order. An earlier merge's files are replaced or
    removed, and the files copied into the daemon's spool to be joined are gone."""
    spec, plan = _committed_job(store, tables=_shard_tables())
    store.objects[f"{OUTPUT}results/part-000000-0000.parquet"] = b"an earlier merge's"
    store.objects[f"{OUTPUT}results/part-000002-0000.parquet"] = b"an earlier merge's"
    merger, _ = _merger(store, join_space=_join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    assert list(merged.summary["outputs"]) == ["results/part-000000-0000.parquet", "job.log"]
    assert _names(store) == {"plan.json", "results/part-000000-0000.parquet", "job.log", "job.json"}
    [joined] = _results(store, merged.summary)
    assert joined.schema_arrow == RESULTS_SCHEMA
    assert joined.num_row_groups == 1
    assert joined.read() == pa.concat_tables(_rows(n, 3) for n in range(0, 12, 3))
    assert _left_in(spool) == []


def test_a_join_beats_the_daemons_progress_as_it_goes(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """A join of tens of GB takes minutes, the job at work all the while: it beats the
    daemon's clock of progress for each shard file copied, each row group read and each
    file sent, so that the watchdog never takes it for a hung daemon."""
    spec, plan = _committed_job(store, tables=_shard_tables())
    beats = _Beats()
    space = JoinSpace(spool, DiskBudget(2**30), beats.beat)
    merger, _ = _merger(store, join_space=space)
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    shard_files, row_groups, sent = 4, 4, 1
    assert beats.count >= shard_files + row_groups + sent


def test_a_sharded_parquet_job_is_cut_into_files_of_parquet_file_bytes(
    store: _PausingStore, spool: ArraySpool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With files of a byte and row groups of two of the shards' (six rows, decoded),
    the same shards join into two files of a row group each, named in order as a run alone
    names them; read one after the other, the rows in order. (Each shard's footer is
    read by a second GET here: the first, of its last 8 bytes, holds only its length.)"""
    monkeypatch.setattr("worker.datasets.tables.FOOTER_GUESS_BYTES", 8)
    spec, plan = _committed_job(store, tables=_shard_tables())
    group_bytes = pq.ParquetFile(io.BytesIO(_parquet([_rows(0, 3)]))).read_row_group(0).nbytes
    tables = Tables(file_bytes=1, row_group_bytes=2 * group_bytes)
    merger, _ = _merger(store, tables, _join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    assert list(merged.summary["outputs"]) == [
        "results/part-000000-0000.parquet",
        "results/part-000000-0001.parquet",
        "job.log",
    ]
    files = _results(store, merged.summary)
    assert [file.metadata.row_group(0).num_rows for file in files] == [6, 6]
    assert pa.concat_tables(file.read() for file in files) == pa.concat_tables(
        [_rows(0, 6), _rows(6, 6)]
    )


def test_a_merger_fenced_as_it_sends_a_file_leaves_that_file_alone_and_writes_no_more(
    store: _PausingStore, spool: ArraySpool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late-write residual: a merger of files of a byte (two files) renews its claim,
    then stalls sending its second file past the claim's end; a watch (files of a MiB:
    one) takes the claim over and merges. The stalled put then lands, its name absent
    to both: that one file stays, named by no job.json (a reader of the folder sees its
    rows; the job's next run removes it), and the late merger is fenced at its next
    renewal, writing nothing more; the job is complete as the watch merged it. (Claims
    run out at once here.)"""
    monkeypatch.setattr(claims, "MERGE_CLAIM_S", 0)
    spec, plan = _committed_job(store, tables=_shard_tables())
    group_bytes = pq.ParquetFile(io.BytesIO(_parquet([_rows(0, 3)]))).read_row_group(0).nbytes
    late_tables = Tables(file_bytes=1, row_group_bytes=2 * group_bytes)
    late, checkpoints = _merger(store, late_tables, _join_space(spool))
    stray = "results/part-000000-0001.parquet"
    store.pause_at = {"late": stray}
    thread, outcome = _merge_on_thread(late, spec, plan, "late")
    assert store.reached.wait(10)
    watch, _ = _merger(store, join_space=_join_space(spool))
    merged = watch.merge(spec, plan, "watch")
    assert isinstance(merged, Merged)
    store.go_on.set()
    thread.join(10)
    assert isinstance(outcome[0], Fenced)
    assert checkpoints.finished(spec, "j", DIGEST) == merged.summary
    assert list(merged.summary["outputs"]) == ["results/part-000000-0000.parquet", "job.log"]
    left = _names(store)
    assert left == {"plan.json", "results/part-000000-0000.parquet", stray, "job.log", "job.json"}
    assert stale_tables(left, merged.summary["outputs"]) == [stray]


class _BrokenCopies(_PausingStore):
    """A store whose reads of the objects `broken` fail midway (a connection lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken: set[str] = set()

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Iterator[bytes]:
        pieces = super().chunks(location, max_bytes, expect=expect)
        if str(location) in self.broken:
            yield next(pieces)
            raise MissingObject(f"{location}: the connection was lost")
        yield from pieces


def test_a_merge_that_fails_copying_a_shard_file_leaves_nothing_here_and_is_merged_again(
    spool: ArraySpool,
) -> None:
    """A merge that fails copying the last shard's file, joined files sent before it
    (a file a row), leaves no copy and no joined file in the daemon's spool; the
    merge tried again (files of another size now) replaces the files sent before, and
    removes those it does not write again."""
    store = _BrokenCopies()
    spec, plan = _committed_job(store, tables=_shard_tables())
    last = str(shard_file(spec, DIGEST, 2, ".a0001-m2.1.parquet"))
    store.broken.add(last)
    merger, _ = _merger(store, Tables(file_bytes=1, row_group_bytes=1), _join_space(spool))
    with pytest.raises(MissingObject):
        merger.merge(spec, plan, "last-committer")
    assert _left_in(spool) == []
    sent = {name for name in _names(store) if name.startswith("results/")}
    assert len(sent) >= 2  # a file a row of those read before the last shard's
    store.broken.clear()
    merger, _ = _merger(store, join_space=_join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    assert _names(store) == {"plan.json", "results/part-000000-0000.parquet", "job.log", "job.json"}
    [joined] = _results(store, merged.summary)
    assert joined.read() == pa.concat_tables(_rows(n, 3) for n in range(0, 12, 3))
    assert _left_in(spool) == []


def test_a_join_the_disk_has_no_room_for_now_is_handed_back_having_written_nothing(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """The join's copy and joined file are claimed of the daemon's disk budget
    (--tar-disk-bytes) before they are written: others' copies holding it, the merge
    is `NoDiskRoom` (the job goes back, uncharged), with nothing written or left here."""
    spec, plan = _committed_job(store, tables=_shard_tables())
    disk = DiskBudget(4 * MIB_LARGEST)
    disk.claim("another job's tars").grow(3 * MIB_LARGEST)
    merger, _ = _merger(store, join_space=_join_space(spool, disk))
    with pytest.raises(NoDiskRoom):
        merger.merge(spec, plan, "last-committer")
    assert not any(name.startswith("results/") for name in _names(store))
    assert _left_in(spool) == []
    assert disk.held_bytes == 3 * MIB_LARGEST


def test_a_join_the_file_size_would_cut_into_too_many_files_cuts_larger_ones(
    store: _PausingStore, spool: ArraySpool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards' files of 18 KiB in all, joined by a worker whose --parquet-file-bytes is
    a byte, would be past the files a job has (10,000, here 5, whose names sort): the
    merge cuts files of the join's bytes over 9,000 (here 4) instead, and merges the job
    into at most that many, every row in order, where it was poison (rejected.json)
    for the merging worker's setting, not the job's fault."""
    monkeypatch.setattr(tables, "MAX_RESULTS_FILES", 5)
    monkeypatch.setattr(tables, "JOINED_FILES", 4)
    spec, plan = _committed_job(store, tables=[[[_rows(0, 400)]], [[_rows(400, 400)]]])
    tiny_files = Tables(file_bytes=1, row_group_bytes=4 * 2**10)  # row groups of ~100 rows
    merger, _ = _merger(store, tiny_files, _join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    joined = _results(store, merged.summary)
    assert 2 <= len(joined) <= 4
    assert pa.concat_tables(file.read() for file in joined) == _rows(0, 800)
    assert _left_in(spool) == []


def _numbers(rows: pa.Table, column: str, values: list[Any]) -> pa.Table:
    return rows.set_column(rows.schema.get_field_index(column), column, pa.array(values))


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        # No one file holds both.
        (
            _rows(0, 3),
            _numbers(_rows(3, 3), "id", [3, 4, 5]),
            "column 'id' has types int64, string",
        ),
        # Floats would lose the integers past 2^53; the checked cast failed mid-join.
        (
            _numbers(_rows(0, 3), "index", [0, 1, 2**60]),
            _numbers(_rows(3, 3), "index", [3.0, 4.0, 5.0]),
            "column 'index' holds integers in one file and floats in another",
        ),
        # Joined, the arrays would be lists of any length.
        (
            _rows(0, 3),
            _rows(3, 3).set_column(
                3, "embedding", pa.array([[0.0] * 3] * 3, pa.list_(pa.float32(), 3))
            ),
            "column 'embedding': shards gave arrays of different shapes",
        ),
    ],
)
def test_shards_files_whose_columns_cannot_be_joined_make_the_merge_poison(
    store: _PausingStore, spool: ArraySpool, first: pa.Table, second: pa.Table, reason: str
) -> None:
    """Columns that cannot be joined without losing or failing a value make the merge
    poison, saying which column, before it writes anything, where it failed on every
    delivery. (Columns that can be joined are: a redriven shard's floats among
    integers, `test_a_job_with_a_dead_lettered_shard_waits_for_its_redrive_then_ends_whole`.)"""
    spec, plan = _committed_job(store, tables=[[[first]], [[second]]])
    merger, _ = _merger(store, join_space=_join_space(spool))
    with pytest.raises(PoisonMessage, match=reason):
        merger.merge(spec, plan, "last-committer")
    assert not any(name.startswith("results/") for name in _names(store))
    assert _left_in(spool) == []


def test_integers_among_floats_within_two_to_the_53_join_as_floats(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """Integers a float holds exactly (the footer's statistics say they all are) join
    with another shard's floats as floats."""
    spec, plan = _committed_job(
        store,
        tables=[
            [[_numbers(_rows(0, 3), "index", [0, 1, -(2**53)])]],
            [[_numbers(_rows(3, 3), "index", [3.5, 4.0, 5.0])]],
        ],
    )
    merger, _ = _merger(store, join_space=_join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    [joined] = _results(store, merged.summary)
    assert joined.read().column("index").to_pylist() == [0.0, 1.0, -(2.0**53), 3.5, 4.0, 5.0]


def test_an_empty_shards_integers_join_with_anothers_floats(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """A shard with no rows still writes a row group, of no rows and no statistics: it
    holds no value to lose, and its integer column joins another shard's floats."""
    spec, plan = _committed_job(
        store,
        tables=[[[_rows(0, 0)]], [[_numbers(_rows(0, 3), "index", [0.5, 1.0, 2.0])]]],
    )
    merger, _ = _merger(store, join_space=_join_space(spool))
    merged = merger.merge(spec, plan, "last-committer")
    assert isinstance(merged, Merged)
    [joined] = _results(store, merged.summary)
    assert joined.read().column("index").to_pylist() == [0.5, 1.0, 2.0]


def test_a_join_over_the_whole_disk_budget_is_handed_back_not_poison(
    store: _PausingStore, spool: ArraySpool
) -> None:
    """A join needs more disk than this worker gives jobs' copies at all (a small
    --tar-disk-bytes, or shards written with a larger --parquet-file-bytes): the job is
    no poison, another worker may merge it; it goes back uncharged (`NoDiskRoom`)."""
    spec, plan = _committed_job(store, tables=_shard_tables())
    disk = DiskBudget(MIB_LARGEST // 2)
    merger, _ = _merger(store, join_space=_join_space(spool, disk))
    with pytest.raises(NoDiskRoom, match="--tar-disk-bytes"):
        merger.merge(spec, plan, "last-committer")
    assert not any(name.startswith("results/") for name in _names(store))
    assert _left_in(spool) == [] and disk.held_bytes == 0


@pytest.mark.parametrize(
    ("ending", "reason"),
    [
        (b"12345678", "it does not end as a Parquet file does"),
        ((2**31).to_bytes(4, "little") + b"PAR1", "its footer claims"),
    ],
)
def test_a_shard_file_with_no_parquet_footer_makes_the_merge_poison_naming_it(
    store: _PausingStore, spool: ArraySpool, ending: bytes, reason: str
) -> None:
    """A shard's results file that does not end with a footer (or with one longer than
    the file) can never be joined: the merge is poison, naming the file, where it was
    retried for ever."""
    spec, plan = _committed_job(store, tables=_shard_tables())
    name = str(shard_file(spec, DIGEST, 0, ".a0001-m0.0.parquet"))
    store.objects[name] = store.objects[name][: -len(ending)] + ending
    merger, _ = _merger(store, join_space=_join_space(spool))
    with pytest.raises(PoisonMessage, match=f"shard file {name}: {reason}"):
        merger.merge(spec, plan, "last-committer")
    assert not any(name.startswith("results/") for name in _names(store))
