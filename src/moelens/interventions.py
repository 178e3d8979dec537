"""Interventions on MoE blocks: plain functions usable inside any trace.

Each says whether it changes the *routing* (which experts run, with which
weights: it writes `router_logits` and lets the family's own scoring do the rest)
or only the *outputs* (it writes the experts call's weights or indices, so the
router's choice stands and only what flows on changes).

============================  ===================  =============================================
call                          changes              how
============================  ===================  =============================================
``ablate(moe, e)``            outputs              weight of every slot routed to ``e`` set to 0
                                                   (``e``: one expert or several, in every mode;
                                                   ``renormalize=True``: the other slots scaled up)
``ablate(.., "route_around")`` routing             ``e``'s logit (or selection score) set
                                                   to -inf: the router picks the best other
                                                   experts, weights renormalised by the family
``ablate(.., "swap", to=j)``  outputs              slots routed to ``e`` run expert ``j``, same weight
``reroute(moe, tokens, ex)``  outputs              the given tokens' slots run experts ``ex``
                                                   (``weights="router"``: weighted as the router
                                                   weighs them; router replay)
``keep_top(moe, n)``          outputs              all but each token's ``n`` highest-weighted
                                                   slots get weight 0 (optionally renormalised)
``steer(moe, e, bias)``       routing              ``bias`` added to ``e``'s logit (SteerMoE style)
``force(moe, experts)``       routing              the given experts put first in every token's
                                                   ranking, so they fill the top slots
============================  ===================  =============================================

Read values of a block before calling an intervention on it (values are served
in execution order) and call interventions that change routing before those that
change outputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, ParamSpec

import nnsight
import numpy
import torch
from jaxtyping import Bool, Float, Int
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from .components import Mlp, Moe
from .components.layer_list import held_blocks
from .components.write_checks import check_before_edit, refuse_under_vmap, remember_before_edit
from .errors import OrderError, ValueUnavailable, WriteError, sentence
from .families import registry
from .families.check import scoring_settings, unrecomputable_weights
from .families.scoring import chosen_weights, score
from .scalars import as_int, as_real, bool_in, check_flag, scalar

ABLATION_MODES = ("zero", "route_around", "swap")

#: What `reroute` gives the rerouted slots: the router's weights of the old experts, or of the new ones.
REROUTE_WEIGHTS = ("kept", "router")

_P = ParamSpec("_P")

#: What an order error inside an intervention means (each intervention writes one value of the block).
INTERVENTION_ORDER = (
    "On one block, call the interventions that change routing (steer, force, ablate(mode='route_around')) before "
    "those that change outputs (ablate with 'zero' or 'swap', reroute, keep_top), and read a value before an "
    "intervention that writes a later one: the model makes the routing first."
)


def _selection_order(moe: Any) -> str:
    """What else orders the routing writes of a block whose router ranks score + a selection bias."""
    if not (isinstance(moe, Moe) and moe.ranks_selection_scores):
        return ""
    return (
        f" On {moe.path} ({moe.family.name}) force and ablate(mode='route_around') also write the selection scores "
        "the router computes after the logits, and force writes the logits too: steer first, then at most one force "
        "(pass all its experts at once; for other experts on other tokens use moelens.reroute), then route_around."
    )


def _intervention(function: Callable[_P, None]) -> Callable[_P, None]:
    """Name the intervention in the order error of a value it asked for after the model had run past it, and in the
    refusal of a value the block cannot serve on this input (ernie4_5_vl_moe's blocks given part of the tokens)."""

    @functools.wraps(function)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        moe = args[0] if args else kwargs.get("moe")
        try:
            return function(*args, **kwargs)
        except OrderError as error:
            if getattr(error, "advised", False):  # says what to do already (`_logits_to_weigh`)
                raise
            raise OrderError(f"{function.__name__}: {error} {INTERVENTION_ORDER}{_selection_order(moe)}") from None
        except ValueUnavailable as error:  # its own type and attributes kept
            if not str(error).startswith(f"{getattr(moe, 'path', None)}."):  # no value of the block: outside a trace,
                raise  # in a backward block, another model's block (`Component._require_trace`, named already)
            error.args = (f"{function.__name__}: {error} ({function.__name__} works on that value, so it cannot act on "
                          "this block in this run.)",)
            raise

    return run


def _moe(block: Any, call: str) -> Moe:
    """``block`` if it is an MoE component, else a `WriteError` that says what it is and where the MoE blocks are."""
    if isinstance(block, Moe):
        block._require_trace(call, f"{call}({block.path}, ...)")
        refuse_under_vmap(f"{call}({block.path}, ...)")
        return block
    if isinstance(block, Mlp):
        raise WriteError(f"{call}: {block.path} is a dense MLP ({type(block._module).__name__}) and runs no mixture of "
                         f"experts; {block._moe_layers}.")
    got = type(block).__name__
    if isinstance(block, nnsight.Envoy):
        inner = held_blocks(block)
        got = f"{block.path} ({type(block._module).__name__})"
        if inner:
            held = inner[0] if len(inner) == 1 else ", ".join(inner[:3]) + (" ..." if len(inner) > 3 else "")
            got += (f", which holds the MoE block {held}: pass that" if len(inner) == 1 else
                    f", which holds the MoE blocks {held}: pass one of them")
    raise WriteError(f"{call} takes an MoE block (model.moes[i] or model.layers[i].mlp of a wrapped model), got {got}.")


def _expert(moe: Moe, expert: Any, what: str) -> int:
    """``expert`` as a Python int id of ``moe`` (an int, a numpy integer or a one-element tensor), checked; ``what``
    names it in an error."""
    index = as_int(expert)
    if index is None:
        mask = (f" (a bool is no id; a mask over the experts goes as a bool tensor of {moe.num_experts} entries)"
                if isinstance(scalar(expert), (bool, numpy.bool_)) else "")
        raise WriteError(f"{what} must be an int expert id in [0, {moe.num_experts}), got {scalar(expert)!r}{mask}.")
    expert = index
    if not 0 <= expert < moe.num_experts:
        raise WriteError(f"{what} {expert} is out of range: {moe.path} has experts 0..{moe.num_experts - 1}.")
    return expert


@_intervention
def ablate(moe: Moe, expert: int | Iterable[int] | Mapping[int, int] | torch.Tensor | numpy.ndarray, mode: str = "zero",
           to: int | Iterable[int] | torch.Tensor | None = None, renormalize: bool = False, tokens: Any = None) -> None:
    """Remove expert ``expert`` (or each of several) from block ``moe`` for the tokens of this invoke (or the given
    ``tokens`` of it).

    Args:
        moe: The MoE component (``model.moes[i]`` or ``model.layers[i].mlp``).
        expert: The expert id to ablate, or several (a list, a set, a range, a tensor of ids:
            pruning the least-used experts is one call).
        mode: ``"zero"``: its slots keep their place but contribute nothing (routing
            unchanged, outputs change); ``"route_around"``: the router never picks it,
            choosing the best other experts and renormalising as the family does
            (changes routing; where the router ranks score + a selection bias,
            ``moe.ranks_selection_scores``, its selection score is set to -inf instead,
            since the bias alone could still pick it);
            ``"swap"``: its slots run expert ``to`` instead, with
            the same weight (outputs change).
        to: The replacement expert for ``mode="swap"``: one for all the ablated experts, or one
            per ablated expert in their order (``ablate(moe, [1, 2], "swap", to=[2, 1])`` exchanges
            experts 1 and 2: each slot's new expert follows from the routing as it was). A swap also
            takes the pairs as one mapping, ``ablate(moe, {1: 2, 2: 1}, "swap")``, as `Edits.swap` does.
        renormalize: For ``mode="zero"``: scale each token's other slots so their weights sum to what all its
            slots' weights summed to (the expert dropped and its weight shared out, with no expert taking its slot:
            colibri's route-around; moelens' ``"route_around"`` lets the router fill the slot instead), as
            `keep_top` renormalises. A token whose every slot is ablated keeps weight 0 in each.
        tokens: Which tokens of this invoke (see `reroute`: a ``[batch, seq]`` bool mask, ``(..., position)``, ...);
            None for all of them. The others keep their routing and weights bit for bit.
    """
    if mode == "swap" and isinstance(expert, Mapping) and to is None:  # {expert: the one taking over its slots}
        expert, to = list(expert), list(expert.values())
    experts = _expert_ids(_moe(moe, "ablate"), expert, "ablate")
    if mode not in ABLATION_MODES:
        raise WriteError(f"ablate mode {mode!r} is not one of {ABLATION_MODES}.")
    if mode != "swap" and to is not None:
        raise WriteError(f"ablate(..., to={to}) only applies to mode='swap', not {mode!r}.")
    renormalize = check_flag("ablate: renormalize", renormalize, WriteError)
    if renormalize and mode != "zero":
        raise WriteError(
            f"ablate(..., renormalize=True) only applies to mode='zero', not {mode!r}: "
            + ("the router renormalises the weights of the experts it picks instead, as the family does."
               if mode == "route_around" else "the expert taking over a slot keeps its weight.")
        )
    if mode == "swap":
        to = _replacements(moe, experts, to, unordered=isinstance(expert, (set, frozenset)))
    if mode == "route_around":
        # Where the router ranks scores + a selection bias, the bias alone could still pick the expert
        # at a -inf logit (its score 0 + bias): exclude it from what is ranked instead. (One location
        # per block, so that several experts can be routed around one after the other.)
        _refuse_unread_bias(moe)
        name = "selection_scores" if moe.ranks_selection_scores else "router_logits"
        ranked = getattr(moe, name)
        chosen = _token_mask(ranked, tokens, "ablate")
        routed_around = ranked.clone()
        routed_around[..., experts] = routed_around[..., experts].masked_fill(chosen, float("-inf"))
        try:  # refused before the model's tensor holds it
            check_before_edit(moe, name, ranked, routed_around)
        except WriteError as error:
            raise WriteError(f"ablate(mode='route_around') of experts {experts}: {error}") from None
        remember_before_edit(ranked)
        ranked[..., experts] = routed_around[..., experts]
        if not moe.ranks_selection_scores and moe.family.holds(moe.SCORING.selection_bias, moe._module):
            _check_bias_did_not_pick(moe)  # a bias this entry names no op for (ergo)
        return
    _refuse_recomputed_routing(moe, f"ablate(mode={mode!r})")
    indices = moe.expert_indices
    chosen = _token_mask(indices, tokens, "ablate")
    routed_here = [(indices == expert) & chosen for expert in experts]  # the routing as it was (a swap may exchange)
    if mode == "zero":
        weights, ablated = moe.expert_weights, functools.reduce(torch.logical_or, routed_here)
        kept = weights.masked_fill(ablated, 0.0)
        moe.expert_weights = _rescaled(weights, kept, _renormalised_total(moe)) if renormalize else kept
        return
    for routed, replacement in zip(routed_here, to):
        indices = indices.masked_fill(routed, replacement)
    moe.expert_indices = indices


def _refuse_recomputed_routing(moe: Moe, call: str) -> None:
    """Raise where ``moe``'s family has no experts call (llama4): moelens recomputes its weights and indices from the
    logits, and the model never reads them, so an intervention writing them could not land."""
    if moe.family.derived_routing:
        raise WriteError(
            f"{call}: {moe.path} ({moe.family.name}) calls no experts module that takes weights and indices (they are "
            "recomputed from router_logits), so writing them cannot change the model; only the routing "
            "interventions apply: ablate(moe, expert, 'route_around'), steer or force (force(moe, experts, tokens=...) "
            "for chosen tokens)."
        )


def _replacements(moe: Moe, experts: list[int], to: Any, unordered: bool = False) -> list[int]:
    """``to`` as the expert that takes over each of ``experts``' slots in a swap: one id for all of them, or one per
    expert (refused where ``unordered``: the experts came as a set, whose order would pair them at random); refused
    where it is missing, of another length, or where every expert would take over its own slots (nothing changes)."""
    if to is None:
        raise WriteError("ablate(..., mode='swap') needs to=<the expert that takes over> (or the pairs as a mapping, "
                         "ablate(moe, {1: 2, 2: 1}, 'swap')).")
    call = "ablate(..., mode='swap')"
    replacements = _expert_ids(moe, to, call, "to", distinct=False)  # two experts may go to one
    if len(replacements) == 1:
        replacements *= len(experts)
    elif (unordered or isinstance(to, (set, frozenset))) and len(experts) > 1:
        raise WriteError(f"{call}: to gives one expert per ablated expert, and {'expert' if unordered else 'to'} is a "
                         "set, whose order would pair them at random; pass lists, in order.")
    if len(replacements) != len(experts):
        raise WriteError(f"{call}: to={replacements} gives {len(replacements)} experts for the {len(experts)} ablated "
                         f"ones {experts}; give one expert for all of them, or one for each.")
    if replacements == experts:
        shown = replacements[0] if len(replacements) == 1 else replacements
        raise WriteError(f"{call}: to={shown} gives each expert its own slots, so nothing would change; give another "
                         "expert to take over them (or use mode='zero').")
    return replacements


def _chosen_experts(moe: Moe) -> torch.Tensor:
    """The experts ``moe``'s router picks per token, ``[b, s, k]``, for a router that adds a selection bias the
    family entry serves no op for (ergo). Where the entry's selection is a plain top-k (of the scores or logits plus
    that bias), they are recomputed from `router_logits` as written so far, so the block's later routing writes
    (another route_around, a force) stay in order; otherwise they are read at the experts call (`expert_indices`)."""
    family, block, scoring = moe.family, moe._module, moe.SCORING
    if scoring.select not in ("score_topk", "logit_topk") or family.groups_of(block) is not None:
        return moe.expert_indices
    ranked = moe.router_logits[..., : moe.num_experts].float()  # without columns past the experts' (zaya, inkling)
    if scoring.select == "score_topk":
        ranked = score(family.score_of(block), ranked, moe.softcap)
    ranked = ranked + family.selection_bias_of(block, moe.num_experts).float()
    return ranked.topk(moe.top_k, dim=-1).indices


def _refuse_unread_bias(moe: Moe) -> None:
    """Raise where a registered family's `Scoring.selection_bias` names nothing on ``moe``'s block (a typo:
    `registry.unread_selection_bias`): the router may add a bias the entry cannot read, so route_around could neither
    rank it out nor tell that it still picks the expert."""
    error = registry.unread_selection_bias(moe.family, moe._module)
    if error is not None:
        raise WriteError(
            f"ablate(mode='route_around'): {moe.path} ({moe.family.name}): Scoring.selection_bias="
            f"{moe.SCORING.selection_bias!r} names nothing on the block ({sentence(error)}), so where the router adds a "
            "bias for picking, the expert could still be picked and route_around could not tell. Fix the entry's "
            "selection_bias (None where the router adds no bias), register it again and wrap the model again "
            "(moelens.wrap(model._module)); or use ablate(moe, expert, 'zero')."
        )


def _check_bias_did_not_pick(moe: Moe) -> None:
    """Raise where a selection bias the family entry serves no op for picked an expert at a -inf logit: the one just
    routed around, or one routed around before it on the block (ranking another expert out can hand it a slot)."""
    logits = moe.router_logits[..., : moe.num_experts]  # first: `_chosen_experts` may run the router past it
    chosen = _chosen_experts(moe)
    at_minus_inf = logits.gather(-1, chosen).isneginf()
    picked = at_minus_inf.any(-1)
    if not is_fake(picked) and picked.any():
        experts = sorted(set(chosen[at_minus_inf].tolist()))
        which = f"expert {experts[0]}" if len(experts) == 1 else f"experts {experts}"
        raise WriteError(
            f"ablate(mode='route_around'): {moe.path} ({moe.family.name}) picks experts by {moe.SCORING.describe()}, "
            f"and its selection bias still picked {which} at a -inf logit for {int(picked.sum())} of "
            f"{picked.numel()} tokens (its family entry serves no selection_scores to rank it out). Use "
            "ablate(moe, expert, 'zero'), or moelens.reroute to send its slots elsewhere"
            + ("" if registry.is_built_in(moe.family) else
               "; or, in your entry, name the router op whose output is the scores plus the bias it ranks "
               "(Scoring(selection_op=...), e.g. 'scores_for_choice_0': moelens.families.check lists the router's "
               "ops), so that route_around ranks the expert out there") + "."
        )


@_intervention
def reroute(moe: Moe, tokens: Any, experts: int | Sequence[int] | torch.Tensor | numpy.ndarray,
            weights: str = "kept") -> None:
    """Send the given tokens' slots to the given experts (outputs change).

    Args:
        moe: The MoE component.
        tokens: Which tokens of this invoke, as an index into ``[batch, seq]`` only: a
            ``[batch, seq]`` bool mask, a ``(batch_index, seq_index)`` tuple,
            ``(slice(None), positions)`` or ``(..., position)`` (``...``: every token).
        experts: One expert id for every slot, or ``k`` ids (one per slot), or a
            tensor broadcastable to the selected ``[n, k]`` slots (one row per selected
            token, in the order the selection gives them: row-major for a mask or slices, the given order
            for index tensors; a ``[b, p, k]`` one shaped like the selection also fits). A selection that
            names a token twice with different experts is refused (which it would keep is undefined).
        weights: ``"kept"``: each slot keeps the weight the router gave it; ``"router"``: the selected tokens'
            slots get the weights the family's scoring gives the new experts from this run's router logits (score,
            renormalisation, scale, per-expert scale, in float32), as if the router had picked them (a token sent to
            the experts it has, slot for slot, keeps its weights). Router replay (``reroute(moe, ...,
            recorded_indices, weights="router")``) runs the experts a recorded run chose with their weights on this
            run's logits; replaying a run's own indices changes nothing. Refused where the
            weights are no function of the logits and the chosen experts (phimoe's sparse mixer, zaya's skip class,
            inkling's extra logit columns).
    """
    _refuse_recomputed_routing(_moe(moe, "reroute"), "reroute")
    logits = _logits_to_weigh(moe, weights)  # read first: the router makes them before the experts' arguments
    indices = moe.expert_indices.clone()
    rows = _token_rows(indices, tokens, "reroute")
    selected = indices[rows]
    _refuse_meta(experts, "reroute", "experts")
    experts = _ordered_ids(experts)
    try:
        with unset_fake_temporarily():  # in model.scan: ids given as numbers or a real tensor keep their values
            replacement = torch.as_tensor(experts, device=indices.device)
    except (TypeError, RuntimeError, ValueError):
        replacement = None
    if replacement is None or replacement.numel() == 0:
        raise WriteError(
            f"reroute: experts={experts!r:.80} {_why_no_ids(experts)}; pass one id, k ids (one per slot), or a tensor "
            "of ids broadcastable to the selected tokens' [n, k] slots."
        )
    known = not is_fake(replacement)  # model.scan's fake tensors (made inside it) hold no ids to show or check
    with unset_fake_temporarily():
        shown = lambda: f" {replacement.tolist()}" if known else ""  # noqa: E731 - only for a refusal
        if replacement.is_floating_point() or replacement.is_complex() or replacement.dtype == torch.bool:
            raise WriteError(f"reroute: expert ids must be integers, got {replacement.dtype}{shown()}; pass ints (or a "
                             ".long() tensor).")
        if known and (int(replacement.min()) < 0 or int(replacement.max()) >= moe.num_experts):
            raise WriteError(f"reroute: expert ids{shown()} must be in [0, {moe.num_experts}) for {moe.path}.")
    replacement = replacement.to(indices.dtype)
    if replacement.dim() > 2:  # shaped like the selection's [b, p, k] slots
        replacement = replacement.reshape(-1, replacement.shape[-1])
    try:
        given = replacement.expand_as(selected)
    except RuntimeError as error:
        raise WriteError(
            f"reroute: experts of shape {tuple(replacement.shape)} do not fit the {tuple(selected.shape)} "
            f"slots selected by tokens; give one id, k={moe.top_k} ids, or one row per selected token."
        ) from error
    if _conflicting_rows(rows[0] * indices.shape[1] + rows[1], given):
        raise WriteError(
            f"reroute: tokens={tokens!r} selects a token more than once and gives it different experts each time, so "
            "which of them it keeps is undefined; select each token once."
        )
    indices[rows] = given
    if logits is not None:
        weighed = moe.expert_weights.clone()
        recomputed = router_weights(moe, logits, indices)[rows].to(weighed.dtype)
        same = (given == selected).all(-1, keepdim=True)  # a token sent to its own experts keeps the router's weights
        weighed[rows] = torch.where(same, weighed[rows], recomputed)
        moe.expert_weights = weighed
    moe.expert_indices = indices


def _logits_to_weigh(moe: Moe, weights: Any) -> torch.Tensor | None:
    """``moe.router_logits``, read where `reroute`'s ``weights`` is ``"router"`` (None for ``"kept"``); refuses
    another ``weights`` and a block whose weights are no function of its logits and the chosen experts."""
    if not isinstance(weights, str) or weights not in REROUTE_WEIGHTS:  # (an array's `in` raises)
        raise WriteError(f"reroute: weights={weights!r} is not one of {REROUTE_WEIGHTS}: 'kept' keeps the router's "
                         "weight of each slot, 'router' gives the new experts the weights the router gives them.")
    if weights == "kept":
        return None
    unweighable = unrecomputable_weights(moe)
    if unweighable:
        raise WriteError(f"reroute: weights='router' on {moe.path} ({moe.family.name}) cannot recompute the weights "
                         f"of other experts: {unweighable}. Keep the router's weights (weights='kept'), or write "
                         "expert_weights yourself.")
    try:
        return moe.router_logits
    except OrderError:
        remedy = ("Call reroute(..., weights='router') before it (a second one on this block too: give all its tokens "
                  "in one call, one row of experts per token), or keep the router's weights (weights='kept')."
                  if not moe.ranks_selection_scores else
                  "On this block force and ablate(mode='route_around') write the selection scores, which the router "
                  "makes after the logits and before the experts' call, so they do not combine with weights='router' "
                  "in either order: beside them keep the router's weights (weights='kept').")
        refusal = OrderError(
            f"reroute: weights='router' reads {moe.path}.router_logits, and the model had already run past them: a "
            f"read of a later value of this block, or an intervention on it, came first. {remedy}"
        )
        refusal.advised = True
        raise refusal from None


def router_weights(moe: Moe, logits: Float[torch.Tensor, "*tokens e"], indices: Int[torch.Tensor, "*tokens k"]
                   ) -> Float[torch.Tensor, "*tokens k"]:
    """The weights ``[..., k]`` ``moe``'s router gives the experts ``indices`` from ``logits``, in float32: its
    family's score, renormalisation, scale and per-expert scale (`moelens.families.scoring.chosen_weights`)."""
    score_name, normalize, scale, softcap, floor, per_expert = scoring_settings(moe)
    return chosen_weights(logits, indices, score_name, moe.SCORING.select, normalize, scale, softcap, floor,
                          per_expert)


@_intervention
def keep_top(moe: Moe, n: int | torch.Tensor, renormalize: bool = False, tokens: Any = None) -> None:
    """Keep each token's ``n`` highest-weighted slots and give the others weight 0 (outputs change).

    The block runs as if it routed each token to its best ``n`` experts (the router's choice
    stands: ``expert_indices`` and the logits are unchanged; the dropped slots stay, contributing
    nothing, as an ablated expert's do under ``ablate(..., "zero")``). Ranked by the slots' weights
    (``expert_weights``), not by their place: many families do not sort their slots.

    A router that ranks score + a selection bias (``moe.ranks_selection_scores``) would keep other experts at
    top_k = n than the highest-weighted ones; set its ``top_k`` to run it at n.

    Args:
        moe: The MoE component.
        n: How many slots to keep, from 0 (none: the routed output is 0) to ``moe.top_k`` (all: nothing changes).
        renormalize: Scale the kept weights so each token's sum is what all its slots' weights summed to, as a
            family that renormalises its top-k weights would give at top_k = n (mixtral, qwen3_moe, gpt_oss; with
            a routed scaling factor, the kept weights sum to it; a sum its rounding alone sets apart from that
            total is taken as the total). By default they keep their values, as a family
            that never renormalises would (deepseek_v2, qwen2_moe without norm_topk_prob). A token whose kept slots
            weigh 0 keeps them at 0; one whose dropped slots weigh 0 (an earlier edit zeroed them) keeps its
            weights as they are.
        tokens: Which tokens of this invoke (see `reroute`); None for all of them.
    """
    _refuse_recomputed_routing(_moe(moe, "keep_top"), "keep_top")
    count = as_int(n)
    if count is None or not 0 <= count <= moe.top_k:
        raise WriteError(f"keep_top: n must be an int slot count in [0, {moe.top_k}] ({moe.path} routes each token to "
                         f"top_k={moe.top_k} experts), got {scalar(n)!r}.")
    renormalize = check_flag("keep_top: renormalize", renormalize, WriteError)
    weights = moe.expert_weights
    rows = None if tokens is None else _token_rows(weights, tokens, "keep_top")
    if count == moe.top_k:  # every slot kept: nothing changes (a renormalisation would round)
        return
    weights = weights.clone()
    total = _renormalised_total(moe) if renormalize else None
    _edit_rows(weights, rows, lambda selected: _best_slots(selected, count, renormalize, total))
    moe.expert_weights = weights


def _renormalised_total(moe: Moe) -> float | None:
    """What ``moe``'s router makes each token's k weights sum to where it renormalises them to sum to one (times its
    scale; dbrx's p-norm with p = 1 is their sum), None where it does not."""
    family, block = moe.family, moe._module
    if moe.SCORING.select != "logit_topk" and family.normalize_of(block) != 1:
        return None
    return family.scale_of(block) or 1.0


def _best_slots(weights: Float[torch.Tensor, "*tokens k"], n: int, renormalize: bool, renormalised: float | None = None
                ) -> Float[torch.Tensor, "*tokens k"]:
    """``weights`` with all but each token's ``n`` largest set to 0 (of equal ones the earlier slots: routers put
    their best expert first, and in bfloat16 the weights of two experts the router told apart can round to one
    value, where torch.topk may pick either); with ``renormalize``, the kept ones scaled to the sum of all of them
    (`_rescaled`, ``renormalised`` the sum the router gives them)."""
    best_first = weights.sort(dim=-1, descending=True, stable=True).indices[..., :n]
    kept = torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, best_first, True)
    best = weights.masked_fill(~kept, 0.0)
    return _rescaled(weights, best, renormalised) if renormalize else best


