"""The embedded demo: the whole product on one machine, against a local moto server.

The helpers here (a stack of queue, dead-letter queue and bucket; sample images) are
also what the end-to-end tests build on.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import boto3
import pyarrow as pa
import pyarrow.parquet as pq

from stages.sentences import sentences
from stages.synthetic import samples
from worker.adapters import aws
from worker.ports import S3Location

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

LOCAL_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Not an EC2 instance: no instance metadata to wait for.
    "AWS_EC2_METADATA_DISABLED": "true",
}
DEMO_MAX_RECEIVE_COUNT = 3
DEMO_IMAGES = 400
DEMO_SMALL_JOBS = {
    "single-1": 1,
    "single-2": 1,
    "single-3": 1,
    "small-1": 3,
    "small-2": 5,
    "medium": 50,
}
DEMO_SMALL_JOB_IMAGES = sum(DEMO_SMALL_JOBS.values())
# A job of texts (a Parquet table of generated sentences), run by a daemon of the shipped
# text model on a queue of its own: a daemon serves one pipeline.
DEMO_TEXT_JOB = "texts"
DEMO_TEXTS = 200
TEXT_PIPELINE = {
    "preprocess": "stages.text:tokens",
    "model": "stages.text:text_model",
    "postprocess": "stages.text:labelled",
}


@dataclass(frozen=True)
class Stack:
    """A jobs queue and a shards queue with their dead-letter queue, and a bucket."""

    queue_url: str
    dlq_url: str
    bucket: str
    shard_queue_url: str


@contextmanager
def local_moto_server() -> Iterator[str]:
    """A moto server on a free loopback port; yields its endpoint URL, stops it after."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def create_stack(
    sqs: SQSClient,
    s3: S3Client,
    name: str,
    visibility_timeout_s: int = 60,
    max_receive_count: int = DEMO_MAX_RECEIVE_COUNT,
) -> Stack:
    """Jobs and shards queues, their dead-letter queue (redrive after a few receives),
    and a bucket, named after `name`."""
    dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    redrive = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_receive_count)}
    queue_url, shard_queue_url = (
        sqs.create_queue(
            QueueName=queue_name,
            Attributes={
                "VisibilityTimeout": str(visibility_timeout_s),
                "RedrivePolicy": json.dumps(redrive),
            },
        )["QueueUrl"]
        for queue_name in (name, f"{name}-shards")
    )
    s3.create_bucket(Bucket=name)
    return Stack(queue_url, dlq_url, name, shard_queue_url)


def upload_samples(s3: S3Client, bucket: str, count: int, seed: int = 0) -> dict[str, str]:
    """Upload `count` synthetic images; returns each one's URI with its true label."""
    labelled = [
        (f"s3://{bucket}/images/{seed}-{number:05d}.img", label, data)
        for number, (label, data) in enumerate(samples(count, seed))
    ]

    def put(entry: tuple[str, str, bytes]) -> None:
        location = S3Location.parse(entry[0])
        s3.put_object(Bucket=location.bucket, Key=location.key, Body=entry[2])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, labelled))
    return {uri: label for uri, label, _ in labelled}


def read_output(s3: S3Client, output: str, name: str) -> bytes:
    location = S3Location.parse(output.rstrip("/") + "/" + name)
    return s3.get_object(Bucket=location.bucket, Key=location.key)["Body"].read()


def run_demo(out: str, images: int = DEMO_IMAGES) -> int:
    """Run the demo end to end and print a table of what each job produced."""
    out_dir = Path(out)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    os.environ.update(LOCAL_AWS_ENV)
    with local_moto_server() as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        print(f"moto server at {endpoint}")
        session = boto3.session.Session()
        sqs, s3 = session.client("sqs"), session.client("s3")
        stack = create_stack(sqs, s3, "demo")
        labels = upload_samples(s3, stack.bucket, images)
        print(f"uploaded {len(labels)} sample images to s3://{stack.bucket}/images/")
        jobs = _enqueue_demo_jobs(sqs, s3, stack, list(labels))
        text_queue = create_stack(sqs, s3, "demo-texts").queue_url
        jobs[DEMO_TEXT_JOB], topics = _enqueue_text_job(sqs, s3, stack, text_queue)
        print(
            f"enqueued {len(jobs)} jobs; running the image daemon, then the text daemon, "
            "until their queues are drained..."
        )
        with (out_dir / "daemon.log").open("w") as log:
            exit_code = _run_daemon(stack, stack.queue_url, log)
            text_exit_code = _run_daemon(stack, text_queue, log, **TEXT_PIPELINE)
        print(f"(their log: {out_dir / 'daemon.log'})\n")
        _print_table(s3, jobs, labels | topics, out_dir)
    return exit_code or text_exit_code


