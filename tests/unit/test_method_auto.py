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
    speed = {"racer": 80.0, "pld": 75.0, "ar": 78.0}
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


def test_a_candidate_measured_far_slower_stops_being_explored():
    from racer_batch.service.execution.auto import EXPLORE_SPREAD

    # pld within the spread of one row of racer, ar far below it
    speed = {"racer": 80.0, "pld": 80.0 / (1 + 0.9 * EXPLORE_SPREAD), "ar": 40.0}
    ch = MethodChooser(("racer", "pld", "ar"))
    later = _feed(ch, "code", 3 + 8 * EXPLORE_EVERY, speed)[3:]
    explored = [m for i, m in enumerate(later, start=1) if i % EXPLORE_EVERY == 0]
    # pld is tried again while its widened rate reaches racer's (the spread narrows as its rows grow), ar never
    assert explored == ["pld", "racer", "racer", "racer", "racer", "racer", "racer", "racer"]
    assert ch.routes["code"].stats["ar"].assigned == 1
    rc = ch.routes["code"]
    assert rc.may_be_best("pld", "racer") is False and rc.may_be_best("ar", "racer") is False
    # a candidate with nothing finished (its first row lost with a killed actor) may still be the best
    rc.stats["ar"] = type(rc.stats["ar"])(assigned=1)
    assert rc.may_be_best("ar", "racer") is True


def test_actors_starting_a_route_at_once_claim_each_first_row_once():
    claims: dict = {}

    class Claiming(_MemoryShare):
        def claim(self, route, method):
            claims[(route, method)] = claims.get((route, method), 0) + 1
            return claims[(route, method)]

    board: dict = {}
    a = MethodChooser(("racer", "pld", "ar"), share=Claiming(board, "a"), clock=lambda: 0.0)
    b = MethodChooser(("racer", "pld", "ar"), share=Claiming(board, "b"), clock=lambda: 0.0)
    # neither re-reads the board (the clock stands still), so only the claims tell them what the other took
    picks = [a.pick("r", greedy=True), b.pick("r", greedy=True), a.pick("r", greedy=True),
             b.pick("r", greedy=True), b.pick("r", greedy=True)]
    # b's rows after the first ones: nothing is measured anywhere yet (no job ranking), so the least-given
    # candidate, counting a first row claimed elsewhere as given
    assert picks == ["racer", "pld", "ar", "racer", "pld"]
    got = {m: a.routes["r"].stats[m].assigned + b.routes["r"].stats[m].assigned for m in a.candidates}
    assert got == {"racer": 2, "pld": 2, "ar": 1}  # one first row per candidate, job-wide
    assert (a.routes["r"].claimed_elsewhere, b.routes["r"].claimed_elsewhere) == ({"pld"}, {"ar"})


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


class _MemoryShare:
    """An in-memory ``auto.EvidenceShare`` of one job: each chooser's own totals under its own name."""

    def __init__(self, board: dict, me: str) -> None:
        self.board, self.me = board, me
        self.reads = 0

    def publish(self, route, method, counters):
        self.board[(self.me, route, method)] = dict(counters)

    def others(self):
        self.reads += 1
        out: dict = {}
        for (who, route, method), c in self.board.items():
            if who != self.me:
                acc = out.setdefault(route, {}).setdefault(method, {})
                for k, v in c.items():
                    acc[k] = acc.get(k, 0) + v
        return out


def test_actors_sharing_evidence_explore_a_route_once_and_choose_from_the_sum():
    board: dict = {}
    now = [0.0]
    a = MethodChooser(("racer", "pld", "ar"), share=_MemoryShare(board, "a"), clock=lambda: now[0])
    b = MethodChooser(("racer", "pld", "ar"), share=_MemoryShare(board, "b"), clock=lambda: now[0])
    speed = {"racer": 50.0, "pld": 90.0, "ar": 40.0}
    assert _feed(a, "code", 3, speed) == ["racer", "pld", "ar"]
    now[0] += 10.0  # past SHARE_REFRESH_S: b reads a's totals
    # b's first rows of the route go to the best measured by a, with no exploring of its own
    assert _feed(b, "code", EXPLORE_EVERY - 1, speed) == ["pld"] * (EXPLORE_EVERY - 1)
    assert b.routes["code"].stats["racer"].assigned == 0
    # a's evidence also makes b's choice on a route b never measured a candidate of
    ev = b.evidence()["code"]
    assert ev["choice"] == "pld" and set(c["rows"] for m, c in ev["candidates"].items() if m != "pld") == {0}
    # the summaries keep each actor's own rows: pooled, every row counts once
    total = sum(c["rows"] for ch in (a, b) for c in ch.evidence()["code"]["candidates"].values())
    assert total == 3 + EXPLORE_EVERY - 1


