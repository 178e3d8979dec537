"""Routing analysis on tiny hand-made caches, against numbers worked out by hand.

Ground truth: a few tokens' experts and weights written out in the test, and the
counts, probabilities, entropies and histogram bins computed from them with plain
Python loops and ``math`` (no moelens code, no torch reductions).
"""

from __future__ import annotations

import math

import pytest
import torch

from moelens import analysis

#: Layer 0 (E = 4, k = 2) of two shards of tokens: each row the two experts a token chose.
CHOSEN = [[[0, 1], [0, 2], [0, 3]], [[1, 2], [0, 1]]]
WIDTH = 4


def shard_of(indices: list[list[int]], weights: list[list[float]], start: int = 0,
             logits: list[list[float]] | None = None) -> analysis.Shard:
    count = len(indices)
    return analysis.Shard(
        token_ids=torch.arange(start, start + count, dtype=torch.int32), text_index=torch.zeros(count, dtype=torch.int32),
        position=torch.arange(start, start + count, dtype=torch.int32),
        indices={0: torch.tensor(indices, dtype=torch.int16)}, weights={0: torch.tensor(weights, dtype=torch.float16)},
        logits={} if logits is None else {0: torch.tensor(logits, dtype=torch.float32)},
    )


def cache_of(shards: list[analysis.Shard], k: int = 2, has_logits: bool = False) -> analysis.RoutingCache:
    return analysis.RoutingCache(layers=[0], num_experts={0: WIDTH}, top_k={0: k}, score={0: "softmax"}, num_texts=1,
                                 has_logits=has_logits, _memory=shards)


def chosen_cache() -> analysis.RoutingCache:
    shards, start = [], 0
    for rows in CHOSEN:
        shards.append(shard_of(rows, [[0.5, 0.5]] * len(rows), start))
        start += len(rows)
    return cache_of(shards)


def tokens_by_hand() -> list[list[int]]:
    return [row for rows in CHOSEN for row in rows]


# -- usage ---------------------------------------------------------------------------------------------


def test_token_fraction_is_the_share_of_tokens_using_each_expert():
    """token_fraction[e] = (tokens routed to e) / tokens, so a row sums to k (not to 1).

    Guards against token_fraction dividing by the layer's slot count (a copy of `fraction`).
    """
    usage = analysis.expert_usage(chosen_cache())
    tokens = tokens_by_hand()
    assert usage.tokens == len(tokens) == 5
    using = [sum(expert in row for row in tokens) for expert in range(WIDTH)]  # [4, 3, 2, 1]
    assert usage.counts[0].tolist() == using
    expected = [count / len(tokens) for count in using]  # [0.8, 0.6, 0.4, 0.2]
    for actual, wanted in zip(usage.token_fraction[0].tolist(), expected):
        assert math.isclose(actual, wanted, rel_tol=1e-12)
    assert math.isclose(float(usage.token_fraction[0].sum()), 2.0, rel_tol=1e-12)  # k
    for actual, wanted in zip(usage.fraction[0].tolist(), [count / (2 * len(tokens)) for count in using]):
        assert math.isclose(actual, wanted, rel_tol=1e-12)  # fraction: rows sum to 1


# -- co-activation ------------------------------------------------------------------------------------


def test_lift_is_the_joint_over_the_product_of_the_marginals():
    """lift[i, j] = P(i and j) / (P(i) P(j)), with each probability counted over the tokens by hand.

    Guards against the denominator being P(i)^2 (a broadcast of the wrong axis): the marginals here differ.
    """
    tokens = tokens_by_hand()
    n = len(tokens)
    marginal = [sum(expert in row for row in tokens) / n for expert in range(WIDTH)]
    joint = [[sum(i in row and j in row for row in tokens) / n for j in range(WIDTH)] for i in range(WIDTH)]
    result = analysis.coactivation(chosen_cache(), 0)
    assert result.tokens == n
    assert result.counts.tolist() == [[round(joint[i][j] * n) for j in range(WIDTH)] for i in range(WIDTH)]
    lift = result.lift()
    for i in range(WIDTH):
        for j in range(WIDTH):
            expected = joint[i][j] / (marginal[i] * marginal[j])
            assert math.isclose(float(lift[i, j]), expected, rel_tol=1e-12), (i, j)
    # e.g. experts 0 and 1: together on 2 of 5 tokens, 0 on 4, 1 on 3: (2/5) / (4/5 * 3/5) = 5/6
    assert math.isclose(float(lift[0, 1]), 5 / 6, rel_tol=1e-12)
    assert math.isclose(float(lift[1, 0]), 5 / 6, rel_tol=1e-12)


# -- entropy histogram ---------------------------------------------------------------------------------


def entropy_by_hand(p: list[float]) -> float:
    total = sum(p)
    p = [x / total for x in p]
    return -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))


@pytest.mark.parametrize("bins", [10, 4])
def test_entropy_histogram_puts_each_token_in_the_bin_of_its_entropy(bins):
    """A token of normalised entropy e is counted in bin floor(e * bins) (e = 1 in the last bin).

    Guards against the bins being scaled by bins - 1 (every token one bin low past the first).
    """
    weights = [[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [1.0, 0.0]]
    # the weights are cached in float16: compute the entropies from what is stored
    stored = [[float(torch.tensor(w, dtype=torch.float16)) for w in row] for row in weights]
    entropies = [entropy_by_hand(row) for row in stored]  # about 0.469, 0.881, 0.971, 1, 0
    expected = [0] * bins
    for entropy in entropies:
        expected[min(math.floor(entropy * bins), bins - 1)] += 1
    cache = cache_of([shard_of([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], weights)])
    result = analysis.routing_entropy(cache, "weights", bins=bins)
    assert result.histogram[0].tolist() == expected
    assert math.isclose(float(result.mean[0]), sum(entropies) / len(entropies), rel_tol=1e-9)
    assert result.edges.tolist() == pytest.approx([i / bins for i in range(bins + 1)])
    if bins == 10:
        assert expected == [1, 0, 0, 0, 1, 0, 0, 0, 1, 2]


def test_router_entropy_histogram_by_hand():
    """The router source: entropy of softmax(logits) over all E experts / log E, binned by hand."""
    probabilities = [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01], [0.4, 0.3, 0.2, 0.1]]
    logits = [[math.log(p) for p in row] for row in probabilities]
    entropies = [entropy_by_hand(row) for row in probabilities]  # about 0.678, 1, 0.121, 0.923
    bins = 10
    expected = [0] * bins
    for entropy in entropies:
        expected[min(math.floor(entropy * bins), bins - 1)] += 1
    assert expected == [0, 1, 0, 0, 0, 0, 1, 0, 0, 2]
    cache = cache_of([shard_of([[0, 1]] * 4, [[0.5, 0.5]] * 4, logits=logits)], has_logits=True)
    result = analysis.routing_entropy(cache, "router", bins=bins)
    assert result.histogram[0].tolist() == expected
    assert math.isclose(float(result.mean[0]), sum(entropies) / len(entropies), rel_tol=1e-6)
