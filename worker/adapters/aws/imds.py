"""EC2 instance metadata (IMDSv2): which instance this is, and interruption notices."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime

import structlog

from worker.ports import Notice, NoticeKind

log = structlog.get_logger()

IMDS_DEFAULT_ENDPOINT = "http://169.254.169.254"
IMDS_TOKEN_TTL_S = 60
IMDS_TOKEN_MARGIN_S = 10
IMDS_TIMEOUT_S = 2.0
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
SPOT_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
TARGET_LIFECYCLE_STATE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
REBALANCE_RECOMMENDATION_PATH = "/latest/meta-data/events/recommendations/rebalance"
ASG_NAME_PATH = "/latest/meta-data/tags/instance/aws:autoscaling:groupName"


class Imds:
    """The instance metadata service, IMDSv2: a session token first, reused until
    shortly before it expires."""

    def __init__(self, endpoint: str | None = None, clock: Callable[[], float] = time.monotonic):
        base = endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or ""
        self._base = base.rstrip("/") or IMDS_DEFAULT_ENDPOINT
        self._clock = clock
        self._token = ""
        self._token_until = float("-inf")

    def read(self, path: str) -> str | None:
        """The value at `path`, or None where the service has none (404)."""
        request = urllib.request.Request(
            self._base + path, headers={"X-aws-ec2-metadata-token": self._session_token()}
        )
        try:
            with urllib.request.urlopen(request, timeout=IMDS_TIMEOUT_S) as reply:
                return reply.read().decode()  # type: ignore[no-any-return]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            if error.code == 401:  # the token expired early (the service restarted)
                self._token_until = float("-inf")
            raise

    def get(self, path: str) -> str:
        """The value at `path`; raises `OSError` where there is none."""
        value = self.read(path)
        if value is None:
            raise FileNotFoundError(f"instance metadata has no {path}")
        return value

    def _session_token(self) -> str:
        if self._clock() < self._token_until:
            return self._token
        request = urllib.request.Request(
            self._base + "/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=IMDS_TIMEOUT_S) as reply:
            self._token = reply.read().decode()
        self._token_until = self._clock() + IMDS_TOKEN_TTL_S - IMDS_TOKEN_MARGIN_S
        return self._token


class ImdsNotices:
    """Interruption notices as EC2 publishes them in instance metadata: a spot
    interruption (with the time the instance goes), an Auto Scaling termination (where a
    lifecycle hook holds the instance until it is told to continue), and a rebalance
    recommendation."""

    def __init__(self, imds: Imds, lifecycle_hook: Callable[[], None] | None = None):
        self._imds = imds
        self._lifecycle_hook = lifecycle_hook

    def poll(self) -> Notice | None:
        action = self._imds.read(SPOT_INSTANCE_ACTION_PATH)
        if action is not None:  # {"action": "terminate" | "stop" | "hibernate", "time": ...}
            return Notice(NoticeKind.TERMINATION, "spot-interruption", _spot_deadline(action))
        if self._imds.read(TARGET_LIFECYCLE_STATE_PATH) == "Terminated":
            return Notice(NoticeKind.TERMINATION, "scale-in", acknowledge=self._lifecycle_hook)
        if self._imds.read(REBALANCE_RECOMMENDATION_PATH) is not None:
            return Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
        return None


def _spot_deadline(action: str) -> float | None:
    """When a spot notice says the instance goes; None (the grace period then) for a
    notice that cannot be read, which is still a notice."""
    try:
        return datetime.fromisoformat(json.loads(action)["time"]).timestamp()
    except (ValueError, KeyError, TypeError) as error:
        log.error("spot_notice_unreadable", notice=action[:200], error=repr(error))
        return None
