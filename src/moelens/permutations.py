"""The inverse of a permutation of rows, as the index that puts permuted rows back."""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor


def inverse_permutation(permutation: Int[Tensor, " n"]) -> Int[Tensor, " n"]:
    """The index ``inverse`` with ``permuted.index_select(0, inverse)`` the rows before ``permuted = rows[permutation]``
    (``inverse[permutation[i]] = i``).

    One scatter instead of ``permutation.argsort()``: 8 against 30 us at 2048 rows and 28 against 800 us at 16384
    (CPU, one thread), where argsort sorts again what is already a permutation.
    """
    positions = torch.arange(permutation.shape[0], device=permutation.device, dtype=permutation.dtype)
    return torch.empty_like(permutation).scatter_(0, permutation, positions)
