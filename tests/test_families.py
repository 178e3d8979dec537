"""Every family entry matches the model it describes: each attribute reference resolves."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from typing import Callable

import pytest
import torch
import transformers
from torch.nn import functional as F

import moelens
from moelens import families
from moelens.families import Family
from moelens.families.unserved import UNSERVED
from moelens.testing import FAMILIES, tiny_config, tiny_inputs, tiny_model


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
        unused_groups = moe.family.groups_of(moe._module) is None  # DS2 greedy: its config leaves them None
        for reference in references(moe.family, moe._module):
            value = moe.family.resolve(reference, moe._module)
            unclamped = reference == getattr(moe.family.expert_gate, "limit", None)  # step3p7 5.25: None on layers
            assert value is not None or reference.endswith(("groups", "bias")) or unclamped or (
                unused_groups and reference in moe.SCORING.groups), (name, reference)
        assert moe.top_k >= 1 and moe.num_experts >= moe.top_k


def test_reciprocal_reference():
    wrapped = moelens.wrap(tiny_model("openai_privacy_filter"))
    moe = wrapped.moes[0]
    assert moe.family.resolve(moe.family.scoring.scale, moe._module) == pytest.approx(1 / moe.top_k)
    hidden = torch.randn(5, moe._module.router.hidden_dim, device=moe.device)
    logits, weights, _ = moe._module.router(hidden)
    assert torch.allclose(weights.sum(-1), torch.full((5,), 1 / moe.top_k, device=weights.device))  # the scale the entry records


@pytest.mark.parametrize("name", FAMILIES)
def test_every_layer_block_has_the_standard_name(name):
    # model.layers[i].mlp is the block of every decoder layer that has one: a Moe on MoE layers, an
    # Mlp on dense ones, whatever the family calls it (mlp, feed_forward, block_sparse_moe, ...).
    wrapped = moelens.wrap(tiny_model(name))
    for moe in wrapped.moes:
        block = wrapped.layers[moe.layer].mlp
        assert block is moe or moe in getattr(block, "moes", [moe]) or moe.path.startswith(block.path), (name, moe.path)
    for path in wrapped._structure.dense_blocks:
        layer = int(path.split(".")[-2])
        assert isinstance(wrapped.layers[layer].mlp, moelens.Mlp), (name, path)
    hf_layers = wrapped._module.get_submodule(wrapped.layers.path.removeprefix("model."))
    attr = wrapped.family.block_attr  # "": the decoder layer is the block (gemma4)
    assert not attr or any(hasattr(layer, attr) for layer in hf_layers), \
        f"{name}: no decoder layer has a {attr!r} child (the family's block_attr)"


def _dense_shared_experts(name: str) -> list[str]:
    """The paths (from the model) of the MoE blocks' shared experts of ``name``'s tiny model that are dense MLPs."""
    from moelens.discovery import discover

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover(tiny_model(name)).shared_mlps


SHARED_MLP_FAMILIES = [name for name in FAMILIES if _dense_shared_experts(name)]


def test_the_families_with_dense_shared_experts_are_many():
    assert {"qwen2_moe", "deepseek_v3", "llama4", "granitemoeshared"} <= set(SHARED_MLP_FAMILIES), SHARED_MLP_FAMILIES


@pytest.mark.parametrize("name", SHARED_MLP_FAMILIES)
def test_a_dense_shared_expert_serves_its_activations_and_output(name):
    """moe.shared_experts was a plain envoy: its hidden activations (which a dense layer's Mlp serves) had no name
    (``.mlp_activation`` raised AttributeError). Ground truth: the input of its down projection and its output, taken
    by hooks on an unwrapped copy (a copy of the output: llama4's block adds the routed output to it in place after,
    so its output is served as the block's shared_expert_output alone); a write of the activations is the same edit
    made there by a pre-hook."""
    hf = tiny_model(name)
    inputs, reference = tiny_inputs(hf), copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    shared = wrapped.moes[-1].shared_experts
    assert isinstance(shared, moelens.components.Mlp), type(shared)
    module = reference.get_submodule(shared.path.removeprefix("model."))
    down = module.get_submodule(shared.down_projection)
    seen = {}
    hooks = [down.register_forward_pre_hook(lambda m, args: seen.update(activation=args[0])),
             module.register_forward_hook(lambda m, args, output: seen.update(output=output.clone()))]
    with torch.no_grad():
        plain = first_output(reference(**inputs))
    with torch.no_grad(), wrapped.trace(**inputs):
        activation = shared.mlp_activation.save()
        if name != "llama4":
            output = shared.mlp_output.save()
        else:  # the block adds the routed output to it in place: served as shared_expert_output alone (review 3:
            output = wrapped.moes[-1].shared_expert_output.save()  # a copy each lost one of two writes)
    torch.testing.assert_close(activation, seen["activation"].view_as(activation), rtol=0, atol=0)
    torch.testing.assert_close(output, seen["output"].view_as(output), rtol=0, atol=0)
    if name == "llama4":
        with pytest.raises(moelens.ValueUnavailable, match=r"shared_expert\.mlp_output cannot be served: llama4's "
                                                           r"block adds .* Read or write .*\.shared_expert_output"):
            with wrapped.trace(**inputs):
                shared.mlp_output.save()
    for hook in hooks:
        hook.remove()
    down.register_forward_pre_hook(lambda m, args: (args[0] * 0.5, *args[1:]))
    with torch.no_grad():
        expected = first_output(reference(**inputs))
    with torch.no_grad(), wrapped.trace(**inputs):
        shared.mlp_activation[:] *= 0.5
        edited = first_output(wrapped.output).save()
    torch.testing.assert_close(edited, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(edited, plain), "the edit changed nothing: the test would not notice a no-op"


def call_order(hf, inputs, block, children):
    """The order in which ``block`` calls its ``children`` in a plain forward of ``hf`` (forward pre-hooks), the first
    call of each."""
    calls = []
    hooks = [getattr(block, name).register_forward_pre_hook(lambda module, args, name=name: calls.append(name))
             for name in children]
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(calls))[:len(children)]


def test_a_shared_expert_read_after_the_router_says_where_its_values_fall():
    """qwen2_moe calls its shared expert before its router (hooks: shared_expert, gate, experts, shared_expert_gate),
    and moe.order() places only its gated output; a read of its activations after router_logits named the shared
    Mlp's own order (mlp_activation -> mlp_output), which the read followed."""
    hf = tiny_model("qwen2_moe")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe = wrapped.moes[1]
    block = hf.get_submodule(moe.path.removeprefix("model."))
    assert call_order(hf, inputs, block, ("shared_expert", "gate", "experts")) == ["shared_expert", "gate", "experts"]
    with pytest.raises(moelens.OrderError, match=rf"shared_expert is the shared expert of {re.escape(moe.path)}: the "
                                                 r"block calls it before its router \(the gated output it serves "
                                                 r"comes after the experts\): read them before the block's values"):
        with wrapped.trace(**inputs):
            moe.router_logits.save()
            moe.shared_experts.mlp_activation.save()
    with wrapped.trace(**inputs):  # in the block's call order
        activation = moe.shared_experts.mlp_activation.save()
        logits = moe.router_logits.save()
    assert activation.shape[-1] == block.shared_expert.down_proj.in_features and logits.shape[-1] == moe.num_experts


def test_a_shared_expert_called_after_the_experts_is_placed_there_by_the_order_error():
    """deepseek_v3 calls its shared experts after its experts (hooks), and the refusal said to read them "before the
    block's other values", which raised an OrderError again on routed_output; it now says where they fall, and that
    order reads."""
    hf = tiny_model("deepseek_v3")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe = wrapped.moes[0]
    block = hf.get_submodule(moe.path.removeprefix("model."))
    assert call_order(hf, inputs, block, ("gate", "experts", "shared_experts")) == ["gate", "experts", "shared_experts"]
    with pytest.raises(moelens.OrderError, match=r"the block calls it after its experts: read them after routed_output, "
                                                 r"before mlp_output, or in a trace of their own"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moe.mlp_output.save()
            moe.shared_experts.mlp_activation.save()
    with torch.no_grad(), wrapped.trace(**inputs):
        routed = moe.routed_output.save()
        shared = moe.shared_experts.mlp_output.save()
        output = moe.mlp_output.save()
    torch.testing.assert_close(output, routed + shared)


def test_a_shared_expert_on_the_decoder_layer_is_named_as_the_blocks():
    """granitemoeshared keeps its shared expert on the decoder layer beside the block (hooks: the layer calls it after
    the block); a mixture value of it said "MoE layers are [0, 1, 2, 3]; iterate model.moes", its layer among them,
    and its order error said nothing of where the layer calls it."""
    hf = tiny_model("granitemoeshared")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe, layer = wrapped.moes[1], hf.model.layers[1]
    shared = wrapped.layers[1].shared_mlp
    assert moe.shared_experts is shared
    assert call_order(hf, inputs, layer, ("block_sparse_moe", "shared_mlp")) == ["block_sparse_moe", "shared_mlp"]
    with pytest.raises(moelens.ValueUnavailable, match=rf"runs beside the experts as the shared expert of the MoE "
                                                       rf"block {re.escape(moe.path)}: use that block"):
        with wrapped.trace(**inputs):
            shared.router_logits.save()
    with pytest.raises(moelens.OrderError, match=rf"shared_mlp is the shared expert of {re.escape(moe.path)}: its "
                                                 r"decoder layer calls it after the block: read them after mlp_output"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.moes[2].router_logits.save()
            shared.mlp_activation.save()


@pytest.mark.parametrize(("name", "reason"), [("deepseek_v3", r"this deepseek_v3 block's shared expert has no gate of "
                                                              r"its own\. Its contribution is shared_expert_output"),
                                             ("mixtral", r"the mixtral family has no shared expert")])
def test_shared_gate_where_there_is_none_says_why(name, reason):
    """moe.shared_gate raised a bare AttributeError ("'Moe' object has no attribute") where the shared expert has
    no gate or there is no shared expert (review 3); where there is one it is the gate module (qwen2_moe's)."""
    gated = moelens.wrap(tiny_model("qwen2_moe")).moes[0]
    assert gated.shared_gate._module is gated._module.shared_expert_gate
    moe = moelens.wrap(tiny_model(name)).moes[0]
    with pytest.raises(moelens.ValueUnavailable, match=rf"mlp\.shared_gate cannot be served: {reason}"):
        moe.shared_gate


def first_output(output):
    """The logits (or last hidden state) of a transformers output."""
    return output.logits if hasattr(output, "logits") else output[0]


@pytest.mark.parametrize(("name", "off"), [("cohere2_moe", {"num_shared_experts": 0}),
                                           ("ernie4_5_moe", {"moe_num_shared_experts": 0})])
def test_a_config_without_its_shared_expert(name, off):
    hf = tiny_model(name, **off)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    ids = torch.arange(3, 9).unsqueeze(0)
    with wrapped.trace(ids):
        values = moe.save_all()
    assert "shared_expert_output" not in values
    torch.testing.assert_close(values["mlp_output"], values["routed_output"])  # nothing added
    with pytest.raises(moelens.ValueUnavailable, match="this checkpoint's .* block has no shared expert"):
        with wrapped.trace(ids):
            moe.shared_expert_output.save()


def test_cohere2_sigmoid_weights_follow_norm_topk_prob():
    from moelens.export.gate import routing

    hf = tiny_model("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=False)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with wrapped.trace(torch.arange(3, 9).unsqueeze(0)):
        logits, weights, indices = (moe.router_logits.save(), moe.expert_weights.save(), moe.expert_indices.save())
    torch.testing.assert_close(weights, torch.sigmoid(logits.gather(-1, indices)))  # not renormalised
    assert moe.family.resolve(moe.SCORING.normalize, moe._module) is False
    assert routing(moe.family, moe._module).gate == "sigmoid"  # tract's plain sigmoid gate expresses it


def test_deepseek_v2_groups_apply_only_with_group_limited_greedy():
    from moelens.export.errors import ExportRefused
    from moelens.export.gate import routing

    limited = tiny_model("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=1,
                         num_experts_per_tok=3)
    wrapped = moelens.wrap(limited)
    moe = wrapped.moes[0]
    assert moe.family.groups_of(moe._module) == (4, 1)
    with pytest.raises(ExportRefused, match=r"group-limited expert selection \(the best 1 of 4 groups\)"):
        routing(moe.family, moe._module)
    # Experts 0 and 7 sit in different groups and only one group is kept: force says so.
    with pytest.raises(moelens.WriteError, match=r"best 1 of 4 expert groups, and experts \[0, 7\] lie in 2 groups \[0, 3\]"):
        with wrapped.trace(torch.arange(3, 9).unsqueeze(0)):
            moelens.force(moe, [0, 7])
    greedy = moelens.wrap(tiny_model("deepseek_v2", topk_method="greedy", n_group=4, topk_group=1))
    moe = greedy.moes[0]
    assert moe.family.groups_of(moe._module) is None
    assert routing(moe.family, moe._module).gate == "softmax_all"


def test_laguna_router_probs_are_the_scores_of_the_softcapped_logits(tmp_path):
    import nnsight

    hf = tiny_model("laguna", moe_router_logit_softcapping=0.02)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    ids = torch.arange(3, 9).unsqueeze(0)
    with wrapped.trace(ids):
        probs = moe.router_probs.save()
    raw = nnsight.NNsight(hf)
    with raw.trace(ids):  # the router's own scores: sigmoid of the softcapped logits
        scores = raw.get(moe.path.removeprefix("model.") + "." + moe.family.router).source.torch_sigmoid_0.output.save()
    torch.testing.assert_close(probs, scores.view_as(probs))
    # The analysis cache applies it too (and keeps it through save / load).
    from moelens import analysis

    cache = analysis.collect_routing(wrapped, ids, logits=True, dtype=torch.float32, progress=False)
    torch.testing.assert_close(cache.probs(moe.layer), probs.reshape(-1, probs.shape[-1]).cpu())  # a cache is on the CPU
    reloaded = analysis.RoutingCache.load(cache.save(tmp_path / "cache"))
    torch.testing.assert_close(reloaded.probs(moe.layer), cache.probs(moe.layer))


@pytest.mark.parametrize(("model_type", "runs_as"), [("sarvam_mla", "deepseek_v3"), ("sarvam_moe", "glm4_moe"),
                                                     ("param2moe", "glm4_moe")])
def test_model_types_that_run_another_familys_blocks(model_type, runs_as):
    # transformers 5.24's sarvam configs and 5.25's param2moe config build DeepseekV3 / Glm4Moe models: their blocks
    # are served as those.
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from moelens.testing import COMMON_SIZES, TINY_OVERRIDES

    if importlib.util.find_spec(f"transformers.models.{model_type}") is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = AutoConfig.for_model(model_type, **{**COMMON_SIZES, **TINY_OVERRIDES[runs_as]})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    wrapped = moelens.wrap(hf)
    assert wrapped.family.name == runs_as and wrapped.moes
    ids = torch.arange(3, 9).unsqueeze(0)
    with torch.no_grad():
        plain = hf(ids).logits
    with wrapped.trace(ids):
        values = wrapped.moes[0].save_all()
        output = wrapped.output.save()
    assert torch.equal(output.logits, plain)
    torch.testing.assert_close(values["expert_outputs"].sum(2), values["routed_output"])


#: Tiny configs of the model types moelens knows and does not serve (moelens.families.unserved).
UNSERVED_CONFIGS = {
    "jetmoe": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, kv_channels=8, num_key_value_heads=2,
                   intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "switch_transformers": dict(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                num_heads=2, num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "nllb-moe": dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=4,
                     encoder_sparse_step=1, decoder_sparse_step=1),
    "doge": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=32, is_moe=True, num_experts=16, num_experts_per_tok=2),
    "vitpose_backbone": dict(image_size=[16, 16], patch_size=[4, 4], hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=32, num_experts=2, part_features=8),
}


def _unserved_model(name: str) -> torch.nn.Module:
    from transformers import AutoBackbone, AutoConfig, AutoModel, AutoModelForImageTextToText

    if name == "dots3_note":  # the whole model: a tiny served language model beside a vision tower with MoE blocks
        vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                      spatial_merge_size=2, adapter_in_dim=16, adapter_out_dim=32, adapter_merge_size=2,
                      moe_intermediate_size=16, pyramid_num_routed=[-1, 4], num_experts_per_tok=2)
        audio = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     adapter_input_size=16, adapter_out_dim=32, feature_size=16, downsample_hidden_size=8)
        config = AutoConfig.for_model(name, text_config=tiny_config(name).to_dict(), vision_config=vision,
                                      audio_config=audio)
        return AutoModelForImageTextToText.from_config(config)
    config = AutoConfig.for_model(name, **UNSERVED_CONFIGS[name])
    return (AutoBackbone if name == "vitpose_backbone" else AutoModel).from_config(config)


@pytest.mark.parametrize("entry", UNSERVED, ids=[entry.name for entry in UNSERVED])
def test_moe_blocks_moelens_does_not_serve_are_named_with_the_reason_and_never_served_as_dense(entry):
    """jetmoe's MoE block has an input_linear and an output_linear (JetMoeParallelExperts): it was served as a
    dense Mlp, whose mlp_activation was the expert-sorted [T * k, I] rows, and wrap said the model had no MoE."""
    model = _unserved_model(entry.name)
    blocks = [name for name, module in model.named_modules() if type(module).__name__ in entry.block_classes]
    assert blocks
    with pytest.warns(UserWarning, match=rf"does not serve these MoE blocks of {entry.name}: .*; {re.escape(entry.reason)}"):
        wrapped = moelens.wrap(model)
    assert not {moe.path.removeprefix("model.") for moe in wrapped.moes} & set(blocks)
    for name in blocks:
        assert not isinstance(wrapped.get(name), (moelens.components.Mlp, moelens.components.Moe)), name


@pytest.mark.parametrize("name", ["switch_transformers", "nllb-moe"])
def test_describe_of_an_encoder_decoder_whose_blocks_are_not_served_names_them(name):
    """describe() said routing analysis runs on token ids alone and the model needs decoder tokens, pointing to a
    trace of blocks moelens does not serve."""
    from moelens import analysis

    entry = next(entry for entry in UNSERVED if entry.name == name)
    with pytest.warns(UserWarning):
        wrapped = moelens.wrap(_unserved_model(name))
    assert not wrapped.moes
    with pytest.raises(moelens.MoelensError, match=rf"has no Mixture-of-Experts layer moelens knows \(it has MoE "
                                                   rf"blocks moelens does not serve \({entry.block_classes[0]}"):
        analysis.describe(wrapped)


def test_a_block_with_a_weight_per_expert_is_not_served_as_a_dense_mlp():
    """An unknown MoE block whose projections hold [E, out, in] weights has no dense hidden activation."""

    class PerExpert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8, 8))

    class Dense(torch.nn.Module):
        def __init__(self, projection: type[torch.nn.Module]) -> None:
            super().__init__()
            self.up_proj, self.down_proj = projection(), projection()

    class Layer(torch.nn.Module):
        def __init__(self, projection: Callable[[], torch.nn.Module]) -> None:
            super().__init__()
            self.mlp = Dense(projection)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(lambda: torch.nn.Linear(8, 8)), Layer(PerExpert)])
    with pytest.warns(UserWarning, match="its 1 dense MLPs"):
        wrapped = moelens.wrap(model)
    assert isinstance(wrapped.get("layers.0.mlp"), moelens.components.Mlp)
    assert not isinstance(wrapped.get("layers.1.mlp"), moelens.components.Mlp)


