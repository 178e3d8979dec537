"""Bad input gets a clear moelens error; unavailable values say why; traces leave nothing behind."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import collections
import math
import pathlib
import re
import subprocess
import sys
import unittest.mock
import warnings
from typing import NamedTuple

import nnsight
import numpy
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.moe import use_experts_implementation
from transformers.models.mixtral.configuration_mixtral import MixtralConfig

import moelens
from custom_models import CustomBlock, CustomModel, custom_family, custom_model
from groundtruth import ascii_tokenizer, built, first_tensor
from moelens import Family, FamilyError, OrderError, ValueUnavailable, WriteError, families
from moelens.testing import NOT_DECORATED, tiny_inputs, tiny_model
from moelens.families.scoring import score
from moelens.testing.tiny import FAMILIES as TINY_FAMILIES


@pytest.fixture(scope="module")
def mixtral():
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    return wrapped, inputs


def write_fails(wrapped, inputs, write, match):
    with pytest.raises(WriteError, match=match):
        with wrapped.trace(**inputs):
            write(wrapped.moes[0])


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda moe: setattr(moe, "expert_indices", torch.full_like(moe.expert_indices, 8)), r"index 8.*\[0, 8\)"),
        (lambda moe: setattr(moe, "expert_indices", moe.expert_indices * 0 - 1), r"index -1"),
        (lambda moe: setattr(moe, "expert_indices", moe.expert_indices.float()), r"float32 indices.*int64"),
        (lambda moe: setattr(moe, "expert_weights", moe.expert_weights[..., :1]), r"shape \(2, 5, 1\), expected \(2, 5, 2\)"),
        (lambda moe: setattr(moe, "router_logits", moe.router_logits * float("nan")), r"NaN"),
        (lambda moe: setattr(moe, "router_logits", torch.full_like(moe.router_logits, float("-inf"))), r"-inf"),
        (lambda moe: setattr(moe, "expert_weights", moe.expert_indices), r"int64 tensor, expected a floating"),
        (lambda moe: moe.expert_indices.__setitem__((0, 0, 0), 99), r"index 99"),  # in place: checked on write-back
        (lambda moe: moe.expert_outputs.__setitem__((0, 0), float("nan")),
         r"expert_outputs: the written tensor holds NaN \(64 of 640, the first at \(0, 0, 0, 0\)\).*torch\.nan_to_num"),
        (lambda moe: setattr(moe, "expert_weights", True), r"wrote a torch\.bool tensor, expected a floating-point"),
        (lambda moe: setattr(moe, "expert_weights", None), r"expert_weights: wrote NoneType None, expected a tensor "
                                                           r"of shape \(2, 5, 2\) and dtype torch\.float32"),
        (lambda moe: setattr(moe, "router_logits", "big"), r"router_logits: wrote str 'big', expected a tensor"),
        (lambda moe: setattr(moe, "router_probs", moe.router_probs), r"derived from router_logits"),
        (lambda moe: moe.router_logits.__setitem__((..., 1), float("inf")), r"holds \+inf; a \+inf logit makes this router's softmax scores NaN"),
        (lambda moe: moe.expert_weights.__setitem__((..., 0), float("inf")), r"expert_weights: the written tensor holds \+inf"),
        (lambda moe: setattr(moe, "routed_output", moe.routed_output - float("inf")), r"routed_output: the written tensor holds -inf"),
        # torch's raw "isposinf does not support complex inputs"
        (lambda moe: setattr(moe, "routed_output", moe.routed_output.to(torch.complex64)),
         r"routed_output: wrote a torch.complex64 tensor, expected a floating-point tensor .* \(of the real part: \.real\)"),
    ],
    ids=["index-too-big", "index-negative", "float-index", "wrong-shape", "nan", "all-neg-inf", "int-weights",
         "in-place-index", "in-place-nan", "bool-number", "none", "text", "probs-read-only", "pos-inf-logit", "inf-weight", "neg-inf-output",
         "complex"],
)
def test_bad_writes_raise_clear_errors(mixtral, write, match):
    wrapped, inputs = mixtral
    write_fails(wrapped, inputs, write, match)


def test_index_writes_are_checked_against_the_experts_a_block_has_now():
    """A block pruned to fewer experts after its first trace: an index write is checked against what it has. (Its own
    model: pruning the one `built` shares left later tests comparing a pruned model with an unpruned reference.)"""
    hf = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.expert_indices.save()  # the first read builds the block's bindings
    block, kept = moe._module, 4
    block.gate.weight = torch.nn.Parameter(block.gate.weight[:kept].clone())
    block.experts.gate_up_proj = torch.nn.Parameter(block.experts.gate_up_proj[:kept].clone())
    block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj[:kept].clone())
    block.gate.num_experts = block.experts.num_experts = kept
    assert moe.num_experts == kept
    write_fails(wrapped, inputs, lambda moe: setattr(moe, "expert_indices", torch.full_like(moe.expert_indices, kept + 2)),
                r"index 6, expected indices in \[0, 4\) for this block's 4 experts")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_an_infinite_logit_is_refused_or_harmless(family):
    # A +inf logit is accepted only where the router's scores saturate (sigmoid); wherever it is
    # accepted the model must compute no NaN from it. A -inf logit (route_around's) never makes NaN.
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if not moe.runs_only_on)
    ids = tiny_inputs(hf, batch=1, seq=4)["input_ids"]
    for infinity in (float("inf"), float("-inf")):
        try:
            with wrapped.trace(ids):
                moe.router_logits[..., 1] = infinity
                output = wrapped.output.save()
        except WriteError as error:
            assert infinity > 0 and "scores NaN" in str(error)
            continue
        assert not torch.isnan(first_tensor(output)).any(), f"{family}: a {infinity} logit gave NaN"


def test_errors_name_the_value(mixtral):
    wrapped, inputs = mixtral
    with pytest.raises(WriteError) as caught:
        with wrapped.trace(**inputs):
            wrapped.moes[1].expert_indices = torch.full_like(wrapped.moes[1].expert_indices, 8)
    assert "model.model.layers.1.mlp.expert_indices" in str(caught.value)


def test_per_slot_values_under_eager_say_how_to_switch():
    hf, wrapped, inputs, plain, reference = built("mixtral", "eager")
    with pytest.raises(ValueUnavailable, match=r'set_experts_implementation\("grouped_mm"\)'):
        with wrapped.trace(**inputs):
            wrapped.moes[0].expert_outputs.save()
    with pytest.raises(ValueUnavailable, match="eager"):
        with wrapped.trace(**inputs):
            wrapped.moes[0].expert_activations.save()


def test_missing_shared_expert_says_why(mixtral):
    wrapped, inputs = mixtral
    with pytest.raises(ValueUnavailable, match="mixtral family has no shared expert"):
        with wrapped.trace(**inputs):
            wrapped.moes[0].shared_expert_output.save()
    with pytest.raises(ValueUnavailable, match="no shared expert"):
        wrapped.moes[0].shared_experts  # noqa: B018 - outside a trace too


def test_shared_expert_turned_off_by_config_says_so():
    hf = tiny_model("granitemoeshared", shared_intermediate_size=0)
    wrapped = moelens.wrap(hf)
    with pytest.raises(ValueUnavailable, match="config turns it off"):
        with wrapped.trace(**tiny_inputs(hf)):
            wrapped.moes[0].shared_expert_output.save()


def test_dense_block_refuses_mixture_values_with_the_moe_layers():
    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    dense = wrapped.layers[0].mlp
    assert isinstance(dense, moelens.Mlp) and not isinstance(dense, moelens.Moe)
    with pytest.raises(ValueUnavailable, match=r"dense MLP.*MoE layers are \[1, 2, 3\]"):
        with wrapped.trace(**inputs):
            dense.router_logits.save()


def test_moe_refuses_dense_activation_and_points_to_slots():
    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    with pytest.raises(ValueUnavailable, match="expert_activations"):
        with wrapped.trace(**inputs):
            wrapped.moes[0].mlp_activation.save()


@pytest.mark.parametrize(("family", "value", "match"), [
    ("llama4", "expert_outputs", "pre-multiplied by their sigmoid score"),
    ("llama4", "routed_output", "no experts"),
    ("gemma4", "mlp_output", "gemma4 has no MoE block"),
    ("diffusion_gemma", "mlp_output", "diffusion_gemma has no MoE block"),  # it said gemma4
    ("dbrx", "expert_outputs", "eager loop only"),
    *[("step3p7", "expert_activations", "not decorated with transformers' use_experts_implementation")]
    * ("step3p7" in NOT_DECORATED),  # transformers 5.25 decorates step3p7's experts
    ("longcat_flash", "expert_outputs", "last 2 experts are zero-compute"),
])
def test_family_refusals_give_the_reason(family, value, match):
    impl = "eager" if family in NOT_DECORATED else "grouped_mm"
    hf, wrapped, inputs, plain, reference = built(family, impl)
    with pytest.raises(ValueUnavailable, match=match):
        with wrapped.trace(**inputs):
            getattr(wrapped.moes[0], value).save()


def test_reading_out_of_order_names_the_order(mixtral):
    wrapped, inputs = mixtral
    with pytest.raises(OrderError, match=r"router_logits -> .* -> routed_output"):
        with wrapped.trace(**inputs):
            wrapped.moes[0].routed_output.save()
            wrapped.moes[0].router_logits.save()
    with pytest.raises(OrderError, match="layer order") as refused:
        with wrapped.trace(**inputs):
            wrapped.moes[2].router_logits.save()
            wrapped.moes[1].router_logits.save()
    # the traceback opens with this message, not with nnsight's (an internal op path) as its cause
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_an_order_error_lists_the_selection_scores_a_route_around_read():
    """On a DS3 block route_around writes the selection scores; reading the logits after it listed no such value."""
    hf, wrapped, inputs, plain, reference = built("deepseek_v3", "grouped_mm")
    moe = wrapped.moes[0]
    with pytest.raises(OrderError, match=r"\(router_logits -> router_probs -> selection_scores -> expert_weights"):
        with wrapped.trace(**inputs):
            moelens.ablate(moe, 1, "route_around")
            moe.router_logits.save()


def test_activations_after_a_raw_op_past_the_sort_name_the_sort(mixtral):
    """Read in execution order from the user's side, yet refused: the message said they were not."""
    wrapped, inputs = mixtral
    assert wrapped.moes[0].experts_implementation == "grouped_mm"
    with pytest.raises(OrderError, match=r"expert_activations is put into token-slot order with the sort permutation "
                                         r"of the grouped_mm experts implementation \(torch_sort_0.*read "
                                         r"expert_activations first"):
        with wrapped.trace(**inputs):
            wrapped.moes[0].experts.source.experts_forward_1.source._grouped_linear_0.output.save()
            wrapped.moes[0].expert_activations.save()
    with wrapped.trace(**inputs):  # the documented order works
        activations = wrapped.moes[0].expert_activations.save()
        up = wrapped.moes[0].experts.source.experts_forward_1.source._grouped_linear_1.input.save()
    assert activations.numel() == up.numel()
    with wrapped.trace(**inputs):  # a read after a write of the same call serves the write (it was refused)
        wrapped.moes[0].expert_activations = torch.zeros_like(activations)
        again = wrapped.moes[0].expert_activations.save()
    assert torch.equal(again, torch.zeros_like(activations))


def test_value_errors_are_never_attribute_errors(mixtral):
    wrapped, inputs = mixtral
    for name in ("shared_expert_output", "mlp_activation"):
        with pytest.raises(ValueUnavailable):
            with wrapped.trace(**inputs):
                getattr(wrapped.moes[0], name)


def test_traces_leave_no_hooks_or_edits_behind():
    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    weights = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    grads = {name: p.requires_grad for name, p in hf.named_parameters()}
    with wrapped.trace(**inputs):
        moelens.ablate(wrapped.moes[0], 1, "route_around")
        moelens.steer(wrapped.moes[1], 2, 5.0)
        moelens.ablate(wrapped.moes[1], 3)
        wrapped.moes[2].expert_outputs[:] = 0
        wrapped.moes[2].shared_expert_output = wrapped.moes[2].shared_expert_output * 2
    with torch.no_grad():
        after = first_tensor(hf(**inputs))
    assert torch.equal(after, plain)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert grads == {name: p.requires_grad for name, p in hf.named_parameters()}
    for module in hf.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks


def test_wrap_leaves_the_users_tokenizer_as_it_was():
    from groundtruth import ascii_tokenizer

    tokenizer = ascii_tokenizer()
    tokenizer.padding_side = "right"
    wrapped = moelens.wrap(tiny_model("mixtral"), tokenizer=tokenizer)
    assert tokenizer.padding_side == "right" and wrapped.tokenizer is not tokenizer
    assert wrapped.tokenizer.padding_side == "left"  # prompts are left-padded (docs/values.md)


def test_wrap_and_a_trace_leave_the_users_model_as_it_was():
    """Config, weights and mode: nothing compared them before and after wrapping (use_cache turned off by wrap
    would have gone unseen, and the user's own generate would have run without a cache)."""
    hf = tiny_model("mixtral").train()
    config, weights = hf.config.to_dict(), {name: value.clone() for name, value in hf.state_dict().items()}
    modes = {name: module.training for name, module in hf.named_modules()}
    wrapped = moelens.wrap(hf)
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
        wrapped.moes[0].save_all()
    assert hf.config.to_dict() == config
    assert hf.state_dict().keys() == weights.keys() and all(torch.equal(hf.state_dict()[n], w) for n, w in weights.items())
    assert {name: module.training for name, module in hf.named_modules()} == modes


def test_moes_are_in_layer_order_past_ten_layers():
    """model.moes[i] is the i-th MoE layer by number (a sort by path would put layers.10 before layers.2)."""
    hf = tiny_model("mixtral", num_hidden_layers=12)
    assert [moe.layer for moe in moelens.wrap(hf).moes] == list(range(12))


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_a_deep_copy_serves_its_own_values(with_tokenizer):
    # nnsight's own deep copy would hand the copy's values to the original's tracer (OrderError).
    from groundtruth import ascii_tokenizer

    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer() if with_tokenizer else None)
    twin = copy.deepcopy(wrapped)
    assert type(twin) is type(wrapped) and twin._module is not hf
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with wrapped.trace(ids):
        original = wrapped.moes[1].save_all()
    with torch.no_grad():
        twin._module.model.layers[1].mlp.experts.down_proj.zero_()
    with twin.trace(ids):
        copied = twin.moes[1].save_all()
    assert torch.equal(copied["router_logits"], original["router_logits"])
    assert not copied["routed_output"].any()  # the copy's own weights
    with wrapped.trace(ids):
        again = wrapped.moes[1].routed_output.save()
    assert torch.equal(again, original["routed_output"])  # the original is untouched


def test_compiling_the_wrapped_model_in_place_is_refused_leaving_it_usable():
    """torch's module.compile() through the wrapper compiled the transformers model in place: its plain calls then
    failed inside dynamo, and every trace was refused."""
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    for envoy, name in ((wrapped, "model"), (wrapped.moes[1], "model.model.layers.1.mlp")):
        with pytest.raises(moelens.MoelensError, match=rf"^{re.escape(name)}\.compile\(\) would compile the "
                                                       r"transformers module in place, .*moelens\.wrap\(copy\.deepcopy"):
            envoy.compile()
    assert all(getattr(module, "_compiled_call_impl", None) is None for module in hf.modules())
    with torch.no_grad(), wrapped.trace(**inputs):
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, hf(**inputs).logits)


@pytest.mark.parametrize("inplace", [True, False])
def test_a_deep_copy_of_an_edited_model_says_its_edits_stay_behind(inplace):
    """nnsight edits live in the wrapper: the copy traces the unedited model (its logits are the plain model's)."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    if inplace:
        edited = wrapped
        with wrapped.edit(inplace=True):
            moelens.steer(wrapped.moes[1], 3, 8.0)
    else:
        with wrapped.edit() as (_, edited):  # (a variable set inside the block does not outlive it)
            moelens.steer(edited.moes[1], 3, 8.0)
    with pytest.warns(UserWarning, match=r"^deepcopy: the model carries 1 nnsight edit\(s\) \(model\.edit\(\)\), "
                                         r"which are not copied: the copy traces the unedited model\. Make them again"):
        twin = copy.deepcopy(edited)
    with torch.no_grad():
        plain = hf(ids).logits
        with twin.trace(ids):
            copied = twin.output.logits.save()
        with edited.trace(ids):
            steered = edited.output.logits.save()
    assert torch.equal(copied, plain) and not torch.equal(steered, plain)


def test_a_base_model_with_a_tokenizer_wraps_and_loads(tmp_path):
    # No head: nnsight cannot infer a pipeline task from it, moelens names one.
    from groundtruth import ascii_tokenizer

    wrapped = moelens.wrap(tiny_model("qwen2_moe").model, tokenizer=ascii_tokenizer())
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    with wrapped.trace("hello"):
        from_text = wrapped.moes[0].router_logits.save()
    with wrapped.trace(ids):
        from_ids = wrapped.moes[0].router_logits.save()
    assert from_text.shape[:2] == (1, 5) and torch.equal(from_text, from_ids)
    folder = tmp_path / "base"
    tiny_model("openai_privacy_filter").save_pretrained(folder)
    ascii_tokenizer().save_pretrained(folder)
    loaded = moelens.load(folder)
    assert loaded.family.name == "openai_privacy_filter" and loaded.tokenizer is not None
    # a base model loaded from a causal-LM checkpoint (its config still names the ForCausalLM class)
    from transformers import AutoModel, AutoTokenizer

    from moelens.data import TINY_MODEL_PATH

    base = moelens.wrap(AutoModel.from_pretrained(TINY_MODEL_PATH), tokenizer=AutoTokenizer.from_pretrained(TINY_MODEL_PATH))
    with base.trace("def f(x):"):
        logits = base.moes[0].router_logits.save()
    assert logits.shape[:2] == (1, 5)
    assert not hasattr(base._module, "generate")  # a base model cannot generate: torch's bare AttributeError was it
    with pytest.raises(moelens.MoelensError, match=r"model\.generate: Qwen2MoeModel has no language-model head, so "
                                                   r"it cannot generate.*AutoModelForCausalLM"):
        with base.generate("def f(x):", max_new_tokens=2):
            pass


def test_tokenizer_keywords_a_generating_models_pipeline_would_drop_are_refused():
    """Beside text, on a model that generates, nnsight's text-generation pipeline hands the tokenizer add_special_tokens,
    padding, truncation and max_length only; text_pair, pad_to_multiple_of, padding_side went to the forward, which
    ignored them (the pair's text was not in the ids). Ground truth: the tokenizer's own call; its settings the
    pipeline takes still reach it."""
    from groundtruth import ascii_tokenizer

    hf = tiny_model("mixtral")
    tokenizer = ascii_tokenizer()
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    for given in ({"text_pair": "x + y"}, {"padding": True, "pad_to_multiple_of": 16}, {"padding_side": "right"},
                  {"split_special_tokens": True}):  # taken through **kwargs: was "did you mean 'skip_special_tokens'?"
        named = next(name for name in given if name != "padding")
        with pytest.raises(moelens.MoelensError, match=rf"^{named} beside a text prompt: a model that generates has its "
                                                       rf"text tokenized by nnsight's text-generation pipeline, .*"
                                                       rf"model\.tokenizer\(texts, {named}=\.\.\., return_tensors='pt'\)"
                                                       + ("" if named == "text_pair" else
                                                          rf"\), or pass tokenizer_encode_kwargs=\{{'{named}': \.\.\.\}}\.$")):
            with torch.no_grad(), wrapped.trace("add(a, b)", **given):
                wrapped.output.save()
    with torch.no_grad(), wrapped.trace("add(a, b)", truncation=True, max_length=4):
        ids = wrapped.model.embed_tokens.input.save()
    assert torch.equal(ids, tokenizer(["add(a, b)"], return_tensors="pt", truncation=True, max_length=4)["input_ids"])
    with torch.no_grad(), wrapped.trace("add(a, b)", tokenizer_encode_kwargs={"padding": "max_length", "max_length": 12,
                                                                              "padding_side": "right"}):
        ids = wrapped.model.embed_tokens.input.save()  # the way the refusal names
    assert torch.equal(ids, tokenizer(["add(a, b)"], return_tensors="pt", padding="max_length", max_length=12,
                                      padding_side="right")["input_ids"])
    # labels beside the text of one of two invokes reached the forward for the whole batch: torch's shape error
    labels = tokenizer(["hello"], return_tensors="pt")["input_ids"]
    with pytest.raises(moelens.MoelensError, match=r"^labels beside the text of one of several invokes: .*"
                                                   r"tracer\.invoke\(model\.tokenizer\(text, return_tensors='pt'\)"
                                                   r"\['input_ids'\], labels=\.\.\.\)"):
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke("hello", labels=labels):
                wrapped.output.save()
            with tracer.invoke("a, b"):
                wrapped.output.save()
    for other in ((), ([{"role": "user", "content": "hello"}],)):  # beside ids by keyword; chat messages beside text
        with pytest.raises(moelens.MoelensError, match=r"^labels beside the text of one of several invokes"):
            with torch.no_grad(), wrapped.trace() as tracer:
                with tracer.invoke(*(other or ("hello",)), labels=labels):
                    wrapped.output.save()
                with tracer.invoke(**tokenizer(["a, b"], return_tensors="pt")) if not other else tracer.invoke("a, b"):
                    wrapped.output.save()
    with torch.no_grad(), wrapped.trace() as tracer:  # beside an empty invoke it is the whole batch's, and taken
        with tracer.invoke("hello", labels=labels):
            loss = wrapped.output.loss.save()
        with tracer.invoke():
            wrapped.moes[0].router_logits.save()
    with torch.no_grad():
        assert torch.equal(loss, hf(input_ids=labels, labels=labels).loss)
    with torch.no_grad(), wrapped.trace() as tracer:  # the way the refusal names: nnsight pads the labels with -100
        with tracer.invoke(labels, labels=labels):
            loss = wrapped.output.loss.save()
        with tracer.invoke(tokenizer(["a, b"], return_tensors="pt")["input_ids"]):
            pass
    padded = tokenizer(["hello", "a, b"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = hf(**padded, labels=torch.cat([labels, torch.full_like(labels, -100)]).masked_fill(
            padded["attention_mask"] == 0, -100)).loss
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"])
def test_a_classifier_with_a_tokenizer_wraps_traces_text_and_takes_its_keywords(head):
    """Heads that cannot generate, wrapped with a tokenizer: question answering failed at wrap (nnsight infers no
    pipeline task for it), a classifier whose config still names the causal LM (from_pretrained of a causal
    checkpoint) failed with "'TextGenerationPipeline' object has no attribute 'assistant_model'"; keywords beside
    text were dropped by the classifiers' pipelines (labels= gave no loss, output_hidden_states=True no hidden
    states) or failed in them (token classification: a TypeError, generate's max_new_tokens too). Ground truth: the
    plain forward on the tokenizer's encoding with the same keywords."""
    import transformers
    from groundtruth import ascii_tokenizer

    config = moelens.testing.tiny_config("mixtral", num_labels=3)
    config.architectures = ["MixtralForCausalLM"]  # what a causal LM's config.json holds
    torch.manual_seed(0)
    hf = getattr(transformers, f"Mixtral{head}")(config).eval()
    tokenizer = ascii_tokenizer()
    encoding = tokenizer(["hello world"], return_tensors="pt")
    labels = {"ForSequenceClassification": torch.tensor([1]), "ForTokenClassification": torch.ones_like(
        encoding["input_ids"])}.get(head)
    keywords = {"output_hidden_states": True, **({"labels": labels} if labels is not None else {})}
    with torch.no_grad():
        expected = hf(**encoding, **keywords)
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    with torch.no_grad(), wrapped.trace("hello world", **keywords):
        output = wrapped.output.save()
    assert len(output.hidden_states) == len(expected.hidden_states)
    for name in ("logits", "start_logits", "loss"):
        if getattr(expected, name, None) is not None:
            assert torch.equal(getattr(output, name), getattr(expected, name)), name
    for settings in ({"truncation": True, "max_length": 4}, {"padding": "max_length", "max_length": 16},
                     {"add_special_tokens": False}):  # the tokenizer's settings reach it (the first version sent them
        with torch.no_grad(), wrapped.trace("hello world", **settings):  # to the forward, which swallowed them)
            output = wrapped.output.save()
        with torch.no_grad():
            expected = hf(**tokenizer(["hello world"], return_tensors="pt", **settings))
        assert torch.equal(getattr(output, "logits", None) if head != "ForQuestionAnswering" else output.start_logits,
                           getattr(expected, "logits", None) if head != "ForQuestionAnswering" else expected.start_logits)
    for given in ({"attention_mask": torch.ones(1, 3, dtype=torch.long)}, {"text_pair": "the cat sat"}):
        with pytest.raises(moelens.MoelensError, match=rf"{next(iter(given))} beside a text prompt: the tokenizer makes "
                                                       r"the text's inputs .* model\.trace\(\*\*tokenizer\("):
            with torch.no_grad(), wrapped.trace("hello world", **given):  # replaced the mask; the pair was dropped
                wrapped.output.save()
    with pytest.raises(moelens.MoelensError, match=r"keywords for the model's forward \(output_hidden_states.*\) beside "
                                                   r"the text of one of several invokes: .* pass them to model\.trace"):
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke("hello", output_hidden_states=True):
                pass
            with tracer.invoke("world"):
                pass
    for model in (wrapped, moelens.wrap(hf)):  # without a tokenizer too: its own refusal said to add one
        with pytest.raises(moelens.MoelensError, match=rf"model\.generate: Mixtral{head} has no language-model head, "
                                                       r"so it cannot generate"):
            with model.generate("hello" if model is wrapped else encoding["input_ids"], max_new_tokens=3):
                pass


def test_wrap_and_load_reject_bad_input(tmp_path):
    with pytest.raises(moelens.MoelensError, match="transformers model instance"):
        moelens.wrap("mixtral")
    with pytest.raises(moelens.MoelensError, match=r"no model at '.*nothing-here': the path does not exist"):
        moelens.load(tmp_path / "nothing-here")
    # a relative path of three parts is no hub id (namespace/name): refused by moelens, not sent to the hub
    with pytest.raises(moelens.MoelensError, match=r"no model at 'no/such/folder': the path does not exist"):
        moelens.load("no/such/folder")
    # "./name" and "../name" name a local folder (a Path of them drops the "./"): refused, not sent to the hub
    for given in ("./no-such-folder", "../no-such-folder"):
        with pytest.raises(moelens.MoelensError, match=rf"no model at '{re.escape(given)}': the path does not exist"):
            moelens.load(given)
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "tokenizer.json").write_text("{}")
    with pytest.raises(moelens.MoelensError, match=r"no-config' is not a transformers checkpoint folder \(no config.json"):
        moelens.load(tmp_path / "no-config")
    with pytest.raises(moelens.MoelensError, match=r"no-config/sub' \(subfolder 'sub'\) is not a transformers"):
        moelens.load(tmp_path / "no-config", subfolder="sub")


def test_a_typo_in_a_relative_path_and_a_config_transformers_cannot_read_are_named(tmp_path, monkeypatch):
    """'ckpts/mixtral-tokk' (ckpts a folder here) was sent to the hub as a repo id: 24 s of retries, then an internet
    error; a config.json of an unknown model type got transformers' paragraph and advice to pass a config.json."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    with pytest.raises(moelens.MoelensError, match=r"no model at 'ckpts/mixtral-tokk': the path does not exist"):
        moelens.load("ckpts/mixtral-tokk")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    with pytest.raises(moelens.MoelensError) as refused:
        moelens.load(tmp_path / "odd")
    message = str(refused.value)
    assert "\n" not in message and "model type `frobnicator`" in message
    assert message.endswith("Its config.json is not one this transformers can read: fix it (or update transformers "
                            "for a model type it does not know).")


def test_load_of_a_folder_without_tokenizer_files_has_no_tokenizer(tmp_path):
    # transformers 5 would build a one-token placeholder from the config's model type
    tiny_model("olmoe").save_pretrained(tmp_path / "olmoe")
    loaded = moelens.load(tmp_path / "olmoe")
    assert getattr(loaded, "tokenizer", None) is None
    with loaded.trace(torch.tensor([[1, 2, 3]])):
        logits = loaded.moes[0].router_logits.save()
    assert logits.shape[:2] == (1, 3)


def test_a_model_whose_first_weights_accelerate_offloads_traces(tmp_path):
    """A device_map that offloads the embeddings (accelerate disk offload) leaves the first parameter on meta, where
    nnsight moved the trace's inputs: NotImplementedError (cannot copy out of meta). accelerate's hooks move them."""
    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    hf.save_pretrained(tmp_path / "checkpoint")
    with torch.no_grad():
        expected = hf(**inputs).logits
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                  "lm_head": "cpu"}
    loaded = moelens.load(tmp_path / "checkpoint", device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert next(loaded._module.parameters()).is_meta
    with torch.no_grad(), loaded.trace(inputs["input_ids"]):
        logits = loaded.moes[0].router_logits.save()
        output = loaded.output.logits.save()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert logits.shape[:2] == inputs["input_ids"].shape


def test_params_of_a_block_accelerate_offloads_to_disk_are_refused_in_a_trace_too(tmp_path):
    """Outside a trace the offloaded experts' weights are on meta and params() refused them; inside one, once the
    experts ran, accelerate had loaded a copy from the offload folder and params() served views of it: the edit held
    for that forward and was lost at the next. Ground truth: the experts loaded whole, edited, change later runs."""
    from moelens.data import TINY_MODEL_PATH

    kept = ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head", "model.layers.0", "model.layers.2",
            "model.layers.3", "model.layers.1.self_attn", "model.layers.1.input_layernorm",
            "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert",
            "model.layers.1.mlp.shared_expert_gate"]
    device_map = {**dict.fromkeys(kept, "cpu"), "model.layers.1.mlp.experts": "disk"}
    offloaded = moelens.load(TINY_MODEL_PATH, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    refused = r"layers\.1\.mlp\.params: accelerate offloads this block's weights to disk .* an edit of a view would be lost"
    with pytest.raises(moelens.ValueUnavailable, match=refused):
        offloaded.moes[1].params()
    with pytest.raises(moelens.ValueUnavailable, match=refused):
        with torch.no_grad(), offloaded.trace("def add(a, b):"):
            offloaded.moes[1].expert_activations.save()  # the experts ran: their weights are loaded now
            offloaded.moes[1].params()
    assert offloaded.moes[0].params().down.shape[0] == 8  # a block held in memory is served
    whole = moelens.load()
    with torch.no_grad():
        whole.moes[1].params().down[0].zero_()  # an edit of a block in memory lasts
    assert not whole._module.model.layers[1].mlp.experts.down_proj[0].any()


def test_params_of_a_block_accelerate_runs_elsewhere_than_it_keeps_them_are_refused():
    """accelerate's CPU offload onto an accelerator moves a copy of the weights to it for each forward (inside a trace,
    an edit of a view would be lost); moelens named only disk offload that way. An execution device of "meta" stands in
    for a GPU here."""
    from accelerate import cpu_offload

    model = tiny_model("mixtral")
    cpu_offload(model, execution_device=torch.device("meta"))
    with pytest.raises(moelens.ValueUnavailable, match=r"layers\.0\.mlp\.params: accelerate keeps this block's weights "
                                                       r"offloaded on the CPU and moves a copy to meta"):
        moelens.wrap(model).moes[0].params()


def test_params_of_a_router_under_a_peft_adapter_are_none_with_the_reason():
    """A PEFT LoRA on the router's linear layer (hunyuan's gate.wg): params().router was None without a word
    (params(3).router.zero_(), the docs' use, raised AttributeError on None). The logits are the base weight and the
    adapters together: the router is None with a warning saying why; the experts are served and their edits land.
    Ground truth: without the adapter params().router is the wg weight [E, D]; the experts' own down_proj."""
    peft = pytest.importorskip("peft")
    plain = tiny_model("hunyuan_v1_moe")
    assert moelens.wrap(plain).moes[1].params().router.shape == plain.model.layers[1].mlp.gate.wg.weight.shape
    adapted = peft.get_peft_model(tiny_model("hunyuan_v1_moe"), peft.LoraConfig(r=4, target_modules=["wg"]))
    with pytest.warns(UserWarning, match=r"layers\.1\.mlp\.params: router and router_bias are None: hunyuan_v1_moe: "
                                         r"the router's linear layer gate\.wg is a PEFT adapter layer .*merge_and_unload"):
        params = moelens.wrap(adapted).moes[1].params(3)
    assert params.router is None and params.router_bias is None
    with torch.no_grad():
        params.down.zero_()
    assert not adapted.base_model.model.model.layers[1].mlp.experts.down_proj[3].any()


def test_a_model_accelerate_cpu_offload_placed_traces():
    """accelerate.cpu_offload puts every weight on meta behind offload hooks and sets no device map: nnsight moved the
    trace's inputs to meta (NotImplementedError: cannot copy out of meta). Ground truth: the model before offload."""
    from accelerate import cpu_offload

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        expected = hf(**inputs).logits
    cpu_offload(hf, execution_device="cpu")
    assert next(hf.parameters()).is_meta and getattr(hf, "hf_device_map", None) is None
    wrapped = moelens.wrap(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        logits = wrapped.moes[0].router_logits.save()
        output = wrapped.output.logits.save()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert logits.shape[:2] == inputs["input_ids"].shape


def test_a_model_with_a_tokenizer_whose_embeddings_accelerate_cpu_offload_placed_traces():
    """cpu_offload of the embeddings alone (the first weight on meta, no device map): nnsight's transformers pipeline
    moved the model to meta's device ("Cannot copy out of meta tensor") before any trace. Ground truth: the plain
    forward of moelens-tiny before the offload."""
    from accelerate import cpu_offload
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelens.data import TINY_MODEL_PATH

    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    with torch.no_grad():
        expected = hf(**tokenizer("def add(a, b):", return_tensors="pt")).logits
    cpu_offload(hf.model.embed_tokens, execution_device="cpu")
    offloaded = moelens.wrap(hf, tokenizer=tokenizer)
    with torch.no_grad(), offloaded.trace("def add(a, b):"):
        output = offloaded.output.logits.save()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert getattr(hf, "hf_device_map", None) is None  # the pipeline's map was taken back


def test_a_model_with_a_tokenizer_and_offloaded_first_weights_loads_and_traces(tmp_path):
    """With a tokenizer nnsight builds a transformers pipeline, which took the device map's first entry, "disk", for
    a torch device: RuntimeError before any trace. Ground truth: moelens-tiny loaded whole."""
    from moelens.data import TINY_MODEL_PATH

    device_map = {"model.embed_tokens": "disk", "lm_head": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu",
                  "model.norm": "cpu"}  # moelens-tiny ties its embeddings and head: both on disk
    offloaded = moelens.load(TINY_MODEL_PATH, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert offloaded._module.hf_device_map == device_map  # as accelerate left it
    whole = moelens.load()
    outputs = []
    for model in (whole, offloaded):
        with torch.no_grad(), model.trace("def add(a, b):"):
            logits = model.moes[1].router_logits.save()
            output = model.output.logits.save()
        outputs.append((logits, output))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    from moelens import analysis  # the expert logit lens reads out through the offloaded head too

    lenses = [analysis.expert_logit_lens(model, ["def add(a, b):\n    return a + b\n"], progress=False)
              for model in (whole, offloaded)]
    assert torch.equal(lenses[1].top_ids, lenses[0].top_ids)


def test_a_model_with_a_tokenizer_offloaded_whole_to_disk_loads_and_traces(tmp_path):
    """device_map {"": "disk"} (what "auto" gives under a small max_memory) has no real device to put first: the
    pipeline took "disk" for a torch device, RuntimeError before any trace. Ground truth: moelens-tiny loaded whole."""
    from moelens.data import TINY_MODEL_PATH

    offloaded = moelens.load(TINY_MODEL_PATH, device_map={"": "disk"}, offload_folder=str(tmp_path / "offload"))
    assert offloaded._module.hf_device_map == {"": "disk"}  # as accelerate left it
    outputs = []
    for model in (moelens.load(), offloaded):
        with torch.no_grad(), model.trace("def add(a, b):"):
            outputs.append((model.moes[1].router_logits.save(), model.output.logits.save()))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_load_expands_a_path_from_the_home_folder(tmp_path, monkeypatch):
    """The folder check expanded ~ but transformers got the raw string: 'Repo id must use alphanumeric chars'."""
    tiny_model("olmoe").save_pretrained(tmp_path / "home" / "olmoe")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    loaded = moelens.load("~/olmoe")
    assert type(loaded._module).__name__ == "OlmoeForCausalLM" and loaded.moes


def test_load_takes_a_tokenizer_and_names_a_keyword_from_pretrained_does_not_take(tmp_path):
    """load(path, tokenizer=...) and load(path, rename=...) failed with transformers' raw TypeError
    (the model's __init__ got an unexpected keyword argument); nnsight's dispatch= has its own refusal."""
    hf = tiny_model("olmoe")
    hf.save_pretrained(tmp_path / "olmoe")  # no tokenizer files
    tokenizer = ascii_tokenizer()
    loaded = moelens.load(tmp_path / "olmoe", tokenizer=tokenizer)
    ids = tokenizer("expert", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        with loaded.trace("expert"):
            logits = loaded.output.logits.save()
        torch.testing.assert_close(logits, hf.to(logits.device)(ids.to(logits.device)).logits, rtol=0, atol=0)
    with pytest.raises(moelens.MoelensError, match=r"moelens.load passes its keywords to OlmoeForCausalLM.from_pretrained, "
                       r"which does not take this one \(.*'rename'.*\); .* moelens.wrap\(model, tokenizer=\.\.\., \*\*nnsight_kwargs\)"):
        moelens.load(tmp_path / "olmoe", rename={"model": "m"})


def test_an_unexpected_keyword_the_user_did_not_pass_passes_through(tmp_path, monkeypatch):
    """A checkpoint's own code calling a helper with a keyword it does not take is not the user's keyword."""
    from transformers import OlmoeForCausalLM

    tiny_model("olmoe").save_pretrained(tmp_path / "olmoe")

    def old_remote_code(cls, *args, **kwargs):
        raise TypeError("helper() got an unexpected keyword argument 'use_legacy_cache'")

    monkeypatch.setattr(OlmoeForCausalLM, "from_pretrained", classmethod(old_remote_code))
    with pytest.raises(TypeError, match=r"^helper\(\) got an unexpected keyword argument 'use_legacy_cache'$"):
        moelens.load(tmp_path / "olmoe", dtype=torch.float32)


def test_a_name_that_is_no_local_folder_and_no_reachable_hub_id_says_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(moelens.MoelensError, match=r"cannot load a model from 'my_checkpoint': .*No local folder "
                       r"'my_checkpoint' is here either \(in '.*'\)\. Pass a local folder"):
        moelens.load("my_checkpoint", local_files_only=True)


def test_load_names_what_is_wrong_with_the_path(tmp_path):
    folder = tmp_path / "checkpoint"
    tiny_model("mixtral").save_pretrained(folder)
    with pytest.raises(moelens.MoelensError, match=r"is a file; .* pass '.*checkpoint'"):
        moelens.load(folder / "config.json")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(moelens.MoelensError, match=r"config-only' holds config.json but no weights file"):
        moelens.load(config_only)
    (config_only / "config.json").write_text("{not json")
    with pytest.raises(moelens.MoelensError, match="cannot load a model") as error:
        moelens.load(config_only)
    assert ".." not in str(error.value).replace(str(tmp_path), "")  # transformers' full stop is not doubled


def test_load_says_what_to_do_about_weights_transformers_did_not_find(tmp_path):
    """Weights saved with variant=, or shards without their index, got "Pass a folder holding config.json and weights
    saved with save_pretrained": what the user had done. Ground truth: transformers loads the first with variant=."""
    import transformers

    hf = tiny_model("mixtral")
    hf.save_pretrained(tmp_path / "variant", variant="v1")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "variant", variant="v1")
    for asked in ({}, {"variant": "v2"}):
        with pytest.raises(moelens.MoelensError, match=r"Its weights were saved with variant='v1' \(model\.v1\."
                                                       r"safetensors\): load it with moelens\.load\(folder, variant='v1'\)"):
            moelens.load(tmp_path / "variant", **asked)
    assert moelens.load(tmp_path / "variant", variant="v1").moes
    hf.save_pretrained(tmp_path / "plain")
    with pytest.raises(moelens.MoelensError, match=r"Its weights were saved with no variant \(model\.safetensors\): "
                                                   r"load it without variant='fp16'"):
        moelens.load(tmp_path / "plain", variant="fp16")
    hf.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    (tmp_path / "shards" / "model.safetensors.index.json").unlink()
    with pytest.raises(moelens.MoelensError, match=r"It holds \d+ shards of weights \(model-00001-of-\d+\.safetensors, "
                                                   r"\.\.\.\) but not their index \(the \.index\.json file"):
        moelens.load(tmp_path / "shards")


def test_a_damaged_shard_index_or_shard_of_a_sharded_checkpoint_is_named(tmp_path):
    """A shard index that was not JSON gave json's bare "Expecting property name ... (char 1)" for the folder, and one
    truncated shard of 16 "the weights file of '<folder>' cannot be read": neither named the file at fault. Ground
    truth: the file this test damaged; the intact copy loads with the saved model's logits."""
    import shutil

    hf = tiny_model("qwen2_moe")
    good = tmp_path / "good"
    hf.save_pretrained(good, max_shard_size="20KB")
    shards = sorted(good.glob("model-*.safetensors"))
    assert len(shards) > 3 and (good / "model.safetensors.index.json").is_file()
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        assert torch.equal(moelens.load(good)._module(ids).logits, hf(ids).logits)
    bad_index = tmp_path / "bad_index"
    shutil.copytree(good, bad_index)
    (bad_index / "model.safetensors.index.json").write_text("{bad")
    with pytest.raises(moelens.MoelensError, match=rf"shard index {re.escape(repr(str(bad_index / 'model.safetensors.index.json')))}"
                                                   r".* is damaged \(Expecting property name.*\); save the model again "
                                                   r"with save_pretrained, or restore that file"):
        moelens.load(bad_index)
    for text in ("{}", '{"metadata": {"total_size": 1}}', '{"weight_map": []}'):  # JSON, but no weight_map object
        (bad_index / "model.safetensors.index.json").write_text(text)  # (transformers: a bare KeyError 'weight_map')
        with pytest.raises(moelens.MoelensError, match=r"shard index .* is damaged \(it holds no weight_map object\)"):
            moelens.load(bad_index)
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    victim = truncated / shards[2].name
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(moelens.MoelensError, match=r"cannot be read \(.*\): it is damaged or truncated") as error:
        moelens.load(truncated)
    named = re.findall(r"model-\d+-of-\d+\.safetensors", str(error.value))
    assert named == [victim.name] and repr(str(victim)) in str(error.value), str(error.value)
    assert f"1 of its {len(shards)} weights files" in str(error.value)


def test_a_damaged_bin_shard_is_named(tmp_path):
    """A truncated pytorch_model-*.bin shard gave torch's bare "PytorchStreamReader failed reading zip archive",
    naming no file (a damaged .safetensors shard is named). Ground truth: the intact folder loads."""
    import json

    model = tiny_model("mixtral")
    model.config.save_pretrained(tmp_path)
    state = model.state_dict()
    keys = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    for name, names in shards.items():
        torch.save({key: state[key].clone() for key in names}, tmp_path / name)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: name for name, names in shards.items() for key in names}}))
    assert type(moelens.load(tmp_path)._module).__name__ == "MixtralForCausalLM"
    victim = tmp_path / "pytorch_model-00002-of-00002.bin"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(moelens.MoelensError, match=rf"cannot be read \(PytorchStreamReader.*\): it is damaged or "
                                                   rf"truncated \({re.escape(repr(str(victim)))}: 1 of its 2 weights "
                                                   r"files\); save the model again"):
        moelens.load(tmp_path)


