"""An HTTP proxy in front of the moto server that counts requests and answers chosen
ones with faults: an AWS error (500 InternalError, 503 SlowDown, ...), a slow answer,
or a connection reset with no answer at all; or with a canned answer, for an API moto
does not implement.

The daemon talks to it as its AWS endpoint, so the faults are real HTTP that botocore
sees, and the daemon's own retry and classification code handles, exactly as with a
failing AWS endpoint.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from tests.support.fakeaws import serve_http

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    action: str  # the API action: X-Amz-Target (JSON protocol) or Action= (query protocol)
    body: str = ""  # an API call's parameters (JSON or query protocol)
    query: str = ""  # the URL's query string (S3's REST calls: list-type=2&prefix=...)


@dataclass
class Fault:
    """What to do to requests that `matches`: the first `times` per method and path
    (None: all of them), each with `probability`.

    `kind` "error" answers `status` with an AWS error `code`; "slow" forwards the
    request; "reset" closes the connection without an answer; "answer" answers
    `status` with `body`. Each waits `delay_s` first.
    """

    name: str
    matches: Callable[[Request], bool]
    times: int | None = None
    probability: float = 1.0
    kind: Literal["error", "slow", "reset", "answer"] = "error"
    status: int = 500
    code: str = "InternalError"
    delay_s: float = 0.0
    body: str = ""


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0):
        self._upstream = urlsplit(upstream).netloc
        self._faults: list[Fault] = []
        self._seen: Counter[tuple[str, str, str]] = Counter()
        self._rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()  # every request seen, by action
        self._requests: list[Request] = []
        self._lock = threading.Lock()

    def fail(self, name: str, matches: Callable[[Request], bool], times: int | None) -> None:
        """Answer matching requests with HTTP 500 InternalError."""
        self.add(Fault(name, matches, times))

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def paths(self, method: str) -> list[str]:
        """The path of every `method` request seen so far (S3's REST calls: /bucket/key)."""
        with self._lock:
            return [request.path for request in self._requests if request.method == method]

    def requests(self, action: str) -> list[Request]:
        """Every request for `action` seen so far, in order."""
        with self._lock:
            return [request for request in self._requests if request.action == action]

    def _fault_for(self, request: Request) -> Fault | None:
        with self._lock:
            self.actions[request.action] += 1
            self._requests.append(request)
            for fault in self._faults:
                if not fault.matches(request):
                    continue
                key = (fault.name, request.method, request.path)
                self._seen[key] += 1
                within = fault.times is None or self._seen[key] <= fault.times
                if within and self._rng.random() < fault.probability:
                    self.injected[fault.name] += 1
                    return fault
        return None

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Run the proxy on a free loopback port; yields its URL."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                target = self.headers.get("X-Amz-Target", "").rpartition(".")[2]
                query_action = parse_qs(body.decode(errors="replace")).get("Action", [""])[0]
                text = body.decode(errors="replace") if target or query_action else ""
                path, _, query = self.path.partition("?")
                request = Request(self.command, path, target or query_action, text, query)
                fault = proxy._fault_for(request)
                if fault is not None:
                    time.sleep(fault.delay_s)
                if fault is not None and fault.kind == "reset":
                    self._reset()
                    return
                if fault is not None and fault.kind == "answer":
                    headers = [("Content-Type", "text/xml")]
                    self._reply(fault.status, headers, fault.body.encode())
                    return
                if fault is not None and fault.kind == "error":
                    error = f"<Error><Code>{fault.code}</Code><Message>injected</Message></Error>"
                    headers = [("Content-Type", "application/xml")]
                    self._reply(fault.status, headers, error.encode())
                    return
                self._forward(body)

            def _forward(self, body: bytes) -> None:
                upstream = http.client.HTTPConnection(proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body or None, headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    kept = [(k, v) for k, v in reply.getheaders() if k.lower() not in HOP_BY_HOP]
                    if self.command == "HEAD":  # no body: its length is the object's
                        kept.append(("Content-Length", reply.getheader("Content-Length", "0")))
                    self._reply(reply.status, kept, data)
                finally:
                    upstream.close()

            def _reset(self) -> None:
                # SO_LINGER 0: the close sends a TCP reset, as a dropped connection does.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                if not any(key == "Content-Length" for key, _ in headers):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

            def log_message(self, format: str, *args: object) -> None:
                pass

        with serve_http(Handler) as url:
            yield url


def input_download(request: Request) -> bool:
    """A download of an input `worker.demo.upload_samples` put under images/."""
    return request.method == "GET" and "/images/" in request.path
