"""The client tells one run of a job from another (review M2, L5; M3's client side): a
handle takes only the job.json and rejected.json its own submit's request id is echoed
in, reads the results at the ETags that job.json names (a later run's files are an
error, never mixed in), waits no longer than it was told whatever S3 does, and cancels
only its own run; a job the daemon or SQS would refuse is refused before it is sent."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker import cli
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import (
    CancelRefused,
    InvalidJob,
    Job,
    JobNotFinished,
    JobRejected,
    Jobs,
    JobStatus,
    OutputReplaced,
    Phase,
)
from worker.errors import MessageRefused, TransientError
from worker.ports import S3Location

OUTPUT = "s3://bkt/out/j1/"
IMAGES = ["s3://bkt/img/0", "s3://bkt/img/1"]


def _put(blobs: InMemoryBlobStore, name: str, data: Any) -> str:
    """Write a file under the output as a daemon would; its ETag."""
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    return blobs.put(S3Location.parse(OUTPUT + name), body, "application/json")


def _finish(blobs: InMemoryBlobStore, request_id: str | None, results: bytes) -> dict[str, Any]:
    """A JSON-lines run's results.jsonl and the job.json naming it, for `request_id`."""
    etag = _put(blobs, "results.jsonl", results)
    summary = {
        "job_id": "j1",
        "request_id": request_id,
        "status": "succeeded",
        "items": 1,
        "succeeded": 1,
        "failed": 0,
        "outputs": {"results.jsonl": etag},
    }
    _put(blobs, "job.json", summary)
    return summary


def _sent(queue: InMemoryJobSource) -> list[dict[str, Any]]:
    return [json.loads(message.body) for message in queue.receive(10, 0, 30)]


def test_each_submit_is_a_run_of_its_own_and_its_handle_takes_only_that_run_s_job_json() -> None:
    """The job sent again to the same output (its id too): the second handle does not
    take the first run's job.json for its own, queued until its run's is written; a
    handle without a request id takes any run's, as before there were any."""
    queue, blobs = InMemoryJobSource(), InMemoryBlobStore()
    jobs = Jobs(queue, blobs)
    first = jobs.submit(OUTPUT, inputs=IMAGES, job_id="j1", params={"top_k": 3})
    second = jobs.submit(OUTPUT, inputs=IMAGES, job_id="j1", params={"top_k": 1})
    assert [body["request_id"] for body in _sent(queue)] == [first.request_id, second.request_id]
    assert first.request_id != second.request_id

    summary = _finish(blobs, first.request_id, b'{"index": 0, "topk": [1, 2, 3]}\n')
    assert first.wait(timeout_s=5) == summary
    assert second.status() == JobStatus(Phase.QUEUED, 0, 0, 0)
    with pytest.raises(TimeoutError, match="last seen: queued"):
        second.wait(timeout_s=0.2, poll_s=0.05)
    with pytest.raises(JobNotFinished, match="not by this run"):
        second.lines()
    assert Job(blobs, OUTPUT, "j1").wait(timeout_s=5) == summary

    _finish(blobs, second.request_id, b'{"index": 0, "topk": [1]}\n')
    assert [record["topk"] for record in second.lines()] == [[1]]
    assert first.status().phase is Phase.QUEUED  # its run's job.json is replaced


