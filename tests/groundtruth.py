"""Ground truth for the core tests, independent of moelens' machinery.

Values come from plain nnsight (a module cache on an unwrapped copy of the model)
and from recomputing experts from their weights; nothing here goes through
moelens' token views, bindings or family ops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache

import nnsight
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import moelens
from moelens.testing import EXPERTS_IMPLEMENTATIONS, FAMILIES, tiny_config, tiny_inputs, tiny_model

#: Where a family's router returns its logits, when not at output[0].
ROUTER_LOGITS = {
    "llama4": lambda output: output[1],
    "dbrx": lambda output: output,
}
#: Families whose router returns probabilities: the logits are this router child's output.
LOGITS_CHILD = {"gemma4": "proj", "diffusion_gemma": "proj"}
#: Families whose router returns fewer logit columns than moelens serves (the
#: extra columns are documented): compare the first E columns.
EXTRA_LOGIT_COLUMNS = {"inkling"}

#: Families whose slot order or routing makes "every token picks the biased expert" not hold.
HASH_ROUTED = {"deepseek_v4"}  # hash layers pick experts from a token table


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII (ids 32..126), pad 0, for vocab-128 models."""
    vocab = {chr(code): code for code in range(32, 127)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@lru_cache(maxsize=None)
def indexer_fields(family: str) -> frozenset[str]:
    """The sparse-attention indexer fields set in ``family``'s tiny (text) config: transformers sizes its
    ``*Indexer`` modules with config fields named ``index_*`` / ``indexer_*`` (``index_topk``: the
    DeepSeek-style top-k over tokens)."""
    config = tiny_config(family).get_text_config()
    return frozenset(name for name, value in vars(config).items() if name.startswith("index") and value is not None)


CASES = [(family, impl) for family in FAMILIES for impl in EXPERTS_IMPLEMENTATIONS[family]]
IDS = [f"{family}-{impl}" for family, impl in CASES]


@lru_cache(maxsize=8)
def built(family: str, impl: str):
    """(hf model, wrapped model, inputs, plain output) for one case, built once per process."""
    hf = tiny_model(family, experts_implementation=impl)
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = first_tensor(hf(**inputs))
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    return hf, wrapped, inputs, plain, reference


def zero_compute_experts(hf) -> int:
    """How many zero-compute experts (input times weight, no weights) the model's config gives each block
    (longcat_flash's ``zero_expert_num``): no experts implementation runs their slots, so no per-slot values."""
    return hf.config.to_dict().get("zero_expert_num") or 0


def first_tensor(output) -> torch.Tensor:
    """The logits (or last hidden state) of a model output."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return output[0]


@dataclass
class Raw:
    """Module-level values of one MoE block from a plain nnsight cache.

    ``routing``: ``(hidden, indices, weights)`` as the router chose them: the experts call's arguments, or, where
    the block changes the choice before that call (longcat_flash from transformers 5.25 hands its zero-compute
    slots to other experts), the router's output. ``routed_output``: the experts' output, or the block's where the
    block adds to it (the zero-compute experts' share).
    """

    router_output: object
    experts_args: tuple
    experts_output: torch.Tensor
    block_output: object
    block_input: torch.Tensor
    logits: torch.Tensor
    routing: tuple | None = None
    routed_output: torch.Tensor | None = None


def raw_values(reference: torch.nn.Module, inputs: dict, block_names: list[str], family) -> dict[str, Raw]:
    """Plain-nnsight cache of every block's router, experts, shared expert and output."""
    plain = nnsight.NNsight(reference)
    paths = {}
    for name in block_names:
        paths[name] = {
            "block": name,
            "router": f"{name}.{family.router}",
            "experts": f"{name}.{family.experts}",
        }
        if family.name in LOGITS_CHILD:
            paths[name]["logits"] = f"{name}.{family.router}.{LOGITS_CHILD[family.name]}"
    modules = [f"model.{path}" for entry in paths.values() for path in entry.values()]
    with plain.trace(**inputs) as tracer:
        cache = tracer.cache(modules=modules, include_inputs=True, device=None)  # on the model's device
    result = {}
    for name, entry in paths.items():
        router = cache[f"model.{entry['router']}"]
        experts = cache[f"model.{entry['experts']}"]
        block = cache[f"model.{entry['block']}"]
        if "logits" in entry:
            logits = cache[f"model.{entry['logits']}"].output
        else:
            logits = ROUTER_LOGITS.get(family.name, lambda output: output[0])(router.output)
        experts_args = experts.inputs[0] if experts.inputs is not None else None
        routing = experts_args[:3] if experts_args is not None else None
        if family.routing_from_router is not None:  # the block changes the router's choice before its experts call
            weights, indices = (router.output[position] for position in family.routing_from_router)
            routing = (experts_args[0], indices, weights)
        result[name] = Raw(
            router_output=router.output,
            experts_args=experts_args,
            experts_output=experts.output,
            block_output=block.output,
            block_input=block.inputs[0][0],
            logits=logits,
            routing=routing,
            routed_output=block.output if family.routed_from_block else experts.output,
        )
    return result


def expert_forward(experts: torch.nn.Module, hidden: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's (activations, output) on rows ``hidden``, from the module's weights.

    Follows the layout flags transformers' decorator stamps on the experts module
    (gated or not, transposed, biases, post-expert norm) and the module's own
    activation / gate function.
    """
    gated = getattr(experts, "has_gate", True)
    transposed = getattr(experts, "is_transposed", False)
    up = expert_up(experts, hidden, expert)
    activations = experts._apply_gate(up) if gated else experts.act_fn(up)
    down = experts.down_proj[expert]
    out = activations @ down if transposed else activations @ down.T
    if getattr(experts, "has_bias", False):
        out = out + experts.down_proj_bias[expert]
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return activations, out


def expert_up(experts: torch.nn.Module, hidden: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert's up projection on rows ``hidden`` (gate and up where gated, in the weights' layout), from the
    module's weights: the input of its gate / activation."""
    gated = getattr(experts, "has_gate", True)
    up_weight = (experts.gate_up_proj if gated else experts.up_proj)[expert]
    up = hidden @ up_weight if getattr(experts, "is_transposed", False) else hidden @ up_weight.T
    if getattr(experts, "has_bias", False):
        up = up + (experts.gate_up_proj_bias if gated else experts.up_proj_bias)[expert]
    return up


def pre_activations_by_hand(experts: torch.nn.Module, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per-slot up projections [T, k, P] recomputed from weights."""
    return torch.stack([torch.stack([expert_up(experts, hidden[token : token + 1], int(expert))[0]
                                     for expert in row]) for token, row in enumerate(indices)])


def slots_by_hand(
    experts: torch.nn.Module, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot activations [T, k, I] and weighted outputs [T, k, D] recomputed from weights."""
    tokens, k = indices.shape
    activations, outputs = [], []
    for token in range(tokens):
        row_act, row_out = [], []
        for slot in range(k):
            act, out = expert_forward(experts, hidden[token : token + 1], int(indices[token, slot]))
            row_act.append(act[0])
            row_out.append(out[0] * weights[token, slot].to(out.dtype))
        activations.append(torch.stack(row_act))
        outputs.append(torch.stack(row_out))
    return torch.stack(activations), torch.stack(outputs)
