"""Jobs that go as they should, end to end (the daemon as a subprocess against a moto
server over HTTP): one-input, fifty-input and manifest jobs with a poison message
beside them, a job longer than four visibility timeouts followed by `enqueue --wait`,
a chain of models, an embedding job with its array file, and JPEGs decoded on the
model's device. Each job's outputs are checked whole: one result line per input, in
input order, with the right answers, and its log and summary."""

from __future__ import annotations

import io
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from stages.synthetic import LABELS, boards
from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.faults import broken_scan, reencoded
from tests.support.jobs import enqueue_command, following
from tests.support.markers import also_on_gpu
from tests.support.paths import REPO
from worker.demo import Stack, upload_samples

pytestmark = pytest.mark.e2e


def _drain_args(stack: Stack, log_dir: Path, *more: str) -> list[str]:
    """`run` flags for a daemon that empties the stack's queue and exits (no dead-letter
    queue unless `more` names one)."""
    return daemon_args(stack, log_dir, "--drain", *more, dlq=False)


def _last_modified(aws: Aws, output: str, name: str) -> Any:
    bucket, _, prefix = output.removeprefix("s3://").partition("/")
    return aws.s3.head_object(Bucket=bucket, Key=prefix + name)["LastModified"]


def test_mixed_jobs_complete_in_order_with_real_answers(aws: Aws, tmp_path: Path) -> None:
    """20 jobs (1-input, 50-input and a 450-input manifest, 7 batches) plus one poison message:
    every job gets one result line per input, in order, its log and its summary
    (written last), each naming the model; the queue ends empty, the poison is
    dead-lettered with its reason, the default model is right on at least 95% of the
    images, and `--timeline-dir` holds the run's Chrome trace and PNG."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 450, seed=11)
    uris = list(labels)
    manifest_uri = f"s3://{stack.bucket}/manifests/big.txt"
    aws.s3.put_object(Bucket=stack.bucket, Key="manifests/big.txt", Body="\n".join(uris).encode())

    jobs: dict[str, list[str]] = {}
    for number in range(10):
        jobs[f"one-{number}"] = [uris[number * 7]]
    for number in range(9):
        jobs[f"fifty-{number}"] = uris[number * 50 : number * 50 + 50][::-1]
    for job_id, inputs in jobs.items():
        aws.send(
            stack.queue_url,
            {"job_id": job_id, "inputs": inputs, "output": f"s3://{stack.bucket}/out/{job_id}/"},
        )
    jobs["manifest"] = uris
    enqueue = subprocess.run(
        enqueue_command(
            stack.queue_url,
            "manifest",
            f"s3://{stack.bucket}/out/manifest/",
            "--manifest",
            manifest_uri,
        ),
        env=aws.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert enqueue.stdout.strip() == "manifest"
    aws.send(stack.queue_url, "this is not json")

    log_dir = tmp_path / "logs"
    run = run_daemon(
        aws,
        _drain_args(
            stack,
            log_dir,
            "--dlq-url",
            stack.dlq_url,
            "--model-version",
            "3",
            "--timeline-dir",
            str(tmp_path / "timeline"),
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]

    correct = total = 0
    for job_id, inputs in jobs.items():
        output = f"s3://{stack.bucket}/out/{job_id}/"
        results = aws.results(output)
        assert [r["index"] for r in results] == list(range(len(inputs)))
        assert [r["input"] for r in results] == inputs
        summary = json.loads(aws.read(output, "job.json"))
        assert (
            summary["status"] == "succeeded"
            and summary["items"] == len(inputs) == summary["succeeded"]
        )
        assert summary["attempt"] == 1
        assert summary["model"]["name"] == "shapes-cnn" and summary["model"]["version"] == "3"
        assert summary["model"]["digest"].startswith("sha256:")
        assert {r["model"] for r in results} == {"shapes-cnn@3"}
        events = [json.loads(line)["event"] for line in aws.read(output, "job.log").splitlines()]
        assert events[0] == "job_received" and "job_finished" in events
        assert log_dir.is_dir() and not list(log_dir.glob(f"{job_id}.*.log"))  # in S3 now
        assert _last_modified(aws, output, "job.json") >= _last_modified(
            aws, output, "results.jsonl"
        )
        correct += sum(r["label"] == labels[r["input"]] for r in results)
        total += len(results)
    assert correct / total >= 0.95, correct / total
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    dead = aws.sqs.receive_message(QueueUrl=stack.dlq_url, MessageAttributeNames=["All"])[
        "Messages"
    ]
    assert dead[0]["Body"] == "this is not json"
    assert "not UTF-8 JSON" in dead[0]["MessageAttributes"]["reason"]["StringValue"]
    trace = json.loads((tmp_path / "timeline" / "timeline.json").read_text())
    calls = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    # The stages, and the garbage collector's pauses of the daemon, if it paused.
    assert {event["name"] for event in calls} - {"gc"} == {"fetch", "preprocess", "inference"}
    # Inputs are fetched in the preprocessing processes: their drivers report it.
    lanes = {
        event["tid"]: event["args"]["name"]
        for event in trace["traceEvents"]
        if event["ph"] == "M" and event["name"] == "thread_name"
    }
    fetched_on = {lanes[event["tid"]] for event in calls if event["name"] == "fetch"}
    assert fetched_on and all(lane.startswith("preprocess-") for lane in fetched_on), fetched_on
    inferred = sum(event["args"]["items"] for event in calls if event["name"] == "inference")
    assert inferred >= total
    with Image.open(tmp_path / "timeline" / "timeline.png") as png:
        assert png.format == "PNG"


def test_job_longer_than_four_visibility_timeouts_is_received_once(
    aws: Aws, tmp_path: Path
) -> None:
    """The heartbeat keeps a slow job's message invisible: with a 2 s visibility timeout
    and a job lasting over 8 s, the message is received once and deleted at the end.
    `enqueue --wait` follows it with a progress bar to its summary."""
    stack = aws.stack(visibility_timeout_s=2)
    uris = list(upload_samples(aws.s3, stack.bucket, 9, seed=3))
    output = f"s3://{stack.bucket}/out/slow/"
    with following(
        aws, stack.queue_url, "slow", output, "--timeout-seconds", "120", *uris
    ) as follower:
        run = run_daemon(
            aws,
            _drain_args(
                stack,
                tmp_path,
                "--visibility-timeout-seconds",
                "2",
                "--heartbeat-interval-seconds",
                "0.5",
                "--batch-size",
                "1",
                "--model",
                "tests.support.slow_model:factory",
                "--progress-interval-seconds",
                "0.5",
            ),
        )
        followed, progress_bar = follower.communicate(timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(aws.read(output, "job.json"))
    assert summary["duration_s"] >= 4 * 2
    assert summary["attempt"] == 1 and summary["status"] == "succeeded"
    received = [json.loads(line) for line in run.stdout.splitlines() if '"job_received"' in line]
    assert len(received) == 1
    assert len(aws.results(output)) == 9
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert follower.returncode == 0
    assert (
        followed.splitlines()[0] == "slow"
        and json.loads("".join(followed.splitlines()[1:]))["items"] == 9
    )
    assert any(f"] {n}/9 items" in progress_bar for n in range(1, 9)), progress_bar
    assert "] 9/9 items" in progress_bar


def test_a_chain_of_models_finds_and_names_the_shapes_on_each_board(
    aws: Aws, tmp_path: Path
) -> None:
    """`--pipeline stages/boards.toml`: the tile finder, a fan-out into one crop per shape
    found, and the default classifier on the crops, each model in its own process. Each
    board's line lists its shapes in tile order with their boxes and labels; an empty
    board has none; an input that does not decode is that input's error; job.json names
    the chain and both its models, and every line carries the chain's name@version. The
    same job as Parquet has the same rows, with the chain's columns as its answer for a
    board with no shapes types them: `count` an integer, `objects` JSON text."""
    stack = aws.stack()
    truth: dict[str, list[tuple[int, str]]] = {}
    for number, (shapes, data) in enumerate(boards(30, seed=21)):
        aws.s3.put_object(Bucket=stack.bucket, Key=f"boards/{number}", Body=data)
        truth[f"s3://{stack.bucket}/boards/{number}"] = shapes
    empty = io.BytesIO()
    Image.new("RGB", (128, 128), (40, 90, 160)).save(empty, format="PNG")
    aws.s3.put_object(Bucket=stack.bucket, Key="boards/empty", Body=empty.getvalue())
    aws.s3.put_object(Bucket=stack.bucket, Key="boards/corrupt", Body=b"\xff\xd8 not a jpeg")
    inputs = [*truth, f"s3://{stack.bucket}/boards/empty", f"s3://{stack.bucket}/boards/corrupt"]
    output = f"s3://{stack.bucket}/out/boards/"
    aws.send(stack.queue_url, {"job_id": "boards", "inputs": inputs, "output": output})
    parquet = f"s3://{stack.bucket}/out/boards-parquet/"
    aws.send(
        stack.queue_url,
        {"job_id": "boards-parquet", "inputs": inputs, "output": parquet, "format": "parquet"},
    )

    run = run_daemon(
        aws,
        _drain_args(
            stack,
            tmp_path,
            "--pipeline",
            str(REPO / "stages" / "boards.toml"),
            "--preprocess-workers",
            "1",
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ready = [json.loads(line) for line in run.stdout.splitlines() if '"model_ready"' in line]
    assert [event["name"] for event in ready] == ["tile-finder", "shapes-cnn"]

    results = aws.results(output)
    assert [r["input"] for r in results] == inputs
    correct = total = 0
    for result in results[: len(truth)]:
        shapes = truth[result["input"]]
        found = result["objects"]
        assert [o["tile"] for o in found] == [tile for tile, _ in shapes], result
        assert result["count"] == len(shapes)
        for o in found:
            row, column = divmod(o["tile"], 2)
            assert o["box"] == [column / 2, row / 2, (column + 1) / 2, (row + 1) / 2]
            assert o["found_score"] >= 0.5
        correct += sum(o["label"] == label for o, (_, label) in zip(found, shapes, strict=True))
        total += len(shapes)
    assert total > 30 and correct / total >= 0.95, (correct, total)
    assert results[-2]["count"] == 0 and results[-2]["objects"] == []
    assert results[-1]["error"]["type"] == "UnidentifiedImageError"
    assert {r["model"] for r in results if "error" not in r} == {"shape-boards@1"}
    summary = aws.summary(output)
    assert summary["status"] == "partial" and summary["failed"] == 1
    model = summary["model"]
    assert (model["name"], model["version"]) == ("shape-boards", "1")
    assert [step["name"] for step in model["steps"]] == ["tile-finder", "shapes-cnn"]
    (name,) = [name for name in aws.summary(parquet)["outputs"] if name.startswith("results/")]
    table = pq.read_table(io.BytesIO(aws.read(parquet, name)))
    assert (table.schema.field("count").type, table.schema.field("objects").type) == (
        pa.int64(),
        pa.string(),
    )
    rows = table.to_pylist()
    assert [row["input"] for row in rows] == inputs
    assert _same_answers(
        [json.loads(row["objects"] or "null") for row in rows],
        [result.get("objects") for result in results],
    )


def _same_answers(left: Any, right: Any) -> bool:
    """Equal, scores within 1e-4: the two jobs' crops are batched together in ways that
    differ from run to run, and a model's answer for a crop differs in the sixth place
    with the batch it is in."""
    if isinstance(left, float) and isinstance(right, float):
        return math.isclose(left, right, abs_tol=1e-4)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(_same_answers, left, right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_same_answers(left[k], right[k]) for k in left)
    return bool(left == right)


def test_an_embedding_job_leaves_its_array_file_in_s3(aws: Aws, tmp_path: Path) -> None:
    """With `--postprocess stages.postprocess:embedding` the default model's whole
    output row of each image lands in embedding.npy under the job's output (through
    moto, with job.json naming its ETag), each line refers to its row, and the row's
    best class is the image's label."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 8, seed=5)
    uris = list(labels)
    output = f"s3://{stack.bucket}/out/embedded/"
    aws.send(stack.queue_url, {"job_id": "embedded", "inputs": uris, "output": output})
    more = ("--postprocess", "stages.postprocess:embedding")
    run = run_daemon(aws, _drain_args(stack, tmp_path / "logs", *more))
    assert run.returncode == 0, run.stderr[-3000:]
    results = aws.results(output)
    assert [r["embedding"] for r in results] == [
        {"array": "embedding.npy", "row": index} for index in range(len(uris))
    ]
    rows = np.load(io.BytesIO(aws.read(output, "embedding.npy")))
    assert rows.shape == (len(uris), len(LABELS)) and rows.dtype == np.float32
    right = sum(LABELS[row.argmax()] == labels[uri] for row, uri in zip(rows, uris, strict=True))
    assert right >= len(uris) - 1
    summary = json.loads(aws.read(output, "job.json"))
    bucket, _, prefix = output.removeprefix("s3://").partition("/")
    head = aws.s3.head_object(Bucket=bucket, Key=prefix + "embedding.npy")
    assert summary["outputs"]["embedding.npy"] == head["ETag"]
    assert not any((tmp_path / "logs" / "arrays").iterdir())


