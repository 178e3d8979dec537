"""What to convert: dense FFN blocks and single Linear layers found in a model, and what to skip (with why).

FFN blocks are recognised by their parts (`FFN_KINDS`): a SwiGLU ``mlp`` with
``gate_proj / up_proj / down_proj`` (Llama, Qwen2, Mistral, Gemma ...), a BERT layer's
``intermediate.dense / output.dense``, a GPT-2 ``mlp`` with ``c_fc / c_proj``
(``Conv1D``). Single Linear / Conv1D layers are candidates with
``target_attention_only`` (inside attention modules) or ``target_modules`` (names
or a regex, as in PEFT). A candidate is skipped, with the reason, when it is
protected (heads, embeddings, poolers, routers), a fused QKV projection, shares
its weight with another module, or is too small for the experts asked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .blocks import ToMoEBlock, ToMoEIntermediateBlock
from .dense import DenseLayer

#: Name components that mark a module as protected (never converted).
PROTECTED = ("lm_head", "classifier", "pooler", "embed_tokens", "embeddings", "embedding", "embed", "wte", "wpe",
             "score", "qa_outputs", "cls", "head", "heads", "router", "gate", "predictions", "decoder_head")
#: Last name components of fused query/key/value projections.
FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv", "in_proj", "W_pack", "to_qkv", "qkv_linear")
#: Name components of attention modules (for ``target_attention_only``).
ATTENTION = ("attn", "attention", "self_attn", "self_attention", "crossattention", "cross_attn")
#: Smallest layer converted: at least this many outputs (or neurons) per expert.
MIN_PER_EXPERT = 2
#: Smallest layer converted: at least this many weights.
MIN_WEIGHTS = 256


def conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return None
    return Conv1D


def is_peft_layer(module: Any) -> bool:
    """A PEFT tuner layer (LoRA ...) wrapping a ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def is_linear(module: Any) -> bool:
    """An ``nn.Linear`` or GPT-2 ``Conv1D`` (or a PEFT layer wrapping one)."""
    if is_peft_layer(module):
        return is_linear(module.base_layer)
    conv1d = conv1d_class()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def base_of(module: nn.Module) -> nn.Module:
    """The Linear inside a PEFT wrapper (or the module itself)."""
    return module.base_layer if is_peft_layer(module) else module


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``(weight [out, in], bias or None, transposed)`` of a Linear / Conv1D (inside a PEFT wrapper too)."""
    base = base_of(module)
    transposed = not isinstance(base, nn.Linear)
    weight = base.weight.detach().float()
    weight = weight.T if transposed else weight
    bias = base.bias.detach().float() if getattr(base, "bias", None) is not None else None
    return weight, bias, transposed


@dataclass
class Site:
    """One thing to convert.

    Attributes:
        name: Where the converted block goes (module name).
        kind: ``"swiglu"``, ``"bert"``, ``"gpt2"`` (FFN blocks) or ``"linear"``.
        hook: The module whose input is the layer's input (calibration is captured there).
        parts: The dense modules the conversion replaces (their parameters are the "original" count).
        read: Builds the `DenseLayer` view.
        install: Puts the converted module in place.
        block_class: The block class to build.
        dropout: The dense block's output dropout, kept in the converted block (GPT-2).
        peft: The PEFT wrapper staying around the converted layer (Linear sites), or None.
        num_experts, top_k: Set per site (GQA-narrow projections get fewer experts).
    """

    name: str
    kind: str
    hook: nn.Module
    parts: list[nn.Module]
    read: Callable[[], DenseLayer]
    install: Callable[[nn.Module], None]
    block_class: type = ToMoEBlock
    dropout: nn.Module | None = None
    peft: nn.Module | None = None
    num_experts: int = 0
    top_k: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def original_parameters(self) -> int:
        seen: set[int] = set()
        total = 0
        for part in self.parts:
            for parameter in part.parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    total += parameter.numel()
        return total

    @property
    def reference(self) -> nn.Module:
        """A dense module whose parameters give the converted block's dtype and device."""
        return self.parts[0]


