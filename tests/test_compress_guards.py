"""moelens.compress: what a conversion must not do, and what it must refuse.

LoRA adapters that leave copies independent and pickle; FFNs whose forward is not what their weights
say, FFNs inside MoE blocks and FFNs shared between places stay dense with the reason, and a second pass lists the
blocks the first converted; the user's RNG, training flags and hooks are left alone; gate_proj is no router; bad
seeds, calibration data and grouped_mm for a float64 model raise `CompressionError`. Ground truth: the models' own
outputs, torch's RNG stream, module attributes.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from transformers import BitNetConfig, BitNetForCausalLM, FalconH1Config, FalconH1ForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import moelens
from moelens.compress import (CompressionError, NothingToConvert, ToMoEBlock, ToMoELinear, ToMoERouter, ToMoESharedExpert,
                              exportable, merge_lora, set_experts_implementation, tomoe)
from moelens.compress.targets import protected_reason
from moelens.testing import tiny_inputs, tiny_model
from test_compress_helpers import VOCAB, bert, convert, gpt2, ids, llama, randomised, run

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def quiet(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build().eval()


def with_trained_adapters(model):
    """``model`` with every LoRA ``B`` random, so the adapters change the output."""
    return randomised(model, "lora_B", 0.1, seed=3)


# -- LoRA adapters ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [llama, gpt2], ids=["swiglu", "gpt2"])
def test_exportable_and_merge_lora_of_a_copy_leave_the_model_working(make):
    tokens = ids()
    converted, _ = convert(make(), num_experts=4, top_k=2, calibration=tokens, lora_r=2)
    converted = with_trained_adapters(converted)
    before = run(converted, tokens)
    gated = exportable(converted)
    torch.testing.assert_close(run(gated, tokens), before, atol=1e-5, rtol=1e-5)  # the copy merged the adapters
    torch.testing.assert_close(run(converted, tokens), before, rtol=0, atol=0)  # the model itself is unchanged
    merged = merge_lora(copy.deepcopy(converted))
    torch.testing.assert_close(run(merged, tokens), before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run(converted, tokens), before, rtol=0, atol=0)
    assert any(name.endswith("lora_A") for name, _ in converted.named_parameters())  # its adapters are still there
    assert not any(name.endswith("lora_A") for name, _ in merged.named_parameters())


def test_a_model_with_lora_adapters_pickles_whole():
    tokens = ids()
    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=tokens, lora_r=2)
    converted = with_trained_adapters(converted)
    moelens.wrap(converted)
    loaded = pickle.loads(pickle.dumps(converted))
    torch.testing.assert_close(run(loaded, tokens), run(converted, tokens), rtol=0, atol=0)
    trainable = {name for name, p in loaded.named_parameters() if p.requires_grad and "lora_" in name}
    assert len(trainable) == 2 * 2 * 3  # 2 layers x (A, B) x (gate_up_proj, down_proj, router weight)


# -- FFNs that stay dense --------------------------------------------------------------------------------


def bitnet():
    """BitNet's FFN: gate/up/down and act_fn, with an RMSNorm (ffn_sub_norm) before down."""
    return quiet(lambda: BitNetForCausalLM(BitNetConfig(**SMALL)))


def falcon_h1(multipliers):
    """Falcon-H1's FFN: gate/up/down and act_fn, gate and down scaled by ``mlp_multipliers``."""
    config = FalconH1Config(**SMALL, mlp_multipliers=multipliers, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                            mamba_d_state=8, mamba_chunk_size=8)
    return quiet(lambda: FalconH1ForCausalLM(config))


@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "weights-only"])
@pytest.mark.parametrize("make", [bitnet, lambda: falcon_h1([1.0, 3.0]), lambda: falcon_h1([1.0, 1.05])],
                         ids=["bitnet", "falcon_h1", "falcon_h1-near-1"])
def test_ffns_that_only_look_like_swiglu_are_refused_naming_why(make, calibrated):
    """Every FFN skipped before a fit (here: its forward is not what its weights compute) returned the model
    unconverted with a logged warning; the docs promise NothingToConvert listing the skips, as the error gate's
    rejections (after a fit, below) do not."""
    dense, tokens = make(), ids()
    before = run(dense, tokens)
    skip = r"model\.layers\.{}\.\w+: its forward does more than down\(act\(gate\(x\)\) \* up\(x\)\)"
    with pytest.raises(NothingToConvert, match=rf"nothing to convert in \w+: every candidate layer was skipped "
                                               rf"\({skip.format(0)}.*; {skip.format(1)}"):
        convert(dense, num_experts=4, top_k=4, calibration=tokens if calibrated else None)
    assert not any(isinstance(m, ToMoEBlock) for m in dense.modules())
    torch.testing.assert_close(run(dense, tokens), before, rtol=0, atol=0)


