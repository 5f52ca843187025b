"""Which model produced a result: the identity every results line and job.json names."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.plugins.encoding import encode_json
from worker.plugins.loading import EXPORT_SUFFIX, TORCHSCRIPT_SUFFIXES
from worker.plugins.spec import PipelineSpec

if TYPE_CHECKING:  # a model's identity is taken in its stage's process, which has torch
    import torch


@dataclass(frozen=True)
class ModelIdentity:
    """Which model produced a result: a name and a version people choose, and the
    sha256 of what was loaded (the model file, or the module's state dict), which
    changes whenever the weights do even if nobody bumped the version."""

    name: str
    version: str
    digest: str
    steps: tuple[ModelIdentity, ...] = ()  # a chain's models, in order

    @functools.cached_property
    def label(self) -> str:
        """`name@version`, on every line of results.jsonl: made once, not per item."""
        return f"{self.name}@{self.version}"

    @functools.cached_property
    def encoded_label(self) -> bytes:
        return encode_json(self.label)

    def labels(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "digest": self.digest}

    def as_dict(self) -> dict[str, Any]:
        """What job.json records: the labels, and a chain's models."""
        if not self.steps:
            return self.labels()
        return {**self.labels(), "steps": [step.as_dict() for step in self.steps]}


def pipeline_identity(spec: PipelineSpec, models: Sequence[ModelIdentity]) -> ModelIdentity:
    """What produced a pipeline's results: its one model, or for a chain its name and
    version and a digest over its models' digests and the steps around them, which
    change the results as much as the weights do."""
    if len(models) == 1 and spec.fan_out is None:
        return models[0]
    fan_out = spec.fan_out
    around = [spec.preprocess, spec.postprocess, fan_out.fan_out if fan_out else None]
    cut = fan_out.max_parts if fan_out else None
    made_of = json.dumps([around, cut, [model.digest for model in models]])
    digest = hashlib.sha256(made_of.encode()).hexdigest()
    return ModelIdentity(
        name=spec.name or "pipeline",
        version=spec.version or digest[:12],
        digest=f"sha256:{digest}",
        steps=tuple(models),
    )


def identify(
    reference: str, model: torch.nn.Module, name: str | None, version: str | None
) -> ModelIdentity:
    """The model's identity: the name and version given, else the module's own
    `model_name` / `model_version` attributes, else the file's name or the factory's
    reference and the digest's first 12 digits."""
    if reference.endswith((EXPORT_SUFFIX, *TORCHSCRIPT_SUFFIXES)):
        with open(reference, "rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        default_name = Path(reference).name
    else:
        digest = _state_digest(model)
        default_name = reference
    return ModelIdentity(
        name=name or getattr(model, "model_name", None) or default_name,
        version=version or getattr(model, "model_version", None) or digest[:12],
        digest=f"sha256:{digest}",
    )


def _state_digest(model: torch.nn.Module) -> str:
    """sha256 over the state dict's names, dtypes, shapes and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