def _rescaled(weights: Float[torch.Tensor, "*tokens k"], kept: Float[torch.Tensor, "*tokens k"],
              renormalised: float | None) -> Float[torch.Tensor, "*tokens k"]:
    """``kept`` (``weights`` with some slots set to 0) scaled so each token's sum is the sum of its ``weights`` (a
    token whose kept ones sum to 0 keeps its zeros; one that lost no weight, its zeroed slots weighing 0 already,
    keeps its weights bit for bit: w / sum * sum moves them by one ulp). ``renormalised``: the sum the router gives them
    (`_renormalised_total`), taken for a sum that only their rounding to their dtype sets apart from it (in bfloat16
    one weight of 1.0 became 0.996, the sum of the rounded weights); a sum further off is the user's, kept."""
    wide = torch.promote_types(weights.dtype, torch.float32)  # float32, or a float64 model's own dtype
    total, left = weights.to(wide).sum(-1, keepdim=True), kept.to(wide).sum(-1, keepdim=True)
    if renormalised is not None:  # the router's float32 division and sum, then the weights' rounding to their dtype
        rounding = (torch.finfo(weights.dtype).eps + weights.shape[-1] * torch.finfo(torch.float32).eps) \
            * abs(renormalised)
        total = torch.where((total - renormalised).abs() <= rounding, renormalised, total)
    # the router's order (w / sum * scale): n = 1 keeps exactly the total; no 0 / 0, also for the gradient
    rescaled = (kept.to(wide) / left.masked_fill(left == 0, 1.0) * total).to(weights.dtype)
    lost = ((kept == 0) & (weights != 0)).any(-1, keepdim=True)
    return torch.where(lost, rescaled, kept)


