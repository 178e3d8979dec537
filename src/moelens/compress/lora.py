"""LoRA adapters on converted blocks (experts and router), as torch parametrizations.

``experts.gate_up_proj`` (or ``up_proj``) and ``experts.down_proj`` become
``base + (alpha / r) * B @ A`` with per-expert ``A [E, r, in]`` and ``B [E, out, r]``;
``router.weight`` becomes ``base + (alpha / r) * B @ A`` with ``A [r, D]``,
``B [E, r]``. ``B`` starts at zero, so adding adapters changes nothing until they
train. Every experts implementation reads the weights by name, so they all see the
adapted weights; `merge_lora` folds the adapters into plain parameters again.
With ``freeze_experts`` the routed and shared experts' weights do not train (the
adapters and the router do).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .experts import is_tomoe_experts
from .router import ToMoERouter


class LoRADelta(nn.Module):
    """Parametrization ``W -> W + scale * B @ A`` for a 2-D ``[out, in]`` or a 3-D ``[E, out, in]`` weight."""

    def __init__(self, shape: torch.Size, rank: int, alpha: float) -> None:
        super().__init__()
        *batch, out_features, in_features = shape
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(*batch, rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(*batch, out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A.view(-1, in_features), a=math.sqrt(5))

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.scale * (self.lora_B @ self.lora_A).to(weight.dtype)


def _adapt(module: nn.Module, name: str, rank: int, alpha: float) -> None:
    tensor = getattr(module, name)
    if not isinstance(tensor, nn.Parameter):  # a fixed buffer (ToMoELinear's placement) is not adapted
        return
    delta = LoRADelta(tensor.shape, rank, alpha).to(device=tensor.device, dtype=tensor.dtype)
    parametrize.register_parametrization(module, name, delta)


def add_lora(block: nn.Module, rank: int, alpha: float) -> None:
    """Add LoRA adapters of rank ``rank`` to a converted block's experts and router."""
    experts = block.experts
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        if name in experts._parameters:
            _adapt(experts, name, rank, alpha)
    _adapt(block.router, "weight", rank, alpha)


def freeze_experts(block: nn.Module) -> None:
    """The routed and shared experts' own weights stop training; LoRA adapters (``lora_A`` / ``lora_B``) keep training."""
    for part in (block.experts, block.shared_experts):
        for name, parameter in part.named_parameters():
            if "lora_" not in name.rsplit(".", 1)[-1]:
                parameter.requires_grad_(False)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter of the converted blocks into plain parameters (in place); returns ``model``."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module) and (is_tomoe_experts(module) or isinstance(module, ToMoERouter)):
            for name in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return model
