"""How a family's routing maps onto tract_moe_ffn's gate modes, read from `Family.scoring`.

tract computes ``logits = x @ wg.T (+ wg_bias)``, takes the top-k logits and weights them
with one of four gate modes:

================  ===================================================  ==========================
gate              weights of the k chosen experts                      moelens scoring
================  ===================================================  ==========================
``softmax_topk``  softmax over the k chosen logits                     softmax, renormalised
                                                                       (``SM+``, ``TK->SM``)
``softmax_all``   softmax over all E logits, gathered, not renormalised softmax, not renormalised
``sigmoid``       sigmoid of each chosen logit                         sigmoid, not renormalised
``raw``           the chosen logits themselves                         (no moelens family)
================  ===================================================  ==========================

A multiplier on the weights (``Scoring.scale``) is applied to the op's output (the weights
enter the output linearly). What tract cannot express: a selection-only correction bias
(``wg_bias`` shifts selection *and* weights), group-limited selection (unless it is trivial on
the live block), sigmoid scores renormalised over the k, a floor on the renormalising sum that can
bind (`floor_refusal`), sparse-mixer, hash or skip-class selection, and score functions other than
softmax and sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import families
from ..errors import FamilyError
from ..families import Family, Scoring
from ..families.tomoe import converted
from .errors import ExportRefused

#: tract_moe_ffn's gate modes.
GATE_MODES = ("softmax_topk", "softmax_all", "sigmoid", "raw")

_SELECTIONS = {"score_topk", "logit_topk", "group_topk"}


@dataclass(frozen=True)
class Routing:
    """The tract routing of one live block.

    Attributes:
        gate: One of `GATE_MODES`.
        scale: Multiplier the router applies to the k weights (1.0 when none), applied
            to the op's output.
        k: Experts per token.
        num_experts: E.
    """

    gate: str
    scale: float
    k: int
    num_experts: int


@dataclass(frozen=True)
class Support:
    """Whether a family exports, from its entry alone (no model needed).

    Attributes:
        status: ``"yes"``, ``"if"`` (depends on the checkpoint's config; `condition` says
            on what) or ``"no"`` (`reason` says which part tract cannot express).
        gate: The gate mode (or ``"softmax_topk / softmax_all"`` when a flag decides).
        condition: For ``"if"``: what the live block must satisfy.
        reason: For ``"no"``: what tract cannot express.
    """

    status: str
    gate: str = ""
    condition: str = ""
    reason: str = ""


def _literal(value: Any) -> bool:
    return not (isinstance(value, str) and "." in value)


def family_support(family: Family | str) -> Support:
    """What the family entry (or the family registered under that name) says about exporting its blocks to
    tract_moe_ffn.

    Raises:
        FamilyError: no family is registered under the name, or ``family`` is neither a name nor an entry.
    """
    if isinstance(family, str):
        family = families.get(family)
    if not isinstance(family, Family):
        raise FamilyError(f"family_support takes a family entry (moelens.families.get(name)) or its name, got "
                          f"{type(family).__name__} {family!r:.60}.")
    reason = structural_refusal(family)
    if reason:
        return Support("no", reason=reason)
    scoring = family.scoring
    reasons = _hard_refusals(family)
    conditions: list[str] = []
    if scoring.groups:
        if reasons:
            reasons.append(_groups())
        else:
            conditions.append(f"{_groups_condition(scoring)} (group-limited selection is refused)")
    if reasons:
        return Support("no", reason="; ".join(reasons))
    score, normalize = scoring.score, scoring.normalize
    if scoring.select == "logit_topk" or normalize is True:
        softmax = "softmax_topk"
    elif normalize is False:
        softmax = "softmax_all"
    else:
        softmax = f"softmax_topk if {normalize} else softmax_all"
    refused = "sigmoid scores renormalised over the k are refused"
    if score == "sigmoid":
        gate = "sigmoid"
        if not _literal(normalize):
            conditions.append(f"not {normalize} ({refused})")
    elif _literal(score):
        gate = softmax
    elif normalize is True:  # a sigmoid would be renormalised
        gate = softmax
        conditions.append(f"{score} is softmax ({refused})")
    else:
        gate = f"{softmax} / sigmoid"
        sigmoid = " or sigmoid" if normalize is False else f", or is sigmoid and not {normalize} ({refused})"
        conditions.append(f"{score} is softmax{sigmoid}")
    if scoring.normalize_min is not None and scoring.normalize is not False and scoring.normalize_min != 0:
        conditions.append(f"{scoring.normalize_min} <= k/E (a floor on the sum of the k weights that can bind is "
                          "refused)")
    if converted(family):
        conditions.append("its experts are gated (a SwiGLU FFN converted): other conversions (GPT-2 and BERT FFNs, "
                          "Linear layers as wide out as in) export as moelens.compress.exportable(model)")
    if conditions:
        return Support("if", gate=gate, condition="; ".join(conditions))
    return Support("yes", gate=gate)


def _hard_refusals(family: Family, score: Any = None, scoring: Scoring | None = None) -> list[str]:
    """What tract cannot express whatever the checkpoint's config (from the entry; ``score`` when resolved)."""
    scoring = family.scoring if scoring is None else scoring
    reasons = []
    if scoring.selection_bias:
        reasons.append(_selection_bias(scoring.selection_bias))
    if scoring.select not in _SELECTIONS:
        reasons.append(_selection(scoring.select))
    score = scoring.score if score is None else score
    if _literal(score) and score not in ("softmax", "sigmoid"):
        reasons.append(_score(score))
    if score == "sigmoid" and scoring.normalize is True:
        reasons.append(_sigmoid_renormalised())
    if family.expert_gate is not None and family.expert_gate.kind not in ("glu", "clamped_swiglu"):
        reasons.append(expert_gate_refusal(family.expert_gate.kind))
    if family.identity_experts is not None:
        reasons.append(f"zero-compute experts ({family.identity_experts}) that pass their input through: "
                       "every tract_moe_ffn expert is an FFN with weights")
    return reasons


