"""S3 clients side by side (issues 12 and 38): the CPU one process spends per GET of a
small object, and GETs per second, `FETCH_CONCURRENCY` at a time against a local
endpoint, as a preprocessing process fetches a request's inputs.

- `boto3`: the daemon's boto3 reader (`open_s3_reader`, its pool sized to the threads),
  its `get` on `FETCH_CONCURRENCY` threads;
- `obstore_reader`: the daemon's obstore reader (`open_obstore_reader`), the same way;
- `obstore`: obstore's own async GETs, `FETCH_CONCURRENCY` at a time (what the client
  costs with nothing of ours around it).

Run by `bench.processes.fetch_clients`, one process per client, so each reading is that
client's alone (not the moto server's, which runs in the bench's process):

    python -m bench.fetch_clients CLIENT ENDPOINT BUCKET PREFIX COUNT SIZE [THREADS]
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

FETCH_CONCURRENCY = 16
CLIENTS = ("boto3", "obstore_reader", "obstore")
ATTEMPTS = 3  # tries per GET (none fails against a local moto)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _on_threads(
    open_reader: Callable[[int, int], Callable[..., bytes]],
    bucket: str,
    keys: list[str],
    threads: int,
) -> Callable[[], list[bytes]]:
    """A daemon's reader, opened as a preprocessing process opens it (for `threads`
    reads at once), its `get` on `threads` threads."""
    from worker.ports import S3Location

    get = open_reader(ATTEMPTS, threads)

    def get_all() -> list[bytes]:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda key: get(S3Location(bucket, key)), keys))

    return get_all


def boto3_gets(
    endpoint: str, bucket: str, keys: list[str], threads: int
) -> Callable[[], list[bytes]]:
    """The daemon's boto3 reader, its pool sized to the threads."""
    from worker.adapters.aws.s3 import open_s3_reader

    return _on_threads(open_s3_reader, bucket, keys, threads)


def obstore_reader_gets(
    endpoint: str, bucket: str, keys: list[str], threads: int
) -> Callable[[], list[bytes]]:
    """The daemon's obstore reader (`ObstoreReader`), its pool sized to the threads."""
    from worker.adapters.aws.obstore_reads import open_obstore_reader

    return _on_threads(open_obstore_reader, bucket, keys, threads)


def obstore_gets(
    endpoint: str, bucket: str, keys: list[str], threads: int
) -> Callable[[], list[bytes]]:
    """obstore's async GETs (Rust, outside the interpreter's lock)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        client_options={"allow_http": True},
    )

    async def get_all() -> list[bytes]:
        limit = asyncio.Semaphore(threads)

        async def get(key: str) -> bytes:
            async with limit:
                result = await obstore.get_async(store, key)
                return bytes(await result.bytes_async())

        return await asyncio.gather(*(get(key) for key in keys))

    return lambda: asyncio.run(get_all())


MAKERS = {"boto3": boto3_gets, "obstore_reader": obstore_reader_gets, "obstore": obstore_gets}


def measure(
    client: str,
    endpoint: str,
    bucket: str,
    keys: list[str],
    size: int,
    *,
    threads: int = FETCH_CONCURRENCY,
) -> dict[str, float]:
    """Warm the client with one read of every key, then read them all again (each
    `size` bytes): CPU ms per GET, GETs/s."""
    get_all = MAKERS[client](endpoint, bucket, keys, threads)
    get_all()
    cpu_s, wall_s = _cpu_s(), time.perf_counter()
    read = get_all()
    cpu_s, wall_s = _cpu_s() - cpu_s, time.perf_counter() - wall_s
    whole = sum(len(data) == size for data in read)
    if whole != len(keys):
        raise RuntimeError(f"{client} read {whole} of {len(keys)} objects whole")
    return {"cpu_ms_per_get": 1000 * cpu_s / len(keys), "gets_per_s": len(keys) / wall_s}


if __name__ == "__main__":
    name, url, bucket_name, prefix, count, object_bytes, *more = sys.argv[1:]
    wanted = [f"{prefix}{number}" for number in range(int(count))]
    concurrency = int(more[0]) if more else FETCH_CONCURRENCY
    figures = measure(name, url, bucket_name, wanted, int(object_bytes), threads=concurrency)
    print(json.dumps(figures), flush=True)
    # obstore's runtime aborts the interpreter's teardown now and then (SIGABRT after
    # the figures are out: 31 of 200 runs under load); there is nothing left to tear down.
    os._exit(0)
