"""The errors the NNEF export raises (all are `moelens.MoelensError`)."""

from __future__ import annotations

from ..errors import MoelensError


class ExportError(MoelensError):
    """The export could not be done or checked: a missing extra, a bad argument, a failed verification."""


class ExportRefused(ExportError):
    """The model (a family, a block, an edit) computes something tract_moe_ffn cannot express.

    The message names the part tract cannot express; nothing is written.
    """


class TractRunFailed(ExportError):
    """tract could not load or run an archive; ``detail`` is tract's own line saying where."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail
