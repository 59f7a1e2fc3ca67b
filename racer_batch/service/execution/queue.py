"""Job queue, job state and telemetry in Redis (streams with a consumer group; JSON values only).

Keys (``P`` is the key prefix, default ``racer-batch:``):

=============================  ========  ==========================================================
``P queue:<prio>``             stream    one entry per queued job (field ``job_id``), group ``workers``
``P jobs``                     zset      job ids by submit time (for ``list``)
``P job:<id>``                 hash      spec (JSON), plan, state, owner, timestamps, cancel flag
``P job:<id>:shards``          hash      shard -> committed summary (Tally JSON + row range; idempotent)
``P job:<id>:inflight``        hash      shard -> progress of the running attempt (Tally JSON)
``P job:<id>:rows``            stream    per-row telemetry, bounded with MAXLEN ~
``P job:<id>:errors``          stream    failed rows (id, row_idx, error), bounded with MAXLEN ~
``P job:<id>:leases``          stream    lease history: taken / released / ended, by whom, bounded
=============================  ========  ==========================================================

Leases. A worker takes a job with XREADGROUP: the entry stays in the group's pending-entries list until
the worker acknowledges it at the end of the job. While it works it renews the lease by re-claiming its own
entry (XCLAIM resets the idle time), but only while the job hash still names it as ``owner`` (one Lua
script, so the check and the renewal are atomic). A worker that dies stops renewing; after ``lease_ms``
another worker takes the entry with XAUTOCLAIM, becomes the owner, and resumes the job from the output
folder. A worker that finds it is no longer the owner stops working on the job.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Optional

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from racer_batch.service.results.tally import Tally

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "racer-batch:"
GROUP = "workers"
ROW_STREAM_MAXLEN = 10_000
ERROR_STREAM_MAXLEN = 2_000
LEASE_STREAM_MAXLEN = 200
PRIORITIES = range(9, -1, -1)  # read order: 9 first
TERMINAL = ("done", "cancelled", "failed")


class QueueUnavailable(RuntimeError):
    """Redis cannot be reached or refused us; the message has the redacted URL and the reason."""


def plural(count: int, noun: str) -> str:
    """``plural(1, "shard")`` -> "1 shard", ``plural(3, "shard")`` -> "3 shards" (status, worker and CLI lines)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _stalled(state: Optional[str], owner_idle_s: Optional[float], lease_s: Optional[float]) -> bool:
    """JobStatus.stalled's rule: running, and the owner's last renewal is over two thirds of a lease old."""
    return state == "running" and owner_idle_s is not None and bool(lease_s) and owner_idle_s > lease_s * 2 / 3


