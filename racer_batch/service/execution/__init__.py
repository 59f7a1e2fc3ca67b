"""How a job runs: the Redis queue and leases (``queue.py``), the worker that plans and dispatches shards
(``worker.py``), the executors and Ray actors (``actors.py``), the row runner that turns a ``ShardTask`` into
``RowRecord``s (``runner.py``), the test-only engine hook (``engine_hook.py``) and local Redis/Ray (``local.py``)."""