def test_results_a_later_run_replaced_are_an_error_never_a_mix() -> None:
    """job.json names its results files with their ETags: a results.jsonl another run
    wrote since, or a Parquet file of the set replaced or removed, raises
    `OutputReplaced` before a record of it is given."""
    blobs = InMemoryBlobStore()
    job = Job(blobs, OUTPUT, "j1", "r-1")
    _finish(blobs, "r-1", b'{"index": 0, "label": "old"}\n')
    _put(blobs, "results.jsonl", b'{"index": 0, "label": "new"}\n')
    with pytest.raises(OutputReplaced, match=r"results\.jsonl, which job\.json names"):
        next(job.lines())
    with pytest.raises(OutputReplaced):
        next(job.batches())

    parts = {}
    for number in range(2):
        sink = io.BytesIO()
        pq.write_table(pa.table({"index": [number], "input": [IMAGES[number]]}), sink)
        name = f"results/part-000000-{number:04d}.parquet"
        parts[name] = _put(blobs, name, sink.getvalue())
    summary = {"job_id": "j1", "request_id": "r-1", "status": "succeeded", "items": 2}
    _put(
        blobs,
        "job.json",
        {**summary, "succeeded": 2, "failed": 0, "format": "parquet", "outputs": parts},
    )
    assert [row["input"] for row in job.lines()] == IMAGES
    _put(blobs, "results/part-000000-0001.parquet", b"another run's")
    with pytest.raises(OutputReplaced, match=r"part-000000-0001\.parquet"):
        next(job.lines())  # not even the first file's rows
    del blobs.objects[OUTPUT + "results/part-000000-0001.parquet"]
    with pytest.raises(OutputReplaced):
        next(job.batches())


@pytest.mark.parametrize(
    "params",
    [{"text": "a\ufffeb"}, {"text": "\uffff"}, {"\uffff": 1}, {"text": "\ud800"}],
)
def test_params_sqs_would_refuse_are_an_invalid_job_before_anything_is_sent(
    params: dict[str, Any],
) -> None:
    """SQS refuses a body holding U+FFFE, U+FFFF or a lone surrogate: each entry of the
    send fails alone, which no retry gets past. `InvalidJob`, the character named."""
    queue = InMemoryJobSource()
    with pytest.raises(InvalidJob, match=r"U\+FFF[EF], a character SQS refuses|surrogates"):
        Jobs(queue, InMemoryBlobStore()).submit(OUTPUT, inputs=IMAGES, params=params)
    assert len(queue) == 0


def test_a_message_the_queue_refuses_is_an_invalid_job() -> None:
    """What the client does not foresee and SQS refuses for what it holds
    (`MessageRefused`, never retried) is `InvalidJob`, with SQS's reason."""

    class Refusing(InMemoryJobSource):
        def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
            raise MessageRefused("1 messages refused by SQS: InvalidMessageContents: no")

    with pytest.raises(InvalidJob, match="InvalidMessageContents"):
        Jobs(Refusing(), InMemoryBlobStore()).submit(OUTPUT, inputs=IMAGES)


def test_a_bucket_the_daemon_would_refuse_is_an_invalid_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon's allow-list, given or read from WORKER_ALLOWED_BUCKETS as the daemon
    reads it: a job naming a bucket outside it would be dead-lettered."""
    queue = InMemoryJobSource()
    allowed = Jobs(queue, InMemoryBlobStore(), frozenset({"bkt"}))
    with pytest.raises(InvalidJob, match="bucket\\(s\\) not allowed: other"):
        allowed.submit(OUTPUT, inputs=["s3://other/a.jpg"])
    allowed.submit(OUTPUT, inputs=IMAGES)
    assert len(queue) == 1

    monkeypatch.setenv("WORKER_ALLOWED_BUCKETS", "bkt, more")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    connected = Jobs.connect("https://sqs.us-east-1.amazonaws.com/1/q")
    with pytest.raises(InvalidJob, match=r"not allowed: other$"):
        connected.submit("s3://more/out/", inputs=["s3://bkt/a", "s3://other/b"])


def test_a_rejected_run_is_told_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """rejected.json (the daemon dead-lettered the job) for this run: the status says
    why, `wait` raises `JobRejected` at once, `enqueue --wait` exits 1 with the reason.
    Another run's rejection is not this one's; one naming no request is the job's."""
    blobs = InMemoryBlobStore()
    rejection = {
        "job_id": "j1",
        "reason": "manifest lists no inputs",
        "rejected_at": "2026-11-26T01:00:00+00:00",
    }
    _put(blobs, "rejected.json", {**rejection, "request_id": "r-0"})
    job = Job(blobs, OUTPUT, "j1", "r-1")
    assert job.status().phase is Phase.QUEUED
    _put(blobs, "rejected.json", {**rejection, "request_id": "r-1"})
    assert job.status() == JobStatus(Phase.REJECTED, 0, 0, 0, rejected="manifest lists no inputs")
    with pytest.raises(JobRejected, match="manifest lists no inputs") as rejected:
        job.wait(timeout_s=60, poll_s=0.01)
    assert rejected.value.reason == "manifest lists no inputs"
    assert cli._wait(job, 60) == 1
    assert "manifest lists no inputs" in capsys.readouterr().err

    _put(blobs, "rejected.json", {**rejection, "request_id": None})
    assert Job(blobs, OUTPUT, "j1").status().phase is Phase.REJECTED
    assert Job(blobs, OUTPUT, "j2").status().phase is Phase.QUEUED
    _finish(blobs, "r-1", b"")  # redriven, and finished since: job.json wins
    assert job.status().phase is Phase.FINISHED