def test_the_other_actors_evidence_is_read_at_most_every_refresh_interval():
    from racer_batch.service.execution.auto import SHARE_REFRESH_S

    board: dict = {}
    now = [0.0]
    share = _MemoryShare(board, "a")
    a = MethodChooser(("racer", "ar"), share=share, clock=lambda: now[0])
    assert _feed(a, "r", 4, {"racer": 50.0, "ar": 40.0}) == ["racer", "ar", "racer", "racer"]
    assert share.reads == 1
    # another actor publishes ar at 100 tokens/s over 10 rows
    board[("c", "r", "ar")] = {"assigned": 10, "rows": 10, "tokens": 1000, "steps": 500, "busy_ms": 10_000.0}
    assert a.pick("r", greedy=True) == "racer"  # not read yet
    now[0] += SHARE_REFRESH_S
    assert a.pick("r", greedy=True) == "ar" and share.reads == 2
    assert board[("a", "r", "ar")]["assigned"] == 2  # a published its own totals only
    # sampled rows neither read nor publish
    a.pick("r", greedy=False)
    assert share.reads == 2


def test_a_failing_share_leaves_the_chooser_on_its_own_evidence():
    class Broken:
        def publish(self, *a):
            return None

        def others(self):
            return {}

    ch = MethodChooser(("racer", "pld"), share=Broken())
    assert _feed(ch, "r", 2, {"racer": 10.0, "pld": 20.0}) == ["racer", "pld"]
    assert ch.pick("r", greedy=True) == "pld"


def test_a_new_route_with_nothing_measured_yet_leans_on_the_other_routes():
    ch = MethodChooser(("racer", "pld", "ar"))
    _feed(ch, "a", 6, {"racer": 20.0, "pld": 30.0, "ar": 90.0})
    # route b: its first rows try each candidate; while none has finished, the next goes to route a's fastest
    assert [ch.pick("b", greedy=True) for _ in range(4)] == ["racer", "pld", "ar", "ar"]
    # once route b measures, its own figures decide
    for m, speed in (("racer", 100.0), ("pld", 10.0), ("ar", 10.0)):
        ch.observe("b", m, tokens=100, steps=40, busy_ms=100_000.0 / speed)
    assert ch.pick("b", greedy=True) == "racer"


def test_while_a_first_row_is_out_the_route_goes_by_the_job_ranking_not_by_the_first_to_finish():
    ch = MethodChooser(("racer", "pld", "ar"))
    _feed(ch, "a", 3, {"racer": 20.0, "pld": 30.0, "ar": 90.0})  # the job so far: ar fastest
    assert [ch.pick("b", greedy=True) for _ in range(3)] == ["racer", "pld", "ar"]
    ch.observe("b", "racer", tokens=100, steps=40, busy_ms=1000.0)  # racer's first row ends first, fast
    # pld's and ar's first rows are still out: the route's own figures would say racer (the others read 0)
    assert [ch.pick("b", greedy=True) for _ in range(3)] == ["ar", "ar", "ar"]
    for m in ("pld", "ar"):
        ch.observe("b", m, tokens=100, steps=40, busy_ms=10_000.0)
    assert ch.pick("b", greedy=True) == "racer"  # every candidate measured here: the route's own figures decide


def test_rows_are_compared_as_if_at_one_context_and_reported_as_measured():
    ch = MethodChooser(("ar", "pld"))
    assert [ch.pick("r", greedy=True) for _ in range(2)] == ["ar", "pld"]
    # ar's row had a long prompt (a forward there costs 1.25x one at the reference context), pld's a short one
    ch.observe("r", "ar", tokens=100, steps=100, busy_ms=1000.0, scale=0.8)
    ch.observe("r", "pld", tokens=100, steps=60, busy_ms=900.0)
    assert ch.pick("r", greedy=True) == "ar"  # 125 tokens/s at one context against pld's 111; raw 100 vs 111
    ev = ch.evidence()["r"]
    assert ev["candidates"]["ar"]["tokens_per_s"] == pytest.approx(100.0)  # the report keeps the measured figure
    assert ch.routes["r"].stats["ar"].counters()["adj_ms"] == pytest.approx(800.0)


