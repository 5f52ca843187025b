"""Stage functions for engine tests; module-level so child processes can import them."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import structlog
import torch

from worker.engine import ItemError, StageFunction
from worker.errors import ObjectTooLarge, TransientError


def sleepy_writer(delay_s: float) -> Callable[[Any, torch.Tensor], Any]:
    def write(value: Any, out: torch.Tensor) -> Any:
        time.sleep(delay_s)
        out.fill_(int(value) % 256)
        return value

    return write


def sleepy_reader(delay_s: float) -> Callable[[torch.Tensor, Sequence[Any]], list[Any]]:
    def read(batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        time.sleep(delay_s * len(values))
        return [(value, int(row.flatten()[0])) for value, row in zip(values, batch, strict=True)]

    return read


def inject_fault(name: str) -> None:
    """Make this process die, segfault, hang or raise, as `name` says; else do nothing."""
    if name == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "segfault":
        ctypes.string_at(0)
    if name == "hang":
        time.sleep(3600)
    if name == "raise":
        raise RuntimeError("bad input")


def faulty_writer() -> Callable[[Any, torch.Tensor], Any]:
    """Dies, segfaults, hangs or raises on the values named so; copies others through."""

    def write(value: Any, out: torch.Tensor) -> Any:
        inject_fault(value)
        out.fill_(1)
        return f"ok:{value}"

    return write


def faulty_runner() -> Callable[[Sequence[Any]], list[Any]]:
    """Dies, segfaults, hangs or raises on the values named so; echoes the others."""

    def run(values: Sequence[Any]) -> list[Any]:
        for value in values:
            inject_fault(str(value))
        return list(values)

    return run


def kill_once_reader(marker_path: str) -> Callable[[torch.Tensor, Sequence[Any]], list[Any]]:
    """Dies on its first batch only (a marker file remembers), then answers."""

    def read(batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        if not os.path.exists(marker_path):
            open(marker_path, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return list(values)

    return read


def broken_setup() -> Callable[..., Any]:
    raise RuntimeError("model file is corrupt")


def memory_limited(max_batch: int) -> Callable[[Sequence[Any]], list[Any]]:
    """Runs out of (GPU) memory on batches larger than `max_batch`, like a real model."""

    def run(values: Sequence[Any]) -> list[Any]:
        if len(values) > max_batch:
            raise torch.OutOfMemoryError(f"cannot fit {len(values)} items (test)")
        return list(values)

    return run


class LayoutProbe(torch.nn.Module):
    """Reports, per item, how it was run: [input channels-last, weight channels-last,
    bfloat16 autocast on]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        flags = [
            batch.is_contiguous(memory_format=torch.channels_last),
            self.conv.weight.is_contiguous(memory_format=torch.channels_last),
            torch.is_autocast_enabled(batch.device.type)
            and torch.get_autocast_dtype(batch.device.type) == torch.bfloat16,
        ]
        return torch.tensor([flags] * len(batch), dtype=torch.float32)


class SizeRecorder(torch.nn.Module):
    """Remembers the size of every batch it is given, in `SizeRecorder.sizes` (shared by
    the instances of one process)."""

    sizes: ClassVar[list[int]] = []

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        SizeRecorder.sizes.append(len(batch))
        return torch.zeros(len(batch), 4)


