"""The torch-to-nnef extractor that writes a `TractMoeFfn` as one tract_moe_ffn call.

Importing this module imports torch-to-nnef (the ``export`` extra) and registers the
extractor for `TractMoeFfn`; every exported block goes through it, whatever its family.
Expert weights may be stored as tract Q4_0 (``quantize="q4_0"``) and in the ``linear``
layout, as torch-to-nnef's own MoE extractor does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch_to_nnef import torch_graph as tg
from torch_to_nnef.op import helper
from torch_to_nnef.op.custom_extractors import ModuleInfoExtractor
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

from .block import TractMoeFfn
from .spec import MoeSpec

#: The op's optional bias inputs, in tract's positional order (after x, wg, w1, w2, w3).
BIAS_ORDER = ("wg_bias", "w1_bias", "w3_bias", "w2_bias")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def quantize_q4_0(tensor: torch.Tensor) -> Any:
    """tract Q4_0 (groups of 32, f16 scale, min-max calibration) of an expert weight."""
    return fp_to_tract_q4_0_with_min_max_calibration(tensor.contiguous(), percentile=1.0)


def stored(name: str, tensor: torch.Tensor, quantize: str | None, layout: str) -> Any:
    """An op input as written to the archive: in ``layout``, Q4_0 for expert weights if asked."""
    if name in EXPERT_WEIGHTS and layout == "linear":
        tensor = tensor.transpose(-1, -2).contiguous()
    if name in EXPERT_WEIGHTS and quantize == "q4_0":
        return quantize_q4_0(tensor)
    return tensor


def stored_weight(module: TractMoeFfn, name: str) -> Any:
    """`stored` of one of the module's expert weights, kept on the module (`TractMoeFfn.stored`).

    Quantizing is deterministic, so the data written to the archive is reused (by `dequantized`)
    as long as the spec still holds the tensor it came from.
    """
    tensor = getattr(module.spec, name)
    kept = module.stored.get(name)
    if kept is None or kept[0] is not tensor:
        kept = module.stored[name] = (tensor, stored(name, tensor, module.quantize, module.layout))
    return kept[1]


def dequantized(module: TractMoeFfn) -> MoeSpec:
    """The module's spec with each expert weight replaced by what the archive stores (dequantized)."""
    if module.quantize is None:
        return module.spec
    weights = {}
    for name in EXPERT_WEIGHTS:
        if getattr(module.spec, name) is None:
            continue
        value = stored_weight(module, name).decompress().to(torch.float32)
        weights[name] = value.transpose(-1, -2).contiguous() if module.layout == "linear" else value
    return module.spec.with_weights(**weights)


def op_inputs(spec: MoeSpec) -> list[tuple[str, torch.Tensor]]:
    """The op's tensor inputs after x, in tract's positional order (biases: all four or the router's alone)."""
    inputs = [("wg", spec.wg), ("w1", spec.w1), ("w2", spec.w2)]
    if spec.w3 is not None:
        inputs.append(("w3", spec.w3))
    if spec.has_expert_biases:
        zeros = {
            "wg_bias": spec.wg.new_zeros(spec.num_experts),
            "w1_bias": spec.w1.new_zeros(spec.num_experts, spec.w1.shape[2]),
            "w3_bias": spec.w1.new_zeros(spec.num_experts, spec.w1.shape[2]),
            "w2_bias": spec.w2.new_zeros(spec.num_experts, spec.w2.shape[2]),
        }
        for name in BIAS_ORDER:
            value = getattr(spec, name)
            inputs.append((name, value if value is not None else zeros[name]))
    elif spec.wg_bias is not None:
        inputs.append(("wg_bias", spec.wg_bias))
    return inputs


def op_attributes(spec: MoeSpec, layout: str) -> dict[str, Any]:
    """The op's attributes."""
    attributes: dict[str, Any] = {"k": spec.k, "activation": spec.activation, "gate": spec.gate}
    if spec.act_limit is not None:
        attributes["act_alpha"] = float(spec.act_alpha)
        attributes["act_limit"] = float(spec.act_limit)
    if layout != "canonical":
        attributes["expert_layout"] = layout
    return attributes


class TractMoeFfnExtractor(ModuleInfoExtractor):
    """Writes a `TractMoeFfn` as ``y = tract_moe_ffn(x, wg, w1, w2, w3[, biases], k=, activation=, gate=...)``."""

    MODULE_CLASS = TractMoeFfn

    def convert_to_nnef(self, g, node, name_to_tensor, null_ref, torch_graph, inference_target, **kwargs):
        module: TractMoeFfn = node.op_ref
        spec = module.spec
        prefix = node.outputs[0].name

        def variable(name: str, tensor: torch.Tensor):
            data = stored_weight(module, name) if name in EXPERT_WEIGHTS else tensor
            if module.quantize and name in EXPERT_WEIGHTS:
                data.nnef_name = f"{prefix}_{name}"  # a quantized tensor is written under this name
            return helper.get_or_add_tensor_variable_in_nnef(
                g,
                tg.TensorVariable(name=f"{prefix}_{name}", data=data, shape=list(data.shape), dtype=torch.float32),
                name_to_tensor,
            )

        x = helper.get_or_add_tensor_variable_in_nnef(g, node.inputs[0], name_to_tensor)
        inputs = [x] + [variable(name, tensor) for name, tensor in op_inputs(spec)]
        output = helper.add_tensor_variable_node_as_nnef_tensor(g, node.outputs[0], name_to_tensor, prevent_variable=True)
        helper.cast_and_add_nnef_operation(
            name_to_tensor=name_to_tensor,
            graph=g,
            type="tract_moe_ffn",
            inputs=tuple(inputs),
            outputs=(output,),
            attribs=op_attributes(spec, module.layout),
            force_consistent_inputs_shapes=False,  # x is [T, D] or [B, S, D], the weights rank 3
        )
        return ["tract_transformers"]