@pytest.mark.parametrize("stopped_at", ["router", "root"])
def test_a_wrap_stopped_half_way_leaves_the_model_wrappable(monkeypatch, stopped_at):
    """Ctrl-C in moelens.wrap between nnsight storing a module's state and installing its forward left the state:
    every later wrap (and of a deep copy) warned "forward was replaced" and never served the module (an OrderError
    blaming the read order for the router; nnsight's OutOfOrderError for the root). Ground truth: a pristine copy."""
    import nnsight.intervention.source as source

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    pristine = copy.deepcopy(hf)
    stopped = hf.model.layers[0].mlp.gate if stopped_at == "router" else hf
    controller = source.Controller

    def interrupted(module, state):
        if module is stopped:
            raise KeyboardInterrupt
        return controller(module, state)

    monkeypatch.setattr(source, "Controller", interrupted)
    with pytest.raises(KeyboardInterrupt):
        moelens.wrap(hf)
    monkeypatch.setattr(source, "Controller", controller)
    fresh = moelens.wrap(pristine)
    with torch.no_grad(), fresh.trace(**inputs):
        expected_logits = fresh.moes[0].router_logits.save()
        expected_output = fresh.output.logits.save()
    for model in (hf, copy.deepcopy(hf)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nnsight's "forward was replaced" among them
            wrapped = moelens.wrap(model)
        with torch.no_grad(), wrapped.trace(**inputs):
            logits = wrapped.moes[0].router_logits.save()
            output = wrapped.output.logits.save()
        torch.testing.assert_close((logits, output), (expected_logits, expected_output), rtol=0, atol=0)


def test_a_checkpoint_path_that_cannot_be_read_says_why(tmp_path, monkeypatch):
    """A dangling symbolic link was taken for a hub id ("couldn't connect to huggingface.co"); a config.json that is a
    folder was "no config.json"; a weights file this user may not read was "No such file or directory" (and an
    unreadable config.json "update transformers"). Unreadable is simulated through os.access: root reads anything."""
    from moelens import loading

    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    with pytest.raises(moelens.MoelensError, match=r"no model at .*dangling': it is a symbolic link to a missing path"):
        moelens.load(tmp_path / "dangling")
    (tmp_path / "odd" / "config.json").mkdir(parents=True)
    with pytest.raises(moelens.MoelensError, match=r"odd' is not a transformers checkpoint folder \(its config\.json is "
                                                   r"a folder\)"):
        moelens.load(tmp_path / "odd")
    tiny_model("mixtral").save_pretrained(tmp_path / "saved")
    weights, beside = tmp_path / "saved" / "model.safetensors", tmp_path / "saved" / "training_args.bin"
    beside.write_bytes(b"a Trainer's file the loader never reads")
    monkeypatch.setattr(loading.os, "access", lambda path, mode: str(path) not in (str(weights), str(beside)))
    with pytest.raises(moelens.MoelensError, match=rf"this user may not read {re.escape(repr(str(weights)))} "
                                                   r"\(permission denied\): give read access"):
        moelens.load(tmp_path / "saved")
    monkeypatch.setattr(loading.os, "access", lambda path, mode: str(path) != str(beside))
    assert type(moelens.load(tmp_path / "saved")._module).__name__ == "MixtralForCausalLM"  # a file beside: not read
    snapshot = tmp_path / "snapshot"  # a hub cache's snapshot whose blob of config.json was deleted
    snapshot.mkdir()
    (snapshot / "config.json").symlink_to(tmp_path / "blobs" / "config")
    with pytest.raises(moelens.MoelensError, match=r"snapshot/config\.json' \(to .*blobs/config'\) is a symbolic link "
                                                   r"to a missing file"):
        moelens.load(snapshot)


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("content", ["lfs-pointer", "junk", "binary-junk"])
def test_a_weights_file_that_is_no_weights_file_is_named(tmp_path, weights, content):
    """A pytorch_model.bin that is a Git LFS pointer (a clone without git-lfs) or junk gave torch's traceback:
    UnpicklingError advising weights_only=False (unsafe, and no help) or a bare KeyError (a number). Ground truth:
    the file this test wrote."""
    model = tiny_model("mixtral")
    model.config.save_pretrained(tmp_path)
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 7109896\n"
    junk = {"lfs-pointer": pointer, "junk": b"junk\n", "binary-junk": bytes(range(256)) * 4}[content]
    (tmp_path / weights).write_bytes(junk)  # torch's unpickling: a KeyError, and an UnpicklingError for bytes
    named = re.escape(f"({str(tmp_path / weights)!r}: 1 of its 1 weights files)")
    expected = (rf"{named}: it is a Git LFS pointer, not the weights .*git lfs pull" if content == "lfs-pointer"
                else rf"cannot be read.*: it is damaged or truncated {named}; save the model again")
    with pytest.raises(moelens.MoelensError, match=expected) as refused:
        moelens.load(tmp_path)
    assert "weights_only" not in str(refused.value)  # torch's advice to load the file unsafely, no help here


def test_the_weights_files_checked_are_those_from_pretrained_is_asked_to_read(tmp_path, monkeypatch):
    """moelens picked the weights files transformers reads without its variant= or use_safetensors=: a damaged
    model.fp16.safetensors read with variant="fp16" went unnamed, an unreadable one was "No such file", an LFS pointer
    pytorch_model.bin read with use_safetensors=False beside model.safetensors was "holds objects other than tensors",
    a junk one a bare KeyError; a model.safetensors link to a deleted blob beside a sound .bin (the loader takes the
    .bin) blocked the load; a shard's link to a deleted blob went unnamed; a config's "transformers_weights": null made
    every file beside count. Ground truth: the files this test wrote, and transformers loading the sound ones."""
    import json

    from moelens import loading

    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path / "fp16", variant="fp16")
    variant = tmp_path / "fp16" / "model.fp16.safetensors"
    variant.write_bytes(variant.read_bytes()[:200])
    with pytest.raises(moelens.MoelensError, match=rf"damaged or truncated \({re.escape(repr(str(variant)))}: 1 of its 1"):
        moelens.load(tmp_path / "fp16", variant="fp16")
    monkeypatch.setattr(loading.os, "access", lambda path, mode: str(path) != str(variant))
    with pytest.raises(moelens.MoelensError, match=rf"may not read {re.escape(repr(str(variant)))} \(permission"):
        moelens.load(tmp_path / "fp16", variant="fp16")
    monkeypatch.undo()
    model.save_pretrained(tmp_path / "both")
    bin_file = tmp_path / "both" / "pytorch_model.bin"
    for junk, refusal in ((b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 7\n", "Git LFS pointer"),
                          (b"junk\n", "damaged or truncated")):
        bin_file.write_bytes(junk)
        with pytest.raises(moelens.MoelensError, match=rf"{re.escape(repr(str(bin_file)))}: 1 of its 1 weights files\)"
                                                       rf"(: it is a|; save).*" if refusal == "Git LFS pointer"
                                                       else rf"{refusal} \({re.escape(repr(str(bin_file)))}"):
            moelens.load(tmp_path / "both", use_safetensors=False)
    model.config.save_pretrained(tmp_path / "linked")
    torch.save(model.state_dict(), tmp_path / "linked" / "pytorch_model.bin")
    (tmp_path / "linked" / "model.safetensors").symlink_to(tmp_path / "blobs" / "deleted")
    assert type(moelens.load(tmp_path / "linked")._module).__name__ == "MixtralForCausalLM"
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")  # a shard's blob deleted in a hub cache
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    shard.symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(moelens.MoelensError, match=rf"{re.escape(repr(str(shard)))} \(to .*gone'\) is a symbolic link "
                                                   r"to a missing file"):
        moelens.load(tmp_path / "sharded")
    config = json.loads((tmp_path / "both" / "config.json").read_text())  # a config naming no weights file of its own
    (tmp_path / "both" / "config.json").write_text(json.dumps({**config, "transformers_weights": None}))
    beside = tmp_path / "both" / "training_args.bin"
    beside.write_bytes(b"a Trainer's file")
    monkeypatch.setattr(loading.os, "access", lambda path, mode: str(path) != str(beside))
    assert type(moelens.load(tmp_path / "both")._module).__name__ == "MixtralForCausalLM"
    named = tmp_path / "both" / "weights" / "custom.safetensors"  # a config naming its own file: that one is read
    named.parent.mkdir()
    (tmp_path / "both" / "model.safetensors").rename(named)
    (tmp_path / "both" / "config.json").write_text(json.dumps({**config, "transformers_weights": "weights/custom.safetensors"}))
    monkeypatch.setattr(loading.os, "access", lambda path, mode: str(path) not in (str(beside), str(named)))
    with pytest.raises(moelens.MoelensError, match=rf"may not read {re.escape(repr(str(named)))} \(permission"):
        moelens.load(tmp_path / "both")


def test_a_sound_bin_holding_more_than_tensors_and_a_junk_bin_beside_the_weights_are_told_apart(tmp_path):
    """A pytorch_model.bin holding a numpy array (torch's safe loading refuses it) was called damaged, with torch's
    advice to pass weights_only=False inside; a config error (a rope type transformers does not know: KeyError) in a
    folder holding a junk .bin beside model.safetensors (a GGML file the loader never reads) was blamed on that .bin.
    Ground truth: the files this test wrote; the config error as transformers raises it without the extra file."""
    import json

    import numpy as np

    model = tiny_model("mixtral")
    model.config.save_pretrained(tmp_path / "numpy")
    torch.save({**model.state_dict(), "extra": np.zeros(3)}, tmp_path / "numpy" / "pytorch_model.bin")
    with pytest.raises(moelens.MoelensError, match=r"holds objects other than tensors, which torch's safe loading "
                                                   r"\(weights_only\) refuses: save the model again") as refused:
        moelens.load(tmp_path / "numpy")
    assert "weights_only=False" not in str(refused.value)
    model.save_pretrained(tmp_path / "rope")
    config = json.loads((tmp_path / "rope" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "bogus-rope", "rope_theta": 10000.0}
    (tmp_path / "rope" / "config.json").write_text(json.dumps(config))
    (tmp_path / "rope" / "ggml-model-q4_0.bin").write_bytes(b"ggjt\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(KeyError, match="bogus-rope"):
        moelens.load(tmp_path / "rope")


def test_tokenizer_files_without_a_vocabulary_or_a_class_load_as_the_folder_holds_them(tmp_path):
    """A tokenizer_config.json alone (a chat template, the vocabulary files never copied) became a one-token placeholder
    Qwen2Tokenizer for qwen-type models: text gave no tokens, blamed on the text. A tokenizer.json with no declared
    class (as the tokenizers library saves it) loaded as the model type's tokenizer, which splits text into other ids.
    Ground truth: the folder's tokenizer.json through the tokenizers library."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from moelens.data import TINY_MODEL_PATH

    text = "x = 1\n    return  a+b"
    bare = tmp_path / "bare"
    shutil.copytree(TINY_MODEL_PATH, bare)
    for path in bare.iterdir():
        if path.name.startswith(("tokenizer_config", "special_tokens", "chat_template")):
            path.unlink()
    expected = Tokenizer.from_file(str(bare / "tokenizer.json")).encode(text).ids
    assert moelens.load(bare).tokenizer(text)["input_ids"] == expected
    config_only = tmp_path / "config-only"
    shutil.copytree(TINY_MODEL_PATH, config_only)
    (config_only / "tokenizer.json").unlink()  # a chat template left alone: the model type's class is taken
    (config_only / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    with pytest.warns(UserWarning, match=r"has no vocabulary \(its 2 tokens are all special or added ones: its files "
                                         r"hold settings alone, .*\), so the model takes token ids only"):
        loaded = moelens.load(config_only)
    assert getattr(loaded, "tokenizer", None) is None


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_a_torch_save_file_passed_to_load_is_sent_to_torch_load_not_to_a_folder(tmp_path, zipped):
    """moelens.load("converted.pt") on a model saved with torch.save(model, path) (docs/compress.md's way to save a
    converted model) said "pass that folder", a folder without config.json. Ground truth: the way the error names,
    moelens.wrap(torch.load(path, weights_only=False)), gives back the saved model's logits."""
    hf = tiny_model("mixtral")
    path = tmp_path / "converted.pt"
    torch.save(hf, path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(moelens.MoelensError, match=r"is a file; .*: this one was written by torch\.save, not "
                                                   r"save_pretrained\. Open .* with moelens\.wrap\(torch\.load\(path, "
                                                   r"weights_only=False\)\), only from a source you trust") as error:
        moelens.load(path)
    assert "pass that folder" not in str(error.value)
    ids = tiny_inputs(hf)["input_ids"]
    reopened = moelens.wrap(torch.load(path, weights_only=False))
    with torch.no_grad():
        assert torch.equal(reopened._module(ids).logits, hf(ids).logits)
    weights = tmp_path / "weights.pt"  # weights alone: the advice says what to do with them too
    torch.save(hf.state_dict(), weights, _use_new_zipfile_serialization=zipped)
    with pytest.raises(moelens.MoelensError, match=r"a file of weights alone \(a state_dict\) loads into the model "
                                                   r"built from its config \(model\.load_state_dict"):
        moelens.load(weights)
    (tmp_path / "config.json").write_text("{}")  # beside a checkpoint: still torch.load, and the folder for that one
    folder = re.escape(repr(str(tmp_path)))
    with pytest.raises(moelens.MoelensError, match=rf"is a file; .*: this one was written by torch\.save.*\(for the "
                                                   rf"checkpoint beside it, pass {folder}\)\.$"):
        moelens.load(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: device_map='cuda' loads")
def test_a_device_map_this_torch_cannot_place_is_named():
    """device_map="cuda" on a CPU-only torch raised torch's bare AssertionError."""
    with pytest.raises(moelens.MoelensError, match=r"where device_map='cuda' places it: Torch not compiled with CUDA "
                                                   r"enabled \(this torch build has no such device\)"):
        moelens.load("moelens-tiny", device_map="cuda")


def test_a_model_without_tokenizer_refuses_text_in_one_invoke(tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path / "olmoe")
    loaded = moelens.load(tmp_path / "olmoe")
    for prompt in ("def f(x):", ["a", "bc"]):
        with pytest.raises(moelens.MoelensError, match="wrapped without a tokenizer, so it takes token ids, not text"):
            with loaded.trace(prompt):
                loaded.moes[0].router_logits.save()


def test_a_model_with_a_tokenizer_refuses_an_input_that_is_no_prompt_or_ids():
    """model.trace(12345) failed inside transformers' text pipeline with "can only concatenate str (not "int") to
    str", so did a list mixing prompts with None or ints, a path and a dict of no ids; numpy arrays of floats or text
    failed in a cast. Ids as a list of ints or an integer array, a dict of ids and text still run."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    path = pathlib.Path("prompt.txt")
    for given, what in ((12345, "int 12345"), (3.5, "float 3.5"), (b"abc", "bytes"), ([1.5, 2.0], "a list holding float 1.5"),
                        (["hello", None], "a list holding NoneType None"), (["hello", 5], "a list holding str and int 5"),
                        ([["hello"]], "a list holding a list of str"), (path, type(path).__name__),
                        ({"text": "hello"}, "a dict with keys ['text'] (no input_ids)"),
                        (numpy.array([[1.0, 2.0]]), "a numpy array of float64"), (numpy.array(["hello"]), "a numpy array of <U5")):
        for run in (lambda: wrapped.trace(given), lambda: wrapped.generate(given, max_new_tokens=1)):
            with pytest.raises(moelens.MoelensError, match=rf"a trace's input was {re.escape(what)}: a model wrapped "
                                                           r"with a tokenizer takes text .* token ids"):
                with run():
                    wrapped.output.save()
        with pytest.raises(moelens.MoelensError, match=rf"a trace's input was {re.escape(what)}"):
            with wrapped.trace() as tracer:
                with tracer.invoke("hello"):
                    pass
                with tracer.invoke(given):
                    pass
    expected = hf(torch.tensor([[5, 6, 7]], device=hf.device)).logits
    for ids in ([5, 6, 7], numpy.array([[5, 6, 7]]), {"input_ids": torch.tensor([[5, 6, 7]])}):
        with wrapped.trace(ids):
            by_ids = wrapped.output.logits.save()
        assert torch.equal(by_ids, expected)
    with wrapped.trace(None, input_ids=torch.tensor([[5, 6, 7]])):  # no positional input: the ids by keyword
        by_keyword = wrapped.output.logits.save()
    assert torch.equal(by_keyword, expected)


def test_ids_without_a_batch_and_sequence_axis_or_on_meta_are_refused_by_name():
    """A 0-d tensor failed in nnsight's batching with a bare IndexError, [1, 1, s] ids in transformers' masking, [[]] in
    its text pipeline ("can only concatenate str"), meta ids with torch's "Cannot copy out of meta tensor"."""
    hf = tiny_model("mixtral")
    ids = tiny_inputs(hf)["input_ids"][:1]
    with_tokenizer, without = moelens.wrap(hf, tokenizer=ascii_tokenizer()), moelens.wrap(copy.deepcopy(hf))
    zero_d = r"a trace's input was a 0-d tensor \(tensor\(5\)\), one id without a batch and a sequence axis"
    on_meta = r"the trace's input (input_ids|argument 0) is on the meta device, which holds shapes but no values"
    refused = [(with_tokenizer, torch.tensor(5), zero_d), (without, torch.tensor(5), zero_d),
               (with_tokenizer, ids[None], r"token ids were of shape \(1, 1, \d+\): a model wrapped with a tokenizer "
                                           r"takes ids \[batch, seq\]"),
               (with_tokenizer, [[]], r"token ids were a list holding an empty row \[\[\]\]"),
               (with_tokenizer, [[5, 6], []], r"a list holding an empty row"),
               (with_tokenizer, ids.to("meta"), on_meta), (without, ids.to("meta"), on_meta)]
    for wrapped, given, message in refused:
        with pytest.raises(moelens.MoelensError, match=message):
            with wrapped.trace(given):
                wrapped.moes[0].router_logits.save()
    for given, message in ((torch.tensor(5), zero_d), (ids.to("meta"), r"an invoke's token ids are on the meta device")):
        with pytest.raises(moelens.MoelensError, match=message):
            with without.trace() as tracer:
                with tracer.invoke(ids):
                    pass
                with tracer.invoke(given):
                    pass
    with with_tokenizer.trace(ids[0]):  # one row [seq] is a prompt
        logits = with_tokenizer.output.logits.save()
    assert torch.equal(logits, hf(ids).logits)


def test_a_model_without_tokenizer_refuses_a_generate_trace():
    """nnsight traces generation only with a tokenizer: without one, model.generate would run the model's own
    generate untraced and then fail on the with statement ('Tensor' object does not support the context manager)."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf)["input_ids"]
    with pytest.raises(moelens.MoelensError, match=r"generate.*needs a tokenizer.*model._module.generate"):
        with wrapped.generate(ids, max_new_tokens=2):
            wrapped.moes[0].router_logits.save()


def test_tokenizer_files_that_do_not_load_are_named(tmp_path):
    from groundtruth import ascii_tokenizer

    folder = tmp_path / "mixtral"
    tiny_model("mixtral").save_pretrained(folder)
    ascii_tokenizer().save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.warns(UserWarning, match=r"the tokenizer saved at .* does not load \(JSONDecodeError.*; fix or re-save"):
        loaded = moelens.load(folder)
    assert getattr(loaded, "tokenizer", None) is None
    # a clone without git-lfs: the warning said "fix or re-save the tokenizer files", naming neither the file nor LFS
    (folder / "tokenizer.json").write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'a' * 64}\n")
    with pytest.warns(UserWarning, match=r"does not load .*; tokenizer\.json is a Git LFS pointer, not the file .*"
                                         r"git lfs pull"):
        moelens.load(folder)


def test_load_reads_config_and_tokenizer_from_the_subfolder(tmp_path):
    from groundtruth import ascii_tokenizer

    tiny_model("mixtral").save_pretrained(tmp_path / "full")
    ascii_tokenizer().save_pretrained(tmp_path / "full")
    loaded = moelens.load(tmp_path, subfolder="full")
    assert type(loaded._module).__name__ == "MixtralForCausalLM" and loaded.tokenizer is not None
    with loaded.trace("def"):
        logits = loaded.moes[0].router_logits.save()
    assert logits.shape[:2] == (1, 3)


def test_load_keeps_the_head_of_the_class_the_checkpoint_was_saved_from(tmp_path):
    """A vision-language MoE (no causal-LM auto class) keeps its LM head; a base model stays a base model."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from moelens.testing import tiny_config

    text = tiny_config("qwen3_vl_moe").get_text_config().to_dict()
    config = AutoConfig.for_model(
        "qwen3_vl_moe", text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"],
                           deepstack_visual_indexes=[]),
    )
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "vlm")
    loaded = moelens.load(tmp_path / "vlm")
    assert type(loaded._module).__name__ == "Qwen3VLMoeForConditionalGeneration" and loaded.moes
    with loaded.trace(torch.tensor([[5, 6, 7]])):
        logits = loaded.output.logits.save()
    assert logits.shape == (1, 3, text["vocab_size"])
    tiny_model("mixtral").model.save_pretrained(tmp_path / "base")
    assert type(moelens.load(tmp_path / "base")._module).__name__ == "MixtralModel"


def test_an_architectures_entry_for_another_model_type_is_not_trusted(tmp_path):
    """A checkpoint whose architectures names a class of another model type (left from a conversion)
    loads with the class its model_type gives, as transformers' auto class does."""
    import json

    folder = tmp_path / "mixtral"
    tiny_model("mixtral").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    assert type(moelens.load(folder)._module).__name__ == "MixtralForCausalLM"


def test_load_takes_a_model_type_the_user_registered_with_transformers_auto_classes(tmp_path):
    """A user's model type registered with AutoConfig and AutoModelForCausalLM (and AutoModel): load
    refused it ("for this kind of AutoModel"), or with AutoModel registered too lost the LM head."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen2MoeConfig
    from transformers import Qwen2MoeForCausalLM, Qwen2MoeModel

    class UsersConfig(Qwen2MoeConfig):
        model_type = "moelens_test_users_moe"

    class UsersModel(Qwen2MoeModel):
        config_class = UsersConfig

    class UsersForCausalLM(Qwen2MoeForCausalLM):
        config_class = UsersConfig

    AutoConfig.register(UsersConfig.model_type, UsersConfig, exist_ok=True)
    AutoModelForCausalLM.register(UsersConfig, UsersForCausalLM, exist_ok=True)
    AutoModel.register(UsersConfig, UsersModel, exist_ok=True)
    model = tiny_model("qwen2_moe")
    users = UsersForCausalLM(UsersConfig(**model.config.to_dict()))
    users.load_state_dict(model.state_dict())
    users.save_pretrained(tmp_path, save_original_format=False)  # no weight conversion is known for this type
    loaded = moelens.load(tmp_path)
    assert type(loaded._module) is UsersForCausalLM and len(loaded.moes) == len(moelens.wrap(model).moes)
    ids = torch.tensor([[5, 6, 7]])
    with loaded.trace(ids):
        logits = loaded.output.logits.save()
    torch.testing.assert_close(logits, model(ids.to(model.device)).logits.to(logits.device))


def test_errors_of_loading_that_are_not_a_size_mismatch_pass_through(tmp_path, monkeypatch):
    from transformers import MixtralForCausalLM

    tiny_model("mixtral").save_pretrained(tmp_path / "mixtral")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(MixtralForCausalLM, "from_pretrained", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        moelens.load(tmp_path / "mixtral")


def test_weights_the_config_does_not_fit_are_reported(tmp_path):
    import json

    folder = tmp_path / "mixtral"
    tiny_model("mixtral").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    deeper = tmp_path / "deeper"  # a layer the checkpoint does not hold: it would stay random
    deeper.mkdir()
    (deeper / "model.safetensors").symlink_to(folder / "model.safetensors")
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    with pytest.warns(UserWarning, match=r"weights of the model are not saved at .* keep their initial \(random\)"):
        moelens.load(deeper)
    wider = tmp_path / "wider"  # experts of another width than the saved ones
    wider.mkdir()
    (wider / "model.safetensors").symlink_to(folder / "model.safetensors")
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(moelens.MoelensError, match=r"do not fit the model its config describes: 8 weights have another "
                                                   r"shape: model.layers.0.mlp.experts.down_proj is saved as \[8, 32, 16\], "
                                                   r"the model has \[8, 32, 32\];.*\(and 5 more\)\. Load them with the "
                                                   "config they were saved with"):
        moelens.load(wider)  # transformers' own message pointed at a report moelens' CLI hides
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(config))
    (truncated / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(moelens.MoelensError, match=r"a weights file of .* cannot be read \(.*\): it is damaged or "
                                                   "truncated"):
        moelens.load(truncated)  # was safetensors' own SafetensorError


def test_a_bad_from_pretrained_setting_gets_transformers_message_only(tmp_path):
    folder = tmp_path / "mixtral"
    tiny_model("mixtral").save_pretrained(folder)
    with pytest.raises(moelens.MoelensError, match="experts_implementation") as error:
        moelens.load(folder, experts_implementation="grouped")
    assert "Load it with the transformers class" not in str(error.value)


def test_unknown_intervention_input(mixtral):
    wrapped, inputs = mixtral
    with pytest.raises(WriteError, match="ablate mode 'drop'"):
        with wrapped.trace(**inputs):
            moelens.ablate(wrapped.moes[0], 1, "drop")
    with pytest.raises(WriteError, match="out of range"):
        with wrapped.trace(**inputs):
            moelens.steer(wrapped.moes[0], 8, 1.0)
    with pytest.raises(WriteError, match="needs to="):
        with wrapped.trace(**inputs):
            moelens.ablate(wrapped.moes[0], 1, "swap")
    with pytest.raises(WriteError, match=r"to=1 gives each expert its own slots, so nothing would change"):
        with wrapped.trace(**inputs):  # was taken, and the expert ran on
            moelens.ablate(wrapped.moes[0], 1, "swap", to=numpy.int64(1))
    with pytest.raises(WriteError, match=r"reroute: expert ids must be integers, got torch.float32"):
        with wrapped.trace(**inputs):
            moelens.reroute(wrapped.moes[0], (0, 1), 1.7)  # was truncated to expert 1


@pytest.mark.parametrize(
    "intervene",
    [lambda b: moelens.ablate(b, 1), lambda b: moelens.ablate(b, 1, "route_around"), lambda b: moelens.steer(b, 1, 2.0),
     lambda b: moelens.force(b, 1), lambda b: moelens.reroute(b, (0, 0), 1)],
    ids=["ablate", "route_around", "steer", "force", "reroute"],
)
def test_interventions_on_a_dense_block_name_the_moe_layers(intervene):
    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    with pytest.raises(WriteError, match=r"layers.0.mlp is a dense MLP .*MoE layers are \[1, 2, 3\]"):
        with wrapped.trace(**inputs):
            intervene(wrapped.layers[0].mlp)
    with pytest.raises(WriteError, match=r"takes an MoE block .*got Tensor"):
        intervene(torch.zeros(2))
    hf, wrapped, inputs, plain, reference = built("gemma4", "grouped_mm")  # the layer is the Moe, beside its mlp
    with pytest.raises(WriteError, match=r"layers.2.mlp is a dense MLP .*shared expert of the MoE block "
                                         r"model.model.layers.2, the decoder layer itself \(model.layers\[2\]\)"):
        with wrapped.trace(**inputs):
            intervene(wrapped.layers[2].mlp)


def test_force_takes_a_tensor_expert_id(mixtral):
    wrapped, inputs = mixtral
    forced = []
    for expert in (6, torch.tensor(6), numpy.array(6), numpy.array([6])):  # a 0-d numpy array raised TypeError
        with wrapped.trace(**inputs):
            moelens.force(wrapped.moes[0], expert)
            forced.append(wrapped.moes[0].expert_indices.save())
    assert all(torch.equal(forced[0], other) for other in forced[1:]) and (forced[0][..., 0] == 6).all()


# -- a custom family, registered without editing moelens --------------------------------------


def test_a_registered_custom_family_is_served():
    model = custom_model()
    family = moelens.families.register(Family(
        "custom", ("custom",), ("CustomBlock",), block_attr="ffn", router="chooser", experts="pool",
        logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk", normalize=False),
    ))
    try:
        assert family in moelens.families.supported()
        assert "custom" in moelens.families.supported()  # by name, as the list prints (it held entries only: False)
        assert "costum" not in moelens.families.supported() and 3 not in moelens.families.supported()
        wrapped = moelens.wrap(model)
        assert [moe.layer for moe in wrapped.moes] == [0, 1]
        assert wrapped.layers[1].mlp is wrapped.moes[1]  # `ffn` aliased as the standard `mlp`
        ids = torch.randint(0, 64, (2, 3))
        with wrapped.trace(ids):
            values = wrapped.moes[1].save_all()
        plain = nnsight.NNsight(copy.deepcopy(model))
        with plain.trace(ids) as tracer:
            cache = tracer.cache(modules=["model.layers.1.ffn.chooser", "model.layers.1.ffn.pool"])
        logits, weights, index = cache["model.layers.1.ffn.chooser"].output
        torch.testing.assert_close(values["router_logits"], logits.reshape(2, 3, -1))
        assert torch.equal(values["expert_indices"], index.reshape(2, 3, -1))
        torch.testing.assert_close(values["routed_output"], cache["model.layers.1.ffn.pool"].output.reshape(2, 3, -1))
        torch.testing.assert_close(values["expert_outputs"].sum(2), values["routed_output"])
    finally:
        moelens.families.unregister("custom")


def test_invokes_batch_for_a_plain_module_without_config_or_mask():
    """CustomModel.forward takes input_ids only, and one copy has no config: several invokes raised raw
    AttributeError / TypeError (moelens passed attention_mask and position_ids)."""
    model = custom_model()
    bare = copy.deepcopy(model)
    del bare.config
    first, second = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])
    moelens.families.register(Family(
        "custom", ("custom",), ("CustomBlock",), block_attr="ffn", router="chooser", experts="pool",
        logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk")))
    try:
        for wrapped in (moelens.wrap(model), moelens.wrap(bare)):
            alone = []
            for ids in (first, second):
                with wrapped.trace(ids):
                    alone.append(wrapped.moes[1].expert_weights.save())
            with wrapped.trace() as tracer:
                with tracer.invoke(first):
                    a = wrapped.moes[1].expert_weights.save()
                with tracer.invoke(second):
                    b = wrapped.moes[1].expert_weights.save()
            torch.testing.assert_close([a, b], alone)
            refusal = r"CustomModel.forward takes no attention_mask, so padding .* cannot be masked"
            with pytest.raises(moelens.MoelensError, match=refusal):
                with wrapped.trace() as tracer:
                    with tracer.invoke(first):
                        pass
                    with tracer.invoke(second[:, :2]):
                        pass
            # an all-ones mask (what moelens' analysis and export pass) masks nothing: left out, not a TypeError
            with wrapped.trace(input_ids=first, attention_mask=torch.ones_like(first)):
                masked = wrapped.moes[1].expert_weights.save()
            torch.testing.assert_close(masked, alone[0])
            with pytest.raises(moelens.MoelensError, match=refusal):
                with wrapped.trace(input_ids=first, attention_mask=torch.tensor([[0, 1, 1]])):
                    pass
    finally:
        moelens.families.unregister("custom")


class MaskedModel(CustomModel):
    """A forward that requires the attention mask, as many hand-written models have it."""

    def forward(self, input_ids, attention_mask):
        hidden = self.embed(input_ids) * attention_mask[..., None]
        for layer in self.layers:
            hidden = hidden + layer["ffn"](hidden)
        return hidden


def test_invokes_of_one_length_pass_a_mask_to_a_forward_that_requires_one():
    model = custom_model()
    masked = MaskedModel(model.config).eval()
    masked.load_state_dict(model.state_dict())
    first, second = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])
    moelens.families.register(custom_family())
    try:
        wrapped = moelens.wrap(masked)
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke(first):
                a = wrapped.output.save()
            with tracer.invoke(second):
                b = wrapped.output.save()
        with torch.no_grad():
            expected = masked(torch.cat([first, second]), torch.ones(2, 3, dtype=torch.long))
        torch.testing.assert_close(torch.cat([a, b]), expected, rtol=0, atol=0)
    finally:
        moelens.families.unregister("custom")


class KeywordBlock(CustomBlock):
    """Calls its experts with the routing as keywords: experts(x, top_k_index=..., top_k_weights=...)."""

    def forward(self, hidden):
        b, s, d = hidden.shape
        flat = hidden.reshape(-1, d)
        _, weights, index = self.chooser(flat)
        return self.pool(flat, top_k_index=index, top_k_weights=weights).reshape(b, s, d)


def test_experts_called_with_keywords_serve_and_take_the_routing():
    """Reading expert_weights / expert_indices of such a call raised a raw IndexError."""
    positional = custom_model()
    keyword = copy.deepcopy(positional)
    for layer in keyword.layers:
        layer["ffn"].__class__ = KeywordBlock
    ids = torch.randint(0, 64, (2, 3))
    results = []
    for model, block in ((positional, "CustomBlock"), (keyword, "KeywordBlock")):
        moelens.families.register(Family(
            "custom", ("custom",), (block,), block_attr="ffn", router="chooser", experts="pool",
            logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk")))
        try:
            wrapped = moelens.wrap(model)
            with torch.no_grad(), wrapped.trace(ids):
                weights = wrapped.moes[0].expert_weights.save()
                indices = wrapped.moes[0].expert_indices.save()
                moelens.ablate(wrapped.moes[1], 2)
                moelens.reroute(wrapped.moes[1], (0, 1), 3)
                output = wrapped.output.save()
            results.append((weights, indices, output))
        finally:
            moelens.families.unregister("custom")
    for positional_value, keyword_value in zip(*results):
        assert torch.equal(positional_value, keyword_value)


class LoopExperts(torch.nn.Module):
    """Experts called like transformers' but not decorated: a loop of their own, no grouped_mm."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, hidden) * 0.3)

    def forward(self, hidden, index, weights):
        out = torch.zeros_like(hidden)
        for slot in range(index.shape[-1]):
            out = out + weights[:, slot, None] * torch.einsum("th,thd->td", hidden, self.weight[index[:, slot]])
        return out


def test_undecorated_custom_experts_say_why_they_have_no_per_slot_values():
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    model = CustomModel(config).eval()
    for layer in model.layers:
        layer["ffn"].pool = LoopExperts(4, 16)
    moelens.families.register(Family(
        "custom", ("custom",), ("CustomBlock",), block_attr="ffn", router="chooser", experts="pool",
        logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk", normalize=False),
    ))
    try:
        wrapped = moelens.wrap(model)
        with pytest.raises(ValueUnavailable, match="LoopExperts.*not decorated.*use_experts_implementation"):
            with wrapped.trace(torch.randint(0, 64, (1, 3))):
                wrapped.moes[0].expert_outputs.save()
    finally:
        moelens.families.unregister("custom")


class OwnKeywordsBlock(CustomBlock):
    """Loop experts called with keywords of its own names (index=, weights=), and a tuple (hidden, logits) returned."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pool = LoopExperts(config.num_local_experts, config.hidden_size)

    def forward(self, hidden):
        b, s, d = hidden.shape
        flat = hidden.reshape(-1, d)
        logits, weights, index = self.chooser(flat)
        return self.pool(flat, index=index, weights=weights).reshape(b, s, d), logits


class TupleModel(CustomModel):
    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            output = layer["ffn"](hidden)
            hidden = hidden + (output[0] if isinstance(output, tuple) else output)
        return hidden


def test_a_custom_block_described_wrongly_says_what_to_fix():
    """Experts called with other keyword names raised NameError; a tuple output read without output_index an
    AttributeError ('Moe' has no attribute 'mlp_output'); output_index on a block returning a tensor silently
    served its first batch row as mlp_output."""
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    tuple_model = TupleModel(config).eval()
    for layer in tuple_model.layers:
        layer["ffn"].__class__ = OwnKeywordsBlock
        layer["ffn"].pool = LoopExperts(4, 16)
    ids = torch.randint(0, 64, (2, 3))
    cases = [
        (tuple_model, "OwnKeywordsBlock", None, "expert_weights", ValueUnavailable,
         r"passed 1 positional arguments and \['index', 'weights'\], but moelens reads its argument 2 \(top_k_weights\) "
         r"\(passed under a keyword of its own\? moelens reads it at position 2 or as top_k_weights=\): call it"),
        (tuple_model, "OwnKeywordsBlock", None, "mlp_output", moelens.FamilyError,
         r"layers.0.ffn.mlp_output: .* serves a tuple, not values per token.*Combine\(output_index="),
        (custom_model(), "CustomBlock", 0, "mlp_output", moelens.FamilyError,
         r"returned a Tensor, not a tuple, but its family entry reads element 0 .*Combine\(output_index=None\)"),
    ]
    for model, block, output_index, value, error, match in cases:
        moelens.families.register(Family(
            "custom", ("custom",), (block,), block_attr="ffn", router="chooser", experts="pool",
            logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk"),
            num_experts=4, combine=moelens.families.Combine(output_index=output_index)))
        try:
            wrapped = moelens.wrap(model)
            with pytest.raises(error, match=match):
                with torch.no_grad(), wrapped.trace(ids):
                    getattr(wrapped.moes[0], value).save()
            with torch.no_grad(), wrapped.trace(ids):  # the router's values are served all the same
                logits = wrapped.moes[0].router_logits.save()
            assert logits.shape == (2, 3, 4)
        finally:
            moelens.families.unregister("custom")


def test_a_write_that_overflows_a_half_precision_model_is_refused():
    """The refusal said the written tensor held +inf (the user wrote none) and, for logits, advised the large finite
    raise they had just written."""
    hf = tiny_model("mixtral", dtype=torch.float16)
    wrapped = moelens.wrap(hf)
    with pytest.raises(WriteError, match=r"routed_output: the written values reach 1e\+06, beyond what the model's "
                                         r"torch.float16 holds \(at most 6.55e\+04\); write values within it\.$"):
        with wrapped.trace(**tiny_inputs(hf)):
            moe = wrapped.moes[0]
            moe.routed_output = torch.full(moe.routed_output.shape, 1e6)  # finite in float32, inf in float16
    with pytest.raises(WriteError, match=r"router_logits: the written values reach 1e\+05, beyond .*float16 holds "
                                         r"\(at most 6.55e\+04\); write values within it \(a few tens already"):
        with wrapped.trace(**tiny_inputs(hf)):
            moe = wrapped.moes[0]
            logits = moe.router_logits.float()
            logits[..., 0] = 1e5
            moe.router_logits = logits
    with pytest.raises(WriteError, match=r"routed_output: the written tensor holds \+inf; .*\.$"):  # an infinity written
        with wrapped.trace(**tiny_inputs(hf)):
            moe = wrapped.moes[0]
            moe.routed_output = torch.full(moe.routed_output.shape, float("inf"))
    with pytest.raises(WriteError, match=r"router_logits: the written tensor holds \+inf; .*moelens.force\) \(in "
                                         r"torch.float16 a number beyond 6.55e\+04 is \+inf\)"):  # in place: inf there
        with wrapped.trace(**tiny_inputs(hf)):
            wrapped.moes[0].router_logits[..., 0] = 1e5


def test_a_finite_write_a_sigmoid_router_takes_as_inf_is_taken():
    """deepseek_v3's sigmoid scores saturate at +inf logits, which a write may hold: 1e39 in float64, +inf in the
    float32 logits, was refused as an overflow while +inf itself passed. Both route alike."""
    hf = tiny_model("deepseek_v3")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    routed = []
    for big in (float("inf"), 1e39):
        with torch.no_grad(), wrapped.trace(**inputs):
            moe = wrapped.moes[0]
            logits = moe.router_logits.double()
            logits[..., 3] = big
            moe.router_logits = logits
            routed.append(moe.expert_indices.save())
    assert torch.equal(routed[0], routed[1]) and (routed[0] == 3).any(-1).all()


def test_a_dense_block_names_its_own_order_without_save_all():
    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    dense = wrapped.layers[0].mlp
    with pytest.raises(ValueUnavailable, match="dense MLP"):
        with wrapped.trace(**inputs):
            dense.selection_scores.save()
    with pytest.raises(moelens.OrderError) as error:
        with wrapped.trace(**inputs):
            dense.mlp_output.save()
            dense.mlp_activation.save()
    assert "mlp_activation -> mlp_output" in str(error.value) and "save_all" not in str(error.value)


def test_a_family_naming_a_missing_op_is_refused_at_wrap():
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    moelens.families.register(Family("custom", ("custom",), ("CustomBlock",), block_attr="ffn", router="chooser",
                                     experts="pool"))
    try:
        with pytest.raises(moelens.FamilyError, match="logits_op='F_linear_0'.*torch_nn_functional_linear_0"):
            moelens.wrap(CustomModel(config))
    finally:
        moelens.families.unregister("custom")


def test_a_family_with_wrong_child_paths_says_so_at_wrap():
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    for router, experts, expected in (("choser", "pool", r"no router at 'choser'; its children are \['chooser', 'pool'\]"),
                                      ("chooser", "pol", r"hold no experts module at 'pol'")):
        moelens.families.register(Family("custom", ("custom",), ("CustomBlock",), block_attr="ffn", router=router,
                                         experts=experts, logits_op="torch_nn_functional_linear_0"))
        try:
            if router == "choser":
                with pytest.raises(moelens.FamilyError, match=expected):
                    moelens.wrap(CustomModel(config))
            else:
                with pytest.warns(UserWarning, match=expected):
                    assert moelens.wrap(CustomModel(config)).moes == []
        finally:
            moelens.families.unregister("custom")


class BlockOut(NamedTuple):
    hidden: torch.Tensor
    router_logits: torch.Tensor


class NamedTupleBlock(CustomBlock):
    """`CustomBlock` returning its output and the router logits as a NamedTuple."""

    def forward(self, hidden):
        b, s, d = hidden.shape
        flat = hidden.reshape(-1, d)
        logits, weights, index = self.chooser(flat)
        return BlockOut(self.pool(flat, index, weights).reshape(b, s, d), logits)


class NamedTupleModel(CustomModel):
    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer["ffn"](hidden).hidden
        return hidden


def test_a_write_into_a_named_tuple_output_keeps_its_type():
    """A block returning a NamedTuple: writing mlp_output rebuilt it as type(raw)(one_tuple), a TypeError. Ground
    truth: the model run by hand with the second block's output zeroed."""
    model = custom_model()
    model.__class__ = NamedTupleModel
    for layer in model.layers:
        layer["ffn"].__class__ = NamedTupleBlock
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model.embed(ids)
        expected = expected + model.layers[0]["ffn"](expected).hidden
    families.register(dataclasses.replace(custom_family(combine=moelens.families.Combine(output_index=0)),
                                          block_classes=("NamedTupleBlock",)))
    try:
        wrapped = moelens.wrap(model)
        assert len(wrapped.moes) == 2
        with torch.no_grad(), wrapped.trace(ids):
            wrapped.moes[1].mlp_output = torch.zeros_like(wrapped.moes[1].mlp_output)
            output = wrapped.output.save()
    finally:
        families.unregister("custom")
    assert torch.equal(output, expected)


@pytest.mark.parametrize("changes, expected", [
    ({"shared": families.SharedExpert("pool", gate="pool_gat", gated_op="mul_0")}, r"has no gate at 'pool_gat'.* SharedExpert.gate path"),
    ({"combine": families.Combine(routed_post="post")}, r"has no routed_post at 'post'.* Combine.routed_post path"),
    ({"combine": families.Combine(block_post="chooser.norm")}, r"has no block_post at 'chooser.norm'"),
])
def test_a_registered_family_naming_a_missing_module_says_so_at_wrap(changes, expected):
    """A misspelt shared-expert gate or post module passed wrap and reads, then failed the export with a bare
    AttributeError naming neither the family nor the field."""
    moelens.families.register(custom_family(**changes))
    try:
        with pytest.raises(moelens.FamilyError, match=rf"family 'custom': block layers.0.ffn \(CustomBlock\) {expected}"):
            moelens.wrap(custom_model())
    finally:
        moelens.families.unregister("custom")


def test_set_experts_implementation_switches_every_block_of_any_wrapped_model():
    """transformers left a subclass defined outside its own files on eager (batched_mm: without a word;
    grouped_mm: "does not support setting"), and a plain torch model had no switch, while moelens'
    errors advised model.set_experts_implementation."""
    from custom_models import UsersQwen2Moe

    config = tiny_model("qwen2_moe").config
    config._experts_implementation = "eager"
    users = UsersQwen2Moe(config)
    plain = custom_model()
    plain.config._experts_implementation = "eager"
    families.register(custom_family())
    try:
        for model in (moelens.wrap(users.eval()), moelens.wrap(plain)):
            ids = torch.tensor([[3, 4, 5, 6]])
            with model.trace(ids):
                eager = model.output.save()
            for implementation in ("batched_mm", "grouped_mm"):
                model.set_experts_implementation(implementation)
                assert {moe.experts_implementation for moe in model.moes} == {implementation}
                with model.trace(ids):
                    outputs = model.moes[-1].expert_outputs.save()
                    routed = model.moes[-1].routed_output.save()
                    switched = model.output.save()
                torch.testing.assert_close(outputs.sum(2), routed)
                torch.testing.assert_close(first_tensor(switched), first_tensor(eager))
            model.set_experts_implementation({"": "eager"})  # transformers' dict form: "" is the model's own config
            assert {moe.experts_implementation for moe in model.moes} == {"eager"}
            if model._module is plain:  # an implementation for FP8 weights is transformers' to pick at load
                with pytest.raises(moelens.MoelensError, match=r"cannot be switched to 'deepgemm_megamoe': it is "
                                                               r"transformers' implementation for FP8 weights"):
                    model.set_experts_implementation("deepgemm_megamoe")
                assert {moe.experts_implementation for moe in model.moes} == {"eager"}
            with pytest.raises((moelens.MoelensError, ValueError), match=r"unknown experts implementation 'grouped'|"
                               r'experts_implementation="grouped"` is not supported'):  # moelens' or transformers' check
                model.set_experts_implementation("grouped")
    finally:
        families.unregister("custom")


def test_set_experts_implementations_dict_form_reaches_layers_in_a_model_without_a_config():
    """A torch model of one's own holding transformers decoder layers (no config of its own): {"": "eager"}
    switched nothing, without a word, while "eager" switched every block."""
    hf = tiny_model("mixtral")

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.layers, self.rotary = hf.model.embed_tokens, hf.model.layers, hf.model.rotary_emb

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(input_ids)
            positions = torch.arange(input_ids.shape[1])[None]
            embeddings = self.rotary(hidden, positions)
            for layer in self.layers:
                hidden = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            return hidden

    model = moelens.wrap(Plain())
    assert {moe.experts_implementation for moe in model.moes} == {"grouped_mm"}
    model.set_experts_implementation({"": "eager"})
    assert {moe.experts_implementation for moe in model.moes} == {"eager"}


def test_set_experts_implementation_refuses_a_key_naming_no_sub_config():
    """transformers' dict form passes over a key naming no sub-config without a word: a misspelt one switched
    nothing."""
    model = moelens.wrap(tiny_model("qwen2_moe"))
    with pytest.raises(moelens.MoelensError, match=r"'text_config' names no sub-config of this model; its keys are "
                                                   r'"" \(the model\'s own config\)\.'):
        model.set_experts_implementation({"": "eager", "text_config": "eager"})
    assert {moe.experts_implementation for moe in model.moes} == {"grouped_mm"}  # nothing switched before refusing


def test_torch_a2a_before_it_is_registered_says_how_to_register_it():
    """Unregistered, torch_a2a was "unknown" with no way to it (a fresh process: registration lasts for the process)."""
    code = ("import moelens\n"
            "from moelens.components.implementations import check_known\n"
            "try:\n    check_known('torch_a2a')\nexcept moelens.MoelensError as error:\n    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("unknown experts implementation 'torch_a2a'; known: eager, ")
    assert result.stdout.strip().endswith("moelens' expert-parallel one is registered by "
                                          "moelens.parallel.register_torch_a2a() (shard_experts calls it).")


def test_set_experts_implementation_refuses_grouped_mm_for_float64_experts_before_switching_anything():
    """torch's grouped_mm runs no float64 matrices: the switch took it and the next forward failed with torch's
    "Expected mat_a to be Float32, BFloat16 or Float16 matrix". Ground truth: the float64 model's own forward on
    batched_mm, which the refused switch left in place."""
    hf = tiny_model("mixtral", experts_implementation="batched_mm").double()
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        expected = hf(**inputs).logits
    model = moelens.wrap(hf)
    with pytest.raises(moelens.MoelensError, match=r"model.layers.0.mlp's experts hold float64 weights, which torch's "
                                                   r'grouped_mm does not run .*pass "batched_mm" or "eager"'):
        model.set_experts_implementation("grouped_mm")
    assert {moe.experts_implementation for moe in model.moes} == {"batched_mm"}
    with torch.no_grad(), model.trace(**inputs):
        logits = model.output.logits.save()
    assert torch.equal(logits, expected)


def test_a_float64_model_on_grouped_mm_says_which_block_and_how_to_switch_as_it_runs():
    """moelens.load(path, dtype=torch.float64) keeps transformers' default grouped_mm: the first trace failed with
    torch's "Expected mat_a to be Float32, BFloat16 or Float16 matrix". Ground truth after the switch: the float64
    model's own forward on batched_mm."""
    hf = tiny_model("mixtral").double()
    inputs = tiny_inputs(hf)
    model = moelens.wrap(hf)
    with pytest.raises(moelens.MoelensError, match=r"^model\.model\.layers\.0\.mlp's experts hold float64 weights, "
                                                   r"which torch's grouped_mm does not run .*: switch with "
                                                   r'model\.set_experts_implementation\("batched_mm"\) \(or "eager"\)'):
        with torch.no_grad(), model.trace(**inputs):
            model.output.save()
    with pytest.raises(RuntimeError, match=r"^my own error$"):  # the user's own error there is left as it is
        with torch.no_grad(), model.trace(**inputs):
            model.moes[0].router_logits.save()
            raise RuntimeError("my own error")
    model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        expected = hf(**inputs).logits
    with torch.no_grad(), model.trace(**inputs):
        logits = model.output.logits.save()
    assert torch.equal(logits, expected)


def test_a_model_with_every_weight_on_meta_wraps_with_a_tokenizer_and_scans():
    """A model built under init_empty_weights, wrapped with a tokenizer, failed in transformers' pipeline ("Cannot copy
    out of meta tensor"): nnsight's pipeline moves a model with no device map to its device. It wraps (the model
    keeps no device map) and scans: the shapes are those of the real model."""
    from accelerate import init_empty_weights

    from moelens.testing import model_class, tiny_config

    with init_empty_weights():
        hf = model_class("mixtral")(tiny_config("mixtral"))
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    assert not hasattr(hf, "hf_device_map") and all(parameter.is_meta for parameter in hf.parameters())
    assert_scan_refused(model, r"grouped_mm, for which torch has no fake kernel in torch\.float32 on the meta device "
                               r".*'batched_mm'")  # torch's "Expected inputs of BF16"
    model.set_experts_implementation("batched_mm")
    with model.scan("hello"):
        shape = nnsight.save(model.moes[0].router_logits.shape)
    assert tuple(shape) == (1, len("hello"), model.moes[0].num_experts)


def test_a_family_with_a_wrong_block_attr_says_so_at_wrap():
    # The block is found by its class at layers.N.ffn; a family saying "fnn" is refused naming the field.
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    moelens.families.register(Family("custom", ("custom",), ("CustomBlock",), block_attr="fnn", router="chooser",
                                     experts="pool", logits_op="torch_nn_functional_linear_0"))
    try:
        with pytest.raises(moelens.FamilyError, match=r"block_attr='fnn'.*layers\.0\.ffn.*children are \['ffn'\]"):
            moelens.wrap(CustomModel(config))
    finally:
        moelens.families.unregister("custom")


def test_a_family_left_at_the_default_block_attr_finds_where_its_blocks_sit():
    """block_attr left at "mlp" while the blocks are at layers.N.ffn: layers[i].mlp raised a raw AttributeError."""
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    moelens.families.register(Family("custom", ("custom",), ("CustomBlock",), router="chooser", experts="pool",
                                     logits_op="torch_nn_functional_linear_0"))
    try:
        wrapped = moelens.wrap(CustomModel(config))
        assert [wrapped.layers[i].mlp for i in range(2)] == list(wrapped.moes)
    finally:
        moelens.families.unregister("custom")


def test_a_registered_selection_bias_that_names_nothing_is_warned_about():
    """A typo there left routing ranked by the logits: route_around then missed the router's own bias."""
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    for bias, warned in (("router.bais", True), ("router.weight", False)):
        moelens.families.register(Family(
            "custom", ("custom",), ("CustomBlock",), block_attr="ffn", router="chooser", experts="pool",
            logits_op="torch_nn_functional_linear_0",
            scoring=moelens.Scoring("softmax", "score_topk", selection_bias=bias, selection_op="torch_topk_0")))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                moelens.wrap(CustomModel(config))
            messages = [str(w.message) for w in caught if "selection_bias" in str(w.message)]
            assert messages == (["family 'custom': selection_bias 'router.bais' names nothing on block layers.0.ffn "
                                 "(family 'custom': cannot read 'router.bais' from CustomBlock ('LinearRouter' object "
                                 "has no attribute 'bais'); it is the entry's scoring.selection_bias; set that to a value, "
                                 "or to a reference to what this model has). Its routing is "
                                 "served as ranked by router_logits, so route_around and force write the logits, not "
                                 "what the router ranks (route_around refuses). Fix the family's selection_bias (None "
                                 "when the router adds no bias), register it again and wrap the model again."]
                                if warned else [])
        finally:
            moelens.families.unregister("custom")
    with warnings.catch_warnings():  # moelens' own entries leave the bias out where the config does
        warnings.simplefilter("error")
        moelens.wrap(tiny_model("lfm2_moe", use_expert_bias=False))


def test_a_registered_shared_expert_path_that_names_nothing_is_warned_about():
    """A typo there left the shared expert running but never served (mlp_output was not routed + shared_expert_output),
    without a word. A path that fits is not warned about."""
    qwen = families.get("qwen2_moe")
    for path, warned in (("shared_experts", True), ("shared_expert", False)):
        families.register(dataclasses.replace(qwen, name="my_qwen", shared=dataclasses.replace(qwen.shared, module=path)),
                          replace=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrapped = moelens.wrap(tiny_model("qwen2_moe"))
        finally:
            families.unregister("my_qwen")
        messages = [str(w.message) for w in caught if "SharedExpert.module" in str(w.message)]
        assert messages == ([f"family 'my_qwen': SharedExpert.module 'shared_experts' names nothing on block "
                             f"{wrapped.moes[0].path.removeprefix('model.')} (Qwen2MoeSparseMoeBlock), which has "
                             "'shared_expert', 'shared_expert_gate': its shared expert runs but is not served "
                             "(shared_expert_output unavailable, mlp_output not routed + shared). Fix the family's "
                             "SharedExpert.module path."] if warned else []), messages

@pytest.mark.parametrize("field, value, expected", [
    ("scoring", "softmax", "Scoring"), ("shared", "shared_expert", "SharedExpert or None"),
    ("combine", "sum", "Combine"), ("router", None, "str"), ("refused", ("shared_expert_output",), "mapping"),
    ("scoring_by_router", {"Router": "softmax"}, "map router classes to Scoring entries"),
])
def test_register_names_a_field_of_the_wrong_kind(field, value, expected):
    """Each failed later with a raw AttributeError far from the cause (a tuple for refused: when read)."""
    with pytest.raises(moelens.FamilyError, match=rf"family 'custom': {field} must .*{expected}"):
        moelens.families.register(Family("custom", ("custom",), ("CustomBlock",), **{field: value}))
    assert "custom" not in {family.name for family in moelens.families.supported()}


def test_register_checks_the_description_and_unregister_gives_back_what_it_took():
    from moelens.families import SharedExpert, registry

    with pytest.raises(moelens.FamilyError, match=r"block_classes must be a tuple of names, got 'CustomBlock'"):
        moelens.families.register(Family("custom", ("custom",), "CustomBlock"))
    with pytest.raises(moelens.FamilyError, match=r"model_types must be a tuple of names"):
        moelens.families.register(Family("custom", "custom", ("CustomBlock",)))
    with pytest.raises(moelens.FamilyError, match=r"shared expert time 'after_expert' is not one of"):
        moelens.families.register(Family("custom", ("custom",), ("CustomBlock",),
                                         shared=SharedExpert("helper", when="after_expert")))
    with pytest.raises(moelens.FamilyError, match=r"selection_arg=0 needs selection_op naming the router call"):
        moelens.families.register(Family("custom", ("custom",), ("CustomBlock",),
                                         scoring=moelens.Scoring("sigmoid", selection_arg=0)))
    assert "custom" not in {family.name for family in moelens.families.supported()}
    qwen = registry.get("qwen2_moe")
    moelens.families.register(Family("takeover", ("takeover",), ("Qwen2MoeSparseMoeBlock",)), replace=True)
    moelens.families.unregister("takeover")
    assert moelens.wrap(tiny_model("qwen2_moe")).moes[0].family is qwen  # qwen2_moe's blocks are found again


def test_a_family_entry_holds_its_own_read_only_lists_and_mappings():
    """An entry is shared by every model of its family: the lists and dict a user registers with, edited after,
    and the mappings of an entry handed out (or of a dataclasses.replace copy) never change the registry."""
    import copy
    import pickle

    from moelens.families import registry

    qwen = registry.get("qwen2_moe")
    with pytest.raises(TypeError, match=r"a family entry is read-only: make a changed copy with dataclasses.replace"):
        qwen.refused["router_logits"] = "scribbled"
    llama4 = registry.get("llama4")
    reasons = dict(llama4.refused)
    with pytest.raises(TypeError, match="read-only"):
        dataclasses.replace(llama4, name="mine").refused.clear()
    assert dict(registry.get("llama4").refused) == reasons and reasons

    types, classes, refused = ["mytype"], ["MyBlock"], {"expert_outputs": "not here"}
    registered = moelens.families.register(Family("mine", types, classes, refused=refused))
    try:
        types[0], classes[0], refused["expert_outputs"] = "other", "OtherBlock", "changed"
        refused["router_logits"] = "added"
        assert registered.model_types == ("mytype",) and registered.block_classes == ("MyBlock",)
        assert dict(registered.refused) == {"expert_outputs": "not here"}
        assert registry.for_model_type("mytype") is registered and registry.for_model_type("other") is None
        for again in (pickle.loads(pickle.dumps(registered)), copy.deepcopy(registered)):
            assert again == registered and hash(again) == hash(registered)
            with pytest.raises(TypeError, match="read-only"):
                again.refused.pop("expert_outputs")
        entries = set(moelens.families.supported())  # was "unhashable type: 'ReadOnlyMapping'": entries hold mappings
        assert registered in entries and len(entries) == len(moelens.families.supported())
        assert dataclasses.replace(registered, refused={"expert_outputs": "other"}) not in entries
    finally:
        moelens.families.unregister("mine")


def longcat_variant(**changes) -> Family:
    """A registered copy of the longcat_flash entry (its blocks taken over) with ``changes``."""
    scoring = {key: changes.pop(key) for key in ("selection_in", "selection_op") if key in changes}
    base = families.get("longcat_flash")
    return families.register(dataclasses.replace(
        base, name="custom", scoring=dataclasses.replace(base.scoring, **scoring), **changes), replace=True)


@pytest.mark.parametrize("scoring, match", [
    ({"selection_op": "scores_for_choise_0"}, r"selection_op='scores_for_choise_0' is not an operation of "
                                              r"LongcatFlashTopkRouter.get_topk_indices; its operations are .*scores_for_choice_0"),
    ({"selection_in": "F_linear_0"}, r"selection_in='F_linear_0' is not a call of a method of LongcatFlashTopkRouter"),
    ({"selection_in": "router_logits_softmax_0"}, r"is not a call of a method"),
])
def test_a_selection_op_inside_a_router_method_is_checked_at_wrap(scoring, match):
    """Passed wrap() and later failed as an order error (a typo) or a raw nnsight error (no method)."""
    longcat_variant(**scoring)
    try:
        with pytest.raises(FamilyError, match=match):
            moelens.wrap(tiny_model("longcat_flash"))
    finally:
        families.unregister("custom")


def test_a_selection_op_in_a_method_called_on_an_instance_not_named_self_is_read():
    """selection_in names the call as nnsight does, after the instance the router's forward calls its method on:
    `s.route(...)` is s_route_0, which wrap refused ("not a call of a method", though its own error listed that op);
    and params().router was None for logits_op s_gate_0 (the call of its Linear child). Ground truth: the router's
    scores plus bias recomputed by hand, the Linear's weight; route_around keeps the expert out of every token's
    top-k (the plain model picks it)."""
    from custom_models import BiasedBlock

    model = custom_model()
    for layer in model.layers:
        layer["ffn"] = BiasedBlock(model.config).eval()
    torch.manual_seed(1)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    scoring = moelens.Scoring("sigmoid", "score_topk", normalize=True, selection_bias="router.bias",
                              selection_in="s_route_0", selection_op="ranked_0")
    entry = dataclasses.replace(custom_family(scoring=scoring, logits_op="s_gate_0"), block_classes=("BiasedBlock",))
    families.register(entry, replace=True)
    try:
        wrapped = moelens.wrap(model)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        picked = []
        hook = model.layers[0]["ffn"].pool.register_forward_hook(lambda module, args, out: picked.append(args[1]))
        with torch.no_grad():
            hidden, _ = model.embed(ids), model(ids)
        hook.remove()
        router = model.layers[0]["ffn"].chooser
        with torch.no_grad(), wrapped.trace(ids):
            ranked = wrapped.moes[0].selection_scores.save()
        with torch.no_grad():
            expected = router.gate(hidden).sigmoid() + router.bias
        torch.testing.assert_close(ranked, expected)
        assert wrapped.moes[0].params().router.data_ptr() == router.gate.weight.data_ptr()  # the live weight
        favourite = int(picked[0].flatten().mode().values)
        with torch.no_grad(), wrapped.trace(ids):
            moelens.ablate(wrapped.moes[0], favourite, "route_around")
            indices = wrapped.moes[0].expert_indices.save()
        assert (picked[0] == favourite).any() and not (indices == favourite).any()
        child_call = dataclasses.replace(scoring, selection_in="s_gate_0")  # a Linear child, no method
        families.register(dataclasses.replace(entry, scoring=child_call), replace=True)
        with pytest.raises(FamilyError, match=r"selection_in='s_gate_0' is not a call of a method "
                                              r"of BiasedRouter "
                                              r"with Python source \(s\.<method>\(\.\.\.\) in its forward, named "
                                              r"s_<method>_<n>\)"):
            moelens.wrap(model)
    finally:
        while "custom" in families.supported():  # each register undone (the second replaced the first)
            families.unregister("custom")


def test_identity_experts_of_the_wrong_kind_or_count_are_named():
    """A plain word was a bare ValueError, a wrong count silently left an expert out of params(), and a
    missing entry blamed expert_layout."""
    with pytest.raises(FamilyError, match=r"identity_experts must be None, an int >= 0 or an attribute reference"):
        longcat_variant(identity_experts="zero_expert_num")
    cases = [({"identity_experts": "experts.act_fn"}, FamilyError, r"identity_experts='experts.act_fn' gives .*not a count"),
             # gate_up_proj first where it has 8 rows (transformers 5.25), down_proj where it has 10 (5.24)
             ({"identity_experts": 3}, ValueUnavailable, r"_proj has shape \(8, 32, \d+\), not \[E=7"),
             ({"identity_experts": None}, ValueUnavailable, r"with 8 experts of weights among the 10: .*identity_experts")]
    for changes, error, match in cases:
        longcat_variant(**changes)
        try:
            with pytest.raises(error, match=match):
                moelens.wrap(tiny_model("longcat_flash")).moes[0].params()
        finally:
            families.unregister("custom")


def served_logits(name: str) -> tuple[list[Family], list[torch.Tensor]]:
    """The family and router_logits of every `Moe` that wrap() finds in the tiny ``name`` model."""
    hf = tiny_model(name)
    wrapped = moelens.wrap(hf)
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf, batch=1, seq=4)):
        logits = nnsight.save([moe.router_logits.save() for moe in wrapped.moes])
    return [moe.family for moe in wrapped.moes], logits


def assert_served_as(name: str, expected: tuple[list[Family], list[torch.Tensor]]) -> None:
    """wrap() of the tiny ``name`` model serves the same families and router_logits as ``expected``."""
    found, logits = served_logits(name)
    assert found == expected[0] and len(logits) == len(expected[1]) > 0
    for got, want in zip(logits, expected[1]):
        assert torch.equal(got, want)


QWEN_BLOCK = "Qwen2MoeSparseMoeBlock"


def owner(block: str = QWEN_BLOCK) -> str | None:
    """The name of the family that owns a block class now."""
    found = families.for_block(type(block, (torch.nn.Module,), {})())
    return found.name if found is not None else None


@pytest.mark.parametrize("order", [("t2", "t1"), ("t1", "t2")])
def test_unregister_gives_a_block_class_back_after_several_takeovers(order):
    before = served_logits("qwen2_moe")
    families.register(Family("t1", ("t1",), (QWEN_BLOCK,)), replace=True)
    families.register(Family("t2", ("t2",), (QWEN_BLOCK,)), replace=True)
    try:
        assert owner() == "t2"
        families.unregister(order[0])
        assert owner() == order[1]  # the newest owner still registered
        families.unregister(order[1])
        assert owner() == "qwen2_moe"
    finally:
        for name in ("t1", "t2"):
            if name in {family.name for family in families.supported()}:
                families.unregister(name)
    assert_served_as("qwen2_moe", before)


def test_reregistering_a_family_without_a_block_class_gives_it_back_and_unregister_undoes_it():
    before = served_logits("qwen2_moe")
    first = families.register(Family("t1", ("t1",), (QWEN_BLOCK,)), replace=True)
    try:
        families.register(Family("t1", ("t1",), ("OtherBlock",)), replace=True)
        assert owner() == "qwen2_moe" and owner("OtherBlock") == "t1"
        assert_served_as("qwen2_moe", before)
        families.unregister("t1")  # undoes the newest registration: the first t1 is back
        assert families.get("t1") is first and owner() == "t1" and owner("OtherBlock") is None
        families.unregister("t1")
        assert owner() == "qwen2_moe"
    finally:
        while "t1" in {family.name for family in families.supported()}:
            families.unregister("t1")
    assert_served_as("qwen2_moe", before)


def test_unregistering_a_replaced_builtin_restores_it():
    builtin = families.get("mixtral")
    before = served_logits("mixtral")
    tweaked = families.register(dataclasses.replace(builtin, notes="my tweak"), replace=True)
    try:
        assert families.get("mixtral") is tweaked and served_logits("mixtral")[0][0] is tweaked
    finally:
        families.unregister("mixtral")
    assert families.get("mixtral") is builtin and owner("MixtralSparseMoeBlock") == "mixtral"
    assert_served_as("mixtral", before)
    # Every built-in entry passes register()'s checks, and unregister puts each one back.
    for family in families.supported():
        families.register(family, replace=True)
        families.unregister(family.name)
        assert families.get(family.name) is family


def test_unregister_of_an_unknown_name_says_what_is_registered():
    with pytest.raises(moelens.FamilyError, match=r"cannot unregister 'nope'.*known families: .*mixtral"):
        families.unregister("nope")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"name": ("custom",)}, r"name must be a non-empty string, got \('custom',\)", id="name"),
        pytest.param({"name": ""}, r"name must be a non-empty string, got ''", id="empty_name"),
        pytest.param({"scoring": moelens.Scoring("softmax", "top_k")}, r"Scoring.select 'top_k' is not one of \('score_topk'",
                     id="select"),
        pytest.param({"scoring_by_router": {"HashRouter": moelens.Scoring("softmax", "hsh")}},
                     r"Scoring.select 'hsh' is not one of", id="select_by_router"),
        pytest.param({"combine": families.Combine(mode="avg")}, r"Combine.mode 'avg' is not one of \('sum', 'average'\)",
                     id="combine_mode"),
        pytest.param({"refused": {"router_logit": "why"}},
                     r"refused names 'router_logit', which is not one of \('router_logits'", id="refused"),
        # a plain word where an attribute reference belongs was read as the literal string, failing far later
        # (int('top_k') at every read, float('scale') in the export) with neither the family nor the field named
        pytest.param({"top_k": "top_k"}, r"top_k must be an int >= 1 or an attribute reference .*got 'top_k'; a "
                     r'plain word is no reference: write "router.top_k", "block.top_k" or "config.top_k"', id="top_k_word"),
        pytest.param({"num_experts": True}, r"num_experts must be an int >= 1 or an attribute reference", id="bool"),
        pytest.param({"combine": families.Combine(routed_scale="routed_scale")}, r"Combine.routed_scale must be None, "
                     r"a positive number or an attribute reference", id="routed_scale_word"),
        pytest.param({"scoring": moelens.Scoring("softmax", scale="scale")}, r"Scoring.scale must be .*attribute "
                     r'reference \("router.routed_scaling_factor", a dotted path', id="scale"),
        pytest.param({"num_experts": "experts"}, r'num_experts must be .*\("experts.num_experts", a dotted path',
                     id="num_experts_word"),
        pytest.param({"scoring": moelens.Scoring("softmax", normalize="norm_topk_prob")},
                     r"Scoring.normalize must be True, False or an attribute reference", id="normalize"),
        pytest.param({"scoring": moelens.Scoring("softmaxx")}, r"Scoring.score must be one of \['sigmoid', 'softmax', "
                     r"'sqrtsoftplus'\] or an attribute reference .*got 'softmaxx'\.$", id="score"),
        pytest.param({"scoring": moelens.Scoring("sigmoid", selection_bias="bias")},
                     r"Scoring.selection_bias must be None or an attribute reference", id="selection_bias"),
        pytest.param({"scoring": moelens.Scoring("softmax", "group_topk", groups=("n_group", "router.topk_group"))},
                     r"Scoring.groups must be an attribute reference .*got 'n_group'", id="groups"),
        pytest.param({"scoring": moelens.Scoring("softmax", "group_topk", groups="router.n_group")},
                     r"Scoring.groups must be None or a pair, got 'router.n_group'", id="groups_pair"),
        pytest.param({"expert_gate": families.ExpertGate("clamped_swiglu", alpha="alpha", limit=7.0)},
                     r"ExpertGate.alpha must be None, a positive number or an attribute reference", id="alpha"),
        pytest.param({"model_types": None}, r"model_types must be a tuple of names, got None", id="model_types_none"),
    ],
)
def test_register_refuses_unknown_words(changes, match):
    fields = {"name": "custom", "model_types": ("custom",), "block_classes": ("CustomBlock",), **changes}
    with pytest.raises(moelens.FamilyError, match=match):
        families.register(Family(**fields))
    assert "custom" not in {family.name for family in families.supported()} and owner("CustomBlock") is None


