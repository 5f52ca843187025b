"""What a postprocessor's array fields may be called, and what each is (its layout):
the output files and Parquet columns they become are named and typed by these, on the
daemon's side and on a producer's (`worker.client`), which has no torch to import."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

# It names a file under the job's output, where names starting "checkpoint-" are the
# checkpoints' (`worker.jobs.checkpoints`), removed once the job is finished.
_FIELD_NAME = re.compile(r"^(?!checkpoint-)[A-Za-z0-9_-]{1,100}$")


def check_field_name(field: object) -> str:
    """The array field's name, if it can name its file; ValueError if not."""
    if not isinstance(field, str) or not _FIELD_NAME.match(field):
        raise ValueError(
            f"the array field {field!r} cannot name a file: use letters, digits, _ and -, "
            "not starting checkpoint-"
        )
    return field


ArrayLayout = tuple[np.dtype[Any], tuple[int, ...]]
ArrayLayouts = Mapping[str, ArrayLayout]


def array_layouts(arrays: Mapping[str, np.ndarray]) -> dict[str, ArrayLayout]:
    return {field: (array.dtype, array.shape) for field, array in arrays.items()}
