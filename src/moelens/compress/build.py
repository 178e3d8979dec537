"""Turn a `Plan` into modules: a `ToMoEBlock` (or subclass) or a `ToMoELinear`.

Experts hold their neurons in the plan's order, zero-padded to the largest expert
rounded up to a multiple of `SIZE_MULTIPLE` (a padded neuron has zero weights in and
out, so it adds nothing; grouped_mm needs the alignment). The router's bias
carries the plan's offset. Everything is built in float32 from the plan and then cast
to the dense layer's dtype and device (the router stays float32).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .blocks import ToMoEBlock, ToMoESharedExpert
from .dense import DenseLayer
from .experts import ExpertsSettings, experts_class
from .fit import Plan
from .linear import ToMoELinear
from .router import ToMoERouter


#: Expert sizes are padded to a multiple of this (grouped_mm needs 16-byte strides, in bf16 too).
SIZE_MULTIPLE = 8


def padded_size(expert_sizes: list[int]) -> int:
    """The neurons (a Linear's outputs) every expert of a block computes: the largest expert's, rounded up to a
    multiple of `SIZE_MULTIPLE`."""
    return -(-max(1, *expert_sizes) // SIZE_MULTIPLE) * SIZE_MULTIPLE


def _members(plan: Plan) -> tuple[list[torch.Tensor], int]:
    members = [plan.members(expert) for expert in range(plan.num_experts)]
    return members, padded_size([int(m.numel()) for m in members])


@torch.no_grad()
def build_block(layer: DenseLayer, plan: Plan, settings: ExpertsSettings, *, block_class: type = ToMoEBlock,
                dropout: nn.Module | None = None, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> ToMoEBlock:
    """The MoE block of a converted FFN (or, with ``block_class=ToMoELinear``, Linear layer)."""
    members, size = _members(plan)
    linear = layer.linear
    hidden, output = layer.hidden_size, layer.output_size
    gated = layer.gated and not linear
    act = nn.Identity() if linear else copy.deepcopy(layer.act)
    width = max(hidden, output) if linear else output  # square experts for a non-square Linear
    experts = experts_class(gated)(settings, plan.num_experts, max(hidden, width), size, width, act)
    down = plan.down
    scatter = torch.zeros(plan.num_experts, width, size) if linear else None
    index = torch.full((plan.num_experts, size), -1, dtype=torch.long)
    for expert, neurons in enumerate(members):
        count = int(neurons.numel())
        index[expert, :count] = neurons
        if gated:
            experts.gate_up_proj[expert, :count] = layer.gate[neurons]
            experts.gate_up_proj[expert, size:size + count] = layer.up[neurons]
            experts.gate_up_proj_bias[expert, :count] = layer.gate_bias[neurons]
            experts.gate_up_proj_bias[expert, size:size + count] = layer.up_bias[neurons]
        else:
            experts.up_proj[expert, :count, :hidden] = layer.up[neurons]
            experts.up_proj_bias[expert, :count] = layer.up_bias[neurons]
        if linear:
            scatter[expert, neurons, torch.arange(count)] = 1.0
        else:
            experts.down_proj[expert, :, :count] = down[:, neurons]
        experts.down_proj_bias[expert, :output] = plan.expert_bias[expert]
    if linear:  # a fixed 0/1 placement, not a parameter
        del experts.down_proj
        experts.register_buffer("down_proj", scatter)

    shared_count = int(plan.shared.numel())
    shared = ToMoESharedExpert(hidden, output, shared_count, gated, copy.deepcopy(layer.act))
    if shared_count:
        shared.up_proj.weight.copy_(layer.up[plan.shared])
        shared.up_proj.bias.copy_(layer.up_bias[plan.shared])
        if gated:
            shared.gate_proj.weight.copy_(layer.gate[plan.shared])
            shared.gate_proj.bias.copy_(layer.gate_bias[plan.shared])
        shared.down_proj.weight.copy_(down[:, plan.shared])
    shared.constant.copy_(plan.constant)

    router = ToMoERouter(hidden, plan.num_experts, plan.top_k, offset=plan.offset)
    router.weight.copy_(plan.router_weight)
    router.bias.copy_(plan.router_bias + plan.offset)

    block = block_class(router, experts, shared, dropout=dropout)
    block.neuron_index.copy_(index)
    block.shared_index = plan.shared.clone()
    block = block.to(dtype=dtype, device=device)
    block.router.float()  # ranking logits that carry the offset needs float32
    return block


def build_linear(layer: DenseLayer, plan: Plan, settings: ExpertsSettings, *, in_features: int, out_features: int,
                 transposed: bool, dtype: torch.dtype, device: torch.device | str) -> ToMoELinear:
    """The `ToMoELinear` of a converted Linear / Conv1D layer."""
    block = build_block(layer, plan, settings, block_class=ToMoELinear, dtype=dtype, device=device)
    block.in_features, block.out_features, block.transposed = in_features, out_features, transposed
    return block
