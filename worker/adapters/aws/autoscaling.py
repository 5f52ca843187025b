"""EC2 Auto Scaling: scale-in protection, taking a host out of service, lifecycle hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import boto3

from worker.adapters.aws.calls import Retrying, client_config
from worker.retry import DEFAULT_AWS_MAX_ATTEMPTS

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient


def autoscaling_client() -> AutoScalingClient:
    return boto3.session.Session().client("autoscaling", config=client_config())


class AsgGuard(Retrying):
    """EC2 Auto Scaling: SetInstanceProtection on this instance."""

    name = "asg"
    renew_every_s: float | None = None  # protection of an instance does not expire

    def __init__(
        self,
        client: AutoScalingClient,
        instance_id: str,
        group_name: str,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
    ):
        super().__init__(attempts)
        self._client = client
        self.instance_id = instance_id
        self.group_name = group_name

    def set_protected(self, protected: bool) -> None:
        self._call(
            lambda: self._client.set_instance_protection(
                InstanceIds=[self.instance_id],
                AutoScalingGroupName=self.group_name,
                ProtectedFromScaleIn=protected,
            )
        )

    def take_out_of_service(self) -> str:
        self._call(
            lambda: self._client.set_instance_health(
                InstanceId=self.instance_id,
                HealthStatus="Unhealthy",
                ShouldRespectGracePeriod=False,
            )
        )
        return f"instance {self.instance_id} set Unhealthy: its Auto Scaling group replaces it"


class LifecycleHook(Retrying):
    """An Auto Scaling lifecycle hook that holds this instance while it terminates."""

    def __init__(
        self,
        client: AutoScalingClient,
        group_name: str,
        hook_name: str,
        instance_id: str,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
    ):
        super().__init__(attempts)
        self._client = client
        self._group_name = group_name
        self._hook_name = hook_name
        self._instance_id = instance_id

    def complete(self) -> None:
        """Let the instance go on terminating."""
        self._call(
            lambda: self._client.complete_lifecycle_action(
                AutoScalingGroupName=self._group_name,
                LifecycleHookName=self._hook_name,
                InstanceId=self._instance_id,
                LifecycleActionResult="CONTINUE",
            )
        )
