"""Turning the default model's class probabilities into result fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stages.synthetic import LABELS

DEFAULT_TOP_K = 3


def top_k(probabilities: Sequence[float], params: dict[str, Any]) -> dict[str, Any]:
    """The best label and the `params["top_k"]` best labels with their scores."""
    wanted = params.get("top_k", DEFAULT_TOP_K)
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise ValueError(f"params.top_k must be a positive integer, not {wanted!r}")
    ranked = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])[:wanted]
    topk = [
        {"label": LABELS[i], "class_id": i, "score": round(float(probabilities[i]), 6)}
        for i in ranked
    ]
    return {**topk[0], "topk": topk}
