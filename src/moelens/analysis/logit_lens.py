"""Logit lens on experts: the vocabulary each expert's output promotes.

For every expert, its weighted per-slot output (``moe.expert_outputs``) is
averaged over the tokens routed to it in a corpus: the expert's typical
contribution to the residual stream. That vector is read out like a final
hidden state, through the model's final norm and unembedding
(``lm_head(norm(v))``): the top tokens are what the expert pushes the next-token
prediction towards. With ``relative=True`` the layer's average contribution
(over all routed slots) is subtracted first, leaving what the expert promotes
*more than its layer does*.

Per-slot outputs exist inside the ``grouped_mm`` / ``batched_mm`` experts
implementations; under ``eager`` the `Moe` error says how to switch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import nnsight
import torch
from jaxtyping import Float, Int
from nnsight.intervention.source import STATE
from torch import Tensor

from ..errors import MoelensError
from ..families import registry
from ..families.entry import get_path
from ..families.tomoe import converted
from ..modules import evaluating, is_adapter_layer
from ..scalars import check_flag
from . import corpus as corpora
from .cache import layer_row
from .checks import check_count, expert_ids
from .collect import can_stop_early, counted_batches, moes_of, refusals_count_a_run, skipped_slots, skips
from .progress import CorpusProgress
from .text import token_strings

#: Names of a model's final norm, tried in order on its base model.
FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm", "layer_norm")


@dataclass
class ExpertLens:
    """What each expert's average output promotes through the unembedding.

    Attributes:
        layers: Decoder-layer indices (rows).
        counts: ``[L, E]`` tokens routed to each expert (what the mean is over).
        mean_outputs: ``[L, E, M]`` each expert's mean weighted output, in the model's hidden space (M: experts
            working in a latent space, nemotron_h's ``moe_latent_size``, mapped there by the block's projection).
        top_ids: ``[L, E, n]`` the most promoted token ids, best first.
        top_logits: ``[L, E, n]`` their logits (-inf for an expert no token reached: its ids mean nothing).
        tokens: ``tokens[l][e]``: the promoted tokens as printable strings; empty for an expert no token
            reached (and for the columns past a layer's own E).
        num_experts: E of each layer (rows); a layer of fewer experts than the widest has padding columns.
        relative: Whether the layer's mean contribution was subtracted first.
        norm: The final norm used (its module name), or None.
    """

    layers: list[int]
    counts: Int[Tensor, "l e"]
    mean_outputs: Float[Tensor, "l e m"]
    top_ids: Int[Tensor, "l e n"]
    top_logits: Float[Tensor, "l e n"]
    tokens: list[list[list[str]]]
    relative: bool
    norm: str | None
    num_experts: list[int]

    def __repr__(self) -> str:  # the default dumps every expert's promoted strings (L x E x n of them)
        top = self.top_ids.shape[-1] if self.top_ids.dim() == 3 else 0
        return (f"ExpertLens(layers {self.layers}, experts {self.num_experts}, top {top} tokens each, "
                f"relative={self.relative}, norm={self.norm!r}; .promoted(layer, expert) lists them)")

    def promoted(self, layer: int, expert: int) -> list[str]:
        """The tokens expert ``expert`` (an integer id) of decoder layer ``layer`` promotes, best first; empty
        when no token of the corpus reached it."""
        row = layer_row(self.layers, layer, "expert lens")
        (expert,) = expert_ids([expert], self.num_experts[row], self.layers[row])
        return self.tokens[row][expert]


def unembedding(model: Any) -> tuple[torch.nn.Module | None, str | None, torch.nn.Module]:
    """(final norm or None, its name, unembedding) of a wrapped model: the unembedding transformers' models name
    (``get_output_embeddings()``), else a plain torch model's ``lm_head`` Linear."""
    module = getattr(model, "_module", model)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None and isinstance(getattr(module, "lm_head", None), torch.nn.Linear):
        head = module.lm_head
    if head is None:
        raise MoelensError(
            f"{type(module).__name__} has no output embedding: the expert logit lens reads expert outputs out through "
            "the model's unembedding, found by get_output_embeddings() (transformers' *ForCausalLM classes) or as an "
            "lm_head Linear; load the *ForCausalLM class, or give a model of your own one of those."
        )
    family = getattr(model, "family", None)
    if family is None and module is model:  # a transformers model of its own: the family its model types name
        known = map(registry.for_model_type, registry.model_types(getattr(module, "config", None)))
        family = next((found for found in known if found is not None), None)
    names = ((family.final_norm,) if family is not None and family.final_norm else ()) + FINAL_NORMS
    for prefix, owner in _norm_owners(module):
        for name in names:
            norm = getattr(owner, name, None)
            if isinstance(norm, torch.nn.Module):
                return norm, prefix + name, head
    return None, None, head


def _norm_owners(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name prefix, module) of where a final norm may sit, nearest the head last: the text decoder
    (``get_decoder()``: ``model.language_model`` of a vision-language model), the base model, the model itself."""
    try:
        decoder = module.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = None
    base = getattr(module, getattr(module, "base_model_prefix", "model"), None)
    inner = getattr(module, "model", None)  # llama4's *ForCausalLM: base_model_prefix "language_model", its decoder itself
    owners = [owner for owner in dict.fromkeys((decoder, base, inner))
              if isinstance(owner, torch.nn.Module) and owner is not module]
    names = {owner: name for name, owner in module.named_modules() if owner in owners}
    return [(f"{names[owner]}.", owner) for owner in owners if owner in names] + [("", module)]


def _to_hidden(moe: Any, total: Float[Tensor, "e d"]) -> Float[Tensor, "e h"]:
    """Expert outputs in the model's hidden space: cut to the block's ``output_size`` (a converted Linear whose
    experts are padded square, as its forward cuts them: `moelens.compress` blocks only), and through the block's projection of the routed sum when
    the experts work in a latent space (nemotron_h's ``fc2_latent_proj``). Only its weight (under a PEFT adapter, the
    map the module runs, read off its outputs): its bias is added once per token to the routed sum, not per expert."""
    width = getattr(moe._module, "output_size", None)  # a converted Linear narrower than its input: square experts
    if converted(moe.family) and isinstance(width, int) and total.shape[-1] > width:  # whose columns past its output
        total = total[..., :width]  # are zero, cut by its forward
    post = moe.family.combine.routed_post
    if post is None or total.numel() == 0:
        return total
    projection = get_path(moe._module, post)
    if isinstance(projection, torch.nn.Identity):
        return total
    weight = getattr(projection, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != total.shape[-1]:
        raise MoelensError(
            f"{moe.path}: the experts' outputs ({total.shape[-1]} wide) reach the hidden state through "
            f"{post} ({type(projection).__name__}), which is not a linear map the logit lens can apply per expert."
        )
    if is_adapter_layer(projection):  # PEFT LoRA on it (a Linear, or a ParamWrapper on its weight): its .weight is
        # the base weight alone; the map the model runs is the module's own (base weight plus the active adapters'
        # product, none under disable_adapter()), read off its outputs on the unit vectors, bias taken out
        with torch.no_grad(), evaluating(projection):
            basis = torch.eye(total.shape[-1], device=weight.device, dtype=weight.dtype)
            mapped = projection(basis) - projection(torch.zeros_like(basis[:1]))
        return total @ mapped.to(total.device, torch.float64)
    return total @ weight.detach().to(total.device, torch.float64).T


def _sums(moes: list[Any], mask: Tensor) -> dict[int, tuple[Any, Any]]:
    """Inside a trace: per layer, the sum of each expert's weighted outputs over real tokens, and counts."""
    sums = {}
    for moe in moes:
        width = moe.num_experts
        indices = weights = None
        for name in moe.order():
            if name == "expert_weights" and skips(moe):
                weights = moe.expert_weights[mask].flatten()
            elif name == "expert_indices":
                indices = moe.expert_indices[mask].flatten()
            elif name == "expert_outputs":
                outputs = moe.expert_outputs[mask]
                flat = outputs.reshape(-1, outputs.shape[-1]).double()
                if weights is not None:  # slots of a skip class ran no expert
                    ran = ~skipped_slots(indices, weights)
                    indices, flat = indices[ran], flat[ran]
                total = flat.new_zeros(width, flat.shape[-1]).index_add_(0, indices, flat)
                sums[moe.layer] = (total, torch.bincount(indices, minlength=width))
    return nnsight.save(sums)


def readout(model: Any, hidden: Float[Tensor, "*tokens h"]) -> Float[Tensor, "*tokens v"]:
    """The logit lens of any hidden-size vectors: ``lm_head(norm(hidden))`` through the model's final norm and
    unembedding, found as `expert_logit_lens` finds them (its ``norm`` names the norm), in float32 whatever the
    model's dtype, the model left as it is. For one token's expert output (``moe.expert_outputs[b, s, slot]``), a
    routed or block output, or a direction, read out after a trace or inside one (there the trace stands down while
    the norm and unembedding run, as for nnsight's own ad-hoc module call: their places in the forward are untouched).
    What a model does to the head's output (cohere2_moe's ``logit_scale``, granitemoe's ``logits_scaling``, a final
    softcap) is not applied: the values are on the head's scale; the tokens rank as the model's logits rank them.

    Args:
        model: A wrapped model (or a transformers model) with an unembedding.
        hidden: ``[..., h]`` vectors of the model's hidden size.

    Returns:
        ``[..., v]`` float32 logits over the unembedding's rows (a padded vocabulary's padding rows included), on
        the unembedding's device.
    """
    norm, _, head = unembedding(model)
    hidden_size = getattr(head, "in_features", None) or head.weight.shape[-1]
    if not isinstance(hidden, Tensor) or hidden.dim() == 0 or hidden.shape[-1] != hidden_size:
        given = f"a tensor of shape {list(hidden.shape)}" if isinstance(hidden, Tensor) else type(hidden).__name__
        raise MoelensError(f"readout: hidden must be a tensor of {hidden_size}-wide vectors (the hidden size the "
                           f"unembedding reads: shape [..., {hidden_size}]), got {given}.")
    if not hidden.is_floating_point():
        raise MoelensError(f"readout: hidden must hold floating-point vectors, got {hidden.dtype}.")
    with _traces_stood_down(model, (norm, head)):
        return _read_out(head, _read_out(norm, hidden) if norm is not None else hidden)


@contextmanager
def _traces_stood_down(model: Any, modules: tuple[torch.nn.Module | None, ...]) -> Iterator[None]:
    """Run the block with every trace of ``model``, or of any model holding ``modules`` (a transformers model given
    beside its wrapper: nnsight's state on each module it instruments names the trace running it), stood down, as
    nnsight's ``Envoy.__call__`` stands its trace down for a module called ad hoc: the calls feed no value and spend
    no occurrence (a later ``lm_head.output`` read would have failed, "already ran past it")."""
    running = [getattr(model, "interleaver", None)]
    for module in modules:
        state = vars(module).get(STATE) if module is not None else None
        running.append(state.active()[0] if state is not None else None)
    stood_down = list({id(interleaver): interleaver for interleaver in running
                       if getattr(interleaver, "interleaving", False)}.values())
    for interleaver in stood_down:
        interleaver.interleaving = False
    try:
        yield
    finally:
        for interleaver in stood_down:
            interleaver.interleaving = True


def _read_out(module: torch.nn.Module, inputs: Tensor) -> Tensor:
    """``module(inputs)`` in float32, with float32 copies of its floating-point weights (the module is left as it is):
    the lens reads E vectors per layer, and a bfloat16 readout rounds their logits to ~3 digits, where near tokens
    tie. A module accelerate offloaded (its weights on the meta device until its hook loads them) runs as it is."""
    tensors = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
    if any(tensor.is_meta for tensor in tensors.values()):
        dtype = next((tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()), inputs.dtype)
        return module(inputs.to(dtype)).float()
    device = next(iter(tensors.values())).device if tensors else inputs.device
    weights = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
    return torch.func.functional_call(module, weights, (inputs.to(device=device, dtype=torch.float32),)).float()


def expert_logit_lens(
    model: Any,
    corpus: Any,
    *,
    layers: list[int] | None = None,
    blocks: str | list[str] | None = None,
    top: int = 10,
    relative: bool = False,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> ExpertLens:
    """Average every expert's output over ``corpus`` and read the tokens it promotes.

    Args:
        model: A wrapped causal LM (`moelens.load` / `moelens.wrap`).
        corpus: Texts or token ids (as for `collect_routing`).
        layers: Decoder-layer indices of the MoE layers (default: all).
        blocks: Only blocks whose path contains this (several MoE blocks per layer).
        top: Tokens per expert (at least 1).
        relative: Subtract the layer's mean contribution before reading out.
        batch_size: Windows per forward.
        max_length: Window length (default: the model's context, at most 512).
        progress: Show a tqdm progress bar.
    """
    with refusals_count_a_run(model):
        top = check_count("top", top)
        relative, progress = check_flag("relative", relative), check_flag("progress", progress)
        moes = moes_of(model, layers, blocks)
        for moe in moes:
            if "expert_outputs" not in moe.order():
                raise moe.no_mixture("expert_outputs")
        norm, norm_name, head = unembedding(model)
        sums = {moe.layer: torch.zeros(moe.num_experts, 0, dtype=torch.float64) for moe in moes}
        counts = {moe.layer: torch.zeros(moe.num_experts, dtype=torch.int64) for moe in moes}
        stream = corpora.batches(corpus, corpora.tokenizer_of(model), batch_size=batch_size,
                                 max_length=corpora.window_length(model, max_length),
                                 pad=corpora.pad_id(model), vocab=corpora.vocab_size(model))
    bar = CorpusProgress(corpus, "expert outputs", progress)
    with evaluating(model._module), closing(bar):  # the pass in eval mode: no dropout, no router jitter
        for batch in counted_batches(model, stream):
            with torch.no_grad(), model.trace(**batch.kwargs()) as tracer:
                read = _sums(moes, batch.mask)
                if can_stop_early(model):
                    tracer.stop()
            for layer, (total, count) in read.items():  # summed where the model runs, kept on the CPU
                total, count = total.cpu(), count.cpu()
                sums[layer] = total if sums[layer].numel() == 0 else sums[layer] + total
                counts[layer] += count
            bar.advance(batch)
        bar.finish()
    if all(count.sum() == 0 for count in counts.values()):
        raise MoelensError("the corpus has no tokens: every item was empty (an empty text or no token ids); pass "
                           "texts or token ids with content.")
    hidden_size = getattr(head, "in_features", None) or head.weight.shape[-1]
    for moe in moes:
        sums[moe.layer] = _to_hidden(moe, sums[moe.layer])
        if sums[moe.layer].numel() and sums[moe.layer].shape[-1] != hidden_size:
            raise MoelensError(
                f"{moe.path}: its experts' outputs are {sums[moe.layer].shape[-1]} wide, and the unembedding reads "
                f"{hidden_size}-wide hidden states: they are not added to the residual stream (such as a converted "
                "up-projection: c_fc, up_proj), so the lens cannot read them out; choose the blocks whose outputs are "
                "(blocks=..., layers=...)."
            )
    layer_ids = [moe.layer for moe in moes]
    width = max(moe.num_experts for moe in moes)
    dim = next(total.shape[-1] for total in sums.values() if total.numel())
    means = torch.zeros(len(layer_ids), width, dim, dtype=torch.float64)
    count_rows = torch.zeros(len(layer_ids), width, dtype=torch.int64)
    for row, layer in enumerate(layer_ids):
        used = sums[layer].shape[0]
        count_rows[row, :used] = counts[layer]
        means[row, :used] = sums[layer] / counts[layer].clamp(min=1)[:, None]
    readout = means.clone()
    if relative:
        layer_mean = (means * count_rows[..., None]).sum(1) / count_rows.sum(1).clamp(min=1)[:, None]
        readout = means - layer_mean[:, None, :]
    with torch.no_grad():
        hidden = readout.float()
        logits = _read_out(head, _read_out(norm, hidden) if norm is not None else hidden).cpu()
    logits = logits[..., : corpora.vocab_size(model) or logits.shape[-1]]  # the tokens the model can output
    logits[count_rows == 0] = float("-inf")
    top_logits, top_ids = logits.topk(min(top, logits.shape[-1]), dim=-1)
    tokenizer = corpora.tokenizer_of(model)
    tokens = [[token_strings(tokenizer, top_ids[row, expert].tolist()) if count_rows[row, expert] else []
               for expert in range(width)] for row in range(len(layer_ids))]
    return ExpertLens(layers=layer_ids, counts=count_rows, mean_outputs=means.float(), top_ids=top_ids,
                      top_logits=top_logits, tokens=tokens, relative=relative, norm=norm_name,
                      num_experts=[moe.num_experts for moe in moes])
