"""One job across the fleet (`worker.sharding.shards`), in this process against the
in-memory fakes: a job over its shard size is planned, its shards run and commit once,
and whoever commits the last merges what an unsharded run writes."""

from __future__ import annotations

import io
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError
from structlog.testing import capture_logs

from tests.support.faults import png_bytes
from tests.support.in_process import (
    assert_same_results,
    draining_settings,
    job_file,
    planned,
    run_until_drained,
    run_while,
    sample_images,
    serving_settings,
)
from tests.support.stagefns import GREY
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import Job, JobStalled, Phase
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.errors import TransientError
from worker.jobs.checkpoints import part_prefix, request_digest
from worker.jobs.plan import (
    Commit,
    Plan,
    RunFile,
    commit_file,
    shard_body,
    shard_file,
    watch_body,
)
from worker.loops.results import FINISH_ATTEMPTS
from worker.message import JobMessage
from worker.plugins.identity import ModelIdentity
from worker.ports import SQS_MAX_VISIBILITY_TIMEOUT_S

# job.json fields that differ between any two runs of a job.
RUN_FIELDS = {"received_at", "finished_at", "duration_s", "worker", "outputs", "device_s"}


def _send(source: InMemoryJobSource, job_id: str, inputs: list[str], **fields: Any) -> None:
    body = {"job_id": job_id, "inputs": inputs, "output": f"s3://bkt/out/{job_id}/", **fields}
    source.send(json.dumps(body))


def _names_under(blobs: InMemoryBlobStore, job_id: str) -> set[str]:
    prefix = f"s3://bkt/out/{job_id}/"
    return {uri.removeprefix(prefix) for uri in blobs.objects if uri.startswith(prefix)}


def test_a_sharded_job_ends_as_its_unsharded_run_does(tmp_path: Path) -> None:
    """23 inputs in shards of 5: five shard messages, and then the same results.jsonl
    (lines, order, scores but for their batches' last digits) and job.json (fields,
    plus `shards`) as the job run whole; nothing of the shards is left but plan.json."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 23)
    inputs[7] = "s3://bkt/img/missing"  # an input's error lands in its place too
    _send(source, "whole", inputs)
    _send(source, "split", inputs, shard_items=5)
    run_until_drained(source, blobs, tmp_path)

    whole, split = job_file(blobs, "whole", "job.json"), job_file(blobs, "split", "job.json")
    assert_same_results(
        job_file(blobs, "split", "results.jsonl"), job_file(blobs, "whole", "results.jsonl")
    )
    assert split["shards"] == {"count": 5, "attempts": 5}
    own = RUN_FIELDS | {"job_id"}
    assert {key: value for key, value in split.items() if key not in own | {"shards"}} == {
        key: value for key, value in whole.items() if key not in own
    }
    assert split["status"] == "partial" and split["failed"] == 1
    assert split["device_s"] > 0
    assert _names_under(blobs, "split") - {"progress.json"} == {
        "results.jsonl",
        "job.log",
        "job.json",
        "plan.json",
    }
    assert Plan.model_validate_json(blobs.objects["s3://bkt/out/split/plan.json"]).shards == 5
    assert job_file(blobs, "split", "job.log").count('"job_received"') == 5
    assert len(source) == 0 and not source.dead_letters


def test_a_manifest_job_is_planned_from_its_stream(tmp_path: Path) -> None:
    """A manifest over the shard size is planned without being held whole (a message
    may ask for smaller shards, not larger): each shard's inputs go under the output,
    and the merged results list every input in order."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 12)
    blobs.objects["s3://bkt/list.txt"] = ("\n".join(inputs) + "\n").encode()
    source.send(
        json.dumps(
            {
                "job_id": "listed",
                "manifest": "s3://bkt/list.txt",
                "output": "s3://bkt/out/listed/",
                "shard_items": 1000,  # larger than the worker's: the worker's stands
            }
        )
    )
    run_until_drained(source, blobs, tmp_path, shard_items=4)
    results = job_file(blobs, "listed", "results.jsonl")
    assert [(line["index"], line["input"]) for line in results] == list(enumerate(inputs))
    assert job_file(blobs, "listed", "job.json")["shards"]["count"] == 3


