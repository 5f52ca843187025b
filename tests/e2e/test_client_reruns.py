"""A job sent again to the same output, end to end (review M2): a daemon subprocess
against the moto server runs the first submit; the second submit's handle does not take
the first run's job.json for its own, and once the daemon has run it, reads the second
run's results, while the first run's handle no longer takes the replaced outputs; a
results file a third run writes over the second's is refused by S3 (If-Match), not read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from worker.client import JobNotFinished, Jobs, OutputReplaced, Phase
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e


def test_a_rerun_is_followed_to_its_own_job_json_and_results(aws: Aws, tmp_path: Path) -> None:
    """The same job id and output, top_k 3 then top_k 1: before the daemon runs the
    second, its handle sees it queued (not finished with the first run's job.json) and
    its wait times out saying so; after, its job.json echoes its request id and every
    line has one label in its top k."""
    stack = aws.stack()
    inputs = sorted(upload_samples(aws.s3, stack.bucket, 3, seed=41))
    output = f"s3://{stack.bucket}/results/nightly/"
    jobs = Jobs.connect(stack.queue_url, sqs=aws.sqs, s3=aws.s3)
    # One preprocessing process, for three images: one process fewer to start.
    args = daemon_args(stack, tmp_path, "--drain", "--preprocess-workers", "1", dlq=False)

    first = jobs.submit(output, inputs=inputs, job_id="nightly", params={"top_k": 3})
    run = run_daemon(aws, args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert first.wait(timeout_s=10)["request_id"] == first.request_id
    assert [len(record["topk"]) for record in first.lines()] == [3, 3, 3]

    second = jobs.submit(output, inputs=inputs, job_id="nightly", params={"top_k": 1})
    assert second.status().phase is Phase.QUEUED
    with pytest.raises(TimeoutError, match="last seen: queued"):
        second.wait(timeout_s=1, poll_s=0.2)
    with pytest.raises(JobNotFinished):
        second.lines()

    run = run_daemon(aws, args)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = second.wait(timeout_s=10)
    assert summary["request_id"] == second.request_id != first.request_id
    records = list(second.lines())
    assert [record["input"] for record in records] == inputs
    assert [len(record["topk"]) for record in records] == [1, 1, 1]
    with pytest.raises(JobNotFinished):
        first.lines()  # its outputs were replaced by the second run's
    # A third run's results.jsonl, written before its job.json: S3 refuses the read
    # (If-Match), and nothing of it is taken for the second run's.
    key = output.removeprefix(f"s3://{stack.bucket}/") + "results.jsonl"
    aws.s3.put_object(Bucket=stack.bucket, Key=key, Body=b'{"index": 0}\n')
    with pytest.raises(OutputReplaced, match="a later run to the same output replaced it"):
        next(second.lines())
