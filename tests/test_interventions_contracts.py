"""Contracts of the interventions (ablate, reroute, steer, force) the other tests left open.

Ground truth is independent of moelens: the same edit made with plain nnsight on an unwrapped
copy of the model (the raw router logits op, the raw experts call's arguments), or hand-built
expectations on a tiny seeded model.
"""

from __future__ import annotations

import dataclasses
import warnings

import nnsight
import pytest
import torch

import moelens
from groundtruth import built, first_tensor
from moelens import WriteError


@pytest.fixture(scope="module")
def mixtral():
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    return wrapped, inputs


def running_moes(wrapped):
    return [moe for moe in wrapped.moes if not moe.runs_only_on]


def plain_edit(reference, inputs, moes, edit) -> torch.Tensor:
    """The model output with ``edit(envoy_of_block, moe)`` applied by plain nnsight on the unwrapped copy."""
    plain = nnsight.NNsight(reference)
    with plain.trace(**inputs):
        for moe in moes:
            edit(plain.get(moe.path.removeprefix("model.")), moe)
        output = plain.output.save()
    return first_tensor(output)


def logits_op(block, moe):
    """The router's raw logits op (plain nnsight)."""
    return block.get(moe.family.router).source.__getattr__(moe.family.logits_op)


def fails(wrapped, inputs, call, match):
    with pytest.raises(WriteError, match=match):
        with wrapped.trace(**inputs):
            call(wrapped.moes[0])


# -- steer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_steer_adds_its_bias_to_the_raw_logit(family):
    """steer adds the bias to the expert's logit (it does not set the logit to the bias): the same as adding it
    to the router's raw logits op output by hand, group-limited routing (deepseek_v3) included."""
    hf, wrapped, inputs, plain, reference = built(family, "grouped_mm" if family != "deepseek_v3" else "eager")
    moes = running_moes(wrapped)
    expert, bias = 2, 1.5
    with wrapped.trace(**inputs):
        for moe in moes:
            moelens.steer(moe, expert, bias)
        output = wrapped.output.save()

    def edit(block, moe):
        op = logits_op(block, moe)
        logits = op.output.clone()
        logits[..., expert] += bias
        op.output = logits

    expected = plain_edit(reference, inputs, moes, edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(first_tensor(output), plain), "a bias of 1.5 changed nothing: the test would not notice"


def test_steer_of_a_routed_around_expert_leaves_its_minus_inf_logit_alone(mixtral):
    """A -inf logit (route_around) plus a finite bias is -inf, not an overflow: the steer is taken, the expert
    stays out of every token's top-k."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        moelens.ablate(moe, 3, "route_around")
        moelens.steer(moe, 3, 5.0)
        logits = moe.router_logits.save()
        indices = moe.expert_indices.save()
    assert torch.isneginf(logits[..., 3]).all() and not (indices == 3).any()


# -- ids checked ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "match"), [
    (lambda moe: moelens.steer(moe, -1, 1.0), r"expert -1 is out of range"),  # would steer the last expert
    (lambda moe: moelens.ablate(moe, -1), r"expert -1 is out of range"),  # would ablate nothing
    (lambda moe: moelens.ablate(moe, -1, "route_around"), r"expert -1 is out of range"),
    (lambda moe: moelens.force(moe, [-1]), r"expert -1 is out of range"),
    (lambda moe: moelens.ablate(moe, 1, "swap", to=2.5), r"to must be an int expert id in \[0, 8\), got 2.5"),
    (lambda moe: moelens.ablate(moe, 1, "swap", to=True), r"to must be an int expert id in \[0, 8\), got True"),
    (lambda moe: moelens.ablate(moe, 1, "swap", to=8), r"to 8 is out of range"),
    (lambda moe: moelens.ablate(moe, 1, "swap", to=-1), r"to -1 is out of range"),
    (lambda moe: moelens.ablate(moe, 1, "route_around", to=2), r"to=2\) only applies to mode='swap', not 'route_around'"),
    (lambda moe: moelens.reroute(moe, (..., 0), -1), r"reroute: expert ids -1 must be in \[0, 8\)"),
    (lambda moe: moelens.reroute(moe, (..., 0), [2, -3]), r"reroute: expert ids \[2, -3\] must be in \[0, 8\)"),
], ids=["steer-neg", "zero-neg", "route-around-neg", "force-neg", "swap-to-float", "swap-to-bool", "swap-to-E",
        "swap-to-neg", "route-around-to", "reroute-neg", "reroute-neg-row"])
def test_expert_ids_outside_the_block_are_refused_by_the_intervention(mixtral, call, match):
    wrapped, inputs = mixtral
    fails(wrapped, inputs, call, match)


# -- token selection -----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [slice(None), Ellipsis, (slice(None), slice(None))], ids=["slice", "ellipsis", "tuple"])
def test_a_whole_selection_forces_every_token_as_no_selection_does(mixtral, tokens):
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        moelens.force(moe, 6)
        everywhere = moe.router_logits.save()
    with wrapped.trace(**inputs):
        moelens.force(moe, 6, tokens=tokens)
        selected = moe.router_logits.save()
        indices = moe.expert_indices.save()
    assert torch.equal(selected, everywhere) and (indices == 6).any(-1).all()


# -- model.scan ----------------------------------------------------------------------------------


def test_reroute_in_scan_takes_a_tensor_of_ids_made_there():
    """In model.scan a tensor made inside it is fake (no ids to show or check): reroute takes it, unchecked, as
    it takes one made before the scan (checked)."""
    model = moelens.load()
    model.set_experts_implementation("batched_mm")  # grouped_mm has no fake float32 kernel on CPU
    moe = model.moes[1]
    prompt = "The quick brown fox"
    with model.scan(prompt):
        moelens.reroute(moe, (..., 0), torch.tensor([1, 2]))
        shape = nnsight.save(model.output.logits.shape)
    ids = model.tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert tuple(shape) == (1, ids.shape[1], model.config.vocab_size)


# -- force ---------------------------------------------------------------------------------------


def lift(logits: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """force's lift written out: the experts' logits (non-finite ones taken as 0) plus the finite logits' range + 30."""
    finite = logits.masked_fill(~torch.isfinite(logits), 0)
    raised = logits.clone()
    raised[..., experts] = finite[..., experts] + (finite.amax(-1, keepdim=True) - finite.amin(-1, keepdim=True) + 30.0)
    return raised


def test_force_after_route_around_lifts_by_the_finite_logits_range(mixtral):
    """A routed-around expert's -inf logit is left out of the range force lifts by (else the lift is inf and the
    softmax weights NaN): the same as route_around then the lift, by hand on the raw logits op."""
    _, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moes = running_moes(wrapped)
    with wrapped.trace(**inputs):
        for moe in moes:
            moelens.ablate(moe, 3, "route_around")
            moelens.force(moe, 5)
        output = wrapped.output.save()

    def edit(block, moe):
        op = logits_op(block, moe)
        logits = op.output.clone()
        logits[..., 3] = float("-inf")
        op.output = lift(logits, [5])

    expected = plain_edit(reference, inputs, moes, edit)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)


