"""Every family x every experts implementation: writes land and do what they say.

Each intervention is compared with the same edit made with plain nnsight on an
unwrapped copy (raw experts-call arguments, the raw logits op), and zero / swap
ablations also with a copy of the model whose expert weights were edited.
"""

from __future__ import annotations

import copy

import nnsight
import numpy
import pytest
import torch

import moelens
from groundtruth import CASES, IDS, built, first_tensor, zero_compute_experts
from moelens.testing import tiny_inputs, tiny_model

HASH_LAYERS = "is_hash"  # deepseek_v4 blocks that route by a token table


def running_moes(wrapped):
    return [moe for moe in wrapped.moes if not moe.runs_only_on]


def routes_by_logits(moe) -> bool:
    return not getattr(moe._module, HASH_LAYERS, False)


def chosen_experts(wrapped, inputs) -> list[int]:
    """For each running block, an expert with weights the first token is routed to (so editing it matters)."""
    moes = running_moes(wrapped)
    with wrapped.trace(**inputs):
        picks = nnsight.save([moe.expert_indices[0, 0] for moe in moes])
    # longcat_flash: a slot's expert with weights, not one of its zero-compute experts
    weighted = [moe.num_experts - moe.family.identity_count(moe._module) for moe in moes]
    return [int(next((e for e in pick.tolist() if e < limit), pick[0])) for pick, limit in zip(picks, weighted)]


def plain_edit(reference, inputs, moes, edit) -> torch.Tensor:
    """The model output with ``edit(envoy_of_block, moe, index)`` applied by plain nnsight."""
    plain = nnsight.NNsight(reference)
    with plain.trace(**inputs):
        for index, moe in enumerate(moes):
            edit(plain.get(moe.path.removeprefix("model.")), moe, index)
        output = plain.output.save()
    return first_tensor(output)


def logits_op(block, moe):
    """The router logits, as the raw op's output (plain nnsight)."""
    return block.get(moe.family.router).source.__getattr__(moe.family.logits_op).output


def selection_op(block, moe):
    """What the router ranks where it adds a selection bias to the scores, as the raw tensor (plain
    nnsight): the output of the op of score + bias, or the argument of its top-k call."""
    scoring = moe.SCORING
    ops = block.get(moe.family.router).source
    if scoring.selection_in:  # ranked inside a method of the router (longcat_flash)
        ops = ops.__getattr__(scoring.selection_in).source
    op = ops.__getattr__(scoring.selection_op)
    return op.output if scoring.selection_arg is None else op.inputs[0][scoring.selection_arg]