def _why_no_ids(experts: Any) -> str:
    """Why ``experts`` (`reroute`'s, as given) made no tensor of ids: an item that is no number, tensors or arrays of
    several ids in a list, rows of different lengths, or nothing in it."""
    items: list[Any] = []
    rows = [experts] if isinstance(experts, (list, tuple)) else []
    while rows:
        for item in rows.pop():
            (rows if isinstance(item, (list, tuple)) else items).append(item)
    odd = [item for item in items if not isinstance(item, (int, float, numpy.number, numpy.ndarray, torch.Tensor))]
    if odd:
        return f"holds {odd[0]!r:.40} ({type(odd[0]).__name__}), which is no expert id"
    if any(isinstance(item, (numpy.ndarray, torch.Tensor)) and item.ndim > 0 for item in items):
        return "holds tensors or arrays of several ids, which torch does not join: stack them into one (torch.stack)"
    return "holds rows of different lengths, which make no tensor" if items else "gives no expert ids"


def _ordered_ids(experts: Any) -> Any:
    """`reroute`'s ``experts`` as given (a list for another ordered sequence: a range, a deque); refuses what gives
    the slots no order (a set, a mapping, a generator) and a bool among the ids (``torch.as_tensor`` would take
    ``[3, True]`` for experts 3 and 1)."""
    if isinstance(experts, Iterable) and not isinstance(experts, (Sequence, torch.Tensor, numpy.ndarray)):
        raise WriteError(f"reroute: experts={experts!r:.80} is a {type(experts).__name__}, which gives the ids no "
                         "order, and reroute gives them to the slots in order; pass one int id, a list or tuple of k "
                         "ids (one per slot), or a tensor of ids broadcastable to the selected [n, k] slots.")
    if isinstance(experts, Sequence) and not isinstance(experts, (list, tuple, str, bytes)):
        experts = list(experts)
    found = bool_in(experts)
    if found is not None:
        raise WriteError(f"reroute: experts={experts!r:.80} holds the bool {found!r}; expert ids are integers (a bool "
                         "is never taken as expert 0 or 1).")
    return experts


def _conflicting_rows(positions: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether a token position listed more than once in ``positions`` gets different rows of ``given`` (False in
    model.scan, where fake tensors hold no positions to compare)."""
    if is_fake(positions) or is_fake(given):
        return False
    order = positions.argsort(stable=True)
    positions, given = positions[order], given[order]
    repeated = positions[1:] == positions[:-1]
    return bool((repeated & (given[1:] != given[:-1]).any(-1)).any())


@_intervention
def steer(moe: Moe, expert: int | Iterable[int] | torch.Tensor | numpy.ndarray, bias: float | torch.Tensor) -> None:
    """Add ``bias`` to expert ``expert``'s router logit (or to each of several experts') for every token
    (changes routing).

    A positive bias makes the router pick the expert more often, a negative one
    less (SteerMoE). The family's scoring turns the biased logits into weights.
    A one-element tensor that requires grad is added as it is, so the gradient reaches it.
    """
    experts = _expert_ids(_moe(moe, "steer"), expert, "steer")
    learned = bias if isinstance(bias, torch.Tensor) and bias.requires_grad and bias.numel() == 1 else None
    bias = scalar(bias)
    real = as_real(bias)  # inf for an int past float's range
    if isinstance(bias, torch.Tensor) and bias.numel() == 1:  # one element whose value `scalar` could not read
        where = "made inside model.scan (a fake tensor)" if is_fake(bias) else f"on the {bias.device.type} device"
        raise WriteError(f"steer: bias is a one-element tensor {where}, which holds no value to add; pass the number "
                         "itself, or a tensor that holds it (on the CPU or the model's device).")
    if real is None:
        raise WriteError(
            f"steer: bias must be a number, got {type(bias).__name__}"
            f"{f' of shape {tuple(bias.shape)}' if isinstance(bias, torch.Tensor) else ''}; for a bias per "
            "expert or per token add it to the logits yourself: moe.router_logits += bias ([E] or "
            "[batch, seq, E]), or moe.router_logits[..., expert] += bias ([batch, seq])."
        )
    if math.isnan(real):
        raise WriteError("steer: bias nan is not a number (NaN); give a finite bias (a few tens already decide the "
                         "routing).")
    logits = moe.router_logits
    added = real if learned is None else learned.reshape(()).to(logits.dtype)
    for expert in experts:  # all checked before any is edited: a refusal leaves the logits as they were
        _check_steer_fits(moe, logits, expert, real)
    remember_before_edit(logits)
    for expert in experts:
        logits[..., expert] += added


def _check_steer_fits(moe: Moe, logits: torch.Tensor, expert: int, bias: float) -> None:
    """Raise where adding ``bias`` to ``expert``'s ``logits`` would take a finite one past what their dtype holds."""
    steered = logits[..., expert].float() + bias
    largest = torch.finfo(logits.dtype).max
    if is_fake(steered):  # model.scan: no logits to add to, but a bias the dtype cannot hold overflows any of them
        reached = abs(bias)
        overflow = reached > largest
    else:
        overflow = bool(((steered.abs() > largest) & logits[..., expert].isfinite()).any())
        reached = float(steered.detach().abs().max()) if overflow else 0.0
    if not overflow:
        return
    down = bias < 0
    if math.isinf(bias) and down:
        raise WriteError(f"steer: bias -inf would remove expert {expert} from {moe.path}'s routing; that is "
                         f"route-around ablation: moelens.ablate(moe, {expert}, 'route_around').")
    raise WriteError(
        f"steer: bias {bias} takes expert {expert}'s logits {'down' if down else 'up'} to "
        f"{'-' if down else ''}{reached:.4g} in "
        f"{moe.path}, beyond what the model's {str(logits.dtype).removeprefix('torch.')} logits hold "
        f"({largest:.4g}, which would be inf); use a bias well inside that range (a few tens already decide "
        "the routing)."
    )


