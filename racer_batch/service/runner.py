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

from racer_batch.service.inputs import (InputPlan, RowTask, answer_columns, iter_raw_rows, parse_row,
                                       row_fingerprint, shard_fingerprint)
from racer_batch.service.metrics import ShardCounts
from racer_batch.service.output import part_path, shard_complete, write_part
from racer_batch.service.queue import ShardSummary
from racer_batch.service.schema import RowAccumulator, error_record, now_utc
from racer_batch.service.shadow import baseline_first, sample_seed, shadow_path, shadow_record, shadow_selected, write_shadow
from racer_batch.service.spec import JobSpec, ModelSpec
from racer_batch.service.engine_hook import hooked_bundle, hooked_engine
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
    """Load a bundle: the engine hook's when one is set and claims the name (engine_hook.py; tests only), else a
    real model through racer_batch.load_model."""
    bundle = hooked_bundle(model.name)
    if bundle is not None:
        return bundle
    if model.trust_remote_code and not allow_remote_code:
        raise ValueError(
            "model.trust_remote_code is set but this worker was not started with --allow-remote-code"
        )
    from racer_batch.models import load_model  # heavy import (torch, transformers) only when needed

    return load_model(model.name, device=device, dtype=model.dtype, trust_remote_code=model.trust_remote_code)


