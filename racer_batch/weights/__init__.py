"""Model weights kept as their file stores them (``stored``: GGUF block formats packed for our CPU kernels).

A folder of its own so that both ``racer_batch.models`` (loading) and ``racer_batch.engine`` (the forward)
use it without importing each other; it needs only ``racer_batch.engine.kernels`` (the native ops).
"""
