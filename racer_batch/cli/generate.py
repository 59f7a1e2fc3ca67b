"""``racer-batch generate`` and ``racer-batch bench``: one prompt, and the methods side by side.

Flags become a DecodingConfig / GenerationParams (generate) or a list of MethodSpec (bench) here; the work is
done by racer_batch.engine and racer_batch.bench, which never import click.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import click

from racer_batch.values import METHODS, weights_conflict

from .exit_codes import CliExit, ExitCode, epilog
from .options import parse_capacity, pydantic_message, set_torch_threads

if TYPE_CHECKING:
    from racer_batch.bench import MethodSpec

_GENERATE_EPILOG = epilog(
    ExitCode.OK,
    ExitCode.INTERNAL,
    (ExitCode.INPUT, "option, value, empty prompt, prompt too long"),
    (ExitCode.MODEL, "unknown name, missing files, unsupported architecture"),
    ExitCode.INTERRUPTED,
)
_BENCH_EPILOG = epilog(
    ExitCode.OK,
    ExitCode.INTERNAL,
    (ExitCode.INPUT, "option, value, --methods / --variant / --sample, benchmark data not found"),
    (ExitCode.MODEL, "unknown name, missing files, unsupported architecture"),
    (ExitCode.INTERRUPTED, "the results so far are in --out"),
)


def _load_model(model: str, **kwargs: Any) -> Any:
    """``load_model`` with a ModelLoadError turned into ``error: ...`` on stderr and exit 3 (settings that conflict
    on any machine, ``values.weights_conflict``, exit 2 before anything loads). transformers'
    per-tensor "Loading weights" bar is switched off (as on the service's actors, which get
    HF_HUB_DISABLE_PROGRESS_BARS=1): a command's stderr keeps its own messages only."""
    from transformers.utils import logging as hf_logging

    from racer_batch import ModelLoadError, load_model

    why = weights_conflict(model, kwargs.get("dtype"), kwargs.get("weights"))
    if why is not None:  # a conflict of options, not a model that failed to load
        raise CliExit(f"--{why}", ExitCode.INPUT)
    hf_logging.disable_progress_bar()
    try:
        return load_model(model, **kwargs)
    except ModelLoadError as exc:
        raise CliExit(str(exc), ExitCode.MODEL) from None


def _decoding_options(f):
    f = click.option("--method", type=click.Choice(METHODS), default="racer", show_default=True,
                     help="Decoding method: racer (retrieval + copy logits), ar (no draft), the ablations and the "
                          "peers of the literature (docs/architecture.md, Methods).")(f)
    f = click.option("--capacity", default="16", show_default=True,
                     help="Draft tree nodes per step incl. the root (paper: 64; CPU: 8-16), or 'auto'.")(f)
    f = click.option("--scope", type=click.Choice(["job", "request", "global"]), default="job", show_default=True,
                     help="Draft state scope.")(f)
    f = click.option("--runner", type=click.Choice(["auto", "eager", "static"]), default="auto", show_default=True,
                     help="Verify forward: static (own decoder, static KV cache), eager (stock transformers), "
                     "auto (static where the architecture allows).")(f)
    f = click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default="auto",
                     show_default=True, help="CUDA graphs of the verify step, one per (streams, tree) "
                     "bucket; auto = on CUDA; the CPU has none (on: a warning, runs uncompiled).")(f)
    f = click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                     help="Weights' precision (default float32 on CPU, bfloat16 on CUDA). Reduced precision changes "
                     "outputs and equals greedy decoding of the same reduced model only up to numerical ties.")(f)
    f = click.option("--weights", type=click.Choice(["as_stored", "float32"]), default=None,
                     help="A GGUF model's weights: as_stored (its quantised blocks, expanded inside our CPU kernels; "
                     "the same outputs bit for bit; a fifth of float32's weight bytes, ~0.4x a process's memory) or "
                     "float32 (de-quantised once). Default: "
                     "as_stored where it runs, else float32.")(f)
    return f


def _weights_ran(bundle: Any, engine: Any) -> str:
    """The weights the engine's matmuls read: ``bundle.weights``, except an as-stored bundle on the eager runner,
    which expands them to float32 when it starts (``ModelBundle.materialize``)."""
    if bundle.weights == "as_stored" and engine.runner.kind != "static":
        return "float32 (expanded from as_stored for the eager runner)"
    return bundle.weights


@click.command(epilog=_GENERATE_EPILOG)
@click.argument("prompt")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Built-in name (smollm2-135m, gemma3-270m, tiny-random), a .gguf file, a local model folder, "
                   "or a hub id.")
@_decoding_options
@click.option("--max-new-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(0.0, 100.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable); cut from the returned text.")
@click.option("--system", "system_prompt", default=None,
              help="System message put before PROMPT (default: none, the model's own chat template decides, as "
              "in a job without generation.system_prompt, so a job's row and this command give the same answer).")
