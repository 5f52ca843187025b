"""Local stand-ins for the two machine-local AWS endpoints: the EC2 instance metadata
service (IMDSv2) and the ECS container agent's task-protection endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

IMDS_TOKEN = "fake-imds-token"


def metadata_time(epoch_s: float) -> str:
    """A time as instance metadata writes it: 2026-11-23T12:00:00Z."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextmanager
def serve_http(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a free loopback port; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class FakeImds:
    """IMDSv2: a token from PUT /latest/api/token, then metadata only with that token.
    `paths` may change while it serves (a notice appearing), and `token` too (the
    service restarted: tokens handed out before are refused); `token_requests` counts
    the tokens handed out."""

    def __init__(self, instance_id: str, group_name: str):
        self.paths = {
            "/latest/meta-data/instance-id": instance_id,
            "/latest/meta-data/tags/instance/aws:autoscaling:groupName": group_name,
        }
        self.token = IMDS_TOKEN
        self.token_requests = 0

    @contextmanager
    def serving(self) -> Iterator[str]:
        imds = self

        class Imds(_Handler):
            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                ):
                    imds.token_requests += 1
                    self._reply(200, imds.token.encode())
                else:
                    self._reply(400, b"")

            def do_GET(self) -> None:
                value = imds.paths.get(self.path)
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    self._reply(401, b"")  # IMDSv1 (no token) is refused, as on a hardened host
                elif value is None:
                    self._reply(404, b"")
                else:
                    self._reply(200, value.encode())

        with serve_http(Imds) as url:
            yield url


class FakeEcsAgent:
    """Records every task-protection state it is sent."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    @contextmanager
    def serving(self) -> Iterator[str]:
        agent = self

        class Agent(_Handler):
            def do_PUT(self) -> None:
                if self.path != "/task-protection/v1/state":
                    self._reply(404, b"")
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                agent.states.append(body)
                reply = {"protection": {"ProtectionEnabled": body["ProtectionEnabled"]}}
                self._reply(200, json.dumps(reply).encode())

        with serve_http(Agent) as url:
            yield url
