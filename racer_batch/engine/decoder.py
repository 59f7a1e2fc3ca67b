"""The one decoder function of the static runner (``decode``), the weights it runs on (``DecoderWeights``), the
one input shape it takes (``Rows``: a flat batch of rows over KV-cache slots) and the two op sets it runs with:
our CPU kernels (``KernelOps``, ``torch.ops.racer``) or torch ops (``TorchOps``: oneDNN / cuBLAS matmuls, aten
norms, SDPA); plus the additive tree-attention mask of a flat batch (``fill_tree_mask``).

Every forward of the static runner is ``decode``: a prompt chunk of one stream (``Rows.prefill``, causal), the
segments of several streams' draft trees on our kernels (``Rows`` from ``seg``, unpadded), and the padded
``[B, N]`` batch on torch ops, eager or captured as a CUDA graph (engine/graphs.py captures this same function).
The layer is the Llama family's: RMSNorm, fused q/k/v, rotary positions (Qwen3 and Gemma 3: per-head q/k RMSNorm
first), the KV write into each row's slot, grouped-query attention over the slot, o projection added to the
residual, RMSNorm, fused gate/up, SiLU x up, down projection added to the residual. The families' variations are
data on the weights: Phi-3's own fused q/k/v and gate/up; Gemma 3's scaled embeddings, ``1 + w`` norms, a norm on
each branch's output, tanh GELU, its attention scale, and sliding-window layers with their own rotary tables;
Qwen3-MoE's and Mixtral's routed experts in place of the MLP (``decoder_ops.moe_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .decoder_ops import (
    FastLinear,
    LayerWeights,
    MoEWeights,
    act_mul,
    fuse_params,
    moe_forward,
    rms_norm,
    rotate_half_rope,
    tree_attention,
)

SDPA_MIN_ROWS = 128  # fewer query rows per stream: our own attention (SDPA's CPU kernels cost ~0.2-8 ms at T=1)
GEMMA_FAMILIES = ("gemma3_text",)  # the (1 + w) norms, scaled embeddings and four norms per layer
SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class DecoderWeights:
    """The decoder's weights over the HF model's own tensors (q/k/v and gate/up fused without a copy), its
    shape, and the rotary tables ``rope_tables[k] = (cos, sin)``, each ``[positions, 1, head_dim]``, from the
    model's own ``rotary_emb`` (so every rope scaling that does not depend on the sequence length is exact; Gemma
    3: one table per layer kind, ``rope_kinds``)."""

    embed: Any  # [V, H]: a tensor, or a StoredWeight (weights/stored.py: rows expanded by the kernels)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: FastLinear
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    context_length: int
    rotary: Any
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    act: str = "silu"  # silu | gelu_tanh
    embed_scale: Optional[torch.Tensor] = None  # 0-dim, the embedding's dtype (Gemma: sqrt(hidden))
    rope_kinds: list[Optional[str]] = field(default_factory=lambda: [None])  # rotary_emb's layer_type argument
    rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # of the activations
    device: torch.device = torch.device("cpu")

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def cos(self) -> torch.Tensor:
        """The first rotary table's cosines ``[positions, 1, D]`` (the only table outside Gemma 3)."""
        return self.rope_tables[0][0] if self.rope_tables else torch.empty(0)

    @property
    def sin(self) -> torch.Tensor:
        return self.rope_tables[0][1] if self.rope_tables else torch.empty(0)

    @property
    def windows(self) -> list[int]:
        """The distinct sliding windows of the layers (empty: every layer sees the whole prefix)."""
        return sorted({layer.window for layer in self.layers if layer.window})

    @staticmethod
    def of(model: Any, *, matmul: str, context_length: int,
           stored: Optional[dict[str, Any]] = None) -> "DecoderWeights":
        """The weights of a HF ``model`` of a family ``static_runner.describe_unsupported`` accepts, with every
        matmul on ``matmul`` (``FastLinear`` path), except the parameters named in ``stored`` (an as-stored
        bundle's ``stored.weights``: name -> ``StoredWeight``), which run as stored (``FastLinear.of_stored``;
        a stored embedding table is looked up by the kernels)."""
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        find = (lambda p: stored.get(names.get(id(p), ""))) if stored else (lambda p: None)
        dec = model.get_decoder()
        return DecoderWeights._build(model.config, dec, model.get_output_embeddings(), find, matmul=matmul,
                                     context_length=context_length, rotary=dec.rotary_emb)

    @staticmethod
    def of_stored(config: Any, stored: Any, *, context_length: int) -> "DecoderWeights":
        """The weights of an as-stored model without its HF modules (weights/plain.py): ``config`` a
        ``PlainConfig`` that ``plain_blocker`` accepts, ``stored`` a ``StoredModel`` from ``weights.stored.read``
        (its stored weights run as stored, its other tensors as float32), the rotary tables ``plain.rotary_of``'s.
        The same reading as ``of``, by the parameters' HF names (``StoredModel.tree``).

        Raises:
            AttributeError: a weight the layout needs is not in ``stored`` (names a missing parameter).
        """
        from ..weights.plain import rotary_of
        from ..weights.stored import StoredWeight

        tree = stored.tree()
        head = tree.lm_head if hasattr(tree, "lm_head") else tree.model.embed_tokens  # tied: the table
        find = lambda p: p if isinstance(p, StoredWeight) else None  # noqa: E731
        return DecoderWeights._build(config, tree.model, head, find, matmul="auto", context_length=context_length,
                                     rotary=rotary_of(config))

    @staticmethod
    def _build(cfg: Any, dec: Any, head: Any, find: Callable[[Any], Any], *, matmul: str, context_length: int,
               rotary: Any) -> "DecoderWeights":
        """``of``'s reading of a decoder ``dec`` (``.layers``, ``.embed_tokens``, ``.norm``) and output layer
        ``head`` (``.weight``, ``.bias``), modules or ``NamedTree``s alike; ``find`` gives a weight's
        ``StoredWeight`` or None."""
        n_heads = int(cfg.num_attention_heads)
        gemma = getattr(cfg, "model_type", "") in GEMMA_FAMILIES
        kinds = list(getattr(cfg, "layer_types", None) or [])
        rope_kinds: list[Optional[str]] = sorted(set(kinds)) if gemma else [None]
        layers = [_layer_weights(layer, matmul, find, gemma=gemma, window=_window(cfg, i, kinds),
                                 rope=rope_kinds.index(kinds[i]) if gemma else 0) for i, layer in enumerate(dec.layers)]
        stored_embed = find(dec.embed_tokens.weight)  # a StoredWeight runs in float32 on the CPU
        embed = stored_embed or dec.embed_tokens.weight.detach()
        dtype, device = (torch.float32, torch.device("cpu")) if stored_embed else (embed.dtype, embed.device)
        scale = getattr(dec.embed_tokens, "embed_scale", None)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        pre_attn = getattr(cfg, "query_pre_attn_scalar", None)
        return DecoderWeights(
            embed=embed, layers=layers, final_norm=_norm_weight(dec.norm, gemma), lm_head=_linear(
                [head.weight], [getattr(head, "bias", None)], matmul, find), n_heads=n_heads,
            n_kv=int(getattr(cfg, "num_key_value_heads", None) or n_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads), eps=float(cfg.rms_norm_eps),
            context_length=int(context_length), rotary=rotary,
            attn_scale=float(pre_attn) ** -0.5 if gemma and pre_attn else 0.0,
            act="gelu_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else "silu",
            embed_scale=None if scale is None else scale.detach().to(dtype), rope_kinds=rope_kinds, dtype=dtype,
            device=device)

    @torch.inference_mode()
    def cover(self, positions: int) -> None:
        """Make the rotary tables hold ``positions`` rows (positions past the context take the last one's)."""
        if self.rope_tables and self.rope_tables[0][0].shape[0] >= positions:
            return
        dtype, device = self.dtype, self.device
        pos = torch.arange(positions, device=device).clamp_(max=self.context_length - 1).view(1, -1)
        x = torch.zeros(1, dtype=dtype, device=device)
        tables = []
        for kind in self.rope_kinds:
            cos, sin = self.rotary(x, pos) if kind is None else self.rotary(x, pos, kind)  # [1, positions, D]
            tables.append((cos[0].to(dtype).unsqueeze(1).contiguous(), sin[0].to(dtype).unsqueeze(1).contiguous()))
        self.rope_tables = tables  # [positions, 1, D] each

    def linears(self) -> list[FastLinear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]


