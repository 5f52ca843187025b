"""Fetching never waits for the slowest object, end to end: a daemon subprocess against
the moto server, through a proxy that holds some objects' GETs for seconds (an S3 tail
at its worst): the inputs fetched meanwhile go on; a GET slow only the first time is
made again and answered by its hedge."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args, free_port, http_get
from tests.support.faultproxy import Fault, FaultProxy, Request
from tests.support.jobs import job_output, send_jobs
from worker.demo import upload_samples
from worker.ports import S3Location

pytestmark = pytest.mark.e2e

# How long a held GET takes: far longer than the rest of the work, on a loaded machine.
HELD_S = 20.0


def _gets_of(keys: set[str]) -> object:
    def matches(request: Request) -> bool:
        return request.method == "GET" and request.path.split("/", 2)[-1] in keys

    return matches


def test_an_input_fetched_goes_on_while_a_slow_one_of_its_request_is_held(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """One preprocessing process fetching eight at a time; the first job's inputs 3 and
    11 (one in each request of eight) answer only after 20 s, however often asked. The
    job sent after it, eight inputs, is done while they are held: before, every request
    waited for its slowest input, and the requests behind it for it."""
    stack = aws.stack()
    uris = sorted(upload_samples(aws.s3, stack.bucket, 24, seed=43))
    held = {S3Location.parse(uris[3]).key, S3Location.parse(uris[11]).key}
    send_jobs(aws, stack, {"slow": uris[:16]})
    send_jobs(aws, stack, {"quick": uris[16:]})
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("held", _gets_of(held), kind="slow", delay_s=HELD_S))
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            daemon_args(stack, tmp_path, "--preprocess-workers", "1", "--fetch-concurrency", "8"),
            env=aws.with_endpoint(proxy_url).env,
        )
        [received] = [e for e in daemon.wait_for("job_received", 2) if e["job_id"] == "quick"]
        started = time.monotonic()
        daemon.wait_for("job_finished", 1, timeout_s=60)
        quick_s = time.monotonic() - started
        [first] = daemon.events("job_finished")
        daemon.send_signal(15)  # the slow job is handed back, its two inputs still held
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert first["job_id"] == "quick", first
    assert quick_s < HELD_S / 2, quick_s
    assert received["items"] == 8
    assert aws.summary(job_output(stack, "quick"))["status"] == "succeeded"


def test_a_get_slow_the_first_time_is_hedged_and_the_hedge_answers(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """After 60 inputs timed, five GETs answer only after 20 s the first time they are
    asked: each is made again past the store's 95th percentile, the hedge answers, the
    job is done in well under 20 s, and the hedges are counted in the metrics. (100
    GETs in flight let all five be hedged at once: with 8, two at a time, the five took
    three rounds of a 95th percentile a loaded machine had made seconds long, over 20 s.)"""
    stack = aws.stack()
    uris = sorted(upload_samples(aws.s3, stack.bucket, 70, seed=47))
    tail = {S3Location.parse(uri).key for uri in uris[-5:]}
    send_jobs(aws, stack, {"warm": uris[:60]})
    port = free_port()
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("tail", _gets_of(tail), times=1, kind="slow", delay_s=HELD_S))
    with proxy.serving() as proxy_url:
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                "--preprocess-workers",
                "1",
                "--fetch-concurrency",
                "100",
                "--metrics-port",
                str(port),
            ),
            env=aws.with_endpoint(proxy_url).env,
        )
        daemon.wait_for("job_finished", 1, timeout_s=60)
        send_jobs(aws, stack, {"tail": uris[-5:]})
        started = time.monotonic()
        daemon.wait_for("job_finished", 2, timeout_s=60)
        tail_s = time.monotonic() - started
        _, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
        daemon.send_signal(15)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert tail_s < HELD_S / 2, tail_s
    assert proxy.injected["tail"] == 5
    hedged = [
        line
        for line in metrics.splitlines()
        if line.startswith("worker_stage_counts_total") and 'count="hedged"' in line
    ]
    assert hedged and float(hedged[0].split()[-1]) >= 5, hedged
