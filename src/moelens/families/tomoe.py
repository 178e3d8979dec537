"""moelens' own converted blocks (`moelens.compress.tomoe`): dense layers turned into MoE blocks.

Every converted block has the same parts: a linear router (``router``, logits from
``F.linear``), decorated experts (``experts``: the standard
``experts(hidden, top_k_index, top_k_weights)`` call) and a shared expert
(``shared_experts``: always-active neurons plus a constant) added after the experts.
Each selected expert runs with weight exactly 1: the router's logits carry a
large offset, it takes the top-k logits and their sigmoid saturates to 1.0 (llama4's
scoring, tract's ``sigmoid`` gate mode).
"""

from __future__ import annotations

from .entry import Family, Scoring, SharedExpert

#: Top-k of the logits, then a sigmoid of each: 1.0 for every selected expert (the logits carry an offset).
UNIT = Scoring("sigmoid", "logit_topk", normalize=False, code="TK->sigmoid (=1)")

#: Always-active neurons plus the dense output bias and the skipped experts' mean contribution.
SHARED = SharedExpert("shared_experts", when="after_experts")

NOTES = (
    "A dense layer converted by moelens.compress.tomoe. Selected experts run with weight 1: "
    "router_logits - router.offset is the router's predicted importance of each expert, and "
    "router_probs (their sigmoid) saturate to 1 for the experts that can be selected. The shared "
    "expert holds the always-active neurons and a constant: the dense output bias plus the mean "
    "contribution of the experts a token skips (each expert's down bias subtracts its share)."
)


def _family(name: str, block_class: str, block_attr: str, where: str) -> Family:
    return Family(
        name, (name,), (block_class,), block_attr=block_attr, router="router", experts="experts",
        logits_op="F_linear_0", scoring=UNIT, shared=SHARED, top_k="router.top_k",
        num_experts="experts.num_experts", notes=f"{where} {NOTES}",
    )


FAMILIES = [
    _family("tomoe", "ToMoEBlock", "mlp", "A whole FFN (SwiGLU mlp, GPT-2 mlp) as one block."),
    _family("tomoe_intermediate", "ToMoEIntermediateBlock", "intermediate",
            "A BERT FFN as one block at layer.intermediate (layer.output.dense is an identity)."),
    _family("tomoe_linear", "ToMoELinear", "mlp",
            "One Linear / Conv1D split by output neurons (identity activation, 0/1 down projection buffer)."),
]
