"""Converted models export to NNEF (moelens.export.to_nnef) and run in tract as in torch.

Ground truth: the converted model's torch forward and the real tract runtime. The
constructions that make tract express the blocks exactly are checked too: the
sigmoid gate gives each selected expert a weight of exactly 1.0 in tract, and
`exportable`'s gated form computes what the plain / identity experts it replaces compute.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

import moelens  # noqa: E402
from moelens.compress import ToMoEGatedExperts, exportable  # noqa: E402
from moelens.export import ExportRefused, run, to_nnef  # noqa: E402
from test_compress_helpers import bert, gpt2, ids, llama  # noqa: E402
from test_compress_helpers import convert as convert_with_stats  # noqa: E402

ATOL, RTOL = 1e-4, 5e-4  # tract's "approximate" level in float32


def convert(model, **settings):
    """The model converted on the default calibration tokens (stats dropped)."""
    return convert_with_stats(model, calibration=ids(), **settings)[0]


def wrap(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moelens.wrap(model)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("tomoe-nnef")


@torch.no_grad()
def logits(model, tokens):
    return model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.numpy()


def test_swiglu_model_with_shared_neurons_exports(out):
    converted = convert(llama(kv_heads=4), num_experts=4, top_k=2, shared_neurons=8)
    tokens = ids(1, 8, seed=5)
    report = to_nnef(wrap(converted), out / "swiglu.nnef.tgz", example_inputs=tokens)
    assert [(b.gate, b.activation, b.k, b.num_experts) for b in report.blocks] == [("sigmoid", "swiglu", 2, 4)] * 2
    np.testing.assert_allclose(run(report.path, tokens), logits(converted, tokens), atol=ATOL, rtol=RTOL)


def test_selected_experts_weigh_exactly_one_in_tract(out):
    """Every expert outputs 2**24 (its down bias) and nothing else: tract must give exactly k * 2**24.

    One ulp below 1.0 (1 - 2**-24) on either weight would give 2**24 - 1 for that slot.
    """
    converted = convert(llama(kv_heads=4), num_experts=4, top_k=2)
    block = converted.model.layers[0].mlp
    with torch.no_grad():
        block.experts.down_proj.zero_()
        block.experts.down_proj_bias.fill_(2.0 ** 24)
        block.shared_experts.bias.zero_()
    hidden = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
    report = to_nnef(wrap(converted).moes[0], out / "unit.nnef.tgz", example_inputs=hidden)
    assert report.blocks[0].gate == "sigmoid"
    result = run(report.path, hidden)
    assert np.array_equal(result, np.full_like(result, 2.0 * 2.0 ** 24))


def test_exportable_form_computes_the_same():
    tokens = ids(2, 8, seed=6)
    for model, settings in ((gpt2(), {}), (gpt2(), {"target_modules": ["c_proj", "c_fc"]}),
                            (llama(kv_heads=4), {"target_attention_only": True}), (bert(), {})):
        converted = convert(model, num_experts=4, top_k=2, **settings)
        gated = exportable(converted)
        assert all(type(m) is ToMoEGatedExperts for n, m in gated.named_modules() if n.endswith(".experts"))
        with torch.no_grad():
            out_converted = converted(input_ids=tokens)[0]
            out_gated = gated(input_ids=tokens)[0]
        # the same numbers up to the float32 rounding of the wider gate_up matmul (1 ulp here)
        torch.testing.assert_close(out_gated, out_converted, atol=1e-6, rtol=1e-6)


def assert_block_runs_in_tract(moe, path, hidden, activation: str) -> None:
    """``moe`` exported alone runs in tract as ``activation`` experts and matches the block in torch."""
    report = to_nnef(moe, path, example_inputs=hidden)
    assert report.blocks[0].activation == activation
    with torch.no_grad():
        expected = moe._module(hidden)
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=ATOL, rtol=RTOL)


def test_gpt2_ffn_blocks_export_in_gated_form(out):
    """GELU (tanh) experts with biases: refused as they are, exported exactly in `exportable`'s gated form."""
    converted = convert(gpt2(), num_experts=4, top_k=2)
    with pytest.raises(ExportRefused, match=r"ungated experts with biases .* moelens.compress.exportable\(model\) .*; export that"):
        to_nnef(wrap(converted).moes[0], out / "refused.nnef.tgz")
    model = wrap(exportable(converted))
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    for index, moe in enumerate(model.moes):
        assert_block_runs_in_tract(moe, out / f"gpt2-{index}.nnef.tgz", hidden, "gelu")


