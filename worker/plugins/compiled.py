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
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
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


class CompiledModel:
    """`forward` (a batch of `dtype` in, outputs out, on `device`) compiled at `sizes`: call
    `compile()` once, then call it as `forward` on any batch."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        item_shape: Sequence[int],
        sizes: Sequence[int],
        dtype: torch.dtype = torch.uint8,
    ):
        self._eager = forward
        with _compiler_warnings_ignored():
            self._compiled = torch.compile(forward)
        self._device = device
        self._sizes = sorted(set(sizes), reverse=True)
        # One static input for every size (a graph reads from where it was captured).
        self._inputs = torch.zeros((self._sizes[0], *item_shape), dtype=dtype, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._ready: list[int] = []

    @property
    def sizes(self) -> list[int]:
        """The sizes compiled and warmed up, smallest first."""
        return list(self._ready)

    @property
    def graphed(self) -> bool:
        return bool(self._graphs)

    def compile(self) -> CompileReport:
        """Compile and warm up every size, largest first, each captured in a CUDA graph
        on a GPU; a size that runs out of memory is left to run eagerly."""
        import torch._dynamo as dynamo  # 1.6 s to import: only where a model is compiled

        # Every size may be compiled on its own if the model pins the batch size.
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, len(self._sizes) + 1)
        started = time.perf_counter()
        out_of_memory = []
        pool = torch.cuda.graph_pool_handle() if self._device.type == "cuda" else None
        for size in self._sizes:
            try:
                self._compile_size(size, pool, first=size == self._sizes[0])
            except torch.OutOfMemoryError:
                out_of_memory.append(size)
                if self._device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            self._ready.append(size)
        self._ready.sort()
        return CompileReport(out_of_memory, round(time.perf_counter() - started, 3))

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        count = len(inputs)
        size = padded_size(count, self._ready)
        if size is None:
            return self._eager(inputs)
        static = self._inputs[:size]
        static[:count].copy_(inputs)
        if size > count:
            static[count:].zero_()
        graph = self._graphs.get(size)
        if graph is None:
            return self._compiled(static)[:count]
        graph.replay()
        return self._outputs[size][:count]

    def _compile_size(self, size: int, pool: _POOL_HANDLE | None, *, first: bool) -> None:
        static = self._inputs[:size]
        if first:  # one compiled graph for every batch size, not one each
            import torch._dynamo as dynamo

            dynamo.maybe_mark_dynamic(static, 0)
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
        self._graphs[size], self._outputs[size] = graph, output


@contextlib.contextmanager
def _compiler_warnings_ignored() -> Iterator[None]:
    """What torch's compiler warns of that is not the user's to act on: inductor's
    advice to allow TF32 for float32 matmuls (the precision is --precision's choice),
    and torch 2.13's deprecation of TorchScript, which importing inductor trips."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TensorFloat32 tensor cores", UserWarning)
        warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
        yield
