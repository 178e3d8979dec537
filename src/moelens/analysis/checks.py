"""Checks of the analysis functions' arguments, so every function words bad input the same way.

An integer argument (a count, a layer, an expert) is a Python int, a numpy integer or a 0-d integer
tensor or array; a bool, a float or text is refused, never rounded or compared as if it were one.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping

import numpy as np
from nnsight import Envoy
from torch import Tensor

from ..errors import MoelensError, described
from ..scalars import as_lone_int


def shown(value: Any) -> str:
    """``value`` for an error message: a block or module of a wrapped model by its path (its repr is the whole module
    tree), anything else as its repr, cut at 80 characters."""
    if isinstance(value, Envoy):
        return f"the {type(value).__name__} {value.path}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else f"{text[:77]}..."


def layer_hint(value: Any) -> str:
    """What to pass instead of a block given where a decoder-layer index is asked for ("" for anything else)."""
    layer = getattr(value, "layer", None) if isinstance(value, Envoy) else None
    return f": pass its layer index (moe.layer, here {layer})" if as_lone_int(layer) is not None else ""


def check_count(name: str, value: Any, least: int = 1) -> int:
    """``value`` as an int: a count such as ``batch_size`` or ``top`` must be an integer of at least ``least``."""
    count = as_lone_int(value)
    if count is None or count < least:
        raise MoelensError(f"{name} must be an integer of at least {least}, got {value!r}.")
    return count


def check_type(value: Any, kind: type | tuple[type, ...], name: str, expected: str, remedy: str) -> None:
    """Refuse a ``name`` that is not a ``kind`` (described as ``expected``), saying what to do (``remedy``)."""
    if not isinstance(value, kind):
        raise MoelensError(f"{name} must be {expected}, got {described(value)}; {remedy}.")


def check_intervene(intervene: Any) -> None:
    """Refuse an ``intervene=`` (`collect_generation`, `token_losses`) that is neither None nor a function."""
    if intervene is not None and not callable(intervene):
        raise MoelensError(f"intervene takes a function of an MoE block (lambda moe: moelens.steer(moe, 3, 4.0)), got "
                           f"{type(intervene).__name__}.")


def refuse_set(name: str, value: Any, order: str) -> None:
    """Refuse a set (or frozenset) ``value`` for ``name``, whose positions give ``order``: a set's iteration order
    is arbitrary (it follows the hash seed for text), so its items would land in the wrong places silently."""
    if isinstance(value, (set, frozenset)):
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
        raise MoelensError(f"{name}={shown} is a set, but {name} gives {order} by position: pass a list "
                           "(a set has no order) in the order you mean.")


def id_list(name: str, values: Any, what: str, example: str = "{name}=[{one}]", items: str = "integers",
            distinct: bool = True, order: str | None = None) -> list[Any]:
    """``values`` as a list: a list, tuple, range, dict keys, 1-D tensor or array, or a set where ``order`` is None
    (its items are checked by the caller).

    One integer alone is refused, suggesting ``example`` (a template of ``name`` and that integer, ``one``),
    as is text or anything else that is not a list; ``what`` names one item, ``items`` what they are.
    ``distinct``: an item given twice is refused (it would be counted or shown twice).
    ``order``: what the positions give when they carry meaning (then a set, which has no order, is refused);
    ``None`` for a filter, whose order does not matter, so a set works as well as a list.
    """
    if isinstance(values, Envoy):  # a block is iterable (its children): named, not iterated
        raise MoelensError(f"{name} must be a list of {what}s ({items}), got {shown(values)}"
                           f"{layer_hint(values) if name == 'layers' else ''}.")
    one = as_lone_int(values)
    if one is not None:
        raise MoelensError(f"{name}={values!r} is one {what}; {name} takes a list: {example.format(name=name, one=one)}.")
    if order is not None:
        refuse_set(name, values, order)
    if (isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable)
            or (isinstance(values, (Tensor, np.ndarray)) and values.ndim != 1)):
        raise MoelensError(f"{name} must be a list of {what}s ({items}), got {described(values)}.")
    values = list(values)
    envoy = next((value for value in values if isinstance(value, Envoy)), None)
    if envoy is not None:
        raise MoelensError(f"{name} holds {shown(envoy)}, which is no {what} ({items})"
                           f"{layer_hint(envoy) if name == 'layers' else ''}.")
    twice = _repeated(values) if distinct else []
    if twice:
        raise MoelensError(f"{name} gives {what} {twice} more than once; give each {what} once.")
    return values


def _repeated(values: list[Any]) -> list[Any]:
    """The items of ``values`` given more than once (integers by value, whatever their type), in order."""
    seen: set[Any] = set()
    twice: list[Any] = []
    for value in values:
        key = value if as_lone_int(value) is None else as_lone_int(value)
        try:
            if key in seen and key not in twice:
                twice.append(key)
            seen.add(key)
        except TypeError:  # unhashable: the caller refuses it as an item
            pass
    return twice


def split_ids(values: Iterable[Any], valid: Collection[int]) -> tuple[list[int | None], list[Any]]:
    """(``values`` as ints, those of them that are not integers in ``valid``: the ones an error names)."""
    values = list(values)
    ids = [as_lone_int(value) for value in values]
    return ids, [value for value, index in zip(values, ids) if index is None or index not in valid]


def expert_ids(experts: Iterable[Any], count: int, layer: int) -> list[int]:
    """``experts`` as ints, every one an expert of ``layer`` (``0..count - 1``); the others are named in the error."""
    ids, outside = split_ids(experts, range(count))
    if outside:
        raise MoelensError(f"experts {outside} are not experts of layer {layer}, which has experts 0..{count - 1}; "
                           "pass integer expert ids in that range.")
    return ids


def check_results(value: Any, kind: type, name: str, made_by: str) -> list[Any]:
    """``value`` (one ``kind`` or a list of them) as a list, refusing anything else and saying what makes one."""
    items = [value] if isinstance(value, kind) else value
    if not isinstance(items, (str, bytes, Mapping)) and isinstance(items, Iterable):
        items = list(items)
        if all(isinstance(item, kind) for item in items):
            return items
    raise MoelensError(f"{name} must hold {kind.__name__} results (one, or a list of them), got {described(value)}; "
                       f"make one with {made_by}.")
