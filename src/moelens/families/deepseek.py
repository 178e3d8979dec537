"""DeepSeek-V2/V3-style families and their many copies.

Their routers compute the logits in float32 from the unflattened input, pick
experts with ``sorted=False`` (slot 0 is not the top-1 expert) and scale the
weights by ``routed_scaling_factor``; the shared experts run after the routed ones
on the unflattened residual and are added plainly.
"""

from __future__ import annotations

import dataclasses

from .entry import SCORES_FOR_CHOICE, Combine, ExpertGate, Family, Scoring, SharedExpert

#: DeepSeek-V3: sigmoid scores, selection on score + correction bias inside the
#: best groups (group score = sum of its top-2), weights = gathered sigmoid,
#: renormalised if flagged (by their sum + 1e-20), times routed_scaling_factor.
DS3 = Scoring(
    "sigmoid", "group_topk",
    normalize="router.norm_topk_prob",
    normalize_eps=1e-20,
    scale="router.routed_scaling_factor",
    selection_bias="router.e_score_correction_bias",
    groups=("router.num_group", "router.topk_group"),
    selection_op=SCORES_FOR_CHOICE,
    code="DS3",
)
#: DeepSeek-V2: softmax scores, greedy or group-limited (group max) top-k, times rsf.
#: (group-limited greedy: groups scored by their best expert, the dropped ones' scores set to 0.0).
DS2 = Scoring("softmax", "score_topk", normalize=False, scale="router.routed_scaling_factor",
              groups=("router.num_group", "router.topk_group"), group_fill=0.0, group_score="max",
              groups_if=("router.topk_method", "group_limited_greedy"), code="DS2")
#: Mistral 4: softmax, group-limited top-k (no bias; the dropped groups' scores set to 0.0), renormalised, times rsf.
SMG = Scoring(
    "softmax", "group_topk", normalize="router.norm_topk_prob", scale="router.routed_scaling_factor",
    groups=("router.num_group", "router.topk_group"), group_fill=0.0, code="SMG",
)
#: Mistral Large 4: as Mistral 4, always renormalised (its router has no flag).
SMG_ALWAYS = dataclasses.replace(SMG, normalize=True)
SHARED_AFTER = SharedExpert("shared_experts", when="after_experts")
UNSORTED = "Slots are not ranked (top-k with sorted=False): slot 0 is not the top-1 expert."
WEIGHT_SUM = "With norm_topk_prob set (the default of most), weights sum to routed_scaling_factor, not 1."


def _ds3(name: str, block: str, model_types: tuple[str, ...] | None = None, **extra) -> Family:
    extra.setdefault("shared", SHARED_AFTER)
    extra.setdefault("notes", f"{UNSORTED} {WEIGHT_SUM}")
    extra.setdefault("scoring", DS3)
    return Family(name, model_types or (name,), (block,), **extra)


FAMILIES = [
    Family("deepseek_v2", ("deepseek_v2",), ("DeepseekV2Moe",), scoring=DS2, shared=SHARED_AFTER,
           notes=f"{UNSORTED} Weights are never renormalised."),
    Family("unlimited_ocr", ("unlimited_ocr", "unlimited_ocr_text"), ("UnlimitedOcrTextMoe",), scoring=DS2,
           shared=SHARED_AFTER, notes=UNSORTED),
    Family("deepseek_ocr2", ("deepseek_ocr2", "deepseek_ocr2_text"), ("DeepseekOcr2TextMoe",), scoring=DS2,
           shared=SHARED_AFTER, notes=UNSORTED),
    _ds3("deepseek_v3", "DeepseekV3MoE", ("deepseek_v3", "sarvam_mla")),  # sarvam_mla: transformers 5.24
    _ds3("deepseek_v32", "DeepseekV32MoE"),
    _ds3("glm4_moe", "Glm4MoeMoE", ("glm4_moe", "sarvam_moe", "param2moe")),  # sarvam_moe: 5.24, param2moe: 5.25
    _ds3("glm4_moe_lite", "Glm4MoeLiteMoE"),
    _ds3("glm4v_moe", "Glm4vMoeTextMoE", ("glm4v_moe", "glm4v_moe_text")),
    _ds3("glm_moe_dsa", "GlmMoeDsaMoE"),
    _ds3("glm5_next", "Glm5NextTextMoE", ("glm5_next", "glm5_next_text"),
         notes=f"Clamped SwiGLU experts; hyper-connection residuals. {UNSORTED}",
         expert_gate=ExpertGate("clamped_glu", limit="experts.swiglu_limit")),
    _ds3("dots1", "Dots1MoE", notes=f"{UNSORTED} Weights are renormalised only with norm_topk_prob (off by default), "
                                   "then sum to routed_scaling_factor."),
    _ds3("dots3_note", "Dots3NoteTextMoE", ("dots3_note", "dots3_note_text"),
         notes=f"{UNSORTED} {WEIGHT_SUM} The language model's blocks are served; the full model's vision tower has "
               "MoE blocks of its own (Dots3NoteVisionMoE, over image patches with no [batch, seq] layout), which "
               "are not (wrap names them in its warning)."),
    _ds3("kimi_linear", "KimiLinearMoE"),
    _ds3("bailing_hybrid", "BailingHybridMoE",
         notes=f"{UNSORTED} {WEIGHT_SUM} From transformers 5.25 the layers listed in swiglu_limits clamp act(gate) "
               "and up in the experts (swiglu_limits_shared: in the shared experts)."),
    _ds3("exaone_moe", "ExaoneMoeSparseMoEBlock"),
    _ds3("solar_open", "SolarOpenMoE"),
    _ds3("axk1", "AXK1MoE", combine=Combine(block_post="post_mlp_layernorm"),
         notes=f"The block returns post_mlp_layernorm(routed + shared). {UNSORTED}"),
    _ds3("axk2", "AXK2MoE", scoring=dataclasses.replace(DS3, group_fill=0.0),
         notes=f"{UNSORTED} {WEIGHT_SUM} Group-limited only where the config sets n_group and topk_group (its "
               "default routes without groups, as A.X-K2-Light does); the groups it drops score 0.0, not -inf."),
    _ds3("hy_v4", "HYV4MoE", expert_gate=ExpertGate("clamped_glu", limit="experts.swiglu_limit")),
    _ds3("hy_v4_vl", "HYV4VLMoE", ("hy_v4_vl", "hy_v4_vl_text"),  # transformers 5.24
         expert_gate=ExpertGate("clamped_glu", limit="experts.swiglu_limit")),
    _ds3("mimo_v2_flash", "MiMoV2FlashMoE", shared=None),
    _ds3("minicpm5_moe", "MiniCPM5MoeMoE"),  # transformers 5.25
    Family("mistral4", ("mistral4",), ("Mistral4MoE",), scoring=SMG, shared=SHARED_AFTER,
           notes=f"Logits keep the model dtype. {UNSORTED} {WEIGHT_SUM}"),
    Family("mistral_large4", ("mistral_large4", "mistral_large4_text"), ("MistralLarge4TextMoE",),
           scoring=SMG_ALWAYS,
           shared=SHARED_AFTER, notes=f"{UNSORTED} {WEIGHT_SUM}"),
    _ds3("nemotron_h", "NemotronHMoE", block_attr="mixer", combine=Combine(routed_post="fc2_latent_proj"),
         notes="The block is the layer's `mixer` (aliased mlp); experts are not gated (relu^2) and run in "
               "moe_latent_size when set, between fc1_latent_proj and fc2_latent_proj."),
]
