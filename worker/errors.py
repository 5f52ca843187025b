"""The daemon's small error tree, classified once where an error is raised.

- `TransientError`: the surroundings failed for now (throttling, 5xx, a timeout, a reset
  connection, a short read). Retried with backoff; a job that cannot get past it is
  released to run again later, never finished with the error in its results.
- `MissingObject`, `AccessDenied`, `ObjectTooLarge`: permanent for that object. For an
  input this is the item's own error record; for a manifest the message is poison.
- `PreconditionFailed`: a conditional write found the object changed since it was read:
  another attempt at the same job wrote it first, so this one is fenced off.
- `WorkerFault`: the worker itself is broken (a stage fails for everything, known-good
  input included). Never an item's error: the daemon stops and hands its jobs back.
- `CannotStart`: a resource the daemon takes at start cannot be had (its metrics port,
  its log directory): it exits 2 saying which, and the setting that names it.

Anything else raised by stage code about one input is that input's error.
"""

from __future__ import annotations


class TransientError(Exception):
    """Worth retrying later: nothing is wrong with the request itself."""


class MissingObject(LookupError):
    """The object (or its bucket) does not exist: retrying will not help."""


class AccessDenied(PermissionError):
    """Reading or writing the object is not allowed (S3 also says this for a missing key
    when the caller may not list the bucket): retrying will not help."""


class ObjectTooLarge(ValueError):
    """The object is bigger than the reader takes (`--max-input-bytes`, a manifest's
    limit): it was not read past the limit. `size` is None where the store did not say."""

    def __init__(self, size: int | None, limit: int):
        super().__init__(
            f"too large: {f'over {limit}' if size is None else size} bytes, limit {limit}"
        )
        self.size, self.limit = size, limit

    def __reduce__(self) -> tuple[type[ObjectTooLarge], tuple[int | None, int]]:
        return type(self), (self.size, self.limit)


class MessageRefused(ValueError):
    """The queue refused a message for what it holds (a sender's fault: characters it
    does not take, a size over its limit): sending it again will not help."""


class PreconditionFailed(Exception):
    """A conditional write did not happen: the object is no longer as this writer saw it."""


class WorkerFault(Exception):
    """A stage of this worker fails on known-good input: the worker, not the data, is
    broken."""


class CannotStart(Exception):
    """What the daemon takes at start cannot be had; the message names it and the
    setting that chose it."""
