"""Forward passes of the target model: prefill, tree verification, KV-cache pruning.

Uses only public transformers hooks (docs/method.md 10.4): the decoder's ``cache=`` keyword with a
``DynamicCache``, explicit ``position_ids`` and a 4D additive attention mask. Logits are computed by the
output layer from the decoder's hidden states, so the prefill never materialises ``[prompt_len, vocab]``
logits at once (docs/method.md 9.9): it computes the copy-logit top-k in chunks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..models import ModelBundle, hf_model
from .decoder import layer_windows, tree_mask_filler
from .static_runner import StaticRunner, describe_unsupported
from .tree import FlatTrees

if TYPE_CHECKING:  # transformers' cache classes are imported where the eager runner runs, not by the worker
    from transformers import DynamicCache

PREFILL_TOPK_CHUNK = 256  # prompt positions per output-layer chunk at prefill
log = logging.getLogger(__name__)



def output_transform(config):
    """What a family's causal-LM head does to ``lm_head(hidden)`` before returning logits, as a function of the
    float logits (None: nothing): ``final_logit_softcapping`` (Gemma 2/3: ``cap * tanh(x / cap)``),
    ``logit_scale`` (Cohere: ``x * scale``), ``logits_scaling`` (Granite: ``x / scaling``). The per-family oracle
    tests (tests/engine/test_eager_families.py) hold the eager logits to the full forward's."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    div = getattr(config, "logits_scaling", None)
    scale, div = (None if v in (None, 1) else v for v in (scale, div))  # 1 and 1.0: nothing to do
    if not cap and scale is None and div is None:
        return None

    def apply(x: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            x = x * scale
        if div is not None:
            x = x / div
        if cap:
            x = torch.tanh(x / cap) * cap
        return x

    return apply


class ModelRunner:
    """Runs the target model for one row at a time (batch size 1) on the stock transformers forward
    (``decoding.runner: eager``; the automatic fallback for architectures the static runner does not cover)."""

    kind = "eager"

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.model = hf_model(bundle)  # an as-stored bundle's weights expanded: the eager forward needs tensors
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.device = torch.device(bundle.device)
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config
        self.windows = layer_windows(config)
        self._transform = output_transform(config)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, V]`` logits of hidden states ``[T, H]``: the output layer, then the family's own transform."""
        out = self.lm_head(hidden)
        return out if self._transform is None else self._transform(out)

    def new_cache(self, needed_len: int = 0) -> DynamicCache:
        """A fresh cache for one row (``needed_len`` is a hint the growing ``DynamicCache`` does not need). Every
        layer keeps every position, sliding-window layers too (their window is in the verify mask), so that
        ``keep_rows`` indexes every layer by the same positions."""
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, cache: DynamicCache, topk: int,
                rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward the whole prompt into ``cache``.

        Args:
            rows: sorted prompt positions whose top-k is wanted (``last_positions``); None: every position.

        Returns:
            (last-position logits ``[V]`` float32, top-``topk`` next-token ids ``[P, topk]`` int64 on the CPU,
            -1 in the rows not asked for, or None when topk == 0).
        """
        n = len(prompt_ids)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        pos = torch.arange(n, device=self.device).unsqueeze(0)  # [1, P]
        hidden = self.decoder(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).last_hidden_state[0]
        last_logits = self.logits(hidden[-1:]).float()[0]  # [V]
        top = None
        if topk > 0:
            want = torch.arange(n) if rows is None else torch.as_tensor(np.asarray(rows, dtype=np.int64))
            picked = hidden if rows is None else hidden.index_select(0, want.to(hidden.device))
            top = torch.full((n, topk), -1, dtype=torch.long)
            for start in range(0, picked.shape[0], PREFILL_TOPK_CHUNK):
                chunk = self.logits(picked[start : start + PREFILL_TOPK_CHUNK])  # [c, V]
                top[want[start : start + PREFILL_TOPK_CHUNK]] = torch.topk(chunk, topk, dim=-1).indices.cpu()
        return last_logits, top

    @torch.inference_mode()
    def verify(
        self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache: DynamicCache
    ) -> torch.Tensor:
        """One forward over a flattened draft tree; returns logits ``[T, V]`` (model dtype). ``attention_mask``:
        one additive ``[1, 1, T, S]`` mask, or a dict of them by layer kind (``layer_windows``)."""
        hidden = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        ).last_hidden_state[0]
        return self.logits(hidden)

    def warmup(self, capacities=()) -> dict[int, float]:
        """Nothing to prepare on the eager path (the static runner packs weights / compiles here)."""
        return {}

    def release(self, cache: DynamicCache) -> None:
        """Nothing to give back: a ``DynamicCache`` is freed with the row."""

    def step_sizes(self, largest: int) -> tuple[int, ...]:
        """Tree sizes up to ``largest`` after which this runner's verify cost steps up (none known here)."""
        return ()

    @torch.inference_mode()
    def verify_flat(self, flat: FlatTrees) -> torch.Tensor:
        """Several streams' draft trees (``tree.FlatTrees``), one transformers forward per stream (no batched
        forward on the eager path): stream ``b``'s rows at positions ``starts[b] + depths`` over its
        ``DynamicCache`` of ``starts[b]`` rows, with the additive mask of its prefix and tree ancestors
        (``decoder.fill_tree_mask``). Returns logits ``[R, V]`` (model dtype) in ``flat``'s row order."""
        neg = float(torch.finfo(self.dtype).min)
        out = []
        for b in range(flat.num_streams):
            lo, hi, start = int(flat.cu[b]), int(flat.cu[b + 1]), int(flat.starts[b])
            t = hi - lo
            mask = torch.empty((t, start + t), dtype=self.dtype)
            tree_mask_filler()(mask, np.array([0, t], dtype=np.int64), flat.parents[lo:hi],
                               np.array([start], dtype=np.int64), neg)
            ids = torch.from_numpy(np.ascontiguousarray(flat.tokens[lo:hi], dtype=np.int64)).view(1, t)
            pos = torch.from_numpy(np.asarray(flat.depths[lo:hi], dtype=np.int64) + start).view(1, t)
            masks = {kind: _windowed(mask, pos[0], start, w, neg).view(1, 1, t, start + t).to(self.device)
                     for kind, w in self.windows.items()}
            out.append(self.verify(input_ids=ids.to(self.device), position_ids=pos.to(self.device),
                                   attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
                                   cache=flat.caches[b]))
        return out[0] if len(out) == 1 else torch.cat(out)

    def verify_tree(self, tree, *, cache: DynamicCache) -> torch.Tensor:
        """One forward over a flattened draft tree (``tree.TreeInputs``); returns logits ``[T, V]``."""
        return self.verify_flat(FlatTrees.of([(tree, cache)]))

    def verify_batch(self, items) -> list[torch.Tensor]:
        """Several streams' trees ``[(tree, cache), ...]`` (``verify_flat``); logits ``[T_b, V]`` per item."""
        flat = FlatTrees.of(list(items))
        logits = self.verify_flat(flat)
        return [logits[int(flat.cu[b]) : int(flat.cu[b + 1])] for b in range(flat.num_streams)]

    @staticmethod
    def keep_rows(cache: DynamicCache, *, committed_len: int, nodes: list[int]) -> None:
        """Keep the committed prefix plus the KV rows of the accepted tree ``nodes`` (flattened indices).

        The cache holds ``committed_len + T`` rows after a verify; afterwards it holds
        ``committed_len + len(nodes)``. A contiguous prefix of the tree (a chain) is a plain crop.
        """
        n = len(nodes)
        if nodes == list(range(n)):
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, : committed_len + n]
                layer.values = layer.values[:, :, : committed_len + n]
            return
        device = cache.layers[0].keys.device
        idx = torch.cat(
            [torch.arange(committed_len, device=device), torch.tensor(nodes, device=device) + committed_len]
        )
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)

    def keep_rows_batch(self, caches: list, starts: np.ndarray, paths: np.ndarray, cu_paths: np.ndarray, *,
                        moved: np.ndarray | None = None) -> None:
        """``keep_rows`` per stream: stream ``b`` keeps ``paths[cu_paths[b] : cu_paths[b + 1]]`` (local node
        indices, root first) after its ``starts[b]`` committed rows. ``moved``: accepted and unused here (the
        static runner's shortcut, ``KVCache.keep_rows_batch``)."""
        for b, cache in enumerate(caches):
            nodes = [int(n) for n in paths[int(cu_paths[b]) : int(cu_paths[b + 1])]]
            self.keep_rows(cache, committed_len=int(starts[b]), nodes=nodes)


