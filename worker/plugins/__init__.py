"""The plug-in contract: what the user's preprocessor, fan-out and postprocessor are.

The rest of the package: `loading` (references to objects, the model), `setups` (what
each stage's process runs at its start), `encoding` (a postprocessor's fields as
written), `fields` (what its array fields may be called, and their layouts),
`identity` (which model produced a result), `device_decoding` (`--decode gpu`) and
`spec` (a pipeline of models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the contract names tensors; a producer's client imports it without torch
    import torch

POSTPROCESS_STAGE = "postprocess"  # what an item error of the postprocessor names
PREPROCESS_STAGE = "preprocess"  # ... and of the preprocessor, wherever it ran


class PluginError(Exception):
    """A reference that does not name a usable object."""


class Preprocessor(Protocol):
    """Turns one input's bytes into a uint8 tensor of `output_shape`, written into `out`.

    It may also have `samples`: inputs it must always decode. The daemon decodes them at
    start (a missing codec stops it there) and whenever an input fails, to tell a broken
    worker from a bad input; without them, every failure is the input's.
    """

    @property
    def output_shape(self) -> tuple[int, ...]: ...

    def __call__(self, data: bytes, out: torch.Tensor) -> Any: ...


@runtime_checkable
class TextPreprocessor(Protocol):
    """Turns one input's text (a text input's, `worker.datasets.texts`) into token ids
    and their attention mask, written into `out`, an integer tensor of `output_shape`
    `(2, longest sequence)` and `output_dtype` (ids in row 0, the mask in row 1, padded
    with zeros), as the job's `params` ask; it returns its notes on the item, the fields
    `notes` names (whether the text was cut to fit: `{"truncated": true}`), which the
    item's result carries, or raises to refuse the text (its item's error).

    The model is then called with the two, `model(input_ids, attention_mask)`, batches of
    shape `(n, longest sequence)`: the sentence-transformers shape.
    """

    @property
    def output_shape(self) -> tuple[int, ...]: ...

    @property
    def output_dtype(self) -> torch.dtype: ...

    @property
    def notes(self) -> dict[str, Any]:
        """Each note with the value a result's probe carries (its field's type)."""

    def __call__(self, text: str, out: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class TokenSlots:
    """What the model's process knows of a `TextPreprocessor`'s slots: their dtype, and
    the notes each result carries (with the probe's values)."""

    dtype: torch.dtype
    notes: dict[str, Any]


@runtime_checkable
class DecodesOnDevice(Preprocessor, Protocol):
    """A preprocessor that can also decode some inputs in batches on the model's device
    (JPEGs with nvJPEG), for `--decode gpu`: the preprocessing processes leave those
    inputs' bytes in their arena slots, and the model's process decodes them there."""

    def device_decoding_unavailable(self) -> str | None:
        """Why it cannot decode on a device on this machine, or None."""

    def device_decodable(self, data: bytes) -> bool:
        """Whether this input is for the device (checked where it is fetched)."""

    def decode_on_device(
        self, encoded: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """Each input (a 1-D uint8 CPU tensor of its bytes) as a uint8 tensor of
        `output_shape` on `device`; raises if any of them cannot be."""


@dataclass(frozen=True, slots=True)
class Undecoded:
    """An item's payload when its slot holds its undecoded bytes, `length` of them, for
    the model's process to decode on its device."""

    length: int


class FanOut(Protocol):
    """Cuts one image into parts for the next model (`spec.FanOutStep`): writes each into
    one of `outs` (uint8 tensors of `output_shape`) and returns what each is about."""

    @property
    def output_shape(self) -> tuple[int, ...]: ...

    def __call__(
        self, image: torch.Tensor, found: Any, outs: Sequence[torch.Tensor]
    ) -> list[Any]: ...


Postprocessor = Callable[[Any, dict[str, Any]], dict[str, Any]]
InferenceFn = Callable[["torch.Tensor", Sequence[Any]], list[Any]]

# An item's value on its way to the model, with its job's params, which the
# postprocessor in the model's process is given: (payload, params), the payload being
# the input's URI, then its bytes, then what the preprocessor returned. A plain tuple:
# pickle writes it in C (a named tuple goes through Python code, 13 times slower), and
# it crosses a pipe three times per item.
WithParams = tuple[Any, dict[str, Any]]


def on_payload(fn: Callable[..., Any]) -> Callable[..., WithParams]:
    """`fn` applied to an item's payload, its params kept."""

    def apply(value: WithParams, *rest: Any) -> WithParams:
        payload, params = value
        return fn(payload, *rest), params

    return apply


def tokens_of(value: WithParams) -> int:
    """The tokens of a tokenized text's item (`worker.plugins.setups`): its size in a
    batch sized in tokens."""
    (_notes, tokens), _params = value
    return int(tokens)
