"""The registry of decoding methods: one ``DecodingMethod`` per value of ``DecodingConfig.method``.

A method is its name, the settings it reads, a check of the config, the draft state of one scope and the
drafter of one row, all declared together in the module that holds its drafter: each built-in module listed
in ``BUILTIN_MODULES`` exports ``DECODING_METHODS``, a tuple of them, read the first time the registry is asked.
``register_method`` adds one more at run time (an extension, a test) and ``unregister_method`` takes it away.
``DecodingConfig`` validates ``method`` against ``method_names()`` and ``values.METHODS`` is read from it, so a
new method needs no edit outside its own module (and, for a new module, one name in ``BUILTIN_MODULES``);
settings it adds are new ``DecodingConfig`` fields in values.py. A method registered at run time exists in
that process only: Ray workers know the built-in ones and whatever their own imports register.

At import this module installs itself into values.py (``values.install_registry``), which validates
``DecodingConfig.method`` through it: values.py imports nothing of the drafters, so there is no import cycle.
"""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import values

if TYPE_CHECKING:
    from ..values import DecodingConfig
    from .state import DraftState

BUILTIN_MODULES = ("methods", "token_recycling", "logitspec", "rest", "sam", "graft")


def plain_state(config: "DecodingConfig", *, scope: str, vocab_size: int, tokenizer: Any) -> "DraftState":
    """An empty DraftState of ``scope``: the state of a method that keeps nothing across rows."""
    from .state import DraftState

    return DraftState(scope=scope)


@dataclass(frozen=True)
class DecodingMethod:
    """One decoding method.

    Attributes:
        name: the value of ``DecodingConfig.method`` that selects it.
        summary: a few words for help texts and docs, e.g. ``"prompt lookup"``.
        make_drafter: ``(config, state) -> drafter``: the drafter of one row (``drafters/base.py::Drafter``),
            bound to the scope's ``state``.
        make_state: ``(config, *, scope, vocab_size, tokenizer) -> DraftState``: a fresh state of one scope
            (``scope`` already resolved; ``tokenizer`` only for methods that read text); default: an empty
            DraftState. May raise ``ValueError`` for input it cannot read (a corpus file).
        settings: the ``DecodingConfig`` fields the method reads beyond the shared ones (capacity, scope,
            acceptance, runner); each must be a field of DecodingConfig.
        check_config: ``(config) -> None``, run by DecodingConfig validation once ``method`` names this one;
            raises ``ValueError`` for a config the method cannot run; None: every config is accepted.
        drafts: False for a method that never proposes a draft (ar): the engine then verifies one token per
            step, warms up and times only T = 1 and runs no capacity tuner.
    """

    name: str
    summary: str
    make_drafter: Callable[["DecodingConfig", "DraftState"], Any]
    make_state: Callable[..., "DraftState"] = plain_state
    settings: tuple[str, ...] = ()
    check_config: Optional[Callable[["DecodingConfig"], None]] = None
    drafts: bool = True


_methods: dict[str, DecodingMethod] = {}  # name -> method, in registration order (built-ins first)
_lock = threading.RLock()
_loaded = False


def _registry() -> dict[str, DecodingMethod]:
    """The registry, with the built-in modules' methods read in on first use."""
    global _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                for mod in BUILTIN_MODULES:
                    for spec in importlib.import_module(f"{__package__}.{mod}").DECODING_METHODS:
                        _add(spec)
                _loaded = True
    return _methods


def _add(spec: DecodingMethod) -> None:
    if not spec.name or not spec.name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"method name {spec.name!r}: use letters, digits, '-' and '_'")
    if spec.name in _methods:
        raise ValueError(f"decoding method {spec.name!r} is already registered")
    _methods[spec.name] = spec


def register_method(spec: DecodingMethod) -> DecodingMethod:
    """Add ``spec`` to the registry; ``DecodingConfig(method=spec.name)`` is valid from then on.

    Raises:
        ValueError: the name is taken or not made of letters, digits, '-' and '_'.
    """
    _registry()
    with _lock:
        _add(spec)
    return spec


def unregister_method(name: str) -> DecodingMethod:
    """Remove the method ``name`` (configs naming it no longer validate); returns its spec.

    Raises:
        ValueError: no method of that name is registered.
    """
    spec = get_method(name)
    with _lock:
        del _methods[name]
    return spec


def method_names() -> tuple[str, ...]:
    """Names of the registered methods, built-ins first in ``BUILTIN_MODULES`` order, e.g. ``("ar", "pld", ...)``."""
    return tuple(_registry())


def get_method(name: str) -> DecodingMethod:
    """The registered method ``name``.

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    spec = _registry().get(name)
    if spec is None:
        raise ValueError(f"unknown decoding method {name!r}; choose from {', '.join(method_names())}")
    return spec


def make_state(config: "DecodingConfig", *, vocab_size: int, scope: str | None = None, tokenizer=None) -> "DraftState":
    """A fresh DraftState holding what ``config.method`` needs, for ``scope`` (default ``config.scope``).

    ``tokenizer`` is needed only to read a text corpus (``corpus_path``) for rest and sam.

    Raises:
        ValueError: an unknown method, or a corpus that cannot be read (rest, sam).
    """
    spec = get_method(config.method)
    return spec.make_state(config, scope=scope or config.scope, vocab_size=vocab_size, tokenizer=tokenizer)


def make_drafter(config: "DecodingConfig", state: "DraftState"):
    """The drafter for one row under ``config.method``, bound to ``state``.

    Raises:
        ValueError: an unknown method.
    """
    return get_method(config.method).make_drafter(config, state)


values.install_registry(sys.modules[__name__])
