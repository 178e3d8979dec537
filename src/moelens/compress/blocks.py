"""`ToMoEBlock`: a dense FFN converted into a Mixture-of-Experts block moelens serves.

The block computes what every decorated MoE in transformers computes::

    logits, w, idx = router(x)        # w == 1 for the k selected experts
    routed = experts(x, idx, w)       # sum of the k experts' outputs
    out = routed + shared_experts(x)  # always-active neurons + a constant

Expert e holds a group of the dense FFN's intermediate neurons; its down bias is
minus what the block adds for it when a token skips it, and the shared expert's
output bias carries the dense output bias plus the sum of those compensations. So
with every expert selected the block is the dense FFN, and with k of E selected a
skipped expert contributes its mean instead of nothing.

`ToMoEIntermediateBlock` is the same block standing where BERT keeps the first
half of its FFN (``layer.intermediate``; the layer's ``output.dense`` becomes an
identity): it has its own class so its family entry can say where it sits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from torch.nn.utils import skip_init

from .router import ToMoERouter


class ToMoESharedExpert(nn.Module):
    """The always-active part of a converted layer: shared neurons (maybe none) plus a constant.

    ``output = down(act(gate(x)) * up(x))`` (gated) or ``down(act(up(x)))``, whose
    ``down.bias`` is the constant (dense output bias + the skipped experts'
    compensation); with no shared neuron the output is that constant for every token.

    Attributes:
        num_neurons: Shared neurons (0: the expert is a constant).
        up_proj, gate_proj, down_proj: ``nn.Linear`` layers (``gate_proj`` only when gated;
            ``up_proj`` / ``gate_proj`` absent when there is no shared neuron).
        bias: The constant ``[D_out]`` (``down_proj.bias`` when there are shared neurons).
    """

    def __init__(self, hidden_size: int, output_size: int, num_neurons: int, gated: bool, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_neurons = num_neurons
        self.output_size = output_size
        self.gated = gated
        if num_neurons:
            # skip_init: nn.Linear's own initialisation would draw from torch's global random stream (the user's)
            self.up_proj = skip_init(nn.Linear, hidden_size, num_neurons, bias=True)
            if gated:
                self.gate_proj = skip_init(nn.Linear, hidden_size, num_neurons, bias=True)
            self.act_fn = act_fn
            self.down_proj = skip_init(nn.Linear, num_neurons, output_size, bias=True)
            for linear in self.children():
                if isinstance(linear, nn.Linear):
                    nn.init.zeros_(linear.weight)
                    nn.init.zeros_(linear.bias)
        else:
            self.bias = nn.Parameter(torch.zeros(output_size))

    @property
    def constant(self) -> Tensor:
        """The constant part of the output ``[D_out]``."""
        return self.down_proj.bias if self.num_neurons else self.bias

    def activations(self, hidden: Float[Tensor, "t d"]) -> Float[Tensor, "t s"]:
        """The shared neurons' activations ``[T, S]``."""
        up = self.up_proj(hidden)
        return self.act_fn(self.gate_proj(hidden)) * up if self.gated else self.act_fn(up)

    def forward(self, hidden_states: Float[Tensor, "t d"]) -> Float[Tensor, "t o"]:
        if not self.num_neurons:
            # The constant for every token (zeros_like + broadcast: traceable by torch-to-nnef, unlike expand).
            return torch.zeros_like(hidden_states[..., :1]) + self.bias.to(hidden_states.dtype)
        return self.down_proj(self.activations(hidden_states))


class ToMoEBlock(nn.Module):
    """A converted FFN: router, experts and a shared expert (see the module docstring).

    Attributes:
        router: `ToMoERouter`.
        experts: `ToMoEGatedExperts` or `ToMoEExperts`.
        shared_experts: `ToMoESharedExpert`.
        dropout: The dense block's output dropout (GPT-2's module, Starcoder2's rate), or an identity.
        neuron_index: ``[E, I]`` long buffer: the dense intermediate neuron each expert
            slot came from (-1 for padding), so conversions can be traced back.
        shared_index: ``[S]`` long buffer: the dense neurons that became shared neurons.
    """

    def __init__(self, router: ToMoERouter, experts: nn.Module, shared_experts: ToMoESharedExpert,
                 dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.router = router
        self.experts = experts
        self.shared_experts = shared_experts
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.register_buffer("neuron_index", torch.full((experts.num_experts, experts.intermediate_dim), -1))
        self.register_buffer("shared_index", torch.zeros(shared_experts.num_neurons, dtype=torch.long))
        #: Zero features appended to the experts' input (a Linear with fewer inputs than outputs).
        self.input_pad = experts.hidden_dim - router.weight.shape[1]
        #: Features of the block output (the experts may compute more: padding, sliced off).
        self.output_size = shared_experts.output_size

    @property
    def num_experts(self) -> int:
        """E: the block's routed experts (``experts.num_experts``, where its family entry reads E; a converted narrow
        Linear may have fewer than the conversion asked for, as its `LayerStats` notes say)."""
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        """k: the experts each token runs, as the router picks them (``router.top_k``, where the family entry reads
        it)."""
        return self.router.top_k

    def forward(self, hidden_states: Float[Tensor, "*tokens d"]) -> Float[Tensor, "*tokens o"]:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        _, top_k_weights, top_k_index = self.router(hidden)
        expert_input = F.pad(hidden, (0, self.input_pad)) if self.input_pad else hidden
        routed = self.experts(expert_input, top_k_index, top_k_weights)
        if routed.shape[-1] != self.output_size:  # square padding of a Linear's experts
            routed = routed[:, : self.output_size]
        shared = self.shared_experts(hidden)
        output = self.dropout(routed + shared)
        return output.view(*shape[:-1], output.shape[-1])


class ToMoEIntermediateBlock(ToMoEBlock):
    """A `ToMoEBlock` standing at a BERT layer's ``intermediate`` (the whole FFN; ``output.dense`` is an identity)."""