def test_attention_linear_layers_export_in_gated_form(out):
    """ToMoELinear (identity experts) as relu(0 x + 1) * (W x + b) experts, block by block in tract."""
    converted = convert(llama(kv_heads=4), num_experts=4, top_k=2, target_attention_only=True)
    with pytest.raises(ExportRefused, match=r"activation Identity is none of .* This block is moelens.compress' output: "
                                            r"moelens.compress.exportable\(model\) .*; export that"):
        to_nnef(wrap(converted).moes[0], out / "refused.nnef.tgz")  # said no way forward before
    model = wrap(exportable(converted))
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    for index in (0, 3):  # q_proj and o_proj of layer 0
        assert_block_runs_in_tract(model.moes[index], out / f"linear-{index}.nnef.tgz", hidden, "relu")


def test_verify_tells_apart_two_blocks_of_one_layer(out):
    """The archive recorded only its block's layer: verified against layer 0's q_proj, an archive of layer 0's v_proj
    was compared and read as a broken export (no tolerance met) instead of an ExportError naming the block."""
    from moelens.export import ExportError, verify

    model = wrap(exportable(convert(llama(kv_heads=4), num_experts=4, top_k=2, target_attention_only=True)))
    value = next(moe for moe in model.moes if moe.path.endswith("layers.0.self_attn.v_proj"))
    query = next(moe for moe in model.moes if moe.path.endswith("layers.0.self_attn.q_proj"))
    archive = to_nnef(value, out / "v_proj.nnef.tgz", verify=False).path
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    assert verify(archive, value, hidden).meets("approximate")
    with pytest.raises(ExportError, match=r"v_proj.nnef.tgz was exported from a block of path "
                                          r"model\.model\.layers\.0\.self_attn\.v_proj, but the block given has path "
                                          r"model\.model\.layers\.0\.self_attn\.q_proj"):
        verify(archive, query, hidden)


def test_verifying_an_edited_block_archive_against_the_unconverted_copy_says_which_to_pass(out):
    """The archive of a converted GPT-2 FFN block with edits is written from `exportable`'s copy; verified against the
    converted block itself, verify raised the export's refusal ending "export that", which the user had done."""
    from moelens.export import Edits, ExportError, verify

    converted = convert(gpt2(), num_experts=4, top_k=2)
    copy = wrap(exportable(converted)).moes[0]
    archive = to_nnef(copy, out / "edited.nnef.tgz", verify=False, edits=Edits(route_around={0: [1]})).path
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3))
    assert verify(archive, copy, hidden).meets("approximate")
    with pytest.raises(ExportError, match=r"edited.nnef.tgz has edits, .* experts not in gated form\. Verify against "
                                          r"the copy that was exported, .*moelens\.compress\.exportable\(model\)"):
        verify(archive, wrap(converted).moes[0], hidden)
    gated = wrap(convert(llama(kv_heads=4), num_experts=4, top_k=2)).moes[0]  # SwiGLU: exports as it is
    archive = to_nnef(gated, out / "gated.nnef.tgz", verify=False, example_inputs=hidden).path
    with pytest.raises(ExportRefused, match=r"Edits\.force\[0\] cannot be baked"):  # not "not in gated form" (review 3)
        verify(archive, gated, hidden, edits=Edits(force={0: [1]}))


def test_a_wrap_left_from_before_an_in_place_conversion_says_to_wrap_again(out):
    """``tomoe(wrapped._module, inplace=True)`` replaced the FFNs the wrap had served as dense MLPs: routing analysis
    and the export said the model has no MoE block, though it has one per layer. Wrapped again, both run (ground
    truth: the converted FFN blocks themselves, as tract runs them)."""
    from moelens import analysis
    from moelens.compress import tomoe

    dense = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no MoE block": a dense model
        stale = wrap(dense)
    tomoe(dense, inplace=True, num_experts=4, top_k=2, max_error=None, progress=False)
    replaced = r"model\.model\.layers\.0\.mlp, model\.model\.layers\.1\.mlp are no longer the module .* Wrap the " \
               r"model again: moelens\.wrap\(model\._module\)\."
    with pytest.raises(moelens.MoelensError, match=rf"routing analysis: {replaced}"):
        analysis.collect_routing(stale, [ids(1, 8)[0]], progress=False)
    with pytest.raises(moelens.MoelensError, match=rf"the export: {replaced}"):
        to_nnef(stale, out / "stale.nnef.tgz", verify=False)
    again = wrap(dense)
    assert [moe._module for moe in again.moes] == [layer.mlp for layer in dense.model.layers]
    assert analysis.collect_routing(again, [ids(1, 8)[0]], progress=False).num_tokens == 8
    hidden = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(4))
    assert_block_runs_in_tract(again.moes[0], out / "again.nnef.tgz", hidden, "swiglu")


