"""What moelens.compress promises about its targets and its calibration pass, pinned against independent ground
truth (model configs, module classes, masks, the dense models' own forwards): neuron counts are the intermediate
width (Conv1D's transposed weight included), the size limits are inclusive and need both, PEFT adapters anywhere
on an FFN (merged ones on a Linear) keep it dense, fused gate/up FFNs are skipped with the reason, a shared FFN
stays dense whatever its sibling's name, unregistered MoE blocks are found by their dispatching experts, camel-case
attention modules count, string targets are full-match regexes, GQA's narrowest projections get two experts;
calibration: one 1-D sequence, padding off flattened inputs, each row's sequence kept, a tuple item as the
positional arguments (a sentence-transformers model's dict), a random sample from every batch, eval mode, no hook
left behind, backward hooks respected, hooks put back in order; blocks: GPT-2's dropout applies, outputs and
routing weights keep the tokens' precision, the router ranks in float32 under autocast, the straight-through
term adds nothing; stats: tied weights count once,
``as_dict`` carries each layer's active fraction."""

from __future__ import annotations

import inspect

import json
import re
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Phi3Config, Phi3ForCausalLM, T5Config, T5EncoderModel
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralExperts
from transformers.models.t5.modeling_t5 import T5Attention
from transformers.pytorch_utils import Conv1D

from moelens.compress import (CompressionError, NothingToConvert, ToMoEBlock, ToMoELinear, ToMoERouter,
                              set_experts_implementation, tomoe)
from moelens.compress import calibration as cal
from moelens.compress import targets as tg
from test_compress_helpers import VOCAB, bert, convert, gpt2, ids, inputs_of, llama, run


