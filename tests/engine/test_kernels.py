"""Our CPU kernels (engine/kernels/cpu_kernels.cpp) against torch's own ops, at the shapes a verify forward
and a prefill give them and at the awkward ones (N not a multiple of 16, K not a multiple of 8, one row,
head_dim off the vector width). Skipped nowhere: where the kernels cannot build, the loader's fallback is
what is tested."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from racer_batch.engine import kernels
from racer_batch.engine.kernels import cpu_ops, unavailable_reason

OPS = cpu_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"kernels unavailable: {unavailable_reason()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_ops
@pytest.mark.parametrize("n,k", [(48, 32), (37, 29), (960, 576), (16, 1), (5, 300), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(n, k, bias):
    g = _gen(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = OPS.pack(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for m in (0, 1, 2, 3, 5, 6, 7, 12, 13, 16, 31, 64, 130):
        x = torch.randn(m, k, generator=g)
        want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
        torch.testing.assert_close(OPS.linear(x, packed, b, n), want, atol=2e-4, rtol=1e-4)
        res = torch.randn(m, n, generator=g)
        got = OPS.linear_add_(res.clone(), x, packed, b)
        torch.testing.assert_close(got, res + want, atol=2e-4, rtol=1e-4)


def _isas() -> list[str]:
    """The GEMM instruction sets this CPU can run: always avx2, and avx512 where it has AVX-512F."""
    return ["avx2", "avx512"] if OPS.isa() == "avx512" or _has_avx512f() else ["avx2"]


def _has_avx512f() -> bool:
    try:
        return "avx512f" in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


@needs_ops
@pytest.mark.parametrize("n,k", [(37, 29), (960, 576), (16, 1), (576, 1536), (80, 200)])
def test_linear_rows_alone_and_in_a_batch_give_the_same_bits_on_every_isa(n, k, isa_restored):
    """A row's output never depends on the other rows of the call (batched streams rely on it), and the AVX2
    and AVX-512 blocks compute lane for lane the same arithmetic, so both paths give the same bits."""
    g = _gen(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    packed = OPS.pack(w)
    x = torch.randn(40, k, generator=g)
    res = torch.randn(40, n, generator=g)
    outs = {}
    for isa in _isas():
        OPS.set_isa(isa)
        full = OPS.linear(x, packed, b, n)
        added = OPS.linear_add_(res.clone(), x, packed, b)
        for m in (1, 5, 6, 7, 12, 13, 24, 25):  # across the 6-row and 12-row block sizes
            assert torch.equal(OPS.linear(x[:m], packed, b, n), full[:m]), (isa, m)
            assert torch.equal(OPS.linear_add_(res[:m].clone(), x[:m], packed, b), added[:m]), (isa, m)
        assert torch.equal(OPS.linear(x[17:18], packed, b, n), full[17:18])
        outs[isa] = (full, added)
    for isa, (full, added) in outs.items():
        assert torch.equal(full, outs["avx2"][0]) and torch.equal(added, outs["avx2"][1]), isa
    torch.testing.assert_close(outs["avx2"][0], F.linear(x, w, b), atol=2e-4, rtol=1e-4)


@needs_ops
def test_a_prompt_chunks_many_rows_go_in_row_ranges_with_the_same_bits(isa_restored):
    """Past 512 KiB of x (a prompt chunk: 300 rows x 1536) the AVX-512 GEMM runs row ranges one after another
    (``X_BLOCK_BYTES``); every row still gets its bits from a call of a few rows, on every ISA, into a strided
    output and added in place."""
    g = _gen(7)
    n, k, m = 72, 1536, 300
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = OPS.pack(w)
    x, res = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    for isa in _isas():
        OPS.set_isa(isa)
        full = OPS.linear(x, packed, b, n)
        added = OPS.linear_add_(res.clone(), x, packed, b)
        for r0 in (0, 74, 75, 149, 225, 299):  # 300 x 1536 floats = 1.8 MB: four ranges of 75 rows
            assert torch.equal(OPS.linear(x[r0 : r0 + 1], packed, b, n), full[r0 : r0 + 1]), (isa, r0)
            assert torch.equal(OPS.linear_add_(res[r0 : r0 + 13].clone(), x[r0 : r0 + 13], packed, b),
                               added[r0 : r0 + 13]), (isa, r0)
        out = torch.full((m, n + 2), 3.0)
        OPS.linear_into_(out[:, 1 : n + 1], x, packed, b)
        assert torch.equal(out[:, 1 : n + 1], full) and (out[:, 0] == 3.0).all() and (out[:, -1] == 3.0).all()
    torch.testing.assert_close(full, F.linear(x, w, b), atol=5e-4, rtol=1e-4)


@needs_ops
def test_isa_switch_row_steps_and_refusals(isa_restored):
    assert OPS.isa() in ("avx2", "avx512")
    OPS.set_isa("avx2")
    assert list(OPS.row_steps(40)) == [6, 12, 18, 24, 30, 36]
    if _has_avx512f():
        assert OPS.set_isa("avx512") == "avx2" and OPS.isa() == "avx512"
        assert list(OPS.row_steps(40)) == [6, 12, 24, 36]  # up to 6 rows AVX2, then 12-row blocks
    else:
        with pytest.raises(RuntimeError, match="no AVX-512F"):
            OPS.set_isa("avx512")
        assert OPS.isa() == "avx2"
    with pytest.raises(RuntimeError, match="'avx2' or 'avx512'"):
        OPS.set_isa("sse")


@needs_ops
@pytest.mark.parametrize("nq,nkv", [(9, 3), (4, 4), (8, 2), (12, 1)])
def test_a_tree_rows_attention_bits_do_not_depend_on_how_many_rows_share_its_block(nq, nkv, isa_restored):
    """The AVX2 kernel takes a KV head's query rows in blocks of 1-4 split as evenly as possible (9 -> 3 + 3 + 3,
    not 4 + 4 + 1 padded), so a row lands in blocks of different sizes as the tree grows: its bits must be the
    same whatever the block's size or position (each row alone against the whole tree, T = 1..9)."""
    g = _gen(nq * 7 + nkv)
    d, length, start = 64, 300, 211
    keys = torch.randn(nkv, length, d, generator=g)
    vals = torch.randn(nkv, length, d, generator=g)
    neg = torch.finfo(torch.float32).min
    OPS.set_isa("avx2")
    for t in range(1, 10):
        q = torch.randn(t, nq, d, generator=g)
        mask = torch.zeros(t, start + t)
        tree = torch.tril(torch.ones(t, t)) * (torch.rand(t, t, generator=g) < 0.6) + torch.eye(t)
        mask[:, start:] = torch.where(tree > 0, 0.0, neg)
        whole = OPS.attention(q, keys, vals, start + t, mask, 0.125)
        for i in range(t):
            alone = OPS.attention(q[i : i + 1], keys, vals, start + t, mask[i : i + 1], 0.125)
            assert torch.equal(alone, whole[i : i + 1]), (t, i)
        for lo in range(t):  # any run of consecutive rows, so blocks start at every offset
            part = OPS.attention(q[lo:], keys, vals, start + t, mask[lo:], 0.125)
            assert torch.equal(part, whole[lo:]), (t, lo)


@needs_ops
@pytest.mark.parametrize("nq,nkv", [(9, 3), (4, 4), (8, 2)])
def test_attention_gives_the_same_bits_on_every_isa_alone_and_batched(nq, nkv, isa_restored):
    """A stream's rows give the same bits alone (``attention``) and beside other streams (``attention_seg``),
    on either instruction set, and the AVX-512 kernel (``attend_wide``) gives the AVX2 one's bits."""
    g = _gen(nq * 10 + nkv)
    d, slots, length = 64, 5, 420
    keys = torch.randn(slots, nkv, length, d, generator=g)
    vals = torch.randn(slots, nkv, length, d, generator=g)
    sizes, starts, slot_of = [4, 3, 13, 1, 6], [300, 12, 250, 100, 7], [2, 0, 4, 1, 3]
    rows = sum(sizes)
    q = torch.randn(rows, nq, d, generator=g)
    seg = torch.tensor([[slot_of[i], starts[i], sum(sizes[:i])] for i in range(len(sizes))])
    span = max(s + t for s, t in zip(starts, sizes))
    neg = torch.finfo(torch.float32).min
    mask = torch.full((rows, span), neg)
    r = 0
    for t, s in zip(sizes, starts):
        mask[r : r + t, :s] = 0.0
        tree = torch.tril(torch.ones(t, t)) * (torch.rand(t, t, generator=g) < 0.6) + torch.eye(t)
        mask[r : r + t, s : s + t] = torch.where(tree > 0, 0.0, neg)
        r += t
    outs = {}
    for isa in _isas():
        OPS.set_isa(isa)
        batched = OPS.attention_seg(q, keys, vals, seg, mask, 0.125)
        r = 0
        for t, s, sl in zip(sizes, starts, slot_of):
            alone = OPS.attention(q[r : r + t], keys[sl], vals[sl], s + t, mask[r : r + t], 0.125)
            assert torch.equal(alone, batched[r : r + t]), (isa, t)
            r += t
        outs[isa] = batched
    for isa, out in outs.items():
        assert torch.equal(out, outs["avx2"]), isa
    # and right: stream 2 (13 rows) against SDPA
    r, t, s, sl = sum(sizes[:2]), sizes[2], starts[2], slot_of[2]
    rep = nq // nkv
    want = F.scaled_dot_product_attention(
        q[r : r + t].transpose(0, 1), keys[sl, :, : s + t].repeat_interleave(rep, 0),
        vals[sl, :, : s + t].repeat_interleave(rep, 0), attn_mask=mask[r : r + t, : s + t], scale=0.125,
    ).transpose(0, 1).reshape(t, nq * d)
    torch.testing.assert_close(outs["avx2"][r : r + t], want, atol=1e-4, rtol=1e-4)