def redact_url(url: str) -> str:
    """``rediss://user:secret@host:6380/0`` -> ``rediss://user:***@host:6380/0`` (never log a password)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _url_password(url: str) -> Optional[str]:
    try:
        return urllib.parse.urlsplit(url).password
    except ValueError:
        return None


def resolve_url(*candidates: Optional[str]) -> str:
    """First non-empty of the candidates (flag, spec), then REDIS_URL, then the default."""
    for c in candidates:
        if c:
            return c
    return os.environ.get("REDIS_URL") or DEFAULT_URL


def connect(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client with retries and exponential backoff; raises QueueUnavailable with a clear message."""
    try:
        client = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 3), health_check_interval=30,
        )
        client.ping()
    except redis.AuthenticationError as exc:
        if _url_password(url) is None:
            raise QueueUnavailable(
                f"Redis at {redact_url(url)} needs a password: put it in the URL "
                "(redis://:PASSWORD@host:port/db, rediss:// for TLS), e.g. in REDIS_URL"
            ) from None
        raise QueueUnavailable(f"Redis at {redact_url(url)} refused the credentials: {exc}") from None
    except redis.ResponseError as exc:
        raise QueueUnavailable(f"Redis at {redact_url(url)} answered with an error: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError) as exc:
        raise QueueUnavailable(f"cannot reach Redis at {redact_url(url)}: {exc}") from None
    return client


@dataclass
class Lease:
    job_id: str
    stream: str
    entry_id: str
    owner: str
    reclaimed: bool = False


@dataclass
class JobStatus:
    job_id: str
    state: str
    name: Optional[str]
    rows_total: int
    totals: Tally  # committed shards' summaries plus the running attempts' progress (not a stalled owner's)
    shards_total: int
    shards_done: int
    submitted_at: float
    started_at: Optional[float]
    finished_at: Optional[float]
    owner: Optional[str]
    output: Optional[str]
    base_rows: int  # rows already committed when this run started (resume)
    base_tokens: int
    model: Optional[str]
    method: Optional[str]
    message: Optional[str]
    owner_idle_s: Optional[float] = None  # seconds since the owner last renewed its lease (running jobs)
    lease_s: Optional[float] = None  # the owner's lease length
    nodes_lost: list[str] = field(default_factory=list)  # Ray node ids lost under this job's actors (hex)
    shards_retried: int = 0  # distinct shards redone (after their actor died or found no room, or an error)
    shard_retries: int = 0  # shard attempts redone (a shard retried twice counts 2)
    rows_lost: int = 0  # rows a stalled owner's unfinished shards had answered (not in totals: they are redone)

    @property
    def fault_note(self) -> Optional[str]:
        """``1 Ray node lost (3f2a9c1b), 2 shards retried`` when a node was lost or shards were retried."""
        if not self.nodes_lost and not self.shards_retried:
            return None
        parts = []
        if self.nodes_lost:
            ids = ", ".join(n[:8] for n in self.nodes_lost)
            parts.append(f"{len(self.nodes_lost)} Ray node{'s' if len(self.nodes_lost) > 1 else ''} lost ({ids})")
        parts.append(f"{plural(self.shards_retried, 'shard')} retried")
        if self.shard_retries > self.shards_retried:
            parts[-1] += f" ({self.shard_retries} retries)"
        return ", ".join(parts)

    @property
    def stalled(self) -> bool:
        """A running job whose owner missed two lease renewals (it renews every third of the lease): the
        worker is likely dead, and another takes the job over once the lease has run out."""
        return _stalled(self.state, self.owner_idle_s, self.lease_s)

    @property
    def stall_note(self) -> Optional[str]:
        """``owner W stopped renewing its lease 25 s ago; ...`` for a stalled job, else None."""
        if not self.stalled:
            return None
        left = max(0.0, self.lease_s - self.owner_idle_s)
        after = f"in about {left:.0f} s" if left > 0 else "now"
        return (f"owner {self.owner} stopped renewing its lease {self.owner_idle_s:.0f} s ago (lease "
                f"{self.lease_s:.0f} s); any worker polling the queue takes the job over {after}")

    @property
    def lost_note(self) -> Optional[str]:
        """``2 rows answered by unfinished shards, not counted: the next owner redoes them`` (stalled jobs)."""
        if not self.stalled or not self.rows_lost:
            return None
        return f"{plural(self.rows_lost, 'row')} answered by unfinished shards, not counted: the next owner redoes them"

    @property
    def cancelled_rows(self) -> int:
        """Rows without an answer because of a cancel: for a cancelled job every row not committed ok or
        error (a partial shard's rows included: it is redone on resume), else the cancelled rows counted."""
        if self.state == "cancelled":
            return max(0, self.rows_total - self.rows_done)
        return self.totals.cancelled

    @property
    def rows_done(self) -> int:
        """Rows with a record; for a cancelled job the rows answered (ok or error), so that rows_done +
        cancelled_rows = rows_total (a partial shard's answered rows count: they are in its part file)."""
        if self.state == "cancelled":
            return self.totals.ok + self.totals.error
        return self.totals.rows

    @property
    def elapsed_s(self) -> float:
        if not self.started_at:
            return 0.0
        return (self.finished_at or time.time()) - self.started_at

    @property
    def rows_per_s(self) -> float:
        """This run's rows per second of wall time (a resumed run does not count rows done before)."""
        return max(0, self.rows_done - self.base_rows) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """This run's output tokens per second of wall time (start-up and model load included)."""
        new = max(0, self.totals.output_tokens - self.base_tokens)
        return new / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> Optional[float]:
        if self.state in TERMINAL or self.rows_per_s <= 0 or self.stalled:
            return None
        return max(0.0, (self.rows_total - self.rows_done) / self.rows_per_s)

    @property
    def mat(self) -> Optional[float]:
        return self.totals.output_tokens / self.totals.steps if self.totals.steps else None

    def route_mat(self) -> dict[str, dict]:
        """{route: {rows, output_tokens, steps, mat}} of the rows done so far."""
        return {
            route: {"rows": t.rows, "output_tokens": t.output_tokens, "steps": t.steps, "mat": t.mat}
            for route, t in sorted(self.totals.routes.items())
        }

    def to_dict(self) -> dict:
        return {
            "job_id": self.job_id, "state": self.state, "name": self.name, "rows_total": self.rows_total,
            "rows_done": self.rows_done, "ok": self.totals.ok, "error": self.totals.error,
            "cancelled": self.cancelled_rows, "stalled": self.stalled, "owner_idle_s": self.owner_idle_s,
            "rows_lost": self.rows_lost, "output_tokens": self.totals.output_tokens,
            "steps": self.totals.steps, "mat": self.mat, "shards_total": self.shards_total,
            "shards_done": self.shards_done, "rows_per_s": self.rows_per_s, "tokens_per_s": self.tokens_per_s,
            "eta_s": self.eta_s, "elapsed_s": self.elapsed_s, "routes": self.route_mat(), "owner": self.owner,
            "output": self.output, "model": self.model, "method": self.method, "message": self.message,
            "nodes_lost": list(self.nodes_lost), "shards_retried": self.shards_retried,
            "shard_retries": self.shard_retries,
        }


# KEYS[1] job hash, KEYS[2] stream; ARGV: group, consumer, entry id. Renew only while we own the job.
_RENEW_LUA = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""


class JobQueue:
    """All Redis access of the service. Plain class: no click, no Ray."""

    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.r = client
        self.prefix = prefix
        self._renew = client.register_script(_RENEW_LUA)
        self._groups_ready = False

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX) -> "JobQueue":
        return cls(connect(url), prefix=prefix)

    # ---- keys
    def k_queue(self, prio: int) -> str:
        return f"{self.prefix}queue:{prio}"

    def k_job(self, job_id: str, sub: str = "") -> str:
        return f"{self.prefix}job:{job_id}" + (f":{sub}" if sub else "")

    def k_evidence(self, job_id: str, spec_hash: str) -> str:
        """Method auto's shared evidence of a job under one spec hash (``actors.RedisEvidence``)."""
        return self.k_job(job_id, f"auto:{spec_hash}")

    def k_index(self) -> str:
        return f"{self.prefix}jobs"

    def _ensure_groups(self) -> None:
        if self._groups_ready:
            return
        for prio in PRIORITIES:
            try:
                self.r.xgroup_create(self.k_queue(prio), GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    # ---- submit side
    def job_exists(self, job_id: str) -> bool:
        return bool(self.r.exists(self.k_job(job_id)))

    def enqueue(self, *, job_id: str, spec: dict, plan: dict, priority: int, name: Optional[str]) -> None:
        """Create (or reset for a re-run) the job hash and put the job on the queue."""
        self._ensure_groups()
        now = time.time()
        key = self.k_job(job_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={
            "job_id": job_id, "spec": json.dumps(spec), "plan": json.dumps(plan), "state": "queued",
            "priority": priority, "name": name or "", "submitted_at": now, "cancel": 0,
            "output": spec["output"]["path"], "model": spec["model"]["name"],
            "method": spec["decoding"]["method"], "message": "",
        })
        pipe.hdel(key, "owner", "started_at", "finished_at", "base_rows", "base_tokens", "nodes_lost",
                  "shards_retried", "shard_retries")
        pipe.delete(self.k_job(job_id, "inflight"), self.k_job(job_id, "retried"))
        pipe.zadd(self.k_index(), {job_id: now})
        pipe.xadd(self.k_queue(priority), {"job_id": job_id})
        pipe.execute()

    def cancel(self, job_id: str) -> str:
        """Ask for a stop at the next step boundary. Returns the state the job is now in."""
        key = self.k_job(job_id)
        state = self.r.hget(key, "state")
        if state is None:
            raise KeyError(job_id)
        if state in TERMINAL:
            return state
        self.r.hset(key, "cancel", 1)
        if state == "queued":
            self.r.hset(key, mapping={"state": "cancelled", "finished_at": time.time()})
            return "cancelled"
        return "cancelling"

    def is_cancelled(self, job_id: str) -> bool:
        return self.r.hget(self.k_job(job_id), "cancel") == "1"

    def still_owner(self, job_id: str, owner: str) -> bool:
        """For actors: keep going only while the job is not cancelled and the lease is ours."""
        cancel, cur = self.r.hmget(self.k_job(job_id), ["cancel", "owner"])
        return cancel != "1" and cur == owner

    # ---- worker side
    def claim(self, *, consumer: str, lease_ms: int, block_ms: int = 1000) -> Optional[Lease]:
        """Take the next job: first an expired lease (XAUTOCLAIM), then new entries by priority."""
        try:
            return self._claim(consumer=consumer, lease_ms=lease_ms, block_ms=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._groups_ready = False  # Redis lost its data (restart without persistence): recreate
            return self._claim(consumer=consumer, lease_ms=lease_ms, block_ms=block_ms)

    def _claim(self, *, consumer: str, lease_ms: int, block_ms: int) -> Optional[Lease]:
        self._ensure_groups()
        for prio in PRIORITIES:
            stream = self.k_queue(prio)
            _, entries, deleted = self.r.xautoclaim(stream, GROUP, consumer, min_idle_time=lease_ms, count=1)
            for entry_id in deleted or []:
                self.r.xack(stream, GROUP, entry_id)
            for entry_id, fields in entries:
                lease = self._take(stream, entry_id, fields, consumer, reclaimed=True, lease_ms=lease_ms)
                if lease:
                    return lease
        for prio in PRIORITIES:
            got = self.r.xreadgroup(GROUP, consumer, {self.k_queue(prio): ">"}, count=1)
            lease = self._first(got, consumer, lease_ms=lease_ms)
            if lease:
                return lease
        if block_ms > 0:
            got = self.r.xreadgroup(GROUP, consumer, {self.k_queue(p): ">" for p in PRIORITIES}, count=1,
                                    block=block_ms)
            return self._first(got, consumer, lease_ms=lease_ms)
        return None

    def _first(self, got: Any, consumer: str, *, lease_ms: int) -> Optional[Lease]:
        for stream, entries in got or []:
            for entry_id, fields in entries:
                lease = self._take(stream, entry_id, fields, consumer, reclaimed=False, lease_ms=lease_ms)
                if lease:
                    return lease
        return None

    def _take(self, stream: str, entry_id: str, fields: dict, consumer: str, *, reclaimed: bool, lease_ms: int
              ) -> Optional[Lease]:
        job_id = (fields or {}).get("job_id")
        key = self.k_job(job_id) if job_id else None
        state = self.r.hget(key, "state") if key else None
        if state is None or state in TERMINAL:  # unknown, finished, or cancelled while queued
            self._drop(stream, entry_id)
            return None
        self.r.hset(key, mapping={"owner": consumer, "state": "running", "lease_stream": stream,
                                  "lease_entry": entry_id, "lease_ms": lease_ms})
        if reclaimed:  # the dead owner's unfinished shard attempts: this owner redoes them and writes its own
            self.r.delete(self.k_job(job_id, "inflight"))
        self.r.hsetnx(key, "started_at", time.time())
        self.r.hincrby(key, "attempts", 1)
        self._lease_event(job_id, "taken", consumer, reclaimed="1" if reclaimed else "0")
        return Lease(job_id=job_id, stream=stream, entry_id=entry_id, owner=consumer, reclaimed=reclaimed)

    def _drop(self, stream: str, entry_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def renew(self, lease: Lease) -> bool:
        """Reset the lease's idle clock; False when another worker has taken the job."""
        return bool(self._renew(keys=[self.k_job(lease.job_id), lease.stream],
                                args=[GROUP, lease.owner, lease.entry_id]))

    def finish(self, lease: Lease, *, state: str, message: str = "") -> None:
        assert state in TERMINAL, f"finish({lease.job_id}) with non-terminal state {state!r}"
        key = self.k_job(lease.job_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={"state": state, "finished_at": time.time(), "message": message})
        pipe.hdel(key, "owner")
        if state != "cancelled":  # a cancel leaves partial shards on disk: status keeps counting their rows
            pipe.delete(self.k_job(lease.job_id, "inflight"))
        pipe.xack(lease.stream, GROUP, lease.entry_id)
        pipe.xdel(lease.stream, lease.entry_id)
        self._lease_event(job_id=lease.job_id, event=state, owner=lease.owner, pipe=pipe, message=message)
        pipe.execute()

    def release(self, lease: Lease, *, message: str = "") -> None:
        """Give a job back unfinished (worker shutting down): requeue it at once for another worker."""
        key = self.k_job(lease.job_id)
        prio = int(self.r.hget(key, "priority") or 5)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={"state": "queued", "message": message})
        # the next lease starts a new run: its start time, resume base and in-flight rows are its own
        pipe.hdel(key, "owner", "started_at", "base_rows", "base_tokens")
        pipe.delete(self.k_job(lease.job_id, "inflight"))
        pipe.xack(lease.stream, GROUP, lease.entry_id)
        pipe.xdel(lease.stream, lease.entry_id)
        pipe.xadd(self.k_queue(prio), {"job_id": lease.job_id})
        self._lease_event(job_id=lease.job_id, event="released", owner=lease.owner, pipe=pipe, message=message)
        pipe.execute()

    def _lease_event(self, job_id: str, event: str, owner: str, *, pipe: Any = None, **extra: str) -> None:
        """One entry of the job's lease history (``taken``, ``released``, or the state it ended in)."""
        fields = {"event": event, "owner": owner, "at": f"{time.time():.6f}", **extra}
        (pipe or self.r).xadd(self.k_job(job_id, "leases"), fields, maxlen=LEASE_STREAM_MAXLEN, approximate=True)

    def lease_history(self, job_id: str) -> list[dict]:
        """The job's lease events, oldest first: ``{"event", "owner", "at" (epoch seconds, float), ...}``
        (``reclaimed`` on ``taken``, ``message`` on ``released`` and ended states)."""
        out = []
        for _, f in self.r.xrange(self.k_job(job_id, "leases")):
            out.append(dict(f, at=float(f["at"])))
        return out

    def note_node_lost(self, job_id: str, node: str) -> None:
        """Record that a Ray node hosting the job's actors was lost (status, ``--json``: ``nodes_lost``)."""
        key = self.k_job(job_id)
        lost = json.loads(self.r.hget(key, "nodes_lost") or "[]")
        if node not in lost:
            self.r.hset(key, "nodes_lost", json.dumps(lost + [node]))

    def note_shard_retried(self, job_id: str, shard: int) -> None:
        """Count one attempt of ``shard`` redone (``shard_retries``), and the shard once among the distinct
        shards retried (``shards_retried``), over all the job's runs."""
        if self.r.sadd(self.k_job(job_id, "retried"), str(shard)):
            self.r.hincrby(self.k_job(job_id), "shards_retried", 1)
        self.r.hincrby(self.k_job(job_id), "shard_retries", 1)

    def mark_run_base(self, job_id: str) -> None:
        """Remember what a resumed run started from, so rows/s and ETA count this run's work only."""
        totals = Tally.of(self.committed(job_id).values())
        key = self.k_job(job_id)
        self.r.hsetnx(key, "base_rows", totals.rows)
        self.r.hsetnx(key, "base_tokens", totals.output_tokens)

    def job_fields(self, job_id: str) -> dict:
        d = self.r.hgetall(self.k_job(job_id))
        if not d:
            raise KeyError(job_id)
        return d

    def set_message(self, job_id: str, message: str) -> None:
        self.r.hset(self.k_job(job_id), "message", message)

    # ---- telemetry (written by actors and the worker)
    def record_row(self, job_id: str, row: dict, *, shard: int, progress: Tally) -> None:
        """One finished row: telemetry entry (``RowRecord.telemetry()``, bounded), error entry if failed,
        and the shard attempt's in-flight progress (``progress.to_dict()``)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(self.k_job(job_id, "rows"), {"row": json.dumps(row)}, maxlen=ROW_STREAM_MAXLEN,
                  approximate=True)
        if row.get("status") == "error":
            pipe.xadd(self.k_job(job_id, "errors"),
                      {"row": json.dumps({k: row.get(k) for k in ("id", "row_idx", "route", "error")})},
                      maxlen=ERROR_STREAM_MAXLEN, approximate=True)
        pipe.hset(self.k_job(job_id, "inflight"), str(shard), json.dumps(progress.to_dict()))
        pipe.execute()

    def commit_shard(self, job_id: str, shard: int, summary: dict) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.k_job(job_id, "shards"), str(shard), json.dumps(summary))
        pipe.hdel(self.k_job(job_id, "inflight"), str(shard))
        pipe.execute()

    def uncommit_shards(self, job_id: str, shards: list[int]) -> None:
        """Forget committed summaries the output folder no longer backs (changed input rows, removed rows)."""
        if shards:
            self.r.hdel(self.k_job(job_id, "shards"), *[str(s) for s in shards])

    def sync_committed(self, job_id: str, done: dict[int, dict]) -> None:
        """Make the committed summaries agree with the output folder's kept shards ``done`` (shard -> summary;
        the folder is the truth): add the ones Redis lacks (a resumed folder under a new prefix or after a
        Redis loss), forget the ones the folder no longer backs."""
        known = self.committed(job_id)
        for shard, meta in done.items():
            if shard not in known:
                self.commit_shard(job_id, shard, meta)
        self.uncommit_shards(job_id, [s for s in known if s not in done])

    def clear_inflight(self, job_id: str, shard: int) -> None:
        self.r.hdel(self.k_job(job_id, "inflight"), str(shard))

    def committed(self, job_id: str) -> dict[int, dict]:
        return {int(k): json.loads(v) for k, v in self.r.hgetall(self.k_job(job_id, "shards")).items()}

    # ---- read side
    def status(self, job_id: str) -> JobStatus:
        d = self.job_fields(job_id)
        spec = json.loads(d["spec"])
        plan = json.loads(d["plan"])
        shard_rows = spec["output"]["shard_rows"]
        rows_total = sum(plan["file_rows"])
        shards_total = -(-rows_total // shard_rows)
        committed = self.committed(job_id)
        totals = Tally.of(committed.values())
        inflight = Tally()
        for shard, v in self.r.hgetall(self.k_job(job_id, "inflight")).items():
            if int(shard) not in committed:
                inflight.merge(Tally.from_dict(json.loads(v)))

        def _f(key: str) -> Optional[float]:
            return float(d[key]) if d.get(key) else None

        idle_s = self._owner_idle_s(d) if d.get("state") == "running" else None
        lease_ms = _f("lease_ms")
        lease_s = lease_ms / 1000.0 if lease_ms else None
        # a stalled owner's unfinished shards are redone whole by the next owner (a part file is written only
        # when its shard ends), so their rows so far are not counted as done
        stalled = _stalled(d.get("state"), idle_s, lease_s)
        if not stalled:
            totals.merge(inflight)

        return JobStatus(
            job_id=job_id, state=d.get("state", "?"), name=d.get("name") or None, rows_total=rows_total,
            totals=totals, rows_lost=inflight.rows if stalled else 0, shards_total=shards_total,
            shards_done=len(committed),
            submitted_at=float(d.get("submitted_at", 0)), started_at=_f("started_at"),
            finished_at=_f("finished_at"), owner=d.get("owner"), output=d.get("output"), model=d.get("model"),
            base_rows=int(d.get("base_rows") or 0), base_tokens=int(d.get("base_tokens") or 0),
            method=d.get("method"), message=d.get("message") or None, owner_idle_s=idle_s,
            lease_s=lease_s, nodes_lost=json.loads(d.get("nodes_lost") or "[]"),
            shards_retried=int(d.get("shards_retried") or 0), shard_retries=int(d.get("shard_retries") or 0),
        )

    def _owner_idle_s(self, d: dict) -> Optional[float]:
        """Seconds since the owner last renewed (the idle time of its pending queue entry), or None."""
        stream, entry = d.get("lease_stream"), d.get("lease_entry")
        if not stream or not entry:
            return None
        got = self.r.xpending_range(stream, GROUP, min=entry, max=entry, count=1)
        return got[0]["time_since_delivered"] / 1000.0 if got else None

    def list_jobs(self, limit: int = 50) -> list[JobStatus]:
        ids = self.r.zrevrange(self.k_index(), 0, limit - 1)
        out = []
        for job_id in ids:
            try:
                out.append(self.status(job_id))
            except KeyError:
                self.r.zrem(self.k_index(), job_id)
        return out

    def errors(self, job_id: str, limit: int = 20) -> list[dict]:
        entries = self.r.xrevrange(self.k_job(job_id, "errors"), count=limit)
        return [json.loads(f["row"]) for _, f in reversed(entries)]

    def recent_rows(self, job_id: str, limit: int = 20) -> list[dict]:
        entries = self.r.xrevrange(self.k_job(job_id, "rows"), count=limit)
        return [json.loads(f["row"]) for _, f in reversed(entries)]

    def delete_job(self, job_id: str) -> None:
        keys = [self.k_job(job_id, s) for s in ("", "shards", "inflight", "rows", "errors", "leases", "retried")]
        keys += list(self.r.scan_iter(match=self.k_evidence(job_id, "*")))
        self.r.delete(*keys)
        self.r.zrem(self.k_index(), job_id)
