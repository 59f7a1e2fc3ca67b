"""The engine hook: unset, the runner's loader and engine factory are the production ones; set, the stand-in
(tests/standin.py, not shipped) serves ``stand-in`` model names. No Redis, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

import racer_batch
from racer_batch.service.execution.engine_hook import ENGINE_HOOK_ENV, engine_hook, hooked_bundle, hooked_engine
from racer_batch.service.execution.runner import default_engine, default_loader
from racer_batch.service.job.spec import ModelSpec
from racer_batch.values import DecodingConfig
from tests.standin import HOOK_TARGET, StandInBundle, StandInEngine


def test_the_shipped_package_has_no_stand_in():
    package = Path(racer_batch.__file__).parent
    assert not list(package.rglob("standin*"))
    mentions = [str(p) for p in package.rglob("*.py") if "StandIn" in p.read_text(encoding="utf-8")]
    assert mentions == []


def test_unset_hook_claims_nothing(monkeypatch):
    monkeypatch.delenv(ENGINE_HOOK_ENV, raising=False)
    assert engine_hook() is None
    assert hooked_bundle("stand-in?mat=2") is None
    bundle = StandInBundle(name="stand-in")
    assert hooked_engine(bundle, DecodingConfig()) is None  # production: every bundle goes to Engine


def test_set_hook_serves_stand_in_names_through_the_runner_defaults(monkeypatch):
    monkeypatch.setenv(ENGINE_HOOK_ENV, HOOK_TARGET)
    bundle = default_loader(ModelSpec(name="stand-in?mat=3&context=100"), allow_remote_code=False, device=None)
    assert isinstance(bundle, StandInBundle) and (bundle.mat, bundle.context_length) == (3, 100)
    engine = default_engine(bundle, DecodingConfig(method="ar"))
    assert isinstance(engine, StandInEngine) and engine.config.method == "ar"
    assert hooked_bundle("smollm2-135m") is None  # a real model name is not the hook's
    assert hooked_engine(object(), DecodingConfig()) is None  # nor a bundle it did not load


@pytest.mark.parametrize("value, message", [
    ("tests.standin", "expected module:attribute"),
    ("tests.standin:NO_SUCH_HOOK", "cannot load it"),
    ("no_such_module_for_the_hook:HOOK", "cannot load it"),
])
def test_bad_hook_value_names_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(ENGINE_HOOK_ENV, value)
    with pytest.raises(ValueError, match=f"{ENGINE_HOOK_ENV} = '{value}'.*{message}"):
        engine_hook()
