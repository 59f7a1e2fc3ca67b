"""Host time per stream-step of the decode loop, split by part, at two revisions measured interleaved.

The host time is what the Python/CPU side of the engine spends between and around the model forwards:
drafting, flattening the trees, acceptance, stop rules, keeping KV rows, drafter updates, telemetry, and
the plumbing around them. It is measured as the decode loop's wall time minus the time spent inside the
runner's forward entry points, for two revisions of the code in one run, so that a before/after comparison
holds on a noisy shared machine:

- ``--base REV``: a git revision (default ``origin/main`` where it exists, else ``HEAD``), its
  ``racer_batch`` package unpacked from ``git archive`` into a temporary folder;
- ``--head WORKTREE`` (default): this checkout as it is (or any git revision).

Each round runs every job once per revision, each in its own child process (``python -m benchmarks.host
--child SPEC``, started by ``benchmarks.common.run_child``: its working folder holds only a link to the
harness, ``PYTHONPATH`` starts with the revision's folder, and the child checks that ``racer_batch`` came from
there), base then head in even rounds and head then base in odd ones. A job is one model and decoding setting
at every B of the grid (``--child-per setting``, the default: one model load and one engine per
child, a fresh job draft state per B) or at one B (``--child-per b``: a child per B, closest pairs in time,
~4 s more per child). Per B, a child warms the engine (KV cache grown to the longest row; B streams of the
shortest prompt decoded for 8 tokens), then greedy-decodes Spec-Bench first turns (chat template, short and
long categories alternating, as in ``benchmarks.throughput``) with continuous batching: at most B streams in
flight, a finished stream replaced by the next prompt; ``min(2 B + 8, --max-prompts)`` prompts, so the batch
stays full for most of the run. torch runs on ``--threads`` threads (default 2).

Parts and how they are measured:

- forward: the runner's ``prefill``, ``verify_tree``, ``verify_batch`` and, where present, ``verify_flat``,
  wrapped at the instance level with ``perf_counter`` accumulators (nested calls counted once);
- a revision whose ``StreamBatch`` keeps its own split (``batch.stats.host_ms``: part -> ms) is read from
  there (split ``own``), nothing else wrapped;
- otherwise (split ``wrapped``, the landed engine) the child wraps, before the run: each drafter's ``propose``
  and ``update`` (the engine's drafter factory wrapped, so every drafter it makes), the engine module's
  ``flatten_tree`` (flatten), ``accept_greedy`` / ``accept_sampling`` / ``accept_relaxed`` (accept),
  ``StopChecker.push`` (stops), the runner's ``keep_rows`` (keep_rows), ``RowStats.observe_step`` and
  ``CapacityTuner.observe`` (telemetry), and its ``argmax_and_topk`` (scores: the fused argmax / top-k of a
  racer step; its AR steps call ``logits.argmax`` inline, left in ``other``). In that engine the StepRecord is
  built inline, so its arithmetic falls in ``other``; the drafter's ``update`` after the prefill and the first
  ``push`` count too (one each per stream).
- ``scores``: the argmax / top-k over a decode step's logits (outside the runner's forward in both engines;
  on a GPU it is device work over logits that stay there). The summary shows the host time with it (``host
  µs/ss``) and without it (``host ex-scores``).
- ``other`` = host minus the named parts: the StreamBatch and generator plumbing, stream set-up and teardown (draft
  state, stop checker, KV slot, the drafter's prompt indexing), the StepRecord and whatever else is not named.

Wrapping costs time of its own. Each child calibrates a wrapper on a no-op called with keywords (median of 5 x
20,000 calls): ``extra`` = what one wrapped call adds to the caller's wall time, ``inner`` = what a wrapper
records for a no-op. A wrapped run is corrected with them: wall and host minus calls x extra, each part minus
its calls x inner (``wrap`` in the split table: the correction per stream-step). The calibration is taken hot, so
the corrected host of a wrapped run can still hold a few µs per stream-step of wrapping. ``--plain-too`` also
runs each wrapped config without the part wrappers (forward timers only; the two runs' order alternated per
round): the summary's figures then come from that unwrapped run and the split from the wrapped one (both shown
in the split table). It doubles the wrapped revision's decoding time, so it is off by default.

Figures per config (model, setting, B), each the median over rounds:

- host µs/ss: host time (µs) per decode stream-step; stream-steps = ``BatchStats.streams`` (the sum over the
  batched verify steps of the streams in each; a prefill is not a step). Host time covers the whole measured
  loop (stream set-up and prefill-side host work included, amortised over the decode stream-steps);
- head/base: the median of the per-round ratios (each pair measured close in time; below 1: head faster);
- host share: host time over the wall time of the loop;
- forward ms/step: verify forward time (prefills excluded) per batched step;
- tokens/s: output tokens over the loop's wall time (a wrapped run's corrected wall); MAT: output tokens per
  target forward of a row (its prefill counted as one); streams/step: stream-steps per batched step (the mean B);
- split: µs per stream-step of each part, and the host time of the run it comes from.

Default sizes are trimmed to keep a full default run near 15 minutes on an idle 2-core machine: 32 new tokens
on tiny-random and 48 on smollm2-135m (``--max-new-tokens 64`` / ``smollm2-135m=128`` for longer rows) and
``min(2 B + 8, max(B + 8, 16))`` prompts per B (``--max-prompts``). A machine busy with other work makes every
figure larger and noisier (the load average at start and end is in the report).

Writes ``<out>/host-<stamp>.json`` (every raw run, per round and revision) and ``.md``, rewritten after every
round (a run stopped midway keeps the rounds it finished).

    python -m benchmarks.host                                 # full grid, base origin/main or HEAD vs the worktree
    python -m benchmarks.host --quick                         # a small grid
    python -m benchmarks.host --base HEAD~1 --head HEAD --rounds 3
    python -m benchmarks.host --no-base --grid "tiny-random=2" --methods racer-c4,ar --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import common

PARTS = ("propose", "flatten", "accept", "stops", "keep_rows", "update", "telemetry")
FORWARDS = ("prefill", "verify_tree", "verify_batch", "verify_flat")
DEFAULT_GRID = "tiny-random=1,8,32,64;smollm2-135m=1,8,16"
QUICK_GRID = "tiny-random=1,8;smollm2-135m=1,8"
DEFAULT_METHODS = "racer-c4,racer-c16,ar"
DEFAULT_TOKENS = {"tiny-random": 32, "smollm2-135m": 48}
QUICK_TOKENS = {"tiny-random": 16, "smollm2-135m": 24}
DEFAULT_MAX_PROMPTS = 16
WARM_TOKENS = 8


# =====================================================================================================
# child side: runs against the revision's racer_batch (PYTHONPATH starts with its folder), which may be older
# than this harness: racer_batch is imported inside the functions, and only what the landed engine had
# =====================================================================================================
class Timers:
    """Milliseconds and calls per name; ``wrap`` makes a timed version of a callable (a call made while
    another of this set's wrappers is running is not counted again)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0

    def wrap(self, fn: Any, name: str) -> Any:
        pc = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (pc() - t0) * 1000.0
                self.calls[name] = self.calls.get(name, 0) + 1
                self.depth -= 1

        return timed


class Patches:
    """Attributes replaced for one run and put back after it (instance attributes removed again)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, obj: Any, name: str, timers: Timers, part: str) -> None:
        own = vars(obj).get(name, None) if hasattr(obj, "__dict__") else None
        had = hasattr(obj, "__dict__") and name in vars(obj)
        timed = timers.wrap(getattr(obj, name), part)
        setattr(obj, name, staticmethod(timed) if isinstance(own, staticmethod) else timed)
        self._undo.append((obj, name, had, own))

    def set(self, obj: Any, name: str, value: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()


def calibrate(calls: int = 20000, repeats: int = 5) -> dict:
    """A wrapper's own cost on a no-op called with keywords: ``extra_us`` added to the caller per call (median
    of ``repeats``), ``inner_us`` recorded by the wrapper per call. Measured hot, so a lower bound of the cost in
    the decode loop (``--plain-too`` shows the rest)."""
    def noop(x: Any, *, capacity: Any = None, max_depth: Any = None) -> Any:  # called as propose is
        return x

    timers = Timers()
    timed = timers.wrap(noop, "noop")
    plain_s, wrapped_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            noop(i, capacity=i, max_depth=i)
        t1 = time.perf_counter()
        for i in range(calls):
            timed(i, capacity=i, max_depth=i)
        t2 = time.perf_counter()
        plain_s.append(t1 - t0)
        wrapped_s.append(t2 - t1)
    extra = max(0.0, (statistics.median(wrapped_s) - statistics.median(plain_s)) / calls * 1e6)
    inner = timers.ms["noop"] * 1000.0 / timers.calls["noop"]
    return {"extra_us": round(extra, 4), "inner_us": round(inner, 4)}


def wrap_forwards(patches: Patches, runner: Any, timers: Timers, evict_mb: int = 0) -> None:
    """Time the runner's forwards; with ``evict_mb``, each decode forward (not the prefill) then adds 1 to every
    byte of an ``evict_mb`` MiB buffer inside the timed call, so the host work after it finds the CPU caches
    holding that buffer, as after a real model's forward (``--evict-mb``)."""
    if evict_mb > 0:
        import numpy as np

        buf = np.zeros(evict_mb << 20, dtype=np.uint8)

        def evicting(fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                np.add(buf, 1, out=buf)
                return out
            return call

        for name in FORWARDS[1:]:
            if callable(getattr(runner, name, None)):
                patches.set(runner, name, evicting(getattr(runner, name)))
    for name in FORWARDS:
        if callable(getattr(runner, name, None)):
            patches.wrap(runner, name, timers, name)


def wrap_parts(patches: Patches, engine: Any, timers: Timers) -> None:
    """The landed engine's parts (module docstring), wrapped until ``patches.restore()``."""
    import racer_batch.engine.engine as engine_mod
    from racer_batch.engine.capacity import CapacityTuner
    from racer_batch.engine.stops import StopChecker
    from racer_batch.values import RowStats

    for name in ("flatten_tree", "accept_greedy", "accept_sampling", "accept_relaxed"):
        if hasattr(engine_mod, name):
            patches.wrap(engine_mod, name, timers, "flatten" if name == "flatten_tree" else "accept")
    if hasattr(engine_mod, "argmax_and_topk"):  # the fused argmax / top-k of a decode step (racer, not AR)
        patches.wrap(engine_mod, "argmax_and_topk", timers, "scores")
    patches.wrap(StopChecker, "push", timers, "stops")
    patches.wrap(engine.runner, "keep_rows", timers, "keep_rows")
    patches.wrap(RowStats, "observe_step", timers, "telemetry")
    patches.wrap(CapacityTuner, "observe", timers, "telemetry")
    factory = engine.drafter_factory

    def timed_factory(config: Any, state: Any) -> Any:
        drafter = factory(config, state)
        for method in ("propose", "update"):
            if hasattr(drafter, "__dict__") and callable(getattr(drafter, method, None)):
                setattr(drafter, method, timers.wrap(getattr(drafter, method), method))
        return drafter

    patches.set(engine, "drafter_factory", timed_factory)


def decode_all(engine: Any, prompt_ids: list[list[int]], streams: int, max_new_tokens: int) -> dict:
    """Greedy-decode every prompt with at most ``streams`` in flight (continuous batching); the loop's wall
    time, output tokens, row forwards and the StreamBatch's counters.

    Raises:
        RuntimeError: a stream ended with an error (chained).
    """
    from racer_batch.engine.batch import StreamBatch
    from racer_batch.values import GenerationParams

    params = GenerationParams(max_new_tokens=max_new_tokens)
    state = engine.new_state()
    batch = StreamBatch()
    todo = list(range(len(prompt_ids)))
    tokens = row_steps = 0
    t0 = time.perf_counter()
    try:
        while todo or len(batch):
            while todo and len(batch) < streams:
                i = todo.pop(0)
                batch.add(i, engine.stream(prompt_ids[i], params, state=state))
            for done in batch.step():
                if done.error is not None:
                    raise RuntimeError(f"prompt {done.key} failed at B={streams}") from done.error
                tokens += done.result.output_tokens
                row_steps += done.result.stats.steps
    finally:
        batch.close()
        engine.free_state(state)
    wall_ms = (time.perf_counter() - t0) * 1000.0
    st = batch.stats
    return {"wall_ms": wall_ms, "output_tokens": tokens, "row_steps": row_steps, "steps": st.steps,
            "stream_steps": st.streams, "prefills": st.prefills, "rows": st.rows,
            "host_ms": dict(getattr(st, "host_ms", None) or {})}


def own_split() -> bool:
    """Whether this revision's StreamBatch keeps its own host split (``stats.host_ms``)."""
    from racer_batch.engine.batch import StreamBatch

    return hasattr(StreamBatch().stats, "host_ms")


def one_run(engine: Any, prompt_ids: list[list[int]], streams: int, max_new_tokens: int, *, wrap: bool,
            evict_mb: int = 0) -> dict:
    """One measured decode of the prompts: forwards always timed, the parts wrapped when ``wrap``; each decode
    forward followed by an ``evict_mb`` MiB sweep, counted in the forward (``wrap_forwards``)."""
    forwards, parts, patches = Timers(), Timers(), Patches()
    try:
        wrap_forwards(patches, engine.runner, forwards, evict_mb)
        if wrap:
            wrap_parts(patches, engine, parts)
        gc.collect()
        got = decode_all(engine, prompt_ids, streams, max_new_tokens)
    finally:
        patches.restore()
    own = got.pop("host_ms")
    got.update(forward_ms=forwards.ms, forward_calls=forwards.calls, parts_ms=parts.ms if wrap else own,
               part_calls=parts.calls if wrap else {})
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in got.items()}


