"""moelens.compress API: settings, stats (checked against the modules), skips and their reasons, errors,
single Linear / Conv1D layers, GQA-narrow projections, PEFT wrappers and LoRA adapters."""

from __future__ import annotations

import copy
import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moelens.compress import (CompressionError, NothingToConvert, ToMoEBlock, ToMoECompressor, ToMoELinear,
                              exportable, get_compressor, inject_tomoe, merge_lora, tomoe)
from test_compress_helpers import bert, convert, gpt2, ids, inputs_of, llama, run


# -- settings ------------------------------------------------------------------------------------------


def test_comp_config_dict_object_and_aliases():
    model, tokens = llama(), ids()
    for config in ({"tomoe_num_experts": 8, "tomoe_top_k": 2, "max_reconstruction_error": None, "progress": False},
                   SimpleNamespace(num_experts=8, tomoe_top_k=2, max_error=None, progress=False)):
        _, stats = tomoe(model, calibration=tokens, comp_config=config, return_stats=True)
        assert {(layer.num_experts, layer.top_k) for layer in stats.converted} == {(8, 2)}
    # an explicit argument that differs from its default wins over comp_config
    _, stats = tomoe(model, top_k=1, calibration=tokens, comp_config={"top_k": 3, "max_error": None, "progress": False},
                     return_stats=True)
    assert stats.converted[0].top_k == 1
    _, stats = tomoe(model, calibration=tokens, comp_config={"tomoe_lora_r": 2, "max_error": None, "progress": False},
                     return_stats=True)
    assert all(layer.lora for layer in stats.converted)


def test_a_setting_named_twice_in_comp_config_with_different_values_is_refused():
    from moelens.compress.options import resolve

    model = llama()
    for config, match in [({"num_experts": 8, "tomoe_num_experts": 2}, r"num_experts=8 and tomoe_num_experts=2"),
                          ({"tomoe_num_experts": 2, "num_experts": 8}, r"num_experts=8 and tomoe_num_experts=2"),
                          ({"max_error": 0.5, "max_reconstruction_error": 0.1},
                           r"max_error=0.5 and max_reconstruction_error=0.1"),
                          (SimpleNamespace(tomoe_top_k=1, top_k=3), r"top_k=3 and tomoe_top_k=1")]:
        with pytest.raises(CompressionError, match=r"comp_config sets \w+ under two names with different values: "
                                                   + match + r"; keep one of the two keys"):
            ToMoECompressor(model, comp_config=config)
    # the same value under both names is one setting
    options = resolve(comp_config={"num_experts": 8, "tomoe_num_experts": 8, "max_error": None,
                                   "max_reconstruction_error": None})
    assert (options.num_experts, options.max_error) == (8, None)


def test_registry_names_and_the_compressor_object():
    for name in ("tomoe", "tomoe_compressor", "tomoe_factory", "tomoe_compressor_factory"):
        assert get_compressor(name) is ToMoECompressor
    compressor = get_compressor("tomoe")(llama(), num_experts=4, top_k=2, calibration=ids(), max_error=None,
                                         progress=False)
    assert "not run yet" in compressor.summary()
    with pytest.raises(CompressionError, match="compress"):
        compressor.get_compression_stats()
    model, stats = compressor.compress()
    assert compressor.get_compression_stats() is stats and compressor.result is model
    assert "2 layers converted" in compressor.summary() and "model.layers.0.mlp" in compressor.summary()
    with pytest.raises(CompressionError, match="no compressor named"):
        get_compressor("nope")


