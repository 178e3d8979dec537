"""Families whose router takes the top-k logits, then a softmax over those k."""

from __future__ import annotations

from .entry import Combine, ExpertGate, Family, Scoring, SharedExpert

TK_SM = Scoring("softmax", "logit_topk", normalize=True, code="TK->SM")
GRANITE_SHARED = SharedExpert("shared_mlp", on_layer=True, when="after_block")
#: gpt-oss experts: clamped SwiGLU with a sigmoid slope (alpha) and an offset up branch.
CLAMPED_SWIGLU = ExpertGate("clamped_swiglu", alpha="experts.alpha", limit="experts.limit")

FAMILIES = [
    Family("gpt_oss", ("gpt_oss",), ("GptOssMLP",), router="router", scoring=TK_SM,
           combine=Combine(output_index=0),
           notes="Experts: transposed weights with biases, interleaved clamped SwiGLU. The block returns "
                 "(hidden, router_scores) and carries a hub-kernel decorator (use_kernels=True hides its ops).",
           expert_gate=CLAMPED_SWIGLU),
    Family("openai_privacy_filter", ("openai_privacy_filter",), ("OpenAIPrivacyFilterMLP",), router="router",
           scoring=Scoring("softmax", "logit_topk", normalize=True, scale="1/router.top_k", code="TK->SM/k"),
           combine=Combine(routed_scale="block.num_experts", output_index=0),
           notes="An encoder; defaults to the eager experts implementation. The router divides the weights by k and the "
                 "block multiplies the experts output by k again (its attribute num_experts holds "
                 "config.num_experts_per_tok).",
           expert_gate=CLAMPED_SWIGLU),
    Family("granitemoe", ("granitemoe",), ("GraniteMoeMoE",), block_attr="block_sparse_moe", router="router",
           logits_cast_op="float_0",
           scoring=TK_SM, notes="The block is `block_sparse_moe` (aliased mlp); the layer scales by residual_multiplier."),
    Family("granitemoe_swa", ("granitemoe_swa",), ("GraniteMoeSWAMoE",), block_attr="block_sparse_moe",
           router="router", logits_cast_op="float_0", scoring=TK_SM, shared=GRANITE_SHARED,
           notes="The shared MLP is a sibling of the block on the decoder layer, applied after it."),
    Family("granitemoeshared", ("granitemoeshared",), ("GraniteMoeSharedMoE",), block_attr="block_sparse_moe",
           router="router", logits_cast_op="float_0", scoring=TK_SM, shared=GRANITE_SHARED,
           notes="The shared MLP (off by default) is a sibling of the block on the decoder layer."),
    Family("granitemoehybrid", ("granitemoehybrid",), ("GraniteMoeHybridMoE",), block_attr="block_sparse_moe",
           router="router", logits_cast_op="float_0", scoring=TK_SM, shared=GRANITE_SHARED,
           notes="Mamba and attention layers; the block is absent when num_local_experts == 0."),
    Family("aria", ("aria", "aria_text"), ("AriaTextMoELayer",), router="router", logits_op="nn_functional_linear_0",
           scoring=TK_SM, shared=SharedExpert("shared_experts", when="after_experts"),
           notes="Experts store transposed weights."),
    Family("cohere2_moe", ("cohere2_moe",), ("Cohere2MoeSparseMoeBlock",),
           scoring=Scoring("router.expert_selection_fn", "logit_topk", normalize="router.norm_topk_prob",
                           code="TK->SM|sigmoid"),
           shared=SharedExpert("shared_experts", when="after_experts"),
           combine=Combine(mode="block.shared_expert_combination_strategy"),
           notes="Scores are a softmax of the top-k logits (summing to one, whatever norm_topk_prob says) or a "
                 "sigmoid of them, renormalised if norm_topk_prob (expert_selection_fn); with shared experts the "
                 "block averages or sums routed and shared output (shared_expert_combination_strategy)."),
]