def test_the_job_ranking_compares_candidates_within_each_route_not_pooled():
    ch = MethodChooser(("racer", "ar"))
    # a slow route (long prompts) where ar had most rows, a fast one where racer had most: ar is faster on both,
    # yet pooled over the two routes racer's tokens per second would be the higher (its rows fell on the fast one)
    for route, n_ar, n_racer, ar_speed, racer_speed in (("slow", 9, 1, 40.0, 30.0), ("fast", 1, 9, 150.0, 100.0)):
        for m, n, v in (("ar", n_ar, ar_speed), ("racer", n_racer, racer_speed)):
            for _ in range(n):
                ch.observe(route, m, tokens=100, steps=50, busy_ms=100_000.0 / v)
    pooled = {m: sum(ch.routes[r].stats[m].tokens for r in ch.routes)
              / sum(ch.routes[r].stats[m].busy_ms for r in ch.routes) for m in ch.candidates}
    assert pooled["racer"] > pooled["ar"]
    assert ch._prior() == ["ar", "racer"]
    # a new route: after the first rows (still out), the rows go to the job ranking's first
    assert [ch.pick("new", greedy=True) for _ in range(4)] == ["racer", "ar", "ar", "ar"]


def test_the_first_route_spreads_its_rows_while_nothing_is_measured():
    ch = MethodChooser(("racer", "pld", "ar"))
    assert ch._prior() is None
    # 2 actors x 4 rows start before any row ends: no ranking yet, so no candidate takes them all
    assert [ch.pick("first", greedy=True) for _ in range(8)] == ["racer", "pld", "ar"] * 2 + ["racer", "pld"]


def test_candidates_are_compared_on_decode_time_without_the_prompt_forward():
    ch = MethodChooser(("ar", "pld"))
    assert [ch.pick("r", greedy=True) for _ in range(2)] == ["ar", "pld"]
    # ar's row had a long prompt: 600 of its 1000 ms were the prompt forward, which pld pays alike
    ch.observe("r", "ar", tokens=100, steps=100, busy_ms=1000.0, decode_ms=400.0)
    ch.observe("r", "pld", tokens=100, steps=60, busy_ms=600.0, decode_ms=500.0)
    assert ch.pick("r", greedy=True) == "ar"  # 250 decode tokens/s against 200; whole rows 100 vs 167
    ev = ch.evidence()["r"]["candidates"]
    assert ev["ar"]["tokens_per_s"] == pytest.approx(100.0) and ev["pld"]["tokens_per_s"] == pytest.approx(166.7, 0.01)


def test_the_context_scale_follows_the_two_measured_curves():
    from racer_batch.engine.capacity import context_scale

    short, long = {4: 10.0, 8: 12.0}, (1024, {4: 14.0, 8: 20.0})
    assert context_scale(short, None, 4, 2000) == 1.0  # no long curve: nothing scaled
    assert context_scale(short, long, 4, 256) == pytest.approx(1.0)
    assert context_scale(short, long, 4, 1024) == pytest.approx(10.0 / 14.0)
    assert context_scale(short, long, 4, 2048) < context_scale(short, long, 4, 1024) < 1.0


def test_a_shard_gives_the_chooser_each_rows_decode_time():
    from types import SimpleNamespace

    from racer_batch.service.execution.job_engines import ShardEngines

    shard = ShardEngines.__new__(ShardEngines)  # only what observe reads
    shard.auto, shard.chooser, shard.first = True, MethodChooser(("ar", "pld")), object()  # no context_scale: 1.0
    rec = SimpleNamespace(status="ok", output_tokens=100, prompt_tokens=50, steps=100, busy_ms=1000.0,
                          decode_ms=900.0)
    shard.observe("r", "ar", rec, greedy=True, prefill_ms=300.0)  # batched: its share less its prompt forward
    shard.observe("r", "pld", rec, greedy=True)  # ran alone: its own decode time
    stats = shard.chooser.routes["r"].stats
    assert (stats["ar"].adj_ms, stats["ar"].busy_ms) == (pytest.approx(700.0), pytest.approx(1000.0))
    assert stats["pld"].adj_ms == pytest.approx(900.0)
    shard.observe("r", "ar", SimpleNamespace(**{**vars(rec), "status": "error"}), greedy=True, prefill_ms=1.0)
    assert stats["ar"].rows == 1  # a failed row teaches nothing


def test_the_pooled_choice_of_one_shard_is_the_shards_own_for_near_equal_candidates():
    """``pool`` ranks the candidates by rates recomputed from the summed ms, unrounded, and the summaries keep the
    ms to 3 decimals: two candidates 0.003% apart (pld listed first and slower, equal at 0.01 tokens/s) come out
    in the shard's order."""
    from racer_batch.service.results.method_auto import figures, pool

    ev = {"r": {"choice": "racer", "candidates": {"pld": figures(1, 100, 50, 1000.04, 1000.04),
                                                  "racer": figures(1, 100, 50, 1000.01, 1000.01)}}}
    cands = ev["r"]["candidates"]
    assert cands["racer"]["compared_tokens_per_s"] == cands["pld"]["compared_tokens_per_s"]  # equal when rounded
    assert pool([ev])["r"]["choice"] == "racer"