def test_a_cancel_stops_every_shard_and_the_job_says_cancelled(tmp_path: Path) -> None:
    """A `cancel` under the output is seen by each shard at its admission: the job ends
    `cancelled`, with no results, once, from the merge."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 6)
    blobs.objects["s3://bkt/out/stopped/cancel"] = b""
    _send(source, "stopped", inputs, shard_items=2)
    run_until_drained(source, blobs, tmp_path)
    summary = job_file(blobs, "stopped", "job.json")
    assert (summary["status"], summary["succeeded"], summary["shards"]["count"]) == (
        "cancelled",
        0,
        3,
    )
    assert job_file(blobs, "stopped", "results.jsonl") == []


def test_forged_shard_messages_are_poison_and_change_nothing(tmp_path: Path) -> None:
    """A shard message is checked against the plan under the output it names: with no
    plan, another request's, a number past the plan's shards, inputs or params that are
    not the plan's, it is dead-lettered, and the finished job is untouched."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "real", inputs, shard_items=2)
    run_until_drained(source, blobs, tmp_path)
    digest = job_file(blobs, "real", "job.json")["request_digest"]
    results = blobs.objects["s3://bkt/out/real/results.jsonl"]
    blobs.objects["s3://bkt/forged.txt"] = inputs[0].encode()

    def forged(output: str, shard: dict[str, Any], manifest: str = "s3://bkt/forged.txt") -> str:
        return json.dumps(
            {"job_id": "real", "manifest": manifest, "output": output, "shard": shard}
        )

    source.send(forged("s3://bkt/out/nothing/", {"index": 0, "plan": digest}))
    source.send(forged("s3://bkt/out/real/", {"index": 0, "plan": "0" * 16}))
    source.send(forged("s3://bkt/out/real/", {"index": 9, "plan": digest}))
    source.send(forged("s3://bkt/out/real/", {"index": 0, "plan": digest}))
    own_inputs = f"s3://bkt/out/real/shards/{digest}/000000.inputs"
    other_params = json.loads(
        forged("s3://bkt/out/real/", {"index": 0, "plan": digest}, own_inputs)
    )
    source.send(json.dumps({**other_params, "params": {"top_k": 1}}))
    run_until_drained(source, blobs, tmp_path)
    reasons = sorted(reason for _, reason in source.dead_letters)
    assert len(reasons) == 5, reasons
    assert any("no plan.json" in reason for reason in reasons)
    assert any("replaced by another request" in reason for reason in reasons)
    assert sum("not a shard of the job" in reason for reason in reasons) == 3
    assert blobs.objects["s3://bkt/out/real/results.jsonl"] == results


class _SendFailsOnce(InMemoryJobSource):
    """A queue whose second `send_many` fails once; it counts the shards sent."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.shards_sent: list[int] = []

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("SendMessageBatch unreachable (fake)")
        self.shards_sent += [json.loads(body)["shard"]["index"] for body in bodies]
        super().send_many(bodies, group, delay_s)


def test_a_redelivered_job_sends_only_the_shards_not_yet_sent(tmp_path: Path) -> None:
    """The planner dies between its two batches of shard messages (the send fails): the
    job's message comes back, finds its plan, and sends only the second batch; each
    shard runs once and the job ends whole."""
    source, blobs = _SendFailsOnce(), InMemoryBlobStore()
    inputs = sample_images(blobs, 24)
    _send(source, "resent", inputs, shard_items=2)
    run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert sorted(source.shards_sent) == list(range(12))
    assert job_file(blobs, "resent", "job.json")["shards"] == {"count": 12, "attempts": 12}
    assert [line["index"] for line in job_file(blobs, "resent", "results.jsonl")] == list(range(24))


class _DeliversTwice(InMemoryJobSource):
    """A queue that delivers every shard message twice (at-least-once, at its worst)."""

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        super().send_many(bodies + bodies, group, delay_s)


def test_a_shard_delivered_twice_counts_once_and_leaves_nothing(tmp_path: Path) -> None:
    """Each shard runs twice at once: one run's commit stands; the other finds the marker
    written, removes what it wrote, and is deleted; the job's results hold each input
    once and nothing of the duplicates is left under the output."""
    source, blobs = _DeliversTwice(), InMemoryBlobStore()
    inputs = sample_images(blobs, 9)
    _send(source, "twice", inputs, shard_items=3)
    run_until_drained(source, blobs, tmp_path)
    assert [line["index"] for line in job_file(blobs, "twice", "results.jsonl")] == list(range(9))
    assert job_file(blobs, "twice", "job.json")["shards"]["count"] == 3
    assert _names_under(blobs, "twice") - {"progress.json"} == {
        "results.jsonl",
        "job.log",
        "job.json",
        "plan.json",
    }
    assert len(source) == 0 and not source.dead_letters


class _ComposeFails(InMemoryBlobStore):
    """A store whose first `failures` composes fail, as S3 does when it is throttled."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def compose(self, location: Any, sources: Any, content_type: str, **kwargs: Any) -> str:
        if self.failures:
            self.failures -= 1
            raise TransientError("SlowDown (fake)")
        return super().compose(location, sources, content_type, **kwargs)


