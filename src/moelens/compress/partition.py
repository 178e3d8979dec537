"""Balanced clustering of a layer's neurons into experts (scikit-learn k-means, then equal-size assignment).

Each neuron is described by a feature vector: on calibration data, how its
contribution to the output varies over tokens (neurons that matter for the same
tokens land in the same expert, so a token's few selected experts hold most of what
it needs); without data, its normalised weights (MoEfication's parameter
clustering). Features are reduced to at most `MAX_FEATURES` dimensions, clustered
with k-means, and assigned to equal-size groups: an exact minimum-cost assignment
(scipy's ``linear_sum_assignment``) for up to `EXACT_LIMIT` neurons, a greedy one
above.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

#: Feature dimensions kept (truncated SVD) before clustering.
MAX_FEATURES = 64
#: Up to this many neurons, the equal-size assignment is exact (Hungarian); above it, greedy.
EXACT_LIMIT = 4096


def group_sizes(count: int, groups: int) -> list[int]:
    """``count`` items split into ``groups`` sizes that differ by at most one (largest first)."""
    base, extra = divmod(count, groups)
    return [base + (1 if index < extra else 0) for index in range(groups)]


def reduce(features: Float[Tensor, "n f"], dims: int = MAX_FEATURES, seed: int = 0) -> Float[Tensor, "n r"]:
    """Rows normalised to unit length, projected on their top ``dims`` singular directions."""
    features = F.normalize(features.float(), dim=-1)
    if features.shape[1] <= dims or features.shape[0] <= dims:
        return features
    # svd_lowrank draws from torch's global CPU generator: seed it for this call only (the user's stream is restored;
    # torch.manual_seed would also reseed every CUDA device).
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        left, singular, _ = torch.svd_lowrank(features, q=dims, niter=4)
    return left * singular


def _assign(cost: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Labels minimising the total cost with exactly ``sizes[g]`` items in group g."""
    count = cost.shape[0]
    if count <= EXACT_LIMIT:
        from scipy.optimize import linear_sum_assignment

        slots = np.concatenate([np.full(size, group) for group, size in enumerate(sizes)])
        rows, columns = linear_sum_assignment(cost[:, slots])
        labels = np.empty(count, dtype=np.int64)
        labels[rows] = slots[columns]
        return labels
    labels = np.full(count, -1, dtype=np.int64)
    room = np.array(sizes)
    # Neurons with the strongest preference (gap between best and second best) choose first.
    ordered = np.sort(cost, axis=1)
    for item in np.argsort(ordered[:, 0] - ordered[:, 1]):
        for group in np.argsort(cost[item]):
            if room[group]:
                labels[item] = group
                room[group] -= 1
                break
    return labels


def balanced_kmeans(
    features: Float[Tensor, "n f"], groups: int, *, seed: int = 0, iterations: int = 4
) -> Int[Tensor, " n"]:
    """Cluster ``n`` rows into ``groups`` groups of equal size (sizes differ by at most one).

    k-means (scikit-learn) gives the starting centroids; then each round assigns rows to
    centroids under the size constraint and moves the centroids to their group's mean.

    Returns:
        The group of each row, ``[n]`` int64.
    """
    from sklearn.cluster import KMeans

    count = features.shape[0]
    sizes = group_sizes(count, groups)
    if groups == 1:
        return torch.zeros(count, dtype=torch.long)
    points = reduce(features, seed=seed).double().numpy()
    centroids = KMeans(groups, n_init=2, random_state=seed).fit(points).cluster_centers_
    labels = None
    for _ in range(iterations):
        cost = ((points[:, None, :] - centroids[None]) ** 2).sum(-1)
        new = _assign(cost, sizes)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centroids = np.stack([points[labels == group].mean(0) for group in range(groups)])
    return torch.from_numpy(labels)


def contiguous(count: int, groups: int) -> Int[Tensor, " n"]:
    """Neurons split in order into equal groups (the naive split)."""
    sizes = group_sizes(count, groups)
    return torch.repeat_interleave(torch.arange(groups), torch.tensor(sizes))