def test_a_family_takes_its_numbers_as_numpy_ones():
    """num_experts=np.int64(4) was refused ("must be an int >= 1 ... got np.int64(4)"), where every other count
    moelens takes may be a numpy integer; so were a numpy Scoring.scale and selection_arg. Ground truth: the same
    family with Python numbers."""
    by_int, by_numpy = custom_family(num_experts=4, top_k=2), custom_family(num_experts=numpy.int64(4), top_k=numpy.int32(2))
    assert (by_numpy.num_experts, by_numpy.top_k) == (4, 2) and type(by_numpy.num_experts) is int
    assert by_numpy == by_int
    scoring = moelens.Scoring("softmax", "score_topk", scale=numpy.float32(2.0), selection_arg=numpy.int64(1))
    assert (type(scoring.scale), type(scoring.selection_arg)) == (float, int) and scoring.scale == 2.0
    assert type(families.ExpertGate("clamped_swiglu", alpha=numpy.float64(1.5), limit=7).alpha) is float
    families.register(by_numpy)
    try:
        moe = moelens.wrap(custom_model()).moes[0]
        assert (moe.num_experts, moe.top_k) == (4, 2)
    finally:
        families.unregister("custom")


def test_every_transformers_family_is_registered():
    from moelens.testing import FAMILIES

    names = {family.name for family in moelens.families.supported()}
    assert set(FAMILIES) <= names
    assert use_experts_implementation  # the decorator the detection relies on is importable


def test_a_block_that_runs_only_on_some_tokens():
    # ernie4_5_vl_moe: vision_moe runs only on image tokens, so on text it never runs.
    hf = tiny_model("ernie4_5_vl_moe")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=4)["input_ids"]
    text = [moe for moe in wrapped.moes if moe.path.endswith("text_moe")]
    vision = [moe for moe in wrapped.moes if moe.path.endswith("vision_moe")]
    assert [moe.runs_only_on for moe in text] == [None] * len(text) and all("image tokens" in moe.runs_only_on for moe in vision)
    with wrapped.trace(ids):
        every = wrapped.save_all()  # leaves vision_moe out
    with wrapped.trace(ids):
        alone = nnsight.save([moe.router_logits.save() for moe in text])
    assert list(every) == [moe.layer for moe in text]
    for values, logits in zip(every.values(), alone):
        assert torch.equal(values["router_logits"], logits)
    # both causes, the block's tokens first: the message led with the read order and save_all, and said the block's
    # tokens last
    with pytest.raises(OrderError, match=r"^model\.layers\.1\.mlp\.vision_moe\.router_logits was not served: either the "
                                         r"block did not run \(it runs only on image tokens .*\), or: "):
        with wrapped.trace(ids):
            vision[0].router_logits.save()
    # named in save_all (the block's or the model's moes=), the block's own reason stands: before, save_all said an
    # earlier read or intervention had run the model past it, on a trace that read nothing else
    for save in (lambda: vision[0].save_all(), lambda: wrapped.save_all(moes=[vision[0]])):
        with pytest.raises(OrderError, match=r"^model\.layers\.1\.mlp\.vision_moe\.router_logits was not served: either") \
                as caught:
            with wrapped.trace(ids):
                save()
        assert "earlier in this trace" not in str(caught.value)


