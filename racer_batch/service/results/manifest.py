"""The manifest of an output folder (``_manifest.json``): the one place that spells out its fields.

The part files are the truth (service/results/output.py); the manifest says which job and spec the folder holds,
for ``check_output_folder`` at submit and for the report commands, and carries the committed shards'
summaries and their merged ``totals`` (Tally JSON plus ``mat``) for people reading the folder.
"""

from __future__ import annotations

from typing import Mapping, Optional

from racer_batch.service.job.inputs import InputPlan
from racer_batch.service.job.spec import JobSpec
from racer_batch.service.results.method_auto import pool as pool_method_auto
from racer_batch.service.results.tally import Tally
from racer_batch.values import AUTO_METHOD


# Keys of a shard result (RowRunner.run_shard) that describe the attempt, not the committed shard.
def job_manifest(job_id: str, spec: JobSpec, plan: InputPlan, *, state: str, done: Mapping[int, dict],
                 worker: Optional[str] = None, faults: Optional[Mapping] = None) -> dict:
    """The manifest of ``job_id`` in ``state`` with the committed shards ``done`` ({shard: summary}).

    ``worker``: the worker writing it (None at submit). ``faults``: what the worker's run met,
    ``{"nodes_lost": [Ray node ids], "shards_retried": distinct shards, "retries": attempts redone}`` (None at submit).
    ``write_manifest`` adds ``schema_version`` and ``updated_at``."""
    totals = Tally.of(done.values())
    manifest = {
        "job_id": job_id, "name": spec.name, "state": state, "spec": spec.stored(), "spec_hash": spec.spec_hash(),
        "config_hash": spec.decoding.config_hash(), "model": spec.model.name,
        "dtype": spec.model.dtype or "default (float32 on CPU, bfloat16 on CUDA)", "method": spec.decoding.method,
        "input": plan.to_dict(), "num_rows": plan.num_rows, "shard_rows": spec.output.shard_rows,
        "num_shards": plan.num_shards(spec.output.shard_rows),
        "shards": {f"{s:05d}": dict(m) for s, m in sorted(done.items())},
        "totals": dict(totals.to_dict(), mat=totals.mat),
    }
    if spec.decoding.method == AUTO_METHOD:  # the choice per route and its evidence, pooled over the shards
        manifest["method_auto"] = pool_method_auto(m.get("method_auto") for m in done.values())
    if worker is not None:
        manifest["worker"] = worker
    if faults is not None:
        manifest["faults"] = dict(faults)
    return manifest
