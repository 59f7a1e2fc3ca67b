"""Helpers of the reliability tests: a worker on a background thread, waits, output checks (input files and
specs: tests/fixtures.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Optional

from racer_batch.service.results.output import read_output


def wait_for(cond: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


class BackgroundWorker:
    """A Worker running ``run()`` on a thread until ``stop()``; its exception (if any) is kept."""

    def __init__(self, worker, **run_kw) -> None:
        self.worker = worker
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._run_kw = run_kw
        self.thread = threading.Thread(target=self._main, name="rel-worker", daemon=True)

    def _main(self) -> None:
        try:
            self.worker.run(stop=self._stop.is_set, **self._run_kw)
        except BaseException as exc:  # noqa: BLE001 - kept for the test to assert on
            self.error = exc

    def start(self) -> "BackgroundWorker":
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self.thread.join(timeout=timeout_s)
        assert not self.thread.is_alive(), "worker thread did not stop"


def output_ids(out_dir: str | Path) -> list[str]:
    return [r["id"] for r in read_output(out_dir).to_pylist()]


def assert_each_id_once(out_dir: str | Path, expected: list[str]) -> list[dict]:
    rows = read_output(out_dir).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicated ids: {sorted(i for i in set(ids) if ids.count(i) > 1)[:5]}"
    assert sorted(ids) == sorted(expected), f"missing {sorted(set(expected) - set(ids))[:5]}"
    return rows
