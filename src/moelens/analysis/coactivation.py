"""Co-activation: which experts are chosen together, in a layer and across layers.

* Within a layer (`coactivation`): ``counts[i, j]`` is the number of tokens routed
  to both expert i and expert j (the diagonal: tokens routed to i).
* Across layers (`transitions`): ``counts[i, j]`` is the number of tokens routed to
  expert i in one layer and to expert j in another (``slots="top1"``: the
  highest-weighted expert of each layer; ``"all"``: any of the k).
* Expert trajectories (`token_paths`, `expert_paths`): each token's top-1 expert
  through the layers, and the most common of those sequences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..errors import MoelensError
from .cache import SKIPPED, RoutingCache, Shard, check_cache
from .checks import check_count, id_list

SLOTS = ("top1", "all")


@dataclass
class Coactivation:
    """Co-activation of one layer's experts.

    Attributes:
        layer: Decoder-layer index.
        counts: ``[E, E]`` tokens routed to both i and j (diagonal: tokens routed to i).
        tokens: Tokens counted.
    """

    layer: int
    counts: Int[Tensor, "e e"]
    tokens: int

    def conditional(self) -> Float[Tensor, "e e"]:
        """``[E, E]`` P(j chosen | i chosen) = counts[i, j] / counts[i, i] (rows of unused experts are 0)."""
        diagonal = self.counts.diagonal().double().clamp(min=1)
        return self.counts.double() / diagonal[:, None]

    def lift(self) -> Float[Tensor, "e e"]:
        """``[E, E]`` P(i and j) / (P(i) P(j)): above 1, the pair is chosen together more than by chance."""
        p = self.counts.diagonal().double() / max(self.tokens, 1)
        joint = self.counts.double() / max(self.tokens, 1)
        return joint / (p[:, None] * p[None, :]).clamp(min=torch.finfo(torch.float64).tiny)


@dataclass
class Transitions:
    """How tokens move between the experts of two layers.

    Attributes:
        source: Decoder-layer index of the rows.
        target: Decoder-layer index of the columns.
        counts: ``[E_source, E_target]`` tokens routed to i in ``source`` and j in ``target``.
        slots: ``"top1"`` or ``"all"``.
        tokens: Tokens counted.
        sources: ``[E_source]`` tokens routed to i in ``source`` (what `conditional` divides by).
    """

    source: int
    target: int
    counts: Int[Tensor, "e f"]
    slots: str
    tokens: int
    sources: Int[Tensor, " e"]

    def conditional(self) -> Float[Tensor, "e f"]:
        """``[E_source, E_target]`` P(j in target | i in source) = counts[i, j] / sources[i].

        With ``"top1"`` a row sums to 1 (less where tokens skipped every slot of ``target``), with
        ``"all"`` to the k of ``target`` (a token has k experts there); rows of unused experts are 0.
        """
        return self.counts.double() / self.sources.double().clamp(min=1)[:, None]


def top1(shard: Shard, layer: int) -> Int[Tensor, " n"]:
    """``[n]`` each token's highest-weighted expert in ``layer`` (`SKIPPED` when every slot skipped)."""
    indices = shard.indices[layer].long()
    best = shard.weights[layer].float().argmax(-1, keepdim=True)
    return indices.gather(-1, best).squeeze(-1)


def experts_used(indices: Int[Tensor, "n k"], num_experts: int) -> Bool[Tensor, "n e"]:
    """``[n, E]`` True where a token's slots name an expert (once, however many slots; skipped slots none)."""
    indices = indices.long()
    hot = torch.zeros(indices.shape[0], num_experts + 1, dtype=torch.bool)  # skipped slots land in the last column
    return hot.scatter_(1, torch.where(indices == SKIPPED, num_experts, indices), True)[:, :num_experts]


def multi_hot(indices: Int[Tensor, "n k"], num_experts: int) -> Float[Tensor, "n e"]:
    """``[n, E]`` 1.0 where a token uses an expert (`experts_used` as float64, for counting by matrix products)."""
    return experts_used(indices, num_experts).double()


def coactivation(cache: RoutingCache, layer: int) -> Coactivation:
    """Count, in ``layer``, the tokens routed to each pair of experts (streams over shards)."""
    check_cache(cache)
    layer = cache.layer_key(layer)
    width = cache.num_experts[layer]
    counts = torch.zeros(width, width, dtype=torch.float64)
    tokens = 0
    for shard in cache._shards():
        hot = multi_hot(shard.indices[layer], width)
        counts += hot.T @ hot
        tokens += shard.num_tokens
    return Coactivation(layer=layer, counts=counts.round().long(), tokens=tokens)


