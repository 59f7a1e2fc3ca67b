"""The plain class that generates one shard: read its rows, answer each, write the part file.

``RowRunner`` knows nothing of Ray; the Ray actor (actors.py) is a thin shell around it and tests call it
directly. It keeps one loaded model (reused by every job naming the same model), one Engine per decoding
config, and one draft state per job (docs/method.md section 7, scope ``job``), freed by ``end_job``.

Up to B rows of a shard are in flight at once (``resources.streams_per_actor``, issue 14): each row is a
generator (``_row_stream``) that runs the row's sequential logic (turns, samples, shadow baseline) and
``yield from``s the engine's streams, so the rows' forwards go through one ``StreamBatch`` and their draft
trees are verified together; a finished row's place goes to the next row of the shard (continuous
batching). Rows are written to the part file in row order; telemetry sees each row when it ends. With B = 1
each row is answered by ``engine.generate`` as before.

A bad row never stops the shard: input problems found by ``parse_row`` and ValueErrors raised by the
engine (prompt too long for the context, missing chat template, ...) become ``status=error`` with the
message; any other exception while generating a row is reported as a model error for that row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Optional, Protocol, Union

from racer_batch.benchdata import has_chat_template
from racer_batch.engine.batch import BatchStats, StreamBatch, drive
from racer_batch.service.execution.auto import MethodChooser
from racer_batch.service.execution.engine_hook import hooked_bundle, hooked_engine
from racer_batch.service.execution.job_engines import AUTO_KEY_SEP, ShardEngines, auto_engine_config
from racer_batch.service.execution.warm import WarmStates
from racer_batch.service.job.inputs import InputPlan, answer_columns, iter_raw_rows, row_fingerprint, shard_fingerprint
from racer_batch.service.job.rows import RowTask, parse_row
from racer_batch.service.job.spec import JobSpec, ModelSpec, auto_streams
from racer_batch.service.job.task import ShardResult, ShardTask
from racer_batch.service.results.output import part_path, shard_complete, write_part
from racer_batch.service.results.record import RowOrigin, RowRecord, ShadowRecord, now_utc
from racer_batch.service.results.shadow import baseline_first, sample_seed, shadow_path, shadow_selected, write_shadow
from racer_batch.service.results.sinks import RowSink
from racer_batch.service.results.tally import Tally
from racer_batch.values import AUTO_METHOD, DecodingConfig, GenerationResult

log = logging.getLogger(__name__)

KEEP_GOING, CANCELLED, LEASE_LOST = "go", "cancelled", "lease-lost"


class ShardSink(RowSink, Protocol):
    """What a runner talks to (Redis in production): a RowSink for each finished row, and the verdict that
    tells it whether to stop."""

    def verdict(self, job_id: str, owner: str) -> str: ...  # KEEP_GOING | CANCELLED | LEASE_LOST


class NullSink:
    """No telemetry, never stops: for direct calls in tests and scripts."""

    def observe(self, record: RowRecord, *, progress: Tally) -> None:
        return None

    def verdict(self, job_id: str, owner: str) -> str:
        return KEEP_GOING


class ShardWriter:
    """The Parquet sink of one shard attempt: collects its rows (RowRecord), shadow pairs (ShadowRecord) and
    input-row fingerprints, and commits them as the part file (and the shadow file before it).

    ``observe(record)`` takes one row; ``summary(tally, ...)`` is the shard summary stored in the part file's
    footer, Redis and the manifest; ``commit(summary, stopped=...)`` writes. The worker uses it too, for a
    shard whose rows are all marked as errors."""

    def __init__(self, *, out_dir: str, job_id: str, shard: int, row_range: tuple[int, int], spec_hash: str,
                 fp_columns: list[str]) -> None:
        self.out_dir, self.job_id, self.shard = out_dir, job_id, shard
        self.row_range, self.spec_hash, self._fp_columns = tuple(row_range), spec_hash, fp_columns
        self.records: list[RowRecord] = []
        self.shadow: list[ShadowRecord] = []
        self.row_fps: list[tuple[str, str]] = []  # (id, row fingerprint) in row order
        self._positions: list[int] = []

    def add_input(self, row_idx: int, row_id: str, raw: dict) -> None:
        """Fingerprint one input row (in row order), before its answer is observed."""
        self.row_fps.append((row_id, row_fingerprint(raw, self._fp_columns)))
        self._positions.append(row_idx)

    def observe(self, record: RowRecord) -> None:
        self.records.append(record)

    def observe_shadow(self, pair: list[ShadowRecord]) -> None:
        self.shadow += pair

    def summary(self, tally: Tally, **extra: Any) -> dict:
        """The shard summary: the tally's JSON, row range, spec hash and input fingerprint, plus ``extra``."""
        n = self.row_range[1] - self.row_range[0]
        assert len(self.records) == n, (f"shard {self.shard} of job {self.job_id}: read {len(self.records)} rows, "
                                        f"expected {n} (input changed since submit?)")
        meta = dict(tally.to_dict(), job_id=self.job_id, shard=self.shard, row_start=self.row_range[0],
                    row_stop=self.row_range[1], spec_hash=self.spec_hash,
                    input_fingerprint=shard_fingerprint([(i, fp) for i, (_, fp) in zip(self._positions, self.row_fps)]),
                    **extra)
        if self.shadow:
            meta["shadow_rows"] = len(self.shadow) // 2
        return meta

    def commit(self, meta: dict, *, stopped: Optional[str]) -> bool:
        """Write the shadow file, then the part file (whose rename commits the shard). Returns False when
        nothing was written: the lease went to another worker, or a partial (stopped) attempt would replace
        a complete part file."""
        if stopped == LEASE_LOST:
            return False  # another worker owns the job now; its copy of this shard wins
        if self.shadow:
            write_shadow(shadow_path(self.out_dir, f"{self.shard:05d}"), self.shadow,
                         meta={"job_id": self.job_id, "shard": self.shard, "spec_hash": self.spec_hash})
        if stopped is not None and shard_complete(self.out_dir, self.shard, spec_hash=self.spec_hash,
                                                  row_range=self.row_range,
                                                  input_fingerprint=meta["input_fingerprint"]):
            return False  # a partial (cancelled) shard is written for inspection, never over a complete one
        write_part(self.out_dir, self.shard, self.records, shard_meta=meta, row_fingerprints=self.row_fps)
        return True


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

    return load_model(model.name, device=device, dtype=model.dtype, trust_remote_code=model.trust_remote_code,
                      weights=model.weights)


