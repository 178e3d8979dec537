"""The settings ``generate`` runs with, as transformers fills them (read by `moelens.model` and
`moelens.analysis.generation`), and the refusal of ``generate`` on a model that cannot generate."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import MoelensError


def generation_setting(model: torch.nn.Module, kwargs: dict[str, Any], name: str) -> Any:
    """The generation setting ``name`` ``generate`` runs with: the keyword, else the ``generation_config`` given,
    else the model's own (transformers fills a given config's unset settings from the model's)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return None


def rows_per_prompt(model: torch.nn.Module, kwargs: dict[str, Any]) -> int:
    """How many rows transformers' ``generate`` runs for each prompt row with these arguments.

    It repeats every row ``max(num_beams, num_return_sequences)`` times, in place (row i
    becomes rows ``i * n`` to ``i * n + n - 1``), from the arguments over the
    ``generation_config`` given over the model's own.
    """
    return max(int(generation_setting(model, kwargs, name) or 1) for name in ("num_beams", "num_return_sequences"))


def _generating(fn: Any) -> bool:
    """Whether a run's ``fn`` is the model's ``generate`` (not its forward)."""
    return getattr(fn, "__name__", fn) == "generate"


def _refuse_no_generate(model: torch.nn.Module) -> None:
    """Refuse ``model.generate`` on a model with no ``generate`` (a base model, a classifier), saying what can."""
    if callable(getattr(model, "generate", None)):
        return
    if not isinstance(model, PreTrainedModel):  # a model of the user's own, with a head or not
        raise MoelensError(
            f"model.generate: {type(model).__name__} is no transformers model (no generate method to drive), so "
            "model.generate cannot run it: trace it a token at a time (append the argmax of "
            "model.output's last position to the ids and trace again), or build it as a transformers model with "
            "a language-model head."
        )
    raise MoelensError(
        f"model.generate: {type(model).__name__} has no language-model head, so it cannot generate: load the "
        "checkpoint with its head (AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language "
        "model) and wrap that; trace this one instead."
    )
