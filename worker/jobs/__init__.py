"""A job's life: its message, the ledger of every held job's state, taking jobs in,
putting results together, settling jobs (ack, release, hand over, dead-letter),
checkpoints, leases, progress reports, array files and the job's own log."""
