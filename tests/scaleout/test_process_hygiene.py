"""The suite-end check of tests/conftest.py: it finds the processes this pytest run started (orphans
included) by the mark in their environment, and not those of another run."""

from __future__ import annotations

import os
import subprocess

from tests.fixtures import SESSION_ENV, kill_and_wait, suite_processes


def test_suite_processes_finds_this_runs_processes_and_orphans_only():
    session = os.environ[SESSION_ENV]
    mine = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, SESSION_ENV: "another-run"})
    # an orphan: its parent shell exits at once, so it is no descendant of this process any more
    orphan = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                                check=True).stdout)
    try:
        found = suite_processes(session)
        assert mine.pid in found and orphan in found and b"sleep 60" in found[orphan]
        assert other.pid not in found and os.getpid() not in found
        assert kill_and_wait([mine.pid, orphan]) == []
        assert not {mine.pid, orphan} & set(suite_processes(session))
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
        kill_and_wait([orphan])
