"""The static verify path: our own lean decoder over the HF weights, a preallocated KV cache with a slot
dimension, draft trees padded to a few fixed sizes, and (optionally) a compiled or CUDA-graph step per size.

Why our own decoder: the stock transformers forward re-concatenates a ``DynamicCache`` every step, runs
separate q/k/v and gate/up matmuls through plain MKL sgemm and pays Python dispatch for every module; on a
small model that overhead is larger than the arithmetic (measurements: docs/architecture.md, "Verify
runner"). The decoder here is the Llama family's computation written out once (RMSNorm, rotary positions,
grouped-query attention, SwiGLU MLP), which covers Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and SmolLM checkpoints. The rotary tables come from the HF model's own ``rotary_emb`` module, so
every rope scaling that does not depend on the sequence length (default, linear, llama3, yarn) is exact.
``describe_unsupported`` names what this decoder cannot run; the engine then falls back to the eager
``ModelRunner`` (``decoding.runner: auto``). The transformers forward stays the test oracle
(tests/engine/test_static_runner.py).

KV cache layout: one tensor ``kv`` of shape ``[layers, 2, slots, kv_heads, max_len, head_dim]`` (2 = keys,
values). A row owns one slot; its committed prefix lives in positions ``[0, L)``; a verify writes the tree's
keys/values at ``[L, L + T_pad)`` and ``keep_rows`` moves the accepted path's rows down to ``[L, L + n)``
in place, one copy per moved node across all layers at once. Nothing is allocated per step on this path
except the small activations of the forward itself.

Fixed shapes: a tree of T nodes is padded to the smallest bucket >= T (``DEFAULT_BUCKETS``). Padding
nodes attend only to themselves, no real node attends to them, and their logits are dropped, so they can
never be accepted. Padding is what makes MKL's packed weights per bucket and a compiled step per bucket
possible on the CPU, and one CUDA graph per bucket on CUDA. Our own CPU kernels (``engine/kernels``, the
float32 CPU default: GEMM, RMSNorm, rope + KV write, tree attention, SiLU) take any row count, so on that
path trees are verified unpadded (``_forward_kernels``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.base import Draft
from ..models import ModelBundle
from .decoder_ops import (MATMUL_PATHS, FastLinear, LayerWeights, default_matmul_path, fuse_params,
                          rms_norm, rotate_half_rope, tree_attention)
from .kernels import fused_argmax_topk
from .tree import flatten_tree

log = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
INITIAL_POSITIONS = 2048  # KV positions per slot allocated at start (grows on demand up to the context)
PREFILL_CHUNK = 512  # prompt tokens per prefill forward (bounds the [chunk, S] attention scores)
PREFILL_TOPK_CHUNK = 256  # prompt positions per output-layer chunk at prefill
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SDPA_MIN_ROWS = 128  # fewer query rows: our own attention (SDPA's CPU kernels cost ~0.2-8 ms at T=1)
STREAM_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # padded stream counts of the batched static step
MAX_SLOTS = 256  # KV-cache slots one runner holds at most (streams in flight)


def describe_unsupported(model: Any) -> Optional[str]:
    """Why the lean decoder cannot run ``model`` exactly, or None when it can.

    Checks the module structure (a Llama-style decoder: ``model.layers[i].self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, RMSNorms, SiLU), the rope type and the sliding window.
    """
    cfg = model.config
    if getattr(cfg, "model_type", None) not in ("llama", "qwen2", "qwen3", "mistral"):
        return f"architecture {getattr(cfg, 'model_type', None)!r} has no static decoder"
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act {act!r} is not SiLU"
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and int(window) < int(cfg.max_position_embeddings):
        return f"sliding-window attention ({window} < context {cfg.max_position_embeddings})"
    try:
        dec = model.get_decoder()
        layer = dec.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight, dec.norm.weight
        dec.rotary_emb
    except AttributeError as exc:
        return f"module layout differs from the Llama family ({exc})"
    return None


def pick_bucket(t: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= ``t``; ``t`` itself past the largest bucket.

    >>> pick_bucket(5, (1, 2, 4, 8)), pick_bucket(8, (1, 2, 4, 8)), pick_bucket(9, (1, 2, 4, 8))
    (8, 8, 9)
    """
    for b in buckets:
        if b >= t:
            return b
    return t


class SlotCache:
    """A row's handle on one slot of the static KV cache: ``length`` committed rows in ``[0, length)``."""

    def __init__(self, runner: "StaticRunner", slot: int) -> None:
        self.runner = runner
        self.slot = slot
        self.length = 0
        self.released = False

    def release(self) -> None:
        """Give the slot back (idempotent: a second call does nothing)."""
        if not self.released:
            self.released = True
            self.runner._free_slots.append(self.slot)
            self.runner._live.pop(self.slot, None)


