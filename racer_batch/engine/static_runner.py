"""The static verify runner: our own lean decoder over the HF weights and a preallocated KV cache with a slot
per stream; one verify call for several streams' draft trees (``verify_flat``).

Why our own decoder: the stock transformers forward re-concatenates a ``DynamicCache`` every step, runs
separate q/k/v and gate/up matmuls through plain MKL sgemm and pays Python dispatch for every module; on a
small model that overhead is larger than the arithmetic (measurements: benchmarks/README.md, "Measurement
history", Verify runner). The decoder (engine/decoder.py) is the Llama family's computation written out once
(RMSNorm, rotary positions, grouped-query attention, gated MLP), with each family's variations as data on its
weights: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), SmolLM, Phi-3, Gemma 3 (text),
Qwen3-MoE and Mixtral, sliding-window layers included. ``describe_unsupported`` names what it cannot run; the engine
then falls back to the eager ``ModelRunner`` (``decoding.runner: auto``). The transformers forward stays the
test oracle (tests/engine/test_static_runner.py).

The runner ties together the decoder (``decoder.decode`` over ``DecoderWeights``, on our CPU kernels or torch
ops), the KV cache (engine/kv_cache.py: slots, growth, ``keep_rows``, the memory check) and, on CUDA with
``compile``, the CUDA graphs of the padded step (engine/graphs.py). A verify takes one of three paths
(``last_batch_path``):

- ``segments`` (our CPU kernels, the float32 CPU default): the streams' trees unpadded, one after another;
- ``padded`` (torch ops: CUDA without graphs, bfloat16 or no kernels on the CPU): one ``[B_pad, N_pad]`` step
  over the slot range the streams span, each tree padded to the largest;
- ``padded-graph`` (CUDA with ``compile``): the same step with bucketed shapes, replayed as a CUDA graph.

Padding rows are leaves under their slot's first row (they see the prefix, that row and themselves), no real
row attends to them, and their logits are dropped, so they can never be accepted.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .._delegate import delegated
from ..models import STATIC_ARCHITECTURES, ModelBundle
from .decoder import DecoderWeights, KernelOps, Rows, TorchOps, decode, tree_mask_filler
from .decoder_ops import MATMUL_PATHS, default_matmul_path
from .graphs import CudaGraphs
from .kernels import calibrate_stored_rows, fused_argmax_topk
from .kv_cache import MAX_SLOTS, KVCache, SlotCache, trim_heap
from .tree import FlatTrees

log = logging.getLogger(__name__)

__all__ = ["StaticRunner", "SlotCache", "describe_unsupported", "pick_bucket", "DEFAULT_BUCKETS", "MAX_SLOTS"]

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# KV positions per slot allocated at start (grows on demand, doubling, up to the context): on CUDA room for a
# typical row up front, so captured graphs survive the first rows; on the CPU, which captures none, a small start
# keeps an idle worker's memory down (a 135M model's 2,048 positions are 94 MB per slot, issue 31)
INITIAL_POSITIONS = 2048
INITIAL_POSITIONS_CPU = 512
PREFILL_CHUNK = 512  # prompt tokens per prefill forward (bounds the [chunk, S] attention scores)
PREFILL_TOPK_CHUNK = 64  # prompt positions per output-layer chunk at prefill: the head's reused logits buffer
# (KernelOps.head) stays at its 64-row start ([64, V] float32: 12.6 MB on SmolLM2; 256 rows kept 50 MB for good)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
STREAM_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # padded stream counts of the captured steps


def describe_unsupported(model: Any) -> Optional[str]:
    """Why the lean decoder cannot run ``model`` (a HF model, or a ``ModelBundle``) exactly, or None when it can.

    Checks the family (``models.STATIC_ARCHITECTURES``), the module structure (a Llama-style decoder:
    ``model.layers[i].self_attn.{q,k,v,o}_proj`` or Phi-3's ``qkv_proj``; ``mlp.{gate,up,down}_proj``, Phi-3's
    ``gate_up_proj`` or a routed ``mlp.experts``; RMSNorms), the activation (SiLU, or Gemma's tanh GELU), the rope
    type and partial rotation, and what no layer of the decoder computes (logit soft-capping, bidirectional
    attention).
    A plain as-stored bundle (no HF model: weights/plain.py) is checked on its config; its layout is its weights'
    names, which ``DecoderWeights.of_stored`` reads (a missing one raises there).
    """
    if isinstance(model, ModelBundle):
        if model.model is None:  # a plain bundle
            return _config_unsupported(model.config)
        model = model.model
    return _config_unsupported(model.config) or _layout_unsupported(model)


def _config_unsupported(cfg: Any) -> Optional[str]:
    """``describe_unsupported``'s checks of the config alone."""
    if getattr(cfg, "model_type", None) not in STATIC_ARCHITECTURES:
        return f"architecture {getattr(cfg, 'model_type', None)!r} has no static decoder"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
        return f"activation {act!r} is neither SiLU nor the tanh GELU"
    why = _rope_unsupported(cfg)
    if why:
        return why
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"{name} is set (the eager runner applies it)"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def _rope_unsupported(cfg: Any) -> Optional[str]:
    """The rope settings the decoder's precomputed tables cannot hold (Gemma 3: one dict per layer kind)."""
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return None
    nested = [v for v in rope.values() if isinstance(v, dict)]
    for params in nested or [rope]:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            return f"rope type {rope_type!r} depends on the sequence length"
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            return f"partial rotary embedding (partial_rotary_factor {factor})"
    return None


def _layer_needs(layer: Any) -> list[str]:
    """The attribute paths ``DecoderWeights.of`` reads from one decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ["qkv_proj"] if hasattr(attn, "qkv_proj") else ["q_proj", "k_proj", "v_proj"]
    need = [f"self_attn.{n}.weight" for n in [*qkv, "o_proj"]]
    if hasattr(mlp, "experts"):
        need += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight", "mlp.gate.top_k"]
    else:
        gate_up = ["gate_up_proj"] if hasattr(mlp, "gate_up_proj") else ["gate_proj", "up_proj"]
        need += [f"mlp.{n}.weight" for n in [*gate_up, "down_proj"]]
    return need + ["input_layernorm.weight", "post_attention_layernorm.weight"]


def _layout_unsupported(model: Any) -> Optional[str]:
    try:
        dec = model.get_decoder()
        for obj, path in [(layer, p) for layer in dec.layers for p in _layer_needs(layer)] + [
                (dec, "norm.weight"), (dec, "rotary_emb")]:
            for part in path.split("."):
                obj = getattr(obj, part)
    except AttributeError as exc:
        return f"module layout differs from the families the decoder covers ({exc})"
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


class StaticRunner:
    """Runs the target model with a static KV cache: one stream per slot, one or several streams per forward.

    The same calls as the eager ``ModelRunner`` (``new_cache``, ``prefill``, ``verify_flat``, ``verify_tree``,
    ``verify_batch``, ``keep_rows``, ``keep_rows_batch``), so the engine's step loop does not know which runs.

    Args:
        bundle: the loaded target model (a Llama-family checkpoint; see ``describe_unsupported``).
        slots: streams the KV cache holds at start (more are added on demand: `reserve_slots`, `new_cache`).
        max_slots: the most slots ``new_cache`` grows to (a leak of rows that never release theirs stops
            there with an error instead of taking memory without bound).
        max_len: KV positions per slot at start (at least one bucket + 1; 0: the context or
            ``INITIAL_POSITIONS`` (``INITIAL_POSITIONS_CPU`` on the CPU), whichever is smaller, plus one bucket of
            tree padding); grows on demand up to the context (growing drops the captured CUDA graphs, which are
            captured again lazily).
        buckets: the padded tree sizes of the captured CUDA graphs.
        matmul: ``auto`` | ``torch`` | ``small_gemm`` | ``onednn_packed`` (``default_matmul_path``).
        compile: CUDA graphs of the padded step per ``(B_pad, N_pad)`` bucket, on CUDA; asked for elsewhere it
            logs a warning and runs uncompiled.

    Raises:
        ValueError: the model is not one the lean decoder can run (``describe_unsupported``), a bad setting, or
            the start KV cache does not fit in memory.
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
        why = describe_unsupported(bundle)
        if why is not None:
            raise ValueError(f"static runner cannot run {bundle.name}: {why}; use decoding.runner 'eager'")
        if matmul not in MATMUL_PATHS:
            raise ValueError(f"matmul path {matmul!r} is not one of {MATMUL_PATHS}")
        if slots < 1 or max_slots < slots:
            raise ValueError(f"need 1 <= slots <= max_slots, got slots={slots}, max_slots={max_slots}")
        self.bundle = bundle
        self.device = torch.device(bundle.device)
        self.dtype = next(bundle.model.parameters()).dtype if bundle.model is not None else torch.float32
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.context_length = int(bundle.context_length)
        path = default_matmul_path(self.device, self.dtype) if matmul == "auto" else matmul
        stored = getattr(bundle, "stored", None)
        if bundle.model is None:  # a plain as-stored bundle: its weights by name, no HF modules
            self.weights = DecoderWeights.of_stored(bundle.config, stored, context_length=self.context_length)
        else:
            self.weights = DecoderWeights.of(bundle.model, matmul=path, context_length=self.context_length,
                                             stored=stored.weights if stored is not None else None)
        self.layers = self.weights.layers
        self.lm_head = self.weights.lm_head
        self.matmul = self.lm_head.path  # what runs (a path that cannot take this weight fell back)
        # our CPU kernels for everything around the matmuls too (norms, rope + KV write, attention, SiLU): one
        # call each instead of 3-10 aten ops, which cost more than the arithmetic at a few rows
        self._ops = self.lm_head._ops if self.matmul in ("small_gemm", "stored") else None
        self.ops: Any = KernelOps(self._ops) if self._ops is not None else TorchOps()
        if self.matmul == "stored":  # which of the stored GEMM's two paths runs at which row count, on this CPU
            calibrate_stored_rows(self._ops, max((lin for lin in self.layers[0].linears() if lin.stored is not None),
                                                 key=lambda lin: lin.n))
        if compile and self.device.type != "cuda":
            log.warning("compile on the CPU is not supported (the compiled step measured ~30x slower than the "
                        "uncompiled runner: benchmarks/verify-compile-20261201-105108.md); running uncompiled")
            compile = False
        self.compiled = self.compile_requested = bool(compile)  # CUDA graphs of the padded step
        self.graphs: Optional[CudaGraphs] = CudaGraphs(self.device, self.dtype) if self.compiled else None
        self.last_batch_path = ""  # how the last verify ran: segments | padded | padded-graph
        self.warmup_s: dict[int, float] = {}
        self._mask_buf = torch.empty(0, dtype=self.dtype)  # reused CPU buffer of the verify mask (_flat_mask)
        self._fill_mask: Optional[Callable[..., Any]] = None  # decoder.tree_mask_filler(), on the first use
        self._mask_neg = float(torch.finfo(self.dtype).min)
        # sized for a typical row up front, so warm-up graphs survive the first rows
        initial = INITIAL_POSITIONS if self.device.type == "cuda" else INITIAL_POSITIONS_CPU
        start = int(max_len) if max_len > 0 else min(self.context_length, initial) + self.buckets[-1]
        w = self.weights
        self.kv_cache = KVCache((len(w.layers), w.n_kv, w.head_dim), dtype=self.dtype, device=self.device,
                                context_length=self.context_length, pad=self.buckets[-1], slots=slots,
                                max_slots=max_slots, start_len=max(start, self.buckets[-1] + 1), kernels=self._ops)
        w.cover(self.kv_cache.max_len)

    # ---- the KV cache (engine/kv_cache.py)
    kv = delegated("kv_cache.kv", "``[layers, 2, slots, kv_heads, max_len, head_dim]`` (a tensor).")
    max_len = delegated("kv_cache.max_len", "Positions each slot holds now (int).")
    slots = delegated("kv_cache.slots", "Slots allocated now (int).")
    max_slots = delegated("kv_cache.max_slots", "Most slots the cache may grow to (int).")
    _free_slots = delegated("kv_cache.free_slots")  # list[int]
    kv_bytes_per_token = delegated("kv_cache.bytes_per_token", "KV-cache bytes one position of one slot takes: "
                                   "layers x 2 x kv_heads x head_dim x dtype bytes (int).")
    kv_bytes_per_slot = delegated("kv_cache.bytes_per_slot", "KV-cache bytes one slot takes at max_len (int).")

    def _changed(self) -> None:
        """The KV cache was reallocated: the rotary tables cover its length, captured graphs are dropped."""
        self.weights.cover(self.kv_cache.max_len)
        if self.graphs is not None:
            self.graphs.clear()

    def _grow(self, need: int) -> None:
        if self.kv_cache.grow(need):
            self._changed()

    def new_cache(self, needed_len: int = 0) -> SlotCache:
        """Take the lowest free slot for one row that will hold up to ``needed_len`` positions (prompt + new
        tokens); when every slot is taken, one more slot is added, up to ``max_slots``.

        Raises:
            RuntimeError: ``max_slots`` slots are taken (rows that never released theirs).
            ValueError: the cache would not fit in memory (``kv_cache.KVCache.check_fits``).
        """
        slots = self.kv_cache.slots
        cache = self.kv_cache.take()
        if self.kv_cache.slots != slots:
            self._changed()
        try:
            self._grow(needed_len + self.buckets[-1])
        except ValueError:
            cache.release()
            raise
        return cache

    def reserve_slots(self, n: int) -> None:
        """Make the static KV cache hold at least ``n`` slots (streams), copying what is cached. Slots are never
        taken back; a larger cache drops the captured CUDA graphs (captured again lazily).

        Raises:
            ValueError: more than ``max_slots``, or ``n`` slots at the current length do not fit in the device's
                memory (the message names the bytes and the settings to lower).
        """
        if self.kv_cache.reserve(n):
            self._changed()

    @staticmethod
    def release(cache: SlotCache) -> None:
        """Give the row's slot back (idempotent)."""
        cache.release()

    @staticmethod
    def keep_rows(cache: SlotCache, *, committed_len: int, nodes: Sequence[int]) -> None:
        """Keep the accepted tree ``nodes`` (flattened indices, root first): row ``committed_len + nodes[i]``
        moves to ``committed_len + i`` in place; the row then holds ``committed_len + len(nodes)`` positions."""
        cache.pool.keep_rows(cache, committed_len=committed_len, nodes=nodes)

    def keep_rows_batch(self, caches: Sequence[SlotCache], starts: np.ndarray, paths: np.ndarray,
                        cu_paths: np.ndarray, *, moved: Optional[np.ndarray] = None) -> None:
        """``keep_rows`` of every stream in one call: stream ``b`` keeps the tree nodes
        ``paths[cu_paths[b] : cu_paths[b + 1]]`` (local indices, root first, ascending) after its ``starts[b]``
        committed rows and then holds ``starts[b] + len(path)``; all moved rows of all streams in one gather
        and one scatter (``KVCache.keep_rows_batch``; ``moved`` as there)."""
        self.kv_cache.keep_rows_batch(caches, starts, paths, cu_paths, moved=moved)

    # ---- prefill
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
            hidden = decode(self.weights, self.kv, Rows.prefill(ids, cache.slot, start), self.ops)  # [c, H]
            last = hidden[-1:]
            if top is not None:
                self._prefill_topk(hidden, want, start, topk, top)
        cache.length = n
        last_logits = self.ops.head(last, self.weights).float()[0].clone()  # [V], its own copy (a reused buffer)
        if self.device.type == "cpu":
            trim_heap()  # the chunks' activations (tens of MB) back to the system, not kept by glibc
        return last_logits, top

    def _prefill_topk(self, hidden: torch.Tensor, want: torch.Tensor, start: int, k: int, top: torch.Tensor) -> None:
        """Top-``k`` ids of the asked-for positions of one prompt chunk into ``top``, the output layer in chunks
        of ``PREFILL_TOPK_CHUNK`` rows."""
        c = hidden.shape[0]
        here = want[(want >= start) & (want < start + c)]  # [c'] positions in this chunk
        picked = hidden if here.numel() == c else hidden.index_select(0, (here - start).to(hidden.device))
        for s in range(0, picked.shape[0], PREFILL_TOPK_CHUNK):
            logits = self.ops.head(picked[s : s + PREFILL_TOPK_CHUNK], self.weights)  # [c'', V]
            top[here[s : s + PREFILL_TOPK_CHUNK]] = self._topk(logits, k)

    def _topk(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Top-``k`` ids ``[T, k]`` (int64, CPU) of ``logits [T, V]``: one pass of our kernels where they run
        (``kernels.fused_argmax_topk``; equal values in index order), else torch.topk."""
        fused = fused_argmax_topk(logits, k, self._ops)
        return fused[1] if fused is not None else torch.topk(logits, k, dim=-1).indices.cpu()

    # ---- verify: one flat batch of draft trees
    @torch.inference_mode()
    def verify_flat(self, flat: FlatTrees) -> torch.Tensor:
        """One forward over several streams' draft trees, each over its own KV-cache slot (B = 1 included).

        Stream ``b``'s rows are ``flat.cu[b] : flat.cu[b + 1]`` (its tree breadth-first), at positions
        ``flat.starts[b] + flat.depths``; each row attends to its stream's committed prefix ``[0, starts[b])``
        and its tree ancestors and itself, and its keys/values are written at ``starts[b] + local index`` of
        the stream's slot. Our CPU kernels take the trees unpadded as segments (every GEMM once over all rows);
        torch ops take them as one padded ``[B_pad, N_pad]`` step, on CUDA with ``compile`` a CUDA graph.

        Returns:
            logits ``[R, V]`` (model dtype), row ``r`` the logits of ``flat`` row ``r``. It may be a buffer the
            runner reuses: valid until the next ``verify_flat`` / ``verify_tree`` / ``verify_batch`` /
            ``prefill`` call (clone to keep it).

        Raises:
            ValueError: two streams share a slot, or a stream has no rows.
        """
        sizes = flat.sizes()
        slots = [c.slot for c in flat.caches]
        if len(set(slots)) != len(slots):
            raise ValueError(f"verify_flat: streams share a KV-cache slot ({slots})")
        if len(sizes) == 0 or int(sizes.min()) < 1:
            raise ValueError(f"verify_flat: every stream needs at least one row (rows per stream {sizes.tolist()})")
        t_max = int(sizes.max())
        windows = self.weights.windows
        if windows and t_max > windows[0]:
            raise ValueError(f"verify_flat: a tree of {t_max} rows is longer than the sliding window "
                             f"({windows[0]} positions); lower decoding.capacity")
        if t_max > self.buckets[-1]:
            self.add_bucket(t_max)
        if self._ops is not None:
            return self._verify_segments(flat)
        return self._verify_padded(flat)

    def verify_tree(self, tree: Any, *, cache: SlotCache) -> torch.Tensor:
        """``verify_flat`` of one flattened draft tree (``tree.TreeInputs``) over the row's committed
        ``cache.length`` positions: logits ``[T, V]``, valid until the runner's next call."""
        return self.verify_flat(FlatTrees.of([(tree, cache)], starts=[cache.length]))

    def verify_batch(self, items: Sequence[tuple[Any, SlotCache]]) -> list[torch.Tensor]:
        """``verify_flat`` of ``[(tree, cache), ...]`` (distinct slots), each tree over its ``cache.length``
        committed positions: logits ``[T_b, V]`` per item, each its own tensor.

        Raises:
            ValueError: two items share a slot.
        """
        flat = FlatTrees.of(list(items), starts=[c.length for _, c in items])
        logits = self.verify_flat(flat)
        return [logits[int(flat.cu[b]) : int(flat.cu[b + 1])].clone() for b in range(flat.num_streams)]

    def _flat_mask(self, rows: int, span: int, cu: np.ndarray, parents: np.ndarray,
                   starts: np.ndarray) -> torch.Tensor:
        """The additive mask ``[rows, span]`` of a flat batch (``decoder.fill_tree_mask``, or the native one where
        it exists) in a reused CPU buffer (valid until the next call)."""
        if self._mask_buf.numel() < rows * span:
            self._mask_buf = torch.empty(max(rows * span, self.buckets[-1] * self.max_len), dtype=self.dtype)
        mask = self._mask_buf[: rows * span].view(rows, span)
        if self._fill_mask is None:  # decided once per runner (the module lookup reads the environment)
            self._fill_mask = tree_mask_filler()
        return self._fill_mask(mask, cu, parents, starts, self._mask_neg)

    def _verify_segments(self, flat: FlatTrees) -> torch.Tensor:
        """Our CPU kernels: the streams' rows one after another, unpadded (``rope_kv_seg_`` writes each row's
        KV into its own slot, ``attention_seg`` runs each stream's rows over its own slot)."""
        self.last_batch_path = "segments"
        need = int((flat.starts + flat.sizes()).max())
        self._grow(need)
        slots = np.fromiter((c.slot for c in flat.caches), np.int64, flat.num_streams)
        seg = torch.from_numpy(np.stack([slots, np.asarray(flat.starts, dtype=np.int64), flat.cu[:-1]], axis=1))
        rows = Rows(ids=torch.from_numpy(np.ascontiguousarray(flat.tokens, dtype=np.int64)),
                    pos=torch.from_numpy(flat.positions().astype(np.int64)), seg=seg,
                    mask=self._flat_mask(flat.rows, need, flat.cu, flat.parents, flat.starts), span=need)
        return self.ops.head(decode(self.weights, self.kv, rows, self.ops), self.weights)

    def _padded_shape(self, flat: FlatTrees, slots: np.ndarray) -> tuple[int, int, int]:
        """``(first slot, B_pad, N_pad)``: with CUDA graphs buckets (slots from 0, the stream bucket holding every
        slot, the tree bucket), else exact (the slot range the streams span, the largest tree)."""
        t_max = int(flat.sizes().max())
        if self.graphs is not None:
            b_pad = min(pick_bucket(int(slots.max()) + 1, STREAM_BUCKETS), self.slots)
            return 0, b_pad, pick_bucket(t_max, self.buckets)
        lo = int(slots.min())
        return lo, int(slots.max()) - lo + 1, t_max

    def _verify_padded(self, flat: FlatTrees) -> torch.Tensor:
        """Torch ops: one ``[B_pad, N_pad]`` step over the slots ``[lo, lo + B_pad)``. Every slot of the range
        gets ``N_pad`` rows: its stream's tree, then padding rows (leaves under its root; logits dropped); a slot
        not in the batch only padding rows, written past its committed rows (a live one's rows there are saved
        before and written back after the step)."""
        sizes = flat.sizes()
        slots = np.fromiter((c.slot for c in flat.caches), np.int64, flat.num_streams)
        lo, b_pad, n_pad = self._padded_shape(flat, slots)
        lengths = np.array([self.kv_cache.length_of(s) for s in range(lo, lo + b_pad)], dtype=np.int64)
        lengths[slots - lo] = flat.starts
        self._grow(int(lengths.max()) + n_pad)
        span = self.max_len if self.graphs is not None else int(lengths.max()) + n_pad
        local = np.arange(flat.rows, dtype=np.int64) - np.repeat(flat.cu[:-1], sizes)
        dest = np.repeat(slots - lo, sizes) * n_pad + local  # [R] each real row's row in the padded layout
        rows = b_pad * n_pad
        # a padding row is a leaf under its slot's row 0 (a tree per slot): it sees that root, the prefix and
        # itself, and no real row sees it
        ids, parents, depths = np.zeros(rows, np.int64), np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        parents[::n_pad] = -1
        ids[dest], parents[dest], depths[dest] = flat.tokens, flat.parents, flat.depths
        inputs = {"ids": torch.from_numpy(ids), "pos": torch.from_numpy(np.repeat(lengths, n_pad) + depths),
                  "write": torch.from_numpy((lengths[:, None] + np.arange(n_pad)[None, :]).reshape(-1)),
                  "mask": self._flat_mask(rows, span, np.arange(b_pad + 1, dtype=np.int64) * n_pad, parents, lengths)}
        # a live slot that sits the step out may hold a verified tree not yet kept where its padding rows write
        idle = [s for s in range(lo, lo + b_pad) if s in self.kv_cache.live and s not in set(slots.tolist())]
        saved = self.kv_cache.save_rows(idle, lengths[np.asarray(idle, dtype=np.int64) - lo], n_pad)
        logits = self._padded_step(lo, b_pad, n_pad, span, inputs)
        self.kv_cache.restore_rows(saved)
        return logits.index_select(0, torch.from_numpy(dest).to(logits.device))

    def _padded_step(self, lo: int, b_pad: int, n_pad: int, span: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[b_pad * n_pad, V]`` of the padded batch: replayed as the CUDA graph of ``(b_pad, n_pad)``,
        or ``decode`` on torch ops."""
        if self.graphs is not None:
            self.last_batch_path = "padded-graph"
            return self.graphs.run(b_pad, n_pad, inputs, capacity_rows=self.slots * self.buckets[-1],
                                   max_len=self.max_len, step=self._step)
        self.last_batch_path = "padded"
        dev = self.device
        rows = Rows(ids=inputs["ids"].to(dev), pos=inputs["pos"].to(dev), seg=torch.empty((0, 3), dtype=torch.long),
                    mask=inputs["mask"].to(dev).view(b_pad, 1, n_pad, span), span=span,
                    write=inputs["write"].to(dev).view(b_pad, n_pad), slot0=lo)
        return self._step(rows)

    def _step(self, rows: Rows) -> torch.Tensor:
        """Logits of ``rows``: ``decode`` and the output layer (what a CUDA graph captures)."""
        return self.ops.head(decode(self.weights, self.kv, rows, self.ops), self.weights)

    # ---- buckets, warm-up
    def step_sizes(self, largest: int) -> tuple[int, ...]:
        """Tree sizes up to ``largest`` after which the verify cost steps up, so a tree of exactly that size
        costs what a smaller one does: on our CPU kernels the row counts where the GEMM adds a pass of register
        blocks (multiples of 6 on AVX2; 6, then multiples of 12 on AVX-512), elsewhere the buckets.
        ``capacity: auto`` adds them to its candidates."""
        if self._ops is not None:
            return tuple(int(r) for r in self._ops.row_steps(largest))
        return tuple(b for b in self.buckets if b <= largest)

    def add_bucket(self, size: int) -> None:
        """Add the power-of-two bucket >= ``size`` (a capacity above the largest bucket): the tree padding
        allowance of the KV cache and the captured steps' buffers grow to it."""
        b = 1 << (int(size) - 1).bit_length()
        if b in self.buckets:
            return
        self.buckets = tuple(sorted((*self.buckets, b)))
        self.kv_cache.pad = self.buckets[-1]
        if self.graphs is not None:
            self.graphs.clear()
        log.info("static runner: tree size %d above the buckets; added bucket %d", size, b)

    def release_scratch(self) -> None:
        """After the warm-up and the cost curve (no row holds a slot): the KV pages they wrote given back on the
        CPU (``KVCache.fresh``), so an actor with room for more streams than it runs holds only what it uses, and
        the output layer's logits buffer sized by their largest verify (``KernelOps.release``)."""
        self.kv_cache.fresh()
        release = getattr(self.ops, "release", None)
        if release is not None:
            release()

    def warmup(self, capacities: Sequence[int] = ()) -> dict[int, float]:
        """Add the bucket of the largest of ``capacities`` and, with CUDA graphs, capture the step of every
        bucket up to it (all buckets when empty) for every stream count the slots allow; returns {bucket:
        seconds} and logs the total."""
        if capacities and max(capacities) > self.buckets[-1]:
            self.add_bucket(max(capacities))
        top = pick_bucket(max(capacities), self.buckets) if capacities else self.buckets[-1]
        t0 = time.perf_counter()
        for b in self.buckets:
            if b > top:
                break
            tb = time.perf_counter()
            if self.graphs is not None and not self.kv_cache.live:
                self._warm_graphs(b)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self.warmup_s[b] = time.perf_counter() - tb
        log.info("static runner warm-up (%s matmuls, buckets up to %d): %.2f s", self.matmul, top,
                 time.perf_counter() - t0)
        return dict(self.warmup_s)

    def _warm_graphs(self, n_pad: int) -> None:
        """Capture the step of tree bucket ``n_pad`` for every stream count the slots allow, on scratch rows:
        chains of ``n_pad`` zeros at position 0 of free slots (only while no row holds a slot)."""
        for b_pad in sorted({min(pick_bucket(k, STREAM_BUCKETS), self.slots) for k in range(1, self.slots + 1)}):
            caches = [self.new_cache(n_pad) for _ in range(b_pad)]
            try:
                zeros = np.zeros(b_pad * n_pad, dtype=np.int64)
                local = np.tile(np.arange(n_pad, dtype=np.int64), b_pad)
                self.verify_flat(FlatTrees(zeros, local - 1, local, np.arange(b_pad + 1, dtype=np.int64) * n_pad,
                                           np.zeros(b_pad, dtype=np.int64), caches))
            finally:
                for c in caches:
                    c.release()

    @property
    def packed_bytes(self) -> int:
        """Bytes held in prepacked weight copies."""
        return sum(lin.extra_bytes for lin in self.weights.linears())
