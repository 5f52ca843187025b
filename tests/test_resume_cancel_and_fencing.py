"""Resumable, cancellable and fenced jobs, in-process against the in-memory fakes: what
a delivery finds under a job's output decides what it runs and what it may write."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, run_daemon, slow_model_flags
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.in_process import (
    job_file,
    run_until_drained,
    run_while,
    sample_images,
    send_job,
    serving_settings,
)
from tests.support.jobs import following, job_output, send_jobs
from tests.support.paths import REPO
from tests.support.timing import wait_until
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon import Daemon, ExitCode
from worker.demo import upload_samples
from worker.jobs.checkpoints import CANCEL_MARKER, CHECKPOINT_PREFIX
from worker.jobs.intake import WAITED_FOR_THE_REPLACED
from worker.ports import S3Location


class CountingBlobs(InMemoryBlobStore):
    """Counts reads of each object; can act just before a chosen object is written."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.before_put: dict[str, Callable[[], None]] = {}

    def get(self, location: S3Location, max_bytes: int | None = None) -> bytes:
        self.reads[str(location)] += 1
        return super().get(location, max_bytes)

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        act = self.before_put.pop(str(location), None)
        if act is not None:
            act()
        return super().put(location, data, content_type, expect=expect)

    def inputs_read(self, uris: list[str]) -> int:
        return sum(self.reads[uri] for uri in uris)

    def names(self, job_id: str) -> list[str]:
        prefix = f"s3://bkt/out/{job_id}/"
        return sorted(uri.removeprefix(prefix) for uri in self.objects if uri.startswith(prefix))


def _parts(blobs: CountingBlobs, job_id: str) -> list[str]:
    return [name for name in blobs.names(job_id) if name.startswith(CHECKPOINT_PREFIX)]


def test_an_interrupted_job_resumes_from_its_checkpoint_and_ends_as_if_uninterrupted(
    tmp_path: Path,
) -> None:
    """A 40-item job is stopped part-way (SIGTERM, no grace): what it finished is saved
    as checkpoint parts and the job handed over as a new message (its receive count starts
    again, so interruptions do not spend maxReceiveCount). The next delivery reads only the inputs
    not done; its results.jsonl is byte for byte an uninterrupted run's, its job.log
    holds both deliveries' lines, job.json counts the attempt and the resumed items, and
    the parts are gone."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 40)
    send_job(source, "long", uris)
    first = Daemon(serving_settings(tmp_path, checkpoint_items=5, grace_seconds=0), source, blobs)

    def drive() -> None:
        wait_until(lambda: len(_parts(blobs, "long")) >= 4)  # 2 parts of 5 (and 2 logs)
        first.stop()

    assert run_while(first, drive) is ExitCode.SIGNALLED
    assert "job.json" not in blobs.names("long") and len(source) == 1
    # Handed over as a continuation: a fresh message, which knows the attempt before it.
    [continuation] = source.receive(1, 0, 0)
    assert (continuation.receive_count, continuation.earlier_attempts) == (1, 1)
    read_first = blobs.inputs_read(uris)

    run_until_drained(
        source, blobs, tmp_path, model="tests.support.slow_model:tenth_of_a_second", batch_size=1
    )
    summary = job_file(blobs, "long", "job.json")
    read_again = blobs.inputs_read(uris) - read_first
    assert summary["resumed"] >= 10 and read_again == 40 - summary["resumed"]
    # Deliveries: the first, the test's look at the continuation, the one that finished.
    assert (summary["attempt"], summary["status"], summary["items"]) == (3, "succeeded", 40)
    assert _parts(blobs, "long") == []
    received = [
        json.loads(line)
        for line in job_file(blobs, "long", "job.log").splitlines()
        if '"job_received"' in line
    ]
    assert [event["attempt"] for event in received] == [1, 3]

    send_job(source, "whole", uris)
    run_until_drained(
        source, blobs, tmp_path, model="tests.support.slow_model:tenth_of_a_second", batch_size=4
    )
    whole = blobs.objects["s3://bkt/out/whole/results.jsonl"]
    assert blobs.objects["s3://bkt/out/long/results.jsonl"] == whole


def test_a_job_already_done_is_acked_without_running_it_again(tmp_path: Path) -> None:
    """A second delivery of a finished job (the ack was lost, or the job was sent twice)
    reads no input and leaves job.json as it was; the same output with other inputs is
    a new job, and runs."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 6)
    send_job(source, "once", uris[:3])
    run_until_drained(source, blobs, tmp_path)
    summary = blobs.objects["s3://bkt/out/once/job.json"]
    read = blobs.inputs_read(uris)

    send_job(source, "once", uris[:3])
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_already_done"] == ["once"]
    assert blobs.inputs_read(uris) == read and len(source) == 0
    assert blobs.objects["s3://bkt/out/once/job.json"] == summary

    send_job(source, "once", uris[3:])
    run_until_drained(source, blobs, tmp_path)
    assert blobs.inputs_read(uris) == read + 3
    assert [r["input"] for r in job_file(blobs, "once", "results.jsonl")] == uris[3:]

    source.send(
        json.dumps(
            {
                "job_id": "once",
                "inputs": uris[3:],
                "output": "s3://bkt/out/once/",
                "params": {"top_k": 1},
            }
        )
    )
    run_until_drained(source, blobs, tmp_path)  # other params: another request
    assert blobs.inputs_read(uris) == read + 6
    assert len(job_file(blobs, "once", "results.jsonl")[0]["topk"]) == 1


