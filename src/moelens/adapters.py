"""PEFT parameter adapters on a MoE block's router or experts.

LoRA on a router's or experts' own parameters (``target_parameters``, or from peft 0.22 a ``target_modules`` naming
fused experts' or a router's transformers-4 projections) puts a ``ParamWrapper`` where the module was. Its forward
calls the family's own module (its ``base_layer``) with each adapted parameter read as the base weight plus the
adapters' product, so moelens serves the block's values beneath it (`beneath_adapters`): every value a trace reads,
or writes, is the adapted model's (the base model's under ``peft_model.disable_adapter()``). What reads the
parameters themselves would get the base weights without that product, and refuses (`refuse_parameter_adapters`)
while the adapters are in force (`in_force`): with them merged into the weights (``peft_model.merge_adapter()``), or
off (``peft_model.disable_adapter()``), the parameters are what runs.
"""

from __future__ import annotations

from typing import Any

import torch

from .families.entry import adapter_chain

#: What to do where a wrapped model's parameters themselves are needed (`refusal`'s default).
MERGE_AND_WRAP = ("Merge the adapters into the weights and wrap the result, moelens.wrap(peft_model.merge_and_unload()) "
                  "(merge a copy, copy.deepcopy(peft_model), to keep the adapters); unmerged, a trace still serves "
                  "the block's adapted values")


def in_force(adapter: torch.nn.Module) -> bool:
    """Whether a PEFT parameter adapter (``ParamWrapper``) runs the module it wraps on other weights than the adapted
    parameter holds now: an active adapter of its own unmerged (its forward adds the adapters' product), or adapters
    merged into the parameter while the adapters are off (its forward takes them out again first). Merged
    (``merge_adapter()``) or off (``disable_adapter()``), the parameter is the weight that runs."""
    if adapter.disable_adapters:
        return adapter.merged
    return not adapter.merged and any(name in adapter.lora_A for name in adapter.active_adapters)


def parameter_adapters(block: torch.nn.Module, family: Any, parts: tuple[str, ...] = ("router", "experts"),
                       forcing: bool = False) -> list[str]:
    """Those of ``parts`` of ``block`` (a live block module of ``family``: its router, its experts) that PEFT parameter
    adapters stand for (only those `in_force` where ``forcing``), in words:
    ``"experts 'experts' (LoRA on down_proj, gate_up_proj)"``; empty where none does."""
    found = []
    for part in parts:
        path = getattr(family, part)
        adapted = sorted(adapter.parameter_name for adapter in adapter_chain(block, path)[:-1]
                         if not forcing or in_force(adapter))
        if adapted:
            found.append(f"{part} {path!r} (LoRA on {', '.join(adapted)})")
    return found


def refusal(block: torch.nn.Module, family: Any, where: str, consequence: str,
            parts: tuple[str, ...] = ("router", "experts"), remedy: str = MERGE_AND_WRAP, forcing: bool = True) -> str:
    """Why ``where`` (a call naming the block, which reads the parameters of ``parts`` of ``block``) cannot go on where
    PEFT parameter adapters stand for some of them (`parameter_adapters`; only those `in_force` where ``forcing``): it
    would get ``consequence``; and what to do (``remedy``, a sentence). Empty where none does."""
    adapted = parameter_adapters(block, family, parts, forcing)
    if not adapted:
        return ""
    chains = (adapter_chain(block, getattr(family, part))[:-1] for part in parts)
    if forcing and any(adapter.disable_adapters and adapter.merged for chain in chains for adapter in chain):
        return (f"{where}: PEFT merged adapters into the block's {' and '.join(adapted)} (merge_adapter()), which are "
                "off now (disable_adapter()), and the block's next forward takes them out of the weights first: the "
                "weights are not those that run. Leave disable_adapter() first, or unmerge the adapters "
                "(peft_model.unmerge_adapter()).")
    if not forcing:
        return (f"{where}: PEFT adapters stand for the block's {' and '.join(adapted)}, kept beside its weights (on "
                f"or off, merged or not): {consequence}. {remedy}.")
    return (f"{where}: PEFT adapters stand for the block's {' and '.join(adapted)}, adding the adapters' product to "
            f"the base weights in each forward: {consequence}. {remedy}.")


def refuse_parameter_adapters(block: torch.nn.Module, family: Any, where: str, consequence: str,
                              error: type[Exception], parts: tuple[str, ...] = ("router", "experts"),
                              remedy: str = MERGE_AND_WRAP, forcing: bool = True) -> None:
    """Raise ``error`` with `refusal` where PEFT parameter adapters (`in_force` where ``forcing``) stand for those
    of ``parts`` of ``block``."""
    message = refusal(block, family, where, consequence, parts, remedy, forcing)
    if message:
        raise error(message)
