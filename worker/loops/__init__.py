"""The daemon's loops over jobs, from the pipeline's ends: taking jobs in (`intake`,
with their admission, `admission`), putting each job's results together and finishing it
(`results`), and reporting progress (`reporting`)."""