def test_outputs_left_mixed_by_two_deliveries_are_redone_whole(tmp_path: Path) -> None:
    """job.json names the results.jsonl and job.log it completes by their ETags: when
    another delivery's results.jsonl has landed since (two deliveries raced, each fenced
    on one file), the job does not count as done, and the next delivery redoes it."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 3)
    send_job(source, "mixed", uris)
    run_until_drained(source, blobs, tmp_path)
    blobs.objects["s3://bkt/out/mixed/results.jsonl"] = b'{"index": 0, "from": "elsewhere"}\n'
    send_job(source, "mixed", uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert not [entry for entry in logs if entry["event"] == "job_already_done"]
    assert [r["input"] for r in job_file(blobs, "mixed", "results.jsonl")] == uris
    recorded = job_file(blobs, "mixed", "job.json")["outputs"]
    listed = blobs.objects_under(S3Location.parse("s3://bkt/out/mixed/"))
    assert recorded == {name: listed[name] for name in ("results.jsonl", "job.log")}


def test_a_job_stopped_without_moving_is_released_and_counts(tmp_path: Path) -> None:
    """A delivery that ran some of a job but finished none of it may be why the worker
    stops (a health check failing while it runs): its job is released, not handed over,
    so its receive counts and a job that can never move reaches the DLQ."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 2)
    send_job(source, "stuck", uris)
    daemon = Daemon(
        serving_settings(tmp_path, grace_seconds=0).model_copy(
            update={"model": "tests.support.slow_model:five_seconds"}
        ),
        source,
        blobs,
    )

    def drive() -> None:
        wait_until(lambda: blobs.inputs_read(uris) >= 1)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    [again] = source.receive(1, 0, 30)
    assert (again.receive_count, again.earlier_attempts) == (2, 0)


