"""The one decoder function of the static runner (``decode``), the weights it runs on (``DecoderWeights``), the
one input shape it takes (``Rows``: a flat batch of rows over KV-cache slots) and the two op sets it runs with:
our CPU kernels (``KernelOps``, ``torch.ops.racer``) or torch ops (``TorchOps``: oneDNN / cuBLAS matmuls, aten
norms, SDPA); plus the additive tree-attention mask of a flat batch (``fill_tree_mask``).

Every forward of the static runner is ``decode``: a prompt chunk of one stream (``Rows.prefill``, causal), the
segments of several streams' draft trees on our kernels (``Rows`` from ``seg``, unpadded), and the padded
``[B, N]`` batch on torch ops, eager or captured as a CUDA graph (engine/graphs.py captures this same function).
The layer is the Llama family's: RMSNorm, fused q/k/v, rotary positions (Qwen3: per-head q/k RMSNorm first),
the KV write into each row's slot, grouped-query attention over the slot, o projection added to the residual,
RMSNorm, fused gate/up, SiLU x up, down projection added to the residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .decoder_ops import FastLinear, LayerWeights, fuse_params, rms_norm, rotate_half_rope, tree_attention

SDPA_MIN_ROWS = 128  # fewer query rows per stream: our own attention (SDPA's CPU kernels cost ~0.2-8 ms at T=1)


@dataclass
class DecoderWeights:
    """The decoder's weights over the HF model's own tensors (q/k/v and gate/up fused without a copy), its
    shape, and the rotary tables ``cos, sin [positions, 1, head_dim]`` (from the model's own ``rotary_emb``,
    so every rope scaling that does not depend on the sequence length is exact)."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: FastLinear
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    context_length: int
    rotary: Any
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @staticmethod
    def of(model: Any, *, matmul: str, context_length: int) -> "DecoderWeights":
        """The weights of a Llama-family HF ``model`` with every matmul on ``matmul`` (``FastLinear`` path)."""
        cfg = model.config
        dec = model.get_decoder()
        n_heads = int(cfg.num_attention_heads)
        layers = [_layer_weights(layer, matmul) for layer in dec.layers]
        head = model.get_output_embeddings()
        return DecoderWeights(
            embed=dec.embed_tokens.weight.detach(), layers=layers, final_norm=dec.norm.weight.detach(),
            lm_head=FastLinear(head.weight, getattr(head, "bias", None), path=matmul), n_heads=n_heads,
            n_kv=int(getattr(cfg, "num_key_value_heads", None) or n_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads), eps=float(cfg.rms_norm_eps),
            context_length=int(context_length), rotary=dec.rotary_emb, cos=torch.empty(0), sin=torch.empty(0))

    @torch.inference_mode()
    def cover(self, positions: int) -> None:
        """Make the rotary tables hold ``positions`` rows (positions past the context take the last one's)."""
        if self.cos.shape[0] >= positions:
            return
        dtype, device = self.embed.dtype, self.embed.device
        pos = torch.arange(positions, device=device).clamp_(max=self.context_length - 1).view(1, -1)
        cos, sin = self.rotary(torch.zeros(1, dtype=dtype, device=device), pos)  # [1, positions, D]
        self.cos = cos[0].to(dtype).unsqueeze(1).contiguous()  # [positions, 1, D]
        self.sin = sin[0].to(dtype).unsqueeze(1).contiguous()

    def linears(self) -> list[FastLinear]:
        per_layer = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return per_layer + [self.lm_head]


