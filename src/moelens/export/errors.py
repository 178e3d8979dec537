"""The errors the NNEF export raises (both are `moelens.MoelensError`)."""

from __future__ import annotations

from ..errors import MoelensError


class ExportError(MoelensError):
    """The export could not be done or checked: a missing extra, a bad argument, a failed verification."""


class ExportRefused(ExportError):
    """The model (a family, a block, an edit) computes something tract_moe_ffn cannot express.

    The message names the part tract cannot express; nothing is written.
    """
