"""`RoutingCache`: the routing of every real token of a corpus, per MoE layer.

A cache holds, for each token the model saw (padding excluded) and each MoE
layer, the ``k`` experts it was routed to (``indices``) and their weights
(``weights``), optionally the router logits, plus where the token came from
(``token_ids``, ``text_index``, ``position``). Tokens are kept in corpus order,
in shards of a bounded number of tokens: in memory, or on disk (one
``.safetensors`` file per shard and a ``routing.json``), where they are read back
one shard at a time, so statistics over a corpus of any size run in bounded
memory (`shards`).

Layers are named by their decoder layer index (``model.layers[i]``), as in
``moe.layer``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from jaxtyping import Float, Int
from nnsight import Envoy
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..errors import MoelensError
from ..families.scoring import score
from ..paths import blocked_above, may_write_into, user_path
from .checks import check_type, layer_hint, shown, split_ids
from .text import check_tokenizer

#: The index of a slot that ran no expert (zaya's skip class, which transformers hands the experts as
#: expert 0 with weight 0): counted by no expert.
SKIPPED = -1

#: Why a result over a cache of no tokens cannot be made, and what to do.
EMPTY_CACHE = ("this routing cache holds no tokens (its corpus was empty, or the collection stopped before its first "
               "batch); collect one over texts with content: analysis.collect_routing(model, texts).")

#: Version of the on-disk layout (``routing.json`` says which).
FORMAT_VERSION = 1
META_FILE = "routing.json"

#: The names moelens gives shard files (``shard-00000.safetensors``, ...): the only files it replaces.
SHARD_NAME = re.compile(r"shard-\d+\.safetensors")


def layer_row(layers: Sequence[int], layer: Any, what: str = "cache") -> int:
    """The position of decoder layer ``layer`` (an integer, see `moelens.scalars.as_lone_int`) in ``layers`` (the MoE layers of
    a cache or a result)."""
    if isinstance(layer, Envoy):  # a block or a decoder layer given for its index (its repr is the whole module tree)
        raise MoelensError(f"layer takes a decoder-layer index, got {shown(layer)}"
                           f"{layer_hint(layer) or ': pass the index of its decoder layer (an int)'}.")
    (index,), outside = split_ids([layer], layers)
    if outside:
        hint = "" if index is not None else " (pass an integer decoder-layer index)"
        raise MoelensError(f"layer {shown(layer)} is not an MoE layer of this {what}; its MoE layers are "
                           f"{list(layers)}{hint}.")
    return list(layers).index(index)


def damaged(path: Path, problem: str) -> MoelensError:
    """The error for a routing cache file that cannot be read.

    With its ``routing.json`` damaged, moelens can no longer tell its shards from other files in the
    folder (and will not overwrite them), so the remedy is a folder without them.
    """
    remedy = ("collect the routing again into another folder, or delete this folder's routing.json and "
              "shard-*.safetensors files first" if path.name == META_FILE
              else "collect the routing again (collect_routing(..., folder=...) replaces this cache)")
    return MoelensError(f"the routing cache file {str(path)!r} is damaged ({problem}); the cache cannot be read: {remedy}.")


@dataclass
class Shard:
    """The routing of a run of consecutive cached tokens.

    Attributes:
        token_ids: ``[n]`` the token ids.
        text_index: ``[n]`` which corpus item each token comes from.
        position: ``[n]`` each token's position in its corpus item.
        indices: Layer -> ``[n, k]`` the experts each token was routed to (int16 / int32).
        weights: Layer -> ``[n, k]`` the routing weight of each slot.
        logits: Layer -> ``[n, E]`` router logits (only when collected).
    """

    token_ids: Int[Tensor, " n"]
    text_index: Int[Tensor, " n"]
    position: Int[Tensor, " n"]
    indices: dict[int, Int[Tensor, "n k"]]
    weights: dict[int, Float[Tensor, "n k"]]
    logits: dict[int, Float[Tensor, "n e"]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """How many tokens the shard holds (the length of ``token_ids``)."""
        return int(self.token_ids.shape[0])

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor, the safetensors layout."""
        tensors = {"token_ids": self.token_ids, "text_index": self.text_index, "position": self.position}
        for kind in ("indices", "weights", "logits"):
            for layer, tensor in getattr(self, kind).items():
                tensors[f"{kind}.{layer}"] = tensor.contiguous()
        return tensors

    def copy(self) -> "Shard":
        """A shard of copies of these tensors."""
        return Shard.from_tensors({name: tensor.clone() for name, tensor in self.to_tensors().items()})

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "Shard":
        """The shard a `to_tensors` layout holds (what a shard file gives back): ``token_ids``, ``text_index`` and
        ``position``, and ``indices.<layer>`` / ``weights.<layer>`` / ``logits.<layer>`` per layer, put in layer
        order; other names are ignored, and nothing is checked (`RoutingCache` checks a shard it reads from disk)."""
        per_layer: dict[str, dict[int, Tensor]] = {"indices": {}, "weights": {}, "logits": {}}
        for name, tensor in tensors.items():
            kind, _, layer = name.partition(".")
            if kind in per_layer:
                per_layer[kind][int(layer)] = tensor
        order = lambda mapping: dict(sorted(mapping.items()))  # noqa: E731
        return cls(
            token_ids=tensors["token_ids"],
            text_index=tensors["text_index"],
            position=tensors["position"],
            indices=order(per_layer["indices"]),
            weights=order(per_layer["weights"]),
            logits=order(per_layer["logits"]),
        )

    @classmethod
    def concat(cls, shards: list["Shard"]) -> "Shard":
        """One shard holding ``shards`` one after the other."""
        first = shards[0]
        cat = lambda name, layer=None: torch.cat(  # noqa: E731
            [getattr(s, name) if layer is None else getattr(s, name)[layer] for s in shards]
        )
        return cls(
            token_ids=cat("token_ids"),
            text_index=cat("text_index"),
            position=cat("position"),
            indices={layer: cat("indices", layer) for layer in first.indices},
            weights={layer: cat("weights", layer) for layer in first.weights},
            logits={layer: cat("logits", layer) for layer in first.logits},
        )


