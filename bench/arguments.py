"""Argument types the benchmarks share: bad values are refused as the command line is read, before minutes of work.

Run as ``python bench/<script>.py``, each benchmark finds this module beside it (the script's folder is on the path).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {minimum}, got {text!r}")
        return value

    return parse


def output_file(text: str) -> Path:
    """An ``argparse`` type: a file to write at the end of the run, in a folder that exists now (so a typo does not
    lose the run's numbers after it)."""
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(path.parent)!r} does not exist; create it first")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name in it")
    return path