@pytest.mark.parametrize("change", ["lora_on_q_proj", "lora_on_mlp_projections", "resized_embeddings"])
def test_modules_replaced_outside_the_routing_leave_routing_analysis_and_the_export_as_they_were(change, out):
    """The refusal of a wrap whose modules were replaced (above) took in every module: a LoRA adapter put on the
    attention projections after wrapping (PEFT replaces them) or resize_token_embeddings (a new lm_head) made routing
    analysis refuse a model whose blocks are as wrapped (review 2); so did a LoRA on the MLP projections, of the dense
    layer and the shared experts (review 3). Ground truth: the experts calls' indices taken by hooks on the same
    torch model."""
    from moelens import analysis
    from moelens.testing import tiny_model

    hf = tiny_model("qwen2_moe")
    wrapped = wrap(hf)
    if change.startswith("lora"):
        from peft import LoraConfig, inject_adapter_in_model

        # the dense layer's and the shared experts' projections only: on a transformers model, peft >= 0.22 turns
        # any target ending in "down_proj" into an adapter on the routed experts' own down_proj too (the test below),
        # so the adapters go onto the layers (a ModuleList, which peft does not convert for)
        targets = ["q_proj"] if change == "lora_on_q_proj" else ["gate_proj", "up_proj", "down_proj"]
        inject_adapter_in_model(LoraConfig(target_modules=targets, r=4, init_lora_weights=False), hf.model.layers)
        adapted = {name.rsplit(".", 3)[0] for name, _ in hf.named_parameters() if ".lora_A." in name}
        assert (adapted == {f"model.layers.{i}.self_attn.q_proj" for i in range(4)} if change == "lora_on_q_proj" else
                {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_expert.up_proj"} < adapted
                and not any("experts" in name for name in adapted))
    else:
        hf.resize_token_embeddings(hf.config.vocab_size + 8)
    tokens = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(0))
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
             for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        hf(tokens[None])
    for hook in hooks:
        hook.remove()
    cache = analysis.collect_routing(wrapped, [tokens], progress=False)
    assert len(cache.layers) == len(seen) > 0
    for layer, indices in zip(cache.layers, seen):
        torch.testing.assert_close(cache.indices(layer).long(), indices.reshape(-1, indices.shape[-1]))
    hidden = torch.randn(1, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(5))
    assert to_nnef(wrapped.moes[-1], out / f"{change}.nnef.tgz", example_inputs=hidden).verification.meets("approximate")


