"""Reference solution of the job-scheduler kata."""
