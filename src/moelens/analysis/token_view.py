"""The per-token expert view of one text: which experts every token goes to, in every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from .cache import SKIPPED, RoutingCache, layer_row
from .checks import check_count, id_list
from .collect import collect_routing, refusals_count_a_run
from .corpus import tokenizer_of, tokenizer_output_hint
from .text import token_strings


@dataclass
class TokenRouting:
    """The routing of each token of one text.

    Attributes:
        token_ids: ``[n]`` the text's token ids.
        tokens: The tokens as printable strings.
        layers: Decoder-layer indices of the MoE layers.
        indices: ``[L, n, k]`` each token's experts per layer, highest weight first (`SKIPPED` in
            the slots a layer of smaller top-k lacks).
        weights: ``[L, n, k]`` their routing weights.
        probs: ``[L, n, E]`` the router's score of every expert (None without logits); a router that scores
            more columns than experts (zaya's skip class) keeps them, past E.
        num_experts: E of each layer.
    """

    token_ids: Int[Tensor, " n"]
    tokens: list[str]
    layers: list[int]
    indices: Int[Tensor, "l n k"]
    weights: Float[Tensor, "l n k"]
    probs: Float[Tensor, "l n e"] | None = None
    num_experts: list[int] = field(default_factory=list)

    def __repr__(self) -> str:  # the default dumps every token's string and every tensor
        k = self.indices.shape[-1] if self.indices.dim() == 3 else 0
        probs = ", with probs" if self.probs is not None else ""
        return (f"TokenRouting({len(self.tokens)} tokens, layers {self.layers}, top-{k} of experts {self.num_experts}"
                f"{probs}; .table() shows them)")

    def top1(self) -> Int[Tensor, "l n"]:
        """``[L, n]`` each token's highest-weighted expert per layer."""
        return self.indices[..., 0]

    def table(self, layers: list[int] | None = None, width: int = 14, max_tokens: int | None = None) -> str:
        """A text table: one row per token, one column per layer, cells ``expert:weight`` per slot; ``width``: the
        most characters of each token shown (at least 1); ``max_tokens``: the first tokens only (None: all), with a
        last line saying how many are left out."""
        width = check_count("width", width)
        shown = len(self.tokens) if max_tokens is None else min(len(self.tokens), check_count("max_tokens", max_tokens))
        rows = [layer_row(self.layers, layer, "token view")
                for layer in (self.layers if layers is None else id_list("layers", layers, "layer"))]
        layers = [self.layers[row] for row in rows]
        token_width = min(max([len(token) for token in self.tokens] + [5]), width)
        cells = []
        for position, token in enumerate(self.tokens[:shown]):
            slots = [
                " ".join(
                    _slot(int(self.indices[row, position, slot]), float(self.weights[row, position, slot]))
                    for slot in range(self.indices.shape[-1])
                )
                for row in rows
            ]
            cells.append((token[:token_width], slots))
        column = max([len(slot) for _, slots in cells for slot in slots] + [8])
        header = f"{'token':<{token_width}}  " + "  ".join(f"{'layer ' + str(layer):<{column}}" for layer in layers)
        lines = [header, "-" * len(header)]
        lines += [f"{token:<{token_width}}  " + "  ".join(f"{slot:<{column}}" for slot in slots) for token, slots in cells]
        if shown < len(self.tokens):
            left = len(self.tokens) - shown
            lines.append(f"... {left} more token{'s' * (left != 1)}")
        return "\n".join(lines)


def _slot(expert: int, weight: float) -> str:
    """One slot of the table: ``expert:weight``, or ``skip`` for a slot that ran no expert."""
    return "skip" if expert == SKIPPED else f"{expert}:{weight:.2f}"


def token_routing(
    model: Any, text: Any, *, logits: bool = True, layers: list[int] | None = None, blocks: str | list[str] | None = None
) -> TokenRouting:
    """Run ``text`` (a string, or token ids; a batch of one, ``[1, n]``, is that one text) and return every
    token's routing in every MoE layer.

    Slots are sorted by weight (highest first) whatever order the family returns them in. A long
    text is run in the windows `collect_routing` cuts by default (the model's context, at most 512
    tokens), each from a fresh context.

    Args:
        model: A model from `moelens.wrap` / `moelens.load` (a string ``text`` needs its tokenizer).
        text: The text, or its token ids.
        logits: Also read the router logits, so the result's ``probs`` holds each expert's score (False: ``probs``
            is None, and the run reads less).
        layers: Decoder-layer indices of the MoE layers to route (default: every MoE layer), as `collect_routing`
            takes them.
        blocks: Only blocks whose module path contains this text (or one of these), for models with several MoE
            blocks in a layer, as `collect_routing` takes it.

    Returns:
        The `TokenRouting` of the text's tokens (``.table()`` prints it, `moelens.analysis.plots.plot_token_routing`
        draws it).
    """
    with refusals_count_a_run(model):
        one = _one_text(text)
    cache = collect_routing(model, [one], batch_size=1, logits=logits, layers=layers, blocks=blocks,
                            dtype=torch.float32, stop_early=True, progress=False)
    if cache.num_tokens == 0:
        raise MoelensError(f"the text {text!r:.60} has no tokens: the tokenizer made none of it; pass text with words "
                           "in it." if isinstance(text, str) else "token_routing got no token ids; pass at least one.")
    return routing_of_text(cache, 0, tokenizer_of(model))


def routing_of_text(cache: RoutingCache, text: int, tokenizer: Any) -> TokenRouting:
    """The `TokenRouting` of the tokens of ``cache``'s text ``text`` (its ``probs`` where the cache holds logits),
    their strings made with ``tokenizer``."""
    kept = cache.text_index() == text
    indices = _stacked([cache.indices(layer)[kept] for layer in cache.layers], SKIPPED)
    weights = _stacked([cache.weights(layer)[kept] for layer in cache.layers], 0.0)
    order = torch.argsort(weights, dim=-1, descending=True, stable=True)
    ids = cache.token_ids()[kept]
    return TokenRouting(
        token_ids=ids,
        tokens=token_strings(tokenizer, ids.tolist()),
        layers=list(cache.layers),
        indices=indices.gather(-1, order),
        weights=weights.gather(-1, order),
        probs=_stacked([cache.probs(layer)[kept] for layer in cache.layers], 0.0) if cache.has_logits else None,
        num_experts=[cache.num_experts[layer] for layer in cache.layers],
    )


#: numpy dtype kinds that hold no token ids (bool, floats, text, bytes, dates, raw data); an object array goes on to
#: the corpus' checks of its items.
NO_ID_KINDS = "bfcSUMmV"


def _one_text(text: Any) -> Any:
    """``text`` as one corpus item: a batch of one (``[1, n]`` ids, ``["text"]``) unwrapped; several texts refused."""
    if isinstance(text, (list, tuple)):
        nested = [item for item in text if not isinstance(item, (int, np.integer))]
        if len(text) == 1 and nested:
            return text[0]
        if nested:
            raise MoelensError(
                f"token_routing routes one text (a string, or one sequence of token ids), got a list of {len(text)} "
                "texts; route each on its own, or all of them with analysis.collect_routing(model, texts) and read "
                "the cache."
            )
    if not isinstance(text, (Sequence, np.ndarray, Tensor)):  # a string too
        raise MoelensError(f"token_routing routes one text: a string or a sequence of token ids, got "
                           f"{type(text).__name__}{tokenizer_output_hint(text)}.")
    if isinstance(text, np.ndarray) and text.ndim == 0 and text.dtype.kind == "U":  # one text, as numpy holds it
        return str(text)
    if isinstance(text, np.ndarray) and text.size and text.dtype.kind in NO_ID_KINDS:
        raise MoelensError(f"token_routing routes one text: a string or a sequence of token ids, got a numpy array of "
                           f"{text.dtype}; pass the text as a str (or the ids as integers).")
    shape = getattr(text, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] == 1:
        return text[0]
    if shape is not None and len(shape) > 1:
        raise MoelensError(
            f"token_routing routes one text, a sequence of token ids [n] (or a batch of one, [1, n]), got token ids "
            f"of shape {tuple(shape)}; route each row on its own, or all with analysis.collect_routing(model, rows)."
        )
    return text


def _stacked(per_layer: list[Tensor], fill: int | float) -> Tensor:
    """``[L, n, width]`` from each layer's ``[n, width_l]``: layers of fewer experts or slots (a model
    converted with different E or k per layer) are padded with ``fill`` (`SKIPPED` slots, weight and
    probability 0)."""
    width = max(tensor.shape[-1] for tensor in per_layer)
    return torch.stack([torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]), value=fill) for tensor in per_layer])
