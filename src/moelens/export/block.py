"""The torch side of an exported block: `TractMoeFfn` (becomes one tract_moe_ffn call)
inside `ExportBlock` (the shared expert and the family's combination, exported as
standard NNEF ops by torch-to-nnef's tracer), and the self-check that the two together
compute what the real block computes.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..families import Family
from ..families.entry import find_path, get_path
from ..families.tomoe import converted
from .errors import ExportRefused
from .spec import MoeSpec


class TractMoeFfn(torch.nn.Module):
    """One tract_moe_ffn call. In torch it computes `MoeSpec.routed` (tract's maths).

    Attributes:
        spec: The op's inputs and attributes.
        quantize: ``"q4_0"`` to store w1/w2/w3 as tract Q4_0, or None.
        layout: ``"canonical"`` (w1/w3 [E, D, H], w2 [E, H, D]) or ``"linear"``
            (w1/w3 [E, H, D], w2 [E, D, H]).
        stored: The expert weights as the extractor wrote them, by name: (the spec tensor
            they came from, the stored data), kept so the export's check reuses the Q4_0 data.
    """

    def __init__(self, spec: MoeSpec, quantize: str | None = None, layout: str = "canonical") -> None:
        super().__init__()
        self.spec = spec
        self.quantize = quantize
        self.layout = layout
        self.stored: dict[str, tuple[Tensor, Any]] = {}

    @property
    def spec(self) -> MoeSpec:
        """The op's inputs and attributes; setting it makes its tensors this module's buffers too (see `forward`)."""
        return self._spec

    @spec.setter
    def spec(self, spec: MoeSpec) -> None:
        self._spec = spec
        for name, tensor in spec.tensors().items():
            self.register_buffer(f"spec_{name}", tensor, persistent=False)

    def forward(self, hidden_states: Float[Tensor, "*tokens d"]) -> Float[Tensor, "*tokens d"]:
        # The spec's tensors are read as this module's buffers (not saved), which torch.jit.trace (run by torch-to-nnef,
        # which puts named copies in the buffers' place) traces as the module's state. A tensor no module holds becomes
        # a constant of the traced graph, which TorchScript never frees: a copy of the expert weights per export.
        buffers = {name: getattr(self, f"spec_{name}") for name in self._spec.tensors()}
        return self._spec.with_weights(**buffers).routed(hidden_states)


class ExportBlock(torch.nn.Module):
    """Stands in for a family's MoE block in the exported copy.

    ``mlp_output = family.combined(block, scale * tract_moe_ffn(x), shared(x))``, with
    ``shared(x) = sigmoid(gate(x)) * shared_module(x)`` when the family's shared expert
    is gated. The original block is kept (its shared expert and combine modules run
    from it); its router and experts are not called.
    """

    def __init__(self, family: Family, block: torch.nn.Module, moe: TractMoeFfn, *, root: bool = False) -> None:
        super().__init__()
        self.original = block
        self.moe = moe
        self._family = family
        self._root = root
        shared = family.shared
        self._shared_path = shared.module if shared is not None and not shared.on_layer else None
        self._gate_path = shared.gate if self._shared_path else None
        if self._shared_path is not None and find_path(block, self._shared_path) is None:
            self._shared_path = self._gate_path = None  # this checkpoint turns its shared expert off

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
            raise ExportRefused(
                f"{self._family.name}: the block is called with more than its hidden states "
                f"({len(args)} extra arguments, {sorted(kwargs)}); only hidden_states -> output blocks export."
            )
        routed = self.moe(hidden_states)
        if self.moe.spec.scale != 1.0:
            routed = routed * self.moe.spec.scale
        shared = None
        if self._shared_path is not None:
            shared = get_path(self.original, self._shared_path)(hidden_states)
            if self._gate_path is not None:
                shared = torch.sigmoid(get_path(self.original, self._gate_path)(hidden_states)) * shared
        output = self._family.combined(self.original, routed, shared)
        if self._family.combine.output_index is not None and not self._root:
            return (output, output)  # the second item (router scores) is unused by the layer
        return output


def block_output(family: Family, output: Any) -> Tensor:
    """The hidden states of a block's output (a tensor, or a tuple for some families)."""
    index = family.combine.output_index
    return output[index] if index is not None else output


def check_block(family: Family, block: torch.nn.Module, spec: MoeSpec, *, tokens: int = 64, seed: int = 0) -> float:
    """Check that `ExportBlock` (tract's maths) computes what ``block`` computes, on random inputs.

    Returns the max abs difference; raises `ExportRefused` when it exceeds 1e-5 relative
    to the output's scale: some part of the block is then not described by the family
    entry, and exporting it would silently change the model.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, spec.wg.shape[1], generator=generator)
    with torch.no_grad():
        real = block_output(family, block(x.clone())).float()  # a block may edit its input in place (router jitter)
        if real.shape[-1] != x.shape[-1]:
            remedy = ("convert only layers whose outputs are as wide as their inputs (target_modules=[...], e.g. "
                      "q_proj and o_proj), or the FFN blocks" if converted(family)
                      else "export the model around it instead")
            raise ExportRefused(
                f"{family.name}: the block maps {x.shape[-1]} features to {real.shape[-1]}, and tract_moe_ffn's "
                f"output has its input's width (a residual-stream FFN); {remedy}."
            )
        mine = ExportBlock(family, block, TractMoeFfn(spec), root=True)(x)
    error = float((real - mine).abs().max())
    scale = float(real.abs().max())
    bound = 1e-5 * scale  # relative: a block whose outputs are small is held as closely as any other
    if error <= bound:
        return error
    factor = float((real * mine).sum() / (mine * mine).sum().clamp_min(1e-30))
    if float((real - factor * mine).abs().max()) <= bound:
        what = (f"the block's output is {factor:.4g} times what tract_moe_ffn computes from the family entry: the "
                "router or block scales the experts' weights by a factor the entry does not record")
    else:
        what = (f"on random inputs the block's output differs from what tract_moe_ffn computes from the family entry "
                f"by up to {error:.3g} (output scale {scale:.3g}): the block computes something its entry does not "
                "describe (a different selection, a weight scaling, an extra projection)")
    raise ExportRefused(f"{family.name}: {what}, so it is refused rather than exported wrong.")
