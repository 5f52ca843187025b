"""The daemon's settings: one typed object, validated once at start-up.

Every field is also a command-line flag (`--batch-size`) and an environment variable
(`WORKER_BATCH_SIZE`); a flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from worker.host import host_cores
from worker.plugins.spec import DecodePlacement, ModelStep, PipelineSpec, devices
from worker.ports import (
    SQS_MAX_DELAY_S,
    SQS_MAX_MESSAGES_PER_RECEIVE,
    SQS_MAX_RECEIVE_WAIT_S,
    SQS_MAX_VISIBILITY_TIMEOUT_S,
)
from worker.retry import DEFAULT_AWS_MAX_ATTEMPTS

DEFAULT_METRICS_PORT = 8000
MAX_RETRY_DELAY_S = SQS_MAX_DELAY_S
# Shutdown's last steps (release what is held, stop the stage processes, drop scale-in
# protection, release what a last long poll brings) get the long poll's wait, and at
# least this long, after the grace period; then the daemon exits regardless.
MIN_SHUTDOWN_TAIL_S = 10.0
# And the process this much more to exit before the platform's SIGKILL.
STOP_MARGIN_S = 10.0
# What a pipeline spec sets per step, so the flags cannot say it too.
PIPELINE_REPLACES = frozenset(
    {"model", "model_name", "model_version", "preprocess", "postprocess", "batch_size"}
)


class Settings(BaseSettings):
    """Everything the daemon can be told; docs/settings.md lists them, made from this class."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", frozen=True, extra="forbid")

    queue_url: str = Field(description="SQS queue URL to pull jobs from (required).")
    dlq_url: str | None = Field(
        default=None,
        description="Dead-letter queue URL for poison messages; without one they are left "
        "to the queue's redrive policy.",
    )
    shard_queue_url: str | None = Field(
        default=None,
        description="SQS queue URL for the shards of jobs split across the fleet, and their "
        "watches: a daemon busy with a shard still takes jobs from --queue-url, one at a time, "
        "so a small job is not stuck behind a giant one's shards (else they go to --queue-url).",
    )
    log_dir: Path = Field(
        default=Path("logs"),
        description="Where the logs of jobs in flight or given back are written "
        "(a finished job's is in S3).",
    )
    drain: bool = Field(
        default=False,
        description="Exit 0 once the queue is empty and nothing is in flight (batch mode).",
    )

    model: str = Field(
        default="stages.model:default_classifier",
        description="The model: 'module:factory' (a function returning a torch module), a "
        "torch.export archive 'path.pt2' or a TorchScript file 'path.pt', on disk or in S3 "
        "(s3://bucket/key.pt2). It takes a uint8 NCHW batch of images on the device, or, "
        "after a text preprocessor, (input_ids, attention_mask) (docs/models.md).",
    )
    model_name: str | None = Field(
        default=None,
        description="The model's name in job.json, results.jsonl and metrics (default: the "
        "module's model_name attribute, else the file name or the factory's reference).",
    )
    model_version: str | None = Field(
        default=None,
        description="The model's version (default: the module's model_version attribute, "
        "else the first 12 digits of its sha256 digest).",
    )
    model_cache_dir: Path | None = Field(
        default=None,
        description="Where a model in S3 is kept (by bucket, key and ETag), fetched at start "
        "unless that ETag's copy is here; a start removes its other copies no process on the "
        "host holds (docs/models.md; default: model-cache under --log-dir).",
    )
    preprocess: str = Field(
        default="stages.preprocess:default_preprocessor",
        description="'module:object': decodes one input's bytes into a uint8 tensor slot, "
        "or tokenizes one text into a slot of token ids and their mask (docs/models.md).",
    )
    postprocess: str = Field(
        default="stages.postprocess:top_k",
        description="'module:function': turns one model output row and the job's params "
        "into the prediction fields of results.jsonl.",
    )
    pipeline: Annotated[PipelineSpec | None, NoDecode] = Field(
        default=None,
        description="A TOML file declaring a chain of models (a detector, a fan-out into "
        "crops, a classifier; see docs/models.md): it takes the place of --model, "
        "--model-name, --model-version, --preprocess, --postprocess and --batch-size.",
    )
    device: str = Field(
        default="auto",
        description="torch device of the model, or several, comma-separated, for one "
        "inference process each (cuda:0,cuda:2): auto is every visible GPU, else the CPU.",
    )
    precision: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Run the model under bfloat16 autocast (on GPUs with bfloat16 tensor "
        "cores, Ampere and later, about twice the float32 throughput).",
    )
    channels_last: bool = Field(
        default=False,
        description="Keep the model's weights and each batch in channels-last memory order "
        "(what tensor-core convolutions want).",
    )
    compile: bool = Field(
        default=False,
        description="Compile the model with torch.compile at each size its warm-up runs "
        "(the batch size and the halves error bisection falls back to), each captured in a "
        "CUDA graph on a GPU, before the first receive (model_ready says how long it took); "
        "a partial batch runs at the next size up, padded with zeros. For a model whose "
        "rows do not depend on each other (docs/models.md).",
    )
    decode: DecodePlacement = Field(
        default="auto",
        description="Where JPEGs are decoded: gpu, in batches on the model's device "
        "(nvJPEG, through torchvision), each input the device rejects decoded on the CPU "
        "there and one neither can decode that input's error; cpu, in the preprocessing "
        "processes, as every other format always is. auto: gpu when every model device is "
        "a GPU and torchvision imports, else cpu (the daemon logs which, and why).",
    )

    batch_size: int = Field(default=64, ge=1, le=4096, description="Items per inference batch.")
    max_batch_wait_ms: float = Field(
        default=20, ge=0, description="How long a partial batch waits for more items."
    )
    max_batch_tokens: int = Field(
        default=0,
        ge=0,
        description="Texts: padded tokens a batch holds at most (texts of like length together, "
        "padded to a few fixed lengths, --batch-size at most; docs/models.md); 0: off.",
    )
    preprocess_workers: int = Field(
        default=2,
        ge=1,
        le=256,
        description="Preprocessing (decode, resize, tokenize) processes, at least: the floor.",
    )
    preprocess_workers_max: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Preprocessing processes, at most: one more starts while the inference "
        "stage waits for decoded images and those running are busy, and one stops once the "
        "rest would have time to spare for 30 s (default: the cores the daemon may run on, "
        "its CPU affinity, at least "
        "--preprocess-workers; equal to it for a fixed count).",
    )
    fetch_concurrency: int = Field(
        default=16,
        ge=1,
        le=512,
        description="Parallel S3 downloads, split among the --preprocess-workers processes "
        "where they fetch (each fetches as many at once, and so does each process added "
        "beyond them); finished jobs are uploaded as many at a time (32 at most). A daemon "
        "receives jobs while fewer items wait ahead of the model (see --prefetch-batches).",
    )
    fetch_in: Literal["auto", "preprocess", "threads"] = Field(
        default="auto",
        description="Where inputs are fetched: in the preprocessing processes, each with an "
        "S3 client of its own, so bytes are fetched where they are decoded and the daemon's "
        "main process never handles them (preprocess); or on threads of the main process "
        "(threads). auto: preprocess, unless the store lives only in this process (the "
        "in-memory fakes of tests and benchmarks).",
    )
    input_client: Literal["auto", "obstore", "boto3"] = Field(
        default="auto",
        description="The S3 client the preprocessing processes read inputs with: obstore "
        "(Rust; a third of boto3's CPU a GET, docs/performance.md), with boto3's endpoint, "
        "region and credentials, and boto3 for what obstore cannot read as boto3 would (a "
        "key such as a/../b, a bucket in another region: said in a log line); boto3; or "
        "auto: obstore where it imports. boto3 does everything else (SQS, writes, listings).",
    )
    max_jobs: int = Field(
        default=256,
        ge=1,
        description="Most jobs (messages) held at once; high enough that one-input jobs "
        "can fill prefetch-batches x batch-size items.",
    )
    prefetch_batches: int = Field(
        default=4,
        ge=1,
        description="Receive more messages only while fewer than this many batches of items, "
        "--fetch-concurrency more, and of jobs (not shards) what the pipeline went through "
        "while the latest were admitted (up to as many again), are waiting ahead of inference.",
    )
    max_items_per_job: int = Field(
        default=100_000_000,
        ge=1,
        description="Jobs listing more inputs (in the message or its manifest) are "
        "rejected as poison. A job over shard-items is planned as shards, reading its "
        "manifest as it streams: the daemon never holds more than shard-items inputs.",
    )
    shard_items: int = Field(
        default=100_000,
        ge=1,
        description="A job with more inputs than this (or its message's 'shard_items') is "
        "split into shards of this many, run across the fleet and merged in order: about "
        "three minutes each at 500 images/s.",
    )
    shard_tars: int = Field(
        default=10,
        ge=1,
        description="A job whose inputs are tar shards (its message's 'tar') with more "
        "tars than this (or its message's 'shard_items') is split into shards of this "
        "many tars: 10 WebDataset tars of 1,000-10,000 images each.",
    )
    max_tar_bytes: int = Field(
        default=16 * 2**30,
        ge=1,
        description="A tar shard over this many bytes (16 GiB by default) makes its "
        "message poison. A job's tars are copied whole to --log-dir while it runs: its "
        "disk holds --shard-tars of them for each shard held.",
    )
    tar_disk_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Most bytes of disk the local copies of tars, the snapshots of "
        "listings planned into shards, and a merge's copies of a sharded Parquet job's "
        "files, may take at once, all jobs' together, claimed "
        "before they are written: a job that finds no room now is handed back to run later, "
        "uncharged; one whose own copy alone takes more is poison. Default: three "
        "quarters of the space free on --log-dir's disk at start (daemons sharing a "
        "disk should each be given their share).",
    )
    parquet_file_bytes: int = Field(
        default=256 * 2**20,
        ge=1,
        description='A job\'s Parquet results (its message\'s "format": "parquet") go '
        "into files of about this many bytes (256 MiB by default), a sharded job's shards' "
        "joined into them as it is merged: raise it for one file of a larger table. At most "
        "10,000 files a job: a larger one is merged into files of its bytes/9,000 (docs/jobs.md).",
    )
    parquet_row_group_bytes: int = Field(
        default=64 * 2**20,
        ge=1,
        description="Parquet results are written in row groups of about this many bytes "
        "before compression (64 MiB by default): the unit a reader skips or reads whole.",
    )
    max_input_bytes: int = Field(
        default=64 * 2**20,
        ge=1,
        description="An input over this many bytes (64 MiB by default) is that input's "
        "error ('too large: N bytes, limit M'), never read: each fetch in flight may hold "
        "one input whole.",
    )
    max_manifest_bytes: int = Field(
        default=16 * 2**30,
        ge=1,
        description="A manifest over this many bytes (16 GiB by default, over 100 million "
        "lines of 160 characters) makes its message poison, never read on; manifests are "
        "read line by line as they stream in.",
    )
    allowed_buckets: Annotated[frozenset[str], NoDecode] = Field(
        default=frozenset(),
        description="Comma-separated buckets that jobs may read and write; empty allows any.",
    )

    visibility_timeout_seconds: int = Field(
        default=120,
        ge=1,
        le=SQS_MAX_VISIBILITY_TIMEOUT_S,
        description="Lease length asked for on receive and on every renewal.",
    )
    heartbeat_interval_seconds: float = Field(
        default=30, gt=0, description="How often in-flight leases are renewed."
    )
    max_lease_seconds: float = Field(
        default=SQS_MAX_VISIBILITY_TIMEOUT_S,
        gt=0,
        le=SQS_MAX_VISIBILITY_TIMEOUT_S,
        description="A job still running this long after its receive is released for "
        "another try (SQS cannot hide a message for more than 12 hours).",
    )
    receive_wait_seconds: int = Field(
        default=SQS_MAX_RECEIVE_WAIT_S,
        ge=0,
        le=SQS_MAX_RECEIVE_WAIT_S,
        description="Long-poll wait of each receive.",
    )
    receive_batch: int = Field(
        default=SQS_MAX_MESSAGES_PER_RECEIVE,
        ge=1,
        le=SQS_MAX_MESSAGES_PER_RECEIVE,
        description="Most messages asked for per receive.",
    )
    grace_seconds: float = Field(
        default=90,
        ge=0,
        description="On SIGTERM, how long in-flight jobs may run before they are handed "
        "over; the daemon exits at most receive-wait-seconds (at least 10 s) after that, "
        "whatever hangs. With stop-timeout-seconds it defaults to what fits in it.",
    )
    stop_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="The container's stop timeout (SIGTERM to SIGKILL: docker --stop-timeout, "
        "ECS stopTimeout), where it is known: the grace period defaults to it less the "
        "shutdown's tail and 10 s, and a grace that does not fit is refused at start.",
    )
    progress_interval_seconds: float = Field(
        default=10,
        gt=0,
        description="How often each in-flight job's progress.json is refreshed (if changed), "
        "its local log file written, and a request to cancel it looked for.",
    )
    checkpoint_items: int = Field(
        default=1000,
        ge=1,
        description="A running job's finished results are saved under its output (a "
        "checkpoint part) every this many results, so a later delivery resumes from them.",
    )
    checkpoint_seconds: float = Field(
        default=60,
        gt=0,
        description="... or every this many seconds, whichever comes first.",
    )
    preprocess_timeout_seconds: float = Field(
        default=30, gt=0, description="Per-item preprocessing limit; a hung worker is replaced."
    )
    inference_timeout_seconds: float = Field(
        default=600, gt=0, description="Per-batch inference limit; a hung process is replaced."
    )
    setup_timeout_seconds: float = Field(
        default=300,
        gt=0,
        description="How long a stage process may take to start (a model's: to load or "
        "compile it) before it is tried again (three tries, then exit 2); a model's "
        "process has --inference-timeout-seconds more for each batch size its warm-up "
        "runs. Meanwhile /healthz answers 503 'starting'.",
    )
    host_breakages_limit: int = Field(
        default=3,
        ge=0,
        description="Take the host out of service (SetInstanceHealth Unhealthy on EC2; "
        "on ECS the task exits) once its daemons have stopped broken this many times "
        "within an hour, counted in the log directory; a daemon started on such a host "
        "exits at once. 0: never.",
    )
    aws_max_attempts: int = Field(
        default=DEFAULT_AWS_MAX_ATTEMPTS,
        ge=1,
        le=30,
        description="Tries per AWS call on throttling, 5xx, timeouts and resets, with "
        "exponential backoff and jitter, each call with its own budget.",
    )
    retry_delay_seconds: float = Field(
        default=30,
        ge=0,
        le=MAX_RETRY_DELAY_S,
        description="A job that cannot progress through transient errors is released "
        "unfinished and becomes visible again after this delay, doubled on each delivery "
        f"(at most {MAX_RETRY_DELAY_S // 60} minutes).",
    )

    protection: Literal["auto", "asg", "ecs", "off"] = Field(
        default="auto",
        description="Scale-in protection while jobs are held: ecs (task protection through "
        "ECS_AGENT_URI), asg (EC2 Auto Scaling through instance metadata), off, or auto: "
        "ecs if ECS_AGENT_URI is set, else asg if instance metadata answers, else off.",
    )
    asg_name: str | None = Field(
        default=None,
        description="Auto Scaling group of this instance; default: its "
        "aws:autoscaling:groupName tag, read from instance metadata.",
    )
    idle_grace_seconds: float = Field(
        default=60,
        ge=0,
        description="Protection is dropped only after no job has been held for this long.",
    )
    ecs_protection_minutes: int = Field(
        default=60,
        ge=1,
        le=2880,
        description="Expiry asked for ECS task protection; renewed at half of it while busy.",
    )
    interruption_notices: Literal["auto", "imds", "off"] = Field(
        default="auto",
        description="Watch instance metadata for spot interruptions, Auto Scaling "
        "terminations and rebalance recommendations: imds, off, or auto (imds where "
        "instance metadata answers).",
    )
    notice_poll_seconds: float = Field(
        default=5, gt=0, le=30, description="How often instance metadata is read for notices."
    )
    interruption_margin_seconds: float = Field(
        default=20,
        ge=0,
        description="On a spot interruption, jobs still running this long before the "
        "instance goes are handed back (released), leaving time to exit.",
    )
    lifecycle_hook_name: str | None = Field(
        default=None,
        description="Auto Scaling lifecycle hook (autoscaling:EC2_INSTANCE_TERMINATING) "
        "that holds this instance while it shuts down; completed once the daemon is done.",
    )
    metrics_port: int = Field(
        default=DEFAULT_METRICS_PORT,
        ge=0,
        le=65535,
        description="Port serving /metrics (Prometheus) and /healthz; 0 turns both off.",
    )
    timeline_dir: Path | None = Field(
        default=None,
        description="Where the time goes, written here every minute and at exit: timeline.json "
        "(a Chrome trace of the last 100,000 stage calls, for Perfetto) and timeline.png.",
    )
    device_hour_price: float | None = Field(
        default=None,
        ge=0,
        description="What an hour of this worker's device costs (its instance's price over "
        "its GPUs, say): job.json then gives each job's 'cost' beside its fleet-wide 'device_s'.",
    )
    notify_queue_url: str | None = Field(
        default=None,
        description="SQS queue that gets each finished job's job.json as a message "
        "(for services waiting on results).",
    )
    notify_topic_arn: str | None = Field(
        default=None,
        description="SNS topic that gets each finished job's job.json as a message (to fan "
        "out to queues, Lambdas, e-mail; subscribers may filter on its status).",
    )

    def pipeline_spec(self) -> PipelineSpec:
        """The chain of `--pipeline`, else the one model the flags name."""
        return self.pipeline or PipelineSpec(
            preprocess=self.preprocess,
            postprocess=self.postprocess,
            steps=[
                ModelStep(
                    model=self.model,
                    name=self.model_name,
                    version=self.model_version,
                    batch_size=self.batch_size,
                )
            ],
        )

    @property
    def preprocess_workers_ceiling(self) -> int:
        return max(self.preprocess_workers, self.preprocess_workers_max or host_cores())

    @property
    def fetched_per_process(self) -> int:
        """Inputs each preprocessing process is sent at once (and fetches at once, where
        it fetches)."""
        return max(1, self.fetch_concurrency // self.preprocess_workers)

    @property
    def s3_connections(self) -> int:
        """Connections for downloads, uploads of finished jobs and progress writes."""
        return 2 * self.fetch_concurrency + 1

    @field_validator("queue_url", "dlq_url", "shard_queue_url")
    @classmethod
    def _standard_queue(cls, value: str | None) -> str | None:
        if value is not None and value.endswith(".fifo"):
            raise ValueError(
                "FIFO queues are not supported: jobs finish out of order and are released "
                "with delays, which a FIFO queue's message groups would block; use a "
                "standard queue"
            )
        return value

    @field_validator("device")
    @classmethod
    def _devices(cls, value: str) -> str:
        return devices(value)

    @field_validator("allowed_buckets", mode="before")
    @classmethod
    def _split_buckets(cls, value: Any) -> Any:
        if isinstance(value, str):
            return frozenset(bucket.strip() for bucket in value.split(",") if bucket.strip())
        return value

    @model_validator(mode="before")
    @classmethod
    def _grace_from_stop_timeout(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("stop_timeout_seconds") is None:
            return data
        if data.get("grace_seconds") is not None:
            return data
        stop_s = float(data["stop_timeout_seconds"])
        wait_s = float(data.get("receive_wait_seconds", SQS_MAX_RECEIVE_WAIT_S))
        grace_s = stop_s - max(wait_s, MIN_SHUTDOWN_TAIL_S) - STOP_MARGIN_S
        return {**data, "grace_seconds": max(0.0, grace_s)}

    def shutdown_tail_s(self) -> float:
        """How long shutdown's last steps may take after the grace period."""
        return max(float(self.receive_wait_seconds), MIN_SHUTDOWN_TAIL_S)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # Half, so that one failed or late renewal still leaves the lease alive.
        if self.heartbeat_interval_seconds * 2 > self.visibility_timeout_seconds:
            raise ValueError(
                f"heartbeat_interval_seconds ({self.heartbeat_interval_seconds}) must be at most "
                f"half of visibility_timeout_seconds ({self.visibility_timeout_seconds}), so one "
                "failed renewal does not lose the lease"
            )
        if (self.preprocess_workers_max or self.preprocess_workers) < self.preprocess_workers:
            raise ValueError(
                f"preprocess_workers_max ({self.preprocess_workers_max}) is below "
                f"preprocess_workers ({self.preprocess_workers})"
            )
        replaced = sorted(PIPELINE_REPLACES & self.model_fields_set) if self.pipeline else []
        if replaced:
            raise ValueError(
                f"pipeline declares the models; set {', '.join(replaced)} in its steps instead"
            )
        if self.lifecycle_hook_name and self.interruption_notices == "off":
            raise ValueError(
                "lifecycle_hook_name needs interruption_notices (auto or imds): the hook's "
                "termination is read from instance metadata"
            )
        stop_s = self.stop_timeout_seconds
        if (
            stop_s is not None
            and self.grace_seconds + self.shutdown_tail_s() + STOP_MARGIN_S > stop_s
        ):
            raise ValueError(
                f"grace_seconds ({self.grace_seconds}) does not fit in stop_timeout_seconds "
                f"({stop_s}) with the shutdown's tail ({self.shutdown_tail_s()} s) and "
                f"{STOP_MARGIN_S} s to exit: the platform would SIGKILL the daemon while it "
                "hands jobs over; lower the grace or raise the stop timeout"
            )
        if self.visibility_timeout_seconds >= self.max_lease_seconds:
            raise ValueError(
                f"visibility_timeout_seconds ({self.visibility_timeout_seconds}) must be less "
                f"than max_lease_seconds ({self.max_lease_seconds})"
            )
        return self
