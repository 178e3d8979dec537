"""The compressor registry: compressors by name, so configs and tools can pick one by a string.

``get_compressor("tomoe")`` (also ``"tomoe_compressor"``, ``"tomoe_factory"``,
``"tomoe_compressor_factory"``) returns `ToMoECompressor`; ``register_compressor``
adds another under any names.
"""

from __future__ import annotations

from typing import Callable

from ..scalars import check_flag
from .errors import CompressionError

_COMPRESSORS: dict[str, Callable] = {}


def register_compressor(factory: Callable, *names: str, replace: bool = False) -> Callable:
    """Register ``factory`` (called as ``factory(model, **settings)``) under ``names``; returns it.

    A name registered to another factory (``tomoe`` and its spellings are moelens' own) needs ``replace=True``.
    """
    if not names:
        raise CompressionError("register_compressor needs at least one name.")
    if not callable(factory):
        raise CompressionError(f"register_compressor takes a callable factory(model, **settings) first, got "
                               f"{type(factory).__name__}.")
    bad = [name for name in names if not isinstance(name, str) or not name]
    if bad:
        raise CompressionError(f"register_compressor's names must be non-empty strings, got {bad[0]!r}.")
    replace = check_flag("replace", replace, CompressionError)
    taken = [name for name in names if _COMPRESSORS.get(name, factory) is not factory]
    if taken and not replace:
        raise CompressionError(f"compressor name(s) {taken} are registered to {_COMPRESSORS[taken[0]]!r}; pass "
                               "replace=True to register this factory in their place, or choose other names.")
    for name in names:
        _COMPRESSORS[name] = factory
    return factory


def get_compressor(name: str) -> Callable:
    """The compressor registered under ``name``."""
    try:
        return _COMPRESSORS[name]
    except KeyError:
        raise CompressionError(f"no compressor named {name!r}; registered: {sorted(_COMPRESSORS)}.") from None


def compressors() -> dict[str, Callable]:
    """Every registered name and its compressor."""
    return dict(_COMPRESSORS)
