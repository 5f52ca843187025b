"""A finished job's notice is sent at least once: a daemon subprocess against the moto
server, its notice queue refusing the first notice through a fault proxy."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.faultproxy import FaultProxy, Request
from tests.support.jobs import job_output, send_jobs
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e

ATTEMPTS = 2  # --aws-max-attempts: the tries of one notice's send


def test_a_notice_not_sent_is_sent_by_the_jobs_next_delivery(aws: Aws, tmp_path: Path) -> None:
    """Every try of the finished job's notice fails: its message is not acked but given
    back, and its next delivery finds job.json with no `announced` marker, sends the
    notice, marks it and acks; where the failed notice was dropped and the message
    acked, so its producer never heard of the job."""
    stack = aws.stack()
    notices = aws.sqs.create_queue(QueueName=f"notices-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    uris = list(upload_samples(aws.s3, stack.bucket, 2, seed=31))
    send_jobs(aws, stack, {"told": uris})

    def notice(request: Request) -> bool:
        return request.action == "SendMessage" and notices.rsplit("/", 1)[1] in request.body

    proxy = FaultProxy(aws.endpoint)
    proxy.fail("notice", notice, times=ATTEMPTS)
    with proxy.serving() as proxy_url:
        flags = ["--drain", "--retry-delay-seconds", "0", "--aws-max-attempts", str(ATTEMPTS)]
        run = run_daemon(
            aws.with_endpoint(proxy_url),
            daemon_args(stack, tmp_path, *flags, "--notify-queue-url", notices),
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert proxy.injected["notice"] == ATTEMPTS
    output = job_output(stack, "told")
    summary = aws.summary(output)
    received = aws.sqs.receive_message(QueueUrl=notices, MaxNumberOfMessages=10)
    assert [json.loads(message["Body"]) for message in received["Messages"]] == [summary]
    announced = json.loads(aws.read(output, "announced"))
    assert announced["finished_at"] == summary["finished_at"]
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []
