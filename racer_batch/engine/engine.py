"""The speculative decoding engine: one loop for every drafter (docs/method.md section 3).

Per step: the drafter proposes a draft tree rooted at the last committed token; the tree is flattened
once (tree.py); the target model verifies it in one forward pass; the accepted path's tokens plus the
bonus token are committed under the exact stop rules; only the accepted KV rows are kept; the drafter
learns from every verified node. The prefill forward is step 0 and emits the first token.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Generator, Sequence, Union

import numpy as np

from ..drafters.base import Verified
from ..drafters.registry import get_method, make_drafter, make_state
from ..drafters.state import DraftState
from ..models import ModelBundle
from ..values import (
    AUTO_METHOD,
    DecodingConfig,
    GenerationParams,
    GenerationResult,
    RowStats,
    StepRecord,
)
from .batch import Decode, Prefill, drive
from .capacity import COST_CONTEXT, LONG_COST_CONTEXT, CapacityTuner, context_scale, cost_at, measure_cost_curve
from .kv_cache import trim_heap
from .runner import make_runner
from .sampling import draw, make_generator, processed_probs
from .step import DecodeRow, Stepper, argmax_and_topk
from .stops import StopChecker

log = logging.getLogger(__name__)

SMALL_BATCH_CAPACITIES = (1, 2, 3)  # extra capacity: auto candidates when several streams share a forward

Prompt = Union[str, Sequence[dict], Sequence[int]]


def _check_messages(messages: list) -> None:
    """Raise ValueError naming the first message that is not ``{"role": ..., "content": str}``."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")


def encode_prompt(tokenizer: Any, prompt: Prompt, *, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt string, or of chat messages rendered with the tokenizer's chat template.

    A plain string is tokenised as is. A list of ``{"role", "content"}`` messages (optionally preceded by
    ``system_prompt``) goes through the chat template with the generation prompt added. A list of ints is
    taken as token ids.

    Raises:
        ValueError: empty prompt, malformed messages, or chat input for a tokenizer without a chat template.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if system_prompt:
            prompt = [{"role": "user", "content": prompt}]
        else:
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = list(prompt)
    if not messages:
        raise ValueError("prompt is empty")
    if set(map(type, messages)) == {int}:  # token ids (the common case, checked at C speed)
        return messages
    if all(isinstance(m, int) and not isinstance(m, bool) for m in messages):
        return [int(m) for m in messages]
    _check_messages(messages)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat messages were given but the tokenizer has no chat template; pass a plain prompt string instead"
        )
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def last_positions(prompt_ids: Sequence[int]) -> np.ndarray:
    """Sorted positions ``[R]`` (int64) of each distinct token's last occurrence in ``prompt_ids``.

    The prompt's top-k rows a drafter reads are those of these positions only: a copy-logit store keeps one
    row per token, the prediction after its most recent occurrence (docs/method.md 2.2: later positions overwrite
    earlier ones), and LogitSpec reads the last position's. So the prefill's output layer and top-k run over
    these rows alone, with the store filled exactly as from every position (on the 24 Spec-Bench prompts of
    the throughput benchmark, 3,382 of 6,412 positions: the output layer is ~20% of a prompt forward).
    """
    ids = np.asarray(prompt_ids, dtype=np.int64)
    if ids.size == 0:
        return np.zeros(0, np.int64)
    _, first_of_reversed = np.unique(ids[::-1], return_index=True)
    return np.sort(ids.size - 1 - first_of_reversed)


