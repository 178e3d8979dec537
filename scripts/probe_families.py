"""Probe every tiny MoE family with nnsight and record its structure to ``docs/dev/family-probe.json``.

For each family in :data:`moelens.testing.FAMILIES` this script builds the tiny model, runs one plain
forward with PyTorch hooks (call order, call signatures, output structures), wraps the model with
``nnsight.NNsight`` to list ``.source`` op names, and runs one trace that reads the router's logits
op (and its binding op) next to ``router.output``. Every result is compared with the reference notes
(``REFERENCE`` below, transcribed from the project's "MoE families in transformers 5.23" notes);
disagreements are listed per family under ``reference_mismatches`` and globally under
``reference_errors``. Failures are recorded, never raised.

Usage::

    python scripts/probe_families.py                  # all families
    python scripts/probe_families.py mixtral gemma4   # some families
    python scripts/probe_families.py --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

import nnsight  # noqa: E402
import transformers  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from moelens.testing import FAMILIES, UNBUILDABLE, tiny_inputs, tiny_model  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "dev" / "family-probe.json"

#: Router ops that may produce the logits, as named by the reference notes.
LOGITS_CANDIDATES = (
    "F_linear_0",
    "self_wg_0",
    "self_gate_0",
    "self_proj_0",
    "nn_functional_linear_0",
    "forward_0",
    "self_router_mlp_0",
    "self_layer_0",
    "torch_mm_0",
)

_DS = ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "after")
_SM = ("mlp", "gate", "F_linear_0", "router_logits_0", [], None)
_QWEN_SHARED = ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_expert", "shared_expert_gate"], "first")

#: What the reference notes say, per family: (block attribute on the decoder layer ("" = the layer
#: itself), router attribute on the block, logits op, logits binding op, shared-expert child names
#: (on the block, or on the layer for granite*), shared-expert position: "first" (before the router),
#: "between" (router, shared, experts), "after" (after the experts), "layer" (sibling on the
#: decoder layer, after the block), or None).
REFERENCE: dict[str, tuple[str, str, str, str, list[str], str | None]] = {
    "mixtral": _SM, "minimax": _SM, "olmoe": _SM, "flex_olmo": _SM, "qwen3_moe": _SM,
    "qwen3_vl_moe": _SM, "qwen3_omni_moe": _SM, "mellum": _SM,
    "inkling2": ("mlp", "gate", "F_linear_0", "logits_0", [], None),
    "qwen2_moe": _QWEN_SHARED, "qwen3_next": _QWEN_SHARED, "qwen3_5_moe": _QWEN_SHARED,
    "qwen4_exp": _QWEN_SHARED,
    "hunyuan_v1_moe": ("mlp", "gate", "self_wg_0", "router_logits_0", ["shared_mlp"], "first"),
    "jamba": ("feed_forward", "router", "F_linear_0", "router_logits_0", [], None),
    "ernie4_5_moe": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "first"),
    # Two blocks per MoE layer (quirk 11): mlp.text_moe and mlp.vision_moe.
    "ernie4_5_vl_moe": ("mlp.text_moe|mlp.vision_moe", "gate", "F_linear_0", "router_logits_0", [], None),
    "gemma4": ("", "router", "self_proj_0", "expert_scores_0", ["mlp"], "first"),
    "diffusion_gemma": ("", "router", "self_proj_0", "expert_scores_0", ["mlp"], "first"),
    "gpt_oss": ("mlp", "router", "F_linear_0", "router_logits_0", [], None),
    "granitemoe": ("block_sparse_moe", "router", "F_linear_0", "router_logits_0", [], None),
    "granitemoe_swa": ("block_sparse_moe", "router", "F_linear_0", "router_logits_0", ["shared_mlp"], "layer"),
    "granitemoeshared": ("block_sparse_moe", "router", "F_linear_0", "router_logits_0", ["shared_mlp"], "layer"),
    "granitemoehybrid": ("block_sparse_moe", "router", "F_linear_0", "router_logits_0", ["shared_mlp"], "layer"),
    "aria": ("mlp", "router", "nn_functional_linear_0", "router_logits_0", ["shared_experts"], "after"),
    "cohere2_moe": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "after"),
    "openai_privacy_filter": ("mlp", "router", "F_linear_0", "router_logits_0", [], None),
    "phimoe": ("mlp", "router", "forward_0", "router_logits_0", [], None),
    "deepseek_v2": _DS, "unlimited_ocr": _DS, "deepseek_ocr2": _DS, "deepseek_v3": _DS,
    "deepseek_v32": _DS, "glm4_moe": _DS, "glm4_moe_lite": _DS, "glm4v_moe": _DS, "glm_moe_dsa": _DS,
    "glm5_next": _DS, "dots1": _DS, "dots3_note": _DS, "kimi_linear": _DS, "bailing_hybrid": _DS,
    "exaone_moe": _DS, "solar_open": _DS, "axk1": _DS, "axk2": _DS, "hy_v4": _DS, "mistral4": _DS,
    "mistral_large4": _DS,
    "mimo_v2_flash": ("mlp", "gate", "F_linear_0", "router_logits_0", [], None),
    # kolibri1: torch_mm_0 / router_logits_0 only on CUDA with matching dtype and no grad.
    "kolibri1": ("mlp", "gate", "F_linear_0", "router_logits_1", ["shared_experts"], "after"),
    "nemotron_h": ("mixer", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "after"),
    "afmoe": ("mlp", "router", "self_gate_0", "router_logits_0", ["shared_experts"], "between"),
    "lfm2_moe": ("feed_forward", "gate", "F_linear_0", "router_logits_0", [], None),
    "flint": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_expert"], "after"),
    "laguna": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "first"),
    "minimax_m2": ("mlp", "gate", "F_linear_0", "router_logits_0", [], None),
    "minimax_m3_vl": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "first"),
    "hy_v3": ("mlp", "gate", "F_linear_0", "router_logits_0", ["shared_experts"], "after"),
    "beam": ("mlp", "gate", "F_linear_0", "router_logits_0", [], None),
    "muse_spark": ("mlp", "gate", "F_linear_0", "router_logits_1", [], None),
    "deepseek_v4": ("mlp", "gate", "F_linear_0", "logits_0", ["shared_experts"], "after"),
    "inkling": ("mlp", "gate", "F_linear_0", "routed_logits_0", ["shared_experts"], None),
    "zaya": ("mlp", "gate", "self_router_mlp_0", "router_logits_0", [], None),
    "llama4": ("feed_forward", "router", "forward_0", "router_logits_0", ["shared_expert"], "after"),
    "dbrx": ("ffn", "router", "self_layer_0", "router_logits_0", [], None),
}

#: Decorator arguments that differ from the defaults, per the reference notes.
REFERENCE_FLAGS: dict[str, dict[str, bool]] = {
    "aria": {"is_transposed": True},
    "gpt_oss": {"is_concatenated": False, "is_transposed": True, "has_bias": True},
    "openai_privacy_filter": {"is_transposed": True, "has_bias": True},
    "nemotron_h": {"has_gate": False},
    "muse_spark": {"has_post_expert_norm": True},
}
_DEFAULT_FLAGS = {
    "has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
    "has_post_expert_norm": False,
}
#: Families whose block returns a tuple (reference quirk 2).
REFERENCE_TUPLE_BLOCKS = {"gpt_oss", "openai_privacy_filter", "zaya", "llama4", "ernie4_5_vl_moe"}
#: Where the reference says ``router.output[0]`` is not the logits.
REFERENCE_OUTPUT_QUIRK = {
    "gemma4": "output[0] is softmax(logits)",
    "diffusion_gemma": "output[0] is softmax(logits)",
    "llama4": "logits are output[1]",
    "zaya": "logits op is [B,S,E+1]; output[0] is its reshape(-1, E+1)",
    "inkling": "logits op is [T,E+n_shared]; routed_logits_0 is [T,E]",
    "muse_spark": "returned logits are router_logits_1 = F_linear_0 * output_multiplier",
}
_UNDECORATED_EXPERTS = ("Llama4TextExperts", "DbrxExperts")

_DS3_ROUTER = [
    "F_linear_0", "router_logits_0", "router_logits_sigmoid_0", "scores_0", "scores_for_choice_0",
    "scores_for_choice_view_0", "topk_0", "sum_0", "torch_topk_0", "group_mask_scatter__0",
    "scores_for_choice_masked_fill_0", "torch_topk_1", "topk_indices_0", "scores_gather_0", "topk_weights_0",
]
_DS_BLOCK = ["self_gate_0", "self_experts_0", "self_shared_experts_0"]
_SM_ROUTER = ["F_linear_0", "router_logits_0", "torch_nn_functional_softmax_0", "torch_topk_0"]
_QWEN_BLOCK = ["self_shared_expert_0", "self_gate_0", "self_experts_0", "self_shared_expert_gate_0", "F_sigmoid_0",
               "expert_output_0"]
#: Op names the reference's per-family notes mention, for the router's and the block's ``.source``
#: ("block" is the decoder layer for gemma4 / diffusion_gemma). Checked for presence.
REFERENCE_OPS: dict[str, dict[str, list[str]]] = {
    "mixtral": {"router": [*_SM_ROUTER, "router_logits_float_0", "router_top_value_sum_0"],
                "block": ["self_gate_0", "self_experts_0"]},
    "minimax": {"router": [*_SM_ROUTER, "router_logits_float_0", "router_top_value_sum_0"],
                "block": ["self_gate_0", "self_experts_0"]},
    **{f: {"router": [*_SM_ROUTER, "router_top_value_to_0"]}
       for f in ("olmoe", "flex_olmo", "qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe", "mellum", "qwen2_moe",
                 "qwen3_next", "qwen3_5_moe", "qwen4_exp")},
    "hunyuan_v1_moe": {"router": ["self_wg_0", "router_logits_0", "F_softmax_0", "torch_topk_0", "routing_weights_to_0"],
                       "block": ["self_shared_mlp_0", "self_gate_0", "self_experts_0"]},
    "jamba": {"router": ["F_linear_0", "router_logits_0", "torch_nn_functional_softmax_0", "top_k_weights_to_0"],
              "block": ["self_router_0", "self_experts_0"]},
    "ernie4_5_moe": {"router": ["hidden_states_float_0", "F_linear_0", "router_logits_0", "F_softmax_0",
                                "self_moe_statics_0", "torch_topk_0", "torch_gather_0"]},
    "gemma4": {"router": ["self_norm_0", "self_proj_0", "expert_scores_0", "nn_functional_softmax_0",
                          "router_probabilities_0", "torch_topk_0", "top_k_weights_sum_0", "top_k_weights_0"],
               "block": ["self_mlp_0", "self_post_feedforward_layernorm_1_0", "self_router_0",
                         "self_pre_feedforward_layernorm_2_0", "self_experts_0", "self_post_feedforward_layernorm_2_0"]},
    "diffusion_gemma": {"router": ["self_norm_0", "self_proj_0", "expert_scores_0", "nn_functional_softmax_0",
                                   "router_probabilities_0", "torch_topk_0"],
                        "block": ["self_mlp_0", "self_router_0", "self_pre_feedforward_layernorm_2_0", "self_experts_0"]},
    "gpt_oss": {"router": ["F_linear_0", "router_logits_0", "torch_topk_0", "torch_nn_functional_softmax_0",
                           "router_scores_0"],
                "block": ["self_router_0", "self_experts_0"]},
    **{f: {"router": ["F_linear_0", "router_logits_0", "router_logits_topk_0", "torch_softmax_0"],
           "block": ["self_router_0", "self_experts_0"]}
       for f in ("granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid")},
    "aria": {"router": ["nn_functional_linear_0", "router_logits_0"]},
    "cohere2_moe": {"router": ["F_linear_0", "torch_topk_0", "F_softmax_0"]},
    "phimoe": {"router": ["forward_0", "router_logits_0", "sparsemixer_0"]},
    "deepseek_v2": {"router": ["hidden_states_type_0", "F_linear_0", "router_logits_0", "router_logits_softmax_0",
                               "torch_topk_0"], "block": _DS_BLOCK},
    "unlimited_ocr": {"router": ["F_linear_0", "router_logits_0", "router_logits_softmax_0"], "block": _DS_BLOCK},
    **{f: {"router": _DS3_ROUTER, "block": _DS_BLOCK}
       for f in ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa", "glm5_next",
                 "dots1", "dots3_note", "kimi_linear", "bailing_hybrid", "exaone_moe", "solar_open", "axk2", "hy_v4")},
    "axk1": {"router": _DS3_ROUTER, "block": [*_DS_BLOCK, "self_post_mlp_layernorm_0"]},
    "nemotron_h": {"router": _DS3_ROUTER,
                   "block": [*_DS_BLOCK, "self_fc1_latent_proj_0", "self_fc2_latent_proj_0"]},
    "kolibri1": {"router": ["torch_mm_0", "router_logits_0", "F_linear_0", "router_logits_1"]},
    "afmoe": {"router": ["self_gate_0", "to_0", "router_logits_0", "torch_sigmoid_0", "torch_topk_0",
                         "scores_gather_0"],
              "block": ["self_router_0", "self_shared_experts_0", "self_experts_0"]},
    "hy_v3": {"block": ["routed_output_0", "self_shared_experts_0", "self_shared_experts_1"]},
    "laguna": {"router": ["F_linear_0", "float_0", "router_logits_0", "torch_tanh_0", "router_logits_1"],
               "block": ["self_shared_experts_0", "self_gate_0", "self_experts_0"]},
    "minimax_m3_vl": {"block": ["self_shared_experts_0", "self_gate_0", "self_experts_0"]},
    "muse_spark": {"router": ["F_linear_0", "router_logits_0", "router_logits_1"],
                   "block": ["self_gate_0", "self_pre_expert_proj_0", "self_pre_expert_norm_0", "self_experts_0",
                             "self_post_expert_proj_0"]},
    "deepseek_v4": {"router": ["F_linear_0", "logits_0", "self_score_fn_0"], "block": ["self_gate_0", "self_gate_1"]},
    "inkling2": {"router": ["F_linear_0", "logits_0", "self_score_fn_0"]},
    "inkling": {"router": ["F_linear_0", "router_logits_0", "routed_logits_0", "shared_gammas_0"]},
    "zaya": {"router": ["self_down_proj_0", "self_router_mlp_0", "router_logits_0", "torch_softmax_0"]},
    "llama4": {"router": ["forward_0", "router_logits_0", "torch_topk_0"], "block": ["self_experts_0"]},
    "dbrx": {"router": ["self_layer_0", "router_logits_0"],
             "block": ["self_router_0", "self_route_tokens_to_experts_0", "self_experts_0"]},
}
for _f in ("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp"):
    REFERENCE_OPS[_f]["block"] = _QWEN_BLOCK
#: The decorated experts wrapper's ops (every decorated family).
REFERENCE_EXPERTS_OPS = ["experts_interface_get_interface_0", "experts_forward_0", "experts_forward_1"]

#: Places where the reference notes (or the task brief) turned out wrong or out of date, found while
#: building the tiny models; the per-family checks above add any they detect to "reference_errors".
REFERENCE_CORRECTIONS: list[str] = [
    "glm5_next: the reference says its tiny config fails the config's own validation and lists it as "
    "read-only. It builds and runs: Glm5NextTextConfig.validate_architecture requires NoPE for the DSA "
    "attention (qk_rope_head_dim == 0), num_key_value_heads == num_attention_heads, a q_lora_rank, and "
    "index_topk divisible by index_kpool. With qk_rope_head_dim=0 the tiny model passes every check here.",
    "Coverage: the reference probed 61 decorated folders and left deepseek_ocr2, ernie4_5_vl_moe and "
    "glm5_next read-only; all 64 decorated folders (plus llama4 and dbrx) build and are probed here.",
    "ernie4_5_vl_moe: besides text_moe/vision_moe (quirk 11), the outer Ernie4_5_VLMoeMoeBlock holds the "
    "shared expert (mlp.shared_experts), which runs before the text/vision blocks; with text-only input "
    "vision_moe is not called at all, and text_moe returns (flat_out [T*D], flat_logits [T*E]).",
    "diffusion_gemma: DiffusionGemmaTextConfig has no enable_moe_block field (the task brief asked to "
    "enable it); every encoder text layer always builds router + experts next to its dense mlp.",
    "axk2: the reference's DS3 op list (scores_for_choice_view_0, topk_0, sum_0, group_mask_scatter__0, "
    "scores_for_choice_masked_fill_0, torch_topk_1) does not apply: the group-limited step is a helper "
    "method (op self_apply_group_scoring_0, run only when n_group is set) and the expert top-k is torch_topk_0.",
    "kolibri1 on CPU: the logits op is F_linear_0 with binding router_logits_1 (torch_mm_0 / "
    "router_logits_0 are in the source but do not run), as the reference says for the non-CUDA path.",
]


# --------------------------------------------------------------------------------------------
# Static structure
# --------------------------------------------------------------------------------------------


def _is_decorated_experts(module: torch.nn.Module) -> bool:
    """An experts module whose class went through ``use_experts_implementation``."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")


