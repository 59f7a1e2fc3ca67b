import os
import sys
import time
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# This run's mark: every process a test starts inherits it (Ray's nodes and workers, worker subprocesses,
# private redis-servers), so the check at the end finds what this run left running, and only that: other
# pytest runs and other people's Ray on the machine carry another value or none.
SESSION = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
os.environ["RACER_TEST_SESSION"] = SESSION

from tests.standin import use_standin  # noqa: E402

use_standin()  # `stand-in` model names run on tests/standin.py, here and in the processes tests start

from tests.fixtures import (  # noqa: E402,F401 (shared fixtures)  # noqa: E402
    SESSION_ENV,
    cli,
    kill_and_wait,
    prefix,
    queue,
    redis_server_factory,
    redis_url,
    suite_processes,
)

assert SESSION_ENV == "RACER_TEST_SESSION"
LEFTOVER_GRACE_S = 30.0  # Ray's workers end a few seconds after their raylet; a leak is still there after this


def pytest_sessionfinish(session, exitstatus):
    """No process this run started outlives it: after every fixture is torn down (Ray sessions, clusters,
    private redis-servers, worker subprocesses), wait up to LEFTOVER_GRACE_S for the processes carrying this
    run's mark to end; any still alive fails the run, is listed, and is killed by pid."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = suite_processes(SESSION)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = suite_processes(SESSION)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) started by this test run outlived it (killed now):"]
    lines += [f"  pid {pid}: {cmd[:160].decode(errors='replace')}" for pid, cmd in sorted(left.items())]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    kill_and_wait(left)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

if os.environ.get("RACER_TEST_THREADS"):  # e.g. 1 on a machine shared with other busy processes
    import torch

    torch.set_num_threads(int(os.environ["RACER_TEST_THREADS"]))


@pytest.fixture(scope="session")
def smol():
    """The real default model (SmolLM2-135M-Instruct) as the CPU loads it by default: its GGUF weights as stored
    (``weights: as_stored`` where our kernels run, else float32)."""
    from racer_batch import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smol_f32():
    """The same model de-quantised to float32 (``weights: float32``): the HF oracle's weights."""
    from racer_batch import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32", weights="float32")


@pytest.fixture()
def tiny():
    from tests.helpers import tiny_bundle

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
