"""What nnsight puts on a model's modules as `wrap` runs (their ``forward`` and nnsight state), noted before and taken
off again where the wrap is refused or was interrupted half-way."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.source import STATE as NNSIGHT_STATE


_MISSING = object()


def _instance_state(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any, Any]]:
    """Each module's own ``forward`` and nnsight state (``__nnsight__``) as they are before `wrap` (`_MISSING` where
    the module has none), so a wrap refused after nnsight put its forwards on the modules can take them off again."""
    return [(module, module.__dict__.get("forward", _MISSING), module.__dict__.get(NNSIGHT_STATE, _MISSING))
            for module in model.modules()]


def _restore_instance_state(state: list[tuple[torch.nn.Module, Any, Any]]) -> None:
    """Put back what `_instance_state` noted: a refused wrap leaves no nnsight forward, which a patch of the module's
    class would no longer reach, on a model no wrapper holds."""
    for module, forward, nnsight_state in state:
        for key, value in (("forward", forward), (NNSIGHT_STATE, nnsight_state)):
            if value is _MISSING:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = value


def _drop_stale_nnsight_state(model: torch.nn.Module) -> None:
    """Forget the nnsight state of a module whose wrapping stopped half-way (Ctrl-C in `wrap`, between nnsight storing
    the state and installing the forward that hands the module's calls to a trace): nnsight would keep the state,
    warn that ``forward`` was replaced and never serve the module again, in every later wrap and deep copy. A module
    whose ``forward`` something else replaced keeps it (nnsight's warning is right there)."""
    for module in model.modules():
        if NNSIGHT_STATE in module.__dict__ and "forward" not in module.__dict__:
            del module.__dict__[NNSIGHT_STATE]