def biased(family: str):
    """A tiny model of ``family`` whose first block with a selection bias has it grow with the expert id (0.1 apart)."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if moe.SCORING.selection_bias)
    with torch.no_grad():
        bias = moe.family.resolve(moe.SCORING.selection_bias, moe._module)
        bias[: moe.num_experts] = torch.arange(moe.num_experts, dtype=bias.dtype) * 0.1  # zaya: then its skip class
    return wrapped, moe, tiny_inputs(hf, batch=1, seq=6)["input_ids"]


@pytest.mark.parametrize(("family", "dtype", "bias", "settings"), [("flint", torch.float32, 20.0, {}),
                                                                   ("lfm2_moe", torch.bfloat16, 8.0,
                                                                    {"use_expert_bias": False})], ids=["flint", "lfm2_bf16"])
def test_force_says_when_saturated_scores_tie_the_forced_experts(family, dtype, bias, settings):
    """A router ranking sigmoid scores (no selection bias): two other experts steered until their sigmoid rounds to 1
    tie the raised forced expert, and top-k left it out of some tokens without a word. A tie that only shares the
    slot left beside the forced expert still forces it."""
    hf = tiny_model(family, dtype=dtype, **settings)
    wrapped, ids = moelens.wrap(hf), tiny_inputs(hf)["input_ids"]
    moe = wrapped.moes[0]
    assert moe.top_k == 2 and not moe.ranks_selection_scores and moe.SCORING.score == "sigmoid"
    with pytest.raises(WriteError, match=rf"force: {re.escape(moe.path)} ranks experts by their sigmoid scores, which "
                                         r"saturate: with the logits of experts \[0\] raised above the others, some "
                                         r"other experts still score as high in torch\.(float32|bfloat16)"):
        with wrapped.trace(ids):
            moelens.steer(moe, 1, bias)
            moelens.steer(moe, 2, bias)
            moelens.force(moe, [0])
    with wrapped.trace(ids):
        moelens.steer(moe, 1, bias)
        moelens.force(moe, [0])
        indices = moe.expert_indices.save()
    assert bool((indices == 0).any(-1).all()) and bool((indices == 1).any(-1).all())


def test_force_says_when_a_selection_bias_outranks_it():
    # A family that adds a selection bias to bounded (sigmoid) scores but names no op where the sum is
    # ranked (afmoe's entry without its selection_op): a saturated expert with a larger bias outranks
    # forced experts whose raised logits can only reach a score of 1.
    afmoe = families.get("afmoe")
    unbound = dataclasses.replace(afmoe, name="afmoe_unbound",
                                  scoring=dataclasses.replace(afmoe.scoring, selection_op=None, selection_arg=None))
    families.register(unbound, replace=True)
    try:
        wrapped, moe, ids = biased("afmoe")
        with pytest.raises(WriteError, match=r"not by the logits alone; raising the logits of experts \[0, 1\] left 6 of 6"):
            with wrapped.trace(ids):
                moelens.steer(moe, moe.num_experts - 1, 30.0)
                moelens.force(moe, [0, 1])
    finally:
        families.unregister("afmoe_unbound")
    # Where the family names it, force also ranks them first where the bias is added: it holds.
    for family in ("afmoe", "deepseek_v3"):
        wrapped, moe, ids = biased(family)
        with wrapped.trace(ids):
            moelens.steer(moe, moe.num_experts - 1, 30.0)
            moelens.force(moe, [0, 1])
            forced = moe.expert_indices.save()
        assert torch.equal(forced.sort(-1).values, torch.tensor([0, 1], device=forced.device).expand_as(forced)), family


#: Every family whose router ranks score + a selection bias (the bias on an op's output or in its top-k call).
SELECTION_BIASED = sorted({family.name for family in families.supported()
                           if family.scoring.selection_op and family.name in TINY_FAMILIES}
                          | {"zaya"})  # its balancing biases are one too: an entry that forgot it fails here


@pytest.mark.parametrize("family", SELECTION_BIASED)
def test_route_around_outranks_the_selection_bias(family):
    # With every logit low, a -inf logit alone would leave the expert with the largest bias selected
    # (score 0 + bias): route_around excludes it where the router ranks score + bias.
    wrapped, moe, ids = biased(family)
    top = moe.num_experts - 1
    with wrapped.trace(ids):
        moe.router_logits[:] = moe.router_logits - 6.0
        moelens.ablate(moe, top, "route_around")
        indices = moe.expert_indices.save()
        weights = moe.expert_weights.save()
    assert not (indices == top).any() and (weights > 0).all()


@pytest.mark.parametrize("family", SELECTION_BIASED)
def test_selection_scores_are_the_scores_plus_the_bias(family):
    wrapped, moe, ids = biased(family)
    with wrapped.trace(ids):
        logits = moe.router_logits.save()
        ranked = moe.selection_scores.save()
    scoring = moe.SCORING
    # inkling: the last columns gate its shared experts; zaya: the last is a skip class its softmax covers
    experts = logits.float() if scoring.select == "skip_topk" else logits[..., : moe.num_experts].float()
    scores = experts if scoring.select == "logit_topk" else score(moe.family.resolve(scoring.score, moe._module), experts)
    bias = moe.family.resolve(scoring.selection_bias, moe._module)
    torch.testing.assert_close(ranked.float(), scores + bias.float())


def test_selection_scores_need_a_selection_bias():
    mixtral = moelens.wrap(tiny_model("mixtral"))
    ids = tiny_inputs(mixtral._module, batch=1, seq=4)["input_ids"]
    with pytest.raises(ValueUnavailable, match=r"selection_scores cannot be served: the mixtral router ranks no"):
        with mixtral.trace(ids):
            mixtral.moes[0].selection_scores.save()
    # lfm2_moe ranks scores + its expert_bias only when the config has one.
    config = tiny_model("lfm2_moe").config
    config.use_expert_bias = False
    unbiased = moelens.wrap(type(tiny_model("lfm2_moe"))(config))
    moe = unbiased.moes[0]
    assert not moe.ranks_selection_scores
    with pytest.raises(ValueUnavailable, match=r"ranks no separate selection score \(this checkpoint has no block.expert_bias\)"):
        with unbiased.trace(ids):
            moe.selection_scores.save()
    with unbiased.trace(ids):  # route_around writes the logits there
        moelens.ablate(moe, 1, "route_around")
        indices = moe.expert_indices.save()
    assert not (indices == 1).any()


@pytest.mark.parametrize("write", [
    lambda moe: (moelens.ablate(moe, 3, "route_around"), moe.expert_weights.__setitem__((..., 1), 0),
                 setattr(moe, "routed_output", torch.zeros(moe.routed_output.shape))),
    lambda moe: (moelens.ablate(moe, 3, "swap", to=1), moelens.reroute(moe, (slice(None), 0), 2),
                 setattr(moe, "expert_indices", torch.zeros(moe.expert_indices.shape, dtype=torch.long))),
    lambda moe: (moelens.steer(moe, 2, numpy.array(2.0)), moelens.force(moe, 1, tokens=(0, 2)),
                 moelens.reroute(moe, (0, 2), [1, 3])),
], ids=["float-values", "indices", "single-token"])
def test_writes_work_in_scan_and_keep_their_shape_checks(write):
    # model.scan runs fake tensors: a write is checked for shape and dtype only (no values to check).
    # grouped_mm has no fake kernel for float32 on CPU in torch, so scan under batched_mm.
    model = moelens.load()
    model.set_experts_implementation("batched_mm")
    moe = model.moes[1]
    with model.scan("The quick brown fox"):
        write(moe)
        shape = nnsight.save(model.output.logits.shape)
    ids = model.tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    assert tuple(shape) == (1, ids.shape[1], model.config.vocab_size)
    with pytest.raises(WriteError, match=rf"shape \(1, 4, 1\), expected \(1, {ids.shape[1]}, 2\)"):
        with model.scan("The quick brown fox"):
            moe.expert_weights = torch.zeros(1, 4, 1)


def test_scan_never_asks_a_fake_tensor_for_its_memory(monkeypatch):
    """save_all() in model.scan compared fake tensors by data_ptr, which torch warns is "almost definitely a
    bug" (and says will error): fake tensors have no memory."""
    from torch._subclasses.fake_tensor import FakeTensor

    def no_memory(tensor):
        raise AssertionError("data_ptr() of a fake tensor")

    model = moelens.load()
    model.set_experts_implementation("batched_mm")
    monkeypatch.setattr(FakeTensor, "data_ptr", no_memory)
    with model.scan("The quick brown fox"):
        shapes = nnsight.save({name: tuple(value.shape) for name, value in model.moes[1].save_all().items()})
    assert shapes["expert_outputs"][2:] == (model.moes[1].top_k, model.config.hidden_size)


def test_a_real_tensor_written_in_scan_is_taken_and_checked_in_full():
    """Values saved from a trace (real tensors) written into model.scan: taken (plain nnsight takes them too;
    checking them under the scan's fake mode raised torch's data-dependent guard error), and their values are
    checked as in a trace (a NaN, an index out of range), since they have values."""
    model = moelens.load()
    model.set_experts_implementation("batched_mm")
    moe = model.moes[1]
    prompt = "The quick brown fox"
    with torch.no_grad(), model.trace(prompt):
        logits, indices, routed = moe.router_logits.save(), moe.expert_indices.save(), moe.routed_output.save()
    for name, value in (("router_logits", logits), ("expert_indices", indices), ("routed_output", routed)):
        with model.scan(prompt):
            setattr(moe, name, value)
            shape = nnsight.save(model.output.logits.shape)
        assert tuple(shape) == (1, logits.shape[1], model.config.vocab_size)
    broken = logits.clone()
    broken[0, 1, 2] = float("nan")
    nan = r"holds NaN \(1 of \d+, the first at \(0, 1, 2\)\)"
    for name, value, expected in (("router_logits", broken, nan), ("router_logits", broken.double(), nan),
                                  ("router_logits", broken.cpu().numpy(), nan), ("router_logits", float("nan"), r"holds NaN"),
                                  ("expert_indices", indices + moe.num_experts, r"wrote expert index \d+, expected")):
        with pytest.raises(WriteError, match=expected):
            with model.scan(prompt):
                setattr(moe, name, value)


def test_ids_with_values_are_taken_and_checked_in_scan_as_in_a_trace():
    """In model.scan an id read in a trace (a real tensor) was read as a placeholder symbol ("got u0"), and
    plain numbers went unchecked: both are known values, so scan takes and checks them as a trace does; ids in
    a tensor made inside the scan (fake, no values) are refused in words."""
    model = moelens.load()
    model.set_experts_implementation("batched_mm")
    moe = model.moes[1]
    prompt = "The quick brown fox"
    with torch.no_grad(), model.trace(prompt):
        first = moe.expert_indices[0, 0, 0].save()
    taken = [lambda: moelens.ablate(moe, first), lambda: moelens.ablate(moe, 2, "swap", to=torch.tensor(3)),
             lambda: moelens.steer(moe, first, 3.0), lambda: moelens.force(moe, first),
             lambda: moelens.force(moe, numpy.array([2, 3])),
             lambda: moelens.reroute(model.layers[torch.tensor(1)].mlp, (slice(None), 1), first)]
    for use in taken:
        with model.scan(prompt):
            use()
            nnsight.save(model.output.logits.shape)
    refused = [(lambda: moelens.reroute(moe, (slice(None), 1), [3, 99]), r"expert ids \[3, 99\] must be in \[0, 8\)"),
               (lambda: moelens.steer(moe, 2, 1e39), r"bias 1e\+39 takes expert 2's logits up to 1e\+39"),
               (lambda: moelens.force(moe, first + 8), r"expert \d+ is out of range"),
               (lambda: moelens.force(moe, torch.tensor([2, 3])), r"force: expert ids in a tensor made inside model.scan")]
    for use, expected in refused:
        with pytest.raises(WriteError, match=expected):
            with model.scan(prompt):
                use()


def test_a_block_of_another_model_is_refused_in_a_trace():
    """A Moe of a second wrapped model, used in the first model's trace, was served and edited at the first
    model's block of the same path, silently: comparing a base and a tuned model read the base twice."""
    hf, base, inputs, plain, reference = built("mixtral", "grouped_mm")
    tuned = moelens.wrap(copy.deepcopy(hf))
    for use in (lambda: tuned.moes[0].router_logits.save(), lambda: moelens.ablate(tuned.moes[0], 3, "route_around")):
        with pytest.raises(ValueUnavailable, match=r"belongs to another wrapped model than the one this trace runs"):
            with base.trace(**inputs):
                use()
    for moes, what in (([tuned.moes[1]], r"model.model.layers.1.mlp of another wrapped model"),
                       ([base.layers[0]], r"model.model.layers.0 \(MixtralDecoderLayer\), which is no MoE block"),
                       ([1], r"int 1")):
        with pytest.raises(moelens.MoelensError, match=rf"save_all\(moes=...\) takes MoE blocks of this model .*got {what}\."):
            with base.trace(**inputs):
                base.save_all(moes=moes)
    with base.trace(**inputs):
        output = first_tensor(base.output).save()
    assert torch.equal(output, plain)


def test_a_value_asked_for_in_another_models_trace_nested_in_its_own_says_so():
    """Asked for inside the trace of a second model nested in this model's trace, a value was refused as if the code
    were in a `with loss.backward():` block (there is none); bound before the nested trace, it is served (the truth:
    the value read alone)."""
    hf, base, inputs, plain, reference = built("mixtral", "grouped_mm")
    other = moelens.wrap(copy.deepcopy(hf))
    with pytest.raises(ValueUnavailable, match=r"router_logits: asked for inside the trace of another model, nested "
                                               r"in this model's trace.*bind this model's values before the nested"):
        with base.trace(**inputs):
            with other.trace(**inputs):
                base.moes[0].router_logits.save()
    with base.trace(**inputs):
        logits = base.moes[0].router_logits.save()
        with other.trace(**inputs):
            nnsight.save(other.output)
    with base.trace(**inputs):
        alone = base.moes[0].router_logits.save()
    assert torch.equal(logits, alone)


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("num_experts", 16, r"router_logits holds 8 entries per token, but family 'my_mixtral' sets this block's "
                        r"router logits per token to 16 \(num_experts=16\)"),
    ("num_experts", 4, r"router_logits holds 8 entries per token, but family 'my_mixtral' sets this block's "
                       r"router logits per token to 4 \(num_experts=4\).*extra_logits"),
    # it went on about extra_logits, a count of router-logit columns
    ("top_k", 3, r"expert_weights holds 2 entries per token, but family 'my_mixtral' sets this block's slots per "
                 r"token to 3 \(top_k=3\): the entry names the wrong setting; fix it"),
    # E logits, the op right: no word of logits_op (the extra count is off)
    ("extra_logits", 2, r"router_logits holds 8 entries per token, but family 'my_mixtral' sets this block's "
                        r"router logits per token to 10 \(num_experts='experts.num_experts' plus extra_logits=2\)(?!.*logits_op)"),
    # a logits op after the logits (the sum of the top-k weights) was blamed on num_experts and extra_logits alone
    ("logits_op", "router_top_value_sum_0", r"router_logits holds 1 entries per token, .*or "
                                            r"logits_op='router_top_value_sum_0' names an op of MixtralTopKRouter\.forward "
                                            r"that holds fewer columns than the logits .* operations are "
                                            r"hidden_states_reshape_0, .*F_linear_0"),
    ("extra_logits", "router.weight", r"family 'my_mixtral' reads extra_logits from 'router.weight', which holds a "
                                      r"Parameter of shape \(8, \d+\) on this block, not a whole number"),
])
def test_a_family_entry_whose_counts_do_not_fit_the_model_is_refused(setting, value, message):
    """An entry that says 16 experts on an 8-expert router took ablate(moe, 12) as a silent no-op; one that says 4
    served indices up to 7 for a block of "4 experts" (analysis failed with a bare IndexError); one that says top-3
    on a top-2 router failed in save_all with a raw reshape error."""
    hf = tiny_model("mixtral")
    ids = tiny_inputs(hf)["input_ids"]
    families.register(dataclasses.replace(families.get("mixtral"), name="my_mixtral", **{setting: value}), replace=True)
    try:
        wrapped = moelens.wrap(hf)
        with pytest.raises(FamilyError, match=message):
            with wrapped.trace(ids):
                wrapped.moes[0].save_all()
    finally:
        families.unregister("my_mixtral")

def test_a_misspelt_value_is_refused_and_other_attributes_are_kept(mixtral):
    """moe.router_logit = ... (for router_logits) added an attribute to the envoy and wrote nothing, silently."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with pytest.raises(moelens.MoelensError, match=r"serves no value 'router_logit' \(did you mean 'router_logits'\?\)"):
        with wrapped.trace(**inputs):
            moe.router_logit = torch.zeros(2, 5, 8)
    for name, meant in (("expert_weight", "expert_weights"), ("routed_outputs", "routed_output")):
        with pytest.raises(moelens.MoelensError, match=rf"'{name}' \(did you mean '{meant}'\?\)"):
            setattr(moe, name, 0)
    moe.note, moe.router_logits_seen = "mine", 3  # a user's own attributes, not like a value
    assert (moe.note, moe.router_logits_seen) == ("mine", 3)
    assert families.for_block(moe) is families.for_block(moe._module) is moe.family  # the envoy or its module
    # its class or class name too: both answered None, as if no family knew the block
    assert families.for_block(type(moe._module)) is families.for_block(type(moe._module).__name__) is moe.family
    with pytest.raises(moelens.FamilyError, match=r"for_block takes an MoE block \(a torch module, its envoy, its "
                                                  r"class or class name\), got int 3"):
        families.for_block(3)
    config = moe.root._module.config
    assert families.for_model_type(config.model_type) is moe.family
    with pytest.raises(moelens.FamilyError, match=rf"for_model_type takes a config's model_type .*got "
                                                  rf"a {type(config).__name__}; pass config.model_type"):
        families.for_model_type(config)  # answered None

def test_load_and_wrap_say_what_they_take():
    """load(model) failed on an over-long file name (the model's repr); wrap(one block) with a raw AttributeError."""
    hf = tiny_model("qwen2_moe")
    wrapped = moelens.wrap(hf)
    for given, advice in ((wrapped, r"got a MoeNNsight: it is wrapped already, use it as it is"),
                          (hf, r"got a Qwen2MoeForCausalLM: to wrap a model you have, use moelens.wrap\(model, tokenizer=...\)"),
                          (3, r"got a int: pass a str or a pathlib.Path")):
        with pytest.raises(moelens.MoelensError, match=rf"moelens.load takes a checkpoint folder, a hub id or 'tiny', {advice}"):
            moelens.load(given)
    with pytest.raises(moelens.MoelensError, match=r"wrap\(\) got one qwen2_moe MoE block \(Qwen2MoeSparseMoeBlock\), "
                                                   r"not a model: wrap the whole model that holds it"):
        moelens.wrap(hf.model.layers[1].mlp)
    # a misspelt keyword was nnsight's "Envoy.__init__() got an unexpected keyword argument", naming no call of the user's
    for tokenizer in (None, ascii_tokenizer()):
        with pytest.raises(moelens.MoelensError, match=r"wrap\(\) got keywords it does not take: 'tokenzier'\. wrap "
                                                       r"takes the model, tokenizer= and the nnsight model's own .* \('tokenzier': "
                                                       r"did you mean 'tokenizer'\?\)\."):
            moelens.wrap(hf, tokenizer=tokenizer, tokenzier=None)


def test_a_compiled_model_is_refused_with_what_to_wrap():
    """A compiled model was wrapped, then traces failed inside torch's dynamo on nnsight's rewritten experts forward
    (an InternalTorchDynamoError naming __nnsight_op__), or not, depending on what the first trace read."""
    hf = tiny_model("mixtral")
    with pytest.raises(moelens.MoelensError, match=r"compiled with torch.compile: wrap the model it compiled, "
                                                   r"moelens.wrap\(model._orig_mod\)"):
        moelens.wrap(torch.compile(hf))
    compiled_in_place = copy.deepcopy(hf)
    compiled_in_place.model.layers[1].compile()
    with pytest.raises(moelens.MoelensError, match=r"model.layers.1 \(MixtralDecoderLayer\) is compiled \(module.compile\(\)\)"):
        moelens.wrap(compiled_in_place)
    swapped = copy.deepcopy(hf)
    swapped.model.layers[1] = torch.compile(swapped.model.layers[1])
    with pytest.raises(moelens.MoelensError, match=r"model.layers.1 \(OptimizedModule\) is compiled by torch.compile"):
        moelens.wrap(swapped)
    wrapped = moelens.wrap(hf)
    for compiled, name in ((hf.model.layers[1].mlp, r"model.layers.1.mlp \(MixtralSparseMoeBlock\)"),
                           (hf.model.layers[2], r"model.layers.2 \(MixtralDecoderLayer\)"),
                           (hf, r"the model \(MixtralForCausalLM\)")):  # after wrapping: refused at the next trace
        compiled.compile()
        with pytest.raises(moelens.MoelensError, match=rf"{name} is compiled \(module.compile\(\)\)"):
            with wrapped.trace(tiny_inputs(hf)["input_ids"]):
                wrapped.output.save()
        compiled._compiled_call_impl = None
    layer = hf.model.layers[1]
    hf.model.layers[1] = torch.compile(layer)  # put in after wrapping: the module wrap saw is not the one that runs
    with pytest.raises(moelens.MoelensError, match=r"model.layers.1 \(OptimizedModule\) is compiled by torch.compile"):
        with wrapped.trace(tiny_inputs(hf)["input_ids"]):
            wrapped.output.save()
    hf.model.layers[1] = layer
    # the form transformers' docs show, a compiled forward on the instance: a trace failed inside dynamo
    compiled_forward = copy.deepcopy(hf)
    compiled_forward.forward = torch.compile(compiled_forward.forward)
    with pytest.raises(moelens.MoelensError, match=r"the model \(MixtralForCausalLM\) is run by a compiled forward"):
        moelens.wrap(compiled_forward)
    block = hf.model.layers[2].mlp
    block.forward = torch.compiler.disable(block.forward)  # marked never to compile: runs as it is, not refused
    with torch.no_grad(), wrapped.trace(tiny_inputs(hf)["input_ids"]):
        logits = first_tensor(wrapped.output).save()
    with torch.no_grad():
        assert torch.equal(logits, copy.deepcopy(hf)(tiny_inputs(hf)["input_ids"]).logits)
    block.forward = torch.compile(block.forward)  # after wrapping, over nnsight's own
    with pytest.raises(moelens.MoelensError, match=r"model.layers.2.mlp \(MixtralSparseMoeBlock\) is run by a "
                                                   r"compiled forward"):
        with wrapped.trace(tiny_inputs(hf)["input_ids"]):
            wrapped.output.save()


def test_modules_beside_the_blocks_may_be_compiled_at_wrap_as_after_it():
    """Attention or lm_head compiled in place was refused at wrap for a reason that does not hold for them (moelens
    reads inside the MoE blocks' forwards), and accepted when compiled after wrapping: both run right now (plain
    transformers on an unwrapped copy)."""
    hf = tiny_model("qwen2_moe")
    ids = tiny_inputs(hf)["input_ids"]
    with torch.no_grad():
        expected = copy.deepcopy(hf)(input_ids=ids).logits
    hf.model.layers[1].self_attn.compile(backend="eager")
    hf.lm_head.compile(backend="eager")
    wrapped = moelens.wrap(hf)
    try:
        with torch.no_grad(), wrapped.trace(ids):
            routed = wrapped.moes[-1].routed_output.save()
            logits = wrapped.output.logits.save()
    finally:
        torch._dynamo.reset()  # dynamo's caches keep fake tensors, which tests counting live tensors cannot read
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert routed.shape[:2] == ids.shape
    for swapped in ("model.layers.1.mlp.experts", "model.layers.0.self_attn"):  # hides what it compiled: refused
        model = copy.deepcopy(hf)
        parent, name = swapped.rsplit(".", 1)
        model.get_submodule(parent).register_module(name, torch.compile(model.get_submodule(swapped), backend="eager"))
        with pytest.raises(moelens.MoelensError, match=rf"{swapped} \(OptimizedModule\) is compiled by torch.compile: "
                                                       rf"put back the module it compiled \(model.{swapped} = "
                                                       rf"model.{swapped}._orig_mod\)"):
            moelens.wrap(model)


def test_generation_runs_uncompiled():
    """transformers compiles the forward for a static cache (on a GPU by itself, or with a compile_config): the
    trace then failed inside torch's dynamo on nnsight's rewritten experts forward."""
    from transformers import CompileConfig

    model = moelens.load()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # what a GPU does without it
    with pytest.raises(moelens.MoelensError, match=r"generate\(\) with a compile_config or disable_compile=False"):
        with model.generate(ids, max_new_tokens=2, cache_implementation="static", compile_config=config):
            pass
    with model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static") as tracer:
        logits = nnsight.save([])
        with tracer.all():
            logits.append(model.moes[1].router_logits)
    assert [tuple(value.shape) for value in logits] == [(1, 5, 8), (1, 1, 8), (1, 1, 8)]


@pytest.mark.parametrize("part", ["gate", "experts", "block"])
def test_a_block_part_two_layers_share_is_refused(part):
    """A router (experts, block) module called by two layers served the first layer's call for both: the second
    layer's router_logits and interventions were the first layer's, silently."""
    hf = tiny_model("mixtral")
    layers = hf.model.layers
    if part == "block":
        layers[2].mlp = layers[1].mlp
    else:
        setattr(layers[2].mlp, part, getattr(layers[1].mlp, part))
    where = "mlp" if part == "block" else f"mlp.{part}"
    with pytest.raises(FamilyError, match=rf"model.layers.2.{where} is the same {'router' if part == 'gate' else part} "
                                          rf"module as model.layers.1.{where}"):
        moelens.wrap(hf)

def test_route_around_leaving_fewer_than_k_experts():
    # mixtral: the router fills the k slots with the -inf experts, at weight 0.
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    ids = tiny_inputs(hf, batch=2, seq=5)["input_ids"]
    with wrapped.trace(ids):
        for expert in range(1, moe.num_experts):  # only expert 0 stays
            moelens.ablate(moe, expert, "route_around")
        indices = moe.expert_indices.save()
        weights = moe.expert_weights.save()
    assert (indices == 0).any(-1).all()
    assert not weights[indices != 0].any()


@pytest.mark.parametrize(("family", "refusal"), [
    # Where the router ranks score + bias it would pick excluded experts at their full weight.
    *[(family, r"selection_scores: fewer than 2 entries of some token are above -inf( inside the best \d of its \d "
               r"expert groups \(the router's reach\))?, so the router would fill its slots with excluded experts, at "
               r"their full weight")
      for family in ("deepseek_v3", "minimax_m2", "ernie4_5_moe", "kolibri1")],
    # phimoe's sparse mixer picks two experts by masked softmaxes: one finite logit makes them NaN.
    ("phimoe", r"router_logits: fewer than 2 entries of some token are above -inf, so its routing scores would be NaN"),
])
def test_route_around_refuses_to_leave_too_few_experts(family, refusal):
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with pytest.raises(WriteError, match=refusal):
        with wrapped.trace(tiny_inputs(hf, batch=2, seq=5)["input_ids"]):
            for expert in range(1, moe.num_experts):  # only expert 0 stays
                moelens.ablate(moe, expert, "route_around")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_route_around_counts_the_experts_inside_the_groups_the_router_keeps(family):
    """A group-limited router picks its k experts inside its best groups only: with fewer than k left above -inf
    there, it filled a slot with a routed-around expert at its full weight (the whole row held enough)."""
    hf = tiny_model(family, num_experts_per_tok=4, n_group=2, topk_group=1)  # the kept group holds exactly k = 4
    inputs = tiny_inputs(hf, batch=4, seq=8)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with pytest.raises(WriteError, match=r"selection_scores: fewer than 4 entries of some token are above -inf inside "
                                         r"the best 1 of its 2 expert groups \(the router's reach\).*leave at least "
                                         r"4 experts above -inf per token in those groups"):
        with wrapped.trace(**inputs):
            moelens.ablate(moe, 5, "route_around")
    hf = tiny_model(family, num_experts_per_tok=2, n_group=2, topk_group=1)  # three left in either group: enough
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    for expert in range(moe.num_experts):
        with wrapped.trace(**inputs):
            moelens.ablate(moe, expert, "route_around")
            indices = moe.expert_indices.save()
        assert not (indices == expert).any()


def test_route_around_one_expert_of_every_group_leaves_k_whichever_groups_tie():
    """Groups of two with one expert routed around each all score -inf (the sum of their top two): whichever two
    the router keeps hold k = 2 experts above -inf, and the write was refused."""
    hf = tiny_model("deepseek_v3")  # 8 experts in 4 groups of 2, 2 kept, k = 2
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with wrapped.trace(**tiny_inputs(hf, batch=2, seq=6)):
        for expert in (0, 2, 4, 6):
            moelens.ablate(moe, expert, "route_around")
        indices = moe.expert_indices.save()
    assert (indices % 2 == 1).all()


def test_route_around_on_a_router_scoring_dropped_groups_zero():
    """axk2 puts 0.0, not -inf, in place of the groups it drops: with the kept experts below 0 (a negative
    correction bias) an expert routed around in a dropped group came back at its full weight."""
    hf = tiny_model("axk2")  # 8 experts in 4 groups of 2, 2 kept, k = 2
    inputs = tiny_inputs(hf, batch=2, seq=6)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    for expert in range(moe.num_experts):  # scores around 0.5: the kept groups hold k experts above 0
        with wrapped.trace(**inputs):
            moelens.ablate(moe, expert, "route_around")
            indices = moe.expert_indices.save()
        assert not (indices == expert).any()
    with torch.no_grad():
        moe.router._module.e_score_correction_bias.fill_(-0.8)
    with pytest.raises(WriteError, match=r"fewer than 2 entries of some token are above 0.0 inside the best 2 of its 4 "
                                         r"expert groups \(the router's reach\), and it scores the experts of the groups "
                                         r"it drops 0.0, so the router would fill its slots with excluded experts"):
        with wrapped.trace(**inputs):
            moelens.ablate(moe, 3, "route_around")


def edit_router_logits(truth: torch.nn.Module, moe, edit, seen=None) -> None:
    """Make ``truth`` (an unwrapped copy) route ``moe``'s block as transformers does on logits edited by hand:
    ``edit(logits)`` in place on the output of the router's one ``F.linear``; ``seen(logits, indices)`` is called
    with what the router returns."""
    router = truth.get_submodule(moe.router.path.removeprefix("model."))
    real, linear = router.forward, F.linear

    def edited_linear(x, weight, bias=None):
        logits = linear(x, weight, bias)
        edit(logits)
        return logits

    def forward(hidden):
        with unittest.mock.patch.object(F, "linear", edited_linear):
            output = real(hidden)
        if seen is not None:
            seen(output[0], output[2])
        return output

    router.forward = forward


@pytest.mark.parametrize("family", ["mistral4", "mistral_large4"])
def test_route_around_that_leaves_a_kept_group_short_is_refused_where_dropped_groups_score_zero(family):
    """mistral4 ranks the softmax of its logits (no selection bias), keeps the best groups, puts 0.0 in place of the
    others and weighs its picks by the scores before that fill. Routing around expert 4 while expert 5 of its group
    dominates (steer) kept the group {4, 5} with one expert above 0.0: the router filled the second slot with an
    expert of a dropped group at that expert's own softmax weight, without a word. Refused now; routing around the
    whole group, or an expert of a group the router drops, equals the unwrapped model with those logits set to -inf
    by hand (a forward hook on its router's linear layer)."""
    hf = tiny_model(family, experts_implementation="eager", n_group=4, topk_group=1)  # 8 experts in groups of 2, k=2
    inputs = tiny_inputs(hf, batch=2, seq=6)
    truth = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with pytest.raises(WriteError, match=r"router_logits: for some token the best 1 of its 4 expert groups \(the "
                                         r"router's reach\) hold fewer than 2 experts scoring above 0.0 .* an expert "
                                         r"of a dropped group, weighted by that expert's own score"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moelens.steer(moe, 5, 2.0)
            moelens.ablate(moe, 4, "route_around")
    with torch.no_grad(), wrapped.trace(**inputs):
        moelens.steer(moe, 5, 2.0)
        moelens.ablate(moe, [4, 5], "route_around")
        indices = moe.expert_indices.save()
        output = wrapped.output.save()
    assert not ((indices == 4) | (indices == 5)).any()

    def edit(logits):
        logits[..., 5] += 2.0
        logits[..., [4, 5]] = float("-inf")

    edit_router_logits(truth, moe, edit)
    with torch.no_grad():
        expected = first_tensor(truth(**inputs))
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(first_tensor(hf(**inputs)), expected)


@pytest.mark.parametrize("dtype, bias, down, refused", [
    (torch.float16, 40.0, None, False),   # route_around(4): the others' softmax is 0 in float16, filled slots weigh 0
    (torch.float16, 8.0, -15.0, True),    # steer(4, -15): 4 scores 0 in float16, a dropped expert fills at its weight
    (torch.bfloat16, 96.0, None, False),
    (torch.bfloat16, 3.0, -100.0, True),
])
def test_the_mistral4_group_check_scores_in_the_routers_dtype(dtype, bias, down, refused):
    """mistral4's router takes the softmax of its logits in their own dtype: a score float32 keeps above 0 is 0 in
    float16 (below 6e-8) or bfloat16 (below 9e-41). The group check scored in float32: it refused writes whose filled
    slots weigh 0 and let through a negative steer that left the kept group one expert short."""
    hf = tiny_model("mistral4", experts_implementation="eager", dtype=dtype, n_group=4, topk_group=1)
    inputs = tiny_inputs(hf, batch=2, seq=6)
    truth = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    kept = {}

    def interventions():
        moelens.steer(moe, 5, bias)
        if down is None:
            moelens.ablate(moe, 4, "route_around")
        else:
            moelens.steer(moe, 4, down)

    def edit(logits):
        logits[..., 5] += bias
        if down is None:
            logits[..., 4] = float("-inf")
        else:
            logits[..., 4] += down

    def seen(logits, indices):
        scores = logits.softmax(-1)  # the router's own scores, in its dtype
        kept["fills_from_dropped"] = bool(((scores.gather(1, indices) > 0) & (indices // 2 != 2)).any())

    edit_router_logits(truth, moe, edit, seen)
    with torch.no_grad():
        expected = first_tensor(truth(**inputs))
    assert kept["fills_from_dropped"] == refused
    if refused:
        with pytest.raises(WriteError, match="an expert of a dropped group"):
            with torch.no_grad(), wrapped.trace(**inputs):
                interventions()
        return
    with torch.no_grad(), wrapped.trace(**inputs):
        interventions()
        output = wrapped.output.save()
    torch.testing.assert_close(first_tensor(output), expected, atol=0, rtol=0)


def test_the_mistral4_group_check_lets_through_a_block_whose_kept_groups_never_hold_k():
    """With k = 3 and one kept group of 2 experts, mistral4's router fills a slot from a dropped group on every token
    by itself: the check refused every write of its logits (steer(0, 0.1) too), blaming the edit. Let through, as
    transformers computes it (the unwrapped model with the same logit bias, by a patched F.linear)."""
    hf = tiny_model("mistral4", experts_implementation="eager", n_group=4, topk_group=1, num_experts_per_tok=3)
    inputs = tiny_inputs(hf, batch=2, seq=6)
    truth = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        moelens.steer(moe, 0, 0.1)
        output = wrapped.output.save()
    edit_router_logits(truth, moe, lambda logits: logits[..., 0].add_(0.1))
    with torch.no_grad():
        torch.testing.assert_close(first_tensor(output), first_tensor(truth(**inputs)), atol=0, rtol=0)


def test_route_around_inside_a_group_kept_whatever_the_ties_is_let_through_where_dropped_groups_score_zero():
    """axk2, 2 groups of 4 (1 kept, k = 2), every expert but 0 biased by -1: the kept group holds one expert above
    0.0, so the router's second slot takes a dropped group's 0.0. Routing around expert 2, in the group whose sum
    beats the other's, was refused though it cannot come back. Truth: the same model with expert 2's correction
    bias -inf (the router then ranks what route_around makes it rank)."""
    hf = tiny_model("axk2", n_group=2, topk_group=1)
    truth = copy.deepcopy(hf)
    bias = torch.tensor([0.0] + [-1.0] * 7)
    for model, values in ((hf, bias), (truth, bias.index_fill(0, torch.tensor([2]), -math.inf))):
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.data.copy_(values)
    inputs = tiny_inputs(hf, batch=2, seq=6)
    wrapped = moelens.wrap(hf)
    indices = []
    with torch.no_grad(), wrapped.trace(**inputs):
        for moe in wrapped.moes:
            moelens.ablate(moe, 2, "route_around")
            indices.append(moe.expert_indices.save())
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        expected = truth(**inputs).logits
    assert all(not (chosen == 2).any() for chosen in indices)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(("family", "settings", "row"), [
    # axk2 (4 groups of 2, 2 kept, k = 2, dropped groups scored 0.0): every group sum ties at -inf; keeping the
    # groups of -0.5 leaves fewer than k above 0.0, and a dropped -inf expert comes back at 0.0
    ("axk2", {}, [-math.inf, 0.5, -math.inf, -0.5, -math.inf, -0.5, -math.inf, -0.5]),
    # deepseek_v3 (2 groups of 4, 1 kept, k = 3): the groups' sums tie at 2; the one holding two finite experts
    # may be the one kept
    ("deepseek_v3", {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3},
     [1.0, 1.0, -math.inf, -math.inf, 1.0, 1.0, 0.0, 0.0]),
])
def test_selection_writes_whose_tied_groups_could_go_the_wrong_way_are_refused(family, settings, row):
    hf = tiny_model(family, **settings)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with pytest.raises(WriteError, match=r"selection_scores: fewer than \d entries of some token are above"):
        with torch.no_grad(), wrapped.trace(torch.tensor([[5, 9, 14, 3]])):
            moe.selection_scores = torch.tensor(row).expand(moe.selection_scores.shape).clone()


def test_token_selections_index_batch_and_position_only(mixtral):
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        plain = moe.router_logits.save()
    with wrapped.trace(**inputs):
        moelens.force(moe, 5, tokens=(..., 3))  # position 3 of every row, not expert column 3
        forced = moe.router_logits.save()
        indices = moe.expert_indices.save()
    changed = (forced != plain).any(-1)
    expected = torch.zeros_like(changed)
    expected[:, 3] = True
    assert torch.equal(changed, expected) and (indices[:, 3] == 5).any(-1).all()
    with wrapped.trace(**inputs):
        moelens.reroute(moe, (..., 1), [2, 4])
        rerouted = moe.expert_indices.save()
    assert (rerouted[:, 1] == torch.tensor([2, 4], device=rerouted.device)).all()
    for call in (lambda: moelens.force(moe, 5, tokens=(0, 99)), lambda: moelens.reroute(moe, (0, 99), 1)):
        with pytest.raises(WriteError, match=r"tokens=\(0, 99\) is not an index into this invoke's \[batch, seq\] = \[2, 5\]"):
            with wrapped.trace(**inputs):
                call()


def test_intervention_arguments(mixtral):
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        moelens.steer(moe, numpy.int64(2), numpy.float32(1e4))
        moelens.force(moe, numpy.array([2]))
        indices = moe.expert_indices.save()
    assert (indices == 2).any(-1).all()
    for call, match in [(lambda: moelens.force(moe, []), r"force: no expert given"),
                        (lambda: moelens.steer(moe, 1, torch.ones(2, 5)), r"steer: bias must be a number, got Tensor of shape \(2, 5\)"),
                        (lambda: moelens.steer(moe, 1, True), r"steer: bias must be a number, got bool"),
                        # a bias per expert ([E]) was told to add a per-token bias
                        (lambda: moelens.steer(moe, 1, torch.ones(8)), r"for a bias per expert or per token add it to "
                                                                       r"the logits yourself: moe\.router_logits \+= bias"),
                        # -inf said the logits would be "inf" beyond float32: it is route_around
                        (lambda: moelens.steer(moe, 1, -math.inf), r"steer: bias -inf would remove expert 1 from "
                                                                   r".*moelens\.ablate\(moe, 1, 'route_around'\)"),
                        # NaN was added, then refused as a "written tensor" holding NaN, naming no bias
                        (lambda: moelens.steer(moe, 1, float("nan")), r"steer: bias nan is not a number \(NaN\); "
                                                                      r"give a finite bias"),
                        (lambda: moelens.steer(moe, 1, torch.tensor(float("nan"))), r"steer: bias nan is not a number"),
                        (lambda: moelens.ablate(moe, numpy.bool_(True)), r"must be an int expert id")]:
        with pytest.raises(WriteError, match=match):
            with wrapped.trace(**inputs):
                call()


def test_force_refuses_a_hash_routed_layer():
    hf = tiny_model("deepseek_v4")
    wrapped = moelens.wrap(hf)
    hashed = wrapped.moes[0]
    assert hashed.SCORING.select == "hash"
    ids = tiny_inputs(hf, batch=1, seq=4)["input_ids"]
    with wrapped.trace(ids):  # ground truth: the table picks, whatever the logits say
        hashed.router_logits[..., 1] += 100.0
        picked = hashed.expert_indices.save()
    assert torch.equal(picked, hf.model.layers[0].mlp.gate.tid2eid[ids])
    with pytest.raises(WriteError, match=r"picks experts from a token-id table .*its logits only weight them"):
        with wrapped.trace(ids):
            moelens.force(hashed, 1)


def test_selection_scores_of_a_hash_routed_layer_say_the_table_picks():
    """The refusal said the choice follows router_logits (read or write those), which a hash layer ignores."""
    hf = tiny_model("deepseek_v4")
    wrapped = moelens.wrap(hf)
    with pytest.raises(ValueUnavailable, match=r"layer picks experts from a token-id table .* write expert_indices"):
        with wrapped.trace(tiny_inputs(hf, batch=1, seq=4)["input_ids"]):
            wrapped.moes[0].selection_scores.save()


def test_force_checks_expert_groups_up_front_so_it_can_come_first():
    # DS3 keeps the best topk_group groups: experts of more groups than that cannot all be picked.
    hf = tiny_model("deepseek_v3", topk_group=1)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    n_group = moe.family.groups_of(moe._module)[0]
    last = moe.num_experts - 1
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with pytest.raises(WriteError, match=rf"best 1 of {n_group} expert groups, and experts \[0, {last}\] lie in 2 groups"):
        with wrapped.trace(ids):
            moelens.force(moe, [0, last])
    # force reads nothing after the router, so route_around can follow it on the same block.
    for family, overrides in [("mistral4", {}), ("deepseek_v3", {}), ("lfm2_moe", {"use_expert_bias": False})]:
        hf = tiny_model(family, **overrides)
        wrapped = moelens.wrap(hf)
        moe = wrapped.moes[0]
        with wrapped.trace(tiny_inputs(hf, batch=1, seq=5)["input_ids"]):
            moelens.force(moe, 1)
            moelens.ablate(moe, 2, "route_around")
            indices = moe.expert_indices.save()
        assert (indices == 1).any(-1).all() and not (indices == 2).any(), family


def test_force_groups_experts_by_consecutive_blocks():
    """DS3's groups are consecutive blocks of E / n_group experts (transformers' view(-1, n_group, E // n_group)):
    with 8 experts in 4 groups, experts 0 and 1 share group 0 and are all picked; 0 and 4 are in groups 0 and 2."""
    hf = tiny_model("deepseek_v3", n_group=4, topk_group=1, num_experts_per_tok=2)
    wrapped = moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if moe.family.groups_of(moe._module))
    assert (moe.num_experts, *moe.family.groups_of(moe._module)) == (8, 4, 1)
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with torch.no_grad(), wrapped.trace(ids):
        moelens.force(moe, [0, 1])
        indices = moe.expert_indices.save()
    assert (indices == 0).any(-1).all() and (indices == 1).any(-1).all()
    with pytest.raises(WriteError, match=r"experts \[0, 4\] lie in 2 groups"):
        with wrapped.trace(ids):
            moelens.force(moe, [0, 4])


def test_values_outside_a_trace_say_they_exist_only_in_a_run(mixtral):
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    for use in (lambda: moe.router_logits, lambda: moe.router_probs, lambda: setattr(moe, "expert_weights", 0.5),
                lambda: moelens.ablate(moe, 1), lambda: moe.save_all()):
        with pytest.raises(ValueUnavailable, match=r"layers\.0\.mlp(\.\w+|, \.\.\.\)): a block.s values exist only while the model runs.*model\.trace"):
            use()
    with pytest.raises(ValueUnavailable, match=r"What it means: help\(type\(block\)\.router_logits\)\.$"):
        moe.router_logits  # noqa: B018 - help(moe.router_logits) raised this, with no way to the value's documentation
    assert type(moe).router_logits.__doc__.startswith("Router logits [b, s, E]")


def test_a_moe_block_neither_lists_nor_serves_dense_values_and_says_if_it_has_a_shared_expert(mixtral):
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    assert "(mlp_activation) -> not served by this block: an MoE block has no single hidden activation" in repr(moe)
    assert "router_logits" in repr(moe)
    with pytest.raises(ValueUnavailable, match="expert_activations"):
        moe.mlp_neurons  # noqa: B018
    assert moe.has_shared_expert is False
    assert moelens.wrap(tiny_model("qwen2_moe")).moes[0].has_shared_expert is True


def test_wrapping_a_wrapped_model_says_so(mixtral):
    wrapped, inputs = mixtral
    with pytest.raises(moelens.MoelensError, match="wrapped already"):
        moelens.wrap(wrapped)
    plain = nnsight.NNsight(wrapped._module)
    with pytest.raises(moelens.MoelensError, match=r"got an nnsight model \(NNsight\).*moelens.wrap\(model._module"):
        moelens.wrap(plain)
    # nnsight 0.8's LanguageModel is no NNsight: it was told to use moelens.load(), as if it were a path
    with warnings.catch_warnings():  # nnsight 0.8 deprecates it, users still build it
        warnings.simplefilter("ignore")
        language = nnsight.LanguageModel(wrapped._module, tokenizer=ascii_tokenizer())
    with pytest.raises(moelens.MoelensError, match=r"got an nnsight model \(LanguageModel\).*moelens.wrap\(model._module"):
        moelens.wrap(language)
    for part in (wrapped.moes[0], wrapped.moes[0].router, plain.model.layers[0]):  # it was told to use moelens.load()
        with pytest.raises(moelens.MoelensError, match=rf"got {re.escape(part.path)}, a {type(part).__name__} of a model "
                                                       r"wrapped already \(by moelens or nnsight\), not a model"):
            moelens.wrap(part)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda moe: moelens.reroute(moe, -1, 1), r"tokens=-1 is ambiguous"),
        (lambda moe: moelens.reroute(moe, torch.tensor([0]), 1), r"is ambiguous.*\(slice\(None\), positions\)"),
        (lambda moe: moelens.reroute(moe, (0,), 1), r"tokens=\(0,\) is ambiguous"),  # it rerouted all of batch row 0
        (lambda moe: moelens.force(moe, 1, tokens=(slice(None),)), r"tokens=\(slice\(None, None, None\),\) is ambiguous"),
        (lambda moe: moelens.force(moe, 1, tokens=torch.zeros(2, 5, dtype=torch.long)), r"integer 0/1 mask: \.bool\(\)"),
        # a set was said to give "no expert ids": it gives no slot order
        (lambda moe: moelens.reroute(moe, (slice(None), 0), {1, 2}), r"experts=\{1, 2\} is a set, which gives the ids "
                                                                     r"no order"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), (e for e in (1, 2))), r"is a generator, which gives the ids no"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), {1: 2}.keys()), r"is a dict_keys, which gives the ids no"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), None), r"experts=None gives no expert ids"),
        # torch.as_tensor took [3, True] for experts 3 and 1
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [3, True]), r"experts=\[3, True\] holds the bool True"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [[False, 3]]), r"holds the bool False"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), (3, numpy.True_)), r"holds the bool"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [torch.tensor(3), torch.tensor(True)]),
         r"holds the bool tensor\(True\)"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [3, numpy.array([True])]), r"holds the bool array"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), []), r"experts=\[\] gives no expert ids"),
        # ragged rows and a None among the ids were said to give "no expert ids"
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [[1, 2], [3]]),
         r"experts=\[\[1, 2\], \[3\]\] holds rows of different lengths, which make no tensor"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), [1, None]), r"experts=\[1, None\] holds None \(NoneType\), "
                                                                        r"which is no expert id"),
        (lambda moe: moelens.reroute(moe, torch.tensor([False, True]), 1), r"a bool mask that is not \[batch, seq\]"),
        (lambda moe: moelens.force(moe, 1, tokens=[False, True]), r"a bool mask that is not \[batch, seq\]"),
        (lambda moe: moelens.reroute(moe, (None, -1), 1), r"holds None, which adds an axis"),
        # a lone bool indexes as a new axis: (..., True) rerouted every token, (..., False) none
        (lambda moe: moelens.reroute(moe, (..., True), 1), r"tokens=\(Ellipsis, True\) holds a lone bool.*True picks every"),
        (lambda moe: moelens.force(moe, 1, tokens=(0, torch.tensor(False))), r"holds a lone bool"),
        (lambda moe: moelens.reroute(moe, (slice(None), numpy.True_), 1), r"holds a lone bool"),
        (lambda moe: moelens.force(moe, 1, tokens=(0, numpy.array(True))), r"holds a lone bool"),
        # meta index tensors picked tokens from uninitialised memory (a raw IndexError, or some other token edited)
        (lambda moe: moelens.keep_top(moe, 0, tokens=(torch.tensor([0], device="meta"), torch.tensor([1], device="meta"))),
         r"keep_top: tokens holds a tensor on the meta device"),
        (lambda moe: moelens.reroute(moe, torch.ones(2, 5, dtype=torch.bool, device="meta"), 1),
         r"reroute: tokens holds a tensor on the meta device"),
        (lambda moe: moelens.reroute(moe, (slice(None), 0), torch.tensor([6, 7], device="meta")),
         r"reroute: experts holds a tensor on the meta device"),
        (lambda moe: moelens.ablate(moe, torch.ones(8, dtype=torch.bool, device="meta")),
         r"ablate: expert holds a tensor on the meta device"),
    ],
    ids=["int-tokens", "int-tensor-tokens", "one-index-tuple", "one-slice-tuple", "int-mask", "set-experts",
         "generator-experts", "dict-keys-experts", "none-experts", "bool-in-list-experts", "bool-in-nested-list-experts",
         "numpy-bool-in-tuple-experts", "bool-tensor-in-list-experts", "bool-array-in-list-experts", "no-experts", "ragged-experts", "none-in-experts", "1d-bool-mask",
         "1d-bool-list", "none-axis", "bool-position", "bool-tensor-position", "numpy-bool-position",
         "numpy-0d-bool-array-position", "meta-token-indices", "meta-token-mask", "meta-experts", "meta-expert-mask"],
)
def test_ambiguous_tokens_and_unusable_experts_are_refused(mixtral, call, match):
    wrapped, inputs = mixtral
    write_fails(wrapped, inputs, call, match)