def test_axk2_without_expert_groups_is_not_group_limited():
    """AXK2Config's default has no groups (n_group=None: the router skips them); moelens read them as ints and
    force (which checks the groups) failed with a bare TypeError."""
    from moelens.testing import tiny_inputs

    hf = tiny_model("axk2", n_group=None, topk_group=None)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    assert moe.family.groups_of(moe._module) is None
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
        moelens.force(moe, 3)
        indices = moe.expert_indices.save()
    assert (indices == 3).any(-1).all()


class _MmRouter(torch.nn.Module):
    """kolibri1's router with its CUDA branch (torch.mm instead of F.linear) taken wherever ``take_mm`` is set,
    so the branch that skips the logits op runs on the CPU too."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.hidden_dim = router.top_k, router.norm_topk_prob, router.hidden_dim
        self.weight, self.e_score_correction_bias = router.weight, router.e_score_correction_bias
        self.take_mm = False

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if self.take_mm:
            router_logits = torch.mm(hidden_states.float(), self.weight.float().t())
        else:
            router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        router_indices = torch.topk(router_logits + self.e_score_correction_bias, self.top_k, dim=-1)[1]
        router_scores = router_logits.gather(1, router_indices).sigmoid()
        if self.norm_topk_prob:
            router_scores = router_scores / router_scores.sum(dim=-1, keepdim=True)
        return router_logits, router_scores, router_indices


@pytest.mark.parametrize("family", ["kolibri1", "kolibri1_1"])
def test_an_order_mistake_on_kolibri1_is_named_as_one_where_its_router_cannot_skip_the_logits(family):
    """Every out-of-order read of kolibri1's logits (expert_indices first, then router_logits) blamed its CUDA torch.mm
    branch and advised torch.enable_grad(), on the CPU and with grad on, where the router ran F_linear_0."""
    if family not in FAMILIES:
        pytest.skip(f"{family}: not in this transformers")
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    for grad in (torch.enable_grad, torch.no_grad):
        with pytest.raises(moelens.errors.OrderError, match=r"router_logits was requested after the model had already "
                                                             r"run past it\. Within a block, read values in the order"):
            with grad(), wrapped.trace(**tiny_inputs(hf)):
                wrapped.moes[0].expert_indices.save()
                wrapped.moes[0].router_logits.save()


def test_kolibri1_logits_skipped_by_its_cuda_branch_are_named_in_the_error(monkeypatch):
    """On CUDA under no_grad kolibri1's router computes its logits with torch.mm and never runs F_linear_0: a read
    of them said the user read out of order. The error now says which branch skipped them and what to do; the
    values after the logits still read (the experts call's arguments). The router here takes that branch on the CPU,
    which is told its weights are on an accelerator."""
    from moelens.components import base

    monkeypatch.setattr(base, "router_on_accelerator", lambda component: True)
    hf = tiny_model("kolibri1")
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate = _MmRouter(layer.mlp.gate)
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    for router in (layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")):
        router.take_mm = True
    with pytest.raises(moelens.errors.OrderError, match=r"was never produced: kolibri1's router skips F_linear_0, "
                       r"where moelens reads its logits, on CUDA .*torch.enable_grad\(\)"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.moes[0].router_logits.save()
    called = []  # the weights the experts module is called with: a torch hook, no moelens
    hook = wrapped.moes[0].experts._module.register_forward_pre_hook(lambda module, args: called.append(args[2]))
    try:
        with torch.no_grad(), wrapped.trace(**inputs):
            weights = wrapped.moes[0].expert_weights.save()
    finally:
        hook.remove()
    torch.testing.assert_close(weights, called[0].reshape(weights.shape), rtol=0, atol=0)


def _ernie_norm_min_run(name: str, **overrides):
    """A tiny ``name`` model wrapped, its first block, and that block's logits, weights and indices on the family's
    tiny inputs."""
    wrapped = moelens.wrap(tiny_model(name, **overrides))
    moe = wrapped.moes[0]
    inputs = tiny_inputs(wrapped._module)
    with torch.no_grad(), wrapped.trace(**inputs):
        logits, weights, indices = moe.router_logits.save(), moe.expert_weights.save(), moe.expert_indices.save()
    return wrapped, moe, inputs, logits, weights, indices


@pytest.mark.parametrize("name", ["ernie4_5_moe", "ernie4_5_vl_moe"])
def test_ernie_weights_follow_the_routers_norm_min_floor(name):
    """ernie's router divides its k weights by clamp(sum, min=moe_norm_min). The entry said plain renormalisation:
    with moe_norm_min=0.9 describe said "renormalised", and families.check refused moelens' own entry (the weights
    "not what the scoring gives"). Ground truth: the weights recomputed by hand from the router's correction bias."""
    wrapped, moe, inputs, logits, weights, indices = _ernie_norm_min_run(name, moe_norm_min=0.9)
    bias = moe._module.gate.moe_statics.e_score_correction_bias.detach().float()
    probs = torch.softmax(logits.float(), dim=-1)
    by_hand_indices = torch.topk(probs + bias, moe.top_k, dim=-1).indices
    chosen = probs.gather(-1, by_hand_indices)
    assert (chosen.sum(-1) < 0.9).any(), "the floor never binds on these inputs: the test would prove nothing"
    assert torch.equal(indices, by_hand_indices)
    torch.testing.assert_close(weights.float(), chosen / chosen.sum(-1, keepdim=True).clamp(min=0.9))
    assert moe.family.normalize_min_of(moe._module) == pytest.approx(0.9)
    assert "renormalised (sum clamped at >= 0.9)" in moe.family.described_on(moe._module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ernie4_5_vl_moe's blocks serve no mlp_output: check warns so
        assert moe.path in moelens.families.check(wrapped, **inputs)


@pytest.mark.parametrize("name", ["ernie4_5_moe", "ernie4_5_vl_moe"])
def test_ernie_with_its_default_norm_min_describes_as_plainly_renormalised(name):
    """The default moe_norm_min (1e-12) only guards a division by zero: the description stays what it was, and the
    weights sum to one (by hand)."""
    _, moe, _, _, weights, _ = _ernie_norm_min_run(name)
    assert moe.family.normalize_min_of(moe._module) == 1e-12
    assert moe.family.described_on(moe._module) == "softmax scores, score topk, selection bias, renormalised (SM+ bias)"
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(weights.shape[:-1]))


