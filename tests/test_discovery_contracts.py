"""Contracts of block discovery and of a family entry's readers that no other test pins.

- `Family.holds`: an attribute the block has but that is None (a config leaving the bias out) is not held.
- `Family.groups_of`: a config that sets only one of ``(n_group, topk_group)`` picks without groups (None).
- `Family.identity_count`: a count read from the block that is negative or a bool is refused, not used.
- `register`: a name or block class already registered is refused unless ``replace=True``; top_k=0 is refused.
- `discover`: blocks of a registered family that hold no experts module are warned about even when the
  model's other blocks (of another family) are served.
- `discover`: a PEFT ``modules_to_save`` wrapper around a MoE block (or its decoder layer) or inside one (its
  router, experts, shared expert) is refused, naming it and ``merge_and_unload()``; one elsewhere (lm_head,
  embed_tokens) wraps as it is.

Ground truth is hand-built: plain torch modules with set attributes, and the model's own module tree.
"""

from __future__ import annotations

import dataclasses

import warnings

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

import moelens
from moelens import Family, FamilyError, Scoring, families
from moelens.discovery import discover
from moelens.testing import tiny_inputs, tiny_model


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
        with pytest.raises(FamilyError, match=r"already registered; 'mixtral' is one of moelens' own families: give "
                                              r"your entry a name, block classes and model types of its own, or pass "
                                              r"replace=True to replace it, which changes how every mixtral model is "
                                              r"served until moelens.families.unregister\('mixtral'\)"):
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
        with pytest.raises(FamilyError, match="already belongs to family 'qwen2_moe'; 'qwen2_moe' is one of moelens' "
                                              "own families: .* or pass replace=True to take it over, which changes.*"
                                              r"unregister\('class_clash_probe'\) gives"):  # the call that undoes it
            families.register(probe)
        mine = families.register(Family(name="class_clash_probe", model_types=(), block_classes=("ProbeOwnBlock",)))
        with pytest.raises(FamilyError, match=r"a family named 'class_clash_probe' is already registered; pass "
                                              r"replace=True to replace it\.$"):  # a user's own: no warning of moelens'
            families.register(dataclasses.replace(mine, block_classes=("ProbeOtherBlock",)))
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


