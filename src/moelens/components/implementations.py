"""Experts implementations whose per-slot values moelens can serve, and their op names.

transformers runs the experts of a decorated family through a function chosen by
``config._experts_implementation``. Inside ``grouped_mm`` and ``batched_mm`` the
per-slot weighted outputs exist as one ``[T, k, D]`` tensor (``weighted_out_view_0``)
and each slot's activations as one ``[T*k, I]`` tensor; the ``eager`` loop has
neither. An implementation registered elsewhere (moelens' expert-parallel
``torch_a2a``) registers its op names here so `Moe` serves it too.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.source import SourceNotAvailable

from ..errors import MoelensError
from ..scalars import check_flag


@dataclass(frozen=True)
class ExpertsOps:
    """Op names inside one experts implementation's forward.

    Attributes:
        slot_outputs: Op whose output is the per-slot weighted outputs ``[T, k, D]``
            in token-slot order.
        gated_activations: Op whose output is the activations after the gate
            (``act(gate) * up``) of gated experts, ``[T*k, I]``.
        plain_activations: The same for non-gated experts (``act(up)``).
        sort: Op returning ``(sorted expert ids, permutation)`` when the rows run
            sorted by expert (the activations are then in that order), or None when
            they run in token-slot order.
        pre_activations: Whether the input of the activation op (gated or plain) is each
            slot's up projection (``[T*k, 2I]`` gate and up, ``[T*k, I]`` up alone), in the
            order of the activations; False where the activations are computed elsewhere and
            only pass through that op (then `Moe` refuses ``expert_pre_activations``).
    """

    slot_outputs: str = "weighted_out_view_0"
    gated_activations: str = "self__apply_gate_0"
    plain_activations: str = "self_act_fn_0"
    sort: str | None = None
    pre_activations: bool = True


#: The op through which the experts module's decorated forward calls the implementation.
IMPLEMENTATION_CALL = "experts_forward_1"

_IMPLEMENTATIONS: dict[str, ExpertsOps] = {
    "grouped_mm": ExpertsOps(sort="torch_sort_0"),
    "batched_mm": ExpertsOps(),
}


#: Weight dtypes an experts implementation cannot run (torch's ``grouped_mm`` takes float32, bfloat16 and float16).
UNSUPPORTED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {"grouped_mm": (torch.float64,)}


def unsupported_dtypes(implementation: str, dtypes: Iterable[torch.dtype]) -> list[str]:
    """The names of those of ``dtypes`` that ``implementation`` cannot run its experts' weights in (sorted)."""
    return sorted({str(dtype).removeprefix("torch.") for dtype in dtypes
                   if dtype in UNSUPPORTED_DTYPES.get(implementation, ())})


def register_implementation(name: str, ops: ExpertsOps, replace: bool = False) -> None:
    """Tell moelens the op names of an experts implementation registered with transformers.

    A name already registered with other ops (``grouped_mm`` and ``batched_mm`` are moelens' own) needs
    ``replace=True``; registering the same ops again changes nothing.

    Raises:
        MoelensError: ``name`` is no non-empty str, ``eager`` (a loop with no per-slot tensors), or taken;
            ``ops`` is no `ExpertsOps` of op names.
    """
    replace = check_flag("replace", replace)
    if not isinstance(name, str) or not name or name == "eager":
        raise MoelensError(f"register_implementation takes the name of an experts implementation registered with "
                           f"transformers (a non-empty str other than 'eager', whose loop has no per-slot tensors), "
                           f"got {name!r}.")
    if not isinstance(ops, ExpertsOps) or not all(isinstance(op, str) and op for op in (
            ops.slot_outputs, ops.gated_activations, ops.plain_activations)) or \
            not (ops.sort is None or isinstance(ops.sort, str) and ops.sort) or not isinstance(ops.pre_activations, bool):
        raise MoelensError(f"register_implementation({name!r}, ops): ops must be ExpertsOps(...) naming ops as str "
                           f"(sort: a str or None; pre_activations: a bool), got {ops!r}.")
    if _IMPLEMENTATIONS.get(name, ops) != ops and not replace:
        raise MoelensError(f"the experts implementation {name!r} is already registered with {_IMPLEMENTATIONS[name]}; "
                           "pass replace=True to replace its op names (every wrapped model reads the new ones).")
    _IMPLEMENTATIONS[name] = ops


def is_dispatching(experts: Any) -> bool:
    """Whether ``experts`` is decorated by transformers' ``use_experts_implementation``, so its
    forward runs the implementation ``experts.config._experts_implementation`` names (the
    decorator's ``__init__`` sets ``_is_expert_parallel`` on every instance)."""
    return "_is_expert_parallel" in getattr(experts, "__dict__", {})


