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
    "Converted by moelens.compress.tomoe. Selected experts weigh exactly 1 (offset logits, saturated sigmoid: "
    "router_logits - router.offset is the predicted importance); the shared expert is the always-active neurons "
    "plus a constant (output bias + the skipped experts' mean contribution)."
)


def _family(name: str, block_class: str, block_attr: str, where: str) -> Family:
    return Family(
        name, (name,), (block_class,), block_attr=block_attr, router="router", experts="experts",
        logits_op="F_linear_0", scoring=UNIT, shared=SHARED, top_k="router.top_k",
        num_experts="experts.num_experts", notes=f"{where} {NOTES}",
    )


FAMILIES = [
    _family("tomoe", "ToMoEBlock", "mlp", "A dense FFN (SwiGLU, GPT-2 mlp)."),
    _family("tomoe_intermediate", "ToMoEIntermediateBlock", "intermediate",
            "A BERT FFN at layer.intermediate (output.dense becomes an identity)."),
    _family("tomoe_linear", "ToMoELinear", "mlp",
            "A Linear / Conv1D split by output neurons."),
]


def converted(family: Family) -> bool:
    """Whether ``family`` is one of moelens' converted blocks (`moelens.compress.tomoe`'s output)."""
    return any(family is entry for entry in FAMILIES)


#: What the export says about converted blocks it cannot write as they are.
EXPORTABLE = ("moelens.compress.exportable(model) is a copy whose ungated converted experts (GPT-2 and BERT FFNs, "
              "Linear layers) compute the same in gated form; export that")
