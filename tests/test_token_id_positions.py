"""Token-id invokes of different lengths, batched by a model wrapped without a tokenizer.

Ground truth: the plain transformers model run on each prompt alone (no padding, no moelens, no nnsight).
moelens left-pads the shorter invoke and masks the padding; a model with learned absolute positions
(GPT-2) gives the same logits only when each row's positions count from its first real token.
"""

from __future__ import annotations

import typing
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import moelens
from annotations import assert_annotations_hold
from moelens.model import _left_padded


def test_each_token_id_invoke_gets_the_logits_it_gets_alone():
    """Positions follow each row's mask: with 0..S-1 for every row, a left-padded row's tokens would sit the
    padding's length later, and its logits would not be the prompt's own under learned absolute positions."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dense model: wrap() says it found no MoE block
        wrapped = moelens.wrap(hf)
    long, short = torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        long_alone, short_alone = hf(long).logits, hf(short).logits
        with wrapped.trace() as tracer:
            with tracer.invoke(long):
                long_batched = wrapped.output.logits.save()
            with tracer.invoke(short):
                short_batched = wrapped.output.logits.save()
    assert long_batched.shape == short_batched.shape == (1, 6, 64)  # the short row, left-padded to 6
    torch.testing.assert_close(long_batched, long_alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(short_batched[:, -3:], short_alone, atol=1e-5, rtol=1e-4)


def test_left_padding_has_the_shapes_its_annotations_name():
    """The rows are of any lengths (one check on a shared axis name, as a user's jaxtyping import hook makes, failed
    whenever it met a row shorter than the longest); the padded ids and mask are [b, w], w the longest row."""
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    ids, mask = _left_padded(rows, pad_id=0)
    hints = typing.get_type_hints(_left_padded)
    assert_annotations_hold([("rows", rows, hints["rows"]), ("return", (ids, mask), hints["return"])])
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 5, 6]] and mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