def layer_windows(config: Any) -> dict[str, int | None]:
    """The attention kinds of a decoder's layers and each kind's window in positions (None: the whole prefix).

    Read from the config as transformers' models read it: ``layer_types`` where the config lists them (Gemma 2/3,
    Cohere 2: ``sliding_attention`` layers see ``sliding_window`` positions), else every layer sliding where
    ``sliding_window`` is set and not switched off by ``use_sliding_window: false`` (Mistral; Qwen2's default is
    off), else every layer full."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return {k: (window if k == SLIDING else None) for k in dict.fromkeys(kinds)}
    if window and getattr(config, "use_sliding_window", True) is not False:
        return {SLIDING: int(window)}
    return {FULL: None}


def _window(cfg: Any, index: int, kinds: list[str]) -> Optional[int]:
    """Layer ``index``'s sliding window (``layer_windows``; None: the whole prefix)."""
    windows = layer_windows(cfg)
    window = windows[kinds[index]] if kinds else next(iter(windows.values()))
    return int(window) if window else None


def _norm_weight(norm: Any, gemma: bool) -> torch.Tensor:
    """An RMSNorm's weight as the decoder multiplies by it: Gemma's ``1 + w`` in float32, else ``w`` itself."""
    w = norm.weight.detach()
    return 1.0 + w.float() if gemma else w


