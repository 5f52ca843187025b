"""The daemon in-process against the in-memory fakes. Bad inputs and poison messages
fail alone; intake pulls on demand, within --max-jobs, and feeds the jobs it holds in
turn; failed receives, downloads, uploads, dead-letter sends and releases are tried
again or given back, never blamed on an input; finished jobs are announced; a lost
lease is neither renewed nor acked; a loop that raises, or a chain's postprocessor
that fails known-good input, stops the daemon. At start: the model is warmed up before
the first receive, within the set-up limits, one inference process per device."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from stages.synthetic import samples
from tests.support.faults import BREAK_MODEL_FILE, blank_png
from tests.support.in_process import (
    breaking_settings,
    draining_settings,
    job_file,
    run_until_drained,
    sample_images,
    send_job,
)
from tests.support.markers import also_on_gpu, needs_gpu
from tests.support.paths import REPO
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.engine import StageSetupTimeout
from worker.errors import TransientError
from worker.loops import intake, results
from worker.plugins import PluginError
from worker.ports import ByteRange, ReceivedMessage, S3Location
from worker.retry import Backoff
from worker.settings import Settings
from worker.telemetry.timeline import Timeline


class CountingSource(InMemoryJobSource):
    """Remembers the most messages it ever had out at once."""

    def __init__(self) -> None:
        super().__init__()
        self.out = 0
        self.most_out = 0
        self.asked: list[int] = []

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        self.asked.append(max_messages)
        received = super().receive(max_messages, wait_s, visibility_timeout_s)
        self.out += len(received)
        self.most_out = max(self.most_out, self.out)
        return received

    def ack(self, receipt_handle: str) -> None:
        super().ack(receipt_handle)
        self.out -= 1


def test_bad_inputs_fail_alone_and_the_job_is_partial(tmp_path: Path) -> None:
    """A corrupt file, a truncated JPEG, a missing key and a decompression bomb each get
    an error record; the other items of the job and other jobs are untouched."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    good = sample_images(blobs, 4)
    jpeg = next(data for _, data in samples(10, seed=9) if data[:2] == b"\xff\xd8")
    blobs.objects["s3://bkt/bad/garbage"] = b"definitely not an image"
    blobs.objects["s3://bkt/bad/truncated"] = jpeg[: len(jpeg) // 3]
    blobs.objects["s3://bkt/bad/bomb"] = blank_png(30_000, 30_000)
    inputs = [
        good[0],
        "s3://bkt/bad/garbage",
        good[1],
        "s3://bkt/bad/missing",
        "s3://bkt/bad/truncated",
        "s3://bkt/bad/bomb",
        good[2],
    ]
    source.send(json.dumps({"job_id": "mixed", "inputs": inputs, "output": "s3://bkt/out/mixed/"}))
    source.send(
        json.dumps({"job_id": "clean", "inputs": [good[3]], "output": "s3://bkt/out/clean/"})
    )
    run_until_drained(source, blobs, tmp_path)

    results = job_file(blobs, "mixed", "results.jsonl")
    assert [r["input"] for r in results] == inputs
    failed = {r["index"]: r["error"] for r in results if "error" in r}
    assert set(failed) == {1, 3, 4, 5}
    assert failed[3]["type"] == "MissingObject"
    assert failed[5]["type"] == "ImageTooLarge"
    assert all("label" in r for r in results if r["index"] in {0, 2, 6})
    summary = job_file(blobs, "mixed", "job.json")
    assert (summary["status"], summary["succeeded"], summary["failed"]) == ("partial", 3, 4)
    assert job_file(blobs, "clean", "job.json")["status"] == "succeeded"
    assert job_file(blobs, "mixed", "job.log").count('"item_failed"') == 4
    assert len(source) == 0


def test_objects_over_their_byte_limits_are_not_read(tmp_path: Path) -> None:
    """An input over --max-input-bytes is that input's error, with its size and the
    limit; a manifest over --max-manifest-bytes makes its message poison, with the
    reason; the other inputs and jobs are untouched."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    good = sample_images(blobs, 2)
    limit = max(len(blobs.objects[uri]) for uri in good)
    blobs.objects["s3://bkt/big"] = bytes(limit + 1)
    blobs.objects["s3://bkt/list.txt"] = "\n".join(good * 200).encode()
    inputs = [good[0], "s3://bkt/big", good[1]]
    source.send(json.dumps({"job_id": "sizes", "inputs": inputs, "output": "s3://bkt/out/sizes/"}))
    source.send(json.dumps({"manifest": "s3://bkt/list.txt", "output": "s3://bkt/out/long/"}))
    run_until_drained(source, blobs, tmp_path, max_input_bytes=limit, max_manifest_bytes=1000)
    results = job_file(blobs, "sizes", "results.jsonl")
    assert results[1]["error"] == {
        "type": "ObjectTooLarge",
        "message": f"too large: {limit + 1} bytes, limit {limit}",
    }
    assert "label" in results[0] and "label" in results[2]
    [(_, reason)] = source.dead_letters
    manifest_bytes = len(blobs.objects["s3://bkt/list.txt"])
    assert reason == f"manifest s3://bkt/list.txt is too large: {manifest_bytes} bytes, limit 1000"


def test_poison_messages_are_dead_lettered_and_the_daemon_goes_on(tmp_path: Path) -> None:
    """Broken messages go to the DLQ with a reason; good jobs around them still finish."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    good = sample_images(blobs, 1)
    blobs.objects["s3://bkt/empty.txt"] = b"\n"
    source.send("{not json")
    source.send(
        json.dumps({"job_id": "../../etc/passwd", "inputs": good, "output": "s3://bkt/out/x/"})
    )
    source.send(json.dumps({"manifest": "s3://bkt/empty.txt", "output": "s3://bkt/out/x/"}))
    source.send(json.dumps({"manifest": "s3://bkt/none.txt", "output": "s3://bkt/out/x/"}))
    source.send(json.dumps({"inputs": good, "output": "s3://elsewhere/out/x/"}))
    source.send(json.dumps({"job_id": "fine", "inputs": good, "output": "s3://bkt/out/fine/"}))
    run_until_drained(source, blobs, tmp_path, allowed_buckets=frozenset({"bkt"}))
    reasons = sorted(reason for _, reason in source.dead_letters)
    assert len(reasons) == 5
    assert any("not UTF-8 JSON" in r for r in reasons)
    assert any("job_id" in r for r in reasons)
    assert any("no inputs" in r for r in reasons)
    assert any("does not exist" in r for r in reasons)
    assert any("not allowed: elsewhere" in r for r in reasons)
    assert job_file(blobs, "fine", "job.json")["status"] == "succeeded"
    assert len(source) == 0


def test_pulls_on_demand_and_never_holds_more_than_max_jobs(tmp_path: Path) -> None:
    """With 40 one-item jobs queued, the daemon never holds more than max_jobs messages
    and never asks for more than it has room for; results are packed across jobs."""
    source, blobs = CountingSource(), InMemoryBlobStore()
    uris = sample_images(blobs, 40)
    for number, uri in enumerate(uris):
        source.send(
            json.dumps(
                {"job_id": f"j{number}", "inputs": [uri], "output": f"s3://bkt/out/j{number}/"}
            )
        )
    run_until_drained(source, blobs, tmp_path, max_jobs=5, batch_size=4, prefetch_batches=1)
    assert 0 < source.most_out <= 5
    assert max(source.asked) <= 5
    for number, uri in enumerate(uris):
        [result] = job_file(blobs, f"j{number}", "results.jsonl")
        assert result["input"] == uri
    assert len(source) == 0


class FlakySource(InMemoryJobSource):
    """Fails its first receive the way an SQS outage would."""

    def __init__(self) -> None:
        super().__init__()
        self.failures_left = 1

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("sqs unreachable")
        return super().receive(max_messages, wait_s, visibility_timeout_s)


def test_failed_receive_is_not_an_empty_queue(tmp_path: Path) -> None:
    """In drain mode a receive that fails backs off and tries again instead of exiting
    as if the queue were empty."""
    source, blobs = FlakySource(), InMemoryBlobStore()
    [uri] = sample_images(blobs, 1)
    source.send(
        json.dumps(
            {"job_id": "after-outage", "inputs": [uri], "output": "s3://bkt/out/after-outage/"}
        )
    )
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "after-outage", "job.json")["status"] == "succeeded"