def _quiet(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build().eval()


def _mlp_config(hidden: int = 32, intermediate: int = 64) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")


# -- neuron counts and size limits -------------------------------------------------------------------------------


def test_a_conv1d_shape_is_read_as_out_then_in():
    layer = Conv1D(128, 32)  # weight stored [in=32, out=128]
    out = layer(torch.randn(3, 32))
    assert tg.linear_shape(layer) == (out.shape[-1], 32) == (128, 32)


@pytest.mark.parametrize("make, width", [(llama, 64), (gpt2, 4 * 32)], ids=["swiglu", "gpt2"])
def test_an_ffn_has_as_many_neurons_as_its_intermediate_width(make, width):
    """Every intermediate neuron is in an expert or shared; 30 shared of 64 / 128 leaves enough for 4 experts,
    and 2 neurons per expert is the smallest split that converts (``width // 2`` experts)."""
    _, stats = convert(make(), num_experts=4, top_k=2, calibration=ids(), shared_neurons=30)
    assert len(stats.converted) == 2 and not stats.skipped
    assert {sum(layer.expert_sizes) + layer.shared_neurons for layer in stats.converted} == {width}
    _, stats = convert(make(), num_experts=width // 2, top_k=2)
    assert len(stats.converted) == 2
    assert {tuple(layer.expert_sizes) for layer in stats.converted} == {(2,) * (width // 2)}


def test_a_sites_original_parameters_count_a_tied_weight_once():
    """A BERT-like FFN whose two halves share a weight (square, tied) counts it once, as torch does."""
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    second.weight = first.weight
    site = tg.Site("ffn", "bert", first, [first, second], lambda: None, first, lambda block: None, 16, 16)
    assert site.original_parameters == sum(p.numel() for p in nn.ModuleList([first, second]).parameters()) == 256 + 32


def test_linear_size_limits_are_inclusive_and_need_both():
    """At least 2 outputs per expert *and* at least 256 weights: exactly at both limits converts, and a layer
    with outputs enough but fewer weights stays dense."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.edge = nn.Linear(32, 8)  # 8 outputs = 2 x 4 experts, 256 weights
            self.few = nn.Linear(8, 16)  # 16 outputs, 128 weights

        def forward(self, x):
            return self.edge(x), self.few(x[..., :8])

    assert (tg.MIN_PER_EXPERT, tg.MIN_WEIGHTS) == (2, 256)
    _, stats = convert(Two(), num_experts=4, top_k=2, target_modules=["edge", "few"])
    assert stats.converted_layers == ["edge"]
    assert stats.skipped_layers == {"few": "too small (8 -> 16) for 4 experts of at least 2 outputs"}


def test_a_projection_too_narrow_for_two_experts_still_gets_two():
    dense = llama(kv_heads=1)  # q: 32 outputs, k/v: 8 (a quarter of 4 experts rounds to 1)
    _, stats = convert(dense, num_experts=4, top_k=2, calibration=ids(), target_attention_only=True)
    layers = {layer.name.removeprefix("model.layers.0.self_attn."): layer for layer in stats.converted
              if ".0." in layer.name}
    assert (layers["q_proj"].num_experts, layers["q_proj"].top_k) == (4, 2)
    for name in ("k_proj", "v_proj"):
        assert (layers[name].num_experts, layers[name].top_k) == (2, 1)
        assert sum(layers[name].expert_sizes) == 8


# -- what stays dense, and why --------------------------------------------------------------------------------------


def test_a_peft_adapter_on_the_down_projection_alone_keeps_the_ffn_dense():
    peft = pytest.importorskip("peft")
    tuned = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["down_proj"]))
    with pytest.raises(NothingToConvert, match="layers.0.mlp: PEFT adapters on the FFN's projections"):
        tomoe(tuned, num_experts=4, top_k=2, calibration=ids(), progress=False)


def test_a_merged_peft_adapter_keeps_its_linear_dense():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    tuned = peft.get_peft_model(llama(), config).eval()
    tuned.merge_adapter()
    with pytest.raises(NothingToConvert, match=r"q_proj: its PEFT adapter is merged into the weights: unmerge it"):
        tomoe(tuned, num_experts=4, top_k=2, calibration=ids(), target_modules=["q_proj"], progress=False)


def test_a_fused_gate_up_ffn_is_skipped_with_the_reason():
    config = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    model = _quiet(lambda: Phi3ForCausalLM(config))
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, nn.Linear)
    with pytest.raises(NothingToConvert, match=r"model.layers.0.mlp: fused gate_up_proj FFN .*not supported"):
        tomoe(model, num_experts=4, top_k=2, progress=False)


def test_an_ffn_shared_with_a_place_whose_name_extends_its_own_stays_dense():
    """``blocks.1`` and ``blocks.10`` are one module: ``blocks.10`` is not inside ``blocks.1``."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(LlamaMLP(_mlp_config()) for _ in range(11))
            self.blocks[10] = self.blocks[1]

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    model = _quiet(Stack)
    with pytest.raises(NothingToConvert, match=r"blocks.1: shares weights with blocks.10.down_proj"):
        tomoe(model, num_experts=4, top_k=2, target_modules=["1"], progress=False)


def test_an_unregistered_block_holding_dispatching_experts_is_an_moe_block():
    """A block moelens has no family for, whose experts transformers dispatches: its dense shared expert is a
    part of that MoE and stays as it is."""

    class CustomMoe(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = MixtralExperts(MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
            self.shared_expert = LlamaMLP(_mlp_config())

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = CustomMoe()
            self.mlp = LlamaMLP(_mlp_config())

    model = _quiet(Model)
    _, stats = convert(model, num_experts=4, top_k=2)
    assert stats.converted_layers == ["mlp"]
    assert stats.skipped_layers["moe.shared_expert"].startswith("inside the MoE block moe ")


def test_camel_case_attention_modules_count_as_attention():
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=1)
    model = _quiet(lambda: T5EncoderModel(config))
    attention = {f"{name}.{part}" for name, module in model.named_modules() if isinstance(module, T5Attention)
                 for part, child in module.named_children() if isinstance(child, nn.Linear)}
    assert attention == {f"encoder.block.0.layer.0.SelfAttention.{p}" for p in "qkvo"}
    _, stats = convert(model, num_experts=4, top_k=2, target_attention_only=True)
    assert set(stats.converted_layers) == attention


def test_a_target_string_is_a_regex_matched_against_the_whole_name():
    """PEFT's rule; the refusal of a string that is only the end of names says so (it said only "no modules
    matching", with q_proj layers in plain sight)."""
    with pytest.raises(NothingToConvert, match=r"A string is a regular expression that must match a whole module "
                                               r"name \(as in PEFT\), and 'q_proj' is only the end of names such as "
                                               r"'model\.layers\.0\.self_attn\.q_proj': give target_modules=\['q_proj'\] "
                                               r"or '\.\*q_proj'\.$"):
        convert(llama(), num_experts=4, top_k=2, target_modules="q_proj")
    with pytest.raises(NothingToConvert, match=r"must match a whole module name \(as in PEFT\)\.$"):
        convert(llama(), num_experts=4, top_k=2, target_modules="nothing_here")
    _, stats = convert(llama(), num_experts=4, top_k=2, target_modules=r".*\.q_proj")
    assert stats.converted_layers == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]


def test_a_target_that_matches_no_recognised_ffn_names_the_linear_layers_inside_it():
    """GPT-NeoX's ``mlp`` (dense_h_to_4h / dense_4h_to_h) is no FFN block moelens recognises: target_modules=['mlp']
    matches it, and the refusal names the modules it matched and the Linear layers inside them (from the model's own
    modules) to name instead."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = _quiet(lambda: GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=2, num_attention_heads=4,
                                                             max_position_embeddings=64)))
    inner = [name for name, _ in model.gpt_neox.layers[0].mlp.named_children() if name.startswith("dense")]
    assert inner == ["dense_h_to_4h", "dense_4h_to_h"]
    with pytest.raises(NothingToConvert, match=re.escape(
            "target_modules=['mlp'] matches gpt_neox.layers.0.mlp (GPTNeoXMLP), gpt_neox.layers.1.mlp (GPTNeoXMLP), "
            "which are neither Linear / Conv1D layers nor FFN blocks moelens recognises (SwiGLU "
            "gate_proj/up_proj/down_proj, BERT intermediate/output, GPT-2 c_fc/c_proj); the Linear / Conv1D layers "
            "inside are dense_h_to_4h, dense_4h_to_h: name those, target_modules=['dense_h_to_4h', 'dense_4h_to_h'].")):
        convert(model, num_experts=4, top_k=2, calibration=ids(), target_modules=["mlp"])
    _, stats = convert(model, num_experts=4, top_k=2, calibration=ids(), target_modules=inner)  # as the error says
    assert len(stats.converted) == 4


# -- calibration ------------------------------------------------------------------------------------------------


def test_one_dimensional_token_ids_are_one_sequence():
    tokens = ids(1, 16)
    assert cal.batches(tokens[0])[0][1]["input_ids"].shape == (1, 16)
    dense = llama()
    one, stats = convert(dense, num_experts=4, top_k=2, calibration=tokens[0])
    batched, _ = convert(dense, num_experts=4, top_k=2, calibration=tokens)
    assert stats.calibration_tokens == 16
    torch.testing.assert_close(run(one, ids(2, 8, seed=1)), run(batched, ids(2, 8, seed=1)), rtol=0, atol=0)


class _FlatMLP(nn.Module):
    """An FFN that sees the batch's tokens flattened to ``[B * T, D]`` (no attention: rows are embeddings)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 32)
        self.mlp = LlamaMLP(_mlp_config())

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed_tokens(input_ids)
        return self.mlp(hidden.reshape(-1, hidden.shape[-1]))


def test_padding_is_left_out_of_an_ffn_that_sees_flattened_tokens():
    model = _quiet(_FlatMLP)
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    calls = cal.batches({"input_ids": tokens, "attention_mask": mask})
    rows = cal.capture(model, calls, {"mlp": model.mlp})["mlp"]
    with torch.no_grad():
        expected = model.embed_tokens(tokens)[mask.bool()]
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)


class _Features(nn.Module):
    """A sentence-transformers-like model: its forward takes the tokenizer's dict as one positional argument."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 32)
        self.mlp = LlamaMLP(_mlp_config())

    def forward(self, features: dict) -> dict:
        return {"token_embeddings": self.mlp(self.embed_tokens(features["input_ids"]))}


def test_a_tuple_item_is_the_models_positional_arguments_and_its_dicts_mask_leaves_padding_out():
    model = _quiet(_Features)
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    features = {"input_ids": tokens, "attention_mask": mask}
    rows = cal.capture(model, cal.batches([(features,)]), {"mlp": model.mlp})["mlp"]
    with torch.no_grad():
        expected = model.embed_tokens(tokens)[mask.bool()]
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    _, stats = convert(model, num_experts=4, top_k=2, calibration=[(features,)])
    assert stats.converted_layers == ["mlp"] and stats.calibration_tokens == 40
    with pytest.raises(CompressionError, match="calibration set is empty"):  # only padding: left out
        convert(model, calibration=[({"input_ids": tokens, "attention_mask": torch.zeros_like(tokens)},)])
    with pytest.raises(CompressionError, match=r"arg 0 input_ids \[4, 16\] int64.*takes 2 positional arguments"):
        convert(model, calibration=[(features, features)])  # the call's failure shows the dict's tensors
    with pytest.raises(CompressionError, match=r"_Features.forward wants the positional argument 'features', and a "
                                               r"tensor or dict item is passed as keyword arguments .*"
                                               r"calibration=\[\(features,\)\]"):
        convert(model, calibration=features)
    with pytest.raises(CompressionError, match=r"calibration items must be .* tuples of the model's positional "
                                               r"arguments; got an empty tuple"):
        convert(model, calibration=[()])


def test_a_sentence_transformer_calibrates_like_its_inner_model(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models
    from transformers import BertTokenizerFast

    bert().save_pretrained(tmp_path)  # the tiny seeded BERT, saved and loaded: nothing downloaded
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                 + [f"w{i}" for i in range(VOCAB - 5)]))
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = st.SentenceTransformer(modules=[models.Transformer(str(tmp_path)), models.Pooling(32)],
                                       device="cpu").eval()
    tokens = ids(4, 16)
    mask = torch.ones_like(tokens)
    mask[:2, 12:] = 0
    features = {"input_ids": tokens, "token_type_ids": torch.zeros_like(tokens), "attention_mask": mask}
    converted, stats = convert(model, num_experts=4, top_k=2, calibration=[(features,)])
    inner, _ = convert(model[0].auto_model, num_experts=4, top_k=2, calibration=features)  # the inner model itself
    assert len(stats.converted) == 2 and stats.calibration_tokens == int(mask.sum())
    with torch.no_grad():
        torch.testing.assert_close(converted[0].auto_model(**features).last_hidden_state,
                                   inner(**features).last_hidden_state, rtol=0, atol=0)


def _padded(batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[batch, seq]`` and a right-padding mask: row r keeps ``seq - 3 r`` tokens."""
    tokens = ids(batch, seq)
    mask = torch.ones_like(tokens)
    for row in range(batch):
        mask[row, seq - 3 * row:] = 0
    return tokens, mask


@pytest.mark.parametrize("make", [bert, llama], ids=["bert", "llama"])
@pytest.mark.parametrize("form", ["dataloader", "tuple"])
def test_a_positional_attention_mask_leaves_the_padding_out(make, form):
    """A DataLoader over TensorDataset(ids, mask) yields [ids, mask] lists, and a tuple (ids, mask) is the model's
    positional call: the mask is the forward's attention_mask (BERT's and Llama's second parameter), so the padding
    is left out, as for the tokenizer's dict. Ground truth: mask.sum() and the FFN's input in the dense model's own
    forward with attention_mask= given by name, at the real positions."""
    from torch.utils.data import DataLoader, TensorDataset

    model = make()
    tokens, mask = _padded()
    calibration = (DataLoader(TensorDataset(tokens, mask), batch_size=4) if form == "dataloader"
                   else [(tokens, mask)])
    _, stats = convert(model, num_experts=4, top_k=2, calibration=calibration)
    assert stats.calibration_tokens == int(mask.sum()) < mask.numel()
    ffn = model.encoder.layer[1].intermediate if make is bert else model.model.layers[1].mlp
    seen = []
    handle = ffn.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=tokens, attention_mask=mask)
    handle.remove()
    rows = cal.capture(model, cal.batches(calibration, model), {"ffn": ffn})["ffn"]
    torch.testing.assert_close(rows, seen[0][mask.bool()], rtol=0, atol=0)


class _Starred(nn.Module):
    """A model whose forward takes its inputs as ``*inputs``: no parameter name to bind a positional mask to."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, 32)
        self.mlp = LlamaMLP(_mlp_config())

    def forward(self, *inputs):
        return self.mlp(self.embed_tokens(inputs[0]))


def _second_parameter(model: nn.Module) -> str:
    """The name ``model.forward`` gives its second positional argument (GPT-2's past_key_values, cache from
    transformers 5.25)."""
    return list(inspect.signature(model.forward).parameters)[1]


@pytest.mark.parametrize("make, where", [
    (gpt2, lambda model: f"GPT2LMHeadModel.forward's {_second_parameter(model)!r}"),
    (lambda: _quiet(_Starred), lambda model: "no named parameter of _Starred.forward"),
], ids=["gpt2", "starred"])
def test_a_positional_mask_the_forward_takes_as_something_else_is_refused(make, where):
    """GPT-2's second parameter is its cache, and a ``*inputs`` forward names none: a second integer tensor shaped
    like the ids (an attention mask) cannot be told to be one, so it is refused before any forward, saying to pass a
    dict."""
    tokens, mask = _padded()
    where = where(make())
    message = (r"calibration item 0 holds, as positional argument 1, an integer tensor shaped like the token ids "
               r"\[4, 16\] \(an attention mask, as a DataLoader over TensorDataset\(ids, mask\) yields\), which would "
               rf"be {re.escape(where)}, so the padding could not be left out\. Pass each batch as a dict: "
               r"calibration=\[\{'input_ids': ids, 'attention_mask': mask\}, \.\.\.\]")
    with pytest.raises(CompressionError, match=message):
        convert(make(), num_experts=4, top_k=2, calibration=[(tokens, mask)])
    converted, stats = convert(make(), num_experts=4, top_k=2, calibration=[(tokens,)])  # the ids alone still run
    assert stats.calibration_tokens == tokens.numel()


def test_a_list_of_texts_is_refused_with_the_advice_to_tokenize():
    with pytest.raises(CompressionError, match=re.escape(
            "calibration items must be token ids or model inputs, not text (item 0 is 'def f(x): return x'); "
            "tokenize the texts first (calibration=tokenizer(texts, return_tensors='pt', padding=True)).")):
        convert(llama(), calibration=["def f(x): return x", "hello world"])


def test_max_tokens_samples_every_batch():
    dense = llama()
    first, second = ids(4, 16, seed=1), ids(4, 16, seed=2)
    mlp = dense.model.layers[0].mlp
    rows = cal.capture(dense, cal.batches([first, second]), {"mlp": mlp}, max_tokens=64)["mlp"]
    seen_first, seen_second = inputs_of(dense, mlp, first), inputs_of(dense, mlp, second)
    assert rows.shape == (64, 32)

    def members(pool):
        return int(sum(bool((pool == row).all(-1).any()) for row in rows))

    assert members(seen_first) + members(seen_second) == 64
    assert members(seen_first) > 0 and members(seen_second) > 0  # not just the first batch's 64


@pytest.mark.parametrize("make", [llama, lambda: _quiet(_FlatMLP)], ids=["[B, T, D]", "[B * T, D]"])
@pytest.mark.parametrize("max_tokens", [10_000, 40])
def test_each_captured_row_keeps_its_sequence_through_padding_and_max_tokens(make, max_tokens):
    """Each row carries the sequence it came from, numbered over all batches, through padding removal and the
    max_tokens sample: what the held-out split needs to hold whole sequences out. Ground truth: each sequence's
    FFN inputs when the untouched model runs on it alone, without padding."""
    model = make()
    mlp = model.model.layers[0].mlp if hasattr(model, "model") else model.mlp
    first, second, third = ids(3, 12, seed=1), ids(2, 9, seed=2), ids(2, 6, seed=3)
    lengths = [12, 7, 3, 9, 5, 6, 6]  # real tokens of each sequence, in order; the third batch has no mask
    masks = [torch.arange(12) < torch.tensor(lengths[:3])[:, None],
             torch.arange(9) < torch.tensor(lengths[3:5])[:, None]]
    calls = cal.batches([{"input_ids": first, "attention_mask": masks[0].long()},
                         {"input_ids": second, "attention_mask": masks[1].long()}, third])
    found = cal.capture_sequences(model, calls, {"mlp": mlp}, max_tokens=max_tokens)["mlp"]
    texts = [first[0], first[1, :7], first[2, :3], second[0], second[1, :5], third[0], third[1]]
    assert found.sequences is not None and found.rows.shape[0] == min(sum(lengths), max_tokens)
    for sequence, text in enumerate(texts):
        seen = []
        handle = mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].reshape(-1, 32)))
        with torch.no_grad():
            model(input_ids=text[None])
        handle.remove()
        alone = seen[0]
        rows = found.rows[found.sequences == sequence]
        if max_tokens > sum(lengths):
            torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-5)
        else:
            assert all(torch.isclose(alone, row, rtol=1e-5, atol=1e-5).all(-1).any() for row in rows)
    assert set(found.sequences.tolist()) <= set(range(len(texts)))
    torch.testing.assert_close(cal.capture(model, calls, {"mlp": mlp}, max_tokens=max_tokens)["mlp"], found.rows,
                               rtol=0, atol=0)  # the rows alone, as before


def test_calibration_runs_in_eval_mode_and_leaves_no_hook_behind():
    dense = bert()  # dropout 0.1 on embeddings and attention
    tokens = ids()
    intermediate = dense.encoder.layer[1].intermediate
    expected = inputs_of(dense, intermediate, tokens)  # eval mode
    dense.train()
    rows = cal.capture(dense, cal.batches(tokens), {"layer": intermediate})["layer"]
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    assert dense.training and intermediate.training
    assert cal.hooked_part(dense) is None and not intermediate._forward_pre_hooks


def test_a_layer_the_error_gate_keeps_dense_carries_no_calibration_hook():
    dense = llama()
    converted, stats = convert(dense, num_experts=4, top_k=1, calibration=ids(), max_error=1e-6)
    assert not stats.converted and stats.skipped  # every layer kept dense by the gate
    assert cal.hooked_part(converted) is None


def test_a_users_backward_hook_keeps_its_layer_dense():
    dense = llama()
    dense.model.layers[1].mlp.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    _, stats = convert(dense, num_experts=4, top_k=2, calibration=ids())
    assert stats.converted_layers == ["model.layers.0.mlp"]
    assert stats.skipped_layers["model.layers.1.mlp"].startswith("a hook of yours on LlamaMLP")


def test_suspended_hooks_come_back_before_the_hooks_added_meanwhile():
    layer = nn.Linear(4, 4)
    order = []
    layer.register_forward_hook(lambda *_: order.append("before"))
    with cal.without_hooks(layer):
        layer.register_forward_hook(lambda *_: order.append("inside"))
        layer(torch.zeros(1, 4))
        assert order == ["inside"]
    order.clear()
    layer(torch.zeros(1, 4))
    assert order == ["before", "inside"]


# -- the converted block ------------------------------------------------------------------------------------------


def test_a_converted_gpt2_block_drops_out_like_the_dense_one_in_training():
    dense = gpt2()
    converted, _ = convert(dense, num_experts=4, top_k=4, calibration=ids())
    before, after = dense.transformer.h[0].mlp, converted.transformer.h[0].mlp
    assert isinstance(after, ToMoEBlock) and not isinstance(after, ToMoELinear)
    before.dropout.p = after.dropout.p = 0.5
    assert_drops_out_alike(before.train(), after.train())


def assert_drops_out_alike(before: torch.nn.Module, after: torch.nn.Module) -> None:
    """The dense FFN ``before`` and the converted block ``after`` (every expert active), in training, drop out the
    same outputs under the same seed: about half of them."""
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.manual_seed(1)
        expected = before(x)
        torch.manual_seed(1)
        got = after(x)
    assert (expected == 0).float().mean() > 0.3
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["starcoder2", "seed_oss"])
def test_a_residual_dropout_rate_drops_out_like_the_dense_ffn_in_training(family):
    """Starcoder2's (c_fc / c_proj) and Seed-OSS's (SwiGLU) FFNs hold their output dropout as a float rate,
    ``residual_dropout``, passed to F.dropout in their forward: the converted block drops out the same outputs under
    the same seed (every expert active, so it is the dense FFN)."""
    import transformers

    config_class = {"starcoder2": transformers.Starcoder2Config, "seed_oss": transformers.SeedOssConfig}[family]
    model_class = {"starcoder2": transformers.Starcoder2ForCausalLM, "seed_oss": transformers.SeedOssForCausalLM}[family]
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                          residual_dropout=0.5)
    dense = _quiet(lambda: model_class(config))
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=ids())
    before, after = dense.model.layers[0].mlp.train(), converted.model.layers[0].mlp.train()
    assert isinstance(after, ToMoEBlock) and before.residual_dropout == 0.5
    assert_drops_out_alike(before, after)


def test_a_swiglu_ffns_inner_dropout_is_noted_not_applied_at_the_output():
    """T5Gemma's and GTE's SwiGLU FFNs drop out act(gate(x)) * up(x), inside the FFN, which a block of experts
    cannot: the converted block applies no dropout at its output (it would drop other numbers) and its stats say so."""
    dense = llama()
    mlp = dense.model.layers[0].mlp
    mlp.dropout = nn.Dropout(0.25)  # as T5GemmaMLP holds it (its forward would apply it inside)
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=ids())
    block = converted.model.layers[0].mlp
    assert isinstance(block.dropout, nn.Identity)
    layer = next(layer for layer in stats.converted if layer.name == "model.layers.0.mlp")
    assert "the FFN's dropout on act(gate(x)) * up(x) (p=0.25, training only) is not kept" in layer.notes


def test_a_converted_block_under_autocast_gives_the_dense_blocks_dtype():
    """No shared neuron: the shared expert is a float32 constant, added in the tokens' precision (bf16 tokens
    into a float32 model under autocast give bf16 outputs, as the dense block does)."""
    dense = llama()
    converted, _ = convert(dense, num_experts=4, top_k=4, calibration=ids())
    before, after = dense.model.layers[0].mlp, converted.model.layers[0].mlp
    assert after.shared_experts.num_neurons == 0
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = before(x), after(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)


def test_a_converted_router_under_autocast_selects_the_experts_its_float32_logits_rank_highest():
    """The router's logits carry an offset of about 64, where bf16's step is 0.5: autocast used to cast the router's
    F.linear inputs to bf16 (despite its float32 weights), so the logits tied on that grid and most tokens ran other
    experts than the float32 router picks. Ground truth: the router's input taken by a plain forward hook, its logits
    recomputed with F.linear in float32 outside autocast, and their top-k."""
    converted, _ = convert(llama(), num_experts=8, top_k=2, calibration=ids(16, 32))
    block = converted.model.layers[0].mlp
    router = block.router
    seen = {}
    handle = router.register_forward_hook(
        lambda module, args, out: seen.update(x=args[0].detach(), logits=out[0].detach(), index=out[2]))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            converted(input_ids=ids(4, 16, seed=7))
    finally:
        handle.remove()
    with torch.no_grad():
        logits = torch.nn.functional.linear(seen["x"].float(), router.weight, router.bias)
    expected = logits.topk(router.top_k, dim=-1).indices
    same = (seen["index"].sort(dim=-1).values == expected.sort(dim=-1).values).all(dim=-1)
    assert same.all(), f"{int((~same).sum())} of {same.numel()} tokens ran other experts than float32 logits rank"
    assert seen["logits"].dtype == torch.float32


def test_routing_weights_are_in_the_tokens_precision_and_the_blocks_output_too():
    converted, _ = convert(llama(), num_experts=4, top_k=2, calibration=ids())
    low = converted.to(torch.bfloat16)
    block = low.model.layers[0].mlp
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        set_experts_implementation(low, implementation)
        with torch.no_grad():
            logits, weights, _ = block.router(x.reshape(-1, 32))
            out = block(x)
        assert logits.dtype == torch.float32 and weights.dtype == torch.bfloat16, implementation
        assert out.dtype == torch.bfloat16, implementation


def test_the_router_weighs_its_selection_the_same_with_and_without_gradients():
    """Below the saturating offset the weights are the sigmoid of the selected logits; the straight-through
    term adds exactly 0 in the forward."""
    router = ToMoERouter(8, 4, 2, offset=0.0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    logits, weights, index = router(x)
    expected = torch.sigmoid(torch.topk(x @ router.weight.detach().T, 2, dim=-1).values)
    assert weights.requires_grad and (expected < 0.99).any()
    torch.testing.assert_close(weights.detach(), expected)
    with torch.no_grad():
        torch.testing.assert_close(router(x)[1], weights.detach(), rtol=0, atol=0)


def test_stats_as_dict_carries_each_layers_active_fraction():
    _, stats = convert(llama(), num_experts=4, top_k=1, calibration=ids(), shared_neurons=8)
    data = json.loads(json.dumps(stats.as_dict()))
    for layer in data["converted"]:
        sizes = sorted(layer["expert_sizes"], reverse=True)
        assert sum(sizes) + layer["shared_neurons"] == 64
        assert layer["active_fraction"] == pytest.approx((sizes[0] + 8) / 64)


@pytest.mark.parametrize("padded", ["encoder", "decoder"])
def test_an_encoder_decoder_leaves_out_each_stacks_own_padding(padded):
    """T5: the encoder's tokens are masked by attention_mask, the decoder's by decoder_attention_mask (all of them
    where there is none). The encoder's mask was applied to the decoder's rows, whose shape matched: real decoder
    tokens were dropped and its padding calibrated on. Ground truth: each wo's inputs taken by a plain pre-hook,
    masked by hand."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0, pad_token_id=0)).eval()
    encoder_ids, decoder_ids = ids(2, 8), ids(2, 8, seed=1)
    short = torch.ones_like(encoder_ids)
    short[1, 2:] = 0
    masks = {"encoder": short, "decoder": torch.ones_like(short)} if padded == "encoder" else \
        {"encoder": torch.ones_like(short), "decoder": short}
    call = {"input_ids": encoder_ids, "attention_mask": masks["encoder"], "decoder_input_ids": decoder_ids}
    if padded == "decoder":
        call["decoder_attention_mask"] = masks["decoder"]
    modules = {"encoder": model.encoder.block[0].layer[1].DenseReluDense.wo,
               "decoder": model.decoder.block[0].layer[2].DenseReluDense.wo}
    seen = {}
    handles = [module.register_forward_pre_hook(lambda module, args, stack=stack: seen.__setitem__(stack, args[0]))
               for stack, module in modules.items()]
    try:
        with torch.no_grad():
            model(**call)
    finally:
        for handle in handles:
            handle.remove()
    rows = cal.capture(model, cal.batches(call), modules)
    for stack in modules:
        torch.testing.assert_close(rows[stack], seen[stack][masks[stack].bool()], rtol=0, atol=0)
