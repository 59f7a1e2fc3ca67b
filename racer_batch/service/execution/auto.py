"""``decoding.method: auto``: each route of a job picks, among lossless methods (``decoding.auto_methods``), the
one with the most measured output tokens per second, and keeps exploring a little.

The rule, per route and per actor (deterministic for a given order of rows and measurements):

1. **Try each candidate first**: while a candidate has been given fewer than ``EXPLORE_ROWS`` of the route's
   rows, the next row goes to the first such candidate (in ``auto_methods`` order).
2. **Then exploit, exploring a little**: every ``EXPLORE_EVERY``-th row of the route goes to the candidate that
   has had the fewest rows (ties: the earlier in ``auto_methods``) among the others that could still be the
   best: those with no finished row yet, or whose tokens per second times ``1 + EXPLORE_SPREAD / sqrt(rows)``
   (the spread of an estimate over that many rows) reaches the best's. With none such, that row goes to the
   best too, so a candidate measured far slower stops costing rows. Every other row goes to the best, the
   candidate with the most output tokens per second of decode time measured so far (its rows' share of the
   forwards they were in, so rows decoded several per forward are not counted whole, less their prompt
   forwards, which cost every candidate alike, and scaled to one context). Ties, and a route where some
   candidate has no finished row yet (its first row is still out), go by the job's ranking (``_prior``: each
   candidate's tokens/s against the fastest on every route where two were measured, averaged over routes); on
   the job's first routes, before any route has two candidates measured, such rows go to the least-given
   candidate instead. (Going by the route's own figures then sent the next rows to whichever first row ended
   first: 10 of a 60-row route's rows to the slower candidates, benchmarks/warm-auto-20261206-031131.md;
   going by the first candidate sent the first route 12 racer rows, benchmarks/warm-auto-20261206-063459.md.)
3. **Sampled rows** (temperature > 0) always go to the first candidate: two lossless methods give the same
   greedy output, but a sampled row's draws depend on the method, so its text must not depend on measurements.

**Evidence shared between actors** (``EvidenceShare``, the service's is ``actors.RedisEvidence``): every actor
publishes its own totals per route and candidate (rows given, rows finished, tokens, steps, busy ms) as it picks
and observes, and reads the other actors' totals at most every ``SHARE_REFRESH_S``. A share that can also
``claim`` (Redis: one atomic counter per route and candidate) hands each candidate's first rows of a route to
one actor only, even when two actors start the route at the same moment. Rules 1 and 2 then count
rows given and measure tokens per second over the sum of its own totals and the others' (an actor killed
mid-job leaves its totals behind, so a resumed run starts from them). A route whose rows are split between two
actors is explored once instead of once per actor. The sum depends on when the others published, so with
sharing the choice is deterministic only for a given order of rows, measurements and publications; the output
never depends on it (every candidate is lossless). The shard summaries keep each actor's own rows only, so
pooling them over the shards still counts every row once.

Every candidate is lossless, so which one answers a greedy row never changes its text. The evidence (rows,
tokens, steps, MAT, tokens/s per candidate; each shard's own rows) and the choice of every route go into the
shard summaries (``method_auto``) and, pooled over the shards (``results/method_auto.py``), into the manifest
and the report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from racer_batch.service.results.method_auto import compared_rate, figures

# Exploration is paid in rows answered by slower candidates: on 27-row routes split over two actors, 2 first rows
# each and one in 10 after put 30-44% of a route's rows on the others (benchmarks/warm-auto-20261205-083829.md:
# auto chose every route's best method, at 0.83-0.96x its tokens/s); one first row each and one in 16 after
# keep it near 15%, and a wrong first pick is still corrected by the rows explored later.
EXPLORE_ROWS = 1  # rows each candidate gets first, per route
EXPLORE_EVERY = 16  # after that, one row in this many goes to the least-tried other candidate
# How far a candidate's tokens/s over one row may sit from its true rate (one-row estimates of the same method on
# one route vary ~20% on a shared 2-core machine, benchmarks/warm-auto-20261206-000240.md): a candidate whose
# rate x (1 + EXPLORE_SPREAD / sqrt(rows)) is below the best's is not explored again.
EXPLORE_SPREAD = 0.3
SHARE_REFRESH_S = 1.0  # the other actors' evidence is read at most this often (seconds)
SHARED_COUNTERS = ("assigned", "rows", "tokens", "steps", "busy_ms", "adj_ms")  # what an actor publishes per candidate


class EvidenceShare(Protocol):
    """Where the actors of one job publish and read method auto's evidence (module docstring).

    ``publish(route, method, counters)`` stores this actor's totals (``SHARED_COUNTERS`` -> number) for one
    route and candidate, replacing what it published before; ``others()`` is every other actor's totals summed,
    ``{route: {method: counters}}``. Both are best effort: a failure is logged by the implementation and the
    chooser goes on with what it has."""

    def publish(self, route: str, method: str, counters: Mapping[str, float]) -> None: ...

    def others(self) -> dict[str, dict[str, dict[str, float]]]: ...


class ClaimingShare(EvidenceShare, Protocol):
    """An ``EvidenceShare`` that also hands out first rows: ``claim(route, method)`` atomically adds one to the
    job's count of first rows of ``route`` given to ``method`` by any actor and returns the new count (None:
    could not tell, the chooser then goes by what it has read)."""

    def claim(self, route: str, method: str) -> Optional[int]: ...


@dataclass
class CandidateStats:
    """What one candidate measured on one route: rows given and finished, output tokens, target forwards and
    actor milliseconds of its finished rows."""

    assigned: int = 0
    rows: int = 0
    tokens: int = 0
    steps: int = 0
    busy_ms: float = 0.0
    # the rows' decode time (busy_ms less their prompt forwards, which every candidate pays alike), each row's
    # scaled to the reference context (capacity.context_scale): what the rule compares
    adj_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.busy_ms if self.busy_ms > 0 else 0.0

    @property
    def rate(self) -> float:
        """What the rule compares: tokens per second of decode time (``adj_ms``: as if every row had the same
        context), or of ``busy_ms`` where no decode time was recorded."""
        return compared_rate(self.tokens, self.busy_ms, self.adj_ms)

    def to_dict(self, since: Optional["CandidateStats"] = None) -> dict:
        """Its figures (``results.method_auto.figures``), or those of what it measured after ``since``."""
        b = since or CandidateStats()
        return figures(self.rows - b.rows, self.tokens - b.tokens, self.steps - b.steps, self.busy_ms - b.busy_ms,
                       self.adj_ms - b.adj_ms)

    def copy(self) -> "CandidateStats":
        return dataclasses.replace(self)

    def counters(self) -> dict[str, float]:
        """Its ``SHARED_COUNTERS`` (what ``EvidenceShare.publish`` takes)."""
        return {name: getattr(self, name) for name in SHARED_COUNTERS}

    @classmethod
    def of(cls, counters: Mapping[str, float]) -> "CandidateStats":
        """From ``SHARED_COUNTERS`` (missing ones 0)."""
        return cls(assigned=int(counters.get("assigned", 0)), rows=int(counters.get("rows", 0)),
                   tokens=int(counters.get("tokens", 0)), steps=int(counters.get("steps", 0)),
                   busy_ms=float(counters.get("busy_ms", 0.0)),
                   adj_ms=float(counters.get("adj_ms", counters.get("busy_ms", 0.0))))

    def __add__(self, other: "CandidateStats") -> "CandidateStats":
        return CandidateStats(self.assigned + other.assigned, self.rows + other.rows, self.tokens + other.tokens,
                              self.steps + other.steps, self.busy_ms + other.busy_ms, self.adj_ms + other.adj_ms)


@dataclass
class RouteChoice:
    """One route's rule (module docstring). ``stats``: this actor's own totals per candidate; ``others``: the
    other actors' (``EvidenceShare.others``, empty without sharing); the rule reads their sum (``seen``)."""

    candidates: Sequence[str]
    stats: dict[str, CandidateStats] = field(default_factory=dict)
    others: dict[str, CandidateStats] = field(default_factory=dict)
    given: int = 0  # greedy rows given out after every candidate had its first rows
    claimed_elsewhere: set = field(default_factory=set)  # candidates whose first rows another actor claimed

    def __post_init__(self) -> None:
        for name in self.candidates:
            self.stats.setdefault(name, CandidateStats())

    def seen(self, name: str) -> CandidateStats:
        """This actor's totals of ``name`` plus the other actors'."""
        other = self.others.get(name)
        return self.stats[name] if other is None else self.stats[name] + other

    def best(self, prior: Optional[Sequence[str]] = None) -> str:
        """The candidate with the most tokens per second so far; ties (nothing measured) go to the earlier in
        ``prior`` (default: the candidates' order)."""
        order = list(prior) if prior is not None else list(self.candidates)
        return max(self.candidates, key=lambda m: (self.seen(m).rate, -order.index(m)))

    def pick(self, prior: Optional[Sequence[str]] = None, claim: Optional[Callable[[str], bool]] = None) -> str:
        """The next row's candidate. ``prior``: as in :meth:`best`; ``claim(method)``: whether this actor may
        give ``method`` a first row (False: another actor already did; None: always)."""
        for name in self.candidates:
            if name not in self.claimed_elsewhere and self.seen(name).assigned < EXPLORE_ROWS:
                if claim is None or claim(name):
                    return self._give(name)
                self.claimed_elsewhere.add(name)
        self.given += 1
        # until every candidate has a finished row here, the route's own figures favour whichever first row ended
        # first (the others read 0): go by the job's ranking instead
        measured = all(self.seen(m).rows > 0 for m in self.candidates)
        if measured:
            best = self.best(prior)
        elif prior is not None:
            best = list(prior)[0]
        else:  # nothing measured anywhere yet (the job's first route): spread the rows, the least-given first
            best = min(self.candidates, key=lambda m: (self._given_to(m), self.candidates.index(m)))
        if self.given % EXPLORE_EVERY == 0:
            others = [m for m in self.candidates if m != best and self.may_be_best(m, best)]
            if others:
                return self._give(min(others, key=lambda m: (self.seen(m).assigned, self.candidates.index(m))))
        return self._give(best)

    def may_be_best(self, name: str, best: str) -> bool:
        """Whether ``name`` could still beat ``best`` (rule 2): no finished row yet, or its tokens per second
        widened by ``EXPLORE_SPREAD / sqrt(rows)`` reaches ``best``'s."""
        st = self.seen(name)
        if st.rows == 0:
            return True
        return st.rate * (1.0 + EXPLORE_SPREAD / math.sqrt(st.rows)) >= self.seen(best).rate

    def _given_to(self, name: str) -> int:
        """Rows ``name`` was given as far as this actor knows: its own and the others' published, and at least
        the first rows where another actor claimed them (its totals may not be read yet)."""
        n = self.seen(name).assigned
        return max(n, EXPLORE_ROWS) if name in self.claimed_elsewhere else n

    def _give(self, name: str) -> str:
        self.stats[name].assigned += 1
        return name