class _ComposesTimed(InMemoryBlobStore):
    """A store whose composes take a tenth of a second each, and that keeps when each
    began and ended."""

    def __init__(self) -> None:
        super().__init__()
        self.composes: list[tuple[float, float]] = []

    def compose(self, location: Any, sources: Any, content_type: str, **kwargs: Any) -> str:
        began = time.monotonic()
        time.sleep(0.1)
        etag = super().compose(location, sources, content_type, **kwargs)
        self.composes.append((began, time.monotonic()))
        return etag


def test_a_merge_writes_its_outputs_one_after_another(tmp_path: Path) -> None:
    """A merge's outputs are written one after another: two mergers at once (the last
    two shards committed together) writing them side by side could each win one file
    and lose the other, and both stop with the job never finished (seen in CI)."""
    source, blobs = InMemoryJobSource(), _ComposesTimed()
    _send(source, "in-turn", sample_images(blobs, 4), shard_items=2)
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "in-turn", "job.json")["status"] == "succeeded"
    spans = sorted(blobs.composes)
    assert len(spans) == 2  # results.jsonl, job.log
    assert all(ended <= began for (_, ended), (began, _) in itertools.pairwise(spans))


def test_a_merge_that_fails_is_done_by_the_last_shards_redelivery(tmp_path: Path) -> None:
    """The merge keeps failing (past the finish's tries): the last shard's message is
    released with its commit standing, and its next delivery finds it committed and
    merges; the job ends whole, once."""
    source, blobs = InMemoryJobSource(), _ComposeFails(FINISH_ATTEMPTS)
    inputs = sample_images(blobs, 6)
    _send(source, "merged-later", inputs, shard_items=3)
    run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert blobs.failures == 0
    summary = job_file(blobs, "merged-later", "job.json")
    assert (summary["status"], summary["shards"]["count"]) == ("succeeded", 2)
    assert [line["index"] for line in job_file(blobs, "merged-later", "results.jsonl")] == list(
        range(6)
    )
    assert _names_under(blobs, "merged-later") - {"progress.json"} == {
        "results.jsonl",
        "job.log",
        "job.json",
        "plan.json",
    }


def test_a_job_sent_again_in_the_other_format_is_another_request(tmp_path: Path) -> None:
    """The same inputs sent again as Parquet are planned again (the format is part of
    the request's digest) and end as Parquet files; a late watch of the job that asks
    for its format, or for none (sent before watches carried it), finds it done and
    changes nothing; one asking for another format is poison."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    # Three daemons started: small batches (a short warm-up) and one preprocessing process.
    quick = {"batch_size": 2, "preprocess_workers": 1}
    _send(source, "twice", inputs, shard_items=2)
    run_until_drained(source, blobs, tmp_path, **quick)
    as_lines = job_file(blobs, "twice", "job.json")
    _send(source, "twice", inputs, shard_items=2, format="parquet")
    run_until_drained(source, blobs, tmp_path, **quick)
    as_table = job_file(blobs, "twice", "job.json")
    assert as_table["format"] == "parquet"
    assert as_table["request_digest"] != as_lines["request_digest"]
    assert [name for name in as_table["outputs"] if name.startswith("results/")] == [
        "results/part-000000-0000.parquet"  # the shards' joined, as a run alone writes it
    ]
    written = dict(blobs.objects)
    watch = {
        "job_id": "twice",
        "output": "s3://bkt/out/twice/",
        "watch": as_table["request_digest"],
    }
    source.send(json.dumps({**watch, "format": "parquet"}))
    source.send(json.dumps(watch))  # sent before watches carried the format: the plan's
    source.send(json.dumps({**watch, "format": "jsonl"}))
    run_until_drained(source, blobs, tmp_path, **quick)
    ((_, reason),) = source.dead_letters
    assert "a jsonl message for a job planned as parquet" in reason
    assert {uri: data for uri, data in blobs.objects.items() if "progress" not in uri} == {
        uri: data for uri, data in written.items() if "progress" not in uri
    }


def test_a_commit_marker_written_before_parquet_results_still_reads() -> None:
    """A rolling upgrade: a merger reads the markers older workers wrote."""
    older = {
        "run": "a0001-m",
        "results": "000003.a0001-m.jsonl",
        "results_bytes": 120,
        "log": "000003.a0001-m.log",
        "log_bytes": 40,
        "cancelled": False,
        "succeeded": 2,
        "failed": 0,
        "resumed": 0,
        "attempt": 1,
        "device_s": 0.5,
        "seconds": 3.0,
    }
    commit = Commit.model_validate_json(json.dumps(older))
    assert commit.results == [RunFile(name="000003.a0001-m.jsonl", bytes=120)]
    assert commit.log == RunFile(name="000003.a0001-m.log", bytes=40)
    with pytest.raises(ValidationError):
        Commit.model_validate_json(json.dumps({**older, "results_bytes": -1}))


def test_a_shard_planned_for_another_model_is_left_for_a_worker_of_that_model(
    tmp_path: Path,
) -> None:
    """A rollout: a shard whose plan names another model than the worker's is released,
    with a delay, for a worker of that model: not run, not dead-lettered, nothing of it
    written."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    model = {"name": "next", "version": "2", "digest": "sha256:" + "0" * 64}
    spec, plan = planned(blobs, "rollout", sample_images(blobs, 4), model)
    source.send(shard_body(spec, plan, 0))
    written = dict(blobs.objects)
    daemon = Daemon(serving_settings(tmp_path), source, blobs)
    with capture_logs() as logs:

        def drive() -> None:
            wait_until(lambda: any(entry["event"] == "job_released" for entry in logs))
            daemon.stop()

        assert run_while(daemon, drive) is ExitCode.SIGNALLED
    (released,) = [entry for entry in logs if entry["event"] == "job_released"]
    assert "planned for model" in released["reason"] and released["retry_in_s"] > 0
    assert len(source) == 1 and not source.dead_letters
    assert blobs.objects == written