class OneAtATime(torch.nn.Module):
    """Refuses batches of more than one item, as an export with a fixed batch of 1 does."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > 1:
            raise ValueError(f"expected a batch of 1, got {len(batch)}")
        return torch.zeros(1, 4)


def one_at_a_time() -> torch.nn.Module:
    return OneAtATime()


def breakable_reader(marker_path: str) -> StageFunction:
    """A reader that answers until `marker_path` exists; from then on it and its probe
    fail everything, as a model does after a sticky CUDA error."""

    def check() -> None:
        if os.path.exists(marker_path):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def read(batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        check()
        return list(values)

    return StageFunction(read, check)


def picky_reader() -> StageFunction:
    """Raises on any batch holding the value "bad"; its probe always passes."""

    def read(batch: torch.Tensor, values: Sequence[Any]) -> list[Any]:
        if "bad" in values:
            raise ValueError("cannot read 'bad'")
        return list(values)

    return StageFunction(read, lambda: None)


def doomed_writer() -> StageFunction:
    """Kills its process on every input and in its probe, as a dead GPU might."""

    def die(*_: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    return StageFunction(die, die)


def dies_at_first_start(marker_path: str, times: int = 1) -> Callable[[Any, torch.Tensor], Any]:
    """Dies during set-up the first `times` times (counted in `marker_path`), then works."""
    marker = Path(marker_path)
    started = int(marker.read_text()) if marker.exists() else 0
    if started < times:
        marker.write_text(str(started + 1))
        os.kill(os.getpid(), signal.SIGKILL)
    return sleepy_writer(0.0)


def fill_reader(fails_on: int) -> Callable[[torch.Tensor, Sequence[Any]], list[Any]]:
    """A stand-in detector: each row's fill value; raises for a batch holding `fails_on`."""

    def read(batch: torch.Tensor, _values: Sequence[Any]) -> list[Any]:
        fills = [int(row.flatten()[0]) for row in batch]
        if fails_on in fills:
            raise ValueError(f"cannot read {fails_on}")
        return fills

    return read


def numbered_parts(
    fails_on: int,
) -> Callable[[torch.Tensor, int, Sequence[torch.Tensor]], list[str]]:
    """A stand-in fan-out: `found % 4` parts of the image, part k filled with k and
    about "found.k"; raises for `fails_on`. It checks that the image it is given is still
    the one the detector read (its slot was kept for it)."""

    def fan_out(image: torch.Tensor, found: int, outs: Sequence[torch.Tensor]) -> list[str]:
        if found == fails_on:
            raise ValueError(f"cannot cut {found}")
        if int(image.flatten()[0]) != found:
            raise AssertionError(f"slot of {found} was overwritten")
        for number in range(found % 4):
            outs[number].fill_(number)
        return [f"{found}.{number}" for number in range(found % 4)]

    return fan_out


def part_reader(
    max_batch: int, fails_on: str
) -> Callable[[torch.Tensor, Sequence[Any]], list[Any]]:
    """A stand-in second model: (about, fill) per part; runs out of memory on batches
    over `max_batch` and raises for a batch holding the part about `fails_on`."""

    def read(batch: torch.Tensor, abouts: Sequence[Any]) -> list[Any]:
        if len(abouts) > max_batch:
            raise torch.OutOfMemoryError(f"cannot fit {len(abouts)} parts (test)")
        if fails_on in abouts:
            raise ValueError(f"cannot read {fails_on}")
        return [(about, int(row.flatten()[0])) for about, row in zip(abouts, batch, strict=True)]

    return read


def dies_while_writing(marker_path: str, times: int) -> Callable[[Any, torch.Tensor], Any]:
    """Dies on its first `times` items in all (counted in `marker_path`), then writes as
    `sleepy_writer` does."""
    marker = Path(marker_path)
    write = sleepy_writer(0.0)

    def write_or_die(value: Any, out: torch.Tensor) -> Any:
        died = int(marker.read_text()) if marker.exists() else 0
        if died < times:
            marker.write_text(str(died + 1))
            os.kill(os.getpid(), signal.SIGKILL)
        return write(value, out)

    return write_or_die


def fetching_writer(slow_fetch_s: float) -> StageFunction:
    """Prepares `name` into `fetched:name` (a fetch); the fetch of `slow` takes
    `slow_fetch_s`, of `throttled` raises a transient error, of `missing` a permanent
    one, and of `fetch-hang` never ends. Then writes, faulting as `inject_fault` says."""

    def fetch(value: str) -> str:
        if value == "slow":
            time.sleep(slow_fetch_s)
        if value == "throttled":
            raise TransientError("SlowDown: reduce your request rate")
        if value == "missing":
            raise FileNotFoundError(f"no object {value}")
        if value == "fetch-hang":
            time.sleep(3600)
        return f"fetched:{value}"

    def write(value: str, out: torch.Tensor) -> str:
        inject_fault(value.removeprefix("fetched:"))
        out.fill_(7)
        return value

    return StageFunction(write, prepare=fetch)