def test_clear_errors():
    model = llama()
    with pytest.raises(CompressionError, match="top_k=5 is larger than num_experts=4"):
        tomoe(model, num_experts=4, top_k=5)
    with pytest.raises(ValueError):  # CompressionError is a ValueError too
        tomoe(model, num_experts=2, top_k=3)
    all_padding = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.zeros(2, 5, dtype=torch.long)}
    for empty in ([], torch.zeros(0, 8, dtype=torch.long), [{"input_ids": torch.zeros(2, 0, dtype=torch.long)}], all_padding):
        with pytest.raises(CompressionError, match="calibration set is empty"):
            tomoe(model, calibration=empty, progress=False)
    with pytest.raises(CompressionError, match="unknown experts implementation 'groupd_mm'"):
        tomoe(model, experts_implementation="groupd_mm", progress=False)  # before any conversion
    with pytest.raises(CompressionError, match=r"comp_config has unknown key\(s\) \['num_expert'\]"):
        tomoe(model, comp_config={"num_expert": 8}, progress=False)
    with pytest.raises(NothingToConvert, match=r"nothing to convert in Sequential: .*FFN blocks\)\.$"):
        tomoe(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), progress=False)  # no Linear layer to name either
    ffn_kind_unknown = nn.ModuleDict({"fc1": nn.Linear(8, 16), "fc2": nn.Linear(16, 8)})  # as BART and OPT name theirs
    with pytest.raises(NothingToConvert, match=r"target_modules=\[\.\.\.\] .*; this model's Linear / Conv1D layers "
                                               r"are named fc1, fc2\.$"):
        tomoe(ffn_kind_unknown, progress=False)
    with pytest.raises(NothingToConvert, match="protected"):
        tomoe(bert(classifier=True), target_modules=["classifier"], progress=False)
    with pytest.raises(CompressionError, match=r"calibration dict holds no tensor .*return_tensors='pt'"):
        tomoe(model, calibration={"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}, progress=False)
    for setting, match in [({"inplace": "False"}, r"inplace must be True or False, got 'False'"),
                           ({"refit": "no"}, r"refit must be True or False"),
                           ({"max_error": "0.2"}, r"max_error must be a number, got '0.2'"),
                           ({"lora_alpha": "x"}, r"lora_alpha must be a number"),
                           ({"lora_alpha": float("nan"), "lora_r": 2}, r"lora_alpha must be a finite number, got nan"),
                           ({"lora_alpha": float("inf"), "lora_r": 2}, r"lora_alpha must be a finite number, got inf"),
                           ({"lora_alpha": 0, "lora_r": 2}, r"lora_alpha=0 scales the rank-2 adapters .* to nothing"),
                           ({"return_stats": "no"}, r"return_stats must be True or False, got 'no'"),
                           ({"comp_config": "num_experts=8"}, r"comp_config must be a dict or an object with tomoe "
                                                              r"settings as attributes .*got str 'num_experts=8'"),
                           ({"comp_config": [("num_experts", 8)]}, r"comp_config must be a dict .*got list"),
                           ({"seed": "x"}, r"seed must be an int"),
                           ({"target_modules": "q_proj["}, r"target_modules='q_proj\[' is not a valid regex "
                                                           r"\(unterminated character set .*\); a string is matched")]:
        with pytest.raises(CompressionError, match=match):
            tomoe(model, calibration=ids(), progress=False, **setting)
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)  # nothing converted in place


def test_numpy_and_0d_tensor_numbers_are_settings_like_python_ones():
    import numpy as np

    from moelens.compress.options import resolve

    options = resolve(num_experts=np.int64(4), top_k=torch.tensor(2), seed=np.uint32(7), lora_alpha=np.float32(8.5),
                      max_error=torch.tensor(0.25, dtype=torch.float64))
    assert (options.num_experts, options.top_k, options.seed, options.lora_alpha, options.max_error) == (4, 2, 7, 8.5, 0.25)
    assert all(type(value) in (int, float) for value in (options.num_experts, options.top_k, options.seed,
                                                           options.lora_alpha, options.max_error))
    import argparse

    assert resolve(comp_config=argparse.Namespace(lr=1e-3), num_experts=8).num_experts == 8  # other attributes ignored
    for setting, match in [({"num_experts": torch.tensor([4])}, r"num_experts must be an int, got tensor\(\[4\]\)"),
                           ({"top_k": np.float64(2.0)}, "top_k must be an int"),
                           ({"lora_alpha": np.array([8.0])}, "lora_alpha must be a number"),
                           ({"seed": True}, "seed must be an int")]:
        with pytest.raises(CompressionError, match=match):
            resolve(**setting)


def test_a_converted_model_pickles_after_wrapping_and_is_not_loaded_as_dense(tmp_path):
    import pickle

    import moelens

    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids())
    wrapped = moelens.wrap(converted)  # nnsight keeps the experts' decorated forward on the instance
    with pytest.warns(UserWarning, match=r"save_pretrained: 2 blocks were converted by moelens.compress.tomoe "
                                         r"\(model.model.layers.0.mlp, ...\).*torch.save\(model._module, path\)"):
        wrapped.save_pretrained(tmp_path / "wrapped")
    copy = pickle.loads(pickle.dumps(converted))
    with torch.no_grad():
        torch.testing.assert_close(copy(ids()).logits, converted(ids()).logits, rtol=0, atol=0)
    # save_pretrained keeps the dense config: loading it would leave the FFN weights random.
    converted.save_pretrained(tmp_path)
    with pytest.raises(moelens.MoelensError, match=r"does not match the model its config describes.*torch.save\(model\)"):
        moelens.load(tmp_path)


