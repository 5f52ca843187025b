"""Inputs read with the client the daemon is told, end to end: a daemon subprocess against
the moto server, through a proxy that records which client sent each request, reads a
job's inputs in its preprocessing processes with obstore (`--input-client obstore`)
and everything else (SQS, the outputs) with boto3, and finishes the job right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.recordingproxy import RecordingProxy
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e


def test_a_daemon_told_obstore_reads_its_inputs_with_it_and_finishes_the_job(
    aws: Aws, tmp_path: Path
) -> None:
    """The daemon says it reads inputs with obstore as told; every input's GET comes from
    obstore, none from boto3, which still writes the outputs; the job succeeds with one
    right answer per input."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 12, seed=38)
    output = f"s3://{stack.bucket}/out/obstore/"
    aws.send(stack.queue_url, {"job_id": "obstore", "inputs": list(labels), "output": output})
    proxy = RecordingProxy(aws.endpoint)
    with proxy.serving() as endpoint:
        flags = ["--drain", "--input-client", "obstore", "--fetch-in", "preprocess"]
        run = run_daemon(aws.with_endpoint(endpoint), daemon_args(stack, tmp_path, *flags))
    assert run.returncode == 0, run.stderr[-3000:]
    chosen = [json.loads(line) for line in run.stdout.splitlines() if "inputs_read_with" in line]
    assert [(event["client"], event["why"]) for event in chosen] == [
        ("obstore", "input_client=obstore")
    ]
    summary = aws.summary(output)
    assert (summary["status"], summary["succeeded"]) == ("succeeded", 12)
    results = aws.results(output)
    assert [result["input"] for result in results] == list(labels)
    assert sum(result["label"] == labels[result["input"]] for result in results) >= 11
    inputs_read = proxy.sent(under=f"/{stack.bucket}/images/")
    assert len(inputs_read) >= 12 and not [sent for sent in inputs_read if sent.by_boto3]
    assert all(sent.by_boto3 for sent in proxy.sent("PUT", under=f"/{stack.bucket}/out/"))
