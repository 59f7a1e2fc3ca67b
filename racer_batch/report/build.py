"""Assemble a report (numbers + charts) from a job's output folder and write it as Markdown, HTML or JSON.

HTML is one self-contained file (charts embedded as base64 PNG); Markdown links the PNG files written next
to it; JSON has every number (no charts).
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from racer_batch.report import charts, drafting
from racer_batch.report.aggregate import OVERALL, aggregate, throughput_timeline
from racer_batch.report.load import JobData
from racer_batch.report.markdown import md_table
from racer_batch.report.shadow import acceptance_rule, analyze

CHART_FILES = {"acceptance": "acceptance_hist.png", "speed_cost": "speed_cost.png", "throughput": "throughput.png"}
NO_SHADOW = ("No shadow rows: speedup versus a baseline was not measured for this job, and none is estimated "
             "here. Add a `shadow:` block to the job spec (or raise its `fraction`: the sample may have picked no "
             "row), or run `racer-batch shadow JOB --baseline ar`.")


def relaxed_banner(job: dict) -> Optional[str]:
    """The header line of a job decoded with relaxed (output-changing) acceptance; None for lossless jobs."""
    rule = job.get("acceptance")
    if not rule:
        return None
    return (f"Relaxed acceptance ({rule}): this job's outputs differ from what the model alone would produce, "
            "by design. Read the capability table (shadow rows against lossless decoding) beside any speed gain.")


@dataclass
class Report:
    title: str
    job: dict  # id, name, model, method, state, rows, output folder, config hash
    by: str
    price_per_device_hour: Optional[float]
    routes: dict[str, dict]  # group -> RouteStats.to_dict(), OVERALL last
    shadow: list[dict]  # ShadowResult.to_dict() per run and route
    timeline: dict  # {"t_s": [...], "tokens_per_s": {group: [...]}}
    charts: dict[str, bytes] = field(default_factory=dict)  # name -> PNG
    life: dict = field(default_factory=dict)  # drafting.shard_life: MAT per shard, cold against warm
    method_choice: dict = field(default_factory=dict)  # drafting.method_choice (method auto), else {}

    def to_json(self) -> dict:
        return {"title": self.title, "job": self.job, "by": self.by,
                "price_per_device_hour": self.price_per_device_hour, "routes": self.routes,
                "shadow": self.shadow, "shadow_note": None if self.shadow else NO_SHADOW,
                "timeline": self.timeline, "charts": {k: CHART_FILES[k] for k in self.charts},
                "draft_state": self.life, "method_auto": self.method_choice}

    def summary_lines(self) -> list[str]:
        a = self.routes[OVERALL]
        lines = [f"{self.title}: {a['rows']} rows (ok {a['ok']}, failed {a['failed']}), "
                 f"{a['output_tokens']} output tokens, MAT {_f(a['mat'])}, "
                 f"{_f(a['tokens_per_device_s'], 1)} tokens per device-second"]
        for s in self.shadow:
            if s["route"] == OVERALL:
                lines.append(f"shadow vs {s['baseline']} ({s['run']}): {s['pairs_ok']} pairs, greedy exact match "
                             f"{_pct(s['greedy_exact_match_rate'])}, speed ratio {_f(s['speed_ratio'])}x")
                cap = s.get("capability")
                if s.get("relaxed") and cap:
                    lines.append(f"  relaxed acceptance ({s['acceptance_rule']}): exact match "
                                 f"{_pct(cap['exact_match_rate'])}, accuracy {_acc(cap['method'])} (method) vs "
                                 f"{_acc(cap['baseline'])} (baseline)")
        if not self.shadow:
            lines.append("no shadow rows: speedup not measured")
        banner = relaxed_banner(self.job)
        if banner:
            lines.insert(1, banner + ("" if self.shadow else " NO shadow rows: the capability cost was not measured."))
        return lines


def _weights_text(job: dict) -> str:
    """``as_stored``, ``float32``, ``as_stored + float32`` (shards on both), or ``unrecorded`` (older output)."""
    return " + ".join(job.get("weights") or []) or "unrecorded"


def _job_summary(data: JobData, rows: list[dict]) -> dict:
    """The report's ``job`` block: identity, model, method, state and sizes, from the manifest and spec."""
    m = data.manifest
    spec = data.spec
    return {"job_id": data.job_id, "name": m.get("name") or spec.get("name"), "state": m.get("state"),
            "model": m.get("model"), "dtype": m.get("dtype") or "default", "method": m.get("method"),
            # the weights the shards ran on (as_stored / float32; model.weights may be unset), from their summaries
            "weights": sorted({str(v["weights"]) for v in (m.get("shards") or {}).values()
                               if isinstance(v, dict) and v.get("weights")}),
            "config_hash": m.get("config_hash"), "spec_hash": m.get("spec_hash"), "rows": len(rows),
            "output": str(data.out_dir), "decoding": spec.get("decoding"),
            "max_new_tokens": (spec.get("generation") or {}).get("max_new_tokens"),
            "devices": sorted({str(r.get("device")) for r in rows if r.get("device")}),
            "acceptance": acceptance_rule(spec.get("decoding"))}