def test_finished_jobs_are_announced_on_the_notify_queue(tmp_path: Path) -> None:
    """With a notification target, each finished job's summary (its job.json) is sent
    once it is complete; a send that fails is logged and leaves the job's message, whose
    next delivery finds job.json not announced and sends it (at least once)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    uris = sample_images(blobs, 2)
    for job_id, uri in zip(["first", "second"], uris, strict=True):
        source.send(
            json.dumps({"job_id": job_id, "inputs": [uri], "output": f"s3://bkt/out/{job_id}/"})
        )
    sent: list[dict[str, Any]] = []
    failures = [ConnectionError("notification queue unreachable")]

    def notify(body: str) -> None:
        if failures:
            raise failures.pop()
        sent.append(json.loads(body))

    settings = Settings(
        queue_url="q",
        drain=True,
        receive_wait_seconds=0,
        log_dir=tmp_path,
        metrics_port=0,
        retry_delay_seconds=0,
    )
    assert Daemon(settings, source, blobs, notify=[notify]).run() is ExitCode.DRAINED
    assert sorted(notice["job_id"] for notice in sent) == ["first", "second"]
    for announced in sent:
        assert announced == job_file(blobs, announced["job_id"], "job.json")
    assert {job_file(blobs, job, "job.json")["status"] for job in ["first", "second"]} == {
        "succeeded"
    }
    assert len(source) == 0


class StolenLeaseSource(InMemoryJobSource):
    """On the first renewal, another consumer receives the message first, as when a
    lease expired unnoticed, and holds it for 2 s: the daemon's receipt handle is stale
    from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.stolen_handles: list[str] = []
        self.acked: list[str] = []

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        with self._lock:  # reentrant: the daemon's own receive cannot slip in between
            if not self.stolen_handles:
                self.stolen_handles = list(receipt_handles)
                super().extend(receipt_handles, 0)
                super().receive(10, 0, 2)
            return super().extend(receipt_handles, visibility_timeout_s)

    def ack(self, receipt_handle: str) -> None:
        self.acked.append(receipt_handle)
        super().ack(receipt_handle)


