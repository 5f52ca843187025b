"""Clients for the moto server the tests run, and what a test asks of it: stacks (a
queue, its dead-letter queue and a bucket), messages, outputs, Auto Scaling groups."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any

import boto3

from worker.demo import Stack, create_stack, read_output


@dataclass
class Aws:
    """Clients for the moto server, and the environment a daemon needs to reach it."""

    endpoint: str
    sqs: Any
    s3: Any
    env: dict[str, str]

    def stack(self, visibility_timeout_s: int = 30, max_receive_count: int = 3) -> Stack:
        name = f"t-{uuid.uuid4().hex[:12]}"
        return create_stack(self.sqs, self.s3, name, visibility_timeout_s, max_receive_count)

    def with_endpoint(self, endpoint: str) -> Aws:
        """The same clients; a daemon started with the result talks to `endpoint`."""
        return replace(self, env={**self.env, "AWS_ENDPOINT_URL": endpoint})

    def with_env(self, **more: str) -> Aws:
        return replace(self, env={**self.env, **more})

    def client(self, service: str) -> Any:
        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client(service, endpoint_url=self.endpoint)

    def send(self, queue_url: str, body: dict[str, Any] | str) -> None:
        text = body if isinstance(body, str) else json.dumps(body)
        self.sqs.send_message(QueueUrl=queue_url, MessageBody=text)

    def read(self, output: str, name: str) -> bytes:
        return read_output(self.s3, output, name)

    def results(self, output: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read(output, "results.jsonl").splitlines()]

    def summary(self, output: str) -> dict[str, Any]:
        return json.loads(self.read(output, "job.json"))  # type: ignore[no-any-return]

    def log_events(self, output: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read(output, "job.log").splitlines()]

    def names(self, output: str) -> list[str]:
        """The names of the objects under an output prefix."""
        bucket, _, prefix = output.removeprefix("s3://").partition("/")
        listing = self.s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return sorted(entry["Key"].removeprefix(prefix) for entry in listing)

    def dead_letters(self, dlq_url: str) -> list[dict[str, Any]]:
        """Every message on the dead-letter queue (left invisible for a minute)."""
        messages: list[dict[str, Any]] = []
        while batch := self.sqs.receive_message(
            QueueUrl=dlq_url,
            MaxNumberOfMessages=10,
            MessageAttributeNames=["All"],
            VisibilityTimeout=60,
        ).get("Messages", []):
            messages += batch
        return messages

    def auto_scaling_group(self, name: str) -> str:
        """An Auto Scaling group of one instance; returns the instance id."""
        ec2 = self.client("ec2")
        autoscaling = self.client("autoscaling")
        ec2.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "g5.xlarge"},
        )
        subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
        autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=name,
            LaunchTemplate={"LaunchTemplateName": name},
            MinSize=1,
            MaxSize=2,
            DesiredCapacity=1,
            VPCZoneIdentifier=subnet,
        )
        [instance] = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])[
            "AutoScalingGroups"
        ][0]["Instances"]
        return str(instance["InstanceId"])

    def protected(self, instance_id: str) -> bool:
        """Whether the instance is protected from scale-in."""
        [instance] = self.client("autoscaling").describe_auto_scaling_instances(
            InstanceIds=[instance_id]
        )["AutoScalingInstances"]
        return bool(instance["ProtectedFromScaleIn"])

    def queue_depth(self, queue_url: str) -> tuple[int, int]:
        """(visible, in flight) messages."""
        attributes = self.sqs.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attributes["ApproximateNumberOfMessages"]),
            int(attributes["ApproximateNumberOfMessagesNotVisible"]),
        )

    def queue_empty(self, queue_url: str) -> bool:
        """No message visible, in flight or delayed (a timer a daemon set)."""
        names = [
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ]
        attributes = self.sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=names)
        return all(int(attributes["Attributes"].get(name, 0)) == 0 for name in names)


def ec2_env(aws: Aws, imds_url: str, **more: str) -> dict[str, str]:
    """The environment of a daemon on an EC2 instance whose metadata service (a
    `FakeImds`) is at `imds_url`, with `more`."""
    return {
        **aws.env,
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url,
        "AWS_EC2_METADATA_DISABLED": "false",
        **more,
    }
