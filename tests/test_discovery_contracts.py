"""Contracts of block discovery and of a family entry's readers that no other test pins.

- `Family.holds`: an attribute the block has but that is None (a config leaving the bias out) is not held.
- `Family.groups_of`: a config that sets only one of ``(n_group, topk_group)`` picks without groups (None).
- `Family.identity_count`: a count read from the block that is negative or a bool is refused, not used.
- `register`: a name or block class already registered is refused unless ``replace=True``; top_k=0 is refused.
- `discover`: blocks of a registered family that hold no experts module are warned about even when the
  model's other blocks (of another family) are served.

Ground truth is hand-built: plain torch modules with set attributes, and the model's own module tree.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from moelens import Family, FamilyError, Scoring, families
from moelens.discovery import discover
from moelens.testing import tiny_model


class Plain(torch.nn.Module):
    """A block whose attributes a test sets by hand."""


def _family(**fields) -> Family:
    return Family(name="contract_probe", model_types=(), block_classes=("Plain",), **fields)


def test_holds_is_false_for_an_attribute_that_is_none():
    block = Plain()
    block.bias = None
    block.other = torch.zeros(3)
    family = _family()
    assert family.holds("block.bias", block) is False
    assert family.holds("block.other", block) is True
    assert family.holds("block.missing", block) is False


def test_groups_of_is_none_when_the_config_sets_only_one_of_the_pair():
    family = _family(scoring=Scoring("sigmoid", "group_topk", groups=("block.n_group", "block.topk_group")))
    block = Plain()
    block.n_group, block.topk_group = 2, None
    assert family.groups_of(block) is None
    block.n_group, block.topk_group = None, 1
    assert family.groups_of(block) is None
    block.n_group, block.topk_group = 4, 1
    assert family.groups_of(block) == (4, 1)


@pytest.mark.parametrize("value", [-1, True], ids=["negative", "bool"])
def test_identity_count_refuses_a_negative_or_bool_count(value):
    family = _family(identity_experts="block.zero_expert_num")
    block = Plain()
    block.zero_expert_num = value
    with pytest.raises(FamilyError, match="not a count of experts"):
        family.identity_count(block)
    block.zero_expert_num = 2
    assert family.identity_count(block) == 2


class IdleBlock(torch.nn.Module):
    """A block of a registered family holding no experts module where its family says."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 2)


class Both(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.served = tiny_model("qwen2_moe")
        self.idle = torch.nn.ModuleList([IdleBlock()])


def test_idle_blocks_of_another_family_are_warned_about_beside_served_blocks():
    model = Both()
    moe_blocks = [name for name, module in model.named_modules() if isinstance(module, Qwen2MoeSparseMoeBlock)]
    families.register(Family(name="idle_probe", model_types=(), block_classes=("IdleBlock",)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            structure = discover(model)
    finally:
        families.unregister("idle_probe")
    assert structure.moe_blocks == moe_blocks and moe_blocks
    idle = [str(w.message) for w in caught if "'idle_probe'" in str(w.message)]
    assert len(idle) == 1 and "hold no experts module at 'experts'" in idle[0] and "idle.0" in idle[0], idle


def test_register_refuses_a_taken_name_without_replace():
    before = families.get("mixtral")
    probe = Family(name="mixtral", model_types=(), block_classes=("NameClashProbeBlock",))
    try:
        with pytest.raises(FamilyError, match="already registered; pass replace=True"):
            families.register(probe)
        with pytest.raises(FamilyError, match=r"replace must be True or False, got 'no'"):  # truthy text: no replace
            families.register(probe, replace="no")
    finally:
        if families.get("mixtral") is probe:  # registered after all: put the built-in back
            families.unregister("mixtral")
    assert families.get("mixtral") is before


def test_register_refuses_a_taken_block_class_without_replace():
    owner = families.get("qwen2_moe")
    assert "Qwen2MoeSparseMoeBlock" in owner.block_classes
    probe = Family(name="class_clash_probe", model_types=(), block_classes=("Qwen2MoeSparseMoeBlock",))
    try:
        with pytest.raises(FamilyError, match="already belongs to family 'qwen2_moe'; pass replace=True"):
            families.register(probe)
    finally:
        if "class_clash_probe" in [f.name for f in families.supported()]:
            families.unregister("class_clash_probe")
    assert families.get("qwen2_moe") is owner


def test_register_refuses_a_top_k_of_zero():
    probe = Family(name="top_k_probe", model_types=(), block_classes=("TopKProbeBlock",), top_k=0)
    try:
        with pytest.raises(FamilyError, match=r"top_k must be an int >= 1"):
            families.register(probe)
    finally:
        if "top_k_probe" in [f.name for f in families.supported()]:
            families.unregister("top_k_probe")
