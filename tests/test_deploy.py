"""Deployment artefacts: the container (hadolint and its key lines) and the
CloudFormation stack (cfn-lint, and what its resources grant and scale on), both
checked by checkov. The image itself cannot be built here: there is no Docker engine.
(The stack deployed into moto, with a daemon draining its queue:
tests/e2e/test_deploy.py.)"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from cfnlint.decode import decode

from tests.support.in_process import run_until_drained, sample_images
from tests.support.paths import REPO, TEMPLATE
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.jobs.checkpoints import CHECKPOINT_PREFIX, FINAL_OUTPUTS, SUPERSEDED_PREFIX
from worker.message import CANCEL_MARKER
from worker.ports import S3Location

DOCKERFILE = REPO / "Dockerfile"
# checkov pins boto3, botocore, packaging and networkx to older releases than the
# project's, so it has a virtual environment of its own inside the project's.
CHECKOV = Path(sys.executable).parent.parent / "checkov" / "bin" / "checkov"


def _tool(name: str) -> str:
    """A linter installed in the project's environment (dev extra)."""
    return str(Path(sys.executable).parent / name)


def _actions(statement: dict[str, Any]) -> list[str]:
    action = statement["Action"]
    return [action] if isinstance(action, str) else list(action)


def _expressions(metrics: list[dict[str, Any]]) -> dict[str, str]:
    """A metric math query's expressions, by id."""
    return {m["Id"]: " ".join(m["Expression"].split()) for m in metrics if "Expression" in m}


def _queues(metrics: list[dict[str, Any]]) -> dict[str, str]:
    """The queue (its logical id) that each SQS metric of a metric math query reads."""
    queues = {}
    for m in metrics:
        metric = m.get("MetricStat", {}).get("Metric", {})
        if metric.get("Namespace") == "AWS/SQS":
            [dimension] = metric["Dimensions"]
            queues[m["Id"]] = dimension["Value"]["Fn::GetAtt"][0]
    return queues


