"""Fault tests: real faults injected into the daemon running as a subprocess against a
moto server (docs/DESIGN.md section 4, one test per row). Every test also checks, through
the `start_daemon` fixture or `run_daemon`, that no process of the daemon outlives it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from PIL import Image

from bench.run import peak_rss, tree_rss_mb
from stages.synthetic import samples
from tests.support.aws import Aws
from tests.support.daemons import (
    StartDaemon,
    daemon_args,
    run_daemon,
    slow_model_flags,
)
from tests.support.faultproxy import FaultProxy, Request
from tests.support.faults import MAGENTA, png_bytes
from tests.support.jobs import assert_complete, job_output, send_jobs, upload
from worker.demo import upload_samples
from worker.jobs.results import FINISH_ATTEMPTS

pytestmark = pytest.mark.e2e


def _local_log(log_dir: Path, job_id: str) -> Path:
    """The job's log on this machine (named by its id and its output)."""
    [path] = log_dir.glob(f"{job_id}.*.log")
    return path


def test_forged_continuation_attributes_poison_their_own_message_alone(
    aws: Aws, tmp_path: Path
) -> None:
    """Messages sent with boto3 whose continuation attributes do not parse (a count of
    "²", a lease end of "soon", a first message id of "../../x", which would name a file
    outside --log-dir) are each dead-lettered naming the attribute, and the valid jobs
    received beside them run. A message naming another job's message as the one it
    replaces, with an output of its own, neither skips nor stops that job."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 6, seed=3))
    jobs = {f"good-{number}": uris[number * 2 : number * 2 + 2] for number in range(3)}
    victim = aws.sqs.send_message(
        QueueUrl=stack.queue_url,
        MessageBody=json.dumps(
            {"job_id": "good-0", "inputs": jobs["good-0"], "output": job_output(stack, "good-0")}
        ),
    )["MessageId"]
    send_jobs(aws, stack, {job_id: jobs[job_id] for job_id in ("good-1", "good-2")})

    def forge(name: str, attribute: str, value: str, **body: str) -> None:
        aws.sqs.send_message(
            QueueUrl=stack.queue_url,
            MessageBody=json.dumps({**body, "inputs": uris[:1], "output": job_output(stack, name)}),
            MessageAttributes={attribute: {"DataType": "String", "StringValue": value}},
        )

    forge("count", "worker.earlier-attempts", "²", job_id="count")
    forge("soon", "worker.replaced-lease-ends", "soon", job_id="soon")
    forge("escape", "worker.first-message-id", "../../x")
    forge("hijack", "worker.handed-over-from", victim, job_id="hijack")

    log_dir = tmp_path / "logs"
    run = run_daemon(aws, daemon_args(stack, log_dir, "--drain"))
    assert run.returncode == 0, run.stderr[-3000:]
    for job_id in ("good-0", "good-1", "good-2"):
        assert_complete(aws, stack, job_id, jobs[job_id])
    assert_complete(aws, stack, "hijack", uris[:1])
    reasons = sorted(
        message["MessageAttributes"]["reason"]["StringValue"]
        for message in aws.dead_letters(stack.dlq_url)
    )
    assert len(reasons) == 3
    for reason, attribute in zip(
        reasons,
        ["worker.earlier-attempts", "worker.first-message-id", "worker.replaced-lease-ends"],
        strict=True,
    ):
        assert f"message attribute {attribute} is not" in reason, reasons
    assert sorted(path.name for path in tmp_path.iterdir()) == ["logs"]
    assert not list(tmp_path.parent.glob("x*.log"))
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def test_a_huge_input_and_a_huge_manifest_leave_the_daemons_memory_alone(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A 300 MB input and a 120 MB manifest beside ordinary jobs, the default limits
    (64 MiB each): the input is its own error and the manifest's message poison, neither
    read, the other jobs done, and the daemon's whole process tree never grows by as
    much as the smaller of the two."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 12, seed=4))
    huge_input = upload(aws, stack, "huge/input.bin", bytes(300 * 2**20))
    line = f"{uris[0]}\n".encode()
    huge_manifest = upload(aws, stack, "huge/manifest.txt", line * (120 * 2**20 // len(line)))
    jobs = {"first": uris[:6], "second": uris[6:]}
    send_jobs(aws, stack, {**jobs, "with-huge": [uris[0], huge_input, uris[1]]})
    aws.send(stack.queue_url, {"manifest": huge_manifest, "output": job_output(stack, "long")})

    daemon = start_daemon(daemon_args(stack, tmp_path, "--drain"))
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
    out of memory, and eight kinds of poison message, all in one run: each bad item gets
    its own error record, the killing job ends failed, every poison message is
    dead-lettered with its reason, and every other job is complete and right."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 58, seed=21)
    good = list(labels)
    jpeg = next(data for _, data in samples(20, seed=9) if data[:2] == b"\xff\xd8")
    bad = {
        name: upload(aws, stack, f"bad/{name}", data)
        for name, data in {
            "garbage": b"definitely not an image",
            "truncated": jpeg[: len(jpeg) // 3],
            "bomb": png_bytes(Image.new("L", (30_000, 30_000))),
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
    for body in poison:
        aws.send(stack.queue_url, body)

    daemon = start_daemon(
        daemon_args(
            stack,
            tmp_path,
            "--drain",
            "--preprocess",
            "tests.support.faults:faulty_preprocessor",
            "--model",
            "tests.support.faults:fragile_classifier",
            "--preprocess-timeout-seconds",
            "2",
            "--allowed-buckets",
            stack.bucket,
            "--max-items-per-job",
            "60",
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

    dead = aws.dead_letters(stack.dlq_url)
    assert sorted(m["Body"] for m in dead) == sorted(
        p if isinstance(p, str) else json.dumps(p) for p in poison
    )
    assert all(m["MessageAttributes"]["reason"]["StringValue"] for m in dead)
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def test_killed_inference_process_is_restarted_and_its_batch_retried(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGKILL the inference process mid-run: the daemon sees it die, starts a new one,
    retries the batch it held, and every job still completes, succeeded."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 48, seed=4))
    jobs = {f"job-{n}": uris[n * 8 : n * 8 + 8] for n in range(6)}
    send_jobs(aws, stack, jobs)
    daemon = start_daemon(
        daemon_args(stack, tmp_path, "--drain", *slow_model_flags(4)),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.3").env,
    )
    [inference] = [
        e for e in daemon.wait_for("stage_worker_started", 3) if e["stage"] == "inference"
    ]
    daemon.wait_for("job_received")
    time.sleep(1.0)
    os.kill(inference["pid"], signal.SIGKILL)
    assert daemon.wait(120) == 0, daemon.stderr[-3000:]

    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
    [lost] = daemon.events("worker_lost")
    assert lost["stage"] == "inference" and "exited with code -9" in lost["reason"]
    started = [e for e in daemon.events("stage_worker_started") if e["stage"] == "inference"]
    assert len(started) == 2 and started[1]["pid"] != inference["pid"]
    logged = [e for job in jobs for e in aws.log_events(job_output(stack, job))]
    assert any(e["event"] == "worker_lost" and e["stage"] == "inference" for e in logged)
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def test_transient_errors_are_retried_and_an_unuploadable_job_goes_to_the_dlq(
    aws: Aws, tmp_path: Path
) -> None:
    """Through a proxy that answers HTTP 500: every input download and some uploads and
    receives fail once and are retried (the jobs succeed on their first attempt); the
    job whose results can never be uploaded is tried again under its lease, then
    released each time, and after the queue's maxReceiveCount (3) SQS moves it to the
    dead-letter queue."""
    stack = aws.stack()
    uris = list(upload_samples(aws.s3, stack.bucket, 20, seed=6))
    jobs = {f"flaky-{n}": uris[n * 5 : n * 5 + 5] for n in range(4)}
    send_jobs(aws, stack, {**jobs, "doomed": uris[:2]})

    proxy = FaultProxy(aws.endpoint)  # the first fault that matches a request applies
    proxy.fail("doomed_upload", _doomed_upload, times=None)
    proxy.fail("input_download", lambda r: r.method == "GET" and "/images/" in r.path, times=1)
    proxy.fail("upload", lambda r: r.method == "PUT" and r.path.endswith("results.jsonl"), times=1)
    proxy.fail("receive", lambda r: r.action == "ReceiveMessage", times=2)
    with proxy.serving() as proxy_url:
        run = run_daemon(
            aws.with_endpoint(proxy_url),
            daemon_args(
                stack,
                tmp_path,
                "--drain",
                "--aws-max-attempts",
                "3",
                "--retry-delay-seconds",
                "0",
            ),
        )
    assert run.returncode == 0, run.stderr[-3000:]

    assert proxy.injected["input_download"] == 20
    assert proxy.injected["upload"] == 4
    # Three deliveries, each finished FINISH_ATTEMPTS times, each write tried 3 times.
    assert proxy.injected["doomed_upload"] == 3 * FINISH_ATTEMPTS * 3
    assert proxy.injected["receive"] == 2
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        assert aws.summary(job_output(stack, job_id))["attempt"] == 1
    assert "job.json" not in aws.names(job_output(stack, "doomed"))
    [dead] = aws.dead_letters(stack.dlq_url)
    assert json.loads(dead["Body"])["job_id"] == "doomed"
    local_log = _local_log(tmp_path, "doomed").read_text()
    assert local_log.count('"job_released"') == 3 and "InternalError" in local_log
    assert aws.queue_depth(stack.queue_url) == (0, 0)


def _doomed_upload(request: Request) -> bool:
    return request.method == "PUT" and request.path.endswith("/out/doomed/results.jsonl")


def test_sigterm_finishes_or_releases_everything_within_the_grace_period(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGTERM mid-run: exit 0 within the grace period; each job is either complete
    (job.json) or visible on the queue again, none left invisible or half-written."""
    stack = aws.stack(visibility_timeout_s=60)
    uris = list(upload_samples(aws.s3, stack.bucket, 24, seed=8))
    jobs = {f"job-{n}": uris[n * 4 : n * 4 + 4] for n in range(6)}
    send_jobs(aws, stack, jobs)
    grace_s = 3
    daemon = start_daemon(
        daemon_args(
            stack,
            tmp_path,
            *slow_model_flags(2),
            "--grace-seconds",
            str(grace_s),
            "--visibility-timeout-seconds",
            "60",
        ),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.5").env,
    )
    daemon.wait_for("job_received", 6)
    time.sleep(1.0)
    daemon.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert time.monotonic() - signalled < grace_s + 10

    done = {job for job in jobs if "job.json" in aws.names(job_output(stack, job))}
    for job in set(jobs) - done:
        assert "results.jsonl" not in aws.names(job_output(stack, job))
    # A job whose job.json was being written as the grace ran out can be both complete
    # and handed back: its next delivery finds it done and acks it.
    released = {e["job_id"] for e in daemon.events("job_released")}
    assert set(jobs) - done <= released and released
    assert aws.queue_depth(stack.queue_url) == (len(released), 0)
    assert daemon.events("daemon_stopped")[0]["reason"] == "signalled"