def test_a_job_with_a_dead_lettered_shard_waits_for_its_redrive_then_ends_whole(
    tmp_path: Path,
) -> None:
    """A shard whose results its model's columns cannot hold is dead-lettered, and noted
    so; the others commit, and the job's watch, finding only that shard left, stops
    (`job_stalled`) where it went on for ever. Redriven once the postprocessor is mended,
    the shard commits, and the job ends whole, as if nothing had happened: its shards'
    files joined into one, the score column the floats the mended postprocessor gives
    (the other shards' integers among them)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    blobs.objects["s3://bkt/img/grey"] = png_bytes(Image.new("RGB", (64, 64), (GREY,) * 3))
    inputs.append("s3://bkt/img/grey")  # shard 2's only input
    _send(source, "stalled", inputs, shard_items=2, format="parquet")
    model, support = "tests.support.stagefns:pixel_embedder", "tests.support.stagefns"
    with capture_logs() as logs:
        run_until_drained(
            source,
            blobs,
            tmp_path,
            model=model,
            postprocess=f"{support}:float_for_grey",
        )
    ((dead, reason),) = source.dead_letters
    assert "score: int64" in reason
    (stalled,) = [entry for entry in logs if entry["event"] == "job_stalled"]
    assert stalled["shards_left"] == [2] and "score: int64" in stalled["reason"]
    left = _names_under(blobs, "stalled")
    assert "job.json" not in left and len(source) == 0
    assert {name.split("/", 2)[2] for name in left if name.startswith("shards/")} >= {
        "commits/000000.commit",
        "commits/000001.commit",
        "000002.dead",
    }
    assert not any(name.endswith("/watch") for name in left)

    source.send(dead.body)  # redriven, with the postprocessor mended
    run_until_drained(source, blobs, tmp_path, model=model, postprocess=f"{support}:float_always")
    summary = job_file(blobs, "stalled", "job.json")
    assert (summary["status"], summary["items"], summary["shards"]["count"]) == ("succeeded", 5, 3)
    joined = blobs.objects["s3://bkt/out/stalled/results/part-000000-0000.parquet"]
    scores = pq.read_table(io.BytesIO(joined)).column("score")
    assert scores.type == pa.float64() and len(scores) == 5
    assert _names_under(blobs, "stalled") - {"progress.json"} == {
        "job.json",
        "job.log",
        "plan.json",
        "results/part-000000-0000.parquet",  # the shards' joined, its scores as floats
    }


def test_a_shard_that_breaks_workers_is_dead_lettered_and_its_job_waits_for_it(
    tmp_path: Path,
) -> None:
    """A shard whose items were in the failing work of three workers that broke is
    dead-lettered with the reason, as a whole job would be, and noted dead; the job's
    other shard commits, and its watch stops."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    model = job_file(blobs, "probe", "job.json")["model"]
    spec, plan = planned(blobs, "breaks", inputs, model)
    source.send(shard_body(spec, plan, 0))
    source.send(shard_body(spec, plan, 1), broke_workers=3, breakage="CUDA error: an illegal")
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    ((_, reason),) = source.dead_letters
    assert "3 workers broke" in reason and "CUDA error" in reason
    assert [entry["shards_left"] for entry in logs if entry["event"] == "job_stalled"] == [[1]]
    shards = f"s3://bkt/out/breaks/shards/{plan.request_digest}/"
    assert json.loads(blobs.objects[shards + "000001.dead"])["reason"] == reason
    assert shards + "commits/000000.commit" in blobs.objects and len(source) == 0


