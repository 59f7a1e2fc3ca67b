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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        if self._panels is not None:
            return self._ops.linear(x, self._panels, self.bias, self.weight.shape[0])
        if self.path == "torch" or (x.shape[0] <= SMALL_ROWS and self._small_plain):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")


@dataclass
class LayerWeights:
    qkv: FastLinear  # [T, H] -> [T, (heads + 2 kv_heads) * head_dim]
    o: FastLinear
    gate_up: FastLinear  # [T, H] -> [T, 2 * intermediate]
    down: FastLinear
    ln_in: torch.Tensor  # [H]
    ln_post: torch.Tensor  # [H]
    q_norm: Optional[torch.Tensor]  # [head_dim] (Qwen3) or None
    k_norm: Optional[torch.Tensor]


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
    """RMSNorm as the Llama family computes it: in float32, scaled by ``weight`` in the input dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel, same arithmetic
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [T, heads, D]`` with ``cos, sin [T, 1, D]`` (halves layout, as HF's rotate_half)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
