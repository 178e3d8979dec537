"""What to convert: dense FFN blocks and single Linear layers found in a model, and what to skip (with why).

FFN blocks are recognised by their parts (`ffn_site`): a SwiGLU ``mlp`` with
``gate_proj / up_proj / down_proj`` (Llama, Qwen2, Mistral, Gemma ...), a BERT layer's
``intermediate.dense / output.dense``, a GPT-2 ``mlp`` with ``c_fc / c_proj``
(``Conv1D``). Single Linear / Conv1D layers are candidates with
``target_attention_only`` (inside attention modules) or ``target_modules`` (names
or a regex, as in PEFT). A candidate is skipped, with the reason, when it is
protected (heads, embeddings, poolers, routers), a fused QKV projection, shares
its weight with another module, sits inside an MoE block (a converted one, or one
of a model that has MoE layers already: moelens' own detection, `is_moe_block`), or
is too small for the experts asked.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..components.implementations import is_dispatching
from ..families import registry
from ..modules import is_adapter_layer
from .blocks import ToMoEBlock, ToMoEIntermediateBlock
from .dense import DenseLayer
from .linear import ToMoELinear, refuse_adapter_merge

#: Name components that mark a module as protected (never converted).
PROTECTED = ("lm_head", "classifier", "pooler", "embed_tokens", "embeddings", "embedding", "embed", "wte", "wpe",
             "score", "qa_outputs", "cls", "head", "heads", "router", "gate", "predictions", "decoder_head")
#: FFN projections whose names start like a router's (``gate_...``): not protected.
FFN_PROJECTIONS = ("gate_proj", "gate_up_proj", "up_gate_proj")
#: Last name components of fused query/key/value projections.
FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv", "in_proj", "W_pack", "to_qkv", "qkv_linear")
#: Name components of attention modules (for ``target_attention_only``).
ATTENTION = ("attn", "attention", "self_attn", "self_attention", "crossattention", "cross_attn")
#: Smallest layer converted: at least this many outputs (or neurons) per expert.
MIN_PER_EXPERT = 2
#: Smallest layer converted: at least this many weights.
MIN_WEIGHTS = 256
#: Why an FFN whose projections carry PEFT adapters stays dense.
PEFT_FFN = "PEFT adapters on the FFN's projections: convert its Linear layers with target_modules to keep them"


def is_linear(module: Any) -> bool:
    """An ``nn.Linear`` or GPT-2 ``Conv1D`` (or a PEFT layer wrapping one)."""
    if is_adapter_layer(module):
        return is_linear(module.base_layer)
    return isinstance(module, (nn.Linear, Conv1D))


def base_of(module: nn.Module) -> nn.Module:
    """The Linear inside a PEFT wrapper (or the module itself)."""
    return module.base_layer if is_adapter_layer(module) else module


def is_transposed(module: nn.Module) -> bool:
    """The layer stores its weight ``[in, out]`` (a GPT-2 ``Conv1D``, not an ``nn.Linear``)."""
    return not isinstance(base_of(module), nn.Linear)


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a Linear / Conv1D (inside a PEFT wrapper too), without copying weights."""
    rows, columns = base_of(module).weight.shape
    return (columns, rows) if is_transposed(module) else (rows, columns)


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [out, in], bias [out])`` of a Linear / Conv1D in float32 on the CPU, where the compressor fits
    (its calibration rows are kept there; zeros for a layer without bias)."""
    base = base_of(module)
    weight = base.weight.detach().float().cpu()
    weight = weight.T if is_transposed(module) else weight
    bias = base.bias.detach().float().cpu() if getattr(base, "bias", None) is not None else torch.zeros(weight.shape[0])
    return weight, bias


@dataclass
class Site:
    """One thing to convert.

    Attributes:
        name: Where the converted block goes (module name).
        kind: ``"swiglu"``, ``"bert"``, ``"gpt2"`` (FFN blocks) or ``"linear"``.
        hook: The module whose input is the layer's input (calibration is captured there).
        parts: The dense modules the conversion replaces (their parameters are the "original" count).
        read: Builds the `DenseLayer` view (float32 copies of the weights).
        run: The dense layer's own forward on input rows ``[1, T, D]``: its output ``y`` (what the
            conversion must reproduce; checked against the `DenseLayer` view before converting).
        install: Puts the converted module in place.
        neurons: The dense layer's neurons: intermediate neurons (FFN) or outputs (Linear).
        width: The dense layer's input width (hidden size): one side of every weight the converted block has.
        block_class: The block class to build.
        dropout: The dense block's output dropout, kept in the converted block (`output_dropout`: GPT-2's
            ``dropout`` module, Starcoder2's and Seed-OSS's ``residual_dropout`` rate), or None.
        peft: The PEFT wrapper staying around the converted layer (Linear sites), or None.
        num_experts, top_k: Set per site (GQA-narrow projections get fewer experts).
    """

    name: str
    kind: str
    hook: nn.Module
    parts: list[nn.Module]
    read: Callable[[], DenseLayer]
    run: Callable[[torch.Tensor], torch.Tensor]
    install: Callable[[nn.Module], None]
    neurons: int
    width: int
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


def _setter(model: nn.Module, name: str) -> Callable[[nn.Module], None]:
    return lambda module: model.set_submodule(name, module)


def _tuned(*modules: nn.Module) -> bool:
    return any(is_adapter_layer(module) for module in modules)


def _ffn(up: nn.Module, down: nn.Module, act: nn.Module, gate: nn.Module | None = None) -> Callable[[], DenseLayer]:
    """The reader of an FFN: ``down(act(up(x)))`` (BERT, GPT-2), or ``down(act(gate(x)) * up(x))`` with ``gate``."""
    def read() -> DenseLayer:
        up_w, up_b = linear_weights(up)
        down_w, down_b = linear_weights(down)
        gate_w, gate_b = linear_weights(gate) if gate is not None else (None, None)
        return DenseLayer(up=up_w, up_bias=up_b, gate=gate_w, gate_bias=gate_b, down=down_w, down_bias=down_b,
                          act=act)

    return read


def ffn_site(model: nn.Module, name: str, module: nn.Module) -> Site | Skip | None:
    """The FFN block site at ``module`` (named ``name``), a skip with the reason, or None when it is no FFN."""
    children = dict(module.named_children())
    if all(part in children for part in ("gate_proj", "up_proj", "down_proj")) and callable(getattr(module, "act_fn", None)):
        gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        if not all(is_linear(m) for m in (gate, up, down)):
            return None
        if _tuned(gate, up, down):
            return Skip(name, PEFT_FFN)
        inner = getattr(module, "dropout", None)
        notes = ([f"the FFN's dropout on act(gate(x)) * up(x) (p={inner.p}, training only) is not kept"]
                 if isinstance(inner, nn.Dropout) and inner.p > 0 else [])
        return Site(name, "swiglu", module, [module], _ffn(up, down, module.act_fn, gate), module, _setter(model, name),
                    *linear_shape(up), dropout=output_dropout(module, "swiglu"), notes=notes)
    if "gate_up_proj" in children and "down_proj" in children and is_linear(children["gate_up_proj"]):
        return Skip(name, "fused gate_up_proj FFN (one Linear for gate and up): not supported")
    intermediate, output = children.get("intermediate"), children.get("output")
    if (intermediate is not None and output is not None and is_linear(getattr(intermediate, "dense", None))
            and is_linear(getattr(output, "dense", None)) and callable(getattr(intermediate, "intermediate_act_fn", None))
            and hasattr(output, "LayerNorm")):
        first, second = intermediate.dense, output.dense
        if _tuned(first, second):
            return Skip(f"{name}.intermediate", PEFT_FFN)

        def install_bert(block: nn.Module) -> None:
            module.intermediate = block
            output.dense = nn.Identity()

        return Site(f"{name}.intermediate", "bert", intermediate, [intermediate, second],
                    _ffn(first, second, intermediate.intermediate_act_fn), lambda x: second(intermediate(x)),
                    install_bert, *linear_shape(first), block_class=ToMoEIntermediateBlock)
    c_fc, c_proj = children.get("c_fc"), children.get("c_proj")
    if (c_fc is not None and c_proj is not None and callable(getattr(module, "act", None))
            and is_linear(c_fc) and is_linear(c_proj)):
        if _tuned(c_fc, c_proj):
            return Skip(name, PEFT_FFN)
        return Site(name, "gpt2", module, [module], _ffn(c_fc, c_proj, module.act), module, _setter(model, name),
                    *linear_shape(c_fc), dropout=output_dropout(module, "gpt2"))
    return None


#: Attributes holding an FFN's output dropout rate (a float its forward passes to ``F.dropout``), in
#: transformers' MLPs: Starcoder2 (``c_fc / c_proj``) and Seed-OSS (SwiGLU).
DROPOUT_RATES = ("residual_dropout",)


def output_dropout(module: nn.Module, kind: str) -> nn.Module | None:
    """The dropout an FFN ``module`` of ``kind`` applies to its output in training, as a module the converted
    block applies after its sum (None: no dropout there).

    A GPT-2 style FFN's ``dropout`` module acts on its output (GPT-2, GPT-Neo, GPT-BigCode); a SwiGLU FFN's
    ``dropout`` module acts inside, on ``act(gate(x)) * up(x)`` (T5Gemma, GTE), which a block of experts cannot
    do, so it is not taken. A float rate in `DROPOUT_RATES` (``residual_dropout``) becomes ``nn.Dropout(rate)``.
    """
    module_dropout = getattr(module, "dropout", None)
    if kind == "gpt2" and isinstance(module_dropout, nn.Module):
        return module_dropout
    for attribute in DROPOUT_RATES:
        rate = getattr(module, attribute, None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            return nn.Dropout(float(rate))
    if kind == "gpt2" and isinstance(module_dropout, (int, float)) and not isinstance(module_dropout, bool):
        return nn.Dropout(float(module_dropout))
    return None


def linear_site(model: nn.Module, name: str, module: nn.Module) -> Site:
    """The site of a single Linear / Conv1D layer (a PEFT wrapper stays around it)."""
    peft = module if is_adapter_layer(module) else None

    def read_linear() -> DenseLayer:
        weight, bias = linear_weights(module)
        return DenseLayer(up=weight, up_bias=bias, down_bias=torch.zeros(weight.shape[0]), act=nn.Identity())

    if peft is not None:
        def install(block: nn.Module) -> None:
            peft.base_layer = block
            peft.merge = functools.partial(refuse_adapter_merge, name)  # PEFT's merge would write into a copy
        hook = peft.base_layer
    else:
        install = _setter(model, name)
        hook = module
    return Site(name, "linear", hook, [base_of(module)], read_linear, hook, install, *linear_shape(module),
                block_class=ToMoELinear, peft=peft)


def _components(name: str) -> list[str]:
    return name.split(".")


def protected_reason(name: str) -> str:
    """Why a module is protected from conversion, or ``""``."""
    for part in _components(name):
        lowered = part.lower()
        if lowered in FFN_PROJECTIONS:
            continue
        if lowered in PROTECTED or any(lowered.startswith(p + "_") or lowered.endswith("_" + p) for p in PROTECTED):
            return f"protected ({part}: output heads, embeddings, poolers and routers stay dense)"
    return ""


def is_moe_block(module: nn.Module) -> bool:
    """A block moelens serves as MoE (`moelens.wrap`'s detection): a registered family's block (a converted
    `ToMoEBlock` too) or a module holding experts decorated with transformers' ``use_experts_implementation``."""
    return registry.for_block(module) is not None or any(is_dispatching(child) for child in module.children())


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """The names of the modules holding each parameter (by ``id``), every place a shared module sits included."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for parameter in module._parameters.values():
            if parameter is not None:
                owners.setdefault(id(parameter), []).append(name)
    return owners


def tied_reason(parts: list[nn.Module], roots: list[str], owners: dict[int, list[str]]) -> str:
    """Why an FFN whose modules sit at ``roots`` stays dense because a parameter of ``parts`` is also held
    elsewhere (the same module at two places, or tied weights), or ``""``."""
    inside = lambda owner: any(owner == root or owner.startswith(root + ".") for root in roots)  # noqa: E731
    others = sorted({owner for part in parts for parameter in part.parameters()
                     for owner in owners.get(id(parameter), []) if not inside(owner)})
    if not others:
        return ""
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (f"shares weights with {shown} (the same module at two places, or tied parameters): converting it at "
            "one place would untie them")


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
    if is_adapter_layer(module) and getattr(module, "merged", False):
        return "its PEFT adapter is merged into the weights: unmerge it first"
    base = base_of(module)
    owners = tied.get(base.weight.data_ptr())
    if owners:
        others = sorted({o for o in owners if o != name and not o.startswith(name + ".")})
        if others:
            return f"tied weights (shared with {', '.join(others)})"
    out_features, in_features = linear_shape(module)
    if out_features < MIN_PER_EXPERT * num_experts or out_features * in_features < MIN_WEIGHTS:
        return f"too small ({in_features} -> {out_features}) for {num_experts} experts of at least {MIN_PER_EXPERT} outputs"
    return ""


def narrow_experts(site_out: int, widest: int, num_experts: int, top_k: int) -> tuple[int, int]:
    """Experts for a projection narrower than its attention's widest converted one (GQA k/v): proportionally fewer,
    about the same active share (both rounded to whole experts)."""
    if site_out >= widest:
        return num_experts, top_k
    experts = max(2, round(num_experts * site_out / widest))
    experts = min(experts, num_experts)
    k = max(1, min(experts, round(top_k * experts / num_experts)))
    return experts, k
