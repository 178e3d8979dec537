"""Contracts pinned by the stop-26 mutation round: a refused write of a value read at the same visit keeps that
read's in-place edit; the window length is checked against the text decoder's context, a non-positive context
means none, and a max_length that is no count is refused by name; stacked or zero-compute-padded expert
parameters of the wrong length are refused, not cut; calibration keeps every row of an FFN whose input does not
fit the mask (a sequence-first model) and ignores a mask that is not [batch, seq] (a 4-D additive mask); export
refuses ungated experts with a router bias alone or with expert biases alone.

Ground truth, independent of moelens: the unwrapped copy of the model run with a torch pre-hook making the same
edit, the configs' numbers, the tensors' own shapes, the embedding rows a plain forward computes, and tract's
binding order (its bias inputs come after w3, which ungated experts lack).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import moelens
from groundtruth import built, first_tensor
from moelens.analysis import corpus as corpora
from moelens.compress import calibration as cal
from moelens.errors import MoelensError, ValueUnavailable
from moelens.testing import tiny_model
from test_compress_helpers import VOCAB, gpt2, ids
from test_compress_helpers import convert as convert_with_stats
from test_served_contracts import GRAD_MODES, with_first_slot_zeroed

# -- served: a refused write of the value read keeps its in-place edit ------------------------------------------


@pytest.mark.parametrize("mode", ["no_grad", "autograd", "inference_mode"])
def test_a_refused_write_of_the_value_read_keeps_its_in_place_edit(mode):
    """expert_weights read and edited in place, then a write of expert_weights itself refused (wrong shape) and
    caught: the write never happened, so the edit made before it must still reach the model (with autograd on or
    under inference_mode the view is a copy only the write-back carries back). Ground truth: the unwrapped model
    with the first slot's weight zeroed by a pre-hook on its experts."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "batched_mm")
    moe = wrapped.moes[1]
    expected = with_first_slot_zeroed(reference, moe, inputs)
    assert not torch.equal(expected, plain)
    with GRAD_MODES[mode](), wrapped.trace(**inputs):
        weights = moe.expert_weights
        weights[..., 0] = 0
        try:
            moe.expert_weights = torch.zeros(3, 3)
        except moelens.WriteError:
            pass
        edited = first_tensor(wrapped.output).save()
    torch.testing.assert_close(edited.detach(), expected, atol=1e-6, rtol=1e-6)


# -- analysis: the window length ----------------------------------------------------------------------------------


class _Composite:
    """A composite config (a vision-language model's): max_position_embeddings only in its text config."""

    def __init__(self, context: int) -> None:
        self.text = SimpleNamespace(max_position_embeddings=context)

    def get_text_config(self):
        return self.text


def test_the_window_is_checked_against_the_text_decoders_context():
    model = SimpleNamespace(config=_Composite(128))
    assert corpora.default_max_length(model) == 128
    assert corpora.window_length(model, 128) == 128
    with pytest.raises(MoelensError, match=r"max_length=129 is longer than the model's context "
                                           r"\(max_position_embeddings=128\)"):
        corpora.window_length(model, 129)


@pytest.mark.parametrize("context", [0, -1])
def test_a_context_that_is_no_positive_count_bounds_no_window(context):
    """default_max_length reads a non-positive max_position_embeddings as no limit (512): a longer max_length
    asked for is taken, not refused as longer than a context of 0."""
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
    assert corpora.default_max_length(model) == 512
    assert corpora.window_length(model, 1024) == 1024


@pytest.mark.parametrize("value", ["64", 0, 2.5])
def test_a_max_length_that_is_no_count_is_refused_by_name(value):
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32))
    with pytest.raises(MoelensError, match=r"max_length must be an integer of at least 1"):
        corpora.window_length(model, value)


# -- params: parameters of the wrong length are refused, not cut ---------------------------------------------------


def test_a_stacked_bias_whose_rows_are_no_multiple_of_the_experts_is_refused():
    """dbrx stacks its experts' rows ([E*H, ...]): a bias of E*H + 1 rows is no per-expert bias."""
    model = moelens.wrap(tiny_model("dbrx"))
    moe = model.moes[0]
    glu = moe.experts._module.mlp
    glu.w1_bias = torch.nn.Parameter(torch.randn(glu.w1.shape[0] + 1))
    with pytest.raises(ValueUnavailable, match=rf"w1_bias has shape \({glu.w1.shape[0] + 1},\)"):
        moe.params()


