"""What a preprocessing process spends, an item, on reading its inputs (`Preparing`):
items fed as the daemon feeds a child (a thread's worth each and a request more), each a
read that waits S3's latency (median 30 ms, p99 200 ms, `bench.harness`) on one of 32
threads, or none; taken in groups as the child answers them, hedged as it hedges. The
CPU is the whole process's (`time.process_time`): the threads woken for each read, the
hand-offs between them, the groups. Issue 38's 16 processes share the host's cores, so
this, times 16, is what the feed costs the host beyond the reads themselves.

    python -m bench.preparing
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import random
import threading
import time
from typing import Any

from bench.harness import S3_MEDIAN_MS, S3_P99_MS
from worker.engine.items import StageFunction
from worker.engine.preparing import Preparing

THREADS = 32  # issue 38's 512 reads in flight over 16 processes
HEDGES = 2
REQUEST_ITEMS = 16  # what a child is sent at once beyond its threads' worth


def preparing_cpu(items: int, latency: bool) -> dict[str, float]:
    """CPU µs an item, items/s and items an answer, for `items` read with S3's latency
    (`latency`) or none."""
    draws = random.Random(1)
    draws_lock = threading.Lock()
    mu = math.log(S3_MEDIAN_MS / 1000)
    sigma = math.log(S3_P99_MS / S3_MEDIAN_MS) / 2.326

    def read(value: int) -> int:
        if latency:
            with draws_lock:
                wait_s = draws.lognormvariate(mu, sigma)
            time.sleep(wait_s)
        return value

    ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
    preparing = Preparing(StageFunction(lambda *_: None, prepare=read), THREADS, ready, HEDGES)
    daemon_end, child_end = multiprocessing.Pipe()
    threading.Thread(target=preparing.read, args=(child_end,), daemon=True).start()
    sent = taken = answers = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while taken < items:
        room = min(THREADS + REQUEST_ITEMS - (sent - taken), items - sent)
        if room > 0:
            daemon_end.send([(None, sent + n, (), sent + n) for n in range(room)])
            sent += room
        group, _ = preparing.next_group()
        taken += len(group)
        answers += 1
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    daemon_end.send(None)
    which = "latency" if latency else "no_latency"
    return {
        f"preparing_cpu_us_per_item_{which}": 1e6 * cpu_s / items,
        f"preparing_items_per_s_{which}": items / wall_s,
        f"preparing_items_per_answer_{which}": items / answers,
    }


def preparing(items: int) -> dict[str, float]:
    """`preparing_cpu` with S3's latency and without."""
    return {**preparing_cpu(items, latency=True), **preparing_cpu(20 * items, latency=False)}


if __name__ == "__main__":
    for name, value in preparing(8000).items():
        print(f"{name:<42}{value:>10.1f}")
