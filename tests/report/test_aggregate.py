"""Aggregation on a hand-made telemetry Parquet; every expected number is worked out by hand below."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from racer_batch.report.aggregate import OVERALL, aggregate, throughput_timeline
from racer_batch.report.build import build_report, render_md, write_report
from racer_batch.report.load import load_output
from racer_batch.service.results.schema import OUTPUT_SCHEMA, to_table

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _row(row_idx, route, status, *, prompt, out, steps, prefill, decode, hist, src=(0, 0, 0, 0), fin_s):
    return {
        "id": f"r{row_idx}", "row_idx": row_idx, "shard": 0, "route": route, "status": status,
        "error": "boom" if status == "error" else None, "text": "t", "turn_texts": ["t"],
        "prompt_tokens": prompt, "output_tokens": out, "steps": steps, "mat": out / steps if steps else None,
        "accepted_hist": hist, "accepted_retrieval": src[0], "accepted_logits": src[1], "accepted_both": src[2],
        "accepted_other": src[3], "prefill_ms": prefill, "decode_ms": decode, "device": "cpu", "job_id": "hand",
        "method": "racer", "finished_at": T0 + dt.timedelta(seconds=fin_s),
    }


# route a: r0 ok      10 prompt, 80 out, 40 steps, 2.0 s (200+1800 ms), hist [10,20,10] -> 20*1+10*2 = 40 accepted
#                     (retrieval 25, logits 10, both 5), finished at +10 s (started at +8 s)
#          r1 error   5 prompt, nothing generated, finished at +11 s
# route b: r2 ok      20 prompt, 30 out, 20 steps, 1.0 s, hist [12,6,2] -> 6+4 = 10 accepted (logits 8, other 2),
#                     finished at +12 s (started at +11 s)
#          r3 cancel  7 prompt, 4 out, 4 steps, 0.5 s, hist [4], finished at +14 s (started at +13.5 s)
ROWS = [
    _row(0, "a", "ok", prompt=10, out=80, steps=40, prefill=200.0, decode=1800.0, hist=[10, 20, 10],
         src=(25, 10, 5, 0), fin_s=10),
    _row(1, "a", "error", prompt=5, out=None, steps=None, prefill=None, decode=None, hist=[], fin_s=11),
    _row(2, "b", "ok", prompt=20, out=30, steps=20, prefill=100.0, decode=900.0, hist=[12, 6, 2],
         src=(0, 8, 0, 2), fin_s=12),
    _row(3, "b", "cancelled", prompt=7, out=4, steps=4, prefill=50.0, decode=450.0, hist=[4], fin_s=14),
]
PRICE = 3.6  # USD per device-hour = 0.001 USD per device-second


@pytest.fixture()
def hand_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(to_table(ROWS), out / "part-00000.parquet")
    (out / "manifest.json").write_text(json.dumps({"job_id": "hand", "name": "hand", "state": "done",
                                                   "model": "m", "method": "racer", "spec": {}}))
    return out


def test_route_numbers_by_hand(hand_folder):
    rows = load_output(hand_folder).rows.to_pylist()
    assert len(rows) == 4
    st = aggregate(rows)
    assert list(st) == ["a", "b", OVERALL]
    a, b, al = (st[k].to_dict(PRICE) for k in ("a", "b", OVERALL))

    assert (a["rows"], a["ok"], a["failed"], a["cancelled"]) == (2, 1, 1, 0)
    assert (a["prompt_tokens"], a["output_tokens"], a["steps"]) == (15, 80, 40)
    assert a["device_s"] == pytest.approx(2.0)
    assert a["wall_s"] == pytest.approx(3.0)  # +8 s (r0 start) .. +11 s (r1 end)
    assert a["tokens_per_device_s"] == pytest.approx(40.0)  # 80 / 2
    assert a["tokens_per_wall_s"] == pytest.approx(80 / 3)
    assert a["mat"] == pytest.approx(2.0)  # 80 / 40
    assert a["accepted_hist"] == [10, 20, 10]
    assert (a["share_retrieval"], a["share_logits"], a["share_both"], a["share_other"]) == (0.625, 0.25, 0.125, 0.0)
    assert a["cost_usd"] == pytest.approx(0.002)  # 3.6 * 2 / 3600
    assert a["cost_per_m_tokens"] == pytest.approx(25.0)  # 0.002 / 80 * 1e6
    assert a["device_hours_per_m_tokens"] == pytest.approx(2 / 3600 / 80 * 1e6)

    assert (b["rows"], b["ok"], b["failed"], b["cancelled"]) == (2, 1, 0, 1)
    assert (b["prompt_tokens"], b["output_tokens"], b["steps"]) == (27, 34, 24)
    assert b["device_s"] == pytest.approx(1.5)
    assert b["wall_s"] == pytest.approx(3.0)  # +11 s .. +14 s
    assert b["mat"] == pytest.approx(34 / 24)
    assert b["accepted_hist"] == [16, 6, 2]
    assert (b["share_logits"], b["share_other"], b["share_retrieval"]) == (0.8, 0.2, 0.0)
    assert b["cost_per_m_tokens"] == pytest.approx(0.0015 / 34 * 1e6)  # 44.12

    assert (al["rows"], al["ok"], al["failed"], al["cancelled"]) == (4, 2, 1, 1)
    assert (al["prompt_tokens"], al["output_tokens"], al["steps"]) == (42, 114, 64)
    assert al["device_s"] == pytest.approx(3.5)
    assert al["wall_s"] == pytest.approx(6.0)  # +8 s .. +14 s
    assert al["mat"] == pytest.approx(1.78125)  # 114 / 64
    assert al["accepted_hist"] == [26, 26, 12]
    assert (al["share_retrieval"], al["share_logits"], al["share_both"], al["share_other"]) == (0.5, 0.36, 0.1, 0.04)
    assert al["cost_per_m_tokens"] == pytest.approx(0.0035 / 114 * 1e6)  # 30.70
    assert st[OVERALL].to_dict(None)["cost_per_m_tokens"] is None  # no price, no cost


def test_gpu_devices_per_actor_scale_device_seconds():
    rows = [dict(ROWS[0], device="cuda:0")]
    half = aggregate(rows, spec={"resources": {"gpus_per_actor": 0.5}})["a"]
    two = aggregate(rows, spec={"resources": {"gpus_per_actor": 2}})["a"]
    assert (half.device_s, two.device_s) == pytest.approx((1.0, 4.0))


def test_timeline_spreads_tokens_over_generation_time():
    row = {"route": "x", "output_tokens": 100, "prefill_ms": 0.0, "decode_ms": 10_000.0,
           "finished_at": T0 + dt.timedelta(seconds=10)}
    t, rates = throughput_timeline([row], bins=2)
    assert t == pytest.approx([2.5, 7.5]) and rates["x"] == pytest.approx([10.0, 10.0])
    t, rates = throughput_timeline(ROWS, bins=6)  # +8 .. +14 s in 1 s bins
    assert sum(rates[OVERALL]) == pytest.approx(114.0)  # every token counted once (bin width 1 s)
    assert rates[OVERALL][0] == pytest.approx(40.0)  # r0: 80 tokens over +8..+10 s
    side = [{"output_tokens": 12, "prefill_ms": 0.0, "decode_ms": 1000.0, "finished_at": T0 + dt.timedelta(seconds=9)}]
    t2, rates2 = throughput_timeline(ROWS, bins=6, side_rows=side, side_label="shadow")
    assert t2 == t and rates2[OVERALL] == rates[OVERALL]  # shadow rows are not job output
    assert rates2["shadow"] == pytest.approx([12.0, 0, 0, 0, 0, 0])  # +8..+9 s


def test_report_without_shadow_says_so_and_writes_formats(hand_folder, tmp_path):
    rep = build_report(load_output(hand_folder), price_per_device_hour=PRICE, n_boot=50)
    assert rep.shadow == [] and "speedup versus a baseline was not measured" in render_md(rep)
    written = write_report(rep, tmp_path / "rep")
    names = sorted(p.name for p in written)
    assert names == ["acceptance_hist.png", "report.html", "report.json", "report.md", "speed_cost.png",
                     "throughput.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "was not measured" in html
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["routes"]["a"]["cost_per_m_tokens"] == pytest.approx(25.0) and js["shadow"] == []


def test_cli_report_on_a_folder(hand_folder, tmp_path):
    from racer_batch.cli import main

    res = CliRunner().invoke(main, ["report", str(hand_folder), "--format", "json", "--out",
                                          str(tmp_path / "r"), "--price-per-gpu-hour", "3.6"])
    assert res.exit_code == 0, res.output
    js = json.loads((tmp_path / "r" / "report.json").read_text())
    assert js["routes"][OVERALL]["output_tokens"] == 114
    bad = CliRunner().invoke(main, ["report", str(tmp_path / "nope"), "--redis-url", "redis://127.0.0.1:1/0"])
    assert bad.exit_code == 4 and "Redis" in bad.output
    by = CliRunner().invoke(main, ["report", str(hand_folder), "--by", "nope"])
    assert by.exit_code == 2 and "not an output column" in by.output


def test_schema_of_hand_parquet_is_the_declared_one(hand_folder):
    assert pq.read_schema(hand_folder / "part-00000.parquet").equals(OUTPUT_SCHEMA, check_metadata=False)


@pytest.mark.service
def test_cli_report_by_job_id_from_redis(hand_folder, tmp_path):
    import uuid

    from racer_batch.cli import main
    from racer_batch.service.execution.queue import QueueUnavailable, connect

    url = "redis://127.0.0.1:6379/0"
    try:
        r = connect(url, timeout_s=2.0)
    except QueueUnavailable as exc:
        pytest.skip(f"needs Redis: {exc}")
    prefix = f"rbtest-report-{uuid.uuid4().hex[:8]}:"
    try:
        r.hset(f"{prefix}job:job-42", mapping={"output": str(hand_folder), "spec": "{}"})
        res = CliRunner().invoke(main, ["report", "job-42", "--redis-url", url, "--prefix", prefix,
                                              "--format", "json", "--out", str(tmp_path / "r")])
        assert res.exit_code == 0, res.output
        assert json.loads((tmp_path / "r" / "report.json").read_text())["job"]["job_id"] == "hand"
        res = CliRunner().invoke(main, ["report", "job-43", "--redis-url", url, "--prefix", prefix])
        assert res.exit_code == 2 and "neither an output folder nor a known job id" in res.output
    finally:
        r.delete(*r.keys(f"{prefix}*") or ["-"])