def test_inject_tomoe_logs_instead_of_raising(caplog):
    with caplog.at_level(logging.ERROR, logger="moelens.compress"):
        assert inject_tomoe() is None
        assert inject_tomoe(llama(), num_experts=2, top_k=3) is None
    assert "no model given" in caplog.text and "top_k=3 is larger" in caplog.text
    converted = inject_tomoe(llama(), num_experts=4, top_k=2, calibration=ids(), max_error=None, progress=False)
    assert isinstance(converted.model.layers[0].mlp, ToMoEBlock)



def test_an_inplace_conversion_that_stops_partway_says_what_the_model_now_holds(monkeypatch):
    """The user's own model is changed layer by layer with inplace=True: an error (or Ctrl-C) at a later layer
    leaves the earlier ones converted, and the error says which."""
    from moelens.compress import compressor

    fitted = compressor.plan_layer
    calls = []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fitted(*args, **kwargs)

    monkeypatch.setattr(compressor, "plan_layer", failing_second)
    model = llama()
    with pytest.raises(KeyboardInterrupt) as stopped:
        tomoe(model, num_experts=4, top_k=2, calibration=ids(), max_error=None, progress=False, inplace=True)
    note = " ".join(getattr(stopped.value, "__notes__", []))
    assert "stopped at model.layers.1.mlp" in note and "['model.layers.0.mlp']" in note, note
    assert isinstance(model.model.layers[0].mlp, ToMoEBlock) and not isinstance(model.model.layers[1].mlp, ToMoEBlock)
    for inplace in (False, True):  # on a copy, or stopped before any layer was converted: nothing to say
        calls[:] = [1] if inplace else []
        untouched = llama()
        with pytest.raises(KeyboardInterrupt) as unchanged:
            tomoe(untouched, num_experts=4, top_k=2, calibration=ids(), max_error=None, progress=False, inplace=inplace)
        assert not getattr(unchanged.value, "__notes__", [])
        assert not any(isinstance(module, ToMoEBlock) for module in untouched.modules())

# -- stats -------------------------------------------------------------------------------------------------


