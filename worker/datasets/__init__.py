"""The forms a job's inputs and outputs take: objects, manifests, prefixes, tables and
inventories read as inputs (`inputs`), tar shards (`tars`, with the disk their copies
may take, `disk`), Parquet results (`tables`) and array files (`arrays`). They know the
job message, never a job's state or the fleet."""
