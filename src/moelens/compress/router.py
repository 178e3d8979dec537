"""`ToMoERouter`: a linear router whose top-k experts run with weight exactly 1.

A converted layer must equal the dense one when every expert runs, so each
selected expert's output is added with weight 1. The router expresses that with
a gate every runtime knows (moelens' ``logit_topk`` + ``sigmoid`` scoring, tract's
``sigmoid`` gate mode): the logits are ``x @ W.T + b`` where ``b`` carries a large
offset, the top-k logits are selected, and their sigmoid is exactly 1.0 in
float32 (``sigmoid(z) == 1.0`` for every ``z > 16.7``; the offset keeps every
selected logit of the calibration tokens above `MIN_SELECTED_LOGIT`).

The router keeps float32 weights in a lower-precision model (its inputs are cast up):
the offset leaves bf16 a resolution of 0.25-0.5 around the logits, too coarse to rank
experts. Casting the model later (``model.to(torch.bfloat16)``, ``.half()``) keeps them
float32 too; moving it to another device moves them. Its logits are computed with autocast
off (as transformers' own routers do): autocast would cast ``F.linear``'s inputs to bf16 again.

Training: the sigmoid is flat there, so the backward is straight-through: each selected weight's
gradient (how much its expert's output helps the loss) goes to its logit unchanged, and the router
(and its LoRA adapter) learn to rank the experts that help higher. The forward is unchanged (1.0).

``router_logits - router.offset`` is the router's prediction of how much each
expert's output matters for the token (the norm of its deviation from the mean
contribution the block adds when it is skipped); ranking by it is what the
top-k does.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..scalars import as_lone_int, as_real
from .errors import CompressionError
from .lora import LoRAHost

#: The smallest selected logit the offset guarantees on the calibration tokens.
MIN_SELECTED_LOGIT = 64.0


def _autocast_off(device_type: str) -> AbstractContextManager:
    """A context in which autocast leaves ops on ``device_type`` tensors in their own dtype.

    ``torch.autocast(device_type, enabled=False)`` where autocast is on for that device; a no-op
    otherwise (``meta`` tensors, which torch.autocast refuses, and runs without autocast).
    """
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


class ToMoERouter(LoRAHost):
    """Linear router: ``logits = x @ weight.T + bias``; top-k logits; weights ``sigmoid`` (= 1).

    Attributes:
        weight: ``[E, D]`` (with its LoRA adapter added when there is one, `LoRAHost`).
        bias: ``[E]``, including `offset`.
        offset: The constant added to every logit so selected weights saturate to 1.
        top_k: k, the experts each token runs.
        num_experts: E.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, offset: float = MIN_SELECTED_LOGIT) -> None:
        sizes = {"hidden_size": hidden_size, "num_experts": num_experts, "top_k": top_k}
        wrong = {name: value for name, value in sizes.items() if as_lone_int(value) is None or as_lone_int(value) < 1}
        if wrong or not top_k <= num_experts or as_real(offset) is None or not math.isfinite(as_real(offset)):
            raise CompressionError(
                f"ToMoERouter(hidden_size={hidden_size!r}, num_experts={num_experts!r}, top_k={top_k!r}, "
                f"offset={offset!r}): the sizes must be integers of at least 1 with top_k <= num_experts, and the offset "
                "a finite number."
            )
        hidden_size, num_experts, top_k = (as_lone_int(value) for value in sizes.values())
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.full((num_experts,), float(offset)))
        self.top_k = top_k
        self.num_experts = num_experts
        self.offset = float(offset)

    def forward(
        self, hidden_states: Float[Tensor, "t d"]
    ) -> tuple[Float[Tensor, "t e"], Float[Tensor, "t k"], Int[Tensor, "t k"]]:
        """Logits ``[T, E]``, the selected experts' weights ``[T, k]`` (1.0) and indices ``[T, k]``."""
        with _autocast_off(hidden_states.device.type):  # the weight (LoRA adapter added) is read in float32 too
            router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias)
        top_values, top_k_index = torch.topk(router_logits, self.top_k, dim=-1)
        top_k_weights = torch.sigmoid(top_values)
        if torch.is_grad_enabled() and top_values.requires_grad:
            # sigmoid is flat at 1.0: a straight-through estimator hands each weight's gradient to its logit
            # unchanged (adding exactly 0.0 in the forward), so the router and its adapter train. Not at an infinite
            # logit (an expert routed around, -inf, that still fills a slot): inf - inf would make its weight NaN.
            straight = top_values - top_values.detach()
            top_k_weights = top_k_weights + torch.where(top_values.isfinite(), straight, torch.zeros_like(straight))
        return router_logits, top_k_weights.to(hidden_states.dtype), top_k_index

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "ToMoERouter":
        """Move and cast like any module, except that no weight (its LoRA adapter's included) drops below float32."""

        def keeping_float32(tensor: Tensor) -> Tensor:
            applied = fn(tensor)
            if applied.is_floating_point() and torch.finfo(applied.dtype).bits < 32:
                return tensor.to(device=applied.device, dtype=torch.float32)
            return applied

        return super()._apply(keeping_float32, recurse)

    def extra_repr(self) -> str:
        return f"hidden={self.weight.shape[1]}, experts={self.num_experts}, top_k={self.top_k}, offset={self.offset:g}"
