"""Export probed and edited MoE models to NNEF for tract: one ``tract_moe_ffn`` per MoE block.

``moelens.export.to_nnef(model, "m.nnef.tgz")`` exports a wrapped model (or one block,
``model.moes[i]``); each MoE block becomes one tract_moe_ffn call whose gate mode,
activation, weight layout and biases come from the block's family entry, and any shared
expert a standard NNEF subgraph added to it. `Edits` bakes ablations, route-around,
steering and swaps into the weights; `verify` runs an archive in tract and the model in
torch. Families tract cannot express are refused with the reason (`family_support` and
`support_table` say which, from the family registry). Needs the ``export`` extra
(``pip install 'moelens[export]'``: torch-to-nnef and tract), imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .edits import Edits
from .errors import ExportError, ExportRefused
from .gate import GATE_MODES, Support, family_support
from .runner import TOLERANCES

if TYPE_CHECKING:  # imported on first use at run time (`__getattr__`)
    from .exporter import ExportReport, to_nnef
    from .table import support_table
    from .verification import Verification, run, verify

__all__ = [
    "GATE_MODES", "TOLERANCES", "Edits", "ExportError", "ExportRefused", "ExportReport", "Support",
    "Verification", "family_support", "run", "support_table", "to_nnef", "verify",
]


def __getattr__(name: str):
    # The exporter, the verification and the support table (torch-to-nnef, tract) load on first use.
    if name in ("to_nnef", "ExportReport"):
        from . import exporter

        return getattr(exporter, name)
    if name in ("verify", "Verification", "run"):
        from . import verification

        return getattr(verification, name)
    if name == "support_table":
        from .table import support_table

        return support_table
    raise AttributeError(f"module 'moelens.export' has no attribute {name!r}")
