"""`collect_routing`: run a corpus through a wrapped model and cache its routing.

For every batch one nnsight trace reads, block by block in the order the model
produces them (``moe.order()``), the moelens values ``router_logits`` (when asked),
``expert_weights`` and ``expert_indices`` of every MoE layer, keeps the real
tokens only (the attention mask drops the padding) and stops the forward after
the last MoE layer (the unembedding is not needed for routing). Works for every
family moelens serves: nothing here knows one.
"""

from __future__ import annotations

from contextlib import closing, contextmanager
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from nnsight import Envoy

from ..components.base import refuse_replaced, replaced_blocks
from ..errors import MoelensError, warn
from ..families.unserved import why_no_moe
from ..model import check_wrapped
from ..modules import evaluating
from ..scalars import as_lone_int, check_flag
from . import corpus as corpora
from .cache import SKIPPED, RoutingCache, Shard, ShardWriter
from .checks import check_count, id_list, refuse_set, shown, split_ids
from .progress import CorpusProgress

#: Default number of tokens per cache shard (a shard is the unit held in memory).
SHARD_TOKENS = 65_536

#: The values a routing cache reads.
ROUTING_VALUES = ("router_logits", "expert_weights", "expert_indices")


def moes_of(model: Any, layers: Iterable[int] | None = None, blocks: str | Iterable[str] | None = None) -> list[Any]:
    """The model's MoE components to analyse, one per decoder layer, with clear errors.

    Args:
        model: A wrapped model.
        layers: Decoder-layer indices to keep: a list (or 1-D tensor) of integers (default: every MoE layer).
        blocks: Keep only blocks whose module path contains this text (or one of these),
            for models with several MoE blocks in a layer (ernie4_5_vl_moe's
            ``text_moe`` / ``vision_moe``).
    """
    check_wrapped(model)
    refuse_replaced(model, replaced_blocks(model), "routing analysis", "model.moes lists the blocks as wrapped",
                    MoelensError)
    moes = list(getattr(model, "moes", None) or [])
    if not moes:
        unserved = why_no_moe(model._module)
        raise MoelensError(
            f"{type(getattr(model, '_module', model)).__name__} has no Mixture-of-Experts layer moelens knows"
            + ("" if unserved == "has no MoE block" else f" (it {unserved})")
            + (getattr(getattr(model, "moes", None), "why_empty", lambda: "")()
               or "; routing analysis needs an MoE model wrapped with moelens.wrap() / moelens.load()") + "."
        )
    if getattr(getattr(model._module, "config", None), "is_encoder_decoder", False):
        raise MoelensError(
            f"routing analysis runs the model on token ids alone, and {type(model._module).__name__} is an "
            "encoder-decoder model, whose forward needs decoder tokens too: read its blocks' values in a trace of "
            "your own, model.trace(input_ids=..., decoder_input_ids=...)."
        )
    if blocks is not None:
        listed = isinstance(blocks, Iterable) and not isinstance(blocks, (str, bytes, Mapping, Envoy))
        wanted_paths = list(blocks) if listed else [blocks]
        if not wanted_paths or not all(isinstance(part, str) for part in wanted_paths):
            wrong = next((part for part in wanted_paths if not isinstance(part, str)), blocks) if listed else blocks
            given = f"a list holding {shown(wrong)}" if listed and wanted_paths else shown(blocks)
            raise MoelensError(f"blocks must be a part of a block path or a list of them (text), got {given}; "
                               f"e.g. blocks={model.moes[0].path.rpartition('.')[2]!r}.")
        moes = [moe for moe in moes if any(part in moe.path for part in wanted_paths)]
        if not moes:
            raise MoelensError(f"no MoE block path contains {wanted_paths}; the blocks are {[m.path for m in model.moes]}.")
    if layers is not None:
        layers = id_list("layers", layers, "layer")
        known = sorted({moe.layer for moe in moes})
        wanted, missing = split_ids(layers, known)
        if missing:
            hint = "" if all(as_lone_int(layer) is not None for layer in missing) else " (decoder-layer indices are integers)"
            raise MoelensError(f"layers {missing} are not MoE layers; the MoE layers are {known}{hint}.")
        if not wanted:
            raise MoelensError(f"layers={layers} selects no MoE layer; the MoE layers are {known}.")
        moes = [moe for moe in moes if moe.layer in wanted]
    shared = sorted({moe.layer for moe in moes if sum(other.layer == moe.layer for other in moes) > 1})
    if shared:
        paths = [moe.path for moe in moes if moe.layer == shared[0]]
        raise MoelensError(
            f"layers {shared} hold several MoE blocks ({', '.join(paths)}); routing analysis keys blocks by "
            f"layer, so choose one kind by a part of its path: blocks={_telling_part(paths)!r}."
        )
    idle = next((moe for moe in moes if moe.runs_only_on), None)  # it would fail only after a whole forward
    if idle is not None:
        others = [moe.path for moe in model.moes if not moe.runs_only_on]
        instead = f"choose the other blocks, blocks={_telling_part(others + [idle.path])!r}, or " if others else ""
        raise MoelensError(
            f"{idle.path} runs only on {idle.runs_only_on}, and routing analysis runs the model on token ids alone, "
            f"so that block never runs here: {instead}read its values in a trace of your own on inputs holding them "
            "(model.trace(**processor(text=..., images=...)))."
        )
    return moes


def _telling_part(paths: list[str]) -> str:
    """A part of the first of ``paths`` that none of the others has (``text_moe``, ``encoder``), for the hint of
    `moes_of`; its last part where none does."""
    first, *others = paths
    parts = first.split(".")
    return next((part for part in reversed(parts) if not part.isdigit()
                 and not any(part in other.split(".") for other in others)), parts[-1])


def empty_cache(model: Any, moes: list[Any], logits: bool) -> RoutingCache:
    """A cache with this model's layer facts and no tokens yet."""
    family = moes[0].family
    return RoutingCache(
        layers=[moe.layer for moe in moes],
        num_experts={moe.layer: moe.num_experts for moe in moes},
        top_k={moe.layer: moe.top_k for moe in moes},
        score={moe.layer: moe.family.score_of(moe._module) for moe in moes},
        softcap={moe.layer: moe.softcap for moe in moes if moe.softcap > 0},
        family=family.name if family is not None else None,
        model=str(getattr(getattr(model, "_module", None), "name_or_path", "") or "") or None,
        has_logits=logits,
        tokenizer=corpora.tokenizer_of(model),
    )


def routing_values(logits: bool) -> list[str]:
    """The values a routing cache reads: `ROUTING_VALUES`, without the router logits unless ``logits``."""
    return [name for name in ROUTING_VALUES if logits or name != "router_logits"]


def skipping_layers(moes: list[Any]) -> set[int]:
    """The layers of ``moes`` whose router has a skip class (`skips`)."""
    return {moe.layer for moe in moes if skips(moe)}


def check_storage_dtype(dtype: Any) -> None:
    """Refuse a ``dtype`` to store routing weights and logits in that is no floating-point torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and torch.finfo(dtype).bits < 16:
        raise MoelensError(
            f"dtype={dtype} stores too few bits for routing weights and logits (float8 keeps about one digit, and "
            "its e4m3/e8m0 kinds have no inf to tell an overflow by); store them as torch.float16, torch.bfloat16 "
            "or torch.float32."
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise MoelensError(
            f"dtype must be a floating-point torch dtype to store weights and logits in (torch.float16, "
            f"torch.bfloat16, torch.float32), got {dtype!r}."
        )


def index_dtype_of(moes: list[Any]) -> torch.dtype:
    """The smallest integer dtype a cache stores these blocks' expert indices in."""
    biggest = max(moe.num_experts for moe in moes)
    return torch.int16 if biggest <= torch.iinfo(torch.int16).max else torch.int32


def skips(moe: Any) -> bool:
    """Whether ``moe``'s router has a skip class (zaya): some slots run no expert."""
    return moe.SCORING.select == "skip_topk"


def skipped_slots(indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The slots of a skip-class router that ran no expert: transformers hands them over as expert 0
    with weight 0 (a slot that ran expert 0 has its softmax score, never exactly 0 in float32)."""
    return (indices == 0) & (weights == 0)


def real_tokens(saved: dict[int, dict[str, Any]], mask: torch.Tensor, index_dtype: torch.dtype,
                dtype: torch.dtype, skipping: set[int] = frozenset()) -> dict[str, dict[int, Any]]:
    """After a trace: the routing values `MoeModelMixin.save_all` saved, at the real tokens of ``mask`` ([b, s]).

    Returns ``{"indices": {layer: [n, k]}, "weights": ..., "logits": ...}`` on the CPU (a cache over a corpus
    lives there whatever device the model runs on), where ``n`` is the number of True entries of ``mask``. In
    the ``skipping`` layers (a skip class, see `skipped_slots`) the slots that ran no expert get the index
    `SKIPPED`.
    """
    read: dict[str, dict[int, Any]] = {"indices": {}, "weights": {}, "logits": {}}
    for layer, values in saved.items():
        indices = values["expert_indices"][mask]
        if layer in skipping:
            indices = indices.masked_fill(skipped_slots(indices, values["expert_weights"][mask]), SKIPPED)
        read["indices"][layer] = indices.to("cpu", index_dtype)
        read["weights"][layer] = _stored(values["expert_weights"][mask], dtype, layer, "expert weights")
        if "router_logits" in values:
            read["logits"][layer] = _stored(values["router_logits"][mask], dtype, layer, "router logits")
    broken = [layer for layer, weights in read["weights"].items() if weights.isnan().any()]
    if broken:
        warn(f"the model computed NaN routing weights in layer{'s' * (len(broken) > 1)} {broken} (a NaN upstream: an "
             "expert or a norm with broken weights, or an overflow in a low precision): their tokens' experts are the "
             "top-k of NaN, and usage, entropy and paths count them as such. Find the first NaN with a trace "
             "(moe.router_logits.isnan().any() per block).")
    return read


def _stored(value: torch.Tensor, dtype: torch.dtype, layer: int, what: str) -> torch.Tensor:
    """``value`` on the CPU in the cache's ``dtype``, refusing finite numbers that dtype turns into inf (float16
    holds up to 65504: their probabilities and entropies would be NaN)."""
    stored = value.to("cpu", dtype)
    if torch.isinf(stored).any():  # rare: check which were finite before the cast only then
        grown = torch.isinf(stored) & torch.isfinite(value.to("cpu"))
        if grown.any():
            largest = float(value.to("cpu")[grown].abs().max())
            raise MoelensError(
                f"layer {layer}'s {what} reach {largest:.4g}, beyond what dtype={dtype} holds "
                f"({torch.finfo(dtype).max:.4g}): stored, they would be inf (and their probabilities and entropies "
                "NaN); collect with dtype=torch.float32 (or torch.bfloat16)."
            )
    return stored


def counted_batches(model: Any, stream: Iterable[Any]) -> Iterator[Any]:
    """``stream``'s batches. Under expert parallelism an error building one (a corpus item refused between traces,
    on this rank only) counts a run of the model's groups first, as a trace raising there would: the other ranks'
    trace of that batch then raises `RankDivergence` instead of pairing with this rank's next trace."""
    batches = iter(stream)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except BaseException:
            model._begin_runs()
            raise
        yield batch


@contextmanager
def refusals_count_a_run(model: Any) -> Iterator[None]:
    """Around an analysis' checks before its first exchange: under expert parallelism a refusal there (on some ranks
    only: a corpus given as a set, another ``layers=``) counts a run of the model's groups, as a trace raising would,
    so the other ranks' first exchange of that call raises `RankDivergence` instead of pairing with this rank's next
    call (`counted_batches` does the same for a corpus item refused between traces)."""
    try:
        yield
    except BaseException:
        begin_runs = getattr(model, "_begin_runs", None)
        if callable(begin_runs):
            begin_runs()
        raise


def can_stop_early(model: Any) -> bool:
    """Whether a trace of ``model`` may stop once the values it needs are read: not when the model carries
    lasting edits (``model.edit(inplace=True)``), which nnsight replays in every trace and which wait for
    values further on (a stop before them fails the trace)."""
    return not getattr(model, "_edits", None)


def _ep_group_of(experts: torch.nn.Module) -> Any:
    """The process group an experts module exchanges tokens over: the one `shard_experts` keeps, or the ``ep``
    dimension of the mesh transformers' own expert parallelism (``DistributedConfig(ep_size=...)``) shards its weights
    on (DTensors); None for experts not sharded over ranks."""
    holder = experts.__dict__.get("_ep_group")  # the group shard_experts keeps (parallel.comm.SharedGroup)
    if holder is not None:
        return holder.group
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        mesh = getattr(getattr(experts, name, None), "device_mesh", None)
        if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
            return mesh.get_group("ep")
    return None


def _writer_of_every_rank(moes: list[Any], folder: str | None, cache: RoutingCache) -> ShardWriter | None:
    """The `ShardWriter` of ``folder`` (None for no folder), refused on every rank of an expert-parallel group
    (`moelens.parallel.shard_experts`', or transformers' own: `_ep_group_of`) together: there every rank collects, each trace a collective, so a folder
    refused on one rank alone would leave the others waiting in their first trace; and ranks streaming to one
    folder (on one machine, or on machines sharing a filesystem) would overwrite each other's shards and
    ``routing.json``. Every rank says which folder it writes to and why it was refused, a collective too."""
    writer = refusal = None
    try:
        writer = ShardWriter(folder, cache) if folder is not None else None
    except Exception as error:  # noqa: BLE001 - raised below, after the other ranks heard of it
        refusal = error
    experts = moes[0].experts._module
    group = _ep_group_of(experts)
    if group is None or dist.get_world_size(group) < 2:
        if refusal is not None:
            raise refusal
        return writer
    runs = experts.__dict__.get("_ep_runs")  # the group's run ids (parallel.runs.Runs): the exchange is a run of them
    if runs is not None:
        weight = next(experts.parameters(), None)
        runs.meet_for_folders(group, weight.device if weight is not None else "cpu")
    mine = (None if writer is None else str(writer.folder.resolve()), None if refusal is None else str(refusal))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if refusal is not None:
        raise refusal
    refused = next((rank for rank, (_, error) in enumerate(everyone) if error is not None), None)
    if refused is not None:
        raise MoelensError(
            f"collect_routing: rank {refused} of the expert-parallel group refused its folder ({everyone[refused][1]}); "
            "every rank collects, each trace a collective, so this rank stops too. Fix that rank's folder and call "
            "collect_routing again on every rank."
        )
    paths = [path for path, _ in everyone]
    shared = sorted({path for path in paths if path is not None and paths.count(path) > 1}, key=paths.index)
    if shared:
        path = mine[0] if mine[0] in shared else shared[0]
        raise MoelensError(
            f"collect_routing: under expert parallelism every rank collects, and ranks "
            f"{[rank for rank, given in enumerate(paths) if given == path]} gave one folder, {path!r}: they would "
            "overwrite each other's shards (every rank stops). Give each rank its own, e.g. "
            "folder=f\"{folder}/rank{torch.distributed.get_rank()}\"."
        )
    return writer


