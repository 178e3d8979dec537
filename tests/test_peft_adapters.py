"""PEFT LoRA on a MoE block's router and experts parameters (a ``ParamWrapper`` where the module was: from
``LoraConfig(target_parameters=...)``, or from peft 0.22 a ``target_modules`` naming the transformers-4 projections).

moelens serves the block beneath the adapters. Ground truth: the PEFT model's own forward (pass-through), the same
model with its adapters merged into the weights by peft (``merge_and_unload``, a plain transformers model), the base
model without adapters (``disable_adapter``), hooks on the family's router and experts modules, and the router's
logits recomputed by hand from its base weight plus the adapters' product.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import moelens
from moelens import FamilyError, MoelensError, ValueUnavailable, families
from moelens.modules import is_adapter_layer
from moelens.testing import EXPERTS_IMPLEMENTATIONS, FAMILIES, tiny_inputs, tiny_model
from test_tiny_models import _one_thread  # noqa: F401  (tiny models run fastest on one thread)

peft = pytest.importorskip("peft")

#: dbrx's experts read their own ``mlp.v1`` attribute, which PEFT's wrapper around ``mlp`` does not have: the model
#: itself fails under the adapters.
CASES = [(family, EXPERTS_IMPLEMENTATIONS[family][-1]) for family in FAMILIES if family != "dbrx"]
CASES += [(family, impl) for family in ("mixtral", "qwen3_moe") for impl in EXPERTS_IMPLEMENTATIONS[family][:-1]]

MERGE = r"Merge the adapters into the weights and wrap the result, moelens\.wrap\(peft_model\.merge_and_unload\(\)\)"


def _targets(hf: torch.nn.Module, parts: tuple[str, ...] = ("router", "experts")) -> list[str]:
    """Every MoE block's router weight (2-D parameters) and experts' stacked weights (3-D), as target_parameters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(hf)
    found = []
    for moe in wrapped.moes:
        block = moe.path.removeprefix("model.")
        for part in parts:
            path = getattr(moe.family, part)
            module = hf.get_submodule(f"{block}.{path}")
            found += [f"{block}.{path}.{name}" for name, parameter in module.named_parameters(recurse=False)
                      if parameter.dim() == (3 if part == "experts" else 2)]
    return found


def adapted(family: str, impl: str | None = None, parts: tuple[str, ...] = ("router", "experts"), **config):
    """(a PEFT model with random LoRA factors on ``parts`` of every MoE block, a copy of the model before them)."""
    hf = tiny_model(family, experts_implementation=impl)
    base = copy.deepcopy(hf)
    config = config or {"target_parameters": _targets(hf, parts)}
    torch.manual_seed(0)
    return peft.get_peft_model(hf, peft.LoraConfig(r=2, init_lora_weights=False, **config)), base


def served(model, inputs: dict) -> tuple[list[dict], torch.Tensor]:
    """Every value of every MoE block that runs on ``inputs``, and the model's first output."""
    values = []
    with torch.no_grad(), model.trace(**inputs):
        for moe in model.moes:
            if not moe.runs_only_on:
                values.append(moe.save_all())
        output = model.output[0].save()
    return values, output


def assert_same_values(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected) > 0
    for block, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.keys() == theirs.keys()
        for name, value in mine.items():
            if value is None or not value.dtype.is_floating_point:
                assert (value is None and theirs[name] is None) or torch.equal(value, theirs[name]), (block, name)
            else:
                torch.testing.assert_close(value, theirs[name], atol=1e-5, rtol=1e-4, equal_nan=True,
                                           msg=lambda m: f"block {block}, {name}: {m}")


