"""`exportable`: a copy of a converted model whose experts tract_moe_ffn can express exactly.

tract_moe_ffn takes expert biases only together with an up projection (``w3``), and
has no identity activation. Plain experts ``down(act(up(x) + b))`` (BERT / GPT-2
FFNs) and the identity experts of `ToMoELinear` are rewritten as gated experts that
compute exactly the same numbers:

* ``act(g) * u`` with ``g = up(x) + b`` and ``u = 0 * x + 1`` (multiplying by 1.0 is exact);
* an identity ``u`` as ``relu(0 * x + 1) * u`` (``relu(1.0) == 1.0``).

LoRA adapters are merged first. The copy computes what the model computes (up to
the float32 rounding of the wider ``gate_up`` matmul, one ulp in the tests) and
exports with ``moelens.export.to_nnef``; the model itself is not changed. A Linear
with ``in_features != out_features`` (square-padded experts, see `ToMoELinear`)
does not export: tract's router and experts must share one width.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .errors import torch_model
from .experts import ToMoEExperts, ToMoEGatedExperts
from .lora import merge_lora


def _is_identity(act: nn.Module) -> bool:
    return isinstance(act, nn.Identity)


@torch.no_grad()
def gated_form(experts: ToMoEExperts) -> ToMoEGatedExperts:
    """Gated experts computing exactly what ``experts`` (plain or identity experts) compute."""
    count, size, hidden = experts.up_proj.shape
    output = experts.down_proj.shape[1]
    identity = _is_identity(experts.act_fn)
    act = nn.ReLU() if identity else copy.deepcopy(experts.act_fn)
    gated = ToMoEGatedExperts(experts.config, count, hidden, size, output, act)
    gated.to(dtype=experts.up_proj.dtype, device=experts.up_proj.device)
    up_weight, up_bias = experts.up_proj.detach(), experts.up_proj_bias.detach()
    if identity:  # relu(0 x + 1) * (W x + b)
        gated.gate_up_proj[:, :size].zero_()
        gated.gate_up_proj_bias[:, :size].fill_(1.0)
        gated.gate_up_proj[:, size:] = up_weight
        gated.gate_up_proj_bias[:, size:] = up_bias
    else:  # act(W x + b) * (0 x + 1)
        gated.gate_up_proj[:, :size] = up_weight
        gated.gate_up_proj_bias[:, :size] = up_bias
        gated.gate_up_proj[:, size:].zero_()
        gated.gate_up_proj_bias[:, size:].fill_(1.0)
    gated.down_proj.copy_(experts.down_proj)
    gated.down_proj_bias.copy_(experts.down_proj_bias)
    sources = {"gate_up_proj": experts.up_proj, "gate_up_proj_bias": experts.up_proj_bias,
               "down_proj": experts.down_proj, "down_proj_bias": experts.down_proj_bias}
    for name, source in sources.items():  # frozen experts stay frozen, a fixed placement (a buffer) fixed
        getattr(gated, name).requires_grad_(isinstance(source, nn.Parameter) and source.requires_grad)
    gated.train(experts.training)
    return gated


def exportable(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every plain / identity experts module in gated form (see the module docstring)."""
    model = merge_lora(copy.deepcopy(torch_model(model, "exportable")))
    for name, module in list(model.named_modules()):
        if type(module) is ToMoEExperts:
            model.set_submodule(name, gated_form(module))
    return model