def test_an_ffn_that_is_swiglu_in_a_new_family_still_converts():
    dense, tokens = falcon_h1([1.0, 1.0]), ids()  # multipliers of 1: exactly SwiGLU
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens)
    assert len(stats.converted) == 2 and not stats.skipped
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens), atol=2e-5, rtol=1e-5)


def test_a_second_pass_leaves_the_converted_blocks_alone():
    tokens = ids()
    first, _ = convert(llama(), num_experts=4, top_k=2, calibration=tokens, shared_neurons=16)
    with pytest.raises(NothingToConvert, match=r"layers.0.mlp.shared_experts: inside the converted block "
                                               r"model.layers.0.mlp \(ToMoEBlock\)"):
        convert(first, num_experts=4, top_k=2, calibration=tokens)
    second, stats = convert(first, num_experts=4, top_k=2, calibration=tokens, target_modules=r".*")
    assert all(".self_attn." in name for name in stats.converted_layers) and len(stats.converted) == 8
    assert "inside the converted block" in stats.skipped_layers["model.layers.0.mlp.shared_experts"]
    for layer in second.model.layers:
        assert type(layer.mlp.shared_experts) is ToMoESharedExpert
        assert all(type(getattr(layer.mlp.shared_experts, part)) is torch.nn.Linear
                   for part in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("make", [llama, bert], ids=["swiglu", "bert"])
def test_a_second_pass_lists_the_blocks_the_first_converted_as_skipped(make):
    tokens = ids()
    first, done = convert(make(), num_experts=4, top_k=2, calibration=tokens)
    assert len(done.converted) == 2
    with pytest.raises(NothingToConvert) as refused:
        convert(first, num_experts=8, top_k=2, calibration=tokens)
    for name in done.converted_layers:  # what the first pass converted, with the reason
        assert re.search(rf"{re.escape(name)}: a block converted by an earlier tomoe pass \(ToMoE\w*Block\)",
                         str(refused.value)), (name, str(refused.value))


def test_a_second_pass_lists_converted_layers_only_where_it_would_convert():
    tokens = ids()
    attention, done = convert(llama(), num_experts=4, top_k=2, calibration=tokens, target_attention_only=True)
    with pytest.raises(NothingToConvert) as refused:  # the attention Linear layers again
        convert(attention, num_experts=4, top_k=2, calibration=tokens, target_attention_only=True)
    for name in done.converted_layers:
        assert f"{name}: a block converted by an earlier tomoe pass (ToMoELinear)" in str(refused.value)
    _, stats = convert(attention, num_experts=4, top_k=2, calibration=tokens)  # the FFNs: the attention is no target
    assert stats.converted_layers == ["model.layers.0.mlp", "model.layers.1.mlp"] and not stats.skipped


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_the_shared_expert_of_a_models_own_moe_block_stays_as_it_is(family):
    dense = tiny_model(family)
    inputs = tiny_inputs(dense, batch=4, seq=8)
    converted, stats = convert(dense, num_experts=4, top_k=2, calibration=inputs)
    assert stats.converted_layers == ["model.layers.0.mlp"]  # the one dense FFN
    moe_blocks = [name for name, m in dense.named_modules() if name.endswith(".mlp") and name != "model.layers.0.mlp"]
    for name in moe_blocks:
        shared = next(n for n in stats.skipped_layers if n.startswith(name + "."))
        assert stats.skipped_layers[shared].startswith(f"inside the MoE block {name} ")
        assert type(converted.get_submodule(shared)) is type(dense.get_submodule(shared))
    wrapped = moelens.wrap(converted)
    assert [m.path.removeprefix("model.") for m in wrapped.moes] == ["model.layers.0.mlp"] + moe_blocks
    with wrapped.trace(tiny_inputs(dense)["input_ids"]):  # every block read in order (nested blocks broke this)
        for moe in wrapped.moes:
            moe.save_all()


def test_an_ffn_shared_between_layers_stays_dense_and_shared():
    tokens = ids()
    dense = llama(num_hidden_layers=3)
    dense.model.layers[2].mlp = dense.model.layers[0].mlp  # one module at two places
    converted, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens)
    assert stats.converted_layers == ["model.layers.1.mlp"]
    assert stats.skipped_layers["model.layers.0.mlp"].startswith("shares weights with model.layers.2.mlp.")
    assert converted.model.layers[0].mlp is converted.model.layers[2].mlp
    assert type(converted.model.layers[0].mlp).__name__ == "LlamaMLP"

    tied = llama(num_hidden_layers=3)
    for part in ("gate_proj", "up_proj", "down_proj"):  # separate modules, tied weights
        getattr(tied.model.layers[2].mlp, part).weight = getattr(tied.model.layers[0].mlp, part).weight
    converted, stats = convert(tied, num_experts=4, top_k=2, calibration=tokens)
    assert stats.converted_layers == ["model.layers.1.mlp"]
    assert "model.layers.0.mlp.gate_proj" in stats.skipped_layers["model.layers.2.mlp"]
    assert converted.model.layers[0].mlp.up_proj.weight is converted.model.layers[2].mlp.up_proj.weight


