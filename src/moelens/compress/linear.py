"""`ToMoELinear`: one Linear (or GPT-2 ``Conv1D``) split by output neurons into experts.

Expert e owns a group of the layer's output neurons (``masks[e]``): it computes
those outputs (``up_proj[e]`` holds their weight rows, ``act_fn`` is an identity)
and a fixed 0/1 ``down_proj[e]`` (a buffer, not a parameter) puts them back in
place. A token's skipped experts give their outputs' mean on the calibration
tokens where they were skipped (the down biases and the shared constant carry it),
so ``top_k == num_experts`` reproduces the dense layer. The block has the same
router / experts / shared-expert structure as `ToMoEBlock`, so `moelens.wrap`
serves its routing the same way.

transformers' batched and grouped experts implementations need experts whose
output has the width of their input, so a layer with ``in_features != out_features``
(GQA key/value projections, an output projection) gets square experts of width
``max(in, out)``: the experts' input is zero-padded, or their output carries zero
rows that the block slices off (``routed_output`` / ``expert_outputs`` are then that
wide; the first ``out_features`` are the layer's).

``weight`` and ``bias`` rebuild the dense parameters from the experts (in the
original layout: ``[out, in]`` for Linear, ``[in, out]`` for Conv1D). They are
read-only: a PEFT wrapper kept around the layer refuses to merge its adapter
(`refuse_adapter_merge`) instead of writing into a rebuilt copy.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool
from torch import Tensor

from .blocks import ToMoEBlock
from .errors import CompressionError
from .experts import ToMoEGatedExperts


def refuse_adapter_merge(layer: str, *args: object, **kwargs: object) -> None:
    """Stands for ``merge`` on a PEFT LoRA wrapper around a `ToMoELinear` (``layer``: its name).

    PEFT merges by adding to ``base_layer.weight``, which a `ToMoELinear` rebuilds from its
    experts on each read: the merge would be lost without a word (and an adapter folded into
    the experts would only act through the experts each token runs).
    """
    raise CompressionError(
        f"{layer}: PEFT cannot merge its LoRA adapter into a moelens.compress ToMoELinear (the layer's weight is "
        "rebuilt from its experts, so the merge would be lost). Keep the adapter unmerged (it acts on top of the "
        "converted layer), or merge it before converting: merge_and_unload() on the dense model, then tomoe."
    )


class ToMoELinear(ToMoEBlock):
    """A Linear / Conv1D layer as a mixture of output-neuron experts (see the module docstring).

    Attributes:
        in_features, out_features: The dense layer's sizes.
        transposed: The dense layer was a GPT-2 ``Conv1D`` (weight stored ``[in, out]``).
        neuron_index: ``[E, I]``: the output neuron each expert row computes (-1: padding).
    """

    in_features: int
    out_features: int
    transposed: bool = False

    @property
    def masks(self) -> Bool[Tensor, "e o"]:
        """``[E, out_features]``: which output neurons each expert computes."""
        masks = torch.zeros(self.num_experts, self.out_features, dtype=torch.bool, device=self.neuron_index.device)
        for expert, rows in enumerate(self.neuron_index):
            masks[expert, rows[rows >= 0]] = True
        return masks

    def _rebuild(self, values: Tensor, shape: tuple[int, ...]) -> Tensor:
        held = self.experts.__dict__.get("_ep_num_local")
        if held is not None and held < self.num_experts:  # moelens.parallel.shard_experts kept this rank's experts
            first = self.experts._ep_first
            raise CompressionError(
                f"{type(self).__name__}'s dense weight is rebuilt from all {self.num_experts} experts, and this rank "
                f"holds experts {first}..{first + held - 1} only (sharded by moelens.parallel.shard_experts); read it "
                "from the model before sharding."
            )
        out = values.new_zeros(shape)
        for expert, rows in enumerate(self.neuron_index):
            keep = rows >= 0
            row_values = values[expert][keep]
            out[rows[keep]] = row_values[:, : shape[1]] if len(shape) > 1 else row_values
        return out

    def _output_rows(self) -> tuple[Tensor, Tensor]:
        """Each expert's output-neuron weights ``[E, I, in]`` and biases ``[E, I]``: ``up_proj``, or the up
        half of the gated form `moelens.compress.exportable` gives identity experts (``relu(0 x + 1) * up``)."""
        experts = self.experts
        if isinstance(experts, ToMoEGatedExperts):
            size = experts.gate_up_proj.shape[1] // 2
            return experts.gate_up_proj[:, size:], experts.gate_up_proj_bias[:, size:]
        return experts.up_proj, experts.up_proj_bias

    @property
    def weight(self) -> Tensor:
        """The dense weight rebuilt from the experts (``[out, in]``; ``[in, out]`` for Conv1D)."""
        weight = self._rebuild(self._output_rows()[0], (self.out_features, self.in_features))
        return weight.t() if self.transposed else weight

    @property
    def bias(self) -> Tensor:
        """The dense bias rebuilt from the experts (zeros when the dense layer had none)."""
        return self._rebuild(self._output_rows()[1], (self.out_features,))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"experts={self.num_experts}, top_k={self.top_k}" + (", conv1d" if self.transposed else ""))
