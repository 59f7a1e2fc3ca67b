"""The local Ray's watchdog (service/execution/local.py ``start_ray_watchdog``): when the process that started Ray
ends, every Ray process of the session goes, including one whose command line no longer names the session folder
(Ray's agents rename theirs to ``ray::DashboardAgent`` but keep their log files in the folder open); the process
that started Ray (alive after an orderly shutdown, maybe with a log file of the folder still open) and other
processes are spared."""

from __future__ import annotations

import subprocess
import sys
import time

from racer_batch.service.execution.local import start_ray_watchdog

# Opens a log file below the folder it reads from stdin (so its command line does not name it), says so, sleeps.
_HOLDER = ("import sys, time; d = sys.stdin.readline().strip(); f = open(d + '/agent.log', 'w'); "
           "print('ready', flush=True); time.sleep(120)")


def _holder(session, name: str | None) -> subprocess.Popen:
    """A process holding a file open below ``session``; ``name``: its command line's first word (``exec -a``)."""
    argv = ["bash", "-c", f'exec -a "{name}" "{sys.executable}" -c "{_HOLDER}"'] if name else \
        [sys.executable, "-c", _HOLDER]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    proc.stdin.write(f"{session}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ready"
    assert str(session).encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    return proc


def test_watchdog_kills_the_sessions_ray_processes_and_spares_the_rest(tmp_path):
    session = tmp_path / "rb-ray-session"
    session.mkdir()
    mine = open(session / "driver.log", "w")  # the process that starts Ray (here: this one) holds one open too
    agent = _holder(session, "ray::FakeAgent")
    bystander = _holder(session, None)
    try:
        assert open(f"/proc/{agent.pid}/cmdline", "rb").read().startswith(b"ray::FakeAgent")
        dog = start_ray_watchdog(str(session), remove_dir=False)
        assert dog is not None
        dog.stdin.close()  # what the end of the process that started Ray does, however it ends
        dog.wait(timeout=30)
        deadline = time.monotonic() + 10
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.poll() is not None, "the session's Ray agent outlived the watchdog"
        assert bystander.poll() is None  # not a Ray process: left alone
    finally:
        mine.close()
        for p in (agent, bystander):
            if p.poll() is None:
                p.kill()
            p.wait()
