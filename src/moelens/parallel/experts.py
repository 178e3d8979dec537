"""``torch_a2a``: a transformers experts implementation whose experts are sharded over ranks.

Registered (by `register_torch_a2a`) beside ``grouped_mm`` / ``batched_mm`` in
transformers' ``ExpertsInterface``, it is what the decorated experts module calls
once ``model.set_experts_implementation("torch_a2a")`` (done by `shard_experts`).
Dense layers and routers run data parallel (each rank its own tokens, replicated
weights); the router emits global expert ids; the experts module of each rank
holds ``L = E / ep`` experts and exchanges (token, expert) rows with the other
ranks of its EP group (see `a2a`).

What the tracer sees. The module boundary is unchanged, so the experts call's
``(hidden_states, top_k_index, top_k_weights)`` (global ids) and its output are
this rank's tokens, exactly as in one process. Inside the implementation,
``weighted_out_view_0`` is the per-slot weighted outputs ``[T, k, D]`` of this
rank's tokens in token-slot order, summed right after (as in grouped_mm), so
`Moe.expert_outputs` reads and writes them. Activations are computed on the
experts' owners; when a trace drills into this call on any rank of the group
(reading a per-slot value or any op inside), the owners stop at the up
projections, which come back to the senders (``[T*k, P]``, token-slot order,
this rank's tokens; P = 2I where gated), are activated there by the experts
module's own gate or activation (``self__apply_gate_0`` / ``self_act_fn_0``, as
in grouped_mm: `Moe.expert_pre_activations` is that op's input,
`Moe.expert_activations` its output) and, possibly edited, go out again to the
owners' down projections. Outside such a trace the layer makes two exchanges of
``D``-wide rows; inside, two more: ``P``-wide rows back, ``I``-wide rows out.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from nnsight.intervention.source import STATE
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from transformers.integrations.moe import _grouped_linear

from ..components.binding import kept_for_backward
from ..components.implementations import IMPLEMENTATION_CALL, ExpertsOps
from ..errors import MoelensError
from .a2a import Plan, plan_dispatch
from .comm import group_size, stored_group

#: The name of the implementation, in transformers' registries and moelens'.
NAME = "torch_a2a"

#: The op names `Moe` reads inside it: grouped_mm's, in token-slot order (no sort).
OPS = ExpertsOps()

def slot_values_wanted(experts: torch.nn.Module) -> bool:
    """Whether a running nnsight trace drilled into this module's experts call.

    That is, whether the call runs source-instrumented: something in the trace
    (a per-slot value such as `Moe.expert_outputs`, or a direct
    ``experts.source.experts_forward_1.source.<op>``) wants the per-slot values.
    """
    state = experts.__dict__.get(STATE)
    if state is None:
        return False
    interleaver, path, _ = state.active()
    if interleaver is None:
        return False
    return f"{path}.source.{IMPLEMENTATION_CALL}" in getattr(interleaver, "sourced", {})


def _up_weight(experts: torch.nn.Module) -> Tensor:
    return experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj


def num_local_experts(experts: torch.nn.Module) -> int:
    """Experts this rank holds (the leading dim of the expert weights)."""
    return int(_up_weight(experts).shape[0])


def _stand_in(rows: Tensor, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """For a rank that received no rows: one row through local expert 0, so backward
    still reaches the exchanges and the expert weights (their gradients zero)."""
    if rows.shape[0]:
        return rows, plan.local_ids, plan.offsets
    offsets = torch.ones_like(plan.offsets)
    return rows.sum(dim=0, keepdim=True), plan.local_ids.new_zeros(1), offsets


def experts_up(experts: torch.nn.Module, rows: Float[Tensor, "r d"], plan: Plan, activate: bool = True
               ) -> Float[Tensor, "r p"]:
    """This rank's experts' activations (after gate / activation) on rows grouped by local expert; with
    ``activate=False`` their up projections ``[r, P]`` (gate and up, P = 2I, where gated), the activation's input."""
    x, ids, offsets = _stand_in(rows, plan)
    gated = getattr(experts, "has_gate", True)
    weight = _up_weight(experts)
    bias = None
    if getattr(experts, "has_bias", False):
        bias = (experts.gate_up_proj_bias if gated else experts.up_proj_bias)[ids]
    out = _grouped_linear(x, weight, offsets, bias=bias, is_transposed=getattr(experts, "is_transposed", False))
    if activate or torch.is_grad_enabled():
        # Without ``activate`` the activation still runs where autograd records it (its result unused): a
        # checkpointed layer's recomputation (no trace, so no round trip) runs it, and the forward must save what the
        # recomputation saves, in the same order (torch pairs the saved tensors by position).
        activated = experts._apply_gate(out) if gated else experts.act_fn(out)
        out = activated if activate else out
    return out if rows.shape[0] else out[:0]


