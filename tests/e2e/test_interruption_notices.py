"""Interruption notices acted on by the daemon as a subprocess against a moto server,
with a fake instance metadata service over HTTP: a spot interruption, and an Auto
Scaling termination through a lifecycle hook. (Reading the notices, and the daemon
in-process: tests/test_interruption_notices.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from tests.support.aws import Aws, ec2_env
from tests.support.daemons import StartDaemon, daemon_args, slow_model_flags
from tests.support.fakeaws import FakeImds, metadata_time
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.jobs import job_output, send_jobs
from worker.adapters.aws.imds import SPOT_INSTANCE_ACTION_PATH, TARGET_LIFECYCLE_STATE_PATH
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e


COMPLETE_LIFECYCLE_ACTION_ANSWER = (
    '<CompleteLifecycleActionResponse xmlns="http://autoscaling.amazonaws.com/doc/2011-01-01/">'
    "<CompleteLifecycleActionResult/><ResponseMetadata><RequestId>1</RequestId>"
    "</ResponseMetadata></CompleteLifecycleActionResponse>"
)


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
    send_jobs(aws, stack, {"short": uris[:2]})
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
        # The long job after the short one is in: each message is admitted apart, and
        # one admitted first is fed first.
        daemon.wait_for("job_received")
        send_jobs(aws, stack, {"long": uris[2:]})
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
