"""What the benchmarks run on: stand-ins for a GPU's model and for a slow decoder
(loaded by reference in the daemon's processes), an S3 with injected latency, a job
source that times the run, the bench's images, and the daemon run in this process over
them (`run_daemon`).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import random
import statistics
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages.synthetic import samples
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.wiring import Daemon
from worker.ports import ByteRange, ObjectReader, ReceivedMessage, RemoteReader, S3Location
from worker.settings import Settings
from worker.telemetry.timeline import Timeline

# A batch costs a fixed floor (kernel launches: small batches are launch-bound on a GPU)
# plus a per-image share: 44 ms for 3 images, 120 ms for 64 (530 images/s), which two CPU
# cores can feed, so the model is the stage that dominates, as on a GPU host.
DEVICE_BASE_MS = 40.0
DEVICE_PER_ITEM_MS = 1.25
FLEET_DEVICE_BATCH_S = 0.5
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


def fleet_device_model() -> nn.Module:
    """Half a second a batch whatever its size: a slow GPU, so that a fleet of daemons
    on this machine's cores is limited by its devices (`bench.fleet`)."""
    return DeviceModel(FLEET_DEVICE_BATCH_S * 1000, 0)


def h100_device_model() -> nn.Module:
    """An H100's pace (`bench.gpu_shaped`): ResNet-50 compiled, 11 ms a batch of 128."""
    from bench.gpu_shaped import H100_BASE_MS, H100_PER_ITEM_MS

    return DeviceModel(H100_BASE_MS, H100_PER_ITEM_MS)


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

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
        *,
        expect: str | None = None,
    ) -> bytes:
        self._wait()
        return super().get(location, max_bytes, byte_range, expect=expect)

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

    def late_get(
        location: S3Location, max_bytes: int | None = None, byte_range: ByteRange | None = None
    ) -> bytes:
        time.sleep(rng.lognormvariate(mu, sigma))
        return get(location, max_bytes, byte_range)

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
        self.machine_cpu_at_first_receive_s = 0.0
        self.machine_cpu_at_last_ack_s = 0.0
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
                self.machine_cpu_at_first_receive_s = machine_cpu_s()
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
                self.machine_cpu_at_last_ack_s = machine_cpu_s()

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

    @property
    def machine_cpu_s(self) -> float:
        """Every process's CPU on the machine from the first receive to the last ack."""
        return self.machine_cpu_at_last_ack_s - self.machine_cpu_at_first_receive_s


def machine_cpu_s() -> float:
    """The CPU time every process on the machine has used since it started (user, nice
    and system time, from /proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system = (int(field) for field in stat.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


# Inputs. --------------------------------------------------------------------------------


def image_pool() -> list[bytes]:
    return [data for _, data in samples(IMAGE_POOL, seed=99)]


DEVICE_MODEL = "bench.harness:device_model"
OVERLAP_JOB_SIZE = 100
# Many fetch threads hide the injected S3 latency; the figures without it use the defaults.
OVERLAP_SETTINGS: dict[str, Any] = {
    "model": DEVICE_MODEL,
    "fetch_concurrency": 128,
    "preprocess_workers": 2,
}


def load_jobs(
    source: InMemoryJobSource,
    blobs: InMemoryBlobStore,
    pool: list[bytes],
    job_sizes: list[int],
    message: dict[str, Any] | None = None,
    *,
    tars: bool = False,
) -> list[list[str]]:
    """Queue one job per size; inputs are pool images stored under distinct keys (with
    `tars`, as the members of one tar shard per job); `message` joins each message's
    fields."""
    jobs, number = [], 0
    for job, size in enumerate(job_sizes):
        uris = [f"s3://bench/in/{n}.img" for n in range(number, number + size)]
        images = [pool[n % len(pool)] for n in range(number, number + size)]
        number += size
        shape: dict[str, Any] = {}
        if tars:
            listed, shape = [f"s3://bench/in/job-{job}.tar"], {"tar": {}}
            keys = [S3Location.parse(uri).key for uri in uris]
            blobs.objects[listed[0]] = tar_of(list(zip(keys, images, strict=True)))
        else:
            listed = uris
            for uri, image in zip(uris, images, strict=True):
                blobs.objects[uri] = image
        source.send(
            json.dumps(
                {
                    "job_id": f"job-{job}",
                    "inputs": listed,
                    "output": f"s3://bench/out/job-{job}/",
                    **shape,
                    **(message or {}),
                }
            )
        )
        jobs.append(uris)
    return jobs


def tar_of(members: list[tuple[str, bytes]], tar_format: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar shard holding `members` (name, bytes) in order, as WebDataset writes them."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tar_format) as archive:
        for name, data in members:
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return sink.getvalue()


@dataclass
class DaemonRun:
    settings: Settings
    wall_s: float
    items: int
    timeline: Timeline
    source: TimedSource


def run_daemon(
    job_sizes: list[int],
    blobs: InMemoryBlobStore,
    work_dir: Path,
    stop_after_s: float | None = None,
    pool: list[bytes] | None = None,
    *,
    message: dict[str, Any] | None = None,
    tars: bool = False,
    **settings: Any,
) -> DaemonRun:
    """Run the daemon in this process over jobs of `job_sizes` (inputs from `pool`, the
    bench's images by default, each job's in a tar shard with `tars`; `message` joins
    their messages' fields), until drained (or stopped)."""
    source, timeline = TimedSource(), Timeline()
    load_jobs(source, blobs, pool or image_pool(), job_sizes, message, tars=tars)
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


def median_of(runs: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(runs))


# The control plane alone: a model and a preprocessor that do nothing, large jobs.
NOOP_MODEL = "bench.harness:noop_model"
NOOP_PREPROCESSOR = "bench.harness:noop_preprocessor"
HOST_JOB_SIZE = 500
