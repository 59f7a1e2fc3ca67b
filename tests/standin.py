"""A stand-in engine with a fixed cost per step, for service tests and scheduling-overhead benchmarks.

Not part of the shipped package: the service reaches it through the engine hook
(racer_batch/service/execution/engine_hook.py). ``use_standin()`` sets ``RACER_BATCH_ENGINE_HOOK`` to this module's
``STANDIN_HOOK`` and adds the repository root to ``PYTHONPATH``, so worker subprocesses and Ray actors
started afterwards find it too; tests/conftest.py calls it for every test run.

Model name ``stand-in`` (options as a query string: ``stand-in?ms_per_step=2&mat=2&context=512``). It
speaks the Engine interface the service uses (``encode``, ``generate``, ``stream``, ``choose_streams``,
``new_state``, ``free_state``, ``bundle``), "tokenises" by whitespace, and answers with deterministic words
derived from the prompt and the seed (never from ``ms_per_step`` or the batch-mates). Each step emits ``mat``
tokens; its forward is a call on a ``StandInRunner``, which sleeps ``ms_per_step`` once per call, so a
``StreamBatch`` step of B streams costs what one stream's step does (the ideal of batched verification).
A prompt containing ``[[stand-in:raise]]`` raises RuntimeError, standing in for a model error. No weights.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Sequence

from racer_batch.engine.batch import Prefill, Verify, drive
from racer_batch.service.execution.engine_hook import ENGINE_HOOK_ENV
from racer_batch.values import DecodingConfig, GenerationParams, GenerationResult, RowStats, StepRecord

STANDIN_PREFIX = "stand-in"
RAISE_MARKER = "[[stand-in:raise]]"
HOOK_TARGET = "tests.standin:STANDIN_HOOK"  # the RACER_BATCH_ENGINE_HOOK value naming this module's hook
ROOT = Path(__file__).resolve().parents[1]  # the repository root: ``tests.standin`` is importable from it


def is_standin(name: str) -> bool:
    """Whether a model name is the stand-in's: ``stand-in`` or ``stand-in?<options>``."""
    return name == STANDIN_PREFIX or name.startswith(STANDIN_PREFIX + "?")


@dataclass
class StandInBundle:
    name: str
    ms_per_step: float = 0.0
    mat: int = 1
    context_length: int = 2048
    device: str = "cpu"
    dtype: str = "none"
    eos_ids: tuple = ()
    weights: str = "float32"  # what a shard summary records as the weights that ran (issue 31)


def load_standin(name: str) -> StandInBundle:
    """The bundle of a stand-in model name; raises ValueError naming a bad option value."""
    q = urllib.parse.parse_qs(name.partition("?")[2])
    try:
        return StandInBundle(
            name=name, ms_per_step=float(q.get("ms_per_step", ["0"])[0]), mat=int(q.get("mat", ["1"])[0]),
            context_length=int(q.get("context", ["2048"])[0]),
        )
    except ValueError as exc:
        raise ValueError(f"model.name = {name!r}: bad stand-in option: {exc}") from None


class StandInState:
    def __init__(self) -> None:
        self.rows_seen = 0
        self.freed = False

    def free(self) -> None:
        self.freed = True


def _render(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"<{m['role']}> {m['content']}" for m in prompt)


@dataclass
class StandInTree:
    """What a stand-in Verify carries: only the size a StreamBatch counts."""

    size: int


class StandInRunner:
    """The forwards of the stand-in: each call (one stream's prefill or verify, or one batched verify of
    several streams) sleeps ``ms_per_step`` once and returns nothing useful (the stand-in's words come from
    the prompt). ``batch_sizes``: streams per ``verify_batch`` call -> calls."""

    def __init__(self, ms_per_step: float) -> None:
        self.ms_per_step = ms_per_step
        self.batch_sizes: dict[int, int] = {}

    def _forward(self) -> None:
        if self.ms_per_step:
            time.sleep(self.ms_per_step / 1000.0)

    def prefill(self, prompt_ids: list[int], *, cache: Any, topk: int) -> tuple[None, None]:
        self._forward()
        return None, None

    def verify_tree(self, tree: StandInTree, *, cache: Any) -> None:
        self._forward()

    def verify_batch(self, items: Sequence[tuple[StandInTree, Any]]) -> list[None]:
        self._forward()
        self.batch_sizes[len(items)] = self.batch_sizes.get(len(items), 0) + 1
        return [None] * len(items)


