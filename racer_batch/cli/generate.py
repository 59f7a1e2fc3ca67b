"""The ``racer-batch`` command line (click). Flags become config objects here; nothing below imports click.

Exit codes:
  0  success
  1  unexpected internal error (a bug: please report it with the traceback shown by --log-level debug)
  2  bad usage or invalid input (unknown option, bad value, empty prompt, prompt too long, bad job spec)
  3  the model could not be loaded (unknown name, missing files, unsupported architecture)
  4  a service the command needs is unreachable (Redis, Ray)
  5  a job ended failed or was cancelled (submit --wait); rows with status=error do not count
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import click

from ..types import METHODS

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_MODEL, EXIT_SERVICE, EXIT_JOB_FAILED = 0, 1, 2, 3, 4, 5

_EPILOG = """\b
Exit codes:
  0  success
  1  unexpected internal error
  2  bad usage or invalid input (option, value, prompt, job spec)
  3  the model could not be loaded
  4  a service the command needs is unreachable (Redis, Ray)
  5  a job ended failed or was cancelled (submit --wait)
  130  interrupted (Ctrl-C)
"""


def _pydantic_message(exc: Any) -> str:
    """One line per error: ``field = value: reason`` (no pydantic boilerplate)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        parts.append(f"{loc} = {err.get('input')!r}: {err.get('msg')}")
    return "; ".join(parts)


def _capacity(value: str) -> Any:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"capacity must be an integer or 'auto', got {value!r}", param_hint="--capacity") from None


@click.group(epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Logging verbosity (stderr).")
@click.version_option(package_name="racer-batch")
def main(log_level: str) -> None:
    """racer-batch: batch LLM generation with RACER lossless speculative decoding."""
    from rich.console import Console
    from rich.logging import RichHandler

    # logs go to stderr: stdout carries only results (a job id, --json), so scripts can capture it
    handler = RichHandler(show_path=False, console=Console(stderr=True, soft_wrap=True))
    logging.basicConfig(level=log_level.upper(), format="%(message)s", handlers=[handler])
    for noisy in ("transformers", "accelerate", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def _decoding_options(f):
    f = click.option("--method", type=click.Choice(METHODS), default="racer", show_default=True,
                     help="Drafter: racer (retrieval + copy logits), retrieval, logits, pld, ar (no draft).")(f)
    f = click.option("--capacity", default="16", show_default=True,
                     help="Draft tree nodes per step incl. the root (paper: 64; CPU: 8-16), or 'auto'.")(f)
    f = click.option("--scope", type=click.Choice(["job", "request", "global"]), default="job", show_default=True,
                     help="Draft state scope.")(f)
    f = click.option("--runner", type=click.Choice(["auto", "eager", "static"]), default="auto", show_default=True,
                     help="Verify forward: static (own decoder, static KV cache), eager (stock transformers), "
                     "auto (static where the architecture allows).")(f)
    f = click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default="auto",
                     show_default=True, help="Compiled verify step per tree size (CUDA graphs; torch.compile on "
                     "CPU); auto = on CUDA only.")(f)
    f = click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                     help="Weights' precision (default float32 on CPU, bfloat16 on CUDA). Reduced precision changes "
                     "outputs and equals greedy decoding of the same reduced model only up to numerical ties.")(f)
    return f


@main.command(epilog=_EPILOG)
@click.argument("prompt")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Built-in name (smollm2-135m, tiny-random), local model folder, or hub id.")
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
@click.option("--raw", is_flag=True, help="Feed PROMPT as plain text instead of a chat user message.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped with the weights.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--torch-threads", type=click.IntRange(0), default=0, show_default=True,
              help="Intra-op torch threads (0 = torch's default). Use 1 on a machine shared with busy processes.")
def generate(prompt: str, model: str, method: str, capacity: str, scope: str, runner: str, compile_mode: str,
             dtype: str | None, max_new_tokens: int,
             temperature: float, top_p: float, top_k: int, seed: int, stop: tuple[str, ...], system_prompt: str | None,
             raw: bool, trust_remote_code: bool, as_json: bool, torch_threads: int) -> None:
    """Generate an answer to PROMPT and print it with its decoding statistics."""
    from pydantic import ValidationError

    from .. import DecodingConfig, Engine, GenerationParams, ModelLoadError, load_model

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    try:
        cfg = DecodingConfig(method=method, capacity=_capacity(capacity), scope=scope, runner=runner,
                             compile=compile_mode)
        params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed, stop=list(stop))
    except ValidationError as exc:
        raise click.UsageError(_pydantic_message(exc)) from None
    try:
        bundle = load_model(model, dtype=dtype, trust_remote_code=trust_remote_code)
    except ModelLoadError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_MODEL)
    engine = Engine(bundle, cfg)
    chat_input: Any = prompt if raw else [{"role": "user", "content": prompt}]
    try:
        res = engine.generate(chat_input, params, system_prompt=None if raw else system_prompt)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INPUT)
    s = res.stats
    if as_json:
        out = res.to_dict()
        out.update(model=bundle.name, method=method, config_hash=cfg.config_hash(), dtype=bundle.dtype,
                   runner=engine.runner.kind)
        click.echo(json.dumps(out))
        return
    click.echo(res.text)
    click.echo(
        f"\n[{bundle.name} {bundle.dtype} | {method} cap={s.capacity} | {engine.runner.kind} runner] {res.output_tokens} tokens, finish={res.finish_reason}, "
        f"steps={s.steps}, MAT={s.mat:.2f}, prefill={res.prefill_ms:.0f} ms, decode={res.decode_ms:.0f} ms, "
        f"{res.tokens_per_s:.1f} tokens/s",
        err=True,
    )