@dataclass
class RoutingCache:
    """The routing of a corpus: per MoE layer, each token's experts and weights.

    Build one with `moelens.analysis.collect_routing`; save it with `save` and read
    it back with `RoutingCache.load` (lazily: shards stay on disk until iterated).

    Attributes:
        layers: The decoder-layer indices of the MoE layers, in order.
        num_experts: Layer -> E.
        top_k: Layer -> k.
        score: Layer -> the family's score function name (``"softmax"``, ``"sigmoid"``...),
            what turns cached logits into `probs`.
        softcap: Layer -> the router's logit softcap, applied before the score (laguna);
            layers without one are absent.
        family: The model's moelens family name.
        model: A name for the model (its path), informative only.
        num_texts: How many corpus items were read.
        has_logits: Whether router logits were collected.
        tokenizer: The tokenizer of the model the routing was collected from (held in memory, not saved: give it
            to `load`); `top_tokens` decodes token ids with it when given none.
    """

    layers: list[int]
    num_experts: dict[int, int]
    top_k: dict[int, int]
    score: dict[int, str]
    softcap: dict[int, float] = field(default_factory=dict)
    family: str | None = None
    model: str | None = None
    num_texts: int = 0
    has_logits: bool = False
    tokenizer: Any = field(default=None, repr=False, compare=False)
    _memory: list[Shard] = field(default_factory=list, repr=False)
    _folder: Path | None = field(default=None, repr=False)
    _files: list[tuple[str, int]] = field(default_factory=list, repr=False)
    #: The id of the collection (or save) that wrote the folder's cache, in its routing.json and each shard.
    _collection: str | None = field(default=None, repr=False)

    # -- size -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """How many (real) tokens are cached."""
        if self._folder is not None:
            return sum(tokens for _, tokens in self._files)
        return sum(shard.num_tokens for shard in self._memory)

    @property
    def num_shards(self) -> int:
        """How many shards hold the tokens: the files ``routing.json`` lists (on disk), or the shards in memory."""
        return len(self._files) if self._folder is not None else len(self._memory)

    @property
    def on_disk(self) -> bool:
        """Whether the shards live on disk (read back one at a time)."""
        return self._folder is not None

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:  # the dataclass' own printed every per-layer dict and no token count
        """The family, how many tokens of how many texts, the layers, E and k (one number where every layer has the
        same), whether logits are held, and where the shards are: in memory, or the folder (nothing is read from it)."""
        try:
            where = "in memory" if self._folder is None else f"folder {str(self._folder)!r}"
            return (f"RoutingCache({f'{self.family}, ' if self.family else ''}"
                    f"{_counted(self.num_tokens, 'token')} in {_counted(self.num_texts, 'text')}, "
                    f"layers {list(self.layers)}, E={self._per_layer(self.num_experts)}, "
                    f"k={self._per_layer(self.top_k)}, "
                    f"logits={self.has_logits}, {where}, {_counted(self.num_shards, 'shard')})")
        except Exception:  # noqa: BLE001 - a repr never raises (a cache built by hand, with entries of any kind)
            return f"RoutingCache(at {id(self):#x})"

    def _per_layer(self, entries: dict[int, Any]) -> Any:
        """``entries`` (``num_experts``, ``top_k``) of this cache's layers, for `__repr__`: the one value where every
        layer has the same, else layer -> value."""
        values = {layer: entries.get(layer) for layer in self.layers}
        first = next(iter(values.values()), None)
        return first if values and all(value == first for value in values.values()) else values

    # -- reading ----------------------------------------------------------------------------

    def shards(self) -> Iterator[Shard]:
        """The shards in corpus order (from disk one at a time when the cache is on disk), each the caller's own:
        editing one changes nothing in the cache."""
        for shard in self._shards():
            yield shard.copy() if self._folder is None else shard

    def _shards(self) -> Iterator[Shard]:
        """The shards in corpus order, an in-memory cache's its own (for moelens' analyses, which only read them)."""
        if self._folder is None:
            yield from self._memory
            return
        self._check_not_replaced()
        for name, tokens in self._files:
            yield self._read(self._folder / name, tokens)

    def _check_not_replaced(self) -> None:
        """Raise `_replaced` when the folder's routing.json is another collection's than this object opened (None on
        both sides: a cache saved before collections had ids)."""
        meta = _cache_meta(self._folder)
        if meta is None:  # gone, or no moelens cache's any more: nothing says another collection wrote it
            path = self._folder / META_FILE
            if not path.is_file():
                what = path.name if self._folder.is_dir() else "its folder"
                raise MoelensError(
                    f"the routing cache in {str(self._folder)!r} is gone: {what} was deleted after this cache object "
                    "opened it. Collect the routing again "
                    "(collect_routing(..., folder=...)), or keep the folder while a cache object reads it."
                )
            raise damaged(path, "not a moelens routing cache's routing.json any more")
        if meta.get("collection") != self._collection:
            raise self._replaced()

    def _replaced(self) -> MoelensError:
        return MoelensError(
            f"the routing cache in {str(self._folder)!r} was replaced after this cache object opened it (a later "
            "collect_routing or save into that folder); its shards are another corpus's now. Open the folder again "
            "(RoutingCache.load(folder)) for the cache it holds, or keep each corpus in a folder of its own."
        )

    def _read(self, path: Path, tokens: int) -> Shard:
        """The shard file ``path``, checked against what ``routing.json`` says of it."""
        try:
            with safe_open(str(path), framework="pt") as file:
                written_by = (file.metadata() or {}).get("collection")
                shard = Shard.from_tensors({name: file.get_tensor(name) for name in file.keys()})
        except (SafetensorError, OSError, KeyError, ValueError) as error:
            raise damaged(path, f"{type(error).__name__}: {error}") from None
        if written_by != self._collection:
            self._check_not_replaced()  # routing.json gone, damaged or another collection's: that is what to say
            raise damaged(path, f"a collection other than the one {META_FILE} lists wrote it: a shard of another cache, "
                                "copied in")
        problem = self._shard_problem(shard, tokens)
        if problem is not None:
            raise damaged(path, problem)
        return shard

    def _shard_problem(self, shard: Shard, tokens: int) -> str | None:
        """What keeps ``shard`` (read from disk) from being the ``tokens`` tokens ``routing.json`` lists for it, or None
        when it holds them: ``[tokens]`` token ids, text indices and positions (of the values `_source_problem` checks),
        and every layer's indices, weights (and logits, when the cache has them) as `_layer_problem` checks them."""
        for name in ("token_ids", "text_index", "position"):
            shape = list(getattr(shard, name).shape)
            if shape != [tokens]:
                return f"its {name} has shape {shape}, where {META_FILE} lists {tokens} tokens"
        problem = self._source_problem(shard)
        if problem is not None:
            return problem
        layers = sorted(self.layers)
        for kind in ("indices", "weights") + (("logits",) if self.has_logits else ()):
            held = list(getattr(shard, kind))
            if held != layers:
                return f"it holds {kind} of layers {held}, where {META_FILE} lists layers {layers}"
        for layer in layers:
            problem = self._layer_problem(shard, layer, tokens)
            if problem is not None:
                return problem
        return None

    def _source_problem(self, shard: Shard) -> str | None:
        """What is wrong with the values of ``shard``'s token_ids, text_index and position (each of the right shape), or
        None: signed integers, token ids and positions 0 or more, text indices below ``num_texts`` (the corpus items
        ``routing.json`` lists). Only each tensor's least and greatest value are read, so a large shard stays cheap."""
        limits = {"token_ids": (None, "token ids are 0 or more"),
                  "text_index": (self.num_texts, f"{META_FILE}'s num_texts (how many corpus items were read) is "
                                                 f"{self.num_texts}: a text index is 0 or more and below it"),
                  "position": (None, "positions in a corpus item are 0 or more")}
        for name, (end, expected) in limits.items():
            tensor = getattr(shard, name)
            if tensor.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
                return f"its {name} are {tensor.dtype}, not integers"
            if not tensor.numel():
                continue
            low, high = (int(bound) for bound in torch.aminmax(tensor))
            if low < 0 or (end is not None and high >= end):
                return f"its {name} holds {low if low < 0 else high}, where {expected}"
        return None

    def _layer_problem(self, shard: Shard, layer: int, tokens: int) -> str | None:
        """What is wrong with ``shard``'s tensors of ``layer``, or None: indices (signed integers, each an expert of the
        layer or `SKIPPED`) and floating-point weights of shape ``[tokens, k]``, floating-point logits of shape
        ``[tokens, E or more]`` (some families' routers have columns past their experts': inkling's shared gates)."""
        k, experts = self.top_k[layer], self.num_experts[layer]
        indices, weights = shard.indices[layer], shard.weights[layer]
        for name, tensor in (("indices", indices), ("weights", weights)):
            if list(tensor.shape) != [tokens, k]:
                return (f"its {name}.{layer} has shape {list(tensor.shape)}, where {META_FILE} lists {tokens} tokens "
                        f"and top_k {k}")
        if indices.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64) or not weights.is_floating_point():
            return f"its indices.{layer} are {indices.dtype} and weights.{layer} {weights.dtype}, not integers and floats"
        if indices.numel():
            low, high = (int(bound) for bound in torch.aminmax(indices))
            if low < SKIPPED or high >= experts:
                return (f"its indices.{layer} hold expert {high if high >= experts else low}, where {META_FILE} lists "
                        f"{experts} experts for the layer (0 to {experts - 1}, or {SKIPPED} for a slot that ran none)")
        if self.has_logits:
            logits = shard.logits[layer]
            if logits.dim() != 2 or logits.shape[0] != tokens or logits.shape[1] < experts or not logits.is_floating_point():
                return (f"its logits.{layer} are {logits.dtype} of shape {list(logits.shape)}, where {META_FILE} lists "
                        f"{tokens} tokens and {experts} experts (floats of shape [{tokens}, {experts} or more])")
        return None

    def _layer_entries_problem(self) -> str | None:
        """What keeps ``num_experts``, ``top_k`` and ``score`` (as read from ``routing.json``) from giving every layer a
        positive integer E and k and a score function name, or None when they do."""
        for name in ("num_experts", "top_k", "score"):
            entries = getattr(self, name)
            for layer in self.layers:
                if layer not in entries:
                    return f"no {name} entry for layer {layer}"
                value = entries[layer]
                if name == "score" and not isinstance(value, str):
                    return f"its score entry for layer {layer} is {value!r}, not a score function name"
                if name != "score" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    return f"its {name} entry for layer {layer} is {value!r}, not a positive integer"
        return None

    def layer_key(self, layer: Any) -> int:
        """``layer`` (an integer decoder-layer index, or a numpy / 0-d tensor one) as the int key of one of this cache's MoE
        layers, the key its per-layer values are stored under; a layer that is not one of them is a clear error."""
        return self.layers[layer_row(self.layers, layer)]

    def _cat(self, kind: str, layer: int | None = None) -> Tensor:
        parts = [getattr(s, kind) if layer is None else getattr(s, kind)[layer] for s in self._shards()]
        if not parts:
            raise MoelensError(EMPTY_CACHE)
        return torch.cat(parts)

    def indices(self, layer: int) -> Int[Tensor, "t k"]:
        """``[T, k]`` int64: the experts every cached token was routed to in ``layer``."""
        return self._cat("indices", self.layer_key(layer)).long()

    def weights(self, layer: int) -> Float[Tensor, "t k"]:
        """``[T, k]`` float32: each slot's routing weight in ``layer``."""
        return self._cat("weights", self.layer_key(layer)).float()

    def dense_weights(self, layer: int) -> Float[Tensor, "t e"]:
        """``[T, E]`` float32: every cached token's routing weight of each expert in ``layer``, 0 for the experts it
        was not routed to (slots that ran no expert, `SKIPPED`, add nothing)."""
        layer = self.layer_key(layer)
        indices, weights = self.indices(layer), self.weights(layer)
        ran = indices != SKIPPED
        dense = torch.zeros(indices.shape[0], self.num_experts[layer])
        return dense.scatter_add_(1, indices.clamp(min=0), weights * ran)

    def logits(self, layer: int) -> Float[Tensor, "t e"]:
        """``[T, E]`` float32: router logits in ``layer`` (collect with ``logits=True``)."""
        if not self.has_logits:
            raise MoelensError("this cache holds no router logits; collect it with collect_routing(..., logits=True).")
        return self._cat("logits", self.layer_key(layer)).float()

    def probs(self, layer: int) -> Float[Tensor, "t e"]:
        """``[T, E]`` the family's score of each expert (what ``moe.router_probs`` serves)."""
        layer = self.layer_key(layer)
        return score(self.score[layer], self.logits(layer), self.softcap.get(layer, 0.0))

    def token_ids(self) -> Int[Tensor, " t"]:
        """``[T]`` int64: every cached token's id, in corpus order (the order of every per-token result here)."""
        return self._cat("token_ids").long()

    def text_index(self) -> Int[Tensor, " t"]:
        """``[T]`` int64: the corpus item each cached token comes from (its place in the corpus, 0 to
        ``num_texts - 1``; every window of a long item has that item's index)."""
        return self._cat("text_index").long()

    def position(self) -> Int[Tensor, " t"]:
        """``[T]`` int64: each cached token's position in its corpus item (counted over the whole item, not its
        window)."""
        return self._cat("position").long()

    def materialize(self) -> "RoutingCache":
        """An in-memory copy (one shard) of this cache."""
        shards = list(self._shards())
        return RoutingCache(**self._meta_fields(), tokenizer=self.tokenizer,
                            _memory=[Shard.concat(shards)] if shards else [])

    # -- saving -----------------------------------------------------------------------------

    def _meta_fields(self) -> dict:
        return dict(
            layers=list(self.layers), num_experts=dict(self.num_experts), top_k=dict(self.top_k),
            score=dict(self.score), softcap=dict(self.softcap), family=self.family, model=self.model,
            num_texts=self.num_texts,
            has_logits=self.has_logits,
        )

    def meta(self) -> dict:
        """What ``routing.json`` holds (JSON-ready)."""
        fields = self._meta_fields()
        for name in ("num_experts", "top_k", "score", "softcap"):
            fields[name] = {str(layer): value for layer, value in fields[name].items()}
        return {"format": FORMAT_VERSION, "num_tokens": self.num_tokens, **fields}

    def save(self, folder: str | Path) -> Path:
        """Write the cache to ``folder`` (created): ``routing.json`` + one safetensors file per shard."""
        folder = user_path(folder, "cache.save's folder")
        if self._folder is not None and folder.resolve() == self._folder.resolve():
            self._check_not_replaced()
            return folder
        writer = ShardWriter(folder, self)
        for shard in self._shards():
            writer.write(shard)
        writer.close()
        return folder

    @classmethod
    def load(cls, folder: str | Path, tokenizer: Any = None) -> "RoutingCache":
        """Open a saved cache; its shards are read from disk when iterated (from this folder, wherever the current
        folder is then). ``tokenizer`` (the model's, ``model.tokenizer``) is what `top_tokens` decodes ids with:
        a saved cache does not hold one."""
        check_tokenizer(tokenizer)
        folder = user_path(folder, "RoutingCache.load's folder").absolute()
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            why = (f"{META_FILE} is missing" if folder.is_dir() else "it is a file, not a cache's folder"
                   if folder.exists() else "the path does not exist")
            raise MoelensError(f"{folder} holds no routing cache ({why}); save one with cache.save(folder).")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise damaged(meta_path, f"not JSON: {error}") from None
        if not isinstance(meta, dict):
            raise damaged(meta_path, f"a JSON {type(meta).__name__}, not an object")
        check_format(meta_path, meta)
        if meta.get("complete") is False:
            raise MoelensError(
                f"the routing cache in {str(folder)!r} is incomplete: the collection or cache.save writing it stopped "
                "before the end (interrupted, or an error); collect the routing again (collect_routing(..., folder=...)) "
                "or save the cache again (cache.save(folder))."
            )
        per_layer = lambda name: {int(layer): value for layer, value in meta[name].items()}  # noqa: E731
        try:
            cache = cls(
                layers=[int(layer) for layer in meta["layers"]],
                num_experts=per_layer("num_experts"),
                top_k=per_layer("top_k"),
                score=per_layer("score"),
                softcap={int(layer): float(cap) for layer, cap in meta.get("softcap", {}).items()},
                family=meta.get("family"),
                model=meta.get("model"),
                num_texts=count_entry(meta.get("num_texts", 0), "num_texts"),
                has_logits=bool(meta.get("has_logits")),
                tokenizer=tokenizer,
                _folder=folder,
                _files=[(str(entry["file"]), count_entry(entry["tokens"], f"tokens entry of the shard {entry['file']!r}"))
                        for entry in meta["shards"]],
                _collection=meta.get("collection"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise damaged(meta_path, f"no {error} entry" if isinstance(error, KeyError) else str(error)) from None
        problem = cache._layer_entries_problem()
        if problem is not None:
            raise damaged(meta_path, problem)
        listed: set[str] = set()
        for name, _ in cache._files:
            if not SHARD_NAME.fullmatch(name) or not (folder / name).is_file():
                raise damaged(meta_path, f"it lists the shard file {name!r}, which is not in {str(folder)!r}")
            if name in listed:
                raise damaged(meta_path, f"it lists the shard file {name!r} more than once, which would count its "
                                         "tokens as often")
            listed.add(name)
        return cache


def _counted(count: int, word: str) -> str:
    """``"1 token"``, ``"11 tokens"``."""
    return f"{count} {word}{'s' * (count != 1)}"


def count_entry(value: Any, what: str) -> int:
    """``value``, the count ``what`` that ``routing.json`` records (of texts, of a shard's tokens), as an int; a
    ValueError saying so when it is no integer of 0 or more (a bool, a string, a float, a negative number)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"its {what} is {value!r}, not a count (an integer, 0 or more)")
    return value


def check_cache(cache: Any) -> None:
    """Refuse a ``cache`` argument that is not a `RoutingCache` (a model, a `Usage` ...), or one of no tokens (whose
    statistics would read as measurements: a balance of 0, an entropy of 0)."""
    check_type(cache, RoutingCache, "cache", "a RoutingCache",
               "collect one with analysis.collect_routing(model, texts), or load one with RoutingCache.load(folder)")
    if cache.num_tokens == 0:
        raise MoelensError(EMPTY_CACHE)


def check_folder(path: Path, what: str) -> None:
    """Refuse a folder to write to that is a file, lies under one, is a symbolic link to a missing path, or an
    existing folder this process may not write into."""
    if path.is_symlink() and not path.exists():
        raise MoelensError(f"{what} {str(path)!r} is a symbolic link to a missing path ({os.readlink(path)}); "
                           "name a folder (it is created if missing).")
    if path.exists() and not path.is_dir():
        raise MoelensError(f"{what} {str(path)!r} is a file; name a folder (it is created if missing).")
    if path.is_dir() and not may_write_into(path):
        raise MoelensError(f"{what} {str(path)!r} is a folder this user may not write into; name another folder.")
    blocked = None if path.is_dir() else blocked_above(path)  # a folder there is written into, nothing made above
    if blocked is not None:
        raise MoelensError(
            f"{what} {str(path)!r} lies under {blocked}; name a folder elsewhere (it is created if missing)."
        )


def check_format(meta_path: Path, meta: dict) -> None:
    """Refuse a ``routing.json`` (``meta``, read from ``meta_path``) that records no format number (no moelens cache's)
    or another format than this moelens reads."""
    found = meta.get("format")
    if isinstance(found, bool) or not isinstance(found, int):
        recorded = "no format recorded in it" if found is None else f"its format is {found!r}, not a format number"
        raise MoelensError(
            f"{str(meta_path)!r} is not a moelens routing cache's {META_FILE} ({recorded}); open a folder that "
            "collect_routing(..., folder=...) or cache.save(folder) wrote."
        )
    if found != FORMAT_VERSION:
        raise MoelensError(
            f"{str(meta_path)!r} has format {found}; this moelens reads format {FORMAT_VERSION}: collect the routing "
            "again with this moelens (collect_routing(..., folder=...)), or read the cache with the moelens version "
            "that wrote it."
        )


#: What every moelens ``routing.json`` records beside its format (`RoutingCache.meta`), since the first format.
CACHE_KEYS = ("num_tokens", "layers", "num_experts", "top_k", "shards")


def _cache_meta(folder: Path) -> dict | None:
    """The ``routing.json`` in ``folder`` when it is a moelens cache's (it records the format, and `CACHE_KEYS`: another
    tool's with a format number is not taken for one), else None."""
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    found = meta.get("format") if isinstance(meta, dict) else None
    is_cache = isinstance(found, int) and not isinstance(found, bool) and all(key in meta for key in CACHE_KEYS)
    return meta if is_cache else None


def listed_shards(meta: dict | None) -> list[str]:
    """The shard files a moelens ``routing.json`` (`_cache_meta`) lists (none without one, or when it is damaged)."""
    try:
        names = [entry["file"] for entry in (meta or {})["shards"]]
    except (KeyError, TypeError):
        return []
    return [name for name in names if isinstance(name, str) and SHARD_NAME.fullmatch(name)]


def check_cache_folder(folder: Path) -> list[str]:
    """Check that a routing cache can be written to ``folder``; returns the shard files of the cache there.

    Those files and ``routing.json`` are what writing a cache there replaces; a shard-named file
    no ``routing.json`` lists (not moelens'), or a ``routing.json`` of another tool, is refused rather
    than overwritten.
    """
    check_folder(folder, "routing cache folder")
    if not folder.is_dir():
        return []
    meta = _cache_meta(folder)
    listed = listed_shards(meta)
    others = sorted(path.name for path in folder.iterdir() if SHARD_NAME.fullmatch(path.name) and path.name not in listed)
    if others:
        raise MoelensError(
            f"routing cache folder {str(folder)!r} holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, "
            f"which no {META_FILE} there lists; a cache written there would overwrite them: move them or name "
            "another folder."
        )
    if meta is None and (folder / META_FILE).exists():
        raise MoelensError(
            f"routing cache folder {str(folder)!r} holds a {META_FILE} that is not a moelens routing cache's (it "
            f"records no format, or not every key a cache records: {', '.join(CACHE_KEYS)}); a cache written there "
            "would overwrite it: move it or name another folder."
        )
    return listed


class ShardWriter:
    """Writes shards of a cache to a folder as they come, then its ``routing.json``.

    The cache already in the folder (its ``routing.json`` and the shards it lists) is replaced at
    `begin`, which the collection calls once its first batch is routed (a collection refused before
    that leaves it as it was); other files are left alone. From then until `close`, ``routing.json``
    says the cache is incomplete (and lists the shards written so far), so an interrupted collection
    fails to load, never as the old cache nor as a mix of two corpora.
    """

    def __init__(self, folder: str | Path, cache: RoutingCache) -> None:
        self.folder = user_path(folder, "folder")
        self._replaced = check_cache_folder(self.folder)  # None once replaced
        self.cache = cache
        self.files: list[tuple[str, int]] = []
        self.collection = secrets.token_hex(8)  # marks routing.json and each shard as this writer's

    def begin(self) -> None:
        """Replace the old cache with an empty one marked incomplete (once; later calls do nothing)."""
        if self._replaced is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        # first marked incomplete, still listing the old shards: stopped below, the folder holds an incomplete cache
        # (not a damaged one), whose listed shards the next collection replaces
        self.files = [(name, 0) for name in self._replaced]
        self._write_meta(complete=False)
        for name in self._replaced:
            (self.folder / name).unlink(missing_ok=True)
        self.files, self._replaced = [], None
        self._write_meta(complete=False)

    def write(self, shard: Shard) -> None:
        self.begin()
        name = f"shard-{len(self.files):05d}.safetensors"
        self.files.append((name, shard.num_tokens))
        self._write_meta(complete=False)  # listed before it is written: a later collection replaces it
        save_file(shard.to_tensors(), str(self.folder / name), metadata={"collection": self.collection})
        # safetensors writes through a private temporary file (mode 0600): give the shard routing.json's mode, the
        # one the user's umask gives a new file, so whoever can read the cache's listing can read its shards
        os.chmod(self.folder / name, stat.S_IMODE((self.folder / META_FILE).stat().st_mode))

    def close(self) -> None:
        self.begin()
        self._write_meta(complete=True)

    def _write_meta(self, complete: bool) -> None:
        meta = self.cache.meta()
        meta["num_tokens"] = sum(tokens for _, tokens in self.files)
        meta["complete"] = complete
        meta["collection"] = self.collection
        meta["shards"] = [{"file": name, "tokens": tokens} for name, tokens in self.files]
        partial = self.folder / f".{META_FILE}.partial"
        try:
            partial.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
            os.replace(partial, self.folder / META_FILE)  # never a half-written routing.json
        finally:  # stopped before the rename: not left in the user's folder
            partial.unlink(missing_ok=True)