@dataclass
class Skip:
    """A candidate left dense, and why."""

    name: str
    reason: str


def _setter(parent: nn.Module, child: str) -> Callable[[nn.Module], None]:
    return lambda module: setattr(parent, child, module)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def _tuned(*modules: nn.Module) -> bool:
    return any(is_peft_layer(module) for module in modules)


def ffn_site(model: nn.Module, name: str, module: nn.Module) -> Site | Skip | None:
    """The FFN block site at ``module`` (named ``name``), a skip with the reason, or None when it is no FFN."""
    children = dict(module.named_children())
    if all(part in children for part in ("gate_proj", "up_proj", "down_proj")) and callable(getattr(module, "act_fn", None)):
        gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        if not all(is_linear(m) for m in (gate, up, down)):
            return None
        if _tuned(gate, up, down):
            return Skip(name, "PEFT adapters on the FFN's projections: convert its Linear layers with target_modules "
                              "to keep them")

        def read_swiglu() -> DenseLayer:
            gate_w, gate_b, _ = linear_weights(gate)
            up_w, up_b, _ = linear_weights(up)
            down_w, down_b, _ = linear_weights(down)
            zeros = torch.zeros(up_w.shape[0])
            return DenseLayer(up=up_w, up_bias=up_b if up_b is not None else zeros, gate=gate_w,
                              gate_bias=gate_b if gate_b is not None else zeros, down=down_w,
                              down_bias=down_b if down_b is not None else torch.zeros(down_w.shape[0]),
                              act=module.act_fn)

        parent, child = _parent(model, name)
        return Site(name, "swiglu", module, [module], read_swiglu, _setter(parent, child))
    if "gate_up_proj" in children and "down_proj" in children and is_linear(children["gate_up_proj"]):
        return Skip(name, "fused gate_up_proj FFN (one Linear for gate and up): not supported")
    intermediate, output = children.get("intermediate"), children.get("output")
    if (intermediate is not None and output is not None and is_linear(getattr(intermediate, "dense", None))
            and is_linear(getattr(output, "dense", None)) and callable(getattr(intermediate, "intermediate_act_fn", None))
            and hasattr(output, "LayerNorm")):
        first, second = intermediate.dense, output.dense
        if _tuned(first, second):
            return Skip(f"{name}.intermediate", "PEFT adapters on the FFN's projections: convert its Linear layers "
                                                "with target_modules to keep them")

        def read_bert() -> DenseLayer:
            up_w, up_b, _ = linear_weights(first)
            down_w, down_b, _ = linear_weights(second)
            return DenseLayer(up=up_w, up_bias=up_b if up_b is not None else torch.zeros(up_w.shape[0]), down=down_w,
                              down_bias=down_b if down_b is not None else torch.zeros(down_w.shape[0]),
                              act=intermediate.intermediate_act_fn)

        def install_bert(block: nn.Module) -> None:
            module.intermediate = block
            output.dense = nn.Identity()

        return Site(f"{name}.intermediate", "bert", intermediate, [intermediate, second], read_bert, install_bert,
                    block_class=ToMoEIntermediateBlock)
    conv1d = conv1d_class()
    c_fc, c_proj = children.get("c_fc"), children.get("c_proj")
    if (conv1d is not None and c_fc is not None and c_proj is not None and callable(getattr(module, "act", None))
            and is_linear(c_fc) and is_linear(c_proj)):
        if _tuned(c_fc, c_proj):
            return Skip(name, "PEFT adapters on the FFN's projections: convert its Linear layers with target_modules "
                              "to keep them")

        def read_gpt2() -> DenseLayer:
            up_w, up_b, _ = linear_weights(c_fc)
            down_w, down_b, _ = linear_weights(c_proj)
            return DenseLayer(up=up_w, up_bias=up_b if up_b is not None else torch.zeros(up_w.shape[0]), down=down_w,
                              down_bias=down_b if down_b is not None else torch.zeros(down_w.shape[0]), act=module.act)

        parent, child = _parent(model, name)
        return Site(name, "gpt2", module, [module], read_gpt2, _setter(parent, child),
                    dropout=getattr(module, "dropout", None))
    return None


