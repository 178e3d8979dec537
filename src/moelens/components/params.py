"""`MoeParams`: a MoE block's router and expert weights as views of the model's own parameters.

Transformers stores experts as fused 3-D parameters whose layout depends on the family
(``gate_up_proj [E, 2H, D]`` or ``[E, D, 2H]``, gate and up halves concatenated or
interleaved, dbrx's ``[E*H, D]`` stacks). `Moe.params` serves them in one convention,
``torch.nn.Linear``'s ``[out, in]`` (``y = x @ W.T + b``), as views: reading costs no
copy, and an in-place edit of a view (``params.down.mul_(0.5)``,
``params.down -= r[:, None] * (r @ params.down)``) changes the model, as editing the
parameter would (assigning another tensor to a field is refused: it would not). The layout comes from the flags transformers stamps on decorated
experts (``has_gate``, ``is_transposed``, ``is_concatenated``) or, for undecorated
experts, from the family entry (`moelens.families.ExpertLayout`).
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
from dataclasses import dataclass, fields
from types import CodeType
from typing import Any, Iterable

import torch
from jaxtyping import Float
from nnsight.intervention.source import OP, Instrument, SourceNotAvailable, source_tree
from torch import Tensor

from ..errors import ArgumentError, LayoutMismatch, ValueUnavailable, WriteError, described, warn
from ..families import ExpertLayout, Family
from ..families.entry import beneath_adapters, find_path, get_path
from ..adapters import MERGE_AND_WRAP, refusal, refuse_parameter_adapters
from ..modules import (called_attribute, disk_offloaded, has_lora_adapters, is_adapter_layer,
                       offloaded_to)
from ..scalars import as_int

#: Names of the scales quantized weights keep beside them (``down_proj_scale_inv``: transformers' FP8 experts).
QUANTIZATION_SCALES = ("_scale_inv", "_scale", "_scales")

#: What to do where PEFT adapters in force stand for a block's router or experts (`block_params`, `router_linear`).
PARAMS_REMEDY = (f"{MERGE_AND_WRAP}; with the adapters merged in place (peft_model.merge_adapter()) or off (under "
                 "peft_model.disable_adapter()), params() serves the weights that run")

#: How nnsight names a call of something called ``linear`` (``F_linear_0``, ``fn_linear_1``, ``linear_0``): the
#: logits ops that may be one ``F.linear(x, router.weight, router.bias)`` call (`functional_linear_operands` checks
#: the callee).
LINEAR_OP = re.compile(r"(?:\w+_)?linear_\d+")


@dataclass(eq=False)  # tensors do not compare to one bool
class MoeParams:
    """One MoE block's weights, as views of its parameters (``[out, in]``, like ``nn.Linear``).

    From ``moe.params()`` every tensor has a leading expert axis ``[E, ...]``; from
    ``moe.params(e)`` it is expert ``e``'s slice. Editing a view in place edits the model.
    Where the last Z experts are zero-compute (`Family.identity_experts`, longcat_flash), the
    router keeps all E rows and the expert views the first E - Z experts, the ones with weights.

    Attributes:
        router: The weight of the linear layer whose output is the router logits,
            ``[E, M]`` (expert ``e``'s row ``[M]``: its logit is ``row @ x + router_bias``,
            ``x`` being what the router's linear layer reads: the model's hidden states, of width
            M, normed or scaled first in some families; the experts' D differs from M only where
            they run in a latent space, nemotron_h's ``moe_latent_size``); None when the logits
            are not one linear layer's output with E rows
            (inkling's extra row, muse_spark's multiplier, zaya's router MLP).
        router_bias: ``[E]`` (a scalar for one expert), or None.
        gate: The gate projection ``[E, H, D]``, or None for ungated experts.
        up: The up projection ``[E, H, D]`` (the only input projection of ungated experts).
        down: The down projection ``[E, D, H]``.
        gate_bias, up_bias: ``[E, H]`` or None; ``down_bias``: ``[E, D]`` or None.
    """

    router: Float[Tensor, "*r m"] | None  # r: all E experts, e below the E - Z with weights (longcat_flash); m: M
    router_bias: Float[Tensor, " *r"] | None
    gate: Float[Tensor, "*e h d"] | None
    up: Float[Tensor, "*e h d"]
    down: Float[Tensor, "*e d h"]
    gate_bias: Float[Tensor, "*e h"] | None = None
    up_bias: Float[Tensor, "*e h"] | None = None
    down_bias: Float[Tensor, "*e d"] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # ``params.down -= x`` edits the view in place, then assigns it back to itself: allowed. Any
        # other assignment would leave the model as it was, so it is refused, as is a name that is no field.
        names = [f.name for f in fields(self)]
        if name not in names:
            raise WriteError(
                f"MoeParams has no field {name!r} (its fields: {names}); assigning it would not change the model. "
                f"Edit a field's view in place instead (params.down.copy_(new), params.down.mul_(0.5), ...)."
            )
        if name in self.__dict__ and value is not self.__dict__[name]:
            if self.__dict__[name] is None:
                raise WriteError(f"MoeParams.{name} is None: this block has no {name} weights to edit.")
            raise WriteError(
                f"MoeParams.{name} is a view of the model's weights: assigning a new tensor would not change the "
                f"model; edit the view in place instead (params.{name}.copy_(new), params.{name}.mul_(0.5), ...)."
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{f.name}={list(value.shape) if value is not None else None}"
                           for f in fields(self) for value in [getattr(self, f.name)])
        return f"MoeParams({shapes})"

    def items(self) -> list[tuple[str, Tensor]]:
        """``(name, view)`` for every weight this block has (the None ones left out)."""
        return [(f.name, value) for f in fields(self) if (value := getattr(self, f.name)) is not None]


def block_params(family: Family, block: torch.nn.Module, num_experts: int, where: str,
                 expert: Any = None) -> MoeParams:
    """`MoeParams` of one live block (every expert's, or expert ``expert``'s); see `Moe.params`.

    ``where`` names the call in errors (``"model.layers.1.mlp.params"``).
    """
    index = None if expert is None else check_expert(expert, num_experts, where)
    copied = "disk" if disk_offloaded(block.modules()) else offloaded_to(block.modules())
    if copied is not None:  # in a forward the weights are loaded into the block, as a copy
        source = ("offloads this block's weights to disk (a device_map placing them on 'disk', or disk_offload) and "
                  "loads a copy" if copied == "disk" else
                  f"keeps this block's weights offloaded on the CPU and moves a copy to {copied}")
        raise ValueUnavailable(
            f"{where}: accelerate {source} of them only while the block runs, so an edit of a view would be lost; "
            "load the model with this layer on the device it runs on (a device_map without 'disk' or CPU offload for "
            "it) to edit its weights."
        )
    refuse_parameter_adapters(block, family, where, "the views would be the base weights alone, and an edit of them "
                              "would leave the adapters' part", ValueUnavailable, parts=("experts",),
                              remedy=PARAMS_REMEDY)
    experts = get_path(block, beneath_adapters(block, family.experts))
    identity = family.identity_count(block)
    if index is not None and index >= num_experts - identity:
        raise ValueUnavailable(
            f"{where}: expert {index} is one of this block's {identity} zero-compute experts ({num_experts - identity} "
            f"to {num_experts - 1}), which return their input times its weight and have no weights; ask for an "
            f"expert in [0, {num_experts - identity})."
        )
    held, slot = num_experts - identity, index  # the experts this process holds, and the asked one's place among them
    sharded = "_ep_size" in experts.__dict__ and experts._ep_num_local < held
    if sharded:  # moelens.parallel.shard_experts:
        # this rank holds a slice of equal ones, in rank order (a group of one rank holds them all)
        held, first = experts._ep_num_local, experts._ep_first
        owner, slot = divmod(index, held) if index is not None else (None, None)
        if owner != experts._ep_rank:
            remedy = ("ask for one of them: moe.params(e) on the rank that holds e" if index is None
                      else f"call moe.params({index}) on rank {owner} of the EP group")
            raise ValueUnavailable(
                f"{where}: the experts are sharded over ranks (moelens.parallel.shard_experts) and this rank holds "
                f"experts {first} to {first + held - 1}; {remedy}."
            )
    try:  # first: its LoRA refusal names the router's adapter too
        views = expert_views(family, experts, held, identity)
    except ValueUnavailable as error:  # said of the experts' class: name the block too
        raise ValueUnavailable(f"{where}: {error}") from None
    try:
        weight, bias = router_linear(family, block, num_experts) or (None, None)
    except AdaptedRouter as error:  # the experts are still served
        warn(f"{where}: router and router_bias are None: {error}")
        weight = bias = None
    except ValueUnavailable as error:  # said of the family's router: name the block too
        raise ValueUnavailable(f"{where}: {error}") from None
    if sharded and weight is not None:  # an edit on the expert's owner alone would route the other ranks' tokens apart
        warn(f"{where}: router and router_bias are None: the experts are sharded over ranks, and every rank holds a "
             "copy of the router that routes its own tokens, so an edit of this rank's copy would change this rank's "
             f"routing alone. Edit the router's weights on every rank alike (the module {family.router!r} of the "
             "block, in model._module).")
        weight = bias = None
    router_module = get_path(block, beneath_adapters(block, family.router))
    stored = {id(tensor) for tensor in (*router_module.parameters(), *router_module.buffers())}
    router = {}
    for name, part, value in (("router", "weight", weight), ("router_bias", "bias", bias)):
        if value is not None and id(value) not in stored:
            raise computed_weight(f"{where}: the router's {part}", part)
        router[name] = None if value is None else editable(value, f"{where}: the router's {part}")
    if index is not None:
        router = {name: None if value is None else value[index] for name, value in router.items()}
        views = {name: None if value is None else value[slot] for name, value in views.items()}
    return MoeParams(**router, **views)


class AdaptedRouter(ValueUnavailable):
    """`router_linear`'s refusal of a router Linear under a PEFT adapter (``params()`` serves the experts beside it)."""


def router_linear(family: Family, block: torch.nn.Module, num_experts: int) -> tuple[Tensor, Tensor | None] | None:
    """The live ``(weight [E, D], bias [E] or None)`` of the linear layer producing the logits, or None.

    The logits op is one ``torch.nn.functional.linear`` call (under any name: ``F.linear``, ``fn.linear``; any of the
    forward's linear calls) on parameters of the router (its own ``weight`` / ``bias``,
    or a child's: longcat_flash's ``classifier.weight``), a ``self.<name>(...)`` call of an ``nn.Linear``
    child, or (``forward_0``) the router is an ``nn.Linear`` calling its own forward (llama4).
    """
    if adapted := refusal(block, family, family.name, "the logits come from the router's base weight and the adapters "
                          "together, which no one [E, D] tensor holds", ("router",), PARAMS_REMEDY):
        raise AdaptedRouter(adapted)
    router = get_path(block, beneath_adapters(block, family.router))
    op = family.logits_op
    called = called_attribute(router, op)
    attribute = getattr(router, called, None) if called else None  # the module the op calls, if one
    if op == "forward_0" and isinstance(router, torch.nn.Linear):
        weight, bias = router.weight, router.bias
    elif is_adapter_layer(attribute):
        adapted = attribute
        raise AdaptedRouter(
            f"{family.name}: the router's linear layer {family.router}.{called} is a PEFT adapter layer "
            f"({type(adapted).__module__}.{type(adapted).__name__}): the logits come from its base weight and the "
            "adapters together, which no one [E, D] tensor holds; merge the adapters in first (model = "
            "peft_model.merge_and_unload()) and wrap the result."
        )
    elif isinstance(attribute, torch.nn.Linear):
        weight, bias = attribute.weight, attribute.bias
    elif hasattr(attribute, "_packed_params"):  # torch's quantized Linear
        raise ValueUnavailable(
            f"{family.name}: the router's linear layer {family.router}.{called} is a "
            f"{type(attribute).__name__} (quantized): its weight is packed, not a "
            "floating-point tensor a view could edit; take params() on the model before quantizing it."
        )
    elif (operands := functional_linear_operands(router, op)) is not None:
        weight_path, bias_path = operands
        if weight_path in (None, UNREADABLE) or bias_path is UNREADABLE:
            return None
        weight, bias = _attribute(router, weight_path), _attribute(router, bias_path)
    else:
        return None
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != num_experts:
        return None
    return weight, (bias if isinstance(bias, Tensor) else None)


#: Tensor methods that change only a dtype or device (what a router may call on its weight or bias in the linear call).
CASTS = ("float", "to", "type", "half", "bfloat16", "double", "type_as")

#: What `linear_call_operands` returns for an operand that is no attribute of the router.
UNREADABLE = object()


class _Calls(Instrument):
    """nnsight's op numbering, keeping each call's arguments (label -> (args, keywords)) and callee expression."""

    def __init__(self) -> None:
        super().__init__()
        self.arguments: dict[str, tuple[list, list]] = {}
        self.callees: dict[str, Any] = {}

    def wrap(self, name: str, fn: Any, args: list, keywords: list, node: Any) -> Any:
        call = super().wrap(name, fn, args, keywords, node)
        self.arguments[self.names[-1]] = (args, keywords)
        self.callees[self.names[-1]] = fn
        return call


def functional_linear_operands(router: torch.nn.Module, op: str) -> tuple[Any, Any] | None:
    """The router paths the ``op`` call of the router's forward passes as weight and bias (as `linear_call_operands`
    reads them) when that call is ``torch.nn.functional.linear`` under any name (``F.linear``, ``fn.linear``, an
    imported ``linear``), else None. A forward with no readable source gives the router's own ``("weight", "bias")``,
    as nn.Linear has, for an ``op`` named like a linear call."""
    if not LINEAR_OP.fullmatch(op):
        return None
    forward = inspect.unwrap(type(router).forward)
    try:
        callee = linear_callee(forward.__code__, op)
    except (SourceNotAvailable, AttributeError):  # no readable source
        return "weight", "bias"
    if callee is None or _resolve(callee, forward) is not torch.nn.functional.linear:
        return None
    return linear_call_operands(forward.__code__, op)


@functools.lru_cache(maxsize=None)
def linear_callee(forward: CodeType, op: str) -> tuple[str, ...] | None:
    """The callee of the ``op`` call of ``forward`` as a name and its attributes (``F.linear``: ``("F", "linear")``),
    or None for no such op or a callee that is no such chain (``ops[0]``, ``get()``)."""
    node = _calls(forward).callees.get(op)
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, *reversed(parts)) if isinstance(node, ast.Name) else None


def _resolve(path: tuple[str, ...], function: Any) -> Any:
    """What the dotted ``path`` names inside ``function`` (its first name a closure variable, a global of its module
    or a builtin), or None where a part is missing or the first name is a local variable of ``function`` (unknown
    until it runs)."""
    code = function.__code__
    first, *rest = path
    if first in code.co_varnames or first in code.co_cellvars:
        return None
    if first in code.co_freevars:
        try:
            value = function.__closure__[code.co_freevars.index(first)].cell_contents
        except ValueError:  # a closure variable not bound yet
            return None
    else:
        value = function.__globals__.get(first, getattr(builtins, first, None))
    for name in rest:
        value = getattr(value, name, None)
    return value


def op_names(function: Any) -> list[str]:
    """The op names nnsight gives the calls and assignments of a Python ``function`` (its decorators peeled),
    in order; raises `SourceNotAvailable` for a function with no Python source."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        raise SourceNotAvailable(f"{function!r} has no Python source")
    return _calls(code).names


def _calls(code: CodeType) -> _Calls:
    """The calls of the function compiled to ``code``, numbered as nnsight numbers its ops."""
    calls = _Calls()
    calls.visit(source_tree(code)[0])
    return calls


@functools.lru_cache(maxsize=None)
def linear_call_operands(forward: CodeType, op: str) -> tuple[Any, Any]:
    """The router attributes the ``op`` call of ``forward`` passes as its weight and its bias, as paths from
    the router: ``F.linear(x, self.weight, self.bias)`` gives ``("weight", "bias")``, longcat_flash's
    ``F.linear(x, self.classifier.weight.type(torch.float32))`` ``("classifier.weight", None)`` (``self``: whatever
    ``forward`` names its first argument). None for an operand not passed, `UNREADABLE` for another expression or
    no such op.

    Read from the source, as nnsight numbers its ops: a router may keep a ``bias`` it adds
    elsewhere (a selection bias), or a linear layer whose bias its call leaves out, which is no part of the logits.
    """
    calls = _calls(forward)
    if op not in calls.arguments:
        return UNREADABLE, UNREADABLE
    args, keywords = calls.arguments[op]
    receiver = forward.co_varnames[0] if forward.co_argcount else None

    def operand(position: int, keyword: str) -> Any:
        node = args[position] if len(args) > position else next((k.value for k in keywords if k.arg == keyword), None)
        return _attribute_path(node, receiver)

    return operand(1, "weight"), operand(2, "bias")


def _attribute_path(node: Any, receiver: str | None) -> Any:
    """``"a.b"`` for the expression ``<receiver>.a.b`` (cast with `CASTS` or not), None for no operand, else
    `UNREADABLE`."""
    if node is None or isinstance(node, ast.Constant) and node.value is None:
        return None
    while isinstance(node, ast.Call):  # self.bias.float(), which nnsight has rewritten as an op call of its own
        method = node.args[1] if isinstance(node.func, ast.Name) and node.func.id == OP and len(node.args) > 1 else None
        if not (isinstance(method, ast.Attribute) and method.attr in CASTS):
            return UNREADABLE
        node = method.value
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if parts and isinstance(node, ast.Name) and node.id == receiver:
        return ".".join(reversed(parts))
    return UNREADABLE


def _attribute(router: torch.nn.Module, path: str | None) -> Any:
    return find_path(router, path) if path else None


def layout_of(family: Family, experts: torch.nn.Module) -> ExpertLayout:
    """Where ``experts`` keeps its weights: from transformers' flags, else the family entry.

    Raises `ValueUnavailable` when neither says it.
    """
    if hasattr(experts, "has_gate"):
        gated, transposed = bool(experts.has_gate), bool(getattr(experts, "is_transposed", False))
        return ExpertLayout(
            gate_up="gate_up_proj" if gated else None, up=None if gated else "up_proj", down="down_proj",
            transposed=transposed, down_transposed=transposed,
            concatenated=bool(getattr(experts, "is_concatenated", True)),
        )
    if family.expert_layout is not None:
        return family.expert_layout
    if not list(experts.parameters(recurse=False)):
        raise ValueUnavailable(
            f"{family.name}: {type(experts).__name__} keeps its weights in modules of its own (one per expert), not "
            "in parameters stacked over the experts, which is what params() serves and an ExpertLayout describes; "
            "read each expert module's weights directly."
        )
    raise ValueUnavailable(
        f"{family.name}: {type(experts).__name__} carries no transformers layout flags (has_gate, is_transposed) and "
        "the family entry has no expert_layout, so moelens does not know where its expert weights are; describe "
        "them with Family(..., expert_layout=ExpertLayout(...))."
    )


def expert_views(family: Family, experts: torch.nn.Module, num_experts: int, identity: int = 0) -> dict[str, Tensor | None]:
    """``gate``, ``up``, ``down`` and their biases as ``[E, out, in]`` views of the experts' parameters.

    ``identity``: how many zero-compute experts follow the ``num_experts`` with weights; rows a
    parameter keeps for every expert (longcat_flash's ``gate_up_proj``, never read for them) are left out.
    """
    if has_lora_adapters(experts):
        raise ValueUnavailable(
            f"{family.name}: {type(experts).__name__} carries LoRA adapters (moelens.compress with lora_r), so its "
            "weights are the parameters plus the adapters' product; fold them in first: "
            "moelens.compress.merge_lora(model) (moelens.compress.exportable(model) merges them in a copy)."
        )
    layout = layout_of(family, experts)
    mismatch = ("the family entry's expert_layout does not match this model's experts" if not hasattr(experts, "has_gate")
                else "its transformers layout flags (has_gate, is_transposed) do not match its parameters")

    def parameter(path: str | None) -> Tensor | None:
        if path is None:
            return None
        value = _stored_at(experts, path)
        if value is None and isinstance(find_path(experts, path), Tensor):
            raise computed_weight(f"{family.name}: {type(experts).__name__}.{path}", path.rpartition(".")[2])
        if value is None:
            raise LayoutMismatch(f"{family.name}: {type(experts).__name__} has no parameter {path!r}; {mismatch}.")
        if any(_stored_at(experts, path + suffix) is not None for suffix in QUANTIZATION_SCALES):
            raise ValueUnavailable(
                f"{family.name}: {type(experts).__name__}.{path} is quantized (it has a scale beside it), so a view "
                "of it is not the weight; moelens serves weights stored as plain floating-point tensors."
            )
        return editable(value, f"{family.name}: {type(experts).__name__}.{path}")

    def per_expert(tensor: Tensor | None, transposed: bool, path: str | None) -> Tensor | None:
        if tensor is None:
            return None
        if layout.stacked and tensor.dim() > 2:  # a stack of every expert's rows is 2-D ([E*out, in]; a bias 1-D)
            raise LayoutMismatch(f"{family.name}: {type(experts).__name__}.{path} has shape {tuple(tensor.shape)}, not "
                                 f"a 2-D stack of every expert's rows [E*out={num_experts}*n, in] (stacked=True); "
                                 f"{mismatch}.")
        if layout.stacked and tensor.shape[0] % num_experts == 0:
            tensor = tensor.view(num_experts, -1, *tensor.shape[1:])
        elif identity and tensor.shape[0] == num_experts + identity:  # unused rows of the zero-compute experts
            tensor = tensor[:num_experts]
        if tensor.shape[0] != num_experts:
            stacked = f"[E*out={num_experts}*n, ...]" if layout.stacked else f"[E={num_experts}, ...]"
            fewer = (f" (with {tensor.shape[0]} experts of weights among the {num_experts + identity}: if the others are "
                     "zero-compute experts, say so with Family.identity_experts)" if tensor.shape[0] < num_experts else "")
            raise LayoutMismatch(
                f"{family.name}: {type(experts).__name__}.{path} has shape {tuple(tensor.shape)}, not {stacked}; "
                f"{mismatch}{fewer}."
            )
        return tensor.transpose(-1, -2) if transposed and tensor.dim() == 3 else tensor

    def bias_of(path: str | None) -> Tensor | None:  # None where the experts have none (a computed one is refused)
        return None if path is None or not isinstance(find_path(experts, path + "_bias"), Tensor) else parameter(path + "_bias")

    views: dict[str, Tensor | None] = {}
    if layout.gate_up is not None:
        fused = per_expert(parameter(layout.gate_up), layout.transposed, layout.gate_up)
        fused_bias = per_expert(bias_of(layout.gate_up), False, layout.gate_up + "_bias")
        views["gate"], views["up"] = _halves(fused, layout.concatenated, dim=1)
        views["gate_bias"], views["up_bias"] = _halves(fused_bias, layout.concatenated, dim=1)
    else:
        for name, path in (("gate", layout.gate), ("up", layout.up)):
            views[name] = per_expert(parameter(path), layout.transposed, path)
            views[f"{name}_bias"] = per_expert(bias_of(path), False, path and path + "_bias")
    views["down"] = per_expert(parameter(layout.down), layout.down_transposed, layout.down)
    views["down_bias"] = per_expert(bias_of(layout.down), False, layout.down + "_bias")
    _check_chain(views, f"{family.name}: {type(experts).__name__}", mismatch)
    return views


def _check_chain(views: dict[str, Tensor | None], where: str, mismatch: str) -> None:
    """Raise `ValueUnavailable` unless the views chain as an expert computes: gate and up ``[E, I, D]`` alike, down
    ``[E, D, I]`` (a wrong layout flag or path reads the stored tensors with their sides swapped)."""
    shapes = {name: tuple(views[name].shape) for name in ("gate", "up", "down") if views.get(name) is not None}
    first = shapes.get("up", shapes.get("gate"))
    if first is None or "down" not in shapes:
        return
    chained = shapes["down"][1:] == first[:0:-1] and shapes.get("gate", first) == first
    if not chained:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise LayoutMismatch(
            f"{where}: the weights read as {listed}, which do not chain as an expert's (gate and up [E, I, D] alike, "
            f"down [E, D, I]); {mismatch} (ExpertLayout: which parameter is gate_up / gate / up / down, transposed, "
            "down_transposed)."
        )


def refuse_fully_sharded(modules: Iterable[torch.nn.Module], where: str) -> None:
    """Raise `ValueUnavailable` when one of ``modules`` (the path from a model down to a block) is sharded by
    torch's FSDP (``fully_shard`` or ``FullyShardedDataParallel``): the weights it holds between gathers are
    copies of the shards, and the next gather overwrites an edit of them."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without torch.distributed
        return
    sharded = next((module for module in modules if isinstance(module, (FSDPModule, FullyShardedDataParallel))), None)
    if sharded is not None:
        raise ValueUnavailable(
            f"{where}: the block sits in {type(sharded).__name__}, which FSDP shards over the ranks: the weights a "
            "module holds are gathered copies of the shards (or the shards themselves), so an edit of a view would be "
            "lost at the next gather; edit the weights before sharding the model."
        )


def editable(weight: Tensor, name: str) -> Tensor:
    """``weight`` detached (a view of the same memory), once it is a loaded floating-point tensor.

    Raises `ValueUnavailable` for a DTensor or a meta tensor (an edit would be lost) and for
    integer or float8 storage (quantized weights, where a view is not the weight).
    """
    if hasattr(weight, "device_mesh") and hasattr(weight, "placements"):  # a torch.distributed DTensor
        raise ValueUnavailable(
            f"{name} is a DTensor (transformers' own tensor / expert parallelism shards it over the ranks), so a view "
            "of it is not the weights this rank keeps and an edit would be lost; edit the weights before sharding "
            "them, or load the model whole and shard its experts with moelens.parallel.shard_experts (whose views "
            "are the rank's own experts)."
        )
    if weight.is_meta:
        raise ValueUnavailable(
            f"{name} is on the meta device (its data is not loaded: accelerate offload or init_empty_weights), so "
            "a view of it holds no weights and an edit would be lost; load the model onto a real device first."
        )
    if not weight.dtype.is_floating_point or weight.dtype.itemsize < 2:  # integer or float8 storage
        raise ValueUnavailable(
            f"{name} is stored as {weight.dtype} (quantized?); moelens serves weights stored as plain "
            "floating-point tensors (16 bits or more), where a view is the weight."
        )
    return weight.detach()


def computed_weight(name: str, attribute: str) -> ValueUnavailable:
    """The refusal of a weight a module computes on access instead of storing it (a view would be a copy);
    ``attribute`` is its name on its module (what the remedy removes the parametrization of)."""
    return ValueUnavailable(
        f"{name} is computed from other tensors each time it is used (torch.nn.utils.parametrize, prune, weight_norm "
        "or spectral_norm), not stored, so a view of it is a copy and an edit would be lost; make it a plain "
        f"parameter first (parametrize.remove_parametrizations(module, {attribute!r}), prune.remove(module, "
        f"{attribute!r}), torch.nn.utils.remove_weight_norm(module, {attribute!r}), ...) or edit the tensors it is "
        "computed from."
    )


def _stored_at(module: torch.nn.Module, path: str) -> Tensor | None:
    """The parameter or buffer registered at dotted ``path`` under ``module`` (None when there is none):
    the stored tensor itself, never one a module computes on access."""
    owner_path, _, name = path.rpartition(".")
    try:
        owner = get_path(module, owner_path)
    except AttributeError:
        return None
    if not isinstance(owner, torch.nn.Module):
        return None
    stored = owner._parameters.get(name)
    return stored if stored is not None else owner._buffers.get(name)


def gate_and_up(family: Family, experts: torch.nn.Module, pre_activations: Any, where: str
                ) -> tuple[Float[Tensor, "*slots i"], Float[Tensor, "*slots i"]]:
    """The gate and up parts of gated experts' pre-activations ``[..., 2I]``, as views ``[..., I]``.

    The split is the one the experts' fused ``gate_up`` weight is stored in (`layout_of`: ``[gate | up]`` halves,
    or interleaved where transformers' ``is_concatenated`` is False, gpt_oss), so ``gate[..., i]`` is the
    projection by row ``i`` of ``params().gate`` (plus its bias) and ``up[..., i]`` by row ``i`` of
    ``params().up``, whatever the family's gate function does with them.

    Raises:
        ArgumentError: ``pre_activations`` is no floating-point tensor of the gated experts' width ``2I``.
        ValueUnavailable: the experts are not gated (their pre-activations are the up projection alone), or
            moelens does not know where their weights are.
    """
    layout = layout_of(family, experts)
    if layout.gate_up is None and layout.gate is not None:
        raise ValueUnavailable(
            f"{where}: {type(experts).__name__} keeps its gate and up projections in separate weights ({layout.gate}, "
            f"{layout.up}), not one fused [.., 2I] projection, and runs its own loop, so moelens serves no "
            "expert_pre_activations to split; read moe.params().gate and .up for the weights."
        )
    if layout.gate_up is None:
        raise ValueUnavailable(
            f"{where}: {type(experts).__name__} is not gated (its activation reads the up projection alone, so "
            "expert_pre_activations [b, s, k, I] is that projection already): there is no gate part to split off."
        )
    fused = _stored_at(experts, layout.gate_up)
    width = None if fused is None else fused.shape[-1 if layout.transposed else -2]
    fits = (isinstance(pre_activations, Tensor) and pre_activations.is_floating_point() and pre_activations.dim() > 0
            and pre_activations.shape[-1] % 2 == 0 and width in (None, pre_activations.shape[-1]))
    if not fits:
        expected = f"2I = {width}, as {type(experts).__name__}.{layout.gate_up} holds" if width else "2I even"
        dtype = f" of dtype {pre_activations.dtype}" if isinstance(pre_activations, Tensor) else ""
        raise ArgumentError(
            f"{where} takes expert_pre_activations, a floating-point torch tensor [..., 2I] of gate and up projections "
            f"({expected}); got {described(pre_activations)}{dtype}. Pass moe.expert_pre_activations (or a part of "
            "it that keeps the last dimension whole)."
        )
    gate, up = _halves(pre_activations, layout.concatenated, dim=-1)
    return gate, up


def _halves(tensor: Tensor | None, concatenated: bool, dim: int) -> tuple[Tensor | None, Tensor | None]:
    """The gate and up halves of a fused tensor along ``dim``, as views: ``[gate; up]`` or interleaved."""
    if tensor is None:
        return None, None
    if concatenated:
        # narrow, not chunk: chunk's outputs are views autograd refuses to let be edited in place (a function of
        # several outputs), so `gate[..., i] = 0` in a trace with autograd on would fail
        half = tensor.shape[dim] // 2
        return tensor.narrow(dim, 0, half), tensor.narrow(dim, half, half)
    index = [slice(None)] * tensor.dim()
    gate_index, up_index = list(index), list(index)
    gate_index[dim], up_index[dim] = slice(0, None, 2), slice(1, None, 2)
    return tensor[tuple(gate_index)], tensor[tuple(up_index)]


def check_expert(expert: Any, num_experts: int, where: str) -> int:
    """``expert`` as an int in ``[0, E)`` (an int, a numpy int or a one-element integer tensor or array, as the
    interventions take it), else an `ArgumentError` saying what was expected."""
    index = as_int(expert)
    if index is None or not 0 <= index < num_experts:
        raise ArgumentError(
            f"{where}: expert {expert!r} is not an expert index; expected an int in [0, {num_experts}) "
            "(or None for every expert)."
        )
    return index