def _is_lone_bool(part: Any) -> bool:
    """Whether ``part`` of a tokens tuple is one bool (Python's, numpy's, a 0-d bool array or tensor)."""
    if isinstance(part, (torch.Tensor, numpy.ndarray)):
        return part.ndim == 0 and part.dtype in (torch.bool, numpy.bool_)
    return isinstance(part, (bool, numpy.bool_))


def _refuse_meta(given: Any, call: str, argument: str) -> None:
    """Refuse a tensor on the meta device as ``call``'s ``argument`` (or in its tuple or list): it holds no values, and
    indexing with one reads whatever memory lies there (model.scan's fake tensors pass: they stand for real ones)."""
    parts = given if isinstance(given, (tuple, list)) else (given,)
    if any(isinstance(part, torch.Tensor) and part.is_meta and not is_fake(part) for part in parts):
        raise WriteError(f"{call}: {argument} holds a tensor on the meta device, which holds no values; pass a tensor "
                         "with data (on the CPU or the model's device), a list, or ints.")


def _token_rows(values: torch.Tensor, tokens: Any, call: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, position)`` index tensors of the tokens ``tokens`` selects in ``values`` ``[b, s, ...]``.

    ``tokens`` indexes the ``[batch, seq]`` grid only (a bool mask, ``(batch_index, seq_index)``,
    ``(slice(None), positions)``, ``...``), so ``(..., p)`` means position ``p`` of every row, never
    a column of the value's last axis. The selected tokens come flat, in the order indexing gives them (row-major
    for a mask or slices, the given order for index tensors; ``values[rows]``
    is ``[n, ...]``). A lone index (an int, a list, an integer mask, a tuple of one) would pick batch rows
    and is refused as ambiguous.
    """
    batch, seq = values.shape[:2]
    _refuse_meta(tokens, call, "tokens")
    if tokens is None:  # force takes None for every token before it gets here; reroute needs a selection
        raise WriteError(
            f"{call}: tokens=None selects no tokens; {call} needs the tokens whose slots it sets: pass "
            "(..., slice(None)) (or ...) for every token, or a [batch, seq] bool mask for some of them."
        )
    whole = tokens is Ellipsis or (isinstance(tokens, slice) and tokens == slice(None))
    if isinstance(tokens, tuple) and any(part is None for part in tokens):
        raise WriteError(
            f"{call}: tokens={tokens!r} holds None, which adds an axis instead of picking tokens; pass "
            "(batch_index, seq_index), (slice(None), positions) or (..., position)."
        )
    if isinstance(tokens, tuple) and any(_is_lone_bool(part) for part in tokens):
        raise WriteError(
            f"{call}: tokens={tokens!r} holds a lone bool, which indexes as a new axis (True picks every token, "
            "False none), not a position; pass an int position, (..., position), or a [batch, seq] bool mask."
        )
    lone = isinstance(tokens, tuple) and len(tokens) == 1 and tokens[0] is not Ellipsis  # (0,) picks batch row 0
    if lone or not (isinstance(tokens, tuple) or whole
                    or (_is_bool_mask(tokens) and torch.as_tensor(tokens).dim() == 2)):  # a [batch, seq] mask
        raise WriteError(
            f"{call}: tokens={tokens!r} is ambiguous: on its own an index (an int, a list, a tuple of one, an integer "
            "tensor or mask, a bool mask that is not [batch, seq]) picks whole batch rows, not positions; pass a [batch, seq] "
            "bool mask (an integer 0/1 mask: "
            ".bool()), (batch_index, seq_index), (slice(None), positions) or (..., position)."
        )
    grid = torch.arange(batch * seq, device=values.device).view(batch, seq)
    if not isinstance(tokens, (tuple, torch.Tensor)) and not whole:
        tokens = torch.as_tensor(tokens)  # a nested list would index one axis per inner list, not as a mask
    try:
        chosen = grid[tokens]
    except (IndexError, TypeError, RuntimeError) as error:
        raise WriteError(
            f"{call}: tokens={tokens!r} is not an index into this invoke's [batch, seq] = [{batch}, {seq}] "
            f"tokens ({error}); pass a [batch, seq] bool mask, (batch_index, seq_index), or (slice(None), positions)."
        ) from None
    chosen = chosen.reshape(-1)
    return chosen // seq, chosen % seq


def _is_bool_mask(tokens: Any) -> bool:
    """Whether ``tokens`` is a bool tensor, array or nested list (a mask)."""
    if isinstance(tokens, (int, slice)) or tokens is None:
        return False
    try:
        return torch.as_tensor(tokens).dtype == torch.bool
    except (TypeError, RuntimeError, ValueError):
        return False


def _token_mask(values: torch.Tensor, tokens: Any, call: str) -> Bool[torch.Tensor, "b s 1"]:
    """Where ``tokens`` (as `_token_rows` takes it; None: every token) selects a token of ``values`` ``[b, s, ...]``,
    as a mask that broadcasts over its last axis."""
    mask = torch.full(values.shape[:2], tokens is None, dtype=torch.bool, device=values.device)
    if tokens is not None:
        mask[_token_rows(values, tokens, call)] = True
    return mask[..., None]


def _edit_rows(values: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None,
               edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace ``values`` (or its ``rows``, from `_token_rows`) in place by ``edit`` of them (a new tensor)."""
    remember_before_edit(values)
    if rows is None:
        values[...] = edit(values)
    else:
        values[rows] = edit(values[rows])