def test_force_lifts_by_the_logits_range_plus_30(mixtral):
    """The documented lift: the forced experts' logits go up by each token's logits range + 30 (max - min + 30),
    so a forced expert 30 below the others still comes first; every other logit stays."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        clean = moe.router_logits.clone().save()
    shifted = clean.clone()
    shifted[..., 1] -= 60.0  # expert 1 far below the rest: only max - min + 30 lifts it above them
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.router_logits = shifted
        moelens.force(moe, [1, 4])
        logits = moe.router_logits.save()
        indices = moe.expert_indices.save()
    torch.testing.assert_close(logits, lift(shifted, [1, 4]), atol=1e-5, rtol=1e-6)
    assert (indices.sort(-1).values == torch.tensor([1, 4], device=indices.device)).all()


def test_force_raises_an_expert_whose_logit_is_minus_inf(mixtral):
    """force puts its experts first whatever their logit: one written to -inf is lifted from 0 and picked."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        moe.router_logits[..., 5] = float("-inf")
        moelens.force(moe, 5)
        logits = moe.router_logits.save()
        indices = moe.expert_indices.save()
    assert torch.isfinite(logits).all() and (indices == 5).any(-1).all()


def experts_call_arguments(reference, inputs, moe, edit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and weights ``moe``'s experts module is called with on the unwrapped copy (a torch pre-hook),
    with ``edit(logits)`` written to the raw router logits op by plain nnsight first, if given."""
    seen = {}
    path = moe.path.removeprefix("model.")  # the tiny models are the base models
    experts = reference.get_submodule(path).get_submodule(moe.family.experts)
    handle = experts.register_forward_pre_hook(lambda module, args: seen.update(indices=args[1], weights=args[2]))
    try:
        plain = nnsight.NNsight(reference)
        with torch.no_grad(), plain.trace(**inputs):
            if edit is not None:
                op = logits_op(plain.get(path), moe)
                op.output = edit(op.output)
    finally:
        handle.remove()
    return seen["indices"], seen["weights"]


def test_force_on_sparsemixer_keeps_the_weights_the_router_gives_the_forced_experts():
    """phimoe's sparsemixer masks each slot's softmax by the gap to the top logit relative to its size. Forcing
    the experts each token already picks changes neither its experts nor their weights, and forcing any top_k
    experts weights them as the router does with every other expert out of reach (their logits -inf)."""
    _, wrapped, inputs, plain, reference = built("phimoe", "eager")
    moe = wrapped.moes[1]
    natural_indices, natural_weights = experts_call_arguments(reference, inputs, moe)
    pairs, counts = natural_indices.unique(dim=0, return_counts=True)
    pair = pairs[counts.argmax()].tolist()  # the pair (in slot order) most tokens pick
    same = (natural_indices == torch.tensor(pair)).all(-1).view(inputs["input_ids"].shape)
    assert 1 < int(same.sum()) < same.numel()
    with torch.no_grad(), wrapped.trace(**inputs):
        moelens.force(moe, pair, tokens=same)
        indices, weights = moe.expert_indices.save(), moe.expert_weights.save()
    assert torch.equal(indices.reshape(natural_indices.shape), natural_indices)
    assert torch.equal(weights.reshape(natural_weights.shape), natural_weights)

    forced = [2, 6]  # expert 6 written within 1% of expert 2, so the two share slot 0's softmax (jitter 0.01)

    def close(logits):
        logits = logits.clone()
        logits[..., 6] = logits[..., 2] * 0.99
        return logits

    def others_out_of_reach(logits):
        out = torch.full_like(logits, float("-inf"))
        out[..., forced] = close(logits)[..., forced]
        return out

    expected_indices, expected_weights = experts_call_arguments(reference, inputs, moe, others_out_of_reach)
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.router_logits = close(moe.router_logits)
        moelens.force(moe, forced)
        indices, weights = moe.expert_indices.save(), moe.expert_weights.save()
    assert torch.equal(indices.reshape(expected_indices.shape), expected_indices)
    assert (expected_weights < 1).any()  # some token's second forced expert is close enough to share slot 0
    torch.testing.assert_close(weights.reshape(expected_weights.shape), expected_weights)


@pytest.mark.parametrize("tokens", [(..., 1), "mask"], ids=["position", "mask"])
def test_force_on_some_tokens_of_a_group_limited_router_matches_plain_nnsight(tokens):
    """deepseek_v3 (4 groups of 2, 2 kept, score + correction bias ranked): force on some tokens lifts their logits
    and sets their selection scores to +inf, and leaves every other token's routing as the router made it."""
    _, wrapped, inputs, plain, reference = built("deepseek_v3", "eager")
    moes = [moe for moe in running_moes(wrapped) if moe.ranks_selection_scores]
    assert moes and all(moe.family.groups_of(moe._module) for moe in moes)
    batch, seq = inputs["input_ids"].shape
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    if tokens == "mask":
        mask[0, 3] = mask[1, 0] = True
        tokens = mask
    else:
        mask[:, 1] = True
    forced = [6, 7]  # one group
    with wrapped.trace(**inputs):
        routed = nnsight.save([moe.expert_indices for moe in moes])
    with wrapped.trace(**inputs):
        picked = nnsight.save([])
        for moe in moes:
            moelens.force(moe, forced, tokens=tokens)
            picked.append(moe.expert_indices)
        output = wrapped.output.save()
    for before, after in zip(routed, picked):
        assert torch.equal(after[~mask], before[~mask])
        assert (after[mask].sort(-1).values == torch.tensor(forced, device=after.device)).all()
    rows = mask.reshape(-1)  # the raw ops hold the tokens flat, [batch * seq, E]

    def edit(block, moe):
        op = logits_op(block, moe)
        logits = op.output.clone()
        logits[rows] = lift(logits[rows], forced)
        op.output = logits
        selection = block.get(moe.family.router).source.__getattr__(moe.SCORING.selection_op)
        scores = selection.output.clone()
        scores[rows.nonzero()[:, :1], torch.tensor(forced)] = float("inf")
        selection.output = scores

    torch.testing.assert_close(first_tensor(output), plain_edit(reference, inputs, moes, edit), atol=1e-6, rtol=1e-6)


@pytest.fixture
def afmoe_without_selection_op():
    """afmoe (sigmoid scores + a selection bias) registered without the op where score + bias is ranked: force
    can only raise the logits there and checks the resulting indices. The bias grows with the expert id."""
    from moelens import families
    from moelens.testing import tiny_inputs, tiny_model

    afmoe = families.get("afmoe")
    unbound = dataclasses.replace(afmoe, name="afmoe_unbound",
                                  scoring=dataclasses.replace(afmoe.scoring, selection_op=None, selection_arg=None))
    families.register(unbound, replace=True)
    try:
        hf = tiny_model("afmoe")
        wrapped = moelens.wrap(hf)
        moe = next(moe for moe in wrapped.moes if moe.SCORING.selection_bias)
        assert moe.family.name == "afmoe_unbound" and not moe.ranks_selection_scores
        with torch.no_grad():
            bias = moe.family.resolve(moe.SCORING.selection_bias, moe._module)
            bias[:] = torch.arange(moe.num_experts, dtype=bias.dtype) * 0.1
        yield wrapped, moe, tiny_inputs(hf, batch=1, seq=6)["input_ids"]
    finally:
        families.unregister("afmoe_unbound")


def test_force_checks_that_every_forced_expert_reached_the_tokens(afmoe_without_selection_op):
    """Forced [E-2, 0] under a steered expert E-1: E-2 (bias 0.6) still makes the top 2, 0 (bias 0) does not, so
    the tokens miss one forced expert: refused, though each holds some forced expert."""
    wrapped, moe, ids = afmoe_without_selection_op
    assert moe.top_k == 2
    last = moe.num_experts - 1
    with wrapped.trace(ids):
        moelens.steer(moe, last, 30.0)
        moelens.force(moe, [last - 1])  # one forced expert alone: it outranks all but the steered one
        indices = moe.expert_indices.save()
    assert (indices.sort(-1).values == torch.tensor([last - 1, last], device=indices.device)).all()
    with pytest.raises(WriteError, match=rf"raising the logits of experts \[{last - 1}, 0\] left 6 of 6 tokens"):
        with wrapped.trace(ids):
            moelens.steer(moe, last, 30.0)
            moelens.force(moe, [last - 1, 0])


def test_force_on_some_tokens_checks_only_those_tokens(afmoe_without_selection_op):
    """The check after force looks at the forced tokens: the others keep the router's choice, without the expert."""
    wrapped, moe, ids = afmoe_without_selection_op
    with torch.no_grad():  # no bias: a forced expert's saturated score (1) outranks every other
        moe.family.resolve(moe.SCORING.selection_bias, moe._module).zero_()
    with wrapped.trace(ids):
        routed = moe.expert_indices.save()
    expert = next(e for e in range(moe.num_experts) if not (routed[0] == e).any(-1).all())
    with wrapped.trace(ids):
        moelens.force(moe, [expert], tokens=(..., 0))
        forced = moe.expert_indices.save()
    assert (forced[0, 0] == expert).any() and torch.equal(forced[0, 1:], routed[0, 1:])
    assert not (forced[0] == expert).any(-1).all()  # so a check of every token would refuse it


def test_force_refuses_logits_too_coarse_to_stay_above_the_others():
    """bfloat16 after a steer of 1e4: the raised logit rounded into a tie with the steered one, and the forced
    expert was silently not picked."""
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", dtype=torch.bfloat16, num_experts_per_tok=1)
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):  # where bfloat16 still steps finely enough, the forced expert is every token's
        moelens.steer(moe, 0, 1000.0)
        moelens.force(moe, [5])
        indices = moe.expert_indices.save()
    assert (indices == 5).all()
    with pytest.raises(WriteError, match=r"router logits reach 9984, where torch.bfloat16 is too coarse .* experts "
                                         r"\[5\] raised above the others to stay above them; steer by less"):
        with warnings.catch_warnings():  # with autograd on, the refusal's numbers made torch warn of a scalar taken
            warnings.simplefilter("error")  # from a tensor that requires grad
            with wrapped.trace(**inputs):
                moelens.steer(moe, 0, 1e4)
                moelens.force(moe, [5])