# -- what the user owns ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lora_r", "shared_neurons"), [(0, 0), (4, 0), (0, 8)])
def test_tomoe_leaves_torchs_random_stream_alone(lora_r, shared_neurons):
    """With shared neurons the shared expert's nn.Linear layers drew their default initialisation from it."""
    dense, tokens = llama(intermediate_size=256), ids(8, 32)  # 256 neurons, 256 tokens: the truncated SVD runs
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    convert(dense, num_experts=4, top_k=2, calibration=tokens, lora_r=lora_r, shared_neurons=shared_neurons)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_the_seed_alone_decides_the_lora_adapters_start():
    def adapters(global_seed, seed):
        torch.manual_seed(global_seed)
        converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids(), lora_r=4, seed=seed)
        return {name: p for name, p in converted.named_parameters() if "lora_A" in name}

    first, again, other = adapters(1, seed=3), adapters(2, seed=3), adapters(1, seed=4)
    assert first and first.keys() == again.keys() == other.keys()
    for name in first:
        torch.testing.assert_close(again[name], first[name], rtol=0, atol=0)
    assert all(not torch.equal(other[name], first[name]) for name in first)
    router_a = [p for name, p in first.items() if "router" in name]
    assert len(router_a) >= 2 and not torch.equal(router_a[0], router_a[1])  # each block draws its own


def test_each_modules_training_flag_is_kept():
    dense = llama()
    dense.train()
    dense.model.layers[1].self_attn.eval()
    dense.model.embed_tokens.eval()
    before = {name: module.training for name, module in dense.named_modules()}
    converted, _ = convert(dense, num_experts=4, top_k=2, calibration=ids())
    assert {n: m.training for n, m in converted.named_modules() if n in before} == {
        n: t for n, t in before.items() if n in dict(converted.named_modules())}
    convert(dense, num_experts=4, top_k=2, calibration=ids(), inplace=True)
    assert {n: m.training for n, m in dense.named_modules() if n in before} == {
        n: t for n, t in before.items() if n in dict(dense.named_modules())}


def test_the_calibration_of_a_copy_does_not_call_the_users_hooks():
    dense, tokens = llama(), ids()
    calls = []
    dense.model.layers[1].register_forward_hook(lambda module, args, output: calls.append(output.shape))
    converted, _ = convert(dense, num_experts=4, top_k=2, calibration=tokens)
    assert calls == []
    run(dense, tokens)
    run(converted, tokens)  # both keep the hook
    assert len(calls) == 2
    # transformers' own hooks, installed on the copy's first forward (the calibration), still work
    with torch.no_grad():
        states = converted(input_ids=tokens, output_hidden_states=True).hidden_states
    assert len(states) == 3


def test_shared_neurons_leave_at_least_two_neurons_per_expert():
    """Without shared neurons a layer needs 2 neurons per expert; with them, 64 - 2 * 4 = 56 shared neurons of 64
    for 4 experts is the most. Before, 57 to 59 built experts of 1 neuron, and 60 was refused saying it left fewer
    neurons than experts (it left exactly as many). Ground truth: the built block's neuron index and shared expert."""
    tokens = ids()
    converted, stats = convert(llama(), num_experts=4, top_k=2, calibration=tokens, shared_neurons=56)
    block = converted.model.layers[0].mlp
    assert block.shared_experts.num_neurons == 56 and stats.converted[0].expert_sizes == [2, 2, 2, 2]
    assert (block.neuron_index >= 0).sum(-1).tolist() == [2, 2, 2, 2]  # each expert's dense neurons (-1: padding)
    everyone = torch.cat([block.shared_index, block.neuron_index[block.neuron_index >= 0]])
    assert sorted(everyone.tolist()) == list(range(64))  # every neuron once: shared or in one expert
    for shared in (57, 60):
        message = (rf"shared_neurons={shared} leaves {64 - shared} of its 64 intermediate neurons for 4 experts, fewer "
                   r"than 2 per expert: pass shared_neurons=56 or fewer \(or fewer experts\)")
        with pytest.raises(NothingToConvert, match=message):
            convert(llama(), num_experts=4, top_k=2, calibration=tokens, shared_neurons=shared)


