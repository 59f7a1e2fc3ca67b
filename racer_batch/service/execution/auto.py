"""``decoding.method: auto``: each route of a job picks, among lossless methods (``decoding.auto_methods``), the
one with the most measured output tokens per second, and keeps exploring a little.

The rule, per route and per actor (deterministic for a given order of rows and measurements):

1. **Try each candidate first**: while a candidate has been given fewer than ``EXPLORE_ROWS`` of the route's
   rows, the next row goes to the first such candidate (in ``auto_methods`` order).
2. **Then exploit, exploring a little**: every ``EXPLORE_EVERY``-th row of the route goes to the candidate that
   has had the fewest rows (ties: the earlier in ``auto_methods``) other than the current best; every other
   row to the best, the candidate with the most output tokens per second of actor time measured so far (its
   rows' ``busy_ms``: a row's share of the forwards it was in, so rows decoded several per forward are not
   counted whole; ties: the earlier candidate).
3. **Sampled rows** (temperature > 0) always go to the first candidate: two lossless methods give the same
   greedy output, but a sampled row's draws depend on the method, so its text must not depend on measurements.

Every candidate is lossless, so which one answers a greedy row never changes its text. The evidence (rows,
tokens, steps, MAT, tokens/s per candidate; each shard's own rows) and the choice of every route go into the
shard summaries (``method_auto``) and, pooled over the shards (``results/method_auto.py``), into the manifest
and the report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from racer_batch.service.results.method_auto import figures

# Exploration is paid in rows answered by slower candidates: on 27-row routes split over two actors, 2 first rows
# each and one in 10 after put 30-44% of a route's rows on the others (benchmarks/warm-auto-20261205-083829.md:
# auto chose every route's best method, at 0.83-0.96x its tokens/s); one first row each and one in 16 after
# keep it near 15%, and a wrong first pick is still corrected by the rows explored later.
EXPLORE_ROWS = 1  # rows each candidate gets first, per route
EXPLORE_EVERY = 16  # after that, one row in this many goes to the least-tried other candidate


@dataclass
class CandidateStats:
    """What one candidate measured on one route: rows given and finished, output tokens, target forwards and
    actor milliseconds of its finished rows."""

    assigned: int = 0
    rows: int = 0
    tokens: int = 0
    steps: int = 0
    busy_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.busy_ms if self.busy_ms > 0 else 0.0

    def to_dict(self, since: Optional["CandidateStats"] = None) -> dict:
        """Its figures (``results.method_auto.figures``), or those of what it measured after ``since``."""
        b = since or CandidateStats()
        return figures(self.rows - b.rows, self.tokens - b.tokens, self.steps - b.steps, self.busy_ms - b.busy_ms)

    def copy(self) -> "CandidateStats":
        return dataclasses.replace(self)


@dataclass
class RouteChoice:
    candidates: Sequence[str]
    stats: dict[str, CandidateStats] = field(default_factory=dict)
    given: int = 0  # greedy rows given out after every candidate had its first rows

    def __post_init__(self) -> None:
        for name in self.candidates:
            self.stats.setdefault(name, CandidateStats())

    def best(self) -> str:
        """The candidate with the most tokens per second so far (ties, or nothing measured: the earlier)."""
        return max(self.candidates, key=lambda m: (self.stats[m].tokens_per_s, -self.candidates.index(m)))

    def pick(self) -> str:
        for name in self.candidates:
            if self.stats[name].assigned < EXPLORE_ROWS:
                return self._give(name)
        self.given += 1
        best = self.best()
        if self.given % EXPLORE_EVERY == 0 and len(self.candidates) > 1:
            others = [m for m in self.candidates if m != best]
            return self._give(min(others, key=lambda m: (self.stats[m].assigned, self.candidates.index(m))))
        return self._give(best)

    def _give(self, name: str) -> str:
        self.stats[name].assigned += 1
        return name


class MethodChooser:
    """The per-route choice of one job on one actor (module docstring)."""

    def __init__(self, candidates: Sequence[str]) -> None:
        if not candidates:
            raise ValueError("method auto needs at least one candidate")
        self.candidates = tuple(candidates)
        self.routes: dict[str, RouteChoice] = {}

    def pick(self, route: str, *, greedy: bool) -> str:
        """The method for the next row of ``route``."""
        if not greedy:
            return self.candidates[0]
        return self._route(route).pick()

    def observe(self, route: str, method: str, *, tokens: int, steps: int, busy_ms: float) -> None:
        """A row of ``route`` answered by ``method`` ended: ``tokens`` output tokens in ``steps`` target forwards
        and ``busy_ms`` of actor time."""
        st = self._route(route).stats[method]
        st.rows += 1
        st.tokens += int(tokens)
        st.steps += int(steps)
        st.busy_ms += float(busy_ms)

    def evidence(self, since: Optional[dict] = None) -> dict[str, Any]:
        """``{route: {"choice": method, "candidates": {method: figures}}}``: the choice now and what each
        candidate measured, all along or after ``since`` (a :meth:`counters` of earlier; a shard's summary
        holds its own rows' evidence, so that the manifest can add the shards up)."""
        since = since or {}
        out = {}
        for route, rc in sorted(self.routes.items()):
            before = since.get(route, {})
            cands = {m: rc.stats[m].to_dict(before.get(m)) for m in rc.candidates}
            if any(c["rows"] for c in cands.values()):
                out[route] = {"choice": rc.best(), "candidates": cands}
        return out

    def counters(self) -> dict:
        """A copy of every route's counters, for a later :meth:`evidence` ``since``."""
        return {route: {m: st.copy() for m, st in rc.stats.items()} for route, rc in self.routes.items()}

    def _route(self, route: str) -> RouteChoice:
        if route not in self.routes:
            self.routes[route] = RouteChoice(self.candidates)
        return self.routes[route]
