"""Expert specialisation: how each expert's tokens split over classes you label.

Label every cached token (``per="token"``: a tensor aligned with the cache's
token order) or every corpus item (``per="text"``: a tensor indexed by text
index) with a class id in ``0..C-1`` (code / prose, a language, a topic; other
ids, e.g. 255, are ignored). Then ``share()`` is P(class | expert), ``base()``
P(class) over all routed slots, and ``lift()`` their ratio: above 1, the expert
gets more of that class than the layer as a whole. ``activation_rate()`` is
P(expert among a token's experts | class), and ``risk_difference(a, b)`` the
difference of two classes' rates (SteerMoE's detection of behaviour-linked experts
on paired prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from ..scalars import as_lone_int
from .cache import SKIPPED, RoutingCache, check_cache
from .checks import described, id_list

PER = ("token", "text")


@dataclass
class Specialisation:
    """Per layer and expert, the routed slots of each class.

    Attributes:
        layers: Decoder-layer indices.
        classes: Class names (column order).
        counts: ``[L, E, C]`` slots of class c routed to expert e.
        tokens: ``[L, C]`` tokens of class c the layer routed (at least one slot not skipped), and
        reached: ``[L, E, C]`` those of them with expert e among their slots (once, where several slots name it),
            for `activation_rate`; None in a `Specialisation` built by hand from counts alone.
        num_experts: Each layer's expert count, where layers have different ones (a converted model): E is the
            largest, and the rows past a layer's own experts are no experts of it; None: every layer has E.
    """

    layers: list[int]
    classes: list[str]
    counts: Int[Tensor, "l e c"]
    tokens: Int[Tensor, "l c"] | None = None
    reached: Int[Tensor, "l e c"] | None = None
    num_experts: list[int] | None = None

    def share(self) -> Float[Tensor, "l e c"]:
        """P(class | expert): each expert's slots split over the classes (rows sum to 1)."""
        return self.counts.double() / self.counts.sum(-1, keepdim=True).double().clamp(min=1)

    def base(self) -> Float[Tensor, "l c"]:
        """P(class) over each layer's slots."""
        totals = self.counts.sum(1).double()
        return totals / totals.sum(-1, keepdim=True).clamp(min=1)

    def lift(self) -> Float[Tensor, "l e c"]:
        """P(class | expert) / P(class): above 1, the expert favours the class."""
        return self.share() / self.base()[:, None, :].clamp(min=torch.finfo(torch.float64).tiny)

    def expert_share(self) -> Float[Tensor, "l e c"]:
        """P(expert | class): how each class's slots spread over the experts (sums to 1 over experts)."""
        return self.counts.double() / self.counts.sum(1, keepdim=True).double().clamp(min=1)

    def activation_rate(self) -> Float[Tensor, "l e c"]:
        """P(expert e among a token's experts | class c): the share of the class's routed tokens that the layer
        sends to the expert (``reached / tokens``: a token counts once for an expert several of its slots name, so
        each rate is at most 1, and they sum to at most k over experts); NaN for a class the layer routed no token
        of, and for the rows past a layer's own experts."""
        if self.tokens is None or self.reached is None:
            raise MoelensError("this Specialisation holds no token counts (it was built from counts alone): make it "
                               "with moelens.analysis.specialisation(cache, labels, ...), which counts them.")
        tokens = self.tokens[:, None, :].double()
        rate = self.reached.double() / tokens.where(tokens > 0, torch.nan)
        for row, experts in enumerate(self.num_experts or ()):
            rate[row, experts:] = torch.nan  # no expert of this layer: no rate, not 0
        return rate

    def risk_difference(self, a: int | str, b: int | str) -> Float[Tensor, "l e"]:
        """How much more often class ``a``'s tokens reach each expert than class ``b``'s: ``activation_rate`` of
        ``a`` minus that of ``b`` (SteerMoE's risk difference, on paired prompts labelled ``a`` and ``b``): from
        -1 to 1, positive for the experts ``a`` favours. ``a`` and ``b`` are class names or ids."""
        rate = self.activation_rate()
        return rate[..., self._class(a)] - rate[..., self._class(b)]

    def _class(self, name: int | str) -> int:
        """The column of class ``name`` (its name, or its id); a `MoelensError` naming the classes otherwise."""
        if isinstance(name, str) and name in self.classes:
            return self.classes.index(name)
        index = as_lone_int(name)
        if index is None or not 0 <= index < len(self.classes):
            raise MoelensError(f"no class {name!r}: the classes are {self.classes} (give a name or an id in "
                               f"0..{len(self.classes) - 1}).")
        return index


def _named_labels(labels: Any, classes: list[str] | None) -> tuple[Any, list[str] | None]:
    """Labels given as class names (a list or tuple of str) as their ids, with the class names: ``classes`` where
    given (a name not in it is refused), else the names in the order they first appear. Other labels pass as given."""
    if not (isinstance(labels, (list, tuple)) and labels and all(isinstance(label, str) for label in labels)):
        return labels, classes
    names = list(dict.fromkeys(labels)) if classes is None else classes
    unknown = [label for label in dict.fromkeys(labels) if label not in names]
    if unknown:
        raise MoelensError(f"labels name the class {unknown[0]!r}, which is not in classes={names}; add it there, or "
                           "leave classes out to take the names in the order the labels give them.")
    return [names.index(label) for label in labels], names