def test_an_array_job_stopped_part_way_is_released_and_counts(tmp_path: Path) -> None:
    """Results with array rows are not checkpointed (their rows live only on the machine
    that made them), so a delivery that finished only such results did not move its job
    forward: it is released, not handed over, and a job whose arrays can never be
    finished within a delivery reaches the DLQ instead of going round forever."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 12)
    send_job(source, "arrays", uris)
    settings = serving_settings(
        tmp_path,
        grace_seconds=0,
        postprocess="stages.postprocess:embedding",
        progress_interval_seconds=0.1,
    )
    daemon = Daemon(settings, source, blobs)
    progress = "s3://bkt/out/arrays/progress.json"

    def drive() -> None:
        wait_until(lambda: json.loads(blobs.objects.get(progress, b"{}")).get("finished", 0) >= 3)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    [again] = source.receive(1, 0, 30)
    assert (again.receive_count, again.earlier_attempts) == (2, 0)


def test_a_delivery_beaten_to_its_outputs_is_fenced_off_and_overwrites_nothing(
    tmp_path: Path,
) -> None:
    """Another delivery of the job (its lease had run out here unnoticed) writes the
    job's outputs while this one runs: this one's conditional write fails, it logs
    `job_fenced` and writes nothing more; its message, given back, is then found done."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 2)
    send_job(source, "other", uris)
    run_until_drained(
        source, blobs, tmp_path
    )  # "other" is what the newer delivery will have written
    theirs = {
        name: blobs.objects[f"s3://bkt/out/other/{name}"]
        for name in ("results.jsonl", "job.log", "job.json")
    }

    def newer_delivery_writes() -> None:
        for name, data in theirs.items():
            blobs.objects[f"s3://bkt/out/raced/{name}"] = data

    blobs.before_put["s3://bkt/out/raced/results.jsonl"] = newer_delivery_writes
    send_job(source, "raced", uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_fenced"] == ["raced"]
    assert [entry["job_id"] for entry in logs if entry["event"] == "job_already_done"] == ["raced"]
    for name, data in theirs.items():
        assert blobs.objects[f"s3://bkt/out/raced/{name}"] == data
    assert len(source) == 0


def test_a_job_cancelled_while_queued_is_acked_without_work(tmp_path: Path) -> None:
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 5)
    blobs.objects[f"s3://bkt/out/queued/{CANCEL_MARKER}"] = b"{}"
    send_job(source, "queued", uris)
    run_until_drained(source, blobs, tmp_path)
    summary = job_file(blobs, "queued", "job.json")
    assert (summary["status"], summary["items"], summary["succeeded"]) == ("cancelled", 5, 0)
    assert blobs.objects["s3://bkt/out/queued/results.jsonl"] == b""
    assert blobs.inputs_read(uris) == 0 and len(source) == 0

    send_job(source, "queued", uris)  # sent again while the cancel stands: cancelled again
    run_until_drained(source, blobs, tmp_path)
    assert blobs.inputs_read(uris) == 0 and len(source) == 0
    del blobs.objects[f"s3://bkt/out/queued/{CANCEL_MARKER}"]
    send_job(source, "queued", uris)  # the cancel withdrawn: it runs
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "queued", "job.json")["status"] == "succeeded"


