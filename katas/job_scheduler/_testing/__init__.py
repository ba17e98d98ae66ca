"""What the job scheduler's suites share: building the code under test (``queues``,
``pools``, ``redis_queues``, ``fleets``), the exact model (``model``) and the ways it
judges a run (``clients``, ``replay``), test clocks (``clocks``), the worker process
the stage-3 fault tests start (``worker``), and the queue on a Redis Cluster
(``cluster``)."""