def test_a_lost_lease_is_not_renewed_or_acked_with_the_stale_handle(tmp_path: Path) -> None:
    """A renewal answered "receipt handle is invalid" means another consumer owns the job
    now: the job still finishes (its outputs were as it found them), but the stale handle
    is never used again; when the message comes back, its new delivery finds the job
    done and acks it without running it again."""
    source, blobs = StolenLeaseSource(), InMemoryBlobStore()
    [uri] = sample_images(blobs, 1)
    source.send(json.dumps({"job_id": "stolen", "inputs": [uri], "output": "s3://bkt/out/s/"}))
    run_until_drained(
        source,
        blobs,
        tmp_path,
        model="tests.support.slow_model:factory",
        visibility_timeout_seconds=1,
        heartbeat_interval_seconds=0.2,
    )
    [stale] = source.stolen_handles
    assert stale not in source.acked and len(source.acked) == 1
    assert len(source) == 0
    assert job_file(blobs, "s", "job.json")["attempt"] == 1  # the third delivery ran nothing


class RecordingBlobs(InMemoryBlobStore):
    """Remembers the order of writes; can fail chosen reads and writes first."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []
        self.failing_gets: dict[str, list[Exception]] = {}
        self.failing_puts: dict[str, int] = {}
        self.before_failing_get: Callable[[], None] = lambda: None

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
    ) -> bytes:
        errors = self.failing_gets.get(str(location))
        if errors:
            self.before_failing_get()
            raise errors.pop()
        return super().get(location, max_bytes, byte_range)

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        name = location.key.rsplit("/", 1)[-1]
        if self.failing_puts.get(name):
            self.failing_puts[name] -= 1
            raise TransientError("SlowDown: please reduce your request rate (test)")
        self.written.append(str(location))
        return super().put(location, data, content_type, expect=expect)


def test_a_small_job_is_not_stuck_behind_a_big_one_received_with_it(tmp_path: Path) -> None:
    """One receive brings a 160-item job and then a one-item job: the small one is fed
    in turn with the big one and finishes first, and neither message is ever seen
    again while held (both were leased from their receive). The big one's items take 4 s
    of the model's: were the small one admitted only after the big one's first items
    were fed, on a loaded machine, it still comes in turn long before the last."""
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    uris = sample_images(blobs, 161)
    send_job(source, "big", uris[:160])
    send_job(source, "small", uris[160:])
    run_until_drained(
        source,
        blobs,
        tmp_path,
        model="tests.support.slow_model:tenth_of_a_second",
        batch_size=4,
        visibility_timeout_seconds=2,
        heartbeat_interval_seconds=0.5,
    )
    summaries = [uri for uri in blobs.written if uri.endswith("job.json")]
    assert summaries == ["s3://bkt/out/small/job.json", "s3://bkt/out/big/job.json"]
    assert job_file(blobs, "big", "job.json")["attempt"] == 1
    assert job_file(blobs, "small", "job.json")["attempt"] == 1


def test_a_throttled_input_is_fed_again_and_never_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download still throttled after its call's retries is no fault of the input. It
    is fed again within the delivery; an input that stays unreachable for all its tries
    sends the job back to the queue, with the reason, to be done on a later delivery.
    Neither job is ever finished with the throttling in its results."""
    monkeypatch.setattr(results, "INPUT_BACKOFF", Backoff(base_s=0.01, cap_s=0.01))
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    uris = sample_images(blobs, 4)
    slow_down = TransientError("SlowDown: reduce your request rate")
    blobs.failing_gets[uris[1]] = [slow_down] * (results.INPUT_RETRIES - 1)
    blobs.failing_gets[uris[3]] = [slow_down] * results.INPUT_RETRIES
    send_job(source, "flaky", uris[:2])
    send_job(source, "unreachable", uris[2:])
    with capture_logs() as logs:
        run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    for job_id, attempt in (("flaky", 1), ("unreachable", 2)):
        summary = job_file(blobs, job_id, "job.json")
        assert (summary["status"], summary["attempt"]) == ("succeeded", attempt)
        assert all("error" not in r for r in job_file(blobs, job_id, "results.jsonl"))
    assert job_file(blobs, "flaky", "job.log").count('"input_retried"') == results.INPUT_RETRIES - 1
    [released] = [e for e in logs if e["event"] == "job_released"]
    assert (released["job_id"], released["reason"]) == (
        "unreachable",
        "fetch of input 1: SlowDown: reduce your request rate",
    )