def test_gate_proj_is_an_ffn_projection_not_a_router():
    dense, tokens = llama(), ids()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens, target_modules=["gate_proj"])
    assert stats.converted_layers == ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj"]
    assert isinstance(converted.model.layers[0].mlp.gate_proj, ToMoELinear)
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens), atol=2e-5, rtol=1e-5)
    for router in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "model.layers.0.router"):
        assert protected_reason(router)


# -- bad input -----------------------------------------------------------------------------------------------


def test_a_seed_outside_what_kmeans_takes_is_refused():
    for seed in (-1, 2**32):
        with pytest.raises(CompressionError, match=rf"seed must be in \[0, 2\*\*32\).*got {seed}"):
            tomoe(llama(), seed=seed)
    _, stats = convert(llama(), num_experts=4, top_k=2, calibration=ids(), seed=2**32 - 1)
    assert len(stats.converted) == 2


@pytest.mark.parametrize("make", [gpt2, bert], ids=["gpt2", "bert"])
def test_calibration_longer_than_the_positions_is_refused(make):
    # learned position embeddings: 64 positions
    with pytest.raises(CompressionError, match=r"input_ids \[1, 100\].*100 tokens long, longer than the "
                                               r"model's 64 positions .*split them"):
        convert(make(), calibration=ids(1, 100))


def test_calibration_past_a_rotary_models_positions_is_warned_of():
    """A rotary model runs past its max_position_embeddings (64 here), where it was never trained: tomoe fitted
    those activations without a word, while collect_routing and to_nnef refuse such lengths."""
    with pytest.warns(UserWarning, match=r"tomoe: calibration sequences of up to 100 tokens run past the model's 64 "
                                         r"positions \(config.max_position_embeddings\).*at most 64 tokens"):
        convert(llama(), num_experts=4, top_k=2, calibration=[ids(2, 30), ids(1, 100)])
    padded = {"input_ids": ids(2, 100), "attention_mask": torch.ones(2, 100, dtype=torch.long)}
    padded["attention_mask"][:, 60:] = 0  # right padding: 60 real tokens, within the positions
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tomoe: calibration sequences")
        convert(llama(), num_experts=4, top_k=2, calibration=[ids(2, 64), padded])


def test_a_vision_towers_position_table_is_not_the_texts():
    """A vision-language model's vision tower holds a learned position table (glm4v's
    ``visual.embeddings.position_embedding``): it was taken for the text's, so a rotary text decoder's calibration
    past its positions went unwarned and a failed batch got a hint of a limit it does not have."""
    from moelens.compress.calibration import _learned_positions

    class VisionLanguage(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)  # a rotary text decoder: no position table beside it
            self.visual = nn.Module()
            self.visual.position_embedding = nn.Embedding(16, 4)

        def get_input_embeddings(self):
            return self.embed_tokens

    from transformers import BartConfig, BartForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    assert not _learned_positions(VisionLanguage()) and not _learned_positions(llama())
    assert _learned_positions(gpt2()) and _learned_positions(bert())  # wpe, embeddings.position_embeddings
    assert _learned_positions(bart)  # embed_positions beside the encoder's embed_tokens, which shares `shared`'s weight


@pytest.mark.parametrize("make", [llama, gpt2], ids=["rotary", "learned positions"])
def test_out_of_vocabulary_ids_are_named_before_the_length(make):
    """Ids past the vocabulary fail in the embedding (IndexError). The hint said the 100-token sequences were
    longer than the model's 64 positions even for a rotary model, for which that is no limit (it converts
    sequences of 100 tokens): the real cause went unsaid. Ground truth: the model's input embedding has VOCAB rows,
    and the same ids taken into the vocabulary convert."""
    model = make()
    tokens = ids(2, 100 if make is llama else 10)
    tokens[0, 3] = VOCAB + 5
    with pytest.raises(CompressionError, match=rf"IndexError: .*\. Token ids outside the model's vocabulary of "
                                               rf"{VOCAB}: 1 of {tokens.numel()} \(ids from \d+ to {VOCAB + 5}; the "
                                               rf"model takes 0 to {VOCAB - 1}\): tokenize with this model's own "
                                               rf"tokenizer") as refused:
        convert(model, num_experts=4, top_k=2, calibration=tokens)
    assert "positions" not in str(refused.value)
    tokens[0, 3] = 5
    assert len(convert(model, num_experts=4, top_k=2, calibration=tokens)[1].converted) == 2


@pytest.mark.parametrize("calibration, message", [
    (torch.tensor(5), r"tensor\(5\) is a single number \(0-d\); pass token ids"),
    (torch.rand(2, 8), r"arg 0 \[2, 8\] float32.*float32, but LlamaForCausalLM takes integer token ids"),
], ids=["0-d", "float"])
def test_calibration_that_is_no_token_ids_is_refused(calibration, message):
    with pytest.raises(CompressionError, match=message):
        convert(llama(), calibration=calibration)