@pytest.mark.parametrize("given", [[3, 4], (3, 4), range(3, 5), collections.deque([3, 4]), torch.Size([3, 4]),
                                   [numpy.int64(3), torch.tensor(4)], numpy.array([3, 4]), [[3, 4]]],
                         ids=["list", "tuple", "range", "deque", "size", "scalars", "array", "nested"])
def test_reroute_takes_every_ordered_sequence_of_ids(mixtral, given):
    """The refusal of sets and generators refused ranges and deques too (ordered sequences, taken before it).
    Ground truth: the indices read before, with the slots of position 0 set by hand."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        before = moe.expert_indices.clone().save()
        moelens.reroute(moe, (slice(None), 0), given)
        after = moe.expert_indices.save()
    expected = before.clone()
    expected[:, 0] = torch.tensor([3, 4])
    assert torch.equal(after, expected)


def test_a_written_list_of_indices_holding_a_bool_is_refused(mixtral):
    """torch.as_tensor([3, True]) is [3, 1]: a bool among the written ids was taken for expert 1 (all-bool lists were
    refused already)."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with pytest.raises(WriteError, match=r"expert_indices: the written list holds the bool True among its numbers"):
        with wrapped.trace(**inputs):
            moe.expert_indices = [[[3, True]] * 5] * 2


def test_a_bool_mask_selects_only_its_tokens(mixtral):
    """As a tensor, a numpy array or nested lists (which torch read as one index per axis: the wrong tokens,
    or a refusal asking for the very mask given)."""
    wrapped, inputs = mixtral
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = True
    for given in (mask, mask.numpy(), mask.tolist()):
        with wrapped.trace(**inputs):
            before = wrapped.moes[0].expert_indices.clone().save()
            moelens.reroute(wrapped.moes[0], given, 7)
            after = wrapped.moes[0].expert_indices.save()
        changed = (after != before).any(-1)
        assert not changed[~mask].any() and (after[mask] == 7).all(), type(given)


def test_reroute_takes_one_row_of_experts_per_selected_token(mixtral):
    """A tuple's selection ([batch, positions]) was kept in shape: rows per token did not fit it."""
    wrapped, inputs = mixtral
    rows = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]])  # tokens (0, 0), (0, 1), (1, 0), (1, 1), row-major
    for experts in (rows, rows.view(2, 2, 2)):
        with wrapped.trace(**inputs):
            moelens.reroute(wrapped.moes[0], (slice(None), [0, 1]), experts)
            after = wrapped.moes[0].expert_indices.save()
        assert torch.equal(after[:, :2], rows.view(2, 2, 2).to(after.device))


def test_reroute_keeps_the_order_an_index_tensor_gives_the_tokens(mixtral):
    """Rows of experts go to the tokens in the order given, not sorted by position (a sort swapped the tokens'
    experts without a word, and every other test selected positions in ascending order)."""
    wrapped, inputs = mixtral
    with wrapped.trace(**inputs):
        moelens.reroute(wrapped.moes[0], (0, torch.tensor([3, 1])), [[1, 2], [5, 6]])
        after = wrapped.moes[0].expert_indices.save()
    assert after[0, 3].tolist() == [1, 2] and after[0, 1].tolist() == [5, 6]


def test_reroute_refuses_a_token_selected_twice(mixtral):
    """(0, [1, 1]) with two rows of experts kept the last row without a word (on CPU; undefined elsewhere); a token
    listed twice with the same experts is no conflict."""
    wrapped, inputs = mixtral
    for tokens in ((0, torch.tensor([1, 1])), (torch.tensor([0, 0]), [2, -3])):  # -3: position 2 of 5 again
        with pytest.raises(WriteError, match=r"reroute: tokens=.* selects a token more than once and gives it different "
                                             r"experts each time, so which of them it keeps is undefined"):
            with wrapped.trace(**inputs):
                moelens.reroute(wrapped.moes[0], tokens, [[1, 2], [5, 6]])
    for tokens, experts, second in (((0, torch.tensor([1, 2])), [[1, 2], [5, 6]], [5, 6]),  # each once
                                    ((0, torch.tensor([1, 1, 2])), [[1, 2], [1, 2], [5, 6]], [5, 6]),  # twice, alike
                                    ((0, torch.tensor([1, 2, 1])), [1, 2], [1, 2])):  # k ids for every slot
        with wrapped.trace(**inputs):
            moelens.reroute(wrapped.moes[0], tokens, experts)
            after = wrapped.moes[0].expert_indices.save()
        assert after[0, 1].tolist() == [1, 2] and after[0, 2].tolist() == second


def test_force_and_reroute_refuse_experts_the_block_cannot_run(mixtral):
    """force of k + 1 experts (one would never run) and reroute to expert E (no such expert) are refused up front."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    calls = {
        rf"force: {moe.top_k + 1} experts given but {moe.path} routes each token to only {moe.top_k}; force at most":
            lambda: moelens.force(moe, list(range(moe.top_k + 1))),
        rf"reroute: expert ids {moe.num_experts} must be in \[0, {moe.num_experts}\)":
            lambda: moelens.reroute(moe, (..., 0), moe.num_experts),
        # was taken as force(moe, [4]): one slot filled where the call names two
        r"force: expert 4 is given more than once in \[4, 4\]; a router picks an expert for one slot at most":
            lambda: moelens.force(moe, [4, 4]),
        # said "up to inf", then that -inf is beyond float32: it is route_around
        r"steer: bias -inf would remove expert 1 from .*'s routing; that is route-around ablation":
            lambda: moelens.steer(moe, 1, float("-inf")),
        # an int past float's range raised float()'s bare OverflowError
        r"steer: bias inf takes expert 1's logits up to inf in .*, beyond what the model's float32 logits hold":
            lambda: moelens.steer(moe, 1, 10**400),
    }
    for message, call in calls.items():
        with pytest.raises(WriteError, match=message):
            with wrapped.trace(**inputs):
                call()


def test_a_family_path_through_a_child_named_like_a_standard_name_binds_the_family_module():
    """A registered family whose experts live at ``experts.base_layer`` gets that module as
    ``moe.experts``, not the block's own child named ``experts``."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, init_lora_weights=False, target_parameters=["mlp.experts.gate_up_proj"])
    tuned = peft.get_peft_model(tiny_model("qwen3_moe", experts_implementation="batched_mm"), config)
    qwen3 = families.get("qwen3_moe")
    families.register(dataclasses.replace(qwen3, name="qwen3_moe_adapted", experts="experts.base_layer"), replace=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the adapter layer is no unknown MoE block
            wrapped = moelens.wrap(tuned)
        moe = wrapped.moes[0]
        assert moe.experts._module is tuned.get_submodule(moe.path.removeprefix("model.") + ".experts.base_layer")
        assert moe.experts_implementation == "batched_mm"
    finally:
        families.unregister("qwen3_moe_adapted")


def test_a_steer_bias_beyond_the_logits_dtype_is_refused():
    """float16 holds at most 65504: a finite bias of 1e5 would make the logit inf."""
    hf = tiny_model("mixtral", dtype=torch.float16)
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    write_fails(wrapped, inputs, lambda moe: moelens.steer(moe, 1, 1e5), r"bias 100000.0 .* float16 logits hold \(6.55e\+04")
    with wrapped.trace(**inputs):
        moelens.steer(wrapped.moes[0], 1, 60.0)
        indices = wrapped.moes[0].expert_indices.save()
    assert (indices == 1).any(-1).all()


def test_ernie_vl_shared_experts_outside_the_modality_blocks_are_named():
    """ernie4_5_vl_moe's layer mlp adds shared experts to text_moe's / vision_moe's output: the modality
    block refuses shared_expert_output naming where they are, and no advice points at a refused value."""
    from moelens.testing import tiny_inputs

    hf = tiny_model("ernie4_5_vl_moe")
    model = moelens.wrap(hf)
    text_moe = model.moes[0]
    assert hf.get_submodule(text_moe.path.removeprefix("model.").rsplit(".", 1)[0]).shared_experts is not None
    with pytest.raises(moelens.ValueUnavailable, match=r"mlp.shared_experts") as error:
        with model.trace(**tiny_inputs(hf)):
            text_moe.shared_expert_output.save()
    assert "read routed_output or mlp_output" not in str(error.value)


def test_errors_name_what_the_user_called(mixtral):
    """router_probs, an intervention and model.save_all outside a trace named router_logits, expert_indices and
    the first block's save_all; an intervention on a block the model had run past named only the value it read."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    for use, named in [(lambda: moe.router_probs, r"layers\.0\.mlp\.router_probs: a block's values exist only"),
                       (lambda: moelens.ablate(moe, 1), r"^ablate\(model\.model\.layers\.0\.mlp, \.\.\.\): a block's values exist only"),
                       (lambda: wrapped.save_all(), r"^model\.save_all: a model's values exist only while it runs")]:
        with pytest.raises(ValueUnavailable, match=named):
            use()
    with pytest.raises(moelens.OrderError, match=r"layers\.0\.mlp\.router_probs was requested after the model had "):
        with wrapped.trace(**inputs):
            moe.expert_weights.save()
            moe.router_probs.save()
    with pytest.raises(moelens.OrderError, match=r"^steer: .*router_logits was requested after .* call the interventions "
                                                 r"that change routing \(steer, force, ablate\(mode='route_around'\)\) "
                                                 r"before those that change outputs"):
        with wrapped.trace(**inputs):
            moelens.ablate(moe, 2)
            moelens.steer(moe, 1, 2.0)
    with pytest.raises(WriteError, match=r"got model\.model\.layers\.0 \(MixtralDecoderLayer\), which holds the MoE "
                                         r"block model\.model\.layers\.0\.mlp \(model\.moes\[0\]\): pass that"):
        with wrapped.trace(**inputs):
            moelens.ablate(wrapped.layers[0], 1)


def test_a_layer_mlp_holding_two_blocks_names_them():
    """ernie4_5_vl_moe's layers[i].mlp holds text_moe and vision_moe: reading a value on it was nnsight's bare
    AttributeError, and an intervention's error told the user to pass model.layers[i].mlp, what they had passed."""
    hf = tiny_model("ernie4_5_vl_moe")
    wrapped = moelens.wrap(hf)
    layer = wrapped.moes[0].layer
    holder = wrapped.layers[layer].mlp
    blocks = (rf"model\.layers\.{layer}\.mlp\.text_moe \(model\.moes\[0\]\), "
              rf"model\.layers\.{layer}\.mlp\.vision_moe \(model\.moes\[1\]\)")
    assert not hasattr(holder, "router_logits") and hasattr(holder, "text_moe")
    with pytest.raises(AttributeError, match=rf"is no MoE block itself: it holds the MoE blocks {blocks}; read "
                                             r"router_logits on one of them"):
        holder.router_logits
    with pytest.raises(WriteError, match=rf"which holds the MoE blocks {blocks}: pass one of them"):
        with wrapped.trace(**tiny_inputs(hf)):
            moelens.ablate(holder, 1)


def test_gemma4s_dense_mlp_names_the_decoder_layer_as_its_block():
    """Its value refusal said the MoE layers are [0, 1, ...], this very layer among them."""
    hf = tiny_model("gemma4")
    wrapped = moelens.wrap(hf)
    with pytest.raises(ValueUnavailable, match=r"layers\.1\.mlp\.router_logits cannot be served: .*shared expert of the "
                                               r"MoE block model\.model\.layers\.1, the decoder layer itself "
                                               r"\(model\.layers\[1\]\): use that block"):
        with wrapped.trace(**tiny_inputs(hf)):
            wrapped.layers[1].mlp.router_logits.save()


def test_save_all_strict_is_a_flag(mixtral):
    """strict="no" is truthy text: it was taken as True (raising where the user asked to leave values out). Refused
    as an `ArgumentError`, as a wrong value name is (it was a bare MoelensError)."""
    wrapped, inputs = mixtral
    for save_all in (lambda: wrapped.save_all(strict="no"), lambda: wrapped.moes[0].save_all(strict="no")):
        with pytest.raises(moelens.ArgumentError, match=r"strict must be True or False, got 'no' \(str\)"):
            with wrapped.trace(**inputs):
                save_all()


def test_a_second_force_on_a_block_ranking_selection_scores_says_what_orders_it():
    """deepseek_v3 ranks score + correction bias: force writes the logits and then the selection scores, so a second
    force comes after the logits; the order error says so (the generic routing-before-outputs rule was followed)."""
    _, wrapped, inputs, _, _ = built("deepseek_v3", "grouped_mm")
    moe = next(moe for moe in wrapped.moes if moe.ranks_selection_scores)
    with pytest.raises(OrderError, match=r"^force: .* \(deepseek_v3\) force and ablate\(mode='route_around'\) also "
                                         r"write the selection scores.*then at most one force"):
        with wrapped.trace(**inputs):
            moelens.force(moe, 2, tokens=(..., 0))
            moelens.force(moe, 3, tokens=(..., 1))
    with wrapped.trace(**inputs):  # the order it gives works
        moelens.steer(moe, 1, 2.0)
        moelens.force(moe, [2, 3])
        moelens.ablate(moe, 5, "route_around")
        indices = moe.expert_indices.save()
    assert (indices[..., :2].sort(-1).values == torch.tensor([2, 3], device=indices.device)).all()


def test_reading_a_misspelt_value_suggests_the_name_meant(mixtral):
    """Jupyter shows no "did you mean" of its own for an attribute error."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    for read, meant in [(lambda: moe.router_logit, "router_logits"), (lambda: moe.expert_weight, "expert_weights"),
                        (lambda: moe.shared_expert_outputs, "shared_expert_output"), (lambda: wrapped.moe, "moes")]:
        with pytest.raises(AttributeError, match=rf"\(did you mean '{meant}'\?\)"):
            read()
    with pytest.raises(AttributeError) as error:
        moe.nothing_like_a_value
    assert "did you mean" not in str(error.value)
    assert not hasattr(moe, "_private_missing")


def test_one_value_name_and_the_embedded_models_name_are_taken(mixtral):
    wrapped, inputs = mixtral
    with wrapped.trace(**inputs):
        one = wrapped.moes[0].save_all("router_logits")  # was split into characters: unknown names ['_', 'e', ...]
        every = wrapped.save_all("expert_indices")
    assert list(one) == ["router_logits"] and all(list(values) == ["expert_indices"] for values in every.values())
    tiny = moelens.load("moelens-tiny")  # the name the docs use went to the hub
    assert type(tiny._module).__name__ == "Qwen2MoeForCausalLM"
    with pytest.warns(UserWarning, match="moelens found no MoE block"):  # and so did the shipped dense model's
        dense = moelens.load("tiny-dense")
    assert type(dense._module).__name__ == "Qwen2ForCausalLM" and dense.tokenizer is not None
    with pytest.raises(moelens.MoelensError, match=r"token_routing routes one text .* got a list of 2 texts"):
        moelens.analysis.token_routing(tiny, ["a text", "another"])
    with pytest.raises(moelens.MoelensError, match=r"token_routing routes one text, .* got token ids of shape \(2, 3\)"):
        moelens.analysis.token_routing(tiny, torch.ones(2, 3, dtype=torch.long))
    ids = tiny.tokenizer("def add(a, b):", return_tensors="pt")["input_ids"]  # a batch of one [1, n] is one text
    assert torch.equal(moelens.analysis.token_routing(tiny, ids).indices,
                       moelens.analysis.token_routing(tiny, "def add(a, b):").indices)


def test_a_folder_of_the_users_named_like_the_embedded_model_wins(tmp_path, monkeypatch, capsys):
    """scripts/train_tiny.py --out DIR writes DIR/moelens-tiny: inside DIR, that folder is the one meant."""
    from moelens.cli import main

    tiny_model("mixtral").save_pretrained(tmp_path / "moelens-tiny")
    monkeypatch.chdir(tmp_path)
    assert moelens.load("moelens-tiny").family.name == "mixtral"
    assert main(["inspect", "moelens-tiny"]) == 0 and "mixtral" in capsys.readouterr().out


def test_reprs_say_what_a_block_and_its_weights_are(mixtral):
    wrapped, inputs = mixtral
    moe = wrapped.moes[1]
    assert repr(moe).startswith("Moe[mixtral, E=8, k=2, grouped_mm; router_probs = softmax(router_logits)] ")
    assert "(router_logits) -> " in repr(moe)
    params = repr(moe.params())
    assert params.startswith("MoeParams(router=[8, ") and "tensor(" not in params


def test_a_deep_models_repr_folds_its_identical_layers_and_lists_its_blocks_a_line_each():
    """Each block's tree named its layer, so nnsight could not fold identical layers ("(0-11): 12 x ..."): a 48-layer
    model printed 277 KB, and model.moes each block's whole tree. Truth: plain nnsight's fold of the same model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                            num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=16, num_experts_per_tok=2)
    hf = Qwen3MoeForCausalLM(config).eval()
    assert "(0-11): 12 x Qwen3MoeDecoderLayer(" in repr(nnsight.NNsight(hf))
    wrapped = moelens.wrap(hf)
    aliases = dict(wrapped._aliases)
    shown = repr(wrapped)
    # the layer tree once: the model.layers alias printed it a second time (nnsight's tree of a rename's mount)
    assert shown.count("(0-11): 12 x Qwen3MoeDecoderLayer(") == 1 and shown.count("(router_logits) -> ") == 1
    assert shown.endswith("\n  (layers): the same as model.model.layers\n)")
    assert wrapped._aliases == aliases and wrapped.layers[3].mlp.path == "model.model.layers.3.mlp"
    listed = repr(wrapped.moes).splitlines()
    assert listed[0] == "MoeList of 12 MoE blocks (model.moes[i] shows one):"
    assert listed[1:] == [f"  [{i}] model.model.layers.{i}.mlp: qwen3_moe, E=16, k=2, grouped_mm" for i in range(12)]


@pytest.mark.parametrize(("family", "implementation", "unserved"), [
    ("mixtral", "eager", {"expert_pre_activations", "expert_activations", "expert_outputs", "shared_expert_output",
                          "selection_scores"}),
    ("qwen2_moe", "grouped_mm", {"selection_scores"}),
    ("deepseek_v3", "grouped_mm", set()),
])
def test_a_blocks_repr_lists_the_values_it_cannot_serve_as_such(family, implementation, unserved):
    """The tree listed every value with its description, as if served (selection_scores on a router with no selection
    bias, a shared expert on mixtral): each listed value is read here, and is marked unserved exactly when the read
    refuses it."""
    hf = tiny_model(family, experts_implementation=implementation)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    listed = {line.strip()[1:].partition(")")[0]: line for line in repr(moe).splitlines() if ") -> " in line}
    refused = set()
    for name in listed:  # the dense MLP's mlp_activation / mlp_neurons were listed as "-> None: Not served ..."
        try:
            with wrapped.trace(**tiny_inputs(hf)):
                getattr(wrapped.moes[0], name).save()
        except ValueUnavailable:
            refused.add(name)
    assert refused == unserved | {"mlp_activation", "mlp_neurons"}
    assert {name for name, line in listed.items() if "not served by this block" in line} == refused


def test_a_llama4_blocks_repr_says_its_recomputed_routing_is_read_only():
    """The tree described expert_weights as writable ("a write changes the output only"); every write is refused."""
    hf = tiny_model("llama4")
    wrapped = moelens.wrap(hf)
    listed = {line.strip()[1:].partition(")")[0]: line for line in repr(wrapped.moes[0]).splitlines() if ") -> " in line}
    for name in ("expert_weights", "expert_indices"):
        assert f"-> read-only here: llama4 calls no experts module, so moelens recomputes {name} from router_logits" \
            in listed[name]
        with pytest.raises(WriteError, match=rf"{name} is recomputed from router_logits"):
            with wrapped.trace(**tiny_inputs(hf)):
                setattr(wrapped.moes[0], name, getattr(wrapped.moes[0], name).clone())
    assert "Writing reroutes the slot" in repr(moelens.wrap(tiny_model("mixtral")).moes[0])  # a block with an experts call


def test_wrapping_leaves_nnsight_forwards_on_the_modules_as_the_docs_say():
    # docs/getting-started.md: wrapping sets nnsight's forward on each module instance, for good; outputs
    # stay the model's own, a class patch made afterwards does not reach it, and a wrapped copy keeps the
    # original as it was.
    hf = tiny_model("mixtral")
    kept = copy.deepcopy(hf)
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with torch.no_grad():
        before = first_tensor(hf(ids))
    wrapped = moelens.wrap(hf)
    copied = moelens.wrap(copy.deepcopy(kept))
    block = hf.model.layers[0].mlp
    assert "forward" in vars(block) and "forward" not in vars(kept.model.layers[0].mlp)
    del wrapped, copied
    with torch.no_grad():
        assert torch.equal(first_tensor(hf(ids)), before)
    block_class = type(block)
    original = block_class.forward
    try:
        block_class.forward = lambda self, hidden_states: torch.zeros_like(hidden_states)
        with torch.no_grad():
            assert torch.equal(first_tensor(hf(ids)), before)  # wrapped: still the forward it had
            assert not torch.equal(first_tensor(kept(ids)), before)  # never wrapped: follows the patch
    finally:
        block_class.forward = original


def test_moes_is_indexed_by_block_and_a_bad_index_says_how_many_blocks_there_are():
    """model.moes[i] raised a list's bare IndexError / TypeError, unlike model.layers[i]; deepseek_v3's tiny model
    has a dense first layer, so block i is layer i + 1."""
    from moelens.components.layer_list import MoeList

    wrapped = moelens.wrap(tiny_model("deepseek_v3"))
    blocks = wrapped.moes
    layers = [moe.layer for moe in blocks]
    assert isinstance(blocks, MoeList) and blocks[-1].layer == layers[-1] and blocks[numpy.int64(0)].layer == layers[0]
    assert [moe.layer for moe in blocks[1:]] == layers[1:] and isinstance(blocks[1:], MoeList)
    for key in (len(blocks), "1", 1.5, None):
        with pytest.raises(moelens.LayerIndexError, match=rf"model.moes\[{re.escape(repr(key))}\]: .* counts the "
                                                          rf"{len(blocks)} MoE blocks, not the layers \(they sit on layers "
                                                          rf"{re.escape(str(layers))}\); layer i's block is "
                                                          r"model\.layers\[i\]\.mlp\."):
            blocks[key]
    ernie = moelens.wrap(tiny_model("ernie4_5_vl_moe")).moes  # two blocks a layer: layers[i].mlp holds them
    with pytest.raises(moelens.LayerIndexError, match=r"not the layers \(they sit on layers .*\); each block's \.path "
                                                      r"and \.layer say where it is\."):
        ernie[len(ernie)]
    with pytest.raises(moelens.LayerIndexError, match=r"this model has no MoE block"):
        moelens.wrap(tiny_model("mixtral")).moes[:0][0]


def test_save_all_arguments_of_the_wrong_type_are_refused_by_name():
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=4)["input_ids"]
    for call, message in ((lambda: wrapped.moes[0].save_all(1), r"save_all: values must be a value name or a list of "
                                                                 r"them .* got int"),
                          (lambda: wrapped.moes[0].save_all(torch.zeros(2)), r"save_all: values must be .* got Tensor"),
                          (lambda: wrapped.save_all(values=[1]), r"save_all: values must be .* got a list holding 1\.$"),
                          (lambda: wrapped.moes[0].save_all(["router_logits", 5]), r"got a list holding 5\.$"),
                          (lambda: wrapped.moes[0].save_all(b"router_logits"), r"got bytes\.$"),
                          (lambda: wrapped.save_all(moes=3), r"save_all\(moes=...\) takes a list of MoE blocks .* got int")):
        with pytest.raises(moelens.ArgumentError if "values" in message else moelens.MoelensError, match=message):
            with wrapped.trace(ids):
                call()


@pytest.mark.parametrize("tokenizer", [5, "gpt2", torch.zeros(2)], ids=["int", "str", "tensor"])
def test_a_tokenizer_that_is_no_tokenizer_is_refused_at_wrap(tokenizer):
    with pytest.raises(moelens.MoelensError, match=rf"wrap\(tokenizer=...\) takes the model's transformers tokenizer .* "
                                                   rf"got {type(tokenizer).__name__}"):
        moelens.wrap(tiny_model("mixtral"), tokenizer=tokenizer)


def test_scan_of_a_model_wrapped_without_a_tokenizer_says_what_it_needs():
    """nnsight's scan comes with a tokenizer's model class: without one it was a bare AttributeError."""
    wrapped = moelens.wrap(tiny_model("mixtral"))
    with pytest.raises(moelens.MoelensError, match=r"model.scan: shape inference needs a model wrapped with a tokenizer"):
        with wrapped.scan(torch.tensor([[5, 6, 7]])):
            wrapped.moes[0].expert_indices.save()


