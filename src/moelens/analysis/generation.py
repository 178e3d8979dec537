"""`collect_generation`: generate from prompts and cache the routing of every token the model read.

One ``model.generate`` trace reads, at every step (``tracer.all()``), the routing values of every MoE
block (`MoeModelMixin.save_all`): the prompt's forward first, then one forward per new token. The
steps are put back together row by row, so the result is a `RoutingCache` like `collect_routing`'s,
which every analysis reads: each prompt is a text of the cache, holding its own tokens and then the
tokens it generated, each routed as the model routed it while generating (with its key-value cache,
not by a fresh forward over the finished text).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import nnsight
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..components import Moe
from ..errors import MoelensError, OrderError
from ..modules import evaluating
from ..scalars import check_flag
from ..wrapping.generation import generation_setting, rows_per_prompt
from . import corpus as corpora
from .cache import RoutingCache, Shard
from .checks import check_count, check_intervene, refuse_set
from .token_view import TokenRouting, routing_of_text
from .collect import (
    check_storage_dtype, empty_cache, index_dtype_of, moes_of, real_tokens, refusals_count_a_run, routing_values,
    skipping_layers,
)

#: nnsight's warning at the end of a ``tracer.all()`` loop, which asks for one step past the last.
OPEN_LOOP_WARNING = r".*was never reached"

#: ``generate`` settings whose runs a generation's routing cannot be told from: why, and what to do instead.
REFUSED_SETTINGS = {
    "stop_strings": "ends rows without an end-of-sequence token, so where a row ended cannot be told from its tokens",
    "stopping_criteria": "may end rows without an end-of-sequence token, so where a row ended cannot be told from its "
                         "tokens",
    "assistant_model": "runs a draft model and checks several tokens per forward, rejected drafts included",
    "prompt_lookup_num_tokens": "checks several drafted tokens per forward, rejected drafts included",
    "assistant_early_exit": "runs the model's first layers alone on drafted tokens, rejected drafts included",
}


@dataclass
class GeneratedRouting:
    """A generation and the routing of every token the model read while generating it.

    Attributes:
        ids: ``[b, P + G]`` the token ids ``model.generate`` returns: the prompts, left-padded to the longest
            (``P`` columns), then the ``G`` tokens generated for each (a row that ended before the others is
            padded after its end-of-sequence token, as transformers pads it).
        prompt_length: ``P``, the columns of ``ids`` that hold the prompts.
        lengths: ``[b]`` how many tokens each row generated, its end-of-sequence token included.
        cache: The routing, a `RoutingCache` whose text ``i`` is prompt ``i``: its tokens at positions
            ``0 .. p - 1``, then every generated token the model read (``generated(i)[j]`` at position ``p + j``,
            ``p`` its ``prompt_lengths[i]``). The last token a
            row generated is read by no forward, so it has no routing; nor have the padding of a prompt and
            the steps after a row ended (the other rows still generating).
        prompt_lengths: ``[b]`` ``p``, the tokens of each row's own prompt, without its padding (row ``i`` is
            left-padded by ``prompt_length - prompt_lengths[i]``).
    """

    ids: Int[Tensor, "b t"]
    prompt_length: int
    lengths: Int[Tensor, " b"]
    cache: RoutingCache
    prompt_lengths: Int[Tensor, " b"]

    def generated(self, row: int) -> Int[Tensor, " g"]:
        """The tokens row ``row`` generated, up to its end-of-sequence token (included), without padding."""
        row = self._row(row)
        return self.ids[row, self.prompt_length : self.prompt_length + int(self.lengths[row])]

    def token_routing(self, row: int) -> TokenRouting:
        """The per-token expert view of row ``row``: its prompt and the generated tokens the model read
        (``.table()`` prints it)."""
        return routing_of_text(self.cache, self._row(row), self.cache.tokenizer)

    def _row(self, row: Any) -> int:
        """``row`` as a row index, refusing a row the generation does not have."""
        rows = self.ids.shape[0]
        index = check_count("row", row, least=0)
        if index >= rows:
            raise MoelensError(f"row must be below the generation's {rows} rows (one per prompt), got {row!r}.")
        return index


class _Received:
    """A transformers streamer keeping what ``generate`` hands it (the prompt ids, then each step's new token of
    every row), and passing it on to the caller's own streamer."""

    def __init__(self, passed_to: Any) -> None:
        self.chunks: list[Tensor] = []
        self.passed_to = passed_to

    def put(self, value: Tensor) -> None:
        self.chunks.append(value.detach().to("cpu").clone())
        if self.passed_to is not None:
            self.passed_to.put(value)

    def end(self) -> None:
        if self.passed_to is not None:
            self.passed_to.end()


def collect_generation(
    model: Any,
    prompts: Any,
    *,
    max_new_tokens: int,
    logits: bool = False,
    layers: Iterable[int] | None = None,
    blocks: str | Iterable[str] | None = None,
    dtype: torch.dtype = torch.float32,
    intervene: Callable[[Moe], None] | None = None,
    **generate_kwargs: Any,
) -> GeneratedRouting:
    """Generate from ``prompts`` and return the generated ids with the routing of every token the model read.

    Args:
        model: A model from `moelens.wrap` / `moelens.load` that can generate.
        prompts: One prompt or a list of them, each a text (tokenized as `collect_routing` tokenizes, without
            special tokens: give token ids for a BOS token or a chat template) or a sequence of token ids.
            They are left-padded to one batch.
        max_new_tokens: How many tokens to generate at most (fewer where every row ends first).
        logits: Also cache router logits (``RoutingCache.probs`` and the router entropy need them).
        layers: Decoder-layer indices of the MoE layers to cache (default: all).
        blocks: Only blocks whose path contains this (models with several MoE blocks per layer).
        dtype: Storage dtype of weights and logits.
        intervene: Called with each MoE block (every one the model runs on every token, cached or not, in model order)
            at every step, before the block's routing is read, to intervene there
            (``lambda moe: moelens.steer(moe, 3, 4.0) if moe.layer == 1 else None``): the generation runs with the
            interventions, and the cache holds the routing as the experts got it (an expert ablated with ``"zero"``
            at weight 0, a swap's new expert). On a cached block a read or write of a value the block makes after
            its routing (its output, ``expert_outputs``), and with ``logits`` one that writes the weights or indices
            (ablate ``"zero"`` / ``"swap"``, reroute, keep_top), is refused: the routing is read after it.
        generate_kwargs: Passed on to ``model.generate`` (``do_sample``, ``temperature``, ``eos_token_id``,
            ``min_new_tokens``, a ``streamer`` ...). Beam search, several sequences per prompt, stop strings,
            stopping criteria and assisted generation are refused: their routing cannot be told apart per row.

    Returns:
        The `GeneratedRouting`: ``ids`` as ``model.generate`` returns them and the routing ``cache``.
    """
    with refusals_count_a_run(model):  # under expert parallelism, a refusal on some ranks only counts a run there
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        logits = check_flag("logits", logits)
        check_storage_dtype(dtype)
        check_intervene(intervene)
        moes = moes_of(model, layers, blocks)
        _refuse_settings(model._module, generate_kwargs)
        if model._ep_runs() and _setting(model._module, generate_kwargs, "prefill_chunk_size"):
            raise MoelensError(
                "collect_generation cannot take prefill_chunk_size on a model whose experts are sharded over ranks: "
                "each rank runs one forward per chunk of its own prompts, so ranks whose prompts differ in length part "
                "from the first forward (every rank then waits in an exchange the others never reach). Leave it out."
            )
        ids, mask = _prompt_batch(model, prompts, max_new_tokens)
    synced = _synced_gpus(model._module, generate_kwargs)
    wanted = routing_values(logits)
    received = _Received(generate_kwargs.pop("streamer", None))
    if generate_kwargs.get("generation_config") is not None:  # a keyword beside it makes transformers warn
        generate_kwargs["generation_config"] = copy.deepcopy(generate_kwargs["generation_config"])
        generate_kwargs["generation_config"].max_new_tokens = max_new_tokens
    else:
        generate_kwargs["max_new_tokens"] = max_new_tokens
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OPEN_LOOP_WARNING)  # a tracer.all() loop ends with it
        with torch.no_grad(), evaluating(model._module), model.generate(input_ids=ids, attention_mask=mask,
                                             streamer=received, **generate_kwargs) as tracer:
            steps = list().save()
            for _ in tracer.all():
                steps.append(model.save_all(wanted, strict=True, moes=moes) if intervene is None else
                             _intervened_step(model, moes, wanted, intervene))
    new = torch.stack(received.chunks[1:], dim=1) if len(received.chunks) > 1 else ids.new_zeros(len(ids), 0)
    steps = _new_tokens_of(steps, ids.shape, new.shape[1], synced)
    lengths = _lengths(new, _setting(model._module, generate_kwargs, "eos_token_id"))
    read = torch.cat([mask.bool(), torch.arange(1, new.shape[1]) < lengths[:, None]], dim=1)  # [b, P + G - 1]
    values = {layer: {name: torch.cat([step[layer][name] for step in steps], dim=1) for name in wanted}
              for layer in steps[0]}
    device = values[moes[0].layer]["expert_indices"].device
    routing = real_tokens(values, read.to(device), index_dtype_of(moes), dtype, skipping_layers(moes))
    cache = empty_cache(model, moes, logits)
    cache.num_texts = len(ids)
    cache._memory = [Shard(
        token_ids=torch.cat([ids, new[:, :-1]], dim=1)[read].to(torch.int32),
        text_index=torch.arange(len(ids)).repeat_interleave(read.sum(1)).to(torch.int32),
        position=(read.cumsum(1) - 1)[read].to(torch.int32),
        indices=routing["indices"],
        weights=routing["weights"],
        logits=routing["logits"],
    )]
    return GeneratedRouting(ids=torch.cat([ids, new], dim=1), prompt_length=ids.shape[1], lengths=lengths,
                            prompt_lengths=mask.sum(1).long(), cache=cache)