def _shadow_dicts(data: JobData, rows: list[dict], *, by: str, n_boot: int) -> list[dict]:
    """``ShadowResult.to_dict()`` per run and route; only the OVERALL ones when grouping by other than route
    (shadow groups are routes)."""
    job_rows = {r["row_idx"]: r for r in rows}
    shadow = [r.to_dict(n_boot=n_boot)
              for r in analyze(data.shadow.to_pylist(), job_rows=job_rows, decoding=data.spec.get("decoding"))]
    if by != "route":
        shadow = [s for s in shadow if s["route"] == OVERALL]
    return shadow


def _timeline(data: JobData, rows: list[dict], *, by: str) -> tuple[list[float], dict[str, list[float]]]:
    """``throughput_timeline`` of the job's rows, with the in-job shadow baseline rows as a side line."""
    in_job_baseline = [r for r in data.shadow.to_pylist() if r["run"] == "job" and r["side"] == "baseline"]
    label = f"shadow baseline rows ({in_job_baseline[0]['method']}, not job output)" if in_job_baseline else ""
    return throughput_timeline(rows, by=by, side_rows=in_job_baseline, side_label=label)


def build_report(data: JobData, *, by: str = "route", price_per_device_hour: Optional[float] = None,
                 title: Optional[str] = None, n_boot: int = 2000, with_charts: bool = True) -> Report:
    """Numbers (and, with ``with_charts``, PNG charts) of one output folder, grouped ``by`` a row column;
    ``price_per_device_hour`` (USD) turns device-hours into cost; ``n_boot``: bootstrap resamples of the CI."""
    rows = data.rows.to_pylist()
    stats = aggregate(rows, by=by, spec=data.spec)
    routes = {k: v.to_dict(price_per_device_hour) for k, v in stats.items()}
    shadow = _shadow_dicts(data, rows, by=by, n_boot=n_boot)
    centres, rates = _timeline(data, rows, by=by)
    job = _job_summary(data, rows)
    rep = Report(title=title or f"Job {job['name'] or ''} {data.job_id}".replace("  ", " ").strip(), job=job, by=by,
                 price_per_device_hour=price_per_device_hour, routes=routes, shadow=shadow,
                 timeline={"t_s": centres, "tokens_per_s": rates},
                 life=drafting.shard_life(rows, data.manifest, by=by),
                 method_choice=drafting.method_choice(rows, data.manifest, by=by))
    if with_charts:
        rep.charts = {
            "acceptance": charts.acceptance_histograms(routes),
            "speed_cost": charts.speed_and_cost(routes, shadow, price=price_per_device_hour),
            "throughput": charts.throughput_over_time(centres, rates),
        }
    return rep


