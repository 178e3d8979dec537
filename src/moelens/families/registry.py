"""The family registry: every known family, user registration, and detection.

Detection looks at the model itself: a module is an MoE block when its class is
some registered family's block class; the model's ``config.model_type`` (or that
of a sub-config) names the family otherwise. `supported()` is what the docs'
family table is generated from.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import FamilyError
from .entry import SHARED_TIMES, Family

_FAMILIES: dict[str, Family] = {}
_BY_BLOCK_CLASS: dict[str, Family] = {}
#: Block classes a family took over with ``replace=True``: class -> the family it took them from.
_TAKEN_FROM: dict[str, Family] = {}


def register(family: Family, *, replace: bool = False) -> Family:
    """Add a family so `moelens.wrap` recognises its blocks, without editing moelens.

    Args:
        family: The description. Its ``block_classes`` are how blocks are found.
        replace: Allow replacing a family (or a block class) registered earlier.

    Returns:
        The family, so ``MY_FAMILY = register(Family(...))`` reads naturally.
    """
    if not isinstance(family, Family):
        raise FamilyError(
            f"register() takes a moelens.families.Family, got {type(family).__name__}; "
            "build one with Family(name=..., model_types=..., block_classes=...)."
        )
    _check_description(family)
    if not family.block_classes:
        raise FamilyError(f"family {family.name!r} names no block_classes: moelens finds blocks by their class name.")
    if not replace:
        if family.name in _FAMILIES:
            raise FamilyError(f"a family named {family.name!r} is already registered; pass replace=True to replace it.")
        taken = [name for name in family.block_classes if name in _BY_BLOCK_CLASS]
        if taken:
            raise FamilyError(
                f"block class {taken[0]!r} already belongs to family {_BY_BLOCK_CLASS[taken[0]].name!r}; "
                "pass replace=True to take it over."
            )
    previous = _FAMILIES.get(family.name)
    if previous is not None:
        for name in previous.block_classes:
            _BY_BLOCK_CLASS.pop(name, None)
    _FAMILIES[family.name] = family
    for name in family.block_classes:
        owner = _BY_BLOCK_CLASS.get(name)
        if owner is not None and owner.name != family.name:
            _TAKEN_FROM[name] = owner
        _BY_BLOCK_CLASS[name] = family
    return family


def _check_description(family: Family) -> None:
    """Raise a `FamilyError` for fields of the wrong kind (a string where names are listed, an unknown time)."""
    for field_name in ("model_types", "block_classes"):
        value = getattr(family, field_name)
        if isinstance(value, str) or not all(isinstance(item, str) for item in value):
            raise FamilyError(
                f"family {family.name!r}: {field_name} must be a tuple of names, got {value!r}"
                + (f"; write ({value!r},)." if isinstance(value, str) else ".")
            )
    if family.shared is not None and family.shared.when not in SHARED_TIMES:
        raise FamilyError(
            f"family {family.name!r}: shared expert time {family.shared.when!r} is not one of {SHARED_TIMES}."
        )
    for scoring in (family.scoring, *family.scoring_by_router.values()):
        if scoring.selection_arg is not None and not (scoring.selection_op and isinstance(scoring.selection_arg, int)
                                                      and scoring.selection_arg >= 0):
            raise FamilyError(
                f"family {family.name!r}: selection_arg={scoring.selection_arg!r} needs selection_op naming the "
                "router call (e.g. torch_topk_0) and the position (an int >= 0) of the ranked argument."
            )


def register_all(families: Iterable[Family]) -> None:
    """Register the built-in entries of one family module."""
    for family in families:
        register(family)


def unregister(name: str) -> None:
    """Remove a registered family; block classes it took over go back to their earlier family."""
    family = _FAMILIES.pop(name)
    for block in family.block_classes:
        if _BY_BLOCK_CLASS.get(block) is family:
            del _BY_BLOCK_CLASS[block]
            earlier = _TAKEN_FROM.pop(block, None)
            if earlier is not None and _FAMILIES.get(earlier.name) is earlier:
                _BY_BLOCK_CLASS[block] = earlier


def supported() -> list[Family]:
    """Every registered family, sorted by name."""
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def get(name: str) -> Family:
    """The family registered under ``name``."""
    try:
        return _FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(_FAMILIES))
        raise FamilyError(f"no moelens family named {name!r}; known families: {known}.") from None


def for_block(module: torch.nn.Module) -> Family | None:
    """The family whose MoE block ``module`` is, or None when it is no known block."""
    return _BY_BLOCK_CLASS.get(type(module).__name__)


def for_model_type(model_type: str) -> Family | None:
    """The family a ``config.model_type`` belongs to, or None."""
    for family in _FAMILIES.values():
        if model_type in family.model_types:
            return family
    return None


def model_types(config) -> list[str]:
    """The model_type of a config and of each of its sub-configs (text_config ...)."""
    found = [getattr(config, "model_type", None)]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found.extend(model_types(sub))
    return [name for name in found if name]
