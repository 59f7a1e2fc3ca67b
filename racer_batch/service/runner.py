"""The plain class that generates one shard: read its rows, answer each, write the part file.

``RowRunner`` knows nothing of Ray; the Ray actor (actors.py) is a thin shell around it and tests call it
directly. It keeps one loaded model (reused by every job naming the same model), one Engine per decoding
config, and one draft state per job (RACER.md section 7, scope ``job``), freed by ``end_job``.

A bad row never stops the shard: input problems found by ``parse_row`` and ValueErrors raised by the
engine (prompt too long for the context, missing chat template, ...) become ``status=error`` with the
message; any other exception while generating a row is reported as a model error for that row.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol

from racer_batch.service.inputs import InputPlan, RowTask, iter_raw_rows, parse_row
from racer_batch.service.output import part_path, shard_complete, write_part
from racer_batch.service.queue import ShardSummary
from racer_batch.service.schema import RowAccumulator, error_record, now_utc
from racer_batch.service.spec import JobSpec, ModelSpec
from racer_batch.service.standin import StandInEngine, is_standin, load_standin
from racer_batch.types import DecodingConfig

log = logging.getLogger(__name__)

KEEP_GOING, CANCELLED, LEASE_LOST = "go", "cancelled", "lease-lost"


class ShardSink(Protocol):
    """Where a runner reports progress and learns whether to stop (Redis in production)."""

    def record_row(self, job_id: str, row: dict, *, shard: int, progress: ShardSummary) -> None: ...

    def verdict(self, job_id: str, owner: str) -> str: ...  # KEEP_GOING | CANCELLED | LEASE_LOST


class NullSink:
    """No telemetry, never stops: for direct calls in tests and scripts."""

    def record_row(self, job_id: str, row: dict, *, shard: int, progress: ShardSummary) -> None:
        return None

    def verdict(self, job_id: str, owner: str) -> str:
        return KEEP_GOING


@dataclass
class ShardTask:
    """What an actor needs to run one shard (plain data: travels through Ray as a dict)."""

    job_id: str
    shard: int
    row_start: int
    row_stop: int
    spec: dict  # JobSpec.stored()
    plan: dict  # InputPlan.to_dict()
    spec_hash: str
    owner: str  # the worker holding the job's lease
    attempt: int = 1
    rows: Optional[list] = None  # [(row_idx, raw record)] read by the worker; None: the runner reads them

    def to_dict(self) -> dict:
        return asdict(self)


def default_loader(model: ModelSpec, *, allow_remote_code: bool, device: Optional[str]) -> Any:
    """Load a bundle: the stand-in engine's, or a real model through racer_batch.load_model."""
    if is_standin(model.name):
        return load_standin(model.name)
    if model.trust_remote_code and not allow_remote_code:
        raise ValueError(
            "model.trust_remote_code is set but this worker was not started with --allow-remote-code"
        )
    from racer_batch.models import load_model  # heavy import (torch, transformers) only when needed

    return load_model(model.name, device=device, trust_remote_code=model.trust_remote_code)


def default_engine(bundle: Any, decoding: DecodingConfig) -> Any:
    if isinstance(bundle, type(load_standin("stand-in"))):
        return StandInEngine(bundle, decoding)
    from racer_batch.engine import Engine

    return Engine(bundle, decoding)


