"""Whether the installed pyarrow can keep what Parquet results hold, checked at start.

A failed item's row of an array field is a null fixed-size list (`worker.datasets.tables`).
No pyarrow before 26 keeps one through Parquet: 24 and earlier refuse to write one
between other rows, and write one at the end into a file they cannot read back ("Expected
all lists to be of size=64 but index 2 had size=0"), as 25 does wherever it is. Each job
whose results hold one would fail at its upload or merge, be handed back and fail again
(26 reads what the others wrote, so such a job ends once its workers have 26). A worker
installed from its package has 26 or later; one put together by hand (a GPU image's own
pyarrow on `PYTHONPATH`) is told so at start instead.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from worker.errors import CannotStart


def check_pyarrow() -> None:
    """`CannotStart`, naming the version, unless a null fixed-size list makes the trip
    through a Parquet file and back."""
    rows = pa.FixedSizeListArray.from_arrays(
        pa.array([0.0, 0.0], pa.float32()), 2, mask=pa.array([True])
    )
    sink = io.BytesIO()
    try:
        pq.write_table(pa.table({"embedding": rows}), sink)
        read = pq.read_table(io.BytesIO(sink.getvalue())).column("embedding").to_pylist()
        failure = None if read == [None] else f"it read back {read}"
    except pa.ArrowException as error:
        failure = f"{type(error).__name__}: {error}"
    if failure is not None:
        raise CannotStart(
            f"pyarrow {pa.__version__} cannot keep a failed item's row of an array field in "
            f"Parquet results ({failure}); the worker needs pyarrow 26 or later "
            "(pip install 'pyarrow>=26')"
        )
