"""The command line: `run` the daemon, `enqueue` or `cancel` a job, or run the `demo`."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from botocore.exceptions import NoRegionError
from pydantic import ValidationError

from worker.adapters import aws
from worker.client import (
    CancelRefused,
    InvalidJob,
    Job,
    JobRejected,
    Jobs,
    JobStalled,
    JobStatus,
    UnreadableOutput,
)
from worker.demo import DEMO_IMAGES, DEMO_SMALL_JOB_IMAGES, run_demo
from worker.entry import exit_at_once
from worker.errors import AccessDenied, CannotStart, TransientError
from worker.jobs.joblog import configure_daemon_logging
from worker.message import REQUEST_ID_PATTERN, TarMembers
from worker.plugins import PluginError
from worker.settings import DEFAULT_METRICS_PORT, Settings

EXIT_USAGE = 2
# What `bench --model` takes of the daemon's settings, and how many images it runs.
BENCH_MODEL_IMAGES = 2000
BENCH_MODEL_SETTINGS = (
    "model",
    "preprocess",
    "postprocess",
    "device",
    "precision",
    "channels_last",
    "batch_size",
    "preprocess_workers",
    "preprocess_workers_max",
)
WAIT_POLL_S = 1.0
HEALTHCHECK_TIMEOUT_S = 4.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="A pipelined SQS batch-inference worker: jobs from SQS, inputs from S3, "
        "a torch model in between, results to S3.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="run the daemon",
        description="Pull jobs from the queue and run them until signalled (SIGTERM/SIGINT: "
        "finish in-flight jobs within --grace-seconds, release the rest, exit 0) or, with "
        "--drain, until the queue is empty. AWS access follows boto3's usual configuration "
        "(AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, credentials).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_settings_flags(run)

    enqueue = commands.add_parser(
        "enqueue",
        help="send a job message",
        description="Send one job to the queue and print its job id; with --wait, follow "
        "it with a progress bar until the job.json of this run appears (not one an earlier "
        "run to the same output left), print that, and exit 0 if it succeeded; exit 1, "
        "saying why, if it was rejected (dead-lettered) or stalled. A job the daemon would "
        "refuse is refused before it is sent (exit 2), a bucket outside "
        "WORKER_ALLOWED_BUCKETS too, where it is set (the Python client, `worker.client`, "
        "does the same from code).",
    )
    enqueue.add_argument(
        "--queue-url",
        default=os.environ.get("WORKER_QUEUE_URL"),
        help="the jobs queue (env WORKER_QUEUE_URL)",
    )
    enqueue.add_argument("--output", required=True, help="s3:// prefix for the job's outputs")
    enqueue.add_argument("--job-id", help="job id (default: a new uuid)")
    sources = enqueue.add_argument_group(
        "inputs",
        "Exactly one of: URIs as arguments, --manifest, --inputs-prefix, --table, --inventory, "
        "--openai-batch, --text.",
    )
    sources.add_argument("--manifest", help="s3:// URI of a file listing one input URI per line")
    sources.add_argument("--inputs-prefix", help="s3:// prefix: every object under it, by key")
    sources.add_argument(
        "--table",
        help="s3:// URI of a CSV (a header row; .csv, .csv.gz), Parquet or JSON-lines (.jsonl, "
        ".json, .gz) file, or a prefix of them, a row per input",
    )
    sources.add_argument("--uri-column", help="the --table column of input URIs (default: uri)")
    sources.add_argument(
        "--text-column",
        help="the --table column of texts: each row's text is an input (a text pipeline's job)",
    )
    sources.add_argument(
        "--id-column",
        help='a --table column of ids, carried into each input\'s result as "id"',
    )
    sources.add_argument("--inventory", help="s3:// URI of an S3 Inventory report's manifest.json")
    sources.add_argument(
        "--text",
        action="append",
        dest="texts",
        metavar="TEXT",
        help="a text that is an input, given in the message (repeat it; for more, a --table)",
    )
    sources.add_argument(
        "--openai-batch",
        help="an OpenAI Batch API file of /v1/embeddings requests, answered in that API's "
        "output and error files too: an s3:// URI, or a local file, uploaded first to "
        "<output>openai-requests.jsonl",
    )
    sources.add_argument(
        "--inputs-suffix",
        help="keep only the objects of --inputs-prefix or --inventory whose key ends so (.jpg)",
    )
    sources.add_argument(
        "--tar",
        action="store_true",
        help="the objects listed are tar shards (WebDataset): each member is an input",
    )
    sources.add_argument(
        "--member-suffix",
        help="with --tar, keep only the members whose name ends so (.jpg)",
    )
    enqueue.add_argument("--params", default="{}", help="JSON object of pipeline parameters")
    enqueue.add_argument(
        "--format",
        choices=("jsonl", "parquet"),
        default="jsonl",
        help="results as results.jsonl, or as Parquet files under results/ (default: jsonl)",
    )
    enqueue.add_argument(
        "--shard-items",
        type=int,
        help="split the job across the fleet in shards of this many inputs, or tars "
        "with --tar (default: the workers' --shard-items, or --shard-tars)",
    )
    enqueue.add_argument("--wait", action="store_true", help="follow the job to its job.json")
    enqueue.add_argument(
        "--timeout-seconds", type=float, default=3600, help="give up waiting after this"
    )
    enqueue.add_argument("inputs", nargs="*", metavar="URI", help="s3:// input URIs")

    cancel = commands.add_parser(
        "cancel",
        help="cancel a queued or running job",
        description="Ask for a job to be cancelled by writing a `cancel` object under its "
        "output prefix. A daemon running the job stops it within its "
        "--progress-interval-seconds, writes job.json with status `cancelled` and the "
        "results it had finished, and deletes its message; a daemon that receives it later "
        "does the same without running it. A finished job (job.json written) is left as it is.",
    )
    cancel.add_argument("--output", required=True, help="the job's s3:// output prefix")
    cancel.add_argument(
        "--job-id",
        help="cancel only the job of this id at --output (refused if another job writes "
        "its progress there); without it, whatever job writes to --output",
    )
    cancel.add_argument(
        "--request-id",
        type=_request_id,
        help="cancel only this run of the job (the request_id its message gave, which its "
        "job.json echoes): another run sent to --output, earlier or later, is not stopped, "
        "and the command exits 1 if this run's job.json is written; without it, any run",
    )
    cancel.add_argument("--reason", default="", help="a note kept in the cancel object")

    demo = commands.add_parser(
        "demo",
        help="run everything locally against a moto server",
        description="Start a local moto server, create a queue, dead-letter queue and bucket, "
        "upload generated sample images, enqueue jobs of several sizes, run the daemon until "
        "the queue is drained, and print what each job produced.",
    )
    demo.add_argument("--out", default="demo-out", help="where logs and downloaded results go")
    demo.add_argument(
        "--images",
        type=int,
        default=DEMO_IMAGES,
        help=f"sample images to draw and upload; the large job reads them all, the six small "
        f"ones take the first {DEMO_SMALL_JOB_IMAGES} (default: %(default)s)",
    )

    bench = commands.add_parser(
        "bench",
        help="measure throughput, overlap, overhead, packing, hand-off and memory",
        description="Run the benchmarks (in-process fakes for SQS and S3, S3 latency "
        "injected, a stand-in device model) and print each figure as a ratio against a "
        "baseline measured in the same run; writes report.json, timeline.json (Chrome "
        "trace) and timeline.png to --out. About 7 minutes with --quick, 10 without, on 2 cores.",
    )
    bench.add_argument("--out", default="bench-out", help="where the report and timeline go")
    bench.add_argument("--quick", action="store_true", help="smaller inputs, shorter runs")
    bench.add_argument(
        "--only",
        action="append",
        metavar="STEP",
        help="run only this step's figures (repeat for more): overlap, tar_shards, fleet, ... "
        "(a name it does not know lists them all)",
    )
    own_model = bench.add_argument_group(
        "your own model",
        "With any of these, only the overlap figure runs, on that model and settings: "
        "the daemon's images/s over the model's alone on ready batches, the inference "
        "lane's busy fraction, and the timeline.",
    )
    add_settings_flags(own_model, only=BENCH_MODEL_SETTINGS)
    own_model.add_argument(
        "--images",
        type=int,
        help=f"images through the daemon, in jobs of 100 (default: {BENCH_MODEL_IMAGES})",
    )

    healthcheck = commands.add_parser(
        "healthcheck",
        help="exit 0 if the local daemon is healthy (for HEALTHCHECK)",
        description="Ask the daemon on this host for /healthz; exit 0 if healthy, 1 if not.",
    )
    healthcheck.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("WORKER_METRICS_PORT") or DEFAULT_METRICS_PORT),
        help="the daemon's --metrics-port (env WORKER_METRICS_PORT)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        # Until the daemon runs (and installs its own handlers) nothing is held: a stop
        # signal during start-up (imports, settings) just ends the process cleanly. Once
        # it runs, a signal during its stages' start stops it as soon as they are up.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _exit_before_start)
        code = _run(args)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)  # the exit status is decided
        # The daemon has released what it held and stopped its children, or given up
        # waiting for them at its shutdown deadline.
        exit_at_once(code)
    if args.command == "enqueue":
        sys.exit(_enqueue(args))
    if args.command == "cancel":
        sys.exit(_cancel(args.output, args.job_id, args.request_id, args.reason))
    if args.command == "healthcheck":
        sys.exit(_healthcheck(args.port))
    if args.command == "bench":
        from bench.run import main as run_bench
        from bench.run import own_model

        chosen = {k: v for k, v in vars(args).items() if k in BENCH_MODEL_SETTINGS}
        if chosen or args.images is not None:
            sys.exit(own_model(Path(args.out), args.images or BENCH_MODEL_IMAGES, **chosen))
        sys.exit(run_bench(Path(args.out), args.quick, args.only))

    if args.images < DEMO_SMALL_JOB_IMAGES:
        print(f"--images: at least {DEMO_SMALL_JOB_IMAGES}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    sys.exit(run_demo(args.out, args.images))


def _exit_before_start(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _run(args: argparse.Namespace) -> int:
    from worker.daemon.wiring import Daemon
    from worker.engine import SharedMemoryTooSmall, StageSetupError, StageSetupTimeout

    try:
        settings = settings_from_flags(args)
    except ValidationError as error:
        print(f"invalid settings:\n{_explain(error)}", file=sys.stderr)
        return EXIT_USAGE
    configure_daemon_logging()
    try:
        sqs = aws.sqs_client()
    except NoRegionError:
        print(
            "cannot start: no AWS region: set AWS_REGION (ECS sets it for a task; on EC2 "
            "set it, or AWS_DEFAULT_REGION)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    attempts = settings.aws_max_attempts
    source = aws.SqsJobSource(sqs, settings.queue_url, settings.dlq_url, attempts)
    shard_source = (
        aws.SqsJobSource(sqs, settings.shard_queue_url, settings.dlq_url, attempts)
        if settings.shard_queue_url
        else None
    )
    blobs = aws.S3BlobStore.from_environment(
        settings.s3_connections, attempts, settings.input_client
    )
    notify: list[Callable[[str], None]] = []
    if settings.notify_queue_url:
        notify.append(aws.SqsSender(sqs, settings.notify_queue_url, attempts))
    if settings.notify_topic_arn:
        notify.append(aws.SnsPublisher(aws.sns_client(), settings.notify_topic_arn, attempts))
    try:
        guard = aws.scale_in_guard(
            settings.protection,
            settings.asg_name,
            settings.ecs_protection_minutes,
            settings.aws_max_attempts,
        )
        notices = aws.interruption_notices(
            settings.interruption_notices,
            settings.lifecycle_hook_name,
            settings.asg_name,
            settings.aws_max_attempts,
        )
        daemon = Daemon(
            settings,
            source,
            blobs,
            shard_source=shard_source,
            guard=guard,
            notices=notices,
            notify=notify,
        )
        return daemon.run().code
    except StageSetupTimeout as error:
        print(
            f"cannot start: {error}; a slow model load needs a higher --setup-timeout-seconds "
            "(its warm-up has --inference-timeout-seconds a batch besides)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except (
        PluginError,
        StageSetupError,
        SharedMemoryTooSmall,
        aws.PlatformUnavailable,
        CannotStart,
    ) as error:
        print(f"cannot start: {error}", file=sys.stderr)
        return EXIT_USAGE


def _healthcheck(port: int) -> int:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/healthz", timeout=HEALTHCHECK_TIMEOUT_S
        ) as reply:
            print(reply.read().decode().strip())
            return 0
    except urllib.error.HTTPError as error:
        print(f"unhealthy: {error.read().decode().strip()}", file=sys.stderr)
    except OSError as error:
        print(f"no answer from the daemon on port {port}: {error}", file=sys.stderr)
    return 1


def _explain(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(map(str, problem["loc"]))
        flag = f"--{where.replace('_', '-')}: " if where else ""
        lines.append(f"  {flag}{problem['msg']}")
    return "\n".join(lines)


def _enqueue(args: argparse.Namespace) -> int:
    if problem := _enqueue_usage_problem(args):
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    try:
        jobs = Jobs.connect(args.queue_url)
        run: dict[str, Any] = {  # the job's, however its inputs are given
            "job_id": args.job_id,
            "params": json.loads(args.params),
            "format": args.format,
            "shard_items": args.shard_items,
        }
        if (local_batch := _local_batch(args)) is not None:
            job = jobs.submit_openai_batch(local_batch, args.output, **run)
        else:
            job = jobs.submit(
                args.output,
                inputs=args.inputs or None,
                manifest=args.manifest,
                inputs_prefix=args.inputs_prefix,
                inputs_suffix=args.inputs_suffix,
                table=_table(args),
                inventory=args.inventory,
                texts=args.texts,
                openai_batch=args.openai_batch,
                tar=TarMembers(member_suffix=args.member_suffix) if args.tar else None,
                **run,
            )
    except json.JSONDecodeError as error:
        print(f"--params is not JSON: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidJob, OSError) as error:  # OSError: a local batch file, unreadable
        print(error, file=sys.stderr)
        return EXIT_USAGE
    except (AccessDenied, TransientError) as error:  # its upload, refused or failing
        print(f"the batch file was not uploaded, and no job sent: {error}", file=sys.stderr)
        return 1
    print(job.job_id)
    if args.wait:
        return _wait(job, args.timeout_seconds)
    return 0


def _enqueue_usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with enqueue's flags together, before anything is sent."""
    if not args.queue_url:
        return "--queue-url (or WORKER_QUEUE_URL) is required"
    if (args.uri_column or args.text_column or args.id_column) and not args.table:
        return "--uri-column, --text-column and --id-column name columns of --table"
    if args.member_suffix and not args.tar:
        return "--member-suffix keeps members of --tar shards"
    if (local_batch := _local_batch(args)) is not None:
        others = [args.inputs, args.manifest, args.inputs_prefix, args.table, args.inventory]
        if any([*others, args.texts, args.tar, args.inputs_suffix]):
            return "a local --openai-batch file is the job's only input (no other inputs)"
        if not local_batch.is_file():
            return f"--openai-batch {local_batch}: no such file (or an s3:// URI)"
    return None