# ---- rendering
def _f(v: Optional[float], nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _pct(v: Optional[float], nd: int = 0) -> str:
    return "-" if v is None else f"{100 * v:.{nd}f}%"


def _route_name(r: str) -> str:
    return "all" if r == OVERALL else r


def route_table(rep: Report) -> tuple[list[str], list[list[str]]]:
    head = [rep.by, "rows", "ok", "failed", "prompt tokens", "output tokens", "wall s", "device s",
            "tokens/device-s", "MAT", "from retrieval", "from logits", "from both", "device-h / M tokens",
            "USD / M tokens"]
    body = []
    for name, d in rep.routes.items():
        body.append([_route_name(name), str(d["rows"]), str(d["ok"]), str(d["failed"] + d["cancelled"]),
                     str(d["prompt_tokens"]), str(d["output_tokens"]), _f(d["wall_s"], 1), _f(d["device_s"], 1),
                     _f(d["tokens_per_device_s"], 1), _f(d["mat"]), _pct(d["share_retrieval"]),
                     _pct(d["share_logits"]), _pct(d["share_both"]), _f(d["device_hours_per_m_tokens"], 1),
                     _f(d["cost_per_m_tokens"])])
    return head, body


def shadow_table(rep: Report) -> tuple[list[str], list[list[str]]]:
    head = ["run", rep.by if rep.by == "route" else "group", "baseline", "pairs", "greedy exact match",
            "speed ratio (x)", "95% CI", "MAT method", "MAT baseline", "first divergence", "job answers reproduced"]
    body = []
    for s in rep.shadow:
        ci = s["speed_ratio_ci95"]
        mism = s["mismatches"]
        div = "none" if not mism else "; ".join(f"{m['id']} turn {m['turn']} char {m['char']}" for m in mism[:3])
        if len(mism) > 3:
            div += f" (+{len(mism) - 3})"
        jm = "-" if s["job_text_matches"] is None else f"{s['job_text_matches']}/{s['job_text_compared']}"
        body.append([s["run"], _route_name(s["route"]), s["baseline"], str(s["pairs_ok"]),
                     _pct(s["greedy_exact_match_rate"]), _f(s["speed_ratio"]),
                     "-" if not ci else f"{ci[0]:.2f} - {ci[1]:.2f}", _f(s["mat_method"]), _f(s["mat_baseline"]),
                     div, jm])
    return head, body


def _acc(side: dict) -> str:
    """Accuracy of one side of a capability block: "75% (3/4)", or "-" when no turn could be scored."""
    return "-" if not side["scored"] else f"{_pct(side['accuracy'])} ({side['correct']}/{side['scored']})"


def capability_table(rep: Report) -> tuple[list[str], list[list[str]]]:
    """Capability beside speed, per run and route: what the speed ratio cost in answers."""
    head = ["run", rep.by if rep.by == "route" else "group", "acceptance", "pairs", "speed ratio (x)", "95% CI",
            "exact match", "accuracy method", "accuracy baseline", "mean tokens method", "mean tokens baseline",
            "repeated 4-grams method", "repeated 4-grams baseline"]
    body = []
    for s in rep.shadow:
        cap = s.get("capability")
        if not cap:
            continue
        ci = s["speed_ratio_ci95"]
        m, b = cap["method"], cap["baseline"]
        body.append([s["run"], _route_name(s["route"]), "relaxed" if s.get("relaxed") else "lossless",
                     str(cap["pairs"]), _f(s["speed_ratio"]), "-" if not ci else f"{ci[0]:.2f} - {ci[1]:.2f}",
                     _pct(cap["exact_match_rate"]), _acc(m), _acc(b), _f(m["mean_tokens"], 1),
                     _f(b["mean_tokens"], 1), _pct(m["repeated_ngram_rate"], 1), _pct(b["repeated_ngram_rate"], 1)])
    return head, body


def relaxed_lines(rep: Report) -> list[str]:
    """One statement per run whose method side used relaxed acceptance: its outputs differ by design."""
    out, seen = [], set()
    for s in rep.shadow:
        if s.get("relaxed") and s["run"] not in seen:
            seen.add(s["run"])
            out.append(f"Run {s['run']}: outputs differ by design. The method ({s['method']}) used relaxed "
                       f"acceptance ({s['acceptance_rule']}); the baseline ({s['baseline']}) decoded losslessly. "
                       "Exact match below 100% is expected here, not a bug; read accuracy, length and "
                       "repetition beside the speed ratio.")
    return out


def capability_notes(rep: Report) -> list[str]:
    """Notes under the capability table: runs and routes without any scorable reference."""
    unscored = [f"{s['run']} / {_route_name(s['route'])}" for s in rep.shadow
                if s.get("capability") and not s["capability"]["method"]["scored"]]
    if not unscored:
        return []
    return [f"Accuracy not measured for {', '.join(unscored)}: no answer turn had a scorable reference "
            "(a `reference` input column with a number or a short answer)."]


def sampling_lines(rep: Report) -> list[str]:
    """Notes under the shadow table: shadow cost inside the job, and the sampled (non-greedy) comparisons."""
    out = []
    for s in rep.shadow:
        if s["run"] == "job" and s["route"] == OVERALL:
            out.append(f"In-job shadow cost: the baseline rows took {s['baseline_ms'] / 1000:.1f} device-seconds "
                       "on the job's actors, not counted in the per-route table above.")
    for s in rep.shadow:
        if s["sampling"]:
            sm = s["sampling"]
            out.append(f"{s['run']} / {_route_name(s['route'])}: {sm['pairs']} sampled pairs; mean output tokens "
                       f"{sm['mean_tokens_method']:.1f} (method) vs {sm['mean_tokens_baseline']:.1f} (baseline); "
                       f"finish reasons {sm['finish_method']} vs {sm['finish_baseline']}; exact match "
                       f"{_pct(s['sampled_exact_match_rate'])} (not expected to be 100% when sampling)")
    return out


DEFINITIONS = [
    "device s: the actor time the rows used, times devices per actor (GPUs per actor; 1 for a CPU actor). A row "
    "that ran alone counts its generation time (prefill + decode); rows batched on one actor each count their "
    "share of every batched step (on a CPU the whole step, host work and forward; on a GPU the verify forward) "
    "and their prefills.",
    "wall s: from the first row's start to the last row's end; tokens/device-s = output tokens / device s.",
    "MAT: output tokens / steps (the prefill is step 0 and emits one token, so autoregressive MAT = 1).",
    "from retrieval / logits / both: share of accepted draft tokens proposed by that source.",
    "speed ratio: (baseline ms per output token) / (method ms per output token) over the shadow rows, "
    "token-weighted, prefill included; CI: percentile bootstrap over rows (2000 resamples).",
    "first divergence: turn and character offset of the first differing character of a mismatched answer.",
    "exact match (capability table): share of shadow pairs, greedy and sampled, whose answers are equal on "
    "every turn; relaxed: the method side used relaxed (output-changing) acceptance.",
    "accuracy: correct / scored answer turns, over turns whose `reference` input is a number (equal to the "
    "answer's last number; in a GSM8K-style reference the part after ####) or a short text of at most 8 words "
    "(found in the answer, case and spaces folded); longer references are not scored; '-': none could be.",
    "mean tokens: output tokens per row of that side; repeated 4-grams: mean over answer turns of "
    "1 - distinct / total 4-grams of the turn's words (CJK text: characters).",
]


def drafting_sections(rep: Report) -> list[tuple[str, str, list]]:
    """``(heading, note, [tables])`` of the drafting sections: the method chosen per group (method auto) and
    the saved draft state over the job's life (when some shard started warm)."""
    out = []
    if rep.method_choice:
        out.append(("Method per " + rep.by + " (method auto)",
                    "Each group tried every candidate first, then kept the one with the most measured tokens per "
                    "second of actor time, exploring a little (`service/execution/auto.py`); `chosen`: the "
                    "choice over the whole job (the manifest's `method_auto`). Every candidate is lossless.",
                    [drafting.choice_table(rep.method_choice, rep.by)]))
    if any(s["warm_commits"] for s in rep.life.get("shards", [])):
        out.append(("Draft state over the job's life",
                    "MAT per shard, and pooled over the shards that started cold against those that started from "
                    "the job's saved draft state (`started from`: the commits folded into it; "
                    "`resources.warm_draft_state`).",
                    [drafting.cold_warm_table(rep.life, rep.by), drafting.life_table(rep.life, rep.by)]))
    return out


def render_md(rep: Report) -> str:
    j = rep.job
    parts = [f"# {rep.title}", "",
             f"Model `{j['model']}` (dtype {j.get('dtype', 'default')}, weights {_weights_text(j)}), "
             f"method `{j['method']}` "
             f"(config {j['config_hash']}), state {j['state']}, "
             f"{j['rows']} rows, max_new_tokens {j['max_new_tokens']}, devices {', '.join(j['devices']) or '-'}. "
             f"Output: `{j['output']}`."
             + (f" Price: {rep.price_per_device_hour:g} USD per device-hour." if rep.price_per_device_hour is not None
                else " No price given: cost shown as device-hours."), ""]
    if relaxed_banner(j):
        parts += [f"**{relaxed_banner(j)}**", ""]
    parts += [f"## Per {rep.by}", "", md_table(*route_table(rep)), "",
             f"![acceptance histogram]({CHART_FILES['acceptance']})", "",
             "## Speedup against a baseline (shadow rows)", ""]
    if rep.shadow:
        parts += [md_table(*shadow_table(rep)), ""] + [f"- {line}" for line in sampling_lines(rep)]
        parts += ["", "### Capability beside speed", ""]
        for line in relaxed_lines(rep):
            parts += [f"**{line}**", ""]
        parts += [md_table(*capability_table(rep)), ""] + [f"- {line}" for line in capability_notes(rep)]
    else:
        parts += [NO_SHADOW]
    parts += ["", f"![speedup and cost]({CHART_FILES['speed_cost']})", ""]
    for heading, note, tables in drafting_sections(rep):
        parts += [f"## {heading}", "", note, ""] + [x for t in tables for x in (md_table(*t), "")]
    parts += ["## Throughput over time", "",
              f"![tokens per second over time]({CHART_FILES['throughput']})", "", "## Definitions", ""]
    parts += [f"- {d}" for d in DEFINITIONS]
    return "\n".join(parts) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:8px 0 16px}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}img{max-width:100%;
margin:8px 0}.note{background:#fff6e0;border-left:4px solid #e0a000;padding:8px 12px}small{color:#666}"""


def _html_text(text: str) -> str:
    """Escape text for HTML and show Markdown `code` spans as <code>."""
    parts = html.escape(text).split("`")
    return ("".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)) if len(parts) % 2
            else html.escape(text))


