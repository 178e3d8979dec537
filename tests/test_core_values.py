"""Every family x every experts implementation: values equal their ground truth.

Ground truth is plain nnsight (a module cache on an unwrapped copy of the model)
and experts recomputed from their weights; see `groundtruth`.
"""

from __future__ import annotations

import typing

import jaxtyping
import nnsight
import pytest
import torch

from annotations import annotated_stub, assert_annotations_hold
from groundtruth import (
    CASES, EXTRA_LOGIT_COLUMNS, IDS, ascii_tokenizer, built, first_tensor, pre_activations_by_hand, raw_values,
    slots_by_hand,
    zero_compute_experts,
)
from moelens.families.entry import PER_SLOT_VALUES, get_path
from moelens.components.moe import Moe
from moelens.families.scoring import score
from moelens.testing import NOT_DECORATED

ATOL = 1e-6
#: Families whose shared experts take a router-made gate as a second input.
SHARED_GATED_BY_ROUTER = {"inkling"}


def running_moes(wrapped):
    """The MoE blocks that run on text-only input (ernie4_5_vl_moe's vision blocks do not)."""
    return [moe for moe in wrapped.moes if not moe.runs_only_on]


@pytest.fixture(scope="module")
def observed():
    """case -> (wrapped, hf, inputs, per-block served values, model output, plain output, raw values)."""
    results = {}

    def observe(family: str, impl: str):
        if (family, impl) not in results:
            hf, wrapped, inputs, plain, reference = built(family, impl)
            moes = running_moes(wrapped)
            with wrapped.trace(**inputs):
                served = nnsight.save([moe.save_all() for moe in moes])
                output = wrapped.output.save()
            names = [moe.path.removeprefix("model.") for moe in moes]
            raw = raw_values(reference, inputs, names, wrapped.family)
            results[(family, impl)] = (wrapped, hf, inputs, served, output, plain, [raw[n] for n in names])
        return results[(family, impl)]

    return observe


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_pass_through_is_bit_identical(observed, family, impl):
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    assert wrapped.moes, f"{family}: no MoE block found"
    assert torch.equal(first_tensor(output), plain)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_routing_values_match_plain_nnsight(observed, family, impl):
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    batch, seq = inputs["input_ids"].shape
    for moe, values, truth in zip(running_moes(wrapped), served, raw):
        logits = values["router_logits"]
        assert logits.shape[:2] == (batch, seq)
        expected = truth.logits.reshape(batch, seq, -1)
        if family in EXTRA_LOGIT_COLUMNS:
            logits = logits[..., : expected.shape[-1]]
        close(logits, expected)
        score_name = moe.family.resolve(moe.family.scoring.score, moe._module)
        close(values["router_probs"], score(score_name, expected if family not in EXTRA_LOGIT_COLUMNS else values["router_logits"]))
        if moe.family.derived_routing:
            top, indices = torch.topk(expected, moe.top_k, dim=-1)
            assert torch.equal(values["expert_indices"], indices)
            close(values["expert_weights"], score(score_name, top))
            continue
        _, indices, weights = truth.routing
        assert values["expert_indices"].dtype == torch.int64
        assert torch.equal(values["expert_indices"], indices.reshape(batch, seq, -1))
        close(values["expert_weights"], weights.reshape(batch, seq, -1))


