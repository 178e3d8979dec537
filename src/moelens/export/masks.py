"""Attention masks and positions built from tensor ops, for whole-model exports with a symbolic token axis.

transformers builds its causal masks and position ids with Python integers taken from the
traced shapes, so torch-to-nnef bakes the traced length into a whole-model archive. A
model given a ready 4D mask (or a mapping of one per layer type) and explicit
``position_ids`` uses them as they are; built here from ``input_ids`` with tensor ops,
they follow the token axis ``S`` of the archive. Every token is attended (no padding),
as in the fixed-length export.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int

from .errors import ExportRefused

#: Layer types whose mask this module builds (``config.layer_types``).
MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-window layers, or None when it has none."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def layer_kinds(config: Any) -> list[str]:
    """Each attention layer's mask kind: ``config.layer_types`` or, without it, one kind for every layer.

    Raises:
        ExportRefused: A layer type whose mask is not a causal or sliding-window one (chunked
            attention, linear attention, state-space layers).
    """
    types = getattr(config, "layer_types", None)
    if not types:
        return ["sliding_attention" if sliding_window(config) else "full_attention"]
    other = sorted(set(types) - set(MASKED_LAYER_TYPES))
    if other:
        raise ExportRefused(
            f"dynamic_tokens=True for a whole model rebuilds each layer's causal or sliding-window mask with "
            f"tensor ops; this model also has {other} layers. Export it at a fixed token count, or export its "
            "blocks (model.moes[i]) with dynamic_tokens=True."
        )
    if "sliding_attention" in types and sliding_window(config) is None:
        raise ExportRefused("the model has sliding_attention layers but no sliding_window in its config.")
    return list(types)


def positions(input_ids: Int[torch.Tensor, "batch seq"]) -> Int[torch.Tensor, "batch seq"]:
    """``0 .. seq-1`` per row, computed from ``input_ids`` so the length stays symbolic."""
    return torch.cumsum(torch.ones_like(input_ids), dim=-1) - 1


def additive_mask(allowed: Bool[torch.Tensor, "batch 1 seq seq"]) -> Float[torch.Tensor, "batch 1 seq seq"]:
    """0 where a query may attend a key, the float32 minimum elsewhere (transformers' eager form)."""
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def attention_masks(config: Any, position: Int[torch.Tensor, "batch seq"]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask each attention layer uses: one 4D mask, or one per layer type when they differ.

    transformers' models with mixed layer types take a mapping (``{"full_attention": ...,
    "sliding_attention": ...}``) in place of ``attention_mask``; a single 4D mask is used as it is.
    """
    kinds = set(layer_kinds(config))
    query, key = position[:, None, :, None], position[:, None, None, :]
    causal = key <= query
    masks = {}
    if "full_attention" in kinds:
        masks["full_attention"] = additive_mask(causal)
    if "sliding_attention" in kinds:  # transformers' overlay: kv_idx > q_idx - window
        masks["sliding_attention"] = additive_mask(causal & (key > query - sliding_window(config)))
    return masks if len(masks) > 1 else next(iter(masks.values()))
