"""Bad inputs and bad messages fail alone: corrupt, truncated, missing, oversized and
decompression-bomb inputs, inputs that hang, segfault or kill their preprocessing
process, an image the model raises on, batches that run out of memory, poison messages
and forged continuation attributes each get their own error record or dead letter,
and every other job is complete and right. The daemon runs as a subprocess against a
moto server (docs/DESIGN.md section 4); every test also checks, through the
`start_daemon` fixture or `run_daemon`, that no process of the daemon outlives it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench.processes import peak_rss, tree_rss_mb
from stages.synthetic import samples
from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, run_daemon
from tests.support.faults import MAGENTA, blank_png, png_bytes
from tests.support.jobs import assert_complete, job_output, send_jobs, upload
from worker.demo import Stack, upload_samples

pytestmark = pytest.mark.e2e


def test_a_huge_input_and_a_huge_manifest_leave_the_daemons_memory_alone(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A 300 MB input and a 120 MB manifest beside ordinary jobs, with limits of 64 MiB
    each (the input's by default): the input is its own error and the manifest's message
    poison, neither read, the other jobs done, and the daemon's whole process tree never
    grows by as much as the smaller of the two."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 12, seed=4))
    huge_input = upload(aws, stack, "huge/input.bin", bytes(300 * 2**20))
    line = f"{uris[0]}\n".encode()
    huge_manifest = upload(aws, stack, "huge/manifest.txt", line * (120 * 2**20 // len(line)))
    jobs = {"first": uris[:6], "second": uris[6:]}
    send_jobs(aws, stack, {**jobs, "with-huge": [uris[0], huge_input, uris[1]]})
    aws.send(stack.queue_url, {"manifest": huge_manifest, "output": job_output(stack, "long")})

    daemon = start_daemon(
        daemon_args(stack, tmp_path, "--drain", "--max-manifest-bytes", str(64 * 2**20))
    )
    daemon.wait_for("daemon_started")
    started_mb = tree_rss_mb(daemon.pid)
    with peak_rss(daemon.pid, every_s=0.05) as peak_mb:
        assert daemon.wait(240) == 0, daemon.stderr[-3000:]
    grew_mb = peak_mb[0] - started_mb
    print(f"daemon tree: {started_mb:.0f} MB at start, peak {peak_mb[0]:.0f} MB")
    assert grew_mb < 100, (started_mb, peak_mb)

    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
    huge = aws.results(job_output(stack, "with-huge"))
    assert huge[1]["error"] == {
        "type": "ObjectTooLarge",
        "message": f"too large: {300 * 2**20} bytes, limit {64 * 2**20}",
    }
    assert "label" in huge[0] and "label" in huge[2]
    [dead] = aws.dead_letters(stack.dlq_url)
    reason = dead["MessageAttributes"]["reason"]["StringValue"]
    assert reason.startswith(f"manifest {huge_manifest} is too large: ")


def test_bad_inputs_and_poison_messages_fail_alone(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Corrupt, truncated, missing and oversized inputs, inputs that hang, segfault or
    SIGKILL their preprocessing process, an image the model raises on, batches that run
    out of memory, eight kinds of poison message and three of forged continuation
    attributes, all in one run: each bad item gets its own error record, the killing job
    ends failed, every poison message is dead-lettered with its reason, and every other
    job is complete and right.

    The attributes sent with boto3 do not parse (a count of "²", a lease end of "soon",
    a first message id of "../../x", which would name a file outside --log-dir): each
    message is dead-lettered naming the attribute. A message naming another job's
    message as the one it replaces, with an output of its own, neither skips nor stops
    that job."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 58, seed=21)
    good = list(labels)
    jpeg = next(data for _, data in samples(20, seed=9) if data[:2] == b"\xff\xd8")
    bad = {
        name: upload(aws, stack, f"bad/{name}", data)
        for name, data in {
            "garbage": b"definitely not an image",
            "truncated": jpeg[: len(jpeg) // 3],
            "bomb": blank_png(15_000, 15_000),  # over twice Pillow's limit: its own guard's
            "hang": b"FAULT:hang",
            "segfault": b"FAULT:segfault",
            "sigkill": b"FAULT:sigkill",
            "magenta": png_bytes(Image.new("RGB", (64, 64), MAGENTA)),
        }.items()
    }
    missing = f"s3://{stack.bucket}/bad/missing"
    mixed = [good[0], bad["garbage"], good[1], missing, bad["truncated"], bad["bomb"]]
    mixed += [bad["hang"], bad["segfault"], bad["sigkill"], bad["magenta"], good[2]]
    expected_errors = {
        1: "UnidentifiedImageError",
        3: "MissingObject",
        4: None,  # whatever Pillow raises for a cut-off JPEG
        5: "ImageTooLarge",
        6: "WorkerHung",
        7: "WorkerDied",
        8: "WorkerDied",
        9: "ValueError",
    }
    jobs = {f"good-{n}": good[3 + n * 11 : 14 + n * 11] for n in range(5)}
    send_jobs(aws, stack, {"mixed": mixed, **jobs, "killer": [bad["sigkill"]]})

    empty = upload(aws, stack, "manifests/empty.txt", b"\n")
    too_long = upload(aws, stack, "manifests/long.txt", "\n".join([good[0]] * 61).encode())
    output = job_output(stack, "poison")
    poison: list[str | dict[str, object]] = [
        "{not json",
        {"inputs": [good[0]], "output": output, "colour": "red"},
        {"inputs": [good[0]], "manifest": empty, "output": output},
        {"output": output},
        {"job_id": "../../etc/passwd", "inputs": [good[0]], "output": output},
        {"inputs": ["s3://someone-elses-bucket/a.png"], "output": output},
        {"manifest": empty, "output": output},
        {"manifest": too_long, "output": output},
    ]
    forged = _send_poison(aws, stack, poison, good[:2])

    daemon = start_daemon(
        daemon_args(
            stack,
            tmp_path / "logs",
            "--drain",
            "--preprocess",
            "tests.support.faults:faulty_preprocessor",
            "--model",
            "tests.support.faults:fragile_classifier",
            "--preprocess-timeout-seconds",
            "1",  # each try of the hang costs this: bisected out of its batch, then alone
            "--allowed-buckets",
            stack.bucket,
            "--max-items-per-job",
            "60",
            "--receive-wait-seconds",
            "0",  # short polls: it drains (two empty receives) without waiting 1 s on each
            # Batches fill (over 8: out of memory) however slowly a loaded machine
            # prepares their items, where 20 ms gave batches of 8 at most once.
            "--max-batch-wait-ms",
            "500",
        )
    )
    exit_code = daemon.wait(240)
    broken = daemon.events("worker_broken") + daemon.events("stage_thread_failed")
    assert exit_code == 0, (broken, daemon.stderr[-3000:])

    results = aws.results(job_output(stack, "mixed"))
    assert [r["input"] for r in results] == mixed
    errors = {r["index"]: r["error"]["type"] for r in results if "error" in r}
    assert set(errors) == set(expected_errors)
    assert all(errors[i] == kind for i, kind in expected_errors.items() if kind), errors
    summary = aws.summary(job_output(stack, "mixed"))
    assert (summary["status"], summary["succeeded"], summary["failed"]) == ("partial", 3, 8)
    events = aws.log_events(job_output(stack, "mixed"))
    assert sum(e["event"] == "item_failed" for e in events) == 8
    lost = [e["reason"] for e in events if e["event"] == "worker_lost"]
    assert any("exited with code -9" in r for r in lost), lost  # SIGKILL
    assert any("exited with code -11" in r for r in lost), lost  # SIGSEGV
    assert any("gave no answer" in r for r in lost), lost  # the hang

    killer = aws.summary(job_output(stack, "killer"))
    assert (killer["status"], killer["failed"]) == ("failed", 1)
    assert aws.results(job_output(stack, "killer"))[0]["error"]["type"] == "WorkerDied"

    correct = 0
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        correct += sum(
            r["label"] == labels[r["input"]] for r in aws.results(job_output(stack, job_id))
        )
    assert correct / sum(map(len, jobs.values())) >= 0.95

    # Batches over 8 ran out of memory: split, and the batch size lowered; no item lost.
    assert daemon.events("batch_size_lowered")[0]["batch_size"] <= 8
    all_events = [
        e["event"] for job in ["mixed", *jobs] for e in aws.log_events(job_output(stack, job))
    ]
    assert "out_of_memory" in all_events

    # Preprocessing workers were replaced; the model was loaded once, never again.
    started = [e["stage"] for e in daemon.events("stage_worker_started")]
    assert started.count("inference") == 1 and started.count("preprocess") > 2

    # Each poison message dead-lettered, and nothing else: at least once, as a forged
    # one (a message back before its delete is dead-lettered again).
    dead = _other_dead_letters_than_the_forged(aws, stack, forged, good[:2], tmp_path)
    assert {m["Body"] for m in dead} == {p if isinstance(p, str) else json.dumps(p) for p in poison}
    assert all(m["MessageAttributes"]["reason"]["StringValue"] for m in dead)
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def _send_poison(
    aws: Aws, stack: Stack, poison: list[str | dict[str, object]], inputs: list[str]
) -> dict[str, str]:
    """The `poison` bodies; the job "victim" of `inputs`; messages whose continuation
    attributes do not parse, sent with boto3 (returned: their ids, each with the
    attribute it forges); and the job "hijack", whose message names victim's as the one
    it replaces. Those last of the first of `inputs`."""
    for body in poison:
        aws.send(stack.queue_url, body)
    victim = aws.sqs.send_message(
        QueueUrl=stack.queue_url,
        MessageBody=json.dumps(
            {"job_id": "victim", "inputs": inputs, "output": job_output(stack, "victim")}
        ),
    )["MessageId"]

    def forge(name: str, attribute: str, value: str, **body: str) -> str:
        output = job_output(stack, name)
        return str(
            aws.sqs.send_message(
                QueueUrl=stack.queue_url,
                MessageBody=json.dumps({**body, "inputs": inputs[:1], "output": output}),
                MessageAttributes={attribute: {"DataType": "String", "StringValue": value}},
            )["MessageId"]
        )

    forged = {
        forge("count", "worker.earlier-attempts", "²", job_id="count"): "worker.earlier-attempts",
        forge("soon", "worker.replaced-lease-ends", "soon", job_id="soon"): (
            "worker.replaced-lease-ends"
        ),
        forge("escape", "worker.first-message-id", "../../x"): "worker.first-message-id",
    }
    forge("hijack", "worker.handed-over-from", victim, job_id="hijack")
    return forged


def _other_dead_letters_than_the_forged(
    aws: Aws, stack: Stack, forged: dict[str, str], inputs: list[str], logs_in: Path
) -> list[dict[str, Any]]:
    """Checks that each forged message was dead-lettered naming its attribute, that no
    log was written outside `logs_in`/logs (the first message id "../../x"), and that
    "victim" and "hijack" (`_send_poison`) are complete; the other dead letters.
    Dead-lettering is a send, then a delete: a send whose answer was lost is sent again,
    and a message back before its delete is dead-lettered again, so a forged message
    may be there twice; each names its source and its reason."""
    others: list[dict[str, Any]] = []
    reasons: dict[str, set[str]] = {}
    for message in aws.dead_letters(stack.dlq_url):
        attributes = message["MessageAttributes"]
        source = attributes["source_message_id"]["StringValue"]
        if source in forged:
            reasons.setdefault(source, set()).add(attributes["reason"]["StringValue"])
        else:
            others.append(message)
    assert reasons.keys() == forged.keys(), reasons
    for source, attribute in forged.items():
        (reason,) = reasons[source]
        assert f"message attribute {attribute} is not" in reason, reasons
    assert sorted(path.name for path in logs_in.iterdir()) == ["logs"]
    assert not list(logs_in.parent.glob("x*.log"))
    assert_complete(aws, stack, "victim", inputs)
    assert_complete(aws, stack, "hijack", inputs[:1])
    return others


def test_a_job_of_missing_inputs_fails_with_their_errors_on_a_fresh_daemon(
    aws: Aws, tmp_path: Path
) -> None:
    """The first job a daemon ever gets names three objects that do not exist: S3 says
    so (a 404 to a role that may list the bucket), which is the inputs' fault with
    nothing fetched before to tell by. The job ends `failed`, each input's error its
    own, acked; it is not handed back by every daemon in turn until the DLQ."""
    stack = aws.stack()
    missing = [f"s3://{stack.bucket}/images/gone-{number}.img" for number in range(3)]
    send_jobs(aws, stack, {"gone": missing})
    run = run_daemon(aws, daemon_args(stack, tmp_path, "--drain"), timeout_s=120)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = aws.summary(job_output(stack, "gone"))
    assert (summary["status"], summary["failed"], summary["attempt"]) == ("failed", 3, 1)
    errors = [line["error"]["type"] for line in aws.results(job_output(stack, "gone"))]
    assert errors == ["MissingObject"] * 3
    assert not aws.dead_letters(stack.dlq_url)