def experts_down(experts: torch.nn.Module, activations: Float[Tensor, "r i"], plan: Plan) -> Float[Tensor, "r d"]:
    """This rank's experts' outputs (down projection, post-expert norm) from their activations."""
    x, ids, offsets = _stand_in(activations, plan)
    bias = experts.down_proj_bias[ids] if getattr(experts, "has_bias", False) else None
    out = _grouped_linear(x, experts.down_proj, offsets, bias=bias, is_transposed=getattr(experts, "is_transposed", False))
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return out if activations.shape[0] else out[:0]


#: Why torch_a2a experts cannot be scanned (`moelens.model`'s scan refuses them up front, before a run is counted).
SCAN_REFUSAL = (
    "torch_a2a cannot run on nnsight's shape-only tensors (model.scan): how many rows each rank sends "
    "depends on the routing. Scan the model before shard_experts or the switch to torch_a2a (or a copy "
    "loaded whole): the values' shapes are the same, with this rank's tokens."
)


def torch_a2a_experts_forward(
    self: torch.nn.Module,
    hidden_states: Float[Tensor, "t d"],
    top_k_index: Int[Tensor, "t k"],
    top_k_weights: Float[Tensor, "t k"],
    process_group: Any = None,
) -> Float[Tensor, "t d"]:
    """The ``torch_a2a`` experts implementation (see the module docstring).

    Args:
        self: The experts module, holding this rank's ``L`` experts.
        hidden_states: This rank's tokens ``[T, D]``.
        top_k_index: Global expert ids ``[T, k]``.
        top_k_weights: Routing weights ``[T, k]``.
        process_group: The EP group (transformers' EP passes it); default: the
            group `shard_experts` stored on the module, else none (one rank, every
            expert local).
    """
    group = process_group if process_group is not None else stored_group(self)
    if is_fake(hidden_states):  # a group of one rank too: its dispatch plan checks the routing on the host
        raise MoelensError(SCAN_REFUSAL)
    num_tokens = hidden_states.size(0)
    num_top_k = top_k_index.size(-1)
    hidden_dim = hidden_states.size(-1)
    num_local = num_local_experts(self)
    plan = plan_dispatch(
        group,
        top_k_index,
        num_local * group_size(group),
        num_local,
        serve=slot_values_wanted(self),
        tag=self.__dict__.get("_ep_tag", 0),
        runs=self.__dict__.get("_ep_runs"),
    )
    rows = plan.dispatch(hidden_states)
    if plan.serve:
        # This rank's tokens' up projections [T*k, P] come back in token-slot order and are activated here, as in
        # grouped_mm (the activation op's input and output are served); the activations, edits included, go to the
        # owners. What the round trip keeps for backward is not a checkpointed layer's to recompute: its
        # recomputation, after the trace, makes none.
        owner_pre_activations = experts_up(self, rows, plan, activate=False)  # saved as a recomputation saves it
        with kept_for_backward():
            slot_pre_activations = plan.to_sender(owner_pre_activations, "pre_activations_back")
            if getattr(self, "has_gate", True):
                slot_activations = self._apply_gate(slot_pre_activations)
            else:
                slot_activations = self.act_fn(slot_pre_activations)
            activations = plan.to_owner(slot_activations, "activations_out")
    else:
        activations = experts_up(self, rows, plan)
    expert_out = experts_down(self, activations, plan)
    proj_out = plan.to_sender(expert_out, "combine")
    weighted_out = proj_out * top_k_weights.reshape(-1).unsqueeze(-1)
    final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final_hidden_states.to(hidden_states.dtype)
