"""`DenseLayer`: a dense FFN or Linear layer seen as neurons, whatever module it came from.

``h = act(gate(x)) * up(x)`` (gated FFN), ``h = act(up(x))`` (plain FFN) or
``h = up(x)`` (a Linear: ``act`` is an identity and there is no down projection,
neuron i *is* output i); ``y = down(h) + down_bias``. The conversion works on this
view only; `moelens.compress.targets` reads it off SwiGLU, BERT and GPT-2 modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn


@dataclass
class DenseLayer:
    """Weights of one dense layer as neurons (float32 copies; see the module docstring).

    Attributes:
        up: ``[N, D]``; up_bias ``[N]``.
        gate: ``[N, D]`` for a gated FFN, else None; gate_bias ``[N]``.
        down: ``[D_out, N]``, or None for a Linear layer (identity: D_out == N).
        down_bias: ``[D_out]``.
        act: The activation module (an ``nn.Identity`` for a Linear layer).
    """

    up: Float[Tensor, "n d"]
    up_bias: Float[Tensor, " n"]
    down_bias: Float[Tensor, " o"]
    act: nn.Module
    gate: Float[Tensor, "n d"] | None = None
    gate_bias: Float[Tensor, " n"] | None = None
    down: Float[Tensor, "o n"] | None = None

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def linear(self) -> bool:
        """A single Linear layer (neurons are the outputs)."""
        return self.down is None

    @property
    def neurons(self) -> int:
        return self.up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.up.shape[1]

    @property
    def output_size(self) -> int:
        return self.down_bias.shape[0]

    def down_norms(self) -> Float[Tensor, " n"]:
        """How much one unit of each neuron's activation moves the output: ``||down[:, i]||``."""
        return self.down.norm(dim=0) if self.down is not None else torch.ones(self.neurons)

    @torch.no_grad()
    def hidden(self, x: Float[Tensor, "t d"]) -> Float[Tensor, "t n"]:
        """The neurons' activations on ``x``."""
        up = x @ self.up.T + self.up_bias
        if self.gate is None:
            return self.act(up)
        return self.act(x @ self.gate.T + self.gate_bias) * up

    @torch.no_grad()
    def project(self, hidden: Float[Tensor, "t n"]) -> Float[Tensor, "t o"]:
        """The dense layer's output from its neurons' activations (a Linear's neurons are its outputs)."""
        if self.down is None:
            return hidden
        return hidden @ self.down.T + self.down_bias

