"""The daemon's life: its wiring (`wiring.Daemon`), the one module that assembles the
pipeline's shape (`stages`), the supervisor of its loops, shutdown, scale-in protection,
interruption notices and the host's record of breakages.

Nothing is imported here: the stage processes' fork server imports `stages`, and
importing this package must not bring the wiring (the jobs, the message, pydantic)
into it with them."""