def _expert_ids(moe: Moe, experts: Any, call: str, argument: str = "expert", distinct: bool = True) -> list[int]:
    """The expert ids of ``moe`` that ``call``'s ``argument`` gives, checked (``distinct``: each once): one id, or the
    items of any iterable (a list, a set, a range, a generator, dict keys) or of a 1-D tensor or array, or where a 1-D
    bool tensor or array (a mask over the ``E`` experts) holds True. Text and
    mappings are refused as a whole: a str is iterable, but its characters are no expert ids, and a mapping's values
    would be dropped; so are tensors of more axes, rows of ids for several blocks."""
    _refuse_meta(experts, call, argument)
    if isinstance(experts, torch.Tensor) and is_fake(experts) and experts.numel() > 1:
        raise WriteError(f"{call}: expert ids in a tensor made inside model.scan have no values there (its tensors "
                         "are fake); pass a list of ints, or a tensor made before the scan.")
    if isinstance(experts, (torch.Tensor, numpy.ndarray)) and experts.ndim > 1:
        raise WriteError(f"{call}: {argument} is a tensor of shape {tuple(experts.shape)}; pass the expert ids of this "
                         f"block, one id or a 1-D list or tensor of them (rows for several blocks: one call each, "
                         "for moe, row in zip(model.moes, rows)).")
    if isinstance(experts, (torch.Tensor, numpy.ndarray)) and experts.dtype in (torch.bool, numpy.bool_) \
            and experts.ndim == 1:  # a mask over the experts (usage.counts[row] < t): the ids where it holds
        if len(experts) != moe.num_experts:
            raise WriteError(f"{call}: {argument} is a bool mask of {len(experts)} entries, and {moe.path} has "
                             f"{moe.num_experts} experts; give one entry per expert, or the expert ids.")
        experts = experts.nonzero()[0] if isinstance(experts, numpy.ndarray) else experts.nonzero().flatten()
        if len(experts) == 0:
            raise WriteError(f"{call}: the bool mask given as {argument} selects no expert.")
    if isinstance(experts, (torch.Tensor, numpy.ndarray)):  # a 0-d one too
        with unset_fake_temporarily():  # in model.scan: a real tensor's ids, not placeholder symbols
            experts = [scalar(expert) for expert in experts.reshape(-1)]
    if isinstance(experts, (str, bytes, bytearray, Mapping)):
        weights = " force takes no weights, the router's scoring of the raised logits gives them." \
            if call == "force" else ""
        raise WriteError(f"{call}: {argument}={experts!r:.80} is {type(experts).__name__}, not expert ids; pass an int "
                         f"expert id, or a list of them ({call.split('(')[0]}(moe, [3, 5])).{weights}")
    listed = list(experts) if isinstance(experts, Iterable) else [experts]
    ids = [_expert(moe, expert, f"{call}: {'expert' if argument == 'experts' else argument}") for expert in listed]
    if not ids:
        raise WriteError(f"{call}: no expert given; pass one expert id or a list of them.")
    repeated = sorted({expert for expert in ids if ids.count(expert) > 1}) if distinct else []
    if repeated:
        why = ("a router picks an expert for one slot at most: pass distinct experts (moelens.reroute sets slots to "
               "any experts)") if call == "force" else "give each expert once"
        raise WriteError(f"{call}: expert {repeated[0]} is given more than once in {ids}; {why}.")
    return ids