def known(fp8: bool = True) -> list[str]:
    """The experts implementations transformers knows (``fp8``: also those for FP8 weights, which it
    picks when it loads them)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    names = ["eager", *ALL_EXPERTS_FUNCTIONS]
    if fp8:
        try:
            from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        except ImportError:
            ALL_FP8_EXPERTS_FUNCTIONS = {}
        names += [name for name in ALL_FP8_EXPERTS_FUNCTIONS if name not in names]
    return names


def check_known(name: str, fp8: bool = True) -> None:
    """Raise a `MoelensError` unless ``name`` is one of the `known` experts implementations."""
    names = known(fp8)
    if name not in names:
        hint = (" moelens' expert-parallel one is registered by moelens.parallel.register_torch_a2a() (shard_experts "
                "calls it).") if name == "torch_a2a" else ""
        raise MoelensError(f"unknown experts implementation {name!r}; known: {', '.join(names)}.{hint}")


def is_transformers_own(name: str) -> bool:
    """Whether the experts implementation ``name`` is one of transformers' (``eager``'s loop, its kernels), not one a
    user registered with transformers (``ALL_EXPERTS_FUNCTIONS.register``), whose op names `register_implementation`
    can tell moelens."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    function = ALL_EXPERTS_FUNCTIONS.get(name) if name != "eager" else None
    return function is None or getattr(function, "__module__", "").startswith("transformers.")


def unreadable_ops(name: str, ops: ExpertsOps) -> str | None:
    """Why the op names ``ops`` registered for the implementation ``name`` (`register_implementation`) cannot be read in
    the function transformers runs for it, or None where they can (or where transformers has no such function)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    function = ALL_EXPERTS_FUNCTIONS.get(name)
    return None if function is None else _unreadable_ops(function, ops)


@functools.cache
def _unreadable_ops(function: Any, ops: ExpertsOps) -> str | None:
    label = getattr(function, "__qualname__", repr(function))
    try:
        names = _nnsight_op_names(function)
    except (SourceNotAvailable, SyntaxError):
        return (f"its function {label} has no Python source whose ops nnsight reads (a lambda, a builtin or a "
                "compiled function): define it with def in a file or a notebook cell")
    missing = [f"{field}={op!r}" for field, op in (("slot_outputs", ops.slot_outputs), ("sort", ops.sort)) if op
               and op not in names]
    if ops.gated_activations not in names and ops.plain_activations not in names:
        missing.append(f"gated_activations={ops.gated_activations!r} or plain_activations={ops.plain_activations!r}")
    return f"its function {label} has no op {'; no op '.join(missing)}; its ops are {', '.join(names)}" \
        if missing else None


def _nnsight_op_names(function: Any) -> tuple[str, ...]:
    """The op names nnsight gives ``function`` as it instruments a call of it (`nnsight.intervention.source.instrument`):
    a callable object through its ``__call__``, a bound method through its function, and a decorator's wrapper peeled
    by the function its closure calls (with or without ``functools.wraps``); none in a lambda."""
    from nnsight.intervention.source import compiled, decorator_chain

    if getattr(function, "__name__", "") == "<lambda>":
        raise SourceNotAvailable("nnsight reads no ops in a lambda")
    if not (inspect.isfunction(function) or inspect.ismethod(function)) and isinstance(
            getattr(type(function), "__call__", None), types.FunctionType):
        function = function.__call__
    if inspect.ismethod(function):
        function = function.__func__
    if not inspect.isfunction(function):
        raise SourceNotAvailable(f"{function!r} has no Python source")
    inner, _ = decorator_chain(function)
    return compiled(inner).names


def ops_for(name: str | None) -> ExpertsOps | None:
    """The op names of implementation ``name``, or None when it serves no per-slot values."""
    return _IMPLEMENTATIONS.get(name) if name else None


def serving() -> tuple[str, ...]:
    """Names of the implementations whose per-slot values moelens serves."""
    return tuple(_IMPLEMENTATIONS)


def runs_torch_a2a(moes: Iterable[Any]) -> bool:
    """Whether any of ``moes``' experts run ``torch_a2a``: switched to it (`moelens.parallel.shard_experts` does, in
    a group of any size), or run by transformers' expert parallelism through it (``ep_implementation="torch_a2a"``,
    which gives the experts module an EP group's run ids, ``_ep_runs``, but no ``_ep_group`` of shard_experts')."""
    for moe in moes:
        marks = moe.experts._module.__dict__
        if moe.experts_implementation == "torch_a2a" or ("_ep_runs" in marks and "_ep_group" not in marks):
            return True
    return False
