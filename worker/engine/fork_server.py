"""The first module the stage processes' fork server preloads (`FORKSERVER_PRELOAD`;
`worker.engine`'s own imports run before it): its garbage collector off while it
imports torch and the rest. What it imports lives as long
as it does, and each full collection walked all of it so far: a third of a second of
CPU at every daemon's start. The server does nothing after but fork; each child turns
the collector back on, over what it inherits frozen (`child_main`)."""

import gc

gc.disable()
