"""The experts modules of converted layers, built like transformers' own MoE experts.

Both classes are decorated with transformers' ``use_experts_implementation``, so
they are called as ``experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])``
and run through ``eager``, ``batched_mm`` or ``grouped_mm`` (or any implementation
registered with transformers, moelens' expert-parallel ``torch_a2a`` included):
`moelens.wrap` serves their per-slot values, export and expert parallelism read
their 3-D weights under the standard names.

* `ToMoEGatedExperts`: gated experts (SwiGLU and other GLU FFNs):
  ``down(act(gate(x)) * up(x))``, weights ``gate_up_proj [E, 2I, D]`` (gate rows
  first) and ``down_proj [E, D_out, I]``.
* `ToMoEExperts`: plain experts ``down(act(up(x)))`` (BERT / GPT-2 GELU FFNs, and
  split Linear layers with an identity activation): ``up_proj [E, I, D]``,
  ``down_proj [E, D_out, I]``.

Both carry biases (``*_bias``): the up biases of the dense layer and, on the down
projection, each expert's share of the compensation for the experts a token skips
(see `moelens.compress.fit`).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers.integrations.moe import use_experts_implementation

from .lora import LoRAHost


class ExpertsSettings:
    """What transformers' experts dispatch reads from ``experts.config``.

    A converted dense model has no MoE in its own config (and its class cannot
    switch experts implementations), so the experts of one compressed model share
    this small object instead; `moelens.compress.set_experts_implementation`
    changes it.

    Attributes:
        _experts_implementation: ``"eager"``, ``"batched_mm"``, ``"grouped_mm"``, or
            any implementation registered in transformers' ``ExpertsInterface``.
    """

    def __init__(self, experts_implementation: str = "grouped_mm") -> None:
        self._experts_implementation = experts_implementation

    def __repr__(self) -> str:
        return f"ExpertsSettings(experts_implementation={self._experts_implementation!r})"


def _eager_loop(
    module: nn.Module,
    hidden_states: Float[Tensor, "t d"],
    top_k_index: Int[Tensor, "t k"],
    top_k_weights: Float[Tensor, "t k"],
) -> Float[Tensor, "t o"]:
    """The reference loop over the experts hit by at least one token."""
    out = hidden_states.new_zeros(hidden_states.shape[0], module.down_proj.shape[1])
    for expert in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == expert)
        projected = module.project(hidden_states[token], expert)
        out.index_add_(0, token, projected * top_k_weights[token, slot, None].to(projected.dtype))
    return out.to(hidden_states.dtype)


class _Experts(LoRAHost):
    """What both experts classes share: sizes, the down projection, the activation (and LoRA adapters, `LoRAHost`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, output_size: int,
                 act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = intermediate_size
        self.down_proj = nn.Parameter(torch.zeros(num_experts, output_size, intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, output_size))
        self.act_fn = act_fn

    def activations(self, hidden: Float[Tensor, "n d"], expert: int) -> Float[Tensor, "n i"]:
        raise NotImplementedError

    def project(self, hidden: Float[Tensor, "n d"], expert: int) -> Float[Tensor, "n o"]:
        """Expert ``expert``'s output (unweighted) on ``hidden``."""
        return nn.functional.linear(self.activations(hidden, expert), self.down_proj[expert], self.down_proj_bias[expert])


@use_experts_implementation(has_gate=True, has_bias=True)
class ToMoEGatedExperts(_Experts):
    """E gated experts: expert e computes ``down_e(act(gate_e(x) + bg_e) * (up_e(x) + bu_e)) + bd_e``.

    Attributes:
        num_experts: E.
        hidden_dim: D, the input width.
        intermediate_dim: I, neurons per expert (smaller experts are zero-padded).
        gate_up_proj: ``[E, 2I, D]``, the gate rows then the up rows of each expert.
        gate_up_proj_bias: ``[E, 2I]``.
        down_proj: ``[E, D_out, I]``.
        down_proj_bias: ``[E, D_out]``: minus the expert's mean contribution when skipped.
        act_fn: The dense layer's activation module.
    """

    def __init__(self, config: ExpertsSettings, num_experts: int, hidden_size: int, intermediate_size: int,
                 output_size: int, act_fn: nn.Module) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, output_size, act_fn)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))

    def activations(self, hidden: Float[Tensor, "n d"], expert: int) -> Float[Tensor, "n i"]:
        """Expert ``expert``'s hidden activations (``act(gate) * up``) on ``hidden``."""
        gate_up = nn.functional.linear(hidden, self.gate_up_proj[expert], self.gate_up_proj_bias[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # Defined on each decorated class, not inherited: the decorated forward then keeps this class's
        # qualified name, so a wrapped model (nnsight stores it on the instance) pickles.
        return _eager_loop(self, hidden_states, top_k_index, top_k_weights)


@use_experts_implementation(has_gate=False, has_bias=True)
class ToMoEExperts(_Experts):
    """E plain experts: expert e computes ``down_e(act(up_e(x) + bu_e)) + bd_e``.

    Attributes:
        num_experts: E.
        hidden_dim: D, the input width.
        intermediate_dim: I, neurons per expert (smaller experts are zero-padded).
        up_proj: ``[E, I, D]``.
        up_proj_bias: ``[E, I]``.
        down_proj: ``[E, D_out, I]``.
        down_proj_bias: ``[E, D_out]``: minus the expert's mean contribution when skipped.
        act_fn: The dense layer's activation module (``nn.Identity`` for a split Linear).
    """

    def __init__(self, config: ExpertsSettings, num_experts: int, hidden_size: int, intermediate_size: int,
                 output_size: int, act_fn: nn.Module) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, output_size, act_fn)
        self.up_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size))
        self.up_proj_bias = nn.Parameter(torch.zeros(num_experts, intermediate_size))

    def activations(self, hidden: Float[Tensor, "n d"], expert: int) -> Float[Tensor, "n i"]:
        """Expert ``expert``'s hidden activations (``act(up)``) on ``hidden``."""
        return self.act_fn(nn.functional.linear(hidden, self.up_proj[expert], self.up_proj_bias[expert]))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return _eager_loop(self, hidden_states, top_k_index, top_k_weights)  # see ToMoEGatedExperts.forward


def experts_class(gated: bool) -> type[nn.Module]:
    """The experts class for a gated (GLU) or a plain FFN."""
    return ToMoEGatedExperts if gated else ToMoEExperts


def is_tomoe_experts(module: Any) -> bool:
    """Whether ``module`` is the experts module of a converted layer."""
    return isinstance(module, _Experts)