def swap_call_args(block, moe, change):
    """Rewrite the experts call's (hidden, indices, weights) with ``change``; where the block changes the router's
    choice before that call (longcat_flash from transformers 5.25), the router's output instead."""
    positions = moe.family.routing_from_router
    if positions is not None:
        router = block.get(moe.family.router)
        output = list(router.output)
        weights_at, indices_at = positions
        output[indices_at], output[weights_at] = change(output[indices_at], output[weights_at])
        router.output = tuple(output)
        return
    experts = block.get(moe.family.experts)
    (hidden, indices, weights, *rest), kwargs = experts.inputs
    indices, weights = change(indices, weights)
    experts.inputs = ((hidden, indices, weights, *rest), kwargs)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_large_logit_bias_puts_expert_in_every_top_k(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if routes_by_logits(moe)]
    target = 3
    with wrapped.trace(**inputs):
        picked = []
        for moe in moes:
            moelens.steer(moe, target, 1e4)
            picked.append(moe.expert_indices.save())
        picked = nnsight.save(picked)
    for moe, indices in zip(moes, picked):
        assert (indices == target).any(-1).all(), f"{moe.path}: expert {target} not in every token's top-k"


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["zero", "route_around", "swap"])
def test_ablation_matches_the_same_edit_in_plain_nnsight(family, impl, mode):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    experts = chosen_experts(wrapped, inputs)
    replacement = [(expert + 1) % moe.num_experts for expert, moe in zip(experts, moes)]
    if moes[0].family.derived_routing and mode != "route_around":
        with pytest.raises(moelens.WriteError, match="recomputed from router_logits"):
            with wrapped.trace(**inputs):
                moelens.ablate(moes[0], experts[0], mode, to=replacement[0] if mode == "swap" else None)
        return
    with wrapped.trace(**inputs):
        for moe, expert, to in zip(moes, experts, replacement):
            moelens.ablate(moe, expert, mode, to=to if mode == "swap" else None)
        output = wrapped.output.save()

    def edit(block, moe, index):
        expert, to = experts[index], replacement[index]
        if mode == "route_around":  # at what the router ranks: the scores + selection bias, or the logits
            ranked = selection_op(block, moe) if moe.ranks_selection_scores else logits_op(block, moe)
            ranked[..., expert] = float("-inf")
        elif mode == "zero":
            swap_call_args(block, moe, lambda i, w: (i, w.masked_fill(i == expert, 0.0)))
        else:
            swap_call_args(block, moe, lambda i, w: (i.masked_fill(i == expert, to), w))

    expected = plain_edit(reference, inputs, moes, edit)
    ablated = first_tensor(output)
    torch.testing.assert_close(ablated, expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(ablated, plain), "the ablation changed nothing: the test would not notice a no-op"


# one family per way of ranking: softmax top-k, top-k then softmax, sigmoid + selection bias in groups, a shared expert
SEVERAL_EXPERTS = [("mixtral", "grouped_mm"), ("gpt_oss", "batched_mm"), ("deepseek_v3", "grouped_mm"),
                   ("qwen2_moe", "eager")]


@pytest.mark.parametrize(("family", "impl"), SEVERAL_EXPERTS, ids=[f"{f}-{i}" for f, i in SEVERAL_EXPERTS])
@pytest.mark.parametrize("mode", ["zero", "route_around", "swap", "steer"])
def test_several_experts_in_one_call_match_the_same_edit_in_plain_nnsight(family, impl, mode):
    """ablate(moe, [a, b], ...) (pruning the least-used experts in one call) and steer(moe, [a, b], bias); a swap
    with to=[b, a] exchanges the two experts: each slot's new expert follows from the routing as it was."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    pairs = [(expert, (expert + 1) % moe.num_experts) for expert, moe in zip(chosen_experts(wrapped, inputs), moes)]
    with wrapped.trace(**inputs):
        for moe, (a, b) in zip(moes, pairs):
            if mode == "steer":
                moelens.steer(moe, [a, b], -6.0)
            else:
                moelens.ablate(moe, [a, b], mode, to=[b, a] if mode == "swap" else None)
        output = wrapped.output.save()

    def edit(block, moe, index):
        a, b = pairs[index]
        if mode == "steer":
            logits = logits_op(block, moe)
            logits[..., [a, b]] -= 6.0
        elif mode == "route_around":
            ranked = selection_op(block, moe) if moe.ranks_selection_scores else logits_op(block, moe)
            ranked[..., [a, b]] = float("-inf")
        elif mode == "zero":
            swap_call_args(block, moe, lambda i, w: (i, w.masked_fill((i == a) | (i == b), 0.0)))
        else:
            swap_call_args(block, moe, lambda i, w: (torch.where(i == a, b, torch.where(i == b, a, i)), w))

    edited = first_tensor(output)
    torch.testing.assert_close(edited, plain_edit(reference, inputs, moes, edit), atol=1e-6, rtol=1e-6)
    assert not torch.equal(edited, plain), "the edit changed nothing: the test would not notice a no-op"


TOKEN_CASES = SEVERAL_EXPERTS[:3] + [("llama4", "eager")]  # llama4: route_around alone (its routing is recomputed)


@pytest.mark.parametrize(("family", "impl"), TOKEN_CASES, ids=[f"{f}-{i}" for f, i in TOKEN_CASES])
@pytest.mark.parametrize("mode", ["zero", "route_around", "swap"])
def test_ablation_of_chosen_tokens_matches_the_same_edit_in_plain_nnsight(family, impl, mode):
    """ablate(..., tokens=(..., 2)): only position 2 of each row loses the expert (causal tracing at a token); ground
    truth: the edit made in plain nnsight at the flat rows of that position alone."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    if moes[0].family.derived_routing and mode != "route_around":
        return  # refused at every token alike (test_ablation_matches_the_same_edit_in_plain_nnsight)
    experts = chosen_experts(wrapped, inputs)
    replacement = [(expert + 1) % moe.num_experts for expert, moe in zip(experts, moes)]
    batch, seq = inputs["input_ids"].shape
    at = torch.zeros(batch, seq, dtype=torch.bool)
    at[:, 2] = True
    outputs = []
    for tokens in ((..., 2), at, None):
        with wrapped.trace(**inputs):
            for moe, expert, to in zip(moes, experts, replacement):
                moelens.ablate(moe, expert, mode, to=to if mode == "swap" else None, tokens=tokens)
            outputs.append(first_tensor(wrapped.output.save()))

    def edit(block, moe, index):
        expert, to = experts[index], replacement[index]
        if mode == "route_around":
            ranked = selection_op(block, moe) if moe.ranks_selection_scores else logits_op(block, moe)
            chosen = at.reshape(*ranked.shape[:-1], 1)
            ranked[..., expert] = ranked[..., expert].masked_fill(chosen[..., 0], float("-inf"))
        else:
            swap_call_args(block, moe, lambda i, w: (
                (i, w.masked_fill((i == expert) & at.reshape(-1, 1), 0.0)) if mode == "zero"
                else (i.masked_fill((i == expert) & at.reshape(-1, 1), to), w)))

    torch.testing.assert_close(outputs[0], plain_edit(reference, inputs, moes, edit), atol=1e-6, rtol=1e-6)
    assert torch.equal(outputs[0], outputs[1]), "(..., 2) and the [batch, seq] mask select the same tokens"
    assert not torch.equal(outputs[0], plain) and not torch.equal(outputs[0], outputs[2])
    # the tokens before position 2 see no edit (to grouped_mm's rounding: the groups' sizes change)
    torch.testing.assert_close(outputs[0][:, :2], plain[:, :2], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("form", ["pairs", "mask", "one-to-for-a-member", "one-element-to"])
def test_other_forms_of_several_experts_match_the_same_edit_in_plain_nnsight(form):
    """A swap's pairs as one mapping ({a: b, b: a}, as Edits.swap takes them: refused as "not expert ids"), a bool
    mask over the experts (usage.counts[row] < t: refused as "got True"), one ``to`` that is itself among the
    ablated experts (refused as "nothing would change", though a's slots change), a one-element ``to`` tensor for
    two experts (refused as "1 experts for the 2")."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moes = running_moes(wrapped)
    pairs = [(expert, (expert + 1) % moe.num_experts) for expert, moe in zip(chosen_experts(wrapped, inputs), moes)]
    with wrapped.trace(**inputs):
        for moe, (a, b) in zip(moes, pairs):
            if form == "pairs":
                moelens.ablate(moe, {a: b, b: a}, "swap")
            elif form == "mask":
                moelens.ablate(moe, numpy.isin(numpy.arange(moe.num_experts), [a, b]), "route_around")
            else:
                moelens.ablate(moe, [a, b], "swap", to=b if form == "one-to-for-a-member" else torch.tensor([b]))
        output = wrapped.output.save()

    def edit(block, moe, index):
        a, b = pairs[index]
        if form == "pairs":
            swap_call_args(block, moe, lambda i, w: (torch.where(i == a, b, torch.where(i == b, a, i)), w))
        elif form == "mask":
            logits_op(block, moe)[..., [a, b]] = float("-inf")
        else:
            swap_call_args(block, moe, lambda i, w: (torch.where(i == a, b, i), w))

    edited = first_tensor(output)
    torch.testing.assert_close(edited, plain_edit(reference, inputs, moes, edit), atol=1e-6, rtol=1e-6)
    assert not torch.equal(edited, plain), "the edit changed nothing: the test would not notice a no-op"


def test_a_refused_steer_of_several_experts_edits_none_of_them():
    """steer(moe, [2, 6], bias) refused for expert 6 (its logits would overflow) had already raised expert 2's
    logits: a trace body catching the refusal ran on half an edit. The logits stay as they were (ground truth: the
    same read without the steer)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        unedited = moe.router_logits.clone().save()
    with wrapped.trace(**inputs):
        logits = moe.router_logits
        logits[..., 6] = 1e38  # + 3e38 is past float32's largest, 3.4e38; expert 2's logits + 3e38 are not
        try:
            moelens.steer(moe, [2, 6], 3e38)
        except moelens.WriteError:
            pass
        after = moe.router_logits.clone().save()
    expected = unedited.clone()
    expected[..., 6] = 1e38
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("call", "match"), [
    (lambda moe: moelens.ablate(moe, [1, 1]), r"^ablate: expert 1 is given more than once in \[1, 1\]; give each "
                                              r"expert once\.$"),
    (lambda moe: moelens.ablate(moe, []), r"^ablate: no expert given"),
    (lambda moe: moelens.ablate(moe, [1, 9]), r"^ablate: expert 9 is out of range: model\.model\.layers\.0\.mlp has "
                                                                r"experts 0\.\.7"),
    (lambda moe: moelens.ablate(moe, "12"), r"^ablate: expert='12' is str, not expert ids; pass an int expert id, or "
                                            r"a list of them \(ablate\(moe, \[3, 5\]\)\)\.$"),
    (lambda moe: moelens.ablate(moe, [1, 2], "swap", to=[3, 4, 5]), r"to=\[3, 4, 5\] gives 3 experts for the 2 "
                                                                     r"ablated ones \[1, 2\]; give one expert for all "
                                                                     r"of them, or one for each"),
    (lambda moe: moelens.ablate(moe, [1, 2], "swap", to=[1, 2]), r"to=\[1, 2\] gives each expert its own slots, so "
                                                                  r"nothing would change"),
    (lambda moe: moelens.ablate(moe, [1, 2], "swap", to=[3, 2.5]), r"^ablate\(\.\.\., mode='swap'\): to must be an "
                                                                    r"int expert id in \[0, 8\), got 2\.5"),
    (lambda moe: moelens.ablate(moe, [1, True], "route_around"), r"^ablate: expert must be an int expert id in "
                                                                  r"\[0, 8\), got True \(a bool is no id; a mask over "
                                                                  r"the experts goes as a bool tensor of 8 entries\)"),
    (lambda moe: moelens.ablate(moe, torch.ones(4, dtype=torch.bool)), r"^ablate: expert is a bool mask of 4 entries, "
                                                                       r"and .* has 8 experts"),
    (lambda moe: moelens.steer(moe, numpy.zeros(8, dtype=bool), 1.0), r"^steer: the bool mask given as expert "
                                                                      r"selects no expert"),
    (lambda moe: moelens.steer(moe, [2, 2], 1.0), r"^steer: expert 2 is given more than once"),
    # a set's order would pair the experts with to's at random (review 1: {5, 1} with to=[2, 6] swapped 1 -> 2)
    (lambda moe: moelens.ablate(moe, {5, 1}, "swap", to=[2, 6]), r"and expert is a set, whose order would pair them "
                                                                  r"at random; pass lists, in order"),
    (lambda moe: moelens.ablate(moe, [4, 1], "swap", to={6, 2}), r"and to is a set, whose order would pair them"),
    # rows for several blocks, the zip of the docs' pruning recipe forgotten: all four were routed around
    (lambda moe: moelens.ablate(moe, torch.tensor([[1, 2], [3, 4]]), "route_around"),
     r"^ablate: expert is a tensor of shape \(2, 2\); pass the expert ids of this block"),
])
def test_several_experts_given_wrong_are_refused_naming_the_value(call, match):
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    with pytest.raises(moelens.WriteError, match=match):
        with wrapped.trace(**inputs):
            call(wrapped.moes[0])


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_force_puts_the_expert_in_every_token_or_says_why(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if routes_by_logits(moe)]
    forced = [(expert + 1) % moe.num_experts for expert, moe in zip(chosen_experts(wrapped, inputs), running_moes(wrapped))
              if routes_by_logits(moe)]
    not_by_logits = any(moe.SCORING.selection_bias or moe.SCORING.groups for moe in moes)
    try:
        with wrapped.trace(**inputs):
            picked = nnsight.save([])
            for moe, expert in zip(moes, forced):
                moelens.force(moe, [expert])
                picked.append(moe.expert_indices.save())
            output = wrapped.output.save()
    except moelens.WriteError as error:  # only where the router does not pick by the logits alone
        assert not_by_logits and "not by the logits alone" in str(error)
        return
    for indices, expert in zip(picked, forced):
        assert (indices == expert).any(-1).all()

    def edit(block, moe, index):  # the same lift, by hand on the raw logits op
        op = block.get(moe.family.router).source.__getattr__(moe.family.logits_op)
        logits = op.output
        finite = logits.masked_fill(~torch.isfinite(logits), 0)
        lift = finite.amax(-1) - finite.amin(-1) + 30.0
        if moe.SCORING.select == "sparsemixer":  # the others lowered instead: its masks are relative to the top
            raised = logits - lift.unsqueeze(-1)
            raised[..., forced[index]] = logits[..., forced[index]]
        else:
            raised = logits.clone()
            raised[..., forced[index]] = logits[..., forced[index]] + lift
        op.output = raised
        if moe.ranks_selection_scores:  # ranked first where the selection bias is added
            selection_op(block, moe)[..., forced[index]] = float("inf")

    torch.testing.assert_close(first_tensor(output), plain_edit(reference, inputs, moes, edit), atol=1e-6, rtol=1e-6)


def edited_weights_copy(reference, moes, experts, replacement, mode):
    """A copy of the model whose expert weights do what the ablation does."""
    model = copy.deepcopy(reference)
    with torch.no_grad():
        for moe, expert, to in zip(moes, experts, replacement):
            module = model.get_submodule(moe.path.removeprefix("model.") + "." + moe.family.experts)
            params = dict(module.named_parameters(recurse=False))
            for name, param in params.items():
                if mode == "swap":
                    param[expert] = param[to]
                elif name.startswith("down_proj"):
                    param[expert] = 0
    return model


def one_implementation_per_family(cases: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One (family, implementation) case of each family in ``cases``, the implementations taken in turn from family
    to family, so that each is among them."""
    implementations: dict[str, list[str]] = {}
    for family, impl in cases:
        implementations.setdefault(family, []).append(impl)
    return [(family, impls[index % len(impls)]) for index, (family, impls) in enumerate(implementations.items())]


#: `test_zero_and_swap_match_edited_expert_weights`' cases: the edit is of the experts call's arguments, which every
#: implementation takes alike (each implementation is held to plain nnsight by
#: `test_ablation_matches_the_same_edit_in_plain_nnsight`).
WEIGHT_EDIT_CASES = one_implementation_per_family([case for case in CASES if case[0] not in ("llama4", "dbrx")])


@pytest.mark.parametrize(("family", "impl"), WEIGHT_EDIT_CASES, ids=[f"{f}-{i}" for f, i in WEIGHT_EDIT_CASES])
@pytest.mark.parametrize("mode", ["zero", "swap"])
def test_zero_and_swap_match_edited_expert_weights(family, impl, mode):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    experts = chosen_experts(wrapped, inputs)
    replacement = [(expert + 1) % moe.num_experts for expert, moe in zip(experts, moes)]
    if mode == "zero" and any(getattr(moe.experts._module, "has_post_expert_norm", False) for moe in moes):
        pytest.skip("a post-expert norm of a zeroed expert is not zero: no weight edit equals zeroing its slot")
    with wrapped.trace(**inputs):
        for moe, expert, to in zip(moes, experts, replacement):
            moelens.ablate(moe, expert, mode, to=to if mode == "swap" else None)
        output = wrapped.output.save()
    model = edited_weights_copy(reference, moes, experts, replacement, mode)
    with torch.no_grad():
        expected = first_tensor(model(**inputs))
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_reroute_matches_plain_nnsight(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if not moe.family.derived_routing]
    if not moes:
        pytest.skip("routing is recomputed from the logits: nothing to reroute")
    tokens = (slice(None), [1, 3])
    with wrapped.trace(**inputs):
        for moe in moes:
            moelens.reroute(moe, tokens, 5)
        output = wrapped.output.save()

    def edit(block, moe, index):
        def change(indices, weights):
            batch, seq = inputs["input_ids"].shape
            grid = indices.view(batch, seq, -1).clone()
            grid[:, [1, 3]] = 5
            return grid.view_as(indices), weights

        swap_call_args(block, moe, change)

    expected = plain_edit(reference, inputs, moes, edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)


def rescaled_by_hand(weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` scaled so each row sums to what the row of ``weights`` summed to (float64; a row of zeros kept)."""
    total, left = weights.double().sum(-1, keepdim=True), kept.double().sum(-1, keepdim=True)
    return (kept.double() * torch.where(left == 0, 1.0, total / left)).to(weights.dtype)


def best_slots_by_rank(weights: torch.Tensor, n: int, renormalize: bool) -> torch.Tensor:
    """Each row's ``n`` largest weights kept, by their rank in a descending sort (float64 for the scaling)."""
    rank = weights.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    kept = torch.where(rank < n, weights, torch.zeros_like(weights))
    return rescaled_by_hand(weights, kept) if renormalize else kept


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_renormalized_zero_ablation_matches_plain_nnsight(family, impl):
    """ablate(..., renormalize=True): the expert's slots weigh 0 and each token's other slots share its weight out
    (colibri's route-around); ground truth: the experts call's weights edited by hand in plain nnsight."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    if moes[0].family.derived_routing:
        with pytest.raises(moelens.WriteError, match=r"ablate\(mode='zero'\): .*recomputed from router_logits"):
            with wrapped.trace(**inputs):
                moelens.ablate(moes[0], 0, renormalize=True)
        return
    experts = chosen_experts(wrapped, inputs)
    with wrapped.trace(**inputs):
        for moe, expert in zip(moes, experts):
            moelens.ablate(moe, expert, renormalize=True)
        output = wrapped.output.save()

    def edit(block, moe, index):
        swap_call_args(block, moe, lambda i, w: (i, rescaled_by_hand(w, w.masked_fill(i == experts[index], 0.0))))

    dropped = first_tensor(output)
    torch.testing.assert_close(dropped, plain_edit(reference, inputs, moes, edit), atol=1e-5, rtol=1e-5)
    with wrapped.trace(**inputs):
        indices, weights = moes[0].expert_indices.save(), moes[0].expert_weights.save()
        moelens.ablate(moes[0], experts[0], renormalize=True)
        ablated = moes[0].expert_weights.save()
    untouched = ~(indices == experts[0]).any(-1)  # tokens that never used the expert keep their weights bit for bit
    assert untouched.any() and torch.equal(ablated[untouched], weights[untouched])
    with wrapped.trace(**inputs):
        for moe, expert in zip(moes, experts):
            moelens.ablate(moe, expert)
        zeroed = wrapped.output.save()
    if all(moe.top_k == 1 for moe in moes):  # zaya: a token's one slot ablated leaves nothing to share out
        assert torch.equal(dropped, first_tensor(zeroed))
    else:
        assert not torch.equal(dropped, first_tensor(zeroed)), "renormalize changed nothing: a no-op would pass"


def test_renormalized_zero_ablation_of_every_routed_expert_keeps_zeros_and_takes_the_router_s_sum():
    """A token whose every slot is ablated keeps weight 0 (no 0 / 0); in bfloat16 the kept weight of a top-2 token
    that lost one slot is the router's 1.0, not the rounded weights' sum (mixtral renormalises its top-k)."""
    hf = tiny_model("mixtral", dtype=torch.bfloat16)
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    with wrapped.trace(**inputs):
        moe = wrapped.moes[0]
        first = moe.expert_indices[0, 0].save()
        moelens.ablate(moe, first.tolist(), renormalize=True)
        every = moe.expert_weights.save()
    with wrapped.trace(**inputs):
        moe = wrapped.moes[0]
        indices = moe.expert_indices.save()
        moelens.ablate(moe, int(first[0]), renormalize=True)
        one = moe.expert_weights.save()
    assert torch.equal(every[0, 0], torch.zeros(2, dtype=torch.bfloat16))
    lost = (indices == int(first[0])).any(-1)
    assert lost.any() and torch.equal(one[lost].float().sum(-1), torch.ones(int(lost.sum())))
    assert torch.equal(one[lost].float().max(-1).values, torch.ones(int(lost.sum())))


@pytest.mark.parametrize(("mode", "to", "match"), [
    ("route_around", None, r"renormalize=True\) only applies to mode='zero', not 'route_around': the router"),
    ("swap", 1, r"renormalize=True\) only applies to mode='zero', not 'swap': the expert taking over"),
])
def test_renormalized_ablation_is_refused_outside_the_zero_mode(mode, to, match):
    hf = tiny_model("mixtral")
    wrapped, inputs = moelens.wrap(hf), tiny_inputs(hf)
    with pytest.raises(moelens.WriteError, match=match):
        with wrapped.trace(**inputs):
            moelens.ablate(wrapped.moes[0], 0, mode, to=to, renormalize=True)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
@pytest.mark.parametrize("renormalize", [False, True], ids=["kept", "renormalized"])
def test_keep_top_matches_plain_nnsight(family, impl, renormalize):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = running_moes(wrapped)
    if moes[0].family.derived_routing:
        with pytest.raises(moelens.WriteError, match="keep_top: .*recomputed from router_logits"):
            with wrapped.trace(**inputs):
                moelens.keep_top(moes[0], 1)
        return
    with wrapped.trace(**inputs):
        for moe in moes:
            moelens.keep_top(moe, moe.top_k - 1, renormalize=renormalize)
        output = wrapped.output.save()

    def edit(block, moe, index):
        swap_call_args(block, moe, lambda i, w: (i, best_slots_by_rank(w, moe.top_k - 1, renormalize)))

    kept = first_tensor(output)  # 1e-5: diffusion_gemma's per-expert scale rounds the float64 rescaling apart
    torch.testing.assert_close(kept, plain_edit(reference, inputs, moes, edit), atol=1e-5, rtol=1e-5)
    assert not torch.equal(kept, plain), "keep_top changed nothing: the test would not notice a no-op"


@pytest.mark.parametrize(("family", "router", "settings"), [
    ("mixtral", "gate", {}), ("qwen3_moe", "gate", {"norm_topk_prob": True}), ("gpt_oss", "router", {}),
])
def test_renormalized_keep_top_is_the_family_at_a_smaller_top_k(family, router, settings):
    """Where the family renormalises its top-k weights, keeping the best n renormalised is the model run with
    top_k = n: the router's own attribute lowered on an unwrapped copy."""
    hf = tiny_model(family, num_experts_per_tok=3, **settings)
    inputs = tiny_inputs(hf, seq=6)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    with wrapped.trace(**inputs):
        for moe in wrapped.moes:
            moelens.keep_top(moe, 2, renormalize=True)
        output = wrapped.output.save()
    for moe in wrapped.moes:
        reference.get_submodule(f"{moe.path.removeprefix('model.')}.{router}").top_k = 2
    with torch.no_grad():
        expected = first_tensor(reference(**inputs))
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_renormalized_keep_top_in_bfloat16_keeps_the_router_s_best_of_equal_weights(family):
    """In bfloat16 the router's two best weights (apart in the float32 scores it ranks) often round to one value;
    torch.topk then kept the second slot on ~6% of tokens (E=32, k=8), unlike the router at top_k=1 (plain
    transformers, its top_k lowered on an unwrapped copy, the experts' output taken by a hook). Tokens whose two
    best float32 scores are themselves equal (the router at k=1 and at k=8 may break that tie either way) are left
    out of the comparison."""
    settings = {"num_experts_per_tok": 8, **({"num_experts": 32, "norm_topk_prob": True} if family == "qwen3_moe"
                                             else {"num_local_experts": 32})}
    hf = tiny_model(family, experts_implementation="batched_mm", dtype=torch.bfloat16, **settings)
    ids = torch.randint(3, 128, (8, 64), generator=torch.Generator().manual_seed(1))
    reference, wrapped = copy.deepcopy(hf), moelens.wrap(hf)
    moe = wrapped.moes[0]
    block = reference.get_submodule(moe.path.removeprefix("model."))
    (block.router if family == "gpt_oss" else block.gate).top_k = 1
    seen = {}
    block.experts.register_forward_hook(lambda module, args, output: seen.update(output=output))
    with torch.no_grad():
        reference(ids)
    with torch.no_grad(), wrapped.trace(ids):
        logits = moe.router_logits.clone().save()
        weights = moe.expert_weights.clone().save()
        moelens.keep_top(moe, 1, renormalize=True)
        routed = moe.routed_output.save()
    top_two = (logits.float().softmax(-1) if family == "qwen3_moe" else logits.float()).topk(2, dim=-1).values
    apart = top_two[..., 0] != top_two[..., 1]
    best_two = weights.sort(-1, descending=True).values[..., :2]
    assert (apart & (best_two[..., 0] == best_two[..., 1])).sum() > 10, "no rounded tie: the test would not see one"
    expected = seen["output"].view_as(routed)
    torch.testing.assert_close(routed[apart], expected[apart], atol=0, rtol=0)


@pytest.mark.parametrize(("family", "top_k_at", "dtype"), [("moelens-tiny", "router", torch.bfloat16),
                                                         ("mixtral", "router", torch.float32),
                                                         ("mixtral", "router", torch.bfloat16),
                                                         ("dbrx", "block", torch.bfloat16)])
def test_renormalized_keep_top_of_one_slot_is_the_router_s_weight(family, top_k_at, dtype):
    """keep_top(moe, 1, renormalize=True) kept 0.996 on moelens-tiny in bfloat16 (scaled to the sum of the two
    rounded weights, 0.998; the logits then differed by up to 0.16), 0.99999994 in float32 (the kept weight times
    total / kept, not the router's w / w) and, on dbrx (a p-norm with p = 1, the weights' sum), 0.992 and 1.008 in
    bfloat16, where the router at top_k = 1 gives 1.0. Ground truth: plain transformers with the router's top_k set
    to 1, its weights taken by a pre-hook on the experts call."""
    if family == "moelens-tiny":
        from transformers import AutoModelForCausalLM

        from moelens.data import TINY_MODEL_PATH

        hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=dtype).eval()
    else:
        hf = tiny_model(family, dtype=dtype)
    reference, wrapped = copy.deepcopy(hf), moelens.wrap(hf)
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    called = []
    for moe in wrapped.moes:
        block = reference.get_submodule(moe.path.removeprefix("model."))
        setattr(reference.get_submodule(moe.router.path.removeprefix("model.")) if top_k_at == "router" else block,
                "top_k", 1)
        experts = block.get_submodule(moe.experts.path.removeprefix(f"{moe.path}."))
        experts.register_forward_pre_hook(lambda module, args: called.append(args[1:3]))
    with torch.no_grad():
        reference(ids)
    kept = []
    with torch.no_grad(), wrapped.trace(ids):
        for moe in wrapped.moes:
            moelens.keep_top(moe, 1, renormalize=True)
            kept.append(moe.expert_weights.max(-1).values.save())
    for weights, arguments in zip(kept, called):
        plain = next(argument for argument in arguments if argument.is_floating_point())
        assert plain.unique().tolist() == [1.0]
        torch.testing.assert_close(weights.reshape(-1), plain.reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_renormalized_keep_top_of_every_slot_changes_nothing(dtype):
    """keep_top(moe, top_k, renormalize=True) rescaled every weight by total / kept, which rounds (2079 of 4096 token
    layers changed in float32). Ground truth: the router's own weights, a pre-hook on an unwrapped copy's experts."""
    hf = tiny_model("mixtral", num_experts_per_tok=6, dtype=dtype)
    reference, wrapped = copy.deepcopy(hf), moelens.wrap(hf)
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    called = []
    for moe in wrapped.moes:
        reference.get_submodule(moe.experts.path.removeprefix("model.")).register_forward_pre_hook(
            lambda module, args: called.append(args[2]))
    with torch.no_grad():
        reference(ids)
    kept = []
    with torch.no_grad(), wrapped.trace(ids):
        for moe in wrapped.moes:
            moelens.keep_top(moe, moe.top_k, renormalize=True)
            kept.append(moe.expert_weights.save())
    for weights, plain in zip(kept, called):
        torch.testing.assert_close(weights.reshape(plain.shape), plain, rtol=0, atol=0)


def test_keep_top_on_chosen_tokens_leaves_the_others():
    hf, wrapped, inputs, plain, reference = built("qwen3_moe", "grouped_mm")
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        before = moe.expert_weights.clone().save()
        moelens.keep_top(moe, 0, tokens=(..., 2))
        after = moe.expert_weights.save()
    expected = before.clone()
    expected[:, 2] = 0
    torch.testing.assert_close(after, expected, atol=0, rtol=0)


def test_renormalized_keep_top_keeps_tokens_whose_dropped_slots_weighed_nothing():
    """A token whose dropped slots an earlier edit zeroed keeps its weights bit for bit (w / sum * sum moved 1 ulp in
    many); the others are scaled to their sum. Ground truth: the weights as edited, rescaled by hand in float64."""
    hf = tiny_model("mixtral", num_experts_per_tok=3)
    wrapped = moelens.wrap(hf)
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), wrapped.trace(ids):
        moe = wrapped.moes[0]
        moe.expert_weights[:2, ..., 2] = 0  # rows 0 and 1: their third slot weighs nothing
        edited = moe.expert_weights.clone().save()
        moelens.keep_top(moe, 2, renormalize=True)
        kept = moe.expert_weights.save()
    assert torch.equal(kept[:2], edited[:2])
    expected = best_slots_by_rank(edited[2:].double(), 2, renormalize=True).float()
    torch.testing.assert_close(kept[2:], expected, rtol=1e-6, atol=0)
    assert (kept[2:] == 0).sum() == 2 * 64, "one slot of each token of rows 2 and 3 dropped"


def test_renormalized_keep_top_of_no_slots_gives_finite_gradients():
    """Keeping no slot renormalised leaves zeros (nothing to scale), and no 0 / 0 reaches the router's gradient."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    with wrapped.trace(**tiny_inputs(hf)):
        moelens.keep_top(wrapped.moes[0], 0, renormalize=True)
        kept = wrapped.moes[0].expert_weights.save()
        loss = wrapped.output.logits.sum().save()
    loss.backward()
    gradient = hf.model.layers[0].mlp.gate.weight.grad
    assert torch.equal(kept, torch.zeros_like(kept))
    assert gradient is not None and gradient.isfinite().all()


@pytest.mark.parametrize(("arguments", "match"), [
    ((3,), r"n must be an int slot count in \[0, 2\] .*top_k=2.*got 3"),
    ((-1,), r"n must be an int slot count in \[0, 2\].*got -1"),
    ((1.0,), r"n must be an int slot count.*got 1\.0"),
    ((1, "yes"), r"keep_top: renormalize must be True or False, got 'yes'"),
    ((1, False, 3), r"keep_top: tokens=3 is ambiguous"),
    ((2, False, 3), r"keep_top: tokens=3 is ambiguous"),  # every slot kept changes nothing, but is checked (review 3)
])
def test_keep_top_refuses_bad_arguments(arguments, match):
    hf, wrapped, inputs, plain, reference = built("qwen3_moe", "grouped_mm")
    with pytest.raises(moelens.WriteError, match=match):
        with wrapped.trace(**inputs):
            moelens.keep_top(wrapped.moes[0], *arguments)


@pytest.mark.parametrize("mode", ["zero", "route_around", "swap"])
def test_ablation_refuses_tokens_it_cannot_select_before_editing(mode):
    """A bad tokens= is refused as keep_top's is, and a caught refusal left no edit in the model's tensor."""
    hf, wrapped, inputs, plain, reference = built("qwen3_moe", "grouped_mm")
    with wrapped.trace(**inputs):
        with pytest.raises(moelens.WriteError, match=r"^ablate: tokens=3 is ambiguous"):
            moelens.ablate(wrapped.moes[0], 1, mode, to=2 if mode == "swap" else None, tokens=3)
        output = wrapped.output.save()
    assert torch.equal(first_tensor(output), plain)


@pytest.mark.parametrize(("family", "impl"), [c for c in CASES if c[1] != "eager"],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] != "eager"])
def test_slot_writes_land(family, impl):
    """Doubling a slot's activations (in place, or read and assigned) doubles its output; zeroing slot outputs removes them."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if moe.family.experts_call and "expert_outputs" in moe.order()
            and not zero_compute_experts(hf)]
    if not moes:
        pytest.skip("no per-slot values in this family")
    moe = moes[0]
    linear_down = not any(
        getattr(moe.experts._module, flag, False) for flag in ("has_bias", "has_post_expert_norm")
    )
    with wrapped.trace(**inputs):
        before = moe.expert_outputs.save()
    last = moe.top_k - 1
    with wrapped.trace(**inputs):
        activations = moe.expert_activations
        activations[:, :, 0] *= 2  # in place: lands through the write-back
        slots = moe.expert_outputs.save()
        slots[:, :, last] = 0  # in place, on a view of the model's tensor
        routed = moe.routed_output.save()
    if linear_down and last:
        torch.testing.assert_close(slots[:, :, 0], 2 * before[:, :, 0], atol=1e-5, rtol=1e-4)
    assert torch.equal(slots[:, :, last], torch.zeros_like(slots[:, :, last]))
    torch.testing.assert_close(routed, slots.sum(2), atol=1e-6, rtol=1e-6)
    with wrapped.trace(**inputs):
        moe.expert_activations = moe.expert_activations * 2  # read, then assign (value = f(value))
        doubled = moe.expert_outputs.save()
    if linear_down:
        torch.testing.assert_close(doubled, 2 * before, atol=1e-5, rtol=1e-4)
    else:
        assert not torch.allclose(doubled, before)


