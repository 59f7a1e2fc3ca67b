"""The reference: plain autoregressive decoding with a KV cache, the oracle every drafter is tested
against (docs/method.md 10.3). Deliberately short and independent of the tree machinery."""

from __future__ import annotations

import time

import torch

from ..models import ModelBundle, hf_model
from ..values import GenerationParams, GenerationResult, RowStats, StepRecord
from .engine import Prompt, encode_prompt
from .sampling import draw, make_generator, processed_probs
from .stops import StopChecker


@torch.inference_mode()
def generate_reference(
    bundle: ModelBundle, prompt: Prompt, params: GenerationParams | None = None, *, system_prompt: str | None = None
) -> GenerationResult:
    """Autoregressive generation: one forward per token through the model's own default mask.

    Same inputs, stop rules and sampler as ``Engine.generate``; greedy output equals HF ``generate``.

    Raises:
        ValueError: as ``Engine.generate``.
    """
    params = params or GenerationParams()
    model = hf_model(bundle)  # the stock forward: an as-stored bundle's weights expanded to float32
    ids = encode_prompt(bundle.tokenizer, prompt, system_prompt=system_prompt)
    if len(ids) >= bundle.context_length:
        raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {bundle.context_length}")
    stops = StopChecker(
        tokenizer=bundle.tokenizer, eos_ids=[*bundle.eos_ids, *params.extra_eos_ids], stop=params.stop,
        max_new_tokens=params.max_new_tokens, prompt_tokens=len(ids), context_length=bundle.context_length,
    )
    gen = make_generator(params.seed)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    stats = RowStats()
    t0 = time.perf_counter()
    x = torch.tensor([ids], device=bundle.device)  # [1, P]
    prefill_ms = 0.0
    while True:
        logits = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]  # [V]
        tok = int(logits.argmax()) if params.greedy else draw(processed_probs(logits, params), gen)
        if not prefill_ms:
            prefill_ms = (time.perf_counter() - t0) * 1000.0
            t1 = time.perf_counter()
        stats.observe_step(StepRecord(1, 0, 1, 0, 0, 0, 0, 0.0, 0.0, 0.0))
        if stops.push(tok):
            break
        x = torch.tensor([[tok]], device=bundle.device)
    return GenerationResult(
        token_ids=list(stops.tokens), text=stops.text(), finish_reason=stops.finish or "length",
        prompt_tokens=len(ids), output_tokens=len(stops.tokens), prefill_ms=prefill_ms,
        decode_ms=(time.perf_counter() - t1) * 1000.0, stats=stats,
    )
