"""Every family entry matches the model it describes: each attribute reference resolves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moelens
from moelens.families import Family
from moelens.testing import FAMILIES, tiny_model


def references(family: Family, block: torch.nn.Module) -> list[str]:
    """Every attribute reference a family entry makes for ``block`` (dotted strings)."""
    found = [family.top_k, family.num_experts]
    for part in (family.scoring_of(block), family.combine, family.expert_gate):
        if part is not None:
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)
                found.extend(value if isinstance(value, tuple) else [value])
    return [value for value in found if isinstance(value, str) and "." in value]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_reference_resolves_on_the_family_model(name):
    wrapped = moelens.wrap(tiny_model(name))
    assert wrapped.moes, name
    for moe in wrapped.moes:
        for reference in references(moe.family, moe._module):
            value = moe.family.resolve(reference, moe._module)
            assert value is not None or reference.endswith(("groups", "bias")), (name, reference)
        assert moe.top_k >= 1 and moe.num_experts >= moe.top_k


def test_reciprocal_reference():
    wrapped = moelens.wrap(tiny_model("openai_privacy_filter"))
    moe = wrapped.moes[0]
    assert moe.family.resolve(moe.family.scoring.scale, moe._module) == pytest.approx(1 / moe.top_k)
    hidden = torch.randn(5, moe._module.router.hidden_dim)
    logits, weights, _ = moe._module.router(hidden)
    assert torch.allclose(weights.sum(-1), torch.full((5,), 1 / moe.top_k))  # the scale the entry records
