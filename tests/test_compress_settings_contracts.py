"""Contracts of the compressor's settings (one setting under two names, float64 and grouped_mm), calibration items
(tuples of positional arguments) and second passes over converted blocks.

Ground truths, independent of moelens: torch's own grouped_mm refusing float64, the user's dict as they built
it, the positional call a tuple item is, and what the first pass converted.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from moelens.compress import CompressionError, NothingToConvert, ToMoELinear, set_experts_implementation
from moelens.compress import calibration as cal
from moelens.compress.options import resolve
from moelens.testing import tiny_inputs, tiny_model
from test_compress_helpers import VOCAB, convert, ids, llama, run

EARLIER = "a block converted by an earlier tomoe pass"


def _quiet(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build().eval()


# -- comp_config: one setting under two names ---------------------------------------------------------------------


def test_a_setting_under_two_names_whose_values_cannot_be_compared_is_refused():
    """8 and tensor([8, 2]) are not one value (their == has no single truth value): keeping the 8 would drop the
    other name's setting without a word."""
    with pytest.raises(CompressionError, match=r"comp_config sets num_experts under two names with different values"):
        resolve(comp_config={"num_experts": 8, "tomoe_num_experts": torch.tensor([8, 2])})


def test_equal_values_under_two_names_are_the_setting_under_its_own_name():
    """8 == 8.0: one setting, and the value under the setting's own name is the one taken (as that name alone)."""
    alone = resolve(comp_config={"num_experts": 8})
    for config in ({"num_experts": 8, "tomoe_num_experts": 8.0}, {"tomoe_num_experts": 8.0, "num_experts": 8}):
        assert resolve(comp_config=config) == alone


def test_one_nan_under_two_names_is_refused_as_a_value_not_as_two_settings():
    """NaN == NaN is False: the same NaN under max_error and its alias was called two different values, hiding the
    real refusal (NaN is no error bound), which the setting given once gets."""
    with pytest.raises(CompressionError) as once:
        resolve(comp_config={"max_error": float("nan")})
    with pytest.raises(CompressionError) as twice:
        resolve(comp_config={"max_error": float("nan"), "max_reconstruction_error": float("nan")})
    assert "max_error must be positive or None" in str(once.value)
    assert str(twice.value) == str(once.value)


def test_an_array_given_beside_comp_config_is_refused_as_a_value():
    """tomoe(comp_config={"top_k": 2}, top_k=tensor([2, 3])) failed with torch's "Boolean value of Tensor with more than
    one value is ambiguous" (numpy's likewise) while weighing the keyword against the default: the same value given
    alone is refused by name."""
    import numpy as np

    for name, config, value, refusal in (("top_k", {"top_k": 2}, torch.tensor([2, 3]), r"top_k must be an int"),
                                         ("max_error", {"max_error": .1}, np.array([.1, .2]), r"max_error must be")):
        with pytest.raises(CompressionError, match=refusal) as alone:
            resolve(**{name: value})
        with pytest.raises(CompressionError) as beside:
            resolve(comp_config=config, **{name: value})
        assert str(beside.value) == str(alone.value)


@pytest.mark.parametrize("entries", [[3], ["mlp", None], [b"mlp"]])
def test_target_modules_entries_that_are_no_names_are_refused_before_the_model_is_copied(entries):
    """target_modules=[3] (a layer index) failed deep in the name matching with "can only concatenate str (not int)
    to str", after the model was copied."""
    with pytest.raises(CompressionError, match=r"target_modules entries must be module names or name suffixes \(str"):
        resolve(target_modules=entries)
    model = llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CompressionError, match=r"not by its index"):
        convert(model, num_experts=4, top_k=2, target_modules=entries)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("on_meta", ["input_ids", "attention_mask"])
def test_calibration_on_the_meta_device_is_refused_by_name(on_meta):
    """Calibration ids on the meta device failed in the copy to the model's device ("Cannot copy out of meta
    tensor"), a meta attention_mask in the padding check ("Tensor.item() cannot be called on meta tensors")."""
    inputs = {"input_ids": ids(), "attention_mask": torch.ones(8, 16, dtype=torch.long)}
    inputs[on_meta] = inputs[on_meta].to("meta")
    for calibration in ((inputs["input_ids"] if on_meta == "input_ids" else inputs), inputs, [inputs]):
        with pytest.raises(CompressionError, match=r"calibration holds a tensor on the meta device \(shape \(8, 16\)\)"):
            cal.batches(calibration)
    with pytest.raises(CompressionError, match=r"on the meta device"):
        convert(llama(), num_experts=4, top_k=2, calibration=inputs)


