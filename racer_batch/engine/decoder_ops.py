"""The pieces the decoder (engine/decoder.py) is built from, over the HF model's own weights: the matmul paths
(``FastLinear``: our small-row GEMM, oneDNN packed weights, or plain ``F.linear``), one decoder layer's weights
(``LayerWeights``), q/k/v and gate/up fused into one matmul each without a copy (``fuse_params``), and the
plain-tensor ops of its torch-ops path (RMSNorm, the rotary embedding, grouped-query tree attention). On our
CPU kernels the decoder calls ``engine/kernels`` for the latter instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .kernels import cpu_ops

log = logging.getLogger(__name__)

MATMUL_PATHS = ("auto", "torch", "small_gemm", "onednn_packed")
SMALL_ROWS = 2  # row counts up to this use plain sgemm: prepacking does not pay for one or two rows


def default_matmul_path(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The matmul path ``auto`` picks: plain ``torch`` (cuBLAS) on CUDA. On the CPU in float32 our own
    small-row GEMM (``small_gemm``, engine/kernels) where it builds: 1.3-2x faster than oneDNN prepacked and
    1.6-3x faster than MKL at the 1-32 rows of a verify forward on the CPUs measured (benchmarks/README.md).
    Otherwise oneDNN prepacked weights when this torch has oneDNN (one extra copy of the weights, any row
    count and dtype), else plain sgemm. ``RACER_MATMUL`` overrides the choice (benchmarks)."""
    env = os.environ.get("RACER_MATMUL")
    if env:
        if env not in MATMUL_PATHS[1:]:
            raise ValueError(f"RACER_MATMUL={env!r} is not one of {MATMUL_PATHS[1:]}")
        return env
    if device.type != "cpu":
        return "torch"
    if dtype == torch.float32 and cpu_ops() is not None:
        return "small_gemm"
    if torch.backends.mkldnn.is_available():
        return "onednn_packed"
    return "torch"


class FastLinear:
    """``y = x @ W.T + b`` with the fastest matmul this torch offers for the row count.

    Args:
        weight: ``[N, K]`` (N output features); kept as given for small row counts and as the oracle.
        bias: ``[N]`` or None.
        path: ``torch`` (F.linear: MKL sgemm on the CPU, cuBLAS on CUDA), ``small_gemm`` (our kernel over
            one copy packed in 16-column panels, every row count; float32 on a CPU with AVX2/FMA) or
            ``onednn_packed`` (one oneDNN prepacked copy, any row count; up to ``SMALL_ROWS`` rows in float32
            take plain sgemm, a GEMV, where its packing does not pay). A path that cannot run the weight
            (dtype, no kernel) falls back to ``onednn_packed`` or ``torch``.
    """

    stored: Optional[list] = None  # path "stored": the weight's parts (weights/stored.py), see ``of_stored``

    @classmethod
    def of_stored(cls, parts: list, bias: Optional[torch.Tensor]) -> "FastLinear":
        """A linear over weights kept as a GGUF file stores them (weights/stored.py ``StoredWeight``, each
        ``[n_i, K]``), concatenated along the output features (fused q/k/v or gate/up): one kernel call where
        ``fuse_stored`` can join them, else one per part into its columns of the output. Path ``stored``; our CPU
        kernels only (float32 in and out), bit for bit the ``small_gemm`` path over the de-quantised weights.

        Raises:
            RuntimeError: our CPU kernels do not run here.
        """
        from ..weights.stored import fuse_stored

        self = cls.__new__(cls)
        self._ops = cpu_ops()
        if self._ops is None:
            raise RuntimeError("stored weights need our CPU kernels (engine/kernels), which do not run here")
        fused = fuse_stored(parts)
        self.stored = [fused] if fused is not None else list(parts)
        self.weight = torch.empty((sum(p.n for p in parts), parts[0].k), device="meta")  # the shape only
        self.bias = None if bias is None else bias.detach().contiguous()
        self.path = "stored"
        self._onednn = self._panels = None
        self._small_plain = False
        cols, start = [], 0
        for part in self.stored:
            cols.append((start, start + part.n))
            start += part.n
        self._cols = cols
        return self

    def stored_into(self, out: torch.Tensor, x: torch.Tensor, *, add: bool) -> torch.Tensor:
        """``out = x @ W.T + b`` (``add``: ``out +=`` that) over the stored parts; ``out [M, N]`` float32 with
        unit column stride. Returns ``out``."""
        op = self._ops.stored_linear_add_ if add else self._ops.stored_linear_into_
        if len(self.stored) == 1:
            return op(out, x, self.stored[0].packed, self.stored[0].fmt, self.bias)
        for part, (c0, c1) in zip(self.stored, self._cols):
            op(out[:, c0:c1], x, part.packed, part.fmt, None if self.bias is None else self.bias[c0:c1])
        return out

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, path: str) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self._ops = None
        if path == "small_gemm":
            self._ops = cpu_ops() if self.weight.dtype == torch.float32 and self.weight.is_cpu else None
        if path == "small_gemm" and self._ops is None:
            path = "onednn_packed" if torch.backends.mkldnn.is_available() else "torch"
        self.path = path
        self._onednn: Optional[torch.Tensor] = None
        self._panels: Optional[torch.Tensor] = None  # small_gemm: [ceil(N/16), K, 16]
        if path == "small_gemm":
            self._panels = self._ops.pack(self.weight)
        if path == "onednn_packed":
            try:
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
            except RuntimeError as exc:  # e.g. bfloat16 on an AVX2-only CPU: oneDNN needs AVX-512 or AVX-NE-CONVERT
                log.info("oneDNN cannot prepack a %s weight here (%s); plain F.linear", self.weight.dtype,
                         str(exc).splitlines()[0])
                path = self.path = "torch"
        # reduced precision has no fast plain GEMV on the CPU: oneDNN takes every row count there
        self._small_plain = self.weight.dtype == torch.float32 or path != "onednn_packed"

    @property
    def extra_bytes(self) -> int:
        """Bytes held in packed copies beside the plain weight."""
        n = 0
        if self._onednn is not None:
            n += self.weight.numel() * self.weight.element_size()
        if self._panels is not None:
            n += self._panels.numel() * self._panels.element_size()
        return n

    @property
    def n(self) -> int:
        """Output features."""
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        if self.stored is not None:
            return self.stored_into(torch.empty((x.shape[0], self.n), dtype=x.dtype), x, add=False)
        if self._panels is not None:
            return self._ops.linear(x, self._panels, self.bias, self.weight.shape[0])
        if self.path == "torch" or (x.shape[0] <= SMALL_ROWS and self._small_plain):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")