def test_stats_counts_match_the_modules():
    """Parameter counts worked out by hand from the shapes.

    The tiny Llama (no biases): vocabulary 128, D = 32, 2 layers with 4 query and 2 key/value heads of 8,
    SwiGLU FFNs of 64 neurons, untied head: embeddings 4096 + per layer (attention 1024 + 512 + 512 + 1024,
    FFN 3 * 32 * 64 = 6144, norms 2 * 32) 9280 + final norm 32 + head 4096 = 26784.
    A converted FFN (E = 4, 4 shared neurons, 60 routed: experts of 15 padded to 16): experts
    4 * (2 * 16 * 32 + 2 * 16 + 32 * 16 + 32) = 6400, shared expert 2 * (32 * 4 + 4) + (4 * 32 + 32) = 424,
    router 4 * 32 + 4 = 132: 6956 in all; a token runs 1 expert of 4: 6956 - 3 * 6400 / 4 = 2156.
    """
    dense = llama()
    converted, stats = convert(dense, num_experts=4, top_k=1, calibration=ids(), shared_neurons=4)
    assert stats.original_parameters == 26784
    assert stats.new_parameters == 26784 + 2 * (6956 - 6144)
    for layer in stats.converted:
        assert (layer.original_parameters, layer.new_parameters, layer.active_parameters) == (6144, 6956, 2156)
        assert sum(layer.expert_sizes) + layer.shared_neurons == 64 and layer.shared_neurons == 4
        assert layer.error is not None and 0 < layer.error < 1 and layer.error_tokens == 128
        assert layer.active_fraction == pytest.approx((15 + 4) / 64)
        computed = converted.get_submodule(layer.name).experts.gate_up_proj.shape[1] // 2  # gate and up rows
        assert computed == layer.padded_expert_size == 16
        assert layer.computed_fraction == pytest.approx((computed + 4) / 64)  # the padding runs too
    assert stats.active_parameters == stats.new_parameters - 2 * 4800
    assert stats.parameter_ratio == pytest.approx(stats.new_parameters / stats.original_parameters)
    assert stats.active_ratio == pytest.approx(stats.active_parameters / stats.original_parameters)
    assert stats.calibration_tokens == 128 and stats.seconds > 0
    data = stats.as_dict()
    assert data["converted"][0]["expert_sizes"] == stats.converted[0].expert_sizes and "active_ratio" in data
    assert data["converted"][0]["computed_fraction"] == stats.converted[0].computed_fraction
    assert "active 30% (computed 31%)" in stats.summary()


def test_weights_only_conversion_records_no_error():
    _, stats = convert(llama(), num_experts=4, top_k=2)
    assert all(layer.error is None and "no calibration" in layer.notes[0] for layer in stats.converted)
    assert stats.calibration_tokens == 0


def test_error_gate_keeps_bad_layers_dense_with_the_reason():
    dense = llama()
    tokens = ids()
    converted, stats = tomoe(dense, num_experts=4, top_k=1, calibration=tokens, max_error=1e-6, progress=False,
                             return_stats=True)
    assert not stats.converted and len(stats.skipped) == 2
    assert all("above max_error=1e-06: kept dense" in skip.reason for skip in stats.skipped)
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens))


# -- skips ----------------------------------------------------------------------------------------------------


def test_protected_fused_tied_and_tiny_layers_are_skipped_with_reasons():
    _, stats = convert(bert(classifier=True), num_experts=4, top_k=2, calibration=ids(), target_modules=r".*")
    reasons = stats.skipped_layers
    assert "protected (classifier" in reasons["classifier"]
    assert "protected (pooler" in reasons["bert.pooler.dense"]
    converted = set(stats.converted_layers)
    assert {"bert.encoder.layer.0.intermediate", "bert.encoder.layer.0.attention.self.query"} <= converted

    _, stats = convert(gpt2(), num_experts=4, top_k=2, calibration=ids(), target_attention_only=True)
    assert "fused QKV" in stats.skipped_layers["transformer.h.0.attn.c_attn"]
    assert stats.converted_layers == ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.tiny = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
            self.second.weight = self.first.weight
            self.big = nn.Linear(16, 32)

        def forward(self, x):
            hidden = self.second(torch.relu(self.first(x)))
            return self.big(hidden), self.tiny(hidden)

    _, stats = convert(Tied(), num_experts=4, top_k=2, target_modules=["first", "second", "tiny", "big"])
    assert stats.skipped_layers["first"] == "tied weights (shared with second)"
    assert stats.skipped_layers["second"] == "tied weights (shared with first)"
    assert stats.skipped_layers["tiny"].startswith("too small (16 -> 4)")
    assert stats.converted_layers == ["big"]
    with pytest.raises(NothingToConvert, match=r"first: tied weights .*tiny: too small"):
        tomoe(Tied(), num_experts=4, top_k=2, target_modules=["first", "second", "tiny"], progress=False)


