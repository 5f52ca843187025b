"""Array outputs: a postprocessor's field whose value is an array (an embedding, a mask)
lands in `<field>.npy` under the job's output, one row per input in input order, and the
item's results.jsonl line says where: `"embedding":{"array":"embedding.npy","row":17}`.

Rows are written as they come into a local file per field, a memory-mapped .npy, so a
job's arrays are never held in memory; the finisher uploads the files beside
results.jsonl. The row of an input that failed, or whose array the job's file could not
take, is zeros, and its line has no reference to it.
"""

from __future__ import annotations

import fcntl
import io
import math
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np

from worker.plugins.fields import ArrayLayout, ArrayLayouts, check_field_name

ARRAY_FILE_SUFFIX = ".npy"
NPY_CONTENT_TYPE = "application/x-npy"
# The longest header of an .npy file of version 1.0, which numpy writes for any array of
# numbers whose description fits it (`npy_bytes`).
NPY_HEADER_MOST = 10 + 2**16
# The most an input's arrays take, all fields together: a row over it is the input's
# error (a checkpoint part holds at least a row, and is read within a bound).
MAX_ROW_BYTES = 64 * 2**20
ARRAYS_DIR = "arrays"  # under --log-dir
SPOOL_LOCK = ".lock"  # in each daemon's directory there, held while it runs


class ArraySpool:
    """A daemon's directory for array files under `root` (`--log-dir`/arrays), held
    under a lock while the daemon runs. Made by `open`, after removing the directories
    of daemons that are gone (their lock free): what a killed daemon left, which nothing
    reads again (a job's next delivery takes its checkpointed rows from S3). A daemon sharing the
    log directory keeps its own."""

    def __init__(self, root: Path):
        self._root = root
        self._lock: IO[str] | None = None
        self._directory: Path | None = None
        # The rows' layouts, once the model's process has probed its postprocessor.
        self.layouts: ArrayLayouts | None = None

    @property
    def directory(self) -> Path:
        assert self._directory is not None, "the spool is not open"
        return self._directory

    def open(self) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        for directory in self._root.iterdir():
            if directory.is_dir():
                _remove_if_unlocked(directory)
        self._directory = Path(tempfile.mkdtemp(dir=self._root))
        self._lock = open(self._directory / SPOOL_LOCK, "w")  # noqa: SIM115 (held while open)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self) -> None:
        """Remove the spool (the daemon is done: every job it held is settled)."""
        if self._lock is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._lock.close()
            self._lock = None


def _remove_if_unlocked(directory: Path) -> None:
    """Remove a daemon's spool once no live daemon holds its lock (one without a lock
    file is one whose daemon died making it, or is making it now: left alone)."""
    try:
        lock = open(directory / SPOOL_LOCK)  # noqa: SIM115 (closed below)
    except OSError:
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # its daemon lives
        shutil.rmtree(directory, ignore_errors=True)


