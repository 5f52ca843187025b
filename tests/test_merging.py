"""Merging a job's committed shards (`worker.sharding.merging`), with two mergers at once,
over a store whose ETags are not MD5s (as under SSE-KMS): one merges, the others leave
everything to it; a merger that died is replaced; a merger whose claim was taken over
writes nothing more."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from worker.adapters import fakes
from worker.adapters.fakes import InMemoryBlobStore
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
from worker.message import JobMessage, ShardRef, parse_job_message
from worker.ports import S3Location
from worker.sharding import merging
from worker.sharding.merging import (
    AlreadyMerged,
    Fenced,
    Incomplete,
    Merged,
    Merger,
    MergingElsewhere,
    Refused,
)

DIGEST = "0123456789abcdef"
OUTPUT = "s3://bkt/out/j/"


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


def _committed_job(blobs: InMemoryBlobStore, shards: int = 2) -> tuple[JobMessage, Plan]:
    """A job of `shards` shards of two items, every shard committed with its files."""
    spec = parse_job_message(
        json.dumps({"job_id": "j", "inputs": ["s3://bkt/a"], "output": OUTPUT}), frozenset()
    )
    plan = Plan(
        job_id="j",
        request_digest=DIGEST,
        items=2 * shards,
        shard_items=2,
        model={"name": "m"},
        params={},
        received_at=0.0,
        attempt=1,
    )
    blobs.objects[f"{OUTPUT}plan.json"] = plan.model_dump_json().encode()
    for shard in range(shards):
        run = f"a0001-m{shard}"
        lines = b"".join(
            json.dumps({"index": index, "input": f"s3://bkt/{index}"}).encode() + b"\n"
            for index in plan.range(shard)
        )
        log = json.dumps({"event": "job_received", "shard": shard}).encode() + b"\n"
        files = {f".{run}.jsonl": lines, f".{run}.log": log}
        for suffix, data in files.items():
            blobs.put(shard_file(spec, DIGEST, shard, suffix), data, "text/plain")
        commit = Commit(
            run=run,
            results=[RunFile(name=f"{shard:06d}.{run}.jsonl", bytes=len(lines))],
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
    merging.open_claim(blobs, spec, DIGEST)  # as its planner does
    return spec, plan


def _merger(blobs: InMemoryBlobStore) -> tuple[Merger, Checkpoints]:
    checkpoints = Checkpoints(blobs, Ledger())
    return Merger(blobs, checkpoints, worker_info={}, device_hour_price=None), checkpoints


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
    monkeypatch.setattr("worker.sharding.merging.MERGE_CLAIM_S", 0.0)
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
