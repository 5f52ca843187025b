"""One job split across the fleet with no coordinator: planning a job into shards
(`planning`), a shard's commit and the job's side files (`shards`), merging the shards'
results into the job's (`merging`) and watching for lost or straggling shards
(`stragglers`). SQS and S3 are the distributed engine; docs/DESIGN.md has the protocol."""