@click.option("--raw", is_flag=True, help="Feed PROMPT as plain text instead of a chat user message (the default "
              "for a model without a chat template).")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped with the weights.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--torch-threads", type=click.IntRange(0), default=0, show_default=True,
              help="Intra-op torch threads (0 = torch's default). Use 1 on a machine shared with busy processes.")
def generate(prompt: str, model: str, method: str, capacity: str, scope: str, runner: str, compile_mode: str,
             dtype: Optional[str], weights: Optional[str], max_new_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int,
             stop: tuple[str, ...], system_prompt: Optional[str], raw: bool, trust_remote_code: bool,
             as_json: bool, torch_threads: int) -> None:
    """Generate an answer to PROMPT and print it with its decoding statistics."""
    from racer_batch import Engine
    from racer_batch.benchdata import has_chat_template

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    set_torch_threads(torch_threads)
    cfg, params = _generate_configs(
        decoding=dict(method=method, capacity=parse_capacity(capacity), scope=scope, runner=runner,
                      compile=compile_mode),
        generation=dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed, stop=list(stop)))
    bundle = _load_model(model, dtype=dtype, trust_remote_code=trust_remote_code, weights=weights)
    engine = Engine(bundle, cfg)
    if not raw and not has_chat_template(bundle.tokenizer) and not system_prompt:
        raw = True  # a base model: PROMPT as plain text (a --system message still asks for the chat form)
    chat_input: Any = prompt if raw else [{"role": "user", "content": prompt}]
    try:
        res = engine.generate(chat_input, params, system_prompt=None if raw else system_prompt)
    except ValueError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None
    if as_json:
        out = res.to_dict()
        out.update(model=bundle.name, method=method, config_hash=cfg.config_hash(), dtype=bundle.dtype,
                   weights=_weights_ran(bundle, engine), runner=engine.runner.kind)
        click.echo(json.dumps(out))
        return
    s = res.stats
    click.echo(res.text)
    click.echo(
        f"\n[{bundle.name} {bundle.dtype}, weights {_weights_ran(bundle, engine)} | {method} cap={s.capacity} | "
        f"{engine.runner.kind} runner] "
        f"{res.output_tokens} tokens, finish={res.finish_reason}, "
        f"steps={s.steps}, MAT={s.mat:.2f}, prefill={res.prefill_ms:.0f} ms, decode={res.decode_ms:.0f} ms, "
        f"{res.tokens_per_s:.1f} tokens/s",
        err=True,
    )


def _generate_configs(*, decoding: dict[str, Any], generation: dict[str, Any]) -> tuple[Any, Any]:
    """Flag values -> (DecodingConfig, GenerationParams); a pydantic error is a usage error (exit 2)."""
    from pydantic import ValidationError

    from racer_batch import DecodingConfig, GenerationParams

    try:
        return DecodingConfig(**decoding), GenerationParams(**generation)
    except ValidationError as exc:
        raise click.UsageError(pydantic_message(exc)) from None


@dataclass(frozen=True)
class _BenchPlan:
    """What ``bench`` runs, from its flags: the rows (MethodSpec), the capacity and the prompt sample."""

    specs: list["MethodSpec"]
    capacity: Any  # int or "auto"
    counts: Optional[dict[str, int]]


@click.command(epilog=_BENCH_EPILOG)
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--methods", default="hf_pld,ar,pld,logits,retrieval,racer", show_default=True,
              help="Comma-separated; HF generate greedy (the baseline) always runs.")
@click.option("--capacity", default="16", show_default=True, help="Draft capacity for tree methods, or 'auto'.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--per-set", type=click.IntRange(1, 8), default=8, show_default=True,
              help="Prompts per set (Spec-Bench, HumanEval, MGSM-ZH) from the smoke subset.")
@click.option("--sample", default=None, metavar="SET=COUNT,...",
              help="Instead of the smoke subset: COUNT items per Spec-Bench category and per HumanEval / MGSM-ZH "
              "set, evenly spaced in file order, e.g. 'spec_bench=10,human_eval=20,mgsm_zh=20'.")
@click.option("--variant", "variants", multiple=True, metavar="LABEL=METHOD:key=value,...",
              help="Also run METHOD with other decoding settings under its own LABEL (repeatable), e.g. "
              "'racer-c32=racer:capacity=32' or 'racer-top2=racer:acceptance=topk,relaxed_topk=2'.")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Static corpus for the rest rows (JSONL with 'text' or 'token_ids', or plain text); "
              "`python -m benchmarks.rest_corpus` writes one without the benchmark's own prompts.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Weights' precision for every row, HF baselines included (default float32 on CPU).")
@click.option("--weights", type=click.Choice(["as_stored", "float32"]), default=None,
              help="A GGUF model's weights for the engine rows: as_stored (quantised blocks, bit-identical "
              "outputs) or float32; default as_stored where it runs. HF rows always run float32.")