class StandInEngine:
    def __init__(self, bundle: StandInBundle, config: Optional[DecodingConfig] = None, *, streams: int = 1) -> None:
        self.bundle = bundle
        self.config = config or DecodingConfig()
        self.streams = streams
        self.runner = StandInRunner(bundle.ms_per_step)

    def new_state(self) -> StandInState:
        return StandInState()

    def free_state(self, state: StandInState) -> None:
        state.free()

    def encode(self, prompt: Any) -> list[int]:
        return [int(hashlib.blake2b(w.encode(), digest_size=2).hexdigest(), 16) for w in _render(prompt).split()]

    def choose_streams(self, choices: Sequence[int]) -> int:
        """A step costs the same for any number of streams here: the most streams win."""
        return max(choices)

    def generate(self, prompt: Any, params: Optional[GenerationParams] = None, *, state: Any = None,
                 should_cancel: Optional[Callable[[], bool]] = None) -> GenerationResult:
        return drive(self.stream(prompt, params, state=state, should_cancel=should_cancel))

    def stream(self, prompt: Any, params: Optional[GenerationParams] = None, *, state: Any = None,
               should_cancel: Optional[Callable[[], bool]] = None) -> Generator[Any, Any, GenerationResult]:
        """``generate`` as a stream (engine/batch.py): yields one Prefill, then one Verify per step."""
        params = params or GenerationParams()
        text_in = _render(prompt)
        if not text_in.strip():
            raise ValueError("empty prompt")
        if RAISE_MARKER in text_in:
            raise RuntimeError("stand-in model error (prompt asked for one)")
        n_prompt = len(self.encode(prompt))
        if n_prompt >= self.bundle.context_length:
            raise ValueError(
                f"prompt has {n_prompt} tokens but the model's context is {self.bundle.context_length}"
            )
        assert state is None or not state.freed, "generate() on a freed draft state"
        if state is not None:
            state.rows_seen += 1
        t0 = time.perf_counter()
        seed = hashlib.sha256(f"{text_in}|{params.seed}".encode()).digest()
        stats = RowStats()
        words: list[str] = []
        finish = "length"
        prefill_ms = 0.0
        step = 0
        while len(words) < params.max_new_tokens:
            if should_cancel is not None and should_cancel():
                finish = "cancelled"
                break
            ts = time.perf_counter()
            emit = 1 if step == 0 else min(self.bundle.mat, params.max_new_tokens - len(words))
            if step == 0:
                yield Prefill(self.runner, [], None, 0)
            else:
                yield Verify(self.runner, StandInTree(size=emit), None)
            for _ in range(emit):
                words.append(f"w{seed[len(words) % len(seed)]}")
            step_ms = (time.perf_counter() - ts) * 1000.0
            if step == 0:
                prefill_ms = step_ms
            stats.observe_step(StepRecord(
                tree_size=1 if step == 0 else self.bundle.mat, accepted_length=emit - 1, emitted=emit,
                accepted_retrieval=emit - 1, accepted_logits=0, accepted_both=0, accepted_other=0,
                draft_ms=0.0, verify_ms=step_ms, update_ms=0.0))
            step += 1
        total_ms = (time.perf_counter() - t0) * 1000.0
        return GenerationResult(
            token_ids=list(range(len(words))), text=" ".join(words), finish_reason=finish,
            prompt_tokens=n_prompt, output_tokens=len(words), prefill_ms=prefill_ms,
            decode_ms=max(0.0, total_ms - prefill_ms), stats=stats,
        )


class StandInHook:
    """The engine hook (racer_batch/service/execution/engine_hook.py EngineHook) serving ``stand-in`` model names."""

    def claims(self, model_name: str) -> bool:
        return is_standin(model_name)

    def load(self, model_name: str) -> StandInBundle:
        return load_standin(model_name)

    def owns(self, bundle: Any) -> bool:
        return isinstance(bundle, StandInBundle)

    def engine(self, bundle: StandInBundle, decoding: DecodingConfig, *, streams: int = 1) -> StandInEngine:
        return StandInEngine(bundle, decoding, streams=streams)


STANDIN_HOOK = StandInHook()


def use_standin() -> None:
    """Serve ``stand-in`` model names with the stand-in engine in this process and in every process it starts
    afterwards (worker subprocesses, a local Ray's actors): sets ``RACER_BATCH_ENGINE_HOOK`` (unless already
    set) and adds the repository root at the end of ``PYTHONPATH`` (unless already there), so that
    ``tests.standin`` imports there without changing which ``racer_batch`` they import."""
    os.environ.setdefault(ENGINE_HOOK_ENV, HOOK_TARGET)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
