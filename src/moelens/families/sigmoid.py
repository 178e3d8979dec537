"""Families that score experts with a sigmoid (or another elementwise score) and pick
the top-k of score + a selection bias, with no expert groups."""

from __future__ import annotations

import dataclasses

from .entry import PER_SLOT_VALUES, SCORES_FOR_CHOICE, TOPK, Combine, ExpertGate, ExpertLayout, Family, Scoring, SharedExpert


def sgb(bias: str | None, *, normalize: bool | str = True, scale: str | None = None, score: str = "sigmoid",
        selection_op: str | None = None, selection_arg: int | None = None, normalize_eps: float = 0.0) -> Scoring:
    """Sigmoid-and-bias scoring: select top-k of score + bias, weights = gathered scores.

    ``selection_op``: the router op whose output is score + bias, where the router binds it
    to a name (``scores_for_choice_0``), or the top-k call it is an argument of (``TOPK``, with
    ``selection_arg=0``). ``normalize_eps``: what the router adds to the weights' sum it divides
    by (``1e-20``), 0.0 for the plain sum (minimax_m2, laguna, step3p7).
    """
    return Scoring(score, "score_topk", normalize=normalize, scale=scale, selection_bias=bias,
                   selection_op=selection_op, selection_arg=selection_arg, normalize_eps=normalize_eps, code="SGB")


#: Why ergo serves no per-slot values.
ERGO_PER_SLOT = ("ErgoExperts runs transformers' experts implementation once per route (k = 1, unit weights) and "
                 "applies each expert's RMSNorm (post_expert_norm) and weight after it, in its own forward: no "
                 "[tokens, k, ...] tensor of the implementation holds the normalised, weighted slots")
SCALED_ROUTED = Combine(routed_scale="block.routed_scaling_factor")
#: inkling2 and inkling2_loop: the score from the config, bias added inside the router's top-k call.
INKLING2 = sgb("router.e_score_correction_bias", score="config.scoring_func", scale="router.routed_scaling_factor",
               selection_op=TOPK, selection_arg=0, normalize_eps=1e-20)

#: kolibri1's entry; kolibri1_1 (transformers 5.25) has the same MoE block.
KOLIBRI1 = Family("kolibri1", ("kolibri1",), ("Kolibri1SparseMoeBlock",), logits_op="F_linear_0",
                  scoring=Scoring("sigmoid", "logit_topk", normalize="router.norm_topk_prob",
                                  selection_bias="router.e_score_correction_bias", selection_op=TOPK, selection_arg=0,
                                  code="logit+bias, sigmoid"),
                  shared=SharedExpert("shared_experts", when="after_experts"),
                  notes="Selection is top-k of logits + bias; weights are the sigmoid of the chosen logits. On CUDA "
                        "in the weights' dtype without grad the logits come from torch.mm instead (not served).",
                  logits_skipped="on CUDA when the hidden states are in the router weight's dtype and grad is off (it "
                                 "runs torch.mm(..., out_dtype=torch.float32) instead): trace under torch.enable_grad() "
                                 "to read them, or read only the values after them (expert_weights onwards)")

