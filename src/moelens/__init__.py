"""moelens: look inside Mixture-of-Experts language models and change what they do.

``moelens.wrap(hf_model)`` / ``moelens.load(path)`` give an nnsight model whose MoE
blocks are `Moe` components serving router logits, expert weights and indices,
per-slot outputs, routed and shared outputs by name, for every MoE family in
transformers. See ``docs/`` for the values, the families and the interventions.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time each name is imported on first use (`__getattr__`)
    from . import analysis, compress, data, export, families, parallel, testing
    from .components import Mlp, Moe
    from .errors import (ArgumentError, FamilyError, LayerIndexError, MoelensError, OrderError, ValueUnavailable,
                         WriteError)
    from .families import Family, Scoring, SharedExpert
    from .interventions import ablate, force, keep_top, reroute, steer
    from .loading import load
    from .model import wrap
    from .top_k import set_top_k

__version__ = "0.1.0"

#: Each public name and the module it is imported from on first use (``moelens.wrap`` imports torch, transformers and
#: nnsight; importing moelens alone does not, so ``moelens --help`` answers at once and importing registers nothing).
_EXPORTS = {
    **dict.fromkeys(("ArgumentError", "FamilyError", "LayerIndexError", "MoelensError", "OrderError",
                     "ValueUnavailable", "WriteError"), ".errors"),
    **dict.fromkeys(("Mlp", "Moe"), ".components"),
    **dict.fromkeys(("Family", "Scoring", "SharedExpert"), ".families"),
    **dict.fromkeys(("ablate", "force", "keep_top", "reroute", "steer"), ".interventions"),
    "load": ".loading",
    "wrap": ".model",
    "set_top_k": ".top_k",
}

#: Feature areas imported on first use (``moelens.export.to_nnef(...)`` after ``import moelens``).
_SUBPACKAGES = ("analysis", "compress", "data", "export", "families", "parallel", "testing")

__all__ = sorted([*_EXPORTS, "families"])


def __getattr__(name: str):
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later reads find it at once
        return value
    raise AttributeError(f"module 'moelens' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and those `__getattr__` imports on first use (for tab completion)."""
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})
