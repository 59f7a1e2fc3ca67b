"""Forward passes of the target model: prefill, tree verification, KV-cache pruning.

Uses only public transformers hooks (STYLE.md 15): the decoder's ``cache=`` keyword with a
``DynamicCache``, explicit ``position_ids`` and a 4D additive attention mask. Logits are computed by the
output layer from the decoder's hidden states, so the prefill never materialises ``[prompt_len, vocab]``
logits at once (RACER.md 9.9): it computes the copy-logit top-k in chunks.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..models import ModelBundle

PREFILL_TOPK_CHUNK = 256  # prompt positions per output-layer chunk at prefill


class ModelRunner:
    """Runs the target model for one row at a time (batch size 1)."""

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.model = bundle.model
        self.decoder = bundle.model.get_decoder()
        self.lm_head = bundle.model.get_output_embeddings()
        self.device = torch.device(bundle.device)
        self.dtype = next(bundle.model.parameters()).dtype

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, cache: DynamicCache, topk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward the whole prompt into ``cache``.

        Returns:
            (last-position logits ``[V]`` float32, top-``topk`` next-token ids at every prompt position
            ``[P, topk]`` on the CPU, or None when topk == 0).
        """
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        pos = torch.arange(len(prompt_ids), device=self.device).unsqueeze(0)  # [1, P]
        hidden = self.decoder(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).last_hidden_state[0]
        last_logits = self.lm_head(hidden[-1:]).float()[0]  # [V]
        top = None
        if topk > 0:
            parts = []
            for start in range(0, hidden.shape[0], PREFILL_TOPK_CHUNK):
                chunk = self.lm_head(hidden[start : start + PREFILL_TOPK_CHUNK])  # [c, V]
                parts.append(torch.topk(chunk, topk, dim=-1).indices.cpu())
            top = torch.cat(parts, dim=0)
        return last_logits, top

    @torch.inference_mode()
    def verify(
        self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """One forward over a flattened draft tree; returns logits ``[T, V]`` (model dtype)."""
        hidden = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        ).last_hidden_state[0]
        return self.lm_head(hidden)

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