def _layer_weights(layer: Any, matmul: str) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    qkv_w = fuse_params([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    qkv_b = fuse_params([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
    gu_w = fuse_params([m.gate_proj.weight, m.up_proj.weight])
    gu_b = fuse_params([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return LayerWeights(
        qkv=FastLinear(qkv_w, qkv_b, path=matmul), o=FastLinear(a.o_proj.weight, a.o_proj.bias, path=matmul),
        gate_up=FastLinear(gu_w, gu_b, path=matmul),
        down=FastLinear(m.down_proj.weight, m.down_proj.bias, path=matmul),
        ln_in=layer.input_layernorm.weight.detach(), ln_post=layer.post_attention_layernorm.weight.detach(),
        q_norm=q_norm.weight.detach() if q_norm is not None else None,
        k_norm=k_norm.weight.detach() if k_norm is not None else None,
    )


@dataclass
class Rows:
    """The one input shape of ``decode``: ``R`` rows of ``B`` streams, each stream's rows consecutive and over
    its own KV-cache slot.

    Attributes:
        ids, pos: ``[R]`` token ids and positions (on the model's device).
        seg: ``[B, 3]`` int64 on the CPU per stream: slot, start (its committed length: its rows' keys/values go
            to ``start, start + 1, ...`` of the slot), first row (our kernels' segments).
        mask: the additive attention mask, each row over its own stream's slot: ``[R, S]`` on our kernels,
            ``[B, 1, N, S]`` on torch ops; None for a causal prompt chunk (one stream: ``Rows.prefill``).
        span: KV positions ``[0, span)`` the rows attend over (torch ops).
        write: torch ops: ``[B, N]`` KV positions of each row, the streams in slots ``[slot0, slot0 + B)``, ``N``
            rows each (the padded layout); None on our kernels.
        slot0, start0: the first stream's slot and start (a prompt chunk's).
        attend, causal_mask, bidx: set by the ops' ``prepare`` once per forward (how a prompt chunk attends
            and its mask; the stream index of the padded layout).
    """

    ids: torch.Tensor
    pos: torch.Tensor
    seg: torch.Tensor
    mask: Optional[torch.Tensor]
    span: int
    write: Optional[torch.Tensor] = None
    slot0: int = 0
    start0: int = 0
    attend: str = ""
    causal_mask: Optional[torch.Tensor] = None
    bidx: Optional[torch.Tensor] = None

    @staticmethod
    def prefill(ids: torch.Tensor, slot: int, start: int) -> "Rows":
        """A prompt chunk of one stream at positions ``[start, start + T)`` of ``slot``, causal (the prefix
        before it visible)."""
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=ids.device)
        return Rows(ids=ids, pos=pos, seg=torch.tensor([[slot, start, 0]], dtype=torch.long), mask=None,
                    span=start + t, write=pos.view(1, t), slot0=slot, start0=start)


def prefill_mask(t: int, start: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Additive mask ``[t, start + t]`` of a prompt chunk at ``start``: the prefix and the chunk's own causal
    part visible (0), the rest the dtype's minimum."""
    seen = torch.ones(t, start + t, dtype=torch.bool, device=device).tril_(diagonal=start)
    return torch.zeros(t, start + t, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)


def decode(w: DecoderWeights, kv: torch.Tensor, rows: Rows, ops: Any) -> torch.Tensor:
    """Hidden states ``[R, H]`` (after the final norm) of ``rows``, writing their keys/values into ``kv [layers,
    2, slots, kv_heads, max_len, head_dim]``: the one decoder function, on ``ops`` (``KernelOps`` or
    ``TorchOps``)."""
    ops.prepare(rows, w)
    x = F.embedding(rows.ids, w.embed)  # [R, H], a fresh tensor (the residual is updated in place)
    cos, sin = w.cos[rows.pos], w.sin[rows.pos]  # [R, 1, D]
    for li, layer in enumerate(w.layers):
        h = ops.rms_norm(x, layer.ln_in, w.eps)
        q = ops.rope_kv(ops.linear(h, layer.qkv), cos, sin, kv[li], layer, rows, w)  # [R, nq, d]
        x = ops.linear_add(x, ops.attention(q, kv[li], rows, w), layer.o)
        h = ops.rms_norm(x, layer.ln_post, w.eps)
        x = ops.linear_add(x, ops.silu_mul(ops.linear(h, layer.gate_up)), layer.down)
    return ops.rms_norm(x, w.final_norm, w.eps)


class KernelOps:
    """``decode`` on our CPU kernels (``torch.ops.racer``, float32): nine calls per layer, the residual updated
    in place. The output layer writes into one reused buffer (``head``)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self._logits = torch.empty(0)

    def prepare(self, rows: Rows, w: DecoderWeights) -> None:
        """A prompt chunk (causal) takes our causal kernel where it runs (AVX-512: no key past a row's own
        position is scored), else SDPA's causal kernel for long chunks, else our masked attention."""
        if rows.mask is not None:
            rows.attend = "segments"
            return
        t = rows.ids.shape[0]
        if t > 1 and bool(self.ops.has_causal(w.head_dim)):
            rows.attend = "causal"
        elif t >= SDPA_MIN_ROWS:
            rows.attend = "sdpa"
        else:
            rows.attend = "masked"
        if t > 1 and rows.attend != "causal" and not (rows.attend == "sdpa" and rows.start0 == 0):
            rows.causal_mask = prefill_mask(t, rows.start0, w.embed.dtype, rows.ids.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return self.ops.linear(x, lin._panels, lin.bias, lin.weight.shape[0])

    def linear_add(self, x: torch.Tensor, y: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return self.ops.linear_add_(x, y, lin._panels, lin.bias)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gu)

    def rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                layer: LayerWeights, rows: Rows, w: DecoderWeights) -> torch.Tensor:
        return self.ops.rope_kv_seg_(qkv, cos, sin, kv[0], kv[1], rows.seg, w.n_heads, layer.q_norm, layer.k_norm,
                                     w.eps)

    def attention(self, q: torch.Tensor, kv: torch.Tensor, rows: Rows, w: DecoderWeights) -> torch.Tensor:
        if rows.attend == "segments":
            return self.ops.attention_seg(q, kv[0], kv[1], rows.seg, rows.mask, w.scale)  # [R, nq * d]
        keys, vals = kv[0, rows.slot0], kv[1, rows.slot0]  # [nkv, max_len, d]: a prompt chunk of one stream
        if rows.attend == "causal":
            return self.ops.attention_causal(q, keys, vals, rows.start0, w.scale)
        if rows.attend == "sdpa":
            return _sdpa(q.unsqueeze(0), keys[:, : rows.span].unsqueeze(0), vals[:, : rows.span].unsqueeze(0),
                         rows.causal_mask, w, causal=rows.causal_mask is None)[0]
        return self.ops.attention(q, keys, vals, rows.span, rows.causal_mask, w.scale)

    def head(self, hidden: torch.Tensor, w: DecoderWeights) -> torch.Tensor:
        """Logits ``[R, V]`` written into one reused buffer (valid until the next call), so a step allocates no
        multi-MB tensor (glibc would map and unmap it every step and its heap would drift by as much)."""
        r = hidden.shape[0]
        if self._logits.shape[0] < r:
            self._logits = torch.empty((max(r, 64), w.lm_head.weight.shape[0]), dtype=hidden.dtype)
        return self.ops.linear_into_(self._logits[:r], hidden, w.lm_head._panels, w.lm_head.bias)


class TorchOps:
    """``decode`` on torch ops (oneDNN / MKL / cuBLAS matmuls through ``FastLinear``, aten norms and rotary,
    SDPA or our matmul attention), over the padded layout: ``B`` streams of ``N`` rows in slots
    ``[slot0, slot0 + B)`` (``Rows.write``). Nothing depends on a value read back from the device, so the same
    calls replay as a CUDA graph."""

    def prepare(self, rows: Rows, w: DecoderWeights) -> None:
        b, n = rows.write.shape
        rows.bidx = torch.arange(b, device=rows.ids.device).view(b, 1)
        if rows.mask is not None:
            rows.attend = "masked"
        elif n > 1 and rows.start0 == 0:
            rows.attend = "causal"
        else:  # one row sees the whole prefix; a prompt chunk after a prefix: causal over the chunk
            rows.attend = "masked"
            if n > 1:
                rows.causal_mask = prefill_mask(n, rows.start0, w.embed.dtype, rows.ids.device).view(1, 1, n, rows.span)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return lin(x)

    def linear_add(self, x: torch.Tensor, y: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return x + lin(y)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    def rope_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                layer: LayerWeights, rows: Rows, w: DecoderWeights) -> torch.Tensor:
        """Rotate q and k (Qwen3: per-head RMSNorm first), write k and v at each row's ``write`` position of its
        stream's slot; returns q ``[R, nq, d]``."""
        nq, nkv, d = w.n_heads, w.n_kv, w.head_dim
        t = qkv.shape[0]
        x = qkv.view(t, nq + 2 * nkv, d)
        if layer.q_norm is None:
            qk = rotate_half_rope(x[:, : nq + nkv], cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        else:
            q = rotate_half_rope(rms_norm(x[:, :nq], layer.q_norm, w.eps), cos, sin)
            k = rotate_half_rope(rms_norm(x[:, nq : nq + nkv], layer.k_norm, w.eps), cos, sin)
        b, n = rows.write.shape
        slots = slice(rows.slot0, rows.slot0 + b)
        kv[0, slots].transpose(1, 2)[rows.bidx, rows.write] = k.view(b, n, nkv, d)  # into each stream's slot
        kv[1, slots].transpose(1, 2)[rows.bidx, rows.write] = x[:, nq + nkv :].view(b, n, nkv, d)
        return q

    def attention(self, q: torch.Tensor, kv: torch.Tensor, rows: Rows, w: DecoderWeights) -> torch.Tensor:
        """Each stream's ``N`` rows over ``[0, span)`` of its slot with its mask block (a prompt chunk: causal);
        SDPA on CUDA and for many rows, else two batched matmuls and a softmax (SDPA's CPU kernels are slow at
        a few rows)."""
        b, n = rows.write.shape
        slots = slice(rows.slot0, rows.slot0 + b)
        keys, vals = kv[0, slots, :, : rows.span], kv[1, slots, :, : rows.span]  # [B, nkv, S, d]
        q4 = q.view(b, n, w.n_heads, w.head_dim)
        mask = rows.mask if rows.mask is not None else rows.causal_mask
        causal = rows.attend == "causal"
        if causal or q.is_cuda or n >= SDPA_MIN_ROWS:
            att = _sdpa(q4, keys, vals, mask, w, causal=causal)  # [B, N, nq * d]
        else:
            att = tree_attention(q4, keys, vals, mask, w.scale)  # [B, N, nq, d]
        return att.reshape(b * n, w.n_heads * w.head_dim)

    def head(self, hidden: torch.Tensor, w: DecoderWeights) -> torch.Tensor:
        return w.lm_head(hidden)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: Optional[torch.Tensor],
          w: DecoderWeights, causal: bool = False) -> torch.Tensor:
    """SDPA of ``q [B, N, nq, d]`` over ``keys, vals [B, nkv, S, d]`` (``mask`` broadcast to ``[B, 1, N, S]``, or
    causal); returns ``[B, N, nq * d]``."""
    b, n = q.shape[0], q.shape[1]
    att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask, is_causal=causal,
                                         scale=w.scale, enable_gqa=w.n_kv != w.n_heads)  # [B, nq, N, d]
    return att.transpose(1, 2).reshape(b, n, w.n_heads * w.head_dim)




def fill_tree_mask(mask: torch.Tensor, cu: np.ndarray, parents: np.ndarray, starts: np.ndarray,
                   neg: float) -> torch.Tensor:
    """Write the additive attention mask of a flat batch into ``mask [R, S]`` (every element) and return it.

    Row ``r`` of stream ``b`` (rows ``cu[b] : cu[b + 1]``) sees, in its stream's KV-cache slot, the committed
    prefix ``[0, starts[b])`` and its tree ancestors and itself: column ``starts[b] + j`` for each ancestor-or-
    self ``j`` (an index local to the stream's tree, from the local ``parents``, -1 at a root; a parent comes
    before its child). Visible columns get 0, every other column ``neg``.

    Vectorised: one pass per tree level (each row walks up to its root together with every other row).
    """
    cu = np.asarray(cu, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int64)
    sizes = np.diff(cu)
    r, s = mask.shape
    first = np.repeat(cu[:-1], sizes)  # [R] first row of each row's stream
    start = np.repeat(np.asarray(starts, dtype=np.int64), sizes)  # [R] its stream's committed length
    up = np.where(parents >= 0, parents + first, -1)  # [R] parent as a flat row index
    rows = np.arange(r, dtype=np.int64)
    node = rows
    hit_rows, hit_cols = [], []
    for _ in range(int(sizes.max(initial=0))):  # a walk up is at most one tree's size long
        if rows.size == 0:
            break
        hit_rows.append(rows)
        hit_cols.append(start[rows] + node - first[rows])
        node = up[node]
        alive = node >= 0
        rows, node = rows[alive], node[alive]
    mask.fill_(neg)
    cols = torch.arange(s, device=mask.device).unsqueeze(0)
    mask.masked_fill_(cols < torch.from_numpy(start).to(mask.device).unsqueeze(1), 0.0)  # committed prefix
    if hit_rows:
        rr = torch.from_numpy(np.concatenate(hit_rows)).to(mask.device)
        cc = torch.from_numpy(np.concatenate(hit_cols)).to(mask.device)
        mask[rr, cc] = 0.0
    return mask


def tree_mask_filler() -> Callable[..., Any]:
    """The function that fills a flat batch's mask: ``racer_batch.drafters.native.fill_tree_mask`` where that
    module provides one (same signature and contract as :func:`fill_tree_mask`; tests/engine/test_flat_verify.py
    checks the two agree), else :func:`fill_tree_mask`."""
    from ..drafters import native

    return native.fill_tree_mask if native.available() else fill_tree_mask