def default_engine(bundle: Any, decoding: DecodingConfig, *, streams: int = 1) -> Any:
    """The engine of a bundle, with room for ``streams`` rows at once: the engine hook's for a bundle it
    loaded, else racer_batch.engine.Engine."""
    engine = hooked_engine(bundle, decoding, streams=streams)
    if engine is not None:
        return engine
    from racer_batch.engine import Engine

    return Engine(bundle, decoding, streams=streams)


@dataclass(frozen=True)
class RowCall:
    """What answering one row needs beside the row and its engine: the job's spec and id, the row's origin
    (RowRecord provenance) and its cancellation (``should_cancel``, polled by the engine at every step; the
    shard's verdict probe, or never for ``answer_row``). Passed once down the row's stream."""

    spec: JobSpec
    job_id: str
    origin: RowOrigin
    should_cancel: Callable[[], bool]
    method: Optional[str] = None  # method auto: the candidate the row runs on the shard's one engine


class RowRunner:
    def __init__(
        self,
        *,
        worker_name: Optional[str] = None,
        node: Optional[str] = None,
        sink: Optional[ShardSink] = None,
        device: Optional[str] = None,
        allow_remote_code: bool = False,
        probe_interval_s: float = 0.05,
        loader: Callable[..., Any] = default_loader,
        engine_factory: Callable[..., Any] = default_engine,
    ) -> None:
        """``engine_factory(bundle, decoding)`` makes an engine; ``engine_factory(bundle, decoding, streams=B)``
        one with room for B rows at once (called so only for B > 1). ``node``: the Ray node id the runner
        lives on (the ``node`` column of its rows and the shard summaries); None outside Ray."""
        self.worker_name = worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.node = node
        self.sink = sink or NullSink()
        self.device = device
        self.allow_remote_code = allow_remote_code
        self.probe_interval_s = probe_interval_s
        self._loader = loader
        self._engine_factory = engine_factory
        self._model_key: Optional[tuple] = None
        self._bundle: Any = None
        self._engines: dict[str, Any] = {}  # config hash -> Engine
        self._room: dict[str, int] = {}  # config hash -> the streams its engine was made for
        self._states: dict[str, tuple[Any, Any]] = {}  # job id -> (engine, draft state)
        self._specs: dict[tuple[str, str, str], JobSpec] = {}  # (job id, spec hash, resources) -> validated spec
        self._warm = WarmStates()  # the jobs' saved draft states (resources.warm_draft_state)
        self._choosers: dict[str, MethodChooser] = {}  # job id -> its per-route method choice (method auto)
        self.models_loaded = 0

    # ---- model, engines and per-job state
    def _engine_for(self, spec: JobSpec, *, streams: int = 1) -> Any:
        """The job's engine (method auto: the one its candidates share, ``job_engines.auto_engine_config``) on its
        model, loaded here on first use."""
        self._ensure_model(spec)
        decoding = spec.decoding
        return self._engine_for_config(auto_engine_config(decoding) if decoding.method == AUTO_METHOD
                                       else decoding, streams=streams)

    def _ensure_model(self, spec: JobSpec) -> None:
        """Load the job's model unless it is the loaded one (another model first ends every job's state)."""
        key = (spec.model.name, spec.model.trust_remote_code, spec.model.dtype, spec.model.weights)
        if key != self._model_key:
            for job_id in list(self._states):
                self.end_job(job_id)
            self._engines.clear()
            self._room.clear()
            self._bundle = None
            self._bundle = self._loader(spec.model, allow_remote_code=self.allow_remote_code, device=self.device)
            self._model_key = key
            self.models_loaded += 1
            log.info("loaded model %s on %s", spec.model.name, getattr(self._bundle, "device", "?"))

    def _engine_for_config(self, decoding: DecodingConfig, *, streams: int = 1) -> Any:
        """The engine of one decoding config on the loaded model (the job's, or a shadow baseline's), with
        room for ``streams`` rows at once: a cached engine with fewer is replaced (the job states it served
        move to the new one)."""
        h = decoding.config_hash()
        old = self._engines.get(h)
        if old is None or self._room[h] < streams:
            engine = self._engine_factory(self._bundle, decoding, streams=streams)
            self._engines[h], self._room[h] = engine, streams
            for key, (e, state) in list(self._states.items()):
                if e is old:
                    self._states[key] = (engine, state)
        return self._engines[h]

    def _auto_streams(self) -> tuple[int, ...]:
        """``streams_per_actor: auto``'s choices on this runner's device (the loaded model's, else the asked)."""
        from racer_batch.models import pick_device

        return auto_streams(getattr(self._bundle, "device", None) or pick_device(self.device))

    def _slots_for(self, spec: JobSpec) -> int:
        """Rows at once an engine of this job needs room for: the setting (auto: the largest choice), at most
        a shard's rows."""
        want = spec.resources.streams_per_actor
        top = max(self._auto_streams()) if want == "auto" else int(want)
        return max(1, min(top, spec.output.shard_rows))

    def _width(self, engine: Any, spec: JobSpec, rows: int) -> int:
        """B, the rows of this shard in flight at once: the setting, or with ``auto`` the engine's choice
        among ``auto_streams`` of the device (``choose_streams``); at most the shard's ``rows``."""
        want = spec.resources.streams_per_actor
        if want != "auto":
            return max(1, min(int(want), rows))
        choices = [b for b in self._auto_streams() if b <= max(1, min(rows, int(engine.streams)))]
        return int(engine.choose_streams(choices))

    def _state_for(self, job_id: str, engine: Any, method: Optional[str] = None) -> Any:
        """The draft state kept under ``job_id`` (a key), made on first use: the engine's, or for ``method`` (one
        of method auto's candidates on the engine) that method's."""
        if job_id not in self._states:
            self._states[job_id] = (engine, engine.new_state() if method is None else engine.new_state(method))
        return self._states[job_id][1]

    def end_job(self, job_id: str) -> bool:
        """Free the job's draft state (and its shadow baseline's); True when there was one."""
        self._choosers.pop(job_id, None)
        for key in [k for k in self._states if k.startswith(job_id + AUTO_KEY_SEP)]:
            self._warm.forget(key)
            engine, state = self._states.pop(key)
            engine.free_state(state)
        self._warm.forget(job_id)
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
        jobs = (k.split(AUTO_KEY_SEP)[0] for k in self._states if not k.endswith(_SHADOW_SUFFIX))
        return list(dict.fromkeys(jobs))  # method auto keeps a state per candidate: the job once

    def describe(self) -> dict:
        return {"worker": self.worker_name, "node": self.node,
                "model": self._model_key[0] if self._model_key else None,
                "device": getattr(self._bundle, "device", None), "models_loaded": self.models_loaded,
                "active_jobs": self.active_jobs}

    def spec_of(self, task: ShardTask) -> JobSpec:
        """The task's JobSpec: as it came (same process), or validated once per job and spec hash."""
        if isinstance(task.spec, JobSpec):
            return task.spec
        # the spec hash leaves resources out (a job may resume with other streams_per_actor): key on them too
        key = (task.job_id, task.spec_hash, json.dumps(task.spec.get("resources"), sort_keys=True, default=str))
        if key not in self._specs:
            while len(self._specs) >= _SPEC_CACHE:
                self._specs.pop(next(iter(self._specs)))
            self._specs[key] = JobSpec.model_validate(task.spec)
        return self._specs[key]

    def answer_row(self, spec: JobSpec, row: RowTask, base: Union[RowOrigin, dict], *, job_id: str
                   ) -> tuple[RowRecord, list[ShadowRecord]]:
        """One row outside a shard (``racer-batch shadow`` on a finished job): the output record and, when
        ``spec.shadow`` selects the row, its shadow pair. ``base``: the row's RowOrigin (or a dict of its
        fields). Draft state is scoped to ``job_id``."""
        engine = self._engine_for(spec)
        state = self._state_for(job_id, engine)
        call = RowCall(spec=spec, job_id=job_id, origin=RowOrigin.of(base), should_cancel=lambda: False)
        return drive(self._row_stream(engine, state, row, call))

    # ---- one shard
    def run_shard(self, task: Union[ShardTask, dict]) -> ShardResult:
        """Generate every row of a shard and commit its part file; returns the attempt's ``ShardResult``."""
        task = ShardTask.of(task)
        t0 = time.perf_counter()
        spec = self.spec_of(task)
        plan = task.plan if isinstance(task.plan, InputPlan) else InputPlan.from_dict(task.plan)
        self._ensure_model(spec)
        chooser = None
        if spec.decoding.method == AUTO_METHOD:
            chooser = self._choosers.get(task.job_id)
            if chooser is None:  # the job's actors share their evidence where the sink can (auto.EvidenceShare)
                share = getattr(self.sink, "evidence_share", None)
                chooser = self._choosers[task.job_id] = MethodChooser(
                    spec.decoding.auto_methods, share=share(task.job_id, task.spec_hash) if share else None)
        shard = ShardEngines(spec, task.job_id, slots=self._slots_for(spec), engine_for=self._engine_for_config,
                             state_for=self._state_for, states=self._states, warm=self._warm, chooser=chooser)
        engine = shard.first
        width = self._width(engine, spec, task.row_stop - task.row_start)
        if width > 1 or spec.resources.streams_per_actor != 1:
            log.info("job %s shard %d: %d rows in flight at once (streams_per_actor: %s)", task.job_id, task.shard,
                     width, spec.resources.streams_per_actor)
        verdict = self._make_probe(task)
        writer = ShardWriter(out_dir=spec.output.path, job_id=task.job_id, shard=task.shard, row_range=task.row_range,
                             spec_hash=task.spec_hash, fp_columns=answer_columns(spec.input))
        origin = RowOrigin(id="", row_idx=-1, shard=task.shard, worker=self.worker_name, node=self.node,
                           device=str(getattr(engine.bundle, "device", "cpu")), model=spec.model.name,
                           method=spec.decoding.method, config_hash=spec.decoding.config_hash(), job_id=task.job_id)
        tally = Tally()
        engines: dict[int, tuple[Any, bool]] = {}  # row position -> (its engine, greedy) while it runs
        in_order = _InRowOrder(writer)
        stopped: Optional[str] = None

        def keep_going() -> bool:  # the rows' cancellation: polled by the engine at every step
            return verdict() != KEEP_GOING

        def start(pos: int, row_idx: int, raw: dict) -> Optional[Generator]:
            """Read one row: its stream, or None when it ends at once (the job was stopped)."""
            nonlocal stopped
            row = parse_row(spec, row_idx, raw)
            writer.add_input(row_idx, row.id, raw)
            greedy = row.params is None or row.params.greedy  # a row that did not parse has no params
            method, row_engine, state = shard.pick(row.route, greedy=greedy)
            row_origin = dataclasses.replace(origin, id=row.id, row_idx=row_idx, route=row.route, seed=row.seed,
                                             method=method)
            stopped = stopped or (None if verdict() == KEEP_GOING else verdict())
            if stopped is None:
                call = RowCall(spec=spec, job_id=task.job_id, origin=row_origin, should_cancel=keep_going,
                               method=method if shard.auto else None)
                engines[pos] = (row_engine, greedy)
                return self._row_stream(row_engine, state, row, call)
            end(pos, RowRecord.without_answer(status="cancelled", origin=row_origin,
                                              error=f"job stopped before this row ran ({stopped})"), [])
            return None

        def end(pos: int, rec: RowRecord, pair: list[ShadowRecord], device_ms: Optional[dict] = None,
                prefill_ms: Optional[dict] = None) -> None:
            """A row ended: telemetry now, the part file in row order. ``device_ms``: its share of the batched
            forwards per runner (B > 1), kept on the record (the cost basis of status and reports); ``prefill_ms``:
            the part of it that was its prompt forwards (method auto compares candidates on the rest)."""
            nonlocal stopped
            row_engine, greedy = engines.pop(pos, (engine, True))
            runner_id = id(getattr(row_engine, "runner", None))
            share = (device_ms or {}).get(runner_id)  # its engine's, not a baseline's
            if share:  # batched with other rows; a row that ran alone keeps None: its generation time counts
                rec.device_ms = share
            shard.observe(rec.route, rec.method, rec, greedy=greedy,
                          prefill_ms=(prefill_ms or {}).get(runner_id) if share else None)
            if rec.status == "cancelled":
                stopped = verdict() if verdict() != KEEP_GOING else CANCELLED
            rec.finished_at = now_utc()
            tally.observe_row(rec)
            self.sink.observe(rec, progress=tally)
            in_order.end(pos, rec, pair)

        stats = _feed(self._rows(task, spec, plan), width=width, start=start, end=end)
        assert in_order.waiting == 0, f"shard {task.shard}: {in_order.waiting} rows ended before an earlier one"
        if stopped is None and verdict() == LEASE_LOST:
            stopped = LEASE_LOST  # the job went to another worker while the last rows ran: its copy wins
        meta = writer.summary(tally, worker=self.worker_name, node=self.node, attempt=task.attempt,
                              elapsed_s=time.perf_counter() - t0, streams=width,
                              weights=getattr(self._bundle, "weights", None),  # what ran (model.weights may be unset)
                              batch_sizes={str(b): n for b, n in sorted(stats.sizes.items())}, **shard.summary())
        written = writer.commit(meta, stopped=stopped)
        if written and stopped is None:
            shard.after_commit(f"shard {task.shard} attempt {task.attempt} by {self.worker_name}")
        return ShardResult(summary=meta, stopped=stopped, written=written,
                           path=str(part_path(spec.output.path, task.shard)))

    @staticmethod
    def _rows(task: ShardTask, spec: JobSpec, plan: InputPlan) -> Any:
        """The shard's [(row_idx, raw record)]: the worker's copy, else read from the input."""
        if task.rows is not None:
            return task.rows
        return iter_raw_rows(plan, task.row_start, task.row_stop, list(spec.input.columns.model_dump().values()))

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

    def _row_stream(self, engine: Any, state: Any, row: RowTask, call: "RowCall"
                    ) -> Generator[Any, Any, tuple[RowRecord, list]]:
        """Answer one row ``spec.n_samples`` times (sample 0 with the row's seed) and, when the row is in the
        shadow sample, once more with the baseline config right before or after sample 0.
        A stream for a StreamBatch (the engine's forwards are yielded). Returns the output record and the shadow
        records ([] or [method, baseline]); a row's own failures become its record, never an exception."""
        spec, origin = call.spec, call.origin
        if row.error is not None:
            return RowRecord.without_answer(status="error", error=f"row {row.id!r}: {row.error}", origin=origin), []
        shadow = spec.shadow
        with_shadow = shadow is not None and shadow_selected(shadow.seed, row.id, shadow.fraction)
        first = with_shadow and baseline_first(shadow.seed, row.id)
        pair: list[ShadowRecord] = []
        baseline = lambda ran_first: self._shadow_baseline(row, call, ran_first=ran_first)  # noqa: E731
        if first:
            pair.append((yield from baseline(True)))
        answers: list[tuple[RowRecord, int]] = []  # (record, seed) per sample
        for k in range(spec.n_samples):
            params = row.params if k == 0 else row.params.model_copy(update={"seed": sample_seed(row.seed, k)})
            rec = yield from self._answer(engine, state, row, params, origin, call.should_cancel, method=call.method)
            answers.append((rec, params.seed))
            if k == 0 and with_shadow:
                method = dataclasses.replace(rec, finished_at=now_utc())
                pair.insert(0, ShadowRecord(row=method, run="job", side="method", ran_first=not first,
                                            temperature=row.params.temperature, reference=row.reference))
                if not first:
                    pair.append((yield from baseline(False)))
            if rec.status != "ok":
                break
        if spec.n_samples == 1:
            return answers[0][0], pair
        return RowRecord.from_samples(answers), pair

    def _shadow_baseline(self, row: RowTask, call: "RowCall", *, ran_first: bool
                         ) -> Generator[Any, Any, ShadowRecord]:
        """The baseline side of a shadow pair: the row's sample 0 with the shadow config, its own draft state."""
        spec = call.spec
        assert spec.shadow is not None
        decoding = spec.shadow.decoding()
        engine = self._engine_for_config(decoding, streams=self._slots_for(spec))
        state = self._state_for(_shadow_key(call.job_id), engine)
        origin = dataclasses.replace(call.origin, method=decoding.method, config_hash=decoding.config_hash())
        rec = yield from self._answer(engine, state, row, row.params, origin, call.should_cancel)
        rec.finished_at = now_utc()
        return ShadowRecord(row=rec, run="job", side="baseline", ran_first=ran_first,
                            temperature=row.params.temperature, reference=row.reference)

    def _answer(self, engine: Any, state: Any, row: RowTask, params: Any, origin: RowOrigin,
                should_cancel: Callable[[], bool], *, method: Optional[str] = None) -> Generator[Any, Any, RowRecord]:
        """One answer to the row (every turn) with these params, as a RowRecord (status ok, error or
        cancelled; the turns answered before an error count). ``method``: the engine runs the row with that
        method instead of its own (method auto)."""
        turns: list[Any] = []
        extra = {} if method is None else {"method": method}

        def done(status: str, error: Optional[str]) -> RowRecord:
            return RowRecord.from_turns(turns, status=status, error=error, origin=origin)

        def generate(prompt: Any) -> Generator[Any, Any, GenerationResult]:
            return (yield from engine.stream(prompt, params, state=state, should_cancel=should_cancel, **extra))

        try:
            if row.turns is not None:
                chat = list(row.chat or [])
                for turn in row.turns:
                    chat.append({"role": "user", "content": turn})
                    turns.append((yield from generate(chat)))
                    if turns[-1].finish_reason == "cancelled":
                        break
                    chat.append({"role": "assistant", "content": turns[-1].text})
            else:
                turns.append((yield from generate(_prompt_of(row, engine))))
        except ValueError as exc:
            return done("error", f"row {row.id!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a model failure on one row must not kill the job
            log.warning("model error on row %s: %r", row.id, exc)
            return done("error", f"row {row.id!r}: model error: {type(exc).__name__}: {exc}")
        if turns and turns[-1].finish_reason == "cancelled":
            return done("cancelled", "cancelled during generation")
        return done("ok", None)


def _prompt_of(row: RowTask, engine: Any) -> Any:
    """The row's prompt for the engine: its chat messages, or its raw text where it has no messages or (a
    ``prompt`` row under ``input.prompt_format: auto``, which carries both) the model has no chat template."""
    if row.chat is None:
        return row.raw
    tokenizer = getattr(getattr(engine, "bundle", None), "tokenizer", None)  # an engine stand-in may have none
    if row.raw is not None and tokenizer is not None and not has_chat_template(tokenizer):
        return row.raw
    return row.chat


def _feed(rows: Iterable[tuple[int, dict]], *, width: int,
          start: Callable[[int, int, dict], Optional[Generator]],
          end: Callable[[int, RowRecord, list[ShadowRecord]], None]) -> BatchStats:
    """Continuous batching of a shard's rows: up to ``width`` in flight in one StreamBatch, a row that ends
    making room for the next. ``start(pos, row_idx, raw)`` gives the row's stream (None: it ended already);
    ``end(pos, record, shadow pair)`` takes each row that ran, in the order they end. ``pos`` counts the
    shard's rows from 0. A stream that raises (not a row's failure: those are records) ends the shard with
    its exception, as a failure outside the rows did before. Returns the batch's counters."""
    batch = StreamBatch()
    in_flight: set[int] = set()
    it = enumerate(rows)
    try:
        while True:
            while len(in_flight) < width and (got := next(it, None)) is not None:
                pos, (row_idx, raw) = got
                stream = start(pos, row_idx, raw)
                if stream is not None:
                    batch.add(pos, stream)
                    in_flight.add(pos)
            if not in_flight:
                return batch.stats
            for fin in batch.step():
                in_flight.discard(fin.key)
                if fin.error is not None:
                    raise fin.error
                end(fin.key, *fin.result, device_ms=fin.device_ms, prefill_ms=fin.prefill_ms)
    finally:
        batch.close()


class _InRowOrder:
    """Hands a shard's ended rows to its writer in row order (rows in flight together end in any order)."""

    def __init__(self, writer: ShardWriter) -> None:
        self.writer = writer
        self._next = 0  # the position the writer takes next
        self._ended: dict[int, tuple[RowRecord, list[ShadowRecord]]] = {}

    @property
    def waiting(self) -> int:
        """Rows ended and held back for an earlier one."""
        return len(self._ended)

    def end(self, pos: int, rec: RowRecord, pair: list[ShadowRecord]) -> None:
        self._ended[pos] = (rec, pair)
        while self._next in self._ended:
            rec, pair = self._ended.pop(self._next)
            self.writer.observe_shadow(pair)
            self.writer.observe(rec)
            self._next += 1


_SHADOW_SUFFIX = "\0shadow"
_SPEC_CACHE = 8  # validated specs kept per runner (one per job and spec hash)


def _shadow_key(job_id: str) -> str:
    """Key of a job's shadow-baseline draft state in RowRunner._states (freed with the job's)."""
    return job_id + _SHADOW_SUFFIX
