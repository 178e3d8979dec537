"""Expert usage and load balance, from a routing cache.

Usage counts *slots*: a token routed to experts 3 and 5 adds one to each, so a
layer's counts sum to ``tokens * k`` (less where slots were skipped: zaya's skip
class counts for no expert). Load balance compares those counts across
a layer's experts: the coefficient of variation (std / mean; 0 is perfectly
balanced, ``sqrt(E - 1)`` is every slot on one expert), max / mean (1 is balanced,
``E`` is one expert taking every slot; how much more the busiest expert works
than the average), min / mean, the normalised entropy of the usage distribution
(1 is uniform) and the number of experts never used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from ..scalars import as_lone_int
from .cache import SKIPPED, RoutingCache, check_cache, layer_row
from .entropy import normalised_entropy
from .checks import check_type, id_list


@dataclass
class Usage:
    """How often each expert of each MoE layer was chosen.

    Attributes:
        layers: Decoder-layer indices of the MoE layers (rows).
        counts: ``[L, E]`` int64 slots routed to each expert (a token adds one per slot);
            a layer with fewer experts than the widest has zero columns past its own E.
        weight: ``[L, E]`` float64 the routing weight summed over those slots.
        tokens: How many tokens were counted.
        top_k: k per layer (row).
        num_experts: E per layer (row); default: the width of ``counts`` for every layer.
    """

    layers: list[int]
    counts: Int[Tensor, "l e"]
    weight: Float[Tensor, "l e"]
    tokens: int
    top_k: list[int]
    num_experts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_experts:
            self.num_experts = [int(self.counts.shape[1])] * len(self.layers)

    @property
    def fraction(self) -> Float[Tensor, "l e"]:
        """``[L, E]`` each expert's share of its layer's counted slots (rows sum to 1)."""
        return self.counts.double() / self.counts.sum(-1, keepdim=True).clamp(min=1)

    @property
    def token_fraction(self) -> Float[Tensor, "l e"]:
        """``[L, E]`` the expert's slots per token: the share of tokens that use it (rows sum to k, less where slots
        were skipped; a token whose slots name an expert twice, after a swap to an expert it already uses, counts
        twice)."""
        return self.counts.double() / max(self.tokens, 1)

    def row(self, layer: int) -> int:
        """The row of decoder layer ``layer``."""
        return layer_row(self.layers, layer, "expert usage")

    def balance(self) -> "LoadBalance":
        """The load balance of every layer."""
        return load_balance(self)


@dataclass
class LoadBalance:
    """How evenly each MoE layer spreads its slots over its experts (one entry per layer).

    Attributes:
        layers: Decoder-layer indices.
        cv: Coefficient of variation of the counts (population std / mean); 0 = balanced.
        max_over_mean: Busiest expert's count / mean count; 1 = balanced, E = one expert.
        min_over_mean: Idlest expert's count / mean count; 1 = balanced, 0 = an unused expert.
        entropy: Entropy of the usage distribution / log(E); 1 = uniform.
        unused: Experts never chosen.

    The four measures are NaN for a layer whose experts measured took no tokens (``load_balance(num_experts=...)``
    keeping only experts no token chose): there is no load to balance.
    """

    layers: list[int]
    cv: Float[Tensor, " l"]
    max_over_mean: Float[Tensor, " l"]
    min_over_mean: Float[Tensor, " l"]
    entropy: Float[Tensor, " l"]
    unused: Int[Tensor, " l"]

    def as_rows(self) -> list[dict]:
        """One JSON-ready dict per layer (a NaN measure is None: JSON has no NaN)."""
        def number(value: Tensor) -> float | None:
            return None if value.isnan() else float(value)

        return [
            {
                "layer": layer,
                "cv": number(self.cv[row]),
                "max_over_mean": number(self.max_over_mean[row]),
                "min_over_mean": number(self.min_over_mean[row]),
                "usage_entropy": number(self.entropy[row]),
                "unused_experts": int(self.unused[row]),
            }
            for row, layer in enumerate(self.layers)
        ]


def expert_usage(cache: RoutingCache) -> Usage:
    """Count, per MoE layer, the slots routed to each expert (streams over the cache's shards).

    Skipped slots (`SKIPPED`: zaya's skip class) count for no expert.

    Layers with fewer experts than the widest one have zero columns past their E.
    """
    check_cache(cache)
    width = max(cache.num_experts.values())
    counts = torch.zeros(len(cache.layers), width, dtype=torch.int64)
    weight = torch.zeros(len(cache.layers), width, dtype=torch.float64)
    tokens = 0
    for shard in cache._shards():
        tokens += shard.num_tokens
        for row, layer in enumerate(cache.layers):
            indices = shard.indices[layer].long().flatten()
            ran = indices != SKIPPED
            counts[row] += torch.bincount(indices[ran], minlength=width)[:width]
            weight[row].index_add_(0, indices[ran], shard.weights[layer].double().flatten()[ran])
    return Usage(layers=list(cache.layers), counts=counts, weight=weight, tokens=tokens,
                 top_k=[cache.top_k[layer] for layer in cache.layers],
                 num_experts=[cache.num_experts[layer] for layer in cache.layers])


def balance_of(counts: Int[Tensor, " e"]) -> tuple[float, float, float, float, int]:
    """(cv, max/mean, min/mean, normalised entropy, unused) of one layer's ``[E]`` counts; NaN for the four
    measures where those experts took no tokens (no load to balance)."""
    counts = counts.double()
    mean = counts.mean()
    if mean == 0:
        return math.nan, math.nan, math.nan, math.nan, int(counts.numel())
    cv = float(counts.std(correction=0) / mean)
    entropy = float(normalised_entropy(counts[None])[0]) if counts.numel() > 1 else 1.0
    return cv, float(counts.max() / mean), float(counts.min() / mean), entropy, int((counts == 0).sum())


def load_balance(usage: Usage | RoutingCache, num_experts: list[int] | None = None) -> LoadBalance:
    """The load balance of every layer, from a `Usage` (or a cache, counted first).

    Args:
        usage: Expert usage, or a routing cache.
        num_experts: E per layer, a list in layer order (a set, which has no order, is refused), each from 1
            to the layer's own E (default: the
            usage's own `Usage.num_experts`); a smaller E measures the layer's first E experts only.
    """
    check_type(usage, (Usage, RoutingCache), "usage", "a Usage or a RoutingCache",
               "count one with analysis.expert_usage(cache), from analysis.collect_routing(model, texts)")
    if isinstance(usage, RoutingCache):
        usage = expert_usage(usage)
    widths = usage.num_experts if num_experts is None else _widths(usage, num_experts)
    values = [balance_of(usage.counts[row, :width]) for row, width in enumerate(widths)]
    cv, max_over_mean, min_over_mean, entropy, unused = torch.tensor(values, dtype=torch.float64).reshape(-1, 5).T
    return LoadBalance(layers=list(usage.layers), cv=cv, max_over_mean=max_over_mean, min_over_mean=min_over_mean,
                       entropy=entropy, unused=unused.long())


def _widths(usage: Usage, num_experts: Any) -> list[int]:
    """``num_experts`` checked against ``usage``: one integer per layer, from 1 to the layer's own E."""
    layers = len(usage.layers)
    widths = id_list("num_experts", num_experts, "expert count", f"one E per layer, {{name}}=[{{one}}] * {layers}",
                     distinct=False, order=f"the E of each layer, in layer order {usage.layers},")
    if len(widths) != layers:
        raise MoelensError(f"num_experts={widths} gives {len(widths)} E for the {layers} layers {usage.layers} of this "
                           f"usage; give one per layer (the usage's own: {usage.num_experts}).")
    checked = []
    for layer, width, own in zip(usage.layers, widths, usage.num_experts):
        count = as_lone_int(width)
        if count is None or not 1 <= count <= own:
            raise MoelensError(f"num_experts gives layer {layer} {width!r} experts; it has {own}: give an integer "
                               f"from 1 to {own} (a smaller E measures the first E experts only).")
        checked.append(count)
    return checked