def test_a_failed_upload_keeps_the_lease_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads that fail twice are tried again under the same lease (first delivery);
    uploads that keep failing release the job, which its next delivery finishes."""
    monkeypatch.setattr(results, "FINISH_BACKOFF", Backoff(base_s=0.01, cap_s=0.01))
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    [uri] = sample_images(blobs, 1)
    blobs.failing_puts["results.jsonl"] = results.FINISH_ATTEMPTS - 1
    send_job(source, "patient", [uri])
    run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert job_file(blobs, "patient", "job.json")["attempt"] == 1
    blobs.failing_puts["results.jsonl"] = results.FINISH_ATTEMPTS
    send_job(source, "released", [uri])
    run_until_drained(source, blobs, tmp_path, retry_delay_seconds=0)
    assert job_file(blobs, "released", "job.json")["attempt"] == 2
    assert len(source) == 0


class RefusingSource(InMemoryJobSource):
    """Its dead-letter queue refuses the first send, and its first release fails."""

    def __init__(self) -> None:
        super().__init__()
        self.dead_letter_refusals = 1
        self.release_failures = 1

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        if self.dead_letter_refusals:
            self.dead_letter_refusals -= 1
            raise PermissionError("KMS.AccessDeniedException on the DLQ's key (test)")
        return super().dead_letter(message, reason)

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        if self.release_failures:
            self.release_failures -= 1
            raise ConnectionError("sqs unreachable (test)")
        super().release(receipt_handle, delay_s)


def test_failing_dead_letter_and_release_calls_never_stop_the_daemon(tmp_path: Path) -> None:
    """A DLQ send that fails leaves the poison message to come back (and be moved on a
    later delivery); a release that fails leaves the message to its visibility timeout.
    Neither stops the daemon, and a good job beside them finishes."""
    source, blobs = RefusingSource(), RecordingBlobs()
    [uri] = sample_images(blobs, 1)
    source.send("{not json")
    send_job(source, "good", [uri])
    run_until_drained(
        source,
        blobs,
        tmp_path,
        retry_delay_seconds=0,
        visibility_timeout_seconds=2,
        heartbeat_interval_seconds=0.5,
    )
    assert [reason for _, reason in source.dead_letters] == [
        "body is not UTF-8 JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)"
    ]
    assert source.release_failures == 0
    assert job_file(blobs, "good", "job.json")["status"] == "succeeded"
    assert len(source) == 0


def test_drain_waits_for_messages_another_worker_holds(tmp_path: Path) -> None:
    """`--drain` is not fooled by an empty receive while a crashed worker's message is
    still invisible: it waits until the queue's own counts are zero, so it does that
    job when the message comes back. Meanwhile its receives, which do not wait
    (receive_wait_seconds 0), come a pause apart, not back to back."""
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    [uri] = sample_images(blobs, 1)
    send_job(source, "stranded", [uri])
    assert len(source.receive(1, 0, 2)) == 1  # a worker that then died
    run_until_drained(source, blobs, tmp_path)
    assert job_file(blobs, "stranded", "job.json")["attempt"] == 2
    assert len(source) == 0
    assert source.receive_calls <= 2 / intake.SHORT_POLL_PAUSE_S + 10  # thousands if spun


def test_a_release_goes_through_when_the_local_log_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's copy of a released job's log cannot be written (the log directory
    is gone): the release still happens, and the job is done on its next delivery."""
    monkeypatch.setattr(results, "INPUT_BACKOFF", Backoff(base_s=0.01, cap_s=0.01))
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    [uri] = sample_images(blobs, 1)
    log_dir = tmp_path / "logs"

    def break_log_dir() -> None:
        if log_dir.is_dir():
            shutil.rmtree(log_dir)
            log_dir.write_text("not a directory any more")

    blobs.failing_gets[uri] = [TransientError("connection reset (test)")] * results.INPUT_RETRIES
    blobs.before_failing_get = break_log_dir
    send_job(source, "logless", [uri])
    run_until_drained(source, blobs, log_dir, retry_delay_seconds=0)
    assert job_file(blobs, "logless", "job.json")["attempt"] == 2
    assert len(source) == 0


