"""Where things are in the repository."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "infra" / "worker.yaml"  # the CloudFormation stack
