import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

if os.environ.get("RACER_TEST_THREADS"):  # e.g. 1 on a machine shared with other busy processes
    import torch

    torch.set_num_threads(int(os.environ["RACER_TEST_THREADS"]))


@pytest.fixture(scope="session")
def smol():
    """The real default model (SmolLM2-135M-Instruct, float32)."""
    from racer_batch import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture()
def tiny():
    from helpers import tiny_bundle

    return tiny_bundle()
