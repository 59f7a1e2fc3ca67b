"""Test helpers shared by every tier: a character tokenizer for tiny random models (no download). Input
files, specs and Redis fixtures for service-level tests on the stand-in engine: tests/fixtures.py."""

from __future__ import annotations

import torch

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.models import ModelBundle, tiny_random_model


class CharTokenizer:
    """Token id i <-> one character; id 2 is the EOS marker "</s>" (a special token)."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?-+*/=()[]{}<>ABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def __init__(self, vocab_size: int) -> None:
        assert vocab_size <= len(self.ALPHABET)
        self.vocab_size = vocab_size
        self.eos_token = "</s>"
        self.eos_token_id = 2
        self.all_special_tokens = ["</s>"]
        self.chat_template = None

    def _piece(self, i: int) -> str:
        return self.eos_token if i == self.eos_token_id else self.ALPHABET[i]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if (skip_special_tokens and i == self.eos_token_id) else self._piece(int(i)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": [self.ALPHABET.index(c) for c in text]}

    def __len__(self) -> int:
        return self.vocab_size

    def convert_tokens_to_ids(self, tok: str) -> int:
        return self.eos_token_id if tok == self.eos_token else self.ALPHABET.index(tok)


class ContextFreeDrafter:
    """Base of test drafters whose tree depends on the root alone: no top-k wanted, nothing to start or learn.
    A subclass sets ``name`` and defines ``propose``."""

    needs_topk = False

    def start(self, prompt_ids, prompt_topk):
        pass

    def update(self, verified):
        pass


def tiny_bundle(*, vocab_size: int = 64, seed: int = 0, context_length: int = 512, head_scale: float | None = None,
                eos: bool = True) -> ModelBundle:
    """A tiny random Llama with a character tokenizer. ``eos=False`` gives it no EOS id at all."""
    model = tiny_random_model(vocab_size=vocab_size, seed=seed, max_positions=context_length)
    if head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale / 25.0)
    tok = CharTokenizer(vocab_size)
    return ModelBundle(model=model, tokenizer=tok, name=f"tiny-{vocab_size}-{seed}", eos_ids=[2] if eos else [],
                       context_length=context_length, device="cpu", dtype="float32")


def check_greedy_equals_reference(bundle: ModelBundle, method: str, capacity: int, prompts: list[str]) -> None:
    """Greedy decoding with ``method`` at ``capacity`` (the ``prompts`` one after another on one draft state)
    gives the HF greedy reference's tokens and finish reason; the counters count emitted tokens only, and no
    step accepts more draft tokens than a tree of ``capacity`` nodes holds."""
    engine = Engine(bundle, DecodingConfig(method=method, capacity=capacity))
    state = engine.new_state()
    for prompt in prompts:
        params = GenerationParams(max_new_tokens=80)
        ref = generate_reference(bundle, prompt, params)
        out = engine.generate(prompt, params, state=state)
        assert out.token_ids == ref.token_ids, (method, prompt)
        assert out.finish_reason == ref.finish_reason
        assert out.stats.emitted_tokens == out.output_tokens == len(out.token_ids)
        assert max(int(k) for k in out.stats.accepted_hist) <= capacity - 1
    engine.free_state(state)