def hedgeable_fetcher(slow_s: float) -> StageFunction:
    """Fetches `name` into `fetched:name` in a millisecond, but the first fetch of a
    `slow-` name takes `slow_s` (a GET in the store's tail: one made again answers at
    once); then writes as `fetching_writer` does."""
    fetched_before: set[str] = set()
    lock = threading.Lock()

    def fetch(value: str) -> str:
        with lock:
            first = value not in fetched_before
            fetched_before.add(value)
        time.sleep(slow_s if first and value.startswith("slow-") else 0.001)
        return f"fetched:{value}"

    def write(value: str, out: torch.Tensor) -> str:
        out.fill_(7)
        return value

    return StageFunction(write, prepare=fetch)


def local_fetching_writer() -> StageFunction:
    """`fetching_writer` whose values that start `local:` are at hand; each output says
    which thread of the child fetched it."""
    fetching = fetching_writer(0.0)
    assert fetching.prepare is not None
    fetch = fetching.prepare

    def fetch_saying_where(value: str) -> tuple[str, str]:
        return fetch(value.removeprefix("local:")), threading.current_thread().name

    def write(value: tuple[str, str], out: torch.Tensor) -> tuple[str, str]:
        out.fill_(7)
        return value

    return StageFunction(
        write, prepare=fetch_saying_where, at_hand=lambda value: value.startswith("local:")
    )


