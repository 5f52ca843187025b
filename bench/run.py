"""`python -m worker bench`: the performance figures of issue 5, each a ratio against a
baseline measured in the same run, on the same inputs, median of the repeats.

SQS and S3 are the in-process fakes (moto's own CPU cost per call would distort every
figure), with S3 latency injected where the figure is about overlap. Without a GPU here,
`DeviceModel` stands in for one: it holds "the device" for `DEVICE_BASE_MS +
DEVICE_PER_ITEM_MS * batch` without using the host's CPU, as a GPU kernel does; the
hand-off figure uses the real default model on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import torch
from botocore.config import Config
from torch import nn

from bench.fetch_clients import CLIENTS
from stages.model import default_classifier
from stages.preprocess import default_preprocessor
from stages.synthetic import samples
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon import Daemon
from worker.demo import LOCAL_AWS_ENV, Stack, create_stack, local_moto_server, upload_samples
from worker.engine import BatchGatherer, TensorArena
from worker.jobs.joblog import configure_daemon_logging
from worker.plugins.loading import inference_devices, load_preprocessor, resolve_device
from worker.plugins.setups import inference_setup
from worker.ports import ObjectReader, ReceivedMessage, RemoteReader, S3Location
from worker.settings import Settings
from worker.telemetry.timeline import Timeline

# A batch costs a fixed floor (kernel launches: small batches are launch-bound on a GPU)
# plus a per-image share: 44 ms for 3 images, 120 ms for 64 (530 images/s), which two CPU
# cores can feed, so the model is the stage that dominates, as on a GPU host.
DEVICE_BASE_MS = 40.0
DEVICE_PER_ITEM_MS = 1.25
SLOW_DEVICE_BATCH_S = 2.0  # for the backlog run: jobs outlive several leases
S3_MEDIAN_MS, S3_P99_MS = 30.0, 200.0
BATCH_SIZE = 64
EMBEDDING_WIDTH = 2048  # floats an image, as a ResNet-50's pooled features
DECODE_MS = 6.0  # one worker: ~170 images/s, a third of what the device model takes
IMAGE_POOL = 64  # distinct encoded images, reused under many keys


# Stand-in models and preprocessor, loaded by reference in the daemon's processes. ---


class DeviceModel(nn.Module):
    """Busy for the batch's device time, CPU idle, like a GPU running the model; its
    output is `width` numbers an item (a classifier's scores, or an embedding)."""

    def __init__(self, base_ms: float, per_item_ms: float, width: int = 4):
        super().__init__()
        self.base_ms, self.per_item_ms, self.width = base_ms, per_item_ms, width

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        time.sleep((self.base_ms + self.per_item_ms * len(batch)) / 1000)
        # On the batch's device, as a model's answer is: copying it back then waits
        # for the work queued before it there (decoding, resizing).
        return torch.rand(len(batch), self.width, device=batch.device)


def device_model() -> nn.Module:
    return DeviceModel(DEVICE_BASE_MS, DEVICE_PER_ITEM_MS)


def embedding_device_model() -> nn.Module:
    return DeviceModel(DEVICE_BASE_MS, DEVICE_PER_ITEM_MS, EMBEDDING_WIDTH)


def slow_device_model() -> nn.Module:
    return DeviceModel(SLOW_DEVICE_BATCH_S * 1000, 0)


def noop_model() -> nn.Module:
    return DeviceModel(0, 0)


class NoopPreprocessor:
    """Writes nothing: isolates the daemon's own per-message cost."""

    output_shape = (3, 8, 8)

    def __call__(self, data: bytes, out: torch.Tensor) -> None:
        return None


noop_preprocessor = NoopPreprocessor()


class WaitingPreprocessor:
    """Holds a worker `DECODE_MS` per image without using the CPU (like decoding that
    waits on memory or a codec), so two cores are no limit on how many workers help."""

    output_shape = (3, 8, 8)

    def __call__(self, data: bytes, out: torch.Tensor) -> None:
        time.sleep(DECODE_MS / 1000)


waiting_preprocessor = WaitingPreprocessor()


# Fakes with latency and timing. -------------------------------------------------------


class LatentBlobStore(InMemoryBlobStore):
    """S3 with lognormal latency per request (median 30 ms, p99 200 ms by default). With
    a `directory`, other processes read it with the same latency, as they would S3."""

    def __init__(
        self,
        median_ms: float = S3_MEDIAN_MS,
        p99_ms: float = S3_P99_MS,
        seed: int = 1,
        directory: Path | None = None,
    ):
        super().__init__(directory)
        self._mu = math.log(median_ms / 1000)
        self._sigma = math.log(p99_ms / median_ms) / 2.326  # z of the 99th percentile
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def remote_reader(self) -> RemoteReader | None:
        reader = super().remote_reader()
        if reader is None:
            return None
        late = functools.partial(_late_reads, reader.open, self._mu, self._sigma)
        return RemoteReader(late, reader.longest_s, reader.imports)

    def _wait(self) -> None:
        with self._rng_lock:
            delay_s = self._rng.lognormvariate(self._mu, self._sigma)
        time.sleep(delay_s)

    def get(self, location: S3Location, max_bytes: int | None = None) -> bytes:
        self._wait()
        return super().get(location, max_bytes)

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        self._wait()
        return super().put(location, data, content_type, expect=expect)

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        self._wait()
        return super().objects_under(prefix)


def _late_reads(
    open_reads: Callable[[int], ObjectReader], mu: float, sigma: float, connections: int
) -> ObjectReader:
    """`open_reads(connections)`, each read after a lognormal wait (in another process)."""
    get, rng = open_reads(connections), random.Random()

    def late_get(location: S3Location, max_bytes: int | None = None) -> bytes:
        time.sleep(rng.lognormvariate(mu, sigma))
        return get(location, max_bytes)

    return late_get


class TimedSource(InMemoryJobSource):
    """Records when work started and ended (and this process's CPU then), how long each
    message was held, redeliveries."""

    def __init__(self) -> None:
        super().__init__(clock=time.monotonic)
        self.first_receive_s = math.inf
        self.last_ack_s = 0.0
        self.cpu_at_first_receive_s = 0.0
        self.cpu_at_last_ack_s = 0.0
        self.received_at: dict[str, float] = {}
        self.held_s = 0.0
        self.redeliveries = 0
        self.receiving = threading.Event()  # set at the first message received
        self._times_lock = threading.Lock()

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        messages = super().receive(max_messages, wait_s, visibility_timeout_s)
        now = time.perf_counter()
        with self._times_lock:
            if messages and now < self.first_receive_s:
                self.first_receive_s = now
                self.cpu_at_first_receive_s = time.process_time()
                self.receiving.set()
            for message in messages:
                self.received_at[message.receipt_handle] = now
                self.redeliveries += message.receive_count > 1
        return messages

    def _held(self, receipt_handle: str) -> None:
        now = time.perf_counter()
        with self._times_lock:
            self.held_s += now - self.received_at.pop(receipt_handle, now)
            if now > self.last_ack_s:
                self.last_ack_s = now
                self.cpu_at_last_ack_s = time.process_time()

    def ack(self, receipt_handle: str) -> None:
        super().ack(receipt_handle)
        self._held(receipt_handle)

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        super().release(receipt_handle, delay_s)
        self._held(receipt_handle)

    @property
    def wall_s(self) -> float:
        return self.last_ack_s - self.first_receive_s

    @property
    def cpu_s(self) -> float:
        """This process's CPU from the first receive to the last ack."""
        return self.cpu_at_last_ack_s - self.cpu_at_first_receive_s


# Inputs. --------------------------------------------------------------------------------


def _image_pool() -> list[bytes]:
    return [data for _, data in samples(IMAGE_POOL, seed=99)]


def _load(
    source: InMemoryJobSource, blobs: InMemoryBlobStore, pool: list[bytes], job_sizes: list[int]
) -> list[list[str]]:
    """Queue one job per size; inputs are pool images stored under distinct keys."""
    jobs, number = [], 0
    for job, size in enumerate(job_sizes):
        uris = []
        for _ in range(size):
            uri = f"s3://bench/in/{number}.img"
            blobs.objects[uri] = pool[number % len(pool)]
            uris.append(uri)
            number += 1
        source.send(
            json.dumps(
                {"job_id": f"job-{job}", "inputs": uris, "output": f"s3://bench/out/job-{job}/"}
            )
        )
        jobs.append(uris)
    return jobs


@dataclass
class DaemonRun:
    settings: Settings
    wall_s: float
    items: int
    timeline: Timeline
    source: TimedSource


def _run_daemon(
    job_sizes: list[int],
    blobs: InMemoryBlobStore,
    work_dir: Path,
    stop_after_s: float | None = None,
    pool: list[bytes] | None = None,
    **settings: Any,
) -> DaemonRun:
    """Run the daemon in this process over jobs of `job_sizes` (inputs from `pool`, the
    bench's images by default), until drained (or stopped)."""
    source, timeline = TimedSource(), Timeline()
    _load(source, blobs, pool or _image_pool(), job_sizes)
    defaults = {"batch_size": BATCH_SIZE, "log_dir": work_dir / "logs", "metrics_port": 0}
    config = Settings(
        queue_url="bench",
        drain=stop_after_s is None,
        receive_wait_seconds=0,
        **{**defaults, **settings},
    )
    daemon = Daemon(config, source, blobs, timeline=timeline)
    if stop_after_s is not None:
        # From the first receive: the model's warm-up comes first, and with a slow
        # stand-in device it takes seconds.
        threading.Thread(
            target=_stop_after, args=(daemon, source, stop_after_s), daemon=True
        ).start()
    daemon.run()
    return DaemonRun(config, source.wall_s, sum(job_sizes), timeline, source)


def _stop_after(daemon: Daemon, source: TimedSource, seconds: float) -> None:
    source.receiving.wait()
    time.sleep(seconds)
    daemon.stop()


def _median(runs: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(runs))


# The figures. ---------------------------------------------------------------------------


def model_only_images_per_s(settings: Settings, batches: int) -> float:
    """The model looping over ready uint8 batches on its device, run (and warmed up) as
    the inference process runs it, precision and memory format included: the daemon's
    ceiling."""
    device = inference_devices(settings.device)[0]
    shape = load_preprocessor(settings.preprocess).output_shape
    infer = inference_setup(
        settings.model,
        device,
        shape,
        batch_size=settings.batch_size,
        precision=settings.precision,
        channels_last=settings.channels_last,
    ).run
    batch = torch.zeros((settings.batch_size, *shape), dtype=torch.uint8)
    batch = batch.to(resolve_device(device))
    values = [None] * settings.batch_size
    started = time.perf_counter()
    for _ in range(batches):
        infer(batch, values)  # each call waits for its outputs
    return batches * settings.batch_size / (time.perf_counter() - started)


DEVICE_MODEL = "bench.run:device_model"
OVERLAP_JOB_SIZE = 100
# Many fetch threads hide the injected S3 latency; the figures without it use the defaults.
OVERLAP_SETTINGS: dict[str, Any] = {
    "model": DEVICE_MODEL,
    "fetch_concurrency": 128,
    "preprocess_workers": 2,
}


def overlap(
    work_dir: Path, images: int, runs: int, out: Path, in_files: bool = False, **settings: Any
) -> dict[str, float]:
    """Daemon images/s over model-only images/s, and the inference lane's busy fraction.
    `in_files`: the inputs are fetched in the preprocessing processes, as from S3, rather
    than on threads of this one."""
    ratios, busy, rates, ceilings = [], [], [], []
    for run in range(runs):
        objects = work_dir / f"overlap-objects-{run}" if in_files else None
        daemon = _run_daemon(
            [OVERLAP_JOB_SIZE] * (images // OVERLAP_JOB_SIZE),
            LatentBlobStore(seed=run, directory=objects),
            work_dir,
            **{**OVERLAP_SETTINGS, **settings},
        )
        ceiling = model_only_images_per_s(
            daemon.settings, max(10, images // daemon.settings.batch_size // 2)
        )
        rates.append(daemon.items / daemon.wall_s)
        ceilings.append(ceiling)
        ratios.append(rates[-1] / ceiling)
        start = daemon.source.first_receive_s
        busy.append(
            daemon.timeline.busy_s("inference", start, start + daemon.wall_s) / daemon.wall_s
        )
        daemon.timeline.write(out, f"overlap run {run + 1}: {images} images, S3 latency injected")
    return {
        "overlap_ratio": statistics.median(ratios),
        "busy_fraction": statistics.median(busy),
        "daemon_images_per_s": statistics.median(rates),
        "model_only_images_per_s": statistics.median(ceilings),
    }


def own_model(out: Path, images: int, **settings: Any) -> int:
    """The overlap figure for the user's model, preprocessor and batch size: how close
    the daemon comes to the model alone, and the timeline that shows why not closer."""
    out.mkdir(parents=True, exist_ok=True)
    configure_daemon_logging(io.StringIO())
    images = max(1, images // OVERLAP_JOB_SIZE) * OVERLAP_JOB_SIZE
    with tempfile.TemporaryDirectory() as scratch:
        chosen = Settings(queue_url="bench", **settings).model_dump(
            mode="json", include=set(settings)
        )
        report: dict[str, Any] = {"images": images, **chosen}
        report.update(overlap(Path(scratch), images, 1, out, **settings))
    _print_table(report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'report.json'}, {out / 'timeline.json'}, {out / 'timeline.png'}")
    return 0


def sequential_worker_s(jobs: int, job_size: int, blobs: InMemoryBlobStore) -> float:
    """One job at a time: receive, download, decode, infer, upload, delete (same code)."""
    source = InMemoryJobSource()
    _load(source, blobs, _image_pool(), [job_size] * jobs)
    model, slot = device_model(), torch.empty(default_preprocessor.output_shape, dtype=torch.uint8)
    started = time.perf_counter()
    while messages := source.receive(1, 0, 60):
        job = json.loads(messages[0].body)
        batch = []
        for uri in job["inputs"]:
            default_preprocessor(blobs.get(S3Location.parse(uri)), slot)
            batch.append(slot.clone())
        scores = model(torch.stack(batch))
        lines = b"".join(json.dumps({"scores": row}).encode() + b"\n" for row in scores.tolist())
        output = S3Location.parse(job["output"])
        for name in ("results.jsonl", "job.log", "job.json"):
            blobs.put(S3Location(output.bucket, output.key + name), lines, "application/json")
        source.ack(messages[0].receipt_handle)
    return time.perf_counter() - started


def speedup(work_dir: Path, jobs: int, runs: int) -> dict[str, float]:
    job_size = 16
    ratios = []
    for run in range(runs):
        daemon = _run_daemon(
            [job_size] * jobs, LatentBlobStore(seed=run), work_dir, **OVERLAP_SETTINGS
        )
        ratios.append(
            sequential_worker_s(jobs, job_size, LatentBlobStore(seed=run)) / daemon.wall_s
        )
    return {"speedup_vs_sequential": statistics.median(ratios)}


def minimal_loop_ms_per_message(messages: int) -> float:
    """receive(10) then delete each: the least any consumer of the queue does."""
    source = InMemoryJobSource()
    for _ in range(messages):
        source.send("{}")
    started = time.perf_counter()
    while batch := source.receive(10, 0, 60):
        for message in batch:
            source.ack(message.receipt_handle)
    return (time.perf_counter() - started) * 1000 / messages


def overhead(work_dir: Path, messages: int, runs: int) -> dict[str, float]:
    def measure() -> float:
        daemon = _run_daemon(
            [1] * messages,
            InMemoryBlobStore(),
            work_dir,
            model=NOOP_MODEL,
            preprocess=NOOP_PREPROCESSOR,
            max_jobs=256,
        )
        return daemon.wall_s * 1000 / messages - minimal_loop_ms_per_message(messages)

    return {"overhead_ms_per_message": _median(runs, measure)}


NOOP_MODEL = "bench.run:noop_model"
NOOP_PREPROCESSOR = "bench.run:noop_preprocessor"
HOST_JOB_SIZE = 500


def host_ceiling(
    work_dir: Path, items: int, blobs: InMemoryBlobStore | None = None
) -> dict[str, float]:
    """The control plane alone (docs/DESIGN.md, section 5): a null model, a preprocess
    that decodes nothing and in-process fakes, so what is left is what the daemon itself
    moves per second; and the CPU its main process (this one) spends per item. The
    preprocessing processes read the inputs from files, as they would from S3."""
    blobs = blobs if blobs is not None else InMemoryBlobStore(work_dir / "objects")
    daemon = _run_daemon(
        [HOST_JOB_SIZE] * (items // HOST_JOB_SIZE),
        blobs,
        work_dir,
        model=NOOP_MODEL,
        preprocess=NOOP_PREPROCESSOR,
        batch_size=256,
    )
    return {
        "host_ceiling_items_per_s": daemon.items / daemon.wall_s,
        "host_cpu_ms_per_item_fakes": 1000 * daemon.source.cpu_s / daemon.items,
    }


def host_cpu(work_dir: Path, jobs: int) -> dict[str, float]:
    """The daemon's main-process CPU per item with real boto3 calls against a moto
    server, inputs fetched in the preprocessing processes (the default) and, the
    baseline, on threads of the main process."""
    fetched_in_preprocess = _host_cpu_ms_per_item(work_dir, jobs, "preprocess")
    fetched_on_threads = _host_cpu_ms_per_item(work_dir, jobs, "threads")
    return {
        "host_cpu_ms_per_item": fetched_in_preprocess,
        "host_cpu_ms_per_item_fetch_threads": fetched_on_threads,
        "host_cpu_fetch_threads_ratio": fetched_on_threads / fetched_in_preprocess,
    }


def _host_cpu_ms_per_item(work_dir: Path, jobs: int, fetch_in: str) -> float:
    """The default model and preprocessor: the daemon a subprocess, its own CPU (not its
    stage processes', not moto's) from its `daemon_started` to its exit."""
    with moto_stack(f"host-cpu-{fetch_in}") as (env, sqs, s3, stack):
        uris = list(upload_samples(s3, stack.bucket, HOST_JOB_SIZE, seed=31))
        for job in range(jobs):
            output = f"s3://{stack.bucket}/out/{job}/"
            sqs.send_message(
                QueueUrl=stack.queue_url,
                MessageBody=json.dumps({"inputs": uris, "output": output}),
            )
        daemon = subprocess.Popen(
            draining_daemon(stack, work_dir / "host-cpu-logs", "--fetch-in", fetch_in),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert daemon.stdout is not None
        started_cpu_s = None
        for line in daemon.stdout:
            if '"daemon_started"' in line:
                started_cpu_s = process_cpu_s(daemon.pid)
                break
        daemon.stdout.read()
        finished_cpu_s = exited_process_cpu_s(daemon)
        if daemon.returncode != 0 or started_cpu_s is None:
            raise RuntimeError(f"the daemon exited {daemon.returncode}")
    return 1000 * (finished_cpu_s - started_cpu_s) / (jobs * len(uris))


@contextlib.contextmanager
def moto_stack(name: str) -> Iterator[tuple[dict[str, str], Any, Any, Stack]]:
    """A moto server on this machine holding a queue and bucket named `name`: yields the
    environment a daemon subprocess reaches it with, SQS and S3 clients, and the stack."""
    with local_moto_server() as endpoint:
        env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint}
        session = boto3.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        sqs = session.client("sqs", endpoint_url=endpoint)
        s3 = session.client(
            "s3", endpoint_url=endpoint, config=Config(max_pool_connections=MOTO_UPLOADS)
        )
        # moto's state outlives its server in this process: a stack of this run's own.
        yield env, sqs, s3, create_stack(sqs, s3, name)


MOTO_UPLOADS = 32  # parallel puts that fill a moto stack's bucket


def draining_daemon(stack: Stack, log_dir: Path, *more: str) -> list[str]:
    """The command that runs the daemon on the stack's queue until it is empty."""
    return [
        *(sys.executable, "-m", "worker", "run", "--queue-url", stack.queue_url),
        *("--drain", "--receive-wait-seconds", "1", "--metrics-port", "0"),
        *("--log-dir", str(log_dir), *more),
    ]


FETCHED_OBJECT_BYTES = 12_000  # about one of the sample JPEGs


def fetch_clients(objects: int) -> dict[str, float]:
    """Each S3 client candidate in a process of its own reading the same `objects`
    small objects from a moto server: its CPU per GET (`bench.fetch_clients`)."""
    figures: dict[str, float] = {}
    with local_moto_server() as endpoint:
        s3 = boto3.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("s3", endpoint_url=endpoint)
        bucket = "fetch-clients"
        s3.create_bucket(Bucket=bucket)
        body = random.Random(5).randbytes(FETCHED_OBJECT_BYTES)
        for number in range(objects):
            s3.put_object(Bucket=bucket, Key=f"objects/{number}", Body=body)
        env = {**os.environ, **LOCAL_AWS_ENV, "AWS_ENDPOINT_URL": endpoint}
        for client in CLIENTS:
            run = subprocess.run(
                [
                    *(sys.executable, "-m", "bench.fetch_clients", client),
                    *(endpoint, bucket, "objects/", str(objects), str(FETCHED_OBJECT_BYTES)),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                raise RuntimeError(f"{client} failed ({run.returncode}):\n{run.stderr[-3000:]}")
            measured = json.loads(run.stdout.splitlines()[-1])
            figures[f"fetch_cpu_ms_per_get_{client}"] = measured["cpu_ms_per_get"]
            figures[f"fetch_gets_per_s_{client}"] = measured["gets_per_s"]
    figures["fetch_cpu_boto3_obstore_ratio"] = (
        figures["fetch_cpu_ms_per_get_boto3"] / figures["fetch_cpu_ms_per_get_obstore"]
    )
    return figures


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process `pid` itself: all its threads, none of
    its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exited_process_cpu_s(process: subprocess.Popen[str]) -> float:
    """`process_cpu_s` of a child at its exit: waited for without reaping it, so its
    /proc entry still holds its final counts; then reaped."""
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    cpu_s = process_cpu_s(process.pid)
    process.wait()
    return cpu_s


def adaptive_workers(work_dir: Path, images: int) -> dict[str, float]:
    """Decoding the bottleneck: one preprocessing process, against a stage that may grow
    to six while the device waits. Images/s tell; the busy fraction alone flatters the
    fixed run, whose device keeps busy on batches of two or three (the base cost of a
    launch-bound batch) where the adaptive one fills them."""
    busy, rate = {}, {}
    for label, ceiling in (("fixed", 1), ("adaptive", 6)):
        daemon = _run_daemon(
            [OVERLAP_JOB_SIZE] * (images // OVERLAP_JOB_SIZE),
            InMemoryBlobStore(),
            work_dir,
            model=DEVICE_MODEL,
            preprocess="bench.run:waiting_preprocessor",
            preprocess_workers=1,
            preprocess_workers_max=ceiling,
        )
        start = daemon.source.first_receive_s
        inference_s = daemon.timeline.busy_s("inference", start, start + daemon.wall_s)
        busy[label] = inference_s / daemon.wall_s
        rate[label] = daemon.items / daemon.wall_s
        peak = max((value for _, value in daemon.timeline.counts("preprocess workers")), default=1)
    return {
        "busy_fraction_one_decoder": busy["fixed"],
        "busy_fraction_adaptive_decoders": busy["adaptive"],
        "adaptive_speedup": rate["adaptive"] / rate["fixed"],
        "adaptive_decoders_peak": float(peak),
    }


def multi_device(work_dir: Path, images: int) -> dict[str, float]:
    """Images/s with two inference processes (`--device cpu,cpu`, as `cuda:0,cuda:1`)
    over one, the device stand-in the bottleneck and decoding free."""
    rates = {}
    for devices in ("cpu", "cpu,cpu"):
        daemon = _run_daemon(
            [OVERLAP_JOB_SIZE] * (images // OVERLAP_JOB_SIZE),
            InMemoryBlobStore(),
            work_dir,
            model=DEVICE_MODEL,
            preprocess=NOOP_PREPROCESSOR,
            device=devices,
        )
        rates[devices] = daemon.items / daemon.wall_s
    return {"multi_device_scaling": rates["cpu,cpu"] / rates["cpu"]}


def array_output(work_dir: Path, images: int) -> dict[str, float]:
    """Images/s of an embedding model (2,048 floats an image, into embedding.npy) over
    the top-k classifier's: the same device stand-in, inputs and S3 latency. Every job's
    embedding.npy is checked to hold a row per input."""
    rates = {}
    for label, model, postprocess in (
        ("top_k", DEVICE_MODEL, "stages.postprocess:top_k"),
        ("embedding", "bench.run:embedding_device_model", "stages.postprocess:embedding"),
    ):
        blobs = LatentBlobStore(seed=7)
        jobs = images // OVERLAP_JOB_SIZE
        daemon = _run_daemon(
            [OVERLAP_JOB_SIZE] * jobs,
            blobs,
            work_dir,
            **{**OVERLAP_SETTINGS, "model": model, "postprocess": postprocess},
        )
        rates[label] = daemon.items / daemon.wall_s
    for job in range(jobs):
        rows = np.load(io.BytesIO(blobs.objects[f"s3://bench/out/job-{job}/embedding.npy"]))
        if rows.shape != (OVERLAP_JOB_SIZE, EMBEDDING_WIDTH) or not rows.any(axis=1).all():
            raise RuntimeError(f"job-{job}'s embedding.npy holds {rows.shape}, not every row")
    return {
        "array_output_ratio": rates["embedding"] / rates["top_k"],
        "embedding_images_per_s": rates["embedding"],
    }


def per_job_batching_s(job_sizes: list[int]) -> float:
    """Model-only time if each job's items were batched alone (no pipeline costs at all)."""
    model = device_model()
    started = time.perf_counter()
    for size in job_sizes:
        for offset in range(0, size, BATCH_SIZE):
            model(torch.zeros(min(BATCH_SIZE, size - offset), 3, 64, 64, dtype=torch.uint8))
    return time.perf_counter() - started


def packing(work_dir: Path, small_jobs: int, runs: int) -> dict[str, float]:
    """Batch fill on 200 three-input jobs plus one of 1,000; throughput on the small-job
    mix against batching each job alone (model time only: a baseline with no pipeline
    costs at all, so the ratio errs low). No S3 latency here: default settings."""
    small, mixed = [3] * small_jobs, [3] * small_jobs + [1000]
    fills, ratios = [], []
    for _ in range(runs):
        daemon = _run_daemon(mixed, InMemoryBlobStore(), work_dir, model=DEVICE_MODEL)
        batches = daemon.timeline.intervals("inference")
        fills.append(sum(b.items for b in batches) / (len(batches) * BATCH_SIZE))
        daemon = _run_daemon(small, InMemoryBlobStore(), work_dir, model=DEVICE_MODEL)
        ratios.append(per_job_batching_s(small) / daemon.wall_s)
    return {"batch_fill": statistics.median(fills), "packing_speedup": statistics.median(ratios)}


HANDOFF_SHAPE = (BATCH_SIZE, 3, 224, 224)  # 9.6 MB of uint8, as in DESIGN.md's figures


def _arena_producer(arena: torch.Tensor, conn: Any, batches: int) -> None:
    torch.set_num_threads(1)  # as in the daemon's preprocessing processes
    slots = list(range(BATCH_SIZE))
    for number in range(batches):
        arena[: len(slots)].fill_(number % 256)
        conn.send(slots)
        conn.recv()  # the consumer is done with the slots


def _queue_producer(queue: Any, batches: int) -> None:
    torch.set_num_threads(1)
    for number in range(batches):
        queue.put(torch.full(HANDOFF_SHAPE, number % 256, dtype=torch.uint8).numpy())


def handoff(batches: int, runs: int) -> dict[str, float]:
    """Preprocess -> inference transfer of uint8 batches: arena slots vs a plain Queue."""
    context = multiprocessing.get_context("spawn")

    def arena_s(shape: tuple[int, ...]) -> tuple[float, float]:
        """Seconds for the batches, and of that the consumer's own part: receiving the
        slot numbers and gathering them (what the inference process waits for)."""
        arena = TensorArena(shape[1:], shape[0])
        parent, child = context.Pipe()
        producer = context.Process(target=_arena_producer, args=(arena.tensor, child, batches))
        producer.start()
        parent.recv()
        parent.send(None)  # the first batch pays for start-up; time the rest
        gatherer = BatchGatherer(arena.tensor)  # as the inference process does
        consumer_s, started = 0.0, time.perf_counter()
        for _ in range(batches - 1):
            parent.poll(None)
            received = time.perf_counter()
            batch = gatherer.gather(parent.recv())
            consumer_s += time.perf_counter() - received
            parent.send(None)
        elapsed = time.perf_counter() - started
        producer.join()
        assert batch.shape == shape
        return elapsed, consumer_s

    def queue_s() -> float:
        queue = context.Queue(maxsize=2)
        producer = context.Process(target=_queue_producer, args=(queue, batches))
        producer.start()
        queue.get()
        started = time.perf_counter()
        for _ in range(batches - 1):
            torch.from_numpy(queue.get())
        elapsed = time.perf_counter() - started
        producer.join()
        return elapsed

    ratio = _median(runs, lambda: queue_s() / arena_s(HANDOFF_SHAPE)[0])
    # The default pipeline's batch (64 x 3 x 64 x 64): what the inference process spends
    # receiving it, against what it spends running the default model on it (CPU).
    default_shape = (BATCH_SIZE, *default_preprocessor.output_shape)
    handoff_s = _median(runs, lambda: arena_s(default_shape)[1]) / (batches - 1)
    model, batch = default_classifier(), torch.zeros(default_shape, dtype=torch.uint8)
    with torch.inference_mode():
        model(batch)
        started = time.perf_counter()
        for _ in range(5):
            model(batch)
    inference_s = (time.perf_counter() - started) / 5
    return {"handoff_ratio": ratio, "handoff_fraction_of_inference": handoff_s / inference_s}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total_kb, pending = 0, [pid]
    while pending:
        current = pending.pop()
        pending += children.get(current, [])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


@contextlib.contextmanager
def peak_rss(pid: int, every_s: float = 0.25) -> Iterator[list[float]]:
    """The most resident memory (MB) of `pid`'s process tree, sampled while inside."""
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], tree_rss_mb(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def backlog(work_dir: Path, seconds: float) -> dict[str, float]:
    """10,000 queued jobs, each lasting several visibility timeouts: memory stays that of
    the jobs in flight (compared with a backlog of 100), no message is redelivered."""
    results = {}
    for queued in (100, 10_000):
        with peak_rss(os.getpid()) as peak:
            daemon = _run_daemon(
                [4] * queued,
                InMemoryBlobStore(),
                work_dir,
                stop_after_s=seconds,
                model="bench.run:slow_device_model",
                batch_size=8,
                prefetch_batches=2,
                visibility_timeout_seconds=2,
                heartbeat_interval_seconds=0.5,
                grace_seconds=0,
            )
        results[queued] = (peak[0], daemon.source)
    peak_mb, source = results[10_000]
    return {
        "peak_rss_mb": peak_mb,
        "peak_rss_mb_backlog_100": results[100][0],
        "redeliveries": float(source.redeliveries),
        "heartbeat_calls_per_job_minute": source.extend_calls / (source.held_s / 60),
    }


TARGETS = {
    "overlap_ratio": (">=", 0.95),
    "busy_fraction": (">=", 0.95),
    "speedup_vs_sequential": (">=", 4.0),
    "overhead_ms_per_message": ("<=", 2.0),
    "batch_fill": (">=", 0.95),
    "packing_speedup": (">=", 5.0),
    "handoff_ratio": (">=", 4.0),
    "handoff_fraction_of_inference": ("<=", 0.05),
    "redeliveries": ("<=", 0.0),
    "adaptive_speedup": (">=", 2.0),
    "multi_device_scaling": (">=", 1.8),
    "array_output_ratio": (">=", 0.9),
    # Issue 12's targets for the host path; not met yet.
    "host_cpu_ms_per_item": ("<=", 0.5),
    "host_ceiling_items_per_s": (">=", 5000.0),
}


def main(out: Path, quick: bool) -> int:
    """Run every figure, print the table, write report.json, timeline.json and .png."""
    out.mkdir(parents=True, exist_ok=True)
    configure_daemon_logging(io.StringIO())  # the daemons' own logs are not the point here
    runs = 3
    report: dict[str, Any] = {"quick": quick, "runs": runs, "cpu_count": os.cpu_count()}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        steps: list[Callable[[], dict[str, float]]] = [
            # Quick too: in a shorter run start-up and the last uploads weigh more
            # (10,000 images gave 0.945 where 20,000 give 0.96).
            lambda: overlap(work_dir, 20000, runs, out),
            lambda: speedup(work_dir, 12 if quick else 40, runs),
            lambda: overhead(work_dir, 1000 if quick else 4000, runs),
            lambda: packing(work_dir, 200, runs),
            lambda: handoff(10 if quick else 40, runs),
            lambda: backlog(work_dir, 12 if quick else 40),
            lambda: adaptive_workers(work_dir, 3000 if quick else 6000),
            lambda: multi_device(work_dir, 3000 if quick else 6000),
            lambda: array_output(work_dir, 3000 if quick else 6000),
            lambda: host_ceiling(work_dir, 5000 if quick else 20000),
            lambda: host_cpu(work_dir, 4),
            lambda: fetch_clients(400),
        ]
        for step in steps:
            report.update(step())
            _print_table(report)
    report["bench_seconds"] = round(time.perf_counter() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'report.json'}, {out / 'timeline.json'}, {out / 'timeline.png'}")
    return 0


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{'figure':<34}{'value':>10}   target")
    for key, value in report.items():
        if isinstance(value, float):
            sign, target = TARGETS.get(key, ("", None))
            met = ""
            if target is not None:
                met = "ok" if (value >= target if sign == ">=" else value <= target) else "MISSED"
            print(f"{key:<34}{value:>10.3f}   {sign} {target if target is not None else ''} {met}")