def _intervened_step(model: Any, moes: list[Moe], wanted: list[str], intervene: Callable[[Moe], None]
                     ) -> dict[int | str, dict[str, Tensor]]:
    """Inside a generation step: ``intervene(block)`` on every MoE block the model runs on every token, each before the
    routing of ``moes`` among them is read; keyed by layer, as ``model.save_all`` keys them (`moes_of` gives one
    block per layer)."""
    cached = {moe.path for moe in moes}
    saved = {}
    for moe in model.moes:
        if not isinstance(moe, Moe) or (moe.runs_only_on and moe.path not in cached):
            continue
        intervene(moe)
        if moe.path not in cached:
            continue
        try:
            saved[moe.layer] = moe.save_all(wanted, strict=True)
        except OrderError as error:
            name = getattr(error, "unreached", None)
            if name is None:
                raise
            logits = "router_logits" in wanted
            raise MoelensError(
                f"collect_generation(intervene=...): {moe.path}'s {name} could not be read after intervene(block) ran "
                f"on it: the intervention read or wrote a value the block makes after {name} ("
                + ("the weights or indices: ablate 'zero' or 'swap', reroute, keep_top; " if logits else "")
                + "its output, expert_outputs, routed_output). On a block whose routing is cached, intervene on the "
                "routing (steer, force, ablate(..., 'route_around')" + (")" if logits else
                ", or the weights and indices: ablate 'zero' or 'swap', reroute, keep_top)")
                + (", or leave logits=True out" if logits else "")
                + "; or cache other layers (layers=) and intervene on this one."
            ) from None
    return nnsight.save(saved)


def _refuse_settings(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse ``generate`` arguments whose routing `collect_generation` could not tell apart per row and step."""
    given = sorted({"input_ids", "attention_mask", "inputs_embeds"} & set(kwargs))
    if given:
        raise MoelensError(f"collect_generation takes the prompts as its prompts argument, got {', '.join(given)} too; "
                           "pass the token ids as prompts (one sequence per prompt, without padding).")
    rows = rows_per_prompt(module, kwargs)
    if rows > 1:
        raise MoelensError(
            f"collect_generation runs one row per prompt, and these settings run {rows} (num_beams="
            f"{generation_setting(module, kwargs, 'num_beams') or 1}, num_return_sequences="
            f"{generation_setting(module, kwargs, 'num_return_sequences') or 1}): beam search reorders its rows between "
            "steps, so a step's routing belongs to no one sequence. Generate without beams; to sample a prompt several "
            "times, repeat it in the list of prompts (each is a text of the cache)."
        )
    for name, why in REFUSED_SETTINGS.items():
        if _setting(module, kwargs, name):
            raise MoelensError(
                f"collect_generation cannot take {name}: it {why}. Generate with model.generate(...) and read the "
                "routing in a `for step in tracer.all():` loop instead (docs/values.md, generation)."
            )


def _setting(module: torch.nn.Module, kwargs: dict[str, Any], name: str) -> Any:
    """`generation_setting`, except that a keyword given as None counts: transformers sets the generation config's
    value to None then (``eos_token_id=None``: no row ends early), where a config's None takes the model's."""
    return kwargs[name] if name in kwargs else generation_setting(module, kwargs, name)


def _synced_gpus(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether ``generate`` runs with ``synced_gpus``: as given, or, where not given (None), as transformers turns it
    on itself (DeepSpeed ZeRO-3 or FSDP in a world of several processes)."""
    given = kwargs.get("synced_gpus")
    if given is not None:
        return bool(given)
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.distributed.utils import _get_torch_distributed_world_size
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # another transformers: it may not turn it on itself
        return False
    return bool((is_deepspeed_zero3_enabled() or is_fsdp_managed_module(module)) and _get_torch_distributed_world_size() > 1)


def _prompt_batch(model: Any, prompts: Any, max_new_tokens: int) -> tuple[Int[Tensor, "b p"], Int[Tensor, "b p"]]:
    """The prompts as left-padded ``input_ids`` and ``attention_mask`` (each refused if empty, holding an id the
    model does not embed, or too long for the model's context with ``max_new_tokens`` more)."""
    refuse_set("prompts", prompts, "the rows of the generation and the texts of its cache")
    tokenizer = corpora.tokenizer_of(model)
    items = list(corpora.items(prompts, "prompts"))
    if not items:
        raise MoelensError("collect_generation got no prompts; pass a text, token ids or a list of them.")
    named = (lambda index: "the prompt") if len(items) == 1 else (lambda index: f"prompt {index}")
    rows = [corpora.encode(item, tokenizer, named(index)) for index, item in enumerate(items)]
    vocab, limit = corpora.vocab_size(model), corpora.context_length(model)
    for index, row in enumerate(rows):
        if not row:
            raise MoelensError(f"{named(index)} has no tokens (the tokenizer made none of it); give "
                               f"{'it' if len(rows) == 1 else 'every prompt'} at least one.")
        outside = [token for token in row if not 0 <= token < (vocab if vocab is not None else token + 1)]
        if outside:
            raise MoelensError(f"{named(index)} holds token id {outside[0]}, outside the model's vocabulary "
                               f"[0, {vocab}); pass ids from the model's own tokenizer.")
        if limit is not None and len(row) + max_new_tokens > limit:
            raise MoelensError(
                f"{named(index)} has {len(row)} token{'s' * (len(row) != 1)}, and with max_new_tokens={max_new_tokens} "
                f"the generation would run past the model's context (max_position_embeddings={limit}); shorten it or "
                "generate fewer tokens."
            )
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), corpora.pad_id(model), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = torch.tensor(row)
        mask[index, width - len(row):] = 1
    return ids, mask


