"""PEFT parameter adapters on a MoE block's router or experts.

LoRA on a router's or experts' own parameters (``target_parameters``, or from peft 0.22 a ``target_modules`` naming
fused experts' or a router's transformers-4 projections) puts a ``ParamWrapper`` where the module was. Its forward
calls the family's own module (its ``base_layer``) with each adapted parameter read as the base weight plus the
adapters' product, so moelens serves the block's values beneath it (`beneath_adapters`): every value a trace reads,
or writes, is the adapted model's (the base model's under ``peft_model.disable_adapter()``). What reads the
parameters themselves would get the base weights without that product, and refuses (`refuse_parameter_adapters`).
"""

from __future__ import annotations

from typing import Any

import torch

from .families.entry import adapter_chain

#: What to do where a wrapped model's parameters themselves are needed (`refusal`'s default).
MERGE_AND_WRAP = ("Merge the adapters into the weights and wrap the result, moelens.wrap(peft_model.merge_and_unload()) "
                  "(merge a copy, copy.deepcopy(peft_model), to keep the adapters); unmerged, a trace still serves "
                  "the block's adapted values")


def parameter_adapters(block: torch.nn.Module, family: Any, parts: tuple[str, ...] = ("router", "experts")
                       ) -> list[str]:
    """Those of ``parts`` of ``block`` (a live block module of ``family``: its router, its experts) that PEFT parameter
    adapters stand for, in words: ``"experts 'experts' (LoRA on down_proj, gate_up_proj)"``; empty where none
    does."""
    found = []
    for part in parts:
        path = getattr(family, part)
        adapted = sorted(adapter.parameter_name for adapter in adapter_chain(block, path)[:-1])
        if adapted:
            found.append(f"{part} {path!r} (LoRA on {', '.join(adapted)})")
    return found


def refusal(block: torch.nn.Module, family: Any, where: str, consequence: str,
            parts: tuple[str, ...] = ("router", "experts"), remedy: str = MERGE_AND_WRAP) -> str:
    """Why ``where`` (a call naming the block, which reads the parameters of ``parts`` of ``block``) cannot go on where
    PEFT parameter adapters stand for some of them (`parameter_adapters`): it would get ``consequence``; and what to
    do (``remedy``, a sentence). Empty where none stands there."""
    adapted = parameter_adapters(block, family, parts)
    if not adapted:
        return ""
    return (f"{where}: PEFT adapters stand for the block's {' and '.join(adapted)}, adding the adapters' product to "
            f"the base weights in each forward: {consequence}. {remedy}.")


def refuse_parameter_adapters(block: torch.nn.Module, family: Any, where: str, consequence: str,
                              error: type[Exception], parts: tuple[str, ...] = ("router", "experts"),
                              remedy: str = MERGE_AND_WRAP) -> None:
    """Raise ``error`` with `refusal` where PEFT parameter adapters stand for those of ``parts`` of ``block``."""
    message = refusal(block, family, where, consequence, parts, remedy)
    if message:
        raise error(message)