def test_check_notes_a_selection_bias_named_without_the_op_that_ranks_it(afmoe_without_selection_op):
    """families.check passed such an entry without a word; route_around then refused where the bias still picked the
    expert, naming no fix. It notes the missing op now, listing the router's ops to name."""
    from moelens import families

    wrapped, moe, ids = afmoe_without_selection_op
    with pytest.warns(UserWarning, match=r"its entry names a selection bias but no op where the router ranks scores "
                                         r"plus that bias \(Scoring\.selection_op.*The router's ops after \w+: .*"
                                         r"torch_topk_0"):
        families.check(wrapped, ids)


def test_route_around_checks_that_a_selection_bias_without_an_op_did_not_pick_the_expert(afmoe_without_selection_op):
    """Where the entry names no op for score + bias (ergo's ``(scores + bias).topk``), route_around can only set the
    logit to -inf, and a large enough bias still picks the expert (score 0 + bias): refused, not silently kept."""
    wrapped, moe, ids = afmoe_without_selection_op
    last = moe.num_experts - 1
    bias = moe.family.resolve(moe.SCORING.selection_bias, moe._module)
    with torch.no_grad():
        bias[last] = 5.0
    with pytest.raises(WriteError, match=rf"its selection bias still picked expert {last} at a -inf logit for 6 of 6 "
                                         r"tokens.*; or, in your entry, name the router op whose output is the scores "
                                         r"plus the bias it ranks \(Scoring\(selection_op=\.\.\.\)"):
        with wrapped.trace(ids):
            moelens.ablate(moe, last, "route_around")
    with torch.no_grad():
        bias.zero_()
    with wrapped.trace(ids):
        moelens.ablate(moe, last, "route_around")
        indices = moe.expert_indices.save()
    assert not (indices == last).any()