def test_lora_put_on_the_experts_after_wrapping_says_to_wrap_again_and_what_reads_weights_to_merge(out):
    """A LoRA adapter on the routed experts' own parameters, put on after wrapping (peft >= 0.22 does that for
    target_modules=["gate_proj", "up_proj", "down_proj"] on transformers 5's fused experts), replaces the experts
    module by a PEFT ParamWrapper: routing analysis, the export, check and params() say to wrap the model again.
    Wrapped again, routing analysis serves the adapted model's routing, check checks, and what reads the weights
    themselves (the export, params) says to merge the adapters. Ground truth: hooks on the experts calls of the PEFT model, and its
    logits."""
    from peft import LoraConfig, get_peft_model

    from moelens import analysis, families
    from moelens.testing import tiny_model

    hf = tiny_model("qwen2_moe")
    wrapped = wrap(hf)
    tuned = get_peft_model(hf, LoraConfig(target_parameters=["mlp.experts.down_proj"], r=4, init_lora_weights=False))
    tokens = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = {"routing analysis": lambda model: analysis.collect_routing(model, [tokens[0]], progress=False),
             "the export": lambda model: to_nnef(model, out / "adapted.nnef.tgz", verify=False),
             "check": lambda model: families.check(model, tokens),
             "params": lambda model: model.moes[0].params()}
    for where, call in calls.items():
        with pytest.raises(moelens.MoelensError, match=r"PEFT put adapters on the parameters of .*experts after "
                                                       r"moelens\.wrap .* Wrap the model again, moelens\.wrap\("
                                                       r"model\._module\), to serve the block's adapted values"):
            call(wrapped)
    again = wrap(hf)  # get_peft_model put the adapters into hf itself
    assert families.check(again, tokens)  # its experts' layout is checked on the module beneath the adapter
    for where in ("the export", "params"):
        with pytest.raises(moelens.MoelensError, match=r"experts 'experts' \(LoRA on down_proj\), adding .* Merge the "
                                                       r"adapters into the weights and (wrap|export) the result"):
            calls[where](again)
    seen = []
    hooks = [layer.mlp.experts.base_layer.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
             for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        adapted_logits = tuned(tokens).logits
    for hook in hooks:
        hook.remove()
    cache = calls["routing analysis"](again)
    assert len(cache.layers) == len(seen) == 3
    for layer, indices in zip(cache.layers, seen):
        torch.testing.assert_close(cache.indices(layer).long(), indices.reshape(-1, indices.shape[-1]))
    with torch.no_grad(), again.trace(tokens):
        logits = again.output.logits.save()
    torch.testing.assert_close(logits, adapted_logits, rtol=0, atol=0)


def test_what_tract_cannot_express_is_refused_with_the_reason(out):
    converted = convert(bert(), num_experts=4, top_k=2)
    with pytest.raises(ExportRefused, match="erf"):  # BERT's exact GELU: tract's gelu is the tanh approximation
        to_nnef(wrap(exportable(converted)).moes[0], out / "bert.nnef.tgz")


def test_an_activation_tract_lacks_is_refused_without_the_exportable_advice(out):
    """A converted SwiGLU block with quick_gelu was refused with "export moelens.compress.exportable(model)", which
    leaves gated experts as they are: following it gave the same refusal."""
    converted = convert(llama(hidden_act="quick_gelu"), num_experts=4, top_k=2)
    for model in (converted, exportable(converted)):
        with pytest.raises(ExportRefused, match=r"QuickGELUActivation is none of tract_moe_ffn's silu, gelu \(tanh\) "
                                                r"or relu\.$"):
            to_nnef(wrap(model).moes[0], out / "quick_gelu.nnef.tgz")


def test_a_layer_that_changes_width_is_refused_with_the_reason(out):
    """A converted k_proj (32 -> 16 features, GQA) is no residual-stream FFN: refused, not a crash."""
    converted = exportable(convert(llama(kv_heads=2), num_experts=2, top_k=1, target_modules=["k_proj"]))
    narrow = [moe for moe in wrap(converted).moes if moe.path.endswith("k_proj")]
    assert narrow, "the k_proj layers were not converted"
    with pytest.raises(ExportRefused, match=r"maps 32 features to 16.*; convert only layers whose outputs are as wide as "
                                            r"their inputs \(target_modules"):
        to_nnef(narrow[0], out / "narrow.nnef.tgz")  # advised exporting "the model around it", which holds it
    # wider (GPT-2's c_fc, 32 -> 128): refused where the experts' padded inputs are read, said to be "not one router
    # over one experts module"
    wide = wrap(exportable(convert(gpt2(), num_experts=4, top_k=2, target_modules=["c_fc"]))).moes[0]
    with pytest.raises(ExportRefused, match=r"a converted Linear whose output is wider than its input .*; convert only "
                                            r"layers whose outputs are as wide as their inputs \(target_modules"):
        to_nnef(wide, out / "wide.nnef.tgz")


def test_experts_with_lora_adapters_are_refused_naming_the_merge(out):
    """LoRA adapters left on the experts: their weights are the parameters plus the adapters' product,
    which the archive would not hold (a torch-to-nnef KeyError before)."""
    converted = convert(llama(), num_experts=4, top_k=2, lora_r=2)
    with pytest.raises(ExportRefused, match=r"LoRA adapters.*merge_lora.*exportable"):
        to_nnef(wrap(converted), out / "lora.nnef.tgz", example_inputs=ids(1, 8, 2))
