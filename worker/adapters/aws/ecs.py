"""ECS: task scale-in protection through the container agent."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

ECS_AGENT_TIMEOUT_S = 5.0


class EcsGuard:
    """ECS task scale-in protection through the container agent's endpoint."""

    name = "ecs"

    def __init__(self, agent_uri: str, expires_minutes: int):
        self._url = agent_uri.rstrip("/") + "/task-protection/v1/state"
        self._expires_minutes = expires_minutes
        # Renew at half the expiry, so one failed renewal still leaves it on.
        self.renew_every_s: float | None = expires_minutes * 60 / 2

    def set_protected(self, protected: bool) -> None:
        body: dict[str, Any] = {"ProtectionEnabled": protected}
        if protected:
            body["ExpiresInMinutes"] = self._expires_minutes
        request = urllib.request.Request(
            self._url,
            data=json.dumps(body).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=ECS_AGENT_TIMEOUT_S) as reply:
            answer = json.loads(reply.read() or b"{}")
        if answer.get("failure") or answer.get("error"):
            raise RuntimeError(f"ECS agent refused task protection: {answer}")

    def take_out_of_service(self) -> str:
        return "the task exits, and the ECS service starts another"