def test_a_cancel_that_names_a_job_id_is_for_that_job_alone(tmp_path: Path) -> None:
    """`worker cancel --job-id`: a `cancel` naming another job is no cancel for this one
    (it runs, and the daemon logs it); one naming it is."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 3)
    for job_id, meant_for in (("other", "someone-else"), ("named", "named")):
        blobs.objects[f"s3://bkt/out/{job_id}/{CANCEL_MARKER}"] = json.dumps(
            {"job_id": meant_for}
        ).encode()
        send_job(source, job_id, uris)
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "other", "job.json")["status"] == "succeeded"
    assert job_file(blobs, "named", "job.json")["status"] == "cancelled"
    ignored = [e for e in logs if e["event"] == "cancel_for_another_job"]
    assert ignored and ignored[0]["cancel_job_id"] == "someone-else"


def test_a_running_job_is_cancelled_within_one_progress_interval(tmp_path: Path) -> None:
    """The job stops being fed; job.json says `cancelled` with what was finished, those
    results are in results.jsonl in input order, and the message is deleted."""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 60)
    send_job(source, "running", uris)
    # Few inputs fetched ahead of the model, so the cancel lands before all are read.
    settings = serving_settings(tmp_path, progress_interval_seconds=0.2, fetch_concurrency=2)
    daemon = Daemon(settings, source, blobs)
    asked_at: list[float] = []

    def drive() -> None:
        wait_until(lambda: blobs.inputs_read(uris) >= 5)
        blobs.objects[f"s3://bkt/out/running/{CANCEL_MARKER}"] = b"{}"
        asked_at.append(time.monotonic())
        wait_until(lambda: "s3://bkt/out/running/job.json" in blobs.objects)
        asked_at.append(time.monotonic())
        wait_until(lambda: len(source) == 0)
        daemon.stop()

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    assert asked_at[1] - asked_at[0] < 1.5  # one 0.2 s interval, and the writes
    summary = job_file(blobs, "running", "job.json")
    results = job_file(blobs, "running", "results.jsonl")
    assert summary["status"] == "cancelled" and 0 < summary["succeeded"] < 60
    assert len(results) == summary["succeeded"]
    assert [r["index"] for r in results] == sorted(r["index"] for r in results)
    assert blobs.inputs_read(uris) < 60


def _gets_of(proxy: FaultProxy, uris: list[str]) -> int:
    paths = {"/" + uri.removeprefix("s3://") for uri in uris}
    return sum(path in paths for path in proxy.paths("GET"))


@pytest.mark.e2e
def test_a_job_stopped_by_sigterm_resumes_without_spending_a_receive(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Against a moto server whose queue dead-letters a message on its second receive:
    a daemon stopped by SIGTERM with no grace checkpoints what it finished and hands the
    job over as a new message; the next daemon reads (through a counting proxy) only the
    inputs not done, nothing is dead-lettered, and no checkpoint is left."""
    stack = aws.stack(max_receive_count=1)
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=21))
    send_jobs(aws, stack, {"long": uris})
    args = daemon_args(stack, tmp_path, *slow_model_flags(1), "--grace-seconds", "0")
    first, again = FaultProxy(aws.endpoint), FaultProxy(aws.endpoint)
    with first.serving() as first_url:
        daemon = start_daemon(
            args, env={**aws.with_endpoint(first_url).env, "SLOW_MODEL_SECONDS_PER_BATCH": "0.1"}
        )
        daemon.wait_for("job_received")
        time.sleep(2.5)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.stderr[-3000:]
    output = job_output(stack, "long")
    assert "job.json" not in aws.names(output)
    assert any(name.startswith(CHECKPOINT_PREFIX) for name in aws.names(output))
    with again.serving() as again_url:
        run = run_daemon(aws.with_endpoint(again_url), [*args, "--drain"])
    assert run.returncode == 0, run.stderr[-3000:]
    summary = aws.summary(output)
    assert (summary["status"], summary["attempt"]) == ("succeeded", 2)
    assert summary["resumed"] > 0
    assert _gets_of(again, uris) == 40 - summary["resumed"]
    assert _gets_of(first, uris) >= summary["resumed"]
    assert [r["input"] for r in aws.results(output)] == uris
    assert not any(name.startswith(CHECKPOINT_PREFIX) for name in aws.names(output))
    assert aws.dead_letters(stack.dlq_url) == []


