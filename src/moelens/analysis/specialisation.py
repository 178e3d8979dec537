"""Expert specialisation: how each expert's tokens split over classes you label.

Label every cached token (``per="token"``: a tensor aligned with the cache's
token order) or every corpus item (``per="text"``: a tensor indexed by text
index) with a class id in ``0..C-1`` (code / prose, a language, a topic; a
negative id or 255 leaves the token out), or with class names, or give a function
of a token's text that names its class. Then ``share()``
is P(class | expert), ``base()`` P(class) over all routed slots, and ``lift()``
their ratio: above 1, the expert gets more of that class than the layer as a
whole. ``activation_rate()`` is P(expert among a token's experts | class), and
``risk_difference(a, b)`` the difference of two classes' rates (SteerMoE's
detection of behaviour-linked experts on paired prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any, Callable

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from ..scalars import as_lone_int
from .cache import SKIPPED, RoutingCache, check_cache, layer_row
from .checks import described, id_list, shown
from .text import token_text

PER = ("token", "text")
#: What `Specialisation.top_experts` ranks by: its methods of these names.
TOP_BY = ("lift", "share", "expert_share", "activation_rate")


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

    def __repr__(self) -> str:  # the dataclass' own printed five [L, E, C] tensors
        return (f"Specialisation(layers={self.layers}, classes={self.classes}, experts={self.counts.shape[1]}, "
                f"slots={int(self.counts.sum())})")

    def row(self, layer: int) -> int:
        """The row of decoder layer ``layer`` in every ``[L, ...]`` result."""
        return layer_row(self.layers, layer, "specialisation")

    def top_experts(self, name: int | str, layer: int, n: int = 3, by: str = "lift") -> list[int]:
        """The ``n`` experts of decoder layer ``layer`` ranked by how much they favour class ``name`` (a class name
        or id), best first, by ``by``: ``"lift"``, ``"share"``, ``"expert_share"`` or ``"activation_rate"`` (the
        methods of those names); past the experts the class reaches, the list goes on with those it favours less
        (a lift of 1 or below). Ties go to the lower expert id. A class with no slot in the layer: ``[]``."""
        if by not in TOP_BY:
            raise MoelensError(f"by={by!r} is not one of {TOP_BY}.")
        row, column = self.row(layer), self._class(name)
        count = as_lone_int(n)
        if count is None or isinstance(n, bool) or count < 1:
            raise MoelensError(f"n={shown(n)}: give how many experts to list, a whole number of at least 1.")
        if not self.counts[row, :, column].any():
            return []
        own = self.num_experts[row] if self.num_experts else self.counts.shape[1]  # no rows past its own experts
        values = getattr(self, by)()[row, :own, column]
        order = sorted(range(own), key=lambda expert: (-float(values[expert]), expert))
        return order[:count]

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


def _labels_of_tokens(cache: RoutingCache, label_of: Callable[[str], Any], classes: list[str] | None
                      ) -> tuple[list[int], list[str] | None]:
    """One class id per cached token, and the class names: ``label_of`` of the token's text (its id decoded alone by
    the cache's tokenizer), called once per distinct id, gives a class name (its place in ``classes``, or without
    them in the order the tokens first give the names) or id; None leaves the token out (-1). Refused: a cache
    without a tokenizer, a label that is no name or id, names mixed with ids, a name ``classes`` lacks."""
    tokenizer = cache.tokenizer
    if tokenizer is None:
        raise MoelensError("labels as a function need the tokens' text, and this cache has no tokenizer to decode "
                           "them with: collect_routing(model, ...) keeps the model's; load a saved cache with "
                           "RoutingCache.load(folder, tokenizer=model.tokenizer).")
    ids = cache.token_ids().tolist()
    labelled: dict[int, Any] = {}
    for token in dict.fromkeys(ids):
        text = token_text(tokenizer, token)
        label = label_of(text)
        if label is not None and (isinstance(label, bool) or not isinstance(label, (str, int, np.integer))):
            raise MoelensError(f"labels: the function gave {shown(label)} for the token {text!r} (id {token}); give "
                               "a class name (str), a class id (int), or None to leave the token out.")
        labelled[token] = label
    if all(label is None for label in labelled.values()):
        raise MoelensError("labels: the function gave None for every token, leaving them all out; give a class name "
                           "or id for the tokens to count.")
    kinds = {isinstance(label, str) for label in labelled.values() if label is not None}
    if len(kinds) > 1:
        raise MoelensError("labels: the function gave class names for some tokens and class ids for others; give "
                           "one kind (None leaves a token out).")
    if kinds != {True}:
        return [-1 if labelled[token] is None else int(labelled[token]) for token in ids], classes
    given = [labelled[token] for token in ids]
    names = list(dict.fromkeys(name for name in given if name is not None)) if classes is None else classes
    unknown = next((name for name in given if name is not None and name not in names), None)
    if unknown is not None:
        raise MoelensError(f"labels: the function names the class {unknown!r}, which is not in classes={names}; add "
                           "it there, or leave classes out to take the names in the order the tokens give them.")
    column = {name: index for index, name in enumerate(names)}
    return [-1 if name is None else column[name] for name in given], names


def _named_labels(labels: Any, classes: list[str] | None) -> tuple[Any, list[str] | None]:
    """Labels given as class names (a list or tuple of str, or a numpy array of them; rows of equal length, as
    ``[N, S]`` ids, flattened) as their ids, with the class names: ``classes`` where given (a name not in it is
    refused), else the names in the order they first appear. Other labels pass as given."""
    if isinstance(labels, np.ndarray) and labels.dtype.kind in "USO":  # names (or objects): torch takes no such array
        labels = labels.tolist()
    rows = isinstance(labels, (list, tuple)) and labels and all(isinstance(row, (list, tuple, np.ndarray))
                                                              for row in labels)
    if rows and len({len(row) for row in labels}) == 1 and all(isinstance(name, str) for row in labels for name in row):
        labels = [str(name) for row in labels for name in row]  # [N, S] names, flattened as ids of that shape are
    if not (isinstance(labels, (list, tuple)) and labels and all(isinstance(label, str) for label in labels)):
        return labels, classes
    names = list(dict.fromkeys(labels)) if classes is None else classes
    unknown = [label for label in dict.fromkeys(labels) if label not in names]
    if unknown:
        raise MoelensError(f"labels name the class {unknown[0]!r}, which is not in classes={names}; add it there, or "
                           "leave classes out to take the names in the order the labels give them.")
    return [names.index(label) for label in labels], names


def _place(shape: tuple[int, ...], index: int) -> str:
    """Where item ``index`` of the flattened labels of ``shape`` is in the labels as given: ``labels[i][j]``."""
    return "labels" + "".join(f"[{int(i)}]" for i in np.unravel_index(index, shape))


def _labels_error(labels: Any, problem: str) -> MoelensError:
    """The refusal of ``labels`` that are no class ids or names, saying why (``problem``) where that is known."""
    return MoelensError(f"labels must be integer class ids (a list, tensor or array of ints) or class names (a list "
                        f"of str), got {described(labels)}{'; ' + problem if problem else ''}.")


def _odd_label(labels: Any) -> str:
    """Why torch makes no tensor of ``labels`` (a list): a ragged nesting, or its first item, by place, that is no
    number (or, where most are class names, no name); "" where neither is found."""
    try:
        grid = np.array(labels, dtype=object)  # a ragged nesting keeps its uneven lists as cells
    except (TypeError, ValueError):
        return ""
    shape, cells = grid.shape, grid.reshape(-1)
    if not shape:  # no list: described() says what it is
        return ""
    sizes = [len(cell) if isinstance(cell, (list, tuple, Tensor, np.ndarray)) else None for cell in cells]
    other = next((i for i, size in enumerate(sizes) if size != sizes[0]), None)
    if other is not None and any(size is not None for size in sizes):
        held = [f"holds {sizes[i]} labels" if sizes[i] is not None else f"is {shown(cells[i])}" for i in (0, other)]
        return (f"they are ragged, {_place(shape, 0)} {held[0]} and {_place(shape, other)} {held[1]}, so they are "
                "neither one label per text nor one per token: pass one label per cached token, flat in corpus order "
                "([label for text in labels for label in text]), or one label per text with per=\"text\"")
    names = 2 * sum(isinstance(cell, str) for cell in cells) > len(cells)  # mostly names: the odd one is no name
    for index, cell in enumerate(cells):
        if names and not isinstance(cell, str):
            return (f"{_place(shape, index)} is {shown(cell)} among class names: give every label as a class name "
                    "(str), or every one as an integer class id (-1 leaves a token or text out)")
        if not names and not (isinstance(cell, (Number, np.generic)) or isinstance(cell, Tensor) and cell.ndim == 0):
            return f"{_place(shape, index)} is {shown(cell)}, no class id (an integer; -1 leaves a token or text out)"
    return ""


def _class_ids(labels: Any) -> Tensor:
    """``labels`` as an int64 tensor of class ids, in the shape given (floats only when they are whole numbers, bools
    as 0 and 1); a fraction, which would be rounded into a class, an infinite or NaN label, which would become an id
    out of range, and anything that is no list, tensor or array of numbers are refused, naming the first bad item."""
    try:
        ids = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        raise _labels_error(labels, _odd_label(labels)) from None
    if ids.is_complex():
        raise _labels_error(labels, "a class id is a whole number, not a complex one")
    if ids.is_floating_point():
        whole = (ids.isfinite() & (ids == ids.round())).flatten()
        if not whole.all():
            index = int(torch.nonzero(~whole)[0])
            value = ids.flatten()[index].item()
            place = _place(tuple(ids.shape), index)
            raise _labels_error(labels, f"a class id is a whole number, never rounded: {place} is {value!r}, a fraction"
                                if np.isfinite(value) else f"{place} is {value!r}, no class id (a whole number; -1 "
                                "leaves a token or text out)")
    return ids.long()


def _text_labels_error(labels: Tensor, cache: RoutingCache) -> MoelensError:
    """The refusal of per-text ``labels`` that are not one per corpus item of ``cache`` (too many: another corpus's
    labels, whose extra ones made classes of their own)."""
    hint = (f" These are one per cached token ({cache.num_tokens}): leave per out (per=\"token\")."
            if labels.shape[0] == cache.num_tokens else " Empty items count too (they have a text_index).")
    return MoelensError(
        f"per-text labels must have one entry per corpus item ({cache.num_texts}), got {labels.shape[0]}.{hint}"
    )


def specialisation(
    cache: RoutingCache, labels: Tensor | Sequence[int | str] | np.ndarray | Callable[[str], Any],
    classes: Sequence[str] | None = None, per: str = "token"
) -> Specialisation:
    """Count, per layer and expert, the routed slots of each labelled class (streams over shards).

    Args:
        cache: A routing cache.
        labels: Class ids: ``[T]`` one per cached token (``per="token"``) or one per
            corpus item (``per="text"``). A negative id or 255 leaves its token (text) out; other ids
            outside ``0..C-1`` are refused (1-based ids, say, would drop a class). Or class names
            (a list, tuple or numpy array of str): their places in ``classes``, or without it the names
            in the order they first appear become the classes. A fraction, NaN, infinity, None, an item of
            another kind and a ragged nesting (per-text lists of per-token labels) are refused by place.
            Or a function of a token's text (its id decoded alone by the cache's tokenizer, a SentencePiece word
            start with its space: ``" 7"``, ``"the"``; part of a character's bytes reads ``"\ufffd"``)
            giving its class name (or id), or None to leave it out, called once per distinct token id
            (``per="token"`` only).
        classes: Class names, a list of str: ``classes[c]`` names class id ``c`` (a set, which has no order, and
            an item that is no text, such as the label values themselves, are refused; default: ``"0" .. "C-1"``
            from the largest label below 255).
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
        odd = next((c for c, name in enumerate(classes) if not isinstance(name, str)), None)
        if odd is not None:
            raise MoelensError(f"classes[{odd}] is {shown(classes[odd])}, no class name: classes names the classes by "
                               "text, classes[c] naming label id c (0, 1, ...); to count labels by their values, pass "
                               "them as names (labels=[str(label) for label in labels], with classes of str or left "
                               "out), or pass ids 0..C-1 with a name for each.")
    if callable(labels):
        if per != "token":
            raise MoelensError("labels as a function label each token by its text; per=\"text\" takes one label "
                               "per corpus item: pass them as a list.")
        labels, classes = _labels_of_tokens(cache, labels, classes)
    labels, classes = _named_labels(labels, classes)
    ids = _class_ids(labels)
    labels = ids.flatten()
    if per == "token" and labels.shape[0] != cache.num_tokens:
        hint = (f" These are one per corpus item ({cache.num_texts}): pass per=\"text\"."
                if labels.shape[0] == cache.num_texts else " To label each corpus item instead, pass per=\"text\".")
        raise MoelensError(
            f"per-token labels must have one entry per cached token ({cache.num_tokens}), got {labels.shape[0]}.{hint}"
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
    outside = torch.nonzero((labels >= num_classes) & (labels != 255)).flatten()  # only where classes are given
    if outside.numel():
        index = int(outside[0])
        raise MoelensError(
            f"{_place(tuple(ids.shape), index)} is {int(labels[index])}, no class id of classes={shown(classes)}, "
            f"which are 0..{num_classes - 1}; only a negative id or 255 leaves a token or text out, so this label "
            f"would be dropped unseen. Number the classes from 0 (1-based labels: subtract 1), name every class "
            f"(classes=[...], {int(labels.max()) + 1} names), or pass the labels as class names."
        )
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
        every = bool(keep.all())  # then no token to leave out: no copy of each layer's indices
        kept = mine if every else mine[keep]
        for row, layer in enumerate(cache.layers):
            indices = shard.indices[layer].long()
            indices = (indices if every else indices[keep]).sort(-1).values  # a token's slots in order, SKIPPED first
            keys = indices * num_classes + kept[:, None]
            routed = indices != SKIPPED
            first = torch.ones_like(routed)  # the first slot of each expert in the row
            first[:, 1:] = indices[:, 1:] != indices[:, :-1]
            counts[row] += torch.bincount(keys[routed], minlength=width * num_classes)
            reached[row] += torch.bincount(keys[routed & first], minlength=width * num_classes)
            tokens[row] += torch.bincount(kept[routed.any(-1)], minlength=num_classes)
    if per == "text" and labels.shape[0] > cache.num_texts:  # after the shards: a damaged cache is named first
        raise _text_labels_error(labels, cache)
    shape = (len(cache.layers), width, num_classes)
    experts = [cache.num_experts[layer] for layer in cache.layers]
    return Specialisation(layers=list(cache.layers), classes=list(classes), counts=counts.view(shape), tokens=tokens,
                          reached=reached.view(shape), num_experts=experts if len(set(experts)) > 1 else None)
