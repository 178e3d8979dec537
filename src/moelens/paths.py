"""Checks on the paths a user names for moelens to write to."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from .errors import MoelensError


#: What an error about an empty path asks for.
NAME_A_PATH = "name a file or folder (an empty path would be the working folder)"


def user_path(path: str | os.PathLike, name: str = "path", error: type[MoelensError] = MoelensError,
              hint: str = "") -> Path:
    """A path the user named, with a leading ``~`` or ``~user`` expanded as a shell would (never a folder named
    ``~``); one that names no known home folder (``~nosuchuser/x``, which a shell would keep as typed) is refused.

    Raises:
        MoelensError (or ``error``): ``path`` is no str or path object, or empty, or begins with a ``~`` or
            ``~user`` whose home folder is not known here; the message names the argument (``name``), what it
            got, and ``hint``.
    """
    if not isinstance(path, (str, os.PathLike)):
        shown = repr(path)
        shown = f" {shown}" if len(shown) <= 60 and "\n" not in shown else ""  # not a model's whole repr
        raise error(f"{name} must be a path (a str or a pathlib.Path), got {type(path).__name__}{shown}{hint}.")
    if not os.fspath(path):  # Path("") is the working folder: an unset shell variable would write there
        raise error(f"{name} is empty: {NAME_A_PATH}{hint}.")
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        head = Path(path).parts[0]
        whose = "this user (HOME is not set)" if head == "~" else f"a user {head[1:]!r}"
        raise error(f"{name} {os.fspath(path)!r} begins with {head!r}, but this system knows no home folder of "
                    f"{whose}; write the path out without it (a folder named {head!r} here is ./{head}){hint}."
                    ) from None


def argument_path(value: str) -> Path:
    """`user_path` as argparse's ``type=`` for a command-line path: an empty one, or one whose ``~user`` names no
    home folder, is a usage error (exit 2)."""
    try:
        return user_path(argument_text(value))
    except MoelensError as refused:
        raise argparse.ArgumentTypeError(str(refused)) from None


def argument_text(value: str) -> str:
    """A command-line path kept as typed (a trailing slash says something `Path` drops): an empty one is a usage
    error (exit 2)."""
    if not value:
        raise argparse.ArgumentTypeError(f"empty: {NAME_A_PATH}")
    return value


def may_write_into(folder: Path) -> bool:
    """Whether this process can create a file in the existing ``folder``: tried with a temporary file
    (gone at once), since permission bits do not tell for root (a read-only mount, an immutable folder)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def blocked_above(path: Path) -> str | None:
    """What stops creating ``path`` above it, in words (``"'<path>', which is a file, not a folder"``), or None.

    Looks at the nearest path above ``path`` that exists or is a symbolic link: a file, a link
    to a missing path, or a folder this process may not write into leaves nothing to create below.
    """
    ancestor = Path(path).parent
    while not (ancestor.exists() or ancestor.is_symlink()):
        ancestor = ancestor.parent
    if not ancestor.exists():
        return f"{str(ancestor)!r}, which is a symbolic link to a missing path ({os.readlink(ancestor)!r})"
    if not ancestor.is_dir():
        return f"{str(ancestor)!r}, which is a file, not a folder"
    if not may_write_into(ancestor):
        return f"{str(ancestor)!r}, a folder this user may not write into"
    return None
