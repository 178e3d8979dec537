"""Errors of the compressor (all `moelens.MoelensError`)."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy
from torch import nn

from ..errors import MoelensError


class CompressionError(MoelensError, ValueError):
    """Bad settings or calibration for a conversion, or a model with nothing to convert."""


class NothingToConvert(CompressionError):
    """The model has no layer the conversion could target."""


def torch_model(model: Any, caller: str) -> nn.Module:
    """``model`` if it is a plain torch model; else a `CompressionError` saying what ``caller`` takes.

    A model `moelens.wrap` (or nnsight) wrapped is refused by name: its ``modules()`` are
    envoys, so the compressor's functions would find nothing to act on and do nothing.
    """
    if isinstance(model, Envoy):
        raise CompressionError(
            f"{caller} takes the torch model, got the nnsight wrapper {type(model).__name__}: pass the model it "
            "wraps (model._module), then wrap the result again with moelens.wrap."
        )
    if not isinstance(model, nn.Module):
        raise CompressionError(f"{caller} takes a torch model (nn.Module), got {type(model).__name__}.")
    return model