@needs_ops
def test_kernel_isa_env_picks_the_default():
    import subprocess
    import sys

    code = "from racer_batch.engine.kernels import cpu_ops; print(cpu_ops().isa())"
    env = dict(__import__("os").environ, RACER_KERNEL_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"
    env.pop("RACER_KERNEL_ISA")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("avx512" if _has_avx512f() else "avx2")


@needs_ops
def test_linear_reads_strided_rows_and_writes_strided_out():
    g = _gen(1)
    w = torch.randn(40, 24, generator=g)
    packed = OPS.pack(w)
    big = torch.randn(7, 50, generator=g)
    x = big[:, 3:27]  # row stride 50, unit column stride
    torch.testing.assert_close(OPS.linear(x, packed, None, 40), F.linear(x, w), atol=1e-4, rtol=1e-4)
    out = torch.zeros(7, 64)
    OPS.linear_add_(out[:, 10:50], x, packed, None)
    torch.testing.assert_close(out[:, 10:50], F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert not out[:, :10].any() and not out[:, 50:].any()
    xt = torch.randn(24, 7, generator=g).t()  # column stride != 1: copied, still right
    torch.testing.assert_close(OPS.linear(xt, packed, None, 40), F.linear(xt, w), atol=1e-4, rtol=1e-4)


@needs_ops
def test_linear_refuses_bad_inputs_with_a_message():
    w = torch.randn(32, 16)
    packed = OPS.pack(w)
    with pytest.raises(RuntimeError, match="K=8"):
        OPS.linear(torch.randn(2, 8), packed, None, 32)
    with pytest.raises(RuntimeError, match="N=50"):
        OPS.linear(torch.randn(2, 16), packed, None, 50)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.linear(torch.randn(2, 16, dtype=torch.float64), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        OPS.linear(torch.randn(2, 16), packed, torch.randn(31), 32)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.pack(w.double())


@needs_ops
@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 5, 64), (2, 7)])
def test_rms_norm(shape):
    g = _gen(2)
    x = 3.0 * torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), atol=1e-5, rtol=1e-5)


