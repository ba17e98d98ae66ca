"""The job states by the short names the suites, the model and the drivers say them."""

from __future__ import annotations

from katas.job_scheduler.api import JobState

SCHEDULED, READY, LEASED = JobState.SCHEDULED, JobState.READY, JobState.LEASED
SUCCEEDED, DEAD, CANCELLED = JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED
FINISHED = (SUCCEEDED, DEAD, CANCELLED)
