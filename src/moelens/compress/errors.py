"""Errors of the compressor (all `moelens.MoelensError`)."""

from __future__ import annotations

from ..errors import MoelensError


class CompressionError(MoelensError, ValueError):
    """Bad settings or calibration for a conversion, or a model with nothing to convert."""


class NothingToConvert(CompressionError):
    """The model has no layer the conversion could target."""