def test_a_trace_begun_while_another_thread_traces_the_model_is_refused():
    """nnsight keeps one interleaver per model: a second thread's trace joined the running one's workers and its
    end cleared them, so a trace could end with its body unfinished and no error (a stale .save())."""
    import threading

    from moelens.components import served
    from moelens.parallel.runs import Runs

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = hf(**inputs).logits
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    runs = Runs()
    for moe in wrapped.moes:  # as shard_experts marks the experts it shards: a run id per run (parallel.runs)
        moe.experts._module.__dict__["_ep_runs"] = runs
    inside, refused = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        with torch.no_grad(), wrapped.trace(**inputs):
            weights = wrapped.moes[0].expert_weights.save()
            inside.set()
            refused.wait(30)  # the model is mid-run, in this thread, while the other thread tries
            logits = wrapped.output.logits.save()
        results["first"] = (weights, logits)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(30)
    running = (runs.current, served.RUNS.get(wrapped.interleaver))
    with pytest.raises(moelens.MoelensError, match="running a trace .* another thread began"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.output.save()
    with pytest.raises(moelens.MoelensError, match="running a trace .* another thread began"):
        wrapped.trace(**inputs, trace=False)  # a run without a with-block: refused before it touches the run's state
    with pytest.raises(moelens.MoelensError, match="running a trace .* another thread began"):
        wrapped.generate(inputs["input_ids"], max_new_tokens=1)  # nnsight ran it inside the other thread's run
    assert (runs.current, served.RUNS.get(wrapped.interleaver)) == running
    # a trace of this thread that ended just before the other began cleans up once more as it returns (nnsight's
    # tracer does, after the run's own clean-up): that leaves the other thread's run alone
    wrapped.interleaver.cancel()
    refused.set()
    thread.join(30)
    weights, logits = results["first"]
    assert torch.equal(logits, plain) and weights.shape[-1] == 2  # the first trace ran to its end, unharmed
    assert runs.current == 1 and served.RUNS.get(wrapped.interleaver) is None
    for failing in (True, False):  # once it is over, another thread traces: after a failed trace too
        def later(failing=failing) -> None:
            try:
                with torch.no_grad(), wrapped.trace(**inputs):
                    if failing:
                        wrapped.moes[0].expert_indices[..., 0] = 99
                    results["later"] = wrapped.output.logits.save()
            except WriteError:
                results["later"] = "refused"
        thread = threading.Thread(target=later)
        thread.start()
        thread.join(30)
        assert results.pop("later") == "refused" if failing else torch.equal(results.pop("later"), plain)
    with torch.no_grad(), wrapped.trace(**inputs):  # and so does this one
        logits = wrapped.output.logits.save()
    assert torch.equal(logits, plain)


def test_a_trace_of_another_wrapper_of_the_same_model_is_refused_while_one_runs():
    """moelens.wrap(hf) twice (or of hf and hf.model) shares the MoE blocks, whose calls nnsight hands to the run that
    began first: a trace of one inside the other's failed with greenlet's "cyclic parent chain", and from another
    thread with an OrderError blaming the read order or "parent cannot be on a different thread". A trace of the
    other before the model runs (in an invoke-mode body, before its invokes) is no clash and runs."""
    import threading

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = hf(**inputs).logits
    first = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    refusal = r"another wrapper of this model's MoE blocks .* is running it {}.* wrap a copy for the second"
    for second in (moelens.wrap(hf, tokenizer=ascii_tokenizer()), moelens.wrap(hf.model)):
        with pytest.raises(moelens.MoelensError, match=refusal.format(r"in this thread \(a trace inside its trace\)")):
            with torch.no_grad(), first.trace(**inputs):
                first.moes[0].router_logits.save()
                with second.trace(input_ids=inputs["input_ids"]):
                    second.moes[0].router_logits.save()
        inside, refused = threading.Event(), threading.Event()
        results: dict[str, object] = {}

        def outer() -> None:
            with torch.no_grad(), first.trace(**inputs):
                first.moes[0].expert_weights.save()
                inside.set()
                refused.wait(30)
                results["outer"] = first.output.logits.save()

        thread = threading.Thread(target=outer)
        thread.start()
        assert inside.wait(30)
        with pytest.raises(moelens.MoelensError, match=refusal.format("in another thread")):
            with torch.no_grad(), second.trace(input_ids=inputs["input_ids"]):
                second.moes[0].router_logits.save()
        refused.set()
        thread.join(30)
        assert torch.equal(results["outer"], plain)  # the running trace went on unharmed
        with torch.no_grad(), first.trace() as tracer:  # its model has not run yet: the other's trace is no clash
            with second.trace(input_ids=inputs["input_ids"]):
                early = second.moes[0].router_logits.save()
            with tracer.invoke(**inputs):
                logits = first.output.logits.save()
        assert torch.equal(logits, plain) and early.shape[-1] == first.moes[0].num_experts
        with torch.no_grad(), second.trace(input_ids=inputs["input_ids"]):  # one after the other: both serve
            after = second.moes[0].router_logits.save()
        assert torch.equal(after, early)


def _first_layer(hf):
    return (hf.model.language_model if hasattr(hf.model, "language_model") else hf.model).layers[0]


@pytest.mark.parametrize("family, part", [("mixtral", "mlp.experts"), ("mixtral", "mlp.gate"),
                                          ("granitemoeshared", "shared_mlp")])  # granite's is on the decoder layer
def test_a_trace_of_a_model_holding_another_s_router_or_experts_is_refused_while_that_one_runs(family, part):
    """Two models sharing one module of a block (B's layer-0 experts, router or shared expert is A's object): a trace
    of B inside A's trace blamed the read order (OrderError) or failed with greenlet's "cyclic parent chain", as nnsight
    hands the shared module's calls to the run that began first. Refused naming the module; one after the other, both
    serve. Ground truth: each model's plain forward on a deep copy (the copies share nothing)."""
    hf_a, hf_b = tiny_model(family, seed=0), tiny_model(family, seed=1)
    host, name = part.rpartition(".")[0], part.rpartition(".")[2]
    module = _first_layer(hf_a).get_submodule(part)
    setattr(_first_layer(hf_b).get_submodule(host), name, module)
    inputs = tiny_inputs(hf_a)
    with torch.no_grad():
        plain_a, plain_b = (copy.deepcopy(hf)(**inputs).logits for hf in (hf_a, hf_b))
    a, b = moelens.wrap(hf_a), moelens.wrap(hf_b)
    read = "shared_expert_output" if "shared" in part else "routed_output"
    with pytest.raises(moelens.MoelensError, match=rf"or of another model holding one of its modules: "
                                                   rf"{type(module).__name__} at 0x[0-9a-f]+\) is running it in this"):
        with torch.no_grad(), a.trace(**inputs):
            a.moes[0].router_logits.save()
            with b.trace(**inputs):
                getattr(b.moes[0], read).save()
    for model, plain in ((a, plain_a), (b, plain_b)):
        with torch.no_grad(), model.trace(**inputs):
            logits = model.output.logits.save()
        assert torch.equal(logits, plain)


def test_a_shared_module_of_a_block_of_another_family_in_the_same_model_is_held_too():
    """A model whose blocks are of two registered families (layer 0 a CustomBlock: chooser / pool; layer 1 another
    block: route / bank): the modules held were found by the first block's family alone, so a second model sharing
    layer 1's experts got greenlet's "cyclic parent chain" instead of the refusal. Ground truth: A's plain forward."""
    from custom_models import LinearRouter, MixtralExperts, custom_family, custom_model

    class OtherBlock(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.route = LinearRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
            self.bank = MixtralExperts(config)

        def forward(self, hidden):
            flat = hidden.reshape(-1, hidden.shape[-1])
            _, weights, index = self.route(flat)
            return self.bank(flat, index, weights).reshape(hidden.shape)

    def mixed():
        model = custom_model()
        model.layers[1]["ffn"] = OtherBlock(model.config)
        for parameter in model.layers[1].parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        return model

    other = moelens.Family("other", ("other",), ("OtherBlock",), block_attr="ffn", router="route", experts="bank",
                           logits_op="torch_nn_functional_linear_0", scoring=moelens.Scoring("softmax", "score_topk"))
    moelens.families.register(custom_family())
    moelens.families.register(other)
    try:
        hf_a, hf_b = mixed(), mixed()
        hf_b.layers[1]["ffn"].bank = hf_a.layers[1]["ffn"].bank
        ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            plain_a = copy.deepcopy(hf_a)(ids)
        a, b = moelens.wrap(hf_a), moelens.wrap(hf_b)
        with pytest.raises(moelens.MoelensError, match=r"holding one of its modules: MixtralExperts at 0x"):
            with torch.no_grad(), a.trace(ids):
                a.moes[1].router_logits.save()
                with b.trace(ids):
                    b.moes[1].routed_output.save()
        with torch.no_grad(), a.trace(ids):
            out = a.output.save()
        assert torch.equal(out, plain_a)
    finally:
        moelens.families.unregister("other")
        moelens.families.unregister("custom")


def test_models_sharing_a_module_moelens_serves_nothing_from_trace_one_inside_the_other():
    """Only the modules values are served from are held: two gemma4 models (whose block is the decoder layer) sharing
    the layer's activation object trace one inside the other, as before. Ground truth: B's plain forward on a copy."""
    hf_a, hf_b = tiny_model("gemma4", seed=0), tiny_model("gemma4", seed=1)
    _first_layer(hf_b).act_fn = _first_layer(hf_a).act_fn
    inputs = tiny_inputs(hf_a)
    with torch.no_grad():
        plain_b = copy.deepcopy(hf_b)(**inputs).logits
    a, b = moelens.wrap(hf_a), moelens.wrap(hf_b)
    with torch.no_grad(), a.trace(**inputs):
        a.moes[0].router_logits.save()
        with b.trace(**inputs):
            logits = b.output.logits.save()
    assert torch.equal(logits, plain_b)


def test_a_trace_generate_or_scan_of_the_model_inside_its_own_trace_is_refused():
    """A trace's body runs while the model runs: a trace of the same wrapper there failed with greenlet's "cyclic
    parent chain", and generate ran transformers' own on the raw prompt ("'str' object has no attribute 'shape'").
    A trace of it in an invoke-mode body before the invokes (the model has not run yet) is no nesting and runs."""
    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = hf(**inputs).logits
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    nested = {
        "a trace": lambda: wrapped.trace(**inputs),
        "model.generate": lambda: wrapped.generate("ab", max_new_tokens=1),
        "model.scan": lambda: wrapped.scan("ab"),
    }
    for what, begin in nested.items():
        with pytest.raises(moelens.MoelensError, match=f"{what} of this model was begun inside a trace of the same "
                                                      r"model.*tracer\.invoke"):
            with torch.no_grad(), wrapped.trace(**inputs):
                wrapped.moes[0].router_logits.save()
                with begin():
                    wrapped.moes[0].router_logits.save()
        assert wrapped.interleaver.owner is None and not wrapped.interleaver.running
        with torch.no_grad(), wrapped.trace(**inputs):  # the model serves as before
            logits = wrapped.output.logits.save()
        assert torch.equal(logits, plain)
    with torch.no_grad(), wrapped.trace() as tracer:
        with wrapped.trace(**inputs):
            early = wrapped.output.logits.save()
        with tracer.invoke(**inputs):
            logits = wrapped.output.logits.save()
    assert torch.equal(early, plain) and torch.equal(logits, plain)


def test_a_trace_generate_or_scan_begun_in_an_invoke_mode_body_after_an_invoke_is_refused():
    """An invoke-mode trace's body runs in the caller's frame before the model runs, queuing a worker at each invoke:
    a trace, generate or scan of the same model begun there after an invoke ran without an error, and took that
    invoke's worker for its own (its .save() held the nested run's logits, a generation step's or a FakeTensor) and
    dropped it. It is refused; caught in the body, the trace goes on; every trace after one runs."""
    hf = tiny_model("mixtral")
    ids, other = tiny_inputs(hf, 1, 5)["input_ids"], tiny_inputs(hf, 1, 5, seed=5)["input_ids"]
    with torch.no_grad():
        plain, plain_other = hf(ids).logits, hf(other).logits
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    interleaver = wrapped.interleaver

    def trace() -> None:
        with wrapped.trace(other):
            wrapped.output.logits.save()

    def generate() -> None:
        with wrapped.generate(other, max_new_tokens=1):
            wrapped.output.logits.save()

    def scan() -> None:
        with wrapped.scan(other):
            wrapped.output.logits.save()

    nested = [("a trace", trace), ("a trace", generate), ("a trace", lambda: wrapped.generate(other, max_new_tokens=1)),
              ("model.scan", scan), ("a trace", lambda: wrapped.trace(other, trace=False))]
    for what, begin in nested:
        refusal = rf"{what} of this model was begun inside a trace of the same model.*tracer\.invoke"
        refusals: list[str] = []
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke(ids):
                first = wrapped.output.logits.save()
            try:
                begin()
            except moelens.MoelensError as error:  # caught in the body: the trace goes on with its invokes
                refusals.append(str(error))
            with tracer.invoke(ids):
                second = wrapped.output.logits.save()
        assert len(refusals) == 1 and re.search(refusal, refusals[0], re.DOTALL)
        assert torch.allclose(first, plain, atol=1e-5) and torch.allclose(second, plain, atol=1e-5)
        with pytest.raises(moelens.MoelensError, match=refusal):
            with torch.no_grad(), wrapped.trace() as tracer:
                with tracer.invoke(ids):
                    wrapped.output.logits.save()
                begin()
        assert interleaver.owner is None and not interleaver.running and not interleaver.mediators
        with torch.no_grad(), wrapped.trace(ids):  # the model serves as before
            logits = wrapped.output.logits.save()
        assert torch.allclose(logits, plain, atol=1e-5)
    with pytest.raises(moelens.MoelensError, match="a trace of this model was begun inside"):
        with torch.no_grad(), wrapped.trace() as tracer:
            trace()  # before the invokes: no clash, and its end leaves the next one after an invoke refused
            with tracer.invoke(ids):
                wrapped.output.logits.save()
            trace()
    with pytest.raises(KeyboardInterrupt):  # a trace ended in its body after an invoke leaves nothing queued
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke(ids):
                wrapped.output.logits.save()
            raise KeyboardInterrupt
    with torch.no_grad(), wrapped.session():  # a session's invoke-mode traces, and a generate's invokes, run
        with wrapped.trace() as tracer:
            with tracer.invoke(ids):
                one = wrapped.output.logits.save()
        with wrapped.trace() as tracer:
            with tracer.invoke(other):
                two = wrapped.output.logits.save()
    with torch.no_grad(), wrapped.generate(max_new_tokens=2) as tracer:
        with tracer.invoke(ids):
            generated = tracer.result.save()
    assert torch.allclose(one, plain, atol=1e-5) and torch.allclose(two, plain_other, atol=1e-5)
    assert generated.shape == (1, ids.shape[1] + 2)


def test_a_clean_up_that_waits_on_a_thread_tracing_another_model_does_not_deadlock():
    """A trace fails while an invoke waits in a thread pool whose job traces another model (one model per thread, as
    the docs advise): nnsight's clean-up ran that invoke's pool exit, which waited for the job, under the lock the
    job's trace needed to begin."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    model, other = moelens.wrap(hf), moelens.wrap(copy.deepcopy(hf))
    outcome: dict[str, object] = {}

    def job() -> str:
        import time

        time.sleep(0.5)  # the other invoke's refused write fails the run meanwhile
        with torch.no_grad(), other.trace(**inputs):
            other.output.save()
        outcome["job"] = "traced"

    def scenario() -> None:
        try:
            with torch.no_grad(), model.trace() as tracer:
                with tracer.invoke(inputs["input_ids"]):
                    with ThreadPoolExecutor(1) as pool:  # its exit waits for the job
                        pool.submit(job)
                        model.moes[1].expert_indices.save()  # parked here when the run fails
                with tracer.invoke(inputs["input_ids"]):
                    model.moes[0].expert_indices[..., 0] = 999
        except BaseException as error:  # noqa: BLE001 - compared below
            outcome["trace"] = type(error).__name__

    thread = threading.Thread(target=scenario, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and outcome == {"job": "traced", "trace": "WriteError"}

def _trace_in_forked_child(wrapped, ids, expected, results) -> None:
    """In a forked child: trace ``wrapped`` on ``ids`` in this thread, in a new one (which may get the id of the
    parent's thread that was tracing), and a wrapped copy of its model; put what came out of each on ``results``."""
    import threading

    def outcome(model) -> tuple:
        try:
            with torch.no_grad(), model.trace(ids):
                logits = model.output.logits.save()
            return ("traced", torch.equal(logits, expected))
        except Exception as error:  # noqa: BLE001 - reported to the parent
            return (type(error).__name__, str(error))

    in_thread = []
    thread = threading.Thread(target=lambda: in_thread.append(outcome(wrapped)))
    thread.start()
    thread.join(60)
    results.put([outcome(wrapped), *in_thread, outcome(moelens.wrap(copy.deepcopy(wrapped._module)))])


def test_a_process_forked_while_another_thread_traces_is_told_so():
    """The child has one thread, yet each trace was refused as "another thread began" a run it could never end (and
    one from a new thread that got the tracing thread's id failed inside greenlet); a wrapped copy of the model
    traces right there, as does the model in a child forked after the trace (plain transformers on an unwrapped
    copy)."""
    import multiprocessing
    import threading

    hf = tiny_model("mixtral")
    ids = tiny_inputs(hf)["input_ids"]
    with torch.no_grad():
        expected = copy.deepcopy(hf)(input_ids=ids).logits
    wrapped = moelens.wrap(hf)
    started, finish = threading.Event(), threading.Event()

    def tracing():
        with torch.no_grad(), wrapped.trace(ids):
            wrapped.moes[0].router_logits.save()
            started.set()
            finish.wait(60)

    context = multiprocessing.get_context("fork")
    outcomes = []
    thread = threading.Thread(target=tracing)
    thread.start()
    try:
        assert started.wait(60)
        for _ in range(2):  # during the trace, then after it
            results = context.Queue()
            child = context.Process(target=_trace_in_forked_child, args=(wrapped, ids, expected, results))
            child.start()
            outcomes.append(results.get(timeout=120))
            child.join(60)
            finish.set()
            thread.join(60)
    finally:
        finish.set()
        thread.join(60)
    during, after = outcomes
    for refused in during[:2]:
        assert refused[0] == "MoelensError" and "was running a trace in another thread when this process was " \
            "forked" in refused[1] and "moelens.wrap(copy.deepcopy(model._module))" in refused[1], refused
    assert during[2] == ("traced", True)
    assert after == [("traced", True)] * 3


@pytest.mark.parametrize(("family", "sizes"), [("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 5}),
                                             ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 6}),
                                             ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 5,
                                                              "n_group": 1, "topk_group": 1})])
def test_a_top_k_above_the_expert_count_is_refused_at_wrap(family, sizes):
    """A config routing each token to more experts than a block has wrapped, then every trace failed inside the router
    with torch's "selected index k out of range", naming neither value."""
    hf = tiny_model(family, **sizes)
    experts, k = next(v for n, v in sizes.items() if "experts" in n and "tok" not in n), sizes["num_experts_per_tok"]
    with pytest.raises(moelens.MoelensError, match=rf"the {family} block model.layers.\d.mlp routes each token to its top_k={k} "
                                                   rf"experts, but it has {experts} \(num_experts\)"):
        moelens.wrap(hf)
    with pytest.raises(RuntimeError, match="out of range"):  # what the unwrapped model does with it
        hf(torch.tensor([[1, 2, 3]], device=hf.device))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_top_k_raised_above_the_expert_count_after_wrapping_is_named_when_a_trace_fails(family):
    """Set on the router after wrapping, the trace failed with torch's "selected index k out of range"."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[-1]
    moe.router._module.top_k = moe.num_experts + 1
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="out of range"):  # what the unwrapped model does with it
        hf(ids)
    with pytest.raises(moelens.MoelensError, match=rf"the {family} block {moe.path.removeprefix('model.')} routes each "
                       rf"token to its top_k={moe.num_experts + 1} experts, but it has {moe.num_experts} .* Set the "
                       rf"block's router.top_k back to at most {moe.num_experts}\."):
        with wrapped.trace(ids):
            pass


def test_no_experts_is_refused_with_advice_one_can_follow():
    """With num_experts=0 the advice was "top_k at most 0"."""
    with pytest.raises(moelens.MoelensError, match=r"top_k=2 experts, but it has 0 \(num_experts\).*Fix the model's "
                                                   r"config \(at least one expert, and top_k at most that number\)"):
        moelens.wrap(tiny_model("mixtral", num_local_experts=0))


def test_top_k_zero_and_a_count_the_entry_cannot_read_still_wrap():
    """The top_k refusal refused k=0, which the model runs (no expert picked), and crashed wrap with a raw TypeError
    when an entry's top_k read None (the read itself says so later)."""
    hf = tiny_model("mixtral", num_experts_per_tok=0)
    assert moelens.wrap(hf).moes[0].top_k == 0 and torch.isfinite(hf(torch.tensor([[1, 2, 3]], device=hf.device)).logits).all()
    hf = tiny_model("mixtral")
    hf.config.moe_k = None
    families.register(dataclasses.replace(families.get("mixtral"), name="k_from_config", top_k="config.moe_k"),
                      replace=True)
    try:
        assert moelens.wrap(hf).moes[0].family.name == "k_from_config"
    finally:
        families.unregister("k_from_config")


def test_a_dict_of_inputs_given_positionally_without_a_tokenizer_says_to_unpack_it():
    """model.trace(inputs) with the dict tiny_inputs (or a tokenizer) returns failed inside torch's embedding
    ("argument 'indices' must be Tensor, not dict"); given as keywords the same inputs run."""
    hf = tiny_model("mixtral")
    model, inputs = moelens.wrap(hf), tiny_inputs(hf)
    for trace in (lambda: model.trace(inputs), lambda: model.trace(inputs, inputs)):
        with pytest.raises(moelens.MoelensError, match=r"got a dict of inputs \(keys \['attention_mask', 'input_ids'\]\) "
                                                       r"where its forward takes input_ids: pass it as keywords, model.trace\(\*\*inputs\)"):
            with trace():
                model.moes[0].router_logits.save()
    with pytest.raises(moelens.MoelensError, match=r"got a dict of inputs"):
        with model.trace() as tracer:
            with tracer.invoke(inputs):
                model.moes[0].router_logits.save()
    with model.trace(**inputs):
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(**inputs).logits, rtol=0, atol=0)

    class TakesADict(torch.nn.Module):  # a forward whose first argument is a dict: it is the model's to take
        def __init__(self) -> None:
            super().__init__()
            self.inner = hf

        def forward(self, batch):
            return self.inner(**batch).logits

    own = moelens.wrap(TakesADict())
    with own.trace(inputs):
        taken = own.output.save()
    torch.testing.assert_close(taken, logits, rtol=0, atol=0)


@pytest.mark.parametrize(("given", "named"), [
    (5, "int 5"), (b"abc", "bytes"), ([1, 2, 3], "list"), (torch.ones(1, 3), r"a torch.float32 tensor of shape \(1, 3\)"),
])
def test_ids_that_are_no_integer_tensor_without_a_tokenizer_are_refused_by_name(given, named):
    """model.trace(5) (or bytes, a list, float ids) on a model wrapped without a tokenizer failed inside torch's
    embedding ("argument 'indices' must be Tensor, not int"), naming neither the input nor what to pass."""
    hf = tiny_model("mixtral")
    model = moelens.wrap(hf)
    for trace in (lambda: model.trace(given), lambda: model.trace(input_ids=given)):
        with pytest.raises(moelens.MoelensError, match=rf"without a tokenizer takes token ids as an integer tensor "
                                                       rf"\[batch, seq\], and got {named} as its input_ids"):
            with trace():
                model.output.save()
    ids = tiny_inputs(hf)["input_ids"]
    with model.trace(ids):
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(ids).logits, rtol=0, atol=0)


def test_one_row_of_ids_without_its_batch_axis_is_refused_with_the_fix():
    """A 1-D ids tensor (one prompt's ids, as a tokenizer's ids[0] gives them) failed deep in the model with torch's
    "The size of tensor a (4) must match the size of tensor b (8)", in a trace and a lone invoke alike; several
    invokes of 1-D rows batch them as rows, as before."""
    hf = tiny_model("mixtral")
    model = moelens.wrap(hf)
    ids = tiny_inputs(hf)["input_ids"][0]
    refused = rf"takes token ids \[batch, seq\], and got one row of {ids.shape[0]} ids without its batch axis: pass ids\[None\]"
    for trace in (lambda: model.trace(ids), lambda: model.trace(input_ids=ids)):
        with pytest.raises(moelens.MoelensError, match=refused):
            with trace():
                model.output.save()
    with pytest.raises(moelens.MoelensError, match=refused):
        with model.trace() as tracer:
            with tracer.invoke(ids):
                model.output.save()
    with model.trace(ids[None]):
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(ids[None]).logits, rtol=0, atol=0)
    with model.trace() as tracer:  # several invokes batch 1-D rows as rows, left-padded
        with tracer.invoke(ids):
            first = model.output.logits.save()
        with tracer.invoke(ids[:2]):
            second = model.output.logits.save()
    torch.testing.assert_close(first, hf(ids[None]).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[:, -2:], hf(ids[None, :2]).logits, rtol=1e-5, atol=1e-5)


def test_save_all_strict_gives_the_reason_a_block_cannot_serve_a_value(mixtral):
    """strict=True raised "this block runs no mixture for it" for a value the block was merely without (mixtral's
    shared expert): the reason and the way out are the ones a direct read gives."""
    wrapped, inputs = mixtral
    with pytest.raises(moelens.MoelensError) as direct:
        with wrapped.trace(**inputs):
            wrapped.moes[0].shared_expert_output.save()
    with pytest.raises(moelens.MoelensError) as strict:
        with wrapped.trace(**inputs):
            wrapped.moes[0].save_all(["router_logits", "shared_expert_output"], strict=True)
    assert "mixtral family has no shared expert" in str(direct.value)
    assert str(strict.value) == str(direct.value)


def test_save_all_follows_a_shared_expert_turned_off_between_traces():
    """save_all() planned a block's reads once and kept the plan: after block.shared_experts = None (ernie4_5_moe's
    forward then runs without it) the next save_all() still waited for the shared expert's output and raised an
    OrderError blaming the read order, where it leaves a value the block does not serve out. Ground truth: the
    block's output is then its routed output alone."""
    hf = tiny_model("ernie4_5_moe")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        before = moe.save_all()
    assert "shared_expert_output" in before
    moe._module.shared_experts = None
    with wrapped.trace(**inputs):
        after = moe.save_all()
    assert "shared_expert_output" not in after and {"routed_output", "mlp_output"} <= set(after)
    assert torch.equal(after["routed_output"].to(after["mlp_output"].dtype), after["mlp_output"])
    with pytest.raises(moelens.MoelensError, match=r"has no shared expert \(its 'shared_experts' is absent"):
        with wrapped.trace(**inputs):
            moe.save_all(["router_logits", "shared_expert_output"], strict=True)



def test_a_shared_expert_put_back_after_a_trace_without_it_is_served_again():
    """The block's bindings were built once, on the first read: built while ``block.shared_experts = None``, they
    never held shared_expert_output, and after the module was put back every read of it (and save_all) raised a bare
    KeyError. Ground truth: the shared expert module's own output, from a torch hook."""
    hf = tiny_model("ernie4_5_moe")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    moe = wrapped.moes[0]
    shared = moe._module.shared_experts
    moe._module.shared_experts = None
    with wrapped.trace(**inputs):
        assert "shared_expert_output" not in moe.save_all()
    moe._module.shared_experts = shared
    outputs = []
    handle = shared.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        with wrapped.trace(**inputs):
            saved = moe.save_all()
        with wrapped.trace(**inputs):
            alone = moe.shared_expert_output.save()
    finally:
        handle.remove()
    batch, seq = inputs["input_ids"].shape
    for value, output in zip((saved["shared_expert_output"], alone), outputs):
        torch.testing.assert_close(value, output.view(batch, seq, -1), rtol=0, atol=0)


def test_a_router_switched_from_sigmoid_to_softmax_after_a_trace_refuses_a_plus_inf_logit():
    """router_logits' write check was built on the first read: a cohere2_moe router switched from sigmoid (a +inf
    logit saturates at 1) to softmax after it still took a +inf logit, and the model's output was NaN. The other
    way round, a legal +inf was refused. Ground truth: what the model computes with the write."""
    hf = tiny_model("cohere2_moe", expert_selection_fn="sigmoid")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)

    routers = [module for module in hf.modules() if type(module).__name__ == "Cohere2MoeTopKRouter"]
    for score in ("sigmoid", "softmax", "sigmoid"):
        for router in routers:
            router.expert_selection_fn = score
        refused = pytest.raises(moelens.WriteError, match=r"holds \+inf; a \+inf logit makes this router's softmax "
                                                          "scores NaN") if score == "softmax" else contextlib.nullcontext()
        with refused, wrapped.trace(**inputs):
            wrapped.moes[0].router_logits[0, 0, 0] = float("inf")
            logits = wrapped.output.logits.save()
        if score == "sigmoid":
            assert logits.isfinite().all()


def test_cohere2_router_probs_follow_the_routers_own_score_function():
    """cohere2_moe's router copies config.expert_selection_fn at init and scores with its copy; moelens read the
    config, so after the router's own was switched router_probs and the block's description named the other
    function. Ground truth: the model's expert weights, the chosen logits' sigmoid (norm_topk_prob off)."""
    hf = tiny_model("cohere2_moe", norm_topk_prob=False)
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    for module in hf.modules():
        if type(module).__name__ == "Cohere2MoeTopKRouter":
            module.expert_selection_fn = "sigmoid"
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        logits, probs = moe.router_logits.save(), moe.router_probs.save()
        weights, indices = moe.expert_weights.save(), moe.expert_indices.save()
    torch.testing.assert_close(weights.float(), logits.float().gather(-1, indices).sigmoid())
    torch.testing.assert_close(probs, logits.float().sigmoid())
    assert "sigmoid(router_logits)" in repr(moe)


@pytest.mark.parametrize("replaced", ["experts", "shared_experts"])
def test_a_module_replaced_after_wrapping_is_named_instead_of_the_read_order(replaced):
    """A module put in place of the block's experts or shared expert after wrapping is one nnsight never sees run:
    a read there raised an OrderError that blamed the read order (the value was read first). Wrapped again, the
    model serves the new module's output (ground truth: a torch hook on it)."""
    hf = tiny_model("ernie4_5_moe")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    block = wrapped.moes[0]._module
    new = copy.deepcopy(getattr(block, replaced))
    setattr(block, replaced, new)
    value = "routed_output" if replaced == "experts" else "shared_expert_output"
    with pytest.raises(moelens.OrderError, match=rf"{value} was never produced: model\.model\.layers\.1\.mlp\.{replaced} "
                                                 r"is no longer the module this model was wrapped with .* Wrap the model "
                                                 r"again: moelens\.wrap\(model\._module\)\.$"):
        with wrapped.trace(**inputs):
            getattr(wrapped.moes[0], value).save()
    with pytest.raises(moelens.OrderError, match=r"router_logits was requested after the model had already run past"):
        with wrapped.trace(**inputs):  # read out of order, at a module nobody replaced: the order is to blame
            wrapped.moes[0].mlp_output.save()
            wrapped.moes[0].router_logits.save()
    outputs = []
    handle = new.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        again = moelens.wrap(hf)
        with again.trace(**inputs):
            served = getattr(again.moes[0], value).save()
    finally:
        handle.remove()
    torch.testing.assert_close(served, outputs[0].view(served.shape), rtol=0, atol=0)

def test_a_block_replaced_through_its_envoy_is_named_and_its_call_arguments_still_served():
    """nnsight's swap of a whole block, ``model...layers[1].mlp = new_block``: router_logits (read inside the router
    moelens never instrumented) raised an OrderError blaming the read order, and save_all one blaming an earlier
    read; it names the replaced block. What is read at module calls (expert_weights, routed_output, mlp_output) stays
    served, equal to a plain model holding the same new block (hooks)."""
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    new = tiny_model("mixtral", seed=1).model.layers[1].mlp
    reference = tiny_model("mixtral")
    reference.model.layers[1].mlp = copy.deepcopy(new)
    wrapped.model.layers[1].mlp = new
    for read in (lambda moe: moe.router_logits, lambda moe: moe.save_all()):
        with pytest.raises(moelens.OrderError, match=r"router_logits was never produced: model\.model\.layers\.1\.mlp "
                                                     r"is no longer the module this model was wrapped with"):
            with torch.no_grad(), wrapped.trace(**inputs):
                read(wrapped.moes[1])
    seen = []
    handle = reference.model.layers[1].mlp.experts.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad():
            reference(**inputs)
    finally:
        handle.remove()
    with torch.no_grad(), wrapped.trace(**inputs):
        routed = wrapped.moes[1].routed_output.save()
    torch.testing.assert_close(routed, seen[0].view(routed.shape), rtol=0, atol=0)


def _save_all_in_a_trace(wrapped, inputs) -> None:
    with wrapped.trace(**inputs):
        wrapped.save_all()


def test_a_block_replaced_through_its_envoy_by_another_module_gets_a_dense_envoy_and_the_list_says_so(tmp_path):
    """``model.layers[1].mlp = nn.Identity()`` raised moelens' internal AttributeError ('NoneType' object has no
    attribute 'shared') after the torch model was changed, and left the envoy showing the old block. As plain nnsight
    on the same model does (ground truth), the envoy now wraps the new module, as a dense block whose output is
    served; its MoE values are refused saying it replaced the block; model.moes' repr says what changed, also for a
    router replaced or a layer removed in the torch model."""
    hf, plain = tiny_model("mixtral"), tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    wrapped.layers[1].mlp = torch.nn.Identity()
    reference = nnsight.NNsight(plain)
    reference.model.layers[1].mlp = torch.nn.Identity()
    assert type(hf.model.layers[1].mlp) is torch.nn.Identity and type(wrapped.layers[1].mlp._module) is torch.nn.Identity
    with torch.no_grad(), reference.trace(**inputs):
        expected = reference.model.layers[1].mlp.output.save()
    with torch.no_grad(), wrapped.trace(**inputs):
        served = wrapped.layers[1].mlp.mlp_output.save()
    torch.testing.assert_close(served, expected, rtol=0, atol=0)
    with pytest.raises(ValueUnavailable, match=r"layers\.1\.mlp\.router_logits cannot be served: this block "
                                               r"\(Identity\) is a dense MLP .* given to the envoy of the MoE block "
                                               r"wrapped here, replacing the block: read its mlp_output, or wrap"):
        with wrapped.trace(**inputs):
            wrapped.moes[1].router_logits.save()
    assert "[1] model.model.layers.1.mlp: replaced through its envoy by Identity, no MoE block" in repr(wrapped.moes)
    # what reads every block refuses it by name (export crashed with 'NoneType' object has no attribute 'experts')
    from moelens import analysis
    from moelens.export.errors import ExportError

    for run, refusal in ((lambda: analysis.collect_routing(wrapped, [inputs["input_ids"][0]], progress=False),
                          moelens.MoelensError),
                         (lambda: families.check(wrapped, inputs["input_ids"]), FamilyError),
                         (lambda: moelens.export.to_nnef(wrapped, tmp_path / "out.nnef.tgz"), ExportError),
                         (lambda: _save_all_in_a_trace(wrapped, inputs), moelens.MoelensError)):
        with pytest.raises(refusal, match=r"model\.model\.layers\.1\.mlp is no longer the module this model was "
                                          r"wrapped with .* Wrap the model again"):
            run()
    assert not list(tmp_path.iterdir())
    swapped = moelens.wrap(tiny_model("mixtral"))  # a block of the family given to the envoy: never instrumented
    swapped.layers[1].mlp = tiny_model("mixtral", seed=1).model.layers[1].mlp
    assert "[1] model.model.layers.1.mlp: mixtral; model.model.layers.1.mlp replaced after wrapping" in \
        repr(swapped.moes)
    assert repr(swapped.moes[1]).startswith("Moe[mixtral; model.model.layers.1.mlp replaced after wrapping")
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    hf.model.layers[2].mlp.gate = torch.nn.Linear(32, 8)
    del hf.model.layers[3]
    listed = repr(wrapped.moes)
    assert "[2] model.model.layers.2.mlp: mixtral; model.model.layers.2.mlp.gate replaced after wrapping" in listed
    assert "[3] model.model.layers.3.mlp: mixtral; removed after wrapping" in listed
    assert "[0] model.model.layers.0.mlp: mixtral, E=8, k=2, grouped_mm" in listed
    assert repr(wrapped.moes[2]).startswith("Moe[mixtral; model.model.layers.2.mlp.gate replaced after wrapping")


def test_read_only_attributes_of_blocks_and_standard_names_are_refused():
    """``moe.layer = 2``, ``moe.family = None`` and ``model.layers = [1, 2]`` were taken as they came: collect_routing
    then refused the layers with advice that could not help, and a later read blamed a missing value. Ground truth: the
    block's layer and family as wrap found them, the standard name still the model's own list."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    for name, value in [("layer", 2), ("family", None), ("runs_before_expansion", True), ("top_k", 1)]:
        with pytest.raises(moelens.MoelensError, match=rf"layers\.0\.mlp\.{name} is read only: moelens reads it from "
                                                       r"the model\. .*moe\.router\._module\.top_k = 1"):
            setattr(moe, name, value)
    assert (moe.layer, moe.family.name, moe.runs_before_expansion, moe.top_k) == (0, "mixtral", False, 2)
    with pytest.raises(moelens.MoelensError, match=r"experts_implementation is read only: .* switch the model's with "
                                                   r"model\.set_experts_implementation\(\"grouped_mm\"\)"):
        moe.experts_implementation = "eager"
    with pytest.raises(AttributeError, match=r"property 'source' of 'Moe' object has no setter"):
        moe.source = None  # nnsight's own property: Python's error, as before
    with pytest.raises(moelens.MoelensError, match=r"model\.layers is moelens' name for 'model\.layers' and is read "
                                                   r"only: .* change nothing in the model"):
        wrapped.layers = [1, 2]
    assert wrapped.layers._module is hf.model.layers


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "granitemoeshared"])
def test_a_setting_meant_for_a_module_on_its_envoy_is_refused(family):
    """``moe.router.top_k = 1`` was kept on nnsight's envoy, which read 1 back while the model routed 2 slots a token,
    without a word; so were ``moe.topk = 1`` and ``moe.experts.act_fn2 = ...`` (typos). Ground truth: the same
    setting made on the module changes the routing, as plain nnsight sees it."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    router = moe.router._module
    shared = [moe.shared_experts] if family != "mixtral" else []
    at = re.escape(moe.router.path)
    for envoy, name, value, refusal in [
        (moe.router, "top_k", 1, rf"{at}\.top_k = \.\.\. would set an attribute of moelens' envoy, not of the model's "
                                 rf"\w+Router, which goes on with its own top_k: set it on the module "
                                 rf"\({at}\._module\.top_k = \.\.\.\)"),
        (moe.router, "weight", torch.zeros(1), rf"{at}\.weight = \.\.\. would set an attribute"),
        (moe.router, "topk", 1, rf"{at} has no attribute 'topk' \(did you mean 'top_k'\?\)"),
        (moe.experts, "act_fn2", None, r"experts has no attribute 'act_fn2' \(did you mean 'act_fn'\?\)"),
        (moe, "topk", 1, r"has no attribute 'topk' \(did you mean 'top_k'\?\)"),
        (moe, "training", True, rf"{re.escape(moe.path)}\.training = \.\.\. would set an attribute of moelens' envoy"),
        *[(expert, "training", True, r"training = \.\.\. would set an attribute of moelens' envoy") for expert in shared],
    ]:
        with pytest.raises(moelens.MoelensError, match=refusal):
            setattr(envoy, name, value)
        assert name not in envoy.__dict__
    weight = router.weight.detach().clone()
    with torch.no_grad():
        moe.router.weight *= 0.5  # in place, then set to the module's own tensor: taken, as by plain nnsight
    assert torch.equal(router.weight, weight * 0.5) and "weight" not in moe.router.__dict__
    with torch.no_grad():
        router.weight.copy_(weight)
    moe.router.my_note = "kept"  # a name of no module nor close to one: the user's own, on the envoy
    assert moe.router.my_note == "kept" and not hasattr(router, "my_note")
    assert moe.router.top_k == router.top_k == moe.top_k == 2 and not hf.training
    inputs = tiny_inputs(hf)
    with wrapped.trace(**inputs):
        two = moe.expert_indices.save()
    router.top_k = 1  # where the model reads it
    with wrapped.trace(**inputs):
        one = moe.expert_indices.save()
    plain = nnsight.NNsight(hf)
    with plain.trace(**inputs):
        raw = plain.get(moe.router.path.partition(".")[2]).output.save()
    assert two.shape[-1] == 2 and one.shape[-1] == 1 and torch.equal(one.flatten(), raw[2].flatten())