FAMILIES = [
    Family("afmoe", ("afmoe",), ("AfmoeSparseMoeBlock",), router="router", logits_op="self_gate_0",
           logits_cast_op="to_0",
           scoring=sgb("block.expert_bias", scale="router.route_scale", selection_op=TOPK, selection_arg=0,
                       normalize_eps=1e-20),
           shared=SharedExpert("shared_experts", when="before_experts"),
           notes="The selection bias is the block's expert_bias, passed to the router; the shared experts "
                 "run between router and experts."),
    Family("lfm2_moe", ("lfm2_moe",), ("Lfm2MoeSparseMoeBlock",), block_attr="feed_forward",
           scoring=sgb("block.expert_bias", normalize="router.norm_topk_prob",
                       scale="router.routed_scaling_factor", selection_op="scores_for_routing_0", normalize_eps=1e-6),
           final_norm="embedding_norm",
           notes="The block is `feed_forward` (aliased mlp); the bias buffer lives on the block."),
    Family("flint", ("flint",), ("FlintSparseMoeBlock",),
           scoring=Scoring("sigmoid", "score_topk", normalize="router.norm_topk_prob", code="sigmoid"),
           shared=SharedExpert("shared_expert", when="after_experts"),
           notes="Logits computed in float32 with autocast off."),
    Family("laguna", ("laguna",), ("LagunaSparseMoeBlock",), logits_cast_op="float_0",
           scoring=dataclasses.replace(sgb("router.e_score_correction_bias", selection_op="scores_for_selection_0"),
                                       softcap="router.router_logit_softcapping"),
           shared=SharedExpert("shared_experts", when="before_router"), combine=SCALED_ROUTED,
           notes="The block returns routed * routed_scaling_factor + shared. With router_logit_softcapping > 0 the "
                 "router scores tanh(logits / c) * c: router_logits are before the softcap, router_probs after."),
    Family("minimax_m2", ("minimax_m2",), ("MiniMaxM2SparseMoeBlock",),
           scoring=sgb("block.e_score_correction_bias", selection_op=SCORES_FOR_CHOICE),
           notes="The selection bias lives on the block and is passed to the router. Slots are not ranked "
                 "(top-k with sorted=False): slot 0 is not the top-1 expert."),
    Family("minimax_m3_vl", ("minimax_m3_vl", "minimax_m3_vl_text"), ("MiniMaxM3VLSparseMoeBlock",),
           scoring=sgb("router.e_score_correction_bias", selection_op=SCORES_FOR_CHOICE),
           shared=SharedExpert("shared_experts", when="before_router"), combine=SCALED_ROUTED,
           notes="Clamped SwiGLU experts; the block returns routed * routed_scaling_factor + shared. Slots are "
                 "not ranked (top-k with sorted=False): slot 0 is not the top-1 expert.",
           expert_gate=ExpertGate("clamped_swiglu", alpha="experts.swiglu_alpha", limit="experts.swiglu_limit")),
    Family("step3p7", ("step3p7", "step3p5"), ("Step3p7SparseMoeBlock",),
           scoring=sgb("router.e_score_correction_bias", selection_op=SCORES_FOR_CHOICE),
           shared=SharedExpert("shared_experts", when="before_router"), combine=SCALED_ROUTED,
           expert_layout=ExpertLayout(gate_up="gate_up_proj"),
           expert_gate=ExpertGate("glu_clamped", limit="experts.limit"),
           notes="Experts decorated by transformers from 5.25 on (up to 5.24 an eager loop only: no per-slot "
                 "values). The block returns "
                 "routed * routed_scaling_factor + shared; layers listed in swiglu_limits clamp silu(gate) and up. "
                 "Slots are not ranked (top-k with sorted=False). The text config's model_type is step3p5."),
    Family("hy_v3", ("hy_v3",), ("HYV3MoE",),
           scoring=sgb("block.e_score_correction_bias", scale="router.router_scaling_factor",
                       selection_op=SCORES_FOR_CHOICE, normalize_eps=1e-20),
           shared=SharedExpert("shared_experts", when="after_experts"),
           notes="Optional float32 combine of routed and shared output."),
    Family("beam", ("beam",), ("BeamMoE",),
           scoring=Scoring("sigmoid", "group_topk", normalize="router.norm_topk_prob",
                           selection_bias="router.e_score_correction_bias",
                           groups=("router.num_group", "router.topk_group"),
                           selection_op=SCORES_FOR_CHOICE, normalize_eps=1e-20, code="DS3 (no rsf)"),
           combine=SCALED_ROUTED, notes="The block, not the router, multiplies by routed_scaling_factor.",
           expert_gate=ExpertGate("glu")),
    Family("muse_spark", ("muse_spark", "muse_spark_text"), ("MuseSparkMoE",), logits_op="router_logits_1",
           scoring=sgb("router.e_score_correction_bias", scale="router.routed_scaling_factor",
                       selection_op=SCORES_FOR_CHOICE, normalize_eps=1e-15),
           combine=Combine(routed_post="post_expert_proj"),
           notes="Logits are scaled by output_multiplier (router_logits_1); the experts run in "
                 "moe_hidden_size between pre_expert_proj/pre_expert_norm and post_expert_proj."),
    KOLIBRI1,
    # transformers 5.25: Kolibri 1.1's MoE block is kolibri1's (its attention differs)
    dataclasses.replace(KOLIBRI1, name="kolibri1_1", model_types=("kolibri1_1",),
                        block_classes=("Kolibri1_1SparseMoeBlock",)),
    Family("ergo", ("ergo",), ("ErgoMoE",), logits_op="self_linear_0",  # transformers 5.25
           scoring=sgb("router.e_score_correction_bias", scale="router.routed_scaling_factor", normalize_eps=1e-20),
           shared=SharedExpert("shared_experts", when="after_experts"),
           refused={name: ERGO_PER_SLOT for name in PER_SLOT_VALUES},
           notes="Experts and the shared expert are relu^2 MLPs followed by an RMSNorm (per expert for the routed "
                 "ones: post_expert_norm). Logits in float32 (the router's `linear`). The router adds the selection "
                 "bias inside a method call (`(scores + bias).topk`) that serves no selection_scores: route_around "
                 "and force check that the bias did not overrule them. Slots are not ranked (sorted=False)."),
    Family("deepseek_v4", ("deepseek_v4",), ("DeepseekV4SparseMoeBlock",),
           scoring=sgb("router.e_score_correction_bias", score="config.scoring_func",
                       scale="router.routed_scaling_factor", selection_op=TOPK, selection_arg=0, normalize_eps=1e-20),
           scoring_by_router={"DeepseekV4HashRouter": Scoring(
               "config.scoring_func", "hash", normalize=True, normalize_eps=1e-20, scale="router.routed_scaling_factor",
               code="HASH")},
           shared=SharedExpert("shared_experts", when="after_experts"),
           notes="Hash layers (the first num_hash_layers) pick experts from a token-id table: there the "
                 "logits only weight the experts, so writing them does not change which experts run.",
           expert_gate=ExpertGate("clamped_glu", limit="experts.limit")),
    Family("inkling", ("inkling", "inkling_text"), ("InklingMoE",),
           scoring=Scoring("sigmoid", "score_topk", normalize=True, scale="router.route_scale",
                           selection_bias="router.e_score_correction_bias", selection_op=SCORES_FOR_CHOICE,
                           code="SGB, logsigmoid-normalised"),
           shared=SharedExpert("shared_experts", when="after_experts"), extra_logits="router.n_shared_experts",
           notes="router_logits has E + n_shared columns: the last are the shared experts' gate logits, "
                 "normalised with the k routed ones into the shared experts' gammas. Writing them changes the "
                 "routing and the shared experts' weight. Weights are also x router.global_scale, a learned "
                 "scalar (1 at init)."),
    Family("inkling2", ("inkling2", "inkling2_text"), ("Inkling2SparseMoeBlock",), scoring=INKLING2,
           notes="Softcapped SwiGLU experts; the router weight must stay float32.",
           expert_gate=ExpertGate("softcapped_glu")),
    Family("inkling2_loop", ("inkling2_loop", "inkling2_loop_text"), ("Inkling2LoopSparseMoeBlock",),  # 5.24
           scoring=INKLING2,
           notes="Routing as inkling2. The loop layers (loop_layer_index_start..end) run loop_num_passes times "
                 "per forward: a value read is the first pass's; read pass i under `for _ in tracer.iter[i]`, "
                 "edit every pass under `for _ in tracer.iter[0:loop_num_passes]`; analysis reads the first pass.",
           expert_gate=ExpertGate("softcapped_glu"), scan_without_cache=True),
]
