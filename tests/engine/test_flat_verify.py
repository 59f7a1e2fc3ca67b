"""The batched verify entry point ``verify_flat`` (one call for B streams' draft trees, ``tree.FlatTrees``) and
``keep_rows_batch`` on both runners, and the flat batch's tree mask (``decoder.fill_tree_mask``).

Oracles: the transformers forward over each stream's full sequence (``test_static_runner.oracle``), the
single-tree kernel forward the runner had before ``verify_flat`` (bit for bit), and ``keep_rows`` per stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_static_runner import ATOL, RTOL, bundle_of, make_model, oracle, prefilled_chain, rand_draft, rand_tokens

from racer_batch.engine.decoder import fill_tree_mask, tree_mask_filler
from racer_batch.engine.kernels import cpu_ops
from racer_batch.engine.runner import ModelRunner
from racer_batch.engine.static_runner import StaticRunner
from racer_batch.engine.tree import FlatTrees, flatten_tree

needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="our CPU kernels did not build here")
NEG = float(torch.finfo(torch.float32).min)


def _streams(runner, gen: torch.Generator, lens, sizes):
    """Prefill one stream per (prompt length, tree size); returns (trees, caches, prompts)."""
    trees, caches, prompts = [], [], []
    for n, t in zip(lens, sizes):
        cache = runner.new_cache(n + 16)
        prompt = rand_tokens(gen, n)
        runner.prefill(prompt, cache=cache, topk=0)
        trees.append(flatten_tree(rand_draft(gen, t), committed_len=n, device="cpu", dtype=torch.float32))
        caches.append(cache)
        prompts.append(prompt)
    return trees, caches, prompts


# ---------------------------------------------------------------- the mask


def test_fill_tree_mask_is_each_trees_visible_block_after_its_prefix():
    gen = torch.Generator().manual_seed(1)
    sizes, starts = [1, 7, 3, 12], [0, 5, 9, 2]
    trees = [flatten_tree(rand_draft(gen, t), committed_len=s, device="cpu", dtype=torch.float32)
             for t, s in zip(sizes, starts)]
    flat = FlatTrees.of([(t, None) for t in trees])
    span = 20
    mask = fill_tree_mask(torch.full((flat.rows, span), 7.0), flat.cu, flat.parents, flat.starts, NEG)
    for b, tree in enumerate(trees):
        lo, hi, s = int(flat.cu[b]), int(flat.cu[b + 1]), starts[b]
        want = torch.full((hi - lo, span), NEG)
        want[:, :s] = 0.0
        want[:, s : s + tree.size] = torch.where(torch.from_numpy(tree.visible), 0.0, NEG)
        assert torch.equal(mask[lo:hi], want), b
        assert np.array_equal(flat.visible(b), tree.visible)


def test_native_tree_mask_filler_agrees_with_ours_when_present():
    gen = torch.Generator().manual_seed(2)
    flat = FlatTrees.of([(flatten_tree(rand_draft(gen, t), committed_len=s, device="cpu", dtype=torch.float32), None)
                         for t, s in ((5, 3), (9, 0), (1, 11))])
    filler = tree_mask_filler()
    if filler is fill_tree_mask:
        pytest.skip("no racer_batch.drafters.native.fill_tree_mask here")
    a = filler(torch.zeros((flat.rows, 16)), flat.cu, flat.parents, flat.starts, NEG)
    b = fill_tree_mask(torch.zeros((flat.rows, 16)), flat.cu, flat.parents, flat.starts, NEG)
    assert torch.equal(a, b)


def test_tree_mask_filler_takes_the_native_one(monkeypatch):
    from racer_batch.drafters import native as native_mod

    calls = []

    def native(mask, cu, parents, starts, neg):
        calls.append(mask.shape)
        return fill_tree_mask(mask, cu, parents, starts, neg)

    monkeypatch.setattr(native_mod, "fill_tree_mask", native)
    monkeypatch.setattr(native_mod, "available", lambda: True)
    assert tree_mask_filler() is native
    model = make_model("llama", seed=3)
    runner = StaticRunner(bundle_of(model))
    gen = torch.Generator().manual_seed(3)
    trees, caches, prompts = _streams(runner, gen, [4], [3])
    runner.verify_tree(trees[0], cache=caches[0])
    assert calls


# ---------------------------------------------------------------- verify_flat against the oracles


def _check_against_oracle(model, logits, flat, trees, prompts):
    for b, (tree, prompt) in enumerate(zip(trees, prompts)):
        got = logits[int(flat.cu[b]) : int(flat.cu[b + 1])]
        for path in tree.paths:
            nodes = [int(n) for n in path if n >= 0]
            want = oracle(model, prompt + [int(tree.tokens[n]) for n in nodes])[len(prompt):]
            torch.testing.assert_close(got[nodes].float(), want, atol=ATOL, rtol=RTOL)


def _runners(bundle):
    out = {"torch": StaticRunner(bundle, matmul="torch"), "eager": ModelRunner(bundle)}
    if cpu_ops() is not None:
        out["kernels"] = StaticRunner(bundle)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "llama_mqa", "phi3_window", "gemma3_text", "qwen3_moe",
                                    "mixtral"])
def test_verify_flat_matches_the_hf_forward_on_every_runner(family):
    """B streams of different committed lengths and tree sizes (one of them a lone root) in one call: every
    node of every stream equals the transformers forward over that stream's sequence, on our kernels, on torch
    ops (the padded step) and on the eager runner; B = 1 goes the same way."""
    model = make_model(family, seed=4)
    for name, runner in _runners(bundle_of(model)).items():
        gen = torch.Generator().manual_seed(4)
        trees, caches, prompts = _streams(runner, gen, [5, 23, 1, 12], [4, 1, 9, 6])
        flat = FlatTrees.of(list(zip(trees, caches)))
        logits = runner.verify_flat(flat)
        assert logits.shape == (flat.rows, 64), name
        _check_against_oracle(model, logits.clone(), flat, trees, prompts)
        for b in range(4):  # each stream alone (B = 1), after dropping the batch's tree rows
            runner.keep_rows(caches[b], committed_len=len(prompts[b]), nodes=[])
            one = FlatTrees.of([(trees[b], caches[b])])
            _check_against_oracle(model, runner.verify_flat(one).clone(), one, [trees[b]], [prompts[b]])


def test_verify_flat_torch_path_keeps_an_idle_slots_rows():
    """On torch ops the batch spans the slot range of its streams: a live slot inside it that sits the step
    out keeps its committed KV rows and the tree rows of its own verify not yet kept (a stream retried alone
    after its batch-mates), and verifies correctly afterwards."""
    model = make_model("llama", seed=6)
    runner = StaticRunner(bundle_of(model), matmul="torch")
    gen = torch.Generator().manual_seed(6)
    trees, caches, prompts = _streams(runner, gen, [6, 30, 2], [5, 2, 3])
    one = FlatTrees.of([(trees[1], caches[1])])
    _check_against_oracle(model, runner.verify_flat(one).clone(), one, [trees[1]], [prompts[1]])
    before = runner.kv[:, :, caches[1].slot, :, : 30 + 2].clone()
    flat = FlatTrees.of([(trees[0], caches[0]), (trees[2], caches[2])])
    _check_against_oracle(model, runner.verify_flat(flat).clone(), flat, [trees[0], trees[2]],
                          [prompts[0], prompts[2]])
    assert runner.last_batch_path == "padded"
    assert torch.equal(runner.kv[:, :, caches[1].slot, :, : 30 + 2], before)
    runner.keep_rows(caches[1], committed_len=30, nodes=[0, 1])
    committed = prompts[1] + [int(t) for t in trees[1].tokens]
    nxt = flatten_tree(rand_draft(gen, 4), committed_len=32, device="cpu", dtype=torch.float32)
    one = FlatTrees.of([(nxt, caches[1])])
    _check_against_oracle(model, runner.verify_flat(one).clone(), one, [nxt], [committed])


def test_verify_flat_refuses_a_shared_slot_and_an_empty_stream():
    runner, cache, tree = prefilled_chain()
    with pytest.raises(ValueError, match="share a KV-cache slot"):
        runner.verify_flat(FlatTrees.of([(tree, cache), (tree, cache)]))
    empty = FlatTrees(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                      np.zeros(2, np.int64), np.array([3]), [cache])
    with pytest.raises(ValueError, match="at least one row"):
        runner.verify_flat(empty)


# ---------------------------------------------------------------- bit for bit on our kernels


@torch.inference_mode()
def _single_tree_kernel_forward(runner, tree, cache) -> torch.Tensor:
    """Logits of one tree as the runner computed them before ``verify_flat``: ``rope_kv_`` and ``attention``
    over the row's slot, the mask a strided view of a ``[bucket, max_len]`` buffer, the output layer written
    into a buffer by ``linear_into_``."""
    ops = runner._ops
    w = runner.weights
    t, start = tree.size, cache.length
    end = start + t
    big = torch.zeros((max(t, 8), runner.max_len))
    big[:t, start:end] = torch.where(torch.from_numpy(tree.visible), 0.0, NEG)
    mask = big[:t, :end]
    ids = torch.from_numpy(tree.tokens)
    pos = torch.from_numpy(tree.depths + start)
    x = F.embedding(ids, w.embed)
    cos, sin = w.cos[pos], w.sin[pos]
    for li, layer in enumerate(w.layers):
        h = ops.rms_norm(x, layer.ln_in, w.eps)
        qkv = ops.linear(h, layer.qkv._panels, layer.qkv.bias, layer.qkv.weight.shape[0])
        keys, vals = runner.kv[li, 0, cache.slot], runner.kv[li, 1, cache.slot]
        q = ops.rope_kv_(qkv, cos, sin, keys, vals, start, w.n_heads, layer.q_norm, layer.k_norm, w.eps)
        att = ops.attention(q, keys, vals, end, mask, w.scale)
        ops.linear_add_(x, att, layer.o._panels, layer.o.bias)
        h = ops.rms_norm(x, layer.ln_post, w.eps)
        gu = ops.linear(h, layer.gate_up._panels, layer.gate_up.bias, layer.gate_up.weight.shape[0])
        ops.linear_add_(x, ops.silu_mul(gu), layer.down._panels, layer.down.bias)
    hidden = ops.rms_norm(x, w.final_norm, w.eps)
    out = torch.empty((t, w.lm_head.weight.shape[0]))
    return ops.linear_into_(out, hidden, w.lm_head._panels, w.lm_head.bias)


@needs_kernels
@pytest.mark.parametrize("family,over", [("llama", {}), ("qwen3", {}), ("llama_mqa", {}),
                                         ("llama", {"hidden_size": 96, "num_attention_heads": 4})])
def test_verify_flat_on_our_kernels_is_bit_identical_to_the_single_tree_forward(family, over):
    """On our kernels ``verify_flat`` (B streams, and B = 1), ``verify_tree`` and ``verify_batch`` give, bit for
    bit, the logits and KV rows of the single-tree kernel forward of each stream alone."""
    model = make_model(family, seed=8, **over)
    lens, sizes = [5, 40, 1, 17], [3, 1, 9, 6]
    results = {}
    for mode in ("reference", "flat", "alone", "tree", "batch"):
        runner = StaticRunner(bundle_of(model))
        assert runner._ops is not None
        trees, caches, _ = _streams(runner, torch.Generator().manual_seed(8), lens, sizes)
        items = list(zip(trees, caches))
        if mode == "reference":
            out = [_single_tree_kernel_forward(runner, t, c) for t, c in items]
        elif mode == "flat":
            flat = FlatTrees.of(items)
            logits = runner.verify_flat(flat).clone()
            out = [logits[int(flat.cu[b]) : int(flat.cu[b + 1])] for b in range(len(items))]
        elif mode == "alone":
            out = [runner.verify_flat(FlatTrees.of([it])).clone() for it in items]
        elif mode == "tree":
            out = [runner.verify_tree(t, cache=c).clone() for t, c in items]
        else:
            out = runner.verify_batch(items)
        kv = [runner.kv[:, :, c.slot, :, : n + t].clone() for c, n, t in zip(caches, lens, sizes)]
        results[mode] = (out, kv)
    ref_logits, ref_kv = results.pop("reference")
    for mode, (out, kv) in results.items():
        for a, b in zip(ref_logits, out):
            assert torch.equal(a, b), mode
        for a, b in zip(ref_kv, kv):
            assert torch.equal(a, b), mode


# ---------------------------------------------------------------- keep_rows_batch


def _paths(gen: np.random.Generator, trees) -> tuple[np.ndarray, np.ndarray]:
    """One random root-to-node path per tree (some a plain chain prefix, some a lone root) and cu offsets."""
    paths = []
    for tree in trees:
        row = tree.paths[gen.integers(len(tree.paths))]
        nodes = [int(n) for n in row if n >= 0]
        paths.append(nodes[: gen.integers(1, len(nodes) + 1)])
    cu = np.zeros(len(paths) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([len(p) for p in paths])
    return np.array([n for p in paths for n in p], dtype=np.int64), cu


@pytest.mark.parametrize("kind", ["static", "eager"])
def test_keep_rows_batch_equals_keep_rows_per_stream(kind):
    model = make_model("llama", seed=9)
    lens, sizes = [5, 21, 3, 9], [7, 1, 10, 5]
    caches_by = {}
    for mode in ("per-stream", "batch"):
        runner = StaticRunner(bundle_of(model)) if kind == "static" else ModelRunner(bundle_of(model))
        trees, caches, _ = _streams(runner, torch.Generator().manual_seed(9), lens, sizes)
        runner.verify_flat(FlatTrees.of(list(zip(trees, caches))))
        nodes, cu = _paths(np.random.default_rng(9), trees)
        assert any(not np.array_equal(nodes[cu[b]: cu[b + 1]], np.arange(cu[b + 1] - cu[b])) for b in range(4))
        if mode == "batch":
            runner.keep_rows_batch(caches, np.array(lens), nodes, cu)
        else:
            for b, c in enumerate(caches):
                runner.keep_rows(c, committed_len=lens[b], nodes=nodes[cu[b]: cu[b + 1]].tolist())
        caches_by[mode] = (runner, caches, [lens[b] + int(cu[b + 1] - cu[b]) for b in range(4)])
    (ra, ca, want), (rb, cb, _) = caches_by["per-stream"], caches_by["batch"]
    for b in range(4):
        if kind == "static":
            assert ca[b].length == cb[b].length == want[b]
            assert torch.equal(ra.kv[:, :, ca[b].slot, :, : want[b]], rb.kv[:, :, cb[b].slot, :, : want[b]])
        else:
            for la, lb in zip(ca[b].layers, cb[b].layers):
                assert la.keys.shape[2] == want[b]
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keep_rows_kernel_moves_the_rows_torch_indexing_moves(dtype):
    """``racer::keep_rows_`` (one call of plain row copies, used on the CPU with our kernels) leaves the cache
    exactly as the torch gather-then-scatter does, for every dtype, with moves of several streams and a
    stream whose path is its chain prefix (nothing moved); an out-of-range position is refused."""
    from racer_batch.engine.kv_cache import KVCache

    ops = cpu_ops()
    assert ops is not None, "our CPU kernels did not build"
    pools = {}
    for name, kernels in (("kernel", ops), ("torch", None)):
        pool = KVCache((3, 2, 8), dtype=dtype, device=torch.device("cpu"), context_length=64, pad=16, slots=4,
                       max_slots=4, start_len=48, kernels=kernels)
        with torch.inference_mode():
            pool.kv.copy_(torch.from_numpy(np.random.default_rng(1).standard_normal(pool.kv.shape)).to(dtype))
        caches = [pool.take() for _ in range(4)]
        pools[name] = (pool, caches)
    starts = np.array([5, 0, 17, 30])
    paths = [np.array([0, 2, 5, 6]), np.array([0, 1, 2]), np.array([0, 3]), np.array([0, 1, 4, 9, 12])]
    cu = np.concatenate([[0], np.cumsum([len(p) for p in paths])])
    before = pools["kernel"][0].kv.clone()
    for pool, caches in pools.values():
        pool.keep_rows_batch(caches, starts, np.concatenate(paths), cu)
    (pk, ck), (pt, ct) = pools["kernel"], pools["torch"]
    s0 = ck[0].slot  # stream 0 kept nodes 0, 2, 5, 6 after 5 rows: position 6 now holds what 7 held
    assert torch.equal(pk.kv[:, :, s0, :, 6], before[:, :, s0, :, 7]) and not torch.equal(pk.kv, before)
    assert torch.equal(pk.kv, pt.kv)
    assert [c.length for c in ck] == [c.length for c in ct] == [9, 3, 19, 35]
    # every stream keeping its root alone (AR's steps) moves nothing and adds one committed row each
    after = pk.kv.clone()
    pk.keep_rows_batch(ck, np.array([9, 3, 19, 35]), np.zeros(4, dtype=np.int64), np.arange(5))
    assert torch.equal(pk.kv, after) and [c.length for c in ck] == [10, 4, 20, 36]
    with pytest.raises(RuntimeError, match="out of range"), torch.inference_mode():
        ops.keep_rows_(pk.kv, torch.tensor([0]), torch.tensor([pk.max_len]), torch.tensor([0]))


def test_keep_rows_batch_then_verify_stays_lossless():
    """After one call keeps every stream's path, the next flat verify of each stream equals the oracle over
    its committed tokens."""
    model = make_model("qwen2", seed=10)
    for runner in _runners(bundle_of(model)).values():
        gen = torch.Generator().manual_seed(10)
        trees, caches, prompts = _streams(runner, gen, [7, 2, 15], [6, 4, 8])
        runner.verify_flat(FlatTrees.of(list(zip(trees, caches))))
        nodes, cu = _paths(np.random.default_rng(10), trees)
        runner.keep_rows_batch(caches, np.array([7, 2, 15]), nodes, cu)
        committed = [p + [int(trees[b].tokens[n]) for n in nodes[cu[b]: cu[b + 1]]] for b, p in enumerate(prompts)]
        nxt = [flatten_tree(rand_draft(gen, t), committed_len=len(c), device="cpu", dtype=torch.float32)
               for t, c in zip((3, 5, 1), committed)]
        flat = FlatTrees.of(list(zip(nxt, caches)))
        _check_against_oracle(model, runner.verify_flat(flat).clone(), flat, nxt, committed)


# ---------------------------------------------------------------- the CUDA-graph step's shapes, on the CPU


class _CallAgain:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the recorded step again into the output
    the capture returned (what a graph's replay does with the same static buffers)."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self):
        self.out.copy_(self.fn())


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_moe"])
def test_graph_path_buckets_and_static_buffers_stay_lossless(family, monkeypatch):
    """The ``padded-graph`` path (CUDA with ``compile``) with the recording replaced by a plain call: streams
    in slots ``[0, B_pad)`` with bucketed ``B_pad`` / ``N_pad``, inputs copied into static buffers, attention
    over each whole slot (stale values past the prefix masked), one graph per ``(B_pad, N_pad)`` replayed with
    new inputs, an idle live slot's rows kept, and the graphs dropped when the cache grows."""
    from test_static_runner import _poison_beyond

    from racer_batch.engine.graphs import CudaGraphs

    monkeypatch.setattr(CudaGraphs, "_record", lambda self, fn: (lambda g: (g, g.out))(_CallAgain(fn)))
    model = make_model(family, seed=12)
    runner = StaticRunner(bundle_of(model), matmul="torch", slots=3, buckets=(1, 2, 4, 8), max_len=96)
    runner.graphs = CudaGraphs(runner.device, runner.dtype)
    runner.warmup([4])  # every stream count the 3 slots allow, tree buckets 1, 2, 4
    assert set(runner.graphs.graphs) == {(b, n) for b in (1, 2, 3) for n in (1, 2, 4)}
    gen = torch.Generator().manual_seed(12)
    trees, caches, prompts = _streams(runner, gen, [6, 30, 2], [5, 2, 3])
    for c, p in zip(caches, prompts):
        _poison_beyond(runner, c, len(p))
    idle = runner.kv[:, :, caches[1].slot, :, :30].clone()
    flat = FlatTrees.of([(trees[0], caches[0]), (trees[2], caches[2])])
    _check_against_oracle(model, runner.verify_flat(flat).clone(), flat, [trees[0], trees[2]],
                          [prompts[0], prompts[2]])
    assert runner.last_batch_path == "padded-graph" and (3, 8) in runner.graphs.graphs
    assert torch.equal(runner.kv[:, :, caches[1].slot, :, :30], idle)
    one = FlatTrees.of([(trees[1], caches[1])])  # slot 1 alone: B_pad 2 (slots 0 and 1), N_pad 2
    _check_against_oracle(model, runner.verify_flat(one).clone(), one, [trees[1]], [prompts[1]])
    n_graphs = len(runner.graphs.graphs)
    nodes, cu = _paths(np.random.default_rng(12), [trees[0], trees[2]])
    runner.keep_rows_batch([caches[0], caches[2]], np.array([6, 2]), nodes, cu)
    committed = [prompts[0] + [int(trees[0].tokens[n]) for n in nodes[cu[0]: cu[1]]],
                 prompts[2] + [int(trees[2].tokens[n]) for n in nodes[cu[1]: cu[2]]]]
    nxt = [flatten_tree(rand_draft(gen, t), committed_len=len(c), device="cpu", dtype=torch.float32)
           for t, c in zip((7, 4), committed)]
    flat = FlatTrees.of([(nxt[0], caches[0]), (nxt[1], caches[2])])
    _check_against_oracle(model, runner.verify_flat(flat).clone(), flat, nxt, committed)
    assert len(runner.graphs.graphs) == n_graphs  # the (3, 8) graph replayed with new inputs
    big = runner.new_cache(200)  # the cache grows: every graph read the old buffers
    assert runner.max_len > 96 and not runner.graphs.graphs
    big.release()
