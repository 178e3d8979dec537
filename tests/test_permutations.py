"""`inverse_permutation` puts permuted rows back, as argsort of the permutation does."""

import pytest
import torch

from moelens.permutations import inverse_permutation


@pytest.mark.parametrize("size", [0, 1, 7, 2048])
def test_inverse_puts_permuted_rows_back(size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    rows = torch.randn(size, 3, generator=generator)
    permutation = torch.randperm(size, generator=generator)
    inverse = inverse_permutation(permutation)
    assert torch.equal(rows[permutation].index_select(0, inverse), rows)
    assert torch.equal(inverse, permutation.argsort())
    assert inverse.dtype == permutation.dtype