@pytest.mark.parametrize("family,impl", CASES, ids=[f"{family}-{impl}" for family, impl in CASES])
def test_every_family_serves_the_adapted_model_beneath_the_adapters(family, impl):
    tuned, base = adapted(family, impl)
    inputs = tiny_inputs(tuned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the adapter layers are no unknown MoE blocks
        wrapped = moelens.wrap(tuned)
    assert wrapped.moes, "the adapted blocks are served"
    for moe in wrapped.moes:
        assert not is_adapter_layer(moe.router._module) and not is_adapter_layer(moe.experts._module)
    with torch.no_grad():
        plain = tuned(**inputs)[0]
        with tuned.disable_adapter():
            unadapted = tuned(**inputs)[0]
    assert not torch.allclose(plain, unadapted), "the adapters change the model"
    values, output = served(wrapped, inputs)
    torch.testing.assert_close(output, plain, rtol=0, atol=0)  # pass-through is bit-identical
    merged = moelens.wrap(copy.deepcopy(tuned).merge_and_unload())
    assert_same_values(values, served(merged, inputs)[0])
    with tuned.disable_adapter():  # the adapters off: the base model's values
        values, output = served(wrapped, inputs)
    torch.testing.assert_close(output, unadapted, rtol=0, atol=0)
    assert_same_values(values, served(moelens.wrap(base), inputs)[0])


@functools.lru_cache(maxsize=None)
def _qwen3():
    tuned, _ = adapted("qwen3_moe", "grouped_mm")
    return tuned, moelens.wrap(tuned), moelens.wrap(copy.deepcopy(tuned).merge_and_unload())


def test_router_logits_are_the_base_weight_plus_the_adapters_product_by_hand():
    tuned, wrapped, _ = _qwen3()
    moe = wrapped.moes[0]
    wrapper = tuned.get_submodule(moe.path.removeprefix("model.") + "." + moe.family.router)
    assert wrapper.parameter_name == "weight" and wrapper.base_layer is moe.router._module
    seen = []
    hook = wrapper.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad(), wrapped.trace(**tiny_inputs(tuned)):
            logits = moe.router_logits.save()
    finally:
        hook.remove()
    adapter = wrapper.active_adapters[0]
    delta = wrapper.lora_B[adapter].weight @ wrapper.lora_A[adapter].weight * wrapper.scaling[adapter]
    by_hand = F.linear(seen[0], moe.router._module.weight + delta)
    torch.testing.assert_close(logits.reshape(by_hand.shape), by_hand, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(by_hand, F.linear(seen[0], moe.router._module.weight), atol=1e-3)


def test_an_experts_call_of_the_module_the_block_calls_runs_the_adapted_weights():
    """The counterfactual-output recipe of docs/values.md: moe.experts is the module beneath the adapters (base
    weights); the block calls the adapter layer above it."""
    tuned, wrapped, merged = _qwen3()
    outputs = []
    for model in (wrapped, merged):
        moe = model.moes[0]
        with torch.no_grad(), model.trace(**tiny_inputs(tuned)):
            hidden = moe.experts.inputs[0][0].save()
        tokens = hidden.shape[:-1].numel()
        slots = (hidden, torch.full((tokens, 1), 7), torch.ones(tokens, 1, dtype=hidden.dtype))
        with torch.no_grad():
            outputs.append((moe._module.get_submodule(moe.family.experts)(*slots), moe.experts._module(*slots)))
    (adapted_call, base_call), (merged_call, _) = outputs
    torch.testing.assert_close(adapted_call, merged_call, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(base_call, merged_call, atol=1e-3)


def test_routing_analysis_with_the_adapters_off_and_on_is_the_base_and_the_merged_models():
    """docs/analysis.md's recipe: how a LoRA fine-tune moved the routing."""
    from moelens import analysis

    tuned, base = adapted("qwen3_moe", "grouped_mm")
    texts = [torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    model = moelens.wrap(tuned)
    with tuned.disable_adapter():
        before = analysis.collect_routing(model, texts, progress=False)
    after = analysis.collect_routing(model, texts, progress=False)
    merged = moelens.wrap(copy.deepcopy(tuned).merge_and_unload())
    for cache, truth in ((before, moelens.wrap(base)), (after, merged)):
        expected = analysis.collect_routing(truth, texts, progress=False)
        for layer in cache.layers:
            assert torch.equal(cache.indices(layer), expected.indices(layer))
            torch.testing.assert_close(cache.weights(layer), expected.weights(layer), atol=1e-5, rtol=1e-4)
    agreement = analysis.routing_agreement(before, after)
    assert (agreement.same_set < 1).any()  # the adapters moved some tokens


def test_scan_refuses_active_parameter_adapters_with_the_way_out():
    """torch's fake tensors, which scan runs on, cannot take the parametrization PEFT puts on in each forward (torch
    raised its own AssertionError)."""
    from groundtruth import ascii_tokenizer

    tuned, _ = adapted("qwen3_moe", "batched_mm", parts=("router",))  # grouped_mm has no fake kernel on the CPU
    wrapped = moelens.wrap(tuned, tokenizer=ascii_tokenizer())
    with pytest.raises(MoelensError, match=r"model\.scan: .*\.mlp\.gate is a PEFT parameter adapter .* Run a real "
                                           r"trace on a short input instead, or scan the model with the adapters "
                                           r"merged: moelens\.wrap\(copy\.deepcopy\(peft_model\)\.merge_and_unload"):
        with wrapped.scan(**tiny_inputs(tuned)):
            pass
    with tuned.disable_adapter():  # the base model's forward: nothing to refuse
        with wrapped.scan(**tiny_inputs(tuned)):
            pass
    with torch.no_grad():
        expected = tuned(**tiny_inputs(tuned)).logits
    tuned.merge_adapter()
    with wrapped.scan(**tiny_inputs(tuned)):  # merged: the forward runs the weights as they are
        pass
    with tuned.disable_adapter(), pytest.raises(MoelensError, match=(  # the forward would unmerge them under fakes
            r"^model\.scan: PEFT merged adapters into .*\.mlp\.gate's weight \(merge_adapter\(\)\), which are off now .* "
            r"unmerge the adapters first \(peft_model\.unmerge_adapter\(\)\)\.$")):
        with wrapped.scan(**tiny_inputs(tuned)):
            pass
    with torch.no_grad():  # the weights are left as they were (a scan got through: one was on the meta device)
        torch.testing.assert_close(tuned(**tiny_inputs(tuned)).logits, expected)


def test_scan_refuses_merged_lora_linear_layers_that_are_off():
    """A LoRA Linear (attention's q_proj) merged, then off, takes the adapters out of its weight in its next forward
    as a parameter adapter does: under scan's fake tensors that left the weight on the meta device."""
    from groundtruth import ascii_tokenizer

    hf = tiny_model("qwen3_moe", experts_implementation="batched_mm")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj"]))
    wrapped = moelens.wrap(tuned, tokenizer=ascii_tokenizer())
    with torch.no_grad():
        expected = tuned(**tiny_inputs(tuned)).logits
    tuned.merge_adapter()
    with tuned.disable_adapter(), pytest.raises(MoelensError, match=(
            r"^model\.scan: PEFT merged adapters into .*\.self_attn\.q_proj \(merge_adapter\(\)\), which are off now")):
        with wrapped.scan(**tiny_inputs(tuned)):
            pass
    tuned.unmerge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(tuned(**tiny_inputs(tuned)).logits, expected)


def test_the_expert_logit_lens_maps_latent_experts_through_the_adapted_projection():
    """nemotron_h's experts work in a latent space that fc2_latent_proj maps to the hidden size; "all-linear" LoRA puts
    an adapter there, whose .weight is the base weight alone. Ground truth: the merged model's lens, and the base
    model's under disable_adapter()."""
    from moelens import analysis

    hf = tiny_model("nemotron_h", experts_implementation="grouped_mm", moe_latent_size=16)
    base = moelens.wrap(copy.deepcopy(hf))
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, init_lora_weights=False, target_modules="all-linear"))
    assert any(name.endswith("fc2_latent_proj") and is_adapter_layer(module) for name, module in tuned.named_modules())
    corpus = [torch.randint(3, 100, (16,), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    wrapped = moelens.wrap(tuned)
    lens = analysis.expert_logit_lens(wrapped, corpus, progress=False)
    merged = analysis.expert_logit_lens(moelens.wrap(copy.deepcopy(tuned).merge_and_unload()), corpus, progress=False)
    with tuned.disable_adapter():
        unadapted = analysis.expert_logit_lens(wrapped, corpus, progress=False)

    def relative_error(got, expected):  # the tiny model's mean outputs are of the order 1e-4
        return float((got - expected).nan_to_num().abs().max() / expected.nan_to_num().abs().max())

    assert relative_error(lens.mean_outputs, merged.mean_outputs) < 1e-4
    assert relative_error(unadapted.mean_outputs,
                          analysis.expert_logit_lens(base, corpus, progress=False).mean_outputs) < 1e-4
    assert relative_error(lens.mean_outputs, unadapted.mean_outputs) > 0.1  # the adapter moves them


def test_describe_names_the_adapted_blocks():
    """moelens inspect's report: LoRA on one layer's experts only."""
    from moelens import analysis

    hf = tiny_model("qwen3_moe")
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_parameters=["model.layers.1.mlp.experts.down_proj"]))
    report = analysis.describe(moelens.wrap(tuned))
    assert [layer.adapters for layer in report.moe_layers] == [["experts 'experts' (LoRA on down_proj)"], [], []]
    assert ("PEFT adapters          layer 1: experts 'experts' (LoRA on down_proj); layers 2, 3: none (trace values "
            "are the adapted model's") in str(report)
    assert "PEFT adapters" not in str(analysis.describe(moelens.wrap(tiny_model("qwen3_moe"))))


def test_writes_land_in_the_adapted_model_as_in_the_merged_one():
    """A steer bias puts its expert in every token's top-k; set_top_k runs the adapted router at its k."""
    tuned, wrapped, merged = _qwen3()
    inputs = tiny_inputs(tuned)
    outputs = []
    for model in (wrapped, merged):
        with torch.no_grad(), model.trace(**inputs):
            moelens.steer(model.moes[0], 3, 50.0)
            indices = model.moes[0].expert_indices.save()
            outputs.append(model.output[0].save())
        assert (indices == 3).any(-1).all()
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-4)
    k = wrapped.moes[0].top_k
    with moelens.set_top_k(wrapped, k + 1), moelens.set_top_k(merged, k + 1):
        values = [served(model, inputs)[0] for model in (wrapped, merged)]
    assert values[0][0]["expert_indices"].shape[-1] == k + 1
    assert_same_values(*values)
    assert wrapped.moes[0].top_k == k


def test_lora_from_transformers_4_target_modules_is_served():
    """peft 0.22 turns target_modules naming transformers 4's expert projections and router into parameter
    adapters on transformers 5's fused experts and router (mixtral and qwen2_moe lineages)."""
    if tuple(int(part) for part in peft.__version__.split(".")[:2]) < (0, 22):
        pytest.skip("peft before 0.22 does not convert these target_modules")
    for family, names in (("mixtral", ["w1", "w2", "w3", "gate"]), ("qwen3_moe", "all-linear")):
        tuned, _ = adapted(family, "grouped_mm", target_modules=names)
        wrapped = moelens.wrap(tuned)
        values, output = served(wrapped, tiny_inputs(tuned))
        assert "experts 'experts' (LoRA on down_proj, gate_up_proj)" in str(
            pytest.raises(ValueUnavailable, wrapped.moes[0].params).value)
        with torch.no_grad():
            torch.testing.assert_close(output, tuned(**tiny_inputs(tuned))[0], rtol=0, atol=0)
        merged = moelens.wrap(copy.deepcopy(tuned).merge_and_unload())
        assert_same_values(values, served(merged, tiny_inputs(tuned))[0])


def test_what_reads_the_adapted_weights_themselves_says_to_merge(tmp_path):
    """params() and the export would read the base weights without the adapters' product; check checks the
    layout on the family's own module (its base weights and its own forward on them)."""
    pytest.importorskip("torch_to_nnef", reason="the export extra is not installed")
    tuned, wrapped, _ = _qwen3()
    moe = wrapped.moes[0]
    with pytest.raises(ValueUnavailable, match=rf"{moe.path}\.params: PEFT adapters stand for the block's experts "
                                               rf"'experts' \(LoRA on down_proj, gate_up_proj\), adding .* {MERGE}"):
        moe.params()
    refused = (r"block's router 'gate' \(LoRA on weight\) and experts 'experts' .* the archive would hold the base "
               r"weights alone\. Merge the adapters into the weights and export the result \(peft_model\."
               r"merge_and_unload\(\), wrapped or not, or peft_model\.merge_adapter\(\) in place\), or export under "
               r"peft_model\.disable_adapter\(\) for the base model\.$")
    with pytest.raises(moelens.export.ExportRefused, match=refused):
        moelens.export.to_nnef(wrapped, tmp_path / "adapted.nnef.tgz", verify=False)
    assert families.check(wrapped, **tiny_inputs(tuned))  # the layout is checked on the family's own module
    assert not list(tmp_path.iterdir())


def _block_of(model: torch.nn.Module, moe) -> torch.nn.Module:
    """``moe``'s block in ``model``, a plain transformers copy of the PEFT model ``moe``'s path runs through."""
    return model.get_submodule(moe.path.removeprefix("model.base_model.model."))


def test_params_serve_the_weights_that_run_with_the_adapters_merged_in_place_or_off():
    """Merged by peft (merge_adapter) the weights are peft's merged ones, those merge_and_unload gives; off
    (disable_adapter) the base model's; merged but off, the next forward unmerges them: refused."""
    tuned, base = adapted("qwen3_moe", "grouped_mm")
    moe = moelens.wrap(tuned).moes[0]
    merged = _block_of(copy.deepcopy(tuned).merge_and_unload(), moe)
    with tuned.disable_adapter():
        params = moe.params()
        for got, expected in ((params.router, _block_of(base, moe).gate.weight),
                              (params.down, _block_of(base, moe).experts.down_proj)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    tuned.merge_adapter()
    params = moe.params()
    gate, up = merged.experts.gate_up_proj.chunk(2, dim=1)  # qwen3_moe's [E, 2H, D]: gate rows, then up rows
    for got, expected in ((params.router, merged.gate.weight), (params.down, merged.experts.down_proj),
                          (params.gate, gate), (params.up, up)):
        torch.testing.assert_close(got, expected)
    with torch.no_grad():
        params.down[3] = 0  # a view: the edit lands in the weights that run
    assert torch.equal(_block_of(tuned.base_model.model, moe).experts.base_layer.base_layer.down_proj[3],
                       torch.zeros_like(params.down[3]))
    with tuned.disable_adapter(), pytest.raises(ValueUnavailable, match=(
            rf"{moe.path}\.params: PEFT merged adapters into the block's experts 'experts' \(LoRA on down_proj, "
            r"gate_up_proj\) \(merge_adapter\(\)\), which are off now \(disable_adapter\(\)\), and the block's next "
            r"forward takes them out .* Leave disable_adapter\(\) first, or unmerge the adapters "
            r"\(peft_model\.unmerge_adapter\(\)\)\.$")):
        moe.params()


def test_the_export_archives_the_weights_that_run_with_the_adapters_merged_in_place_or_off(tmp_path):
    """tract's output on each archive is the merge_and_unload copy's logits (merged in place) and the base model's
    (adapters off)."""
    pytest.importorskip("torch_to_nnef", reason="the export extra is not installed")
    tuned, base = adapted("qwen3_moe", "grouped_mm")
    wrapped = moelens.wrap(tuned)
    merged = copy.deepcopy(tuned).merge_and_unload()
    ids = tiny_inputs(tuned)["input_ids"][:1]
    tuned.merge_adapter()
    moelens.export.to_nnef(wrapped, tmp_path / "merged.nnef.tgz", example_inputs=ids, verify=False)
    tuned.unmerge_adapter()
    with tuned.disable_adapter():
        moelens.export.to_nnef(wrapped, tmp_path / "base.nnef.tgz", example_inputs=ids, verify=False)
    with torch.no_grad():
        for name, reference in (("merged", merged), ("base", base)):
            got = torch.from_numpy(moelens.export.run(tmp_path / f"{name}.nnef.tgz", ids))
            torch.testing.assert_close(got, reference(ids).logits, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_an_adapted_router_alone_leaves_the_experts_weights_served():
    """params() serves the experts (what runs) and warns that the router is None; check checks the whole entry."""
    tuned, base = adapted("qwen3_moe", "grouped_mm", parts=("router",))
    wrapped = moelens.wrap(tuned)
    moe = wrapped.moes[0]
    with pytest.warns(UserWarning, match=r"router and router_bias are None: qwen3_moe: PEFT adapters stand for the "
                                         rf"block's router 'gate' \(LoRA on weight\), adding .* {MERGE}"):
        params = moe.params()
    assert params.router is None
    experts = base.get_submodule(moe.path.removeprefix("model.base_model.model.") + ".experts")
    torch.testing.assert_close(params.down, experts.down_proj, rtol=0, atol=0)
    assert families.check(wrapped, **tiny_inputs(tuned))


def test_a_lora_linear_standing_for_a_router_is_still_refused_with_what_to_do():
    """llama4's router is an nn.Linear: target_modules=["router"] puts LoRA's Linear there, which adds its part
    after the router's own forward."""
    tuned = peft.get_peft_model(tiny_model("llama4"), peft.LoraConfig(r=2, target_modules=["router"]))
    with pytest.raises(FamilyError, match=r"feed_forward\.router, the router of this llama4 block, is wrapped by a "
                                          r"PEFT adapter layer \(Linear\).*merge_and_unload\(\).*target_parameters"):
        moelens.wrap(tuned)


def test_adapters_put_on_after_wrapping_say_to_wrap_again_which_serves_them():
    hf = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    wrapped = moelens.wrap(hf)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, init_lora_weights=False, target_parameters=_targets(hf)))
    with pytest.raises(MoelensError, match=r"PEFT put adapters on the parameters of .*experts, .*gate after moelens\.wrap .* "
                                           r"Wrap the model again, moelens\.wrap\(model\._module\), to serve the "
                                           r"block's adapted values"):
        wrapped.moes[0].params()
    again = moelens.wrap(tuned)
    values, output = served(again, tiny_inputs(hf))
    with torch.no_grad():
        torch.testing.assert_close(output, tuned(**tiny_inputs(hf))[0], rtol=0, atol=0)
    assert_same_values(values, served(moelens.wrap(copy.deepcopy(tuned).merge_and_unload()), tiny_inputs(hf))[0])


def test_a_hook_at_the_adapted_routers_path_is_told_where_moelens_derives_the_routing():
    """llama4 calls no experts module: moelens derives the weights and indices from the logits, and refuses them
    where a forward hook on the router may change the scores the block goes on with, the wrapper's too."""
    hf = tiny_model("llama4")
    path = "model.layers.1.feed_forward.router"
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, init_lora_weights=False, target_parameters=[f"{path}.weight"]))
    wrapped = moelens.wrap(tuned)
    handle = tuned.base_model.model.get_submodule(path).register_forward_hook(lambda module, args, output: output)
    try:
        with pytest.raises(ValueUnavailable, match="the router has a forward hook that is not moelens'"):
            with torch.no_grad(), wrapped.trace(**tiny_inputs(tuned)):
                wrapped.moes[0].expert_weights.save()
    finally:
        handle.remove()
