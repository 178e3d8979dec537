"""The errors moelens raises.

Every error names the value or input at fault, what was expected, and what to do.
None of them derives from ``AttributeError``: an eproperty getter that raises one is
swallowed by ``Envoy.__getattr__`` and resurfaces as "object has no attribute".
"""

from __future__ import annotations

import sys
import warnings
from typing import Any


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside moelens and nnsight (the user's line, not moelens' own),
    however deep in moelens it is raised: ``moelens.load`` and ``moelens.wrap`` reach the same warning at different
    depths, and a check of a trace's inputs runs inside nnsight when the trace's ``with`` block ends."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and str(frame.f_globals.get("__name__")).partition(".")[0] in ("moelens", "nnsight"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class MoelensError(Exception):
    """Base class of every error moelens raises on purpose."""


class ValueUnavailable(MoelensError):
    """A value that this family, this block or this run cannot serve (and why).

    ``why`` is the reason and the remedy without the value's path (what ``describe`` and a block's repr list).
    """

    def __init__(self, message: str, why: str | None = None) -> None:
        super().__init__(message)
        self.why = message if why is None else why


class LayoutMismatch(ValueUnavailable):
    """Expert weights that are not where, or not shaped as, their layout says (a wrong `ExpertLayout` in a family
    entry, or transformers' layout flags that do not match the parameters): what `Moe.params` raises for them."""


class OrderError(MoelensError):
    """A value was requested after the model had already run past it in this trace."""


class WriteError(MoelensError, ValueError):
    """A write to a served value that would make the model compute something wrong."""


class FamilyError(MoelensError, ValueError):
    """A model or family description moelens cannot use."""


class ArgumentError(MoelensError, ValueError):
    """An argument of the wrong kind or outside its range (an expert id past the block's experts, a value name that
    is none): not a `ValueUnavailable`, which code may catch to skip the values a block does not serve."""


class LayerIndexError(MoelensError, IndexError):
    """``model.layers[key]`` with a key that is no layer of the model."""


def sentence(error: Exception) -> str:
    """``error``'s message without its final full stop, to go inside a sentence."""
    return str(error).rstrip().rstrip(".")


def described(value: Any) -> str:
    """A value in words for an error: its type, with the value itself when it is short (text, a number, None), or
    its shape (a tensor, an array)."""
    if value is None or isinstance(value, (str, int, float)):
        return f"{type(value).__name__} {value!r:.60}"
    numpy = sys.modules.get("numpy")  # a numpy scalar (np.int64(3)) has a shape () too: named as a number
    if isinstance(getattr(value, "shape", None), tuple) and not (numpy and isinstance(value, numpy.generic)):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    return type(value).__name__