def test_route_around_checks_that_the_bias_picks_no_expert_routed_around_before(afmoe_without_selection_op):
    """Routing a second expert around frees a slot that the selection bias can hand to an expert routed around
    before it (score 0 + bias): the check looked only at the expert just routed around, so expert 0 ran again, at
    weight 0, with no error (and the other order raised). The truth: the same two logits set to -inf by hand, read
    at the experts call, pick expert 0."""
    wrapped, moe, ids = afmoe_without_selection_op
    bias = moe.family.resolve(moe.SCORING.selection_bias, moe._module)
    kept = bias.clone()
    with torch.no_grad():
        bias.zero_()
        bias[[1, 2]] = 0.45  # ranked first, over every unbiased expert (sigmoid scores about 0.5)
        bias[0] = 0.75  # at a -inf logit still over the unbiased experts, under 1 and 2
    try:
        with wrapped.trace(ids):
            logits = moe.router_logits
            logits[..., 0] = float("-inf")
            alone = moe.expert_indices.save()
        with wrapped.trace(ids):
            logits = moe.router_logits
            logits[..., [0, 1]] = float("-inf")
            by_hand = moe.expert_indices.save()
        assert not (alone == 0).any() and (by_hand == 0).any()
        with wrapped.trace(ids):
            moelens.ablate(moe, 0, "route_around")  # taken: 1 and 2 hold the slots
        with pytest.raises(WriteError, match=r"its selection bias still picked expert 0 at a -inf logit"):
            with wrapped.trace(ids):
                moelens.ablate(moe, 0, "route_around")
                moelens.ablate(moe, 1, "route_around")
    finally:
        with torch.no_grad():
            bias.copy_(kept)


def test_a_selection_bias_without_an_op_still_takes_several_routing_edits_on_one_block(afmoe_without_selection_op):
    """The check after route_around / force recomputes the router's choice from the logits written so far: reading it
    at the experts call ran the router, so a second route_around, or route_around after force (the documented
    order), raised an OrderError on ergo. Truth: the same logit edits made by hand, read at the experts call."""
    wrapped, moe, ids = afmoe_without_selection_op
    with torch.no_grad():
        moe.family.resolve(moe.SCORING.selection_bias, moe._module).zero_()
    with wrapped.trace(ids):
        moelens.force(moe, [0])
        moelens.ablate(moe, 5, "route_around")
        moelens.ablate(moe, 6, "route_around")
        indices = moe.expert_indices.save()
    with wrapped.trace(ids):
        logits = moe.router_logits
        logits[..., [5, 6]] = float("-inf")
        logits[..., 0] = 100.0  # sigmoid 1: the top score
        by_hand = moe.expert_indices.save()
    assert torch.equal(indices.sort(-1).values, by_hand.sort(-1).values)
    assert (indices == 0).any(-1).all() and not ((indices == 5) | (indices == 6)).any()


def test_route_around_with_the_logit_removes_the_expert_from_an_unrenormalised_softmax():
    """zaya weights its experts by softmax scores it does not renormalise and ranks them with a selection bias:
    route_around (the selection score) leaves the expert's probability in the softmax, as docs/interventions.md
    says; setting its logit to -inf first gives the weights of a router without that expert (its logit and its
    bias -inf on an unwrapped copy), bit for bit."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("zaya")
    reference, wrapped, ids = copy.deepcopy(hf), moelens.wrap(hf), tiny_inputs(hf)["input_ids"]
    moe, expert = wrapped.moes[1], 3
    assert moe.ranks_selection_scores and not moe.family.normalize_of(moe._module)
    router = reference.get_submodule(moe.path.removeprefix("model.")).gate
    with torch.no_grad():
        router.balancing_biases[expert] = float("-inf")
    router.router_mlp.register_forward_hook(lambda module, args, out: out.index_fill(-1, torch.tensor([expert]),
                                                                                      float("-inf")))
    seen = {}
    router.register_forward_hook(lambda module, args, out: seen.update(weights=out[1], indices=out[2]))
    with torch.no_grad():
        reference(ids)
    results = {}
    for with_logit in (False, True):
        with torch.no_grad(), wrapped.trace(ids):
            if with_logit:
                moe.router_logits[..., expert] = float("-inf")
            moelens.ablate(moe, expert, "route_around")
            results[with_logit] = (moe.expert_weights.save(), moe.expert_indices.save())
    for weights, indices in results.values():
        assert torch.equal(indices.reshape(seen["indices"].shape), seen["indices"])
    assert torch.equal(results[True][0].reshape(seen["weights"].shape), seen["weights"])
    kept = results[False][0].reshape(seen["weights"].shape)  # e's probability stays in the softmax
    assert (kept <= seen["weights"]).all() and (kept < seen["weights"]).any()


# -- spellings of arguments --------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["set", "generator", "dict keys", "reversed tuple"])
def test_force_takes_any_iterable_of_expert_ids_as_the_list(mixtral, spelling):
    """force(moe, {3, 5}), a generator or dict keys were refused ("expert must be an int expert id ... got {3, 5}")
    though a list was taken; force does not depend on the order its experts come in, so any iterable of ids is
    taken, with results bit-identical to the list's. Ground truth: the list spelling's run (router_logits, indices
    and block output read after force), and its logits against the documented lift written out by hand."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    given = {"set": lambda: {5, 3}, "generator": lambda: (expert for expert in (5, 3)),
             "dict keys": lambda: dict.fromkeys((5, 3)).keys(), "reversed tuple": lambda: (5, 3)}[spelling]
    runs = []
    for experts in ([3, 5], given()):
        with torch.no_grad(), wrapped.trace(**inputs):
            clean = moe.router_logits.clone().save()
            moelens.force(moe, experts)
            runs.append((clean, moe.router_logits.save(), moe.expert_indices.save(), moe.output.save()))
    (clean, logits, indices, output), spelled = runs
    for value, expected in zip(spelled, runs[0]):
        assert torch.equal(value, expected)
    torch.testing.assert_close(logits, lift(clean, [3, 5]), atol=1e-5, rtol=1e-6)
    assert (indices.sort(-1).values == torch.tensor([3, 5], device=indices.device)).all()


@pytest.mark.parametrize("call, match", [
    (lambda moe: moelens.force(moe, "35"), r"^force: experts='35' is str, not expert ids; pass an int expert id, or "
                                           r"a list of them"),
    (lambda moe: moelens.force(moe, b"3"), r"^force: experts=b'3' is bytes, not expert ids"),
    (lambda moe: moelens.force(moe, {3: 0.7, 5: 0.3}), r"^force: experts=\{3: 0.7, 5: 0.3\} is dict, not expert ids; "
                                                      r".*force takes no weights"),
    (lambda moe: moelens.reroute(moe, None, [1, 2]), r"^reroute: tokens=None selects no tokens; reroute needs the "
                                                     r"tokens whose slots it sets: pass \(\.\.\., slice\(None\)\) "
                                                     r"\(or \.\.\.\) for every token, or a \[batch, seq\] bool mask"),
    (lambda moe: moelens.steer(moe, 1, torch.tensor(2.0, device="meta")),
     r"^steer: bias is a one-element tensor on the meta device, which holds no value to add; pass the number itself"),
    (lambda moe: moelens.steer(moe, 1, torch.tensor([2.0], device="meta")),
     r"^steer: bias is a one-element tensor on the meta device, which holds no value"),
], ids=["force-str", "force-bytes", "force-dict", "reroute-none", "steer-meta-0d", "steer-meta-1"])
def test_arguments_refused_as_what_they_are(mixtral, call, match):
    """Refusals that named something other than what was passed, or gave advice that did not fit: force(moe, "35")
    was split into characters ("got '3'"); reroute(moe, None, ...) called None an index that picks batch rows;
    steer with a meta scalar said to add a per-token bias by hand, not that it holds no value."""
    wrapped, inputs = mixtral
    fails(wrapped, inputs, call, match)


