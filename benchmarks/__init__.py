"""The benchmark harness: every measurement behind a figure in ``benchmarks/README.md``.

Each module is run from the repository root as ``python -m benchmarks.<module> [options]`` (``--help`` for
its options) and writes its results as ``benchmarks/<name>-<stamp>.json`` and ``.md`` through
:mod:`benchmarks.common`, the one shared module (machine description, results files, the Markdown writer,
prompt sampling, two-revision child processes). Rows are the product's own ``RowRecord`` and ``Tally``.

- ``merge``: pools several ``racer-batch bench`` results files (the product's side-by-side comparison of the
  decoding methods, ``racer_batch/bench.py``) into one token-weighted table.
- ``capacity_vs_relaxed``: capacity tuning against relaxed acceptance.
- ``throughput``: output tokens/s of one actor with B streams in flight.
- ``host``: host time per stream-step of the decode loop, at two revisions.
- ``verify``: the verify-forward cost curve t(T) per runner and matmul path.
- ``kernel_ab``: our CPU kernels at two revisions.
- ``gpu``: the GPU cost model and the B x N grid (prepared for a CUDA machine; ``benchmarks/gpu_bench.sh``).
- ``sched_overhead``: the batch service's scheduling overhead; processes vs threads as streams.
- ``soak``: many short rows through one actor, memory and Redis state over time.
- ``specbench_job``: all 480 Spec-Bench questions as one racer-batch job.
- ``rest_corpus``: a corpus for the REST drafter that leaves the benchmark items out.
- ``warm_auto``: a job's saved draft state and ``decoding.method: auto`` on a Spec-Bench job, one racer-batch
  job per contender (issue 30).
- ``cross_row``: what a job's rows teach each other's drafts: RACER's MAT per draft-state scope (a state per
  row, per shard, per actor, one for the job), on one engine without the service's timing (issue 30).

Nothing here is imported by ``racer_batch``; the harness imports the product, never the other way round.
"""