def _modules_to_save_model(target: str) -> torch.nn.Module:
    """A PEFT model of tiny qwen2_moe with ``modules_to_save=[target]`` whose trainable copies differ from the frozen
    originals (so values from the copy that does not run would show)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=[target])
    tuned = peft.get_peft_model(tiny_model("qwen2_moe"), config).eval()
    with torch.no_grad():
        for module in tuned.modules():
            if hasattr(module, "original_module"):
                for parameter in module.modules_to_save["default"].parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.5)
    return tuned


def _running(module: torch.nn.Module) -> torch.nn.Module:
    """The module that runs in ``module``'s place: a modules_to_save wrapper's active trainable copy, or itself."""
    return module.modules_to_save["default"] if hasattr(module, "original_module") else module


def _hooked_values(tuned: torch.nn.Module, inputs: dict) -> tuple[dict[int, dict[str, torch.Tensor]], torch.Tensor]:
    """Ground truth by torch forward hooks on the modules that run in the PEFT model: per MoE layer, the router's
    logits and the block's output; and the model's logits."""
    values: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(tuned.base_model.model.model.layers):
        block = _running(_running(layer).mlp)
        if not hasattr(block, "experts"):
            continue
        record = values.setdefault(index, {})
        handles += [
            _running(block.gate).register_forward_hook(lambda m, a, out, r=record: r.update(router_logits=out[0])),
            block.register_forward_hook(lambda m, a, out, r=record: r.update(mlp_output=out)),
            _running(block.shared_expert).register_forward_hook(lambda m, a, out, r=record: r.update(shared=out)),
            _running(block.shared_expert_gate).register_forward_hook(lambda m, a, out, r=record: r.update(gate=out)),
        ]
    try:
        with torch.no_grad():
            logits = tuned(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    for record in values.values():  # qwen2_moe's shared expert output, gated as the block adds it
        record["shared_expert_output"] = torch.sigmoid(record.pop("gate")) * record.pop("shared")
    return values, logits


def _assert_served_like_hooks(wrapped, values: dict, logits: torch.Tensor, inputs: dict) -> None:
    """``wrapped`` serves each hooked layer's router logits and block output, and the model's logits, as hooked."""
    with wrapped.trace(**inputs):
        served = wrapped.save_all()
        output = wrapped.output.logits.save()
    assert sorted(served) == sorted(values) and values
    for index, hooked in values.items():
        for name, want in hooked.items():
            torch.testing.assert_close(served[index][name].reshape(want.shape), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(output, logits, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("target", "where", "what"),
    [
        ("mlp", r"layers\.1\.mlp", r"holds the qwen2_moe MoE block .*layers\.1\.mlp twice"),
        ("layers.1", r"layers\.1", r"holds the qwen2_moe MoE block .*layers\.1\.mlp twice"),
        ("gate", r"layers\.1\.mlp\.gate", r"MoE block .*layers\.1\.mlp for its router \('gate'\)"),
        ("experts", r"layers\.1\.mlp\.experts", r"MoE block .*layers\.1\.mlp for its experts \('experts'\)"),
    ],
    ids=["block", "decoder_layer", "router", "experts"],
)
def test_peft_modules_to_save_on_or_around_a_moe_block_is_refused(target, where, what):
    """PEFT's modules_to_save puts a wrapper holding the frozen original (``original_module``, which no longer runs)
    beside the trainable copy (which does). Before, around a block moelens served both as Moe blocks (model.moes[0]
    the dead original, save_all failing with an OrderError), on the router it raised a FamilyError about a
    ModulesToSaveWrapper op, and on the experts it warned of unknown blocks and served none. Now wrap refuses it,
    naming the wrapper and merge_and_unload(); the merged model serves the trainable copy, as hooks on it show."""
    tuned = _modules_to_save_model(target)
    inputs = tiny_inputs(tuned.base_model.model)
    values, logits = _hooked_values(tuned, inputs)
    with pytest.raises(FamilyError, match=rf"base_model\.model\.model\.{where} \(ModulesToSaveWrapper, PEFT's "
                                          rf"modules_to_save wrapper\) .*{what}.*merge_and_unload\(\)"):
        moelens.wrap(tuned)
    _assert_served_like_hooks(moelens.wrap(tuned.merge_and_unload()), values, logits, inputs)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens", "shared_expert", "shared_expert_gate"])
def test_peft_modules_to_save_away_from_the_moe_blocks_wraps_as_it_is(target):
    """A modules_to_save wrapper on a module no MoE block holds, or on a part of a block whose output moelens reads
    at the module (the shared expert, its gate; a first version refused those too), is no reason to refuse: the
    model wraps, serves every MoE block once and its values equal hooks on the PEFT model (its trainable copy
    runs)."""
    tuned = _modules_to_save_model(target)
    inputs = tiny_inputs(tuned.base_model.model)
    values, logits = _hooked_values(tuned, inputs)
    wrapped = moelens.wrap(tuned)
    assert [moe.layer for moe in wrapped.moes] == sorted(values)
    _assert_served_like_hooks(wrapped, values, logits, inputs)


def test_mlp_activation_under_modules_to_save_is_the_running_copys_whichever_adapter_runs():
    """A shared expert or dense MLP in PEFT's modules_to_save wraps as it is (mlp_output is the trainable copy's); its
    mlp_activation raised 'ModulesToSaveWrapper has no down projection'. It is the input of the down_proj that runs:
    the active adapter's copy, another one after set_adapter (a read before it made the next fail with an order
    error), the frozen original under disable_adapter(); and a write to it reaches that down_proj. Ground truth: a
    pre-hook on that down_proj (which also zeroes its input, for the write)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    targets = ["shared_expert", "layers.0.mlp"]
    tuned = peft.get_peft_model(tiny_model("qwen2_moe"), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                       modules_to_save=targets)).eval()
    tuned.add_adapter("other", peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=targets))
    layers = tuned.base_model.model.model.layers
    wrappers = {"dense": layers[0].mlp, "shared": layers[1].mlp.shared_expert}
    with torch.no_grad():
        for wrapper in wrappers.values():
            for adapter, scale in (("default", 0.5), ("other", 1.0)):
                for parameter in wrapper.modules_to_save[adapter].parameters():
                    parameter.add_(torch.randn_like(parameter) * scale)
    inputs = tiny_inputs(tuned.base_model.model)
    wrapped = moelens.wrap(tuned)
    blocks = {"dense": wrapped.layers[0].mlp, "shared": wrapped.moes[0].shared_experts}

    def hooked(running: dict[str, torch.nn.Module], zero: str | None = None) -> tuple[dict, torch.Tensor]:
        seen = {}

        def hook(name: str):
            return lambda module, args: (seen.update({name: args[0].clone()}),
                                         (torch.zeros_like(args[0]),) if name == zero else None)[1]

        handles = [running[name].down_proj.register_forward_pre_hook(hook(name)) for name in running]
        with torch.no_grad():
            logits = tuned(**inputs).logits
        for handle in handles:
            handle.remove()
        return seen, logits

    def served(zero: str | None = None) -> tuple[dict, torch.Tensor]:
        read = {}
        with torch.no_grad(), wrapped.trace(inputs["input_ids"]):
            for name, block in blocks.items():
                read[name] = block.mlp_activation.save()
                if name == zero:
                    block.mlp_activation = torch.zeros_like(block.mlp_activation)
            logits = wrapped.output.logits.save()
        return read, logits

    def check(running: dict[str, torch.nn.Module]) -> None:
        expected, _ = hooked(running)
        got, _ = served()
        for name in blocks:
            assert torch.equal(got[name].reshape(expected[name].shape), expected[name]), name
        for name in blocks:
            assert torch.equal(served(zero=name)[1], hooked(running, zero=name)[1]), name

    check({name: wrapper.modules_to_save["default"] for name, wrapper in wrappers.items()})
    tuned.set_adapter("other")
    check({name: wrapper.modules_to_save["other"] for name, wrapper in wrappers.items()})
    with tuned.disable_adapter():
        check({name: wrapper.original_module for name, wrapper in wrappers.items()})


def test_mlp_output_of_a_block_adding_the_residual_under_modules_to_save_is_its_own_part():
    """bloom's MLP adds the residual itself, so mlp_output is its down projection's output; in a modules_to_save
    wrapper moelens looked at the wrapper's forward (no residual parameter) and served the sum, residual included.
    Ground truth: a hook on the running copy's dense_4h_to_h."""
    peft = pytest.importorskip("peft")
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    base = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)).eval()
    tuned = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["query_key_value"],
                                                      modules_to_save=["h.0.mlp"])).eval()
    running = tuned.base_model.model.transformer.h[0].mlp.modules_to_save["default"]
    with torch.no_grad():
        for parameter in running.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    seen = {}
    handle = running.dense_4h_to_h.register_forward_hook(lambda module, args, output: seen.update(out=output.clone()))
    with torch.no_grad():
        tuned(input_ids=ids)
    handle.remove()
    wrapped = moelens.wrap(tuned)
    with torch.no_grad(), wrapped.trace(ids):
        output = wrapped.layers[0].mlp.mlp_output.save()
    assert torch.equal(output.reshape(seen["out"].shape), seen["out"])