def _linear(weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]], matmul: str,
            find: Callable[[torch.Tensor], Any]) -> FastLinear:
    """One ``FastLinear`` over ``weights`` stacked along the output features (q/k/v or gate/up fused without a
    copy: ``fuse_params``) with their biases (all None or all given): as stored where ``find`` gives every
    weight's ``StoredWeight``; a stored part among float ones is expanded to float32 (its exact numbers)."""
    bias = None if biases[0] is None else (fuse_params(biases) if len(biases) > 1 else biases[0].detach())
    parts = [find(w) for w in weights]
    if all(p is not None for p in parts):
        return FastLinear.of_stored(parts, bias)
    weights = [p.expanded() if p is not None else w for p, w in zip(parts, weights)]
    return FastLinear(fuse_params(weights) if len(weights) > 1 else weights[0], bias, path=matmul)


def _layer_weights(layer: Any, matmul: str, find: Callable[[torch.Tensor], Any], *, gemma: bool = False,
                   window: Optional[int] = None, rope: int = 0) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    if hasattr(a, "qkv_proj"):  # Phi-3: already fused
        qkv = _linear([a.qkv_proj.weight], [a.qkv_proj.bias], matmul, find)
    else:
        qkv = _linear([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], [a.q_proj.bias, a.k_proj.bias,
                                                                             a.v_proj.bias], matmul, find)
    gate_up = down = moe = None
    if hasattr(m, "experts"):
        moe = _moe_weights(m, matmul)
    else:
        if hasattr(m, "gate_up_proj"):  # Phi-3: already fused, gate first
            gate_up = _linear([m.gate_up_proj.weight], [m.gate_up_proj.bias], matmul, find)
        else:
            gate_up = _linear([m.gate_proj.weight, m.up_proj.weight], [m.gate_proj.bias, m.up_proj.bias], matmul,
                              find)
        down = _linear([m.down_proj.weight], [m.down_proj.bias], matmul, find)
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    post_attn = post_ffn = None
    ln_post = layer.post_attention_layernorm
    if gemma:
        post_attn, post_ffn = _norm_weight(layer.post_attention_layernorm, True), \
            _norm_weight(layer.post_feedforward_layernorm, True)
        ln_post = layer.pre_feedforward_layernorm
    return LayerWeights(
        qkv=qkv, o=_linear([a.o_proj.weight], [a.o_proj.bias], matmul, find), gate_up=gate_up, down=down,
        ln_in=_norm_weight(layer.input_layernorm, gemma), ln_post=_norm_weight(ln_post, gemma),
        q_norm=_norm_weight(q_norm, gemma) if q_norm is not None else None,
        k_norm=_norm_weight(k_norm, gemma) if k_norm is not None else None,
        post_attn_norm=post_attn, post_ffn_norm=post_ffn, moe=moe, window=window, rope=rope,
    )