def test_a_planner_that_finds_another_s_plan_writes_that_plan_s_shards(tmp_path: Path) -> None:
    """A rollout: a worker with shards of 2 finds the plan.json that one with shards of 3
    wrote before it died, no inputs file written. It writes the files as that plan splits
    the job, not by its own size, sends those shards, and the job ends whole."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 7)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    model = job_file(blobs, "probe", "job.json")["model"]
    plan = Plan(
        job_id="rolled",
        request_digest=request_digest(
            inputs,
            None,
            JobMessage(inputs=inputs, output="s3://results/rolled/"),
            ModelIdentity(**model),
        ),
        items=7,
        shard_items=3,
        model=model,
        params={},
        received_at=time.time(),
        attempt=1,
    )
    blobs.objects["s3://bkt/out/rolled/plan.json"] = plan.model_dump_json().encode()
    _send(source, "rolled", inputs, shard_items=2)
    run_until_drained(source, blobs, tmp_path)
    summary = job_file(blobs, "rolled", "job.json")
    assert (summary["status"], summary["shards"]["count"]) == ("succeeded", 3)
    assert [line["input"] for line in job_file(blobs, "rolled", "results.jsonl")] == inputs
    assert not source.dead_letters


def test_a_job_whose_last_shard_is_lost_stops_being_watched(tmp_path: Path) -> None:
    """A shard duplicated already, none of whose runs started for longer than a run can
    last (its messages moved to the DLQ by the queue's redrive policy, unseen by any
    worker): the watch stops (`job_stalled`, naming it) where it came back for ever."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    spec, plan = planned(blobs, "lost", inputs, job_file(blobs, "probe", "job.json")["model"])
    long_ago = {"at": time.time() - 2 * SQS_MAX_VISIBILITY_TIMEOUT_S}  # the default lease ceiling
    blobs.objects[str(shard_file(spec, plan.request_digest, 1, ".started"))] = json.dumps(
        long_ago
    ).encode()
    blobs.objects[str(shard_file(spec, plan.request_digest, 1, ".duplicated"))] = b""
    source.send(shard_body(spec, plan, 0))
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    (stalled,) = [entry for entry in logs if entry["event"] == "job_stalled"]
    assert stalled["shards_left"] == [1] and "no run of shards [1]" in stalled["reason"]
    assert "s3://bkt/out/lost/job.json" not in blobs.objects and len(source) == 0


