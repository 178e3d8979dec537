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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from jaxtyping import Float, Int
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import MoelensError
from ..families.scoring import score

#: The index of a slot that ran no expert (zaya's skip class, which transformers hands the experts as
#: expert 0 with weight 0): counted by no expert.
SKIPPED = -1

#: Version of the on-disk layout (``routing.json`` says which).
FORMAT_VERSION = 1
META_FILE = "routing.json"


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
        return int(self.token_ids.shape[0])

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor, the safetensors layout."""
        tensors = {"token_ids": self.token_ids, "text_index": self.text_index, "position": self.position}
        for kind in ("indices", "weights", "logits"):
            for layer, tensor in getattr(self, kind).items():
                tensors[f"{kind}.{layer}"] = tensor.contiguous()
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "Shard":
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
    _memory: list[Shard] = field(default_factory=list, repr=False)
    _folder: Path | None = field(default=None, repr=False)
    _files: list[tuple[str, int]] = field(default_factory=list, repr=False)

    # -- size -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """How many (real) tokens are cached."""
        if self._folder is not None:
            return sum(tokens for _, tokens in self._files)
        return sum(shard.num_tokens for shard in self._memory)

    @property
    def num_shards(self) -> int:
        return len(self._files) if self._folder is not None else len(self._memory)

    @property
    def on_disk(self) -> bool:
        """Whether the shards live on disk (read back one at a time)."""
        return self._folder is not None

    def __len__(self) -> int:
        return self.num_tokens

    # -- reading ----------------------------------------------------------------------------

    def shards(self) -> Iterator[Shard]:
        """The shards in corpus order (from disk one at a time when the cache is on disk)."""
        if self._folder is None:
            yield from self._memory
            return
        for name, _ in self._files:
            yield Shard.from_tensors(load_file(str(self._folder / name)))

    def _layer(self, layer: int) -> int:
        if layer not in self.num_experts:
            raise MoelensError(f"layer {layer} is not an MoE layer of this cache; its MoE layers are {self.layers}.")
        return layer

    def _cat(self, kind: str, layer: int | None = None) -> Tensor:
        parts = [getattr(s, kind) if layer is None else getattr(s, kind)[layer] for s in self.shards()]
        if not parts:
            raise MoelensError("this routing cache holds no tokens.")
        return torch.cat(parts)

    def indices(self, layer: int) -> Int[Tensor, "t k"]:
        """``[T, k]`` int64: the experts every cached token was routed to in ``layer``."""
        return self._cat("indices", self._layer(layer)).long()

    def weights(self, layer: int) -> Float[Tensor, "t k"]:
        """``[T, k]`` float32: each slot's routing weight in ``layer``."""
        return self._cat("weights", self._layer(layer)).float()

    def logits(self, layer: int) -> Float[Tensor, "t e"]:
        """``[T, E]`` float32: router logits in ``layer`` (collect with ``logits=True``)."""
        if not self.has_logits:
            raise MoelensError("this cache holds no router logits; collect it with collect_routing(..., logits=True).")
        return self._cat("logits", self._layer(layer)).float()

    def probs(self, layer: int) -> Float[Tensor, "t e"]:
        """``[T, E]`` the family's score of each expert (what ``moe.router_probs`` serves)."""
        return score(self.score[layer], self.logits(layer), self.softcap.get(layer, 0.0))

    def token_ids(self) -> Int[Tensor, " t"]:
        return self._cat("token_ids").long()

    def text_index(self) -> Int[Tensor, " t"]:
        return self._cat("text_index").long()

    def position(self) -> Int[Tensor, " t"]:
        return self._cat("position").long()

    def materialize(self) -> "RoutingCache":
        """An in-memory copy (one shard) of this cache."""
        shards = list(self.shards())
        return RoutingCache(**self._meta_fields(), _memory=[Shard.concat(shards)] if shards else [])

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
        folder = Path(folder)
        if self._folder is not None and folder.resolve() == self._folder.resolve():
            return folder
        writer = ShardWriter(folder, self)
        for shard in self.shards():
            writer.write(shard)
        writer.close()
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "RoutingCache":
        """Open a saved cache; its shards are read from disk when iterated."""
        folder = Path(folder)
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise MoelensError(f"{folder} holds no routing cache ({META_FILE} is missing); save one with cache.save(folder).")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT_VERSION:
            raise MoelensError(f"{meta_path} has format {meta.get('format')!r}; this moelens reads format {FORMAT_VERSION}.")
        per_layer = lambda name: {int(layer): value for layer, value in meta[name].items()}  # noqa: E731
        return cls(
            layers=[int(layer) for layer in meta["layers"]],
            num_experts=per_layer("num_experts"),
            top_k=per_layer("top_k"),
            score=per_layer("score"),
            softcap={int(layer): float(cap) for layer, cap in meta.get("softcap", {}).items()},
            family=meta.get("family"),
            model=meta.get("model"),
            num_texts=int(meta.get("num_texts", 0)),
            has_logits=bool(meta.get("has_logits")),
            _folder=folder,
            _files=[(entry["file"], int(entry["tokens"])) for entry in meta["shards"]],
        )


class ShardWriter:
    """Writes shards of a cache to a folder as they come, then its ``routing.json``."""

    def __init__(self, folder: str | Path, cache: RoutingCache) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("shard-*.safetensors"):
            stale.unlink()
        self.cache = cache
        self.files: list[tuple[str, int]] = []

    def write(self, shard: Shard) -> None:
        name = f"shard-{len(self.files):05d}.safetensors"
        save_file(shard.to_tensors(), str(self.folder / name))
        self.files.append((name, shard.num_tokens))

    def close(self) -> None:
        meta = self.cache.meta()
        meta["num_tokens"] = sum(tokens for _, tokens in self.files)
        meta["shards"] = [{"file": name, "tokens": tokens} for name, tokens in self.files]
        (self.folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