# A field's row: its dtype and shape, as the postprocessor's answer to the model's
# output for zeros gave them at start (`about["arrays"]`).
class ArrayFiles:
    """One job's array files, in `directory`: a file per field, `rows` rows each, each
    row of the field's `layouts` (where they are not known, a chain's, of its first row),
    float arrays as `floats` where given (float16).
    A row's disk blocks are taken as it is written, not the whole file's up front."""

    def __init__(
        self,
        directory: Path,
        rows: int,
        layouts: ArrayLayouts | None = None,
        floats: str | None = None,
    ):
        self.directory = directory  # the job's own: its Parquet files are written here too
        self._rows = rows
        self._layouts = layouts
        # What float arrays are stored as, where the job asks (`JobMessage.array_floats`).
        self._floats = np.dtype(floats) if floats else None
        self._files: dict[str, _ArrayFile] = {}
        self._lock = threading.Lock()  # `remove` comes from whichever thread settles the job
        self._removed = False

    def write(self, row: int, arrays: dict[str, np.ndarray]) -> bytes:
        """Put each field's array in row `row` of the field's file; the references to
        them, JSON-encoded as members of the item's line. ValueError, and nothing
        written, if a field cannot name a file, is not one of the layouts', its array
        does not fit the file, or the arrays take over MAX_ROW_BYTES."""
        with self._lock:
            if self._removed:  # the job was settled meanwhile: nothing will read them
                return b""
            files = []
            row_bytes = sum(array.nbytes for array in arrays.values())
            if row_bytes > MAX_ROW_BYTES:
                raise ValueError(
                    f"its arrays take {row_bytes} bytes, over the {MAX_ROW_BYTES} an input's "
                    "may take"
                )
            for field, given in arrays.items():
                array = self._stored(field, given)
                file = self._files.get(field)
                dtype, shape = file.layout if file else self._layout(field, array)
                if array.shape != shape or array.dtype != dtype:
                    raise ValueError(
                        f"the {field} array is {array.dtype}{list(array.shape)}, where "
                        f"this job's {field}{ARRAY_FILE_SUFFIX} takes {dtype}{list(shape)}"
                    )
                files.append((file or self._open(field, dtype, shape), array))
            for file, array in files:
                file.put(row, array)
        return b"".join(
            b',"%s":{"array":"%s%s","row":%d}'
            % (field.encode(), field.encode(), ARRAY_FILE_SUFFIX.encode(), row)
            for field in arrays
        )

    def _stored(self, field: str, array: np.ndarray) -> np.ndarray:
        """The array as its file holds it: a float one as `floats`, where given; a value
        beyond their range is the item's error, not an infinity in its results."""
        if self._floats is None or array.dtype.kind != "f":
            return array
        with np.errstate(over="ignore"):
            stored = array.astype(self._floats)
        if not np.isfinite(stored).all() and np.isfinite(array).all():
            raise ValueError(f"the {field} array holds values beyond {self._floats}'s range")
        return stored

    def _layout(self, field: str, first: np.ndarray) -> ArrayLayout:
        """The dtype and shape of a field's rows: the probe's, or (unprobed) its first row's."""
        check_field_name(field)
        if self._layouts is None:
            dtype, shape = first.dtype, first.shape
        elif field in self._layouts:
            dtype, shape = self._layouts[field]
        else:
            raise ValueError(
                f"the postprocessor gave no {field} array for the model's answer to zeros "
                "at start: each input must get the same array fields"
            )
        if dtype.hasobject:
            raise ValueError(f"the {field} array holds Python objects, not numbers")
        if self._floats is not None and dtype.kind == "f":
            dtype = self._floats
        return dtype, shape

    def _open(self, field: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> _ArrayFile:
        # Not its parents: a spool removed (the daemon stopped) is not made again.
        self.directory.mkdir(exist_ok=True)
        file = _ArrayFile(self.directory / f"{field}{ARRAY_FILE_SUFFIX}", dtype, shape, self._rows)
        self._files[field] = file
        return file

    def rows(self, indices: list[int]) -> dict[str, np.ndarray] | None:
        """Each field's rows `indices`, copied (for a checkpoint; a row not written is
        zeros); None once the files are removed."""
        with self._lock:
            if self._removed:
                return None
            return {field: np.array(file.rows[indices]) for field, file in self._files.items()}

    def rows_within(self, most_bytes: int) -> int | None:
        """How many rows of the fields opened so far fit in `most_bytes` as .npy files
        (`rows`, then `npy_bytes`), a file per field; at least one, if any field has rows;
        None, if there are no fields yet."""
        with self._lock:
            row_bytes = sum(file.row_bytes for file in self._files.values())
            if not row_bytes:
                return None
            return max(1, (most_bytes - NPY_HEADER_MOST * len(self._files)) // row_bytes)

    def files(self) -> dict[str, Path]:
        """Each file's output name and local path, written through to disk."""
        with self._lock:
            for file in self._files.values():
                file.rows.flush()
            return {
                f"{field}{ARRAY_FILE_SUFFIX}": self.directory / f"{field}{ARRAY_FILE_SUFFIX}"
                for field in self._files
            }

    def remove(self) -> None:
        """Delete the files (the job is settled); later writes are dropped."""
        with self._lock:
            self._removed = True
            self._files.clear()
            shutil.rmtree(self.directory, ignore_errors=True)


class _ArrayFile:
    """A memory-mapped .npy of `rows` rows, sparse until rows are put in it."""

    def __init__(self, path: Path, dtype: np.dtype[Any], shape: tuple[int, ...], rows: int):
        self.path = path
        self.rows: np.memmap = np.lib.format.open_memmap(
            path, mode="w+", dtype=dtype, shape=(rows, *shape)
        )
        self.row_bytes = dtype.itemsize * math.prod(shape)

    @property
    def layout(self) -> ArrayLayout:
        return self.rows.dtype, self.rows.shape[1:]

    def put(self, row: int, array: np.ndarray) -> None:
        # The row's blocks are taken first: on a full disk this is an OSError here, not
        # a SIGBUS when its page is written back. (Linux; macOS, for local runs, has no
        # posix_fallocate.)
        if self.row_bytes and hasattr(os, "posix_fallocate"):
            descriptor = os.open(self.path, os.O_RDWR)
            try:
                offset = self.rows.offset + row * self.row_bytes
                os.posix_fallocate(descriptor, offset, self.row_bytes)
            finally:
                os.close(descriptor)
        self.rows[row] = array


def npy_bytes(array: np.ndarray) -> bytes:
    """`array` as an .npy file's bytes."""
    stream = io.BytesIO()
    np.lib.format.write_array(stream, array, allow_pickle=False)
    return stream.getvalue()


def read_npy(data: bytes) -> np.ndarray:
    """The array of an .npy file's bytes that anyone may have written: ValueError for
    anything but a whole .npy of numbers, read without allocating more than `data`
    holds (numpy's own reader allocates what the header claims)."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"an .npy file of version {version}, not 1.0 or 2.0")
    if dtype.hasobject:
        raise ValueError("an .npy file of Python objects, not numbers")
    if not all(type(size) is int and size >= 0 for size in shape):
        raise ValueError(f"an .npy file of shape {shape}")
    body = memoryview(data)[stream.tell() :]
    if len(body) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"an .npy file of {len(body)} bytes past its header, not its {shape}'s")
    return np.frombuffer(body, dtype).reshape(shape, order="F" if fortran_order else "C")
