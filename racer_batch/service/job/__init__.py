"""What a job is: the spec (``spec.py``: pydantic, validated once per process), its input rows (``inputs.py``:
the input plan, row parsing, row fingerprints) and ``submit.py`` (validate, claim the output folder, queue)."""
