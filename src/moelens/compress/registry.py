"""The compressor registry: compressors by name, so configs and tools can pick one by a string.

``get_compressor("tomoe")`` (also ``"tomoe_compressor"``, ``"tomoe_factory"``,
``"tomoe_compressor_factory"``) returns `ToMoECompressor`; ``register_compressor``
adds another under any names.
"""

from __future__ import annotations

from typing import Callable

from .errors import CompressionError

_COMPRESSORS: dict[str, Callable] = {}


def register_compressor(factory: Callable, *names: str) -> Callable:
    """Register ``factory`` (called as ``factory(model, **settings)``) under ``names``; returns it."""
    if not names:
        raise CompressionError("register_compressor needs at least one name.")
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
