"""benchmarks/capacity_vs_relaxed.py: the variants it runs and how it reads them."""

from __future__ import annotations

import pytest

import racer_batch.bench as bench
from benchmarks import capacity_vs_relaxed as cvr_module


def test_capacity_vs_relaxed_reading():
    cvr = cvr_module
    names = cvr.variants([8, 16, 64], 16, 2, 0.1)
    assert names[0] == "lossless-c64=racer:capacity=64" and names.count("lossless-c64=racer:capacity=64") == 1
    assert all(bench.parse_method(n).method == "racer" for n in names)

    def rows(**s):
        return {k.replace("_", "-"): {"speedup_vs_hf_greedy": v} for k, v in s.items()}

    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.3, top2_c64=1.2, top2_c16=1.4))
    assert (a["best_lossless"], a["best_relaxed"]) == ("lossless-c16", "top2-c16")
    assert a["share"] == pytest.approx(0.75) and a["verdict"].startswith("reproduced")
    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.05, top2_c64=1.5))
    assert a["share"] == pytest.approx(0.1) and a["verdict"].startswith("refuted")
    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.05, top2_c64=0.9))
    assert a["share"] is None



def test_capacity_vs_relaxed_markdown():
    """The committed result through ``render_md``: the finding and one table row per setting (md_records)."""
    import json
    from pathlib import Path

    result = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "capacity_vs_relaxed.json").read_text())
    result["machine"] = {"cpu": "CPU X", "family": "25", "model": "1", "isa": ["avx2"], "cores": 2}
    md = cvr_module.render_md(result)
    assert f"Reproduce: `{result['command']}`" in md and "Machine: CPU X (family 25 model 1, avx2), 2 cores." in md
    assert f"- verdict: {result['analysis']['verdict']}" in md
    assert "| setting | mat | ms_per_token | speedup_vs_hf_greedy |" in md
    for label in result["overall"]:
        assert f"\n| {label} | " in md
