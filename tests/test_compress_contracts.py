"""What tomoe promises and no other test pinned: the reported error is the built block's (on the held-out
tokens, shared neurons included), padding is not calibrated on, list targets are whole name parts, LoRA scales
by alpha / r, GPT-2 keeps its residual dropout, bad settings and too many shared neurons are refused, and the
active fraction counts the biggest experts."""

from __future__ import annotations

import pytest
import torch

from moelens.compress import CompressionError, NothingToConvert, fit
from moelens.compress.stats import LayerStats

from test_compress_helpers import convert, gpt2, ids, inputs_of, llama


def _err(y, t):
    return float((y - t).norm() / t.norm())


def test_reported_error_is_the_built_blocks_error_with_shared_neurons_and_refit():
    dense = llama()
    tokens = ids()  # 128 tokens: error measured on all of them
    mlp = dense.model.layers[0].mlp
    x = inputs_of(dense, mlp, tokens)
    conv, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens, shared_neurons=8)
    with torch.no_grad():
        actual = _err(conv.model.layers[0].mlp(x), mlp(x))
    assert stats.converted[0].error == pytest.approx(actual, rel=1e-3)


def test_reported_error_is_measured_on_the_held_out_rows():
    dense = llama()
    tokens = ids(64, 16)  # 1024 tokens: one in eight held out
    mlp = dense.model.layers[0].mlp
    x = inputs_of(dense, mlp, tokens)
    conv, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens)
    _, held = fit._split(x.shape[0], seed=0)
    with torch.no_grad():
        actual = _err(conv.model.layers[0].mlp(x[held]), mlp(x[held]))
    assert stats.converted[0].error_tokens == 128
    assert stats.converted[0].error == pytest.approx(actual, rel=1e-3)


def test_lora_adapter_scale_is_alpha_over_r():
    conv, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids(), lora_r=2, lora_alpha=8.0)
    experts = conv.model.layers[0].mlp.experts
    adapter = experts.lora["gate_up_proj"]
    with torch.no_grad():
        adapter.lora_B.normal_(generator=torch.Generator().manual_seed(0))
        expected = experts._parameters["gate_up_proj"] + (8.0 / 2) * adapter.lora_B @ adapter.lora_A
    torch.testing.assert_close(experts.gate_up_proj, expected)


def test_padding_is_not_calibrated_on():
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    _, stats = convert(llama(), num_experts=4, top_k=2, calibration={"input_ids": tokens, "attention_mask": mask})
    assert stats.calibration_tokens == int(mask.sum()) == 40


def test_a_list_target_is_a_whole_name_component():
    with pytest.raises(NothingToConvert):
        convert(llama(), num_experts=2, top_k=1, calibration=ids(), target_modules=["proj"])


def test_gpt2_block_keeps_its_residual_dropout():
    dense = gpt2()
    conv, _ = convert(dense, num_experts=4, top_k=2, calibration=ids())
    block = conv.transformer.h[0].mlp
    assert isinstance(block.dropout, torch.nn.Dropout) and block.dropout.p == dense.config.resid_pdrop


@pytest.mark.parametrize(("bad", "message"), [
    (dict(lora_r=-1), r"lora_r must be 0 or more, got -1"),
    (dict(shared_neurons=-2), r"shared_neurons must be 0 or more, got -2"),
    (dict(max_error=0.0), r"max_error must be positive or None \(no gate\), got 0.0"),
    (dict(max_tokens=0), r"max_tokens must be positive, got 0"),
])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(CompressionError, match=message):
        convert(llama(), num_experts=4, top_k=2, calibration=ids(), **bad)


def test_too_many_shared_neurons_are_a_skip_reason():
    with pytest.raises(NothingToConvert, match="shared_neurons=62 leaves fewer neurons than experts"):
        convert(llama(), num_experts=4, top_k=2, calibration=ids(), shared_neurons=62)


def test_active_fraction_uses_the_biggest_experts():
    layer = LayerStats("x", "swiglu", 3, 1, [5, 4, 4], 0, None, 0, 0, 0, 0)
    assert layer.active_fraction == pytest.approx(5 / 13)
