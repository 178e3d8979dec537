"""What router logits mean: the elementwise scores behind `Moe.router_probs`.

Each family's `Scoring.score` names one of these functions. They run in float32,
as the routers that upcast do, and keep the logits' shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
