"""An engine hook: a way for tests and benchmark scripts to put a fake engine behind some model names.

Unset (production), nothing changes: every model name is loaded by ``racer_batch.load_model`` and run by
``racer_batch.engine.Engine``. Set ``RACER_BATCH_ENGINE_HOOK`` to ``module:attribute`` (for example
``tests.standin:STANDIN_HOOK``) and the runner asks that object first, in every process that reads the
variable: the worker, its Ray actors (they inherit the environment) and worker subprocesses. The module must
be importable there (on ``PYTHONPATH``). The object implements ``EngineHook``::

    hook.claims("stand-in?mat=2")  -> True     # this model name is the hook's
    hook.load("stand-in?mat=2")    -> bundle   # instead of load_model (ValueError for a bad name)
    hook.owns(bundle)              -> True     # a bundle this hook loaded
    hook.engine(bundle, decoding, streams=4)  -> engine   # instead of Engine(bundle, decoding, streams=4)

The engine has what the service uses of an Engine, whatever the job: the ``bundle`` and ``streams`` attributes,
``new_state``, ``free_state``, ``stream`` (a generator yielding ``engine.batch.Prefill`` / ``Verify`` / ``Decode``
requests, as ``Engine.stream``) and ``choose_streams``. The runner does not look at its shape: it is the same
contract as the ``engine_factory`` a RowRunner takes in tests.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Optional, Protocol

from racer_batch.values import DecodingConfig

ENGINE_HOOK_ENV = "RACER_BATCH_ENGINE_HOOK"


class EngineHook(Protocol):
    """A stand-in for the model loader and the engine, for the model names it claims."""

    def claims(self, model_name: str) -> bool: ...

    def load(self, model_name: str) -> Any: ...

    def owns(self, bundle: Any) -> bool: ...

    def engine(self, bundle: Any, decoding: DecodingConfig, *, streams: int = 1) -> Any: ...


@functools.lru_cache(maxsize=4)
def _import_hook(target: str) -> EngineHook:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{ENGINE_HOOK_ENV} = {target!r}: expected module:attribute")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{ENGINE_HOOK_ENV} = {target!r}: cannot load it ({exc})") from None


def engine_hook() -> Optional[EngineHook]:
    """The hook named by ``$RACER_BATCH_ENGINE_HOOK``; None when the variable is unset or empty.

    Raises:
        ValueError: the value is not ``module:attribute`` or cannot be imported (the message names it).
    """
    target = os.environ.get(ENGINE_HOOK_ENV, "").strip()
    return _import_hook(target) if target else None


def hooked_bundle(model_name: str) -> Optional[Any]:
    """The hook's bundle for ``model_name`` when a hook is set and claims the name; else None."""
    hook = engine_hook()
    if hook is None or not hook.claims(model_name):
        return None
    return hook.load(model_name)


def hooked_engine(bundle: Any, decoding: DecodingConfig, *, streams: int = 1) -> Optional[Any]:
    """The hook's engine (room for ``streams`` rows at once) for a bundle the hook loaded; None for any other
    bundle or without a hook."""
    hook = engine_hook()
    if hook is None or not hook.owns(bundle):
        return None
    return hook.engine(bundle, decoding, streams=streams)