@pytest.mark.parametrize(("floor", "match"), [
    ("router.top_k_missing", r"cannot read 'router.top_k_missing'"),
])
def test_a_scoring_floor_that_is_no_number_is_refused_naming_it(floor, match):
    """Scoring.normalize_min is read off the block like Scoring.scale: a path the block lacks is a FamilyError naming
    the field and value, not a silent misread (a plain word or a negative number is refused at register:
    test_registration_mistakes)."""
    base = moelens.families.get("ernie4_5_moe")
    moelens.families.register(dataclasses.replace(
        base, name="floored_ernie", scoring=dataclasses.replace(base.scoring, normalize_min=floor)), replace=True)
    try:
        moe = moelens.wrap(tiny_model("ernie4_5_moe")).moes[0]
        with pytest.raises(moelens.FamilyError, match=match):
            moe.family.described_on(moe._module)
    finally:
        moelens.families.unregister("floored_ernie")


def test_a_scoring_floor_of_the_wrong_kind_is_refused_when_registered():
    """A bool is neither a number nor a reference: register names the field."""
    base = moelens.families.get("ernie4_5_moe")
    with pytest.raises(moelens.FamilyError, match=r"Scoring.normalize_min must be a number or a string or None, "
                                                   r"got True"):
        moelens.families.register(dataclasses.replace(
            base, name="floored_ernie", scoring=dataclasses.replace(base.scoring, normalize_min=True)), replace=True)