# -- set_experts_implementation: every converted block's dtype ----------------------------------------------------


def test_grouped_mm_is_refused_when_any_converted_block_is_float64():
    """Layer 0 float32, layer 1 float64: torch's grouped_mm runs float32 and refuses float64 (checked here on torch
    itself), so switching the whole model to it is refused up front, every block left as it was."""
    a, b, offs = torch.randn(4, 8), torch.randn(1, 8, 4), torch.tensor([4], dtype=torch.int32)
    assert torch._grouped_mm(a, b, offs=offs).shape == (4, 4)
    with pytest.raises(RuntimeError, match="Double"):
        torch._grouped_mm(a.double(), b.double(), offs=offs)
    converted, stats = convert(llama(), num_experts=4, top_k=4, calibration=ids(), experts_implementation="eager")
    assert len(stats.converted) == 2
    converted.model.layers[1].mlp.double()
    with pytest.raises(CompressionError, match=r"'grouped_mm' cannot run the converted experts' float64 weights"):
        set_experts_implementation(converted, "grouped_mm")
    assert [layer.mlp.experts.config._experts_implementation for layer in converted.model.layers] == ["eager"] * 2


# -- calibration items ----------------------------------------------------------------------------------------


def test_a_tuple_of_token_ids_is_the_models_positional_call():
    """[(ids,)] calls model(ids): for a causal LM that is input_ids, so it calibrates as ids itself does."""
    tokens = ids()
    assert cal.batches([(tokens,)]) == [((tokens,), {})]
    by_tuple, tuple_stats = convert(llama(), num_experts=4, top_k=2, calibration=[(tokens,)])
    by_ids, ids_stats = convert(llama(), num_experts=4, top_k=2, calibration=tokens)
    assert tuple_stats.calibration_tokens == ids_stats.calibration_tokens == tokens.numel()
    torch.testing.assert_close(run(by_tuple, tokens), run(by_ids, tokens), rtol=0, atol=0)


def test_python_lists_of_token_ids_are_refused_before_any_forward():
    """[[5, 6, 7], [8, 9, 10]]: token ids as Python lists, not tensors. They were never the model's positional
    arguments (model(5, 6, 7)); the item is refused up front, saying what an item may be."""
    with pytest.raises(CompressionError, match=r"calibration items must be token-id tensors, .*; got list"):
        cal.batches([[5, 6, 7], [8, 9, 10]])


class _Scaled(nn.Module):
    """A model whose forward takes a number, then the tokenizer's dict (the dict is not the first argument), and
    that adds its outputs to the dict it is given (as sentence-transformers modules do)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 32)
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu"))

    def forward(self, scale: float, features: dict) -> dict:
        features["token_embeddings"] = self.mlp(scale * self.embed_tokens(features["input_ids"]))
        return features


def test_a_dict_later_in_a_tuple_item_is_checked_for_tokens_and_masks_padding():
    model = _quiet(_Scaled)
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    padding_only = {"input_ids": tokens, "attention_mask": torch.zeros_like(tokens)}
    with pytest.raises(CompressionError, match="calibration set is empty"):  # only padding: left out, as a dict item
        cal.batches([(2.0, padding_only)])
    _, stats = convert(model, num_experts=4, top_k=2, calibration=[(2.0, {"input_ids": tokens, "attention_mask": mask})])
    assert stats.converted_layers == ["mlp"] and stats.calibration_tokens == int(mask.sum())


def test_the_users_calibration_dict_is_left_as_they_built_it():
    """The model adds token_embeddings to the dict it is called with: the calibration must call it with a copy,
    or the user's dict (reused for the next call, the next conversion, their own run) changes under them."""
    model = _quiet(_Scaled)
    tokens = ids(4, 16)
    features = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    convert(model, num_experts=4, top_k=2, calibration=[(1.0, features)])
    assert sorted(features) == ["attention_mask", "input_ids"] and features["input_ids"] is tokens


def test_a_failing_keyword_call_gets_no_positional_argument_hint():
    """Token ids past the vocabulary make a causal LM fail; its forward takes every input as a keyword (all have
    defaults), so the hint for models that want a positional argument does not apply."""
    with pytest.raises(CompressionError, match=r"failed on batch 0") as refused:
        convert(llama(), num_experts=4, top_k=2, calibration=torch.full((2, 8), VOCAB + 5))
    assert "wants the positional argument" not in str(refused.value)