def default_engine(bundle: Any, decoding: DecodingConfig) -> Any:
    """The engine of a bundle: the engine hook's for a bundle it loaded, else racer_batch.engine.Engine."""
    engine = hooked_engine(bundle, decoding)
    if engine is not None:
        return engine
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
        key = (spec.model.name, spec.model.trust_remote_code, spec.model.dtype)
        if key != self._model_key:
            for job_id in list(self._states):
                self.end_job(job_id)
            self._engines.clear()
            self._bundle = None
            self._bundle = self._loader(spec.model, allow_remote_code=self.allow_remote_code, device=self.device)
            self._model_key = key
            self.models_loaded += 1
            log.info("loaded model %s on %s", spec.model.name, getattr(self._bundle, "device", "?"))
        return self._engine_for_config(spec.decoding)

    def _engine_for_config(self, decoding: DecodingConfig) -> Any:
        """The engine of one decoding config on the loaded model (the job's, or a shadow baseline's)."""
        h = decoding.config_hash()
        if h not in self._engines:
            self._engines[h] = self._engine_factory(self._bundle, decoding)
        return self._engines[h]

    def _state_for(self, job_id: str, engine: Any) -> Any:
        if job_id not in self._states:
            self._states[job_id] = (engine, engine.new_state())
        return self._states[job_id][1]

    def end_job(self, job_id: str) -> bool:
        """Free the job's draft state (and its shadow baseline's); True when there was one."""
        shadow = self._states.pop(_shadow_key(job_id), None)
        if shadow is not None:
            shadow[0].free_state(shadow[1])
        got = self._states.pop(job_id, None)
        if got is None:
            return False
        engine, state = got
        engine.free_state(state)
        return True

    @property
    def active_jobs(self) -> list[str]:
        return [k for k in self._states if not k.endswith(_SHADOW_SUFFIX)]

    def describe(self) -> dict:
        return {"worker": self.worker_name, "model": self._model_key[0] if self._model_key else None,
                "device": getattr(self._bundle, "device", None), "models_loaded": self.models_loaded,
                "active_jobs": self.active_jobs}

    def answer_row(self, spec: JobSpec, row: RowTask, base: dict, *, job_id: str) -> tuple[dict, list[dict]]:
        """One row outside a shard (``racer-batch shadow`` on a finished job): the output record and, when
        ``spec.shadow`` selects the row, its shadow pair. Draft state is scoped to ``job_id``."""
        engine = self._engine_for(spec)
        state = self._state_for(job_id, engine)
        return self._run_row(engine, state, spec, row, base, job_id=job_id, should_cancel=lambda: False)

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
        counts = ShardCounts()  # per-route rows/tokens/accepted/steps for the worker's Prometheus metrics
        records: list[dict] = []
        base_common = {
            "shard": task.shard, "worker": self.worker_name, "device": device, "model": spec.model.name,
            "method": spec.decoding.method, "config_hash": spec.decoding.config_hash(), "job_id": task.job_id,
        }
        columns = list(spec.input.columns.model_dump().values())
        fp_columns = answer_columns(spec.input)
        row_fps: list[tuple[str, str]] = []  # (id, row fingerprint) in row order: stamped into the part file
        row_positions: list[int] = []
        stopped: Optional[str] = None
        shadow_records: list[dict] = []
        source = task.rows if task.rows is not None else iter_raw_rows(plan, task.row_start, task.row_stop, columns)
        for row_idx, rec in source:
            row = parse_row(spec, row_idx, rec)
            row_fps.append((row.id, row_fingerprint(rec, fp_columns)))
            row_positions.append(row_idx)
            base = dict(base_common, id=row.id, row_idx=row_idx, route=row.route, seed=row.seed)
            if stopped is None and verdict() != KEEP_GOING:
                stopped = verdict()
            if stopped is not None:
                out = error_record(status="cancelled", error=f"job stopped before this row ran ({stopped})",
                                   base=base)
            else:
                out, pair = self._run_row(engine, state, spec, row, base, job_id=task.job_id,
                                          should_cancel=lambda: verdict() != KEEP_GOING)
                shadow_records += pair
                if out["status"] == "cancelled":
                    stopped = verdict() if verdict() != KEEP_GOING else CANCELLED
            out["finished_at"] = now_utc()
            records.append(out)
            gen_ms = (out.get("prefill_ms") or 0.0) + (out.get("decode_ms") or 0.0)
            summary.observe_row(status=out["status"], route=out["route"], output_tokens=out["output_tokens"] or 0,
                                steps=out["steps"] or 0, gen_ms=gen_ms)
            counts.observe_row(out)
            self.sink.record_row(task.job_id, _telemetry(out), shard=task.shard, progress=summary)
        assert len(records) == task.row_stop - task.row_start, (
            f"shard {task.shard} of job {task.job_id}: read {len(records)} rows, expected "
            f"{task.row_stop - task.row_start} (input changed since submit?)"
        )
        input_fp = shard_fingerprint([(i, fp) for i, (_, fp) in zip(row_positions, row_fps)])
        meta = dict(summary.to_dict(), job_id=task.job_id, shard=task.shard, row_start=task.row_start,
                    row_stop=task.row_stop, spec_hash=task.spec_hash, input_fingerprint=input_fp,
                    worker=self.worker_name, attempt=task.attempt, elapsed_s=time.perf_counter() - t0)
        if shadow_records:
            meta["shadow_rows"] = len(shadow_records) // 2
        written = self._commit(task, records, meta, stopped=stopped, shadow_records=shadow_records,
                               row_fps=row_fps)
        return dict(meta, stopped=stopped, written=written, path=str(part_path(spec.output.path, task.shard)),
                    counts=counts.to_dict())

    def _commit(self, task: ShardTask, records: list[dict], meta: dict, *, stopped: Optional[str],
                shadow_records: Optional[list[dict]] = None,
                row_fps: Optional[list[tuple[str, str]]] = None) -> bool:
        out_dir = task.spec["output"]["path"]
        if stopped == LEASE_LOST:
            return False  # another worker owns the job now; its copy of this shard wins
        if shadow_records:  # before the part file, whose rename commits the shard
            write_shadow(shadow_path(out_dir, f"{task.shard:05d}"), shadow_records,
                         meta={"job_id": task.job_id, "shard": task.shard, "spec_hash": task.spec_hash})
        if stopped is not None:
            # A partial (cancelled) shard is written for inspection, but never over a complete one.
            if shard_complete(out_dir, task.shard, spec_hash=task.spec_hash,
                              row_range=(task.row_start, task.row_stop),
                              input_fingerprint=meta["input_fingerprint"]):
                return False
        write_part(out_dir, task.shard, records, shard_meta=meta, row_fingerprints=row_fps)
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

    def _run_row(self, engine: Any, state: Any, spec: JobSpec, row: RowTask, base: dict, *, job_id: str,
                 should_cancel: Callable[[], bool]) -> tuple[dict, list[dict]]:
        """Answer one row ``spec.n_samples`` times (sample 0 with the row's seed) and, when the row is in the
        shadow sample, once more with the baseline config right before or after sample 0.
        Returns the output record and the shadow records ([] or [method, baseline])."""
        if row.error is not None:
            return error_record(status="error", error=f"row {row.id!r}: {row.error}", base=base), []
        shadow = spec.shadow
        pair: list[dict] = []
        with_shadow = shadow is not None and shadow_selected(shadow.seed, row.id, shadow.fraction)
        first = with_shadow and baseline_first(shadow.seed, row.id)
        if with_shadow and first:
            pair.append(self._shadow_baseline(spec, row, base, job_id=job_id, ran_first=True,
                                              should_cancel=should_cancel))
        results = []  # (accumulator, status, error, seed) per sample
        for k in range(spec.n_samples):
            params = row.params if k == 0 else row.params.model_copy(update={"seed": sample_seed(row.seed, k)})
            acc, status, error = self._answer(engine, state, row, params, should_cancel=should_cancel)
            results.append((acc, status, error, params.seed))
            if k == 0 and with_shadow:
                method = acc.record(status=status, error=error, base=base)
                method["finished_at"] = now_utc()
                pair.insert(0, shadow_record(method, run="job", side="method", ran_first=not first,
                                             temperature=row.params.temperature, reference=row.reference))
                if not first:
                    pair.append(self._shadow_baseline(spec, row, base, job_id=job_id, ran_first=False,
                                                      should_cancel=should_cancel))
            if status != "ok":
                break
        acc0, status, error, _ = results[0]
        if len(results) == 1 and spec.n_samples == 1:
            return acc0.record(status=status, error=error, base=base), pair
        total = RowAccumulator()
        for acc, st, err, _ in results:
            total.add(acc)
            if st != "ok" and status == "ok":
                status, error = st, err
        total.turn_texts, total.finish_reason = acc0.turn_texts, acc0.finish_reason
        rec = total.record(status=status, error=error, base=base)
        rec["samples"] = [
            {"sample": k, "seed": seed, "status": st, "text": acc.turn_texts[-1] if acc.turn_texts else None,
             "turn_texts": list(acc.turn_texts), "output_tokens": acc.output_tokens,
             "finish_reason": acc.finish_reason}
            for k, (acc, st, _, seed) in enumerate(results)
        ]
        return rec, pair

    def _shadow_baseline(self, spec: JobSpec, row: RowTask, base: dict, *, job_id: str, ran_first: bool,
                         should_cancel: Callable[[], bool]) -> dict:
        """The baseline side of a shadow pair: the row's sample 0 with the shadow config, its own draft state."""
        assert spec.shadow is not None
        decoding = spec.shadow.decoding()
        engine = self._engine_for_config(decoding)
        state = self._state_for(_shadow_key(job_id), engine)
        acc, status, error = self._answer(engine, state, row, row.params, should_cancel=should_cancel)
        rec = acc.record(status=status, error=error, base=dict(base, method=decoding.method,
                                                               config_hash=decoding.config_hash()))
        rec["finished_at"] = now_utc()
        return shadow_record(rec, run="job", side="baseline", ran_first=ran_first,
                             temperature=row.params.temperature, reference=row.reference)

    def _answer(self, engine: Any, state: Any, row: RowTask, params: Any, *,
                should_cancel: Callable[[], bool]) -> tuple[RowAccumulator, str, Optional[str]]:
        """One answer to the row (every turn) with these params: (accumulator, status, error)."""
        acc = RowAccumulator()
        try:
            if row.turns is not None:
                chat = list(row.chat or [])
                for turn in row.turns:
                    chat.append({"role": "user", "content": turn})
                    res = engine.generate(chat, params, state=state, should_cancel=should_cancel)
                    acc.add_turn(res)
                    if res.finish_reason == "cancelled":
                        break
                    chat.append({"role": "assistant", "content": res.text})
            else:
                res = engine.generate(row.chat if row.chat is not None else row.raw, params, state=state,
                                      should_cancel=should_cancel)
                acc.add_turn(res)
        except ValueError as exc:
            return acc, "error", f"row {row.id!r}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a model failure on one row must not kill the job
            log.warning("model error on row %s: %r", row.id, exc)
            return acc, "error", f"row {row.id!r}: model error: {type(exc).__name__}: {exc}"
        if acc.finish_reason == "cancelled":
            return acc, "cancelled", "cancelled during generation"
        return acc, "ok", None


_SHADOW_SUFFIX = "\0shadow"


def _shadow_key(job_id: str) -> str:
    """Key of a job's shadow-baseline draft state in RowRunner._states (freed with the job's)."""
    return job_id + _SHADOW_SUFFIX


def _telemetry(rec: dict) -> dict:
    keys = ("id", "row_idx", "shard", "route", "status", "error", "output_tokens", "steps", "mat",
            "tokens_per_s", "finish_reason", "worker", "device")
    return {k: rec.get(k) for k in keys}
