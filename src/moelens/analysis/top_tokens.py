"""The tokens each expert serves most, from a routing cache.

``by="count"`` ranks the token ids an expert was routed most often;
``by="share"`` ranks them by the fraction of that token's occurrences routed to
the expert (tokens seen fewer than ``min_count`` times are left out), which
shows what an expert is *for* rather than what is frequent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from .cache import EMPTY_CACHE, SKIPPED, RoutingCache, check_cache
from .checks import check_count, expert_ids, id_list
from .text import check_tokenizer, token_strings

RANKINGS = ("count", "share")


@dataclass
class ExpertTokens:
    """The tokens one expert serves most.

    Attributes:
        layer: Decoder-layer index.
        expert: Expert id.
        token_ids: ``[n]`` token ids, best first.
        counts: ``[n]`` how often each was routed to the expert: its occurrences whose slots name the expert (once
            each where several slots name it, as after a swap to an expert the token already uses).
        share: ``[n]`` the fraction of the token's occurrences routed to the expert (at most 1).
        tokens: The token ids as printable strings.
        total: Slots routed to the expert over the whole cache (each of them, also where one token's slots name
            the expert twice).
    """

    layer: int
    expert: int
    token_ids: Int[Tensor, " n"]
    counts: Int[Tensor, " n"]
    share: Float[Tensor, " n"]
    tokens: list[str]
    total: int

    #: The tokens a repr names; a list of them for every expert of a wide layer printed every tensor in full.
    SHOWN = 5

    def __repr__(self) -> str:
        shown = ", ".join(f"{token!r} x{count} ({share:.0%})" for token, count, share in
                          zip(self.tokens[:self.SHOWN], self.counts.tolist(), self.share.tolist()))
        more = f", ... {len(self.tokens) - self.SHOWN} more" if len(self.tokens) > self.SHOWN else ""
        return f"ExpertTokens(layer {self.layer}, expert {self.expert}, {self.total} slots: {shown or 'no token'}{more})"


def pair_counts(cache: RoutingCache, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(experts, token ids, counts) of every (expert, token) pair routed in ``layer``, per-token occurrences [V] and
    the slots routed to each expert [E]. A pair counts token occurrences: one whose slots name an expert twice (a
    swap to an expert it already uses) counts once.

    The shards' pairs are merged once those waiting outnumber twice the pairs merged so far, so memory follows the
    distinct pairs (at most experts x vocabulary), not the cache's length, and each pair is merged a bounded number of
    times. No floor of waiting pairs: a few million small per-shard tensors left waiting between the shards' large
    temporaries fragmented glibc's heap, so the peak grew with the number of shards (~1.4 MiB a shard of 65,536 tokens)."""
    layer = cache.layer_key(layer)
    stride = 1 << 32
    keys, counts = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
    occurrences, read = torch.zeros(0, dtype=torch.int64), False
    slots = torch.zeros(cache.num_experts[layer], dtype=torch.int64)

    def merged() -> tuple[list[Tensor], list[Tensor]]:
        unique, inverse = torch.unique(torch.cat(keys), return_inverse=True)
        return [unique], [torch.zeros(unique.shape[0], dtype=torch.int64).index_add_(0, inverse, torch.cat(counts))]

    for shard in cache._shards():
        read = True
        ids = shard.token_ids.long()
        indices = shard.indices[layer].long().sort(-1).values  # a token's repeated expert: neighbouring slots
        routed = indices != SKIPPED
        slots += torch.bincount(indices[routed], minlength=slots.shape[0])
        routed[:, 1:] &= indices[:, 1:] != indices[:, :-1]
        unique, found = torch.unique((indices * stride + ids[:, None])[routed], return_counts=True)
        keys.append(unique)
        counts.append(found)
        if sum(part.shape[0] for part in keys[1:]) > 2 * keys[0].shape[0]:
            keys, counts = merged()
        seen = torch.bincount(ids)
        if seen.shape[0] > occurrences.shape[0]:
            seen[: occurrences.shape[0]] += occurrences
            occurrences = seen
        else:
            occurrences[: seen.shape[0]] += seen
    if not read:
        raise MoelensError(EMPTY_CACHE)
    (keys,), (counts,) = merged()
    return keys // stride, keys % stride, counts, occurrences, slots


def top_tokens(
    cache: RoutingCache,
    layer: int,
    experts: list[int] | None = None,
    *,
    n: int = 10,
    by: str = "count",
    min_count: int = 3,
    tokenizer: Any = None,
) -> list[ExpertTokens]:
    """The ``n`` tokens each expert of ``layer`` serves most (one `ExpertTokens` per expert).

    Args:
        cache: A routing cache.
        layer: Decoder-layer index of an MoE layer.
        experts: Which experts: a list of integer ids (default: all).
        n: Tokens per expert.
        by: ``"count"`` (most routed) or ``"share"`` (largest share of the token's occurrences).
        min_count: With ``by="share"``, ignore tokens seen fewer times than this.
        tokenizer: Decodes ids into strings (a wrapped model's ``.tokenizer``, not the model); default: the
            cache's own (the model's it was collected from, or the one given to `RoutingCache.load`), else ids are
            shown as ``#<id>``.
    """
    check_cache(cache)
    if by not in RANKINGS:
        raise MoelensError(f"by={by!r} is not one of {RANKINGS}.")
    n = check_count("n", n)
    min_count = check_count("min_count", min_count, least=0)
    check_tokenizer(tokenizer)
    tokenizer = cache.tokenizer if tokenizer is None else tokenizer
    layer = cache.layer_key(layer)
    count = cache.num_experts[layer]
    experts = list(range(count)) if experts is None else expert_ids(id_list("experts", experts, "expert id"), count, layer)
    expert_of, token_of, counts, occurrences, slots = pair_counts(cache, layer)
    edges = torch.searchsorted(expert_of, torch.arange(count + 1)).tolist()  # pairs sorted by expert: one run each
    result = []
    for expert in experts:
        mine = slice(edges[expert], edges[expert + 1])
        ids, served = token_of[mine], counts[mine]
        share = served.double() / occurrences[ids].double()
        if by == "share":
            keep = occurrences[ids] >= min_count
            ids, served, share = ids[keep], served[keep], share[keep]
            ranking = _ranked(share, served)
        else:
            ranking = _ranked(served, share)
        ranking = ranking[:n]
        result.append(ExpertTokens(
            layer=layer, expert=expert, token_ids=ids[ranking], counts=served[ranking], share=share[ranking],
            tokens=token_strings(tokenizer, ids[ranking].tolist()), total=int(slots[expert]),
        ))
    return result


def _ranked(first: Tensor, then: Tensor) -> Tensor:
    """Positions in descending order of ``first``, ties broken by descending ``then`` (two stable sorts,
    so neither key can outweigh a real difference in the other, as a weighted sum of the two would)."""
    by_then = torch.argsort(then, descending=True, stable=True)
    return by_then[torch.argsort(first[by_then], descending=True, stable=True)]