def _windowed(mask: torch.Tensor, qpos: torch.Tensor, start: int, window: int | None, neg: float) -> torch.Tensor:
    """The tree mask ``[T, start + T]`` with keys at or beyond ``window`` positions behind their query hidden
    (a query at position q sees keys at positions p > q - window, as transformers' sliding-window masks);
    ``mask`` itself where ``window`` is None. Key j < start sits at position j, tree key i at ``qpos[i]``."""
    if window is None:
        return mask
    kpos = torch.cat([torch.arange(start, dtype=torch.long), qpos])
    far = kpos[None, :] <= qpos[:, None] - int(window)
    return mask.masked_fill(far, neg)


@torch.inference_mode()
def check_tree_verify(runner: ModelRunner, *, seed: int = 0) -> float:
    """Hold the eager runner to the model's own full-sequence forward on one branching tree (a 12-token random
    prompt, a 5-node tree with two branches), for a family no oracle test covers (``models.
    EAGER_TESTED_ARCHITECTURES``): a family whose forward ignores a custom 4D mask or explicit positions, or whose
    head transforms the logits in a way ``output_transform`` does not know, fails here instead of drafting wrong.

    Returns the largest difference relative to the largest logit. Raises:
        ValueError: the difference is above 1e-3 (float32) or 5e-2 (16-bit), naming the family.
    """
    from ..drafters.base import Draft
    from .tree import flatten_tree

    vocab = runner.bundle.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (12,), generator=gen).tolist()
    draft = Draft(torch.randint(0, vocab, (5,), generator=gen).tolist(), [-1, 0, 0, 1, 2], [0] * 5)
    cache = runner.new_cache()
    runner.prefill(prompt, cache=cache, topk=0)
    tree = flatten_tree(draft, committed_len=len(prompt), device=runner.device, dtype=runner.dtype)
    logits = runner.verify_tree(tree, cache=cache).float()
    worst = 0.0
    for path in tree.paths:
        nodes = [int(n) for n in path if n >= 0]
        ids = torch.tensor([prompt + [int(tree.tokens[n]) for n in nodes]], device=runner.device)
        want = runner.model(input_ids=ids).logits[0, len(prompt):].float()
        worst = max(worst, float((logits[nodes] - want).abs().max()) / max(float(want.abs().max()), 1.0))
    tol = 1e-3 if runner.dtype == torch.float32 else 5e-2
    if worst > tol:
        family = getattr(runner.model.config, "model_type", "?")
        raise ValueError(f"architecture {family!r}: a tree verified with a 4D attention mask and explicit positions "
                         f"does not match the model's own forward (relative difference {worst:.2g} > {tol}); its "
                         "transformers implementation does not honour the mask, so RACER cannot run it")
    return worst