@click.option("--out", "out_dir", default="benchmarks", show_default=True, type=click.Path(file_okay=False))
@click.option("--torch-threads", type=click.IntRange(0), default=0, show_default=True,
              help="Intra-op torch threads (0 = torch's default). Use 1 on a machine shared with busy processes.")
@click.option("--system", "system_prompt", default=None,
              help="System message before every conversation (default: none, as in jobs and generate; the data's "
              "protocol used \"You are a helpful assistant.\").")
def bench(model: str, methods: str, capacity: str, max_new_tokens: int, per_set: int, sample: Optional[str],
          variants: tuple[str, ...], corpus: Optional[str], dtype: Optional[str], weights: Optional[str],
          out_dir: str, torch_threads: int,
          system_prompt: Optional[str]) -> None:
    """Run the decoding methods side by side on the smoke prompts and write JSON + Markdown results."""
    from racer_batch.bench import run_bench, summarize, write_results
    from racer_batch.benchdata import sample_prompts

    set_torch_threads(torch_threads)
    plan = _bench_plan(methods=methods, variants=variants, capacity=capacity, corpus=corpus, sample=sample)
    bundle = _load_model(model, dtype=dtype, weights=weights)
    command = shlex.join(["racer-batch", *sys.argv[1:]])  # each argument quoted where a shell needs it
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def partial(res) -> None:  # a long run leaves its results so far on disk after every item
        write_results(summarize(res), Path(out_dir), command=command, stamp=stamp)

    try:
        items = sample_prompts(plan.counts) if plan.counts else None
        res = run_bench(bundle, methods=plan.specs, capacity=plan.capacity, max_new_tokens=max_new_tokens,
                        per_set=per_set, corpus=corpus, items=items, on_item=partial, system_prompt=system_prompt)
    except FileNotFoundError as exc:
        raise CliExit(f"benchmark data not found ({exc}); set RACER_BATCH_DATA to the shared/data folder",
                      ExitCode.INPUT) from None
    except KeyboardInterrupt:
        raise CliExit(f"interrupted; the results of the items done so far are in {out_dir}",
                      ExitCode.INTERRUPTED) from None
    jpath, mpath = write_results(summarize(res), Path(out_dir), command=command, stamp=stamp)
    click.echo(mpath.read_text())
    click.echo(f"wrote {jpath} and {mpath}", err=True)


def _bench_plan(*, methods: str, variants: tuple[str, ...], capacity: str, corpus: Optional[str],
                sample: Optional[str]) -> _BenchPlan:
    """bench's flags -> a _BenchPlan; every bad value is a ``click.BadParameter`` naming its flag (exit 2)."""
    from racer_batch.bench import parse_method
    from racer_batch.benchdata import parse_sample

    specs = [parse_method(m) for m in _method_names(methods)]
    cap = parse_capacity(capacity)
    specs += [_variant(v, capacity=cap, corpus=corpus) for v in variants]
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise click.BadParameter(f"row labels must be unique; repeated: {dup}",
                                 param_hint="--variant" if variants else "--methods")
    try:
        counts = parse_sample(sample) if sample else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sample") from None
    return _BenchPlan(specs=specs, capacity=cap, counts=counts)


def _method_names(methods: str) -> list[str]:
    """``--methods "ar, racer"`` -> ["ar", "racer"]; an unknown name is a ``click.BadParameter``."""
    from racer_batch.bench import HF_METHODS

    names = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in names if m not in (*METHODS, *HF_METHODS)]
    if bad:
        raise click.BadParameter(f"unknown method(s) {bad}; choose from {[*HF_METHODS, *METHODS]}",
                                 param_hint="--methods")
    return names


def _variant(text: str, *, capacity: Any, corpus: Optional[str]) -> "MethodSpec":
    """One ``--variant`` -> MethodSpec, its settings checked by building its DecodingConfig."""
    from pydantic import ValidationError

    from racer_batch.bench import HF_METHODS, decoding_config, parse_method

    try:
        spec = parse_method(text)
        if spec.method not in HF_METHODS:
            decoding_config(spec, capacity=capacity, corpus=corpus)
    except ValidationError as exc:
        e = exc.errors()[0]
        key = str(e["loc"][0]) if e["loc"] else "settings"  # a union field adds its branch: keep the name
        raise click.BadParameter(f"{text!r}: {key} = {e.get('input')!r}: {e['msg']}", param_hint="--variant") from None
    except ValueError as exc:  # parse_method's messages already quote the variant
        raise click.BadParameter(str(exc), param_hint="--variant") from None
    return spec


COMMANDS = (generate, bench)


def register(group: click.Group) -> None:
    """Add generate and bench to a click group (the top-level ``racer-batch`` one)."""
    for cmd in COMMANDS:
        group.add_command(cmd)
