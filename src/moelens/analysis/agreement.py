"""How two routings of the same tokens agree: a model before and after an edit, two checkpoints of one
architecture, a model and its fine-tuned copy.

Both caches must hold the same tokens in the same order: collect them from the same corpus with the same
``max_length`` (a cache does not record its windows, so routing over other windows of the same tokens, which saw
another context, is compared all the same). Per MoE layer both hold:

* ``top1``: the share of tokens whose highest-weighted expert is the same;
* ``jaccard``: the mean over tokens of |A ∩ B| / |A ∪ B|, A and B the token's experts in each cache (1: the same
  experts; the two k may differ);
* ``same_set``: the share of tokens routed to the same experts (in any slot order);
* ``kept[layer, e]``: of the tokens the first cache routes to expert e, the share the second routes to e too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import MoelensError
from .cache import RoutingCache, Shard, _counted, check_cache, layer_row
from .checks import check_type
from .coactivation import experts_used, top1


@dataclass
class Agreement:
    """How the routing of a second cache agrees with a first's, per MoE layer both hold (one entry per layer).

    Attributes:
        layers: Decoder-layer indices (the MoE layers both caches hold).
        top1: ``[L]`` the share of tokens with the same highest-weighted expert.
        jaccard: ``[L]`` the mean |A ∩ B| / |A ∪ B| of each token's experts (1 where neither routes it anywhere; a
            slot at weight 0, as ``ablate(..., "zero")`` leaves it, still names its expert).
        same_set: ``[L]`` the share of tokens routed to the same experts.
        kept: ``[L, E]`` of the tokens the first cache routes to each expert, the share the second routes there
            too (NaN for an expert the first routes no token to, and past a layer's own E).
        tokens: Tokens compared.
    """

    layers: list[int]
    top1: Float[Tensor, " l"]
    jaccard: Float[Tensor, " l"]
    same_set: Float[Tensor, " l"]
    kept: Float[Tensor, "l e"]
    tokens: int

    def row(self, layer: int) -> int:
        """The row of decoder layer ``layer``."""
        return layer_row(self.layers, layer, "agreement")

    def as_rows(self) -> list[dict]:
        """One JSON-ready dict per layer."""
        return [{"layer": layer, "top1": float(self.top1[row]), "jaccard": float(self.jaccard[row]),
                 "same_set": float(self.same_set[row])} for row, layer in enumerate(self.layers)]

    def __repr__(self) -> str:
        lines = [f"Agreement over {_counted(self.tokens, 'token')}",
                 f"{'layer':>5}  {'top1':>6}  {'jaccard':>7}  {'same set':>8}"]
        lines += [f"{row['layer']:>5}  {row['top1']:>6.1%}  {row['jaccard']:>7.1%}  {row['same_set']:>8.1%}"
                  for row in self.as_rows()]
        return "\n".join(lines)


def routing_agreement(first: RoutingCache, second: RoutingCache) -> Agreement:
    """How ``second``'s routing agrees with ``first``'s, token by token, in each MoE layer both caches hold (streams
    over their shards).

    Raises:
        MoelensError: the caches hold different tokens (another corpus, another ``max_length`` or order), no MoE
            layer in common, or a common layer with another number of experts (its expert ids name other experts).
    """
    for name, cache in (("first", first), ("second", second)):
        check_type(cache, RoutingCache, name, "a RoutingCache", "collect one with analysis.collect_routing(model, "
                   "texts) (collect_generation's result holds one: .cache), or load one with RoutingCache.load(folder)")
        check_cache(cache)
    layers = [layer for layer in first.layers if layer in second.layers]
    if not layers:
        raise MoelensError(f"the two caches hold no MoE layer in common (the first holds {first.layers}, the second "
                           f"{second.layers}): collect both with the same layers= to compare their routing.")
    for layer in layers:
        if first.num_experts[layer] != second.num_experts[layer]:
            raise MoelensError(
                f"layer {layer} has {first.num_experts[layer]} experts in the first cache and "
                f"{second.num_experts[layer]} in the second: its expert ids name different experts, so their "
                "routing cannot be compared token by token."
            )
    if first.num_tokens != second.num_tokens:
        raise MoelensError(
            f"the first cache holds {first.num_tokens} tokens and the second {second.num_tokens}: routing is compared "
            "token by token, so collect both from the same corpus with the same max_length."
        )
    width = max(first.num_experts[layer] for layer in layers)
    same_top1, jaccard, same_set = (torch.zeros(len(layers), dtype=torch.float64) for _ in range(3))
    routed, kept = (torch.zeros(len(layers), width, dtype=torch.float64) for _ in range(2))
    for a, b in _paired(first, second):
        for row, layer in enumerate(layers):
            same_top1[row] += (top1(a, layer) == top1(b, layer)).sum()
            hot_a, hot_b = experts_used(a.indices[layer], width), experts_used(b.indices[layer], width)
            both = hot_a & hot_b
            union = (hot_a | hot_b).sum(-1)
            jaccard[row] += torch.where(union > 0, both.sum(-1).double() / union.clamp(min=1), 1.0).sum()
            same_set[row] += (hot_a == hot_b).all(-1).sum()
            routed[row] += hot_a.sum(0)
            kept[row] += both.sum(0)
    tokens = first.num_tokens  # none empty: check_cache refused that
    share = kept / routed
    for row, layer in enumerate(layers):
        share[row, first.num_experts[layer]:] = float("nan")
    return Agreement(layers=layers, top1=same_top1 / tokens, jaccard=jaccard / tokens, same_set=same_set / tokens,
                     kept=share, tokens=tokens)


def _paired(first: RoutingCache, second: RoutingCache) -> Iterator[tuple[Shard, Shard]]:
    """The two caches' shards cut into runs of the same tokens (their shards may end at other tokens), each pair
    checked to hold the same token ids at the same positions."""
    left, right = first._shards(), second._shards()
    a, b, start = next(left, None), next(right, None), 0
    while a is not None and b is not None:
        size = min(a.num_tokens, b.num_tokens)
        head_a, head_b = _part(a, 0, size), _part(b, 0, size)
        _check_same_tokens(head_a, head_b, start)
        yield head_a, head_b
        start += size
        a = _part(a, size, a.num_tokens) if a.num_tokens > size else next(left, None)
        b = _part(b, size, b.num_tokens) if b.num_tokens > size else next(right, None)


def _part(shard: Shard, start: int, stop: int) -> Shard:
    """Tokens ``start`` to ``stop`` of ``shard`` (views, not copies)."""
    cut = slice(start, stop)
    return Shard(token_ids=shard.token_ids[cut], text_index=shard.text_index[cut], position=shard.position[cut],
                 indices={layer: tensor[cut] for layer, tensor in shard.indices.items()},
                 weights={layer: tensor[cut] for layer, tensor in shard.weights.items()})


def _check_same_tokens(a: Shard, b: Shard, start: int) -> None:
    """Refuse runs of other tokens, or of other corpus items or positions."""
    differ = (a.token_ids != b.token_ids) | (a.position != b.position) | (a.text_index != b.text_index)
    if differ.any():
        at = int(differ.nonzero()[0])
        raise MoelensError(
            f"the caches hold different tokens: token {start + at} is id {int(a.token_ids[at])} at position "
            f"{int(a.position[at])} of corpus item {int(a.text_index[at])} in the first, id {int(b.token_ids[at])} "
            f"at position {int(b.position[at])} of item {int(b.text_index[at])} in the second. Routing is compared "
            "token by token: collect both from the same corpus, in the same order, with the same max_length."
        )