def test_a_router_replaced_through_the_envoy_is_named_and_params_of_a_replaced_block_refused():
    """nnsight's own way to swap a module, ``model...mlp.gate = new``, left moelens reading the router it had
    instrumented: router_logits raised an OrderError blaming the read order. A block replaced in the torch model kept
    serving params() of the detached block: editing those views changed nothing, without a word."""
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    wrapped.model.layers[1].mlp.gate = copy.deepcopy(hf.model.layers[1].mlp.gate)
    with pytest.raises(moelens.OrderError, match=r"router_logits was never produced: model\.model\.layers\.1\.mlp\.gate "
                                                 r"is no longer the module this model was wrapped with .* through its "
                                                 r"envoy"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.moes[1].router_logits.save()
    with pytest.raises(moelens.MoelensError, match=r"model\.model\.layers\.0\.mlp\.router is moelens' name for "
                                                   r"'gate'; .* Replace 'gate' itself, where the model keeps it"):
        wrapped.moes[0].router = copy.deepcopy(hf.model.layers[0].mlp.gate)  # was added beside gate, never called
    assert "router" not in hf.model.layers[0].mlp._modules
    with pytest.raises(moelens.MoelensError, match=r"model\.layers is moelens' name for 'model\.layers'"):
        wrapped.layers = copy.deepcopy(hf.model.layers)  # at the root, a plain nnsight setattr added it, never called
    assert "layers" not in hf._modules
    granite = tiny_model("granitemoe")  # its layers call the block block_sparse_moe: mlp is a decoder layer's alias
    with pytest.raises(moelens.MoelensError, match=r"layers\.0\.mlp is moelens' name for 'block_sparse_moe'"):
        moelens.wrap(granite).layers[0].mlp = copy.deepcopy(granite.model.layers[0].block_sparse_moe)
    assert "mlp" not in granite.model.layers[0]._modules
    granite = tiny_model("granitemoeshared")  # its shared expert sits on the decoder layer, served by a descriptor
    with pytest.raises(moelens.MoelensError, match=r"shared_experts is moelens' name for 'shared_mlp'"):
        moelens.wrap(granite).moes[0].shared_experts = copy.deepcopy(granite.model.layers[0].shared_mlp)
    renamed = moelens.wrap(tiny_model("mixtral"), rename={"experts": "ffn"})  # a name of the user's own is theirs
    renamed.moes[0].ffn = copy.deepcopy(renamed.moes[0].experts._module)
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    assert wrapped.moes[1].params().down.shape[0] == 8
    hf.model.layers[1].mlp = copy.deepcopy(hf.model.layers[1].mlp)
    with pytest.raises(moelens.ValueUnavailable, match=r"model\.model\.layers\.1\.mlp\.params: model\.model\.layers"
                                                       r"\.1\.mlp is no longer the module .* editing them would not "
                                                       r"change the model"):
        wrapped.moes[1].params()
    assert wrapped.moes[0].params().down.shape[0] == 8  # the blocks left as they were


@pytest.mark.parametrize("removal", ["del gate", "gate = None", "experts = None"])
def test_a_router_or_experts_removed_after_wrapping_is_named(removal):
    """A router or experts module deleted or set to None after wrapping: params() raised the torch AttributeError of
    the family's path ('has no attribute gate') or a FamilyError advising to fix the entry, and a trace reading the
    routing the same FamilyError (the model itself fails on calling None later). Both name the removed module now."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    block = hf.model.layers[1].mlp
    name, _, assigned = removal.removeprefix("del ").partition(" = ")
    if assigned:
        setattr(block, name, None)
    else:
        delattr(block, name)
    removed = rf"model\.model\.layers\.1\.mlp\.{name} \(removed\) is no longer the module"
    with pytest.raises(moelens.ValueUnavailable, match=rf"layers\.1\.mlp\.params: {removed}"):
        wrapped.moes[1].params()
    if name == "experts":  # the logits are read, then their width asks the experts for E
        with pytest.raises(moelens.ValueUnavailable, match=rf"layers\.1\.mlp\.num_experts: {removed}"):
            with wrapped.trace(torch.tensor([[1, 2, 3]])):
                wrapped.moes[1].router_logits.save()
    assert wrapped.moes[0].params().down.shape[0] == 8


@pytest.mark.parametrize("change", ["removed", "inserted", "appended"])
def test_layers_added_or_removed_after_wrapping_are_refused_at_the_next_trace(change):
    """model.moes and model.layers are built at wrap: with a layer inserted, moes[1] served the logits of the block
    now at layers[2] under layer 1's name; an appended layer's block was left out of save_all; a removed one gave
    AttributeErrors naming '_static_bindings'. Wrapped again, the model serves the blocks it runs (ground truth: a
    torch hook on the block at layers[1])."""
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    layers = hf.model.layers
    if change == "removed":
        del layers[3]
    elif change == "inserted":
        hf.model.layers = torch.nn.ModuleList([layers[0], copy.deepcopy(layers[1]), *layers[1:]])
    else:
        layers.append(copy.deepcopy(layers[3]))
    count = {"removed": 3, "inserted": 5, "appended": 5}[change]
    with pytest.raises(moelens.MoelensError, match=rf"the model's model\.layers holds {count} layers, and moelens "
                                                   r"wrapped it with 4 \(layers added or removed since moelens\.wrap\)"
                                                   r".*Wrap the model again"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.moes[1].router_logits.save()
    again = moelens.wrap(hf)
    assert len(again.moes) == count
    seen = []
    handle = hf.model.layers[1].mlp.gate.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad(), again.trace(**inputs):
            logits = again.moes[1].router_logits.save()
    finally:
        handle.remove()
    torch.testing.assert_close(logits.reshape(-1, 8), seen[0][0].reshape(-1, 8), rtol=0, atol=0)  # (logits, ...)
    with pytest.warns(UserWarning, match="no MoE block"):  # a dense model's layers are watched too
        dense = moelens.wrap(dense_hf := tiny_model("qwen3_moe", mlp_only_layers=[0, 1, 2, 3]))
    dense_hf.model.layers.append(copy.deepcopy(dense_hf.model.layers[0]))
    with pytest.raises(moelens.MoelensError, match=r"the model's model\.layers holds 5 layers, and moelens wrapped it"):
        with torch.no_grad(), dense.trace(**tiny_inputs(dense_hf)):
            dense.layers[1].mlp.output.save()


@pytest.mark.parametrize("change", ["swapped", "duplicated"])
def test_layers_reordered_after_wrapping_are_refused_at_the_next_trace(change):
    """Layers swapped after wrapping (same count): model.layers[0].mlp.router_logits was served, without an error, from
    the block now running at position 1 (nnsight serves a module's values by identity)."""
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    layers = list(hf.model.layers)
    order = [layers[1], layers[0], *layers[2:]] if change == "swapped" else [layers[0], layers[0], *layers[2:]]
    hf.model.layers = torch.nn.ModuleList(order)
    with pytest.raises(moelens.MoelensError, match=r"holds its layers in another order than moelens wrapped them in"
                                                   r".*Wrap the model again"):
        with torch.no_grad(), wrapped.trace(**inputs):
            wrapped.layers[0].mlp.router_logits.save()


@pytest.mark.parametrize("call", ["eval()", "train()", "train(False)", "half()", "float()", "bfloat16()", "double()",
                                  "requires_grad_(False)", "to(dtype=torch.bfloat16)", "to('cpu', torch.float16)",
                                  "to(torch.bfloat16, non_blocking=True)"])
def test_torch_s_in_place_module_methods_return_the_wrapped_model(call):
    """model.half(), .eval(), ... returned the transformers model (torch's return their module), so
    model = moelens.load(...).eval() dropped moelens, and model.moes then raised AttributeError. They return the wrapped
    model, as to() does (in each of torch's forms: nnsight's took one device alone, TypeError), with the module
    changed as torch's own method changes it. Ground truth: the same method on an unwrapped copy."""
    hf = tiny_model("mixtral")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    assert eval(f"wrapped.{call}") is wrapped
    assert eval(f"reference.{call}") is reference
    assert [(p.dtype, p.requires_grad) for p in hf.parameters()] == \
        [(p.dtype, p.requires_grad) for p in reference.parameters()]
    assert [m.training for m in hf.modules()] == [m.training for m in reference.modules()]
    if hf.training or hf.dtype == torch.float64:  # router jitter draws at random; float64 traces are refused
        return
    inputs = tiny_inputs(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        expected = reference(**inputs).logits
    assert torch.equal(logits, expected)


def test_model_save_all_gives_every_block_the_names_of_a_generator(mixtral):
    """model.save_all(values=<a generator>) handed the one generator to each block: the first block used it up, and
    every later block saved nothing, with no error."""
    wrapped, inputs = mixtral
    with wrapped.trace(**inputs):
        saved = wrapped.save_all(name for name in ("router_logits", "expert_indices"))
    assert len(saved) == len(wrapped.moes) > 1
    assert all(set(values) == {"router_logits", "expert_indices"} for values in saved.values())


@pytest.mark.parametrize(("family", "name", "message"), [
    ("deepseek_v3", "selection_scores", r"save_all: \['selection_scores'\] is not among the values save_all reads .*: "
                                        r"read moe\.selection_scores on its own\."),
    # it said to read moe.mlp_activation (moe.selection_scores) on its own, which this block refuses
    ("mixtral", "mlp_activation", r"mlp_activation cannot be served: an MoE block has no single hidden activation.*"
                                  r"expert_activations"),
    ("mixtral", "selection_scores", r"selection_scores cannot be served: the mixtral router ranks no separate "
                                    r"selection score"),
])
def test_save_all_names_a_value_it_does_not_read_as_one_to_read_on_its_own(family, name, message):
    """A documented value save_all leaves to a read of its own was called an "unknown value name"; one the block never
    serves gets its reason."""
    _, wrapped, inputs, _, _ = built(family, "grouped_mm")
    with pytest.raises(moelens.MoelensError, match=message):
        with wrapped.trace(**inputs):
            wrapped.moes[0].save_all([name, "router_logits"])
    with pytest.raises(moelens.ArgumentError, match=r"save_all: unknown value names \['logits'\]; choose from"):
        with wrapped.trace(**inputs):  # a mistake, not a value to skip: no ValueUnavailable
            wrapped.moes[0].save_all([name, "logits"])


def test_a_model_whose_config_names_no_experts_implementation_runs_eager():
    """Built as MyModel(config), a model's config names no experts implementation and transformers runs the experts'
    own (eager) forward: moelens said the block "runs None"."""
    hf = custom_model()
    hf.config._experts_implementation = None
    moelens.families.register(custom_family())
    try:
        wrapped = moelens.wrap(hf)
        moe = wrapped.moes[0]
        assert moe.experts_implementation == "eager"
        with pytest.raises(moelens.MoelensError, match=r"this block runs 'eager'"):
            with wrapped.trace(torch.tensor([[1, 2, 3]])):
                moe.expert_outputs.save()
    finally:
        moelens.families.unregister("custom")



def test_a_pad_token_past_the_embeddings_is_named_as_the_padding():
    """A pad token added to the tokenizer after training (id 4096 of a 4096-row model): a batch of two texts was
    refused as if the texts' ids came from another tokenizer, while every real token was in range (ground truth:
    the tokenizer's ids of each text alone)."""
    tokenizer = copy.deepcopy(moelens.load().tokenizer)
    tokenizer.pad_token = None
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    model = moelens.load()
    rows = model._module.get_input_embeddings().num_embeddings
    texts = ["def add(a, b):", "x"]
    assert tokenizer.pad_token_id >= rows and all(max(tokenizer(text)["input_ids"]) < rows for text in texts)
    with pytest.warns(UserWarning):
        wrapped = moelens.wrap(model._module, tokenizer=tokenizer)
    with pytest.raises(moelens.MoelensError, match=rf"^the padding's token id {tokenizer.pad_token_id} is outside the "
                                                   r"model's input embeddings .*every real token is in range.*"
                                                   r"model\.tokenizer\.pad_token = model\.tokenizer\.eos_token"):
        with torch.no_grad(), wrapped.trace(texts):
            wrapped.output.save()
    plain = moelens.wrap(tiny_model("mixtral"))  # no tokenizer, the user's own mask: the ids are theirs to fix
    rows = plain._module.get_input_embeddings().num_embeddings
    with pytest.raises(moelens.MoelensError, match=rf"^token id {rows + 3} is outside the model's input embeddings"):
        with torch.no_grad(), plain.trace(torch.tensor([[5, rows + 3, 7]]), attention_mask=torch.tensor([[1, 0, 1]])):
            plain.output.save()

def test_a_tokenizer_with_more_tokens_than_the_model_embeds_is_warned_of_at_wrap():
    """The embedded model's tokenizer (4096 tokens) on a tiny mixtral (128 embedding rows) was taken silently, and a
    text trace then failed with torch's bare "index out of range in self". The warning's claim is checked too: that
    text is refused (the model cannot embed it); the model's own tokenizer, and one that fits, warn of nothing."""
    tokenizer = moelens.load().tokenizer
    hf = tiny_model("mixtral")
    rows = hf.get_input_embeddings().num_embeddings
    with pytest.warns(UserWarning, match=rf"has {len(tokenizer)} tokens, but the model's input embeddings hold {rows} "
                                         r"rows.*Pass the tokenizer saved with this model"):
        wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    text = "def add(a, b):"
    assert max(tokenizer(text)["input_ids"]) >= rows
    with pytest.raises(moelens.MoelensError, match=rf"token id \d+ is outside the model's input embeddings \({rows} rows"):
        with wrapped.trace(text):
            wrapped.output.save()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
        moelens.load()


def test_wrap_with_a_tokenizer_keeps_a_device_map_attribute_set_to_none():
    """nnsight's pipeline needs a device map while wrap builds it; moelens gives a model without one a map meanwhile
    and took it off after, also where the user's model held ``hf_device_map = None`` (set by other code): the
    attribute was gone after wrap."""
    hf = tiny_model("mixtral")
    hf.hf_device_map = None
    moelens.wrap(hf, tokenizer=ascii_tokenizer())
    assert "hf_device_map" in hf.__dict__ and hf.hf_device_map is None


def test_wrap_with_a_tokenizer_leaves_the_model_on_its_device_where_an_accelerator_is_found(monkeypatch):
    """nnsight builds a transformers pipeline for a model with a tokenizer, and a pipeline given no device moves a
    model with no device map to the first accelerator it finds: on a machine with a GPU, moelens.wrap(cpu_model,
    tokenizer=...) and moelens.load() moved the user's CPU model onto cuda:0 (seen on an H200). Here transformers is
    told a GPU exists (torch has none, so a move would fail); the model stays where it was, and no map is left on it."""
    import transformers.pipelines.base

    monkeypatch.setattr(transformers.pipelines.base, "is_torch_cuda_available", lambda: True)
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    assert {parameter.device.type for parameter in hf.parameters()} == {"cpu"}
    assert getattr(hf, "hf_device_map", None) is None
    with torch.no_grad(), wrapped.trace("ab"):
        logits = wrapped.output.logits.save()
    assert logits.device.type == "cpu"


def test_ids_outside_the_embeddings_of_a_model_on_an_accelerator_are_refused_before_it_runs(monkeypatch):
    """On CUDA an embedding lookup of an id out of range is a device-side assert, not torch's IndexError: the run
    failed with it, and every later CUDA call of the process failed too (seen on an H200). Where the embeddings sit
    on an accelerator the ids are checked before the model runs (here the check is made to think so: the model never
    runs on the bad ids); ids in range run as before."""
    import moelens.model

    hf = tiny_model("mixtral")
    rows = hf.get_input_embeddings().num_embeddings
    wrapped = moelens.wrap(hf)
    monkeypatch.setattr(moelens.model, "_embeddings_on_accelerator", lambda module: True)
    looked_up = []
    hook = hf.get_input_embeddings().register_forward_pre_hook(lambda module, args: looked_up.append(args[0]))
    try:
        with pytest.raises(moelens.MoelensError, match=rf"token id {rows + 2} is outside the model's input embeddings "
                                                      rf"\({rows} rows: ids 0 to {rows - 1}; 1 of the 8 ids"):
            with wrapped.trace(torch.tensor([[5, 6, 7, rows + 2], [1, 2, 3, 4]])):
                wrapped.output.save()
        assert not looked_up
        with torch.no_grad(), wrapped.trace(torch.tensor([[5, 6, 7, rows - 1]])):
            logits = wrapped.output.logits.save()
    finally:
        hook.remove()
    with torch.no_grad():
        assert torch.equal(logits, hf(torch.tensor([[5, 6, 7, rows - 1]])).logits)
    assert len(looked_up) == 1


@pytest.mark.parametrize("value", ["expert_outputs", "expert_activations"])
def test_a_per_slot_value_read_after_its_block_ran_in_a_generation_is_an_order_error(value):
    """In model.generate, expert_outputs read after routed_output of the same block (at the first step, or in the
    first pass of tracer.iter) was served the next step's call, silently: nnsight only counts the experts
    implementation's ops from the drill on. Ground truth: the experts module's own output at each call (a torch
    hook on the model)."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = model.moes[0]
    settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with pytest.raises(OrderError, match=rf"{value} was requested after the model had already run past it"):
        with model.generate("hello", **settings):
            moe.routed_output.save()
            getattr(moe, value).save()
    with pytest.raises(OrderError, match=rf"{value} was requested after the model had already run past it"):
        with model.generate("hello", **settings) as tracer:
            for _ in tracer.iter[0:2]:
                moe.routed_output.save()
                getattr(moe, value).save()
    calls = []
    experts = hf.get_submodule(moe.path.removeprefix("model.")).experts
    hook = experts.register_forward_hook(lambda module, args, output: calls.append(output.detach().clone()))
    try:
        with model.generate("hello", **settings) as tracer:
            slots, routed = nnsight.save([]), nnsight.save([])
            for _ in tracer.iter[0:2]:
                slots.append(moe.expert_outputs)
                routed.append(moe.routed_output)
    finally:
        hook.remove()
    for step in range(2):
        torch.testing.assert_close(slots[step].sum(2).reshape(calls[step].shape), calls[step], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(routed[step].reshape(calls[step].shape), calls[step], atol=0, rtol=0)


# -- inputs the model cannot run on: refused by name before torch fails deep inside ---------------------------------


def _router_logits(model, *inputs, **kwargs):
    with model.trace(*inputs, **kwargs):
        logits = model.moes[0].router_logits.save()
    return logits


def test_a_trace_whose_invokes_are_all_empty_says_it_has_no_input():
    """nnsight's batching failed on it with a bare "IndexError: list index out of range"."""
    model = moelens.load()
    with pytest.raises(moelens.MoelensError, match=r"the trace has no input: its invokes are all empty"):
        with model.trace() as tracer:
            with tracer.invoke():
                model.moes[0].router_logits.save()


def test_a_value_read_in_a_trace_given_no_input_says_to_read_it_in_an_invoke():
    """The trace body of model.trace() (no input) runs to collect invokes, not with the model: the error said "use
    them inside a trace" to a user inside one."""
    model = moelens.load()
    with pytest.raises(ValueUnavailable, match=r"A trace given no input runs the model only for its invokes: read the "
                                               r"values inside a tracer\.invoke\(inputs\) block"):
        with model.trace():
            model.moes[0].router_logits.save()


def test_an_attention_mask_that_does_not_fit_the_ids_is_refused():
    """A mask of another length than the ids (or than the cache and the ids) was taken as it was, by transformers
    too: the logits moved by up to 8.6 without a word. Ground truth: the plain model, with the mask that fits."""
    model = moelens.load()
    bare = moelens.wrap(copy.deepcopy(model._module))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = model._module(ids, attention_mask=torch.ones(1, 3, dtype=torch.long), use_cache=True)
    for wrapped in (model, bare):
        for mask in (torch.ones(1, 2, dtype=torch.long), torch.tensor([[0, 1, 1, 1]])):
            shape = re.escape(str(tuple(mask.shape)))
            with pytest.raises(moelens.MoelensError, match=rf"the attention_mask of shape {shape} does not fit the "
                                                           r"input_ids of shape \(1, 3\): give one entry per token .* "
                                                           r"shape \(1, 3\)"):
                with torch.no_grad(), wrapped.trace(ids, attention_mask=mask):
                    wrapped.output.logits.save()
        with torch.no_grad(), wrapped.trace(ids, attention_mask=torch.ones(1, 3, dtype=torch.long)):
            logits = wrapped.output.logits.save()
        assert torch.equal(logits, plain.logits)
        new = torch.tensor([[8, 9]])  # a step after a cache of 3 tokens: the mask covers them and the new ones
        with torch.no_grad():
            expected = model._module(new, attention_mask=torch.ones(1, 5, dtype=torch.long),
                                     past_key_values=copy.deepcopy(plain.past_key_values)).logits
        for width in (1, 2, 4):  # 2: the mask of the new tokens alone, the usual slip (the logits moved by 4.9)
            with pytest.raises(moelens.MoelensError, match=rf"shape \(1, {width}\) does not fit the input_ids of shape "
                                                           r"\(1, 2\): .* and 3 more for the tokens the cache holds "
                                                           r"before them, 1 row of at least 5\."):
                with torch.no_grad(), wrapped.trace(new, attention_mask=torch.ones(1, width, dtype=torch.long),
                                                    past_key_values=copy.deepcopy(plain.past_key_values)):
                    wrapped.output.logits.save()
        with torch.no_grad(), wrapped.trace(new, attention_mask=torch.ones(1, 5, dtype=torch.long),
                                            past_key_values=copy.deepcopy(plain.past_key_values)):
            logits = wrapped.output.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    # generate over a prefilled cache: its ids hold the cached tokens, and the mask fits them (transformers' reuse)
    prompt = model.tokenizer("def add(a, b):", return_tensors="pt")
    with torch.no_grad():
        prefix = model._module(prompt["input_ids"][:, :4], use_cache=True).past_key_values
        expected = model._module.generate(**prompt, past_key_values=copy.deepcopy(prefix), max_new_tokens=2,
                                          do_sample=False)
    with torch.no_grad(), model.generate(**prompt, past_key_values=copy.deepcopy(prefix), max_new_tokens=2,
                                         do_sample=False) as tracer:
        generated = tracer.result.save()
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("prompts, row", [("", ""), (["", "hello there"], r" \(row 0 of the batch\)")])
def test_a_prompt_with_no_tokens_is_refused(prompts, row):
    """An empty string gives the model a zero-length sequence: "cannot reshape tensor of 0 elements" in attention;
    beside a longer prompt it became a row of padding alone."""
    model = moelens.load()
    with pytest.raises(moelens.MoelensError, match=rf"a prompt of the trace has no tokens{row}: "):
        _router_logits(model, prompts)
    bare = moelens.wrap(model._module)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(moelens.MoelensError, match=r"a prompt of the trace has no tokens: "):
        _router_logits(bare, empty)
    with pytest.raises(moelens.MoelensError, match=r"a prompt of the trace has no tokens: "):
        with bare.trace() as tracer:
            with tracer.invoke(empty):
                pass
            with tracer.invoke(torch.tensor([[3, 4]])):
                bare.moes[0].router_logits.save()
    embeds = torch.zeros(1, 0, model._module.config.hidden_size)
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):  # the plain model's failure
        model._module(inputs_embeds=embeds)
    with pytest.raises(moelens.MoelensError, match=r"a prompt of the trace has no tokens: an empty inputs_embeds "):
        with bare.trace(inputs_embeds=embeds):
            bare.moes[0].router_logits.save()


def test_an_input_holding_no_prompts_is_refused():
    """model.trace([]) or ids of 0 rows: nnsight counts no rows and takes the trace for one without input, running the
    body without the model, whose first read failed with "Cannot access model.output outside of interleaving" (the
    truth: plain transformers cannot run a batch of no prompts either)."""
    model = moelens.load()
    bare = moelens.wrap(model._module)
    for wrapped, given, shown in ((model, [], "an empty list"), (model, torch.zeros(0, 5, dtype=torch.long),
                                                                  r"ids of shape \(0, 5\)"),
                                  (bare, torch.zeros(0, 5, dtype=torch.long), r"ids of shape \(0, 5\)")):
        with pytest.raises(moelens.MoelensError, match=rf"^the input holds no prompts \({shown}\), so the model would "
                                                       r"not run"):
            with wrapped.trace(given):
                wrapped.output.logits.save()
    with pytest.raises(moelens.MoelensError, match=r"^the input holds no prompts \(an empty list\)"):
        with model.trace() as tracer:
            with tracer.invoke([]):
                pass
    hidden = model._module.config.hidden_size  # embeddings of no prompts (review 2): plain transformers fails too
    with pytest.raises(moelens.MoelensError, match=rf"^the input holds no prompts \(inputs_embeds of shape \(0, 5, "
                                                   rf"{hidden}\)\)"):
        with model.trace(inputs_embeds=torch.zeros(0, 5, hidden)):
            model.output.logits.save()


def test_ids_of_more_than_two_axes_without_a_tokenizer_are_refused_by_shape():
    """A [1, 1, 3] ids tensor (ids[None] of a batch) failed deep in transformers with "too many values to unpack",
    after embedding and attention; a model wrapped with a tokenizer refuses it by shape, and so does one without."""
    bare = moelens.wrap(moelens.load()._module)
    with pytest.raises(moelens.MoelensError, match=r"^a model wrapped without a tokenizer takes token ids \[batch, seq\], "
                                                   r"and got ids of shape \(1, 1, 3\)"):
        with bare.trace(torch.tensor([[[5, 6, 7]]])):
            bare.output.save()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8, torch.bool])
def test_token_ids_the_embedding_cannot_take_are_refused(dtype):
    """int16 ids (moelens-tiny's own held-out windows are stored so), int8, uint8 and bool ids reached torch's
    embedding ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int")."""
    model = moelens.load()
    ids = torch.tensor([[5, 6]]).to(dtype)
    with pytest.raises(moelens.MoelensError, match=rf"input_ids are a {re.escape(str(dtype))} tensor of shape \(1, 2\): "
                                                   r"a model's embedding takes torch.long or torch.int32 ids; .*\.long\(\)"):
        _router_logits(model, ids)
    assert _router_logits(model, ids.long()).shape[:2] == (1, 2)
    assert _router_logits(model, ids.int()).shape[:2] == (1, 2)  # int32 is embedded as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_unembeddable_ids_in_one_of_several_invokes_are_named(dtype):
    """Float ids in the second of two invokes reached nnsight's batching: "NotImplementedError: Can't batch these
    inputs; pass text or token ids", naming neither the invoke nor the dtype."""
    model = moelens.load()
    with pytest.raises(moelens.MoelensError, match=rf"the input_ids of the trace's invoke 1 are a {re.escape(str(dtype))} "
                                                   r"tensor of shape \(1, 2\): .*\.long\(\)"):
        with model.trace() as tracer:
            with tracer.invoke(torch.tensor([[4, 5]])):
                pass
            with tracer.invoke(torch.tensor([[1, 2]]).to(dtype)):
                pass


@pytest.mark.parametrize("as_keyword", [False, True])
def test_float_token_ids_are_refused_with_a_tokenizer_too(as_keyword):
    """Without a tokenizer they were refused by name; with one they reached torch's embedding ("Expected tensor for
    argument #1 'indices' to have one of the following scalar types")."""
    model = moelens.load()
    ids = torch.tensor([[5.0, 6.0]])
    with pytest.raises(moelens.MoelensError, match=r"input_ids are a torch\.float32 tensor of shape \(1, 2\): token "
                                                   r"ids are integers; .*\.long\(\)"):
        _router_logits(model, input_ids=ids) if as_keyword else _router_logits(model, ids)


@pytest.mark.parametrize("bad", [99999, -1])
def test_a_token_id_outside_the_embeddings_is_named(bad):
    """torch's embedding said only "IndexError: index out of range in self"; the run is refused naming the id and the
    rows, with or without a tokenizer, in generation too, and the model runs as before afterwards."""
    model = moelens.load()
    rows = model._module.get_input_embeddings().num_embeddings
    message = rf"token id {bad} is outside the model's input embeddings \({rows} rows: ids 0 to {rows - 1}; 1 of the 2"
    with pytest.raises(moelens.MoelensError, match=message):
        _router_logits(model, torch.tensor([[5, bad]]))
    with pytest.raises(moelens.MoelensError, match=message):
        with model.generate(torch.tensor([[5, bad]]), max_new_tokens=2):
            pass
    bare = moelens.wrap(model._module)
    with pytest.raises(moelens.MoelensError, match=message):
        _router_logits(bare, torch.tensor([[5, bad]]))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = model._module(ids).logits
        with bare.trace(ids):
            traced = bare.output.logits.save()
    assert torch.equal(traced, plain)


def test_a_meta_tensor_written_is_refused():
    """A tensor on the meta device reached the NaN check: "Tensor.item() cannot be called on meta tensors"."""
    model = moelens.load()
    with pytest.raises(WriteError, match=r"router_logits: wrote a tensor on the meta device, which holds no values"):
        with model.trace("hello world"):
            shape = model.moes[0].router_logits.shape
            model.moes[0].router_logits = torch.zeros(shape, device="meta")


def assert_scan_refused(model, match: str, value: str = "router_logits") -> None:
    """model.scan("hello") reading the first block's ``value`` raises a MoelensError matching ``match``."""
    with pytest.raises(moelens.MoelensError, match=match):
        with model.scan("hello"):
            getattr(model.moes[0], value).save()


def test_scan_under_grouped_mm_on_a_float32_cpu_model_says_to_switch():
    """torch's fake grouped_mm takes only bfloat16 on CPU: scan failed inside torch with "Expected inputs of BF16
    type"; a bfloat16 model scans under grouped_mm."""
    model = moelens.load()
    model.set_experts_implementation("grouped_mm")
    assert_scan_refused(model, r"model\.scan: .*mlp's experts run grouped_mm, for which torch has no fake kernel in "
                               r"torch\.float32 on the CPU.*'batched_mm'", "expert_outputs")
    half = moelens.wrap(copy.deepcopy(model._module).to(torch.bfloat16), tokenizer=model.tokenizer)
    with half.scan("hello"):
        shape = nnsight.save(half.moes[0].expert_outputs.shape)
    tokens = len(model.tokenizer("hello")["input_ids"])
    assert tuple(shape)[:3] == (1, tokens, half.moes[0].top_k)


def test_scan_through_a_value_dependent_experts_loop_says_what_to_do():
    """Scan's fake tensors cannot follow an experts loop that runs each expert on the tokens that picked it: torch's
    GuardOnDataDependentSymNode ("Could not guard on data-dependent expression"). Under transformers' eager loop the
    error names the block and the switch; a family whose own loop it is (dbrx) says to run a real trace. The model
    traces after. A guard the scan body fails itself keeps torch's error, which names the body's line."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    model = moelens.load()
    model.set_experts_implementation("eager")
    assert_scan_refused(model, r"^model\.scan: model\.model\.layers\.0\.mlp's experts run a loop that depends on the "
                               r"values .*set_experts_implementation\('batched_mm'\)")
    with torch.no_grad(), model.trace("hello"):
        logits = model.moes[0].router_logits.save()
    assert logits.shape[-1] == model.moes[0].num_experts and torch.isfinite(logits).all()
    dbrx = moelens.wrap(tiny_model("dbrx"), tokenizer=ascii_tokenizer())
    assert_scan_refused(dbrx, r"^model\.scan: model\.transformer\.blocks\.0\.ffn's experts run a loop that depends on "
                              r"the values.*run a real trace on a short input instead\.$")
    model.set_experts_implementation("batched_mm")
    with pytest.raises(GuardOnDataDependentSymNode):
        with model.scan("hello"):
            if model.moes[0].router_logits.sum() > 0:  # the body's own branch on a value
                pass
    # a value read inside the experts call: the body runs inside the experts' frames, and was blamed on their loop
    for name in ("expert_weights", "expert_indices", "expert_outputs", "routed_output"):
        with pytest.raises(GuardOnDataDependentSymNode):
            with model.scan("hello"):
                if getattr(model.moes[0], name).flatten()[0] > 0:
                    pass


def test_scan_of_weights_accelerate_offloaded_to_disk_says_what_to_do(tmp_path):
    """model.scan of a model whose weights accelerate loads from an offload folder (device_map to "disk") failed
    inside torch ("could not determine the shape of object type 'torch.storage.UntypedStorage'", after a logged torch
    traceback). It is refused up front with the ways out; as it says, a copy built from the config under
    init_empty_weights(include_buffers=True) scans, into the shape a real trace of the offloaded model reads. Weights
    accelerate keeps on the CPU (cpu_offload) still scan."""
    from accelerate import cpu_offload, init_empty_weights
    from transformers import AutoModelForCausalLM

    from moelens.data import TINY_MODEL_PATH

    offloaded = moelens.load(TINY_MODEL_PATH, device_map={"": "disk"}, offload_folder=str(tmp_path / "offload"))
    offloaded.set_experts_implementation("batched_mm")
    assert all(parameter.is_meta for parameter in offloaded._module.parameters())
    assert_scan_refused(offloaded, r"^model\.scan: accelerate loads some of this model's weights from disk .*Run a real "
                                   r"trace on a short input instead, or scan a copy built without weights: "
                                   r".*init_empty_weights\(include_buffers=True\)")
    with torch.no_grad(), offloaded.trace("hello"):
        truth = offloaded.moes[0].router_logits.save()
    with init_empty_weights(include_buffers=True):
        empty = AutoModelForCausalLM.from_config(offloaded._module.config)
    copy_model = moelens.wrap(empty, tokenizer=offloaded.tokenizer)
    copy_model.set_experts_implementation("batched_mm")
    with copy_model.scan("hello"):
        shape = nnsight.save(copy_model.moes[0].router_logits.shape)
    assert tuple(shape) == tuple(truth.shape)
    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    cpu_offload(hf, execution_device="cpu")
    on_cpu = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    with on_cpu.scan("hello"):
        shape = nnsight.save(on_cpu.moes[0].router_logits.shape)
    assert tuple(shape) == (1, len("hello"), hf.config.num_local_experts)


def test_scan_of_meta_weights_beside_real_buffers_names_the_buffers():
    """init_empty_weights() keeps buffers real: deepseek_v3's router keeps its e_score_correction_bias on the CPU beside
    the meta weights, and model.scan failed with torch's FakeTensorDeviceMismatchError ("found at least two devices,
    meta and cpu"), naming neither. The error names the buffers and the ways out; as it says, include_buffers=True
    (or moving them to meta) scans, into the router's logits shape [1, tokens, n_routed_experts]. A real rotary
    inv_freq beside meta weights (mixtral) scans as before."""
    from accelerate import init_empty_weights

    from moelens.testing import model_class, tiny_config

    config = tiny_config("deepseek_v3")
    with init_empty_weights():
        hf = model_class("deepseek_v3")(config)
    real = [name for name, buffer in hf.named_buffers() if not buffer.is_meta and "e_score" in name]
    assert real and all(parameter.is_meta for parameter in hf.parameters())
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    model.set_experts_implementation("batched_mm")
    assert_scan_refused(model, rf"^model\.scan: the model's weights are on the meta device, but {len(real)} of its "
                               rf"buffers are real tensors on cpu \({re.escape(real[0])}, .*"
                               r"init_empty_weights\(include_buffers=True\).*hf_model\.to\('meta'\)")
    hf.to("meta")  # the refused model, its buffers moved to meta
    with init_empty_weights(include_buffers=True):
        built_empty = moelens.wrap(model_class("deepseek_v3")(config), tokenizer=ascii_tokenizer())
    built_empty.set_experts_implementation("batched_mm")
    for remedy in (model, built_empty):
        with remedy.scan("hello"):
            shape = nnsight.save(remedy.moes[0].router_logits.shape)
        assert tuple(shape) == (1, len("hello"), config.n_routed_experts)
    with init_empty_weights():
        mixtral = model_class("mixtral")(tiny_config("mixtral"))
    assert any(not buffer.is_meta for buffer in mixtral.buffers())
    model = moelens.wrap(mixtral, tokenizer=ascii_tokenizer())
    model.set_experts_implementation("batched_mm")
    with model.scan("hello"):
        shape = nnsight.save(model.moes[0].router_logits.shape)
    assert tuple(shape) == (1, len("hello"), mixtral.config.num_local_experts)



def _scan_device_mismatch(model, body) -> BaseException:
    """The error ``model.scan("hello")`` running ``body(model)`` raises: torch's device mismatch of fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    model.set_experts_implementation("batched_mm")
    with pytest.raises(FakeTensorDeviceMismatchError, match="found at least two devices, meta and cpu") as raised:
        with model.scan("hello"):
            body(model)
    return raised.value


def _add_a_cpu_tensor(model) -> None:
    """A scan body's own mistake: adds a tensor it builds on the CPU to the first block's meta router logits."""
    logits = model.moes[0].router_logits
    model.moes[0].router_logits = logits + torch.ones(logits.shape[-1])


def test_scan_does_not_blame_real_buffers_for_a_device_mismatch_they_did_not_cause():
    """A mixtral built under init_empty_weights() keeps only its rotary inv_freq real, which scans (the same scan
    reads the router's logits [1, tokens, experts]); a CPU tensor the scan body adds, or a real CPU lm_head weight,
    fails on the two devices, and that was a MoelensError blaming the buffers (model.rotary_emb.inv_freq, ...),
    whose advice (include_buffers=True) still failed. Torch's own device-mismatch error comes through instead."""
    from accelerate import init_empty_weights

    from moelens.testing import model_class, tiny_config

    def empty_mixtral():
        with init_empty_weights():
            hf = model_class("mixtral")(tiny_config("mixtral"))
        assert [name for name, buffer in hf.named_buffers() if not buffer.is_meta]
        return hf

    model = moelens.wrap(empty_mixtral(), tokenizer=ascii_tokenizer())
    model.set_experts_implementation("batched_mm")
    with model.scan("hello"):
        shape = nnsight.save(model.moes[0].router_logits.shape)
    assert tuple(shape) == (1, len("hello"), model._module.config.num_local_experts)
    assert not isinstance(_scan_device_mismatch(model, _add_a_cpu_tensor), moelens.MoelensError)
    hf = empty_mixtral()
    hf.lm_head.weight = torch.nn.Parameter(torch.zeros(hf.lm_head.weight.shape))  # real, on the CPU
    real_head = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    error = _scan_device_mismatch(real_head, lambda model: model.moes[0].router_logits.save())
    assert not isinstance(error, moelens.MoelensError)


def test_scan_blames_a_real_buffer_only_where_the_model_computes_with_it():
    """deepseek_v3 with only its routers' e_score_correction_bias real: the scan body's own CPU tensor, added to the
    router's logits before the router adds its bias, fails in the body, and comes through as torch's error; the
    plain scan then fails where the router adds the real bias, and names the buffers. hy_v3's block hands its bias to
    its router, whose scan names them too."""
    from accelerate import init_empty_weights

    from moelens.testing import model_class, tiny_config

    with init_empty_weights(include_buffers=True):
        hf = model_class("deepseek_v3")(tiny_config("deepseek_v3"))
    biased = [name.rpartition(".")[0] for name, _ in hf.named_buffers() if name.endswith(".e_score_correction_bias")]
    for router in biased:
        bias = hf.get_submodule(router).e_score_correction_bias
        hf.get_submodule(router).e_score_correction_bias = torch.nn.Buffer(torch.zeros(bias.shape))
    assert [name for name, buffer in hf.named_buffers() if not buffer.is_meta] == [
        f"{router}.e_score_correction_bias" for router in biased]
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    assert not isinstance(_scan_device_mismatch(model, _add_a_cpu_tensor), moelens.MoelensError)
    assert_scan_refused(model, rf"^model\.scan: the model's weights are on the meta device, but {len(biased)} of its "
                               rf"buffers are real tensors on cpu \({re.escape(biased[0])}\.e_score_correction_bias, ")
    with init_empty_weights():
        handing = model_class("hy_v3")(tiny_config("hy_v3"))
    handed = [name for name, _ in handing.named_buffers() if name.endswith(".e_score_correction_bias")]
    assert handed and all(name.endswith(".mlp.e_score_correction_bias") for name in handed)  # not its router's
    model = moelens.wrap(handing, tokenizer=ascii_tokenizer())
    model.set_experts_implementation("batched_mm")
    assert_scan_refused(model, rf"^model\.scan: the model's weights are on the meta device, but {len(handed)} of its "
                               rf"buffers are real tensors on cpu \({re.escape(handed[0])}, ")

def test_params_of_a_dense_block_says_it_is_dense():
    """Mlp.params() was nnsight's "'Mlp' object (nor its module) has attribute 'params'"."""
    hf = tiny_model("qwen2_moe")
    wrapped = moelens.wrap(hf)
    dense = next(layer.mlp for layer in wrapped.layers if not isinstance(layer.mlp, moelens.Moe))
    with pytest.raises(ValueUnavailable, match=r"mlp\.params\(\) cannot be served: this block \(Qwen2MoeMLP\) is a dense "
                                               r"MLP and runs no mixture of experts\. MoE layers are \["):
        dense.params()


def test_a_dense_blocks_missing_moe_attributes_say_it_is_dense():
    """block.router / .num_experts / .order() on a dense layer were nnsight's "'Mlp' object (nor its module) has
    attribute ..."; still an AttributeError, so hasattr tells the kinds of block apart."""
    wrapped = moelens.wrap(tiny_model("qwen2_moe"))
    dense = next(layer.mlp for layer in wrapped.layers if not isinstance(layer.mlp, moelens.Moe))
    for name in ("router", "experts", "shared_experts", "num_experts", "top_k", "order", "save_all"):
        assert hasattr(wrapped.moes[0], name) and not hasattr(dense, name)
        with pytest.raises(AttributeError, match=rf"^{re.escape(dense.path)} has no {name}: this block \(Qwen2MoeMLP\) is "
                                                 r"a dense MLP and runs no mixture of experts \(MoE layers are \["):
            getattr(dense, name)
    with pytest.raises(AttributeError, match=r"'Mlp' object \(nor its module\) has attribute 'routerr'"):
        dense.routerr
    assert isinstance(dense.gate_proj._module, torch.nn.Linear)  # its own modules as before


def test_an_attribute_error_inside_a_moe_property_is_not_called_a_dense_block(monkeypatch):
    """Python retries __getattr__ when a property raises AttributeError: on a Moe that is no dense block."""
    moe = moelens.wrap(tiny_model("qwen2_moe")).moes[0]

    def broken(self):
        raise AttributeError("inner attribute missing")

    monkeypatch.setattr(moelens.Moe, "top_k", property(broken))
    with pytest.raises(AttributeError) as raised:
        moe.top_k
    assert "dense MLP" not in str(raised.value)


def test_a_layer_without_an_mlp_block_says_so():
    """nemotron_h's attention and mamba layers hold no MLP: layers[i].mlp was nnsight's bare "'Envoy' object (nor its
    module) has attribute 'mlp'"; layers with a block keep their alias."""
    wrapped = moelens.wrap(tiny_model("nemotron_h"))
    blockless = [i for i in range(len(wrapped.layers)) if not hasattr(wrapped.layers[i], "mlp")]
    assert blockless and all(isinstance(wrapped.layers[moe.layer].mlp, moelens.Moe) for moe in wrapped.moes)
    with pytest.raises(AttributeError, match=rf"layers\.{blockless[0]} \(NemotronHBlock\) has no 'mlp': moelens sees no "
                                             r"MLP block it serves in this layer \(a hybrid model's attention or mamba "
                                             r"layer, or an MLP of a kind it does not recognise"):
        wrapped.layers[blockless[0]].mlp


