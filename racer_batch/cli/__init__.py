"""The ``racer-batch`` command line (click): the only package that imports click.

Layout (one module per command family; flags become config objects here and are handed down):
  exit_codes.py  the one exit-code table (``ExitCode``), rendered into every command's --help
  options.py     options and value parsers shared by several commands
  generate.py    generate, bench                          -> racer_batch.engine, racer_batch.bench
  service.py     submit, status, list, cancel, errors, worker -> racer_batch.service
  render.py      the service commands' tables, summaries and progress lines
  report.py      report, shadow, export                   -> racer_batch.report

``main`` is the click group; ``run`` is the console entry point (``racer-batch``, ``python -m racer_batch``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from . import generate as _generate
from . import report as _report
from . import service as _service
from .exit_codes import CliExit, ExitCode, epilog

__all__ = ["CliExit", "ExitCode", "main", "run"]


class _Group(click.Group):
    """The top-level group: a Ctrl-C that no command handled itself exits 130, not click's "Aborted!" 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise CliExit("interrupted", ExitCode.INTERRUPTED) from None


@click.group(cls=_Group, epilog=epilog(*ExitCode), context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Logging verbosity (stderr).")
@click.version_option(package_name="racer-batch")
def main(log_level: str) -> None:
    """racer-batch: batch LLM generation with RACER lossless speculative decoding."""
    from rich.console import Console
    from rich.logging import RichHandler

    # logs go to stderr: stdout carries only results (a job id, --json), so scripts can capture it
    handler = RichHandler(show_path=False, console=Console(stderr=True, soft_wrap=True))
    logging.basicConfig(level=log_level.upper(), format="%(message)s", handlers=[handler])
    for noisy in ("transformers", "accelerate", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


for _family in (_generate, _service, _report):
    _family.register(main)


def run() -> None:
    """Console entry point with the documented exit codes for uncaught errors."""
    try:
        main.main(standalone_mode=True)
    except SystemExit:
        raise
    except Exception as exc:
        logging.getLogger(__name__).exception("internal error")
        click.echo(f"internal error: {exc!r}", err=True)
        sys.exit(ExitCode.INTERNAL)