def _is_experts(module: torch.nn.Module) -> bool:
    return _is_decorated_experts(module) or type(module).__name__ in _UNDECORATED_EXPERTS


def find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder-layer list: the first ModuleList of ``num_hidden_layers`` modules holding experts."""
    n = getattr(model.config, "num_hidden_layers", None)
    fallback = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or (n is not None and len(module) != n):
            continue
        if any(_is_experts(m) for m in module.modules()):
            return name, module
        if fallback is None and name.endswith(("layers", "blocks")):
            fallback = (name, module)
    if fallback is None:
        raise LookupError("no decoder layer list found")
    return fallback


def _children(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_children()]


def _resolve(root: Any, path: str) -> Any:
    """getattr along a dotted path; integer parts index (works on modules and envoys)."""
    obj = root
    for part in path.split(".") if path else []:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _find_router(block: torch.nn.Module, experts_name: str) -> str | None:
    names = _children(block)
    for preferred in ("gate", "router"):
        if preferred in names and preferred != experts_name:
            return preferred
    for name, child in block.named_children():
        cls = type(child).__name__
        if name != experts_name and ("Router" in cls or cls.endswith("Gate")):
            return name
    return None


def _flags(experts: torch.nn.Module) -> dict[str, Any]:
    keys = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm", "_is_expert_parallel")
    return {k: getattr(experts, k) for k in keys if hasattr(experts, k)}


def _top_k(router: torch.nn.Module, block: torch.nn.Module, model: torch.nn.Module) -> tuple[Any, str | None]:
    for owner, label in ((router, "router"), (block, "block")):
        for attr in ("top_k", "moe_top_k", "num_experts_per_tok"):
            if hasattr(owner, attr) and isinstance(getattr(owner, attr), int):
                return getattr(owner, attr), f"{label}.{attr}"
    cfg = getattr(router, "config", None)
    for attr in ("top_k_experts", "num_experts_per_tok", "moe_k", "moe_topk", "moe_top_k"):
        if cfg is not None and getattr(cfg, attr, None) is not None:
            return getattr(cfg, attr), f"router.config.{attr}"
    for attr in ("top_k_experts", "num_experts_per_tok", "moe_k", "moe_topk"):
        if getattr(model.config, attr, None) is not None:
            return getattr(model.config, attr), f"model.config.{attr}"
    return None, None


def _num_experts(experts: torch.nn.Module) -> tuple[Any, str | None]:
    for attr in ("num_experts", "moe_num_experts", "num_local_experts"):
        value = getattr(experts, attr, None)
        if isinstance(value, int):
            return value, f"experts.{attr}"
    return None, None


def _dense_mlp(layer: torch.nn.Module) -> list[dict[str, Any]]:
    out = []
    for name, child in layer.named_children():
        cls = type(child).__name__
        if "shared" in name:
            continue
        if "MLP" in cls or "FFN" in cls or "FeedForward" in cls or name in ("mlp", "feed_forward", "ffn"):
            out.append({"attr": name, "class": cls, "children": _children(child)})
    return out


def describe_layer(layer: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """Static description of one decoder layer: MoE blocks (with router/experts/shared) or dense MLP."""
    experts_paths = [name for name, m in layer.named_modules() if name and _is_experts(m)]
    info: dict[str, Any] = {"layer_class": type(layer).__name__, "children": _children(layer)}
    if not experts_paths:
        dense = _dense_mlp(layer)
        info["kind"] = "dense" if dense else "none"
        info["dense_mlp"] = dense
        return info
    info["kind"] = "moe"
    blocks = []
    for path in experts_paths:
        block_path, _, experts_name = path.rpartition(".")
        block = _resolve(layer, block_path)
        experts = _resolve(layer, path)
        router_name = _find_router(block, experts_name)
        router = getattr(block, router_name) if router_name else None
        e, e_from = _num_experts(experts)
        entry: dict[str, Any] = {
            "block_path": block_path,  # relative to the layer; "" = the layer itself
            "block_class": type(block).__name__,
            "block_children": _children(block),
            "experts": {
                "name": experts_name,
                "class": type(experts).__name__,
                "decorated": _is_decorated_experts(experts),
                "flags": _flags(experts),
                "num_experts": e,
                "num_experts_from": e_from,
                "params": {n: list(p.shape) for n, p in experts.named_parameters(recurse=False)},
            },
        }
        if router is not None:
            k, k_from = _top_k(router, block, model)
            entry["router"] = {
                "name": router_name,
                "class": type(router).__name__,
                "bases": [b.__name__ for b in type(router).__mro__[1:3]],
                "children": _children(router),
                "top_k": k,
                "top_k_from": k_from,
                "has_top_k_attr": hasattr(router, "top_k"),
                "has_num_experts_attr": hasattr(router, "num_experts"),
                "params": {n: list(p.shape) for n, p in router.named_parameters(recurse=False)},
                "buffers": {n: list(b.shape) for n, b in router.named_buffers(recurse=False)},
            }
        else:
            entry["router"] = None
        shared_block = [
            {"name": n, "class": type(c).__name__, "on": "block"}
            for n, c in block.named_children()
            if "shared" in n
        ]
        shared_layer = (
            [{"name": n, "class": type(c).__name__, "on": "layer"} for n, c in layer.named_children() if "shared" in n]
            if block is not layer
            else []
        )
        # Nested blocks (ernie4_5_vl_moe: mlp.text_moe): shared experts on an enclosing module.
        shared_outer = []
        parts = block_path.split(".") if block_path else []
        for depth in range(len(parts) - 1, 0, -1):
            outer_path = ".".join(parts[:depth])
            outer = _resolve(layer, outer_path)
            shared_outer += [
                {"name": n, "class": type(c).__name__, "on": outer_path, "outer_class": type(outer).__name__}
                for n, c in outer.named_children()
                if "shared" in n
            ]
        entry["shared"] = shared_block + shared_outer + shared_layer
        if block is layer:  # gemma4-style: router/experts on the layer next to a dense MLP
            entry["parallel_dense_mlp"] = _dense_mlp(layer)
        known = {experts_name, router_name} | {s["name"] for s in shared_block}
        entry["other_block_children"] = [n for n in _children(block) if n not in known] if block is not layer else []
        entry["block_buffers"] = {
            n: list(b.shape) for n, b in block.named_buffers(recurse=False)
        } if block is not layer else {}
        entry["block_params"] = {
            n: list(p.shape) for n, p in block.named_parameters(recurse=False)
        } if block is not layer else {}
        blocks.append(entry)
    info["blocks"] = blocks
    return info


# --------------------------------------------------------------------------------------------
# Dynamic structure from one plain forward with hooks
# --------------------------------------------------------------------------------------------


def _describe_value(value: Any) -> Any:
    """Tensors become ``"float32[10, 8]"`` (dtype[shape]); tuples/lists are described element-wise."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return [_describe_value(v) for v in value]
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    if hasattr(value, "to_tuple"):
        return {"type": type(value).__name__}
    return {"type": type(value).__name__}