@pytest.mark.parametrize(
    ("decoder", "fallbacks"),
    also_on_gpu(
        # The stand-in refuses the progressive JPEG, as some decoders do; nvJPEG takes it.
        (("tests.support.faults:standin_device_decoder", "auto"), 1),
        (("stages.preprocess:default_preprocessor", "cuda"), 0),
    ),
)
def test_jpegs_decoded_on_the_device_fall_back_to_the_cpu_one_input_at_a_time(
    aws: Aws, tmp_path: Path, decoder: tuple[str, str], fallbacks: int
) -> None:
    """`--decode gpu` with nvJPEG on a GPU, and everywhere with a stand-in for it
    (`tests.support.faults:standin_device_decoder`): the sample JPEGs are decoded in the
    model's process and labelled as on the CPU; PNGs, a CMYK JPEG, a truncated one and
    one with a broken scan header (nvJPEG would picture the last two) in the
    preprocessing processes, the bad ones failing there, as ever, each that input's
    error alone; a progressive JPEG is labelled right wherever it is decoded, and the
    job's log says how many the device sent back to the CPU."""
    preprocess, device = decoder
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 40, seed=9)
    uris = list(labels)
    inputs = {uri: aws.s3.get_object(Bucket=stack.bucket, Key=uri.split("/", 3)[3]) for uri in uris}
    first_jpeg, jpeg = next(
        (uri, data)
        for uri, got in inputs.items()
        if (data := got["Body"].read())[:2] == b"\xff\xd8"
    )
    odd = {
        "progressive": reencoded(jpeg, progressive=True),
        "cmyk": reencoded(jpeg, mode="CMYK"),
        "truncated": jpeg[: len(jpeg) * 3 // 4],
        "broken": broken_scan(jpeg),
    }
    for name, data in odd.items():
        aws.s3.put_object(Bucket=stack.bucket, Key=f"odd/{name}.jpg", Body=data)
    odd_uris = [f"s3://{stack.bucket}/odd/{name}.jpg" for name in odd]
    output = f"s3://{stack.bucket}/out/on-device/"
    aws.send(stack.queue_url, {"job_id": "on-device", "inputs": uris + odd_uris, "output": output})
    more = ("--decode", "gpu", "--preprocess", preprocess, "--device", device)
    run = run_daemon(aws, _drain_args(stack, tmp_path / "logs", *more))
    assert run.returncode == 0, run.stderr[-3000:]

    decided = [json.loads(line) for line in run.stdout.splitlines() if "inputs_decoded_in" in line]
    assert [(line["where"], line["why"]) for line in decided] == [("inference", "--decode gpu")]
    results = aws.results(output)
    fell_back = [e for e in aws.log_events(output) if e["event"] == "decoded_on_cpu"]
    right = sum(r["label"] == labels[r["input"]] for r in results[: len(uris)])
    assert right >= len(uris) - 1
    progressive, cmyk, truncated, broken = results[len(uris) :]
    assert progressive["label"] == cmyk["label"] == labels[first_jpeg]
    assert truncated["error"]["type"] == broken["error"]["type"] == "OSError"
    assert "truncated" in truncated["error"]["message"]
    assert "broken data stream" in broken["error"]["message"]
    summary = aws.summary(output)
    assert (summary["status"], summary["failed"]) == ("partial", 2)
    assert sum(event["inputs"] for event in fell_back) == fallbacks