def structural_refusal(family: Family) -> str:
    """Why the family's block has no shape tract_moe_ffn can take, or ``""``."""
    if not family.experts_call or family.derived_routing:
        return ("the block does not call its experts as experts(hidden, indices, weights) (they run on their own, "
                "e.g. on score-premultiplied inputs), so it is not one routed-experts op")
    if "mlp_output" in family.refused:
        return f"the block output is not an FFN output ({family.refused['mlp_output'].split(';')[0]})"
    if "expert_outputs" in family.refused:  # dbrx: its own experts module; ergo: a norm per expert after the op
        return f"the experts are not one transformers experts op: {family.refused['expert_outputs']}"
    return ""


def routing(family: Family, block: Any) -> Routing:
    """The tract routing of a live block; raises `ExportRefused` naming what tract cannot express."""
    name = family.name
    reason = structural_refusal(family)
    if reason:
        raise ExportRefused(f"{name}: {reason}.")
    scoring = family.scoring_of(block)
    score = family.score_of(block)
    reasons = _hard_refusals(family, score, scoring)
    if scoring.expert_scale:
        reasons.append(f"a learned multiplier per expert ({scoring.expert_scale}) on the chosen "
                       "weights: tract's gate weighs every expert alike")
    if family.softcap_of(block) > 0:
        reasons.append("router logits softcapped before scoring (tanh(logits / c) * c): tract's gate scores "
                       "the router's linear output as it is")
    groups = family.groups_of(block)
    limited = groups is not None and groups[0] != 1 and groups[1] < groups[0]
    if limited:
        reasons.append(_groups(f" (the best {groups[1]} of {groups[0]} groups)"))
    normalize = family.resolve(scoring.normalize, block)
    floor = floor_refusal(family, block, normalize) if score == "softmax" else ""
    if floor:
        reasons.append(floor)
    if limited and len(reasons) == 1:  # the groups alone stand in the way: say where such a block exports
        reasons[0] += _groups_remedy(name, scoring)
    if reasons:
        raise ExportRefused(f"{name}: " + "; ".join(reasons) + ".")
    if score == "sigmoid" and normalize:
        raise ExportRefused(f"{name}: {_sigmoid_renormalised()}.")
    if score == "sigmoid":
        gate = "sigmoid"
    elif scoring.select == "logit_topk" or _truthy_norm(normalize):
        gate = "softmax_topk"
    elif normalize in (False, None, 0):
        gate = "softmax_all"
    else:
        raise ExportRefused(
            f"{name}: the k softmax weights are normalised by {scoring.normalize} = {normalize!r}; tract_moe_ffn "
            "renormalises them to sum to one (softmax_topk) or not at all (softmax_all)."
        )
    scale = family.scale_of(block)
    return Routing(
        gate=gate,
        scale=1.0 if scale is None else scale,
        k=int(family.resolve(family.top_k, block)),
        num_experts=int(family.resolve(family.num_experts, block)),
    )


