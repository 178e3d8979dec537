"""Numbers as moelens takes them in arguments: a Python number, a numpy scalar, or a one-element tensor or array.

An id (an expert, a layer, a count) is an integer and never a bool: a float, a bool, text or a tensor of
several values is refused by the caller, in its own words, never rounded or taken as 0/1. A flag is True or
False (numpy's too): text such as ``"False"`` is truthy in Python, so it is refused, not taken as True.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .errors import MoelensError


def scalar(value: Any) -> Any:
    """A one-element tensor or numpy array (or a numpy scalar) as its Python number; anything else as it is
    (a tensor without values, on the meta device, too)."""
    if isinstance(value, torch.Tensor):
        single = value.numel() == 1
    elif isinstance(value, (np.ndarray, np.generic)):
        single = value.size == 1
    else:
        return value
    if not single:
        return value
    try:
        with unset_fake_temporarily():  # in model.scan a real tensor's value, not a placeholder symbol for it
            number = value.item()
    except RuntimeError:  # a meta tensor has no value to give
        return value
    # a fake tensor computed inside model.scan gives a placeholder (torch.SymInt): it has no value either
    return value if isinstance(number, (torch.SymInt, torch.SymFloat, torch.SymBool)) else number


def as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is one integer (see the module docstring), else None."""
    value = scalar(value)
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def as_real(value: Any) -> float | None:
    """``value`` as a Python float when it is one real number, not a bool, else None (finiteness is the caller's)."""
    value = scalar(value)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range (10**400): infinite, which the caller refuses
        return math.inf if value > 0 else -math.inf


def as_lone_int(value: Any) -> int | None:
    """`as_int` of a value with no axes: a 0-d tensor or array counts, a one-element list-like one does not (where
    a list of ids is taken, ``tensor([3])`` is that list)."""
    return None if getattr(value, "ndim", 0) != 0 else as_int(value)


def bool_in(value: Any) -> Any:
    """A bool inside ``value``, a list or tuple (nested) of ids, numbers, arrays or tensors, else None:
    ``torch.as_tensor([3, True])`` is ``tensor([3, 1])``, so a bool among numbers would pass for 1 unseen. One pass
    over the items (a stack)."""
    pending = list(value) if isinstance(value, (list, tuple)) else []
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif (isinstance(item, (bool, np.bool_)) or isinstance(item, torch.Tensor) and item.dtype == torch.bool
              or isinstance(item, np.ndarray) and item.dtype == np.bool_):
            return item
    return None


def check_flag(name: str, value: Any, error: type[MoelensError] = MoelensError) -> bool:
    """``value`` as a Python bool; raises ``error`` naming ``name`` unless it is True or False (numpy's too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")
    return bool(value)