@pytest.mark.parametrize(("family", "impl"), [c for c in CASES if c[1] != "eager"],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] != "eager"])
def test_pre_activation_writes_land_where_the_activation_reads_them(family, impl):
    """An edit of one slot's up projections is what that slot's gate / activation sees (the activations read after
    it are the module's own gate of the edited projections, by hand, slot by slot: a mix-up of the expert-sorted rows
    fails here); the same edit of every row equals plain nnsight editing the activation op's input."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if "expert_pre_activations" in moe.order()
            and not zero_compute_experts(hf)]
    if not moes:
        pytest.skip("no per-slot values in this family")
    moe = moes[0]
    experts = moe.experts._module
    gate = experts._apply_gate if getattr(experts, "has_gate", True) else experts.act_fn
    with torch.no_grad(), wrapped.trace(**inputs):
        pre = moe.expert_pre_activations
        pre[:, :, 0] += 0.25  # in place, one slot
        edited = pre.save()
        activations = moe.expert_activations.save()
    torch.testing.assert_close(activations, gate(edited), atol=1e-6, rtol=1e-6)
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.expert_pre_activations = moe.expert_pre_activations * 0.5  # every row alike: no order to match
        output = wrapped.output.save()

    def edit(block, moe_, index):
        if index == 0:
            inner = block.get(moe.family.experts).source.experts_forward_1.source
            op = inner.self__apply_gate_0 if getattr(experts, "has_gate", True) else inner.self_act_fn_0
            op.input *= 0.5

    with torch.no_grad():
        expected = plain_edit(reference, inputs, [moe], edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(first_tensor(output), plain)


@pytest.mark.parametrize(("family", "impl"), [c for c in CASES if c[1] != "eager"],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] != "eager"])
def test_gate_and_up_views_edit_the_pre_activations_the_model_goes_on_with(family, impl):
    """moe.gate_and_up gives views: zeroing gate unit 1 and raising up unit 0 in place in a trace equals plain
    nnsight editing the activation op's input at the columns the fused weight keeps them in (halves, or
    interleaved where transformers' is_concatenated is False). With autograd on, as most traces run: chunk's halves
    were views autograd refuses to let be edited in place (a function of several outputs)."""
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moes = [moe for moe in running_moes(wrapped) if "expert_pre_activations" in moe.order()
            and getattr(moe.experts._module, "has_gate", False) and not zero_compute_experts(hf)]
    if not moes:
        pytest.skip("no gated experts with per-slot values in this family")
    moe = moes[0]
    experts = moe.experts._module
    with wrapped.trace(**inputs):
        gate, up = moe.gate_and_up(moe.expert_pre_activations)
        gate[..., 1] = 0
        up[..., 0] += 0.5
        output = wrapped.output.save()
    width = experts.gate_up_proj.shape[-1 if experts.is_transposed else -2]
    gate_column, up_column = (1 * 2, 0 * 2 + 1) if not experts.is_concatenated else (1, width // 2)

    def edit(block, moe_, index):
        if index == 0:
            op = block.get(moe.family.experts).source.experts_forward_1.source.self__apply_gate_0
            op.input[:, gate_column] = 0
            op.input[:, up_column] += 0.5

    expected = plain_edit(reference, inputs, [moe], edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(first_tensor(output), plain)


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_output_writes_match_plain_nnsight(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moe = running_moes(wrapped)[0]
    order = moe.order()
    name = "routed_output" if "routed_output" in order else "shared_expert_output"
    with wrapped.trace(**inputs):
        value = getattr(moe, name)
        setattr(moe, name, value * 0.5)
        output = wrapped.output.save()

    def edit(block, moe_, index):
        if index:
            return
        module = block.get(moe.family.experts) if name == "routed_output" else moe_.shared_experts
        if name == "routed_output" and moe.family.routed_from_block:
            module = block
        if name == "shared_expert_output":
            module = plain_shared(block, moe_)
        if name == "routed_output" or not moe.family.shared.gated_op:
            module.output = module.output * 0.5
        else:
            op = block.source.__getattr__(moe.family.shared.gated_op)
            op.output = op.output * 0.5

    expected = plain_edit(reference, inputs, [moe], edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(first_tensor(output), plain)


def plain_shared(block, moe):
    spec = moe.family.shared
    return (block.parent if spec.on_layer else block).get(spec.module)


IN_PLACE_EDITS = [
    ("expert_indices", "expert_weights", lambda indices: indices[..., 0].fill_(100), "expert index 100"),
    ("expert_indices", "expert_weights", lambda indices: indices[..., 0].fill_(-1), "expert index -1"),
    ("expert_weights", "expert_indices", lambda weights: weights[..., 0].fill_(float("nan")), "NaN"),
]


@pytest.mark.parametrize(("edited", "read_after", "edit", "match"), IN_PLACE_EDITS)
def test_in_place_edits_are_checked_when_the_other_call_argument_is_read_after(edited, read_after, edit, match):
    """Weights and indices are both the experts call's arguments: reading one must not let the
    other's later in-place edit through unchecked."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    with pytest.raises(moelens.WriteError, match=match):
        with wrapped.trace(**inputs):
            view = getattr(moe, edited)
            getattr(moe, read_after)
            edit(view)
            wrapped.output.save()
    with pytest.raises(moelens.WriteError, match=match):
        with wrapped.trace(**inputs):
            view = getattr(moe, edited)
            setattr(moe, read_after, getattr(moe, read_after) * 1)  # a write of the other argument
            edit(view)
            wrapped.output.save()