# -- a second pass: what it lists as converted by the first -------------------------------------------------------


def test_a_second_pass_aimed_elsewhere_does_not_list_the_converted_ffns():
    tokens = ids()
    first, done = convert(llama(), num_experts=4, top_k=2, calibration=tokens)
    assert done.converted_layers == ["model.layers.0.mlp", "model.layers.1.mlp"]
    _, stats = convert(first, num_experts=4, top_k=2, calibration=tokens, target_modules=r".*self_attn\.q_proj")
    assert stats.converted_layers == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert not [skip.name for skip in stats.skipped if EARLIER in skip.reason]


def test_a_second_pass_whose_target_modules_name_the_converted_blocks_lists_them():
    tokens = ids()
    first, done = convert(llama(), num_experts=4, top_k=2, calibration=tokens)
    with pytest.raises(NothingToConvert) as refused:
        convert(first, num_experts=4, top_k=2, calibration=tokens, target_modules=r"model\.layers\.\d+\.mlp")
    for name in done.converted_layers:
        assert re.search(rf"{re.escape(name)}: {EARLIER} \(ToMoE\w*Block\)", str(refused.value)), str(refused.value)


def test_attention_only_second_pass_does_not_list_converted_linears_outside_attention():
    tokens = ids()
    first, done = convert(llama(), num_experts=4, top_k=2, calibration=tokens,
                          target_modules=r".*mlp\.down_proj")
    assert done.converted_layers == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert all(type(first.get_submodule(name)) is ToMoELinear for name in done.converted_layers)
    _, stats = convert(first, num_experts=4, top_k=2, calibration=tokens, target_attention_only=True)
    assert stats.converted and all(".self_attn." in name for name in stats.converted_layers)
    assert not [skip.name for skip in stats.skipped if EARLIER in skip.reason]


def test_a_models_own_moe_block_is_not_called_converted_by_tomoe():
    dense = tiny_model("qwen2_moe")
    _, stats = convert(dense, num_experts=4, top_k=2, calibration=tiny_inputs(dense, batch=4, seq=8))
    assert stats.converted_layers == ["model.layers.0.mlp"]
    assert not [skip.name for skip in stats.skipped if EARLIER in skip.reason]


# -- lora_r: refused above full rank before any work ------------------------------------------------------------


def test_a_lora_rank_above_the_layers_input_width_is_refused_before_the_model_is_touched():
    """Every weight of a converted block has the dense layer's input width (hidden size 32 here) as one side, so
    rank 32 is a full update: 33 only costs memory (10**7 was gigabytes and a killed process). Refused up front,
    even in place: the user's model keeps its dense layers and weights."""
    dense = _quiet(llama)
    width = dense.config.hidden_size
    before = {name: value.clone() for name, value in dense.state_dict().items()}
    for rank in (width + 1, 10**7):
        with pytest.raises(CompressionError, match=rf"lora_r={rank} is above the input width of "
                                                  rf"model\.layers\.0\.mlp \({width}\).*use lora_r <= {width}"):
            convert(dense, num_experts=4, top_k=2, lora_r=rank, inplace=True)
    assert type(dense.model.layers[0].mlp) is LlamaMLP
    assert all(torch.equal(before[name], value) for name, value in dense.state_dict().items())
    converted, stats = convert(dense, num_experts=4, top_k=2, lora_r=width)  # full rank itself is allowed
    assert stats.converted and all(layer.lora for layer in stats.converted)
    assert converted.model.layers[0].mlp.experts.lora.down_proj.lora_A.shape[-2] == width


# -- refit: what it buys ------------------------------------------------------------------------------------------


def test_the_refit_lowers_the_held_out_error():
    """The ridge refit of the down projection (on by default) is most of a conversion's quality: switched off, the
    held-out error of a 256-neuron FFN into 8 experts, top-2, rose from about 0.51 to 0.80 and no test saw it."""
    dense, tokens = _quiet(lambda: llama(intermediate_size=256)), ids(16, 64)  # 1024 tokens: 128 held out
    errors = {refit: [layer.error for layer in convert(dense, num_experts=8, top_k=2, calibration=tokens,
                                                        refit=refit)[1].converted] for refit in (True, False)}
    assert len(errors[True]) == len(errors[False]) == 2
    assert all(fitted < 0.8 * plain for fitted, plain in zip(errors[True], errors[False])), errors