def warm(engine: Any, prompt_ids: list[list[int]], streams: int, max_new_tokens: int) -> None:
    """First-touch costs outside the measurement: the KV cache grown to the longest row, then B streams of
    the shortest prompt for a few tokens (the batched verify at B, its buffers)."""
    runner = engine.runner
    if hasattr(runner, "new_cache") and hasattr(runner, "release"):
        runner.release(runner.new_cache(max(len(p) for p in prompt_ids) + max_new_tokens))
    shortest = min(prompt_ids, key=len)
    decode_all(engine, [shortest] * streams, streams, min(WARM_TOKENS, max_new_tokens))


def measure_b(engine: Any, prompt_ids: list[list[int]], streams: int, spec: dict, rnd: int) -> dict:
    ids = prompt_ids[: spec["prompts"][str(streams)]]
    warm(engine, ids, streams, spec["max_new_tokens"])
    own = own_split()
    rec: dict = {"streams": streams, "prompts": len(ids), "split": "own" if own else "wrapped"}
    plain_first = rnd % 2 == 0
    evict = int(spec.get("evict_mb", 0))
    if spec.get("plain_too") and not own and plain_first:
        rec["plain"] = one_run(engine, ids, streams, spec["max_new_tokens"], wrap=False, evict_mb=evict)
    rec.update(one_run(engine, ids, streams, spec["max_new_tokens"], wrap=not own, evict_mb=evict))
    if spec.get("plain_too") and not own and not plain_first:
        rec["plain"] = one_run(engine, ids, streams, spec["max_new_tokens"], wrap=False, evict_mb=evict)
    return rec