def test_a_loop_that_raises_stops_the_daemon_and_gives_its_jobs_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop of the daemon that dies (here the progress reporter) does not leave a
    half-working daemon renewing leases: it stops as broken and releases what it held."""
    source, blobs = InMemoryJobSource(), RecordingBlobs()
    [uri] = sample_images(blobs, 1)
    send_job(source, "held", [uri])
    settings = breaking_settings(tmp_path, monkeypatch)
    daemon = Daemon(settings, source, blobs)
    assert daemon.run() is ExitCode.BROKEN
    assert "progress bug" in (daemon.health_problem() or "")
    assert [m.body for m in source.receive(10, 0, 30)] != []  # visible again at once
    assert not blobs.written


class TimedSource(InMemoryJobSource):
    def __init__(self) -> None:
        super().__init__()
        self.first_receive_at: float | None = None

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        if self.first_receive_at is None:
            self.first_receive_at = time.time()
        return super().receive(max_messages, wait_s, visibility_timeout_s)


@pytest.mark.parametrize("device", also_on_gpu("cpu", "cuda"))
def test_intake_and_health_wait_until_the_model_is_warmed_up(tmp_path: Path, device: str) -> None:
    """The inference process runs a batch at the batch size and at each size bisection
    falls back to before the first receive; meanwhile /healthz says the daemon is
    starting. The model takes a second for any batch of more than one item, which only
    the warm-up sends."""
    source, blobs = TimedSource(), InMemoryBlobStore()
    send_job(source, "one", sample_images(blobs, 1))
    settings = draining_settings(
        tmp_path, model="tests.support.slow_model:slow_to_warm_up", batch_size=4, device=device
    )
    daemon = Daemon(settings, source, blobs)
    health_while_starting = []

    def watch_health() -> None:
        while source.first_receive_at is None:
            health_while_starting.append(daemon.health_problem())
            time.sleep(0.05)

    watching = threading.Thread(target=watch_health, daemon=True)
    with capture_logs(processors=[structlog.processors.TimeStamper()]) as logs:
        began = time.time()
        watching.start()
        assert daemon.run() is ExitCode.DRAINED
    watching.join(5)

    ready = next(event for event in logs if event["event"] == "model_ready")
    assert ready["warm_up"]["batch_sizes"] == [4, 2, 1]
    assert ready["timestamp"] - began >= 2.0  # the batches of 4 and 2 ran in set-up
    assert source.first_receive_at is not None and source.first_receive_at > ready["timestamp"]
    assert health_while_starting[0] is not None
    assert health_while_starting[0].startswith("starting")
    summary = job_file(blobs, "one", "job.json")
    assert summary["model"]["name"] == "tests.support.slow_model:slow_to_warm_up"
    batches = [e for e in job_file(blobs, "one", "job.log").splitlines() if '"batch_done"' in e]
    assert len(batches) == 1 and '"batch_items": 1' in batches[0]  # a lone image's batch too


def test_a_daemon_stopped_while_it_warms_up_takes_no_job(tmp_path: Path) -> None:
    """SIGTERM during the model's warm-up: the daemon stops once started, without a
    receive, where its intake, started before the main thread looked for the signal,
    received (a job admitted only to be handed over, a receive spent)."""
    source, blobs = TimedSource(), InMemoryBlobStore()
    send_job(source, "one", sample_images(blobs, 1))
    settings = draining_settings(
        tmp_path, model="tests.support.slow_model:slow_to_warm_up", batch_size=4
    )
    daemon = Daemon(settings, source, blobs)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert daemon.run() is ExitCode.SIGNALLED
    assert source.first_receive_at is None
    assert len(source) == 1


def test_the_set_up_limit_is_a_setting_and_the_warm_up_adds_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--setup-timeout-seconds` bounds a stage process's start; a model's process also
    has `--inference-timeout-seconds` for each batch size its warm-up runs: a warm-up of
    4 s starts within a 30 s set-up limit, and a model that takes 30 s to load does not
    start within 20 s and seven warm-up sizes of 0.125 s (one try here: each is timed
    alike). The preprocessing processes have the same limit, so it is one a loaded
    machine's starts fit: beside a second suite one took over 10 s to start, and its
    limit, not the model's, stopped the daemon."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    send_job(source, "one", sample_images(blobs, 1))
    warming = draining_settings(
        tmp_path,
        model="tests.support.slow_model:slow_to_warm_up",
        batch_size=16,  # warm-up batches of 16, 8, 4 and 2 images: 1 s each
        setup_timeout_seconds=30,
        inference_timeout_seconds=5,
    )
    assert Daemon(warming, source, blobs).run() is ExitCode.DRAINED
    monkeypatch.setattr("worker.engine.child_handle.START_ATTEMPTS", 1)
    loading = draining_settings(
        tmp_path,
        model="tests.support.slow_model:slow_to_load",
        setup_timeout_seconds=20,
        inference_timeout_seconds=0.125,  # 7 warm-up batch sizes: 20.875 s in all
    )
    with pytest.raises(StageSetupTimeout, match=r"inference-0 did not start: .* in 20\.875 s"):
        Daemon(loading, source, blobs).run()


@pytest.mark.parametrize("devices", also_on_gpu("cpu,cpu", "cuda:0,cuda:0"))
def test_one_inference_process_per_device_each_fed_while_free(tmp_path: Path, devices: str) -> None:
    """`--device cpu,cpu` runs two inference processes (the way `cuda:0,cuda:1` does, and
    `cuda:0,cuda:0`, two on one GPU): batches go to whichever is free, so both run some,
    and every job's results are in input order. 0.1 s a batch of 4: 48 images keep both
    busy."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    uris = sample_images(blobs, 48)
    for number in range(4):
        send_job(source, f"part-{number}", uris[number * 12 : number * 12 + 12])
    timeline = Timeline()
    settings = draining_settings(
        tmp_path, model="tests.support.slow_model:tenth_of_a_second", batch_size=4, device=devices
    )
    assert Daemon(settings, source, blobs, timeline=timeline).run() is ExitCode.DRAINED
    batches = Counter(interval.worker for interval in timeline.intervals("inference"))
    assert set(batches) == {"inference-0", "inference-1"}
    assert sum(i.items for i in timeline.intervals("inference")) == 48
    for number in range(4):
        results = job_file(blobs, f"part-{number}", "results.jsonl")
        assert [r["input"] for r in results] == uris[number * 12 : number * 12 + 12]


