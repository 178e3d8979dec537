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


def top_logits(
    logits: Float[torch.Tensor, "*tokens e"], k: int, score_name: str
) -> tuple[Float[torch.Tensor, "*tokens k"], torch.Tensor]:
    """Weights and indices of routing that takes the top-k logits and scores them.

    The routing of families without an experts call (llama4: top-k of the logits,
    then a sigmoid of each), recomputed from the logits. The weights come back in the
    logits' dtype, rounded as llama4's router rounds its float32 scores.
    """
    values, indices = torch.topk(logits, k, dim=-1)
    return score(score_name, values).to(logits.dtype), indices


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