def _prefill_forwards(shapes: list[tuple[int, int]], width: int) -> int:
    """How many of the forwards (their ``[rows, tokens]`` ``shapes``) ran over the prompts, ``width`` tokens: 1, or
    one per chunk with ``prefill_chunk_size``."""
    total = 0
    for index, (_, tokens) in enumerate(shapes):
        total += tokens
        if total >= width:
            return index + 1
    return len(shapes)


def _new_tokens_of(steps: list[dict[int, dict[str, Tensor]]], prompt_shape: torch.Size, generated: int,
                   synced: bool) -> list[dict[int, dict[str, Tensor]]]:
    """Each step's values at the tokens it read first: the prompts at step 0 (put back together where they ran in
    chunks), then the one new token of every row (without a key-value cache, ``use_cache=False``, a step runs the
    whole sequence again: its last token is the new one). ``synced``: under ``synced_gpus`` the forwards after this
    rank's rows ended, run until every rank's had, read no token and are left out. A run of other shapes is refused
    (settings `_refuse_settings` does not know of, such as a generation config's own drafting)."""
    rows, width = prompt_shape
    shapes = [tuple(next(iter(next(iter(step.values())).values())).shape[:2]) for step in steps]
    chunks = _prefill_forwards(shapes, width)
    if synced:
        steps, shapes = steps[:chunks + generated - 1], shapes[:chunks + generated - 1]
    if chunks > 1 and all(shape[0] == rows for shape in shapes[:chunks]) and sum(
            shape[1] for shape in shapes[:chunks]) == width:
        steps = [{layer: {name: torch.cat([step[layer][name] for step in steps[:chunks]], dim=1) for name in values}
                  for layer, values in steps[0].items()}] + steps[chunks:]
        shapes = [(rows, width)] + shapes[chunks:]
    if len(shapes) != generated or shapes[0] != (rows, width) or any(
            shape not in ((rows, 1), (rows, width + step)) for step, shape in enumerate(shapes[1:], start=1)):
        raise MoelensError(
            f"the generation ran forwards over {shapes[:6]}{' ...' if len(shapes) > 6 else ''} [rows, tokens], where "
            f"collect_generation reads one over the prompts, {(rows, width)}, and then one new token per row per step "
            f"({generated} steps in all): a setting of this generation (beams, drafts) runs other rows or tokens. "
            "Generate with model.generate(...) and read the routing in a `for step in tracer.all():` loop instead."
        )
    return steps[:1] + [{layer: {name: value[:, -1:] for name, value in values.items()} for layer, values in step.items()}
                        for step in steps[1:]]


def _lengths(new: Int[Tensor, "b g"], eos: Any) -> Int[Tensor, " b"]:
    """How many tokens each row generated up to its first end-of-sequence token (``eos``: one id, a list of ids or
    None), that token included: ``g`` for a row that never generated one."""
    ended: Bool[Tensor, "b g"] = torch.isin(new, torch.as_tensor([] if eos is None else eos).flatten().to(new.dtype))
    first = torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1])
    return first.to(torch.long)
