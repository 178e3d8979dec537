"""Blocks one forward calls several times (inkling2_loop's loop layers, transformers 5.24).

Each call's values are served under nnsight's ``tracer.iter[i]`` (pass i); a read outside it is
the first pass's. Ground truth: plain nnsight's per-call values of the raw modules, and a copy
of the model with an expert's weights zeroed.
"""

from __future__ import annotations

import copy

import nnsight
import pytest
import torch

import moelens
from moelens.testing import UNBUILDABLE, tiny_inputs, tiny_model

pytestmark = pytest.mark.skipif("inkling2_loop" in UNBUILDABLE, reason=UNBUILDABLE.get("inkling2_loop", ""))

PASSES = 2  # the tiny config's loop_num_passes


@pytest.fixture(scope="module", params=["grouped_mm", "batched_mm"])
def looped(request):
    hf = tiny_model("inkling2_loop", experts_implementation=request.param)
    assert hf.config.loop_num_passes == PASSES
    wrapped = moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if moe.layer == hf.config.loop_layer_index_start)
    return hf, wrapped, moe, tiny_inputs(hf, batch=2, seq=5)


def test_each_pass_is_served_as_plain_nnsight_sees_that_call(looped):
    hf, wrapped, moe, inputs = looped
    raw = nnsight.NNsight(hf)
    block = raw.get(moe.path.removeprefix("model."))
    with raw.trace(**inputs) as tracer:
        expected = nnsight.save([])
        for _ in tracer.iter[0:PASSES]:
            logits = block.gate.source.F_linear_0.output
            (_, indices, weights), _ = block.experts.inputs
            expected.append((logits, indices, weights, block.experts.output))
    with wrapped.trace(**inputs) as tracer:
        served = nnsight.save([])
        for _ in tracer.iter[0:PASSES]:
            served.append((moe.router_logits, moe.expert_indices, moe.expert_weights, moe.routed_output))
    with wrapped.trace(**inputs):
        first = moe.router_logits.save()
    assert len(served) == len(expected) == PASSES
    for got, want in zip(served, expected):
        for value, raw_value in zip(got, want):
            assert torch.equal(value.reshape(raw_value.shape), raw_value)
    assert not torch.equal(served[0][0], served[1][0])  # the passes see different hidden states
    assert torch.equal(first, served[0][0])


def test_an_ablation_on_every_pass_equals_zeroed_expert_weights(looped):
    hf, wrapped, moe, inputs = looped
    with wrapped.trace(**inputs):
        expert = moe.expert_indices[0, 0, 0].save()
    expert = int(expert)
    with wrapped.trace(**inputs) as tracer:
        for _ in tracer.iter[0:PASSES]:
            moelens.ablate(moe, expert, "zero")
        every_pass = wrapped.output.save()
    with wrapped.trace(**inputs):
        moelens.ablate(moe, expert, "zero")  # the first pass only
        first_pass = wrapped.output.save()
    reference = copy.deepcopy(hf)
    experts = reference.get_submodule(moe.path.removeprefix("model.") + ".experts")
    with torch.no_grad():
        experts.down_proj[expert] = 0
        expected = reference(**inputs).logits
    torch.testing.assert_close(every_pass.logits, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first_pass.logits, expected, atol=1e-5, rtol=1e-5)


def test_a_scan_without_use_cache_false_is_refused_before_it_runs():
    """inkling2_loop's forward deep-copies its key-value cache: under scan's fake tensors torch failed with a raw
    storage error and the process could crash on its next allocation. A scan with use_cache=False serves the
    shapes a real trace does."""
    from groundtruth import ascii_tokenizer

    wrapped = moelens.wrap(tiny_model("inkling2_loop", experts_implementation="batched_mm"), tokenizer=ascii_tokenizer())
    with pytest.raises(moelens.MoelensError, match=r"model.scan of this inkling2_loop model needs use_cache=False"):
        with wrapped.scan("hello"):
            wrapped.moes[0].expert_indices.save()
    with wrapped.scan("hello", use_cache=False):
        shape = nnsight.save(tuple(wrapped.moes[0].expert_indices.shape))
    with wrapped.trace("hello"):
        real = nnsight.save(tuple(wrapped.moes[0].expert_indices.shape))
    assert shape == real


def test_passes_read_in_order_in_one_generation_step_are_not_refused_and_a_late_read_is():
    """A tracer.iter body of generate may read every pass of a looped block in the model's order (each value after a
    step's first is served at the next visit): moelens refuses a read that nnsight serves in a later generation step
    than it was asked in, which these are not. The same passes read one per body (the calls of all steps counted
    together) serve the same values. A value of the block read after a later one at the last pass of a step was served
    the next step's and is refused."""
    from groundtruth import ascii_tokenizer

    hf = tiny_model("inkling2_loop", experts_implementation="grouped_mm")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    start = hf.config.loop_layer_index_start
    moe = next(moe for moe in wrapped.moes if moe.layer == start)
    first = next(moe for moe in wrapped.moes if moe.layer < start)
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad(), wrapped.generate(ids, **settings) as tracer:
        in_one_body = nnsight.save([])
        for _ in tracer.iter[1:3]:
            first.router_logits.save()  # the step's first read: pins the step
            for _ in range(PASSES):
                in_one_body.append(moe.router_logits.save())
                moe.routed_output.save()
    with torch.no_grad(), wrapped.generate(ids, **settings) as tracer:
        per_call = nnsight.save([])
        for _ in tracer.iter[PASSES:3 * PASSES]:
            per_call.append(moe.router_logits.save())
    assert len(in_one_body) == len(per_call) == 2 * PASSES
    for got, want in zip(in_one_body, per_call):
        assert torch.equal(got, want)
    with pytest.raises(moelens.errors.OrderError, match=r"router_logits was requested after the model had already run"):
        with torch.no_grad(), wrapped.generate(ids, **settings) as tracer:
            for call in tracer.iter[PASSES:3 * PASSES]:
                if call == 2 * PASSES - 1:  # the last pass of step 1
                    moe.routed_output.save()
                moe.router_logits.save()
                moe.routed_output.save()


def test_a_pass_read_after_the_block_was_skipped_at_an_earlier_pass_is_refused(looped):
    """The block skipped with .skip() at its first pass never ran its router there, so the router's op counted one
    visit fewer than the block's calls: router_logits read at the next pass (tracer.iter[1]) was served the pass after
    it (the next generation step's first), silently. Refused now, as the block's own calls run ahead of the op's."""
    from groundtruth import ascii_tokenizer

    hf, _, looped_moe, inputs = looped
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = next(moe for moe in wrapped.moes if moe.path == looped_moe.path)
    settings = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False)
    with pytest.raises(moelens.errors.OrderError, match=r"router_logits cannot be served at this step: .* did not run"):
        with torch.no_grad(), wrapped.generate(inputs["input_ids"], **settings) as tracer:
            for call in tracer.iter[0:PASSES]:
                if call == 0:
                    moe.skip(moe.inputs[0][0])
                else:
                    moe.router_logits.save()