def test_a_job_whose_shards_all_die_before_any_commit_says_it_stalled(tmp_path: Path) -> None:
    """Both shards of a job break workers and are dead-lettered before either commits:
    each death arms a watch, which says the job stalled, in the log and in its
    progress.json, so the client stops waiting and says why (where nothing watched it,
    and its producer waited for ever)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    spec, plan = planned(blobs, "doomed", inputs, job_file(blobs, "probe", "job.json")["model"])
    for shard in range(plan.shards):
        source.send(shard_body(spec, plan, shard), broke_workers=3, breakage="CUDA error")
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert len(source.dead_letters) == 2 and len(source) == 0
    (stalled,) = [entry for entry in logs if entry["event"] == "job_stalled"]
    assert stalled["shards_left"] == [0, 1] and "3 workers broke" in stalled["reason"]
    progress = json.loads(job_file(blobs, "doomed", "progress.json"))
    assert progress["stalled"]["shards"] == [0, 1] and progress["job_id"] == "doomed"
    job = Job(blobs, "s3://bkt/out/doomed/", "doomed")
    status = job.status()
    assert status.phase is Phase.STALLED and status.stalled is not None
    assert "shards [0, 1] cannot run" in status.stalled and "CUDA error" in status.stalled
    with pytest.raises(JobStalled, match="3 workers broke"):
        job.wait(timeout_s=5, poll_s=0.01)


def test_a_shard_whose_message_is_gone_before_it_starts_gets_a_duplicate(tmp_path: Path) -> None:
    """A shard's message moved to the DLQ by the queue's redrive policy before any run
    of it began (here: never sent), so no worker noted it. Once nothing else of the job
    runs, a watch sends the shard again, and the job ends whole. Before, the watch
    waited for every shard to start, and came back for ever. A watch found superseded
    (the marker due later than it) ends, and a commit replaces a watch due later than
    the one it arms (here: one due in 15 minutes, as before any commit)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    spec, plan = planned(blobs, "gone", inputs, job_file(blobs, "probe", "job.json")["model"])
    marker = f"s3://bkt/out/gone/shards/{plan.request_digest}/watch"
    blobs.objects[marker] = json.dumps({"due": time.time() + 900}).encode()
    source.send(watch_body(spec, plan))  # due now, so superseded
    source.send(shard_body(spec, plan, 0))
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    events = [entry["event"] for entry in logs]
    assert events.count("watch_superseded") == 1
    (duplicated,) = [entry for entry in logs if entry["event"] == "shard_duplicated"]
    assert (duplicated["shard"], duplicated["why"]) == (1, "never started")
    summary = job_file(blobs, "gone", "job.json")
    assert (summary["status"], summary["shards"]["count"]) == ("succeeded", 2)
    assert [line["input"] for line in job_file(blobs, "gone", "results.jsonl")] == inputs
    assert len(source) == 0 and not source.dead_letters


def test_every_shard_whose_message_is_gone_gets_a_duplicate_one_a_watch(tmp_path: Path) -> None:
    """Two shards whose messages are gone, one of them duplicated already and its
    duplicate gone too (the same crash before any run began): a watch still sends the
    other once nothing of the job runs; it commits, and the job waits for the first."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 6)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    spec, plan = planned(blobs, "gone2", inputs, job_file(blobs, "probe", "job.json")["model"])
    duplicated = {"at": time.time()}
    blobs.objects[str(shard_file(spec, plan.request_digest, 1, ".duplicated"))] = json.dumps(
        duplicated
    ).encode()
    source.send(shard_body(spec, plan, 0))
    # Of the probe's model; stopped here, as the job's watch comes back while it waits.
    daemon = Daemon(draining_settings(tmp_path), source, blobs)
    commit = str(commit_file(spec, plan.request_digest, 2))
    with capture_logs() as logs:

        def drive() -> None:
            wait_until(lambda: commit in blobs.objects)
            daemon.stop()

        assert run_while(daemon, drive) is ExitCode.SIGNALLED
    duplicates = [(e["shard"], e["why"]) for e in logs if e["event"] == "shard_duplicated"]
    assert duplicates == [(2, "never started")]
    assert "s3://bkt/out/gone2/job.json" not in blobs.objects


def test_a_shards_checkpoint_parts_are_its_own(tmp_path: Path) -> None:
    """Each shard reads and removes its own checkpoint parts alone: shard 1 runs first
    (its finish removed every shard's parts), then shard 0, sent by the watch shard 1's
    commit armed, resumes from what its earlier run saved; the job's log holds what
    that run logged once (every shard folded in every other's)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    inputs = sample_images(blobs, 4)
    _send(source, "probe", inputs[:1])  # for the worker's model identity
    run_until_drained(source, blobs, tmp_path)
    probed = job_file(blobs, "probe", "results.jsonl")[0]
    spec, plan = planned(blobs, "own", inputs, job_file(blobs, "probe", "job.json")["model"])
    part = f"s3://bkt/out/own/{part_prefix(plan.request_digest, 0)}0001-earlier-00001"
    blobs.objects[f"{part}.jsonl"] = json.dumps(probed).encode() + b"\n"  # input 0's result
    blobs.objects[f"{part}.log"] = b'{"event": "SHARD_ZERO_EARLIER_RUN"}\n'
    source.send(shard_body(spec, plan, 1))
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [e["resumed"] for e in logs if e["event"] == "job_received"] == [0, 1]
    assert job_file(blobs, "own", "job.json")["resumed"] == 1
    assert job_file(blobs, "own", "job.log").count("SHARD_ZERO_EARLIER_RUN") == 1
    assert job_file(blobs, "own", "results.jsonl")[0] == probed
