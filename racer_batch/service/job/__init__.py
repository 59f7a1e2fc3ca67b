"""What a job is: the spec (``spec.py``: pydantic, validated once per process), its input rows (``inputs.py``:
the input plan, row parsing, row fingerprints) and one shard of it as an actor runs it (``task.py``). The lowest
service layer: it imports nothing of ``results/``, ``execution/`` or ``submit.py``."""