@_intervention
def force(moe: Moe, experts: int | Iterable[int] | torch.Tensor | numpy.ndarray, tokens: Any = None) -> None:
    """Make every token (or the given ``tokens``) route to ``experts`` first (changes routing).

    The forced experts' logits are raised above every other expert's (by the logits'
    range + 30, keeping the forced experts' own logit order among themselves), so they
    fill the top ``len(experts)`` slots; weights follow from the family's scoring of the
    raised logits: with softmax scores the other slots keep a weight near 0, with sigmoid
    scores the forced ones saturate towards 1. phimoe's sparsemixer masks each slot's
    softmax by each logit's gap to the top one relative to its size, which a raise would
    shrink: there the other experts are lowered by as much instead, so the forced experts
    keep the weights the router gives them among themselves (forcing the experts a token
    already picks changes nothing, unless other experts lie within the mixer's jitter
    threshold of a forced expert's logit (the top one's for the first slot, the second
    one's for the second): those drop out of its masked softmaxes, and the forced
    weights grow), and a slot left beside them takes the best other expert, weighted by a
    softmax over the others within the threshold of it (from about 1 / (E - forced) where
    the other logits are close, up to 1): force ``top_k`` experts to fill every slot.

    Where the router ranks score + a selection bias (``moe.ranks_selection_scores``) the
    forced experts' selection scores are also set to +inf, so the bias cannot overrule
    them. Where it keeps only the best groups of experts (DS3, mistral4, DeepSeek-V2's
    group-limited greedy) a raised expert wins its group and its group a place, so
    ``force`` raises `WriteError` up front when the experts lie in more groups than are
    kept. (A custom family with a selection bias but no ``selection_op``: ``force`` reads
    the resulting ``expert_indices`` and raises if a token misses a forced expert.) Call it
    before ``route_around`` on the same block. A hash-routed layer (deepseek_v4's first layers) picks experts
    from a token-id table: ``force`` raises there. Read routing values of the block
    before calling it. ``tokens`` indexes this invoke's ``[batch, seq]`` (see `reroute`).
    """
    chosen = _expert_ids(_moe(moe, "force"), experts, "force", "experts")
    if len(chosen) > moe.top_k:
        raise WriteError(f"force: {len(chosen)} experts given but {moe.path} routes each token to only {moe.top_k}; "
                         f"force at most {moe.top_k}: the token's other slots keep the router's choice.")
    scoring = moe.SCORING
    if scoring.select == "hash":
        raise WriteError(
            f"force: {moe.path} ({moe.family.name}) picks experts from a token-id table "
            f"({moe.family.described_on(moe._module)}); "
            "its logits only weight them. Set the slots with moelens.reroute(moe, tokens, experts) instead."
        )
    groups = moe.family.groups_of(moe._module)
    if groups is not None:  # a raised expert wins its group, and its group a place, unless too many groups
        n_group, topk_group = groups
        spanned = sorted({expert // (moe.num_experts // n_group) for expert in chosen})
        if len(spanned) > topk_group:
            raise WriteError(
                f"force: {moe.path} picks experts inside the best {topk_group} of {n_group} expert groups, and "
                f"experts {chosen} lie in {len(spanned)} groups {spanned}: some could never be picked. Force experts "
                f"of at most {topk_group} groups, or set the slots with moelens.reroute(moe, tokens, experts)."
            )

    # Scores ranked by the router as they are (with a selection bias: the +inf write or the choice check below)
    # saturate (sigmoid at 1, softmax at 0), so raised logits can still tie there. Among the top-k a tie may take
    # a slot left beside the forced experts; inside groups it may cost a forced expert its group.
    ranks_scores = scoring.select in ("score_topk", "group_topk") and not moe.ranks_selection_scores and \
        not moe.family.holds(scoring.selection_bias, moe._module)
    room = moe.top_k - len(chosen) if scoring.select == "score_topk" else 0
    score_name = moe.family.score_of(moe._module) if ranks_scores else ""

    def tied(ranked: torch.Tensor, room: int = 0, considered: torch.Tensor | None = None) -> bool:
        """Whether some token ranks more than ``room`` other experts as high as one of the forced ones in ``ranked``
        (among the tokens ``considered``: not those whose logits the model itself made +inf, which no raise outranks)."""
        others = ranked.clone()
        others[..., chosen] = float("-inf")
        ties = (others >= ranked[..., chosen].amin(-1, keepdim=True)).sum(-1) > room
        if considered is not None:
            ties = ties & considered
        return bool(ties.any())

    # phimoe's sparsemixer masks each slot's softmax by the gap to the top logit relative to its size: raising the
    # forced experts would shrink their gaps and unmask some of them, so the others are lowered instead.
    lowers_others = scoring.select == "sparsemixer"

    def lifted(rows: torch.Tensor) -> torch.Tensor:
        finite = rows.masked_fill(~torch.isfinite(rows), 0)
        gap = finite.amax(-1, keepdim=True) - finite.amin(-1, keepdim=True) + 30.0
        raised = rows - gap if lowers_others else rows.clone()  # a -inf (routed around) stays -inf
        raised[..., chosen] = finite[..., chosen] if lowers_others else finite[..., chosen] + gap
        if is_fake(rows):  # model.scan: no values to check
            return raised
        if (torch.isinf(raised) & torch.isfinite(rows)).any() or torch.isinf(raised[..., chosen]).any():
            span = float((finite.float().amax(-1) - finite.float().amin(-1)).max().detach())  # float16 spans overflow
            moved = "lowering the others below" if lowers_others else "raising them above the others"
            raise WriteError(
                f"force: {moe.path}'s router logits span {span:.4g}, so forcing experts {chosen} ({moved} by the "
                f"span + 30) overflows {rows.dtype} (at most {torch.finfo(rows.dtype).max:.4g}); steer by "
                "less before forcing, or set the slots with moelens.reroute(moe, tokens, experts)."
            )
        # a +inf the model computed itself (a float16 overflow) is not the write's: its tokens keep their own NaN
        considered = ~(rows == float("inf")).any(-1)
        if tied(raised, considered=considered):  # rounded into a tie
            top = float(finite.abs().amax().detach())
            raise WriteError(
                f"force: {moe.path}'s router logits reach {top:.4g}, where {rows.dtype} is too coarse (steps of about "
                f"{torch.finfo(rows.dtype).eps * top:.3g}) for experts {chosen} raised above the others to stay above "
                "them; steer by less before forcing, or set the slots with moelens.reroute(moe, tokens, experts)."
            )
        if ranks_scores:
            scored = score(score_name, raised, moe.softcap)[..., : moe.num_experts]
            for dtype in dict.fromkeys((torch.float32, rows.dtype)):  # the router may score in the logits' dtype
                if tied(scored.to(dtype), room, considered):
                    raise WriteError(
                        f"force: {moe.path} ranks experts by their {score_name} scores, which saturate: with the "
                        f"logits of experts {chosen} raised above the others, some other experts still score as high "
                        f"in {dtype} (their logits are too large already), so the router could leave a forced expert "
                        "out. Steer by less before forcing, or set the slots with moelens.reroute(moe, tokens, experts)."
                    )
        return raised

    logits = moe.router_logits
    rows = None if tokens is None else _token_rows(logits, tokens, "force")  # every value below is [b, s, ...]
    _edit_rows(logits, rows, lifted)
    if moe.ranks_selection_scores:  # also ranked first where the selection bias is added: they win
        forced = torch.tensor(chosen, dtype=torch.long)
        _edit_rows(moe.selection_scores, rows,
                   lambda ranked: ranked.index_fill(-1, forced.to(ranked.device), float("inf")))
    elif moe.family.holds(scoring.selection_bias, moe._module):  # a bias this entry names no op for
        indices = _chosen_experts(moe)
        if rows is not None:
            indices = indices[rows]
        missed = ~torch.stack([(indices == expert).any(-1) for expert in chosen]).all(0)
        if not is_fake(missed) and missed.any():
            raise WriteError(
                f"force: {moe.path} ({moe.family.name}) picks experts by {scoring.describe()}, not by the logits "
                f"alone; raising the logits of experts {chosen} left {int(missed.sum())} of {missed.numel()} "
                "tokens without them (a bounded score cannot outrank a larger selection bias). Set the slots "
                "with moelens.reroute(moe, tokens, experts) instead."
            )