def test_gpt2_ffn_with_a_tied_head_converts_the_ffn_only():
    dense = gpt2()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=ids())
    assert stats.converted_layers == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert converted.lm_head.weight is converted.transformer.wte.weight  # the tie survives the copy
    torch.testing.assert_close(run(converted, ids()), run(dense, ids()), atol=2e-5, rtol=1e-5)


# -- single Linear / Conv1D layers -------------------------------------------------------------------------------


def test_conv1d_layers_as_tomoe_linear():
    dense = gpt2()
    tokens = ids()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens, target_modules=["c_proj", "c_fc"])
    assert len(stats.converted) == 6 and all(layer.kind == "linear" for layer in stats.converted)
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens), atol=2e-5, rtol=1e-5)
    for name in ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_proj"):
        layer, original = converted.get_submodule(name), dense.get_submodule(name)
        assert isinstance(layer, ToMoELinear) and layer.transposed
        assert torch.equal(layer.weight, original.weight) and torch.equal(layer.bias, original.bias)
        gated = exportable(converted).get_submodule(name)  # identity experts in gated form: the same dense layer
        assert torch.equal(gated.weight, original.weight) and torch.equal(gated.bias, original.bias)
        masks = layer.masks
        assert masks.shape == (4, original.nf) and torch.equal(masks.sum(0), torch.ones(original.nf, dtype=torch.long))
        assert stats.converted[[l.name for l in stats.converted].index(name)].expert_sizes == masks.sum(1).tolist()


def test_tomoe_linear_skipped_outputs_get_their_mean():
    """With k < E a token's skipped output neurons take their mean on the calibration tokens that skip them."""
    dense = llama(kv_heads=4)
    tokens = ids(4, 16)
    converted, _ = convert(dense, num_experts=4, top_k=1, calibration=tokens, target_modules=["o_proj"])
    layer = converted.model.layers[0].self_attn.o_proj
    x = inputs_of(dense, dense.model.layers[0].self_attn.o_proj, tokens)
    with torch.no_grad():
        exact = dense.model.layers[0].self_attn.o_proj(x)
        chosen = layer.router(x)[2][:, 0]
        got = layer(x)
    masks = layer.masks
    for expert in range(4):
        runs, outputs = chosen == expert, masks[expert]
        torch.testing.assert_close(got[runs][:, outputs], exact[runs][:, outputs], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[~runs][:, outputs], exact[~runs][:, outputs].mean(0).expand_as(got[~runs][:, outputs]),
                                   atol=1e-5, rtol=1e-4)


def test_gqa_narrow_projections_get_fewer_experts():
    dense = llama(kv_heads=2)  # q: 32 outputs, k/v: 16
    tokens = ids()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens, target_attention_only=True)
    layers = {layer.name.rsplit(".", 1)[1]: layer for layer in stats.converted if ".0." in layer.name}
    assert (layers["q_proj"].num_experts, layers["q_proj"].top_k) == (4, 4)
    assert (layers["k_proj"].num_experts, layers["k_proj"].top_k) == (2, 2)
    assert "narrow projection" in layers["v_proj"].notes[0]
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens), atol=2e-5, rtol=1e-5)
    _, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens, target_attention_only=True)
    assert {layer.top_k for layer in stats.converted if "k_proj" in layer.name} == {1}