def hook_pass(model: torch.nn.Module, layers_path: str, layers: dict[int, dict[str, Any]], inputs: dict) -> None:
    """Run one forward with hooks; add call order, signatures and output structures to ``layers``."""
    layer_list = _resolve(model, layers_path)
    handles = []
    events: dict[int, list[str]] = {i: [] for i in layers}
    captured: dict[tuple[int, str, str], Any] = {}

    def pre(i: int, tag: str):
        def fn(module, args, kwargs):
            events[i].append(tag)
            captured.setdefault((i, tag, "args"), (args, kwargs))

        return fn

    def post(i: int, tag: str):
        def fn(module, args, kwargs, output):
            captured.setdefault((i, tag, "out"), output)

        return fn

    for i, info in layers.items():
        layer = layer_list[i]
        for name, child in layer.named_children():
            handles.append(child.register_forward_pre_hook(pre(i, f"layer.{name}"), with_kwargs=True))
        for b, block_info in enumerate(info.get("blocks", [])):
            block = _resolve(layer, block_info["block_path"])
            if block is layer:
                continue
            for name, child in block.named_children():
                handles.append(child.register_forward_pre_hook(pre(i, f"block{b}.{name}"), with_kwargs=True))
                handles.append(child.register_forward_hook(post(i, f"block{b}.{name}"), with_kwargs=True))
            handles.append(block.register_forward_hook(post(i, f"block{b}"), with_kwargs=True))
            handles.append(block.register_forward_pre_hook(pre(i, f"block{b}"), with_kwargs=True))
        for b, block_info in enumerate(info.get("blocks", [])):
            for sh in block_info.get("shared", []):
                if sh["on"] not in ("block", "layer"):
                    child = _resolve(layer, f"{sh['on']}.{sh['name']}")
                    handles.append(child.register_forward_pre_hook(pre(i, f"outer{b}.{sh['name']}"), with_kwargs=True))
            block = _resolve(layer, block_info["block_path"])
            if block is layer:
                for name in (block_info["experts"]["name"], (block_info["router"] or {}).get("name")):
                    if name:
                        child = getattr(layer, name)
                        handles.append(child.register_forward_hook(post(i, f"layer.{name}"), with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()

    for i, info in layers.items():
        order = events[i]
        info["layer_call_order"] = _dedupe([e[len("layer."):] for e in order if e.startswith("layer.")])
        for b, block_info in enumerate(info.get("blocks", [])):
            prefix = f"block{b}."
            in_layer = block_info["block_path"] == ""
            if in_layer:
                block_info["call_order"] = info["layer_call_order"]
                r_tag = f"layer.{(block_info['router'] or {}).get('name')}"
                e_tag = f"layer.{block_info['experts']['name']}"
                block_info["block_called"] = True
            else:
                block_info["call_order"] = _dedupe([e[len(prefix):] for e in order if e.startswith(prefix)])
                r_tag = f"block{b}.{(block_info['router'] or {}).get('name')}"
                e_tag = f"block{b}.{block_info['experts']['name']}"
                block_info["block_called"] = (i, f"block{b}", "args") in captured
                blk_out = captured.get((i, f"block{b}", "out"))
                blk_args = captured.get((i, f"block{b}", "args"))
                block_info["block_inputs"] = _describe_value(list(blk_args[0])) if blk_args else None
                block_info["block_input_kwargs"] = sorted(blk_args[1]) if blk_args else None
                block_info["block_output"] = _describe_value(blk_out)
                block_info["block_output_is_tuple"] = isinstance(blk_out, tuple) if blk_args else None
            r_out = captured.get((i, r_tag, "out"))
            r_args = captured.get((i, r_tag, "args"))
            e_args = captured.get((i, e_tag, "args"))
            e_out = captured.get((i, e_tag, "out"))
            block_info["router_called"] = r_args is not None
            block_info["router_inputs"] = _describe_value(list(r_args[0])) if r_args else None
            block_info["router_input_kwargs"] = sorted(r_args[1]) if r_args else None
            block_info["router_output"] = _describe_value(r_out)
            block_info["experts_called"] = e_args is not None
            if e_args is not None:
                args, kwargs = e_args
                block_info["experts_call"] = {
                    "n_positional": len(args),
                    "kwargs": sorted(kwargs),
                    "args": _describe_value(list(args)),
                }
                block_info["experts_output"] = _describe_value(e_out)
                if len(args) >= 2 and isinstance(args[1], torch.Tensor) and not args[1].is_floating_point():
                    # How many different experts the 10 tokens were sent to (degenerate routing -> few).
                    block_info["distinct_experts_selected"] = int(args[1].unique().numel())
                block_info["router_to_experts"] = _match_router_to_experts(r_out, args)
            block_info["shared_position"] = _shared_position(block_info, order, b, in_layer)


def _parse(desc: Any) -> tuple[str | None, list[int] | None]:
    """Inverse of :func:`_describe_value` for one tensor: ``"float32[10, 8]"`` -> ("float32", [10, 8])."""
    if not isinstance(desc, str) or "[" not in desc:
        return None, None
    dtype, _, rest = desc.partition("[")
    return dtype, json.loads("[" + rest)


def _dedupe(seq: list[str]) -> list[str]:
    seen: list[str] = []
    for s in seq:
        if s not in seen:
            seen.append(s)
    return seen


def _match_router_to_experts(router_out: Any, experts_args: tuple) -> dict[str, Any] | None:
    """Which router outputs are the experts' (indices, weights) arguments."""
    if router_out is None or len(experts_args) < 3:
        return None
    outs = router_out if isinstance(router_out, tuple) else (router_out,)
    result: dict[str, Any] = {}
    for label, arg in (("indices", experts_args[1]), ("weights", experts_args[2])):
        hit = None
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and isinstance(arg, torch.Tensor) and o.shape == arg.shape:
                if torch.equal(o, arg):
                    hit = j
                    break
        result[f"{label}_is_router_output"] = hit
    return result


def _shared_position(block_info: dict[str, Any], order: list[str], b: int, in_layer: bool) -> str | None:
    shared = block_info.get("shared") or []
    if in_layer:  # gemma4-style: the parallel dense MLP plays the shared expert
        shared = [{"name": d["attr"], "on": "layer"} for d in block_info.get("parallel_dense_mlp", [])]
    if not shared:
        return None
    router = (block_info.get("router") or {}).get("name")
    experts = block_info["experts"]["name"]
    if in_layer:
        seq = [e[len("layer."):] for e in order if e.startswith("layer.")]
        names = [s["name"] for s in shared]
    else:
        seq = [e[len(f"block{b}."):] for e in order if e.startswith(f"block{b}.")]
        names = [s["name"] for s in shared if s["on"] == "block"]
        outer = [s["name"] for s in shared if s["on"] not in ("block", "layer")]
        if not names and outer:
            oseq = [e for e in order if e.startswith(f"outer{b}.") or e == f"block{b}"]
            try:
                blk = oseq.index(f"block{b}")
                sh = min(oseq.index(f"outer{b}.{n}") for n in outer if f"outer{b}.{n}" in oseq)
            except ValueError:
                return "not called"
            return "outer-after-block" if sh > blk else "outer-before-block"
        if not names and any(s["on"] == "layer" for s in shared):
            lseq = [e for e in order if e.startswith("layer.") or e == f"block{b}"]
            lnames = [f"layer.{s['name']}" for s in shared if s["on"] == "layer"]
            try:
                blk = lseq.index(f"block{b}")
                sh = min(lseq.index(n) for n in lnames if n in lseq)
            except ValueError:
                return "not called"
            return "layer" if sh > blk else "layer-before-block"
    try:
        r = seq.index(router) if router in seq else None
        e = seq.index(experts)
        s = min(seq.index(n) for n in names if n in seq)
    except ValueError:
        return "not called"
    if r is not None and s < r:
        return "first"
    if r is not None and r < s < e:
        return "between"
    return "after" if s > e else "before-experts"


# --------------------------------------------------------------------------------------------
# nnsight: .source op names and one trace
# --------------------------------------------------------------------------------------------


def _op_names(envoy: Any) -> list[str]:
    return [op.name for op in envoy.source]


_GLOBAL_LISTINGS: dict[str, list[str]] = {}


def source_pass(nm: Any, layers_path: str, layers: dict[int, dict[str, Any]], listings: dict[str, str]) -> None:
    """Record ``.source`` op names of routers, blocks and experts (outside a trace)."""
    for i, info in layers.items():
        layer_env = _resolve(nm, f"{layers_path}.{i}")
        if info["kind"] != "moe":
            continue
        for block_info in info["blocks"]:
            block_env = _resolve(layer_env, block_info["block_path"])
            for key, env, cls in (
                ("block_source_ops", block_env, block_info["block_class"]),
                (
                    "router_source_ops",
                    getattr(block_env, block_info["router"]["name"]) if block_info["router"] else None,
                    (block_info["router"] or {}).get("class"),
                ),
                ("experts_source_ops", getattr(block_env, block_info["experts"]["name"]), block_info["experts"]["class"]),
            ):
                if env is None:
                    block_info[key] = None
                    continue
                try:
                    block_info[key] = _op_names(env)
                    # The decorated experts wrapper is the same everywhere: listed once, globally.
                    if cls not in listings and not (key == "experts_source_ops" and block_info["experts"]["decorated"]):
                        listings[cls] = str(env.source)
                    elif key == "experts_source_ops" and "experts_wrapper" not in _GLOBAL_LISTINGS:
                        _GLOBAL_LISTINGS["experts_wrapper"] = str(env.source).splitlines()
                except Exception as exc:  # noqa: BLE001 - recorded
                    block_info[key] = None
                    block_info.setdefault("errors", []).append(f"{key}: {type(exc).__name__}: {exc}")


def _compare(value: torch.Tensor, target: Any) -> str | None:
    """'equal', 'close', 'equal-after-reshape', ... or None."""
    if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    for label, a in (("", value), ("-after-reshape", value.reshape(-1, value.shape[-1]) if value.dim() else value)):
        if a.shape != target.shape:
            continue
        if torch.equal(a, target):
            return "equal" + label
        if a.dtype == target.dtype and torch.allclose(a, target, atol=1e-6, rtol=1e-5):
            return "close" + label
    return None


def _relations(value: torch.Tensor, router_out: Any, num_experts: int | None) -> dict[str, Any]:
    outs = router_out if isinstance(router_out, tuple) else (router_out,)
    rel: dict[str, Any] = {}
    for j, o in enumerate(outs):
        c = _compare(value, o)
        if c:
            rel[f"output[{j}]"] = c
        if isinstance(o, torch.Tensor) and o.is_floating_point() and value.shape[-1] == o.shape[-1]:
            c = _compare(torch.softmax(value.float(), dim=-1), o)
            if c:
                rel[f"softmax->output[{j}]"] = c
        if num_experts and value.shape[-1] > num_experts and isinstance(o, torch.Tensor):
            c = _compare(value[..., :num_experts], o)
            if c:
                rel[f"[..., :E]->output[{j}]"] = c
    return rel


def trace_pass(
    nm: Any, family: str, layers_path: str, layers: dict[int, dict[str, Any]], inputs: dict
) -> dict[str, Any]:
    """One trace: for each MoE layer read the logits op, its binding and ``router.output``."""
    ref = REFERENCE.get(family)
    plan = []  # (layer, block index, router path, op, binding)
    for i, info in layers.items():
        if info["kind"] != "moe":
            continue
        for b, block_info in enumerate(info["blocks"]):
            if not block_info.get("router") or not block_info.get("router_called"):
                continue
            ops = block_info.get("router_source_ops") or []
            op = ref[2] if ref and ref[2] in ops else next((c for c in LOGITS_CANDIDATES if c in ops), None)
            binding = ref[3] if ref and ref[3] in ops else None
            path = ".".join(p for p in (layers_path, str(i), block_info["block_path"], block_info["router"]["name"]) if p)
            plan.append((i, b, path, op, binding))
    result: dict[str, Any] = {"ok": False, "plan": [list(p) for p in plan]}
    saved: list[tuple[Any, Any, Any]] = []
    t0 = time.perf_counter()
    try:
        with nm.trace(**inputs):
            for i, b, path, op, binding in plan:
                router = _resolve(nm, path)
                op_val = getattr(router.source, op).output.save() if op else None
                bind_val = getattr(router.source, binding).output.save() if binding else None
                out_val = router.output.save()
                saved.append((op_val, bind_val, out_val))
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded
        result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if not result["ok"]:
        result["fallback"] = _fallback_traces(nm, plan, inputs)
        return result
    for (i, b, path, op, binding), (op_val, bind_val, out_val) in zip(plan, saved):
        block_info = layers[i]["blocks"][b]
        e = block_info["experts"]["num_experts"]
        entry: dict[str, Any] = {"router_path": path, "op": op, "binding": binding}
        if op_val is not None:
            entry["op_output"] = _describe_value(op_val)
            entry["op_relations"] = _relations(op_val, out_val, e) if isinstance(op_val, torch.Tensor) else {}
        if bind_val is not None:
            entry["binding_output"] = _describe_value(bind_val)
            entry["binding_relations"] = _relations(bind_val, out_val, e) if isinstance(bind_val, torch.Tensor) else {}
            if isinstance(op_val, torch.Tensor) and isinstance(bind_val, torch.Tensor):
                entry["binding_equals_op"] = _compare(bind_val, op_val)
        entry["router_output"] = _describe_value(out_val)
        entry["op_matches_output0"] = bool(
            entry.get("op_relations", {}).get("output[0]")
        )
        block_info["logits_trace"] = entry
    return result


def _fallback_traces(nm: Any, plan: list, inputs: dict) -> list[dict[str, Any]]:
    """After a failed trace: try each present logits candidate of the first planned router alone."""
    if not plan:
        return []
    i, b, path, _, _ = plan[0]
    router_env = _resolve(nm, path)
    ops = [o for o in _op_names(router_env) if o in LOGITS_CANDIDATES]
    tries = []
    for op in ops:
        box: list[Any] = []
        try:
            with nm.trace(**inputs):
                router = _resolve(nm, path)
                box.append(getattr(router.source, op).output.save())
                box.append(router.output.save())
            rel = _relations(box[0], box[1], None) if isinstance(box[0], torch.Tensor) else {}
            tries.append({"layer": i, "op": op, "ok": True, "shape": _describe_value(box[0]), "relations": rel})
        except Exception as exc:  # noqa: BLE001 - recorded
            tries.append({"layer": i, "op": op, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return tries


# --------------------------------------------------------------------------------------------
# Reference comparison
# --------------------------------------------------------------------------------------------


def check_reference(family: str, rec: dict[str, Any]) -> list[str]:
    """Statements of the reference notes that this probe found to be wrong for ``family``."""
    bad: list[str] = []
    ref = REFERENCE.get(family)
    moe = [(i, l) for i, l in rec["layers"].items() if l["kind"] == "moe"]
    if not moe:
        return ["no MoE layer found"]
    decorated = family not in ("llama4", "dbrx")
    impl = rec.get("default_experts_implementation")
    want_impl = "eager" if family in ("openai_privacy_filter", "llama4", "dbrx") else "grouped_mm"
    if impl != want_impl:
        bad.append(f"default experts implementation is {impl!r}, reference says {want_impl!r}")
    for i, layer in moe:
        for block in layer["blocks"]:
            where = f"layer {i} ({block['block_path'] or '<layer>'})"
            if ref:
                if block["block_path"] not in ref[0].split("|"):
                    bad.append(f"{where}: block attribute is {block['block_path']!r}, reference says {ref[0]!r}")
                rname = (block.get("router") or {}).get("name")
                if rname != ref[1]:
                    bad.append(f"{where}: router attribute is {rname!r}, reference says {ref[1]!r}")
                ops = block.get("router_source_ops") or []
                if ref[2] not in ops:
                    bad.append(f"{where}: logits op {ref[2]!r} not in router.source")
                if ref[3] not in ops:
                    bad.append(f"{where}: binding op {ref[3]!r} not in router.source")
                names = sorted(s["name"] for s in block.get("shared", []) if s["on"] in ("block", "layer"))
                want = sorted(ref[4]) if block["block_path"] else []
                if block["block_path"] == "" and block.get("parallel_dense_mlp"):
                    names = sorted(d["attr"] for d in block["parallel_dense_mlp"])
                    want = sorted(ref[4])
                if names != want:
                    bad.append(f"{where}: shared children {names}, reference says {want}")
                pos = block.get("shared_position")
                if ref[5] and pos != ref[5]:
                    bad.append(f"{where}: shared expert position {pos!r}, reference says {ref[5]!r}")
            ref_ops = REFERENCE_OPS.get(family, {})
            for part, key in (("router", "router_source_ops"), ("block", "block_source_ops")):
                ops = block.get(key)
                if ops is None or block["block_path"].endswith("vision_moe"):
                    continue
                missing = [o for o in ref_ops.get(part, []) if o not in ops]
                if missing:
                    bad.append(f"{where}: {part}.source lacks {missing} named by the reference")
            if decorated and block.get("experts_source_ops") != REFERENCE_EXPERTS_OPS:
                bad.append(f"{where}: experts.source ops {block.get('experts_source_ops')}")
            if decorated:
                flags = block["experts"]["flags"]
                want_flags = {**_DEFAULT_FLAGS, **REFERENCE_FLAGS.get(family, {})}
                for k, v in want_flags.items():
                    if flags.get(k) != v:
                        bad.append(f"{where}: experts.{k}={flags.get(k)!r}, reference says {v!r}")
                if not isinstance(block["experts"]["num_experts"], int):
                    bad.append(f"{where}: experts.num_experts is not an int")
                router = block.get("router") or {}
                gemma = family in ("gemma4", "diffusion_gemma")
                if router and router.get("has_top_k_attr") == gemma:
                    bad.append(f"{where}: router.top_k present={router.get('has_top_k_attr')} (reference: absent only in gemma)")
                if router and router.get("has_num_experts_attr") == gemma:
                    bad.append(
                        f"{where}: router.num_experts present={router.get('has_num_experts_attr')} "
                        "(reference: absent only in the gemma routers)"
                    )
                call = block.get("experts_call")
                if call:
                    if call["n_positional"] != 3 or call["kwargs"]:
                        bad.append(f"{where}: experts called with {call['n_positional']} positional args, kwargs {call['kwargs']}")
                    else:
                        idx_dtype, _ = _parse(call["args"][1])
                        if idx_dtype != "int64":
                            bad.append(f"{where}: experts indices dtype {idx_dtype}")
                        _, hidden_shape = _parse(call["args"][0])
                        if hidden_shape is None or len(hidden_shape) != 2:
                            bad.append(f"{where}: experts hidden is {call['args'][0]}, reference says [T, D]")
            if block.get("block_path"):
                is_tuple = block.get("block_output_is_tuple")
                if is_tuple is not None and is_tuple != (family in REFERENCE_TUPLE_BLOCKS):
                    bad.append(f"{where}: block output is_tuple={is_tuple}")
            lt = block.get("logits_trace")
            if lt and lt.get("op_output"):
                shape = _parse(lt["op_output"])[1] or []
                e = block["experts"]["num_experts"]
                if family == "zaya":
                    if len(shape) != 3:
                        bad.append(f"{where}: zaya logits op shape {shape}, reference says [B,S,E+1]")
                elif family == "inkling":
                    if len(shape) != 2:
                        bad.append(f"{where}: logits op shape {shape}")
                elif shape != [rec["tokens"], e]:
                    bad.append(f"{where}: logits op shape {shape}, reference says [T, E] = [{rec['tokens']}, {e}]")
                if family not in REFERENCE_OUTPUT_QUIRK and not lt.get("op_matches_output0"):
                    if not (family == "kolibri1"):
                        bad.append(f"{where}: {lt['op']} does not equal router.output[0] ({lt.get('op_relations')})")
    return bad


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def probe(family: str) -> dict[str, Any]:
    """Everything recorded for one family. Never raises."""
    rec: dict[str, Any] = {"family": family, "ok": False}
    t0 = time.perf_counter()
    try:
        model = tiny_model(family)
        rec["model_class"] = type(model).__name__
        rec["config_class"] = type(model.config).__name__
        rec["default_experts_implementation"] = model.config._experts_implementation
        rec["reinitialised_zero_tensors"] = list(getattr(model, "_tiny_reinitialised", ()))
        inputs = tiny_inputs(model)
        rec["inputs"] = {k: list(v.shape) for k, v in inputs.items()}
        rec["tokens"] = int(inputs["input_ids"].numel())
        layers_path, layer_list = find_layers(model)
        rec["layers_path"] = layers_path
        layers = {i: describe_layer(layer, model) for i, layer in enumerate(layer_list)}
        rec["layers"] = layers
        rec["moe_layers"] = [i for i, l in layers.items() if l["kind"] == "moe"]
        rec["dense_layers"] = [i for i, l in layers.items() if l["kind"] == "dense"]
        try:
            hook_pass(model, layers_path, layers, inputs)
        except Exception as exc:  # noqa: BLE001 - recorded
            rec.setdefault("errors", []).append(f"hook pass: {type(exc).__name__}: {exc}")
        nm = nnsight.NNsight(model)
        listings: dict[str, str] = {}
        try:
            source_pass(nm, layers_path, layers, listings)
        except Exception as exc:  # noqa: BLE001 - recorded
            rec.setdefault("errors", []).append(f"source pass: {type(exc).__name__}: {exc}")
        rec["source_listings"] = {k: v.splitlines() for k, v in listings.items()}
        rec["trace"] = trace_pass(nm, family, layers_path, layers, inputs)
        rec["reference"] = _reference_summary(family)
        rec["reference_mismatches"] = check_reference(family, rec)
        rec["summary"] = family_summary(rec)
        checks = extra_checks(family)
        if checks:
            rec["extra_checks"] = checks
        rec["layers"] = _dedupe_layers(layers, layers_path)
        rec["ok"] = rec["trace"]["ok"] and not rec.get("errors")
    except Exception as exc:  # noqa: BLE001 - recorded
        rec.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
        rec["traceback"] = traceback.format_exc().splitlines()[-12:]
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


_VOLATILE = ("distinct_experts_selected",)


def _dedupe_layers(layers: dict[int, dict[str, Any]], layers_path: str) -> dict[int, dict[str, Any]]:
    """Replace a layer identical to an earlier one (up to its index and the data-dependent
    ``distinct_experts_selected``) by ``{"kind", "same_as", "distinct_experts_selected"}``."""

    def key(info: dict[str, Any], i: int) -> str:
        stripped = {
            **info,
            "blocks": [{k: v for k, v in b.items() if k not in _VOLATILE} for b in info.get("blocks", [])],
        }
        text = json.dumps(stripped, sort_keys=True, default=str)
        return text.replace(f"{layers_path}.{i}.", f"{layers_path}.<i>.")

    out: dict[int, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for i, info in layers.items():
        k = key(info, i)
        if k in seen:
            out[i] = {"kind": info["kind"], "same_as": seen[k]}
            if info.get("blocks"):
                out[i]["distinct_experts_selected"] = [b.get("distinct_experts_selected") for b in info["blocks"]]
        else:
            seen[k] = i
            out[i] = info
    return out


def _experts_index_shapes(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(hidden, indices) arguments of every decorated experts call in one forward."""
    seen: list[tuple[Any, Any]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.append((args[0], args[1])))
        for m in model.modules()
        if _is_decorated_experts(m)
    ]
    try:
        with torch.no_grad():
            model(**tiny_inputs(model))
    finally:
        for h in hooks:
            h.remove()
    return seen


def extra_checks(family: str) -> dict[str, Any]:
    """Family quirks the reference states that need a non-default config or a closer look."""
    out: dict[str, Any] = {}
    try:
        if family == "phimoe":
            model = tiny_model(family, num_experts_per_tok=4)
            calls = _experts_index_shapes(model)
            out["num_experts_per_tok=4"] = {
                "router.top_k": model.model.layers[0].mlp.router.top_k,
                "experts_indices": _describe_value(calls[0][1]),
                "note": "selection is hard-coded to 2 slots whatever router.top_k says",
            }
        elif family == "nemotron_h":
            model = tiny_model(family, moe_latent_size=16)
            calls = _experts_index_shapes(model)
            out["moe_latent_size=16"] = {
                "experts_hidden": _describe_value(calls[0][0]),
                "fc1_latent_proj": type(model.model.layers[1].mixer.fc1_latent_proj).__name__,
                "note": "experts run in the latent size (default None: fc1/fc2_latent_proj are Identity)",
            }
        elif family == "zaya":
            model = tiny_model(family)
            outs: list[Any] = []
            hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: outs.append(o)) for layer in model.model.layers]
            try:
                with torch.no_grad():
                    model(**tiny_inputs(model))
            finally:
                for h in hooks:
                    h.remove()
            skips = [int((o[1] == 0).sum()) for o in outs]
            out["skip_class"] = {
                "skipped_slots_per_layer (weight 0)": skips,
                "note": "skip slots come back as index 0 with weight 0",
            }
    except Exception as exc:  # noqa: BLE001 - recorded
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def family_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """The facts a family table needs, from the first MoE layer (and the first dense layer)."""
    out: dict[str, Any] = {
        "model_class": rec.get("model_class"),
        "layers_path": rec.get("layers_path"),
        "moe_layers": rec.get("moe_layers"),
        "dense_layers": rec.get("dense_layers"),
        "default_experts_implementation": rec.get("default_experts_implementation"),
    }
    layers = rec.get("layers", {})
    moe = [layers[i] for i in rec.get("moe_layers", [])]
    if moe:
        blocks = moe[0]["blocks"]
        b = blocks[0]
        router = b.get("router") or {}
        lt = b.get("logits_trace") or {}
        out.update(
            {
                "block_paths": [x["block_path"] for x in blocks],
                "block_class": b["block_class"],
                "block_children": b["block_children"],
                "block_call_order": b.get("call_order"),
                "block_output": b.get("block_output"),
                "router": f"{router.get('name')} -> {router.get('class')}",
                "router_children": router.get("children"),
                "router_input": b.get("router_inputs"),
                "router_output": b.get("router_output"),
                "router_to_experts": b.get("router_to_experts"),
                "top_k": router.get("top_k"),
                "top_k_from": router.get("top_k_from"),
                "logits_op": lt.get("op"),
                "logits_op_output": lt.get("op_output"),
                "logits_op_relations": lt.get("op_relations"),
                "logits_binding": lt.get("binding"),
                "logits_binding_relations": lt.get("binding_relations"),
                "experts": f"{b['experts']['name']} -> {b['experts']['class']}",
                "experts_decorated": b["experts"]["decorated"],
                "experts_flags": {k: v for k, v in b["experts"]["flags"].items() if k != "_is_expert_parallel"},
                "experts_params": b["experts"]["params"],
                "num_experts": b["experts"]["num_experts"],
                "distinct_experts_selected": b.get("distinct_experts_selected"),
                "experts_call": (b.get("experts_call") or {}).get("args"),
                "shared": [f"{s['on']}.{s['name']} -> {s['class']}" for s in b.get("shared", [])],
                "shared_position": b.get("shared_position"),
                "parallel_dense_mlp": [d["attr"] for d in b.get("parallel_dense_mlp", [])],
                "other_block_children": b.get("other_block_children"),
                "router_params_and_buffers": {
                    **router.get("params", {}),
                    **{f"{k} (buffer)": v for k, v in router.get("buffers", {}).items()},
                },
                "block_params_and_buffers": {
                    **b.get("block_params", {}),
                    **{f"{k} (buffer)": v for k, v in b.get("block_buffers", {}).items()},
                },
            }
        )
    dense = [layers[i] for i in rec.get("dense_layers", [])]
    if dense and dense[0].get("dense_mlp"):
        d = dense[0]["dense_mlp"][0]
        out["dense_mlp"] = f"{d['attr']} -> {d['class']} {d['children']}"
    return out


def _reference_summary(family: str) -> dict[str, Any] | None:
    ref = REFERENCE.get(family)
    if ref is None:
        return None
    return {
        "block_attr": ref[0],
        "router_attr": ref[1],
        "logits_op": ref[2],
        "binding": ref[3],
        "shared": ref[4],
        "shared_position": ref[5],
        "flags": REFERENCE_FLAGS.get(family, {}),
        "output_quirk": REFERENCE_OUTPUT_QUIRK.get(family),
    }


def summary_line(rec: dict[str, Any]) -> str:
    """One compact line for the console."""
    if "layers" not in rec:
        return f"{rec['family']:24s} FAIL {'; '.join(rec.get('errors', []))[:200]}"
    moe = [rec["layers"][i] for i in rec["moe_layers"]]
    block = moe[0]["blocks"][0] if moe else {}
    lt = block.get("logits_trace") or {}
    rel = lt.get("op_relations") or {}
    status = "ok" if rec["ok"] else "FAIL"
    return (
        f"{rec['family']:24s} {status:4s} {rec['model_class']:34s} {rec['layers_path']:26s} "
        f"moe={rec['moe_layers']} dense={rec['dense_layers']} "
        f"block={block.get('block_path')!r}:{block.get('block_class')} "
        f"router={(block.get('router') or {}).get('name')} k={(block.get('router') or {}).get('top_k')} "
        f"E={block.get('experts', {}).get('num_experts')} shared={[s['name'] for s in block.get('shared', [])]}"
        f"@{block.get('shared_position')} logits={lt.get('op')}:{lt.get('op_output')}"
        f"->{','.join(f'{k}:{v}' for k, v in rel.items()) or '-'} "
        f"mismatches={len(rec.get('reference_mismatches', []))} {rec['seconds']:.1f}s"
    )


def dump_json(obj: Any, indent: int = 0) -> str:
    """JSON with one key per line, but lists/dicts of scalars kept on one line (readable, diffable)."""

    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, float, bool))

    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        if all(scalar(v) for v in obj.values()) and len(json.dumps(obj, default=str)) <= 100:
            return json.dumps(obj, default=str)
        items = [f"{inner}{json.dumps(str(k))}: {dump_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]"
        flat = json.dumps(obj, default=str)
        if len(flat) <= 100 and all(scalar(v) or (isinstance(v, dict) and all(map(scalar, v.values()))) or (
            isinstance(v, list) and all(map(scalar, v))) for v in obj):
            return flat
        if all(scalar(v) for v in obj) and all(isinstance(v, str) for v in obj) and len(flat) > 100:
            return "[\n" + ",\n".join(inner + json.dumps(v) for v in obj) + "\n" + pad + "]"
        return "[\n" + ",\n".join(inner + dump_json(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, default=str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="families to probe (default: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the machine may be shared
    families = args.families or list(FAMILIES)
    records: dict[str, Any] = {}
    t0 = time.perf_counter()
    for family in families:
        rec = probe(family)
        records[family] = rec
        print(summary_line(rec), flush=True)
        for m in rec.get("reference_mismatches", []):
            print(f"    ! {m}", flush=True)
    errors = {f: r["reference_mismatches"] for f, r in records.items() if r.get("reference_mismatches")}
    front = ("family", "ok", "summary", "reference_mismatches", "errors")
    records = {f: {**{k: r[k] for k in front if k in r}, **{k: v for k, v in r.items() if k not in front}}
               for f, r in records.items()}
    doc = {
        "about": (
            "Structure of every tiny MoE family (moelens.testing.tiny_model, default experts implementation, "
            "batch 2 x seq 5 = 10 tokens, hidden 32, 8 experts, top-2) as seen by PyTorch hooks and nnsight; "
            "written by scripts/probe_families.py. Multimodal families are built as their text decoder only."
        ),
        "fields": {
            "summary": "the facts a family table needs, from the first MoE layer (and first dense layer)",
            "layers_path": "path of the decoder-layer ModuleList in the built model",
            "layers[i].kind": "'moe' (holds a decorated experts module, or llama4/dbrx experts), 'dense' (plain "
            "MLP), 'none' (no MLP, e.g. a nemotron_h attention layer); {'same_as': j} = identical to layer j "
            "except distinct_experts_selected (how many experts the 10 tokens were routed to)",
            "block_path": "MoE block relative to the decoder layer; '' = the layer itself (gemma4-style)",
            "shared[].on": "'block', 'layer' (sibling on the decoder layer) or the path of an enclosing module",
            "shared_position": "when the shared expert runs: 'first' (before the router), 'between' (router, "
            "shared, experts), 'after' (after the experts, inside the block), 'layer' (on the decoder layer, after "
            "the block), 'outer-before-block' (enclosing module, before the block)",
            "call_order": "order in which the block's children were first called (hooks)",
            "router_to_experts": "which router.output index is the experts' indices / weights argument",
            "logits_trace": "one nnsight trace: the logits op and its binding op of router.source, compared with "
            "router.output; relations: 'output[j]: equal' (torch.equal), 'close' (allclose 1e-6), "
            "'-after-reshape' (op.reshape(-1, last dim)), 'softmax->output[j]' (softmax of the op), "
            "'[..., :E]->output[j]' (first E columns)",
            "tensor descriptions": "'dtype[shape]'",
            "reference_mismatches": "statements of the reference notes that the probe found wrong for this family",
            "reference_corrections": "reference (or brief) statements found wrong while building the tiny models",
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "nnsight": getattr(nnsight, "__version__", "?"),
        },
        "logits_candidates": list(LOGITS_CANDIDATES),
        "unbuildable": UNBUILDABLE,
        "n_families": len(records),
        "n_ok": sum(1 for r in records.values() if r["ok"]),
        "seconds": round(time.perf_counter() - t0, 1),
        "reference_errors": errors,
        "reference_corrections": REFERENCE_CORRECTIONS,
        "source_listings": _GLOBAL_LISTINGS,
        "families": records,
    }
    if not args.families or args.out != DEFAULT_OUT:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dump_json(doc) + "\n")
        print(f"wrote {args.out}")
    print(f"{doc['n_ok']}/{doc['n_families']} ok in {doc['seconds']}s; "
          f"{sum(len(v) for v in errors.values())} reference mismatches in {len(errors)} families")
    return 0 if doc["n_ok"] == doc["n_families"] else 1


if __name__ == "__main__":
    sys.exit(main())