def _moe_weights(mlp: Any, matmul: str) -> MoEWeights:
    """Qwen3-MoE / Mixtral: ``gate`` (the router, ``top_k``; Qwen3 ``norm_topk_prob``, Mixtral always
    renormalises) and ``experts`` with ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    router, experts = mlp.gate, mlp.experts
    n = experts.gate_up_proj.shape[0]
    return MoEWeights(
        router=router.weight.detach(),
        gate_up=[FastLinear(experts.gate_up_proj[e], None, path=matmul) for e in range(n)],
        down=[FastLinear(experts.down_proj[e], None, path=matmul) for e in range(n)],
        top_k=int(router.top_k), normalise=bool(getattr(router, "norm_topk_prob", True)))


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
        local: set by ``decode`` once per forward for each sliding window of the model: the same rows whose mask
            also hides keys ``window`` or more positions behind each row (``ops.windowed``).
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
    local: dict[int, "Rows"] = field(default_factory=dict)  # per sliding window: these rows with its mask

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
    rows.local = {win: ops.windowed(rows, win, w) for win in w.windows}
    # [R, H], a fresh tensor (the residual is updated in place)
    x = F.embedding(rows.ids, w.embed) if isinstance(w.embed, torch.Tensor) else w.embed.rows(rows.ids)
    if w.embed_scale is not None:
        x = x * w.embed_scale
    tables = [(cos[rows.pos], sin[rows.pos]) for cos, sin in w.rope_tables]  # [R, 1, D] each
    for li, layer in enumerate(w.layers):
        seen = rows.local[layer.window] if layer.window else rows
        cos, sin = tables[layer.rope]
        h = ops.rms_norm(x, layer.ln_in, w.eps)
        q = ops.rope_kv(ops.linear(h, layer.qkv), cos, sin, kv[li], layer, seen, w)  # [R, nq, d]
        x = _add_branch(ops, x, ops.attention(q, kv[li], seen, w), layer.o, layer.post_attn_norm, w.eps)
        h = ops.rms_norm(x, layer.ln_post, w.eps)
        if layer.moe is not None:
            x = _add_out(ops, x, ops.moe(h, layer.moe, w.act), layer.post_ffn_norm, w.eps)
        elif w.act == "silu" and layer.post_ffn_norm is None:
            x = ops.linear_add(x, ops.silu_mul(ops.linear(h, layer.gate_up)), layer.down)
        else:
            x = _add_branch(ops, x, ops.act_mul(ops.linear(h, layer.gate_up), w.act), layer.down,
                            layer.post_ffn_norm, w.eps)
    return ops.rms_norm(x, w.final_norm, w.eps)


def _add_branch(ops: Any, x: torch.Tensor, y: torch.Tensor, lin: FastLinear, norm: Optional[torch.Tensor],
                eps: float) -> torch.Tensor:
    """``x + lin(y)`` (fused where the ops fuse it), or Gemma's ``x + norm(lin(y))``."""
    if norm is None:
        return ops.linear_add(x, y, lin)
    return _add_out(ops, x, ops.linear(y, lin), norm, eps)


