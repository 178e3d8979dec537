"""Fixes to torch-to-nnef 0.24.12's op emitters, in force only while moelens exports.

``aten::logsumexp`` is written with the axis as torch gave it, and tract panics on a
negative axis in the ``logsumexp`` fragment's reductions (granitemoe_swa's attention sinks
call ``torch.logsumexp(weights, dim=-1)``). The fixed emitter resolves the axis against the
input's rank first, as torch-to-nnef's other reductions do (``pick_axis``). The registry is
restored when the export ends, so torch-to-nnef used on its own is unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator


def _positive_axis(emit: Callable[..., Any]) -> Callable[..., Any]:
    """``emit`` run with the node's ``dim`` input resolved to a non-negative axis."""
    from torch_to_nnef.op.helper import pick_axis

    def emit_with_positive_axis(node: Any, op_helper: Any, **kwargs: Any) -> Any:
        input_node, dim_node = node.inputs[:2]
        dim = dim_node.data
        if isinstance(dim, int) and dim < 0:
            dim_node.data = pick_axis(input_node, dim)
        elif isinstance(dim, list) and any(axis < 0 for axis in dim):
            dim_node.data = [pick_axis(input_node, axis) for axis in dim]
        return emit(node, op_helper, **kwargs)

    return emit_with_positive_axis


#: Emitters replaced during an export, by aten op name.
FIXES = {"logsumexp": _positive_axis}


@contextmanager
def fixed_emitters() -> Iterator[None]:
    """torch-to-nnef's aten registry with `FIXES` applied, restored on exit."""
    from torch_to_nnef.op.aten import aten_ops_registry

    registry = aten_ops_registry._registry
    originals = {name: registry[name] for name in FIXES if name in registry}
    try:
        for name, original in originals.items():
            registry[name] = FIXES[name](original)
        yield
    finally:
        registry.update(originals)
