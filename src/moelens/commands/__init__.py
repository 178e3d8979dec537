"""The ``moelens`` command's subcommands: each module here adds its parsers (``register(subparsers)``), and a
command's body is imported only when it runs (`runs`), so ``moelens --help`` and a refused command line answer
without importing torch, transformers or nnsight."""

from __future__ import annotations

import argparse
import functools
import importlib
from typing import Any, Callable


@functools.cache  # one per command: parsers built twice give equal namespaces
def runs(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand's ``func``: ``module.function(args)``, the module imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


def add_model_argument(parser: Any) -> None:
    """The ``MODEL`` argument every subcommand that loads a model takes."""
    parser.add_argument("model", metavar="MODEL", help="a local checkpoint folder, or 'tiny' for moelens-tiny")
