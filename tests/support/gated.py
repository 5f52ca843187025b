"""Daemons whose calls to S3 and SQS a test makes one at a time, in the order it picks:
each delivery of a message runs on a thread that stops before every call
(`tests.support.fleet`, `tests/test_protocol_properties.py`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from worker.adapters.fakes import InMemoryBlobStore
from worker.errors import TransientError
from worker.ports import ReceivedMessage, S3Location

STUCK_S = 30.0  # a daemon that neither calls S3 or SQS nor ends in this long hangs


class Crashed(BaseException):
    """The daemon's process died here: nothing more of it runs (`except Exception` in
    the code under test does not catch it, as nothing catches a SIGKILL)."""


# What becomes of a call: made; the daemon dies before it, or after it (the answer lost);
# S3 or SQS fail it (throttled past the adapter's tries: nothing done); its answer is
# lost and the adapter makes it again, which answers (a conditional write then finds
# its own write, a send is sent twice).
Fate = Literal["lives", "dies", "dies_unanswered", "fails", "retried"]


class Caller:
    """Makes a daemon's calls to S3 and SQS as they come (the unsharded run's daemon, and
    those that run a job to its end)."""

    def call(self, what: str, function: Callable[[], Any]) -> Any:
        return function()


class Actor(Caller):
    """One delivery of a message on a daemon of its own, on a thread that stops before
    each call to S3 or SQS until the machine lets it make it: one call at a time in the
    whole game, in the order the machine picks."""

    def __init__(self, name: str, message_id: str) -> None:
        self.name = name
        self.message_id = message_id
        self.pending = ""  # the call it stopped before
        self.calls = 0
        self.ended = False
        self.dead = False
        self.error: BaseException | None = None
        self._fate: Fate = "lives"
        self._go = threading.Semaphore(0)
        self._stopped = threading.Semaphore(0)

    def start(self, work: Callable[[], None]) -> None:
        """Run `work` on its thread, up to its first call."""
        threading.Thread(target=self._run, args=(work,), name=self.name, daemon=True).start()
        self._wait()

    def step(self, fate: Fate = "lives") -> None:
        """Let it make the call it stopped before (or die before it, or after it, the
        answer lost) and go on to its next call, or its end."""
        self._fate = fate
        self._go.release()
        self._wait()

    def call(self, what: str, function: Callable[[], Any]) -> Any:
        if self.dead:  # a `finally` of the code under test, after the crash
            raise Crashed(self.name)
        self.pending = what
        self._stopped.release()
        self._go.acquire()
        self.calls += 1
        fate, self._fate = self._fate, "lives"
        if fate == "dies":
            self.dead = True
            raise Crashed(self.name)
        if fate == "fails":
            raise TransientError(f"SlowDown (the machine's): {what}")
        answer = function()
        if fate == "dies_unanswered":
            self.dead = True
            raise Crashed(self.name)
        return function() if fate == "retried" else answer

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Crashed:
            self.dead = True
        except BaseException as error:
            self.error = error
        finally:
            self.ended = True
            self._stopped.release()

    def _wait(self) -> None:
        if not self._stopped.acquire(timeout=STUCK_S):
            raise AssertionError(f"{self.name} neither called S3 or SQS nor ended")
        if self.error is not None:
            raise AssertionError(f"{self.name} failed at {self.pending}") from self.error


class GatedStore:
    """A store as one daemon sees it: each call through its `Caller`, named by what it
    does and to which key under `root` (the job's output)."""

    def __init__(self, store: InMemoryBlobStore, caller: Caller, root: str) -> None:
        self._store = store
        self._caller = caller
        self._root = root

    def _call(self, what: str, location: Any, function: Callable[[], Any]) -> Any:
        return self._caller.call(f"{what} {self._short(location)}", function)

    def _short(self, location: Any) -> str:
        return str(location).removeprefix(self._root)

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: Any = None,
        *,
        expect: str | None = None,
    ) -> Any:
        read = lambda: self._store.get(location, max_bytes, byte_range, expect=expect)  # noqa: E731
        return self._call("get", location, read)

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Iterator[bytes]:
        whole = lambda: b"".join(self._store.chunks(location, max_bytes, expect=expect))  # noqa: E731
        yield self._call("get", location, whole)

    def head(self, location: S3Location) -> Any:
        return self._call("head", location, lambda: self._store.head(location))

    def put(self, location: S3Location, *args: Any, **kwargs: Any) -> str:
        return self._call("put", location, lambda: self._store.put(location, *args, **kwargs))

    def put_file(self, location: S3Location, *args: Any, **kwargs: Any) -> str:
        put_file = self._store.put_file
        return self._call("put", location, lambda: put_file(location, *args, **kwargs))

    def compose(self, location: S3Location, *args: Any, **kwargs: Any) -> str:
        compose = self._store.compose
        return self._call("compose", location, lambda: compose(location, *args, **kwargs))

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        return self._call("list", prefix, lambda: self._store.objects_under(prefix))

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        yield from self._call("list", prefix, lambda: list(self._store.keys_under(prefix)))

    def delete(self, locations: list[S3Location]) -> None:
        names = ",".join(self._short(location) for location in locations)
        self._caller.call(f"delete {names}", lambda: self._store.delete(locations))

    def remote_reader(self) -> None:
        return None


class GatedQueue:
    """A queue (a `JobSource`) as one daemon sees it: each call through its `Caller`."""

    def __init__(self, queue: Any, caller: Caller) -> None:
        self._queue = queue
        self._caller = caller

    def ack(self, receipt_handle: str) -> None:
        self._caller.call(f"ack {receipt_handle}", lambda: self._queue.ack(receipt_handle))

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        what = f"release {receipt_handle}"
        self._caller.call(what, lambda: self._queue.release(receipt_handle, delay_s))

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        return self._caller.call(  # type: ignore[no-any-return]
            "extend", lambda: self._queue.extend(receipt_handles, visibility_timeout_s)
        )

    def requeue(self, message: ReceivedMessage, **fields: Any) -> None:
        self._caller.call(
            f"requeue {message.message_id}", lambda: self._queue.requeue(message, **fields)
        )

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        kinds = ",".join(_kind(body) for body in bodies)
        what = f"send {kinds} in {delay_s} s"
        self._caller.call(what, lambda: self._queue.send_many(bodies, group, delay_s))

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        what = f"dead-letter {message.message_id}"
        return self._caller.call(  # type: ignore[no-any-return]
            what, lambda: self._queue.dead_letter(message, reason)
        )

    def receive(self, *args: Any) -> list[ReceivedMessage]:
        raise AssertionError("the test delivers the messages")


def _kind(body: str) -> str:
    """What a message sent is, in a call's name."""
    fields = json.loads(body)
    if "shard" in fields:
        return f"shard {fields['shard']['index']}"
    return "watch" if "watch" in fields else "job"
