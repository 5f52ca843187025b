"""The array rows a checkpoint part saves beside its lines (`worker.jobs.checkpoints`),
read back from the job's output, where anyone who may write it may have written them."""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog

from worker.datasets.arrays import ARRAY_FILE_SUFFIX, ArrayFiles, read_npy
from worker.errors import MissingObject, ObjectTooLarge
from worker.message import JobMessage
from worker.ports import BlobStore

log = structlog.get_logger()


class PartRows:
    """The array rows a checkpoint part (`part`, its name less `.jsonl`) saved beside
    its lines: row n of its `<field>.npy` is line n's, read once a line refers to the
    field, within `room` bytes for all its fields; a file without a row for each line
    is none of the part's."""

    def __init__(
        self,
        blobs: BlobStore,
        spec: JobMessage,
        part: str,
        listing: dict[str, str],
        *,
        lines: int,
        room: int,
    ):
        self._blobs = blobs
        self._spec = spec
        self._part = part
        self._listing = listing
        self._lines = lines  # a field's rows are the part's only if there are as many
        self._room = room
        self._fields: dict[str, np.ndarray | None] = {}

    def resume(
        self, record: dict[str, Any], number: int, position: int, arrays: ArrayFiles
    ) -> bool:
        """Whether line `number`, `record`, of the item at `position`, can be resumed:
        it refers to no array rows, or its rows are in the part and written to `arrays`
        at `position` (where its references say they are)."""
        references = {
            name: reference.get("row")
            for name, reference in record.items()
            if isinstance(reference, dict) and reference.get("array") == name + ARRAY_FILE_SUFFIX
        }
        if not references:
            return True
        if any(type(row) is not int or row != position for row in references.values()):
            return False
        rows = {}
        for name in references:
            row = self._row(name, number)
            if row is None:
                return False
            rows[name] = row
        try:
            arrays.write(position, rows)  # checked against the job's layouts as any row
        except (ValueError, OSError) as error:
            log.warning("checkpoint_rows_skipped", part=self._part, error=str(error))
            return False
        return True

    def _row(self, name: str, number: int) -> np.ndarray | None:
        if name not in self._fields:
            self._fields[name] = self._read(f"{self._part}.{name}{ARRAY_FILE_SUFFIX}")
        rows = self._fields[name]
        return None if rows is None else rows[number]

    def _read(self, name: str) -> np.ndarray | None:
        if name not in self._listing:
            return None
        try:
            data = self._blobs.get(self._spec.output_location(name), self._room)
            rows = read_npy(data)
            if rows.ndim == 0 or len(rows) != self._lines:
                raise ValueError(f"{rows.shape} rows for the part's {self._lines} lines")
        except (MissingObject, ObjectTooLarge, ValueError) as error:
            log.warning("checkpoint_part_skipped", name=name, error=str(error))
            return None
        self._room -= len(data)
        return rows
