"""The engines and draft states one shard of a job answers its rows with.

A job names one decoding method: every row goes to that method's engine and the job's draft state. With
``decoding.method: auto`` the shard has one engine for all candidates of ``decoding.auto_methods``
(``auto_engine_config``) and one job draft state per candidate; each row runs the candidate its route's
``MethodChooser`` picks (service/execution/auto.py) on that engine (``Engine.stream(method=...)``), so rows of
every candidate share each batched forward, and a step whose trees differ in size is charged to its rows by the
engine's measured verify cost (``Engine.measure_step_cost``, ``engine.batch.step_shares``). Either way the states
are warmed and saved through ``WarmStates``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from racer_batch.drafters.registry import get_method
from racer_batch.service.execution.auto import MethodChooser
from racer_batch.service.execution.warm import WarmStates
from racer_batch.values import AUTO_METHOD, DecodingConfig

AUTO_KEY_SEP = "#method="  # a job's draft state per candidate under method auto: "<job id>#method=<name>"


def auto_engine_config(decoding: DecodingConfig) -> DecodingConfig:
    """The config of method auto's one engine: its first candidate that drafts (its capacity sizes the trees
    the runner verifies; AR rows verify their root alone), else its first candidate."""
    names = decoding.auto_methods
    drafting = [n for n in names if get_method(n).drafts]
    return decoding.for_method((drafting or list(names))[0])


def state_key(job_id: str, method: Optional[str]) -> str:
    """Where a runner keeps a job's draft state: the job id, or with method auto one key per candidate."""
    return job_id if method is None else f"{job_id}{AUTO_KEY_SEP}{method}"


class ShardEngines:
    """One shard's engines, states and per-row choice (module docstring).

    Args:
        spec: the job's JobSpec. job_id: its id. slots: rows each engine needs room for.
        engine_for: ``(decoding, streams=) -> engine`` (the runner's engine cache).
        state_for: ``(key, engine, method) -> state``: the runner's draft state under ``key``, made on first use
            (``method``: a candidate of method auto, else None).
        states: the runner's ``{key: (engine, state)}`` of job draft states (a warmed state replaces one here).
        warm: the runner's WarmStates. chooser: the job's MethodChooser (method auto), kept by the runner across
            shards; None otherwise.
    """

    def __init__(self, spec: Any, job_id: str, *, slots: int, engine_for: Callable[..., Any],
                 state_for: Callable[[str, Any], Any], states: dict[str, tuple[Any, Any]], warm: WarmStates,
                 chooser: Optional[MethodChooser]) -> None:
        self.spec, self.job_id, self.warm, self.chooser = spec, job_id, warm, chooser
        self.auto = spec.decoding.method == AUTO_METHOD
        names = spec.decoding.auto_methods if self.auto else (spec.decoding.method,)
        engine = engine_for(auto_engine_config(spec.decoding) if self.auto else spec.decoding, streams=slots)
        measure = getattr(engine, "measure_step_cost", None) if self.auto else None
        if measure is not None:
            measure()  # before any row is in flight: it verifies over a scratch slot
        self.states: dict[str, Any] = {}  # method -> its job draft state
        for name in names:
            method = self._method(name)
            key = state_key(job_id, method)
            state = warm.before_shard(key, spec, engine, state_for(key, engine, method), method)
            states[key] = (engine, state)
            self.states[name] = state
        self.first = engine  # the one engine: chooses B (streams_per_actor: auto) and names the device
        self._since = chooser.counters() if chooser is not None else None  # the shard's evidence starts here

    def pick(self, route: str, *, greedy: bool) -> tuple[str, Any, Any]:
        """``(method, engine, draft state)`` for the next row of ``route``."""
        name = self.chooser.pick(route, greedy=greedy) if self.auto else next(iter(self.states))
        return name, self.first, self.states[name]

    def observe(self, route: str, method: str, record: Any, *, greedy: bool,
                prefill_ms: Optional[float] = None) -> None:
        """A row ended: method auto learns from a finished greedy row's tokens, steps and actor time.

        ``prefill_ms``: the part of the row's actor time (``record.busy_ms``, its share of batched forwards)
        that was its prompt forward; None where the row ran alone (its ``decode_ms`` is then its decode time)."""
        if self.auto and greedy and record.status == "ok":
            tokens = record.output_tokens or 0
            of = getattr(self.first, "context_scale", None)  # an engine hook's stand-in may have none: 1.0
            scale = of((record.prompt_tokens or 0) + tokens / 2) if of is not None else 1.0
            if prefill_ms is not None:
                decode = max(record.busy_ms - prefill_ms, 0.0)
            else:
                decode = float(record.decode_ms or 0.0)
            self.chooser.observe(route, method, tokens=tokens, steps=record.steps or 0, busy_ms=record.busy_ms,
                                 decode_ms=decode, scale=scale)

    def warm_commits(self) -> int:
        """Commits in the states the shard started from (the most among the candidates; 0: all cold)."""
        return max(self.warm.commits_at_start(state_key(self.job_id, self._method(n))) for n in self.states)

    def summary(self) -> dict:
        """What the shard summary adds: ``warm_commits`` and, with method auto, ``method_auto`` (each route's
        evidence from this shard's rows, and the actor's choice at its end)."""
        out: dict[str, Any] = {"warm_commits": self.warm_commits()}
        if self.auto:
            out["method_auto"] = self.chooser.evidence(self._since)
        return out

    def after_commit(self, label: str) -> None:
        """The shard is committed: save every state that learned."""
        for name, state in self.states.items():
            method = self._method(name)
            self.warm.after_commit(state_key(self.job_id, method), self.spec, self.first, state, label=label,
                                   method=method)

    def _method(self, name: str) -> Optional[str]:
        """The method a state is kept and saved under: the candidate with method auto, else None (the job's)."""
        return name if self.auto else None