def _forwards_of(model, calibration, **settings):
    """Convert ``model`` in place on ``calibration``; returns ``(stats, calls)``, ``calls`` holding each calibration
    forward's ``(args, kwargs)`` as a torch forward pre-hook on the model itself saw them."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, dict(kwargs))),
                                             with_kwargs=True)
    try:
        _, stats = convert(model, num_experts=4, top_k=2, calibration=calibration, inplace=True, **settings)
    finally:
        handle.remove()
    return stats, calls


def test_a_top_level_tuple_is_one_call_of_the_models_positional_arguments():
    """calibration=(ids, mask) is the model's positional call, as documented (input_ids=ids, attention_mask=mask),
    the same as [(ids, mask)]. Before, a top-level tuple was iterated as a list: two forwards, the second running
    the 0/1 mask as token ids, and the padding counted as real tokens. Ground truth: a forward pre-hook on the
    model recording what each calibration forward got, mask.sum(), and the model converted on [(ids, mask)]."""
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, :6] = 0  # left padding: 40 real tokens
    stats, calls = _forwards_of(llama(), (tokens, mask))
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert args == () and kwargs["input_ids"] is tokens and kwargs["attention_mask"] is mask
    listed, listed_calls = _forwards_of(llama(), [(tokens, mask)])
    assert len(listed_calls) == 1 and stats.calibration_tokens == listed.calibration_tokens == int(mask.sum())
    top, _ = convert(llama(), num_experts=4, top_k=2, calibration=(tokens, mask))
    expected, _ = convert(llama(), num_experts=4, top_k=2, calibration=[(tokens, mask)])
    torch.testing.assert_close(run(top, tokens), run(expected, tokens), rtol=0, atol=0)


def test_one_dataloader_batch_given_as_the_calibration_list_is_refused():
    """next(iter(DataLoader(TensorDataset(ids, mask)))) is the list [ids, mask]; given as calibration, the list's
    items are calls, so the mask ran as a batch of token ids 0 and 1 and the padding of ids was fitted on
    (calibration_tokens 3072 where the mask holds 1152). Refused, saying how to pass the one batch; the DataLoader
    itself calibrates on the real tokens (ground truth: mask.sum())."""
    from torch.utils.data import DataLoader, TensorDataset

    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, :6] = 0
    loader = DataLoader(TensorDataset(tokens, mask), batch_size=4)
    batch = next(iter(loader))
    assert isinstance(batch, list)
    with pytest.raises(CompressionError, match=r"calibration is a list of tensors whose item 1 is shaped like item 0 "
                                               r"\[4, 16\] and holds only 0 and 1: an attention mask.*tuple\(batch\)"):
        convert(llama(), num_experts=4, top_k=2, calibration=batch)
    stats, calls = _forwards_of(llama(), loader)
    assert len(calls) == 1 and stats.calibration_tokens == int(mask.sum())
    two_batches, calls = _forwards_of(llama(), [tokens, ids(2, 16)])  # a list of token-id batches stays two calls
    assert len(calls) == 2


def test_a_top_level_tuple_is_refused_or_run_as_the_same_tuple_in_a_list():
    """GPT-2's second positional parameter is its cache, so (ids, mask) is refused before any forward, as
    [(ids, mask)] is; a model taking the tokenizer's dict as one positional argument (a sentence-transformers model)
    calibrates with (features,) as with [(features,)]. Before, the top-level tuple was iterated: GPT-2 ran the mask
    as token ids, and (features,) was run as model(**features) and refused, telling the user to pass a tuple."""
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 12:] = 0
    message = (r"calibration item 0 holds, as positional argument 1, an integer tensor shaped like the token ids "
               r"\[4, 16\] .*Pass each batch as a dict")
    for calibration in ([(tokens, mask)], (tokens, mask)):
        with pytest.raises(CompressionError, match=message):
            _forwards_of(gpt2(), calibration)
    model, ran = gpt2(), []
    model.register_forward_pre_hook(lambda module, args: ran.append(args))
    with pytest.raises(CompressionError, match=message):
        convert(model, num_experts=4, top_k=2, calibration=(tokens, mask), inplace=True)
    assert ran == []  # refused before any forward

    class Features(nn.Module):
        """A sentence-transformers-like model: its forward takes the tokenizer's dict as one positional argument."""

        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, 32)
            self.mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu"))

        def forward(self, features: dict) -> torch.Tensor:
            return self.mlp(self.embed_tokens(features["input_ids"]))

    features = {"input_ids": tokens, "attention_mask": mask}
    stats, calls = _forwards_of(quiet(Features), (features,))
    assert len(calls) == 1 and calls[0][1] == {} and len(calls[0][0]) == 1  # model(features)
    assert all(calls[0][0][0][key] is value for key, value in features.items())
    listed, _ = _forwards_of(quiet(Features), [(features,)])
    assert stats.converted_layers == listed.converted_layers == ["mlp"]
    assert stats.calibration_tokens == listed.calibration_tokens == int(mask.sum())


