"""Options and value parsers shared by several ``racer-batch`` commands."""

from __future__ import annotations

from typing import Any, Callable, Union

import click

from racer_batch.service.execution import queue as q

PREFIX_ENV = "RACER_BATCH_PREFIX"


def redis_options(*, url_help: str, prefix_help: str) -> Callable[[Any], Any]:
    """Decorator adding ``--redis-url`` (default None: resolved later) and ``--prefix`` (env PREFIX_ENV)."""

    def add(f: Any) -> Any:
        f = click.option("--prefix", envvar=PREFIX_ENV, default=q.DEFAULT_PREFIX, show_default=True,
                         help=f"Redis key prefix (env {PREFIX_ENV}){prefix_help}")(f)
        return click.option("--redis-url", default=None, help=url_help)(f)

    return add


def pydantic_message(exc: Any) -> str:
    """One line per error of a pydantic ``ValidationError``: ``field = value: reason`` (no boilerplate)."""
    from racer_batch.service.job.spec import error_reason

    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        given = "" if err.get("type") == "missing" else f" = {err.get('input')!r}"
        parts.append(f"{loc}{given}: {error_reason(err)}")
    return "; ".join(parts)


def parse_capacity(value: str) -> Union[int, str]:
    """``--capacity`` text -> an int, or ``"auto"``; raises ``click.BadParameter`` on anything else."""
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"capacity must be an integer or 'auto', got {value!r}",
                                 param_hint="--capacity") from None


def set_torch_threads(count: int) -> None:
    """``--torch-threads``: intra-op torch threads; 0 keeps torch's default, no torch installed is a no-op."""
    if not count:
        return
    try:
        import torch
    except ImportError:  # the stand-in model needs no torch
        return
    torch.set_num_threads(count)
