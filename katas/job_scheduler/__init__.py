"""The job-scheduler kata: leases, fencing tokens and retries, then worker pools, then Redis."""