def make_runner(bundle: ModelBundle, *, kind: str = "auto", compile: str = "auto"):
    """The verify runner for ``decoding.runner`` (``auto`` | ``eager`` | ``static``).

    ``auto`` takes the static runner (engine/static_runner.py) when ``describe_unsupported`` finds nothing
    against the model, else the eager ``ModelRunner``, and logs why. ``compile``: CUDA graphs of the static
    runner's verify step per (streams, tree) bucket on CUDA: ``auto`` and ``on`` there, ``off`` never; on the CPU
    there is nothing to compile (``on`` logs a warning and runs uncompiled: the torch.compile'd CPU step was
    ~30x slower, benchmarks/verify-compile-20261201-105108.md, and was removed).

    Raises:
        ValueError: ``static`` for a model the static runner cannot run, an unknown kind, or an eager runner on a
            family no oracle test covers that fails ``check_tree_verify``.
    """
    if kind not in ("auto", "eager", "static"):
        raise ValueError(f"decoding.runner must be auto, eager or static, got {kind!r}")
    if kind == "eager":
        return _eager(bundle)
    why = describe_unsupported(bundle)
    if why is not None:
        if kind == "static":
            raise ValueError(f"decoding.runner 'static' cannot run {bundle.name}: {why}; use 'eager' or 'auto'")
        log.info("static runner unavailable for %s (%s): using the eager runner", bundle.name, why)
        return _eager(bundle)
    on_cuda = str(bundle.device).startswith("cuda")
    want_compile = compile == "on" or (compile == "auto" and on_cuda)
    return StaticRunner(bundle, compile=want_compile)


def _eager(bundle: ModelBundle) -> ModelRunner:
    """The eager runner; checked on the model itself (``check_tree_verify``) where no oracle test covers its family."""
    from ..models import EAGER_TESTED_ARCHITECTURES

    runner = ModelRunner(bundle)
    family = getattr(bundle.config, "model_type", None)
    if family not in EAGER_TESTED_ARCHITECTURES:
        worst = check_tree_verify(runner)
        log.info("family %r has no oracle test: its tree verify matched its own forward (relative difference "
                 "%.2g)", family, worst)
    return runner