def test_second_signal_cuts_the_grace_period_short(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGTERM, then SIGINT: the daemon does not wait out its 60 s grace; it releases
    the jobs at once and exits 0."""
    stack = aws.stack(visibility_timeout_s=60)
    uris = list(upload_samples(aws.s3, stack.bucket, 8, seed=9))
    send_jobs(aws, stack, {"a": uris[:4], "b": uris[4:]})
    daemon = start_daemon(
        daemon_args(stack, tmp_path, *slow_model_flags(1)),
        env=aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="2.0").env,
    )
    daemon.wait_for("job_received", 2)
    daemon.send_signal(signal.SIGTERM)
    daemon.wait_for("draining_in_flight_jobs")
    daemon.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert time.monotonic() - signalled < 10
    assert aws.queue_depth(stack.queue_url) == (2, 0)


def test_sigkill_of_the_daemon_loses_nothing(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """SIGKILL the daemon with 30 jobs in flight; its children go with it. A new daemon
    started at once with `--drain` does the rest, the dead one's jobs included once
    their leases run out: every job has exactly one complete, in-order results.jsonl
    and job.json, and both queues are empty."""
    # Leases longer than a daemon's start, so the new daemon's first receive finds the
    # dead one's messages still in flight.
    stack = aws.stack(visibility_timeout_s=12)
    uris = list(upload_samples(aws.s3, stack.bucket, 180, seed=10))
    jobs = {f"job-{n:02d}": uris[n * 6 : n * 6 + 6] for n in range(30)}
    send_jobs(aws, stack, jobs)
    lease = ["--visibility-timeout-seconds", "12", "--heartbeat-interval-seconds", "3"]
    model = slow_model_flags(4)
    env = aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="0.1").env
    first = start_daemon(daemon_args(stack, tmp_path, *lease, *model), env=env)
    first.wait_for("job_finished", 5)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert first.close() == []  # its children noticed and exited
    assert aws.queue_depth(stack.queue_url)[1] > 0  # the dead daemon's leases

    second = start_daemon(daemon_args(stack, tmp_path, "--drain", *lease, *model), env=env)
    assert second.wait(120) == 0, second.stderr[-3000:]

    attempts = []
    for job_id, inputs in jobs.items():
        assert_complete(aws, stack, job_id, inputs)
        assert set(aws.names(job_output(stack, job_id))) <= {
            "job.json",
            "job.log",
            "results.jsonl",
            "progress.json",
        }
        attempts.append(aws.summary(job_output(stack, job_id))["attempt"])
    assert max(attempts) >= 2  # the kill did interrupt jobs in flight
    assert aws.queue_depth(stack.queue_url) == (0, 0)
    assert aws.dead_letters(stack.dlq_url) == []


def test_job_reaching_the_lease_ceiling_is_released_with_a_reason(aws: Aws, tmp_path: Path) -> None:
    """A job that no delivery can move forward within the longest lease (one input
    slower than the ceiling, shrunk to 4 s here from SQS's 12 h) is released with a log
    line instead of being renewed; each delivery meets the same fate until the redrive
    policy moves it to the dead-letter queue. (One that moves forward is handed over:
    `tests/test_resume.py`.)"""
    stack = aws.stack(visibility_timeout_s=2)
    uris = list(upload_samples(aws.s3, stack.bucket, 1, seed=12))
    send_jobs(aws, stack, {"endless": uris})
    run = run_daemon(
        aws.with_env(SLOW_MODEL_SECONDS_PER_BATCH="6"),
        daemon_args(
            stack,
            tmp_path,
            "--drain",
            *slow_model_flags(1),
            "--visibility-timeout-seconds",
            "2",
            "--heartbeat-interval-seconds",
            "0.5",
            "--max-lease-seconds",
            "4",
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ceilings = [json.loads(line) for line in run.stdout.splitlines() if "lease_ceiling" in line]
    assert len(ceilings) == 3 and all(e["job_id"] == "endless" for e in ceilings)
    assert _local_log(tmp_path, "endless").read_text().count('"lease_ceiling_reached"') == 3
    [dead] = aws.dead_letters(stack.dlq_url)
    assert json.loads(dead["Body"])["job_id"] == "endless"
    assert "job.json" not in aws.names(job_output(stack, "endless"))
    assert aws.queue_depth(stack.queue_url) == (0, 0)