def linear_site(model: nn.Module, name: str, module: nn.Module) -> Site:
    """The site of a single Linear / Conv1D layer (a PEFT wrapper stays around it)."""
    peft = module if is_peft_layer(module) else None

    def read_linear() -> DenseLayer:
        weight, bias, _ = linear_weights(module)
        out = weight.shape[0]
        return DenseLayer(up=weight, up_bias=bias if bias is not None else torch.zeros(out),
                          down_bias=torch.zeros(out), act=nn.Identity())

    if peft is not None:
        def install(block: nn.Module) -> None:
            peft.base_layer = block
        hook = peft.base_layer
    else:
        parent, child = _parent(model, name)
        install = _setter(parent, child)
        hook = module
    from .linear import ToMoELinear

    return Site(name, "linear", hook, [base_of(module)], read_linear, install, block_class=ToMoELinear, peft=peft)


def _components(name: str) -> list[str]:
    return name.split(".")


def protected_reason(name: str) -> str:
    """Why a module is protected from conversion, or ``""``."""
    for part in _components(name):
        lowered = part.lower()
        if lowered in PROTECTED or any(lowered.startswith(p + "_") or lowered.endswith("_" + p) for p in PROTECTED):
            return f"protected ({part}: output heads, embeddings, poolers and routers stay dense)"
    return ""


def in_attention(name: str) -> bool:
    parts = [p.lower() for p in _components(name)[:-1]]
    return any(p in ATTENTION or p.endswith("attn") or p.endswith("attention") for p in parts)


def matches(name: str, targets: str | list[str] | tuple[str, ...]) -> bool:
    """PEFT-style matching: a regex (full match) for a string, else exact names or ``.suffix`` names."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == target or name.endswith("." + target) for target in targets)


def shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """Module names by weight storage, for the weights that several modules share (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and not isinstance(type(module).__dict__.get("weight"), property):
            owners.setdefault(weight.data_ptr(), []).append(name)
    return {ptr: names for ptr, names in owners.items() if len(set(names)) > 1}


def linear_skip_reason(name: str, module: nn.Module, tied: dict[int, list[str]], num_experts: int) -> str:
    """Why a Linear candidate stays dense, or ``""``."""
    reason = protected_reason(name)
    if reason:
        return reason
    if _components(name)[-1] in FUSED_QKV:
        return "fused QKV projection: splitting its outputs would mix queries, keys and values"
    if is_peft_layer(module) and getattr(module, "merged", False):
        return "its PEFT adapter is merged into the weights: unmerge it first"
    base = base_of(module)
    owners = tied.get(base.weight.data_ptr())
    if owners:
        others = sorted({o for o in owners if o != name and not o.startswith(name + ".")})
        if others:
            return f"tied weights (shared with {', '.join(others)})"
    weight, _, _ = linear_weights(module)
    out_features, in_features = weight.shape
    if out_features < MIN_PER_EXPERT * num_experts or weight.numel() < MIN_WEIGHTS:
        return f"too small ({in_features} -> {out_features}) for {num_experts} experts of at least {MIN_PER_EXPERT} outputs"
    return ""


def narrow_experts(site_out: int, widest: int, num_experts: int, top_k: int) -> tuple[int, int]:
    """Experts for a projection narrower than its attention's widest (GQA k/v): proportionally fewer, same active share."""
    if site_out >= widest:
        return num_experts, top_k
    experts = max(2, round(num_experts * site_out / widest))
    experts = min(experts, num_experts)
    k = max(1, min(experts, round(top_k * experts / num_experts)))
    return experts, k