@pytest.mark.parametrize("assign_weights", [False, True], ids=["in_place", "assigned"])
def test_edits_of_both_call_arguments_land(assign_weights):
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    with wrapped.trace(**inputs):
        indices = moe.expert_indices
        weights = moe.expert_weights
        if assign_weights:
            moe.expert_weights = weights * 0.5
        else:
            weights *= 0.5
        indices[..., 0] = 5  # after the weights were read (and written)
        output = wrapped.output.save()

    def edit(block, moe, index):
        def change(indices, weights):
            indices = indices.clone()
            indices[:, 0] = 5
            return indices, weights * 0.5

        swap_call_args(block, moe, change)

    expected = plain_edit(reference, inputs, [moe], edit)
    torch.testing.assert_close(first_tensor(output), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
def test_keep_top_runs_under_inference_mode(renormalize):
    """keep_top edits a copy of the weights it made itself: under torch.inference_mode that copy keeps no version
    counter, which the check of an earlier in-place edit asked for ("Inference tensors do not track version
    counter"). It gives what it gives under torch.no_grad."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "batched_mm")
    moe = running_moes(wrapped)[0]
    outputs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), wrapped.trace(**inputs):
            moelens.keep_top(moe, 1, renormalize=renormalize)
            outputs.append(wrapped.output.logits.save())
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], plain)


def test_renormalized_keep_top_keeps_float64_weights_exact():
    """A float64 model's weights are rescaled in float64, not float32: the one slot kept weighs the token's sum."""
    hf = tiny_model("qwen2_moe", dtype=torch.float64, experts_implementation="batched_mm")  # grouped_mm: no float64
    wrapped = moelens.wrap(hf)
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
        moe = wrapped.moes[0]
        before = moe.expert_weights.clone().save()
        moelens.keep_top(moe, 1, renormalize=True)
        after = moe.expert_weights.save()
    assert after.dtype == torch.float64
    torch.testing.assert_close(after.amax(-1), before.sum(-1), atol=1e-15, rtol=0)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_reads_and_in_place_edits_work_under_inference_mode(impl):
    """torch.inference_mode's tensors keep no version counter: reads still equal the raw ops and
    the plain forward, in-place edits still land and are still checked."""
    hf, wrapped, inputs, plain, reference = built("mixtral", impl)
    moe = running_moes(wrapped)[0]
    raw = nnsight.NNsight(reference)
    with torch.inference_mode(), raw.trace(**inputs):
        raw_logits = logits_op(raw.get(moe.path.removeprefix("model.")), moe).save()
    with torch.inference_mode(), wrapped.trace(**inputs):
        values = moe.save_all()
        output = wrapped.output.save()
    assert torch.equal(first_tensor(output), plain)
    assert torch.equal(values["router_logits"].reshape(raw_logits.shape), raw_logits)

    with torch.inference_mode(), wrapped.trace(**inputs):
        weights = moe.expert_weights
        weights *= 0.5
        edited = wrapped.output.save()

    def edit(block, moe, index):
        swap_call_args(block, moe, lambda indices, weights: (indices, weights * 0.5))

    torch.testing.assert_close(first_tensor(edited), plain_edit(reference, inputs, [moe], edit), atol=1e-6, rtol=1e-6)
    with pytest.raises(moelens.WriteError, match="expert index 100"):
        with torch.inference_mode(), wrapped.trace(**inputs):
            moe.expert_indices[..., 0] = 100
            wrapped.output.save()
    if impl != "eager":  # per-slot values: the view is un-sorted into token-slot order, its edit sorted back
        with torch.inference_mode(), wrapped.trace(**inputs):
            moe.expert_activations.zero_()
            routed = moe.routed_output.save()
        assert routed.abs().max() == 0  # bias-free down projections of zero activations


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_a_per_slot_value_read_twice_at_one_visit_is_one_view(impl):
    """Reading expert_activations a second time in the same visit serves the view read first (grouped_mm un-sorts
    a copy: asking the op again raised an OrderError); an edit of it lands. Ground truth: zero activations through
    bias-free down projections give a zero routed output."""
    hf, wrapped, inputs, plain, reference = built("mixtral", impl)
    moe = running_moes(wrapped)[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        first = moe.expert_activations
        again = moe.expert_activations
        same = nnsight.save(again is first)
        first.zero_()
        routed = moe.routed_output.save()
    assert same
    assert routed.abs().max() == 0


GRAD_MODES = {"no_grad": torch.no_grad, "autograd": torch.enable_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize(("edited", "later", "grad"), [
    ("expert_activations", "expert_outputs", "no_grad"),  # put in token-slot order: a copy
    ("expert_activations", "expert_outputs", "autograd"),
    ("expert_indices", "expert_activations", "autograd"),  # integer indices: a copy off the graph
    ("expert_weights", "expert_activations", "inference_mode"),  # every value a copy under inference_mode
    ("router_logits", "expert_weights", "inference_mode"),
])
def test_a_late_in_place_edit_of_a_copy_the_model_does_not_hold_is_an_error(edited, later, grad):
    """A copy edited after a later value was read had had its write-back: the edit was silently lost."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.{edited} was edited in place after moelens had handed it back"):
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            view = getattr(moe, edited)
            getattr(moe, later)
            view[..., 0] = 1
            wrapped.output.save()
    with GRAD_MODES[grad](), wrapped.trace(**inputs):  # edited in time, the same edit lands
        view = getattr(moe, edited)
        view[..., 0] = 1
        getattr(moe, later)
        output = wrapped.output.save()
    assert not torch.equal(first_tensor(output), plain)
    with torch.no_grad():
        assert torch.equal(first_tensor(hf(**inputs)), plain)


