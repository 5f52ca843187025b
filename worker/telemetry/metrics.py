"""Operations: Prometheus metrics and a health check, served on one HTTP port.

`GET /metrics` is the Prometheus text format; `GET /healthz` answers 200 while the
pipeline's workers are up and the daemon is making progress, 503 with the reason
otherwise (the container's HEALTHCHECK and the ECS task's health check use it).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import generate_latest

from worker.errors import CannotStart

log = structlog.get_logger()

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Metrics:
    """Every metric the daemon exports, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.jobs = Counter(
            "worker_jobs", "Jobs finished or given up, by outcome.", ["outcome"], registry=registry
        )
        self.items = Counter(
            "worker_items", "Items finished, by outcome.", ["outcome"], registry=registry
        )
        self.model = Info(
            "worker_model", "The model serving: name, version and digest.", registry=registry
        )
        self.jobs_in_flight = Gauge("worker_jobs_in_flight", "Jobs held now.", registry=registry)
        self.stage_busy = Counter(
            "worker_stage_busy_seconds",
            "Time each stage spent working on items.",
            ["stage"],
            registry=registry,
        )
        self.stage_workers = Gauge(
            "worker_stage_workers",
            "Processes serving each process stage (preprocess follows demand).",
            ["stage"],
            registry=registry,
        )
        self.stage_queue_depth = Gauge(
            "worker_stage_queue_depth",
            "Items waiting in front of each stage.",
            ["stage"],
            registry=registry,
        )
        self.batch_items = Histogram(
            "worker_batch_items",
            "Items per call of each stage.",
            ["stage"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.stage_counts = Counter(
            "worker_stage_counts",
            "What each stage's processes counted: the fetch's reads, and of those hedged.",
            ["stage", "count"],
            registry=registry,
        )
        self.gc_pauses = Histogram(
            "worker_gc_pause_seconds",
            "The daemon's garbage collections, each a pause of every thread, by generation.",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self.worker_restarts = Counter(
            "worker_stage_restarts",
            "Stage processes replaced after a crash or a hang.",
            ["stage"],
            registry=registry,
        )
        self.lease_renewals = Counter(
            "worker_lease_renewals",
            "Message leases renewed, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.protection_calls = Counter(
            "worker_scale_in_protection_calls",
            "Scale-in protection API calls, by requested state and outcome.",
            ["protected", "outcome"],
            registry=registry,
        )
        self.interruption_notices = Counter(
            "worker_interruption_notices",
            "Interruption notices acted on, by kind and cause.",
            ["kind", "cause"],
            registry=registry,
        )
        self.host_out_of_service = Gauge(
            "worker_host_out_of_service",
            "1 once this host is taken out of service for breaking its workers.",
            registry=registry,
        )
        self.jobs_handed_back = Counter(
            "worker_jobs_handed_back",
            "Jobs released unfinished at shutdown, by why the daemon stopped.",
            ["reason"],
            registry=registry,
        )
        self._stage_metrics: dict[str, tuple[Any, Any]] = {}
        self._stage_count_children: dict[tuple[str, str], Any] = {}
        self._stage_counts_lock = threading.Lock()
        self._stage_count_totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self._items_succeeded = self.items.labels("succeeded")
        self._items_failed = self.items.labels("failed")

    def follow(
        self,
        jobs_held: Callable[[], int],
        queue_depths: Callable[[], dict[str, int]],
        worker_counts: Callable[[], dict[str, int]],
    ) -> None:
        """Read the gauges from the daemon when scraped, rather than keep them updated."""
        self.jobs_in_flight.set_function(jobs_held)
        for gauge, read in (
            (self.stage_queue_depth, queue_depths),
            (self.stage_workers, worker_counts),
        ):
            for stage in read():
                gauge.labels(stage).set_function(
                    functools.partial(lambda read, stage: read()[stage], read, stage)
                )

    def stage_ran(self, stage: str, items: int, duration_s: float) -> None:
        # Looking labels up costs more than the update: bind each stage's once.
        if stage not in self._stage_metrics:
            self._stage_metrics[stage] = (
                self.stage_busy.labels(stage),
                self.batch_items.labels(stage),
            )
        busy, batch_items = self._stage_metrics[stage]
        busy.inc(duration_s)
        batch_items.observe(items)

    def stage_counted(self, stage: str, name: str, count: int) -> int:
        """Add to what `stage`'s processes counted as `name`; the total so far. (Kept
        here too: reading it back from the counter collects every label's samples, on
        each answer of a child.)"""
        key = (stage, name)
        with self._stage_counts_lock:  # each of a stage's driver threads counts
            if key not in self._stage_count_children:
                self._stage_count_children[key] = self.stage_counts.labels(stage, name)
            self._stage_count_children[key].inc(count)
            self._stage_count_totals[key] += count
            return self._stage_count_totals[key]

    def gc_paused(self, generation: int, seconds: float) -> None:
        self.gc_pauses.labels(str(generation)).observe(seconds)

    def item_finished(self, failed: bool) -> None:
        (self._items_failed if failed else self._items_succeeded).inc()

    def leases_renewed(self, ok: int, failed: int) -> None:
        self.lease_renewals.labels("ok").inc(ok)
        self.lease_renewals.labels("failed").inc(failed)

    def protection_called(self, protected: bool, ok: bool) -> None:
        self.protection_calls.labels(str(protected).lower(), "ok" if ok else "failed").inc()

    def export(self) -> bytes:
        return generate_latest(self.registry)


@contextmanager
def serving(
    port: int, metrics: Metrics, health: Callable[[], str | None], host: str = "0.0.0.0"
) -> Iterator[int]:
    """Serve /metrics and /healthz on `port` (0: a free one); yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, metrics.export())
            elif self.path == "/healthz":
                problem = health()
                if problem is None:
                    self._reply(200, "text/plain", b"ok\n")
                else:
                    self._reply(503, "text/plain", problem.encode() + b"\n")
            else:
                self._reply(404, "text/plain", b"try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # scraped every few seconds: not worth a log line each

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as error:
        reason = error.strerror or str(error)
        raise CannotStart(
            f"cannot serve metrics on port {port} (--metrics-port): {reason}"
        ) from None
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    bound_port = server.server_address[1]
    log.info("metrics_serving", port=bound_port, paths=["/metrics", "/healthz"])
    try:
        yield bound_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
