"""Cluster mode for real (issue 15): a Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``,
what Ray's own test suite uses to simulate nodes), a ``racer-batch worker`` process that joins it by address,
the real Redis, the stand-in engine. Actors spread over the nodes, a node is lost mid-job, the cluster has no
room at all for a while, and the head goes away under a running worker.

One cluster serves the module (start-up is ~10 s): a head and two nodes of 1 CPU each. A test that needs
another node adds it and removes it again; the head test runs last, as it ends the cluster. Every process is
stopped by the fixtures (the cluster's by pid, the workers by pid) even when a test fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from racer_batch.service.execution.actors import ThreadExecutor
from racer_batch.service.execution.worker import Worker
from racer_batch.service.results.output import part_path, read_manifest
from tests.fixtures import RayCluster, cpu_seconds, queue_url, ray_cluster, submit_standin_job, worker_process
from tests.reliability.util import assert_each_id_once, wait_for

pytestmark = pytest.mark.service

LEASE_S = 3.0
# A loop that spins burns a whole core; the worker waiting on its actors (or for room) uses a few percent.
SPIN_SHARE = 0.5


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with ray_cluster("rbcl-", head_cpus=1, nodes=[{"num_cpus": 1}, {"num_cpus": 1}]) as c:
        yield c


def _job(queue, tmp_path: Path, *, rows: int, ms_per_step: int, shard_rows: int, actors: int,
         cpus_per_actor: float):
    """A stand-in job of ``rows`` rows (``ms_per_step`` per step) on ``actors`` actors of ``cpus_per_actor`` CPUs.
    Returns (spec, submit result, the row ids)."""
    rows_ = [{"id": f"r{i:02d}", "prompt": f"prompt number {i}"} for i in range(rows)]
    spec, sub = submit_standin_job(queue, tmp_path, rows_, **{
        "model.name": f"stand-in?ms_per_step={ms_per_step}&mat=2", "output.shard_rows": shard_rows,
        "resources.num_actors": actors, "resources.cpus_per_actor": cpus_per_actor})
    return spec, sub, [r["id"] for r in rows_]


def _worker(cluster: RayCluster, queue, redis_url: str, log: Path, name: str, *args: str):
    """``racer-batch worker --ray-address`` (the cluster's) named ``name`` with ``args``, its report in ``log``."""
    return worker_process(log, "--ray-address", cluster.address, *args, redis_url=redis_url, prefix=queue.prefix,
                          name=name, lease_s=LEASE_S)


def _footer(out_dir: str, shard: int) -> dict:
    return json.loads(pq.read_schema(part_path(out_dir, shard)).metadata[b"racer_batch.shard"])


def test_actors_spread_over_the_nodes_of_a_cluster_joined_by_address(cluster, queue, redis_url, tmp_path):
    """``racer-batch worker --ray-address`` joins the three-node cluster; three actors of 0.5 CPU land on
    three different nodes (SPREAD: Ray's default would fill the node the worker joined first); the job
    completes with every id once, and each row names the node that answered it."""
    spec, sub, ids = _job(queue, tmp_path, rows=12, ms_per_step=20, shard_rows=2, actors=3, cpus_per_actor=0.5)
    log = tmp_path / "worker.log"
    with _worker(cluster, queue, redis_url, log, "spreader", "--max-jobs", "1") as proc:
        proc.wait(timeout=180)
    assert proc.returncode == 0, log.read_text()
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.totals.ok == 12, st.to_dict()
    rows = assert_each_id_once(spec.output.path, ids)
    nodes = {n.node_id for n in cluster.nodes()}
    answered = {r["node"] for r in rows}
    print(f"rows per node: { {n[:8]: sum(r['node'] == n for r in rows) for n in sorted(answered)} }")
    assert answered == nodes  # one actor per node: all three answered rows
    assert {r["worker"].split("@")[0] for r in rows} == {"spreader/a0", "spreader/a1", "spreader/a2"}
    assert all(_footer(spec.output.path, s)["node"] in nodes for s in range(6))
    assert (st.nodes_lost, st.shards_retried) == ([], 0)
    assert [e["event"] for e in queue.lease_history(sub.job_id)] == ["taken", "done"]


def test_a_node_lost_mid_job_retries_its_shards_on_the_nodes_left(cluster, queue, redis_url, cli, tmp_path):
    """A fourth node joins; four actors of 1 CPU fill the four nodes. The node is removed (its raylet and
    actor SIGKILLed) while its actor holds a half-done shard. The shard is redone on the other nodes; the
    cluster no longer has room for a fourth actor, so the job runs on the three left (the status line says
    so) and ends done, every id once. Status, its JSON and the manifest name the lost node and count the
    retried shards; the worker's CPU time shows it did not spin."""
    doomed = cluster.add_node(num_cpus=1)
    try:
        spec, sub, ids = _job(queue, tmp_path, rows=32, ms_per_step=80, shard_rows=4, actors=4, cpus_per_actor=1)
        log = tmp_path / "worker.log"
        with _worker(cluster, queue, redis_url, log, "survivor", "--max-jobs", "1", "--actor-start-timeout",
                     "30") as proc:
            def half_done_on_doomed() -> set[int]:
                seen: dict[int, int] = {}
                for r in queue.recent_rows(sub.job_id, 200):
                    if r.get("node") == doomed.node_id:
                        seen[r["shard"]] = seen.get(r["shard"], 0) + 1
                return {s for s, n in seen.items() if n < 4}

            wait_for(lambda: bool(half_done_on_doomed()) or proc.poll() is not None, timeout_s=120,
                     what="a shard half done on the doomed node", poll_s=0.02)
            held = half_done_on_doomed()
            assert held, f"the worker ended first: {log.read_text()}"
            t0, cpu0 = time.monotonic(), cpu_seconds(proc.pid)
            cluster.remove_node(doomed)
            last = [t0, cpu0]  # the worker's CPU time at the latest look while it still ran

            def ended() -> bool:
                if proc.poll() is None:
                    last[:] = [time.monotonic(), cpu_seconds(proc.pid)]
                return queue.status(sub.job_id).state != "running" or proc.poll() is not None

            wait_for(ended, timeout_s=120, what="the job to end", poll_s=0.1)
            wall_s, cpu_s = last[0] - t0, last[1] - cpu0
            proc.wait(timeout=60)
        text = log.read_text()
        assert proc.returncode == 0, text
    finally:
        if doomed in cluster.nodes():
            cluster.remove_node(doomed)
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.totals.ok == 32, st.to_dict()
    rows = assert_each_id_once(spec.output.path, ids)
    for shard in held:  # redone elsewhere, as a later attempt
        assert all(r["node"] != doomed.node_id for r in rows if r["shard"] == shard)
        assert _footer(spec.output.path, shard)["attempt"] >= 2
    assert st.nodes_lost == [doomed.node_id] and st.shards_retried >= len(held), st.to_dict()
    assert st.to_dict()["nodes_lost"] == [doomed.node_id]
    assert read_manifest(spec.output.path)["faults"] == {"nodes_lost": [doomed.node_id],
                                                         "shards_retried": st.shards_retried,
                                                         "retries": st.shard_retries}
    out = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", queue.prefix])
    assert out.exit_code == 0 and f"1 Ray node lost ({doomed.node_id[:8]})" in out.output, out.output
    assert f"Ray node {doomed.node_id} lost" in text
    assert "running on what is left: 3 of 4 actors: no room for more actors of 1 CPU" in text, text
    print(f"after the node loss: worker CPU {cpu_s:.2f} s over {wall_s:.1f} s")
    assert wall_s > 1.0 and cpu_s < SPIN_SHARE * wall_s, f"the worker used {cpu_s:.1f} s of CPU in {wall_s:.1f} s"


def test_no_room_at_all_waits_with_a_status_line_then_runs(cluster, queue, redis_url, tmp_path):
    """A job whose actors need 2 CPUs on a cluster of 1-CPU nodes: no actor can be placed. The worker keeps
    the lease and waits, the job's status line says why, and it does not spin; once a 2-CPU node joins, the
    job runs there (on what is left: one of its two actors) and ends done, every id once."""
    spec, sub, ids = _job(queue, tmp_path, rows=6, ms_per_step=10, shard_rows=2, actors=2, cpus_per_actor=2)
    log = tmp_path / "worker.log"
    big = None
    try:
        with _worker(cluster, queue, redis_url, log, "patient", "--max-jobs", "1") as proc:
            wait_for(lambda: (queue.status(sub.job_id).message or "").startswith("waiting for Ray resources")
                     or proc.poll() is not None, timeout_s=120, what="the waiting status line")
            t0, cpu0 = time.monotonic(), cpu_seconds(proc.pid)
            time.sleep(2 * LEASE_S)  # past the lease: it must have been renewed meanwhile
            cpu_s, wall_s = cpu_seconds(proc.pid) - cpu0, time.monotonic() - t0
            st = queue.status(sub.job_id)
            print(f"waiting: {st.message!r}; worker CPU {cpu_s:.2f} s over {wall_s:.1f} s")
            assert st.state == "running" and st.owner == "patient" and not st.stalled, st.to_dict()
            assert st.message == ("waiting for Ray resources: 0 of 2 actors: no room for more actors of 2 CPU "
                                  "on the 3 live node(s) (3 CPU)"), st.message
            assert cpu_s < SPIN_SHARE * wall_s, f"the worker used {cpu_s:.1f} s of CPU in {wall_s:.1f} s"
            big = cluster.add_node(num_cpus=2)
            proc.wait(timeout=120)
        text = log.read_text()
        assert proc.returncode == 0, text
    finally:
        if big is not None and big in cluster.nodes():
            cluster.remove_node(big)
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.totals.ok == 6 and st.message is None, st.to_dict()
    rows = assert_each_id_once(spec.output.path, ids)
    assert {r["node"] for r in rows} == {big.node_id}
    assert "running on what is left: 1 of 2 actors" in text, text


def test_head_lost_hands_the_job_back_and_a_fresh_worker_finishes_it(cluster, queue, redis_url, tmp_path):
    """The Ray head (GCS and its raylet) is killed by pid under a running worker. The worker does not wait
    for Ray to end it a minute later: it hands the job back to the queue at once and exits with code 4 and a
    message naming the head. Nothing is left leased by a dead owner; a fresh worker then finishes the job,
    keeping the shards committed before, every id once. (Runs last: it ends the module's cluster.)"""
    spec, sub, ids = _job(queue, tmp_path, rows=24, ms_per_step=60, shard_rows=2, actors=2, cpus_per_actor=0.5)
    log = tmp_path / "worker.log"
    with _worker(cluster, queue, redis_url, log, "orphan", "--idle-exit", "120") as proc:
        wait_for(lambda: queue.status(sub.job_id).shards_done >= 2 or proc.poll() is not None, timeout_s=120,
                 what="two shards committed")
        assert proc.poll() is None, log.read_text()
        address, t_kill = cluster.address, time.time()
        cluster.remove_node(cluster.head)
        proc.wait(timeout=45)  # Ray itself would end the process only after 60 s
        exited_s = time.time() - t_kill
    text = log.read_text()
    print(f"head killed: the worker exited {exited_s:.1f} s later with code {proc.returncode}")
    assert proc.returncode == 4, text
    assert f"the Ray head at {address} does not answer" in text and "handed back to the queue" in text
    st = queue.status(sub.job_id)
    assert st.state == "queued" and st.owner is None and "does not answer" in (st.message or ""), st.to_dict()
    history = queue.lease_history(sub.job_id)
    assert [(e["event"], e["owner"]) for e in history] == [("taken", "orphan"), ("released", "orphan")]
    assert history[-1]["at"] - t_kill < LEASE_S  # handed back before the lease would have run out
    kept = st.shards_done
    fresh = Worker(queue, ThreadExecutor(queue_url(queue), prefix=queue.prefix, name="fresh"), name="fresh",
                   lease_s=LEASE_S)
    try:
        assert fresh.run(max_jobs=1, idle_exit_s=30) == 1
    finally:
        fresh.executor.shutdown()
    st = queue.status(sub.job_id)
    # the shards committed before were kept (an actor of the lost cluster may have committed one more since)
    assert st.state == "done" and st.rows_done == 24 and st.base_rows >= 2 * kept, st.to_dict()
    rows = assert_each_id_once(spec.output.path, ids)
    assert sum(r["worker"].startswith("fresh/") for r in rows) == 24 - st.base_rows
    assert int(queue.job_fields(sub.job_id)["attempts"]) == 2
