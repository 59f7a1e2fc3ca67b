"""Report charts as PNG bytes (matplotlib, Agg backend: no display needed). Every axis is labelled with its unit."""

from __future__ import annotations

import io
import math
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from racer_batch.report.aggregate import OVERALL

DPI = 110


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def acceptance_histograms(routes: dict[str, dict]) -> bytes:
    """One panel per route: share of steps (%) by accepted draft length (tokens), MAT in the title."""
    names = [r for r in routes if r != OVERALL] + [OVERALL]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    width = max((len(routes[n]["accepted_hist"]) for n in names), default=1)
    for ax, name in zip(axes.flat, names):
        d = routes[name]
        hist = d["accepted_hist"]
        steps = sum(hist)
        share = [100.0 * v / steps for v in hist] if steps else []
        ax.bar(range(len(share)), share, color="#4c72b0" if name != OVERALL else "#55a868")
        mat = d.get("mat")
        ax.set_title(f"{'all routes' if name == OVERALL else 'route ' + name}: "
                     f"MAT {mat:.2f}" if mat else name, fontsize=10)
        ax.set_xlabel("accepted draft tokens per step (tokens)")
        ax.set_ylabel("share of steps (%)")
        ax.set_xlim(-0.6, max(width, 2) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("Acceptance-length histogram per route (step 0, the prefill, counts at 0)", fontsize=11)
    fig.tight_layout()
    return _png(fig)


def _ci_error_bars(shadow: list[dict], vals: list[float]) -> tuple[list[float], list[float]]:
    """(below, above) error-bar lengths of each speed ratio from its 95% CI (0 where there is none)."""
    lo = [max(0.0, v - s["speed_ratio_ci95"][0]) if s["speed_ratio_ci95"] else 0.0 for v, s in zip(vals, shadow)]
    hi = [max(0.0, s["speed_ratio_ci95"][1] - v) if s["speed_ratio_ci95"] else 0.0 for v, s in zip(vals, shadow)]
    return lo, hi


def _speed_panel(ax, shadow: list[dict]) -> None:
    """Measured speed ratio per shadow run and route with its 95% CI, or a note when there are no shadow rows."""
    if not shadow:
        ax.text(0.5, 0.5, "no shadow rows:\nspeedup not measured", ha="center", va="center", fontsize=11)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title("Measured speedup", fontsize=10)
        return
    labels = [f"{'all' if s['route'] == OVERALL else s['route']}\n{_run_label(s)}" for s in shadow]
    vals = [s["speed_ratio"] or 0.0 for s in shadow]
    ax.bar(range(len(vals)), vals, yerr=list(_ci_error_bars(shadow, vals)), capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.2f}x", (i, v), textcoords="offset points", xytext=(8, 2), fontsize=8)
    ax.set_ylabel("speed ratio vs baseline (x, token-weighted)")
    ax.set_title("Measured speedup (shadow rows, 95% bootstrap CI)", fontsize=10)


def _cost_panel(ax, routes: dict[str, dict], price: Optional[float]) -> None:
    """Cost per million output tokens per route (USD, with a price) or device-hours per million tokens."""
    names = [r for r in routes if r != OVERALL] + [OVERALL]
    if price is not None:
        vals = [routes[n]["cost_per_m_tokens"] or 0.0 for n in names]
        ax.set_ylabel("cost per million output tokens (USD)")
        ax.set_title(f"Cost per route at {price:g} USD per device-hour", fontsize=10)
        fmt = "{:.2f}"
    else:
        vals = [routes[n]["device_hours_per_m_tokens"] or 0.0 for n in names]
        ax.set_ylabel("device-hours per million output tokens (h)")
        ax.set_title("Compute per route (no price given)", fontsize=10)
        fmt = "{:.1f}"
    ax.bar(range(len(names)), vals, color="#dd8452")
    ax.set_xticks(range(len(names)), ["all" if n == OVERALL else n for n in names], fontsize=9)
    ax.set_xlabel("route")
    for i, v in enumerate(vals):
        ax.annotate(fmt.format(v), (i, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)


def speed_and_cost(routes: dict[str, dict], shadow: list[dict], *, price: Optional[float]) -> bytes:
    """Left: measured speed ratio vs the baseline per route with 95% CI (shadow rows only).
    Right: cost per million output tokens (USD, with a price) or device-hours per million tokens."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    _speed_panel(ax1, shadow)
    _cost_panel(ax2, routes, price)
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def throughput_over_time(centres_s: list[float], rates: dict[str, list[float]]) -> bytes:
    """Output tokens/s of the whole job and of each route across the job's wall time."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    if not centres_s:
        ax.text(0.5, 0.5, "no rows with timestamps", ha="center", va="center")
    if OVERALL in rates:  # drawn first and light, so the routes on top stay visible
        ax.plot(centres_s, rates[OVERALL], color="0.6", lw=4, alpha=0.6, label="all routes (job output)")
    for name, vals in rates.items():
        if name.startswith("shadow baseline"):
            ax.plot(centres_s, vals, color="black", lw=1.2, ls=":", label=name)
        elif name != OVERALL:
            ax.plot(centres_s, vals, lw=1.4, label=f"route {name}")
    ax.set_xlabel("time since the first row started (s)")
    ax.set_ylabel("output tokens per second (tokens/s)")
    ax.set_title("Throughput over the job's time (each row's tokens spread over its generation time)", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if rates:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return _png(fig)


def _run_label(s: dict) -> str:
    run = s["run"]
    return f"vs {s['baseline']} ({'in job' if run == 'job' else 'post-hoc'})"
