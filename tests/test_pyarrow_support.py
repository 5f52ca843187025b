"""The worker's pyarrow must keep a failed item's null row of an array field through a
Parquet file (24 and earlier cannot write one, 25 cannot read it back): a daemon on one
that cannot refuses to start, where it would fail every such job at its upload."""

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


def test_a_daemon_whose_pyarrow_cannot_read_a_null_array_row_back_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def as_pyarrow_25_reads(*_args: object, **_kwargs: object) -> pa.Table:
        raise pa.ArrowInvalid("Expected all lists to be of size=2 but index 1 had size=0")

    monkeypatch.setattr(pq, "read_table", as_pyarrow_25_reads)
    source = InMemoryJobSource()
    source.send('{"job_id": "j"}')
    daemon = Daemon(draining_settings(tmp_path), source, InMemoryBlobStore())
    with pytest.raises(CannotStart, match=r"pyarrow \S+ cannot keep .* needs pyarrow 26 or later"):
        daemon.run()
    assert source.counts().visible == 1  # nothing was received
