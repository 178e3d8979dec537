"""moelens.compress: the fitting steps of a conversion (partition, shared neurons, importance, router, refit).

Pins what each step computes, on tiny hand-made layers and point sets:

* the clustering features are normalised per neuron (row), so a neuron's scale never
  changes its expert;
* the equal-size assignment (greedy above ``EXACT_LIMIT``) lets the strongest preference
  choose first, and the balanced k-means moves its centroids until the groups are the
  optimal equal-size ones even when k-means starts unbalanced;
* shared neurons without data are ranked by ``||up_i|| * ||down_i||``;
* gated activations are clustered by magnitude (a neuron and its sign-flipped twin share
  an expert);
* an expert's importance is the norm of its *centred* contribution;
* the ridge leaves the constant column unpenalised, the refit is pulled towards the dense
  weights, and the weights-only router is the mean of each expert's normalised gate rows.

Ground truth: brute force over every equal-size partition or assignment of a few items,
norms, means and products written out by hand, and least squares solved in closed form.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import nn

from moelens.compress import fit, partition
from moelens.compress.dense import DenseLayer


def same_partition(labels, expected) -> bool:
    """Whether two labelings group the items the same way (group numbers may differ)."""
    labels, expected = [int(v) for v in labels], [int(v) for v in expected]
    pairs = set(zip(labels, expected))
    return len(pairs) == len(set(labels)) == len(set(expected))


def equal_partitions(count: int, size: int):
    """Every split of ``count`` items into two groups of ``size`` (each split once)."""
    for chosen in itertools.combinations(range(1, count), size - 1):
        labels = [1] * count
        for item in (0, *chosen):
            labels[item] = 0
        yield labels


def within_sum_of_squares(points: list[list[float]], labels: list[int]) -> float:
    total = 0.0
    for group in set(labels):
        members = [p for p, label in zip(points, labels) if label == group]
        mean = [sum(column) / len(members) for column in zip(*members)]
        total += sum((v - m) ** 2 for p in members for v, m in zip(p, mean))
    return total


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector]


# -- partition ----------------------------------------------------------------------------------


def test_reduce_normalises_each_neuron_to_unit_length():
    features = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0], [-6.0, 0.0, 8.0]])
    expected = torch.tensor([unit(row) for row in features.tolist()])
    torch.testing.assert_close(partition.reduce(features), expected)


def test_a_neurons_scale_does_not_change_its_group():
    """Rows along two planted directions, scaled over four orders of magnitude: grouped by direction only."""
    generator = torch.Generator().manual_seed(0)
    directions = torch.tensor([[1.0, 0.2, 0.0], [0.0, 0.3, 1.0]])
    planted = [0, 1, 0, 1, 1, 0, 0, 1]
    features = directions[planted] + 0.05 * torch.randn(8, 3, generator=generator)
    scales = torch.tensor([100.0, 0.01, 1.0, 10.0, 100.0, 0.01, 10.0, 1.0])
    plain = partition.balanced_kmeans(features, 2)
    scaled = partition.balanced_kmeans(features * scales[:, None], 2)
    assert same_partition(plain, planted)
    assert scaled.tolist() == plain.tolist()


def test_greedy_assignment_lets_the_strongest_preference_choose_first(monkeypatch):
    """Four items, two groups of two: the two that pay 10 away from group 0 get it (cost 2, the brute-force optimum)."""
    cost = np.array([[0.0, 1.0], [0.0, 10.0], [0.0, 1.0], [0.0, 10.0]])
    assignments = [list(labels) for labels in itertools.product([0, 1], repeat=4) if sum(labels) == 2]
    best = min(assignments, key=lambda labels: sum(cost[i, g] for i, g in enumerate(labels)))
    assert best == [1, 0, 1, 0]
    monkeypatch.setattr(partition, "EXACT_LIMIT", 0)  # the greedy pass, on a problem small enough to brute-force
    assert partition._assign(cost, [2, 2]).tolist() == best


def test_greedy_assignment_above_the_exact_limit():
    """Half the items pay 10 away from group 0, half pay 1: the former fill group 0 (no monkeypatching)."""
    count = 2 * ((partition.EXACT_LIMIT + 2) // 2)
    strong = np.arange(count) % 2 == 0
    cost = np.zeros((count, 2))
    cost[:, 1] = np.where(strong, 10.0, 1.0)
    labels = partition._assign(cost, [count // 2, count // 2])
    assert labels.tolist() == np.where(strong, 0, 1).tolist()
    assert cost[np.arange(count), labels].sum() == count // 2  # the optimum: each weak item pays 1


def test_balanced_kmeans_rebalances_an_unbalanced_kmeans_start():
    """Unit vectors in three planted clumps of 4, 2 and 2 (angles below).

    Plain 2-means joins the pair at 355/0 degrees to the clump of four (6 against 2); with
    two groups of four, the optimum (brute force over all 35 splits) is the clump of four
    alone and the two pairs together, which only moving the centroids after k-means finds.
    """
    angles = [240, 260, 270, 280, 355, 0, 130, 135]
    points = [[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in angles]
    costs = sorted((within_sum_of_squares(points, labels), labels) for labels in equal_partitions(8, 4))
    (best_cost, best), (second_cost, _) = costs[0], costs[1]
    assert best == [0, 0, 0, 0, 1, 1, 1, 1] and second_cost - best_cost > 0.5
    # the unconstrained 2-means optimum (every split, any sizes) is the unbalanced 6 + 2
    splits = [[0, *bits] for bits in itertools.product([0, 1], repeat=7) if 0 < sum(bits) < 8]
    assert min(splits, key=lambda labels: within_sum_of_squares(points, labels)) == [0, 0, 0, 0, 0, 0, 1, 1]
    labels = partition.balanced_kmeans(torch.tensor(points), 2)
    assert same_partition(labels, best)


# -- shared neurons, features, importance -------------------------------------------------------


def _layer(up_norms, down_norms, *, gated=False, seed=0) -> DenseLayer:
    """A layer whose neuron i has ``||up_i|| = up_norms[i]`` and ``||down_i|| = down_norms[i]``."""
    generator = torch.Generator().manual_seed(seed)
    neurons = len(up_norms)
    up = nn.functional.normalize(torch.randn(neurons, 5, generator=generator), dim=1) * torch.tensor(up_norms)[:, None]
    down = nn.functional.normalize(torch.randn(3, neurons, generator=generator), dim=0) * torch.tensor(down_norms)
    gate = torch.randn(neurons, 5, generator=generator) if gated else None
    return DenseLayer(up=up, up_bias=torch.zeros(neurons), down_bias=torch.zeros(3), act=nn.SiLU(), gate=gate,
                      gate_bias=torch.zeros(neurons) if gated else None, down=down)


def test_shared_neurons_without_data_rank_up_norm_times_down_norm():
    """Products 4*1, 1*5, 3*1, 2*3, 0.5*2, 2.5*1: the top two are neurons 1 (5) and 3 (6), not the largest up rows."""
    layer = _layer([4.0, 1.0, 3.0, 2.0, 0.5, 2.5], [1.0, 5.0, 1.0, 3.0, 2.0, 1.0])
    assert fit.choose_shared(layer, None, 2).tolist() == [1, 3]
    assert fit.choose_shared(layer, None, 3).tolist() == [0, 1, 3]
    plan = fit.plan_layer(layer, None, num_experts=2, top_k=1, shared_neurons=2)
    assert plan.shared.tolist() == [1, 3]
    assert plan.labels[[1, 3]].tolist() == [-1, -1]


def test_a_gated_neuron_and_its_sign_flipped_twin_share_an_expert():
    """``h1 = -h0`` and ``h3 = -h2`` (same gate, negated up rows): they matter for the same tokens."""
    generator = torch.Generator().manual_seed(0)
    eye = torch.eye(4)
    gate = 3.0 * eye[[0, 0, 1, 1]]
    up = torch.stack([eye[2], -eye[2], eye[3], -eye[3]])
    layer = DenseLayer(up=up, up_bias=torch.zeros(4), down_bias=torch.zeros(2), act=nn.SiLU(), gate=gate,
                       gate_bias=torch.zeros(4), down=torch.randn(2, 4, generator=generator))
    x = torch.randn(64, 4, generator=generator)
    hidden = layer.hidden(x)
    torch.testing.assert_close(hidden[:, 1], -hidden[:, 0])
    torch.testing.assert_close(hidden[:, 3], -hidden[:, 2])
    plan = fit.plan_layer(layer, x, num_experts=2, top_k=1)
    assert same_partition(plan.labels, [0, 0, 1, 1])


def _importance_by_hand(hidden: list[list[float]], down: list[list[float]], members: list[int]) -> list[float]:
    tokens = len(hidden)
    means = [sum(row[i] for row in hidden) / tokens for i in range(len(hidden[0]))]
    result = []
    for row in hidden:
        output = [sum((row[i] - means[i]) * down[o][i] for i in members) for o in range(len(down))]
        result.append(math.sqrt(sum(v * v for v in output)))
    return result


def test_importance_is_the_norm_of_the_centred_contribution():
    """Neuron 1 carries a constant offset of 7; expert 2 is neuron 4 alone, constant 2.5: it never matters."""
    generator = torch.Generator().manual_seed(0)
    layer = _layer([1.0] * 5, [1.0, 2.0, 0.5, 1.5, 3.0])
    hidden = torch.randn(6, 5, generator=generator)
    hidden[:, 1] += 7.0
    hidden[:, 4] = 2.5
    labels = torch.tensor([0, 0, 1, 1, 2])
    importance = fit.importance(layer, hidden, labels, 3)
    for expert in range(3):
        members = [i for i in range(5) if labels[i] == expert]
        expected = _importance_by_hand(hidden.tolist(), layer.down.tolist(), members)
        torch.testing.assert_close(importance[:, expert], torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert importance[:, 2].abs().max() < 1e-5


# -- ridge, refit, weights-only router ----------------------------------------------------------


def test_ridge_leaves_the_constant_free():
    """Fitting a constant target: the penalised weights are 0 and the constant column recovers it exactly."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator)
    inputs = torch.cat([x, torch.ones(40, 1)], dim=1)
    constant = torch.tensor([2.5, -1.0])
    solution = fit._ridge(inputs, constant.expand(40, 2), strength=0.5)
    expected = torch.cat([torch.zeros(3, 2), constant[None]])
    torch.testing.assert_close(solution, expected, atol=1e-5, rtol=1e-5)