def transitions(cache: RoutingCache, source: int, target: int, slots: str = "top1") -> Transitions:
    """Count the tokens routed to expert i in layer ``source`` and j in layer ``target`` (streams over shards).

    Args:
        cache: A routing cache.
        source: The layer of the rows (a decoder-layer index of the cache).
        target: The layer of the columns.
        slots: Which of a token's experts count: ``"top1"`` its highest-weighted expert in each layer (a token
            counts in one cell), ``"all"`` any of its k in each layer (a token counts in the cell of each pair of
            its experts); slots that ran no expert (`SKIPPED`) count nowhere.
    """
    check_cache(cache)
    if slots not in SLOTS:
        raise MoelensError(f"slots={slots!r} is not one of {SLOTS}.")
    source, target = cache.layer_key(source), cache.layer_key(target)
    rows, columns = cache.num_experts[source], cache.num_experts[target]
    counts = torch.zeros(rows, columns, dtype=torch.float64)
    sources = torch.zeros(rows, dtype=torch.float64)
    tokens = 0
    for shard in cache._shards():
        tokens += shard.num_tokens
        if slots == "top1":  # one expert a layer: count the (source, target) pairs, no [n, E] one-hot matmul
            first, then = top1(shard, source), top1(shard, target)
            ran = first != SKIPPED
            both = ran & (then != SKIPPED)
            counts += torch.bincount(first[both] * columns + then[both], minlength=rows * columns).view(rows, columns)
            sources += torch.bincount(first[ran], minlength=rows)
            continue
        chosen = multi_hot(shard.indices[source], rows)  # any of a token's experts: once each, however many slots
        counts += chosen.T @ multi_hot(shard.indices[target], columns)
        sources += chosen.sum(0)
    return Transitions(source=source, target=target, counts=counts.round().long(), slots=slots, tokens=tokens,
                       sources=sources.round().long())


def _path_layers(cache: RoutingCache, layers: list[int] | None, call: str) -> list[int]:
    """The cache's keys of the layers of a path (``layers``, in path order; the cache's own by default)."""
    layers = list(cache.layers) if layers is None else id_list("layers", layers, "layer",
                                                                order="the layer of each step of a path")
    if not layers:
        raise MoelensError(f"{call}: layers={layers} names no layer; the cache holds layers {list(cache.layers)}.")
    return [cache.layer_key(layer) for layer in layers]


def _shard_paths(shard: Shard, layers: list[int]) -> Int[Tensor, "n l"]:
    """``[n, len(layers)]`` each token of ``shard``'s top-1 expert in each of ``layers``."""
    return torch.stack([top1(shard, layer) for layer in layers], dim=1)


def token_paths(cache: RoutingCache, layers: list[int] | None = None) -> Int[Tensor, "t l"]:
    """Each token's path: its top-1 expert (highest-weighted slot) in every layer of ``layers``.

    Args:
        cache: A routing cache.
        layers: The layers of a path, in path order (default: the cache's), as for `expert_paths`.

    Returns:
        ``[T, len(layers)]`` int64, row ``t`` the cache's token ``t`` (as ``cache.token_ids()``, ``text_index()``
        and ``position()`` order them), ``[t, i]`` its expert in ``layers[i]`` (`SKIPPED`, -1, where every slot of
        the token skipped that layer); group or cluster tokens by their rows (``torch.unique(paths, dim=0,
        return_inverse=True)``). `expert_paths` counts these rows.
    """
    check_cache(cache)
    layers = _path_layers(cache, layers, "token_paths")
    return torch.cat([_shard_paths(shard, layers) for shard in cache._shards()])


def expert_paths(cache: RoutingCache, layers: list[int] | None = None, top: int = 20) -> list[tuple[tuple[int, ...], int]]:
    """The ``top`` most common trajectories: each token's top-1 expert in every layer of ``layers``.

    Args:
        cache: A routing cache.
        layers: The layers of a path, in path order (default: the cache's); a list, since ``path[i]`` is
            the expert in ``layers[i]`` (a set, which has no order, is refused).
        top: How many paths to return.

    Returns:
        ``[(path, tokens), ...]`` most common first, paths of equal count in ascending order (so the cut at
        ``top`` does not depend on how the cache is sharded); ``path[i]`` is the expert in ``layers[i]``
        (`SKIPPED`, -1, where every slot of the token skipped that layer).
    """
    check_cache(cache)
    top = check_count("top", top)
    layers = _path_layers(cache, layers, "expert_paths")
    paths: Counter[tuple[int, ...]] = Counter()
    for shard in cache._shards():
        unique, counts = torch.unique(_shard_paths(shard, layers), dim=0, return_counts=True)
        for path, count in zip(unique.tolist(), counts.tolist()):
            paths[tuple(path)] += count
    return sorted(paths.items(), key=lambda item: (-item[1], item[0]))[:top]