def test_fetching_in_the_preprocessing_processes_needs_a_store_they_can_read(
    tmp_path: Path,
) -> None:
    """The in-memory store lives in this process only: asking for fetches elsewhere is
    refused at start, not quietly done on threads here."""
    with pytest.raises(ValueError, match="fetch_in=preprocess: this blob store lives only"):
        Daemon(
            draining_settings(tmp_path, fetch_in="preprocess"),
            InMemoryJobSource(),
            InMemoryBlobStore(),
        )


@pytest.mark.gpu
@needs_gpu
def test_a_batch_that_does_not_fit_on_the_gpu_is_split_and_the_batch_size_lowered(
    tmp_path: Path,
) -> None:
    """A model that really runs out of GPU memory on batches over 8 images
    (`tests.support.faults:memory_hungry_classifier`): the warm-up notes the sizes that
    do not fit, the first batch of 32 is bisected down to what fits, the batch size is
    lowered, and every image gets the default model's answer."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    uris = sample_images(blobs, 40)
    send_job(source, "big", uris)
    settings = draining_settings(
        tmp_path,
        model="tests.support.faults:memory_hungry_classifier",
        batch_size=32,
        device="cuda",
    )
    with capture_logs() as logs:
        assert Daemon(settings, source, blobs).run() is ExitCode.DRAINED
    ready = next(event for event in logs if event["event"] == "model_ready")
    assert ready["warm_up"]["out_of_memory"] == [32, 16]
    lowered = [event["batch_size"] for event in logs if event["event"] == "batch_size_lowered"]
    assert lowered and max(lowered) <= 8
    results = job_file(blobs, "big", "results.jsonl")
    assert [r["input"] for r in results] == uris
    truth = dict(zip(uris, (label for label, _ in samples(40, seed=5)), strict=True))
    assert sum(r["label"] == truth[r["input"]] for r in results) >= 38
    events = job_file(blobs, "big", "job.log")
    assert '"out_of_memory"' in events


def test_a_chains_postprocessor_that_fails_known_good_input_breaks_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's postprocessor runs in the daemon, where no stage probes it: one that
    fails an input with no parts and no params stops the daemon from starting, and one
    that starts failing so later breaks the worker instead of failing the input. The
    job goes back, unwritten, as the one suspect."""
    marker = tmp_path / "broken"
    monkeypatch.setenv(BREAK_MODEL_FILE, str(marker))
    chain = tmp_path / "chain.toml"
    boards = (REPO / "stages" / "boards.toml").read_text()
    chain.write_text(
        boards.replace("stages.boards:objects", "tests.support.faults:breakable_objects")
    )
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    send_job(source, "boards", sample_images(blobs, 2))
    settings = Settings(
        queue_url="q", log_dir=tmp_path / "logs", metrics_port=0, pipeline=str(chain)
    )
    marker.touch()
    with pytest.raises(PluginError, match="fails on an input with no parts and no params"):
        Daemon(settings, source, blobs)
    marker.unlink()
    daemon = Daemon(settings, source, blobs)
    marker.touch()
    assert daemon.run() is ExitCode.BROKEN
    assert "the postprocessor fails known-good input" in (daemon.health_problem() or "")
    assert not [uri for uri in blobs.objects if uri.startswith("s3://bkt/out/")]
    [back] = source.receive(10, 0, 30)
    assert back.broke_workers == 1 and "library is gone" in back.breakage
