"""Source-instrumenting a `Moe`'s router, experts and block as `wrap` builds it, checking the ops its family names."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.source import SourceNotAvailable

from ..components import Moe
from ..components.base import INSTRUMENTED
from ..components.implementations import is_dispatching
from ..components.params import op_names
from ..errors import FamilyError
from ..families import Family
from ..modules import called_attribute, instance_name


def _instrument(moe: Moe) -> None:
    """Source-instrument what a Moe's values are read from, before any trace runs.

    A module's forward must be instrumented before it starts running for its
    ops to be served; doing it here means a trace can ask for any value at any
    time. Outside a trace the instrumented forwards run as the originals.
    """
    family = moe.family
    object.__setattr__(moe, INSTRUMENTED, {envoy.path: envoy._module for envoy in (moe, moe.router, moe.experts)})
    _require_op(moe.router, family.logits_op, family, "logits_op", moe._module)
    if family.logits_cast_op:
        _require_op(moe.router, family.logits_cast_op, family, "logits_cast_op")
    scoring = moe.SCORING
    if scoring.selection_in:  # its own ops are instrumented in the trace (nnsight drills only there)
        _require_op(moe.router, scoring.selection_in, family, "scoring.selection_in")
        _require_method_op(moe.router._module, scoring.selection_in, scoring.selection_op, family)
    elif scoring.selection_op:
        _require_op(moe.router, scoring.selection_op, family, "scoring.selection_op")
    if family.experts_call and is_dispatching(moe.experts._module):
        moe.experts.source  # noqa: B018 - installs the experts' op handoffs
    if family.shared is not None and family.shared.gated_op:
        _require_op(moe, family.shared.gated_op, family, "shared.gated_op")


def _require_op(envoy: Any, op: str, family: Family, field: str, block: torch.nn.Module | None = None) -> None:
    """Source-instrument ``envoy`` and check its forward has the op the family names; ``block``: the block whose
    router ``envoy`` is, where a router path naming another module is as likely as a wrong op (the refusal says so)."""
    try:
        names = envoy.source.names
    except SourceNotAvailable:
        raise FamilyError(
            f"family {family.name!r}: {field}={op!r} names an operation of {type(envoy._module).__name__}.forward, "
            "whose Python source cannot be read (a class defined at the interactive prompt, by exec or python -c): "
            "moelens reads a block's values at the operations of its source, so define the class in a file or "
            "module (a notebook cell will do) and import it."
        ) from None
    if op not in names:
        children = [name for name, _ in block.named_children()] if block is not None else []
        router = (f" If {type(envoy._module).__name__} is not the router, fix the entry's router={family.router!r} "
                  f"instead (the block's children: {', '.join(children)})." if children else "")
        raise FamilyError(
            f"family {family.name!r}: {field}={op!r} is not an operation of "
            f"{type(envoy._module).__name__}.forward; its operations are {', '.join(names)}.{router}"
        )


def _require_method_op(router: torch.nn.Module, call: str, op: str, family: Family) -> None:
    """Check that ``call`` (``self_get_topk_indices_0``) calls a method of the router with Python source
    whose ops include ``op`` (numbered as nnsight numbers them)."""
    called = called_attribute(router, call)
    method = getattr(type(router), called, None) if called else None
    try:
        names = op_names(method) if callable(method) else None
    except SourceNotAvailable:
        names = None
    if names is None:
        instance = instance_name(router)
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_in={call!r} is not a call of a method of "
            f"{type(router).__name__} with Python source ({instance}.<method>(...) in its forward, named "
            f"{instance}_<method>_<n>), where moelens reads selection_op."
        )
    if op not in names:
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_op={op!r} is not an operation of "
            f"{type(router).__name__}.{called}; its operations are {', '.join(names)}."
        )
