"""What router logits mean: the elementwise scores behind `Moe.router_probs`.

Each family's `Scoring.score` names one of these functions. They run in float32,
as the routers that upcast do, and keep the logits' shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float

from ..errors import FamilyError


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return F.softmax(logits, dim=-1, dtype=torch.float32)  # upcast inside the op: one op, the same values


def _sigmoid(logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits.float())


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits.float()).sqrt()


SCORE_FUNCTIONS = {
    "softmax": _softmax,
    "sigmoid": _sigmoid,
    "sqrtsoftplus": _sqrtsoftplus,
}


def score(name: str, logits: Float[torch.Tensor, "*tokens e"], softcap: float = 0.0) -> Float[torch.Tensor, "*tokens e"]:
    """Apply the score function ``name`` (``"softmax"``, ``"sigmoid"``, ...) to ``logits``.

    ``softcap``: a router's logit softcap ``c`` (``Scoring.softcap``), applied first when
    positive: ``tanh(logits / c) * c``.
    """
    try:
        function = SCORE_FUNCTIONS[name]
    except KeyError:
        raise FamilyError(
            f"unknown score function {name!r}; expected one of {sorted(SCORE_FUNCTIONS)}."
        ) from None
    if softcap > 0:
        logits = torch.tanh(logits.float() / softcap) * softcap
    return function(logits)


def derived_routing(
    logits: Float[torch.Tensor, "*tokens e"], k: int, score_name: str, select: str, normalize: bool | float | None,
    scale: float | None, softcap: float = 0.0, normalize_min: float = 0.0,
) -> tuple[Float[torch.Tensor, "*tokens k"], torch.Tensor]:
    """Weights and indices of a router that picks the top-k logits (the top-k scores, its score function being
    monotone), recomputed from the logits for families without an experts call (llama4: then a sigmoid of each):
    the weights are `chosen_weights` of the entry's scoring, in the logits' dtype (rounded as llama4's router rounds
    its float32 scores). `register` refuses a derived entry ranking anything else (a selection bias, groups)."""
    indices = torch.topk(logits, k, dim=-1).indices
    weights = chosen_weights(logits, indices, score_name, select, normalize, scale, softcap, normalize_min)
    return weights.to(logits.dtype), indices


def chosen_weights(logits: torch.Tensor, indices: torch.Tensor, score_name: str, select: str,
                   normalize: bool | float | None, scale: float | None, softcap: float = 0.0,
                   normalize_min: float = 0.0, expert_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The weights ``[..., k]`` a router gives the experts at ``indices``: the scores of the chosen logits
    (``logit_topk``) or the chosen scores of every logit (any other selection), renormalised over the k as
    ``normalize`` says (True: to sum to one; a number p: by their p-norm, as dbrx's ``moe_normalize_expert_weights``;
    False, None or 0: not at all), that sum or norm clamped at >= ``normalize_min`` (ernie4_5's ``moe_norm_min``;
    0: no floor), times ``scale``, times ``expert_scale[e]`` for a slot of expert ``e`` (gemma4's per_expert_scale)."""
    logits = logits.float()
    if select == "logit_topk" and score_name == "softmax":  # a softmax over the chosen logits alone
        chosen = score(score_name, logits.gather(-1, indices), softcap)
    else:  # elementwise scores taken over every logit, then gathered: bit-equal to llama4's sigmoid of its [T, E]
        chosen = score(score_name, logits, softcap).gather(-1, indices)
    if normalize is True:
        chosen = chosen / chosen.sum(-1, keepdim=True).clamp(min=normalize_min)
    elif normalize not in (False, None, 0):
        norm = torch.linalg.vector_norm(chosen, ord=float(normalize), dim=-1, keepdim=True)
        chosen = chosen / norm.clamp(min=normalize_min)
    chosen = chosen * scale if scale is not None else chosen
    if expert_scale is not None:  # a learned multiplier per expert (gemma4's per_expert_scale), of the chosen ones
        chosen = chosen * expert_scale.detach().float().to(chosen.device)[indices]
    return chosen


def kept_experts(groups: tuple[int, int], num_experts: int) -> int:
    """How many of ``num_experts`` a group-limited router can pick from: the experts of the best ``topk_group`` of
    its ``n_group`` equal groups (``groups``: ``(n_group, topk_group)``, as `Family.groups_of` gives them)."""
    n_group, topk_group = groups
    return topk_group * (num_experts // n_group)


def kept_groups(
    ranked: Float[torch.Tensor, "*tokens e"], n_group: int, topk_group: int, group_score: str, fill: float,
    rtol: float = 1e-5,
) -> tuple[Float[torch.Tensor, "*tokens e"], torch.Tensor]:
    """What a group-limited router takes its top-k of: ``ranked`` (its scores, plus a selection bias where it adds
    one) with the experts of all but the best ``topk_group`` of its ``n_group`` consecutive groups set to ``fill``.
    A group scores the sum of its best two (``group_score="top2_sum"``) or its best one (``"max"``).

    Also returns, per token, whether the kept groups are a close call: the last kept group's score within
    ``rtol`` (relative) of the best dropped one's, where rounding may make the router keep the other (a router
    that scores in float16 or bfloat16 rounds by more: mistral4's).
    """
    grouped = rearrange(ranked, "... (g e) -> ... g e", g=n_group)
    best = grouped.topk(min(2 if group_score == "top2_sum" else 1, grouped.shape[-1]), dim=-1).values.sum(-1)
    order = best.sort(dim=-1, descending=True).values
    close = torch.zeros(best.shape[:-1], dtype=torch.bool, device=best.device)
    if topk_group < n_group:
        last, next_best = order[..., topk_group - 1], order[..., topk_group]
        close = (last - next_best) <= rtol * torch.maximum(last.abs(), next_best.abs()).clamp_min(1e-30)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(topk_group, dim=-1).indices, True)
    kept = grouped.masked_fill(~keep.unsqueeze(-1), fill)
    return rearrange(kept, "... g e -> ... (g e)"), close
