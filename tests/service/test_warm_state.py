"""Warm draft state across shards and actors (``resources.warm_draft_state``; service/execution/warm.py).

Two RowRunners stand for two actors of one job on a tiny random model (no Redis, no Ray): the second actor's
shard starts from the first one's saved state. The oracle is the same job with the setting off: every row's
output is the same; only the drafts (steps) may differ.
"""

from __future__ import annotations

import logging

import pytest

from racer_batch.drafters.snapshot import FILE_NAME, load
from racer_batch.report.build import build_report, render_md
from racer_batch.report.load import load_output
from racer_batch.service.execution.runner import RowRunner, ShardTask, default_engine
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.manifest import job_manifest
from racer_batch.service.results.output import read_output, write_manifest
from tests.fixtures import write_parquet
from tests.helpers import tiny_bundle

PROMPTS = ["abcabd the cat and the hat", "hello world, hello there", "0123012301 0123", "mississippi miss"]


def _spec(tmp_path, out: str, **extra):
    over = {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / out), "model.name": "tiny",
            "generation.max_new_tokens": 40, "output.shard_rows": 4, "decoding.capacity": 8}
    over.update(extra)
    return load_spec(None, over)


def _task(spec, shard: int) -> dict:
    return ShardTask(job_id="j", shard=shard, row_start=4 * shard, row_stop=4 * shard + 4, spec=spec.stored(),
                     plan=plan_input(spec.input).to_dict(), spec_hash=spec.spec_hash(), owner="t").to_dict()


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle(seed=3, head_scale=60.0)


def _runner(bundle, name: str) -> RowRunner:
    return RowRunner(worker_name=name, loader=lambda model, **kw: bundle, engine_factory=default_engine)


def _run(bundle, spec, names=("a", "b")) -> tuple[list[dict], list[int]]:
    """Shard 0 on actor ``names[0]``, shard 1 on ``names[1]``, then the manifest a worker would write; the rows
    and each shard's steps."""
    steps, done = [], {}
    for shard, name in enumerate(names):
        res = _runner(bundle, name).run_shard(_task(spec, shard))
        assert res.committed and res.summary["ok"] == 4, res
        steps.append(res.summary["steps"])
        want = shard if spec.resources.warm_draft_state else 0  # commits in the state the shard started from
        assert res.summary["warm_commits"] == want, res.summary
        done[shard] = res.summary
    write_manifest(spec.output.path, job_manifest("j", spec, plan_input(spec.input), state="done", done=done))
    return read_output(spec.output.path).to_pylist(), steps


def test_the_next_shard_on_another_actor_starts_warm_with_the_same_outputs(tmp_path, bundle, caplog):
    """Shard 1 repeats shard 0's prompts under other ids. Warm: actor b loads actor a's saved state (a log
    line), answers every row as the cold run does and in fewer steps; the snapshot then holds both commits."""
    write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": PROMPTS[i % 4]} for i in range(8)])
    cold_rows, cold_steps = _run(bundle, _spec(tmp_path, "cold", **{"resources.warm_draft_state": False}))
    assert not (tmp_path / "cold" / FILE_NAME).exists()
    with caplog.at_level(logging.INFO, logger="racer_batch.service.execution.warm"):
        warm_rows, warm_steps = _run(bundle, _spec(tmp_path, "warm"))
    assert any("draft state warmed from" in r.getMessage() and "(1 commits" in r.getMessage() for r in caplog.records)
    text = [(r["id"], r["text"], r["output_tokens"], r["finish_reason"]) for r in cold_rows]
    assert [(r["id"], r["text"], r["output_tokens"], r["finish_reason"]) for r in warm_rows] == text
    assert warm_steps[0] == cold_steps[0] and warm_steps[1] < cold_steps[1], (warm_steps, cold_steps)
    spec = _spec(tmp_path, "warm")
    engine = default_engine(bundle, spec.decoding)
    snap = load(tmp_path / "warm" / FILE_NAME, _runner(bundle, "x")._warm.key(spec, engine))
    assert snap is not None and snap.commits == 2 and len(snap.texts) == 8
    assert snap.recent == ["shard 0 attempt 1 by a", "shard 1 attempt 1 by b"]
    # the report: MAT per shard with what it started from, and cold against warm per route
    rep = build_report(load_output(tmp_path / "warm"), n_boot=10, with_charts=False)
    assert [(s["shard"], s["warm_commits"]) for s in rep.life["shards"]] == [(0, 0), (1, 1)]
    (cw,) = rep.life["cold_warm"].values()  # one route
    assert (cw["cold"]["rows"], cw["warm"]["rows"]) == (4, 4) and cw["warm"]["mat"] > cw["cold"]["mat"]
    md = render_md(rep)
    assert "## Draft state over the job's life" in md and "| 1 | 1 commits |" in md
    assert "Draft state over" not in render_md(build_report(load_output(tmp_path / "cold"), n_boot=10,
                                                            with_charts=False))


def test_a_state_saved_under_another_config_or_a_corrupt_one_is_not_loaded(tmp_path, bundle, caplog):
    """A snapshot saved under another decoding config is refused with a log line naming the config hash; a
    corrupt one is skipped with a log line; either way the shard runs cold and saves a fresh snapshot."""
    write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": PROMPTS[i % 4]} for i in range(8)])
    other = _spec(tmp_path, "out", **{"decoding.capacity": 6})
    assert _runner(bundle, "a").run_shard(_task(other, 0)).committed
    spec = _spec(tmp_path, "out")
    with caplog.at_level(logging.INFO):
        res = _runner(bundle, "b").run_shard(_task(spec, 1))
    msgs = [r.getMessage() for r in caplog.records]
    assert res.committed and any("saved under another config_hash; refused" in m for m in msgs)
    assert not any("draft state warmed" in m for m in msgs)
    (tmp_path / "out" / FILE_NAME).write_bytes(b"\x00 not a snapshot")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        res = _runner(bundle, "c").run_shard(_task(spec, 1))
    assert res.committed and any("is unreadable" in r.getMessage() for r in caplog.records)
    engine = default_engine(bundle, spec.decoding)
    snap = load(tmp_path / "out" / FILE_NAME, _runner(bundle, "x")._warm.key(spec, engine))
    assert snap is not None and snap.commits == 1  # rewritten from this shard alone


def test_an_actor_that_saved_last_keeps_its_state_and_reloads_after_another_commit(tmp_path, bundle):
    """One actor running shards 0 and 1 in turn keeps its in-memory state (the saved one equals it); after
    another actor commits, its next shard loads the merged snapshot."""
    write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": PROMPTS[i % 4]} for i in range(12)])
    spec = _spec(tmp_path, "out")
    a, b = _runner(bundle, "a"), _runner(bundle, "b")
    a.run_shard(_task(spec, 0))
    state0 = a._states["j"][1]
    a.run_shard(_task(spec, 1))
    assert a._states["j"][1] is state0  # nothing new saved by others: no reload
    b.run_shard(_task(spec, 2))  # b loads a's two commits, adds its own
    a.run_shard(_task(spec, 1))  # a retries shard 1: the snapshot has b's commit, so a reloads
    assert a._states["j"][1] is not state0 and state0.freed
    assert spec.resources.warm_draft_state is True  # the default
    assert spec.spec_hash() == _spec(tmp_path, "out", **{"resources.warm_draft_state": False}).spec_hash()