def test_refit_with_a_huge_ridge_keeps_the_dense_weights(monkeypatch):
    """The refit is pulled towards the dense down projection and compensation biases, not towards zero."""
    generator = torch.Generator().manual_seed(0)
    tokens, neurons, outputs = 32, 6, 3
    hidden = torch.randn(tokens, neurons, generator=generator)
    target = torch.randn(tokens, outputs, generator=generator)
    labels = torch.tensor([0, 0, 1, 1, 2, -1])
    selected = torch.zeros(tokens, 3, dtype=torch.bool)
    selected[torch.arange(tokens), torch.arange(tokens) % 3] = True
    down = torch.randn(outputs, neurons, generator=generator)
    expert_bias = torch.randn(3, outputs, generator=generator)
    constant = torch.randn(outputs, generator=generator)
    monkeypatch.setattr(fit, "REFIT_RIDGE", 1e9)
    new_down, new_bias, _ = fit._refit(hidden, target, labels, selected, down, expert_bias, constant)
    torch.testing.assert_close(new_down, down, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_bias, expert_bias, atol=1e-4, rtol=1e-4)


def test_weights_only_router_is_the_mean_normalised_gate_row_of_each_expert():
    layer = _layer([1.0, 2.0, 3.0, 0.5, 1.5, 2.5], [1.0] * 6, gated=True)
    plan = fit.plan_layer(layer, None, num_experts=3, top_k=1)
    assert plan.expert_sizes() == [2, 2, 2]
    for expert in range(3):
        rows = [unit(layer.gate[i].tolist()) for i in range(6) if plan.labels[i] == expert]
        expected = [sum(column) / len(rows) for column in zip(*rows)]
        torch.testing.assert_close(plan.router_weight[expert], torch.tensor(expected))


def test_the_seed_moves_the_clustering_and_the_held_out_tokens():
    """`seed` seeds the k-means start and which calibration tokens are held out (docs/compress.md): a fixed
    seed in either passed every test, since only the other seeded steps changed."""
    features = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    labels = [partition.balanced_kmeans(features, 8, seed=seed) for seed in (0, 0, 1)]
    assert torch.equal(labels[0], labels[1]) and not torch.equal(labels[0], labels[2])
    held = [fit._split(2048, seed)[1] for seed in (0, 0, 1)]
    assert torch.equal(held[0], held[1]) and not torch.equal(held[0], held[2])
    assert held[0].shape == (256,) and fit._split(1023, 0)[1] is None  # every eighth token, from 1024 tokens
