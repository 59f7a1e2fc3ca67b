"""Report tests: hand-made Parquet files and the stand-in engine; no Redis or Ray unless a test asks."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
