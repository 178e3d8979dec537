"""Families whose router takes a softmax over all E logits, then the top-k."""

from __future__ import annotations

from .entry import SCORES_FOR_CHOICE, ExpertLayout, Family, Scoring, SharedExpert

ALWAYS = Scoring("softmax", "score_topk", normalize=True, code="SM+")
IF_FLAGGED = Scoring("softmax", "score_topk", normalize="router.norm_topk_prob", code="SM±")
NEVER = Scoring("softmax", "score_topk", normalize=False, code="SM0")

#: The qwen2_moe shared expert: runs first, gated by sigmoid(shared_expert_gate(x)),
#: and the gated product is bound after the experts call.
QWEN_SHARED = SharedExpert(
    "shared_expert", gated_op="shared_expert_output_1", gate="shared_expert_gate", when="after_experts"
)

FAMILIES = [
    Family("mixtral", ("mixtral",), ("MixtralSparseMoeBlock",), scoring=ALWAYS,
           notes="Expert weights are float32 whatever the model's dtype (the softmax runs on .float())."),
    Family("minimax", ("minimax",), ("MiniMaxSparseMoeBlock",), scoring=ALWAYS, notes="Routing as mixtral."),
    Family("olmoe", ("olmoe",), ("OlmoeSparseMoeBlock",), scoring=IF_FLAGGED,
           notes="norm_topk_prob defaults to False: weights sum to less than 1."),
    Family("flex_olmo", ("flex_olmo",), ("FlexOlmoSparseMoeBlock",), scoring=IF_FLAGGED),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeSparseMoeBlock",), scoring=IF_FLAGGED,
           notes="Dense layers (mlp_only_layers, decoder_sparse_step) are Mlp."),
    Family("qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"), ("Qwen3VLMoeTextSparseMoeBlock",), scoring=ALWAYS,
           notes="Multimodal: decoder layers at model.language_model.layers."),
    Family("qwen3_omni_moe", ("qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text"),
           ("Qwen3OmniMoeThinkerTextSparseMoeBlock",), scoring=IF_FLAGGED,
           notes="The thinker's MoE stack: wrap the thinker (hf_model.thinker). The full model has no forward of its "
                 "own, so a trace of it is refused with that advice; its talker has a second stack "
                 "(Qwen3OmniMoeTalkerTextSparseMoeBlock), which is not served (wrap names it in its warning)."),
    Family("mellum", ("mellum",), ("MellumSparseMoeBlock",), scoring=IF_FLAGGED),
    Family("jamba", ("jamba",), ("JambaSparseMoeBlock",), router="router", scoring=NEVER, block_attr="feed_forward",
           notes="The block is `feed_forward` (aliased mlp); weights are never renormalised; mamba and attention "
                 "layers interleave."),
    Family("hunyuan_v1_moe", ("hunyuan_v1_moe",), ("HunYuanMoEV1Moe",), logits_op="self_wg_0", scoring=ALWAYS,
           shared=SharedExpert("shared_mlp", when="before_router"),
           notes="The logits are the router's wg Linear output; the shared MLP runs first and is added plainly."),
    Family("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeSparseMoeBlock",), scoring=IF_FLAGGED, shared=QWEN_SHARED,
           notes="Shared expert gated by sigmoid(shared_expert_gate(x)); served after its gate."),
    Family("qwen3_next", ("qwen3_next",), ("Qwen3NextSparseMoeBlock",), scoring=IF_FLAGGED, shared=QWEN_SHARED),
    Family("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), ("Qwen3_5MoeSparseMoeBlock",), scoring=ALWAYS,
           shared=QWEN_SHARED, notes="The router carries a hub-kernel decorator: use_kernels=True hides its ops."),
    Family("qwen4_exp", ("qwen4_exp", "qwen4_exp_text"), ("Qwen4ExpTextSparseMoeBlock",), scoring=IF_FLAGGED,
           shared=QWEN_SHARED),
    Family("longcat_flash", ("longcat_flash",), ("LongcatFlashMoE",), router="router",
           scoring=Scoring("softmax", "score_topk", scale="router.routed_scaling_factor",
                           selection_bias="router.e_score_correction_bias", selection_op=SCORES_FOR_CHOICE,
                           selection_in="self_get_topk_indices_0", code="SM+ bias, x rsf"),
           num_experts="router.n_routed_experts", identity_experts="config.zero_expert_num",
           routing_from_router=(1, 2), routed_from_block=True,
           expert_layout=ExpertLayout(gate_up="gate_up_proj"),  # transformers 5.23 and 5.24: undecorated experts
           notes="The last zero_expert_num of the E experts are zero-compute: they return their input times its "
                 "weight (params() serves the others), so there are no per-slot values (up to transformers 5.24 an "
                 "eager loop of the experts' own runs every expert; from 5.25 the block adds the zero-compute share "
                 "itself and hands those slots to other experts with weight 0). expert_weights and expert_indices "
                 "are the router's choice, routed_output the block's output. The router ranks softmax + correction "
                 "bias in get_topk_indices; slots are not ranked (sorted=False). The block is a shortcut beside the "
                 "layer's two dense mlps (layers[i].mlps)."),
    Family("lara_mini", ("lara_mini",), ("LaraMiniSparseMoeBlock",), scoring=IF_FLAGGED,  # transformers 5.24
           shared=SharedExpert("shared_expert", when="after_experts"),
           notes="Logits in float32; the shared expert is added in full (no gate) after the experts."),
]
