"""An OpenAI Batch API file round trip: the client uploads a local batch input file and
sends its job in one call, a daemon subprocess running the shipped text model drains the
queue on the moto server, and the client fetches the output and error files, each line
as OpenAI writes it, the embeddings the model's own answers."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stages.sentences import TOPICS
from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.jobs import enqueue_command, job_output
from tests.support.texts import TEXT_MODEL_FLAGS, embeddings_request, model_answers
from worker.client import Jobs

pytestmark = pytest.mark.e2e

TEXT_FLAGS = [*TEXT_MODEL_FLAGS, "--preprocess-workers", "1"]


def test_a_local_batch_file_is_submitted_in_one_call_and_answered_in_openais_files(
    aws: Aws, tmp_path: Path
) -> None:
    """Three requests and a chat request: the output file answers the three in file
    order, a text and two in base64, with the model's embeddings and their tokens; the
    chat request is the error file's line, status 400; job.json names both files."""
    stack = aws.stack()
    texts = ["the forecast says rain", "a late train", "fresh bread at dawn", "the final score"]
    requests = tmp_path / "requests.jsonl"
    lines = [
        embeddings_request("first", texts[0]),
        {**embeddings_request("chat", "hi"), "url": "/v1/chat/completions"},
        embeddings_request("pair", texts[1:3], encoding_format="base64"),
        embeddings_request("last", [texts[3]]),
    ]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    jobs = Jobs.connect(stack.queue_url, sqs=aws.sqs, s3=aws.s3)
    job = jobs.submit_openai_batch(requests, job_output(stack, "batch"), job_id="batch")

    run = run_daemon(aws, daemon_args(stack, tmp_path / "logs", "--drain", *TEXT_FLAGS))
    assert run.returncode == 0, run.stderr[-3000:]
    summary = job.wait(timeout_s=30)
    assert (summary["status"], summary["items"], summary["failed"]) == ("partial", 5, 1)
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    output_file, errors_file = job.openai_batch_files(fetched)

    output = [json.loads(line) for line in output_file.read_text().splitlines()]
    assert [line["custom_id"] for line in output] == ["first", "pair", "last"]
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in output)
    bodies = [line["response"]["body"] for line in output]
    assert [body["object"] for body in bodies] == ["list"] * 3
    assert [[entry["index"] for entry in body["data"]] for body in bodies] == [[0], [0, 1], [0]]
    pair = [np.frombuffer(base64.b64decode(e["embedding"]), "<f4") for e in bodies[1]["data"]]
    embeddings = [bodies[0]["data"][0]["embedding"], *pair, bodies[2]["data"][0]["embedding"]]
    assert np.allclose(embeddings, model_answers(texts)[:, len(TOPICS) :], atol=1e-5)
    assert all(body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] for body in bodies)

    [chat] = [json.loads(line) for line in errors_file.read_text().splitlines()]
    assert (chat["custom_id"], chat["error"]) == ("chat", None)
    assert chat["response"]["status_code"] == 400
    assert chat["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_enqueue_uploads_a_local_batch_file_and_sends_its_job(aws: Aws, tmp_path: Path) -> None:
    """`worker enqueue --openai-batch FILE`, a local file: uploaded to the job's output
    (openai-requests.jsonl) and its job sent naming it, as the client's one call does; a
    file that is not there, or one given beside other inputs, is a usage error (exit 2)
    with nothing sent."""
    stack = aws.stack()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(embeddings_request("only", "a late train")) + "\n")
    output = job_output(stack, "local")

    def enqueue(*more: str) -> subprocess.CompletedProcess[str]:
        command = enqueue_command(stack.queue_url, "local", output, *more)
        return subprocess.run(command, env=aws.env, capture_output=True, text=True, check=False)

    missing = enqueue("--openai-batch", str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    beside = enqueue("--openai-batch", str(requests), f"s3://{stack.bucket}/a.jpg")
    assert beside.returncode == 2 and "the job's only input" in beside.stderr
    assert aws.queue_depth(stack.queue_url) == (0, 0) and aws.names(output) == []

    sent = enqueue("--openai-batch", str(requests), "--shard-items", "50")
    assert sent.returncode == 0, sent.stderr
    assert aws.read(output, "openai-requests.jsonl") == requests.read_bytes()
    [message] = aws.sqs.receive_message(QueueUrl=stack.queue_url)["Messages"]
    body = json.loads(message["Body"])
    assert body["job_id"] == "local" == sent.stdout.strip()
    assert body["openai_batch"] == f"{output.rstrip('/')}/openai-requests.jsonl"
    assert body["shard_items"] == 50