def _enqueue_demo_jobs(
    sqs: SQSClient, s3: S3Client, stack: Stack, uris: list[str]
) -> dict[str, str]:
    jobs: dict[str, str] = {}
    start = 0
    for job_id, size in DEMO_SMALL_JOBS.items():
        output = f"s3://{stack.bucket}/results/{job_id}/"
        body = {"job_id": job_id, "inputs": uris[start : start + size], "output": output}
        sqs.send_message(QueueUrl=stack.queue_url, MessageBody=json.dumps(body))
        jobs[job_id] = output
        start += size
    manifest_key = "manifests/large.txt"
    s3.put_object(Bucket=stack.bucket, Key=manifest_key, Body="\n".join(uris).encode())
    output = f"s3://{stack.bucket}/results/large/"
    large_job = {
        "job_id": "large",
        "manifest": f"s3://{stack.bucket}/{manifest_key}",
        "output": output,
        "params": {"top_k": 2},
    }
    sqs.send_message(QueueUrl=stack.queue_url, MessageBody=json.dumps(large_job))
    jobs["large"] = output
    return jobs


def _enqueue_text_job(
    sqs: SQSClient, s3: S3Client, stack: Stack, queue_url: str
) -> tuple[str, dict[str, str]]:
    """A Parquet table of generated sentences and the job that embeds and labels it, in
    Parquet; its output, and each row's input name with its true topic."""
    drawn = list(sentences(DEMO_TEXTS, seed=3))
    table = pa.table(
        {"ticket": [f"t-{row:04d}" for row in range(len(drawn))], "body": [t for _, t in drawn]}
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)
    s3.put_object(Bucket=stack.bucket, Key="texts/tickets.parquet", Body=sink.getvalue())
    uri = f"s3://{stack.bucket}/texts/tickets.parquet"
    output = f"s3://{stack.bucket}/results/{DEMO_TEXT_JOB}/"
    job = {
        "job_id": DEMO_TEXT_JOB,
        "table": {"uri": uri, "text_column": "body", "id_column": "ticket"},
        "output": output,
    }
    sqs.send_message(QueueUrl=queue_url, MessageBody=json.dumps(job))
    return output, {f"{uri}#row={row}": topic for row, (topic, _) in enumerate(drawn)}


def _run_daemon(stack: Stack, queue_url: str, log: TextIO, **pipeline: str) -> int:
    """A daemon of `pipeline` (the default's if not given) that drains `queue_url`,
    logging to `log` (structlog is configured once a process: every daemon's goes there)."""
    from worker.daemon.wiring import Daemon
    from worker.jobs.joblog import configure_daemon_logging
    from worker.settings import Settings

    settings = Settings(
        queue_url=queue_url,
        dlq_url=stack.dlq_url,
        drain=True,
        receive_wait_seconds=1,
        log_dir=Path(log.name).parent / "logs",
        batch_size=32,
        metrics_port=0,
        **pipeline,  # type: ignore[arg-type]
    )
    started = time.monotonic()
    configure_daemon_logging(log)
    source = aws.SqsJobSource(aws.sqs_client(), queue_url, stack.dlq_url)
    blobs = aws.S3BlobStore.from_environment(settings.s3_connections, settings.aws_max_attempts)
    code = Daemon(settings, source, blobs).run().code
    print(f"daemon exited with {code} after {time.monotonic() - started:.1f} s")
    return code


def _print_table(s3: S3Client, jobs: dict[str, str], labels: dict[str, str], out_dir: Path) -> None:
    columns = f"{'job':<10} {'status':<10} {'items':>6} {'failed':>6}"
    header = f"{columns} {'correct':>8} {'time s':>7}  outputs"
    print(header)
    print("-" * len(header))
    for job_id, output in jobs.items():
        local = out_dir / "results" / job_id
        local.mkdir(parents=True)
        files = {
            name: read_output(s3, output, name) for name in ("results.jsonl", "job.log", "job.json")
        }
        for name, data in files.items():
            (local / name).write_bytes(data)
        summary: dict[str, Any] = json.loads(files["job.json"])
        results = [json.loads(line) for line in files["results.jsonl"].splitlines()]
        correct = sum(r.get("label") == labels[r["input"]] for r in results)
        print(
            f"{job_id:<10} {summary['status']:<10} {summary['items']:>6} {summary['failed']:>6} "
            f"{correct / len(results):>8.1%} {summary['duration_s']:>7.2f}  {output}"
        )
    print(f"\nresults, job logs and summaries copied to {out_dir / 'results'}/<job>/")
    sys.stdout.flush()
