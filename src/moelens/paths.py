"""Checks on the paths a user names for moelens to write to."""

from __future__ import annotations

import os
from pathlib import Path


def blocked_above(path: Path) -> str | None:
    """What stops creating ``path`` above it, in words (``"<path>, which is a file, not a folder"``), or None.

    Looks at the nearest path above ``path`` that exists or is a symbolic link: a file, a link
    to a missing path, or a folder this process may not write into leaves nothing to create below.
    """
    ancestor = Path(path).parent
    while not (ancestor.exists() or ancestor.is_symlink()):
        ancestor = ancestor.parent
    if not ancestor.exists():
        return f"{ancestor}, which is a symbolic link to a missing path ({os.readlink(ancestor)})"
    if not ancestor.is_dir():
        return f"{ancestor}, which is a file, not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor}, a folder this user may not write into"
    return None
