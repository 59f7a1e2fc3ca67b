"""scripts/host_bench.py end to end on the tiny model: head only, one round, B = 2, 8 new tokens."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_bench.py"


@pytest.fixture(scope="module")
def host_bench():
    spec = importlib.util.spec_from_file_location("host_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["host_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_parsers(host_bench):
    assert host_bench.parse_grid("tiny-random=8,1;smollm2-135m=2") == {"tiny-random": [1, 8], "smollm2-135m": [2]}
    assert host_bench.parse_methods("racer-c4,ar") == [("racer-c4", "racer", 4), ("ar", "ar", 1)]
    assert host_bench.parse_tokens("tiny-random=16", ["tiny-random", "smollm2-135m"], host_bench.DEFAULT_TOKENS) == {
        "tiny-random": 16, "smollm2-135m": host_bench.DEFAULT_TOKENS["smollm2-135m"]}
    assert [host_bench.prompts_for(b, 16) for b in (1, 8, 16, 32, 64)] == [10, 16, 24, 40, 72]
    for bad in ("tiny-random", "tiny-random=0", "x=a"):
        with pytest.raises(ValueError):
            host_bench.parse_grid(bad)
    with pytest.raises(ValueError):
        host_bench.parse_methods("racer-c0")


def test_host_bench_smoke_on_the_tiny_model(host_bench, tmp_path):
    """Each setting in its own child process on this checkout: the host time, its parts and the tokens."""
    rc = host_bench.main(["--no-base", "--grid", "tiny-random=2", "--methods", "racer-c4,ar", "--max-new-tokens", "8",
                          "--rounds", "1", "--max-prompts", "1", "--out", str(tmp_path), "--tag", "smoke"])
    assert rc == 0
    (jpath,) = tmp_path.glob("host-*-smoke.json")
    d = json.loads(jpath.read_text())
    assert set(d["revisions"]) == {"head"} and d["settings"]["rounds_done"] == 1
    assert {(r["setting"], r["streams"]) for r in d["rows"]} == {("racer-c4", 2), ("ar", 2)}
    for raw in d["raw"]:
        run, dv = raw["run"], raw["derived"]
        assert run["output_tokens"] > 0 and run["stream_steps"] > 0 and run["prompts"] == 10
        assert dv["host_us"] > 0 and dv["tokens_per_s"] > 0
        named = {p: v for p, v in dv["parts_us"].items() if p != "other"}
        assert set(host_bench.PARTS) <= set(named), named
        assert all(v >= 0 for v in named.values())
        # the named parts fit in the host time of their run (the tolerance: timer granularity, wrapping correction)
        assert dv["split_host_us"] > 0
        assert sum(named.values()) <= dv["split_host_us"] * 1.05 + 5.0
        assert abs(sum(dv["parts_us"].values()) - dv["split_host_us"]) < 1e-6 * max(1.0, dv["split_host_us"])
        assert run["forward_ms"].get("prefill", 0) > 0
    md = tmp_path.joinpath(jpath.name.replace(".json", ".md")).read_text()
    assert "| tiny-random | racer-c4 | 2 |" in md and "Machine:" in md and "avx512f" in md