@dataclass
class MoEWeights:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router ``[E, H]`` picks ``top_k`` experts per row
    from the softmax of its logits (renormalised over the picked ones where ``normalise``); each expert is a gated
    MLP ``down(act(gate) * up)`` with gate/up fused, its output scaled by the row's weight for it."""

    router: torch.Tensor  # [E, H]
    gate_up: list[FastLinear]  # per expert: [T, H] -> [T, 2 * moe_intermediate]
    down: list[FastLinear]  # per expert: [T, moe_intermediate] -> [T, H]
    top_k: int
    normalise: bool

    def linears(self) -> list[FastLinear]:
        return [*self.gate_up, *self.down]


@dataclass
class LayerWeights:
    """One decoder layer. Llama family: ``x += o(attn(rope(qkv(norm_in(x)))))``, ``x += down(act(gate) * up)``
    of ``norm_post(x)``. Gemma 2/3 add ``post_attn_norm`` / ``post_ffn_norm`` on each branch's output before its
    residual add (``ln_post`` is then Gemma's ``pre_feedforward_layernorm``). A MoE layer has ``moe`` in place of
    ``gate_up`` / ``down``. Norm weights are as the decoder multiplies them (Gemma's ``1 + w`` precomputed in
    float32)."""

    qkv: FastLinear  # [T, H] -> [T, (heads + 2 kv_heads) * head_dim]
    o: FastLinear
    gate_up: Optional[FastLinear]  # [T, H] -> [T, 2 * intermediate]; None on a MoE layer
    down: Optional[FastLinear]
    ln_in: torch.Tensor  # [H]
    ln_post: torch.Tensor  # [H]
    q_norm: Optional[torch.Tensor]  # [head_dim] (Qwen3, Gemma 3) or None
    k_norm: Optional[torch.Tensor]
    post_attn_norm: Optional[torch.Tensor] = None  # [H] (Gemma)
    post_ffn_norm: Optional[torch.Tensor] = None  # [H] (Gemma)
    moe: Optional[MoEWeights] = None
    window: Optional[int] = None  # a sliding-window layer: a query at position q sees keys at positions > q - window
    rope: int = 0  # which of the decoder's rotary tables (Gemma 3: one per layer kind)

    def linears(self) -> list[FastLinear]:
        dense = [lin for lin in (self.gate_up, self.down) if lin is not None]
        return [self.qkv, self.o, *dense, *(self.moe.linears() if self.moe is not None else [])]


ACTIVATIONS = ("silu", "gelu_tanh")


