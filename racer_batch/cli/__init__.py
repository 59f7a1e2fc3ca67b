"""The ``racer-batch`` command line (click): the only package that imports click."""

from .generate import main, run

__all__ = ["main", "run"]