class _TakesTokens(torch.nn.Module):
    """A model whose forward calls its token ids ``tokens``: nnsight counts no rows for that keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_model("mixtral")

    def forward(self, tokens):
        return self.inner(input_ids=tokens).logits


def test_inputs_the_model_runs_on_are_not_refused_as_empty():
    """The refusals above keep to what cannot run: an invoke whose input is a keyword nnsight counts no rows of
    (all invokes looked empty) and a user's mask with a row of zeros (a fixed-size batch's padding row) ran before
    and still run, equal to the plain forward."""
    model = moelens.wrap(_TakesTokens().eval())
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = model._module(ids)
        with model.trace() as tracer:
            with tracer.invoke(tokens=ids):
                logits = model.moes[0].router_logits.save()
                out = model.output.save()
    assert tuple(logits.shape) == (1, 3, 8) and torch.equal(out, plain)
    tiny = moelens.load()
    ids, mask = torch.tensor([[5, 6, 7], [0, 0, 0]]), torch.tensor([[1, 1, 1], [0, 0, 0]])
    with torch.no_grad():
        plain = tiny._module(input_ids=ids, attention_mask=mask).logits
        with tiny.trace(input_ids=ids, attention_mask=mask):
            out = tiny.output.logits.save()
    assert torch.equal(out, plain)


@pytest.mark.parametrize("form", ["encoding", "list"])
def test_a_token_id_outside_the_embeddings_is_named_in_every_input_form(form):
    """Ids given as the tokenizer's dict or as a list of lists reached torch's bare IndexError (only a tensor was
    looked at): the ids are read from the batch the model ran on."""
    model = moelens.load()
    ids = [[5, 99999]]
    given = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(1, 2, dtype=torch.long)} if form == "encoding" \
        else ids
    with pytest.raises(moelens.MoelensError, match=r"token id 99999 is outside the model's input embeddings"):
        _router_logits(model, given)


@pytest.mark.parametrize("tokenizer", [False, True])
def test_a_run_of_a_model_whose_weights_are_not_loaded_is_refused(tokenizer):
    """A model built on the meta device: a trace wrapped with a tokenizer failed inside transformers ("Tensor.item()
    cannot be called on meta tensors"), and one without gave every value and the logits as meta tensors, unsaid.
    Scan still works on it."""
    from moelens.testing import model_class, tiny_config

    with torch.device("meta"):
        hf = model_class("mixtral")(tiny_config("mixtral"))
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer() if tokenizer else None)
    model.set_experts_implementation("batched_mm")
    runs = [lambda: model.trace(torch.tensor([[1, 2, 3]]))]
    if tokenizer:  # generate needs one
        runs.append(lambda: model.generate(torch.tensor([[1, 2]]), max_new_tokens=1))
    for run in runs:
        with pytest.raises(moelens.MoelensError, match=r"\d+ of the model's weights and buffers are not loaded \(on the "
                                                       r"meta device: model\.embed_tokens\.weight, .*model\.scan"):
            with run():
                model.moes[0].router_logits.save()
    if tokenizer:
        with model.scan("hi"):
            shape = nnsight.save(model.moes[0].router_logits.shape)
        assert tuple(shape) == (1, 2, model.moes[0].num_experts)


@pytest.mark.parametrize("loaded", ["all but the layers", "the state dict, with assign=True"])
def test_a_run_of_a_model_loaded_in_part_is_refused_naming_what_is_not(loaded):
    """Only the first weight was looked at: a model whose layers were never loaded failed inside torch ("Tensor on
    device cpu is not on the expected device meta"), and one built on meta whose state dict was loaded with
    assign=True kept its rotary embedding's buffers (not in a state dict) on meta: "Cannot copy out of meta tensor"."""
    from moelens.testing import model_class, tiny_config

    real = model_class("mixtral")(tiny_config("mixtral"))
    with torch.device("meta"):
        hf = model_class("mixtral")(tiny_config("mixtral"))
    state = real.state_dict()
    if loaded == "all but the layers":
        hf.load_state_dict({name: value for name, value in state.items() if ".layers." not in name}, assign=True,
                           strict=False)
        hf.model.rotary_emb = real.model.rotary_emb
        named = r"model\.layers\.0\.[\w.]+, model\.layers\.0\.[\w.]+, model\.layers\.0\.[\w.]+, \.\.\."
    else:
        hf.load_state_dict(state, assign=True)
        named = r"model\.rotary_emb\.inv_freq, model\.rotary_emb\.original_inv_freq\)"
    model = moelens.wrap(hf)
    with pytest.raises(moelens.MoelensError, match=r"weights and buffers are not loaded \(on the meta device: " + named):
        with model.trace(torch.tensor([[1, 2, 3]])):
            model.output.save()


def test_register_implementation_checks_what_it_is_given_and_keeps_moelens_own():
    """It took anything: ``register_implementation("grouped_mm", 3)`` replaced moelens' own entry, and a later read of
    expert_outputs said the Moe had no such attribute."""
    from moelens.components import ExpertsOps, register_implementation
    from moelens.components.implementations import _IMPLEMENTATIONS

    before = dict(_IMPLEMENTATIONS)
    refused = {(None, ExpertsOps()): r"takes the name of an experts implementation .*got None",
               ("eager", ExpertsOps()): r"other than 'eager', whose loop has no per-slot tensors\), got 'eager'",
               ("grouped_mm", 3): r"ops must be ExpertsOps\(\.\.\.\) naming ops as str .*got 3",
               ("mine", ExpertsOps(slot_outputs="")): r"ops must be ExpertsOps",
               ("mine", ExpertsOps(sort=5)): r"ops must be ExpertsOps",
               ("mine", ExpertsOps(pre_activations="no")): r"pre_activations: a bool\), got",
               ("grouped_mm", ExpertsOps(slot_outputs="bogus_op")): r"'grouped_mm' is already registered with .*"
                                                                    r"pass replace=True"}
    for (name, ops), message in refused.items():
        with pytest.raises(moelens.MoelensError, match=message):
            register_implementation(name, ops)
    for flag in ("False", "no", 0):  # a true string replaced moelens' own ops (a later read was another tensor)
        with pytest.raises(moelens.MoelensError, match=rf"replace must be True or False, got {flag!r}"):
            register_implementation("grouped_mm", ExpertsOps(slot_outputs="bogus_op"), replace=flag)
    assert _IMPLEMENTATIONS == before
    register_implementation("batched_mm", before["batched_mm"])  # the same ops again: nothing changes
    try:
        register_implementation("grouped_mm", ExpertsOps(slot_outputs="bogus_op"), replace=True)
        assert _IMPLEMENTATIONS["grouped_mm"].slot_outputs == "bogus_op"
    finally:
        _IMPLEMENTATIONS.clear()
        _IMPLEMENTATIONS.update(before)


def test_op_names_registered_again_reach_a_block_that_served_per_slot_values():
    """A block kept the per-slot bindings it built first for an implementation: after wrong op names were fixed
    with register_implementation(..., replace=True), it still read the wrong ones (an OrderError) until wrapped
    again."""
    from moelens.components import ExpertsOps, register_implementation
    from moelens.components.implementations import ops_for

    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    wrapped, inputs, good = moelens.wrap(hf), tiny_inputs(hf), ops_for("batched_mm")
    try:
        register_implementation("batched_mm", ExpertsOps(slot_outputs="no_such_op_0"), replace=True)
        with pytest.raises(ValueUnavailable, match=r"expert_outputs cannot be served: this block runs the experts "
                                                   r"implementation 'batched_mm', and its function "
                                                   r"batched_mm_experts_forward has no op slot_outputs='no_such_op_0'; "
                                                   r"its ops are .*weighted_out_view_0"):
            with torch.no_grad(), wrapped.trace(**inputs):  # was an OrderError blaming the read order
                wrapped.moes[0].expert_outputs.save()
    finally:
        register_implementation("batched_mm", good, replace=True)
    with torch.no_grad(), wrapped.trace(**inputs):
        outputs = wrapped.moes[0].expert_outputs.save()
        routed = wrapped.moes[0].routed_output.save()
    torch.testing.assert_close(outputs.sum(2), routed)


def users_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An experts implementation of a user's own: transformers' batched_mm, called."""
    from transformers.integrations.moe import batched_mm_experts_forward

    return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def test_an_implementation_moelens_cannot_read_says_why_and_how_to_register_it():
    """One registered with transformers alone was said to be "a loop over experts with no [tokens, k, ...] tensor";
    registered with op names it lacks, a read blamed the read order (OrderError); a lambda raised nnsight's
    SourceNotAvailable; a misspelt name in the config was taken at wrap without a word. Ground truth: the values the
    same block serves under batched_mm, which the user's function runs."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from moelens.components import ExpertsOps, register_implementation
    from moelens.components.implementations import _IMPLEMENTATIONS

    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        expected = wrapped.moes[0].routed_output.save()
    functions = {"users_own": users_experts_forward, "users_lambda": lambda *args: users_experts_forward(*args)}

    def refused(implementation, match):
        wrapped.set_experts_implementation(implementation)
        with pytest.raises(ValueUnavailable, match=match):
            with torch.no_grad(), wrapped.trace(**inputs):
                wrapped.moes[0].expert_outputs.save()
        with torch.no_grad(), wrapped.trace(**inputs):  # the model runs it
            torch.testing.assert_close(wrapped.moes[0].routed_output.save(), expected, rtol=0, atol=0)

    try:
        for name, function in functions.items():
            ALL_EXPERTS_FUNCTIONS.register(name, function)
        refused("users_own", r"runs 'users_own' \(an implementation registered with transformers, whose op names "
                             r"moelens does not know\).*moelens\.components\.register_implementation\('users_own', "
                             r"ExpertsOps\(\.\.\.\)\)")
        register_implementation("users_own", ExpertsOps())
        refused("users_own", r"runs the experts implementation 'users_own', and its function users_experts_forward has "
                             r"no op slot_outputs='weighted_out_view_0'; no op gated_activations='self__apply_gate_0' "
                             r"or plain_activations='self_act_fn_0'; its ops are batched_mm_experts_forward_0\. "
                             r"Register it again with the op names it has")
        register_implementation("users_lambda", ExpertsOps())
        refused("users_lambda", r"its function .*<lambda> has no Python source whose ops nnsight reads")
    finally:
        for name in functions:
            ALL_EXPERTS_FUNCTIONS._global_mapping.pop(name, None)
            _IMPLEMENTATIONS.pop(name, None)
    misspelt = tiny_model("mixtral")
    misspelt.config._experts_implementation = "grouped_mn"
    with pytest.warns(UserWarning, match=r"the model's experts run 'grouped_mn', which transformers does not know "
                                         r"\(known: eager, .*\): its forward fails\. Switch with "
                                         r"model\.set_experts_implementation\('grouped_mm'\)"):
        moelens.wrap(misspelt)


def test_an_implementation_registered_without_pre_activations_refuses_them_with_the_reason():
    """ExpertsOps(pre_activations=False) says the activation op's input is no slot's up projection: the value is
    refused naming the implementation and the flag, and the activations are still served."""
    from moelens.components import ExpertsOps, register_implementation
    from moelens.components.implementations import ops_for

    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    wrapped, inputs, good = moelens.wrap(hf), tiny_inputs(hf), ops_for("batched_mm")
    try:
        register_implementation("batched_mm", ExpertsOps(pre_activations=False), replace=True)
        with pytest.raises(ValueUnavailable, match=r"expert_pre_activations.*the batched_mm experts implementation was "
                                                   r"registered with ExpertsOps\(pre_activations=False\).*Read "
                                                   r"expert_activations, or recompute the projection"):
            with torch.no_grad(), wrapped.trace(**inputs):
                wrapped.moes[0].expert_pre_activations.save()
        with torch.no_grad(), wrapped.trace(**inputs):
            served = wrapped.moes[0].save_all()
    finally:
        register_implementation("batched_mm", good, replace=True)
    assert "expert_activations" in served and "expert_pre_activations" not in served


def test_an_interrupt_as_a_trace_begins_leaves_the_model_to_other_threads(monkeypatch):
    """Ctrl-C while nnsight built the batcher (after moelens claimed the run for this thread, before nnsight's
    clean-up was in place) left the run claimed: every trace from another thread was refused until this thread
    traced the wrapper again."""
    import threading

    import moelens.model

    hf = tiny_model("mixtral")
    wrapped, ids = moelens.wrap(hf), tiny_inputs(hf)["input_ids"]
    real = moelens.model._present

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(moelens.model, "_present", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(moelens.model, "_present", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with wrapped.trace(ids):
            wrapped.output.save()
    assert wrapped.interleaver.owner is None
    outcome = {}

    def other_thread():
        try:
            with wrapped.trace(ids):
                outcome["logits"] = wrapped.moes[0].router_logits.save()
        except Exception as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    thread.join(60)
    assert "error" not in outcome and outcome["logits"].shape[-1] == 8, outcome


def test_an_interrupt_while_the_blocks_are_marked_running_leaves_them_to_other_wrappers():
    """Ctrl-C while hold_blocks marked the blocks as this run's (before it recorded them) left them marked:
    every other wrapper of the model was refused until this one traced again."""
    import moelens.components.run_owner as run_owner

    hf = tiny_model("mixtral")
    first, second, ids = moelens.wrap(hf), moelens.wrap(hf), tiny_inputs(hf)["input_ids"]
    source = pathlib.Path(run_owner.__file__).read_text().splitlines()
    line = next(number for number, text in enumerate(source, 1) if "_RUNNING[block] = self" in text)
    marked = []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != run_owner.__file__:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line:
                marked.append(frame.f_lineno)
                if len(marked) == 2:  # the first block marked, the second not yet
                    sys.settrace(None)
                    raise KeyboardInterrupt
            return local
        return local

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            with first.trace(ids):
                first.moes[0].router_logits.save()
    finally:
        sys.settrace(None)
    assert len(marked) == 2 and not run_owner._RUNNING
    with second.trace(ids):
        logits = second.moes[0].router_logits.save()
    assert logits.shape[-1] == 8


def test_a_run_lock_left_held_by_an_interrupt_hangs_no_trace(monkeypatch):
    """A Ctrl-C landing between a `with _CLAIMING:` block's end and its __exit__ left moelens' global lock held: every
    later trace of any wrapped model hung in claim() forever. Now the interrupted thread (a notebook's) takes it
    again, and another thread gets an error naming the cause after CLAIM_WAIT_S. The leak is made by acquiring the
    lock without releasing it, as the interrupted block leaves it."""
    import threading

    import moelens.components.run_owner as run_owner

    hf = tiny_model("mixtral")
    wrapped, ids = moelens.wrap(hf), tiny_inputs(hf)["input_ids"]
    with torch.no_grad():
        expected = hf(ids).logits
    monkeypatch.setattr(run_owner, "CLAIM_WAIT_S", 0.5)
    leaked, other_done, outcome = threading.Event(), threading.Event(), {}

    def interrupted_thread():
        run_owner._CLAIMING.acquire()  # left held, as by the interrupt
        try:
            with torch.no_grad(), wrapped.trace(ids):
                outcome["logits"] = wrapped.output.logits.save()
            leaked.set()
            other_done.wait(60)
        finally:
            run_owner._CLAIMING.release()

    thread = threading.Thread(target=interrupted_thread, daemon=True)
    thread.start()
    assert leaked.wait(60), "a trace in the thread that left the lock held hung"
    try:
        torch.testing.assert_close(outcome["logits"], expected, rtol=0, atol=0)
        with pytest.raises(moelens.MoelensError, match=r"run registry has been held by another thread for 0\.5 s.*an "
                                                       r"interrupt \(Ctrl-C\) in that thread left it held"):
            with wrapped.trace(ids):
                wrapped.output.save()
    finally:
        other_done.set()
        thread.join(60)
    with torch.no_grad(), wrapped.trace(ids):  # released: traces from any thread again
        logits = wrapped.output.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama4", "dbrx"])
def test_switching_experts_that_run_their_own_loop_is_refused(family):
    """transformers refuses the switch for these classes, and moelens found no block to switch: the call returned
    as if it had switched them."""
    wrapped = moelens.wrap(tiny_model(family))
    with pytest.raises(moelens.MoelensError, match=r"has no MoE block whose experts run a pluggable implementation .*"
                                                   r"has nothing to switch"):
        wrapped.set_experts_implementation("grouped_mm")


def test_gate_and_up_refuses_what_is_not_gated_pre_activations(mixtral):
    """moe.gate_and_up names the value and the width it expects (2I of the fused weight), and says why a block
    whose experts are not gated has no gate part."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        pre = moe.expert_pre_activations.save()
        activations = moe.expert_activations.save()
    width = pre.shape[-1]
    for bad, shown in ((activations, rf"Tensor of shape \(2, \d+, 2, {width // 2}\) of dtype torch.float32"),
                       (pre.long(), rf"Tensor of shape \(2, \d+, 2, {width}\) of dtype torch.int64"),
                       (pre[..., :-2], "Tensor of shape"), ([1.0, 2.0], "list"),
                       (torch.tensor(1.0), r"Tensor of shape \(\)")):
        with pytest.raises(moelens.ArgumentError,
                           match=rf"model\.layers\.0\.mlp\.gate_and_up takes expert_pre_activations, a floating-point "
                                 rf"torch tensor \[\.\.\., 2I\] of gate and up projections \(2I = {width}, as "
                                 rf"MixtralExperts\.gate_up_proj holds\); got {shown}"):
            moe.gate_and_up(bad)
    hf, wrapped_relu, inputs_relu, plain, reference = built("nemotron_h", "grouped_mm")
    with pytest.raises(ValueUnavailable, match=r"is not gated .*no gate part to split off"):
        wrapped_relu.moes[0].gate_and_up(torch.zeros(1, 1, 2, 8))
    hf, wrapped_dbrx, inputs_dbrx, plain, reference = built("dbrx", "eager")  # gated, in separate weights of its loop
    with pytest.raises(ValueUnavailable, match=r"keeps its gate and up projections in separate weights \(mlp\.w1, "
                                               r"mlp\.v1\).*serves no expert_pre_activations to split"):
        wrapped_dbrx.moes[0].gate_and_up(torch.zeros(1, 1, 2, 8))


def test_saving_a_model_with_nnsight_edits_warns_that_they_are_not_saved(tmp_path):
    """model.edit(inplace=True) edits live in the wrapper, not the weights: save_pretrained (nnsight forwards it to
    the transformers model) wrote the unedited model without a word, and moelens.load gave it back unedited. Ground
    truth: the reloaded model's logits equal the unedited model's, not the edited ones."""
    hf = tiny_model("mixtral")
    ids = tiny_inputs(hf)["input_ids"]
    with torch.no_grad():
        plain = hf(input_ids=ids).logits
    wrapped = moelens.wrap(hf)
    with wrapped.edit(inplace=True):
        moelens.steer(wrapped.moes[0], 0, 10.0)  # every token's top-k takes expert 0
    with wrapped.trace(ids):
        edited = wrapped.output.logits.save()
    assert not torch.allclose(edited, plain)
    with pytest.warns(UserWarning, match=r"save_pretrained: the model carries 1 nnsight edit\(s\) \(model\.edit\(\)\), "
                                         r"which are not in its weights and are not saved.*moe\.params\(\)"):
        wrapped.save_pretrained(tmp_path / "saved")
    reloaded = moelens.load(tmp_path / "saved")
    with reloaded.trace(ids):
        again = reloaded.output.logits.save()
    torch.testing.assert_close(again, plain)
    wrapped.clear_edits()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped.save_pretrained(tmp_path / "clean")


def test_load_warns_where_a_later_sharded_save_is_shadowed_by_an_earlier_single_file(tmp_path):
    """save_pretrained(max_shard_size=...) into the folder of an unsharded save leaves model.safetensors in place,
    and transformers (plain from_pretrained too) reads it before the newer shards: an edit saved so loaded unedited,
    silently. moelens.load warns, naming both files; the other order (single file newer) stays silent."""
    folder = tmp_path / "model"
    tiny_model("mixtral").save_pretrained(folder)
    model = moelens.load(folder)
    with torch.no_grad():
        model.moes[0].params(0).down.zero_()
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors").is_file() and (folder / "model.safetensors.index.json").is_file()
    with pytest.warns(UserWarning, match=r"holds both model\.safetensors and a shard index written after it "
                                         r"\(model\.safetensors\.index\.json.*transformers reads model\.safetensors "
                                         r"and ignores the shards"):
        shadowed = moelens.load(folder)
    assert shadowed.moes[0].params(0).down.any()  # the old single file, unedited: what the warning is about
    (folder / "model.safetensors").unlink()
    assert not moelens.load(folder).moes[0].params(0).down.any()  # the edit, from the shards
    other = tmp_path / "other"
    tiny_model("mixtral").save_pretrained(other, max_shard_size="20KB")
    tiny_model("mixtral").save_pretrained(other)  # the single file written last: it is what should load
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moelens.load(other)


def test_a_refused_wrap_leaves_no_nnsight_forward_on_the_users_model():
    """A wrap moelens refuses after nnsight made its envoys (a router's top_k above its expert count) left nnsight's
    dispatcher on every module: a class patch made afterwards no longer reached the model, which no wrapper holds.
    Ground truth: a copy nobody tried to wrap."""
    hf = tiny_model("mixtral")
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    never = copy.deepcopy(hf)
    gate = hf.model.layers[-1].mlp.gate
    gate.top_k = gate.num_experts + 1
    with pytest.raises(moelens.MoelensError, match="routes each token to its top_k"):
        moelens.wrap(hf)
    gate.top_k = never.model.layers[-1].mlp.gate.top_k
    assert not [name for name, module in hf.named_modules() if {"forward", "__nnsight__"} & set(vars(module))]
    moe_class = type(hf.model.layers[0].mlp)
    original = moe_class.forward
    try:
        moe_class.forward = lambda self, hidden_states: torch.zeros_like(hidden_states)
        with torch.no_grad():
            assert torch.equal(first_tensor(hf(ids)), first_tensor(never(ids)))
    finally:
        moe_class.forward = original
    wrapped = moelens.wrap(hf)  # and it wraps once fixed
    with torch.no_grad(), wrapped.trace(ids):
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, first_tensor(never(ids)))


def _timed(function):
    """A decorator without functools.wraps: nnsight peels it by the function its closure calls."""
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


def test_an_implementation_nnsight_instruments_through_a_wrapper_or_call_passes_the_op_check():
    """The op check read a decorator's wrapper without functools.wraps (its ops: function_0) where nnsight instruments
    the function the wrapper calls (as it instruments a callable object's __call__): it served the values before the
    check. Ground truth: the values the same block serves under batched_mm, which the wrapper runs."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    from moelens.components import ExpertsOps, register_implementation
    from moelens.components.implementations import _IMPLEMENTATIONS

    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        expected = wrapped.moes[0].expert_outputs.save()
    ops = ExpertsOps()
    functions = {"users_timed": _timed(batched_mm_experts_forward)}
    try:
        for name, function in functions.items():
            ALL_EXPERTS_FUNCTIONS.register(name, function)
            register_implementation(name, ops)
            wrapped.set_experts_implementation(name)
            with torch.no_grad(), wrapped.trace(**inputs):
                served = wrapped.moes[0].expert_outputs.save()
            torch.testing.assert_close(served, expected, rtol=0, atol=0)
    finally:
        for name in functions:
            ALL_EXPERTS_FUNCTIONS._global_mapping.pop(name, None)
            _IMPLEMENTATIONS.pop(name, None)


def test_a_block_given_back_to_its_envoy_is_served_and_checked_as_wrapped():
    """``model.layers[1].mlp = nn.Identity()`` then the original block given back: its forward is still the one
    moelens instrumented, and its values are served (a hook on its router is the truth), yet repr said "replaced after
    wrapping" and families.check refused it (put_in_after_wrap looked only at the new envoy's own record)."""
    hf = tiny_model("mixtral")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    original = hf.model.layers[1].mlp
    wrapped.layers[1].mlp = torch.nn.Identity()
    wrapped.layers[1].mlp = original
    seen = []
    hook = original.gate.register_forward_hook(lambda module, args, out: seen.append(out[0] if isinstance(out, tuple)
                                                                                     else out))
    with torch.no_grad(), wrapped.trace(**inputs):
        logits = wrapped.moes[1].router_logits.save()
    hook.remove()
    torch.testing.assert_close(logits.reshape(seen[0].shape), seen[0], rtol=0, atol=0)
    assert "[1] model.model.layers.1.mlp: mixtral, E=8" in repr(wrapped.moes)
    assert families.check(wrapped, **inputs)


def test_a_model_wrapped_before_its_family_was_registered_is_told_to_wrap_again():
    """A model wrapped before the user registered its family has no Moe: model.moes[0] said only "no MoE block" and
    routing analysis to wrap an MoE model, with no word of the family registered since. Ground truth: the model's own
    block class, and a wrap after the registration serving both its blocks."""
    from custom_models import custom_family, custom_model

    from moelens.analysis import collect_routing
    from moelens.errors import LayerIndexError

    hf = custom_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the wrap's warning: no MoE block
        early = moelens.wrap(hf)
    moelens.families.register(custom_family())
    try:
        hint = (r"; the family 'custom', registered after this model was wrapped, describes its CustomBlock blocks: "
                r"wrap it again \(moelens\.wrap\(model\._module\)\)\.$")
        with pytest.raises(LayerIndexError, match=r"^model\.moes\[0\]: this model has no MoE block \(model\.moes is "
                                                  r"empty\)" + hint):
            early.moes[0]
        with pytest.raises(moelens.MoelensError, match=r"^CustomModel has no Mixture-of-Experts layer moelens knows"
                                                       + hint):
            collect_routing(early, torch.tensor([[1, 2, 3]]), progress=False)
        assert len(moelens.wrap(early._module).moes) == 2  # the way named
    finally:
        moelens.families.unregister("custom")
    with pytest.raises(LayerIndexError, match=r"model\.moes is empty\)\.$"):  # no family names it: no hint
        early.moes[0]


@pytest.mark.parametrize("tokenizer", [False, True])
def test_a_misspelt_forward_keyword_is_refused_not_dropped(tokenizer):
    """A transformers forward takes any keyword and drops one it does not know: a trace given atention_mask ran
    unmasked, without a word. A near miss of a keyword the forward takes is refused naming it; the keywords a text
    invoke gives the tokenizer (max_length, truncation) and return_dict still run. Ground truth: the plain model with
    the mask spelt right gives other logits than without it, so the typo would have mattered."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer()) if tokenizer else moelens.wrap(hf)
    ids, mask = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1]])
    with torch.no_grad():
        assert not torch.equal(hf(ids, attention_mask=mask).logits[:, 1:], hf(ids).logits[:, 1:])
    refusal = r"^the keyword 'atention_mask' given to the trace is no argument of MixtralForCausalLM.forward.*'attention_mask'\?"
    with pytest.raises(moelens.MoelensError, match=refusal):
        with torch.no_grad(), wrapped.trace(ids, atention_mask=mask):
            wrapped.output.save()
    with pytest.raises(moelens.MoelensError, match=r"'output_hiden_states'.*did you mean 'output_hidden_states'\?"):
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke(ids, output_hiden_states=True):
                wrapped.output.save()
    with torch.no_grad(), wrapped.trace(ids, attention_mask=mask, return_dict=True):
        logits = wrapped.output.logits.save()
    with torch.no_grad():  # with a tokenizer, nnsight counts a padded row's positions from its mask
        assert torch.equal(logits, hf(ids, attention_mask=mask).logits) if not tokenizer else \
            torch.equal(logits, hf(ids, attention_mask=mask, position_ids=torch.tensor([[1, 0, 1, 2]])).logits)
    if tokenizer:
        with torch.no_grad(), wrapped.trace("abcdef", truncation=True, max_length=3):
            cut = wrapped.output.logits.save()
        assert cut.shape[1] == 3


@pytest.mark.parametrize("tokenizer", [False, True])
def test_a_tokenizer_setting_beside_token_ids_is_refused_not_dropped(tokenizer):
    """trace(ids, max_length=3) ran on all the ids without a word: only text goes through the tokenizer, and the
    forward drops a keyword it does not know. A setting of the tokenizer or the text pipeline beside ids is refused
    (at the trace and at an invoke; padding="max_length" was taken for text on a model without a tokenizer); one that
    asks for nothing (False, None, "do_not_pad") runs, and so does the setting beside text. Ground truth: the plain
    model on the ids cut to 3 tokens, which is what the setting asks for."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer()) if tokenizer else moelens.wrap(hf)
    ids = torch.tensor([[40, 41, 42, 43, 44, 45]])
    for setting in ({"max_length": 3, "truncation": True}, {"padding": "max_length"}, {"add_special_tokens": True}):
        name = next(iter(setting))
        refusal = rf"^{name}= is a setting of the tokenizer .* given beside token ids .* MixtralForCausalLM.forward takes"
        with pytest.raises(moelens.MoelensError, match=refusal):
            with torch.no_grad(), wrapped.trace(ids, **setting):
                wrapped.output.save()
        with pytest.raises(moelens.MoelensError, match=refusal):
            with torch.no_grad(), wrapped.trace() as tracer:
                with tracer.invoke(ids, **setting):
                    wrapped.output.save()
    with torch.no_grad(), wrapped.trace(ids, truncation=False, max_length=None, padding="do_not_pad"):
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, hf(ids).logits)
    if tokenizer:
        with torch.no_grad(), wrapped.trace("()*+,-", truncation=True, max_length=3):
            cut = wrapped.output.logits.save()
        with torch.no_grad():
            assert torch.equal(cut, hf(ids[:, :3]).logits)


def test_a_tokenizer_setting_no_tokenizer_takes_is_refused_beside_text_too():
    """Two drops the first check let through: a setting on an ids invoke beside a text invoke (the check looked for
    text in the whole trace), and a setting given to model.trace(...) beside text invokes, which nnsight hands to the
    forward, not the tokenizer; and a PEFT model was not checked at all. Ground truth: the same setting on the text
    invoke cuts it (the plain model on the cut ids); the plain PEFT model runs all the ids given max_length."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    ids = torch.tensor([[40, 41, 42, 43, 44, 45]])
    with pytest.raises(moelens.MoelensError, match=r"^max_length= is a setting of the tokenizer .* beside token ids"):
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke("()*+,-"):
                pass
            with tracer.invoke(ids, max_length=3, truncation=True):
                wrapped.output.save()
    with pytest.raises(moelens.MoelensError, match=r"^max_length= .* given to model.trace\(\.\.\.\) beside its "
                                                   r"invokes.* tracer.invoke\(text, max_length=\.\.\.\)\.$"):
        with torch.no_grad(), wrapped.trace(max_length=3, truncation=True) as tracer:
            with tracer.invoke("()*+,-"):
                wrapped.output.save()
    with torch.no_grad(), wrapped.trace() as tracer:
        with tracer.invoke("()*+,-", max_length=3, truncation=True):
            cut = wrapped.output.logits.save()
    with torch.no_grad():
        assert torch.equal(cut, hf(ids[:, :3]).logits)
    with pytest.raises(moelens.MoelensError, match=r"^this model was wrapped without a tokenizer, so it takes token "
                                                   r"ids, not text"):  # not transformers' "exactly one of input_ids"
        with torch.no_grad(), moelens.wrap(hf).trace(text="()*+,-"):
            pass
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(tiny_model("mixtral"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        assert adapted(ids, max_length=3).logits.shape[1] == 6  # dropped by the plain model too
    with pytest.raises(moelens.MoelensError, match=r"^max_length= is a setting of the tokenizer"):
        with torch.no_grad(), moelens.wrap(adapted).trace(ids, max_length=3):
            pass
    with pytest.raises(moelens.MoelensError, match=r"'atention_mask'.*did you mean 'attention_mask'\?"):
        with torch.no_grad(), moelens.wrap(adapted).trace(ids, atention_mask=torch.ones_like(ids)):
            pass


def test_an_unknown_keyword_far_from_every_argument_is_warned_of_at_the_users_line():
    """attn_mask= (no near miss of attention_mask) ran without a word: the model drops a keyword it does not know.
    It is warned of, at the trace's line; a known keyword is not. Ground truth: the plain model gives the same
    logits with and without it (it was dropped)."""
    hf = tiny_model("mixtral")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    half = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(hf(ids, attn_mask=half).logits, hf(ids).logits)
    wrapped = moelens.wrap(hf)
    with pytest.warns(UserWarning, match=r"^the keyword 'attn_mask' given to the trace is no argument of "
                                         r"MixtralForCausalLM.forward .* so the model runs without it\.") as caught:
        with torch.no_grad(), wrapped.trace(ids, attn_mask=half):
            logits = wrapped.output.logits.save()
    assert [pathlib.Path(warning.filename).name for warning in caught] == ["test_core_errors.py"]
    with torch.no_grad():
        assert torch.equal(logits, hf(ids).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), wrapped.trace(ids, attention_mask=half, use_cache=False, return_dict=True):
            logits = wrapped.output.logits.save()
        # the loss function's keywords, which the forward hands its **kwargs to: they change the loss
        loss_settings = {"labels": ids, "shift_labels": ids.roll(-1, 1), "ignore_index": 7}
        with torch.no_grad(), wrapped.trace(ids, **loss_settings):
            loss = wrapped.output.loss.save()
    with torch.no_grad():
        assert torch.equal(logits, hf(ids, attention_mask=half).logits)
        assert torch.equal(loss, hf(ids, **loss_settings).loss) and loss != hf(ids, labels=ids).loss
    with pytest.warns(UserWarning, match=r"^the keyword 'shift_labels' given to the trace is no argument of "
                                         r"MixtralModel.forward"):  # a base model computes no loss
        with torch.no_grad(), moelens.wrap(hf.model).trace(ids, shift_labels=ids):
            pass
    gemma4 = tiny_model("gemma4")  # its text model reads return_shared_kv_states from **kwargs unnamed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped_gemma4 = moelens.wrap(gemma4)
        with torch.no_grad(), wrapped_gemma4.trace(ids, return_shared_kv_states=True):
            output = wrapped_gemma4.output.save()
    assert output.shared_kv_states is not None  # the model returned them, as only that keyword makes it
    with torch.no_grad():
        assert gemma4(ids).shared_kv_states is None


def test_keywords_a_tokenizer_gives_or_an_inner_forward_names_are_not_taken_for_misspellings():
    """token_type_ids (a tokenizer's output, model.trace(**tokenizer(...))) was refused as a misspelling of the
    tokenizer setting 'return_token_type_ids', and qwen4_exp's ple_input_ids (named by the inner text model, which
    the causal LM's **kwargs reach) as one of 'input_ids'. Ground truth: the plain model runs with each (and reads
    ple_input_ids: other ids give other logits)."""
    tokenizer = ascii_tokenizer()
    hf = tiny_model("mixtral")
    encoded = tokenizer(["abcd", "efgh"], return_tensors="pt", return_token_type_ids=True)
    assert "token_type_ids" in encoded
    for wrapped in (moelens.wrap(hf), moelens.wrap(hf, tokenizer=tokenizer)):
        with torch.no_grad(), wrapped.trace(**encoded):
            logits = wrapped.output.logits.save()
        with torch.no_grad():
            assert torch.equal(logits, hf(**encoded).logits)
    hf = tiny_model("qwen4_exp", ple_layer_ids=[2])
    ids, other = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10, 11, 12]])
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(ids)
        plain = hf(inputs_embeds=embeds, ple_input_ids=other).logits
        assert not torch.allclose(plain, hf(inputs_embeds=embeds, ple_input_ids=ids).logits)
    wrapped = moelens.wrap(hf)
    with torch.no_grad(), wrapped.trace(inputs_embeds=embeds, ple_input_ids=other):
        logits = wrapped.output.logits.save()
    assert torch.equal(logits, plain)
    with pytest.raises(moelens.MoelensError, match=r"'ple_input_id'.*did you mean 'ple_input_ids'\?"):
        with torch.no_grad(), wrapped.trace(inputs_embeds=embeds, ple_input_id=other):
            wrapped.output.save()


@pytest.mark.filterwarnings("ignore:moelens.families.check")  # gemma4's block output is not checked: no mlp_output
@pytest.mark.parametrize("family", ["gemma4", "deepseek_v3"])
def test_check_of_a_model_accelerate_offloads_reads_the_offloaded_router_tensors(family, tmp_path):
    """families.check read gemma4's router.per_expert_scale and deepseek_v3's e_score_correction_bias (with
    offload_buffers=True) outside the forward, where accelerate keeps them on meta: torch's "Cannot copy out of meta
    tensor" / "Tensor on device meta is not on the expected device cpu". Ground truth: the check of the model loaded
    whole passes."""
    hf = tiny_model(family)
    ids = tiny_inputs(hf)["input_ids"]
    hf.save_pretrained(tmp_path / "checkpoint")
    assert moelens.families.check(moelens.load(tmp_path / "checkpoint"), ids)
    offloaded = moelens.load(tmp_path / "checkpoint", device_map="auto", max_memory={"cpu": 1}, offload_buffers=True,
                             offload_folder=str(tmp_path / "offload"))
    assert next(offloaded._module.parameters()).is_meta
    assert moelens.families.check(offloaded, ids)
    assert torch.equal(tiny_inputs(offloaded._module)["input_ids"], ids)  # on the CPU, not on meta with the weights


def test_nnsight_lazy_loading_is_refused_saying_what_serves_it(tmp_path):
    """nnsight's dispatch=False / meta_buffers= were refused by load as from_pretrained's TypeError, whose advice
    (pass nnsight settings to wrap) wrap refused in turn as a misspelling ("did you mean 'path'?")."""
    hf = tiny_model("mixtral")
    for keywords in ({"dispatch": False}, {"meta_buffers": True}):
        with pytest.raises(moelens.MoelensError, match=rf"moelens.wrap does not take {next(iter(keywords))}=: nnsight's lazy "
                                               r"loading .* device_map='auto', offload_folder=.*init_empty_weights"):
            moelens.wrap(hf, **keywords)
    hf.save_pretrained(tmp_path)
    with pytest.raises(moelens.MoelensError, match=r"moelens.load does not take dispatch=: nnsight's lazy loading"):
        moelens.load(tmp_path, dispatch=False)


@pytest.mark.parametrize("change", ["lora_on_shared_expert", "modules_to_save_on_experts"])
def test_a_peft_module_put_in_after_wrapping_gets_the_advice_that_works(change):
    """The replaced-module refusals advise merging only for what wrapping again refuses (an adapter layer on a block's
    router or experts, a modules_to_save wrapper), and wrapping again for a LoRA on a shared expert's Linear, which
    wraps as it is (getting-started.md). Ground truth: what moelens.wrap does with the model."""
    peft = pytest.importorskip("peft")
    hf = tiny_model("qwen2_moe")
    wrapped = moelens.wrap(hf)
    if change == "lora_on_shared_expert":  # into the layer list: peft does not turn these onto the fused experts there
        peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
                                     hf.model.layers)
    else:
        peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["experts"]))
    advice = r"Wrap the model again" if change == "lora_on_shared_expert" else r"merge_and_unload\(\)\)\.$"
    with pytest.raises(ValueUnavailable, match=advice):
        wrapped.moes[-1].params()
    if change == "lora_on_shared_expert":
        assert moelens.wrap(hf).moes[-1].params() is not None
    else:  # a trace read too: the original experts no longer run
        with pytest.raises(OrderError, match=advice), wrapped.trace(torch.tensor([[5, 9, 14, 3]])):
            wrapped.moes[-1].routed_output.save()
        with pytest.raises(FamilyError, match="modules_to_save"):
            moelens.wrap(hf)