def test_a_parameter_with_more_rows_than_every_expert_is_refused_not_cut():
    """longcat_flash keeps gate_up_proj rows for its zero-compute experts too up to transformers 5.24 (E rows, the
    identity ones left out; 5.25 keeps only the experts with weights): a tensor with still more rows than E does not
    match the block and must not be cut to its first rows."""
    model = moelens.wrap(tiny_model("longcat_flash"))
    moe = model.moes[0]
    experts = moe.experts._module
    with_weights = moe.num_experts - moe.family.identity_count(moe._module)
    rows = experts.gate_up_proj.shape[0]
    assert rows in (moe.num_experts, with_weights) and moe.num_experts > with_weights
    assert moe.params().gate.shape[0] == with_weights
    longer = experts.gate_up_proj.detach()
    experts.gate_up_proj = torch.nn.Parameter(torch.cat([longer, longer[: moe.num_experts + 1 - rows]]))
    with pytest.raises(ValueUnavailable, match=rf"gate_up_proj has shape \({moe.num_experts + 1},"):
        moe.params()


# -- compress: calibration rows --------------------------------------------------------------------------------------


def _mlp_model(sequence_first: bool) -> nn.Module:
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, 32)
            self.mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu"))

        def forward(self, input_ids, attention_mask=None):
            hidden = self.embed_tokens(input_ids)
            return self.mlp(hidden.transpose(0, 1) if sequence_first else hidden)

    torch.manual_seed(0)
    return Model().eval()


def test_an_ffn_whose_input_is_sequence_first_keeps_the_real_rows():
    """A sequence-first model ([S, B, D], as torch's nn.Transformer without batch_first): the [B, S] mask fits its
    input transposed, so the real tokens are kept and the padding left out (every row, padding included, was kept).
    (With S == B the layout cannot be told from the shape: it is taken for batch first, as transformers' models are.)"""
    model = _mlp_model(sequence_first=True)
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    rows = cal.capture(model, cal.batches({"input_ids": tokens, "attention_mask": mask}), {"mlp": model.mlp})["mlp"]
    with torch.no_grad():
        expected = model.embed_tokens(tokens)[mask.bool()]
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)


def test_a_four_dimensional_additive_mask_is_not_read_as_padding():
    """A custom 4-D attention mask is additive (0 where a token attends): it marks no padding, so no token is
    left out and the batch is not dropped as all padding."""
    model = _mlp_model(sequence_first=False)
    tokens = ids(2, 8)
    mask = torch.zeros(2, 1, 8, 8)
    calls = cal.batches({"input_ids": tokens, "attention_mask": mask})
    rows = cal.capture(model, calls, {"mlp": model.mlp})["mlp"]
    with torch.no_grad():
        expected = model.embed_tokens(tokens).reshape(-1, 32)
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)


# -- export: ungated experts with any bias are refused ------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_gpt2_block():
    """A converted GPT-2 FFN (tomoe): ungated GELU experts with up/down biases, a router with a bias."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert_with_stats(gpt2(), calibration=ids(), num_experts=4, top_k=2)[0]
        moe = moelens.wrap(converted).moes[0]
    return moe.family, moe._module


def _without(block, *paths):
    for path in paths:
        owner, _, name = path.rpartition(".")
        module = block.get_submodule(owner)
        delattr(module, name)
        module.register_parameter(name, None)


@pytest.mark.parametrize("left", ["router bias", "expert biases"])
def test_ungated_experts_with_any_bias_are_refused(converted_gpt2_block, left):
    """tract_moe_ffn binds its bias inputs after w3, which ungated experts lack: a router bias alone, or expert
    biases alone, cannot be expressed either; with neither the block is read."""
    pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
    import copy

    from moelens.export import ExportRefused
    from moelens.export.spec import read_spec

    family, block = converted_gpt2_block
    assert block.router.bias is not None and block.experts.up_proj_bias is not None
    neither = copy.deepcopy(block)
    _without(neither, "router.bias", "experts.up_proj_bias", "experts.down_proj_bias")
    spec = read_spec(family, neither)
    assert spec.w3 is None and spec.wg_bias is None and not spec.has_expert_biases
    one = copy.deepcopy(block)
    _without(one, *(("experts.up_proj_bias", "experts.down_proj_bias") if left == "router bias" else ("router.bias",)))
    with pytest.raises(ExportRefused, match="ungated experts with biases cannot be expressed"):
        read_spec(family, one)