class _Hanging(InMemoryBlobStore):
    """A store whose job.json reads hang until `release` is set, or fail for now
    `failures` times first."""

    def __init__(self, failures: int = 0, hang: bool = False):
        super().__init__()
        self.failures = failures
        self.release = threading.Event()
        if not hang:
            self.release.set()

    def get(self, location: S3Location, *args: Any, **kwargs: Any) -> bytes:
        if location.key.endswith("job.json"):
            if self.failures:
                self.failures -= 1
                raise TransientError("SlowDown: please reduce your request rate")
            self.release.wait()
        return super().get(location, *args, **kwargs)


def test_wait_keeps_its_timeout_whatever_a_look_takes_and_says_what_it_saw() -> None:
    """A look at the job that hangs does not hold `wait` past its timeout; one that
    fails for now is tried again within it; the timeout says what it saw last."""
    hanging = _Hanging(hang=True)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="a look unanswered when the time was up"):
        Job(hanging, OUTPUT, "j1", "r-1").wait(timeout_s=0.5, poll_s=0.05)
    assert time.monotonic() - started < 30  # the look itself hangs for good
    hanging.release.set()

    failing = _Hanging(failures=2)
    summary = _finish(failing, "r-1", b"")
    assert Job(failing, OUTPUT, "j1", "r-1").wait(timeout_s=30, poll_s=0.01) == summary
    failing.failures = 10**6
    with pytest.raises(TimeoutError, match="last seen: a look that failed: SlowDown"):
        Job(failing, OUTPUT, "j1", "r-1").wait(timeout_s=0.3, poll_s=0.01)


def test_cancel_names_its_run_and_is_withdrawn_if_the_run_finished_as_it_was_written() -> None:
    """The `cancel` object names the job and the run; an earlier run's job.json does not
    stop it; this run's does, also one written just as the cancel was (then the cancel
    is taken back: nothing is left to stop a later run)."""
    blobs = InMemoryBlobStore()
    _finish(blobs, "r-0", b"")
    job = Job(blobs, OUTPUT, "j1", "r-1")
    marker = job.cancel("wrong model")
    request = json.loads(blobs.objects[str(marker)])
    assert (request["job_id"], request["request_id"], request["reason"]) == (
        "j1",
        "r-1",
        "wrong model",
    )

    class FinishingAsCancelled(InMemoryBlobStore):
        def put(self, location: S3Location, data: bytes, *args: Any, **kwargs: Any) -> str:
            etag = super().put(location, data, *args, **kwargs)
            if location.key.endswith("/cancel"):
                _finish(self, "r-1", b"")
            return etag

    racing = FinishingAsCancelled()
    with pytest.raises(CancelRefused, match="nothing was cancelled"):
        Job(racing, OUTPUT, "j1", "r-1").cancel()
    assert OUTPUT + "cancel" not in racing.objects
    with pytest.raises(CancelRefused, match="the job is finished"):
        Job(racing, OUTPUT, "j1", "r-1").cancel()