def floor_refusal(family: Family, block: Any, normalize: Any) -> str:
    """Why tract cannot express the floor the live ``block``'s router clamps its renormalising sum at
    (`Scoring.normalize_min`, ``normalize`` as resolved on the block), or "" where the floor cannot bind.

    tract's ``softmax_topk`` always renormalises to sum to one; the router divides by ``clamp(sum, min=floor)``
    instead, which differs only on tokens whose k chosen softmax scores sum below the floor. The k largest of E
    softmax scores (what a router without a selection bias or groups picks, the only routers exported) sum to at
    least k/E, and a softmax over the k chosen logits (``logit_topk``) to 1: a floor at most that never binds
    (ernie4_5's default ``moe_norm_min=1e-12``), one above it is refused. A router that does not renormalise to a
    sum has no sum to clamp.
    """
    if not _truthy_norm(normalize):
        return ""
    floor = family.normalize_min_of(block)
    k, experts = int(family.resolve(family.top_k, block)), int(family.resolve(family.num_experts, block))
    logit_topk = family.scoring_of(block).select == "logit_topk"
    least, what = (1.0, "1, what a softmax over the k chosen logits sums to") if logit_topk else (
        k / experts, f"k/E = {k}/{experts}, the least the k largest of E softmax scores sum to")
    if floor <= least:
        return ""
    return (f"the k softmax weights are divided by their sum clamped at >= {floor:g} (Scoring.normalize_min = "
            f"{family.scoring_of(block).normalize_min!r}, a floor such as ernie4_5's moe_norm_min), above {what}: "
            "it binds where the chosen scores sum below it, and tract_moe_ffn's softmax_topk always renormalises "
            "them to sum to one")


def _truthy_norm(normalize: Any) -> bool:
    # True, or dbrx's p-norm with p == 1 (a sum: the weights are positive softmax values).
    return normalize is True or (not isinstance(normalize, bool) and normalize == 1)


def _selection_bias(reference: str) -> str:
    return (f"a correction bias ({reference}) used for expert selection only: tract's router bias (wg_bias) "
            "shifts selection and weights alike")


def _groups(which: str = "") -> str:
    return f"group-limited expert selection{which}: tract picks the top-k over all experts"


def _groups_remedy(name: str, scoring: Scoring) -> str:
    """What a live block refused for its group-limited selection alone is told: where a block of its family exports."""
    where = ("its groups do not apply, " if scoring.groups_if else "") + "there is one group or every group is kept"
    return (f"{GROUPS_REMEDY.format(name=name)} {where} ({_groups_condition(scoring)}): see "
            f"moelens.export.family_support({name!r})")


#: How `_groups_remedy` starts (the support table, whose row states the condition, leaves it out).
GROUPS_REMEDY = "; a {name} block exports only where"


def _groups_condition(scoring: Scoring) -> str:
    """Where a block of group-limited ``scoring`` exports all the same: its groups do not apply (`Scoring.groups_if`),
    it has one group, or it keeps every group (the references as the entry names them)."""
    n_group, topk_group = scoring.groups
    unless = f"{scoring.groups_if[0]} != {scoring.groups_if[1]!r} or " if scoring.groups_if else ""
    return f"{unless}{n_group} == 1 or {topk_group} == {n_group}"


def _selection(select: str) -> str:
    what = {
        "sparsemixer": "sparse-mixer routing (masked softmaxes per slot)",
        "hash": "hash routing (experts picked from a token-id table)",
        "skip_topk": "a 'skip' class in the router's softmax",
    }.get(select, f"{select!r} expert selection")
    return f"{what}: tract picks the top-k logits of one linear router"


def _score(score: Any) -> str:
    return f"the {score!r} score function: tract gates with softmax, sigmoid or the raw logits"


def _sigmoid_renormalised() -> str:
    return "sigmoid scores renormalised over the k chosen experts: tract's sigmoid gate does not renormalise"


def expert_gate_refusal(kind: str) -> str:
    """Why tract_moe_ffn cannot run experts whose gated activation is of ``kind`` (a family's `ExpertGate` kind)."""
    what = {
        "clamped_glu": "clamped SwiGLU without the sigmoid slope and offset (silu(min(g, l)) * clamp(u))",
        "glu_clamped": "SwiGLU whose activation is clamped after it is applied (min(silu(g), l) * clamp(u))",
        "softcapped_glu": "softcapped SwiGLU",
    }.get(kind, kind)
    return (f"experts computing a {what}: tract has swiglu/silu/gelu/relu and gpt-oss's clamped SwiGLU "
            "(act_alpha, act_limit) only")
