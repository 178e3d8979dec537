"""Noting, as each call of a block begins, whether it got a flat subset of the tokens gathered out of the batch.

Some families' layers send the tokens of each modality to a block of their own (ernie4_5_vl_moe's
``text_moe`` / ``vision_moe``): such a call gets ``[n * D]`` or ``[n, D]`` instead of ``[B, S, D]``, which no
``[batch, seq]`` view can place. A forward pre-hook per wrapper notes it on the block (`note_gathered_calls`);
`Moe` reads the note (`gathered_call`) and refuses those calls' values. The hook goes with its wrapper.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .moe import Moe


#: The attribute a `_GatheredNote` sets on its block.
GATHERED = "_moelens_tokens_gathered"


class _GatheredNote:
    """The forward pre-hook of `Moe.mark_gathered_calls`: notes on the block whether its call got tokens
    gathered out of the batch (``[n * D]`` or ``[n, D]`` rather than ``[B, S, D]``), passed by position or
    keyword. It serves one component, held weakly. A copy of the model (``copy.deepcopy``, or pickled and loaded) copies its hooks:
    the copied note serves no component and takes itself off at its first call."""

    def __init__(self, component: "Moe | None" = None) -> None:
        self.component = weakref.ref(component) if component is not None else None

    def __deepcopy__(self, memo: dict) -> "_GatheredNote":
        return _GatheredNote()

    def __reduce__(self) -> tuple:
        return _GatheredNote, ()

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if self.component is None:  # a copy's: no wrapper of the copy reads it, nor what the original noted
            for key, hook in list(module._forward_pre_hooks.items()):
                if hook is self:
                    del module._forward_pre_hooks[key]
            module.__dict__.pop(GATHERED, None)
            return
        # the hidden states: the first argument, or the first tensor passed by keyword (block(hidden_states=x))
        hidden = args[0] if args else next((value for value in (kwargs or {}).values()
                                            if isinstance(value, torch.Tensor)), None)
        setattr(module, GATHERED, isinstance(hidden, torch.Tensor) and hidden.dim() < 3)


#: A note of no wrapper, for models pickled while wrapped by an earlier moelens, whose hook was the function
#: ``moelens.components.moe._note_gathered``: loaded, it is this note, which takes itself off at the first call.
STALE_NOTE = _GatheredNote()


def drop_gathered_notes(model: torch.nn.Module) -> None:
    """Take every `_GatheredNote` and what they noted off the modules of ``model`` (a fresh copy no wrapper serves)."""
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, _GatheredNote):
                del module._forward_pre_hooks[key]
        module.__dict__.pop(GATHERED, None)


def _stop_noting(module: torch.nn.Module, hook: torch.utils.hooks.RemovableHandle) -> None:
    """Take one component's `_GatheredNote` and what it noted off ``module``."""
    hook.remove()
    module.__dict__.pop(GATHERED, None)


def note_gathered_calls(component: "Moe", block: torch.nn.Module) -> None:
    """Have ``block`` note its calls for ``component``, until the component is collected."""
    hook = block.register_forward_pre_hook(_GatheredNote(component), with_kwargs=True)
    weakref.finalize(component, _stop_noting, block, hook)


def gathered_call(block: torch.nn.Module) -> bool:
    """Whether ``block``'s running call got tokens gathered out of the batch (as its note says)."""
    return getattr(block, GATHERED, False)