def _local_batch(args: argparse.Namespace) -> Path | None:
    """`--openai-batch` where it names a local file (uploaded with the job), not S3."""
    batch = args.openai_batch
    return Path(batch) if batch and not batch.startswith("s3://") else None


def _table(args: argparse.Namespace) -> dict[str, str] | None:
    """The message's `table`, from `--table` and the columns given."""
    if not args.table:
        return None
    columns = {
        "uri_column": args.uri_column,
        "text_column": args.text_column,
        "id_column": args.id_column,
    }
    return {"uri": args.table, **{name: column for name, column in columns.items() if column}}


def _request_id(value: str) -> str:
    """A request id as a job's message may give one (a cancel naming any other stops
    nothing)."""
    if not re.fullmatch(REQUEST_ID_PATTERN, value):
        raise argparse.ArgumentTypeError(f"not a request id ({REQUEST_ID_PATTERN}): {value!r}")
    return value


def _cancel(output: str, job_id: str | None, request_id: str | None, reason: str) -> int:
    try:
        job = Job.connect(output, job_id, request_id)
    except ValueError as error:
        print(f"--output: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        marker = job.cancel(reason)
    except (CancelRefused, UnreadableOutput) as error:
        print(error, file=sys.stderr)
        return 1
    print(f"cancel requested: {marker}")
    return 0


def _wait(job: Job, timeout_s: float) -> int:
    """Follow a job with a progress bar until its job.json appears; print the summary."""
    started = time.monotonic()

    def draw(status: JobStatus) -> None:
        _draw(status.finished, status.items, status.failed, time.monotonic() - started)

    try:
        summary = job.wait(timeout_s, WAIT_POLL_S, on_status=draw)
    except (TimeoutError, UnreadableOutput, JobStalled, JobRejected) as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return 0 if summary["status"] == "succeeded" else 1


def _draw(finished: int, items: int, failed: int, elapsed_s: float, width: int = 30) -> None:
    filled = width * finished // items if items else 0
    total = str(items) if items else "?"
    bar = "#" * filled + "." * (width - filled)
    print(
        f"\r[{bar}] {finished}/{total} items, {failed} failed, {elapsed_s:.0f} s",
        end="",
        file=sys.stderr,
        flush=True,
    )


def add_settings_flags(parser: argparse._ActionsContainer, only: Sequence[str] = ()) -> None:
    """Add one flag per settings field (or per field named in `only`), with its
    description and default as help."""
    for name, field in Settings.model_fields.items():
        if only and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        env = f"WORKER_{name.upper()}"
        # A field unset by default says in its description what unset means.
        unset = field.is_required() or field.default is None
        default = "" if unset else f" [default: {_show(field.default)}]"
        help_text = f"{field.description}{default} (env {env})"
        if field.annotation is bool:
            parser.add_argument(
                flag, action="store_true", default=argparse.SUPPRESS, help=help_text
            )
        else:
            parser.add_argument(
                flag, default=argparse.SUPPRESS, metavar=name.upper(), help=help_text
            )


def _show(value: Any) -> str:
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "any"
    return str(value)


def settings_from_flags(namespace: argparse.Namespace) -> Settings:
    """Settings from the flags given, the environment, then the defaults."""
    given = {
        name: value for name, value in vars(namespace).items() if name in Settings.model_fields
    }
    return Settings(**given)
