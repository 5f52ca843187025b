"""A postprocessor's fields as they are written: JSON on the item's results.jsonl line,
and its array fields apart (`worker.datasets.arrays`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import orjson

from worker.engine import ItemError, torch_class
from worker.plugins import POSTPROCESS_STAGE, Postprocessor
from worker.plugins.fields import ArrayLayout, array_layouts, check_field_name

if TYPE_CHECKING:  # a chain's postprocessor runs in the daemon's process, without torch
    import torch

# numpy scalars (and 0-d arrays) as numbers; non-str keys as strings, as `json` does.
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
# results.jsonl's own fields on every line (`id` where a job's table gives ids); a
# postprocessor's fields go between them.
RECORD_FIELDS = frozenset({"index", "input", "member", "id", "model", "error"})


# What the model's process sends for an item: its fields, JSON-encoded (`encoded_fields`),
# and with them its array fields, if it has any.
Encoded = bytes | tuple[bytes, dict[str, np.ndarray]]


def probed_columns(answer: Encoded) -> tuple[bytes, dict[str, ArrayLayout]]:
    """A postprocessor's answer to its probe as what it tells of every answer: its
    fields as a JSON object (their types: Parquet results' columns), its arrays' layouts."""
    fields, arrays = answer if isinstance(answer, tuple) else (answer, {})
    return b"{" + fields[1:] + b"}", array_layouts(arrays)


def encoded_fields(
    postprocess: Postprocessor,
    output: Any,
    params: dict[str, Any],
    notes: dict[str, Any] | None = None,
) -> Encoded:
    """The postprocessor's fields for one model output (and a text preprocessor's
    `notes` on its input after them), JSON-encoded as the members that follow `input` in
    the item's results.jsonl line (`,"label":"cat",...`); those whose value is an array
    (numpy or torch, not a scalar) apart, as arrays (`worker.datasets.arrays`)."""
    fields = postprocess(output, params)
    if not isinstance(fields, dict):
        raise TypeError(f"the postprocessor returned a {type(fields).__name__}, not a dict")
    if notes:
        fields = {**fields, **notes}
    clash = RECORD_FIELDS.intersection(fields)
    if clash:
        raise ValueError(
            f"the postprocessor returned {', '.join(sorted(clash))}: results.jsonl's own "
            "fields on every line"
        )
    arrays = {
        check_field_name(name): _as_numpy(value)
        for name, value in fields.items()
        if _is_array(value) and value.ndim > 0
    }
    if arrays:
        fields = {name: value for name, value in fields.items() if name not in arrays}
    encoded = b"," + encode_json(fields)[1:-1] if fields else b""
    return (encoded, arrays) if arrays else encoded


def encode_json(value: Any) -> bytes:
    """Compact JSON, numpy scalars as numbers (orjson: twelve times the speed of the
    standard library's encoder, which cost the inference process more per item than
    the default postprocessor itself)."""
    return orjson.dumps(value, default=_scalar, option=JSON_OPTIONS)


def _as_numpy(array: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if str(array.dtype) == "torch.bfloat16":  # numpy has no bfloat16
        array = array.float()
    return array.detach().cpu().numpy()


def _scalar(value: Any) -> Any:
    """A torch scalar as the Python number JSON can encode (orjson's `default`; it
    encodes numpy's itself)."""
    if _is_array(value) and value.ndim == 0:
        return value.item()
    raise TypeError(f"a {type(value).__name__} is not JSON serializable")


def _is_array(value: Any) -> TypeGuard[np.ndarray | torch.Tensor]:
    """A numpy array, or a tensor (in a process that has imported torch: the daemon's,
    running a chain's postprocessor, may not have)."""
    return isinstance(value, (np.ndarray, torch_class("Tensor", np.ndarray)))


def postprocessed(
    postprocess: Postprocessor,
    output: Any,
    params: dict[str, Any],
    notes: dict[str, Any] | None = None,
) -> Encoded | ItemError:
    """One output's encoded fields, or why the postprocessor failed on it."""
    try:
        return encoded_fields(postprocess, output, params, notes)
    except Exception as error:
        return ItemError.from_exception(error, POSTPROCESS_STAGE)


def chain_postprocess_fault(postprocess: Postprocessor) -> str | None:
    """Why a chain's postprocessor fails known-good input (the parts of an input its
    fan-out found nothing in, with no params), or None: it tells a broken worker from
    bad inputs, as a model's probe does."""
    outcome = postprocessed(postprocess, [], {})
    return f"{outcome.type}: {outcome.message}" if isinstance(outcome, ItemError) else None