class Engine:
    """Generates with the target model under one DecodingConfig.

    Example::

        engine = Engine(load_model("smollm2-135m"), DecodingConfig(method="racer", capacity=16))
        state = engine.new_state()
        result = engine.generate([{"role": "user", "content": "Hi"}], GenerationParams(max_new_tokens=64), state=state)
        engine.free_state(state)
    """

    def __init__(
        self,
        bundle: ModelBundle,
        config: DecodingConfig | None = None,
        *,
        drafter_factory: Callable[[DecodingConfig, DraftState], Any] | None = None,
        streams: int = 1,
    ) -> None:
        """
        Args:
            bundle: the loaded target model.
            config: decoding configuration (default: RACER with the paper's settings).
            drafter_factory: ``(config, state) -> drafter`` replacing the built-in drafters (tests, extensions).
            streams: the most streams this engine will run at once in a ``StreamBatch``: KV-cache slots are
                reserved for them and ``capacity: auto`` measures the verify cost up to that many trees.

        Raises:
            ValueError: ``streams`` < 1, or method ``auto`` (the service's, not an engine's).
        """
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        if config is not None and config.method == AUTO_METHOD:
            raise ValueError("method auto is chosen per row by the batch service among decoding.auto_methods; an "
                             "Engine runs one method (DecodingConfig.for_method)")
        self.streams = int(streams)
        self.bundle = bundle
        self.config = config or DecodingConfig()
        self.drafter_factory = drafter_factory or make_drafter
        t_setup = time.perf_counter()
        self.runner = make_runner(bundle, kind=self.config.runner, compile=self.config.compile)
        self._global_states: dict[str, DraftState] = {}  # scope global: method -> its process-wide state
        self._configs: dict[str, DecodingConfig] = {}  # config_for's cache: method -> this config with it
        self._stream_cost: dict[int, float] | None = None  # choose_streams' cost curve (fixed capacity)
        self._in_flight = 0  # streams of this engine started and not ended (a StreamBatch runs several)
        self.step_cost: dict[int, float] | None = None  # measure_step_cost: {tree rows: verify ms}
        # measure_step_cost at a long context: (context tokens, {tree rows: verify ms}); None where not measured
        self.step_cost_long: tuple[int, dict[int, float]] | None = None
        self.tuner: CapacityTuner | None = None
        self.drafts = get_method(self.config.method).drafts
        sizes = self._tree_sizes()
        reserve = getattr(self.runner, "reserve_slots", None)
        if reserve is not None:
            reserve(self.streams)
        self.runner.warmup(sizes)  # static runner: pack weights / compile every tree size it will use
        self.warmup_s = time.perf_counter() - t_setup  # runner set-up (weight packing) + warm-up, seconds
        if self.config.capacity == "auto" and self.drafts:
            cands = sizes
            # several streams' trees in one forward: the cost of larger totals too (the tuner extrapolates past)
            batch = [r for r in (96, 128) if self.streams > 1 and r <= self.streams * cands[-1]]
            cost = measure_cost_curve(self.runner, sorted(set(cands) | set(batch)))
            log.info("verify cost curve t(T)/t(1): %s", {t: round(ms / cost[1], 2) for t, ms in cost.items()})
            self.tuner = CapacityTuner(cost, cands)
            self.cost_curve_ms = cost
        self.stepper = Stepper(self)
        release = getattr(self.runner, "release_scratch", None)
        if release is not None:
            release()  # the KV pages the warm-up and cost curve wrote (static runner, CPU)
        trim_heap()  # the warm-up's and cost curve's temporaries


    def _tree_sizes(self) -> list[int]:
        """Every tree size this engine will verify: 1 for a method without drafts, the capacity, or with
        ``capacity: auto`` the candidates."""
        if not self.drafts:
            return [1]
        if self.config.capacity != "auto":
            return [int(self.config.capacity)]
        # the configured candidates plus the sizes where this runner's cost steps up (a tree of 6 costs
        # what one of 4 does on our CPU kernels): output-neutral, so the config (and its hash) stays as set
        auto = sorted(set(self.config.auto_capacities))
        sizes = sorted(set(auto) | {s for s in self.runner.step_sizes(auto[-1]) if s >= auto[0]})
        if self.streams > 1:  # with B trees per forward the best tree is small (B x 3 rows at B = 4 on a CPU)
            sizes = sorted(set(sizes) | {c for c in SMALL_BATCH_CAPACITIES if c < sizes[0]})
        return sizes

    def choose_streams(self, choices: Sequence[int]) -> int:
        """How many streams to verify in one forward (``resources.streams_per_actor: auto``): the choice with
        the most expected output tokens per second. With ``capacity: auto`` it is chosen together with the
        capacity from the tuner's observed acceptance and the measured cost curve (``best_streams``); with a
        fixed capacity c from the cost curve alone, ``B / t(B x c)`` (the acceptance per tree does not depend
        on B), measured here once on first use.

        Raises:
            ValueError: no choices.
        """
        choices = sorted(set(int(b) for b in choices))
        if not choices:
            raise ValueError("no stream counts to choose from")
        if self.tuner is not None and self.tuner.steps >= self.tuner.warmup_steps:
            return self.tuner.best_streams(choices)[0]
        cap = self._capacity(1) if self.tuner is None else self.tuner.warmup_cap
        if self._stream_cost is None:
            self._stream_cost = measure_cost_curve(self.runner, sorted({cap * b for b in choices}))
        return max(choices, key=lambda b: b / cost_at(self._stream_cost, b * cap))

    def measure_step_cost(self) -> dict[int, float]:
        """``{rows: ms}`` of one verify forward over that many tree rows after ``COST_CONTEXT`` cached tokens,
        measured once (``measure_cost_curve`` at 1, 2, 4, ... up to twice ``streams`` x capacity, with ``capacity:
        auto``'s own curve merged in) and kept in ``step_cost``; the same sizes after ``LONG_COST_CONTEXT`` tokens
        (less where the model's context is shorter; skipped below twice ``COST_CONTEXT``) in ``step_cost_long``.
        A ``StreamBatch`` splits a step whose trees differ in size by them (``batch.step_shares``: a tree row's
        attention over a long context costs more than the short curve says); call it before rows are in flight
        (it verifies over a scratch slot)."""
        if self.step_cost is None:
            cap = max(1, self._capacity(1) if self.tuner is None else max(self.tuner.candidates))
            top = max(2, 2 * self.streams * cap)
            sizes = sorted({1 << i for i in range(top.bit_length()) if (1 << i) <= top} | {top})
            curve = dict(measure_cost_curve(self.runner, sizes, context_tokens=COST_CONTEXT))
            for rows, ms in (getattr(self, "cost_curve_ms", None) or {}).items():
                curve.setdefault(rows, ms)
            self.step_cost = curve
            long = min(LONG_COST_CONTEXT, int(self.bundle.context_length) - top - 1)
            if long >= 2 * COST_CONTEXT:
                self.step_cost_long = (long, dict(measure_cost_curve(self.runner, sizes, context_tokens=long)))
            log.info("verify cost per forward (ms by tree rows): %s; after %s tokens: %s",
                     {r: round(ms, 2) for r, ms in sorted(curve.items())},
                     self.step_cost_long and self.step_cost_long[0],
                     self.step_cost_long and {r: round(ms, 2) for r, ms in sorted(self.step_cost_long[1].items())})
        return self.step_cost

    def context_scale(self, context: float) -> float:
        """``capacity.context_scale`` over this engine's measured step costs and streams: what a step costs after
        ``COST_CONTEXT`` tokens over one after ``context`` (1.0 until ``measure_step_cost`` measured both curves)."""
        return context_scale(self.step_cost, self.step_cost_long, self.streams, context)

    # ---- state lifecycle (docs/method.md section 7) ----
    def new_state(self, method: str | None = None) -> DraftState:
        """Draft state for one scope. With scope ``global`` every call returns the process-wide state.

        Args:
            method: another lossless method whose rows this engine also runs (``stream(method=...)``): a state
                for that method's drafters (None: this engine's own method). Scope ``global`` keeps one per
                method.

        Raises:
            ValueError: ``method`` is not registered or refuses this config's settings.
        """
        config = self.config_for(method)
        if self.config.scope == "global":
            got = self._global_states.get(config.method)
            if got is None or got.freed:
                got = make_state(config, vocab_size=self.bundle.vocab_size, tokenizer=self.bundle.tokenizer)
                self._global_states[config.method] = got
            return got
        return make_state(config, vocab_size=self.bundle.vocab_size, tokenizer=self.bundle.tokenizer)

    def config_for(self, method: str | None) -> DecodingConfig:
        """This engine's config, or with ``method`` set to another registered method (method auto's candidates
        run their rows on one engine and share its forwards); cached per method.

        Raises:
            ValueError / pydantic.ValidationError: ``method`` is not registered or refuses these settings, or is
                ``auto``.
        """
        if method is None or method == self.config.method:
            return self.config
        got = self._configs.get(method)
        if got is None:
            if method == AUTO_METHOD:
                raise ValueError("a row runs one method: method auto picks it per row (DecodingConfig.for_method)")
            got = self._configs[method] = self.config.for_method(method)
        return got

    def free_state(self, state: DraftState) -> None:
        """Free a job's draft state (a no-op for a global state, which lives as long as the engine)."""
        if not any(state is g for g in self._global_states.values()):
            state.free()

    def encode(self, prompt: Prompt, *, system_prompt: str | None = None) -> list[int]:
        return encode_prompt(self.bundle.tokenizer, prompt, system_prompt=system_prompt)

    def _capacity(self, streams: int = 1) -> int:
        """Capacity of the next step's draft tree when ``streams`` streams of this engine are in flight."""
        if not self.drafts:
            return 1
        if self.tuner is not None:
            return self.tuner.capacity(streams=max(1, streams))
        return int(self.config.capacity)

    # ---- generation ----
    def generate(
        self,
        prompt: Prompt,
        params: GenerationParams | None = None,
        *,
        state: DraftState | None = None,
        system_prompt: str | None = None,
        should_cancel: Callable[[], bool] | None = None,
        keep_steps: bool = False,
        method: str | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (one stream alone, batch size 1).

        Args:
            prompt: a string, or chat messages ``[{"role", "content"}, ...]``.
            params: sampling and stopping parameters (default: greedy, 256 new tokens).
            state: the draft state of the job (scope ``job``); None creates a private one for this call.
                Scope ``request`` always uses a fresh state; scope ``global`` the engine's own.
            should_cancel: polled at every step boundary; True ends generation with ``cancelled``.
            keep_steps: keep one StepRecord per step in ``result.stats.step_records``.
            method: another lossless method for this row (``stream``); None: the engine's own.

        Raises:
            ValueError: empty prompt, no chat template for chat input, a prompt that fills the context, or a
                ``method`` that is not registered.
        """
        return drive(self.stream(prompt, params, state=state, system_prompt=system_prompt,
                                 should_cancel=should_cancel, keep_steps=keep_steps, method=method))

    def stream(
        self,
        prompt: Prompt,
        params: GenerationParams | None = None,
        *,
        state: DraftState | None = None,
        system_prompt: str | None = None,
        should_cancel: Callable[[], bool] | None = None,
        keep_steps: bool = False,
        method: str | None = None,
    ) -> Generator[Any, Any, GenerationResult]:
        """``generate`` as a stream for a ``StreamBatch`` (engine/batch.py): a generator that yields the forward
        it needs next (``Prefill`` once, then one ``Verify`` per step), is sent what the runner returned, and
        returns the ``GenerationResult``. Arguments and errors as ``generate`` (raised from the first ``next``).
        Closing it early releases its KV-cache slot and private draft state.

        Streams of one job may share its draft state (scope ``job``): each row keeps its own automaton
        cursor, so rows in flight together only share what they have learned.

        ``method``: another lossless method for this row (``config_for``; None: the engine's own), with a
        ``state`` made by ``new_state(method)``. Rows of different methods in one ``StreamBatch`` share every
        forward (method auto's candidates: one engine, one forward per step). A row's capacity is the
        engine's (the same config but for the method).

        Raises (besides ``generate``'s):
            ValueError: ``method`` is not registered or refuses the config's settings."""
        params = params or GenerationParams()
        bundle = self.bundle
        cfg = self.config_for(method)
        prompt_ids = self.encode(prompt, system_prompt=system_prompt)
        if len(prompt_ids) >= bundle.context_length:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the model's context is {bundle.context_length}: "
                "shorten the prompt"
            )
        private = False
        if self.config.scope == "request" or state is None:
            state = make_state(cfg, vocab_size=bundle.vocab_size, scope="request", tokenizer=bundle.tokenizer)
            private = True
        if self.config.scope == "global":
            state, private = self.new_state(method), False
        try:
            return (yield from self._stream_ids(prompt_ids, params, state=state, should_cancel=should_cancel,
                                                keep_steps=keep_steps, cfg=cfg))
        finally:
            if private:
                state.free()

    def _stream_ids(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        *,
        state: DraftState | None,
        should_cancel: Callable[[], bool] | None,
        keep_steps: bool,
        cfg: DecodingConfig | None = None,
    ) -> Generator[Any, Any, GenerationResult]:
        bundle, runner = self.bundle, self.runner
        cfg = cfg or self.config
        drafter = self.drafter_factory(cfg, state)
        k = cfg.max_breadth if getattr(drafter, "needs_topk", False) else 0
        want_probs = bool(k) and getattr(drafter, "needs_topk_probs", False)
        stops = StopChecker(
            tokenizer=bundle.tokenizer,
            eos_ids=[*bundle.eos_ids, *params.extra_eos_ids],
            stop=params.stop,
            max_new_tokens=params.max_new_tokens,
            prompt_tokens=len(prompt_ids),
            context_length=bundle.context_length,
        )
        stats = RowStats(keep_steps=keep_steps)
        cache = runner.new_cache(min(len(prompt_ids) + params.max_new_tokens, bundle.context_length))
        self._in_flight += 1
        try:
            result = yield from self._decode(prompt_ids, params, drafter=drafter, cache=cache, stops=stops,
                                             stats=stats, k=k, want_probs=want_probs, should_cancel=should_cancel)
            if state is not None:  # kept for a saved draft state (scope job); a drafter without state has none
                state.learned(prompt_ids, result.token_ids)
            return result
        finally:
            self._in_flight -= 1
            runner.release(cache)
            close = getattr(drafter, "close", None)
            if close is not None:
                close()

    def _prefill(self, prompt_ids: list[int], params: GenerationParams, *, drafter: Any, cache: Any, k: int,
                 gen: Any) -> Generator[Any, Any, tuple[int, int]]:
        """The prompt forward; the drafter learns the prompt. Returns (the first token, the prompt length)."""
        last_logits, prompt_topk = yield Prefill(self.runner, prompt_ids, cache, k,
                                                 last_positions(prompt_ids) if k else None)
        if params.greedy:  # our kernels' argmax where they apply (torch.argmax's first maximal index either way)
            fused = argmax_and_topk(last_logits.reshape(1, -1), 1, getattr(self.runner, "_ops", None))
            first = int(fused[0][0]) if fused is not None else int(last_logits.argmax())
        else:
            first = draw(processed_probs(last_logits, params), gen)
        drafter.start(prompt_ids, prompt_topk.numpy() if prompt_topk is not None else None)
        drafter.update(Verified(np.zeros(0, np.int64), np.zeros((0, max(k, 1)), np.int64), [first]))
        return first, len(prompt_ids)

    def _decode(self, prompt_ids: list[int], params: GenerationParams, *, drafter: Any, cache: Any,
                stops: StopChecker, stats: RowStats, k: int, want_probs: bool,
                should_cancel: Callable[[], bool] | None) -> Generator[Any, Any, GenerationResult]:
        """The prefill (step 0: the first token), then one ``Decode`` per step until a stop rule ends the row;
        the steps themselves run batched in ``step.Stepper`` (module docstring there)."""
        gen = make_generator(params.seed)
        t0 = time.perf_counter()
        first, prompt_len = yield from self._prefill(prompt_ids, params, drafter=drafter, cache=cache, k=k, gen=gen)
        prefill_ms = (time.perf_counter() - t0) * 1000.0
        stats.observe_step(StepRecord(1, 0, 1, 0, 0, 0, 0, 0.0, 0.0, 0.0))
        stops.push(first)
        row = DecodeRow(drafter, cache, stops, params, gen, committed_len=prompt_len, root=first, k=k,
                        want_probs=want_probs, keep_steps=stats.keep_steps, finish=stops.finish)
        row.done = row.finish is not None
        t_decode = time.perf_counter()
        self.stepper.open(row)
        try:
            if should_cancel is not None and should_cancel():  # asked before the first step too
                row.finish = "cancelled"
            else:  # one standing request: the runner resumes this stream once the row is done or cancelled
                request = Decode(self.stepper, row, should_cancel)
                while not row.done:
                    yield request
        finally:
            self.stepper.close(row, stats)
        finish = row.finish
        decode_ms = (time.perf_counter() - t_decode) * 1000.0
        stats.capacity = self._capacity(self._in_flight)
        return GenerationResult(
            token_ids=list(stops.tokens),
            text=stops.text(),
            finish_reason=finish or "length",
            prompt_tokens=len(prompt_ids),
            output_tokens=len(stops.tokens),
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            stats=stats,
        )
