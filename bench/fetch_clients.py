"""S3 clients side by side (issue 12): the CPU one process spends per GET of a small
object, and GETs per second, `FETCH_CONCURRENCY` at a time against a local endpoint.

Run by `bench.processes.fetch_clients`, one process per client, so each reading is that
client's alone (not the moto server's, which runs in the bench's process):

    python -m bench.fetch_clients boto3|obstore ENDPOINT BUCKET PREFIX COUNT SIZE
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
CLIENTS = ("boto3", "obstore")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def boto3_gets(endpoint: str, bucket: str, keys: list[str]) -> Callable[[], list[bytes]]:
    """The daemon's own adapter (`S3BlobStore`), on threads as a preprocessing process
    fetches a request."""
    from worker.adapters.aws.s3 import S3BlobStore, s3_client
    from worker.ports import S3Location

    store = S3BlobStore(s3_client(FETCH_CONCURRENCY))

    def get_all() -> list[bytes]:
        with ThreadPoolExecutor(FETCH_CONCURRENCY) as pool:
            return list(pool.map(lambda key: store.get(S3Location(bucket, key)), keys))

    return get_all


def obstore_gets(endpoint: str, bucket: str, keys: list[str]) -> Callable[[], list[bytes]]:
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
        limit = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def get(key: str) -> bytes:
            async with limit:
                result = await obstore.get_async(store, key)
                return bytes(await result.bytes_async())

        return await asyncio.gather(*(get(key) for key in keys))

    return lambda: asyncio.run(get_all())


def measure(
    client: str, endpoint: str, bucket: str, keys: list[str], size: int
) -> dict[str, float]:
    """Warm the client with one read of every key, then read them all again (each
    `size` bytes): CPU ms per GET, GETs/s."""
    make = {"boto3": boto3_gets, "obstore": obstore_gets}[client]
    get_all = make(endpoint, bucket, keys)
    get_all()
    cpu_s, wall_s = _cpu_s(), time.perf_counter()
    read = get_all()
    cpu_s, wall_s = _cpu_s() - cpu_s, time.perf_counter() - wall_s
    whole = sum(len(data) == size for data in read)
    if whole != len(keys):
        raise RuntimeError(f"{client} read {whole} of {len(keys)} objects whole")
    return {"cpu_ms_per_get": 1000 * cpu_s / len(keys), "gets_per_s": len(keys) / wall_s}


if __name__ == "__main__":
    name, url, bucket_name, prefix, count, object_bytes = sys.argv[1:]
    wanted = [f"{prefix}{number}" for number in range(int(count))]
    print(json.dumps(measure(name, url, bucket_name, wanted, int(object_bytes))), flush=True)
    # obstore's runtime aborts the interpreter's teardown now and then (SIGABRT after
    # the figures are out: 31 of 200 runs under load); there is nothing left to tear down.
    os._exit(0)