def act_mul(gu: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused ``gu [T, 2I]`` (gate first), on torch ops: SiLU (Llama family) or the tanh
    GELU (Gemma's ``gelu_pytorch_tanh``)."""
    inter = gu.shape[-1] // 2
    gate = gu[:, :inter]
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * gu[:, inter:]


def moe_forward(h: torch.Tensor, moe: MoEWeights, linear, act: str, *, dense: bool = False) -> torch.Tensor:
    """The MoE MLP's output ``[T, H]`` of ``h [T, H]`` (without the residual), as transformers' Qwen3-MoE and
    Mixtral blocks compute it: router logits, softmax in float32, top-k (renormalised where ``moe.normalise``),
    then each picked expert over its rows, scaled by the row's weight and added in ascending expert order.

    ``linear(x, FastLinear)`` runs the matmuls (our kernels or torch). ``dense``: every expert over every row with
    the weight 0 where it was not picked (no data-dependent shapes, so a CUDA graph can capture it; the added
    zeros leave each sum exact); otherwise only the picked rows per expert (one host read of the picked ids)."""
    logits = F.linear(h, moe.router)  # [T, E]
    top_v, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), moe.top_k, dim=-1)  # [T, k]
    if moe.normalise:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    top_v = top_v.to(h.dtype)
    out = torch.zeros_like(h)
    if dense:
        for e in range(len(moe.gate_up)):
            weight = (top_v * (top_i == e)).sum(dim=-1, keepdim=True)  # [T, 1]: the one picked weight, or 0
            out += linear(act_mul(linear(h, moe.gate_up[e]), act), moe.down[e]) * weight
        return out
    for e in torch.unique(top_i).tolist():  # ascending
        rows, slot = torch.where(top_i == e)
        y = linear(act_mul(linear(h.index_select(0, rows), moe.gate_up[e]), act), moe.down[e])
        out.index_add_(0, rows, y * top_v[rows, slot].unsqueeze(1))
    return out


@torch.no_grad()
def fuse_params(params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate parameters ``[n_i, K]`` along dim 0 and re-point each at its rows of the result, so the
    fused weight (one matmul for q/k/v, one for gate/up) costs no memory beside the model's own weights, and
    the transformers forward (the oracle, the eager runner) keeps running on the very same numbers. Params
    that are already consecutive rows of one storage (a second runner over the same model) are reused."""
    first = params[0]
    offset = first.storage_offset()
    consecutive = all(p.is_contiguous() for p in params)
    for p in params:
        consecutive = consecutive and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() \
            and p.storage_offset() == offset
        offset += p.numel()
    total = sum(p.shape[0] for p in params)
    if consecutive:
        return first.detach().as_strided((total, *first.shape[1:]), first.stride())
    fused = torch.cat([p.detach() for p in params], dim=0).contiguous()
    row = 0
    for p in params:
        p.data = fused[row : row + p.shape[0]]
        row += p.shape[0]
    return fused


def tree_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: Optional[torch.Tensor],
                   scale: float) -> torch.Tensor:
    """Grouped-query attention of a few query rows per stream: ``q [B, T, nq, d]`` over ``keys, vals
    [B, nkv, S, d]`` with the additive ``mask`` (broadcast to ``[B, 1, T, S]``; None: all visible); returns
    ``[B, T, nq, d]``.

    The ``nq / nkv`` query heads that share a KV head are folded into the row dimension (query head
    ``j * rep + r`` reads KV head ``j``, as transformers' ``repeat_kv`` lays them out), so no KV is repeated;
    written out as two batched matmuls and a softmax because the fused CPU kernels are slow for few rows.
    """
    b, t, nq, d = q.shape
    nkv, s = keys.shape[1], keys.shape[2]
    rep = nq // nkv
    qf = q.transpose(1, 2).reshape(b, nkv, rep * t, d)  # [B, nkv, rep*T, d]
    scores = torch.matmul(qf, keys.transpose(2, 3)).mul_(scale).view(b, nkv, rep, t, s)  # [B, nkv, rep, T, S]
    if mask is not None:
        scores.add_(mask.reshape(mask.shape[0], 1, 1, t, s))
    probs = torch.softmax(scores, dim=-1).view(b, nkv, rep * t, s)
    return torch.matmul(probs, vals).view(b, nq, t, d).transpose(1, 2)  # [B, T, nq, d]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it: in float32, scaled by ``weight`` in the input dtype. A float32
    ``weight`` over a reduced-precision ``x`` is Gemma's order instead (scaled in float32, then cast)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel, same arithmetic
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [T, heads, D]`` with ``cos, sin [T, 1, D]`` (halves layout, as HF's rotate_half)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