def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@needs_ops
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("nq,nkv,d", [(9, 3, 64), (4, 4, 32), (4, 1, 6)])
def test_rope_kv_writes_rotated_keys_and_values_at_their_rows(norm, nq, nkv, d):
    g = _gen(nq * d)
    t, start, max_len = 5, 11, 24
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g)
    ang = torch.randn(t, 1, d // 2, generator=g).repeat(1, 1, 2)
    cos, sin = ang.cos(), ang.sin()
    cache = torch.full((2, nkv, max_len, d), 7.0)
    qn = torch.randn(d, generator=g) if norm else None
    kn = torch.randn(d, generator=g) if norm else None
    q = OPS.rope_kv_(qkv, cos, sin, cache[0], cache[1], start, nq, qn, kn, 1e-6)
    q_in = qkv[:, : nq * d].view(t, nq, d)
    k_in = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
    if norm:
        q_in, k_in = F.rms_norm(q_in, (d,), qn, 1e-6), F.rms_norm(k_in, (d,), kn, 1e-6)
    torch.testing.assert_close(q, _rope_ref(q_in, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[0, :, start : start + t], _rope_ref(k_in, cos, sin).transpose(0, 1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[1, :, start : start + t], qkv[:, (nq + nkv) * d :].view(t, nkv, d).transpose(0, 1))
    untouched = torch.ones(max_len, dtype=torch.bool)
    untouched[start : start + t] = False
    assert (cache[:, :, untouched] == 7.0).all()  # nothing written outside the tree's rows
    with pytest.raises(RuntimeError, match="past"):
        OPS.rope_kv_(qkv, cos, sin, cache[0], cache[1], max_len - 2, nq, qn, kn, 1e-6)


@needs_ops
@pytest.mark.parametrize("nq,nkv,d", [(9, 3, 64), (4, 2, 32), (2, 1, 12)])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_equals_sdpa(nq, nkv, d, masked):
    g = _gen(nq + d)
    t, s, max_len = 6, 40, 50
    q = torch.randn(t, nq, d, generator=g)
    kv = torch.randn(2, nkv, max_len, d, generator=g)
    mask = None
    if masked:  # a tree block: each row sees the prefix, itself and a random subset of the other rows
        vis = torch.ones(t, s, dtype=torch.bool)
        vis[:, s - t :] = torch.rand(t, t, generator=g) < 0.5
        vis[:, s - t :] |= torch.eye(t, dtype=torch.bool)
        mask = torch.zeros(t, max_len).masked_fill_(~F.pad(vis, (0, max_len - s)), torch.finfo(torch.float32).min)
    got = OPS.attention(q, kv[0], kv[1], s, mask, d ** -0.5)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kv[0, :, :s].unsqueeze(0), kv[1, :, :s].unsqueeze(0),
        attn_mask=None if mask is None else mask[:, :s], scale=d ** -0.5, enable_gqa=True,
    )[0].transpose(0, 1).reshape(t, nq * d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_ops
def test_silu_mul():
    gu = 4.0 * torch.randn(7, 2 * 37, generator=_gen(3))
    torch.testing.assert_close(OPS.silu_mul(gu), F.silu(gu[:, :37]) * gu[:, 37:], atol=1e-6, rtol=1e-5)


def test_kernels_off_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("RACER_KERNELS", "off")
    assert cpu_ops() is None
    assert unavailable_reason() == "RACER_KERNELS=off"
    from racer_batch.engine.decoder_ops import default_matmul_path

    assert default_matmul_path(torch.device("cpu")) in ("onednn_packed", "torch")


def test_a_failed_build_falls_back_with_the_compiler_error(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.delenv("RACER_KERNELS", raising=False)
    monkeypatch.setenv("RACER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(kernels, "_cpu_has_avx2_fma", lambda: True)
    assert cpu_ops() is None
    assert "failed" in unavailable_reason()
    assert not list(tmp_path.glob("*.so"))  # no half-written library left for the next process


@needs_ops
@pytest.mark.parametrize("nq,nkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (12, 1, 80), (4, 2, 128), (2, 1, 256)])
def test_wide_attention_is_bit_identical_to_the_avx2_kernel(nq, nkv, d, isa_restored):
    """The AVX-512 tree attention (``attend_wide``: 16-key tiles transposed, 8 lane-class accumulators per row)
    gives the bits of the AVX2 one (``attend4``) at every key count around its tile edges (odd counts take the
    single-key tail), for one node up to more rows of a KV head than one task holds (split into chunks), over
    a strided cache slot, with and without a tree mask; and both are right (SDPA)."""
    g = _gen(nq * 1000 + d)
    max_len = 420
    kv = torch.randn(2, nkv, max_len, d, generator=g)
    neg = torch.finfo(torch.float32).min
    rep = nq // nkv
    for s_total in (1, 2, 3, 15, 16, 17, 31, 33, 47, 100, 401):
        for t in (1, 2, 5, 13):
            if t > s_total:
                continue
            q = torch.randn(t, nq, d, generator=g)
            start = s_total - t
            mask = torch.zeros(t, max_len)
            mask[:, s_total:] = neg
            vis = torch.tril(torch.ones(t, t)) * (torch.rand(t, t, generator=g) < 0.6) + torch.eye(t)
            mask[:, start:s_total] = torch.where(vis > 0, 0.0, neg)
            for m in (None, mask):
                outs = {}
                for isa in _isas():
                    OPS.set_isa(isa)
                    outs[isa] = OPS.attention(q, kv[0], kv[1], s_total, m, d ** -0.5)
                for isa, out in outs.items():
                    assert torch.equal(out, outs["avx2"]), (isa, s_total, t, m is None)
                want = F.scaled_dot_product_attention(
                    q.transpose(0, 1), kv[0, :, :s_total].repeat_interleave(rep, 0),
                    kv[1, :, :s_total].repeat_interleave(rep, 0),
                    attn_mask=None if m is None else m[:, :s_total], scale=d ** -0.5,
                ).transpose(0, 1).reshape(t, nq * d)
                torch.testing.assert_close(outs["avx2"], want, atol=1e-4, rtol=1e-4)


@needs_ops
@pytest.mark.parametrize("k", [1, 2, 8, 13])
def test_argmax_topk_is_torchs_argmax_and_topk(k):
    """One pass gives torch.argmax (the first maximal index, also among ties) and torch.topk's ids; with ties
    the top-k holds the lower indices first (its values equal torch.topk's)."""
    g = _gen(k)
    for t, v in [(1, 49152), (5, 37), (16, 100), (3, k)]:
        x = torch.randn(t, v, generator=g) * 4
        am, top = OPS.argmax_topk(x, k)
        assert am.dtype == top.dtype == torch.long and top.shape == (t, k)
        assert torch.equal(am, x.argmax(dim=-1))
        assert torch.equal(top, torch.topk(x, k, dim=-1).indices)
    # ties: every value taken from a few levels, the maximum repeated
    x = torch.randint(0, 4, (6, 300), generator=g).float()
    x[:, 7] = 9.0
    x[:, 200] = 9.0
    x[2, 0] = 9.0
    am, top = OPS.argmax_topk(x, k)
    assert torch.equal(am, x.argmax(dim=-1))
    want_vals = torch.topk(x, k, dim=-1).values
    assert torch.equal(x.gather(1, top), want_vals)
    for r in range(6):  # equal values in index order
        vals = x[r, top[r]].tolist()
        for a in range(k - 1):
            assert vals[a] > vals[a + 1] or top[r, a] < top[r, a + 1]
    # a vocabulary-sized row at several thread counts, with ties far apart (the first maximal index wins)
    x = torch.randint(0, 3, (2, 49152), generator=g).float()
    x[0, [5, 24575, 24576, 40000]] = 7.0
    x[1, [49151, 30000]] = 7.0
    for threads in (1, 2, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            am, top = OPS.argmax_topk(x[:1], k)
            am2, top2 = OPS.argmax_topk(x, k)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(am, x[:1].argmax(dim=-1)) and torch.equal(am2, x.argmax(dim=-1))
        for got, rows in ((top, x[:1]), (top2, x)):
            assert torch.equal(rows.gather(1, got), torch.topk(rows, k, dim=-1).values)
            for r in range(rows.shape[0]):
                vals = rows[r, got[r]].tolist()
                assert all(vals[a] > vals[a + 1] or got[r, a] < got[r, a + 1] for a in range(k - 1))
    with pytest.raises(RuntimeError, match="k"):
        OPS.argmax_topk(x, 0)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_topk(x.double(), 2)


@needs_ops
@pytest.mark.parametrize("nq,nkv,d", [(9, 3, 64), (4, 4, 32), (2, 1, 128)])
def test_causal_prefill_attention_equals_sdpa(nq, nkv, d, isa_restored):
    """``attention_causal``: each row of a prefill chunk sees the prefix and the chunk up to itself; a first
    chunk and one after a prefix, at lengths around the 12-row tasks and 16-key tiles. Where the AVX-512
    kernels do not run it refuses (the runner then takes SDPA)."""
    if not OPS.has_causal(d):
        with pytest.raises(RuntimeError, match="AVX-512"):
            OPS.attention_causal(torch.zeros(2, nq, d), torch.zeros(nkv, 4, d), torch.zeros(nkv, 4, d), 0, 0.1)
        return
    g = _gen(nq + d)
    kv = torch.randn(2, nkv, 300, d, generator=g)
    rep = nq // nkv
    for start, t in [(0, 2), (0, 13), (0, 100), (37, 1), (37, 25), (150, 131)]:
        q = torch.randn(t, nq, d, generator=g)
        got = OPS.attention_causal(q, kv[0], kv[1], start, d ** -0.5)
        s = start + t
        vis = torch.ones(t, s, dtype=torch.bool).tril_(diagonal=start)
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1), kv[0, :, :s].repeat_interleave(rep, 0), kv[1, :, :s].repeat_interleave(rep, 0),
            attn_mask=vis, scale=d ** -0.5,
        ).transpose(0, 1).reshape(t, nq * d)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    OPS.set_isa("avx2")
    assert not OPS.has_causal(d)
