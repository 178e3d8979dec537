"""Tiny, seeded, randomly initialised models for every MoE family in transformers 5.23 to 5.25.

Nothing is downloaded: every model is built from a config made by :func:`tiny_config`, with
``from_config`` under ``torch.manual_seed(seed)``. The sizes are the same for every family where
the config allows it (``COMMON_SIZES``, then the family's ``TINY_OVERRIDES``):

* ``hidden_size`` 32, 4 decoder layers, 4 attention heads, 2 key/value heads (4 with multi-head
  latent attention, which needs one per head), ``head_dim`` 8 where the config has the field;
* 8 routed experts, top-2 (zaya: top-1, the only value it accepts), expert intermediate size 16,
  dense MLP intermediate size 32;
* ``vocab_size`` 128, ``max_position_embeddings`` 128, pad/bos/eos ids 0/1/2;
* family fixes: MLA and indexer sizes, mamba / linear-attention sizes, expert groups that divide
  8 experts (``n_group`` 4, ``topk_group`` 2), scaled-down YaRN, per-layer attention variants.

Layout: where a family can interleave dense and MoE layers, the 4 layers hold at least one dense
layer and at least two MoE layers (usually layer 0 dense, 1-3 MoE; jamba 0/2 dense; nemotron_h
attention, MoE, MLP, MoE). ``MOE_EVERY_LAYER`` lists the families that cannot mix (and why).
Optional shared experts are on; gemma4's MoE block is enabled. Multimodal families are built as
their text decoder only: the text config with the text causal LM, or with the text model when the
family has no text causal LM (``model_class``); openai_privacy_filter is an encoder (base model).

Example::

    from moelens.testing import tiny_model, tiny_inputs
    model = tiny_model("mixtral", experts_implementation="batched_mm")
    out = model(**tiny_inputs(model))
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedConfig, PreTrainedModel

from ..scalars import as_int

__all__ = [
    "CALLED_SEVERAL_TIMES",
    "COMMON_SIZES",
    "EXPERTS_IMPLEMENTATIONS",
    "FAMILIES",
    "MOE_EVERY_LAYER",
    "NOT_DECORATED",
    "TINY_OVERRIDES",
    "UNBUILDABLE",
    "config_class",
    "model_class",
    "tiny_config",
    "tiny_inputs",
    "tiny_model",
]

#: Sizes shared by every family. A key is applied only when the family's config class has a field
#: of that name (so ``head_dim`` is skipped where the config derives it); ``TINY_OVERRIDES`` wins.
COMMON_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    # Special tokens inside the tiny vocab (several families default to ids >= 100k).
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Dense/MoE layout used by the families that take a per-layer list.
_DSSS = ["dense", "sparse", "sparse", "sparse"]

# Multi-head latent attention (DeepSeek-V2/V3 style) sizes.
_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "num_key_value_heads": 4,  # MLA expands the latent to one key/value per query head
}
# DeepSeek sparse-attention indexer sizes.
_INDEXER = {"index_topk": 4, "index_head_dim": 8, "index_n_heads": 2}
# gpt-oss style YaRN rope.
_GPT_OSS_YARN = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 32,
}

#: Per-family config overrides, applied on top of ``COMMON_SIZES``. Pure data.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "afmoe": {
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "num_dense_layers": 1,
        "global_attn_every_n_layers": 2, "sliding_window": 16,
    },
    "aria": {"moe_num_experts": 8, "moe_topk": 2, "moe_num_shared_experts": 1, "intermediate_size": 16},
    "axk1": {
        **_MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
    },
    "axk2": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
        "gated_norm_rank": 4,
    },
    "bailing_hybrid": {
        **_MLA, "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "layer_group_size": 2,
        "num_mtp_layers": 0,
    },
    "beam": {
        "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "mlp_layer_types": _DSSS, "sliding_window": 16,
    },
    "cohere2_moe": {
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "intermediate_size": 16,
        "mlp_layer_types": _DSSS, "prefix_dense_intermediate_size": 32, "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    "deepseek_ocr2": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "mlp_layer_types": _DSSS,
    },
    "deepseek_v2": {
        **_MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
    "deepseek_v3": {
        **_MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "num_mtp_layers": 0,
    },
    "deepseek_v32": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    },
    "deepseek_v4": {  # intermediate_size is an alias of moe_intermediate_size here
        "intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "num_key_value_heads": 1,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2, "index_head_dim": 8,
        "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 2, "sliding_window": 16,
        "num_nextn_predict_layers": 0, "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "partial_rotary_factor": 0.5,  # default 64/512 would give a 1-dim RoPE at head_dim 8
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    },
    "diffusion_gemma": {  # no enable_moe_block field: every layer has the MoE path
        "num_experts": 8, "top_k_experts": 2, "sliding_window": 16, "global_head_dim": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "dots1": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1, "sliding_window": 16, "max_window_layers": 4,
    },
    "dots3_note": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
        "shared_experts_intermediate_size": 16, "sliding_window": 16,
        # Sliding-attention layers get their own MLA sizes (popped in __post_init__).
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 8,
    },
    "ergo": {  # transformers 5.25; layer 0 dense
        "num_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 16, "num_dense_blocks": 1,
        "first_dense_intermediate_size": 32, "sliding_window": 16, "global_attention_every_n_layers": 2,
    },
    "ernie4_5_moe": {
        "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
        "moe_layer_end_index": 3, "moe_layer_interval": 1,
    },
    "ernie4_5_vl_moe": {
        "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": [16, 16],
        "mlp_layer_types": _DSSS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]},
    },
    "exaone_moe": {
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "mlp_layer_types": _DSSS, "sliding_window": 16, "sliding_window_pattern": 2,
    },
    "flex_olmo": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "flint": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "mlp_only_layers": [0], "sliding_window": 16,
    },
    "gemma4": {
        "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "sliding_window": 16,
        "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "global_head_dim": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "glm4_moe": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1, "num_mtp_layers": 0,
    },
    "glm4_moe_lite": {
        **_MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "mlp_layer_types": _DSSS,
    },
    "glm4v_moe": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 0],
        },
    },
    "glm5_next": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
        "linear_head_dim": 8, "linear_num_heads": 4, "hc_mult": 2, "hc_sinkhorn_iters": 2,
        "index_kpool": 2, "qk_rope_head_dim": 0,
    },
    "glm_moe_dsa": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
    },
    "gpt_oss": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16, "sliding_window": 16,
        "rope_parameters": _GPT_OSS_YARN,
    },
    "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "granitemoe_swa": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16,
        "shared_intermediate_size": 16, "sliding_window": 16,
    },
    "granitemoehybrid": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16,
        "shared_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mamba_n_heads": 4, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 8,
    },
    "granitemoeshared": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16,
        "shared_intermediate_size": 16,
    },
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2, "intermediate_size": 16},
    "hy_v3": {
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "mlp_layer_types": _DSSS,
    },
    "hy_v4": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS, "hc_mult": 2,
    },
    "inkling": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "mlp_layer_types": _DSSS,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
        "sliding_window_size": 16, "d_rel": 4, "rel_extent": 16,
    },
    "hy_v4_vl": {  # transformers 5.24
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS, "hc_mult": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    },
    "inkling2_loop": {  # transformers 5.24; layers 2-3 run twice per forward
        "intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 16, "d_rel": 4,
        "rel_extent": 16, "unpadded_vocab_size": 128, "n_layers_per_attn_res_block": 2,
        "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2,
    },
    "lara_mini": {  # transformers 5.24
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "sliding_window": 16,
    },
    "inkling2": {  # intermediate_size is an alias of moe_intermediate_size here
        "intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 16, "d_rel": 4,
        "rel_extent": 16, "unpadded_vocab_size": 128, "n_layers_per_attn_res_block": 2,
    },
    "jamba": {
        "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16, "expert_layer_period": 2,
        "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 0,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
    },
    "kimi_linear": {
        **_MLA, "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "mlp_layer_types": _DSSS, "linear_head_dim": 8, "linear_num_heads": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    },
    "kolibri1": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "sliding_window": 16,
    },
    "kolibri1_1": {  # transformers 5.25; layer 0 dense
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "sliding_window": 16, "mlp_only_layers": [0], "mlp_only_intermediate_size": 32,
        "head_dim": 16,  # NVFP4 rounding needs head_dim % 16 == 0
        # layers 1 and 3 run indexed attention (3 reads layer 1's keys and values), with a budget shorter than
        # the tiny inputs so the indexer selects
        "layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        "index_num_heads": 2, "index_topk": 4, "index_pool_size": 8, "index_compression": 2,
        "index_num_local_tokens": 2, "index_num_sink_tokens": 1,
    },
    "laguna": {  # a routed scale of its own, which Combine.routed_scale must read (1.0 would hide a wrong entry)
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16, "moe_routed_scaling_factor": 2.5,
        "mlp_layer_types": _DSSS, "sliding_window": 16,
    },
    "longcat_flash": {  # 4 layers of 2 attention sublayers each; 2 zero-compute experts beside the 8
        **_MLA, "num_layers": 4, "n_routed_experts": 8, "zero_expert_num": 2, "moe_topk": 2,
        "expert_ffn_hidden_size": 16, "ffn_hidden_size": 32,
    },
    "lfm2_moe": {
        "num_experts": 8, "num_experts_per_tok": 2, "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "mellum": {
        "num_experts": 8, "num_experts_per_tok": 2, "mlp_layer_types": _DSSS, "sliding_window": 16,
    },
    "mimo_v2_flash": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "mlp_layer_types": _DSSS, "v_head_dim": 8, "sliding_window": 16,
    },
    "minicpm5_moe": {  # transformers 5.25
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "mlp_layer_types": _DSSS,
    },
    "minimax": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16, "block_size": 4,
    },
    "minimax_m2": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "minimax_m3_vl": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16,
        "dense_intermediate_size": 32, "shared_intermediate_size": 16, "rotary_dim": 8,
        "mlp_layer_types": _DSSS, "index_n_heads": 2, "index_head_dim": 8, "index_block_size": 2,
        "index_topk_blocks": 2,
    },
    "mistral4": {
        **_MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    "mistral_large4": {
        **_MLA, **_INDEXER, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "mlp_layer_types": _DSSS,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
        },
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "muse_spark": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "moe_hidden_size": 16,
        "mlp_layer_types": _DSSS, "sliding_window": 16,
    },
    "nemotron_h": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
        "topk_group": 2, "moe_shared_expert_intermediate_size": 16,
        "layers_block_type": ["full_attention", "moe", "mlp", "moe"],
        "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 8,
    },
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "openai_privacy_filter": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16, "sliding_window": 16,
        "rope_parameters": _GPT_OSS_YARN,
    },
    "phimoe": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
    "qwen2_moe": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "mlp_only_layers": [0],
    },
    "qwen3_5_moe": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]},
    "qwen3_next": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "mlp_only_layers": [0], "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    },
    "qwen3_omni_moe": {"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]},
    "qwen3_vl_moe": {"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]},
    "qwen4_exp": {
        "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "hc_count": 2, "hc_lowrank": 4, "indexer_n_heads": 2,
        "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8, "indexer_compress_ratio": 2,
    },
    "solar_open": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
    },
    "step3p7": {  # layer 1 clamps its experts and shared expert (swiglu_limits), as the checkpoint's last layers do
        "n_routed_experts": 8, "num_experts_per_tok": 2, "share_expert_dim": 16, "mlp_layer_types": _DSSS,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 16, "swiglu_limits": [0.0, 0.02, 0.0, 0.0], "swiglu_limits_shared": [0.0, 0.05, 0.0, 0.0],
        "moe_router_scaling_factor": 2.5,  # as laguna's
    },
    "unlimited_ocr": {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "mlp_layer_types": _DSSS,
        "sliding_window": 16,
    },
    "zaya": {  # top-1 only (validated); its 3-layer router MLP is near-uniform at std 0.02
        "num_experts": 8, "num_experts_per_tok": 1, "router_hidden_size": 16, "initializer_range": 0.1,
    },
    "llama4": {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16,
        "intermediate_size_mlp": 32, "moe_layers": [1, 2, 3], "attention_chunk_size": 16,
    },
    "dbrx": {
        "d_model": 32, "n_heads": 4, "n_layers": 4, "max_seq_len": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 16},
    },
}

# Config class to use when it is not the family's main config (multimodal -> text config).
_CONFIG_CLASS: dict[str, str] = {
    "aria": "AriaTextConfig",
    "deepseek_ocr2": "DeepseekOcr2TextConfig",
    "diffusion_gemma": "DiffusionGemmaTextConfig",
    "dots3_note": "Dots3NoteTextConfig",
    "ernie4_5_vl_moe": "Ernie4_5_VLMoeTextConfig",
    "gemma4": "Gemma4TextConfig",
    "glm4v_moe": "Glm4vMoeTextConfig",
    "glm5_next": "Glm5NextTextConfig",
    "inkling": "InklingTextConfig",
    "inkling2": "Inkling2TextConfig",
    "inkling2_loop": "Inkling2LoopTextConfig",
    "hy_v4_vl": "HYV4VLTextConfig",
    "minimax_m3_vl": "MiniMaxM3VLTextConfig",
    "mistral_large4": "MistralLarge4TextConfig",
    "muse_spark": "MuseSparkTextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "qwen3_omni_moe": "Qwen3OmniMoeTextConfig",
    "qwen3_vl_moe": "Qwen3VLMoeTextConfig",
    "qwen4_exp": "Qwen4ExpTextConfig",
    "step3p7": "Step3p7TextConfig",
    "unlimited_ocr": "UnlimitedOcrTextConfig",
    "llama4": "Llama4TextConfig",
}

# Model class to use when AutoModelForCausalLM has no entry for the config.
_MODEL_CLASS: dict[str, str] = {
    "deepseek_ocr2": "DeepseekOcr2TextModel",
    "diffusion_gemma": "DiffusionGemmaEncoderTextModel",
    "ernie4_5_vl_moe": "Ernie4_5_VLMoeTextModel",
    "glm4v_moe": "Glm4vMoeTextModel",
    "glm5_next": "Glm5NextTextModel",
    "hy_v4_vl": "HYV4VLTextModel",
    "mistral4": "Mistral4ForCausalLM",
    "mistral_large4": "MistralLarge4TextModel",
    "muse_spark": "MuseSparkTextModel",
    "openai_privacy_filter": "OpenAIPrivacyFilterModel",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerTextModel",
    "qwen3_vl_moe": "Qwen3VLMoeTextModel",
    "step3p7": "Step3p7TextModel",
    "unlimited_ocr": "UnlimitedOcrTextModel",
}

#: The installed transformers' release, ``(5, 24, 0)``.
TRANSFORMERS_RELEASE: tuple[int, ...] = Version(transformers.__version__).release

#: Families whose experts transformers does not decorate with ``use_experts_implementation``: they run
#: their own eager forward whatever ``experts_implementation`` says, so they are tested under eager only
#: (transformers 5.25 decorates longcat_flash's and step3p7's).
NOT_DECORATED: tuple[str, ...] = ("dbrx", "llama4") + (
    ("longcat_flash", "step3p7") if TRANSFORMERS_RELEASE < (5, 25) else ())

#: The transformers release that added each family newer than 5.23.
ADDED_IN: dict[str, str] = {
    "hy_v4_vl": "5.24", "inkling2_loop": "5.24", "lara_mini": "5.24",
    "ergo": "5.25", "kolibri1_1": "5.25", "minicpm5_moe": "5.25",
}

#: Families that cannot be built with a tiny config in the installed transformers, with the reason
#: (the families a later transformers added).
UNBUILDABLE: dict[str, str] = {
    family: f"transformers {transformers.__version__} has no {family} model (added in transformers {release})"
    for family, release in ADDED_IN.items()
    if importlib.util.find_spec(f"transformers.models.{family}") is None
}

_NO_SWITCH = "the decoder layer always builds the MoE block (no dense/MoE switch in the config)"
#: Families whose every decoder layer is MoE (dense layers cannot be mixed in), with the reason.
#: Every other family's tiny model has at least one dense and at least two MoE layers.
MOE_EVERY_LAYER: dict[str, str] = {
    "aria": _NO_SWITCH,
    "dbrx": _NO_SWITCH,
    "deepseek_v4": "mlp_layer_types only chooses hash_moe vs moe (layer 0 is hash-routed here)",
    "diffusion_gemma": "router/experts are built on every text layer, next to the dense mlp",
    "flex_olmo": _NO_SWITCH,
    "gemma4": "enable_moe_block is global: all layers or none (each layer also keeps its dense mlp)",
    "gpt_oss": _NO_SWITCH,
    "granitemoe": _NO_SWITCH,
    "granitemoe_swa": _NO_SWITCH,
    "granitemoehybrid": "the block is dropped only when num_local_experts == 0, for every layer at once",
    "granitemoeshared": _NO_SWITCH,
    "hunyuan_v1_moe": "num_experts may be a per-layer list, but every layer still builds the MoE block",
    "inkling2": _NO_SWITCH,
    "inkling2_loop": _NO_SWITCH,
    "kolibri1": _NO_SWITCH,
    "lara_mini": _NO_SWITCH,
    "minimax": _NO_SWITCH,
    "minimax_m2": _NO_SWITCH,
    "longcat_flash": "every decoder layer holds the shortcut MoE block beside its two dense mlps",
    "mixtral": _NO_SWITCH,
    "olmoe": _NO_SWITCH,
    "openai_privacy_filter": _NO_SWITCH,
    "phimoe": _NO_SWITCH,
    "qwen3_5_moe": _NO_SWITCH,
    "qwen4_exp": _NO_SWITCH,
    "solar_open": _NO_SWITCH,
    "zaya": _NO_SWITCH,
}

#: Families whose blocks run several times in one forward, with the reason: each value is served per
#: call (tracer.iter), which the tests over `FAMILIES` (one call per block) do not model; tested on their own.
CALLED_SEVERAL_TIMES: dict[str, str] = {
    "inkling2_loop": "the loop layers run loop_num_passes times per forward",
}

#: Every family :func:`tiny_model` can build and the tests over families run (``model_type`` folder names).
FAMILIES: tuple[str, ...] = tuple(sorted(f for f in TINY_OVERRIDES if f not in UNBUILDABLE and f not in CALLED_SEVERAL_TIMES))

_ALL_IMPLS = ("eager", "batched_mm", "grouped_mm")
#: Experts implementations each family honours (the `NOT_DECORATED` ones: eager only).
EXPERTS_IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    f: (("eager",) if f in NOT_DECORATED else _ALL_IMPLS) for f in FAMILIES
}


def _module(family: str, kind: str):
    return importlib.import_module(f"transformers.models.{family}.{kind}_{family}")


def config_class(family: str) -> type[PreTrainedConfig]:
    """The config class :func:`tiny_config` instantiates for ``family`` (the text config for multimodal ones)."""
    _check(family)
    mod = _module(family, "configuration")
    if family in _CONFIG_CLASS:
        return getattr(mod, _CONFIG_CLASS[family])
    for value in vars(mod).values():
        if (
            isinstance(value, type)
            and issubclass(value, PreTrainedConfig)
            and value.__module__ == mod.__name__
            and getattr(value, "model_type", None) == family
        ):
            return value
    raise LookupError(f"no config class with model_type {family!r}")


def model_class(family: str) -> type[PreTrainedModel]:
    """The model class :func:`tiny_model` builds for ``family`` (causal LM where one exists)."""
    _check(family)
    if family in _MODEL_CLASS:
        return getattr(_module(family, "modeling"), _MODEL_CLASS[family])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config_class(family).model_type]
    return getattr(_module(family, "modeling"), name)


def _check(family: str) -> None:
    if not isinstance(family, str):
        raise TypeError(f"tiny models are built by family name (a str such as 'mixtral'), got {type(family).__name__}: "
                        "pass its name (family.name for an entry of moelens.families.supported()).")
    if family in UNBUILDABLE:
        raise ValueError(f"{family!r} cannot be built tiny: {UNBUILDABLE[family]}")
    if family not in TINY_OVERRIDES:
        raise KeyError(f"unknown MoE family {family!r}; known: {', '.join(FAMILIES)}")


def _field_names(cls: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}))


#: Keywords every transformers config takes besides its fields (``PreTrainedConfig.__init__`` acts on them).
CONFIG_SETTINGS = frozenset({"attn_implementation", "experts_implementation", "output_attentions", "per_layer_config",
                             "rope_scaling", "rope_theta", "name_or_path", "num_labels"})


def tiny_config(family: str, **overrides: Any) -> PreTrainedConfig:
    """A tiny config for ``family``: ``COMMON_SIZES`` (where the class has the field), then
    ``TINY_OVERRIDES[family]``, then ``overrides``."""
    cls = config_class(family)
    fields = _field_names(cls)
    unknown = sorted(set(overrides) - fields - CONFIG_SETTINGS) if fields else []
    if unknown:  # a config keeps any keyword as an attribute, so a misspelt size would be silently left at its default
        near = {name: difflib.get_close_matches(name, sorted(fields), n=1) for name in unknown}
        raise TypeError(
            f"tiny_config({family!r}): {cls.__name__} has no field "
            + ", ".join(f"{name!r}" + (f" (did you mean {near[name][0]!r}?)" if near[name] else "") for name in unknown)
            + f"; overrides must name fields of {cls.__name__} (a multimodal family's tiny model is its text "
            "decoder, sized by the text config's fields)."
        )
    kwargs: dict[str, Any] = {k: v for k, v in COMMON_SIZES.items() if k in fields}
    kwargs.update(_copy(TINY_OVERRIDES[family]))
    kwargs.update(overrides)
    return cls(**kwargs)


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


_NORM_HINTS = ("norm", "ln_", "layernorm")
#: Selection-bias tensors (parameters or buffers) replaced by seeded normal(0, std) values, by name.
#: zaya's router probabilities differ by ~1e-4 in a tiny model, so its balancing biases (one per
#: expert plus the "skip" class, default 0 and -1) get a much smaller std: the router then decides,
#: and the skip class is picked for some tokens (so the skip path runs). transformers' from_pretrained sets the skip
#: class's bias back to -1 (its _init_weights runs on that buffer), so a saved tiny zaya does not reload exactly.
_BIAS_STD: dict[str, float] = {
    "e_score_correction_bias": 0.01,
    "expert_bias": 0.01,
    "balancing_biases": 1e-5,
}
#: Static token -> experts tables (deepseek_v4 hash routing), zero at init: filled with k distinct experts per token.
_HASH_TABLES = ("tid2eid",)


def _seed_for(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _is_norm(model: torch.nn.Module, param_name: str) -> bool:
    owner_path = param_name.rsplit(".", 1)[0] if "." in param_name else ""
    owner_name = owner_path.rsplit(".", 1)[-1].lower()
    owner = model.get_submodule(owner_path) if owner_path else model
    return any(h in owner_name for h in _NORM_HINTS) or "norm" in type(owner).__name__.lower()


def _reinit(model: torch.nn.Module, seed: int) -> list[str]:
    """Seeded values for all-zero floating parameters (not norms), selection-bias tensors and
    zero hash-routing tables. Returns the names of the tensors that were changed."""
    changed: list[str] = []
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        for name, tensor in model.named_buffers():
            if name.rsplit(".", 1)[-1] in (*_BIAS_STD, *_HASH_TABLES):
                tensors[name] = tensor
        for name, tensor in tensors.items():
            if not tensor.numel():
                continue
            leaf = name.rsplit(".", 1)[-1]
            gen = torch.Generator().manual_seed(_seed_for(name, seed))
            if leaf in _HASH_TABLES and not tensor.is_floating_point():
                if tensor.any() or tensor.dim() != 2:
                    continue
                n_experts = _num_experts_near(model, name)
                rows = [torch.randperm(n_experts, generator=gen)[: tensor.shape[1]] for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows).to(tensor.dtype))
            elif not tensor.is_floating_point():
                continue
            elif leaf in _BIAS_STD:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * _BIAS_STD[leaf])
            elif not tensor.any() and not _is_norm(model, name):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.02)
            else:
                continue
            changed.append(name)
    return changed


def _num_experts_near(model: torch.nn.Module, name: str) -> int:
    """Number of experts of the router owning ``name`` (its ``num_experts``, else the config's)."""
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    for attr in ("num_experts", "n_routed_experts"):
        value = getattr(owner, attr, None)
        if isinstance(value, int):
            return value
    cfg = model.config
    for attr in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    raise LookupError(f"number of experts for {name}")


def _keep_in_fp32(model: PreTrainedModel, dtype: torch.dtype) -> list[str]:
    """Upcast what ``from_pretrained`` would keep in float32 at ``dtype`` (``_keep_in_fp32_modules_strict``
    for bf16/fp16, ``_keep_in_fp32_modules`` for fp16); ``from_config`` does not do it. Returns the names."""
    get_plan = getattr(model, "_get_dtype_plan", None)
    patterns = list(get_plan(dtype)) if get_plan is not None else []
    if not patterns:
        return []
    regex = re.compile("|".join(p.replace("*", ".*") for p in patterns))
    changed = []
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and tensor.dtype != torch.float32 and regex.search(name):
                tensor.data = tensor.data.to(torch.float32)
                changed.append(name)
    return changed


def _seed(seed: Any, function: str) -> int:
    """``seed`` as an int (a numpy integer or a one-element integer tensor too); refused otherwise: torch takes a
    float or a bool seed as an int, and the seeded re-draws would read it as text, a model of no seed."""
    index = as_int(seed)
    if index is None:
        raise TypeError(f"{function}: seed must be an int, got {type(seed).__name__} {seed!r:.40}.")
    return index


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    experts_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny random model of ``family`` in ``eval()`` mode.

    Built under ``torch.manual_seed(seed)`` with ``from_config`` (``experts_implementation`` is passed
    only when not ``None``; the family default is used otherwise). ``overrides`` go to :func:`tiny_config`.

    Random init in transformers 5 leaves some weights exactly zero (afmoe's router, biases,
    attention sinks, ...), which makes routing degenerate (ties in top-k). After building:

    * every floating parameter that is all zeros, except norm weights/biases (modules whose name or
      class says norm), is re-drawn from normal(0, 0.02), seeded by ``seed`` and the parameter name;
    * selection-bias tensors (``e_score_correction_bias``, ``expert_bias``: normal(0, 0.01); zaya's
      ``balancing_biases``: normal(0, 1e-5), so its near-uniform tiny router still decides and the
      skip class is chosen for some tokens) get seeded random values, so the biased-selection code
      paths are exercised;
    * deepseek_v4's zero hash table ``tid2eid`` gets k distinct random experts per token id.

    The names of the tensors changed this way are kept in ``model._tiny_reinitialised``.

    For a bf16/fp16 ``dtype``, the tensors the family keeps in float32 when loaded with
    ``from_pretrained`` (``_keep_in_fp32_modules_strict``: e.g. ernie/beam/flint router weights,
    inkling2's router, which fails otherwise) are upcast as ``from_pretrained`` would.
    """
    seed = _seed(seed, "tiny_model")
    cfg = tiny_config(family, **overrides)
    cls = model_class(family)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    torch.manual_seed(seed)
    model = cls._from_config(cfg, **kwargs)
    model._tiny_reinitialised = tuple(_reinit(model, seed))
    if dtype != torch.float32:
        _keep_in_fp32(model, dtype)
    return model.eval()


def tiny_inputs(model: PreTrainedModel, batch: int = 2, seq: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for a tiny model's forward: ``input_ids`` ``[batch, seq]`` (seeded, drawn from
    ``3 .. vocab_size-1`` so no pad/bos/eos token appears) and an all-ones ``attention_mask``.

    Every family's forward needs only these (deepseek_v4's hash-routed layers read ``input_ids``;
    text-only multimodal decoders derive their M-RoPE positions themselves). They lie on the model's
    device, drawn on the CPU so a seed gives the same ids everywhere; on the CPU where that is the meta device (a
    model whose weights accelerate offloads: its hooks move the inputs)."""
    sizes = {}
    for name, value in (("batch", batch), ("seq", seq)):
        try:
            sizes[name] = operator.index(value) if not isinstance(value, bool) else 0
        except TypeError:
            sizes[name] = 0
        if sizes[name] < 1:
            raise ValueError(f"tiny_inputs: {name} must be a positive int (rows, tokens per row), got {value!r}.")
    batch, seq = sizes["batch"], sizes["seq"]
    if getattr(model, "config", None) is None:
        raise TypeError(f"tiny_inputs: model must be a transformers model (tiny_model(family)), got "
                        f"{type(model).__name__} {model!r:.40}.")
    gen = torch.Generator().manual_seed(_seed(seed, "tiny_inputs"))
    vocab = int(getattr(model.config, "vocab_size", None) or COMMON_SIZES["vocab_size"])
    device = model.device if model.device.type != "meta" else torch.device("cpu")
    input_ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
