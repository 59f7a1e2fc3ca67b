"""The local Ray's watchdog (service/execution/local.py ``start_ray_watchdog``): when the process that started Ray
ends, every process of the session goes, including one whose command line no longer names the session folder
(Ray's agents rename theirs to ``ray::DashboardAgent`` but keep their log files in the folder open)."""

from __future__ import annotations

import subprocess
import sys
import time

from racer_batch.service.execution.local import start_ray_watchdog

# Opens a log file below the folder it reads from stdin (so its command line does not name it), says so, sleeps.
_AGENT = ("import sys, time; d = sys.stdin.readline().strip(); f = open(d + '/agent.log', 'w'); "
          "print('ready', flush=True); time.sleep(120)")


def test_watchdog_kills_a_session_process_known_only_by_its_open_files(tmp_path):
    session = tmp_path / "rb-ray-session"
    session.mkdir()
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        agent.stdin.write(f"{session}\n")
        agent.stdin.flush()
        assert agent.stdout.readline().strip() == "ready"
        assert str(session).encode() not in open(f"/proc/{agent.pid}/cmdline", "rb").read()
        dog = start_ray_watchdog(str(session), remove_dir=True)
        assert dog is not None
        dog.stdin.close()  # what the end of the process that started Ray does, however it ends
        dog.wait(timeout=30)
        deadline = time.monotonic() + 10
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.poll() is not None, "the session's agent outlived the watchdog"
        assert not session.exists()
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
