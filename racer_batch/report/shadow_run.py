"""`racer-batch shadow JOB`: shadow a finished job locally.

The sampled rows (same hash rule as the spec's ``shadow:`` block) are read from the job's input and each is
answered twice in this process, by the job's decoding config and by the baseline, one right after the other
in an order set by the row's hash, so machine drift hits both sides alike. The method side is re-run rather
than taken from the job's output because the job's timings were measured under other conditions (other
actors, other load); the report also checks that the re-run reproduced the job's answers. Both sides keep a
draft state for the whole shadow run, as a job does. Results: ``shadow-posthoc-<baseline>-s<seed>.parquet``
in the output folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from racer_batch.report.load import JobData, ReportError
from racer_batch.service.execution.runner import RowRunner
from racer_batch.service.job.inputs import InputPlan, iter_raw_rows
from racer_batch.service.job.rows import RowTask, parse_row
from racer_batch.service.job.spec import JobSpec, ShadowSpec, SpecError, resolve_preset
from racer_batch.service.results.shadow import shadow_path, shadow_selected, write_shadow
from racer_batch.values import DecodingConfig


def baseline_config(name_or_path: str) -> DecodingConfig:
    """The ``decoding`` section of a preset (a preset name, e.g. ar, or a YAML path). Raises ReportError."""
    try:
        path = resolve_preset(name_or_path, None)
    except SpecError as exc:
        raise ReportError(f"--baseline {name_or_path!r}: {exc}") from None
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    dec = data.get("decoding") if isinstance(data, dict) else None
    if not isinstance(dec, dict):
        raise ReportError(f"--baseline {name_or_path!r}: {path} has no decoding section")
    return DecodingConfig.model_validate(dec)


def _pick_rows(spec: JobSpec, plan: InputPlan, *, fraction: float, seed: int,
               max_rows: Optional[int]) -> list[RowTask]:
    """The good input rows the shadow sample selects (``shadow_selected``), in row order, at most ``max_rows``."""
    columns = list(spec.input.columns.model_dump().values())
    picked = []
    for row_idx, rec in iter_raw_rows(plan, 0, plan.num_rows, columns):
        row = parse_row(spec, row_idx, rec)
        if row.error is None and shadow_selected(seed, row.id, fraction):
            picked.append(row)
        if max_rows is not None and len(picked) >= max_rows:
            break
    return picked


def _answer_pairs(runner: RowRunner, spec: JobSpec, shadow_spec: JobSpec, picked: list[RowTask], *,
                  job_id: str, run: str, device: Optional[str],
                  on_row: Optional[Callable[[int, int, str], None]]) -> list[dict]:
    """Answer each picked row by both sides (``shadow_spec``) in one draft-state scope, ended at the end.
    Returns the shadow records, two per row, tagged with ``run``."""
    state_key = f"shadow-run:{job_id}:{time.time_ns()}"
    records: list[dict] = []
    try:
        for i, row in enumerate(picked):
            base = {"id": row.id, "row_idx": row.row_idx, "shard": None, "route": row.route, "seed": row.seed,
                    "worker": runner.worker_name, "device": device or "cpu", "model": spec.model.name,
                    "method": spec.decoding.method, "config_hash": spec.decoding.config_hash(),
                    "job_id": job_id}
            _, pair = runner.answer_row(shadow_spec, row, base, job_id=state_key)
            assert len(pair) == 2, f"row {row.id}: expected a method and a baseline record, got {len(pair)}"
            for r in pair:
                r.run = run
            records += pair
            if on_row is not None:
                on_row(i + 1, len(picked), row.id)
    finally:
        runner.end_job(state_key)
    return records


def _check_input_here(job: JobData, plan: InputPlan) -> None:
    """Raise ReportError when an input file of the job is missing on this machine."""
    for f in plan.files:
        if not Path(f).is_file():
            raise ReportError(f"job {job.job_id}: input file {f} is not on this machine")


def run_posthoc_shadow(job: JobData, *, baseline: str, fraction: float, seed: int = 0,
                       max_rows: Optional[int] = None, device: Optional[str] = None,
                       on_row: Optional[Callable[[int, int, str], None]] = None,
                       runner: Optional[RowRunner] = None) -> tuple[Path, int]:
    """Shadow the sampled rows of a finished job. Returns (shadow file, rows shadowed).

    ``on_row(done, total, row id)`` is called after each row. Raises ReportError for a fraction outside
    (0, 1], a manifest without spec or input plan, a missing input file, or a sample that selects no row."""
    if not 0 < fraction <= 1:
        raise ReportError(f"--fraction must be in (0, 1], got {fraction}")
    spec, plan = job.job_input()
    _check_input_here(job, plan)
    shadow_spec = spec.model_copy(update={
        "n_samples": 1,
        "shadow": ShadowSpec(config=baseline_config(baseline), name=baseline, fraction=1.0, seed=seed),
    })
    picked = _pick_rows(spec, plan, fraction=fraction, seed=seed, max_rows=max_rows)
    if not picked:
        raise ReportError(f"job {job.job_id}: no row selected at fraction {fraction} (seed {seed}); raise it")
    runner = runner or RowRunner(worker_name="shadow", device=device)
    records = _answer_pairs(runner, spec, shadow_spec, picked, job_id=job.job_id, run=f"posthoc:{baseline}",
                            device=device, on_row=on_row)
    tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(baseline).stem)
    path = write_shadow(shadow_path(job.out_dir, f"posthoc-{tag}-s{seed}"), records,
                        meta={"job_id": job.job_id, "baseline": baseline, "fraction": fraction, "seed": seed})
    return path, len(picked)
