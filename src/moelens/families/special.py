"""Families that break the one-component model, each with what it serves and why not the rest."""

from __future__ import annotations

from .entry import PER_SLOT_VALUES, TOPK, Combine, ExpertLayout, Family, Scoring, SharedExpert

NO_SLOTS = (
    "{family} does not call its experts as experts(hidden, top_k_index, top_k_weights) through "
    "transformers' experts implementations, so there is no per-slot tensor"
)
GEMMA_NO_BLOCK = (
    "{family} has no MoE block: the decoder layer adds post_feedforward_layernorm_1(mlp(x)) + "
    "post_feedforward_layernorm_2(experts(...)) to the residual, so the layer output is not an FFN output; "
    "read routed_output and shared_expert_output (the dense mlp) instead"
)
LLAMA4_NO_SLOTS = (
    "llama4 runs all E experts on inputs pre-multiplied by their sigmoid score (no experts(hidden, "
    "indices, weights) call), so there are no per-slot values or routed sum to serve; expert_weights and "
    "expert_indices are recomputed from router_logits"
)


def _gemma(name: str, model_types: tuple[str, ...], layers: tuple[str, ...], shared_when: str) -> Family:
    return Family(
        name, model_types, layers, block_attr="", router="router", experts="experts", logits_op="self_proj_0",
        scoring=Scoring("softmax", "score_topk", normalize=True, expert_scale="router.per_expert_scale",
                        code="SM+ x per_expert_scale"),
        top_k="router.config.top_k_experts",
        shared=SharedExpert("mlp", when=shared_when),
        refused={"mlp_output": GEMMA_NO_BLOCK.format(family=name)},
        notes="The decoder layer holds router and experts beside a dense mlp that always runs (served as the "
              "shared expert); the router reads the pre-norm residual; weights are scaled by a learned "
              "per_expert_scale and do not sum to 1. Only checkpoints with enable_moe_block have a mixture.",
    )


FAMILIES = [
    _gemma("gemma4", ("gemma4", "gemma4_text"), ("Gemma4TextDecoderLayer",), "before_router"),
    _gemma("diffusion_gemma", ("diffusion_gemma", "diffusion_gemma_text"),
           ("DiffusionGemmaEncoderTextLayer", "DiffusionGemmaDecoderTextLayer"),
           "before_router"),
    Family("llama4", ("llama4", "llama4_text"), ("Llama4TextMoe",), block_attr="feed_forward", router="router",
           logits_op="forward_0", scoring=Scoring("sigmoid", "logit_topk", normalize=False, code="TK->sigmoid"),
           shared=SharedExpert("shared_expert", when="after_experts", edited_later=True),
           combine=Combine(output_index=0), top_k="router.top_k", num_experts="router.num_experts",
           experts_call=False, derived_routing=True,
           refused={name: LLAMA4_NO_SLOTS for name in (*PER_SLOT_VALUES, "routed_output")},
           expert_layout=ExpertLayout(gate_up="gate_up_proj", transposed=True, down_transposed=True),
           notes="Experts are not decorated; the shared expert's output is edited in place by the block, so it "
                 "is served as a copy."),
    Family("dbrx", ("dbrx",), ("DbrxFFN",), block_attr="ffn", router="router", logits_op="self_layer_0",
           scoring=Scoring("softmax", "score_topk", normalize="block.moe_normalize_expert_weights",
                           code="SM, p-norm"),
           top_k="block.top_k",
           expert_layout=ExpertLayout(gate="mlp.w1", up="mlp.v1", down="mlp.w2", down_transposed=True, stacked=True),
           refused={name: NO_SLOTS.format(family="dbrx") + " (its experts run an eager loop only)"
                    for name in PER_SLOT_VALUES},
           notes="Layers are transformer.blocks[i].ffn; weights are normalised by a p-norm."),
    Family("zaya", ("zaya",), ("ZayaSparseMoeBlock",), logits_op="self_router_mlp_0",
           scoring=Scoring("softmax", "skip_topk", normalize=False, code="SM over E+1 (skip)",
                           selection_bias="router.balancing_biases", selection_op=TOPK, selection_arg=0),
           combine=Combine(output_index=0), extra_logits=1,
           notes="Logits have E+1 columns: the last is a 'skip' class. Skip slots come as index 0 with weight 0, "
                 "so index 0 does not always mean expert 0 ran. The router carries state across layers; it ranks "
                 "softmax(logits) + balancing_biases (selection_scores, E+1 columns). transformers' from_pretrained "
                 "resets the skip class's balancing bias to -1 (ZayaPreTrainedModel._init_weights): a checkpoint "
                 "saved with another value loads with other routing, in moelens.load as in transformers."),
    Family("phimoe", ("phimoe",), ("PhimoeSparseMoeBlock",), router="router", logits_op="forward_0",
           scoring=Scoring("softmax", "sparsemixer", code="SPM"), top_k=2,
           notes="Sparse-mixer routing picks exactly 2 experts whatever num_experts_per_tok says; weights are "
                 "masked softmaxes, each at most 1, so they sum to at most 2 (2 when no other expert is within the "
                 "jitter threshold)."),
    Family("ernie4_5_vl_moe", ("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), ("Ernie4_5_VLMoeSparseMoeBlock",),
           scoring=Scoring("softmax", "score_topk", normalize=True, normalize_min="router.norm_min",
                           selection_bias="router.moe_statics.e_score_correction_bias",
                           selection_op="self_moe_statics_0", code="SM+ bias"),
           refused={"mlp_output": "an ernie4_5_vl_moe modality block returns its output flattened to 1-D for "
                                  "the layer to scatter back by modality; read the layer's mlp.output instead",
                    "shared_expert_output": "the layer's mlp runs its shared experts (mlp.shared_experts, "
                                            "moe_num_shared_experts of them) on every token outside text_moe and "
                                            "vision_moe and adds them to their output; read the output of the "
                                            "layer's mlp.shared_experts instead"},
           notes="Each layer's mlp holds two MoE blocks, text_moe and vision_moe (model.moes lists both), each "
                 "running only on its modality's tokens. Values are served as [batch, seq, ...] only when a block "
                 "sees every token (text-only input for text_moe): on an input with image tokens both blocks run on "
                 "tokens gathered out of the batch and their values raise the reason; vision_moe does not run on "
                 "text-only input (model.save_all() leaves it out; named in moes=, it raises OrderError there, "
                 "strict or not: the run ended without it).",
           runs_only_on={"vision_moe": "image tokens (moe_mm_token_type_ids)"}),
    Family("ernie4_5_moe", ("ernie4_5_moe",), ("Ernie4_5_MoeSparseMoeBlock",),
           scoring=Scoring("softmax", "score_topk", normalize=True, normalize_min="router.norm_min",
                           selection_bias="router.moe_statics.e_score_correction_bias",
                           selection_op="self_moe_statics_0", code="SM+ bias"),
           shared=SharedExpert("shared_experts", when="before_router"),
           notes="Selection adds a correction bias to the softmax; weights are divided by their sum clamped at >= "
                 "moe_norm_min (1e-12 by default), so they sum to less than one where the chosen scores sum below it."),
]