def _class_ids(labels: Any) -> Tensor:
    """``labels`` as a flat int64 tensor of class ids (floats only when they are whole numbers, bools as 0 and 1);
    fractions, which would be rounded into a class, and anything that is no list, tensor or array of numbers are
    refused."""
    try:
        ids = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.is_complex() or ids.is_floating_point() and not bool((ids == ids.round()).all()):
        raise MoelensError(f"labels must be integer class ids (a list, tensor or array of ints) or class names (a "
                           f"list of str), got {described(labels)}; a class id is a whole number (ids outside 0..C-1 "
                           "are ignored), never rounded.")
    return ids.long().flatten()


def _text_labels_error(labels: Tensor, cache: RoutingCache) -> MoelensError:
    """The refusal of per-text ``labels`` that are not one per corpus item of ``cache`` (too many: another corpus's
    labels, whose extra ones made classes of their own)."""
    return MoelensError(
        f"per-text labels must have one entry per corpus item ({cache.num_texts}), got {labels.shape[0]}."
    )


def specialisation(
    cache: RoutingCache, labels: Tensor, classes: list[str] | None = None, per: str = "token"
) -> Specialisation:
    """Count, per layer and expert, the routed slots of each labelled class (streams over shards).

    Args:
        cache: A routing cache.
        labels: Class ids: ``[T]`` one per cached token (``per="token"``) or one per
            corpus item (``per="text"``). Ids outside ``0..C-1`` are ignored. Or class names
            (a list of str): their places in ``classes``, or without it the names in the order
            they first appear become the classes.
        classes: Class names, a list: ``classes[c]`` names class id ``c`` (a set, which has no order, is refused;
            default: ``"0" .. "C-1"`` from the largest label below 255).
        per: ``"token"`` or ``"text"``.
    """
    check_cache(cache)
    if per not in PER:
        raise MoelensError(f"per={per!r} is not one of {PER}.")
    if classes is not None:
        classes = id_list("classes", classes, "class name", "{name}=['name of class 0', ...]", items="text",
                          order="the name of class 0, 1, ... (the label ids)")
        if not classes:
            raise MoelensError("classes is empty: name at least one class (or leave classes out to number them).")
    labels, classes = _named_labels(labels, classes)
    labels = _class_ids(labels)
    if per == "token" and labels.shape[0] != cache.num_tokens:
        raise MoelensError(
            f"per-token labels must have one entry per cached token ({cache.num_tokens}), got {labels.shape[0]}."
        )
    if per == "text" and labels.shape[0] < cache.num_texts:
        raise _text_labels_error(labels, cache)
    if classes is None:
        if (labels > 255).any():  # 255 marks a token to leave out; a class above it would be dropped unseen
            raise MoelensError(
                f"labels hold class ids above 255 (up to {int(labels.max())}): without classes, ids from 255 up are "
                f"left out (255 marks tokens to skip); name the classes (classes=[...], {int(labels.max()) + 1} "
                "names) to count them all."
            )
        valid = labels[(labels >= 0) & (labels < 255)]
        classes = [str(c) for c in range(int(valid.max()) + 1 if valid.numel() else 1)]
    num_classes = len(classes)
    width = max(cache.num_experts.values())
    counts = torch.zeros(len(cache.layers), width * num_classes, dtype=torch.int64)
    tokens = torch.zeros(len(cache.layers), num_classes, dtype=torch.int64)
    reached = torch.zeros_like(counts)
    start = 0
    for shard in cache._shards():
        if per == "token":
            mine = labels[start : start + shard.num_tokens]
        else:
            mine = labels[shard.text_index.long()]
        start += shard.num_tokens
        keep = (mine >= 0) & (mine < num_classes)
        for row, layer in enumerate(cache.layers):
            indices = shard.indices[layer].long()[keep].sort(-1).values  # a token's slots in order, SKIPPED first
            keys = indices * num_classes + mine[keep][:, None]
            routed = indices != SKIPPED
            first = torch.ones_like(routed)  # the first slot of each expert in the row
            first[:, 1:] = indices[:, 1:] != indices[:, :-1]
            counts[row] += torch.bincount(keys[routed], minlength=width * num_classes)
            reached[row] += torch.bincount(keys[routed & first], minlength=width * num_classes)
            tokens[row] += torch.bincount(mine[keep][routed.any(-1)], minlength=num_classes)
    if per == "text" and labels.shape[0] > cache.num_texts:  # after the shards: a damaged cache is named first
        raise _text_labels_error(labels, cache)
    shape = (len(cache.layers), width, num_classes)
    experts = [cache.num_experts[layer] for layer in cache.layers]
    return Specialisation(layers=list(cache.layers), classes=list(classes), counts=counts.view(shape), tokens=tokens,
                          reached=reached.view(shape), num_experts=experts if len(set(experts)) > 1 else None)