def test_a_model_that_ran_keeps_transformers_own_hooks_during_calibration():
    """A model's first forward installs transformers' output-capturing hooks (router logits for the aux
    loss): calibrating a copy must keep them, while the user's own hooks stay off."""
    model = tiny_model("mixtral", output_router_logits=True)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0)).to(model.device)
    model(input_ids=ids, labels=ids)
    converted = tomoe(model, num_experts=2, top_k=1, calibration=ids, target_attention_only=True, max_error=10.0)
    assert torch.isfinite(converted(input_ids=ids, labels=ids).aux_loss)


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half()], ids=["to_bfloat16", "half"])
def test_casting_a_converted_model_keeps_its_routers_float32(cast):
    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids(), lora_r=2)
    routers = [m for m in converted.modules() if isinstance(m, ToMoERouter)]
    before = {name: p.clone() for name, p in converted.named_parameters() if ".router." in name}
    low = cast(converted)
    after = dict(low.named_parameters())
    assert routers and before
    for name, weight in before.items():  # bias with the offset, weight, LoRA adapters: untouched
        assert after[name].dtype == torch.float32 and torch.equal(after[name], weight), name
    assert next(low.model.layers[0].mlp.experts.parameters()).dtype != torch.float32  # the rest was cast
    hidden = torch.randn(16, 32).to(next(low.model.layers[0].mlp.experts.parameters()).dtype)
    logits = routers[0](hidden)[0]
    torch.testing.assert_close(logits, hidden.float() @ routers[0].weight.T + routers[0].bias, rtol=0, atol=0)


def test_a_float64_model_is_refused_with_grouped_mm_and_converts_with_batched_mm_or_eager():
    dense, tokens = llama().double(), ids()
    with pytest.raises(CompressionError, match=r"experts_implementation='grouped_mm' cannot run the model's float64 "
                                               r"weights .*pass experts_implementation='batched_mm' or 'eager', or "
                                               r"convert a float32 copy \(model.float\(\)\)"):
        convert(dense, num_experts=4, top_k=2, calibration=tokens, inplace=True)
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in dense.model.layers)  # refused before any work
    for implementation in ("batched_mm", "eager"):  # every expert runs: the dense model's float64 output
        converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens,
                                   experts_implementation=implementation)
        experts = converted.model.layers[0].mlp.experts
        assert len(stats.converted) == 2 and next(experts.parameters()).dtype == torch.float64
        torch.testing.assert_close(run(converted, tokens), run(dense, tokens), rtol=1e-9, atol=1e-9)
    with pytest.raises(CompressionError, match=r"'grouped_mm' cannot run the converted experts' float64 weights"):
        set_experts_implementation(converted, "grouped_mm")
    with pytest.raises(moelens.MoelensError, match=r"model.layers.0.mlp's experts hold float64 weights, which "
                                                   r"torch's grouped_mm does not run"):
        moelens.wrap(converted).set_experts_implementation("grouped_mm")  # the wrapper's switch refuses alike
    torch.testing.assert_close(run(converted, tokens), run(dense, tokens), rtol=1e-9, atol=1e-9)  # still eager


def test_the_compressor_functions_refuse_a_wrapped_model_by_name():
    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids(), lora_r=2)
    wrapped = moelens.wrap(converted)
    calls = {
        "tomoe": lambda: tomoe(wrapped, num_experts=4, top_k=2, progress=False),
        "merge_lora": lambda: merge_lora(wrapped),
        "set_experts_implementation": lambda: set_experts_implementation(wrapped, "eager"),
        "exportable": lambda: exportable(wrapped),
    }
    for name, call in calls.items():  # each did nothing (the wrapper's modules are envoys) and said nothing
        with pytest.raises(CompressionError, match=rf"^{name} takes the torch model, got the nnsight wrapper "
                                                   r"MoeNNsight: pass the model it wraps \(model._module\)"):
            call()
    assert any("lora" in name for name, _ in converted.named_modules())  # nothing was merged
    for bad in (None, "model"):
        with pytest.raises(CompressionError, match=r"^merge_lora takes a torch model \(nn.Module\), got"):
            merge_lora(bad)