def test_reroute_takes_every_token_as_its_refusal_of_none_says(mixtral):
    """reroute's refusal of tokens=None names (..., slice(None)) for every token: that spelling sets every token's
    slots, as a [batch, seq] mask of all True does (ground truth: the mask spelling's run)."""
    wrapped, inputs = mixtral
    moe = wrapped.moes[0]
    runs = []
    for tokens in ((..., slice(None)), None):
        with torch.no_grad(), wrapped.trace(**inputs):
            if tokens is None:
                tokens = torch.ones(moe.expert_indices.shape[:2], dtype=torch.bool)
            moelens.reroute(moe, tokens, [2, 6])
            runs.append((moe.expert_indices.save(), moe.output.save()))
    (indices, output), (mask_indices, mask_output) = runs
    assert (indices == torch.tensor([2, 6])).all()
    assert torch.equal(indices, mask_indices) and torch.equal(output, mask_output)


def test_force_runs_beside_a_token_whose_float16_logits_the_model_overflowed():
    """docs/values.md: a +inf the model computed itself is not the write's. force refused the whole trace for one
    token's float16 overflow, blaming float16's coarseness at logits of 4.7 (steps of 0.005)."""
    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm", dtype=torch.float16)
    inputs = tiny_inputs(hf)
    model = moelens.wrap(hf)
    moe = model.moes[0]
    with torch.no_grad(), model.trace(**inputs):
        hidden = moe.router.inputs[0][0].save()
    hidden = hidden.reshape(-1, hidden.shape[-1]).float()
    target = 3
    others = torch.cat([hidden[:target], hidden[target + 1:]])
    basis, _ = torch.linalg.qr(others.T)
    direction = hidden[target] - basis @ (basis.T @ hidden[target])
    with torch.no_grad():
        moe.router._module.weight[2] = (direction / (direction @ hidden[target]) * 1e5).half()  # +inf at token 3 only
    with torch.no_grad(), model.trace(**inputs):
        logits = moe.router_logits.save()
        moelens.force(moe, [1])
        indices = moe.expert_indices.save()
    flat = logits.reshape(-1, logits.shape[-1])
    assert torch.isinf(flat[target, 2]) and torch.isfinite(torch.cat([flat[:target], flat[target + 1:]])).all()
    forced = (indices.reshape(flat.shape[0], -1) == 1).any(-1)
    assert torch.cat([forced[:target], forced[target + 1:]]).all()


@pytest.mark.parametrize("call", [lambda moe: moelens.steer(moe, 1, 2.0), lambda moe: moelens.ablate(moe, 1),
                                  lambda moe: moelens.force(moe, 1)], ids=["steer", "ablate", "force"])
def test_an_intervention_on_a_block_given_part_of_the_tokens_names_itself(call):
    """ernie4_5_vl_moe's text block runs on the text tokens alone when the input holds image tokens too: an
    intervention there was refused with the read's advice alone (router_logits cannot be served ... read the
    layer's mlp.output), naming no intervention."""
    from moelens.testing import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(tiny_model("ernie4_5_vl_moe"))
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
    types = torch.zeros_like(ids)
    types[0, 3:5] = 1  # two image tokens in row 0
    with pytest.raises(moelens.ValueUnavailable, match=r"^(steer|ablate|force): .*(router_logits|expert_indices) "
                                                       r"cannot be served: this call of the block ran on part of the "
                                                       r"tokens.* \((steer|ablate|force) works on that value, so it "
                                                       r"cannot act on this block in this run\.\)$"):
        with wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
            call(wrapped.moes[0])