class RowRunner:
    def __init__(
        self,
        *,
        worker_name: Optional[str] = None,
        sink: Optional[ShardSink] = None,
        device: Optional[str] = None,
        allow_remote_code: bool = False,
        probe_interval_s: float = 0.05,
        loader: Callable[..., Any] = default_loader,
        engine_factory: Callable[[Any, DecodingConfig], Any] = default_engine,
    ) -> None:
        self.worker_name = worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.sink = sink or NullSink()
        self.device = device
        self.allow_remote_code = allow_remote_code
        self.probe_interval_s = probe_interval_s
        self._loader = loader
        self._engine_factory = engine_factory
        self._model_key: Optional[tuple] = None
        self._bundle: Any = None
        self._engines: dict[str, Any] = {}  # config hash -> Engine
        self._states: dict[str, tuple[Any, Any]] = {}  # job id -> (engine, draft state)
        self.models_loaded = 0

    # ---- model, engines and per-job state
    def _engine_for(self, spec: JobSpec) -> Any:
        key = (spec.model.name, spec.model.trust_remote_code)
        if key != self._model_key:
            for job_id in list(self._states):
                self.end_job(job_id)
            self._engines.clear()
            self._bundle = None
            self._bundle = self._loader(spec.model, allow_remote_code=self.allow_remote_code, device=self.device)
            self._model_key = key
            self.models_loaded += 1
            log.info("loaded model %s on %s", spec.model.name, getattr(self._bundle, "device", "?"))
        h = spec.decoding.config_hash()
        if h not in self._engines:
            self._engines[h] = self._engine_factory(self._bundle, spec.decoding)
        return self._engines[h]

    def _state_for(self, job_id: str, engine: Any) -> Any:
        if job_id not in self._states:
            self._states[job_id] = (engine, engine.new_state())
        return self._states[job_id][1]

    def end_job(self, job_id: str) -> bool:
        """Free the job's draft state; True when there was one."""
        got = self._states.pop(job_id, None)
        if got is None:
            return False
        engine, state = got
        engine.free_state(state)
        return True

    @property
    def active_jobs(self) -> list[str]:
        return list(self._states)

    def describe(self) -> dict:
        return {"worker": self.worker_name, "model": self._model_key[0] if self._model_key else None,
                "device": getattr(self._bundle, "device", None), "models_loaded": self.models_loaded,
                "active_jobs": self.active_jobs}

    # ---- one shard
    def run_shard(self, task_d: dict) -> dict:
        """Generate every row of a shard and commit its part file. Returns the shard summary (a dict)."""
        task = ShardTask(**task_d)
        t0 = time.perf_counter()
        spec = JobSpec.model_validate(task.spec)
        plan = InputPlan.from_dict(task.plan)
        engine = self._engine_for(spec)
        state = self._state_for(task.job_id, engine)
        device = str(getattr(engine.bundle, "device", "cpu"))
        verdict = self._make_probe(task)
        summary = ShardSummary()
        records: list[dict] = []
        base_common = {
            "shard": task.shard, "worker": self.worker_name, "device": device, "model": spec.model.name,
            "method": spec.decoding.method, "config_hash": spec.decoding.config_hash(), "job_id": task.job_id,
        }
        columns = list(spec.input.columns.model_dump().values())
        stopped: Optional[str] = None
        source = task.rows if task.rows is not None else iter_raw_rows(plan, task.row_start, task.row_stop, columns)
        for row_idx, rec in source:
            row = parse_row(spec, row_idx, rec)
            base = dict(base_common, id=row.id, row_idx=row_idx, route=row.route, seed=row.seed)
            if stopped is None and verdict() != KEEP_GOING:
                stopped = verdict()
            if stopped is not None:
                out = error_record(status="cancelled", error=f"job stopped before this row ran ({stopped})",
                                   base=base)
            else:
                out = self._run_row(engine, state, spec, row, base, should_cancel=lambda: verdict() != KEEP_GOING)
                if out["status"] == "cancelled":
                    stopped = verdict() if verdict() != KEEP_GOING else CANCELLED
            out["finished_at"] = now_utc()
            records.append(out)
            gen_ms = (out.get("prefill_ms") or 0.0) + (out.get("decode_ms") or 0.0)
            summary.observe_row(status=out["status"], route=out["route"], output_tokens=out["output_tokens"] or 0,
                                steps=out["steps"] or 0, gen_ms=gen_ms)
            self.sink.record_row(task.job_id, _telemetry(out), shard=task.shard, progress=summary)
        assert len(records) == task.row_stop - task.row_start, (
            f"shard {task.shard} of job {task.job_id}: read {len(records)} rows, expected "
            f"{task.row_stop - task.row_start} (input changed since submit?)"
        )
        meta = dict(summary.to_dict(), job_id=task.job_id, shard=task.shard, row_start=task.row_start,
                    row_stop=task.row_stop, spec_hash=task.spec_hash, worker=self.worker_name,
                    attempt=task.attempt, elapsed_s=time.perf_counter() - t0)
        written = self._commit(task, records, meta, stopped=stopped)
        return dict(meta, stopped=stopped, written=written, path=str(part_path(spec.output.path, task.shard)))

    def _commit(self, task: ShardTask, records: list[dict], meta: dict, *, stopped: Optional[str]) -> bool:
        out_dir = task.spec["output"]["path"]
        if stopped == LEASE_LOST:
            return False  # another worker owns the job now; its copy of this shard wins
        if stopped is not None:
            # A partial (cancelled) shard is written for inspection, but never over a complete one.
            if shard_complete(out_dir, task.shard, spec_hash=task.spec_hash,
                              row_range=(task.row_start, task.row_stop)):
                return False
        write_part(out_dir, task.shard, records, shard_meta=meta)
        return True

    def _make_probe(self, task: ShardTask) -> Callable[[], str]:
        """A throttled stop check: asks the sink at most every probe_interval_s; a stop is sticky."""
        last = {"t": 0.0, "v": KEEP_GOING}

        def verdict() -> str:
            if last["v"] != KEEP_GOING:
                return last["v"]
            now = time.monotonic()
            if now - last["t"] >= self.probe_interval_s:
                last["t"] = now
                last["v"] = self.sink.verdict(task.job_id, task.owner)
            return last["v"]

        return verdict

    def _run_row(self, engine: Any, state: Any, spec: JobSpec, row: RowTask, base: dict, *,
                 should_cancel: Callable[[], bool]) -> dict:
        if row.error is not None:
            return error_record(status="error", error=f"row {row.id!r}: {row.error}", base=base)
        acc = RowAccumulator()
        try:
            if row.turns is not None:
                chat = list(row.chat or [])
                for turn in row.turns:
                    chat.append({"role": "user", "content": turn})
                    res = engine.generate(chat, row.params, state=state, should_cancel=should_cancel)
                    acc.add_turn(res)
                    if res.finish_reason == "cancelled":
                        break
                    chat.append({"role": "assistant", "content": res.text})
            else:
                res = engine.generate(row.chat if row.chat is not None else row.raw, row.params, state=state,
                                      should_cancel=should_cancel)
                acc.add_turn(res)
        except ValueError as exc:
            return acc.record(status="error", error=f"row {row.id!r}: {exc}", base=base)
        except Exception as exc:  # noqa: BLE001 - a model failure on one row must not kill the job
            log.warning("model error on row %s of job %s: %r", row.id, base["job_id"], exc)
            return acc.record(status="error", error=f"row {row.id!r}: model error: {type(exc).__name__}: {exc}",
                              base=base)
        status = "cancelled" if acc.finish_reason == "cancelled" else "ok"
        return acc.record(status=status, error="cancelled during generation" if status == "cancelled" else None,
                          base=base)


def _telemetry(rec: dict) -> dict:
    keys = ("id", "row_idx", "shard", "route", "status", "error", "output_tokens", "steps", "mat",
            "tokens_per_s", "finish_reason", "worker", "device")
    return {k: rec.get(k) for k in keys}