def test_shared_neurons_are_noted_as_not_applied_to_single_linear_layers():
    """shared_neurons is per FFN block: a Linear layer converted beside an FFN gets none, and its stats say so
    (they were dropped without a word)."""
    dense = llama(kv_heads=2)
    _, stats = convert(dense, num_experts=4, top_k=2, calibration=ids(), shared_neurons=4,
                       target_modules=["q_proj", "mlp"], max_error=None)
    layers = {layer.name: layer for layer in stats.converted}
    assert {name.rsplit(".", 1)[1] for name in layers} == {"q_proj", "mlp"}, sorted(layers)
    for name, layer in layers.items():
        if name.endswith("q_proj"):
            assert layer.shared_neurons == 0
            assert any("no shared neurons (shared_neurons=4 applies to FFN blocks" in note for note in layer.notes)
        else:
            assert layer.shared_neurons == 4 and not any("shared neurons" in note for note in layer.notes)


# -- PEFT and LoRA -----------------------------------------------------------------------------------------------------


def test_peft_lora_wrapper_stays_around_the_converted_layer():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    tuned = peft.get_peft_model(llama(), config).eval()
    tokens = ids()
    converted, stats = convert(tuned, num_experts=4, top_k=4, calibration=tokens, target_attention_only=True)
    attention = converted.base_model.model.model.layers[0].self_attn
    assert type(attention.q_proj).__name__ == "Linear" and isinstance(attention.q_proj.base_layer, ToMoELinear)
    assert any("PEFT wrapper kept" in note for layer in stats.converted for note in layer.notes)
    torch.testing.assert_close(run(converted, tokens), run(tuned, tokens), atol=2e-5, rtol=1e-5)
    with converted.disable_adapter():  # the adapters still act on top of the converted layer
        assert not torch.allclose(run(converted, tokens), run(tuned, tokens), atol=1e-3)
    ffn_tuned = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["up_proj"]))
    with pytest.raises(NothingToConvert, match="layers.0.mlp: PEFT adapters on the FFN's projections"):
        tomoe(ffn_tuned, num_experts=4, top_k=2, calibration=tokens, progress=False)


def test_peft_refuses_to_merge_its_adapter_into_a_converted_layer():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    tokens = ids()
    converted, _ = convert(peft.get_peft_model(llama(), config).eval(), num_experts=4, top_k=2, calibration=tokens,
                           target_attention_only=True)
    adapted = run(converted, tokens)
    for merge in (converted.merge_and_unload, converted.merge_adapter):
        with pytest.raises(CompressionError, match=r"self_attn\.[qv]_proj: PEFT cannot merge .* merge_and_unload\(\) on "
                                                   "the dense model, then tomoe"):
            merge()
        torch.testing.assert_close(run(converted, tokens), adapted, rtol=0, atol=0)  # the adapters still act
    copied = pickle.loads(pickle.dumps(copy.deepcopy(converted)))
    with pytest.raises(CompressionError, match="PEFT cannot merge"):
        copied.merge_and_unload()


def test_lora_adapters_on_experts_and_router_with_frozen_experts():
    dense = llama()
    tokens = ids()
    plain, _ = convert(dense, num_experts=4, top_k=2, calibration=tokens)
    adapted, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens, lora_r=2, lora_alpha=4.0)
    torch.testing.assert_close(run(adapted, tokens), run(plain, tokens))  # B starts at zero
    block = adapted.model.layers[0].mlp
    trainable = {name for name, p in block.named_parameters() if p.requires_grad}
    assert trainable == {
        "router.weight", "router.lora.weight.lora_A", "router.lora.weight.lora_B", "router.bias",
        "experts.lora.gate_up_proj.lora_A", "experts.lora.gate_up_proj.lora_B",
        "experts.lora.down_proj.lora_A", "experts.lora.down_proj.lora_B",
    }
    assert block.experts.lora.gate_up_proj.lora_A.shape == (4, 2, 32)
    adapted.train()
    run_out = adapted(input_ids=tokens).logits
    run_out.square().mean().backward()
    assert block.experts.lora.down_proj.lora_B.grad.abs().sum() > 0
    assert block.experts._parameters["gate_up_proj"].grad is None
    with torch.no_grad():
        block.experts.lora.down_proj.lora_B.normal_()
    adapted.eval()
    before = run(adapted, tokens)
    merged = merge_lora(adapted)
    assert "down_proj" in merged.model.layers[0].mlp.experts._parameters
    torch.testing.assert_close(run(merged, tokens), before, atol=1e-5, rtol=1e-5)
    assert all(layer.lora for layer in stats.converted)