@pytest.mark.parametrize("where", ["model.layers.1.mlp", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"])
def test_a_layer_carrying_a_users_hook_stays_as_it_is(where):
    """The conversion replaced the hooked modules, so the hook stopped running without a word."""
    dense = llama()
    ran = []
    dense.get_submodule(where).register_forward_hook(lambda module, args, output: ran.append(where))
    tokens = ids()
    attention = where.endswith("q_proj")
    converted, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens, target_attention_only=attention)
    hooked = where if attention else "model.layers.1.mlp"
    assert [s.reason for s in stats.skipped if s.name == hooked] == [
        f"a hook of yours on {'Linear' if attention else 'LlamaMLP'}{'.down_proj' if where.endswith('down_proj') else ''} "
        "(a module the conversion replaces) would be dropped: remove it (handle.remove()) to convert this layer"]
    assert hooked not in {layer.name for layer in stats.converted} and stats.converted  # the others still convert
    ran.clear()
    run(converted, tokens)
    assert ran == [where]  # the hook still runs, on the layer left as it was


@pytest.mark.parametrize(("factory", "names", "message"), [
    (None, ("broken",), r"register_compressor takes a callable factory\(model, \*\*settings\) first, got NoneType"),
    (lambda model, **settings: model, (None,), r"register_compressor's names must be non-empty strings, got None"),
    (lambda model, **settings: model, ("",), r"register_compressor's names must be non-empty strings, got ''"),
    (lambda model, **settings: model, ("mine", "tomoe"), r"compressor name\(s\) \['tomoe'\] are registered to "
                                                         r".*ToMoECompressor.*pass replace=True"),
])
def test_register_compressor_refuses_what_it_could_not_call_or_find(factory, names, message):
    """A None factory was registered (get_compressor then returned None, which failed when called) and a None name
    listed among the compressors."""
    from moelens.compress import compressors, register_compressor

    before = compressors()
    with pytest.raises(CompressionError, match=message):
        register_compressor(factory, *names)
    assert compressors() == before


def test_register_compressor_replaces_a_taken_name_when_asked():
    from moelens.compress import ToMoECompressor, compressors, get_compressor, register_compressor

    def mine(model, **settings):
        return model

    before = compressors()
    for flag in ("False", "no"):  # a true string replaced moelens' own tomoe
        with pytest.raises(CompressionError, match=rf"replace must be True or False, got {flag!r}"):
            register_compressor(mine, "tomoe", replace=flag)
    assert compressors() == before
    try:
        assert register_compressor(mine, "tomoe", replace=True) is mine and get_compressor("tomoe") is mine
        register_compressor(mine, "tomoe")  # the same factory again: nothing to replace
    finally:
        register_compressor(ToMoECompressor, "tomoe", replace=True)
    assert compressors() == before


@pytest.mark.parametrize("sizes", [(16, 4, 9), ("16", 4, 2), (16, 0, 1), (16, 4, 2.0), (16, 4, 2, float("nan"))],
                         ids=str)
def test_a_router_of_impossible_sizes_is_refused_when_built(sizes):
    """ToMoERouter(128, 4, 9) was built and failed when it ran with torch's "selected index k out of range"."""
    from moelens.compress import ToMoERouter

    with pytest.raises(CompressionError, match=r"ToMoERouter\(hidden_size=.*the sizes must be integers of at least 1 "
                                               r"with top_k <= num_experts, and the offset a finite number"):
        ToMoERouter(*sizes)
    router = ToMoERouter(np.int64(16), torch.tensor(4), 4)
    assert (router.top_k, router.num_experts) == (4, 4) and type(router.top_k) is int
    assert router(torch.randn(3, 16))[2].shape == (3, 4)


def test_switching_the_experts_of_a_model_with_no_converted_block_is_refused():
    from moelens.compress import set_experts_implementation

    with pytest.raises(CompressionError, match=r"LlamaForCausalLM holds no block converted by moelens.compress, so "
                                               r"set_experts_implementation has nothing to switch"):
        set_experts_implementation(llama(), "eager")


def roberta() -> nn.Module:
    """RoBERTa counts positions past its padding id itself (real tokens from padding_idx + 1)."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    return RobertaModel(RobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, pad_token_id=1)).eval()


@pytest.mark.parametrize("make", [gpt2, bert, roberta], ids=["gpt2", "bert", "roberta"])
def test_left_padded_calibration_sees_each_text_at_its_own_positions(make):
    """Left-padded rows were run without position_ids: a model with learned position embeddings saw their real tokens
    at the padding's positions (not what generate or a trace gives it), and was calibrated on those inputs. RoBERTa,
    which counts positions past the padding itself, was then given positions from 0 (off by its padding id + 1)."""
    from moelens.compress import calibration

    model = make()
    pad = model.config.pad_token_id or 0
    long, short = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[11, 12, 13]])
    batch = {"input_ids": torch.cat([long, torch.cat([torch.full((1, 3), pad), short], 1)]),
             "attention_mask": torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])}
    module = model.transformer.h[1].mlp if make is gpt2 else model.encoder.layer[1].intermediate
    seen = []
    handle = module.register_forward_pre_hook(lambda _, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=long)
        model(input_ids=short)
    handle.remove()
    captured = calibration.capture(model, calibration.batches(batch), {"ffn": module})["ffn"]
    torch.testing.assert_close(captured, torch.cat(seen), atol=1e-5, rtol=1e-5)


def test_calibration_ids_of_three_dimensions_leave_their_padding_out_and_a_mask_shaped_unlike_them_is_refused():
    """GPT-2 flattens [3, 4, 16] ids (input_ids.view(-1, seq)) and ran them, while the 3-D mask was not read: 192
    positions were fitted on where 120 are real tokens. Such ids are legitimate (a multiple-choice head takes
    [batch, choices, seq] and cannot take them flattened): the padding is left out over [-1, seq]. Ground truth: the
    same ids and mask as [12, 16], counted by mask.sum(), and the model converted from them. A mask shaped unlike the
    ids was blamed on a module running on parts of the sequence (padded, refused; all ones, taken without a word)."""
    model = gpt2()
    tokens = torch.randint(3, VOCAB, (3, 4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[..., 10:] = 0
    deep, deep_stats = convert(model, num_experts=4, top_k=2, calibration={"input_ids": tokens, "attention_mask": mask})
    flat = {"input_ids": tokens.reshape(12, 16), "attention_mask": mask.reshape(12, 16)}
    flat_model, flat_stats = convert(model, num_experts=4, top_k=2, calibration=flat)
    assert deep_stats.calibration_tokens == flat_stats.calibration_tokens == int(mask.sum()) == 120
    torch.testing.assert_close(run(deep, ids(2, 16)), run(flat_model, ids(2, 16)))
    for given, shape in ((flat["input_ids"], (12, 15)), (flat["input_ids"], (6, 16)), (tokens, (3, 4, 15))):
        mask_shape, ids_shape = ", ".join(map(str, shape)), ", ".join(map(str, given.shape))
        with pytest.raises(CompressionError, match=rf"calibration attention_mask of shape \[{mask_shape}\] does not "
                                                   rf"match input_ids \[{ids_shape}\]"):
            convert(model, num_experts=4, top_k=2,
                    calibration={"input_ids": given, "attention_mask": torch.ones(shape, dtype=torch.long)})


def test_a_multiple_choice_heads_calibration_is_taken_with_its_padding_left_out():
    """BertForMultipleChoice takes [batch, choices, seq] ids (it cannot run them flattened to [-1, seq]): they were
    refused, with advice the model fails on. Ground truth: mask.sum() real tokens."""
    from transformers import BertConfig, BertForMultipleChoice
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64)
    model = quiet(lambda: BertForMultipleChoice(config))
    tokens = torch.randint(3, VOCAB, (4, 3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[..., 10:] = 0
    stats = convert(model, num_experts=4, top_k=2, calibration={"input_ids": tokens, "attention_mask": mask})[1]
    assert stats.calibration_tokens == int(mask.sum()) == 120
    assert convert(model, num_experts=4, top_k=2, calibration=tokens)[1].calibration_tokens == tokens.numel()


def test_padding_a_chunked_feed_forward_cannot_tell_apart_is_refused():
    """BERT's chunked feed-forward runs on parts of the sequence, whose shape does not fit the mask: every row,
    padding included, was calibrated on and counted."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, chunk_size_feed_forward=4)).eval()
    tokens = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1:, 6:] = 0
    with pytest.raises(CompressionError, match=r"encoder.layer.0.intermediate's input of shape \(4, 4, 32\) does not "
                                               r"fit the batch's attention_mask \(4, 16\)"):
        convert(model, num_experts=4, top_k=2, calibration={"input_ids": tokens, "attention_mask": mask})
    converted, stats = convert(model, num_experts=4, top_k=2, max_error=None,
                               calibration={"input_ids": tokens, "attention_mask": torch.ones_like(mask)})
    assert stats.calibration_tokens == 64


@pytest.mark.parametrize("make", [llama, gpt2], ids=["linear", "gpt2"])
def test_exportable_keeps_frozen_experts_and_a_fixed_placement_frozen(make):
    """exportable() made every gated-form weight a trainable Parameter: frozen experts (freeze_experts, the default)
    and ToMoELinear's fixed 0/1 placement (a buffer) came out trainable."""
    from moelens.compress import exportable

    settings = {"target_attention_only": True} if make is llama else {}
    converted, _ = convert(make(), num_experts=4, top_k=2, calibration=ids(8, 16), **settings)
    for module in exportable(converted).modules():
        if type(module).__name__ == "ToMoEGatedExperts":
            assert not [name for name, param in module.named_parameters() if param.requires_grad], module
