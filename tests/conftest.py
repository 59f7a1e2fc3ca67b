import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
if str(Path(__file__).parents[1]) not in sys.path:  # the repository root: ``tests.standin``, ``tests.fixtures``
    sys.path.append(str(Path(__file__).parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from tests.standin import use_standin  # noqa: E402

use_standin()  # `stand-in` model names run on tests/standin.py, here and in the processes tests start

from tests.fixtures import cli, prefix, queue, redis_server_factory, redis_url  # noqa: E402,F401 (shared fixtures)

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


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models (tests/unit, tests/engine) run fastest on one thread; two threads on a loaded machine spin."""
    path = str(request.node.fspath)
    if "/tests/unit/" not in path and "/tests/engine/" not in path:
        yield
        return
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