@pytest.mark.parametrize("grad", list(GRAD_MODES))
def test_save_all_leaves_each_value_as_a_read_would(grad):
    """save_all leaves no write-back for a value it reads the next one after at once (a round trip to the model
    for nothing): a copy among them edited after save_all is still a late edit, the last value read stays open
    (an edit right after save_all lands, as after a read of it), and a view of the model's tensor edited in
    place changes the model's tensor (as plain nnsight)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    assert moe.order()[-1] == "mlp_output"
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.expert_activations was edited in place after "
                                                 "moelens had handed it back"):
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            activations = moe.save_all()["expert_activations"]
            activations[..., 0] = 1
            wrapped.output.save()
    with GRAD_MODES[grad](), wrapped.trace(**inputs):
        values = moe.save_all()
        values["mlp_output"][:] = 0
        output = wrapped.output.save()
    block = hf.get_submodule(moe.path.removeprefix("model."))  # the same edit by a plain torch hook
    hook = block.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    try:
        with GRAD_MODES[grad]():
            expected = hf(**inputs)
    finally:
        hook.remove()
    torch.testing.assert_close(first_tensor(output), first_tensor(expected))
    assert not torch.equal(first_tensor(output), plain) and values["mlp_output"].abs().max() == 0
    if grad != "inference_mode":  # there every value is a copy
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            values = moe.save_all()
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            probs = moe.router_probs.save()
        assert torch.equal(values["router_probs"], probs) and values["router_probs"].dtype == torch.float32
        with pytest.raises(moelens.OrderError, match=r"expert_indices was edited in place after"):
            with torch.enable_grad(), wrapped.trace(**inputs):  # integer indices: a copy off the graph
                indices = moe.save_all()["expert_indices"]
                indices[..., 0] = 1
    with torch.no_grad():
        assert torch.equal(first_tensor(hf(**inputs)), plain)


def test_an_edit_right_after_save_all_lands_when_a_value_it_was_asked_for_cannot_be_served():
    """save_all read every value but the last one asked for without a write-back; with the last one unavailable
    (per-slot values under eager) the value read last was a copy already handed back (inference_mode): an edit
    of it right after save_all was lost, and the trace failed with a late-edit error."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "eager")
    moe = running_moes(wrapped)[0]
    with torch.inference_mode(), wrapped.trace(**inputs):
        values = moe.save_all(["expert_weights", "expert_outputs"])
        values["expert_weights"].mul_(0)
        output = wrapped.output.save()
    experts = hf.get_submodule(moe.experts.path.removeprefix("model."))  # the same edit by a plain torch pre-hook
    hook = experts.register_forward_pre_hook(lambda module, args: (*args[:2], torch.zeros_like(args[2]), *args[3:]))
    try:
        with torch.inference_mode():
            expected = hf(**inputs)
    finally:
        hook.remove()
    assert list(values) == ["expert_weights"]
    assert torch.equal(first_tensor(output), first_tensor(expected)) and not torch.equal(first_tensor(output), plain)


