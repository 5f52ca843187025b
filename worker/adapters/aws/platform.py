"""Which platform this daemon runs on decides where its notices come from and which
guard holds scale-in protection."""

from __future__ import annotations

import os

from worker.adapters.aws.autoscaling import AsgGuard, LifecycleHook, autoscaling_client
from worker.adapters.aws.ecs import EcsGuard
from worker.adapters.aws.imds import ASG_NAME_PATH, INSTANCE_ID_PATH, Imds, ImdsNotices
from worker.ports import NoticeSource, ScaleInGuard


class PlatformUnavailable(Exception):
    """The machine lacks what the settings ask of it (scale-in protection outside an
    Auto Scaling group or ECS, interruption notices without instance metadata)."""


def interruption_notices(
    mode: str, lifecycle_hook: str | None, asg_name: str | None, max_attempts: int
) -> NoticeSource | None:
    """Where interruption notices come from for `mode` (auto, imds, off); None for off.

    `auto` watches instance metadata where it answers (EC2, ECS on EC2), else nothing
    (Fargate, a laptop). `imds`, or a lifecycle hook to complete, that cannot work raises
    `PlatformUnavailable`, so a misconfigured fleet fails at start.
    """
    required = mode == "imds" or lifecycle_hook is not None
    metadata_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    if mode == "off" or (metadata_off and not required):
        return None
    imds = Imds()
    try:
        instance_id = imds.get(INSTANCE_ID_PATH)
        group = (asg_name or imds.get(ASG_NAME_PATH)) if lifecycle_hook else ""
    except OSError as error:
        if not required:
            return None
        raise PlatformUnavailable(
            f"interruption notices need instance metadata, which did not say which instance "
            f"(and group, for --lifecycle-hook-name) this is: {error}"
        ) from error
    if not lifecycle_hook:
        return ImdsNotices(imds)
    hook = LifecycleHook(autoscaling_client(), group, lifecycle_hook, instance_id, max_attempts)
    return ImdsNotices(imds, hook.complete)


def scale_in_guard(
    mode: str, asg_name: str | None, ecs_expires_minutes: int, max_attempts: int
) -> ScaleInGuard | None:
    """The guard for `mode` (auto, asg, ecs, off); None for off.

    `auto` takes ECS when the agent's URI is set, else EC2 Auto Scaling when the instance
    metadata service answers, else off. An explicit mode that cannot work raises
    `PlatformUnavailable`, so a misconfigured fleet fails at start, not at scale-in.
    """
    if mode == "off":
        return None
    agent_uri = os.environ.get("ECS_AGENT_URI")
    if mode == "ecs" or (mode == "auto" and agent_uri):
        if not agent_uri:
            raise PlatformUnavailable("--protection ecs, but ECS_AGENT_URI is not set")
        return EcsGuard(agent_uri, ecs_expires_minutes)
    if mode == "auto" and os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    try:
        imds = Imds()
        instance_id = imds.get(INSTANCE_ID_PATH)
        group = asg_name or imds.get(ASG_NAME_PATH)
    except OSError as error:
        if mode == "auto":
            return None
        raise PlatformUnavailable(
            f"--protection asg, but the instance metadata service did not say which "
            f"instance and group this is ({error}); is the instance in an Auto Scaling "
            "group with instance metadata tags on, or is --asg-name missing?"
        ) from error
    return AsgGuard(autoscaling_client(), instance_id, group, max_attempts)
