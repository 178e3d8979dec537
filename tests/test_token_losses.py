"""`analysis.token_losses`: each text's next-token loss, token by token.

Ground truth: the plain transformers model (moelens-tiny loaded by transformers) run on each window of each text
alone, without padding, its loss computed here by hand; an ablation made there by a forward pre-hook on the experts.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import moelens
from moelens import analysis
from moelens.data import TINY_MODEL_PATH

TEXTS = ["In 1999 there were 365 days.", "ok", "", "def mean(values): return sum(values) / len(values)"]


@pytest.fixture(scope="module")
def models():
    return moelens.load(), transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).eval()


def plain_losses(reference: torch.nn.Module, ids: list[int], window: int) -> list[float]:
    """The loss of each token of ``ids`` given the tokens before it in its window of ``window`` tokens (NaN at a
    window's first token), from one plain forward per window."""
    losses = []
    for start in range(0, len(ids), window):
        piece = ids[start: start + window]
        with torch.no_grad():
            log_probs = reference(torch.tensor([piece])).logits[0].float().log_softmax(-1)
        losses += [math.nan] + [-float(log_probs[j - 1, piece[j]]) for j in range(1, len(piece))]
    return losses


@pytest.mark.parametrize("window", [None, 5])
def test_token_losses_are_each_window_s_plain_losses_and_an_intervention_s(models, window):
    """Batched with padding (batch_size 3 puts texts of 1 to 16 tokens together) and cut into windows of 5, the
    losses are each window's own, NaN at its first token; with intervene (zero-ablating expert 0 of layer 1), those of
    the plain model whose layer-1 experts get expert 0's weights zeroed."""
    model, reference = models
    tokenized = [model.tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    length = window or 512
    losses = analysis.token_losses(model, TEXTS, batch_size=3, max_length=window)
    assert [len(row) for row in losses] == [len(ids) for ids in tokenized]
    for row, ids in zip(losses, tokenized):
        torch.testing.assert_close(row, torch.tensor(plain_losses(reference, ids, length)), atol=2e-5, rtol=1e-5,
                                   equal_nan=True)

    def zeroed(module, args):
        return args[0], args[1], args[2].masked_fill(args[1] == 0, 0), *args[3:]

    hook = reference.model.layers[1].mlp.experts.register_forward_pre_hook(zeroed)
    try:
        ablated = analysis.token_losses(model, TEXTS, batch_size=3, max_length=window,
                                        intervene=lambda moe: moelens.ablate(moe, 0) if moe.layer == 1 else None)
        for row, ids in zip(ablated, tokenized):
            torch.testing.assert_close(row, torch.tensor(plain_losses(reference, ids, length)), atol=2e-5, rtol=1e-5,
                                       equal_nan=True)
    finally:
        hook.remove()
    assert not torch.allclose(ablated[0][1:], losses[0][1:])


def test_token_losses_refuse_a_model_without_logits_and_an_intervene_that_is_no_function(models):
    model, reference = models
    with pytest.raises(moelens.MoelensError, match=r"model must be a model wrapped by moelens"):
        analysis.token_losses(reference, TEXTS)  # was AttributeError: no attribute 'moes'
    with pytest.raises(moelens.MoelensError, match=r"intervene takes a function of an MoE block .*got dict"):
        analysis.token_losses(model, TEXTS, intervene={1: 0})
    base = moelens.wrap(transformers.AutoModel.from_pretrained(TINY_MODEL_PATH), tokenizer=model.tokenizer)
    with pytest.raises(moelens.MoelensError, match=r"token_losses needs the model's next-token logits, and its output "
                                                   r"\(\w+\) has none"):
        analysis.token_losses(base, TEXTS)
