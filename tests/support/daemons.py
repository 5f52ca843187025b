"""The daemon as a real subprocess (`python -m worker run ARGS`): started, watched
through its JSON log lines, stopped, and checked to leave no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.aws import Aws
from tests.support.paths import REPO
from worker.demo import Stack

ORPHAN_GRACE_S = 10.0


@dataclass
class DaemonRun:
    returncode: int
    stdout: str
    stderr: str


class DaemonProcess:
    """`python -m worker run ARGS` as a real subprocess in its own process group, with
    its JSON log lines collected as they come so a test can act on them. Its temporary
    files go to a directory of its own, removed when it is closed: a daemon killed
    leaves its process server's socket directory behind, and they piled up in /tmp."""

    def __init__(self, env: dict[str, str], args: list[str], cwd: Path = REPO):
        self._temporary = tempfile.mkdtemp(prefix="daemon-")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "worker", "run", *args],
                env={**env, "TMPDIR": self._temporary},
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self._temporary, ignore_errors=True)
            raise
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        # Parsed once as they come: a test polls for events every 50 ms, and a busy
        # daemon's thousands of lines parsed at each poll cost its neighbours CPU.
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._readers = [
            threading.Thread(target=self._collect, args=(name,), daemon=True)
            for name in self._lines
        ]
        for reader in self._readers:
            reader.start()

    def _collect(self, name: str) -> None:
        for line in getattr(self.process, name):
            self._lines[name].append(line)
            if name == "stdout":
                with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
                    event = json.loads(line)
                    self._events.setdefault(event.get("event"), []).append(event)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def temporary_directory(self) -> Path:
        """Where its temporary files go (its TMPDIR), until it is closed."""
        return Path(self._temporary)

    @property
    def stdout(self) -> str:
        return "".join(self._lines["stdout"])

    @property
    def stderr(self) -> str:
        return "".join(self._lines["stderr"])

    def events(self, name: str) -> list[dict[str, Any]]:
        """The daemon's log events called `name`, so far."""
        return list(self._events.get(name, []))

    def wait_for(self, name: str, count: int = 1, timeout_s: float = 120) -> list[dict[str, Any]]:
        """Wait until the daemon has logged `name` `count` times; its events."""
        deadline = time.monotonic() + timeout_s
        while len(events := self.events(name)) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                events_tail = "".join(self._lines["stdout"][-30:])
                raise AssertionError(
                    f"no {count} x {name}; last events:\n{events_tail}\n"
                    f"stderr:\n{self.stderr[-3000:]}"
                )
            time.sleep(0.05)
        return events

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """The daemon's exit status, and every line it wrote read (its events are then
        all there, its last ones too); on a time-out, an error that shows its last
        events."""
        try:
            status = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            tail = "".join(self._lines["stdout"][-40:])
            raise AssertionError(
                f"still running after {timeout_s} s; last events:\n{tail}"
            ) from None
        # The readers end at the pipes' end: once its children, which exit with it, let go.
        for reader in self._readers:
            reader.join(ORPHAN_GRACE_S)
        return status

    def close(self) -> list[str]:
        """Kill whatever is left; returns what was still running of the daemon's group."""
        leftovers: list[str] = []
        if self.process.poll() is not None:
            # Children notice their parent's death by themselves; give them a moment.
            deadline = time.monotonic() + ORPHAN_GRACE_S
            while (leftovers := processes_in_group(self.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        for reader in self._readers:
            reader.join(5)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        shutil.rmtree(self._temporary, ignore_errors=True)
        return leftovers


def processes_in_group(pgid: int) -> list[str]:
    """`ps`-style lines of the live (not zombie) processes in process group `pgid`."""
    found = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            stat = stat_path.read_text()
            state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(group) == pgid and state not in "ZX":
                found.append(stat[: stat.rindex(")") + 1])
    return found


StartDaemon = Callable[..., DaemonProcess]
"""The `start_daemon` fixture: `start(args, env=None)` starts a daemon; the fixture
checks, after the test, that none of its processes remain."""


def run_daemon(aws: Aws, args: list[str], timeout_s: float = 240) -> DaemonRun:
    """Run `python -m worker run ARGS` to completion; nothing of it may outlive it."""
    daemon = DaemonProcess(aws.env, args)
    try:
        returncode = daemon.wait(timeout_s)
    finally:
        leftovers = daemon.close()
    assert not leftovers, f"processes left behind: {leftovers}"
    return DaemonRun(returncode, daemon.stdout, daemon.stderr)


def daemon_args(stack: Stack, log_dir: Path, *more: str, dlq: bool = True) -> list[str]:
    """`run` flags for a daemon on the stack's queue (and its dead-letter queue, unless
    not `dlq`), receiving with a 1 s wait and keeping its logs in `log_dir`; then `more`."""
    dead_letters = ["--dlq-url", stack.dlq_url] if dlq else []
    return [
        "--queue-url",
        stack.queue_url,
        *dead_letters,
        "--receive-wait-seconds",
        "1",
        "--log-dir",
        str(log_dir),
        *more,
    ]


def slow_model_flags(batch_size: int) -> list[str]:
    """Flags for the model that sleeps SLOW_MODEL_SECONDS_PER_BATCH per batch."""
    return ["--model", "tests.support.slow_model:factory", "--batch-size", str(batch_size)]


def free_port() -> int:
    """A loopback port nothing listens on (for `--metrics-port`, or a closed endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET, an error status included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
