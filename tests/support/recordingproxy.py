"""An HTTP proxy in front of the moto server that forwards every request and records
who sent it: its method, path, `User-Agent` (boto3's or obstore's) and the access key
its `Authorization` header was signed with. `FaultProxy` (`tests.support.faultproxy`)
can sit in front of it to answer some requests itself."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests.support.fakeaws import serve_http
from tests.support.faultproxy import HOP_BY_HOP

_ACCESS_KEY = re.compile(r"Credential=([^/]+)/")


@dataclass(frozen=True)
class Sent:
    """One request as it came: `path` is /bucket/key, unquoted."""

    method: str
    path: str
    user_agent: str
    access_key: str

    @property
    def by_boto3(self) -> bool:
        return "Boto3/" in self.user_agent


class RecordingProxy:
    def __init__(self, upstream: str):
        self._upstream = urlsplit(upstream).netloc
        self._sent: list[Sent] = []
        self._lock = threading.Lock()

    def sent(self, method: str = "GET", under: str = "/") -> list[Sent]:
        """Every `method` request so far whose path starts with `under`, in order."""
        with self._lock:
            return [s for s in self._sent if s.method == method and s.path.startswith(under)]

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Run the proxy on a free loopback port; yields its URL."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = _ACCESS_KEY.search(self.headers.get("Authorization", ""))
                sent = Sent(
                    self.command,
                    unquote(self.path.partition("?")[0]),
                    self.headers.get("User-Agent", ""),
                    key[1] if key else "",
                )
                with proxy._lock:
                    proxy._sent.append(sent)
                upstream = http.client.HTTPConnection(proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body or None, headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    self.send_response(reply.status)
                    for name, value in reply.getheaders():
                        if name.lower() not in HOP_BY_HOP:
                            self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

            def log_message(self, format: str, *args: object) -> None:
                pass

        with serve_http(Handler) as url:
            yield url
