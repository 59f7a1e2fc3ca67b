"""benchmarks/kernel_ab.py: our CPU kernels at two revisions in alternating processes."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernel_ab


def test_kernel_ab_times_two_revisions_in_alternating_processes(tmp_path):
    """HEAD (unpacked from git) against this checkout, attention only, two configs: each revision's ms, the
    ratio, the commit each revision named, and the report files; bad configs and a missing --base refused."""
    from racer_batch.engine.kernels import cpu_ops

    with pytest.raises(SystemExit) as bad:
        kernel_ab.main(["--base", "HEAD", "--configs", "4x0x3"])
    assert bad.value.code == 2
    with pytest.raises(SystemExit) as missing:
        kernel_ab.main(["--configs", "1x16x2"])
    assert missing.value.code == 2
    if cpu_ops() is None:  # the children would fail the same way: the error says so
        with pytest.raises(RuntimeError, match="failed"):
            kernel_ab.main(["--base", "HEAD", "--configs", "1x16x2", "--rounds", "1", "--repeats", "1", "--no-verify",
                      "--out", str(tmp_path)])
        return
    assert kernel_ab.main(["--base", "HEAD", "--configs", "1x16x2,2x8x1", "--rounds", "2", "--repeats", "1",
                     "--no-verify", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("kernel-ab-*.json")
    d = json.loads(js.read_text())
    assert [r["config"] for r in d["rows"]] == ["1x16x2", "2x8x1"] and all(r["what"] == "attention" for r in d["rows"])
    assert all(r["base_ms"] > 0 and r["head_ms"] > 0 and r["head_over_base"] > 0 for r in d["rows"])
    assert d["base"].startswith("HEAD (") and d["head"].startswith("WORKTREE (at ") and len(d["raw"]) == 2
    assert all(set(r) == {"base", "head"} and r["base"]["isa"] and r["head"]["isa"] for r in d["raw"]) and d["isa"]
    assert d["command"].startswith("python -m benchmarks.kernel_ab --base HEAD ")
    assert "| attention | 1x16x2 |" in js.with_suffix(".md").read_text()


def test_a_kernel_child_refuses_a_racer_batch_from_elsewhere(tmp_path):
    """A child whose racer_batch does not come from the revision's folder stops before timing anything."""
    with pytest.raises(SystemExit, match="not from the revision's folder"):
        kernel_ab.main(["--child", str(tmp_path), "--configs", "1x16x2", "--no-verify", "--repeats", "1"])
