"""Routing entropy: how spread out each token's routing is.

Two sources, both normalised to [0, 1]:

* ``"router"`` (needs a cache collected with ``logits=True``): the entropy of the
  router's distribution over all E experts, ``p = score(logits)`` renormalised to
  sum to one (softmax families already do; sigmoid families score each expert on
  its own), divided by ``log E``. 0: the router is certain of one expert; 1: it
  cannot tell the experts apart.
* ``"weights"`` (always available): the entropy of the k routing weights of the
  chosen experts, renormalised, divided by ``log k``. 0: one slot takes all the
  weight; 1: the k slots weigh the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from .cache import RoutingCache, Shard, check_cache
from .checks import check_count
from ..families.scoring import score

SOURCES = ("router", "weights")


@dataclass
class Entropy:
    """Per-layer distribution of the tokens' normalised routing entropy.

    Attributes:
        layers: Decoder-layer indices (rows).
        source: ``"router"`` (over all experts) or ``"weights"`` (over the k slots).
        mean: ``[L]`` mean normalised entropy.
        histogram: ``[L, bins]`` token counts per entropy bin (a token of NaN entropy, routed by NaN weights the
            model computed, is in none: a row then sums to fewer than ``tokens``).
        edges: ``[bins + 1]`` bin edges over [0, 1].
        tokens: Tokens counted.
    """

    layers: list[int]
    source: str
    mean: Float[Tensor, " l"]
    histogram: Int[Tensor, "l bins"]
    edges: Float[Tensor, " edges"]
    tokens: int


def normalised_entropy(p: Float[Tensor, "t n"]) -> Float[Tensor, " t"]:
    """Entropy of each row of non-negative scores (renormalised to sum to 1), / log n."""
    p = p.double().clamp(min=0)
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    n = p.shape[-1]
    if n < 2:
        return torch.zeros(p.shape[0], dtype=torch.float64)
    entropy = -(p * p.clamp(min=torch.finfo(torch.float64).tiny).log()).sum(-1)
    return (entropy / math.log(n)).clamp(0, 1)


def _pick_source(cache: RoutingCache, source: str | None) -> str:
    if source is None:
        return "router" if cache.has_logits else "weights"
    if source not in SOURCES:
        raise MoelensError(f"entropy source {source!r} is not one of {SOURCES}.")
    if source == "router" and not cache.has_logits:
        raise MoelensError(
            "the router entropy needs router logits; collect the cache with logits=True "
            "or use source='weights' (the entropy of the top-k weights)."
        )
    return source


def _shard_entropy(cache: RoutingCache, shard: Shard, layer: int, source: str) -> Tensor:
    if source == "router":
        return normalised_entropy(score(cache.score[layer], shard.logits[layer].float(), cache.softcap.get(layer, 0.0)))
    return normalised_entropy(shard.weights[layer].float())


def token_entropy(cache: RoutingCache, layer: int, source: str | None = None) -> Float[Tensor, " t"]:
    """``[T]`` every cached token's normalised routing entropy in ``layer``, in the cache's token order.

    ``source``: ``"router"`` (over all E experts; needs a cache collected with ``logits=True``) or ``"weights"``
    (over the k routing weights); default: router when logits were cached (see the module docstring).
    """
    check_cache(cache)
    source = _pick_source(cache, source)
    layer = cache.layer_key(layer)
    return torch.cat([_shard_entropy(cache, shard, layer, source) for shard in cache._shards()])


def routing_entropy(cache: RoutingCache, source: str | None = None, bins: int = 40) -> Entropy:
    """Mean and histogram of the tokens' routing entropy per layer (streams over shards).

    Args:
        cache: A routing cache.
        source: ``"router"`` or ``"weights"`` (default: router when logits were cached).
        bins: Histogram bins over [0, 1].
    """
    bins = check_count("bins", bins)
    check_cache(cache)
    source = _pick_source(cache, source)
    histogram = torch.zeros(len(cache.layers), bins, dtype=torch.int64)
    total = torch.zeros(len(cache.layers), dtype=torch.float64)
    tokens = 0
    for shard in cache._shards():
        tokens += shard.num_tokens
        for row, layer in enumerate(cache.layers):
            values = _shard_entropy(cache, shard, layer, source)
            total[row] += values.sum()
            # a NaN entropy (the model computed NaN routing weights) is in no bin: cast to an integer it would
            # land in bin 0, the "certain" end, while the mean says NaN
            bucket = (values[~values.isnan()] * bins).long().clamp(0, bins - 1)
            histogram[row] += torch.bincount(bucket, minlength=bins)
    return Entropy(
        layers=list(cache.layers), source=source, mean=total / max(tokens, 1), histogram=histogram,
        edges=torch.linspace(0, 1, bins + 1, dtype=torch.float64), tokens=tokens,
    )