def test_every_vocabulary_the_getting_started_guide_names_imports_from_families():
    """EXPERT_GATES, named beside SHARED_TIMES and SELECTIONS as what a field may hold, was no name of
    moelens.families (an ImportError)."""
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([A-Z][A-Z_]{4,})`", guide))
    assert "EXPERT_GATES" in named
    for name in named:
        assert name in families.__all__ and isinstance(getattr(families, name), tuple), name


@pytest.mark.parametrize("where", ["expert", "router"])
def test_check_of_a_model_that_computes_nan_says_so_instead_of_blaming_the_entry(where):
    """A NaN in the experts' or the router's weights (plain transformers' output: NaN): check said moelens' own
    mixtral entry "does not describe what the model computes" (largest difference nan) and to fix its Combine or
    logits_op; it names the first block computing NaN and what holds it. The same model without the NaN passes."""
    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    assert moelens.families.check(moelens.wrap(hf), ids)
    block = hf.model.layers[1].mlp
    with torch.no_grad():
        if where == "expert":
            block.experts.down_proj[:, 0, 0] = float("nan")  # every expert's: some token runs one
        else:
            block.gate.weight[5, 0] = float("nan")
        assert hf(ids).logits.isnan().any()
    held = "routed_output, mlp_output hold NaN" if where == "expert" else \
        "router_logits, expert_weights, routed_output, mlp_output hold NaN"
    with pytest.raises(moelens.errors.FamilyError, match=rf"^check: the model computes NaN on these inputs, first at "
                                                          rf"model\.model\.layers\.1\.mlp: {held} .*the entry may well "
                                                          r"be right"):
        moelens.families.check(moelens.wrap(hf), ids)


def test_a_shared_expert_called_between_router_and_experts_is_placed_there_by_the_order_error():
    """afmoe calls its shared experts after its router, before its experts (hooks); the refusal said to read them
    after expert_indices, which afmoe serves at the experts' call, after the shared experts: that order raised again."""
    hf = tiny_model("afmoe")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if moe.has_shared_expert)
    with pytest.raises(moelens.OrderError, match=r"the block calls it between its router and its experts: read them "
                                                 r"after router_logits, before expert_weights"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moe.mlp_output.save()
            moe.shared_experts.mlp_activation.save()
    with torch.no_grad(), wrapped.trace(**inputs):  # the order it names reads
        moe.router_logits.save()
        shared = moe.shared_experts.mlp_output.save()
        moe.expert_weights.save()
    with torch.no_grad(), wrapped.trace(**inputs):
        alone = moe.shared_experts.mlp_output.save()
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("family", ["gemma4", "diffusion_gemma"])
def test_check_passes_the_built_in_entry_of_a_router_with_a_trained_per_expert_scale(family):
    """gemma4's router multiplies each chosen weight by its expert's learned per_expert_scale, which transformers
    starts at ones (as every tiny model has it): check refused moelens' own entry on any trained checkpoint ("the
    weights its experts got are not what the scoring gives", 0.35 apart). Ground truth: the weights a pre-hook on an
    unwrapped copy's experts sees are the renormalised softmax top-k times the scale of each chosen expert."""
    hf = tiny_model(family)
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if name.endswith("router.per_expert_scale"):
                parameter.copy_(torch.rand(parameter.shape, generator=torch.Generator().manual_seed(1)) * 1.5 + 0.25)
    inputs, seen = tiny_inputs(hf), {}
    reference = copy.deepcopy(hf)
    layer = next(module for module in reference.modules() if hasattr(module, "router") and hasattr(module, "experts"))
    layer.experts.register_forward_pre_hook(lambda module, args: seen.update(indices=args[1], weights=args[2]))
    layer.router.proj.register_forward_hook(lambda module, args, output: seen.update(logits=output))
    with torch.no_grad():
        reference(**inputs)
    top = seen["logits"].float().softmax(-1).gather(-1, seen["indices"])
    renormalised = top / top.sum(-1, keepdim=True)
    assert not torch.allclose(seen["weights"], renormalised, atol=1e-3), "a scale of ones would hide the multiplier"
    torch.testing.assert_close(seen["weights"], renormalised * layer.router.per_expert_scale[seen["indices"]])
    assert families.check(moelens.wrap(hf), **inputs)


def test_a_per_expert_scale_is_described_and_refused_where_it_is_no_tensor_of_experts():
    """Scoring.describe names the multiplier per expert; a reference giving something else than a float tensor [E]
    raised a bare AttributeError ('int' object has no attribute 'detach') inside families.check."""
    family = families.get("gemma4")
    assert "x router.per_expert_scale[expert]" in family.scoring.describe()
    layer = tiny_model("gemma4").model.layers[0]
    assert torch.equal(family.expert_scale_of(layer), layer.router.per_expert_scale)
    wrong = dataclasses.replace(family, scoring=dataclasses.replace(family.scoring,
                                                                    expert_scale="router.config.top_k_experts"))
    with pytest.raises(moelens.FamilyError, match=r"Scoring\.expert_scale='router\.config\.top_k_experts' gives a int "
                                                  r"on Gemma4TextDecoderLayer, not a floating-point tensor \[E\]"):
        wrong.expert_scale_of(layer)
