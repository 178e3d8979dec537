"""LoRA adapters on converted blocks (experts and router), added when the weights are read.

``experts.gate_up_proj`` (or ``up_proj``) and ``experts.down_proj`` read as
``base + (alpha / r) * B @ A`` with per-expert ``A [E, r, in]`` and ``B [E, out, r]``;
``router.weight`` reads as ``base + (alpha / r) * B @ A`` with ``A [r, D]``,
``B [E, r]``. ``B`` starts at zero, so adding adapters changes nothing until they
train. Every experts implementation reads the weights by name, so they all see the
adapted weights; `merge_lora` folds the adapters into the plain parameters again.
With ``freeze_experts`` the routed and shared experts' weights do not train (the
adapters and the router do).

The adapters are plain submodules (``<module>.lora.<weight>``) that `LoRAHost` adds
when the weight is looked up, not torch parametrizations: a parametrized module
shares a generated class with its deep copies (merging a copy broke the original)
and does not pickle.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import LORA_ADAPTERS, has_lora_adapters
from .errors import torch_model


class LoRADelta(nn.Module):
    """The adapter of one 2-D ``[out, in]`` or 3-D ``[E, out, in]`` weight: ``W -> W + scale * B @ A``.

    Attributes:
        scale: ``alpha / rank``.
        lora_A: ``[*batch, rank, in]``, Kaiming-uniform at start (drawn from ``generator``, torch's global one if None).
        lora_B: ``[*batch, out, rank]``, zero at start (the adapter adds nothing until it trains).
    """

    def __init__(self, shape: torch.Size, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        *batch, out_features, in_features = shape
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(*batch, rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(*batch, out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A.view(-1, in_features), a=math.sqrt(5), generator=generator)

    def forward(self, weight: Tensor) -> Tensor:
        """The adapted weight."""
        return weight + self.scale * (self.lora_B @ self.lora_A).to(weight.dtype)


class LoRAHost(nn.Module):
    """A module whose parameters named in its ``lora`` adapters (an ``nn.ModuleDict``) read as adapted.

    ``module.<name>`` is ``lora[<name>](base)``, what every forward and experts implementation
    sees; the parameter ``<name>`` in ``parameters()`` and the state dict stays the base weight.
    Without a ``lora`` child the module is an ordinary module.
    """

    def __getattr__(self, name: str) -> Any:
        # Parameters live in _parameters, not in __dict__, so reading one always lands here.
        adapters = self.__dict__.get("_modules", {}).get(LORA_ADAPTERS)
        if adapters is not None and name in adapters._modules:
            return adapters._modules[name](super().__getattr__(name))
        return super().__getattr__(name)


def _adapt(module: LoRAHost, name: str, rank: int, alpha: float, generator: torch.Generator) -> None:
    base = module._parameters.get(name)
    if base is None:  # a fixed buffer (ToMoELinear's placement) is not adapted
        return
    if not has_lora_adapters(module):
        module.add_module(LORA_ADAPTERS, nn.ModuleDict())
    module._modules[LORA_ADAPTERS][name] = LoRADelta(base.shape, rank, alpha, generator).to(device=base.device, dtype=base.dtype)


def add_lora(block: nn.Module, rank: int, alpha: float, generator: torch.Generator) -> None:
    """Add LoRA adapters of rank ``rank`` to a converted block's experts and router (``lora_A`` drawn from ``generator``)."""
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        _adapt(block.experts, name, rank, alpha, generator)
    _adapt(block.router, "weight", rank, alpha, generator)


def freeze_experts(block: nn.Module) -> None:
    """The routed and shared experts' own weights stop training; LoRA adapters (``lora_A`` / ``lora_B``) keep training."""
    for part in (block.experts, block.shared_experts):
        for name, parameter in part.named_parameters():
            if "lora_" not in name.rsplit(".", 1)[-1]:
                parameter.requires_grad_(False)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter of the converted blocks into its base parameter (in place); returns ``model``."""
    for module in list(torch_model(model, "merge_lora").modules()):
        if isinstance(module, LoRAHost) and has_lora_adapters(module):
            for name, adapter in module._modules[LORA_ADAPTERS].items():
                base = module._parameters[name]
                base.copy_(adapter(base))
            del module._modules[LORA_ADAPTERS]
    return model