class PixelEmbedder(torch.nn.Module):
    """An embedding model's stand-in: each image's first 32 pixel values, as float32."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.flatten(1)[:, :32].float()


def pixel_embedder() -> torch.nn.Module:
    return PixelEmbedder()


def finishing_runner(run_s: float, finish_s: float, spans: str | None = None) -> StageFunction:
    """Runs each request for `run_s` (the device), raising on `bad-run`; then finishes
    it for `finish_s` (postprocessing), logging `finished` for each value: `bad` gets
    an error of its own, a request holding `explode` makes the whole finish raise, and
    `unsendable` an outcome that cannot be pickled. With `spans`, a file, each run and
    finish appends a line to it: its kind, then when it started and ended."""

    def spanned(kind: str, started: float) -> None:
        if spans is not None:
            with open(spans, "a") as file:
                file.write(f"{kind} {started} {time.monotonic()}\n")

    def run(values: Sequence[str]) -> list[str]:
        started = time.monotonic()
        time.sleep(run_s)
        spanned("run", started)
        if "bad-run" in values:
            raise ValueError("the run refuses bad-run")
        return [f"ran:{value}" for value in values]

    def finish(outputs: list[str], values: list[str]) -> list[Any]:
        started = time.monotonic()
        time.sleep(finish_s)
        spanned("finish", started)
        if "explode" in values:
            raise RuntimeError("finish broke")
        for value in values:
            structlog.get_logger().info("finished", value=value)
        return [
            ItemError("ValueError", "bad item", "postprocess")
            if value == "bad"
            else (lambda: None)
            if value == "unsendable"
            else f"{output}+"
            for output, value in zip(outputs, values, strict=True)
        ]

    return StageFunction(run, finish=finish)


def failing_finisher(marker_path: str) -> StageFunction:
    """Finishes every item with an error; its finish probe fails once the file at
    `marker_path` exists (a postprocessor whose library broke), and passes until then
    (bad params on every item: the items' fault)."""

    def finish(outputs: list[Any], values: list[Any]) -> list[Any]:
        return [ItemError("KeyError", "no such label", "postprocess") for _ in values]

    def finish_probe() -> None:
        if os.path.exists(marker_path):
            raise ImportError("libpostprocess.so: cannot open shared object file (test)")

    return StageFunction(list, finish=finish, finish_probe=finish_probe)


class Echo(torch.nn.Module):
    """Answers each image with its own pixels: a view of the batch it is given."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.flatten(1)


def echo_model() -> torch.nn.Module:
    return Echo()


def needs_params(output: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A postprocessor with no default for a param it needs."""
    return {"above": bool(output[0] > params["threshold"])}


def revocable_fetcher(marker_path: str) -> StageFunction:
    """Fetches `name` into `fetched:name`, but `denied` (an object the worker may not
    read), `huge` (over the size limit), `name` once a file `deleted-name` is beside
    `marker_path` (its owner deleted it) or `gone-name` (unreadable for now), and every
    input once `marker_path` exists (the worker's credentials revoked); then writes as
    `sleepy_writer` does, with the fill 7."""
    marker = Path(marker_path)

    def fetch(value: str) -> str:
        if value == "denied" or marker.exists():
            raise PermissionError(f"AccessDenied: {value} (test)")
        if value == "huge":
            raise ObjectTooLarge(10, 5)
        if (marker.parent / f"deleted-{value}").exists():
            raise FileNotFoundError(f"NoSuchKey: {value} (test)")
        if (marker.parent / f"gone-{value}").exists():
            raise TransientError(f"{value} cannot be read for now (test)")
        return f"fetched:{value}"

    def write(value: str, out: torch.Tensor) -> str:
        out.fill_(7)
        return value

    return StageFunction(write, prepare=fetch)


def revocable_parts(
    marker_path: str,
) -> Callable[[torch.Tensor, int, Sequence[torch.Tensor]], list[str]]:
    """`numbered_parts` (failing on nothing) until `marker_path` exists; from then on it
    fails every image, as a fan-out whose process broke would."""
    marker = Path(marker_path)
    fan_out = numbered_parts(-1)

    def cut(image: torch.Tensor, found: int, outs: Sequence[torch.Tensor]) -> list[str]:
        if marker.exists():
            raise RuntimeError("the fan-out's process is broken (test)")
        return fan_out(image, found, outs)

    return cut


def oom_killed_writer(vmstat_path: str) -> Callable[[Any, torch.Tensor], Any]:
    """`sleepy_writer`, but `oom` makes the kernel's OOM killer kill this process (its
    stand-in: the kill counted in `vmstat_path`, then SIGKILL) and `sigkill` is killed
    by someone else."""
    vmstat = Path(vmstat_path)
    write = sleepy_writer(0.0)

    def write_or_die(value: Any, out: torch.Tensor) -> Any:
        if value == "oom":
            kills = int(vmstat.read_text().split()[-1])
            vmstat.write_text(f"pgfault 12\noom_kill {kills + 1}\n")
        if value in ("oom", "sigkill"):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(1 if isinstance(value, str) else value, out)

    return write_or_die


def int_then_float(output: Any, _params: dict[str, Any]) -> dict[str, Any]:
    """A postprocessor whose `score` is an integer for the model's answer to zeros and a
    fraction for anything else: Parquet results cannot hold it."""
    total = float(np.asarray(output).sum())
    return {"score": 0 if total == 0 else total / (total + 1)}


# The grey of the one image `float_for_grey` scores with a fraction.
GREY = 7


def float_for_grey(output: Any, _params: dict[str, Any]) -> dict[str, Any]:
    """A postprocessor whose `score` is an integer, but a fraction for an image of one
    grey (`GREY`): Parquet results cannot hold it."""
    return {"score": 0.5 if (np.asarray(output) == GREY).all() else 0}


def float_always(output: Any, _params: dict[str, Any]) -> dict[str, Any]:
    """`float_for_grey` mended: its `score` always a float."""
    return {"score": 0.5 if (np.asarray(output) == GREY).all() else 0.0}


def environment_reader() -> Callable[[Sequence[str]], list[str | None]]:
    """A stage whose items are names of environment variables, and their outputs the
    child's values of them."""
    return lambda names: [os.environ.get(name) for name in names]


def collector_at_setup() -> Callable[[Sequence[Any]], list[tuple[int, bool, int]]]:
    """A stage whose every output is what the child's garbage collector was at its
    set-up: how many objects it held frozen, whether it was on, and how many full
    collections it had run (those of the fork server it was forked from included)."""
    seen = (gc.get_freeze_count(), gc.isenabled(), gc.get_stats()[2]["collections"])
    return lambda items: [seen for _ in items]
