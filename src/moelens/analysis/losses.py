"""`token_losses`: each text's next-token loss, token by token, with or without interventions.

The measure of what an ablation or a steer does to the model's predictions: run a corpus through the model with
``intervene`` and without, and compare the losses at the tokens of the kind you care about (digits, code, a
language). Texts are tokenized and cut into windows as `collect_routing` does, and batched with padding that never
reaches a real token's loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Float
from torch import Tensor

from ..components import Moe
from ..errors import MoelensError
from ..model import check_wrapped
from ..modules import evaluating
from . import corpus as corpora
from .checks import check_intervene
from .collect import counted_batches


def token_losses(
    model: Any,
    corpus: Any,
    *,
    intervene: Callable[[Moe], None] | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
) -> list[Float[Tensor, " n"]]:
    """Each corpus item's next-token loss at each of its tokens, in nats.

    Args:
        model: A model from `moelens.wrap` / `moelens.load` with a language-model head (its output has ``logits``).
        corpus: Texts (needs the model's tokenizer), token-id sequences or a ``[N, S]`` token-id tensor, as
            `collect_routing` takes them (texts tokenized without special tokens).
        intervene: Called in each batch's trace with every MoE block the model runs on every token, in model order
            (``lambda moe: moelens.ablate(moe, 3) if moe.layer == 1 else None``): the losses are those of the model
            with its interventions.
        batch_size: Windows per forward.
        max_length: Window length (default: the model's context, at most 512); a longer item is cut into windows.

    Returns:
        One float32 tensor per corpus item, ``[n]`` for its ``n`` tokens: entry ``j`` is ``-log p(token j | the
        tokens before it in its window)``, NaN at each window's first token (no context to predict it from: token 0,
        and the first of each later window). An empty item gives an empty tensor.
    """
    check_wrapped(model)
    check_intervene(intervene)
    tally = corpora.Tally()
    stream = corpora.batches(corpus, corpora.tokenizer_of(model), batch_size=batch_size,
                             max_length=corpora.window_length(model, max_length), pad=corpora.pad_id(model),
                             vocab=corpora.vocab_size(model), tally=tally)
    blocks = [moe for moe in model.moes if isinstance(moe, Moe) and not moe.runs_only_on]
    windows: dict[int, list[tuple[int, Tensor]]] = {}
    with evaluating(model._module):  # the pass in eval mode: no dropout, no router jitter
        for batch in counted_batches(model, stream):
            targets = batch.input_ids[:, 1:].long()
            with torch.no_grad(), model.trace(**batch.kwargs()):
                for moe in blocks if intervene is not None else ():
                    intervene(moe)
                logits = _logits_of(model.output)[:, :-1]  # only the [b, s - 1] losses leave the trace
                log_probs = logits.float().log_softmax(-1)
                next_losses = (-log_probs.gather(-1, targets.to(logits.device)[..., None])[..., 0]).cpu().save()
            for row, (text, offset) in enumerate(zip(batch.text_index.tolist(), batch.offset.tolist())):
                length = int(batch.attention_mask[row].sum())
                losses = torch.full((length,), float("nan"))
                losses[1:] = next_losses[row, : length - 1]
                windows.setdefault(text, []).append((offset, losses))
    return [torch.cat([losses for _, losses in sorted(windows[text], key=lambda window: window[0])])
            if text in windows else torch.zeros(0) for text in range(tally.items)]


def _logits_of(output: Any) -> Tensor:
    """The logits of a model's output (``[b, s, V]``); refused where it has none (a model with no language-model
    head)."""
    logits = getattr(output, "logits", None)
    if not isinstance(logits, Tensor):
        raise MoelensError(f"token_losses needs the model's next-token logits, and its output ({type(output).__name__}) "
                           "has none: load the model with its language-model head (AutoModelForCausalLM).")
    return logits