def _html_table(head: list[str], body: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><tr>{h}</tr>{rows}</table>"


def _img(rep: Report, name: str, alt: str) -> str:
    png = rep.charts.get(name)
    if png is None:
        return ""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(rep: Report) -> str:
    j = rep.job
    price = (f"Price: {rep.price_per_device_hour:g} USD per device-hour." if rep.price_per_device_hour is not None
             else "No price given: cost shown as device-hours per million tokens.")
    shadow_html = (_html_table(*shadow_table(rep)) + "".join(f"<p>{html.escape(s)}</p>" for s in sampling_lines(rep))
                   + "<h3>Capability beside speed</h3>"
                   + "".join(f'<p class="note">{html.escape(s)}</p>' for s in relaxed_lines(rep))
                   + _html_table(*capability_table(rep))
                   + "".join(f"<p>{_html_text(s)}</p>" for s in capability_notes(rep))
                   if rep.shadow else f'<p class="note">{html.escape(NO_SHADOW)}</p>')
    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(rep.title)}</title>
<style>{_CSS}</style></head><body>
<h1>{html.escape(rep.title)}</h1>
<p>Model <code>{html.escape(str(j['model']))}</code> (dtype {html.escape(str(j.get('dtype', 'default')))}, \
weights {html.escape(_weights_text(j))}), \
method <code>{html.escape(str(j['method']))}</code>
(config {html.escape(str(j['config_hash']))}), state {html.escape(str(j['state']))}, {j['rows']} rows,
max_new_tokens {j['max_new_tokens']}, devices {html.escape(', '.join(j['devices']) or '-')}. {html.escape(price)}<br>
<small>output folder {html.escape(j['output'])}; generated {generated}</small></p>
{f'<p class="note"><b>{html.escape(relaxed_banner(j))}</b></p>' if relaxed_banner(j) else ''}
<h2>Per {html.escape(rep.by)}</h2>
{_html_table(*route_table(rep))}
{_img(rep, 'acceptance', 'acceptance-length histogram per route')}
<h2>Speedup against a baseline (shadow rows)</h2>
{shadow_html}
{_img(rep, 'speed_cost', 'speedup and cost per route')}
{"".join(f"<h2>{html.escape(h)}</h2><p>{_html_text(n)}</p>" + "".join(_html_table(*t) for t in ts)
         for h, n, ts in drafting_sections(rep))}
<h2>Throughput over time</h2>
{_img(rep, 'throughput', 'output tokens per second over the job time')}
<h2>Definitions</h2><ul>{''.join(f'<li>{_html_text(d)}</li>' for d in DEFINITIONS)}</ul>
</body></html>
"""


def write_report(rep: Report, out_dir: str | Path, *, formats: Iterable[str] = ("md", "html", "json")) -> list[Path]:
    """Write report.<fmt> for each format, plus the PNG charts (always, so Markdown can link them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, png in rep.charts.items():
        p = out / CHART_FILES[name]
        p.write_bytes(png)
        written.append(p)
    for fmt in formats:
        p = out / f"report.{fmt}"
        if fmt == "md":
            p.write_text(render_md(rep), encoding="utf-8")
        elif fmt == "html":
            p.write_text(render_html(rep), encoding="utf-8")
        elif fmt == "json":
            p.write_text(json.dumps(rep.to_json(), indent=1), encoding="utf-8")
        else:
            raise ValueError(f"format = {fmt!r}: expected md, html or json")
        written.append(p)
    return written
