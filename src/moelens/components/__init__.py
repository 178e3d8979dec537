"""moelens components: nnsight envoys that serve a block's values by name."""

from .base import Component
from .implementations import ExpertsOps, register_implementation
from .mlp import Mlp
from .moe import Moe
from .params import MoeParams

__all__ = ["Component", "ExpertsOps", "Mlp", "Moe", "MoeParams", "register_implementation"]