#: Families whose weights are no function of the k chosen scores alone: inkling normalises them together with its
#: shared experts' gate columns, phimoe's sparsemixer takes a masked softmax per slot, zaya serves a slot that
#: chose its skip class as expert 0 with weight 0.
WEIGHTS_NOT_FROM_CHOSEN_SCORES = {"inkling", "phimoe", "zaya"}


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_the_scoring_entry_says_how_the_model_weighs_the_chosen_experts(observed, family, impl):
    """The family's Scoring (score, select, normalize, scale), applied by hand to the served logits and indices,
    gives the weights the model passed its experts: a wrong score function or normalisation flag in the table
    (which router_probs and the export's gate follow) fails here."""
    if family in WEIGHTS_NOT_FROM_CHOSEN_SCORES:
        pytest.skip(f"{family}: weights are no function of the chosen scores alone")
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    for moe, values in zip(running_moes(wrapped), served):
        scoring, block = moe.SCORING, moe._module
        logits, indices = values["router_logits"].float(), values["expert_indices"]
        name = moe.family.resolve(scoring.score, block)
        if scoring.select == "logit_topk":  # the chosen logits, then their score
            chosen = score(name, logits.gather(-1, indices))
        else:  # the scores of all the logits (a softmax over every column), then the chosen ones
            chosen = score(name, logits).gather(-1, indices)
        normalize = moe.family.resolve(scoring.normalize, block)
        if normalize is True or (not isinstance(normalize, bool) and normalize == 1):
            chosen = chosen / chosen.sum(-1, keepdim=True)
        if scoring.scale is not None:
            chosen = chosen * float(moe.family.resolve(scoring.scale, block))
        close(values["expert_weights"], chosen, atol=1e-6)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_outputs_match_plain_nnsight_and_weights(observed, family, impl):
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    batch, seq = inputs["input_ids"].shape
    for moe, values, truth in zip(running_moes(wrapped), served, raw):
        if "routed_output" in values:
            close(values["routed_output"], truth.routed_output.reshape(batch, seq, -1))
        if "mlp_output" in values:
            block_output = truth.block_output[0] if isinstance(truth.block_output, tuple) else truth.block_output
            close(values["mlp_output"], block_output.reshape(batch, seq, -1))
        if impl == "eager" or not moe.family.experts_call or "expert_outputs" not in values:
            continue
        hidden, indices, weights = truth.routing
        activations, outputs = slots_by_hand(moe.experts._module, hidden, indices, weights)
        close(values["expert_outputs"], outputs.reshape(batch, seq, *outputs.shape[1:]), atol=1e-5)
        close(values["expert_activations"], activations.reshape(batch, seq, *activations.shape[1:]), atol=1e-5)
        close(values["expert_outputs"].sum(2), values["routed_output"], atol=1e-6)
        pre = pre_activations_by_hand(moe.experts._module, hidden, indices)
        close(values["expert_pre_activations"], pre.reshape(batch, seq, *pre.shape[1:]), atol=1e-5)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_gate_and_up_split_the_pre_activations_as_the_fused_weight_is_stored(observed, family, impl):
    """moe.gate_and_up gives each slot's projection by the gate rows and by the up rows of its expert's fused weight
    (split here by transformers' own flag: halves, or interleaved where is_concatenated is False), and where the
    experts gate with transformers' default function, act(gate) * up is the served expert_activations."""
    from transformers.integrations.moe import _default_apply_gate

    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    checked = 0
    for moe, values, truth in zip(running_moes(wrapped), served, raw):
        experts = moe.experts._module
        if "expert_pre_activations" not in values or not getattr(experts, "has_gate", False):
            continue
        gate, up = moe.gate_and_up(values["expert_pre_activations"])
        hidden, indices, _ = truth.routing
        fused = experts.gate_up_proj if experts.is_transposed else experts.gate_up_proj.transpose(-1, -2)  # [E, D, 2I]
        bias = experts.gate_up_proj_bias if experts.has_bias else torch.zeros(fused.shape[0], fused.shape[-1])
        rows = (slice(0, None, 2), slice(1, None, 2)) if not experts.is_concatenated else \
            (slice(0, fused.shape[-1] // 2), slice(fused.shape[-1] // 2, None))
        for part, served_part in zip(rows, (gate, up)):
            by_hand = torch.einsum("td,tkdi->tki", hidden, fused[indices][..., part]) + bias[indices][..., part]
            close(served_part, by_hand.reshape(served_part.shape), atol=1e-5)
        if type(experts)._apply_gate is _default_apply_gate:
            close(experts.act_fn(gate) * up, values["expert_activations"])
        checked += 1
    if not checked:  # test_every_value_the_model_computes_is_served checks that nothing servable was left out
        pytest.skip(f"{family}/{impl}: no gated experts with per-slot values served")


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_every_value_the_model_computes_is_served(observed, family, impl):
    """save_all leaves out only what the block cannot serve: the checks below run on what it gives, so a value
    wrongly refused (the granite families' shared expert on the decoder layer, per-slot values under batched_mm)
    slipped through them. Truth: the model's own modules and the experts implementation it runs."""
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    for moe, values in zip(running_moes(wrapped), served):
        spec, block = moe.family.shared, moe._module
        host = hf.get_submodule(moe.path.removeprefix("model.").rpartition(".")[0]) if spec and spec.on_layer else block
        has_shared = spec is not None and isinstance(getattr_path(host, spec.module), torch.nn.Module)
        assert ("shared_expert_output" in values) == has_shared, (moe.path, sorted(values))
        per_slot = (impl != "eager" and family not in NOT_DECORATED and not moe.family.refused
                    and not zero_compute_experts(hf))
        assert set(PER_SLOT_VALUES) <= set(values) or not per_slot, (moe.path, sorted(values))


def getattr_path(root, path: str):
    """``root``'s attribute at the dotted ``path``, or None."""
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_shared_expert_and_recombination(observed, family, impl):
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    batch, seq = inputs["input_ids"].shape
    for moe, values, truth in zip(running_moes(wrapped), served, raw):
        block = moe._module
        if "shared_expert_output" in values:
            shared = moe.shared_experts._module
            spec = moe.family.shared
            with torch.no_grad():
                if spec.on_layer or not moe.family.block_attr or family in SHARED_GATED_BY_ROUTER:
                    # its input (or its gate) is not the block input: checked through the recombination
                    expected = None
                else:
                    shared_in = truth.block_input
                    expected = shared(shared_in)
                    if spec.gate is not None:
                        expected = torch.sigmoid(get_path(block, spec.gate)(shared_in)) * expected
            if expected is not None:
                close(values["shared_expert_output"], expected.reshape(batch, seq, -1), atol=1e-5)
        if "mlp_output" in values and "routed_output" in values:
            with torch.no_grad():
                combined = moe.family.combined(block, values["routed_output"], values.get("shared_expert_output"))
            close(combined, values["mlp_output"], atol=1e-5)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_every_value_has_the_shape_and_dtype_its_annotation_names(observed, family, impl):
    """Each served value's jaxtyping annotation (``Float[Tensor, "b s k h"]``, the documented shape) holds, with one
    size per name across all of a block's values (``b``, ``s`` the input's; ``k`` every per-slot value's; ``h`` the
    experts' width D, ``m`` the model's M: they differ in nemotron_h's and muse_spark's narrower experts). The
    logits of families with extra logit columns are left out: their E is not the probabilities' (docs/values.md)."""
    wrapped, hf, inputs, served, output, plain, raw = observed(family, impl)
    for moe, values in zip(running_moes(wrapped), served):
        assert_annotations_hold([("input_ids", inputs["input_ids"], jaxtyping.Int[torch.Tensor, "b s"])] + [
            (name, value, typing.get_type_hints(annotated_stub(Moe, name))["return"]) for name, value in values.items()
            if not (name == "router_logits" and family in EXTRA_LOGIT_COLUMNS)
        ])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_llama4_expert_weights_are_the_scores_its_router_returns(dtype):
    """llama4 has no experts call: its weights are recomputed from the logits, and must equal (dtype
    included) the router's own scores, sigmoid in float32 cast back to the model's dtype."""
    import copy

    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("llama4", dtype=dtype)
    inputs = tiny_inputs(hf)
    plain = nnsight.NNsight(copy.deepcopy(hf))
    model = moelens.wrap(hf)
    moe = model.moes[0]
    with torch.no_grad(), model.trace(**inputs):
        weights, indices = moe.expert_weights.save(), moe.expert_indices.save()
    with torch.no_grad(), plain.trace(**inputs):
        scores = plain.get(f"{moe.path.removeprefix('model.')}.{moe.family.router}").output[0].save()  # [T, E]
    flat_indices = indices.reshape(-1, indices.shape[-1])
    expected = scores.reshape(flat_indices.shape[0], -1).gather(1, flat_indices)
    assert weights.dtype == dtype
    # bit-equal in every dtype: the sigmoid is taken over every logit, then gathered, as the router takes it (over
    # the k chosen logits alone, float32 differed in the last bit: the vectorised and the tail path round apart)
    assert torch.equal(weights.reshape(expected.shape), expected)


def test_llama4_derived_routing_is_refused_under_a_forward_hook_on_its_router():
    """A user's forward hook on llama4's router may change the scores the block goes on with after the logits op
    moelens derives expert_weights from: they came out twice the weights the block used under a halving hook."""
    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("llama4")
    inputs = tiny_inputs(hf)
    model = moelens.wrap(hf)
    moe = model.moes[0]
    handle = moe.router._module.register_forward_hook(lambda module, args, output: (output[0] * 0.5, output[1]))
    try:
        with pytest.raises(moelens.ValueUnavailable, match=r"expert_weights cannot be served: the llama4 block calls no "
                                                           r"experts module, .* the router has a forward hook"):
            with torch.no_grad(), model.trace(**inputs):
                moe.expert_weights.save()
        with torch.no_grad(), model.trace(**inputs):
            saved = moe.save_all()
        assert "router_logits" in saved and "expert_weights" not in saved and "expert_indices" not in saved
    finally:
        handle.remove()
    with torch.no_grad(), model.trace(**inputs):
        weights = moe.expert_weights.save()
    assert weights.shape[-1] == moe.top_k


def test_zero_compute_experts_pass_their_input_through(observed):
    """longcat_flash: routed_output is, per slot, its weight times its expert's SwiGLU FFN of the input (from
    the params() views, checked against the module in test_params), or times the input itself for one of the
    last zero_expert_num experts."""
    wrapped, hf, inputs, served, output, plain, raw = observed("longcat_flash", "eager")
    zero_compute_slots = 0
    for moe, values, truth in zip(running_moes(wrapped), served, raw):
        params = moe.params()
        with_weights = params.up.shape[0]
        assert with_weights == moe.num_experts - hf.config.zero_expert_num
        hidden, indices, weights = truth.routing  # the router's choice, by plain nnsight
        hidden = hidden.reshape(-1, params.up.shape[-1])
        indices, weights = indices.reshape(hidden.shape[0], -1), weights.reshape(hidden.shape[0], -1)
        expected = torch.zeros_like(hidden)
        with torch.no_grad():
            for token, (row, slot_weights) in enumerate(zip(indices.tolist(), weights)):
                for expert, weight in zip(row, slot_weights):
                    x = hidden[token]
                    if expert < with_weights:
                        x = params.down[expert] @ (torch.nn.functional.silu(params.gate[expert] @ x) * (params.up[expert] @ x))
                    expected[token] += weight * x
        zero_compute_slots += int((indices >= with_weights).sum())
        close(values["routed_output"], expected.reshape(values["routed_output"].shape), atol=1e-6)
    assert zero_compute_slots  # the identity path ran


def test_the_remote_path_refuses_a_moelens_that_is_not_installed(monkeypatch):
    """Run from a source tree on the path (not pip-installed), nnsight shipped moelens by value and pickling its run
    state failed with "TypeError: cannot pickle '_thread.lock' object"."""
    import importlib.metadata

    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral")
    model, inputs = moelens.wrap(hf, tokenizer=ascii_tokenizer()), tiny_inputs(hf)
    installed = importlib.metadata.packages_distributions()
    assert "moelens" in installed  # as the README installs it: the remote path works (the test below)
    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {name: dists for name, dists in installed.items() if name != "moelens"})
    for run in (lambda: model.trace(**inputs, remote="local"), lambda: model.session(remote="local")):
        with pytest.raises(moelens.MoelensError, match=r"remote='local': .* moelens is not installed here .* install "
                                                       r"it \(pip install -e <the moelens checkout>\)"):
            with run():
                model.output.save()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_nnsights_serialised_remote_path_serves_the_same_values_and_edits(family):
    """``remote="local"``: nnsight serialises the trace as for NDIF and runs it back here. Values, a write and an
    intervention come out as in a plain trace (ground truth: the same reads in a plain trace, and torch hooks)."""
    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model(family)
    model, inputs = moelens.wrap(hf, tokenizer=ascii_tokenizer()), tiny_inputs(hf)  # nnsight's remote path needs one
    hooked = {}
    handle = model.moes[1]._module.register_forward_hook(lambda module, args, output: hooked.setdefault("out", output))

    def run(**kwargs):
        with model.trace(**inputs, **kwargs):
            values = model.moes[0].save_all()
            moelens.steer(model.moes[1], 3, 50.0)  # expert 3 in every token's top-k
            block = model.moes[1].mlp_output.save()
            logits = model.output.logits.save()
        return values, block, logits

    try:
        (values, block, logits), (local_values, local_block, local_logits) = run(remote="local"), run()
    finally:
        handle.remove()
    assert values.keys() == local_values.keys() and all(torch.equal(values[n], local_values[n]) for n in values)
    assert torch.equal(block, local_block) and torch.equal(logits, local_logits)
    out = hooked["out"][0] if isinstance(hooked["out"], tuple) else hooked["out"]
    torch.testing.assert_close(block, out, rtol=0, atol=0)  # the steered block's own output, seen by torch
    with model.trace(**inputs):
        clean = model.output.logits.save()
    assert not torch.equal(clean, logits) and torch.equal(clean, hf(**inputs).logits)
    bare = moelens.wrap(hf)  # remote= went to the model as an input, refused as text
    with bare.trace(**inputs, remote=False):  # a remote=REMOTE switch, off: a plain trace
        off = bare.output.logits.save()
    assert torch.equal(off, clean)
    with pytest.raises(moelens.MoelensError, match=r"remote='local' runs nnsight's remote path, which comes with "
                                                   r"a model wrapped with its tokenizer"):
        with bare.trace(**inputs, remote="local"):
            bare.output.logits.save()
