"""S3 Inventory reports as a job's listing (`"inventory"`): what a report's manifest.json
says of its files, and how its rows are read (`worker.datasets.inputs` reads them)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from worker.message import PoisonMessage

MAX_INVENTORY_MANIFEST_BYTES = 16 * 2**20
# An S3 Inventory's columns that keep a row out: a delete marker, an older version (by
# their names in lower case without "_": a CSV's IsLatest is a Parquet file's is_latest).
INVENTORY_SKIPS = {"isdeletemarker": True, "islatest": False}
INVENTORY_COLUMNS = {"bucket", "key", *INVENTORY_SKIPS}
MAX_BUCKET_CHARS = 63
MAX_FLAG_BYTES = 16  # an inventory's "true" or "false"


class InventoryReport(NamedTuple):
    bucket: str  # where its files are
    file_format: str  # "csv" or "parquet"
    columns: list[str]
    files: list[str]


def inventory_report(uri: str, data: bytes) -> InventoryReport:
    """The parts of an S3 Inventory manifest.json this reader needs; poison if it is not
    one, or lists ORC files (not read)."""
    try:
        manifest = json.loads(data)
        file_format = str(manifest["fileFormat"]).lower()
        bucket = str(manifest["destinationBucket"]).removeprefix("arn:aws:s3:::")
        columns = [name.strip() for name in str(manifest["fileSchema"]).split(",")]
        files = [str(entry["key"]) for entry in manifest["files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise PoisonMessage(f"{uri} is not an S3 Inventory manifest: {error!r}") from error
    if file_format not in ("csv", "parquet"):
        raise PoisonMessage(
            f"{uri} is an inventory of {file_format} files: only CSV and Parquet are read"
        )
    return InventoryReport(bucket, file_format, columns, files)


def inventory_name(name: str) -> str:
    """An inventory's column name as the reader knows it: a CSV's IsLatest is a Parquet
    file's is_latest."""
    return name.lower().replace("_", "")


def inventory_columns(names: list[str]) -> list[str]:
    """The columns of an inventory's Parquet file that are read."""
    return [name for name in names if inventory_name(name) in INVENTORY_COLUMNS]


def truthy(value: Any) -> bool:
    """A CSV inventory's "true"/"false", or a Parquet one's booleans."""
    return value is True or (isinstance(value, str) and value.lower() == "true")
