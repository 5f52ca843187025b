"""Turning a model's output for one input into its result fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stages.synthetic import LABELS

DEFAULT_TOP_K = 3


def top_k(probabilities: np.ndarray | Sequence[float], params: dict[str, Any]) -> dict[str, Any]:
    """The best label and the `params["top_k"]` best labels with their scores."""
    wanted = params.get("top_k", DEFAULT_TOP_K)
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise ValueError(f"params.top_k must be a positive integer, not {wanted!r}")
    scores = np.asarray(probabilities)
    ranked = np.argsort(-scores, kind="stable")[:wanted]  # ties in class order
    topk = [
        {"label": LABELS[i], "class_id": int(i), "score": round(float(scores[i]), 6)}
        for i in ranked
    ]
    return {**topk[0], "topk": topk}


def embedding(output: np.ndarray, _params: dict[str, Any]) -> dict[str, Any]:
    """The model's whole output for the input, as an array: it lands in embedding.npy
    under the job's output, and the input's line says which row (`worker.datasets.arrays`)."""
    return {"embedding": output}