def test_dockerfile_passes_hadolint() -> None:
    lint = subprocess.run(
        [_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_dockerfile_has_what_a_gpu_worker_needs() -> None:
    """CUDA base with the CUDA build of the pinned torch and the torchvision made for it
    (GPU decoding), a non-root user, tini as PID 1 in front of the daemon, and a
    HEALTHCHECK on the daemon's own health endpoint."""
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert any(line.startswith("ARG CUDA_IMAGE=nvidia/cuda:") for line in lines)
    assert any(
        "pip install torch==2.13.0 torchvision==0.28.0 --index-url" in line for line in lines
    )
    assert "USER 10001" in lines and "useradd --system --uid 10001" in DOCKERFILE.read_text()
    assert lines[-1] == 'ENTRYPOINT ["/usr/bin/tini", "--", "python", "-m", "worker", "run"]'
    assert 'CMD ["python", "-m", "worker", "healthcheck"]' in lines


def test_template_passes_cfn_lint() -> None:
    lint = subprocess.run(
        [_tool("cfn-lint"), str(TEMPLATE)], capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_infra_and_dockerfile_pass_checkov() -> None:
    """Every check passes or is skipped in the template with its reason beside it."""
    assert CHECKOV.exists(), "checkov is not installed: `make test` installs it"
    template, problems = decode(str(TEMPLATE))
    assert not problems and template is not None
    for name, resource in template["Resources"].items():
        for skip in resource.get("Metadata", {}).get("checkov", {}).get("skip", []):
            assert skip.get("comment"), f"{name} skips {skip['id']} without saying why"
    files = [arg for path in sorted((REPO / "infra").glob("*.yaml")) for arg in ("-f", str(path))]
    scan = subprocess.run(
        [
            str(CHECKOV),
            *files,
            *("-f", str(DOCKERFILE)),
            *("--framework", "cloudformation", "dockerfile"),
            *("--compact", "--quiet", "--skip-download"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"},
        cwd=REPO,
    )
    assert scan.returncode == 0, scan.stdout + scan.stderr
    assert "cloudformation scan results" in scan.stdout and "dockerfile scan results" in scan.stdout


def test_template_locks_things_down() -> None:
    """Private, encrypted bucket; encrypted queues; IMDSv2 only; the daemon's policy
    names only the actions it calls, and on ECS task protection for its own tasks; ECS
    gives the daemon 120 s after SIGTERM; on EC2,
    scale-in waits for the daemon through a lifecycle hook it is told the name of."""
    template, problems = decode(str(TEMPLATE))
    assert not problems and template is not None
    resources = template["Resources"]
    bucket = resources["DataBucket"]["Properties"]
    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert resources["JobsQueue"]["Properties"]["SqsManagedSseEnabled"] is True
    assert resources["ShardsQueue"]["Properties"]["SqsManagedSseEnabled"] is True
    assert resources["DeadLetterQueue"]["Properties"]["SqsManagedSseEnabled"] is True
    metadata = resources["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["MetadataOptions"]
    assert metadata["HttpTokens"] == "required"
    statements = resources["WorkerPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    actions = {action for statement in statements for action in _actions(statement)}
    assert actions == {
        "sqs:ReceiveMessage",
        "sqs:DeleteMessage",
        "sqs:ChangeMessageVisibility",
        "sqs:GetQueueAttributes",
        "sqs:SendMessage",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:ListBucket",
        "sns:Publish",
        "autoscaling:SetInstanceProtection",
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:SetInstanceHealth",
        "logs:CreateLogStream",
        "logs:PutLogEvents",
    }
    assert all(statement["Resource"] != "*" for statement in statements)
    [consume] = [s for s in statements if s.get("Sid") == "ConsumeJobs"]
    queues = [{"Fn::GetAtt": ["JobsQueue", "Arn"]}, {"Fn::GetAtt": ["ShardsQueue", "Arn"]}]
    assert consume["Resource"] == queues
    hosts_out = resources["HostsOutOfService"]["Properties"]
    assert '"host_out_of_service"' in hosts_out["FilterPattern"]
    [task_policy] = resources["TaskRole"]["Properties"]["Policies"]
    [task_statement] = task_policy["PolicyDocument"]["Statement"]
    assert set(task_statement["Action"]) == {"ecs:UpdateTaskProtection", "ecs:GetTaskProtection"}
    assert "task/${Cluster}/*" in json.dumps(task_statement["Resource"])
    hook = resources["TerminationHook"]["Properties"]
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["LifecycleHookName"] == {"Fn::Sub": "${AWS::StackName}-drain"}
    user_data = resources["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"]
    assert "WORKER_LIFECYCLE_HOOK_NAME=${AWS::StackName}-drain" in json.dumps(user_data)
    assert template["Parameters"]["StopTimeoutSeconds"]["Default"] == 120
    [container] = resources["TaskDefinition"]["Properties"]["ContainerDefinitions"]
    assert container["StopTimeout"] == {"Ref": "StopTimeoutSeconds"}
    stop_timeout = {"Name": "WORKER_STOP_TIMEOUT_SECONDS", "Value": {"Ref": "StopTimeoutSeconds"}}
    assert stop_timeout in container["Environment"]
    assert "WORKER_STOP_TIMEOUT_SECONDS=${StopTimeoutSeconds}" in json.dumps(user_data)
    shard_queue = {"Name": "WORKER_SHARD_QUEUE_URL", "Value": {"Ref": "ShardsQueue"}}
    assert shard_queue in container["Environment"]
    assert "WORKER_SHARD_QUEUE_URL=${ShardsQueue}" in json.dumps(user_data)
    notify_topic = {"Name": "WORKER_NOTIFY_TOPIC_ARN", "Value": {"Ref": "JobsFinishedTopic"}}
    assert notify_topic in container["Environment"]
    assert "WORKER_NOTIFY_TOPIC_ARN=${JobsFinishedTopic}" in json.dumps(user_data)
    # One worker per instance, on all of its GPUs (an inference process each).
    gpus = {"Type": "GPU", "Value": {"Ref": "GpusPerInstance"}}
    assert container["ResourceRequirements"] == [gpus]
    assert "--gpus all" in json.dumps(user_data)
    # /dev/shm holds the batch arena: Docker's 64 MiB default is raised on both platforms.
    assert container["LinuxParameters"]["SharedMemorySize"] == {"Ref": "SharedMemoryMiB"}
    assert "--shm-size ${SharedMemoryMiB}m" in json.dumps(user_data)
    assert template["Parameters"]["SharedMemoryMiB"]["Default"] >= 1024


def _deletable(key: str) -> bool:
    """Whether the daemon's data policy lets it delete `key` of the data bucket (IAM's
    * spans "/" too, and its ? is one character, as fnmatch's)."""
    template, problems = decode(str(TEMPLATE))
    assert not problems and template is not None
    statements = template["Resources"]["WorkerPolicy"]["Properties"]["PolicyDocument"]
    [deletes] = [s for s in statements["Statement"] if "s3:DeleteObject" in _actions(s)]
    assert _actions(deletes) == ["s3:DeleteObject"]
    patterns = [resource["Fn::Sub"] for resource in deletes["Resource"]]
    assert all(p.startswith("${DataBucket.Arn}/") for p in patterns)
    keys = [p.removeprefix("${DataBucket.Arn}/") for p in patterns]
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in keys)


def test_template_scopes_the_daemons_data_policy() -> None:
    """The daemon deletes what its runs leave on the way (checkpoint parts, a sharded
    job's shards/<digest>/ files, an earlier run's Parquet parts) and nothing else,
    wherever a job's output prefix is; its data policy is on the instance role only on
    EC2 (on ECS the task role carries it, and the instance keeps what the ECS agent
    needs)."""
    template, problems = decode(str(TEMPLATE))
    assert not problems and template is not None
    resources = template["Resources"]
    for output in ("", "results/job-1/", "a/b/c/"):
        assert _deletable(f"{output}{CHECKPOINT_PREFIX}0123abcd-m1-0.jsonl")
        assert _deletable(f"{output}{SUPERSEDED_PREFIX}m1")
        assert _deletable(f"{output}shards/0123456789abcdef/000003.inputs")
        assert _deletable(f"{output}shards/0123456789abcdef/commits/000003.commit")
        assert _deletable(f"{output}results/part-000003-0001.parquet")
        kept = [*FINAL_OUTPUTS, CANCEL_MARKER, "scores.npy", f"my{CHECKPOINT_PREFIX}x"]
        kept += ["shards/0001.tar", "shards/train/0001.tar", "results/_SUCCESS"]
        kept += ["results/part-00000-c0ffee.snappy.parquet"]  # Spark's
        assert not any(_deletable(f"{output}{name}") for name in kept)
    assert not _deletable("inputs/0001.jpg")

    instance_policies = resources["InstanceRole"]["Properties"]["ManagedPolicyArns"]
    on_ec2_only = {"Fn::If": ["OnEc2", {"Ref": "WorkerPolicy"}, {"Ref": "AWS::NoValue"}]}
    assert on_ec2_only in instance_policies
    assert json.dumps(instance_policies).count("WorkerPolicy") == 1
    assert resources["TaskRole"]["Properties"]["ManagedPolicyArns"] == [{"Ref": "WorkerPolicy"}]


class _DeletesSeen(InMemoryBlobStore):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []

    def delete(self, locations: list[S3Location]) -> None:
        self.deleted += [location.key for location in locations]
        super().delete(locations)


def test_every_key_the_daemon_deletes_is_one_its_policy_lets_it(tmp_path: Path) -> None:
    """A sharded Parquet job whose output holds an earlier run's extra part, and a
    sharded job whose output is the bucket's root, run to their end: every key the daemon
    deleted on the way is one the template's policy lets it delete (on S3 it would
    otherwise be refused, and the files left behind), the shards' files and the stale
    part among them. (Checkpoint parts, which jobs this small do not write, are the
    policy's first patterns, above.)"""
    source, blobs = InMemoryJobSource(), _DeletesSeen()
    inputs = sample_images(blobs, 4)
    blobs.objects["s3://bkt/out/table/results/part-000009-0000.parquet"] = b"an earlier run's"
    for output, extra in (("s3://bkt/out/table/", {"format": "parquet"}), ("s3://bkt/", {})):
        body = {"inputs": inputs, "output": output, "shard_items": 2, **extra}
        source.send(json.dumps(body))
    run_until_drained(source, blobs, tmp_path, batch_size=2, preprocess_workers=1)
    assert [key for key in blobs.deleted if not _deletable(key)] == []
    assert "out/table/results/part-000009-0000.parquet" in blobs.deleted
    assert any(key.startswith("out/table/shards/") for key in blobs.deleted)
    assert any("/commits/" in key for key in blobs.deleted)  # the commit markers' folder
    assert any(key.startswith("shards/") for key in blobs.deleted)  # the root's


def test_template_scales_from_zero_places_tasks_on_capacity_and_alarms_have_runbooks() -> None:
    """Backlog per worker (jobs and shards queues both) stays defined at 0 workers, jobs
    waiting with none start one, a job waiting too long (in either queue) adds one; ECS
    tasks go through a capacity provider that grows the group and protects busy
    instances; Spot is an option with capacity rebalancing; every operator alarm has a
    runbook in docs/operating.md."""
    template, problems = decode(str(TEMPLATE))
    assert not problems and template is not None
    resources, parameters = template["Resources"], template["Parameters"]
    assert parameters["MinWorkers"]["MinValue"] == 0
    for policy, config, divisor in (
        ("BacklogScaling", "TargetTrackingConfiguration", "workers"),
        ("ServiceBacklogScaling", "TargetTrackingScalingPolicyConfiguration", "tasks"),
    ):
        metrics = resources[policy]["Properties"][config]["CustomizedMetricSpecification"]
        assert _expressions(metrics["Metrics"]) == {
            "queued": "FILL(visible, 0) + FILL(visible_shards, 0)",
            f"backlog_per_{divisor[:-1]}": f"IF({divisor} > 0, queued / {divisor}, queued)",
        }
        assert _queues(metrics["Metrics"]) == {
            "visible": "JobsQueue",
            "visible_shards": "ShardsQueue",
        }
    from_zero = resources["ScaleFromZero"]["Properties"]
    assert _expressions(from_zero["Metrics"]) == {
        "queued": "FILL(visible, 0) + FILL(visible_shards, 0)",
        "waiting_with_no_worker": "IF(queued > 0 AND workers == 0, 1, 0)",
    }
    assert _queues(from_zero["Metrics"]) == {
        "visible": "JobsQueue",
        "visible_shards": "ShardsQueue",
    }
    adds_one = {"Fn::If": ["OnEc2", {"Ref": "GroupAddsOne"}, {"Ref": "ServiceAddsOne"}]}
    assert from_zero["AlarmActions"] == [adds_one]
    oldest = resources["OldestJobTooOld"]["Properties"]
    assert _expressions(oldest["Metrics"]) == {
        "oldest": "MAX([FILL(oldest_jobs, 0), FILL(oldest_shards, 0)])"
    }
    assert _queues(oldest["Metrics"]) == {
        "oldest_jobs": "JobsQueue",
        "oldest_shards": "ShardsQueue",
    }
    assert {
        m["MetricStat"]["Metric"]["MetricName"] for m in oldest["Metrics"] if "MetricStat" in m
    } == {"ApproximateAgeOfOldestMessage"}
    no_progress = resources["NoProgress"]["Properties"]["Metrics"]
    assert set(_queues(no_progress).values()) == {"JobsQueue", "ShardsQueue"}
    assert (
        oldest["Threshold"] == {"Ref": "MaxQueueWaitSeconds"} and adds_one in oldest["AlarmActions"]
    )

    provider = resources["CapacityProvider"]["Properties"]["AutoScalingGroupProvider"]
    assert provider["ManagedScaling"]["Status"] == "ENABLED"
    assert provider["ManagedTerminationProtection"] == "ENABLED"
    service = resources["Service"]["Properties"]
    assert "LaunchType" not in service
    assert service["CapacityProviderStrategy"][0]["CapacityProvider"] == {"Ref": "CapacityProvider"}
    group = resources["WorkerGroup"]["Properties"]
    assert group["NewInstancesProtectedFromScaleIn"] == {"Fn::If": ["OnEcs", True, False]}
    assert group["CapacityRebalance"] == {"Fn::If": ["OnSpot", True, False]}
    distribution = group["MixedInstancesPolicy"]["InstancesDistribution"]
    assert distribution["OnDemandPercentageAboveBaseCapacity"] == {"Fn::If": ["OnSpot", 0, 100]}

    operating = (REPO / "docs" / "operating.md").read_text()
    runbooks = operating[operating.index("## Alarms") :]
    for alarm in ("DeadLetters", "OldestJobTooOld", "NoProgress", "WorkersUnhealthy"):
        assert resources[alarm]["Type"] == "AWS::CloudWatch::Alarm"
        assert f"**{alarm}**" in runbooks