@pytest.mark.e2e
def test_a_continuation_runs_alone_when_its_sender_died_before_deleting_the_old_message(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGKILL between handing a job over and deleting its message: a daemon stopped by
    SIGTERM sends the continuation, its delete is held at the proxy, and the test kills
    it there, so both messages are in the queue, the old one visible again. The next
    daemon runs the continuation, which marks the message it replaces: that one,
    received after the mark, is acked unread; received before it, it is stopped within a
    progress interval (`job_handed_over_already`), and the continuation, seeing that the
    old lease has ended, waits that long before it runs. The job runs once, never two
    deliveries at the same time."""
    stack = aws.stack(visibility_timeout_s=3)
    uris = list(upload_samples(aws.s3, stack.bucket, 40, seed=24))
    send_jobs(aws, stack, {"split": uris})
    common = ["--visibility-timeout-seconds", "3", "--heartbeat-interval-seconds", "1"]
    proxy = FaultProxy(aws.endpoint)
    held = Fault("held_delete", lambda r: r.action == "DeleteMessage", kind="reset", delay_s=5)
    proxy.add(held)
    with proxy.serving() as proxy_url:
        first = start_daemon(
            daemon_args(
                stack, tmp_path / "first", *slow_model_flags(1), *common, "--grace-seconds", "0"
            ),
            env={**aws.with_endpoint(proxy_url).env, "SLOW_MODEL_SECONDS_PER_BATCH": "0.1"},
        )
        first.wait_for("job_received")
        time.sleep(1.5)
        first.send_signal(signal.SIGTERM)
        wait_until(lambda: proxy.requests("SendMessage") and proxy.requests("DeleteMessage"))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    gate = tmp_path / "old-message-acked"
    second = start_daemon(
        [
            *daemon_args(stack, tmp_path / "second", *slow_model_flags(4), *common),
            "--drain",
            "--progress-interval-seconds",
            "0.5",
        ],
        env={
            **aws.env,
            "SLOW_MODEL_SECONDS_PER_BATCH": "0.05",
            "SLOW_MODEL_GATE_FILE": str(gate),
        },
    )
    [old] = second.wait_for("job_handed_over_already", timeout_s=60)
    gate.touch()
    assert second.wait(60) == 0, second.stderr[-3000:]
    assert len(second.events("job_handed_over_already")) == 1
    [done] = second.events("job_finished")
    # Never two at once: if the old message ran at all, it had stopped before the
    # delivery that finished the job started (which waited for it: `job_deferred`).
    received = {event["message_id"]: event["timestamp"] for event in second.events("job_received")}
    if old["message_id"] in received:
        assert received[done["message_id"]] > old["timestamp"]
    summary = aws.summary(job_output(stack, "split"))
    waited = len(second.events("job_deferred"))  # a delivery of its own, counted
    assert (summary["status"], summary["attempt"]) == ("succeeded", 2 + waited)
    assert [r["input"] for r in aws.results(job_output(stack, "split"))] == uris
    assert aws.queue_depth(stack.queue_url) == (0, 0)


@pytest.mark.e2e
def test_a_daemon_that_lost_its_lease_is_fenced_off_by_the_newer_delivery(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """The first daemon cannot renew its lease (every renewal answers 500), so the
    message reappears and a second daemon finishes the job first (the first one's model
    waits for it). When the slow first one gets to its writes, they are refused
    (If-None-Match): it logs `job_fenced`, and the outputs stay the second daemon's."""
    stack = aws.stack(visibility_timeout_s=2)
    uris = list(upload_samples(aws.s3, stack.bucket, 4, seed=22))
    send_jobs(aws, stack, {"raced": uris})
    proxy = FaultProxy(aws.endpoint)
    proxy.fail("renewals", lambda request: request.action == "ChangeMessageVisibilityBatch", None)
    common = ["--visibility-timeout-seconds", "2", "--heartbeat-interval-seconds", "0.5"]
    gate = tmp_path / "fast-daemon-done"
    with proxy.serving() as proxy_url:
        slow = start_daemon(
            # One job at most: it does not take the message back when it reappears.
            daemon_args(stack, tmp_path / "slow", *slow_model_flags(4), *common, "--max-jobs", "1"),
            env={
                **aws.with_endpoint(proxy_url).env,
                "SLOW_MODEL_SECONDS_PER_BATCH": "0.5",
                "SLOW_MODEL_GATE_FILE": str(gate),
            },
        )
        slow.wait_for("job_received")
        fast = run_daemon(aws, [*daemon_args(stack, tmp_path / "fast", *common), "--drain"])
        assert fast.returncode == 0, fast.stderr[-3000:]
        gate.touch()
        [fenced] = slow.wait_for("job_fenced", timeout_s=60)
        slow.send_signal(signal.SIGTERM)
        assert slow.wait(30) == 0, slow.stderr[-3000:]
    assert fenced["job_id"] == "raced"
    summary = aws.summary(job_output(stack, "raced"))
    assert summary["worker"]["pid"] != slow.pid and summary["attempt"] == 2
    assert [r["input"] for r in aws.results(job_output(stack, "raced"))] == uris


@pytest.mark.e2e
def test_worker_cancel_stops_a_running_job_and_a_queued_one(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """`worker cancel --output` on a running job: the daemon stops it within a progress
    interval, writes job.json `cancelled` with what it finished, and deletes its message;
    `enqueue --wait` shows it. A job cancelled before it is received is acked unread.
    `--job-id` is refused for an output another job is writing."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 60, seed=23))  # 48 s of work
    running, queued = job_output(stack, "running"), job_output(stack, "queued")
    with following(aws, stack.queue_url, "running", running, *uris) as follower:
        # Few inputs fetched ahead of the slow model: those inside still run after a cancel.
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                *slow_model_flags(1),
                *("--progress-interval-seconds", "0.5", "--fetch-concurrency", "2", "--drain"),
            ),
            env={**aws.env, "SLOW_MODEL_SECONDS_PER_BATCH": "0.8"},
        )
        daemon.wait_for("job_received")
        _cancel(aws, queued)
        send_jobs(aws, stack, {"queued": uris})
        _wait_for_progress(aws, running)
        wrong_job = _cancel(aws, running, "--job-id", "queued", check=False)
        assert wrong_job.returncode == 1 and "job running's output" in wrong_job.stderr
        cancelled = _cancel(aws, running, "--job-id", "running", check=False)
        assert cancelled.returncode == 0, cancelled.stderr
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
        followed, _ = follower.communicate(timeout=30)
    assert follower.returncode == 1  # not succeeded
    assert json.loads(followed[followed.index("{") :])["status"] == "cancelled"
    summary = aws.summary(running)
    assert summary["status"] == "cancelled" and 0 < summary["succeeded"] < 60
    assert len(aws.results(running)) == summary["succeeded"]
    assert aws.summary(queued)["succeeded"] == 0 and aws.summary(queued)["status"] == "cancelled"
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    finished = _cancel(aws, running, check=False)
    assert finished.returncode == 1 and "nothing to cancel" in finished.stderr


def _cancel(
    aws: Aws, output: str, *flags: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", "cancel", "--output", output, "--reason", "test", *flags],
        env=aws.env,
        cwd=REPO,
        check=check,
        capture_output=True,
        text=True,
    )


def _wait_for_progress(aws: Aws, output: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(aws.s3.exceptions.NoSuchKey):
            aws.read(output, "progress.json")
            return
        time.sleep(0.2)
    raise AssertionError(f"no progress.json under {output}")


def test_a_job_that_reaches_the_lease_ceiling_moving_forward_is_handed_over(
    tmp_path: Path,
) -> None:
    """Each delivery may hold the job for 5 s (SQS's 12 h, shrunk): what it finished is
    checkpointed and the job handed over, so deliveries add up to the whole job. (Few
    fetch threads: items of a handed-over delivery already inside the stages still run,
    and with a 5 s lease they would eat much of the next delivery's time.)"""
    source, blobs = InMemoryJobSource(), CountingBlobs()
    uris = sample_images(blobs, 60)
    send_job(source, "endless", uris)
    with capture_logs() as logs:
        run_until_drained(
            source,
            blobs,
            tmp_path,
            model="tests.support.slow_model:tenth_of_a_second",
            batch_size=1,
            visibility_timeout_seconds=1,
            heartbeat_interval_seconds=0.2,
            max_lease_seconds=6,
            fetch_concurrency=2,
            progress_interval_seconds=0.5,
        )
    summary = job_file(blobs, "endless", "job.json")
    # Each continuation comes within the 1 s lease (and 5 s of clock skew) of the
    # delivery it replaces, so it waits once before it runs (`Intake._handed_over`).
    handed_over = [entry["reason"] for entry in logs if entry["event"] == "job_released"]
    assert len(handed_over) == summary["attempt"] - 1
    assert set(handed_over) == {"lease ceiling reached", WAITED_FOR_THE_REPLACED}
    assert summary["status"] == "succeeded" and summary["resumed"] > 0
