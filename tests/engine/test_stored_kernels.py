"""Weights as a GGUF file stores them (issue 31, weights/stored.py and the stored GEMM of cpu_kernels.cpp): the
packed blocks expand to exactly gguf-py's de-quantised numbers, and the stored GEMM gives bit for bit the float32
GEMM's results over those numbers, for every format, at awkward shapes (N not a multiple of 16, K a few groups,
row counts around the micro-kernels' blocks), on every instruction set this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from racer_batch.engine.kernels import UNLIMITED_ROWS, cpu_ops, unavailable_reason
from racer_batch.weights import stored

OPS = cpu_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"kernels unavailable: {unavailable_reason()}")

# types gguf-py quantises (and so gives realistic blocks); the K-quants get random blocks with sane scales
QUANTISED = {"F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_1": Q.Q4_1}
RANDOM_BLOCKS = {"Q4_K": (Q.Q4_K, 144), "Q6_K": (Q.Q6_K, 210)}


def _tensor(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, int]:
    """A GGUF tensor's bytes ``[n, bytes per row]`` (F16: halves ``[n, k]``) of type ``kind`` and its id."""
    rng = np.random.default_rng(seed)
    if kind in QUANTISED:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[0, :7] = 0.0  # a run of zeros: d = 0 blocks stay exact
        return quantize(w, QUANTISED[kind]), int(QUANTISED[kind])
    qtype, size = RANDOM_BLOCKS[kind]
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    scale = (rng.random((n, k // 256, 2)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
    if kind == "Q4_K":
        raw[..., 0:4] = scale  # d and dmin
    else:
        raw[..., 208:210] = scale[..., :2]  # d
    return raw.reshape(n, -1), int(qtype)


def _cases():
    for kind in (*QUANTISED, *RANDOM_BLOCKS):
        big = kind in RANDOM_BLOCKS
        small = [(33, 96), (64, 32), (37, 576), (16, 64), (100, 64)]
        for n, k in ([(33, 256), (64, 512), (37, 768)] if big else small):
            yield kind, n, k


def _isas() -> list[str]:
    return ["avx2", "avx512"] if OPS is not None and ("avx512f" in open("/proc/cpuinfo").read().split()) else ["avx2"]


@needs_ops
@pytest.mark.parametrize("kind,n,k", list(_cases()))
def test_stored_blocks_expand_to_gguf_pys_numbers_and_the_gemm_is_bit_identical(kind, n, k, isa_restored):
    raw, gtype = _tensor(kind, n, k, seed=n * k)
    want_w = torch.from_numpy(np.array(dequantize(raw, gtype), dtype=np.float32)).reshape(n, k)
    w = stored.pack(raw, gtype, n, k)
    assert w.packed.dtype == torch.uint8 and w.packed.shape == ((n + 15) // 16, k // 32, OPS.stored_group_bytes(w.fmt))
    assert torch.equal(w.expanded(), want_w)  # every weight: the de-quantiser's own float
    ids = torch.tensor([n - 1, 0, 5, n // 2, 5], dtype=torch.long)
    assert torch.equal(w.rows(ids), want_w[ids])  # the embedding lookup
    f32 = OPS.pack(want_w)
    g = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=g)
    for isa, rows_max in [(isa, lim) for isa in _isas() for lim in (UNLIMITED_ROWS, 0, 8)]:
        OPS.set_isa(isa)
        OPS.set_stored_rows(rows_max)  # every row count in register blocks, all through the chunk buffer, a mix
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 40):
            x = torch.randn(m, k, generator=g)
            case = (isa, rows_max, m)
            assert torch.equal(OPS.stored_linear(x, w.packed, w.fmt, None, n), OPS.linear(x, f32, None, n)), case
            assert torch.equal(OPS.stored_linear(x, w.packed, w.fmt, bias, n), OPS.linear(x, f32, bias, n)), case
            res = torch.randn(m, n, generator=g)
            assert torch.equal(OPS.stored_linear_add_(res.clone(), x, w.packed, w.fmt, bias),
                               OPS.linear_add_(res.clone(), x, f32, bias)), (isa, m)
            out = torch.full((m, n + 3), 7.0)
            OPS.stored_linear_into_(out[:, 1 : n + 1], x, w.packed, w.fmt, bias)  # a column slice (row stride n + 3)
            assert torch.equal(out[:, 1 : n + 1], OPS.linear(x, f32, bias, n))
            assert (out[:, 0] == 7.0).all() and (out[:, n + 1 :] == 7.0).all()  # nothing written outside it


@needs_ops
def test_a_row_permutation_reorders_the_stored_rows():
    """Llama's GGUF q/k rows are permuted back at load (transformers' LlamaTensorProcessor): ``row_order``."""
    raw, gtype = _tensor("Q4_1", 48, 64, seed=3)
    order = np.random.default_rng(0).permutation(48)
    want = torch.from_numpy(np.array(dequantize(raw, gtype), dtype=np.float32)).reshape(48, 64)[order]
    assert torch.equal(stored.pack(raw, gtype, 48, 64, row_order=order).expanded(), want)


@needs_ops
def test_fused_parts_run_as_one_call_and_mixed_formats_as_column_slices():
    """q/k/v (or gate/up) of one format, each a multiple of 16 rows, are joined into one weight whose parts are
    re-pointed at its panels (no second copy); other mixes run part by part into the output's columns. Both give
    the float32 fused weight's bits."""
    from racer_batch.engine.decoder_ops import FastLinear

    specs = [("Q4_1", 64), ("Q4_1", 32), ("Q4_1", 21)]
    parts = [stored.pack(*_tensor(kind, n, 96, seed=i), n, 96) for i, (kind, n) in enumerate(specs)]
    dense = torch.cat([p.expanded() for p in parts])
    lin = FastLinear.of_stored(parts, None)
    assert len(lin.stored) == 1 and lin.stored[0].n == 117
    base = lin.stored[0].packed.untyped_storage().data_ptr()
    assert all(p.packed.untyped_storage().data_ptr() == base for p in parts)
    assert stored.fuse_stored(parts).packed.data_ptr() == lin.stored[0].packed.data_ptr()  # a second runner reuses it
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    f32 = OPS.pack(dense)
    assert torch.equal(lin(x), OPS.linear(x, f32, None, 117))
    mixed = [stored.pack(*_tensor("Q8_0", 20, 96, seed=7), 20, 96), parts[2]]
    bias = torch.randn(41, generator=torch.Generator().manual_seed(2))
    lin2 = FastLinear.of_stored(mixed, bias)
    assert len(lin2.stored) == 2
    want = OPS.linear(x, OPS.pack(torch.cat([m.expanded() for m in mixed])), bias, 41)
    assert torch.equal(lin2(x), want)
    res = torch.randn(9, 41)
    packed = OPS.pack(torch.cat([m.expanded() for m in mixed]))
    assert torch.equal(lin2.stored_into(res.clone(), x, add=True), OPS.linear_add_(res.clone(), x, packed, bias))


@needs_ops
def test_bad_inputs_are_refused_with_the_reason():
    raw, gtype = _tensor("Q4_1", 16, 64, seed=1)
    w = stored.pack(raw, gtype, 16, 64)
    with pytest.raises(RuntimeError, match="x has K=32"):
        OPS.stored_linear(torch.zeros(2, 32), w.packed, w.fmt, None, 16)
    with pytest.raises(RuntimeError, match="group"):
        OPS.stored_linear(torch.zeros(2, 64), w.packed, stored.I8, None, 16)
    with pytest.raises(RuntimeError, match="N=17"):
        OPS.stored_linear(torch.zeros(2, 64), w.packed, w.fmt, None, 17)
    with pytest.raises(RuntimeError, match="out of range"):
        w.rows(torch.tensor([16]))
    with pytest.raises(ValueError, match="no stored format"):
        stored.pack(raw, int(Q.Q5_0), 16, 64)
    with pytest.raises(ValueError, match="bytes per row"):
        stored.pack(raw[:, :-2], gtype, 16, 64)
    assert not stored.can_store(gtype, (16, 48)) and stored.can_store(gtype, (16, 64))


def test_the_stored_rows_threshold_follows_the_faster_path_and_one_noisy_size_does_not_flip_it():
    from racer_batch.engine.kernels import pick_stored_rows

    # registers ahead up to 8 rows, the buffer from 12 (an Intel Xeon's shape)
    xeon = {1: (0.06, 0.18), 4: (0.11, 0.25), 8: (0.15, 0.16), 12: (0.38, 0.32), 32: (0.94, 0.67), 64: (1.9, 1.3)}
    assert pick_stored_rows(xeon) == 8
    # registers ahead everywhere (a Zen 4's shape): every row count, past the grid too
    assert pick_stored_rows({m: (m * 0.9, m * 1.0) for m in (1, 8, 64)}) == UNLIMITED_ROWS
    # the buffer ahead everywhere: none in registers
    assert pick_stored_rows({m: (m * 1.2, m * 1.0) for m in (1, 8, 64)}) == 0
    # one size where the buffer is barely ahead amid register wins does not split the range
    noisy = {1: (0.06, 0.18), 4: (0.10, 0.099), 8: (0.15, 0.25), 12: (0.4, 0.3), 64: (2.0, 1.3)}
    assert pick_stored_rows(noisy) == 8
    with pytest.raises(ValueError, match="no stored-GEMM timings"):
        pick_stored_rows({})


@needs_ops
def test_calibration_sets_the_threshold_once_per_process_and_the_environment_wins(monkeypatch, isa_restored):
    from racer_batch.engine import kernels
    from racer_batch.engine.decoder_ops import FastLinear

    lin = FastLinear.of_stored([stored.pack(*_tensor("Q8_0", 64, 96, seed=5), 64, 96)], None)
    monkeypatch.setattr(kernels, "_state", dict(kernels._state))  # this test's own once-per-process record
    kernels._state.pop("stored_rows", None)
    monkeypatch.delenv("RACER_STORED_ROWS", raising=False)
    chosen = kernels.calibrate_stored_rows(OPS, lin, rounds=1, reps=1)
    assert chosen == 0 or chosen == UNLIMITED_ROWS or chosen in kernels.STORED_ROWS_GRID
    assert OPS.set_stored_rows(chosen) == chosen  # it was set
    assert kernels.calibrate_stored_rows(OPS, lin) == chosen  # cached: not timed again
    kernels._state.pop("stored_rows")
    monkeypatch.setenv("RACER_STORED_ROWS", "3")
    assert kernels.calibrate_stored_rows(OPS, lin) == 3