def _add_out(ops: Any, x: torch.Tensor, y: torch.Tensor, norm: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return x + (y if norm is None else ops.rms_norm(y, norm, eps))


def _window_mask(mask: torch.Tensor, pos: torch.Tensor, window: int, neg: float) -> torch.Tensor:
    """A copy of the additive ``mask [..., S]`` (rows' leading shape as ``pos``'s, e.g. ``[R, S]`` with ``pos
    [R]``, or ``[B, 1, N, S]`` with ``pos`` of ``B * N`` rows) with the columns of keys ``window`` or more
    positions behind each row hidden, as transformers' sliding-window masks (a query at position q sees keys at
    positions > q - window). Column c holds position c for the committed prefix; a tree's own rows are never that
    far behind their descendants (``StaticRunner`` keeps trees within the window), so columns stand for
    positions."""
    cols = torch.arange(mask.shape[-1], device=mask.device)
    far = cols <= (pos - window).view(*mask.shape[:-1], 1)
    return mask.masked_fill(far, neg)


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
            rows.causal_mask = prefill_mask(t, rows.start0, w.dtype, rows.ids.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        if lin.stored is not None:
            return lin(x)
        return self.ops.linear(x, lin._panels, lin.bias, lin.n)

    def linear_add(self, x: torch.Tensor, y: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        if lin.stored is not None:
            return lin.stored_into(x, y, add=True)
        return self.ops.linear_add_(x, y, lin._panels, lin.bias)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gu)

    def act_mul(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        return self.ops.silu_mul(gu) if act == "silu" else act_mul(gu, act)

    def moe(self, h: torch.Tensor, moe: MoEWeights, act: str) -> torch.Tensor:
        return moe_forward(h, moe, self.linear, act)

    def windowed(self, rows: Rows, window: int, w: DecoderWeights) -> Rows:
        """``rows`` with each row's keys ``window`` or more positions behind hidden (``rows`` itself when no row
        is that far along); a prompt chunk then attends through an explicit mask."""
        if int(rows.pos.max()) < window:
            return rows
        neg = torch.finfo(w.dtype).min
        if rows.mask is not None:
            return replace(rows, mask=_window_mask(rows.mask, rows.pos, window, neg))
        t = rows.ids.shape[0]
        base = rows.causal_mask if rows.causal_mask is not None else prefill_mask(t, rows.start0, w.dtype,
                                                                                   rows.ids.device)
        return replace(rows, attend="sdpa" if t >= SDPA_MIN_ROWS else "masked",
                       causal_mask=_window_mask(base, rows.pos, window, neg))

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

    def release(self) -> None:
        """Drop the reused logits buffer (a warm-up's or cost curve's largest verify sized it); the next ``head``
        allocates one for its rows (at least 64)."""
        self._logits = self._logits[:0].clone()

    def head(self, hidden: torch.Tensor, w: DecoderWeights) -> torch.Tensor:
        """Logits ``[R, V]`` written into one reused buffer (valid until the next call), so a step allocates no
        multi-MB tensor (glibc would map and unmap it every step and its heap would drift by as much)."""
        r = hidden.shape[0]
        if self._logits.shape[0] < r:
            self._logits = torch.empty((max(r, 64), w.lm_head.n), dtype=hidden.dtype)
        if w.lm_head.stored is not None:
            return w.lm_head.stored_into(self._logits[:r], hidden, add=False)
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
                rows.causal_mask = prefill_mask(n, rows.start0, w.dtype, rows.ids.device).view(1, 1, n, rows.span)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return lin(x)

    def linear_add(self, x: torch.Tensor, y: torch.Tensor, lin: FastLinear) -> torch.Tensor:
        return x + lin(y)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return act_mul(gu, "silu")

    def act_mul(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        return act_mul(gu, act)

    def moe(self, h: torch.Tensor, moe: MoEWeights, act: str) -> torch.Tensor:
        """Routed experts; while a CUDA graph is being captured, every expert over every row (graph-safe)."""
        dense = h.is_cuda and torch.cuda.is_current_stream_capturing()
        return moe_forward(h, moe, self.linear, act, dense=dense)

    def windowed(self, rows: Rows, window: int, w: DecoderWeights) -> Rows:
        """``rows`` with each row's keys ``window`` or more positions behind hidden. On CUDA always (no host read
        of the positions, so a CUDA graph can capture it); elsewhere ``rows`` itself when no row is that far
        along. A prompt chunk then attends through an explicit mask."""
        if not rows.ids.is_cuda and int(rows.pos.max()) < window:
            return rows
        neg = torch.finfo(w.dtype).min
        if rows.mask is not None:
            return replace(rows, mask=_window_mask(rows.mask, rows.pos, window, neg))
        n, span = rows.write.shape[1], rows.span
        base = rows.causal_mask if rows.causal_mask is not None else \
            prefill_mask(n, rows.start0, w.dtype, rows.ids.device).view(1, 1, n, span)
        return replace(rows, attend="masked", causal_mask=_window_mask(base, rows.pos, window, neg))

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
