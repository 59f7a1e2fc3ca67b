"""``decoding.method: auto`` (service/execution/auto.py): the per-route rule and the config it needs."""

from __future__ import annotations

import pytest

from racer_batch.service.execution.auto import EXPLORE_EVERY, EXPLORE_ROWS, MethodChooser
from racer_batch.values import DecodingConfig


def _feed(ch: MethodChooser, route: str, n: int, speed: dict[str, float]) -> list[str]:
    """``n`` greedy rows of ``route``, each finishing at once with ``speed[method]`` tokens per second."""
    got = []
    for _ in range(n):
        m = ch.pick(route, greedy=True)
        got.append(m)
        ch.observe(route, m, tokens=100, steps=40, busy_ms=100_000.0 / speed[m])
    return got


def test_each_candidate_first_then_the_fastest_with_a_little_exploration():
    ch = MethodChooser(("racer", "pld", "ar"))
    speed = {"racer": 80.0, "pld": 60.0, "ar": 40.0}
    first = 3 * EXPLORE_ROWS
    got = _feed(ch, "code", first + 3 * EXPLORE_EVERY, speed)
    assert got[:first] == ["racer"] * EXPLORE_ROWS + ["pld"] * EXPLORE_ROWS + ["ar"] * EXPLORE_ROWS
    later = got[first:]
    explored = [m for i, m in enumerate(later, start=1) if i % EXPLORE_EVERY == 0]
    assert explored == ["pld", "ar", "pld"]  # the least-tried other candidate, in turn
    assert all(m == "racer" for i, m in enumerate(later, start=1) if i % EXPLORE_EVERY)
    ev = ch.evidence()["code"]
    assert ev["choice"] == "racer" and ev["candidates"]["racer"]["tokens_per_s"] == pytest.approx(80.0)
    assert ev["candidates"]["ar"]["mat"] == 2.5
    assert sum(c["rows"] for c in ev["candidates"].values()) == first + 3 * EXPLORE_EVERY


def test_routes_choose_apart_and_the_choice_follows_the_measurements():
    ch = MethodChooser(("racer", "pld", "ar"))
    _feed(ch, "code", 20, {"racer": 50.0, "pld": 90.0, "ar": 40.0})
    _feed(ch, "chat", 20, {"racer": 70.0, "pld": 30.0, "ar": 40.0})
    ev = ch.evidence()
    assert (ev["chat"]["choice"], ev["code"]["choice"]) == ("racer", "pld") and list(ev) == ["chat", "code"]


def test_sampled_rows_always_go_to_the_first_candidate():
    ch = MethodChooser(("pld", "racer"))
    assert {ch.pick("r", greedy=False) for _ in range(5)} == {"pld"}
    assert ch.pick("r", greedy=True) == "pld" and ch.routes["r"].stats["pld"].assigned == 1


def test_the_config_of_method_auto():
    cfg = DecodingConfig(method="auto", auto_methods=["pld", "ar"], capacity=8)
    assert cfg.for_method("pld").method == "pld" and cfg.for_method("pld").capacity == 8
    assert DecodingConfig().config_hash() == DecodingConfig(auto_methods=("racer", "pld", "ar")).config_hash()
    for bad in ([], ["racer", "racer"], ["auto"], ["nope"]):
        with pytest.raises(ValueError):
            DecodingConfig(method="auto", auto_methods=bad)
    with pytest.raises(ValueError, match="needs acceptance lossless"):
        DecodingConfig(method="auto", acceptance="topk")
    from racer_batch.engine import Engine
    from tests.helpers import tiny_bundle

    with pytest.raises(ValueError, match="an Engine runs one method"):
        Engine(tiny_bundle(), cfg)
