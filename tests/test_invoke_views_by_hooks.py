"""Per-invoke token views against torch hooks on an unwrapped deep copy run on the same padded batch: invokes of
text and ids of different lengths (one of one token, one of two prompts), an empty invoke (every row), and a write
of each routing value in one invoke only (the other invokes' rows untouched)."""

from __future__ import annotations

import copy

import nnsight
import pytest
import torch

import moelens
from groundtruth import ascii_tokenizer
from moelens.testing import tiny_model

FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]
VALUES = ("router_logits", "expert_weights", "expert_indices", "routed_output", "mlp_output")


def hooked(reference, moe, edit=None):
    """Run ``reference`` with hooks on ``moe``'s router, experts and block: (flat values, remove)."""
    path = moe.path.removeprefix("model.")
    block = reference.get_submodule(path)
    router, experts = block.get_submodule(moe.family.router), block.get_submodule(moe.family.experts)
    seen = {}

    def pre(module, args):
        hidden, indices, weights = args[:3]
        if edit and edit[0] in ("expert_weights", "expert_indices"):
            target = weights if edit[0] == "expert_weights" else indices
            target = edit[1](target.clone())
            weights, indices = (target, indices) if edit[0] == "expert_weights" else (weights, target)
        seen["expert_indices"], seen["expert_weights"] = indices.clone(), weights.clone()
        return (hidden, indices, weights, *args[3:])

    def experts_out(module, args, output):
        if edit and edit[0] == "routed_output":
            output = edit[1](output.clone())
        seen["routed_output"] = output.reshape(-1, output.shape[-1]).clone()
        return output

    def block_out(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        if edit and edit[0] == "mlp_output":
            tensor = edit[1](tensor.reshape(-1, tensor.shape[-1]).clone()).view_as(tensor)
            output = (tensor, *output[1:]) if isinstance(output, tuple) else tensor
        seen["mlp_output"] = tensor.reshape(-1, tensor.shape[-1]).clone()
        return output

    handles = [router.register_forward_hook(lambda m, a, o: seen.__setitem__("router_logits", o[0].clone())),
               experts.register_forward_pre_hook(pre), experts.register_forward_hook(experts_out),
               block.register_forward_hook(block_out)]
    return seen, lambda: [handle.remove() for handle in handles]


def left_padded(rows):
    width = max(len(row) for row in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):], mask[index, width - len(row):] = torch.tensor(row), 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_and_id_invokes_of_different_lengths_and_an_empty_invoke_are_their_rows(family):
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = next(m for m in wrapped.moes if not m.runs_only_on)
    invokes = ["hello world", ["hi", "abcde"], "x", torch.tensor([[40, 41, 42, 43]])]
    read = {}
    with torch.no_grad(), wrapped.trace() as tracer:
        for index, prompt in enumerate(invokes):
            with tracer.invoke(prompt):
                read[index] = nnsight.save({name: getattr(moe, name).save() for name in VALUES})
        with tracer.invoke():
            read["all"] = nnsight.save({name: getattr(moe, name).save() for name in VALUES})
    tokenizer = ascii_tokenizer()
    rows = [tokenizer(text)["input_ids"] for text in ("hello world", "hi", "abcde", "x")] + [[40, 41, 42, 43]]
    ids, mask, positions = left_padded(rows)
    seen, remove = hooked(reference, moe)
    with torch.no_grad():
        reference(input_ids=ids, attention_mask=mask, position_ids=positions)
    remove()
    spans = {0: (0, 1), 1: (1, 2), 2: (3, 1), 3: (4, 1), "all": (0, 5)}
    for key, (start, size) in spans.items():
        for name in VALUES:
            expected = seen[name].reshape(*ids.shape, *seen[name].shape[1:])[start:start + size]
            torch.testing.assert_close(read[key][name], expected.to(read[key][name].dtype), atol=2e-6, rtol=0)


EDITS = {
    "router_logits": None,  # the router's own op: covered by the read tests; no hook point outside its forward
    "expert_weights": lambda t: t.index_fill(-1, torch.tensor([0]), 0.0),
    "expert_indices": lambda t: (t + 1) % 8,
    "routed_output": lambda t: t * 3,
    "mlp_output": lambda t: t * 2,
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [name for name, edit in EDITS.items() if edit is not None])
def test_a_write_in_one_invoke_changes_its_rows_alone(family, name):
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = next(m for m in wrapped.moes if not m.runs_only_on)
    generator = torch.Generator().manual_seed(3)
    invokes = [torch.randint(4, 120, shape, generator=generator) for shape in ((1, 7), (2, 3), (1, 1))]
    logits = {}
    with torch.no_grad(), wrapped.trace() as tracer:
        for index, ids in enumerate(invokes):
            with tracer.invoke(ids):
                if index == 1:
                    setattr(moe, name, EDITS[name](getattr(moe, name)))
                logits[index] = wrapped.output.logits.save()
    ids, mask, positions = left_padded([row.tolist() for ids in invokes for row in ids])
    seq = ids.shape[1]

    def rows_of_invoke_1(tensor):
        tensor = tensor.clone()
        tensor[seq:3 * seq] = EDITS[name](tensor[seq:3 * seq])
        return tensor

    with torch.no_grad():
        clean = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        seen, remove = hooked(reference, moe, (name, rows_of_invoke_1))
        edited = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        remove()
    assert not torch.allclose(edited[1:3], clean[1:3])
    for index, (start, size) in enumerate(((0, 1), (1, 2), (3, 1))):
        expected = (edited if index == 1 else clean)[start:start + size]
        torch.testing.assert_close(logits[index], expected, atol=1e-5, rtol=0)
