"""The method registry: a decoding method registered here, in the test, runs through the engine unchanged."""

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pytest
from pydantic import ValidationError

import racer_batch.values as values_mod
from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.drafters import (
    DecodingMethod,
    Draft,
    DraftState,
    Verified,
    get_method,
    make_drafter,
    make_state,
    method_names,
    register_method,
    unregister_method,
)
from racer_batch.drafters.registry import BUILTIN_MODULES

SOURCE_ECHO = 1 << 10  # a source bit of its own: no SOURCE_* constant in values.py is needed
PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat"]


@dataclass
class EchoState(DraftState):
    """The toy's scope state: how many rows each drafter of the scope started."""

    started: list[int] = field(default_factory=list)


class EchoDrafter:
    """Toy drafter: the tokens that followed the previous occurrence of the root in the row's context."""

    name = "echo"
    needs_topk = False

    def __init__(self, state: EchoState, *, num_tokens: int) -> None:
        self.state = state
        self.num_tokens = num_tokens
        self.context: list[int] = []

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.state.rows += 1
        self.state.started.append(len(prompt_ids))
        self.context = list(prompt_ids)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        n = min(self.num_tokens, capacity - 1, max_depth)
        ctx = self.context  # its last token is the root
        prev = next((i for i in range(len(ctx) - 2, -1, -1) if ctx[i] == root), None)
        chain = ctx[prev + 1 : prev + 1 + n] if prev is not None and n > 0 else []
        return Draft([root, *chain], list(range(-1, len(chain))), [0] + [SOURCE_ECHO] * len(chain))

    def update(self, verified: Verified) -> None:
        self.context.extend(verified.committed)


def _echo_method(**kw) -> DecodingMethod:
    return DecodingMethod(
        "echo", "toy: copy what followed the root's previous occurrence",
        make_state=lambda config, *, scope, vocab_size, tokenizer: EchoState(scope=scope),
        make_drafter=lambda config, state: EchoDrafter(state, num_tokens=6), **kw,
    )


@pytest.fixture()
def echo():
    spec = register_method(_echo_method())
    try:
        yield spec
    finally:
        unregister_method("echo")


def test_registered_method_runs_losslessly_through_the_engine(tiny, echo):
    assert "echo" in values_mod.METHODS and "echo" in DecodingConfig.model_json_schema()["properties"]["method"]["enum"]
    engine = Engine(tiny, DecodingConfig(method="echo", capacity=8))
    state = engine.new_state()
    assert isinstance(state, EchoState) and state.scope == "job"
    drafted = accepted = 0
    for prompt in PROMPTS:
        params = GenerationParams(max_new_tokens=80)
        ref = generate_reference(tiny, prompt, params)
        out = engine.generate(prompt, params, state=state)
        assert out.token_ids == ref.token_ids, prompt
        assert out.finish_reason == ref.finish_reason
        assert out.stats.emitted_tokens == out.output_tokens == len(out.token_ids)
        drafted += out.stats.tree_tokens - out.stats.steps
        accepted += out.stats.accepted_other  # the toy's bit is neither retrieval nor logits
    assert state.rows == len(PROMPTS) and len(state.started) == len(PROMPTS)  # its state and drafter were used
    assert drafted > 0 and accepted > 0
    engine.free_state(state)
    assert state.freed


def test_unregistered_method_is_refused_naming_the_known_ones(echo):
    assert isinstance(make_drafter(DecodingConfig(method="echo"), make_state(DecodingConfig(method="echo"),
                                                                            vocab_size=8)), EchoDrafter)
    unregister_method("echo")
    try:
        assert "echo" not in values_mod.METHODS
        with pytest.raises(ValidationError, match=r"unknown decoding method 'echo'; choose from ar, pld, .*graft"):
            DecodingConfig(method="echo")
        with pytest.raises(ValueError, match="unknown decoding method 'echo'"):
            get_method("echo")
    finally:
        register_method(echo)  # the fixture unregisters it again


def test_registry_refuses_taken_and_malformed_names(echo):
    with pytest.raises(ValueError, match="'echo' is already registered"):
        register_method(_echo_method())
    with pytest.raises(ValueError, match="'racer' is already registered"):
        register_method(DecodingMethod("racer", "a second racer", make_drafter=lambda config, state: None))
    with pytest.raises(ValueError, match="letters, digits"):
        register_method(DecodingMethod("no spaces", "bad name", make_drafter=lambda config, state: None))
    assert get_method("racer").summary.startswith("RACER")  # the built-in one stays


def test_check_config_runs_in_decoding_config_validation():
    def refuse_auto(config):
        if config.capacity == "auto":
            raise ValueError("echo drafts a fixed chain: set an integer capacity")

    register_method(_echo_method(check_config=refuse_auto))
    try:
        assert DecodingConfig(method="echo", capacity=8).method == "echo"
        with pytest.raises(ValidationError, match="echo drafts a fixed chain"):
            DecodingConfig(method="echo", capacity="auto")
    finally:
        unregister_method("echo")


def test_builtin_methods_and_their_settings():
    names = method_names()
    assert names == values_mod.METHODS
    assert names[:10] == ("ar", "pld", "logits", "retrieval", "racer", "tr", "logitspec", "rest", "sam", "graft")
    assert DecodingConfig.model_json_schema()["properties"]["method"]["enum"] == list(names)
    assert len(BUILTIN_MODULES) == 6
    fields = set(DecodingConfig.model_fields)
    for name in names:
        spec = get_method(name)
        assert spec.name == name and spec.summary
        assert set(spec.settings) <= fields, (name, set(spec.settings) - fields)
        cfg = DecodingConfig(method=name)
        drafter = make_drafter(cfg, make_state(cfg, vocab_size=16, scope="request"))
        assert drafter.name == name
    # every method-named setting belongs to the spec of that method
    for f in fields:
        prefix = f.split("_", 1)[0]
        if prefix in names:
            assert f in get_method(prefix).settings, f