class MethodChooser:
    """The per-route choice of one job on one actor (module docstring). ``share``: where the job's actors
    publish and read their evidence (None: this actor's own only); ``clock``: seconds, for the refresh."""

    def __init__(self, candidates: Sequence[str], *, share: Optional[EvidenceShare] = None,
                 clock: Any = time.monotonic) -> None:
        if not candidates:
            raise ValueError("method auto needs at least one candidate")
        self.candidates = tuple(candidates)
        self.routes: dict[str, RouteChoice] = {}
        self.share = share
        self._clock = clock
        self._read_at: Optional[float] = None
        self._others: dict[str, dict[str, CandidateStats]] = {}  # route -> method -> the other actors' totals

    def pick(self, route: str, *, greedy: bool) -> str:
        """The method for the next row of ``route``."""
        if not greedy:
            return self.candidates[0]
        rc = self._route(route)
        if self.share is not None:
            self._refresh()
            rc.others = self._others.get(route, {})
        claim = getattr(self.share, "claim", None)
        name = rc.pick(self._prior(), None if claim is None else lambda m: self._claim(claim, route, m))
        self._publish(route, name)
        return name

    @staticmethod
    def _claim(claim: Callable[[str, str], Optional[int]], route: str, method: str) -> bool:
        """Whether this actor gets ``method``'s first row of ``route`` (``ClaimingShare.claim``); yes when the
        share cannot tell."""
        got = claim(route, method)
        return got is None or got <= EXPLORE_ROWS

    def _prior(self) -> Optional[list[str]]:
        """The job's ranking of the candidates (own and shared evidence), fastest first, or None while no route
        has two candidates measured: how a route whose candidates are not all measured yet picks.

        Each candidate is scored by the mean over routes of log(its tokens/s / the route's fastest measured
        candidate's), over the routes where it and at least one other have a finished row; unscored candidates
        come last; ties in the candidates' order. Comparing within each route first keeps the mix of routes out
        of it: pooled over routes, a candidate whose rows fell on slow routes (long prompts) looked slower than
        one that ran mostly fast routes (racer ranked first after a summarization route where ar had most rows,
        benchmarks/warm-auto-20261206-063459.md)."""
        terms: dict[str, list[float]] = {m: [] for m in self.candidates}
        for route in set(self.routes) | set(self._others):
            shared = self._others.get(route, {})
            own = self.routes[route].stats if route in self.routes else {}
            rates = {}
            for m in self.candidates:
                st = own.get(m, CandidateStats()) + shared.get(m, CandidateStats())
                if st.rows > 0 and st.rate > 0:
                    rates[m] = st.rate
            if len(rates) >= 2:
                top = max(rates.values())
                for m, r in rates.items():
                    terms[m].append(math.log(r / top))
        if not any(terms.values()):
            return None
        score = {m: (sum(v) / len(v) if v else -math.inf) for m, v in terms.items()}
        return sorted(self.candidates, key=lambda m: (-score[m], self.candidates.index(m)))

    def observe(self, route: str, method: str, *, tokens: int, steps: int, busy_ms: float,
                decode_ms: Optional[float] = None, scale: float = 1.0) -> None:
        """A row of ``route`` answered by ``method`` ended: ``tokens`` output tokens in ``steps`` target forwards
        and ``busy_ms`` of actor time, ``decode_ms`` of it after the prompt forward (None: all of it); ``scale``:
        what a forward at the reference context costs over one at the row's (``capacity.context_scale``; 1: not
        scaled), applied to ``decode_ms`` for the rule's comparisons. The prompt forward costs every candidate
        the same, yet it is 20-60% of a 128-token row's time on long prompts and varies with the prompt, so
        leaving it out keeps a few rows' comparison about the method."""
        st = self._route(route).stats[method]
        st.rows += 1
        st.tokens += int(tokens)
        st.steps += int(steps)
        st.busy_ms += float(busy_ms)
        st.adj_ms += float(busy_ms if decode_ms is None else decode_ms) * float(scale)
        self._publish(route, method)

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

    def _refresh(self) -> None:
        """Read the other actors' evidence unless it was read less than ``SHARE_REFRESH_S`` ago."""
        now = self._clock()
        if self._read_at is None or now - self._read_at >= SHARE_REFRESH_S:
            self._read_at = now
            shared = self.share.others() if self.share is not None else {}
            self._others = {route: {m: CandidateStats.of(c) for m, c in per.items() if m in self.candidates}
                            for route, per in shared.items()}

    def _publish(self, route: str, method: str) -> None:
        if self.share is not None:
            self.share.publish(route, method, self._route(route).stats[method].counters())

    def _route(self, route: str) -> RouteChoice:
        if route not in self.routes:
            self.routes[route] = RouteChoice(self.candidates)
        return self.routes[route]