def child_main(spec_path: str) -> int:
    """The child process: one model and setting at every B of the job in the JSON file ``spec_path`` (written
    by :func:`run_job`; ``src`` the revision's folder); prints the ``RESULT`` line ``common.run_child`` reads.

    Raises:
        SystemExit: ``racer_batch`` was not imported from ``src`` (``common.check_origin``).
        RuntimeError: a stream ended with an error.
    """
    spec = json.loads(Path(spec_path).read_text())
    package = common.check_origin(spec["src"])
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from racer_batch.engine import Engine
    from racer_batch.models import load_model
    from racer_batch.values import DecodingConfig

    t0 = time.perf_counter()
    bundle = load_model(spec["model"], device="cpu", dtype="float32")
    engine = Engine(bundle, DecodingConfig(method=spec["method"], capacity=spec["capacity"]),
                    streams=max(spec["streams"]))
    prompt_ids = [engine.encode(p) for p in spec["messages"]]
    setup_s = time.perf_counter() - t0
    cal = calibrate()
    runs = [measure_b(engine, prompt_ids, b, spec, int(spec["round"])) for b in spec["streams"]]
    common.print_result({"racer_batch": str(package),
                         "runner": getattr(engine.runner, "kind", type(engine.runner).__name__),
                         "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                         "setup_s": round(setup_s, 2), "calibration": cal, "runs": runs})
    return 0


# =====================================================================================================
# parent side: revisions, jobs, summary, report (this checkout's racer_batch only, for the machine, the prompts
# and the Markdown tables; the decoding runs in the children)
# =====================================================================================================
def parse_grid(text: str) -> dict[str, list[int]]:
    """``"tiny-random=1,8;smollm2-135m=1"`` -> ``{"tiny-random": [1, 8], "smollm2-135m": [1]}``.

    Raises:
        ValueError: a part that is not ``MODEL=B[,B...]`` with positive integers.
    """
    grid: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        model, eq, bs = part.partition("=")
        items = [b.strip() for b in bs.split(",") if b.strip()]
        if not eq or not model.strip() or not items or not all(b.isdigit() and int(b) > 0 for b in items):
            raise ValueError(f"--grid: {part!r} is not MODEL=B[,B...] with positive integers")
        grid[model.strip()] = sorted({int(b) for b in items})
    if not grid:
        raise ValueError("--grid is empty")
    return grid


def parse_methods(text: str) -> list[tuple[str, str, int]]:
    """``"racer-c4,ar"`` -> ``[("racer-c4", "racer", 4), ("ar", "ar", 1)]`` (method ``-c<capacity>``).

    Raises:
        ValueError: a label that is not ``ar`` or ``<method>-c<positive int>``.
    """
    out = []
    for label in filter(None, (m.strip() for m in text.split(","))):
        if label == "ar":
            out.append(("ar", "ar", 1))
            continue
        method, sep, cap = label.rpartition("-c")
        if not sep or not method or not cap.isdigit() or int(cap) < 1:
            raise ValueError(f"--methods: {label!r} is not 'ar' or METHOD-cCAPACITY (e.g. racer-c4)")
        out.append((label, method, int(cap)))
    if not out:
        raise ValueError("--methods is empty")
    return out


def parse_tokens(text: Optional[str], models: list[str], defaults: dict[str, int]) -> dict[str, int]:
    """New tokens per model: ``None`` -> the defaults (64 for other models), ``"32"`` -> every model,
    ``"tiny-random=16,smollm2-135m=32"`` -> per model (the others keep their default).

    Raises:
        ValueError: not a positive int or MODEL=N list.
    """
    out = {m: defaults.get(m, 64) for m in models}
    if text is None:
        return out
    if text.strip().isdigit() and int(text) > 0:
        return {m: int(text) for m in models}
    for part in filter(None, (p.strip() for p in text.split(","))):
        model, eq, n = part.partition("=")
        if not eq or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--max-new-tokens: {part!r} is not N or MODEL=N")
        out[model.strip()] = int(n)
    return out


def pick_prompts(n: int) -> list[list[dict]]:
    """``n`` Spec-Bench first turns as chat messages, as ``benchmarks.throughput`` picks them
    (``common.spec_bench_prompts``).

    Raises:
        ValueError: ``n`` < 1.
    """
    from racer_batch.benchdata import conversation

    return [conversation([it.turns[0]], []) for it in common.spec_bench_prompts(n)]


def prompts_for(streams: int, cap: int) -> int:
    """Prompts decoded at B streams: ``2 B + 8`` (two waves and a tail, continuous batching), capped at ``cap``
    but never below ``B + 8`` (the batch full at the start, a few streams joining later).

    >>> [prompts_for(b, 16) for b in (1, 8, 16, 32, 64)]
    [10, 16, 24, 40, 72]
    """
    return min(2 * streams + 8, max(streams + 8, cap))


def jobs_of(grid: dict[str, list[int]], methods: list[tuple[str, str, int]], per_b: bool) -> list[dict]:
    """One job per (model, setting), holding every B of the model's grid, or one per B with ``per_b``."""
    jobs = []
    for model, bs in grid.items():
        for label, method, cap in methods:
            for chunk in ([[b] for b in bs] if per_b else [bs]):
                jobs.append({"model": model, "setting": label, "method": method, "capacity": cap, "streams": chunk})
    return jobs


def run_job(src: Path, spec: dict, tmp: Path, timeout_s: float) -> dict:
    """One child process (``python -m benchmarks.host --child SPEC``) on the revision in ``src``; its result.
    The spec goes to the child as a JSON file under ``tmp``, removed afterwards.

    Raises:
        RuntimeError: the child failed, ran past ``timeout_s`` seconds or printed no result.
    """
    path = tmp / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(dict(spec, src=str(src))))
    try:
        return common.run_child("host", ["--child", str(path)], src=src, tmp=tmp, timeout_s=timeout_s,
                                what=f"{spec['model']} {spec['setting']}")
    finally:
        path.unlink(missing_ok=True)


def _figures(run: dict, overhead_ms: float = 0.0) -> dict:
    """The headline figures of one run, its wall time less ``overhead_ms`` (a wrapped run's correction)."""
    wall_ms = run["wall_ms"] - overhead_ms
    fwd = run["forward_ms"]
    host_ms = wall_ms - sum(fwd.values())
    steps, ss = run["steps"], max(run["stream_steps"], 1)
    return {"host_us": host_ms * 1000.0 / ss, "host_share": host_ms / wall_ms if wall_ms > 0 else None,
            "forward_ms_per_step": sum(v for k, v in fwd.items() if k != "prefill") / steps if steps else None,
            "streams_per_step": run["stream_steps"] / steps if steps else None,
            "prefill_ms": fwd.get("prefill", 0.0), "tokens_per_s": run["output_tokens"] / wall_ms * 1000.0,
            "mat": run["output_tokens"] / run["row_steps"] if run["row_steps"] else None}


def derive(run: dict, cal: dict) -> dict:
    """The reported figures of one raw run (module docstring). The split comes from the run itself (a wrapped
    run corrected by the calibration: wall less calls x extra, each part less its calls x inner); the headline
    figures from its unwrapped twin where there is one (``--plain-too``), else from the same run."""
    calls = run.get("part_calls", {})
    overhead_ms = sum(calls.values()) * cal["extra_us"] / 1000.0
    fig = _figures(run, overhead_ms)
    ss = max(run["stream_steps"], 1)
    parts = dict.fromkeys(PARTS, 0.0)
    for name, ms in run["parts_ms"].items():
        parts[name] = max(0.0, ms - calls.get(name, 0) * cal["inner_us"] / 1000.0) * 1000.0 / ss
    parts["other"] = fig["host_us"] - sum(parts.values())
    fig["host_ex_us"] = fig["host_us"] - parts.get("scores", 0.0)
    out = dict(fig, parts_us=parts, split=run["split"], split_host_us=fig["host_us"],
               wrap_us=overhead_ms * 1000.0 / ss,
               headline="own split" if run["split"] == "own" else "wrapped run, corrected")
    if "plain" in run:
        out.update(_figures(run["plain"]), headline="unwrapped run")
        out["plain_host_us"] = out["host_us"]
        out["host_ex_us"] = out["host_us"] - parts.get("scores", 0.0)
    return out


def _ratios(head: list[dict], base: list[dict], key: str) -> list[float]:
    """head / base of ``key`` per round (both lists indexed by round)."""
    return [h[key] / b[key] for h, b in zip(head, base) if h.get(key) is not None and b.get(key)]


def part_names(derived: list[dict]) -> list[str]:
    """PARTS, then any other part a revision reports (sorted), then ``other``."""
    extra = {p for d in derived for p in d["parts_us"] if p not in PARTS and p != "other"}
    return [*PARTS, *sorted(extra), "other"]


def _side(derived: list[dict]) -> dict:
    """Medians over rounds of one revision's derived figures for one config."""
    if not derived:
        return {}
    names = part_names(derived)
    keys = ("host_us", "host_ex_us", "host_share", "forward_ms_per_step", "streams_per_step", "tokens_per_s", "mat",
            "wrap_us", "split_host_us", "plain_host_us")
    side = {k: common.median([d.get(k) for d in derived]) for k in keys}
    side["parts_us"] = {p: common.median([d["parts_us"].get(p) for d in derived]) for p in names}
    side["split"], side["headline"] = derived[-1]["split"], derived[-1]["headline"]
    return side


def summarize(raw: list[dict]) -> list[dict]:
    """One row per (model, setting, B): each revision's medians over rounds and the per-round ratios."""
    by: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in raw:
        key = (r["model"], r["setting"], r["streams"])
        by.setdefault(key, {}).setdefault(r["revision"], {})[r["round"]] = r["derived"]
    rows = []
    for (model, setting, b), revs in by.items():
        rounds = sorted(set(revs.get("base", {})) & set(revs.get("head", {})))
        base = [revs["base"][i] for i in rounds]
        head = [revs["head"][i] for i in rounds]
        row = {"model": model, "setting": setting, "streams": b,
               "base": _side(list(revs.get("base", {}).values())), "head": _side(list(revs.get("head", {}).values())),
               "host_ratio": common.median(_ratios(head, base, "host_us")),
               "host_ex_ratio": common.median(_ratios(head, base, "host_ex_us")),
               "tokens_ratio": common.median(_ratios(head, base, "tokens_per_s"))}
        rows.append(row)
    return rows


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return ""
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


RATIO_KEYS = {"host_us": "host_ratio", "host_ex_us": "host_ex_ratio", "tokens_per_s": "tokens_ratio"}


def summary_table(rows: list[dict], revs: list[str]) -> tuple[list[str], list[list[str]]]:
    """Column names and cell texts of the summary (one line per config)."""
    both = len(revs) == 2
    per_rev = (("host µs/ss", "host_us", 1), ("host ex-scores µs/ss", "host_ex_us", 1), ("host share", "host_share", 3),
               ("fwd ms/step", "forward_ms_per_step", 2), ("tokens/s", "tokens_per_s", 1), ("MAT", "mat", 2))
    cols = ["model", "setting", "B"]
    for name, key, _ in per_rev:
        cols += [f"{r} {name}" for r in revs]
        cols += [f"{name} head/base"] * (both and key in RATIO_KEYS)
    cols.append("streams/step")
    cells = []
    for row in rows:
        line = [row["model"], row["setting"], str(row["streams"])]
        for _name, key, nd in per_rev:
            line += [_f(row[r].get(key), nd) for r in revs]
            if both and key in RATIO_KEYS:
                line.append(_f(row[RATIO_KEYS[key]], 3))
        line.append(_f(row[revs[-1]].get("streams_per_step"), 1))
        cells.append(line)
    return cols, cells


def split_table(rows: list[dict], revs: list[str]) -> tuple[list[str], list[list[str]]]:
    """Column names and cell texts of the per-part split (one line per config and revision)."""
    names = part_names([row[r] for row in rows for r in revs if row[r]])
    plain = any(row[r].get("plain_host_us") is not None for row in rows for r in revs)
    cols = ["model", "setting", "B", "rev", "split", *names, "host", "wrap", *(["plain"] if plain else [])]
    cells = []
    for row in rows:
        for r in revs:
            side = row[r]
            cells.append([row["model"], row["setting"], str(row["streams"]), r, side.get("split", ""),
                          *[_f(side.get("parts_us", {}).get(p)) for p in names], _f(side.get("split_host_us")),
                          _f(side.get("wrap_us"), 2), *([_f(side.get("plain_host_us"))] if plain else [])])
    return cols, cells


def render_md(d: dict) -> str:
    """The report: settings, machine, the summary table and the per-part split."""
    m, s = d["machine"], d["settings"]
    revs = [r for r in ("base", "head") if r in d["revisions"]]
    cal = ", ".join(f"{r} {c['extra_us']:.2f} / {c['inner_us']:.2f} µs" for r, c in d["calibration"].items())
    lines = [f"# Host time per stream-step, {' vs '.join(revs)} ({d['stamp']})", "",
             f"Reproduce: `{d['command']}`", "",
             f"Machine: {common.machine_line(m)}; torch {d.get('torch', m.get('torch', '?'))} with "
             f"{s['threads']} threads, Python {m['python']}; load average {m['load']} at start, "
             f"{d.get('load_end', '?')} at the last write.", "",
             *[f"- {r}: `{d['revisions'][r]}`; split: {d['splits'].get(r, '?')}; headline figures from the "
               + ", ".join(sorted({row[r]['headline'] for row in d['rows'] if row[r]})) for r in revs], "",
             f"Settings: {s['rounds_done']} of {s['rounds']} rounds, a child process per revision per "
             f"{'B' if s['child_per'] == 'b' else 'model and setting'} (order alternated per round); greedy, "
             f"Spec-Bench first turns, min(2B+8, max(B+8, {s['max_prompts']})) prompts per B, continuous batching; "
             "new tokens " + ", ".join(f"{k} {v}" for k, v in s["max_new_tokens"].items())
             + f"; a wrapper's cost per call (median over children, extra / inner): {cal or 'none'}"
             + (f"; after each decode forward a {s['evict_mb']} MiB buffer swept inside the timed forward "
                "(`--evict-mb`: the host work finds the caches cold, as after a real model's forward)"
                if s.get("evict_mb") else "") + ".", ""]
    split_note = ("Split of the host time, µs per stream-step (median over rounds of each part; `host`: the host "
                  "time of the run the split comes from; `wrap`: the wrapping correction already taken off a "
                  "wrapped run's host time; `plain`, where run: the host time of the same config without part "
                  "wrappers, the summary's figure):")
    for title, (cols, cells) in (("Summary (medians over rounds):", summary_table(d["rows"], revs)),
                                 (split_note, split_table(d["rows"], revs))):
        lines += [title, "", common.md_table(cols, cells), ""]
    lines += ["Columns: host µs/ss = (loop wall - runner forward time) per decode stream-step (BatchStats.streams); "
              "host ex-scores = the same less the `scores` part, the argmax / top-k over the decode logits (device "
              "work on a GPU, where the logits stay; a landed engine's only where it calls `argmax_and_topk`, its "
              "racer path: its AR argmax stays in `other`, so an AR ratio of this column flatters the head); "
              "head/base = median of the per-round ratios (below 1: head faster); host share = host / wall; fwd "
              "ms/step = verify forward ms per batched step (prefills excluded); tokens/s = output tokens / wall; "
              "MAT = output tokens per row forward (prefill counted); streams/step = stream-steps per batched step "
              "(the mean B: below B while the batch fills and drains). Parts: the docstring of "
              "benchmarks/host.py says how each is measured; `other` = host minus the named parts.", ""]
    return "\n".join(lines)


def measure(*, base: Optional[str], head: str, grid: dict[str, list[int]], methods: list[tuple[str, str, int]],
            tokens: dict[str, int], max_prompts: int, rounds: int, threads: int, per_b: bool = False,
            plain_too: bool = False, timeout_s: float = 1800.0, on_round: Any = None, command: str = "",
            stamp: str = "", evict_mb: int = 0) -> dict:
    """The whole measurement (module docstring); returns the result dict (``on_round(d)`` after each round).

    Raises:
        subprocess.CalledProcessError: a revision could not be unpacked (``common.unpack``).
        RuntimeError: a child failed, ran past ``timeout_s`` seconds or printed no result.
    """
    revisions = {"base": base, "head": head} if base is not None else {"head": head}
    n_of = {b: prompts_for(b, max_prompts) for bs in grid.values() for b in bs}
    messages = pick_prompts(max(n_of.values()))
    jobs = jobs_of(grid, methods, per_b)
    d: dict = {"command": command, "stamp": stamp, "machine": common.machine(),
               "revisions": {k: common.describe(v) for k, v in revisions.items()}, "splits": {}, "calibration": {},
               "settings": {"grid": grid, "methods": [m[0] for m in methods], "max_new_tokens": tokens,
                            "max_prompts": max_prompts, "prompts_per_b": n_of, "rounds": rounds, "rounds_done": 0,
                            "threads": threads, "child_per": "b" if per_b else "setting", "plain_too": plain_too,
                            "evict_mb": evict_mb},
               "children": [], "raw": [], "rows": []}
    with tempfile.TemporaryDirectory(prefix="host-bench-") as tmp:
        src = {k: common.unpack(v, Path(tmp) / k) for k, v in revisions.items()}
        for rnd in range(rounds):
            order = list(revisions) if rnd % 2 == 0 else list(reversed(revisions))
            for job in jobs:
                spec = dict(job, threads=threads, max_new_tokens=tokens[job["model"]], round=rnd,
                            plain_too=plain_too, evict_mb=evict_mb,
                            messages=messages[: max(n_of[b] for b in job["streams"])],
                            prompts={str(b): n_of[b] for b in job["streams"]})
                for rev in order:
                    t0 = time.perf_counter()
                    got = run_job(src[rev], spec, Path(tmp), timeout_s)
                    _record(d, dict(got, child_s=round(time.perf_counter() - t0, 1)), job, rev, rnd)
            d["settings"]["rounds_done"] = rnd + 1
            d["rows"] = summarize(d["raw"])
            d["load_end"] = common.machine()["load"]
            if on_round is not None:
                on_round(d)
    return d


def _record(d: dict, got: dict, job: dict, rev: str, rnd: int) -> None:
    d["children"].append({"round": rnd, "revision": rev, "model": job["model"], "setting": job["setting"],
                          **{k: v for k, v in got.items() if k != "runs"}})
    d["torch"] = got["torch"]
    cals = [c["calibration"] for c in d["children"] if c["revision"] == rev]
    d["calibration"][rev] = {k: statistics.median(c[k] for c in cals) for k in ("extra_us", "inner_us")}
    for run in got["runs"]:
        d["splits"][rev] = run["split"]
        d["raw"].append({"round": rnd, "revision": rev, "model": job["model"], "setting": job["setting"],
                         "streams": run["streams"], "run": run, "derived": derive(run, got["calibration"])})
        dv = d["raw"][-1]["derived"]
        print(f"round {rnd + 1} {rev:4s} {job['model']} {job['setting']} B={run['streams']}: host "
              f"{dv['host_us']:.1f} µs/ss, {dv['tokens_per_s']:.1f} tokens/s", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (``--help``; ``--child SPEC`` is a child process's mode); returns the exit status.

    Raises:
        SystemExit: bad options (status 2), or a child whose ``racer_batch`` came from elsewhere.
        RuntimeError: a child failed (:func:`measure`).
    """
    p = argparse.ArgumentParser(prog=common.prog("host"), description=__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help="git revision to compare against (default origin/main, else HEAD)")
    p.add_argument("--head", default="WORKTREE", help="WORKTREE (this checkout as it is; default) or a git revision")
    p.add_argument("--no-base", action="store_true", help="measure the head only")
    p.add_argument("--grid", default=None, help=f"MODEL=B,B;MODEL=B,... (default {DEFAULT_GRID!r})")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="ar and/or METHOD-cCAPACITY labels")
    p.add_argument("--max-new-tokens", default=None, help="N, or MODEL=N,... (default tiny-random 32, "
                   "smollm2-135m 48; --quick 16 and 24)")
    p.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS,
                   help=f"prompts per B: min(2B+8, max(B+8, this)) (default {DEFAULT_MAX_PROMPTS})")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads in the children")
    p.add_argument("--quick", action="store_true", help=f"grid {QUICK_GRID!r}, fewer tokens (flags given win)")
    p.add_argument("--child-per", choices=("setting", "b"), default="setting",
                   help="a child process per model and setting (all its B; default) or per B")
    p.add_argument("--plain-too", action="store_true", help="also run each wrapped config without part wrappers")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="after each decode forward, sweep a buffer of this many MiB inside the timed forward, so the "
                        "host work meets caches as cold as after a real model's forward (default 0: off)")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds per child process")
    p.add_argument("--out", default=str(common.OUT))
    p.add_argument("--tag", default="")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child)
    try:
        grid = parse_grid(args.grid or (QUICK_GRID if args.quick else DEFAULT_GRID))
        methods = parse_methods(args.methods)
        tokens = parse_tokens(args.max_new_tokens, list(grid), QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.max_prompts < 1 or args.threads < 1 or args.evict_mb < 0:
        p.error("--rounds, --max-prompts and --threads must be >= 1, --evict-mb >= 0")
    base = None if args.no_base else (args.base or common.default_base())
    stamp = common.stamp() + (f"-{args.tag}" if args.tag else "")
    command = common.command("host", argv)
    out, paths = Path(args.out), []

    def write(d: dict) -> None:
        paths[:] = common.write_results(out, f"host-{stamp}", d, render_md(d))

    d = measure(base=base, head=args.head, grid=grid, methods=methods, tokens=tokens, max_prompts=args.max_prompts,
                rounds=args.rounds, threads=args.threads, per_b=args.child_per == "b", plain_too=args.plain_too,
                timeout_s=args.child_timeout, on_round=write, command=command, stamp=stamp,
                evict_mb=args.evict_mb)
    print(render_md(d))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
