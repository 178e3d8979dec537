"""Checks on the paths a user names for moelens to write to."""

from __future__ import annotations

from pathlib import Path


def file_above(path: Path) -> Path | None:
    """The nearest existing path above ``path`` when it is a file (nothing can be written under it), else None."""
    ancestor = Path(path).parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    return None if ancestor.is_dir() else ancestor
