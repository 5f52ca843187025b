"""An HTTP proxy in front of the moto server that counts requests and answers chosen
ones with errors.

The daemon talks to it as its AWS endpoint, so the faults are real HTTP 500s that
botocore sees, retries and finally raises, exactly as with a failing AWS endpoint.
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from tests.fakeaws import serve_http

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})
ERROR_BODY = b"<Error><Code>InternalError</Code><Message>injected fault</Message></Error>"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    action: str  # the API action: X-Amz-Target (JSON protocol) or Action= (query protocol)


@dataclass
class Fault:
    """Fail requests that `matches`, the first `times` per method and path (None: all)."""

    name: str
    matches: Callable[[Request], bool]
    times: int | None


class FaultProxy:
    def __init__(self, upstream: str):
        self._upstream = urlsplit(upstream).netloc
        self._faults: list[Fault] = []
        self._seen: Counter[tuple[str, str, str]] = Counter()
        self.injected: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()  # every request seen, by action
        self._lock = threading.Lock()

    def fail(self, name: str, matches: Callable[[Request], bool], times: int | None) -> None:
        self._faults.append(Fault(name, matches, times))

    def _fault_for(self, request: Request) -> str | None:
        with self._lock:
            self.actions[request.action] += 1
            for fault in self._faults:
                if not fault.matches(request):
                    continue
                key = (fault.name, request.method, request.path)
                self._seen[key] += 1
                if fault.times is None or self._seen[key] <= fault.times:
                    self.injected[fault.name] += 1
                    return fault.name
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
                request = Request(self.command, self.path.split("?")[0], target or query_action)
                if proxy._fault_for(request):
                    self._reply(500, [("Content-Type", "application/xml")], ERROR_BODY)
                    return
                upstream = http.client.HTTPConnection(proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body or None, headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    kept = [(k, v) for k, v in reply.getheaders() if k.lower() not in HOP_BY_HOP]
                    self._reply(reply.status, kept, data)
                finally:
                    upstream.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

            def log_message(self, format: str, *args: object) -> None:
                pass

        with serve_http(Handler) as url:
            yield url
