"""One job's life: the ledger of every held job's state, settling jobs (ack, release,
hand over, dead-letter), checkpoints, leases, the job lanes, the plan records a sharded
job's runs share, the summary and the job's own log."""