def test_route_around_on_a_softmax_with_a_selection_bias_keeps_the_expert_s_share_as_documented():
    """ernie4_5_moe ranks softmax scores + a selection bias and renormalises: route_around sets e's selection score to
    -inf and leaves its probability in the softmax, so the others' scores are a router's with e beside the same biases
    and can pick other experts than a router without e (docs/interventions.md); the documented way to a router without
    e (its logit set to -inf first) picks what the plain model does with that logit at -inf. Ground truth: the plain
    model with F.linear's output for that router's weight patched, and the experts' indices seen by a pre-hook."""
    import copy
    from unittest import mock

    from moelens.testing import tiny_model

    hf = tiny_model("ernie4_5_moe")
    reference = copy.deepcopy(hf)
    model = moelens.wrap(hf)
    block = model.moes[0]
    router = [p for p in reference.get_submodule(block.router.path.removeprefix("model.")).parameters()
              if p.dim() == 2 and p.shape[0] == block.num_experts][-1]
    linear = torch.nn.functional.linear

    def without_expert_0(x, weight, bias=None):
        out = linear(x, weight, bias)
        return out.index_fill(-1, torch.tensor([0]), float("-inf")) if weight is router else out

    seen = []
    handle = reference.get_submodule(block.experts.path.removeprefix("model.")).register_forward_pre_hook(
        lambda module, args: seen.append(args[1].sort(-1).values))
    ids = torch.tensor([[70, 33, 90, 100, 45, 66, 77]])
    try:
        with torch.no_grad(), mock.patch.object(torch.nn.functional, "linear", without_expert_0):
            expected = first_tensor(reference(input_ids=ids))
    finally:
        handle.remove()
    chosen = {}
    for logit_first in (False, True):
        with torch.no_grad(), model.trace(ids):
            if logit_first:
                block.router_logits[..., 0] = float("-inf")
            moelens.ablate(block, 0, "route_around")
            indices = block.expert_indices.save()
            output = model.output.logits.save()
        chosen[logit_first] = indices.reshape(seen[0].shape).sort(-1).values
        assert not (chosen[logit_first] == 0).any()
    assert torch.equal(chosen[True], seen[0]) and torch.equal(output, expected)
    assert not torch.equal(chosen[False], seen[0])  # the tiny model's biases decide some tokens otherwise


def test_a_routing_change_reaches_the_aux_loss_and_an_outputs_change_does_not():
    """With output_router_logits=True the model returns its router logits and an aux loss computed from them: a steer
    (routing) shows in both, an ablation in "zero" mode (outputs) of the last block in neither (interventions.md; of an
    earlier block, the blocks after it route the changed hidden states). Ground truth: the
    unwrapped copy's returned logits with the bias added by hand, and transformers' own load-balancing loss of them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    ids = inputs["input_ids"]  # unpadded: transformers' aux loss fails on a padded batch's mask
    config = reference.config
    with torch.no_grad():
        unedited = reference(input_ids=ids, output_router_logits=True)
    layer, expert, bias = len(wrapped.moes) - 1, 3, 4.0  # the last layer's: the others' logits stay as they were
    expected_logits = [logits.clone() for logits in unedited.router_logits]
    expected_logits[layer][:, expert] += bias
    expected_aux = load_balancing_loss_func(tuple(expected_logits), config.num_local_experts,
                                            config.num_experts_per_tok)
    with torch.no_grad(), wrapped.trace(input_ids=ids, output_router_logits=True):
        moelens.steer(wrapped.moes[layer], expert, bias)
        steered = wrapped.output.save()
    for got, want in zip(steered.router_logits, expected_logits):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(steered.aux_loss, expected_aux)
    assert not torch.allclose(steered.aux_loss, unedited.aux_loss)
    with torch.no_grad(), wrapped.trace(input_ids=ids, output_router_logits=True):
        moelens.ablate(wrapped.moes[layer], expert)
        ablated = wrapped.output.save()
    assert torch.equal(ablated.aux_loss, unedited.aux_loss)
    assert not torch.allclose(ablated.logits, unedited.logits)
