"""The worker's pyarrow must keep a failed item's null row of an array field through a
Parquet file (none before 26 reads one back): a daemon on one that cannot refuses to
start, where it would fail every such job at its upload."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.in_process import draining_settings
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.wiring import Daemon
from worker.datasets.pyarrow_support import check_pyarrow
from worker.errors import CannotStart


def test_the_installed_pyarrow_keeps_a_null_array_row_through_parquet() -> None:
    check_pyarrow()


@pytest.mark.parametrize(
    ("step", "failure"),
    [  # what pyarrow 24 and 25 do
        ("write_table", pa.ArrowNotImplementedError("Lists with non-zero length null components")),
        ("read_table", pa.ArrowInvalid("Expected all lists to be of size=2 but index 1 had ...")),
    ],
)
def test_a_daemon_whose_pyarrow_cannot_keep_a_null_array_row_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, failure: pa.ArrowException
) -> None:
    def as_an_earlier_pyarrow(*_args: object, **_kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(pq, step, as_an_earlier_pyarrow)
    source = InMemoryJobSource()
    source.send('{"job_id": "j"}')
    with pytest.raises(CannotStart, match=r"pyarrow \S+ cannot keep .* needs pyarrow 26 or later"):
        Daemon(draining_settings(tmp_path), source, InMemoryBlobStore()).run()
    assert source.counts().visible == 1  # nothing was received
