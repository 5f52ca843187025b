"""The pipeline engine: stages joined by bounded channels.

Generic on purpose: it moves `Item`s (a job key, an index, a value) through stage
functions and knows nothing of images, models, S3 or SQS.

- A `ThreadStage` runs a function on threads of this process (I/O-bound work).
- A `ProcessStage` runs it in child processes (CPU- or GPU-bound work). Each child is
  fed by one driver thread here, which waits on the child's pipe *and* its process
  sentinel, so a crash is seen the moment it happens, without polling. The child is
  restarted and the items it held are retried; a stage's other children, and other
  stages, are untouched (a dead CPU worker never reloads the model).
- Errors are data: an item whose function raised carries an `ItemError` and flows on to
  the end of the pipeline like any other; stages pass such items through untouched.
- A worker fault is not data: when every item of a call fails, the child runs its
  stage's probe (known-good input). If that fails too, the items are not blamed: the
  child is replaced and the call retried, and if the fresh child fails the same way the
  stage reports itself broken (`WorkerFault`). Items that kill or hang their child on
  every try are blamed only after a fresh child passes its probe.
- A process stage may `prepare` each item in its child before the function runs
  (fetch the input's bytes there, on threads of the child), so the bytes never cross a
  pipe and the work of getting them never holds this process's interpreter.
- Large values cross process boundaries through a `TensorArena`: preallocated shared
  memory whose slots one stage writes in place and a later stage reads, so only slot
  numbers travel through pipes. The daemon's process makes it without torch (a file of
  shared memory each child maps as a tensor): torch is imported by the children only.
- A fan-out stage turns each item into parts (an image into crops of what a detector
  found), each in a slot of another arena; later stages run the parts as items, and
  `Pipeline.next_results` puts each item back together from its parts, in order.

What runs where. In the daemon's process: `pipeline` (the stages and channels),
`stage` (thread stages, and what all stages share), `process_stage` (a process stage's
driver threads), `child_handle` (starting, feeding and replacing one child), `scaler`.
In each child process: `child_main`, and `child_arenas` (the arenas as tensors); in the
fork server they are forked from, `fork_server`, imported first. Between
them: `wire` (what crosses the pipe) and `arena` (what crosses through shared memory).
`items` is the data all of them move; `token_batches` chooses batches sized in tokens.
"""

from __future__ import annotations

from worker.engine.arena import SharedMemoryTooSmall, TensorArena
from worker.engine.channel import Channel, Closed
from worker.engine.child_handle import (
    WorkerDied,
    WorkerFailedProbe,
    WorkerHung,
    WorkerLost,
    host_oom_kills,
)
from worker.engine.items import (
    Item,
    ItemError,
    Part,
    PrepareStep,
    StageFunction,
    StageObserver,
    StageSetup,
    StageSetupError,
    StageSetupTimeout,
    bisection_sizes,
    isolate_failures,
    torch_class,
)
from worker.engine.pipeline import Pipeline
from worker.engine.process_stage import (
    MAX_ITEM_ATTEMPTS,
    OOM_COOLDOWN_S,
    PIPELINED_BATCHES,
    ProcessStage,
)
from worker.engine.scaler import WorkerScaler
from worker.engine.stage import ThreadStage
from worker.engine.token_batches import TokenBudget, bucket_lengths, bucket_of
from worker.engine.wire import PROBE

__all__ = [
    "MAX_ITEM_ATTEMPTS",
    "OOM_COOLDOWN_S",
    "PIPELINED_BATCHES",
    "PROBE",
    "Channel",
    "Closed",
    "Item",
    "ItemError",
    "Part",
    "Pipeline",
    "PrepareStep",
    "ProcessStage",
    "SharedMemoryTooSmall",
    "StageFunction",
    "StageObserver",
    "StageSetup",
    "StageSetupError",
    "StageSetupTimeout",
    "TensorArena",
    "ThreadStage",
    "TokenBudget",
    "WorkerDied",
    "WorkerFailedProbe",
    "WorkerHung",
    "WorkerLost",
    "WorkerScaler",
    "bisection_sizes",
    "bucket_lengths",
    "bucket_of",
    "host_oom_kills",
    "isolate_failures",
    "torch_class",
]
