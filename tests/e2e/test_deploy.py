"""The CloudFormation stack (infra/worker.yaml) deployed into moto, for EC2 and for
ECS, and a daemon given its outputs draining its queue. (The template's own checks:
tests/test_deploy.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.aws import Aws
from tests.support.daemons import run_daemon
from tests.support.paths import TEMPLATE
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("platform", ["ec2", "ecs"])
def test_stack_deploys_into_moto_and_a_daemon_drains_its_queue(
    aws: Aws, tmp_path: Path, platform: str
) -> None:
    """The stack creates an encrypted queue with a redrive policy, the bucket, the topic
    of finished jobs and the worker group; a daemon given the stack's outputs drains a
    job from it and announces it on the topic and on a notification queue. (moto skips
    the target-tracking policies and the bucket's access block: the template test and
    cfn-lint check those.)"""
    ec2 = aws.client("ec2")
    cloudformation = aws.client("cloudformation")
    name = f"fleet-{platform}-{tmp_path.name[-12:].replace('_', '-')}".rstrip("-")
    cloudformation.create_stack(
        StackName=name,
        TemplateBody=TEMPLATE.read_text(),
        Parameters=[
            {"ParameterKey": "Platform", "ParameterValue": platform},
            {"ParameterKey": "ImageUri", "ParameterValue": "example.com/sqs-batch-worker:1"},
            {
                "ParameterKey": "AmiId",
                "ParameterValue": ec2.describe_images()["Images"][0]["ImageId"],
            },
            {
                "ParameterKey": "Subnets",
                "ParameterValue": ec2.describe_subnets()["Subnets"][0]["SubnetId"],
            },
        ],
        Capabilities=["CAPABILITY_IAM"],
    )
    [stack] = cloudformation.describe_stacks(StackName=name)["Stacks"]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    queue_url, dlq_url, bucket = (
        outputs["QueueUrl"],
        outputs["DeadLetterQueueUrl"],
        outputs["BucketName"],
    )

    attributes = aws.sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])[
        "Attributes"
    ]
    assert json.loads(attributes["RedrivePolicy"])["maxReceiveCount"] == 3
    assert attributes["SqsManagedSseEnabled"] == "true"
    assert aws.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=[outputs["AutoScalingGroupName"]]
    )["AutoScalingGroups"]

    sns = aws.client("sns")
    subscriber_url = aws.sqs.create_queue(QueueName=f"{name}-subscriber")["QueueUrl"]
    subscriber_arn = aws.sqs.get_queue_attributes(
        QueueUrl=subscriber_url, AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    sns.subscribe(
        TopicArn=outputs["JobsFinishedTopicArn"],
        Protocol="sqs",
        Endpoint=subscriber_arn,
        Attributes={"RawMessageDelivery": "true"},
    )
    notify_url = aws.sqs.create_queue(QueueName=f"{name}-notices")["QueueUrl"]

    uris = list(upload_samples(aws.s3, bucket, 3, seed=18))
    output = f"s3://{bucket}/results/deployed/"
    aws.send(queue_url, {"job_id": "deployed", "inputs": uris, "output": output})
    run = run_daemon(
        aws,
        [
            "--queue-url",
            queue_url,
            "--dlq-url",
            dlq_url,
            "--allowed-buckets",
            bucket,
            "--drain",
            "--receive-wait-seconds",
            "1",
            "--log-dir",
            str(tmp_path),
            "--notify-topic-arn",
            outputs["JobsFinishedTopicArn"],
            "--notify-queue-url",
            notify_url,
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = aws.summary(output)
    assert summary["status"] == "succeeded"
    for announced_on in (subscriber_url, notify_url):
        [notice] = aws.sqs.receive_message(QueueUrl=announced_on)["Messages"]
        assert json.loads(notice["Body"]) == summary
    assert aws.queue_depth(queue_url) == (0, 0)