def test_the_router_trains_straight_through_its_saturated_weights():
    """The selected weights are sigmoid(logit) = 1.0 exactly, whose slope is 0: the router got no gradient at all.
    Straight through, each selected logit gets the gradient of its weight: its expert's output (computed
    alone, from the experts module) dotted with the gradient of the routed output."""
    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids(), lora_r=2)
    block = converted.model.layers[0].mlp
    with torch.no_grad():
        block.router.lora.weight.lora_B.normal_()
    hidden = inputs_of(converted, block, ids(2, 8)).detach()
    logits, weights, index = block.router(hidden)
    assert torch.equal(weights, torch.ones_like(weights))  # the forward is unchanged
    logits.retain_grad()
    routed = block.experts(hidden, index, weights)
    upstream = torch.randn_like(routed)
    (routed * upstream).sum().backward()
    expected = torch.zeros_like(logits)
    with torch.no_grad():
        for slot in range(index.shape[1]):
            alone = block.experts(hidden, index[:, slot:slot + 1], torch.ones(len(hidden), 1))
            expected.scatter_(1, index[:, slot:slot + 1], (alone * upstream).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, expected)
    assert expected.abs().sum() > 0
    trained = {name: p.grad.abs().sum().item() for name, p in block.router.named_parameters() if p.grad is not None}
    assert set(trained) == {"weight", "bias", "lora.weight.lora_A", "lora.weight.lora_B"} and min(trained.values()) > 0
    with torch.no_grad():  # no straight-through ops where nothing trains
        assert block.router(hidden)[1].grad_fn is None


def test_the_error_gate_says_when_no_token_was_held_out():
    # Below 1024 calibration tokens the error is measured on the fit tokens: tomoe warns once (it warned once per
    # layer: a property of the calibration set), the stats say so for each layer.
    with pytest.warns(UserWarning, match=r"fewer than 1024 calibration tokens, .*Give at least 1024 calibration") as seen:
        _, stats = tomoe(llama(), num_experts=4, top_k=2, calibration=ids(8, 16), max_error=0.9, return_stats=True,
                         progress=False)
    assert len(stats.converted) == 2 and sum("fewer than 1024" in str(w.message) for w in seen) == 1
    for layer in stats.converted:
        assert layer.error_tokens == 128 and any("none held out" in note for note in layer.notes)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, stats = tomoe(llama(max_position_embeddings=128), num_experts=4, top_k=2, calibration=ids(16, 80),
                         max_error=10.0, return_stats=True, progress=False)
    assert len(stats.converted) == 2
    assert all(layer.error_tokens == 1280 // 8 and not layer.notes for layer in stats.converted)


def test_the_held_out_warning_names_max_tokens_when_it_cut_the_tokens():
    """2048 calibration tokens cut to 500 by max_tokens: the warning asked for more calibration tokens."""
    with pytest.warns(UserWarning, match=r"fewer than 1024 calibration tokens \(max_tokens=500\), .*Raise max_tokens"):
        tomoe(llama(), num_experts=4, top_k=2, calibration=ids(64, 32), max_tokens=500, max_error=0.9, progress=False)


def test_a_model_whose_weights_are_not_loaded_is_refused_before_any_work():
    """A model built on the meta device came back unconverted, each layer "needing more than hidden states"."""
    with torch.device("meta"):
        empty = llama()
    for calibration in (None, ids(8, 16)):
        with pytest.raises(CompressionError, match=r"weights that are not loaded \(model\.embed_tokens\.weight, .* "
                                                   r"on the meta device: offloaded by a device_map, or made under "
                                                   r"init_empty_weights\).*load the model without offloading"):
            tomoe(empty, num_experts=4, top_k=2, calibration=calibration, progress=False)