@main.command(epilog=_EPILOG)
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
              "scripts/build_rest_corpus.py writes one without the benchmark's own prompts.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Weights' precision for every row, HF baselines included (default float32 on CPU).")
@click.option("--out", "out_dir", default="benchmarks", show_default=True, type=click.Path(file_okay=False))
@click.option("--torch-threads", type=click.IntRange(0), default=0, show_default=True,
              help="Intra-op torch threads (0 = torch's default). Use 1 on a machine shared with busy processes.")
@click.option("--system", "system_prompt", default=None,
              help="System message before every conversation (default: none, as in jobs and generate; the data's "
              "protocol used \"You are a helpful assistant.\").")
def bench(model: str, methods: str, capacity: str, max_new_tokens: int, per_set: int, sample: str | None,
          variants: tuple[str, ...], corpus: str | None, dtype: str | None, out_dir: str, torch_threads: int,
          system_prompt: str | None) -> None:
    """Run the decoding methods side by side on the smoke prompts and write JSON + Markdown results."""
    from pathlib import Path

    from pydantic import ValidationError

    from .. import ModelLoadError, load_model
    from ..bench import HF_METHODS, decoding_config, parse_method, run_bench, summarize, write_results
    from ..benchdata import parse_sample, sample_prompts

    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in names if m not in (*METHODS, *HF_METHODS)]
    if bad:
        raise click.BadParameter(f"unknown method(s) {bad}; choose from {[*HF_METHODS, *METHODS]}", param_hint="--methods")
    specs = [parse_method(m) for m in names]
    for v in variants:
        try:
            spec = parse_method(v)
            if spec.method not in HF_METHODS:
                decoding_config(spec, capacity=_capacity(capacity), corpus=corpus)
        except ValidationError as exc:
            e = exc.errors()[0]
            key = str(e["loc"][0]) if e["loc"] else "settings"  # a union field adds its branch: keep the name
            raise click.BadParameter(f"{v!r}: {key} = {e.get('input')!r}: {e['msg']}", param_hint="--variant") from None
        except ValueError as exc:  # parse_method's messages already quote the variant
            raise click.BadParameter(str(exc), param_hint="--variant") from None
        specs.append(spec)
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise click.BadParameter(f"row labels must be unique; repeated: {dup}",
                                 param_hint="--variant" if variants else "--methods")
    try:
        bundle = load_model(model, dtype=dtype)
    except ModelLoadError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_MODEL)
    counts = None
    if sample:
        try:
            counts = parse_sample(sample)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--sample") from None
    command = "racer-batch " + " ".join(sys.argv[1:])
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def partial(res) -> None:  # a long run leaves its results so far on disk after every item
        write_results(summarize(res), Path(out_dir), command=command, stamp=stamp)

    try:
        items = sample_prompts(counts) if counts else None
        res = run_bench(bundle, methods=specs, capacity=_capacity(capacity), max_new_tokens=max_new_tokens,
                        per_set=per_set, corpus=corpus, items=items, on_item=partial, system_prompt=system_prompt)
    except FileNotFoundError as exc:
        click.echo(f"error: benchmark data not found ({exc}); set RACER_BATCH_DATA to the shared/data folder", err=True)
        sys.exit(EXIT_INPUT)
    summary = summarize(res)
    jpath, mpath = write_results(summary, Path(out_dir), command=command, stamp=stamp)
    click.echo(mpath.read_text())
    click.echo(f"wrote {jpath} and {mpath}", err=True)


def _register_service_commands() -> None:
    from .service import register

    register(main)


def _register_report_commands() -> None:
    from .report import register

    register(main)


_register_service_commands()
_register_report_commands()


def run() -> None:
    """Console entry point with the documented exit codes for uncaught errors."""
    try:
        main.main(standalone_mode=True)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - last-resort handler turns a crash into exit code 1
        logging.getLogger(__name__).exception("internal error")
        click.echo(f"internal error: {exc!r}", err=True)
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    run()
