"""MoE families: one small data entry per family, the registry, and detection.

``moelens.families.supported()`` lists every family moelens serves;
``moelens.families.register(Family(...))`` describes a custom model's blocks
without editing moelens.
"""

from . import deepseek, sigmoid, softmax, special, tomoe, topk_softmax
from .check import check
from .entry import (COMBINE_MODES, EXPERT_GATES, SELECTIONS, SHARED_TIMES, VALUE_NAMES, Combine, ExpertGate, ExpertLayout,
                    Family, Scoring, SharedExpert)
from .registry import for_block, for_model_type, get, register, register_all, supported, unregister

for _module in (softmax, topk_softmax, deepseek, sigmoid, special, tomoe):
    register_all(_module.FAMILIES)

__all__ = [
    "COMBINE_MODES", "EXPERT_GATES", "SELECTIONS", "SHARED_TIMES", "VALUE_NAMES", "Combine", "ExpertGate", "ExpertLayout", "Family", "Scoring", "SharedExpert",
    "check", "for_block", "for_model_type", "get", "register", "supported", "unregister",
]
