"""moelens.wrap serves every value of a converted model, and each matches a recomputation by hand.

Ground truth: the block's input captured with a plain torch hook (no nnsight), and the
routing and every expert recomputed from the module's weights.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import moelens
from moelens.compress import set_experts_implementation, tomoe
from moelens.families.entry import VALUE_NAMES
from test_compress_helpers import activation_by_hand, bert, gpt2, ids, llama, pre_activation_by_hand

CASES = {
    "llama": (llama, {}, "tomoe"),
    "bert": (bert, {}, "tomoe_intermediate"),
    "gpt2-conv1d": (gpt2, {"target_modules": ["c_proj"]}, "tomoe_linear"),
}


def wrapped(case: str, implementation: str = "grouped_mm"):
    build, settings, family = CASES[case]
    converted = tomoe(build(), num_experts=4, top_k=2, calibration=ids(), shared_neurons=0, max_error=None,
                      progress=False, **settings)
    set_experts_implementation(converted, implementation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nnsight's note on BERT's `output` submodules
        return converted, moelens.wrap(converted), family


def expected_values(block, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every served value of ``block`` on input ``x`` [b, s, D], recomputed from its weights."""
    shape = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    router, experts = block.router, block.experts
    logits = flat @ router.weight.T + router.bias
    weights, indices = torch.topk(logits, router.top_k, dim=-1)
    padded = F.pad(flat, (0, block.input_pad))
    pre_activations, activations, outputs = [], [], []
    for token in range(flat.shape[0]):
        token_pres, token_acts, token_outs = [], [], []
        for expert in indices[token].tolist():
            h = activation_by_hand(experts, expert, padded[token])
            token_pres.append(pre_activation_by_hand(experts, expert, padded[token]))
            token_acts.append(h)
            token_outs.append(experts.down_proj[expert] @ h + experts.down_proj_bias[expert])
        pre_activations.append(torch.stack(token_pres))
        activations.append(torch.stack(token_acts))
        outputs.append(torch.stack(token_outs))
    expert_outputs = torch.stack(outputs)
    routed = expert_outputs.sum(1)
    shared = block.shared_experts.bias.expand(flat.shape[0], -1)
    return {
        "router_logits": logits.view(*shape, -1),
        "router_probs": torch.sigmoid(logits).view(*shape, -1),
        "expert_weights": torch.ones_like(weights).view(*shape, -1),
        "expert_indices": indices.view(*shape, -1),
        "expert_pre_activations": torch.stack(pre_activations).view(*shape, router.top_k, -1),
        "expert_activations": torch.stack(activations).view(*shape, router.top_k, -1),
        "expert_outputs": expert_outputs.view(*shape, router.top_k, -1),
        "routed_output": routed.view(*shape, -1),
        "shared_expert_output": shared.reshape(*shape, -1),
        "mlp_output": (routed[:, : block.output_size] + shared).view(*shape, -1),
    }


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_wrap_serves_every_value_as_recomputed(case, implementation):
    converted, model, family = wrapped(case, implementation)
    assert model.family.name == family and len(model.moes) == (4 if case == "gpt2-conv1d" else 2)
    moe = model.moes[-1]
    block = moe._module
    assert (moe.num_experts, moe.top_k) == (4, 2) and moe.experts_implementation == implementation
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    tokens = ids(2, 6, seed=3)
    with model.trace(tokens):
        values = moe.save_all()
    handle.remove()
    assert list(values) == list(moe.order()) == [v for v in VALUE_NAMES]
    with torch.no_grad():
        expected = expected_values(block, seen["x"])
    for name, value in values.items():
        torch.testing.assert_close(value.float(), expected[name].float(), atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(values["mlp_output"], seen["y"])


def test_standard_names_on_a_converted_bert():
    _, model, _ = wrapped("bert")
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["Moe", "Moe"]
    assert model.layers[0].mlp.path.endswith("encoder.layer.0.intermediate")


def test_attention_only_conversion_leaves_dense_mlps_as_mlp_components():
    converted = tomoe(llama(kv_heads=4), num_experts=4, top_k=2, calibration=ids(), target_attention_only=True,
                      max_error=None, progress=False)
    model = moelens.wrap(converted)
    assert len(model.moes) == 8 and model.family.name == "tomoe_linear"
    assert type(model.layers[0].mlp).__name__ == "Mlp"


def test_interventions_on_a_converted_block():
    """ablate(zero) removes exactly the ablated expert's slots from the routed sum."""
    converted, model, _ = wrapped("llama")
    tokens = ids(1, 6, seed=4)
    with model.trace(tokens):
        moe = model.moes[0]
        indices = moe.expert_indices.save()
        outputs = moe.expert_outputs.save()
        routed = moe.routed_output.save()
    with model.trace(tokens):
        moe = model.moes[0]
        moelens.ablate(moe, 1)
        ablated = moe.routed_output.save()
    kept = (indices != 1).unsqueeze(-1).float()
    torch.testing.assert_close(ablated, (outputs * kept).sum(2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ablated, routed)
    with model.trace(tokens):
        moelens.force(model.moes[0], [3])
        forced = model.moes[0].expert_indices.save()
        forced_weights = model.moes[0].expert_weights.save()
    assert (forced[..., 0] == 3).all() and torch.equal(forced_weights, torch.ones_like(forced_weights))


def test_a_block_under_a_module_named_like_an_nnsight_attribute_is_served():
    """BERT's attention output projection is ``attention.output.dense``, and nnsight serves ``.output`` as a
    module's output: converting every linear layer must still wrap, and that block serve its values."""
    converted = tomoe(bert(), num_experts=4, top_k=2, calibration=ids(), target_modules=r".*", shared_neurons=0,
                      max_error=None, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nnsight's note on BERT's `output` submodules
        model = moelens.wrap(converted)
    moe = next(moe for moe in model.moes if moe._module is converted.encoder.layer[1].attention.output.dense)
    block = moe._module
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    with model.trace(ids(2, 6, seed=3)):
        values = moe.save_all()
    handle.remove()
    with torch.no_grad():
        expected = expected_values(block, seen["x"])
    for name, value in values.items():
        torch.testing.assert_close(value.float(), expected[name].float(), atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(values["mlp_output"], seen["y"])


def test_the_wrapped_models_switch_runs_every_converted_block_with_the_implementation():
    """model.set_experts_implementation on a wrapped conversion went to the dense model's class, which
    switched nothing, without a word."""
    converted, model, _ = wrapped("llama", "grouped_mm")
    with model.trace(ids()):
        before = model.moes[0].expert_outputs.save()
    for implementation in ("batched_mm", "eager"):
        model.set_experts_implementation(implementation)
        assert {moe.experts_implementation for moe in model.moes} == {implementation}
    # transformers' dict form, "" for the model's own config: the converted experts hold settings of their own
    # (no config of the model), and were left on their implementation while the model's config said the new one
    model.set_experts_implementation({"": "batched_mm"})
    assert {moe.experts_implementation for moe in model.moes} == {"batched_mm"}
    model.set_experts_implementation("eager")
    with model.trace(ids()):
        routed = model.moes[0].routed_output.save()
    torch.testing.assert_close(routed, before.sum(2))


def test_an_expert_routed_around_that_still_fills_a_slot_weighs_zero_with_autograd_on():
    """With every expert active (top_k = num_experts), route_around(e) leaves e in a slot at logit -inf; the
    router's straight-through term (-inf) - (-inf) made its weight NaN under autograd (on by default in a trace), and
    with it the whole model's output. Ground truth: the unwrapped copy, e's router bias at -inf, under no_grad."""
    converted = tomoe(llama(), num_experts=4, top_k=4, calibration=ids(), shared_neurons=0, max_error=None,
                      progress=False)
    reference = copy.deepcopy(converted)
    with torch.no_grad():
        reference.model.layers[0].mlp.router.bias[1] = float("-inf")
        expected = reference(ids()[:1]).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = moelens.wrap(converted)
    with model.trace(ids()[:1]):
        moelens.ablate(model.moes[0], 1, "route_around")
        weights = model.moes[0].expert_weights.save()
        logits = model.output.logits.save()
    assert torch.is_grad_enabled() and not weights.isnan().any()
    assert set(weights[..., -1].unique().tolist()) == {0.0}  # e fills the last slot, at weight 0
    torch.testing.assert_close(logits, expected)


def test_check_leaves_out_the_output_of_a_block_dropping_out_in_training():
    """A converted GPT-2 block keeps its dense dropout; in training mode check blamed moelens' own entry (its Combine)
    for the dropped outputs."""
    converted = tomoe(gpt2(), num_experts=4, top_k=2, calibration=ids(), shared_neurons=0, max_error=None,
                      progress=False).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = moelens.wrap(converted)
    with pytest.warns(UserWarning, match=r"its block output is not checked: the block is in training mode with "
                                         r"dropout on, .*call model\.eval\(\) first"):
        assert moelens.families.check(model, ids()[:1]) == [moe.path for moe in model.moes]
