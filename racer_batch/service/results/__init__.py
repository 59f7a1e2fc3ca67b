"""What a job leaves: the row record and its schemas (``record.py``, ``schema.py``), the one tally
(``tally.py``), the sinks that consume them (``sinks.py``: Parquet writer, sink interfaces; ``metrics.py``:
Prometheus), the output folder (``output.py``, ``manifest.py``, ``shadow.py``) and resume (``resume.py``)."""
