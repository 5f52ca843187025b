"""Interruption notices: spot interruptions, Auto Scaling terminations through a
lifecycle hook, and rebalance recommendations, read from a fake instance metadata
service over HTTP; the daemon as a subprocess against a moto server, and in-process."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from tests.support.aws import Aws, ec2_env
from tests.support.daemons import StartDaemon, daemon_args, slow_model_flags
from tests.support.fakeaws import FakeImds, metadata_time
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.in_process import job_file, run_while, sample_images, send_job, serving_settings
from tests.support.jobs import job_output, send_jobs
from tests.support.timing import wait_until
from worker.adapters import aws as aws_adapters
from worker.adapters.aws import (
    REBALANCE_RECOMMENDATION_PATH,
    SPOT_INSTANCE_ACTION_PATH,
    TARGET_LIFECYCLE_STATE_PATH,
    Imds,
    ImdsNotices,
    PlatformUnavailable,
)
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon import Daemon, ExitCode
from worker.daemon.interruptions import InterruptionWatch
from worker.demo import upload_samples
from worker.ports import Notice, NoticeKind
from worker.settings import Settings

COMPLETE_LIFECYCLE_ACTION_ANSWER = (
    '<CompleteLifecycleActionResponse xmlns="http://autoscaling.amazonaws.com/doc/2011-01-01/">'
    "<CompleteLifecycleActionResult/><ResponseMetadata><RequestId>1</RequestId>"
    "</ResponseMetadata></CompleteLifecycleActionResponse>"
)


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
    assert isinstance(aws_adapters.interruption_notices("auto", None, None, 1), ImdsNotices)
    del fake.paths["/latest/meta-data/instance-id"]
    assert aws_adapters.interruption_notices("auto", None, None, 1) is None
    with pytest.raises(PlatformUnavailable, match="instance metadata"):
        aws_adapters.interruption_notices("imds", None, None, 1)
    with pytest.raises(PlatformUnavailable, match="lifecycle-hook-name"):
        aws_adapters.interruption_notices("auto", "drain-hook", None, 1)
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


@pytest.mark.e2e
def test_a_spot_notice_finishes_what_can_finish_and_hands_back_the_rest(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A spot interruption appears in instance metadata and no signal comes: the daemon
    stops receiving at once, finishes the job that can finish before the instance goes
    (less the margin), hands back the one that cannot, drops scale-in protection and
    exits 0 before the notice's time."""
    stack = aws.stack(visibility_timeout_s=60)
    group = f"{stack.bucket}-workers"
    instance_id = aws.auto_scaling_group(group)
    uris = list(upload_samples(aws.s3, stack.bucket, 72, seed=17))
    send_jobs(aws, stack, {"short": uris[:2], "long": uris[2:]})
    fake = FakeImds(instance_id, group)
    with fake.serving() as imds_url:
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                *slow_model_flags(1),
                "--notice-poll-seconds",
                "0.5",
                "--interruption-margin-seconds",
                "5",
                "--idle-grace-seconds",
                "600",
                "--visibility-timeout-seconds",
                "60",
            ),
            env=ec2_env(aws, imds_url, SLOW_MODEL_SECONDS_PER_BATCH="0.25"),
        )
        daemon.wait_for("job_received", 2)
        daemon.wait_for("scale_in_protection_set")
        # The long job needs 70 x 0.25 s; the short one at most the batches fed before
        # it, ahead of it in the stages' queues: about 5 s. It has about 10.
        goes_at = int(time.time()) + 16
        action = {"action": "terminate", "time": metadata_time(goes_at)}
        fake.paths[SPOT_INSTANCE_ACTION_PATH] = json.dumps(action)
        [notice] = daemon.wait_for("interruption_notice")
        time.sleep(1.5)  # a receive under way when it came is over
        send_jobs(aws, stack, {"late": uris[:1]})
        assert daemon.wait(30) == 0, daemon.stderr[-3000:]
        assert time.time() < goes_at
    assert (notice["kind"], notice["cause"]) == ("termination", "spot-interruption")
    assert aws.summary(job_output(stack, "short"))["status"] == "succeeded"
    assert "job.json" not in aws.names(job_output(stack, "long"))
    [released] = daemon.events("job_released")
    assert (released["job_id"], released["reason"]) == ("long", "interrupted: spot-interruption")
    [handled] = daemon.events("interruption_handled")
    assert handled["handed_back"] == 1
    assert daemon.events("daemon_stopped")[0]["reason"] == "interrupted"
    assert not aws.protected(instance_id)
    assert aws.queue_depth(stack.queue_url) == (2, 0)  # long, handed back; late, never taken


@pytest.mark.e2e
def test_a_lifecycle_hook_termination_finishes_the_job_then_completes_the_action(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """Auto Scaling terminates the instance through a lifecycle hook: its target
    lifecycle state turns Terminated. The daemon finishes its job within the grace
    period, drops protection, then completes the lifecycle action (CONTINUE) for its
    group, hook and instance, and exits 0."""
    stack = aws.stack()
    group = f"{stack.bucket}-workers"
    instance_id = aws.auto_scaling_group(group)
    uris = list(upload_samples(aws.s3, stack.bucket, 4, seed=18))
    send_jobs(aws, stack, {"held": uris})
    proxy, fake = FaultProxy(aws.endpoint), FakeImds(instance_id, group)
    # moto has no CompleteLifecycleAction: the proxy answers it as Auto Scaling would.
    proxy.add(
        Fault(
            "complete",
            lambda request: request.action == "CompleteLifecycleAction",
            kind="answer",
            status=200,
            body=COMPLETE_LIFECYCLE_ACTION_ANSWER,
        )
    )
    with proxy.serving() as proxy_url, fake.serving() as imds_url:
        daemon = start_daemon(
            daemon_args(
                stack,
                tmp_path,
                *slow_model_flags(1),
                "--notice-poll-seconds",
                "0.5",
                "--lifecycle-hook-name",
                "drain-hook",
            ),
            env=ec2_env(aws.with_endpoint(proxy_url), imds_url, SLOW_MODEL_SECONDS_PER_BATCH="0.5"),
        )
        daemon.wait_for("job_received")
        fake.paths[TARGET_LIFECYCLE_STATE_PATH] = "Terminated"
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    assert aws.summary(job_output(stack, "held"))["status"] == "succeeded"
    assert not aws.protected(instance_id)
    [completion] = proxy.requests("CompleteLifecycleAction")
    parameters = {name: values[0] for name, values in parse_qs(completion.body).items()}
    assert (
        parameters
        | {
            "AutoScalingGroupName": group,
            "LifecycleHookName": "drain-hook",
            "InstanceId": instance_id,
            "LifecycleActionResult": "CONTINUE",
        }
        == parameters
    )
    assert daemon.events("interruption_handled")[0]["handed_back"] == 0
    assert not daemon.events("lifecycle_action_not_completed")
