"""`--compile`: the model compiled by `torch.compile` at the batch sizes it runs at,
each compiled and warmed up before the daemon receives anything and, on a GPU, captured
in a CUDA graph.

Why this shape (issue 38): on an H100, eager ResNet-50 in bf16 took 26 ms of the host's
time to launch a batch of 128 that kept the GPU busy 14.6 ms; compiled by inductor
(default mode, 14 s) and replayed from a CUDA graph at batch 256 it ran 22,700
images/s, against 11,680 eager, and eager with a CUDA graph 13,000. Inductor's own
CUDA graphs (mode "reduce-overhead") would capture the same, but keep their outputs
only until the next run and replay where they like; the graphs here are captured and
replayed on the inference process's compute stream, each size's output copied back
before the next replay (`Staging.outputs`). "max-autotune" would tune every
convolution at every size: minutes of start for a few percent.

The batch dimension is compiled once as a dynamic size (and once more for a batch of
one, which torch always specialises), so a start compiles twice, not once per size;
each size then gets a graph of its own. A batch of another size is run at the
smallest compiled size that holds it, the rest of it zeros, and the padding's outputs
dropped: a model whose rows depend on one another would answer differently (as it
would to error bisection's halves). A size that ran out of memory while compiling is
run eagerly, as the stage's out-of-memory recovery expects.

Batches of texts sized in tokens (`--max-batch-tokens`) come cut to a few lengths, each
at the sizes a batch of that length may have: the length is compiled as a dynamic size
too, and each (size, length) gets a graph of its own, reading its rows and columns of
the one static input. A batch of a length not compiled runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# Runs of each size on a side stream before its capture, as torch's CUDA graph notes
# advise (lazy initialisation, cuDNN's autotuning and the allocator's first blocks must
# not happen inside a capture).
WARM_RUNS = 2


def padded_size(count: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` that holds `count` items, or None if none does."""
    return min((size for size in sizes if size >= count), default=None)


@dataclass(frozen=True)
class CompileReport:
    """What compiling took: the sizes that ran out of memory (run eagerly), and the
    seconds spent compiling and capturing every size."""

    out_of_memory: list[int]
    seconds: float


# A batch's shape as compiled: its size, and the length it is cut to (None: uncut).
Shape = tuple[int, int | None]


class CompiledModel:
    """`forward` (a batch of `dtype` in, outputs out, on `device`) compiled at `sizes`, or,
    for batches cut to lengths (their last dimension), at the sizes given for each
    length: call `compile()` once, then call it as `forward` on any batch."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        item_shape: Sequence[int],
        sizes: Sequence[int] | Mapping[int, Sequence[int]],
        dtype: torch.dtype = torch.uint8,
    ):
        self._eager = forward
        with _compiler_warnings_ignored():
            self._compiled = torch.compile(forward)
        self._device = device
        self._cut = isinstance(sizes, Mapping)
        by_length = sizes if isinstance(sizes, Mapping) else {None: sizes}
        self._shapes: list[Shape] = sorted(
            {(size, length) for length, each in by_length.items() for size in each},
            key=lambda shape: (shape[0], shape[1] or 0),
            reverse=True,
        )
        # One static input for every shape (a graph reads from where it was captured).
        largest = max(size for size, _ in self._shapes)
        self._inputs = torch.zeros((largest, *item_shape), dtype=dtype, device=device)
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Shape, torch.Tensor] = {}
        self._ready: dict[int | None, list[int]] = {}

    @property
    def sizes(self) -> list[int]:
        """The sizes compiled and warmed up (at any length), smallest first."""
        return sorted({size for sizes in self._ready.values() for size in sizes})

    @property
    def graphed(self) -> bool:
        return bool(self._graphs)

    def compile(self) -> CompileReport:
        """Compile and warm up every size, largest first, each captured in a CUDA graph
        on a GPU; a size that runs out of memory is left to run eagerly."""
        import torch._dynamo as dynamo  # 1.6 s to import: only where a model is compiled

        # Every shape may be compiled on its own if the model pins the batch size.
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, len(self._shapes) + 1)
        started = time.perf_counter()
        out_of_memory = []
        pool = torch.cuda.graph_pool_handle() if self._device.type == "cuda" else None
        for shape in self._shapes:
            try:
                self._compile_shape(shape, pool, first=shape == self._shapes[0])
            except torch.OutOfMemoryError:
                out_of_memory.append(shape[0])
                if self._device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            self._ready.setdefault(shape[1], []).append(shape[0])
        for sizes in self._ready.values():
            sizes.sort()
        return CompileReport(
            sorted(set(out_of_memory), reverse=True), round(time.perf_counter() - started, 3)
        )

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        count = len(inputs)
        length = inputs.shape[-1] if self._cut else None
        size = padded_size(count, self._ready.get(length, []))
        if size is None:
            return self._eager(inputs)
        static = self._static((size, length))
        static[:count].copy_(inputs)
        if size > count:
            static[count:].zero_()
        graph = self._graphs.get((size, length))
        if graph is None:
            return self._compiled(static)[:count]
        graph.replay()
        return self._outputs[(size, length)][:count]

    def _static(self, shape: Shape) -> torch.Tensor:
        """The static input's rows and columns for a batch of this shape."""
        size, length = shape
        return self._inputs[:size] if length is None else self._inputs[:size, ..., :length]

    def _compile_shape(self, shape: Shape, pool: _POOL_HANDLE | None, *, first: bool) -> None:
        static = self._static(shape)
        if first:  # one compiled graph for every batch size (and length), not one each
            import torch._dynamo as dynamo

            dynamo.maybe_mark_dynamic(static, 0)
            if self._cut:
                dynamo.maybe_mark_dynamic(static, static.dim() - 1)
        with torch.inference_mode(), _compiler_warnings_ignored():
            self._compiled(static)
            if self._device.type != "cuda":
                return
            compute = torch.cuda.current_stream(self._device)
            side = torch.cuda.Stream(self._device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for _ in range(WARM_RUNS):
                    self._compiled(static)
            compute.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._compiled(static)
        self._graphs[shape], self._outputs[shape] = graph, output


@contextlib.contextmanager
def _compiler_warnings_ignored() -> Iterator[None]:
    """What torch's compiler warns of that is not the user's to act on: inductor's
    advice to allow TF32 for float32 matmuls (the precision is --precision's choice),
    and torch 2.13's deprecation of TorchScript, which importing inductor trips."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TensorFloat32 tensor cores", UserWarning)
        warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
        yield