@pytest.mark.parametrize("grad", list(GRAD_MODES))
def test_values_save_all_reads_where_its_last_one_is_read_stay_open(grad):
    """save_all settled every value but the last as read, though expert_weights is read where expert_indices is
    (both arguments of the experts call) and router_probs is scored from the logits: the model had not used them
    when save_all returned, so an edit then reached the model unchecked (no_grad) or was lost with a late-edit
    error (inference_mode). Now it lands as after plain reads, and is checked."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    experts = hf.get_submodule(moe.experts.path.removeprefix("model."))  # the same edit by a plain torch pre-hook
    hook = experts.register_forward_pre_hook(lambda module, args: (*args[:2], args[2] * 0.5, *args[3:]))
    try:
        with GRAD_MODES[grad]():
            expected = hf(**inputs)
    finally:
        hook.remove()
    with GRAD_MODES[grad](), wrapped.trace(**inputs):
        moe.save_all(["expert_weights", "expert_indices"])["expert_weights"].mul_(0.5)
        output = wrapped.output.save()
    torch.testing.assert_close(first_tensor(output), first_tensor(expected))
    assert not torch.equal(first_tensor(output), plain)
    with pytest.raises(moelens.WriteError, match=rf"{moe.path}.router_logits: the written tensor holds NaN"):
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            moe.save_all(["router_logits", "router_probs"])["router_logits"][0, 0, 0] = float("nan")
            wrapped.output.save()


@pytest.mark.parametrize("grad", ["no_grad", "autograd"])
def test_in_place_changes_by_others_to_a_served_tensor_are_no_late_edit(grad):
    """The model's own tensors change in place by a torch hook or a plain nnsight edit: not a late edit of
    the moelens value that shares them (served as a view of them under no_grad, handed to the model as the
    model's tensor with autograd on)."""
    hf = tiny_model("mixtral")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    moe = wrapped.moes[0]
    with torch.no_grad():
        plain = first_tensor(hf(**inputs))
    block = hf.get_submodule(moe.path.removeprefix("model."))
    hook = block.register_forward_hook(lambda module, args, output: output.mul_(0.5))
    try:
        with torch.no_grad():
            hooked = first_tensor(hf(**inputs))
        with GRAD_MODES[grad](), wrapped.trace(**inputs):
            served = moe.mlp_output.save()
            output = wrapped.output.save()
    finally:
        hook.remove()
    torch.testing.assert_close(first_tensor(output), hooked)
    with GRAD_MODES[grad](), wrapped.trace(**inputs):
        routed = moe.routed_output.save()
        wrapped.get(moe.path.removeprefix("model.")).output[:] = 0  # the block output: a reshape of routed_output
        zeroed = wrapped.output.save()
    assert not torch.equal(first_tensor(zeroed), plain)
    assert served.shape == routed.shape == (*inputs["input_ids"].shape, hf.config.hidden_size)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_int32_indices_reach_the_experts_as_the_models_index_dtype(impl):
    """Expert indices written as int32 went to the experts as int32 (eager's one_hot refuses them): the written
    tensor is cast to the dtype (and device) of the indices the model holds; the result equals the int64 write."""
    hf = tiny_model("mixtral", experts_implementation=impl)
    wrapped = moelens.wrap(hf)
    seen = []
    hook = hf.model.layers[0].mlp.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    ids = torch.tensor([[5, 9, 14, 3, 7], [8, 2, 11, 4, 6]])
    logits = {}
    for dtype in (torch.int64, torch.int32):
        with torch.no_grad(), wrapped.trace(ids):
            moe = wrapped.moes[0]
            moe.expert_indices = ((moe.expert_indices + 1) % moe.num_experts).to(dtype)
            logits[dtype] = wrapped.output.logits.save()
    hook.remove()
    assert [index.dtype for index in seen] == [torch.int64, torch.int64]
    assert torch.equal(logits[torch.int64], logits[torch.int32])


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", ["tensor", "numpy", "number"])
def test_a_patched_value_is_the_models_copy_so_a_later_steer_leaves_the_users_value_alone(grad, kind):
    """Patch the logits saved from a clean run, then steer: the model gets clean + 5 on expert 1 (plain nnsight on
    a copy), and the tensor or array written stays as it was (it was edited in place without autograd);
    a number written fills a tensor the steer can edit (an expanded scalar refused in-place edits)."""
    _, wrapped, inputs, _, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        clean = moe.router_logits.save()
    written = {"tensor": clean.clone(), "numpy": clean.clone().cpu().numpy(), "number": 0.5}[kind]
    kept = copy.deepcopy(written)
    with torch.set_grad_enabled(grad), wrapped.trace(**inputs):
        moe.router_logits = written
        moelens.steer(moe, 1, 5.0)
        output = wrapped.output.save()
    if kind != "number":
        assert (kept == written).all()

    patched = torch.as_tensor(written, dtype=clean.dtype, device=clean.device).expand(clean.shape).reshape(-1, clean.shape[-1])

    def edit(block, plain_moe, index):
        if index == 0:
            op = block.get(plain_moe.family.router).source.__getattr__(plain_moe.family.logits_op)
            op.output = patched + 5.0 * (torch.arange(patched.shape[-1], device=patched.device) == 1)

    expected = plain_edit(reference, inputs, wrapped.moes, edit)
    torch.testing.assert_close(first_tensor(output).detach(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("name", ["expert_weights", "expert_indices"])
def test_an_in_place_edit_of_routing_moelens_derives_is_an_error(name, grad_mode):
    """llama4 calls no experts module: moelens recomputes its weights and indices from the logits, and the model
    never reads them. An in-place edit of one was lost silently (assignment was refused already); under
    inference_mode a read raised torch's "Inference tensors do not track version counter". The value read in each
    grad mode is the router's own choice: the top-k of its logits, weighted by its sigmoid scores (plain nnsight)."""
    hf, wrapped, inputs, plain, reference = built("llama4", "eager")
    moe = running_moes(wrapped)[0]
    mode = GRAD_MODES[grad_mode]
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.{name} was edited in place, but .* never reads"):
        with mode(), wrapped.trace(**inputs):
            value = getattr(moe, name).save()
            value[..., 0] = 0
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.{name} was edited in place, but .* never reads"):
        with mode(), wrapped.trace(**inputs):  # edited as it is read, no reference kept: as nnsight users edit
            getattr(moe, name)[..., 0] = 0
    with mode(), wrapped.trace(**inputs):  # read, or edited as a clone, it raises nothing and the output is the plain one
        value = getattr(moe, name).save()
        value.clone()[..., 0] = 0
        output = wrapped.output.logits.save()
    assert torch.equal(output, plain)
    raw = nnsight.NNsight(reference)
    with torch.no_grad(), raw.trace(**inputs):
        scores, logits = raw.get(moe.router.path.removeprefix("model.")).output
        scores, logits = scores.save(), logits.save()
    indices = torch.topk(logits, moe.top_k, dim=-1).indices
    expected = indices if name == "expert_indices" else scores.gather(-1, indices)
    torch.testing.assert_close(value.reshape(expected.shape), expected, rtol=0, atol=1e-6)  # sigmoid's last bit


@pytest.mark.parametrize("call", ["zero", "swap", "reroute"])
def test_output_interventions_on_recomputed_routing_name_the_intervention(call):
    """On llama4 (no experts call) ablate zero / swap and reroute were refused as a write of expert_weights or
    expert_indices the user never made, saying "write router_logits"; they name the intervention and the ones that
    apply. The routing interventions still land: route_around keeps the expert out of every token's top-k."""
    hf, wrapped, inputs, plain, reference = built("llama4", "eager")
    moe = running_moes(wrapped)[0]
    intervene = {"zero": lambda: moelens.ablate(moe, 1), "swap": lambda: moelens.ablate(moe, 1, "swap", to=2),
                 "reroute": lambda: moelens.reroute(moe, (..., 0), 2)}[call]
    named = "reroute" if call == "reroute" else f"ablate\\(mode='{call}'\\)"
    with pytest.raises(moelens.WriteError, match=rf"^{named}: {moe.path} \(llama4\) calls no experts module .* "
                                                 r"only the routing interventions apply: ablate\(moe, expert, "
                                                 r"'route_around'\)"):
        with torch.no_grad(), wrapped.trace(**inputs):
            intervene()
    with torch.no_grad(), wrapped.trace(**inputs):
        moelens.ablate(moe, 1, "route_around")
        indices = moe.expert_indices.save()
    assert not (indices == 1).any()


def test_a_granite_mlp_output_edited_after_save_all_lands_or_says_it_was_handed_back():
    """granitemoeshared's shared MLP runs after the block, so save_all reads shared_expert_output after mlp_output.
    Under no_grad mlp_output is the model's own tensor, which the layer adds only later: an edit after save_all
    lands (ground truth: a forward hook zeroing the block's output). Under inference_mode it is a copy handed back
    when shared_expert_output was read: the late-edit error said "after the model had used it", which it had not."""
    hf, wrapped, inputs, plain, reference = built("granitemoeshared", "grouped_mm")
    moe = running_moes(wrapped)[0]
    assert moe.order()[-2:] == ("mlp_output", "shared_expert_output")
    with torch.no_grad(), wrapped.trace(**inputs):
        values = moe.save_all()
        values["mlp_output"].zero_()
        output = wrapped.output.save()
    block = hf.get_submodule(moe.path.removeprefix("model."))
    hook = block.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    try:
        with torch.no_grad():
            expected = hf(**inputs)
    finally:
        hook.remove()
    assert torch.equal(first_tensor(output), first_tensor(expected)) and not torch.equal(first_tensor(output), plain)
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.mlp_output was edited in place after moelens had "
                                                 r"handed it back to the model \(once a later value"):
        with torch.inference_mode(), wrapped.trace(**inputs):
            values = moe.save_all()
            values["mlp_output"].zero_()


def test_values_saved_under_inference_mode_are_normal_tensors_router_probs_too():
    """Every value served under torch.inference_mode is a normal copy, so a user edits it after the trace; router_probs,
    scored by moelens, was an inference tensor there, whose edit raised torch's "Inplace update to inference tensor
    outside InferenceMode". Ground truth: the float32 softmax of the logits read (mixtral's scoring)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = running_moes(wrapped)[0]
    with torch.inference_mode(), wrapped.trace(**inputs):
        values = moe.save_all()
    with torch.inference_mode(), wrapped.trace(**inputs):
        alone = moe.router_probs.save()
    assert not any(value.is_inference() for value in (*values.values(), alone))
    assert torch.equal(values["router_probs"], torch.softmax(values["router_logits"].float(), dim=-1))
    values["router_probs"][..., 0] = 0  # the user's own analysis copy


def nan_in_second_row(model) -> torch.utils.hooks.RemovableHandle:
    """A NaN the model computes itself in batch row 1 (one embedding entry, spread by attention), row 0 finite."""
    def poison(module, args, output):
        output = output.clone()
        output[1, 0, 0] = float("nan")
        return output
    return model.get_input_embeddings().register_forward_hook(poison)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("intervention", ["steer", "route_around", "force_row_0", "keep_top_row_0", "zero"])
def test_an_intervention_on_finite_rows_runs_beside_the_model_s_own_nan(grad, intervention):
    """Where the model computed NaN in one batch row, each intervention was refused as if it had written the NaN
    ("the written tensor holds NaN"), even on the finite row alone; compared with the same edit in plain nnsight on
    an unwrapped copy computing the same NaN (row 0 equal, row 1 NaN in both)."""
    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    inputs = tiny_inputs(hf, batch=2, seq=5)
    reference, wrapped = copy.deepcopy(hf), moelens.wrap(hf)
    handles = [nan_in_second_row(hf), nan_in_second_row(reference)]
    row_0 = (0, slice(None))
    try:
        with torch.set_grad_enabled(grad), wrapped.trace(**inputs):
            moe = wrapped.moes[0]
            {"steer": lambda: moelens.steer(moe, 3, 2.0), "route_around": lambda: moelens.ablate(moe, 3, "route_around"),
             "force_row_0": lambda: moelens.force(moe, 3, tokens=row_0),
             "keep_top_row_0": lambda: moelens.keep_top(moe, 1, tokens=row_0),
             "zero": lambda: moelens.ablate(moe, 3)}[intervention]()
            output = wrapped.output.save()

        def edit(block, moe, index):
            if index:
                return
            logits = logits_op(block, moe)
            if intervention == "steer":
                logits[..., 3] += 2.0
            elif intervention == "route_around":
                logits[..., 3] = float("-inf")
            elif intervention == "force_row_0":
                first = logits[:5]  # the raw logits are flat [batch * seq, E]: row 0's tokens first
                logits[:5, 3] = first[:, 3] + first.amax(-1) - first.amin(-1) + 30.0
            else:
                kept = (lambda w: best_slots_by_rank(w, 1, False)) if intervention == "keep_top_row_0" else None
                swap_call_args(block, moe, lambda i, w: (i, torch.cat([kept(w[:5]), w[5:]]) if kept else
                                                         w.masked_fill(i == 3, 0.0)))

        with torch.set_grad_enabled(grad):
            expected = plain_edit(reference, inputs, running_moes(wrapped), edit)
    finally:
        for handle in handles:
            handle.remove()
    edited = first_tensor(output)
    assert edited[1].isnan().all() and expected[1].isnan().all()
    torch.testing.assert_close(edited[0], expected[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("intervention", ["route_around", "force"])
def test_a_group_limited_routing_intervention_runs_beside_the_model_s_own_nan(intervention):
    """deepseek_v3 (selection scores ranked in groups): with the model's own NaN in row 1, route_around and force were
    refused as if the write left that row's tokens short of experts (NaN > -inf is False). Ground truth: row 0 run
    alone, where the model computes no NaN, with the same intervention."""
    hf = tiny_model("deepseek_v3")
    inputs = tiny_inputs(hf, batch=2, seq=5)
    wrapped = moelens.wrap(hf)
    edit = {"route_around": lambda moe: moelens.ablate(moe, 1, "route_around"),
            "force": lambda moe: moelens.force(moe, [1])}[intervention]
    handle = nan_in_second_row(hf)
    try:
        with torch.no_grad(), wrapped.trace(**inputs):
            edit(running_moes(wrapped)[0])
            output = first_tensor(wrapped.output).save()
    finally:
        handle.remove()
    with torch.no_grad(), wrapped.trace(**{name: value[:1] for name, value in inputs.items()}):
        edit(running_moes(wrapped)[0])
        alone = first_tensor(wrapped.output).save()
    assert output[1].isnan().all()
    torch.testing.assert_close(output[0], alone[0], atol=1e-6, rtol=1e-6)


def test_a_route_around_that_leaves_too_few_experts_is_refused_beside_a_nan_selection_bias():
    """A NaN in deepseek_v3's selection bias (one column of the ranked scores, every token) leaves the weights finite:
    the check of the write's shortfall must still run on those rows (a NaN counts as a pick, as torch's top-k ranks
    it), or routing around six of eight experts passes and the router picks routed-around ones. Ground truth: the
    same route_around on the model without the NaN is refused; one that leaves enough experts runs."""
    hf = tiny_model("deepseek_v3")
    wrapped = moelens.wrap(hf)
    moe = running_moes(wrapped)[0]
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        moe._module.gate.e_score_correction_bias[0] = float("nan")
        assert hf(**inputs).logits.isfinite().all()
    with pytest.raises(moelens.WriteError, match=r"selection_scores: fewer than \d+ entries of some token"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moelens.ablate(moe, [1, 2, 3, 4, 5, 6], "route_around")
    with torch.no_grad(), wrapped.trace(**inputs):
        moelens.ablate(moe, 1, "route_around")
        indices = moe.expert_indices.save()
    assert not (indices == 1).any()


def test_a_nan_the_user_writes_beside_the_model_s_own_is_still_refused():
    """Beside the model's own NaN (row 1), a NaN written into the finite row 0 is refused; an in-place edit of the
    model's tensor under torch.no_grad, where the values before are gone, says so and to assign instead."""
    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    inputs = tiny_inputs(hf, batch=2, seq=5)
    wrapped = moelens.wrap(hf)
    handle = nan_in_second_row(hf)
    try:
        for grad in (False, True):
            with pytest.raises(moelens.WriteError, match=r"holds NaN \(1 of 80, the first at \(0, 2, 3\)\)"):
                with torch.set_grad_enabled(grad), wrapped.trace(**inputs):
                    logits = wrapped.moes[0].router_logits
                    wrapped.moes[0].router_logits = torch.where(torch.arange(5)[:, None] == 2, logits.index_fill(
                        -1, torch.tensor([3]), float("nan")), logits)
        with pytest.raises(moelens.WriteError, match=r"edit a copy and assign it: edited = "
                                                     r"model\.model\.layers\.0\.mlp\.router_logits\.clone\(\)"):
            with torch.no_grad(), wrapped.trace(**inputs):
                wrapped.moes[0].router_logits[0, :, 3] -= 1.0
        # the user's NaN written in place into the model's tensor, then an assignment or an intervention: not the
        # model's own (review: they passed as such)
        then = {"assigned": lambda moe, logits: setattr(moe, "router_logits", logits),
                "steer": lambda moe, logits: moelens.steer(moe, 1, 2.0),
                "force": lambda moe, logits: moelens.force(moe, 1, tokens=(1, slice(None)))}
        for what, follow in then.items():
            with pytest.raises(moelens.WriteError, match=r"holds NaN \(\d+ of 80, the first at \(0, 0, 3\)\)"):
                with torch.no_grad(), wrapped.trace(**inputs):
                    logits = wrapped.moes[0].router_logits
                    logits[0, :, 3] = float("nan")
                    follow(wrapped.moes[0], logits)
        with pytest.raises(moelens.WriteError, match=r"expert_weights: the written tensor holds NaN"):
            with torch.no_grad(), wrapped.trace(**inputs):
                wrapped.moes[0].expert_weights[0, :, 0] = float("nan")
                moelens.keep_top(wrapped.moes[0], 1)
        with torch.no_grad(), wrapped.trace(**inputs):  # assigned, the same edit is told from the model's NaN
            logits = wrapped.moes[0].router_logits
            edited = logits.clone()
            edited[0, :, 3] -= 1.0
            wrapped.moes[0].router_logits = edited
            output = wrapped.output.save()
        assert first_tensor(output)[0].isfinite().all()
    finally:
        handle.remove()


@pytest.mark.parametrize("family", sorted({family for family, _ in CASES}))
def test_reroute_with_the_routers_weights_replays_a_runs_own_routing_unchanged(family):
    """Router replay: reroute(moe, ..., indices, weights="router") with a run's own indices gives each slot the
    weight the family's router gave it, so the output is the plain model's (ground truth: the model's own router).
    Blocks whose weights are no function of the logits and the chosen experts are refused, naming why."""
    hf = tiny_model(family)
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = first_tensor(hf(**inputs))
    wrapped = moelens.wrap(hf)
    moes = [moe for moe in running_moes(wrapped) if not moe.family.derived_routing]
    if not moes:
        pytest.skip("routing is recomputed from the logits: nothing to reroute")
    with torch.no_grad(), wrapped.trace(**inputs):
        recorded = nnsight.save([moe.expert_indices for moe in moes])
    unweighable = [moe for moe in moes if moe.SCORING.select in ("sparsemixer", "skip_topk")
                   or moe.family.resolve(moe.family.extra_logits, moe._module)]
    if unweighable:
        with pytest.raises(moelens.WriteError, match=rf"^reroute: weights='router' on {unweighable[0].path} "
                                                     r"\(\w+\) cannot recompute the weights of other experts: "):
            with torch.no_grad(), wrapped.trace(**inputs):
                moelens.reroute(unweighable[0], ..., recorded[moes.index(unweighable[0])], weights="router")
        return
    with torch.no_grad(), wrapped.trace(**inputs):
        for moe, indices in zip(moes, recorded):
            moelens.reroute(moe, ..., indices, weights="router")
        replayed = first_tensor(wrapped.output).save()
    torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["dbrx", "deepseek_v4", "lfm2_moe", "mistral4", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bfloat16", "float64"])
def test_router_replay_of_a_runs_own_routing_is_exact_in_every_dtype(family, dtype):
    """Replaying a run's own indices changed the logits by a bfloat16 step where the router weighs in bfloat16
    (moelens recomputes in float32) and by 1e-10 in float64: a token sent to its own experts keeps the router's
    weights. Ground truth: the plain model."""
    hf = tiny_model(family, dtype=dtype, experts_implementation="eager" if family == "dbrx" else "batched_mm")
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = first_tensor(hf(**inputs))
    wrapped = moelens.wrap(hf)
    moes = running_moes(wrapped)
    with torch.no_grad(), wrapped.trace(**inputs):
        recorded = nnsight.save([moe.expert_indices for moe in moes])
    with torch.no_grad(), wrapped.trace(**inputs):
        for moe, indices in zip(moes, recorded):
            moelens.reroute(moe, ..., indices, weights="router")
        replayed = first_tensor(wrapped.output).save()
    assert torch.equal(replayed, plain)


def test_router_replay_refusals_say_what_to_do():
    """weights= given as an array (a natural misreading) raised numpy's "truth value of an array is ambiguous"; on a
    block whose router ranks selection scores, route_around before reroute(weights='router') was refused with advice
    to do what the user had done (routing interventions first)."""
    hf = tiny_model("deepseek_v3")
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moe = running_moes(wrapped)[0]
    with pytest.raises(moelens.WriteError, match=r"^reroute: weights=array\(.* is not one of \('kept', 'router'\)"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moelens.reroute(moe, (..., 0), [3, 4], weights=numpy.ones(2))
    with pytest.raises(moelens.OrderError, match=r"^reroute: weights='router' reads .*router_logits, and the model had "
                                                 r"already run past them: .* they do not combine with weights='router' "
                                                 r"in either order: beside them keep the router's weights"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moelens.ablate(moe, 3, "route_around")
            moelens.reroute(moe, (..., 0), [3, 4], weights="router")


def weights_by_hand(family: str, config, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The weights each family's router gives the experts ``indices`` from its raw ``logits`` [T, E], written out."""
    if family == "gpt_oss":  # a softmax over the chosen logits alone
        return logits.gather(-1, indices).softmax(-1)
    if family == "deepseek_v3":  # sigmoid scores of the chosen, renormalised, times the routed scale
        chosen = logits.sigmoid().gather(-1, indices)
        chosen = chosen / chosen.sum(-1, keepdim=True) if config.norm_topk_prob else chosen
        return chosen * config.routed_scaling_factor
    chosen = logits.softmax(-1).gather(-1, indices)  # mixtral (renormalised), qwen2_moe (as norm_topk_prob says)
    return chosen / chosen.sum(-1, keepdim=True) if getattr(config, "norm_topk_prob", True) else chosen


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_reroute_with_the_routers_weights_replays_recorded_routing_on_changed_routers(family):
    """Indices recorded before the routers changed, replayed after: the experts run are the recorded ones, weighted
    by the changed routers' logits. Ground truth: plain nnsight handing the experts call the recorded indices and
    the weights written out by hand from the raw logits op."""
    hf = tiny_model(family)
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moes = running_moes(wrapped)
    with torch.no_grad(), wrapped.trace(**inputs):
        recorded = nnsight.save([moe.expert_indices for moe in moes])
    torch.manual_seed(1)
    with torch.no_grad():
        for moe in moes:
            moe.params().router.add_(torch.randn_like(moe.params().router) * 0.5)
    reference = copy.deepcopy(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        original = nnsight.save([moe.expert_indices for moe in moes])
    assert any(not torch.equal(now, then) for now, then in zip(original, recorded))  # the routers chose otherwise
    with torch.no_grad(), wrapped.trace(**inputs):
        for moe, indices in zip(moes, recorded):
            moelens.reroute(moe, ..., indices, weights="router")
        replayed = first_tensor(wrapped.output).save()

    def edit(block, moe, index):
        logits = logits_op(block, moe)
        flat = recorded[index].flatten(0, 1)
        swap_call_args(block, moe, lambda indices, weights: (
            flat.to(indices.dtype), weights_by_hand(family, hf.config, logits.float(), flat).to(weights.dtype)))

    with torch.no_grad():
        expected = plain_edit(reference, inputs, moes, edit)
    torch.testing.assert_close(replayed, expected, atol=1e-6, rtol=1e-6)
