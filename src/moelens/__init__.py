"""moelens: look inside Mixture-of-Experts language models and change what they do.

``moelens.wrap(hf_model)`` / ``moelens.load(path)`` give an nnsight model whose MoE
blocks are `Moe` components serving router logits, expert weights and indices,
per-slot outputs, routed and shared outputs by name, for every MoE family in
transformers. See ``docs/`` for the values, the families and the interventions.
"""

from . import families
from .components import Mlp, Moe
from .errors import ArgumentError, FamilyError, LayerIndexError, MoelensError, OrderError, ValueUnavailable, WriteError
from .families import Family, Scoring, SharedExpert
from .interventions import ablate, force, keep_top, reroute, steer
from .loading import load
from .model import wrap

__all__ = [
    "ArgumentError", "Family", "FamilyError", "LayerIndexError", "Mlp", "Moe", "MoelensError", "OrderError", "Scoring",
    "SharedExpert", "ValueUnavailable", "WriteError", "ablate", "families", "force", "keep_top", "load", "reroute",
    "steer", "wrap",
]
__version__ = "0.1.0"

#: Feature areas imported on first use (``moelens.export.to_nnef(...)`` after ``import moelens``),
#: so importing moelens stays light and registers nothing.
_SUBPACKAGES = ("analysis", "compress", "export", "parallel", "testing", "data")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'moelens' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the feature areas `__getattr__` imports on first use (for tab completion)."""
    return sorted({*globals(), *_SUBPACKAGES})
