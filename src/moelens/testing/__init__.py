"""Test helpers: tiny seeded MoE models for every family in transformers (no downloads)."""

from moelens.testing.tiny import (
    COMMON_SIZES,
    EXPERTS_IMPLEMENTATIONS,
    FAMILIES,
    MOE_EVERY_LAYER,
    TINY_OVERRIDES,
    UNBUILDABLE,
    config_class,
    model_class,
    tiny_config,
    tiny_inputs,
    tiny_model,
)

__all__ = [
    "COMMON_SIZES",
    "EXPERTS_IMPLEMENTATIONS",
    "FAMILIES",
    "MOE_EVERY_LAYER",
    "TINY_OVERRIDES",
    "UNBUILDABLE",
    "config_class",
    "model_class",
    "tiny_config",
    "tiny_inputs",
    "tiny_model",
]