def collect_routing(
    model: Any,
    corpus: Any,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    logits: bool = False,
    layers: Iterable[int] | None = None,
    blocks: str | Iterable[str] | None = None,
    folder: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    dtype: torch.dtype = torch.float16,
    stop_early: bool = True,
    progress: bool = True,
) -> RoutingCache:
    """Run ``corpus`` through ``model`` batch by batch and cache every real token's routing.

    Args:
        model: A model from `moelens.wrap` / `moelens.load`.
        corpus: Texts (needs the model's tokenizer), token-id sequences, a ``[N, S]``
            token-id tensor (every row real tokens), or a tokenizer's output (padding dropped
            by its attention_mask); any iterable, consumed lazily. Items longer than
            ``max_length`` are cut into windows. A token's ``text_index`` is its item's place in
            the corpus, so a set of texts (which has no order) is refused: pass a list.
        batch_size: Windows per forward.
        max_length: Window length (default: the model's context, at most 512).
        logits: Also cache router logits (``[T, E]`` per layer; lets `RoutingCache.probs`
            and the router entropy work).
        layers: Decoder-layer indices of the MoE layers to cache, a list or a set (default: all).
        blocks: Only blocks whose path contains this (models with several MoE blocks per layer).
        folder: Stream the cache to this folder (one file per shard) instead of
            memory; only one shard is ever held in memory.
        shard_tokens: Tokens per shard (a shard is closed after the batch that reaches it).
        dtype: Storage dtype of weights and logits (float16 halves the memory).
        stop_early: Stop each forward after the last cached layer (the rest of the
            model does not change the routing); a model carrying lasting nnsight edits
            runs to the end all the same (`can_stop_early`).
        progress: Show a tqdm progress bar (over the texts where their number is known, else the tokens).

    Returns:
        The `RoutingCache` (on disk when ``folder`` is given).
    """
    with refusals_count_a_run(model):
        refuse_set("corpus", corpus, "the text_index of its items (a token's text_index is its item's place in the corpus)")
        shard_tokens = check_count("shard_tokens", shard_tokens)
        logits = check_flag("logits", logits)
        stop_early = check_flag("stop_early", stop_early)
        progress = check_flag("progress", progress)
        check_storage_dtype(dtype)
        moes = moes_of(model, layers, blocks)
        cache = empty_cache(model, moes, logits)
        wanted = routing_values(logits)
        index_dtype = index_dtype_of(moes)
        skipping = skipping_layers(moes)
        tokenizer = corpora.tokenizer_of(model)
        tally = corpora.Tally()
        stream = corpora.batches(
            corpus,
            tokenizer,
            batch_size=batch_size,
            max_length=corpora.window_length(model, max_length),
            pad=corpora.pad_id(model),
            tally=tally,
            vocab=corpora.vocab_size(model),
        )
    writer = _writer_of_every_rank(moes, folder, cache)
    pending: list[Shard] = []
    pending_tokens = 0
    shards: list[Shard] = []

    def flush() -> None:
        nonlocal pending, pending_tokens
        if not pending:
            return
        shard = Shard.concat(pending)
        if writer is not None:
            writer.write(shard)
        else:
            shards.append(shard)
        pending, pending_tokens = [], 0

    bar = CorpusProgress(corpus, "routing", progress)
    with evaluating(model._module), closing(bar):  # the pass in eval mode: no dropout, no router jitter
        for batch in counted_batches(model, stream):
            mask = batch.mask
            with torch.no_grad(), model.trace(**batch.kwargs()) as tracer:
                saved = model.save_all(wanted, strict=True, moes=moes)  # keyed by layer: moes_of keeps one per layer
                if stop_early and can_stop_early(model):
                    tracer.stop()
            read = real_tokens(saved, mask, index_dtype, dtype, skipping)
            rows = mask.sum(1)
            positions = torch.arange(mask.shape[1]).expand_as(mask)
            pending.append(
                Shard(
                    token_ids=batch.input_ids[mask].to(torch.int32),
                    text_index=batch.text_index.repeat_interleave(rows).to(torch.int32),
                    position=(positions + batch.offset[:, None])[mask].to(torch.int32),
                    indices=read["indices"],
                    weights=read["weights"],
                    logits=read["logits"],
                )
            )
            if writer is not None:  # from here on, a stop leaves the folder's cache marked incomplete
                writer.begin()
            pending_tokens += batch.num_tokens
            bar.advance(batch)
            if pending_tokens >= shard_tokens:
                flush()
        flush()
        bar.finish()
    cache.num_texts = tally.items  # empty items too: they have no token, but are corpus items
    if writer is not None:
        writer.close()
        return RoutingCache.load(folder, tokenizer=cache.tokenizer)
    cache._memory = shards
    return cache
