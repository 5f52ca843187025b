"""Interruption notices: spot interruptions, Auto Scaling terminations through a
lifecycle hook, and rebalance recommendations, read from a fake instance metadata
service over HTTP, and acted on by the daemon in-process. (The daemon as a subprocess
against a moto server: tests/e2e/test_interruption_notices.py.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakeaws import FakeImds, metadata_time
from tests.support.in_process import job_file, run_while, sample_images, send_job, serving_settings
from tests.support.timing import wait_until
from worker.adapters.aws.imds import (
    REBALANCE_RECOMMENDATION_PATH,
    SPOT_INSTANCE_ACTION_PATH,
    TARGET_LIFECYCLE_STATE_PATH,
    Imds,
    ImdsNotices,
)
from worker.adapters.aws.platform import PlatformUnavailable, interruption_notices
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.interruptions import InterruptionWatch
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.ports import Notice, NoticeKind
from worker.settings import Settings


@pytest.fixture
def imds() -> Iterator[tuple[FakeImds, str]]:
    fake = FakeImds("i-0123456789abcdef0", "workers")
    with fake.serving() as url:
        yield fake, url


def test_metadata_notices_are_read_with_one_token(imds: tuple[FakeImds, str]) -> None:
    """Nothing, then a rebalance recommendation, then a lifecycle termination, then a
    spot interruption with its time: each poll answers the most serious notice standing,
    and one IMDSv2 token serves every poll."""
    fake, url = imds
    completed: list[bool] = []
    notices = ImdsNotices(Imds(url), lambda: completed.append(True))
    assert notices.poll() is None
    fake.paths[REBALANCE_RECOMMENDATION_PATH] = json.dumps(
        {"noticeTime": metadata_time(time.time())}
    )
    assert notices.poll() == Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
    fake.paths[TARGET_LIFECYCLE_STATE_PATH] = "Terminated"
    scale_in = notices.poll()
    assert scale_in is not None and scale_in.kind is NoticeKind.TERMINATION
    assert scale_in.cause == "scale-in" and scale_in.deadline is None
    assert scale_in.acknowledge is not None
    scale_in.acknowledge()
    assert completed == [True]
    goes_at = int(time.time()) + 120
    action = {"action": "terminate", "time": metadata_time(goes_at)}
    fake.paths[SPOT_INSTANCE_ACTION_PATH] = json.dumps(action)
    assert notices.poll() == Notice(NoticeKind.TERMINATION, "spot-interruption", goes_at)
    assert fake.token_requests == 1
    fake.paths[SPOT_INSTANCE_ACTION_PATH] = "not json"
    unreadable = notices.poll()  # still a notice: the grace period is its deadline
    assert unreadable == Notice(NoticeKind.TERMINATION, "spot-interruption", None)


def test_a_token_the_service_no_longer_knows_is_replaced(imds: tuple[FakeImds, str]) -> None:
    """The metadata service restarted and refuses the cached token (401): that poll
    fails, and the next one gets a fresh token and reads the notice."""
    fake, url = imds
    notices = ImdsNotices(Imds(url))
    assert notices.poll() is None
    fake.token = "rotated"
    fake.paths[REBALANCE_RECOMMENDATION_PATH] = "{}"
    with pytest.raises(OSError):
        notices.poll()
    assert notices.poll() == Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
    assert fake.token_requests == 2


def test_the_watch_reports_what_is_new_and_outlives_unreadable_metadata() -> None:
    """A poll that fails (the service blinks) is tried again; a notice standing across
    polls is reported once; a scale-in after a rebalance is reported, and a spot notice
    with its time after that; the watch ends there, as nothing more can change."""
    rebalance = Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
    scale_in = Notice(NoticeKind.TERMINATION, "scale-in")
    spot = Notice(NoticeKind.TERMINATION, "spot-interruption", time.time() + 120)
    script: list[Notice | Exception | None] = [
        OSError("no answer (test)"),
        None,
        rebalance,
        OSError("no answer (test)"),
        rebalance,
        scale_in,
        scale_in,
        spot,
    ]
    seen: list[Notice] = []
    overran: list[bool] = []

    class Scripted:
        def poll(self) -> Notice | None:
            if not script:  # the watch should have ended: end it, and fail below
                overran.append(True)
                watch.stop()
                return None
            answer = script.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    watch = InterruptionWatch(Scripted(), 0.001, seen.append)
    watch.run()
    assert seen == [rebalance, scale_in, spot]
    assert script == [] and not overran


def test_notices_that_cannot_work_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, imds: tuple[FakeImds, str]
) -> None:
    """`imds`, or a lifecycle hook, without instance metadata stops the daemon at start
    with a clear error; `auto` then watches nothing; a hook with notices off is refused
    by the settings."""
    fake, url = imds
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url)
    assert isinstance(interruption_notices("auto", None, None, 1), ImdsNotices)
    del fake.paths["/latest/meta-data/instance-id"]
    assert interruption_notices("auto", None, None, 1) is None
    with pytest.raises(PlatformUnavailable, match="instance metadata"):
        interruption_notices("imds", None, None, 1)
    with pytest.raises(PlatformUnavailable, match="lifecycle-hook-name"):
        interruption_notices("auto", "drain-hook", None, 1)
    with pytest.raises(ValueError, match="lifecycle_hook_name needs interruption_notices"):
        Settings(queue_url="q", lifecycle_hook_name="drain-hook", interruption_notices="off")


class SettableNotices:
    """Answers with whatever notice the test has set."""

    def __init__(self) -> None:
        self.notice: Notice | None = None

    def poll(self) -> Notice | None:
        return self.notice


def test_a_rebalance_recommendation_stops_intake_and_finishes_what_is_held(
    tmp_path: Path,
) -> None:
    """The instance is at risk but not yet going: the held job finishes and is acked,
    no message is received after the notice, and the daemon keeps serving until it is
    told to stop."""
    source, blobs, notices = InMemoryJobSource(), InMemoryBlobStore(), SettableNotices()
    uris = sample_images(blobs, 10)
    send_job(source, "held", uris)
    daemon = Daemon(serving_settings(tmp_path), source, blobs, notices=notices)

    def drive() -> None:
        wait_until(lambda: source.counts().in_flight == 1)
        notices.notice = Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
        wait_until(lambda: "s3://bkt/out/held/job.json" in blobs.objects)
        send_job(source, "late", uris[:1])
        receives = source.receive_calls
        time.sleep(1.0)
        assert source.receive_calls == receives and source.counts().visible == 1
        daemon.stop()

    # Signalled, not drained or broken: it was still serving when told to stop.
    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    assert job_file(blobs, "held", "job.json")["status"] == "succeeded"
    assert source.counts().visible == 1


def test_a_daemon_started_under_a_standing_notice_takes_no_work(tmp_path: Path) -> None:
    """The container restarted after a spot notice: the notice is read before the first
    receive, so no job is taken (and handed back, spending a delivery); it exits at once."""
    source, blobs, notices = InMemoryJobSource(), InMemoryBlobStore(), SettableNotices()
    send_job(source, "queued", sample_images(blobs, 1))
    notices.notice = Notice(NoticeKind.TERMINATION, "spot-interruption", time.time() + 100)
    daemon = Daemon(serving_settings(tmp_path), source, blobs, notices=notices)
    assert daemon.run() is ExitCode.INTERRUPTED
    assert source.receive_calls == 0 and source.counts().visible == 1


def test_a_spot_notice_during_a_shutdown_brings_its_end_forward(tmp_path: Path) -> None:
    """SIGTERM with a 60 s grace, then a spot notice with 2 s left: the daemon does not
    wait out the grace (nor the 15 s the job needs); it hands the job back."""
    source, blobs, notices = InMemoryJobSource(), InMemoryBlobStore(), SettableNotices()
    send_job(source, "long", sample_images(blobs, 150))
    daemon = Daemon(
        serving_settings(tmp_path, grace_seconds=60, interruption_margin_seconds=1),
        source,
        blobs,
        notices=notices,
    )
    goes_at: list[float] = []

    def drive() -> None:
        wait_until(lambda: source.counts().in_flight == 1)
        daemon.stop()
        time.sleep(0.5)
        goes_at.append(time.time() + 2)
        notices.notice = Notice(NoticeKind.TERMINATION, "spot-interruption", goes_at[0])

    assert run_while(daemon, drive) is ExitCode.SIGNALLED
    assert time.time() < goes_at[0] + 6  # handed back at 1 s before, then the exit
    assert "s3://bkt/out/long/job.json" not in blobs.objects
    assert source.counts().visible == 1
