"""The Redis ACL documented in infra/redis.md is enough to run a job: a private redis-server with that
user (and the default user disabled), a job on the stand-in engine through worker threads, every row ok."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.actors import ThreadExecutor
from racer_batch.service.execution.local import start_private_redis
from racer_batch.service.execution.queue import JobQueue, QueueUnavailable, connect
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import read_output
from racer_batch.service.submit import submit_job

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.service,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on the PATH")]


def documented_acl() -> list[str]:
    """The ACL SETUSER rule from infra/redis.md, as arguments (line continuations joined)."""
    text = (ROOT / "infra" / "redis.md").read_text()
    m = re.search(r"ACL SETUSER (.+?)\n\s*```", text, re.S)
    assert m, "infra/redis.md has no ACL SETUSER block"
    return m.group(1).replace("\\\n", " ").split()


def test_documented_acl_runs_a_job(tmp_path):
    admin = start_private_redis(password="admin-secret")
    try:
        r = connect(admin.url)
        rule = documented_acl()
        assert rule[0] == "racer" and "~racer-batch:*" in rule
        rule = [(">acl-test-pw" if a.startswith(">") else a) for a in rule]
        r.execute_command("ACL", "SETUSER", *rule)
        port = admin.url.rsplit(":", 1)[1].split("/")[0]
        url = f"redis://racer:acl-test-pw@127.0.0.1:{port}/0"
        queue = JobQueue.from_url(url, prefix="racer-batch:")
        with pytest.raises(Exception, match="no permissions"):  # nothing outside its prefix
            queue.r.set("other-app:key", "1")
        pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": f"row {i} words"} for i in range(5)]),
                       tmp_path / "in.parquet")
        spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                                "model.name": "stand-in?mat=2", "generation.max_new_tokens": 6,
                                "output.shard_rows": 2, "resources.num_actors": 2})
        job_id = submit_job(queue, spec).job_id
        executor = ThreadExecutor(url, prefix="racer-batch:")
        try:
            assert Worker(queue, executor, lease_s=10).run(max_jobs=1) == 1
        finally:
            executor.shutdown()
        st = queue.status(job_id)
        assert st.state == "done" and st.totals.ok == 5, st
        assert sorted(read_output(spec.output.path).column("status").to_pylist()) == ["ok"] * 5
        with pytest.raises(QueueUnavailable):
            connect(f"redis://racer:wrong@127.0.0.1:{port}/0", timeout_s=2)
    finally:
        admin.stop()
