"""benchmarks/cross_row.py: which state a row runs on under each scope, and the MAT ratios it reports."""

from __future__ import annotations

import doctest

import pytest

from benchmarks import cross_row


def test_doctests():
    assert doctest.testmod(cross_row).failed == 0


def test_state_keys_follow_the_service_shards_and_actors():
    keys = {s: [cross_row.state_key(s, i, 3, 2) for i in range(12)] for s in cross_row.SCOPES}
    assert keys["row"] == list(range(12))  # a new state every row
    assert keys["shard"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # a new state every shard
    assert keys["actor"] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]  # shard i on actor i % 2, kept
    assert keys["job"] == [0] * 12
    with pytest.raises(ValueError, match="unknown scope"):
        cross_row.state_key("global", 0, 3, 2)


def _run(scope: str, steps: list[int], texts: list[str] | None = None) -> dict:
    rows = [{"id": i, "route": "a" if i < 4 else "b", "shard": i // 2, "tokens": 12, "steps": s,
             "text": [(texts or ["x"] * len(steps))[i]]} for i, s in enumerate(steps)]
    return {"scope": scope, "capacity": 4, "max_nodes": 100, "wall_s": 1.0, "rows": rows}


def test_analyse_pools_the_shards_after_each_actors_first():
    runs = [_run("row", [12, 12, 12, 12, 12, 12]), _run("actor", [1, 1, 8, 8, 6, 6]),
            _run("job", [1, 1, 6, 6, 4, 4], ["x", "x", "x", "y", "x", "x"])]
    (fig,) = cross_row.analyse(runs, actors=2)
    sc = fig["scopes"]
    # shards 0-1 (rows 0-3) are each actor's first: only rows 4-5 (shard 2) count
    assert sc["actor"]["mat"] == pytest.approx(24 / 12) and sc["job"]["mat"] == pytest.approx(24 / 8)
    assert sc["row"]["mat"] == pytest.approx(1.0)
    assert sc["job"]["over_actor"] == 1.5 and sc["job"]["over_row"] == 3.0 and sc["actor"]["over_row"] == 2.0
    assert sc["job"]["routes"] == {"b": pytest.approx(3.0)}
    assert sc["job"]["mat_all_rows"] == pytest.approx(72 / 22)
    assert sc["job"]["rows_differing_from_row_scope"] == 1 and sc["actor"]["rows_differing_from_row_scope"] == 0
    md = cross_row.render({"stamp": "s", "machine": {"cpu": "CPU X", "cores": 2}, "command": "c", "rows": 6,
                           "args": {"per_group": 1, "max_new_tokens": 8, "shard_rows": 2, "actors": 2},
                           "figures": [fig]})
    assert "| 4 | 100 | 1 |  | 2 | 3 | 1.5 |  | 3 | 2 |" in md  # shard did not run: blank and "'4/100/job': 1" in md


def test_slim_keeps_a_texts_hash_not_the_text():
    run = _run("job", [1, 2], ["a", "b"])
    kept = cross_row.slim(run)
    assert [r["steps"] for r in kept["rows"]] == [1, 2] and run["rows"][0]["text"] == ["a"]  # the input untouched
    assert kept["rows"][0]["text"] != kept["rows"][1]["text"] and len(kept["rows"][0]["text"]) == 16
    assert cross_row.slim(_run("row", [3, 3], ["a", "b"]))["rows"][0]["text"] == kept["rows"][0]["text"]