class StaticRunner:
    """Runs the target model with a static KV cache and fixed verify shapes: one stream per slot, one or
    several streams per forward (`verify_batch`).

    The same calls as the eager ``ModelRunner`` (``new_cache``, ``prefill``, ``verify_tree``,
    ``keep_rows``), so the engine's step loop does not know which one runs.

    Args:
        bundle: the loaded target model (a Llama-family checkpoint; see ``describe_unsupported``).
        slots: streams the KV cache holds at start (more are added on demand: `reserve_slots`, `new_cache`).
        max_slots: the most slots ``new_cache`` grows to (a leak of rows that never release theirs stops
            there with an error instead of taking memory without bound).
        max_len: KV positions per slot at start (at least one bucket + 1; 0: the context or
            ``INITIAL_POSITIONS``, whichever is smaller, plus one bucket of tree padding); grows on demand up to the context (growing drops the
            captured CUDA graphs, which are captured again lazily, and recompiles a compiled CPU step).
        buckets: the padded tree sizes.
        matmul: ``auto`` | ``torch`` | ``small_gemm`` | ``mkl_packed`` | ``onednn_packed``
            (``default_matmul_path``).
        compile: compile the verify step per bucket: CUDA graphs on CUDA, ``torch.compile`` on the CPU.

    Raises:
        ValueError: the model is not one the lean decoder can run (``describe_unsupported``), or a bad setting.
    """

    kind = "static"

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        slots: int = 1,
        max_slots: int = MAX_SLOTS,
        max_len: int = 0,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        matmul: str = "auto",
        compile: bool = False,
    ) -> None:
        why = describe_unsupported(bundle.model)
        if why is not None:
            raise ValueError(f"static runner cannot run {bundle.name}: {why}; use decoding.runner 'eager'")
        if matmul not in MATMUL_PATHS:
            raise ValueError(f"matmul path {matmul!r} is not one of {MATMUL_PATHS}")
        if slots < 1 or max_slots < slots:
            raise ValueError(f"need 1 <= slots <= max_slots, got slots={slots}, max_slots={max_slots}")
        self.max_slots = int(max_slots)
        self.bundle = bundle
        model = bundle.model
        cfg = model.config
        self.device = torch.device(bundle.device)
        self.dtype = next(model.parameters()).dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.matmul = default_matmul_path(self.device, self.dtype) if matmul == "auto" else matmul
        self.context_length = int(bundle.context_length)
        dec = model.get_decoder()
        self.n_layers = len(dec.layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self._rotary = dec.rotary_emb
        self.embed = dec.embed_tokens.weight.detach()  # [V, H]
        self.final_norm = dec.norm.weight.detach()
        self.layers: list[LayerWeights] = []
        for layer in dec.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w = fuse_params([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            qkv_b = fuse_params([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
            gu_w = fuse_params([m.gate_proj.weight, m.up_proj.weight])
            gu_b = fuse_params([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
            self.layers.append(LayerWeights(
                qkv=FastLinear(qkv_w, qkv_b, path=self.matmul),
                o=FastLinear(a.o_proj.weight, a.o_proj.bias, path=self.matmul),
                gate_up=FastLinear(gu_w, gu_b, path=self.matmul),
                down=FastLinear(m.down_proj.weight, m.down_proj.bias, path=self.matmul),
                ln_in=layer.input_layernorm.weight.detach(),
                ln_post=layer.post_attention_layernorm.weight.detach(),
                q_norm=a.q_norm.weight.detach() if getattr(a, "q_norm", None) is not None else None,
                k_norm=a.k_norm.weight.detach() if getattr(a, "k_norm", None) is not None else None,
            ))
        head = model.get_output_embeddings()
        self.lm_head = FastLinear(head.weight, getattr(head, "bias", None), path=self.matmul)
        self.matmul = self.lm_head.path  # what runs (a path that cannot take this weight fell back)
        # our CPU kernels for everything around the matmuls too (norms, rope + KV write, attention, SiLU):
        # one call each instead of 3-10 aten ops, which cost more than the arithmetic at a few rows
        self._ops = self.lm_head._ops if self.matmul == "small_gemm" else None
        self._logits = torch.empty(0)  # kernel path: reused [rows, V] output of the lm_head (see _head)
        self.slots = slots
        self._free_slots = list(range(slots))[::-1]
        self._live: dict[int, SlotCache] = {}  # slot -> the row's handle, while taken
        self.max_len = 0
        self.kv: torch.Tensor = torch.empty(0)
        self._cos = self._sin = torch.empty(0)
        self.compiled = False
        self.compile_requested = bool(compile)
        self._graphs: dict[tuple[int, int], Any] = {}  # (slot, bucket) -> (CUDA graph, its logits)
        self._batch_graphs: dict[tuple[int, int], Any] = {}  # (streams bucket, tree bucket) -> (graph, logits)
        self._bbuf: Optional[dict[str, torch.Tensor]] = None  # static inputs of the batched step
        self.last_batch_path = ""  # how the last verify_batch ran: segments | padded | padded-graph | per-stream
        self._compiled_fn: Any = None
        self.warmup_s: dict[int, float] = {}
        # the additive mask [max bucket, max_len] is kept 0 outside the tree block of the current step
        self.mask = torch.empty(0)
        # sized for a typical row up front, so warm-up graphs / compiled steps survive the first rows
        start = int(max_len) if max_len > 0 else min(self.context_length, INITIAL_POSITIONS) + self.buckets[-1]
        self._grow(max(start, self.buckets[-1] + 1))

    # ---- memory ----
    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one position of one slot takes: layers x 2 x kv_heads x head_dim x dtype bytes."""
        return self.n_layers * 2 * self.n_kv * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.kv_bytes_per_token * self.max_len

    @torch.inference_mode()
    def _grow(self, need: int) -> None:
        """Make every slot hold at least ``need`` positions (copying what is cached), bounded by the context
        plus one bucket of padding."""
        need = min(int(need), self.context_length + self.buckets[-1])
        if need <= self.max_len:
            return
        new_len = max(need, min(2 * self.max_len, self.context_length + self.buckets[-1]))
        kv = torch.zeros((self.n_layers, 2, self.slots, self.n_kv, new_len, self.head_dim), dtype=self.dtype,
                         device=self.device)
        if self.max_len:
            kv[:, :, :, :, : self.max_len].copy_(self.kv)
        self.kv = kv
        positions = torch.arange(new_len, device=self.device).clamp_(max=self.context_length - 1).view(1, -1)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self._rotary(probe, positions)  # [1, new_len, D]
        self._cos = cos[0].to(self.dtype).unsqueeze(1).contiguous()  # [new_len, 1, D]
        self._sin = sin[0].to(self.dtype).unsqueeze(1).contiguous()
        self.mask = torch.zeros((self.buckets[-1], new_len), dtype=self.dtype, device=self.device)
        self.max_len = new_len
        self._graphs.clear()  # captured graphs point at the old buffers
        self._batch_graphs.clear()
        self._bbuf = None
        if self.compiled:
            self._enable_compile()  # static buffers of the new width (a compiled step recompiles for it)
        log.debug("static KV cache: %d slots x %d positions (%.1f MB per slot)", self.slots, new_len,
                  self.kv_bytes_per_slot / 1e6)

    def new_cache(self, needed_len: int = 0) -> SlotCache:
        """Take a free slot for one row that will hold up to ``needed_len`` positions (prompt + new tokens);
        when every slot is taken, one more slot is added (``reserve_slots``), up to ``max_slots``.

        Raises:
            RuntimeError: ``max_slots`` slots are taken (rows that never released theirs).
        """
        if not self._free_slots:
            if self.slots >= self.max_slots:
                raise RuntimeError(f"all {self.slots} KV-cache slots are in use")
            self.reserve_slots(self.slots + 1)
        self._grow(needed_len + self.buckets[-1])
        slot = min(self._free_slots)  # the lowest free slot: streams stay in [0, B), the batched graphs' range
        self._free_slots.remove(slot)
        cache = SlotCache(self, slot)
        self._live[slot] = cache
        return cache

    @torch.inference_mode()
    def reserve_slots(self, n: int) -> None:
        """Make the static KV cache hold at least ``n`` slots (streams), copying what is cached. Slots are
        never taken back; a larger cache drops the captured CUDA graphs (captured again lazily)."""
        n = int(n)
        if n <= self.slots:
            return
        if n > self.max_slots:
            raise ValueError(f"{n} KV-cache slots asked for, this runner holds at most {self.max_slots}")
        kv = torch.zeros((self.n_layers, 2, n, self.n_kv, self.max_len, self.head_dim), dtype=self.dtype,
                         device=self.device)
        kv[:, :, : self.slots].copy_(self.kv)
        self.kv = kv
        self._free_slots = list(range(n - 1, self.slots - 1, -1)) + self._free_slots
        self.slots = n
        self._graphs.clear()
        self._batch_graphs.clear()
        self._bbuf = None
        if self.compiled:
            self._enable_compile()
        log.debug("static KV cache: %d slots x %d positions", n, self.max_len)

    # ---- the decoder ----
    def _prefill_mask(self, t: int, start: int, device: torch.device) -> torch.Tensor:
        """Additive mask ``[t, start + t]`` of a prefill chunk at ``start``: the prefix and the chunk's own
        causal part visible (0), the rest the dtype's minimum."""
        seen = torch.ones(t, start + t, dtype=torch.bool, device=device).tril_(diagonal=start)
        return torch.zeros(t, start + t, dtype=self.dtype, device=device).masked_fill_(
            ~seen, torch.finfo(self.dtype).min)

    def _forward_kernels(self, ids: torch.Tensor, pos: torch.Tensor, slot: int, start: int,
                         mask: Optional[torch.Tensor]) -> torch.Tensor:
        """``_forward`` (eager shapes) through our CPU kernels (engine/kernels): the same arithmetic, the
        residual stream updated in place by the o and down projections."""
        ops = self._ops
        t = ids.shape[0]
        end = start + t
        x = F.embedding(ids, self.embed)  # [T, H], a fresh tensor: added into in place below
        cos, sin = self._cos[pos], self._sin[pos]  # [T, 1, D]
        nq, d, eps = self.n_heads, self.head_dim, self.eps
        kv = self.kv
        # a prefill chunk (no mask, several rows): our causal kernel where it runs (AVX-512), which scores no
        # key past a row's own position; else SDPA's blocked causal kernel for long chunks, ours with a mask
        own_causal = mask is None and t > 1 and bool(ops.has_causal(self.head_dim))
        sdpa = mask is None and t >= SDPA_MIN_ROWS and not own_causal
        causal = sdpa and start == 0  # SDPA's is_causal needs no mask
        if mask is None and t > 1 and not causal and not own_causal:  # causal over the chunk, the prefix visible
            mask = self._prefill_mask(t, start, ids.device)
        for li, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.ln_in, eps)
            qkv = ops.linear(h, layer.qkv._panels, layer.qkv.bias, layer.qkv.weight.shape[0])
            keys, vals = kv[li, 0, slot], kv[li, 1, slot]  # [nkv, max_len, d]
            q = ops.rope_kv_(qkv, cos, sin, keys, vals, start, nq, layer.q_norm, layer.k_norm, eps)  # [T, nq, d]
            if own_causal:
                att = ops.attention_causal(q, keys, vals, start, self.scale)  # [T, nq * d]
            elif sdpa:
                att = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), keys[:, :end].unsqueeze(0), vals[:, :end].unsqueeze(0),
                    attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.n_kv != nq,
                )[0].transpose(0, 1).reshape(t, nq * d)
            else:
                att = ops.attention(q, keys, vals, end, mask, self.scale)  # [T, nq * d]
            ops.linear_add_(x, att, layer.o._panels, layer.o.bias)
            h = ops.rms_norm(x, layer.ln_post, eps)
            gu = ops.linear(h, layer.gate_up._panels, layer.gate_up.bias, layer.gate_up.weight.shape[0])
            ops.linear_add_(x, ops.silu_mul(gu), layer.down._panels, layer.down.bias)
        return ops.rms_norm(x, self.final_norm, eps)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of ``hidden [T, H]``. On our kernels they are written into one reused buffer
        (valid until the next call: a verify's logits are consumed within its step), so a step allocates no
        multi-MB tensor; glibc would map and unmap it every step and its heap would drift by as much."""
        if self._ops is None:
            return self.lm_head(hidden)
        t = hidden.shape[0]
        if self._logits.shape[0] < t:
            self._logits = torch.empty((max(t, self.buckets[-1]), self.lm_head.weight.shape[0]), dtype=self.dtype)
        out = self._logits[:t]
        return self._ops.linear_into_(out, hidden, self.lm_head._panels, self.lm_head.bias)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slot: int, start: int, mask: Optional[torch.Tensor],
                 write_idx: Optional[torch.Tensor] = None, plain: bool = False) -> torch.Tensor:
        """Hidden states ``[T, H]`` for ``ids [T]`` at ``pos [T]``.

        Eager shapes (``write_idx`` None): writes the KV at ``[start, start + T)`` of ``slot`` and attends over
        ``[0, start + T)`` with the additive ``mask [T, start + T]`` (None: causal, for the prefill).
        Static shapes (the compiled / CUDA-graph step): writes the KV at the positions ``write_idx [T]`` and
        attends over the whole buffer ``[0, max_len)`` with ``mask [T, max_len]``, so no shape depends on the
        committed length. ``plain``: plain F.linear matmuls (for ``torch.compile``, which lowers them itself).
        """
        if self._ops is not None and write_idx is None and not plain:
            return self._forward_kernels(ids, pos, slot, start, mask)
        t = ids.shape[0]
        end = self.max_len if write_idx is not None else start + t
        x = F.embedding(ids, self.embed)  # [T, H]
        cos, sin = self._cos[pos], self._sin[pos]  # [T, 1, D]
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim
        kv = self.kv
        is_causal = False
        if mask is None and t > 1:  # prefill: causal over the chunk, everything before it visible
            if start == 0:
                is_causal = True
            else:
                mask = self._prefill_mask(t, start, ids.device)
        elif t == 1 and write_idx is None:
            mask = None  # one token sees the whole prefix
        gqa = nkv != nq
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln_in, self.eps)
            qkv = layer.qkv(h, plain)  # [T, (nq + 2 nkv) d]
            v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
            if layer.q_norm is None:  # rotate q and k heads in one go
                qk = rotate_half_rope(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d), cos, sin)
                q, k = qk[:, :nq], qk[:, nq:]
            else:  # Qwen3: per-head RMSNorm of q and k before the rotation
                q = rotate_half_rope(rms_norm(qkv[:, : nq * d].view(t, nq, d), layer.q_norm, self.eps), cos, sin)
                k = rotate_half_rope(rms_norm(qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d), layer.k_norm, self.eps),
                            cos, sin)
            if write_idx is None:
                kv[li, 0, slot, :, start:end].copy_(k.transpose(0, 1))
                kv[li, 1, slot, :, start:end].copy_(v.transpose(0, 1))
            else:
                kv[li, 0, slot].index_copy_(1, write_idx, k.transpose(0, 1))
                kv[li, 1, slot].index_copy_(1, write_idx, v.transpose(0, 1))
            keys = kv[li, 0, slot, :, :end].unsqueeze(0)  # [1, nkv, S, d]
            vals = kv[li, 1, slot, :, :end].unsqueeze(0)
            if t >= SDPA_MIN_ROWS or is_causal:
                att = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), keys, vals, attn_mask=mask, is_causal=is_causal,
                    scale=self.scale, enable_gqa=gqa,
                )[0].transpose(0, 1)  # [T, nq, d]
            else:
                att = tree_attention(q, keys[0], vals[0], mask, self.scale)
            x = x + layer.o(att.reshape(t, nq * d), plain)
            h = rms_norm(x, layer.ln_post, self.eps)
            gu = layer.gate_up(h, plain)
            inter = gu.shape[-1] // 2
            x = x + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:], plain)
        return rms_norm(x, self.final_norm, self.eps)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, cache: SlotCache, topk: int,
                rows: Optional[np.ndarray] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Forward the prompt straight into the row's slot, in chunks of ``PREFILL_CHUNK`` tokens.

        Args:
            rows: sorted prompt positions whose top-k is wanted (``last_positions``); None: every position.
                The output layer runs over those rows only (its weights are a fifth of SmolLM2's).

        Returns:
            (last-position logits ``[V]`` float32, top-``topk`` next-token ids ``[P, topk]`` int64 on the CPU,
            -1 in the rows not asked for, or None when topk == 0).
        """
        n = len(prompt_ids)
        self._grow(n + self.buckets[-1])
        ids_all = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        want = torch.arange(n) if rows is None else torch.as_tensor(np.asarray(rows, dtype=np.int64))
        top = torch.full((n, topk), -1, dtype=torch.long) if topk > 0 else None
        last = None
        for start in range(0, n, PREFILL_CHUNK):
            ids = ids_all[start : start + PREFILL_CHUNK]
            pos = torch.arange(start, start + ids.shape[0], device=self.device)
            hidden = self._forward(ids, pos, cache.slot, start, None)  # [c, H]
            last = hidden[-1:]
            if topk > 0:
                here = want[(want >= start) & (want < start + ids.shape[0])]  # [c'] positions in this chunk
                picked = hidden if here.numel() == ids.shape[0] else hidden.index_select(
                    0, (here - start).to(hidden.device))
                for s in range(0, picked.shape[0], PREFILL_TOPK_CHUNK):
                    logits = self._head(picked[s : s + PREFILL_TOPK_CHUNK])  # [c'', V]
                    top[here[s : s + PREFILL_TOPK_CHUNK]] = self._topk(logits, topk)
        cache.length = n
        last_logits = self._head(last).float()[0].clone()  # [V], its own copy (the head buffer is reused)
        return last_logits, top

    def _topk(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Top-``k`` ids ``[T, k]`` (int64, CPU) of ``logits [T, V]``: one pass of our kernels where they run
        (``kernels.fused_argmax_topk``; equal values in index order), else torch.topk."""
        fused = fused_argmax_topk(logits, k, self._ops)
        return fused[1] if fused is not None else torch.topk(logits, k, dim=-1).indices.cpu()

    def _padded(self, tree: Any, committed_len: int, t_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tree padded to ``t_pad`` nodes on the CPU: ids ``[t_pad]``, positions ``[t_pad]`` and the additive
        tree block ``[t_pad, t_pad]`` of the mask (padding nodes see only themselves, nobody sees them)."""
        t = tree.size
        ids = np.zeros(t_pad, dtype=np.int64)
        ids[:t] = tree.tokens
        pos = np.full(t_pad, committed_len, dtype=np.int64)
        pos[:t] += tree.depths
        visible = np.eye(t_pad, dtype=bool)
        visible[:t, :t] = tree.visible
        block = torch.from_numpy(np.where(visible, 0.0, np.float32(torch.finfo(self.dtype).min)))
        return torch.from_numpy(ids), torch.from_numpy(pos), block

    def _write_tree(self, tree: Any, committed_len: int, t_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids / positions ``[t_pad]`` on the device, and the tree block written into the preallocated mask."""
        ids, pos, block = self._padded(tree, committed_len, t_pad)
        self.mask[:t_pad, committed_len : committed_len + t_pad].copy_(block)
        return ids.to(self.device), pos.to(self.device)

    @torch.inference_mode()
    def verify_tree(self, tree: Any, *, cache: SlotCache) -> torch.Tensor:
        """One forward over a flattened draft tree (``tree.TreeInputs``) padded to its bucket.

        Returns:
            logits ``[T, V]`` of the real nodes (model dtype); padding rows are dropped. On the CUDA-graph path
            they live in the graphs' shared output pool, on our CPU kernels in one reused buffer: either way
            valid until the next ``verify_tree`` or ``prefill`` call.
        """
        t = tree.size
        if t > self.buckets[-1]:
            self.add_bucket(t)
        # our CPU kernels take any row count: padding would only add work there
        t_pad = t if self._ops is not None and not self.compile_requested else pick_bucket(t, self.buckets)
        committed = cache.length
        if committed + t_pad > self.max_len:
            self._grow(committed + t_pad)
        if self.compile_requested and not self.compiled:
            self._enable_compile()
        if self.compiled:
            return self._verify_compiled(tree, cache.slot, committed, t_pad)
        ids, pos = self._write_tree(tree, committed, t_pad)
        end = committed + t_pad
        try:
            hidden = self._forward(ids, pos, cache.slot, committed, self.mask[:t_pad, :end])
            return self._head(hidden[:t] if t < t_pad else hidden)
        finally:
            self.mask[:t_pad, committed:end].zero_()

    @torch.inference_mode()
    def verify_batch(self, items: Sequence[tuple[Any, SlotCache]]) -> list[torch.Tensor]:
        """One forward over several streams' draft trees, each over its own slot: ``items`` is
        ``[(tree, cache), ...]`` with distinct slots.

        On our CPU kernels the trees are concatenated unpadded (``sum T_b`` rows): every GEMM runs once over all
        rows, the rotary embedding and KV write use each row's own slot and position, and attention takes each
        stream's rows over its own slot with its own tree mask (``_forward_segments``). Elsewhere the trees go
        padded to ``[B_pad, N_pad]`` through one static-shape step (``_verify_padded``): streams in slots
        ``[0, B_pad)``, trees padded to the tree bucket; on CUDA with ``compile`` that step is one CUDA graph
        per ``(B_pad, N_pad)`` bucket, captured on first use. A compiled CPU step verifies one by one.

        Returns:
            logits ``[T_b, V]`` per item, each its own tensor (model dtype).

        Raises:
            ValueError: two items share a slot.
        """
        slots = [c.slot for _, c in items]
        if len(set(slots)) != len(slots):
            raise ValueError(f"verify_batch: streams share a KV-cache slot ({slots})")
        if len(items) == 1 or (self.device.type != "cuda" and self.compile_requested):
            self.last_batch_path = "per-stream"
            return [self.verify_tree(tree, cache=c).clone() if len(items) > 1 else self.verify_tree(tree, cache=c)
                    for tree, c in items]
        if self._ops is None:
            return self._verify_padded(items)
        self.last_batch_path = "segments"
        need = max(c.length + tree.size for tree, c in items)
        if need > self.max_len:
            self._grow(need)
        sizes = [tree.size for tree, _ in items]
        rows = sum(sizes)
        ids = np.concatenate([tree.tokens for tree, _ in items]).astype(np.int64)
        pos = np.concatenate([c.length + tree.depths for tree, c in items]).astype(np.int64)
        # per stream: slot, KV start (its committed length), first row; the tree blocks of the mask side by side
        seg = torch.tensor([[c.slot, c.length, sum(sizes[:i])] for i, (_, c) in enumerate(items)], dtype=torch.long)
        mask = torch.zeros((rows, need), dtype=self.dtype)
        neg = float(torch.finfo(self.dtype).min)
        r = 0
        for tree, c in items:
            t = tree.size
            block = torch.from_numpy(np.where(tree.visible, 0.0, np.float32(neg)))
            mask[r : r + t, c.length : c.length + t] = block
            mask[r : r + t, c.length + t :] = neg
            r += t
        hidden = self._forward_segments(torch.from_numpy(ids), torch.from_numpy(pos), seg, mask)
        logits = self._head(hidden)
        out, r = [], 0
        for t in sizes:
            out.append(logits[r : r + t].clone())
            r += t
        return out

    @torch.inference_mode()
    def _verify_padded(self, items: Sequence[tuple[Any, SlotCache]]) -> list[torch.Tensor]:
        """The batch as one ``[B_pad, N_pad]`` static-shape step: B_pad the smallest stream bucket holding every
        item's slot (slots ``[0, B_pad)``; a slot of the range that is not in the batch gets a padding tree
        that writes only its own scratch rows), N_pad the tree bucket of the largest tree."""
        n_pad = pick_bucket(max(tree.size for tree, _ in items), self.buckets)
        if n_pad > self.buckets[-1]:
            self.add_bucket(n_pad)
        b_pad = pick_bucket(max(c.slot for _, c in items) + 1, STREAM_BUCKETS)
        if b_pad > self.slots:
            b_pad = self.slots
        need = max(self._live[s].length if s in self._live else 0 for s in range(b_pad)) + n_pad
        if need > self.max_len:
            self._grow(need)
        buf = self._batch_buffers()
        by_slot = {c.slot: (tree, c) for tree, c in items}
        neg = torch.finfo(self.dtype).min
        ids = torch.zeros((b_pad, n_pad), dtype=torch.long)
        pos = torch.zeros((b_pad, n_pad), dtype=torch.long)
        write = torch.zeros((b_pad, n_pad), dtype=torch.long)
        mask = torch.full((b_pad, n_pad, self.max_len), neg, dtype=self.dtype)
        for b in range(b_pad):
            length = self._live[b].length if b in self._live else 0
            write[b] = torch.arange(length, length + n_pad)
            pos[b] = length
            if b in by_slot:
                tree, _ = by_slot[b]
                t = tree.size
                ids[b, :t] = torch.from_numpy(tree.tokens)
                pos[b, :t] += torch.from_numpy(tree.depths)
                mask[b, :, :length] = 0.0
                block = torch.from_numpy(np.where(np.eye(n_pad, dtype=bool), 0.0, np.float32(neg))).to(self.dtype)
                block[:t, :t] = torch.from_numpy(np.where(tree.visible, 0.0, np.float32(neg)))
                mask[b, :, length : length + n_pad] = block
            else:  # not in this batch: padding rows that see only themselves, written past the slot's rows
                mask[b, :, length : length + n_pad] = torch.where(torch.eye(n_pad, dtype=torch.bool), 0.0, neg)
        buf["ids"][:b_pad, :n_pad].copy_(ids)
        buf["pos"][:b_pad, :n_pad].copy_(pos)
        buf["write"][:b_pad, :n_pad].copy_(write)
        buf["mask"][:b_pad, :n_pad].copy_(mask)
        if self.compiled and self.device.type == "cuda":
            graph = self._batch_graphs.get((b_pad, n_pad))
            if graph is None:
                graph = self._capture_batch(b_pad, n_pad)
            graph[0].replay()
            logits = graph[1]
            self.last_batch_path = "padded-graph"
        else:
            logits = self._batch_step(b_pad, n_pad)
            self.last_batch_path = "padded"
        logits = logits.view(b_pad, n_pad, -1)
        return [logits[c.slot, : tree.size].clone() for tree, c in items]

    def _batch_buffers(self) -> dict[str, torch.Tensor]:
        """Static inputs of the batched step, sized for every slot and the largest tree bucket."""
        b, t = self.slots, self.buckets[-1]
        buf = self._bbuf
        if buf is None or buf["ids"].shape != (b, t) or buf["mask"].shape[-1] != self.max_len:
            dev = self.device
            buf = self._bbuf = {
                "ids": torch.zeros((b, t), dtype=torch.long, device=dev),
                "pos": torch.zeros((b, t), dtype=torch.long, device=dev),
                "write": torch.zeros((b, t), dtype=torch.long, device=dev),
                "mask": torch.zeros((b, t, self.max_len), dtype=self.dtype, device=dev),
            }
            self._batch_graphs.clear()
        return buf

    def _batch_step(self, b_pad: int, n_pad: int) -> torch.Tensor:
        """Logits ``[b_pad * n_pad, V]`` of the static batch buffers: streams in slots ``[0, b_pad)``, each
        writing its KV at its ``write`` positions and attending over its whole slot with its ``mask`` row
        block, so no shape depends on a committed length (what a CUDA graph needs)."""
        buf = self._bbuf
        assert buf is not None
        ids, pos = buf["ids"][:b_pad, :n_pad], buf["pos"][:b_pad, :n_pad]
        write, mask = buf["write"][:b_pad, :n_pad], buf["mask"][:b_pad, :n_pad].unsqueeze(1)  # [B, 1, N, L]
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim
        rows = b_pad * n_pad
        x = F.embedding(ids.reshape(rows), self.embed)  # [R, H]
        cos = self._cos[pos.reshape(rows)].view(b_pad, n_pad, 1, d)
        sin = self._sin[pos.reshape(rows)].view(b_pad, n_pad, 1, d)
        bidx = torch.arange(b_pad, device=self.device).view(b_pad, 1)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln_in, self.eps)
            qkv = layer.qkv(h).view(b_pad, n_pad, nq + 2 * nkv, d)
            v = qkv[:, :, nq + nkv :]
            if layer.q_norm is None:
                qk = rotate_half_rope(qkv[:, :, : nq + nkv], cos, sin)
                q, k = qk[:, :, :nq], qk[:, :, nq:]
            else:
                q = rotate_half_rope(rms_norm(qkv[:, :, :nq], layer.q_norm, self.eps), cos, sin)
                k = rotate_half_rope(rms_norm(qkv[:, :, nq : nq + nkv], layer.k_norm, self.eps), cos, sin)
            keys, vals = self.kv[li, 0, :b_pad], self.kv[li, 1, :b_pad]  # [B, nkv, L, d] views
            keys.transpose(1, 2)[bidx, write] = k  # [B, N, nkv, d] into each stream's own slot rows
            vals.transpose(1, 2)[bidx, write] = v
            att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=nkv != nq)  # [B, nq, N, d]
            x = x + layer.o(att.transpose(1, 2).reshape(rows, nq * d))
            h = rms_norm(x, layer.ln_post, self.eps)
            gu = layer.gate_up(h)
            inter = gu.shape[-1] // 2
            x = x + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        return self.lm_head(rms_norm(x, self.final_norm, self.eps))

    def _capture_batch(self, b_pad: int, n_pad: int) -> tuple[Any, torch.Tensor]:
        """Capture the batched step of ``(b_pad, n_pad)`` as one CUDA graph over the static batch buffers."""
        got = self._graph_of(lambda: self._batch_step(b_pad, n_pad), n_pad)
        self._batch_graphs[(b_pad, n_pad)] = got
        return got

    def _forward_segments(self, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[R, H]`` of several streams' rows in one pass of our CPU kernels.

        Args:
            ids, pos: ``[R]`` token ids and positions, the streams' rows one after another.
            seg: ``[B, 3]`` int64 per stream: KV slot, start (committed length: its rows' KV goes to
                ``[start, start + T_b)``), first row in ``ids``.
            mask: ``[R, >= max(start + T_b)]`` additive mask, each row over its own stream's slot.
        """
        ops = self._ops
        x = F.embedding(ids, self.embed)  # [R, H]
        cos, sin = self._cos[pos], self._sin[pos]
        nq, eps = self.n_heads, self.eps
        kv = self.kv
        for li, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.ln_in, eps)
            qkv = ops.linear(h, layer.qkv._panels, layer.qkv.bias, layer.qkv.weight.shape[0])
            keys, vals = kv[li, 0], kv[li, 1]  # [slots, nkv, max_len, d]
            q = ops.rope_kv_seg_(qkv, cos, sin, keys, vals, seg, nq, layer.q_norm, layer.k_norm, eps)
            att = ops.attention_seg(q, keys, vals, seg, mask, self.scale)  # [R, nq * d]
            ops.linear_add_(x, att, layer.o._panels, layer.o.bias)
            h = ops.rms_norm(x, layer.ln_post, eps)
            gu = ops.linear(h, layer.gate_up._panels, layer.gate_up.bias, layer.gate_up.weight.shape[0])
            ops.linear_add_(x, ops.silu_mul(gu), layer.down._panels, layer.down.bias)
        return ops.rms_norm(x, self.final_norm, eps)

    # ---- the compiled step: static input buffers, one CUDA graph or compiled graph per (slot, bucket) ----
    def _static_step(self, slot: int, t_pad: int) -> torch.Tensor:
        """Logits ``[t_pad, V]`` from the static buffers ``_ids``, ``_pos``, ``_write`` and ``_gmask``."""
        plain = self.device.type != "cuda"
        hidden = self._forward(self._ids[:t_pad], self._pos[:t_pad], slot, 0, self._gmask[:t_pad],
                               write_idx=self._write[:t_pad], plain=plain)
        return self.lm_head(hidden, plain)

    def _fill_static(self, tree: Any, committed_len: int, t_pad: int) -> None:
        """Write one padded tree into the static buffers (ids, positions, KV write positions, full-span mask)."""
        ids, pos, block = self._padded(tree, committed_len, t_pad)
        self._ids[:t_pad].copy_(ids)
        self._pos[:t_pad].copy_(pos)
        self._write[:t_pad].copy_(torch.arange(committed_len, committed_len + t_pad))
        gm = self._gmask[:t_pad]
        gm[:, :committed_len].zero_()
        gm[:, committed_len:].fill_(torch.finfo(self.dtype).min)
        gm[:, committed_len : committed_len + t_pad].copy_(block)

    def _verify_compiled(self, tree: Any, slot: int, committed: int, t_pad: int) -> torch.Tensor:
        self._fill_static(tree, committed, t_pad)
        if self.device.type == "cuda":
            graph = self._graphs.get((slot, t_pad))
            if graph is None:
                graph = self._capture(slot, t_pad)
            graph[0].replay()
            logits = graph[1]
        else:
            logits = self._compiled_fn(slot, t_pad)
        return logits[: tree.size]

    def _capture(self, slot: int, t_pad: int) -> tuple[Any, torch.Tensor]:
        """Capture one CUDA graph of the static step for ``(slot, t_pad)`` over the current static buffers."""
        got = self._graph_of(lambda: self._static_step(slot, t_pad), t_pad)
        self._graphs[(slot, t_pad)] = got
        return got

    def _graph_of(self, step: Any, bucket: int) -> tuple[Any, torch.Tensor]:
        """(CUDA graph, its output) of ``step()`` in the shared memory pool: two warm-up runs on a side stream
        first, as capture requires; the seconds are added to ``warmup_s[bucket]``."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = step()
        self._graph_pool = graph.pool()
        self.warmup_s[bucket] = self.warmup_s.get(bucket, 0.0) + time.perf_counter() - t0
        return graph, out

    def _enable_compile(self) -> None:
        """Switch verification to the static-shape step: CUDA graphs on CUDA, ``torch.compile`` on the CPU.

        Compiled CPU artifacts are reused across processes through inductor's own on-disk caches
        (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``), so later processes skip code
        generation; CUDA graphs are captured per process (milliseconds per graph).
        """
        t = self.buckets[-1]
        self._ids = torch.zeros(t, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(t, dtype=torch.long, device=self.device)
        self._write = torch.zeros(t, dtype=torch.long, device=self.device)
        self._gmask = torch.zeros((t, self.max_len), dtype=self.dtype, device=self.device)
        self._graphs.clear()  # captured graphs read the buffers they were captured with
        self._graph_pool = None
        if self.device.type != "cuda" and self._compiled_fn is None:
            log.warning("compile on the CPU: torch.compile of the verify step is ~30x slower per step than the "
                        "uncompiled static runner on the CPUs measured (benchmarks/README.md); use compile 'off'")
            import torch._dynamo as dynamo

            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
            self._compiled_fn = torch.compile(self._static_step, dynamic=False)
        self.compiled = True

    def step_sizes(self, largest: int) -> tuple[int, ...]:
        """Tree sizes up to ``largest`` after which the verify cost steps up, so a tree of exactly that size
        costs what a smaller one does: on our CPU kernels the row counts where the GEMM adds a pass of register
        blocks (multiples of 6 on AVX2; 6, then multiples of 12 on AVX-512),
        the buckets where trees are padded. ``capacity: auto`` adds them to its candidates."""
        if self._ops is not None and not self.compile_requested:
            return tuple(int(r) for r in self._ops.row_steps(largest))
        return tuple(b for b in self.buckets if b <= largest)

    @staticmethod
    def release(cache: SlotCache) -> None:
        """Give the row's slot back (idempotent)."""
        cache.release()

    @staticmethod
    @torch.inference_mode()
    def keep_rows(cache: SlotCache, *, committed_len: int, nodes: list[int]) -> None:
        """Keep the accepted tree ``nodes`` (flattened indices, root first): row ``committed_len + nodes[i]``
        moves to ``committed_len + i`` in place (nodes ascend, so no source is overwritten before it is read).
        """
        runner = cache.runner
        kv = runner.kv
        for i, node in enumerate(nodes):
            if node != i:
                kv[:, :, cache.slot, :, committed_len + i].copy_(kv[:, :, cache.slot, :, committed_len + node])
        cache.length = committed_len + len(nodes)

    @torch.inference_mode()
    def add_bucket(self, size: int) -> None:
        """Add the power-of-two bucket >= ``size`` (a capacity above the largest bucket): the mask, the tree
        padding allowance of the KV cache and the static buffers grow to it."""
        b = 1 << (int(size) - 1).bit_length()
        if b in self.buckets:
            return
        self.buckets = tuple(sorted((*self.buckets, b)))
        if b == self.buckets[-1]:
            self.mask = torch.zeros((b, self.max_len), dtype=self.dtype, device=self.device)
            if self.compiled:
                self._enable_compile()
        log.info("static runner: tree size %d above the buckets; added bucket %d", size, b)

    # ---- warm-up ----
    def warmup(self, capacities: Sequence[int] = ()) -> dict[int, float]:
        """Pack weights for, and run once, every bucket up to the largest of ``capacities`` (all buckets when
        empty); returns {bucket: seconds} and logs the total."""
        if capacities and max(capacities) > self.buckets[-1]:
            self.add_bucket(max(capacities))
        top = pick_bucket(max(capacities), self.buckets) if capacities else self.buckets[-1]
        t0 = time.perf_counter()
        for b in self.buckets:
            if b > top:
                break
            tb = time.perf_counter()
            for layer in self.layers:
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                    lin.prepare(b)
            self.lm_head.prepare(b)
            if self.compile_requested:
                self._warm_compiled(b)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self.warmup_s[b] = time.perf_counter() - tb
        log.info("static runner warm-up (%s matmuls, buckets up to %d): %.2f s", self.matmul, top,
                 time.perf_counter() - t0)
        return dict(self.warmup_s)

    @torch.inference_mode()
    def _warm_compiled(self, t_pad: int) -> None:
        """Compile (CPU) or capture (CUDA) the step of bucket ``t_pad`` on a scratch slot state: a chain of
        ``t_pad`` tokens after position 0 of slot 0 (nothing is committed there between rows)."""
        if not self.compiled:
            self._enable_compile()
        tree = flatten_tree(Draft.chain([0] * t_pad), committed_len=0, device=self.device, dtype=self.dtype)
        self._verify_compiled(tree, 0, 0, t_pad)

    @property
    def packed_bytes(self) -> int:
        """Bytes held in prepacked weight copies."""
        lins = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.extra_bytes for lin in lins + [self.lm_head])
