"""Contracts of the read / write / write-back machinery of served values (`moelens.components.served`).

Ground truth, independent of moelens: the unwrapped copy of the model run with a torch pre-hook or forward
hook that makes the same edit on the experts call, and the linearity of the experts' bias-free down projection.
"""

from __future__ import annotations

import pytest
import torch

import moelens
from groundtruth import built, first_tensor
from test_core_batching import two_invokes_edited_by_hand
from moelens.testing import tiny_inputs, tiny_model


#: The grad modes a read is served in: a view of the model's tensor (no_grad), or a copy (autograd for the routing
#: values, inference_mode for every value).
GRAD_MODES = {"no_grad": torch.no_grad, "autograd": torch.enable_grad, "inference_mode": torch.inference_mode}


def with_first_slot_zeroed(reference: torch.nn.Module, moe, inputs: dict) -> torch.Tensor:
    """The unwrapped model's output with ``moe``'s first slot weighted 0 by a pre-hook on its experts."""
    experts = reference.get_submodule(moe.experts.path.removeprefix("model."))
    handle = experts.register_forward_pre_hook(
        lambda module, args: (args[0], args[1], args[2].clone().index_fill_(-1, torch.tensor([0], device=args[2].device), 0.0)))
    try:
        with torch.no_grad():
            return first_tensor(reference(**inputs))
    finally:
        handle.remove()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_an_in_place_edit_made_after_another_invokes_write_landed_at_the_same_visit_lands(grad):
    """Invoke 1 assigns its expert indices, and only once that write has landed (a second barrier) invoke 2
    edits its own view in place. Invoke 2's view is a view of the tensor the model held before the write: the
    write-back must splice it into what the model holds now, or the edit is silently lost. Ground truth: the
    unwrapped model run with both edits made by a pre-hook on its experts."""
    wrapped, moe, first, second, expected = two_invokes_edited_by_hand("grouped_mm")
    logits = []
    with torch.set_grad_enabled(grad), wrapped.trace() as tracer:
        read, written = tracer.barrier(2), tracer.barrier(2)
        with tracer.invoke(first):
            own = moe.expert_indices
            read()
            moe.expert_indices = own.clone().index_fill_(-1, torch.tensor([0], device=own.device), 1)
            written()
            logits.append(first_tensor(wrapped.output)[0].save())
        with tracer.invoke(second):
            other = moe.expert_indices
            read()
            written()
            other[:, :, 0] = 2
            logits.append(first_tensor(wrapped.output)[0].save())
    torch.testing.assert_close(torch.stack([row.detach() for row in logits]), expected)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_a_per_slot_value_read_then_written_at_one_visit_is_written(grad):
    """grouped_mm's expert_activations read, then written (scaled) at the same visit: the write reuses what the
    read's sort permutation request returned (asking for it again, past the sort, would be refused). Ground
    truth: mixtral's down projections are bias-free and linear, so activations x 2 give a routed output x 2 of
    the unwrapped model's, taken by a forward hook on its experts."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    experts = reference.get_submodule(moe.experts.path.removeprefix("model."))
    assert all(getattr(experts, name, None) is None for name in ("down_proj_bias", "down_bias"))
    seen = []
    handle = experts.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    try:
        with torch.no_grad():
            reference(**inputs)
    finally:
        handle.remove()
    with torch.set_grad_enabled(grad), wrapped.trace(**inputs):
        activations = moe.expert_activations
        moe.expert_activations = activations * 2
        routed = moe.routed_output.save()
    torch.testing.assert_close(routed.detach(), 2 * seen[0].reshape(routed.shape), atol=1e-5, rtol=1e-5)


def test_a_float32_tensor_written_to_a_float16_value_is_checked_as_the_model_gets_it():
    """1e6 is finite in float32 and inf in float16: a float32 tensor written to a float16 model's routed output
    is checked after the cast to float16, so the write is refused rather than the model silently computing
    with inf."""
    hf = tiny_model("mixtral", dtype=torch.float16)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    inputs = tiny_inputs(hf)
    value = torch.full((*inputs["input_ids"].shape, hf.config.hidden_size), 1e6, dtype=torch.float32)
    assert torch.isfinite(value).all() and torch.isinf(value.half()).all()
    with pytest.raises(moelens.WriteError, match=r"routed_output: the written values reach 1e\+06, beyond what the "
                                                 r"model's torch.float16 holds"):
        with torch.no_grad(), wrapped.trace(**inputs):
            moe.routed_output = value
            wrapped.output.save()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_the_model_gets_a_copy_of_the_tensor_written_so_a_later_edit_of_the_users_tensor_does_not_reach_it(grad):
    """A tensor written, then edited in place by the user before the model moves on: the model computes with the
    value as written (its own copy, with autograd on as off). Ground truth: plain nnsight on the unwrapped copy
    setting the raw logits op's output to the value as written."""
    import nnsight

    _, wrapped, inputs, _, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        clean = moe.router_logits.save()
    patched = clean.clone()
    patched[..., 2] += 3.0
    written = patched.clone()
    with torch.set_grad_enabled(grad), wrapped.trace(**inputs):
        moe.router_logits = written
        written.add_(100.0)  # the user's tensor, after the write
        output = wrapped.output.save()
    plain = nnsight.NNsight(reference)
    with torch.no_grad(), plain.trace(**inputs):
        block = plain.get(moe.path.removeprefix("model."))
        op = block.get(moe.family.router).source.__getattr__(moe.family.logits_op)
        op.output = patched.reshape(-1, patched.shape[-1])
        expected = plain.output.save()
    torch.testing.assert_close(first_tensor(output).detach(), first_tensor(expected), atol=1e-6, rtol=1e-6)


def test_the_gathered_call_note_covers_both_flat_shapes_and_calls_by_keyword():
    """The note on an ernie4_5_vl_moe block says a call got tokens gathered out of the batch for ``[n * D]`` and
    ``[n, D]`` inputs, not for ``[B, S, D]``; a call of the block with its input by keyword still runs (the
    hook sees no positional argument)."""
    from moelens.components.gathered import gathered_call

    hf = tiny_model("ernie4_5_vl_moe")
    wrapped = moelens.wrap(hf)
    block = wrapped.moes[0]._module
    hidden = hf.config.text_config.hidden_size if hasattr(hf.config, "text_config") else hf.config.hidden_size
    x = torch.randn(2, 4, hidden, device=hf.device)
    noted = {}
    with torch.no_grad():
        for name, value in (("batch", x), ("rows", x.reshape(8, hidden)), ("flat", x.reshape(-1))):
            block(value)
            noted[name] = gathered_call(block)
        expected = block(x)
        by_keyword = block(hidden_states=x)
    assert noted == {"batch": False, "rows": True, "flat": True}
    torch.testing.assert_close(first_tensor(by_keyword), first_tensor(expected))


def test_reads_left_unedited_swap_nothing_into_the_model_and_an_edit_still_lands(monkeypatch):
    """Each read leaves a write-back; one whose views were not edited is dropped as the next value is read,
    instead of a round trip that swaps the model's own tensor back in. Counted at nnsight's batcher, which lands
    every swap: a trace that reads every value of every block swaps at most the last read back (nnsight's own
    request for the output flushes it); an in-place edit of expert_weights is one swap that changes something,
    and lands (ground truth: the unwrapped copy with the same edit made by a pre-hook on its experts)."""
    from moelens.components.served import MoeBatcher

    _, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    swaps = []
    widen = MoeBatcher.widen
    monkeypatch.setattr(MoeBatcher, "widen", lambda self, *args: swaps.append(args) or widen(self, *args))
    with torch.no_grad(), wrapped.trace(**inputs):
        wrapped.save_all()
        untouched = wrapped.output.save()
    assert len(swaps) <= 1
    torch.testing.assert_close(first_tensor(untouched), plain, atol=0, rtol=0)
    swaps.clear()

    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.expert_weights[..., 0] = 0.0
        moe.routed_output.save()
        edited = wrapped.output.save()
    assert [rebase.changes for *_, rebase in swaps].count(True) == 1
    expected = with_first_slot_zeroed(reference, moe, inputs)
    torch.testing.assert_close(first_tensor(edited), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "autograd", "inference_mode"])
def test_a_refused_write_caught_in_the_trace_keeps_the_edits_made_before_it_at_that_visit(mode):
    """expert_weights edited in place, then a refused write of expert_indices at the same visit, caught by the
    user: the edit made in time still reaches the model (the refusal must not drop the open reads' write-back,
    which with autograd on or under inference_mode carries a copy). Ground truth: the unwrapped model with the
    first slot's weight zeroed by a pre-hook on its experts."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "batched_mm")
    moe = wrapped.moes[1]
    expected = with_first_slot_zeroed(reference, moe, inputs)
    with GRAD_MODES[mode](), wrapped.trace(**inputs):
        weights = moe.expert_weights
        weights[..., 0] = 0
        try:
            moe.expert_indices = 10**6
        except moelens.WriteError:
            pass
        edited = first_tensor(wrapped.output).save()
    torch.testing.assert_close(edited.detach(), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(expected, plain)


@pytest.mark.parametrize("mode", ["autograd", "inference_mode"])
def test_a_read_that_fails_at_the_same_visit_keeps_the_edits_made_before_it(mode, monkeypatch):
    """expert_weights edited in place (a copy, under autograd and inference_mode), then expert_indices at the
    same visit fails as it is cut into this invoke's view (made to fail here), and the user goes on: the edit
    still reaches the model. Ground truth: the unwrapped model with the first slot's weight zeroed by a pre-hook."""
    from moelens.components import served

    hf, wrapped, inputs, plain, reference = built("mixtral", "batched_mm")
    moe = wrapped.moes[1]
    expected = with_first_slot_zeroed(reference, moe, inputs)
    cut = served.tokens.view

    def failing_for_indices(tensor, features, rows, name):
        if name.endswith("expert_indices"):
            raise moelens.ValueUnavailable(f"{name}: made to fail")
        return cut(tensor, features, rows, name)

    monkeypatch.setattr(served.tokens, "view", failing_for_indices)
    with GRAD_MODES[mode](), wrapped.trace(**inputs):
        weights = moe.expert_weights
        weights[..., 0] = 0
        try:
            moe.expert_indices
        except moelens.ValueUnavailable:
            pass
        edited = first_tensor(wrapped.output).save()
    torch.testing.assert_close(edited.detach(), expected, atol=1e-6, rtol=1e-6)



#: A notebook cell (module level: a trace inside a function keeps the model in a cycle of nnsight's own frames)
#: that traces a model, deletes it and prints how many of its weights are still alive, the cycle collector off.
_DELETED_AFTER_A_TRACE = """
import gc, sys, weakref
import nnsight, torch, moelens
from moelens.testing import tiny_inputs, tiny_model
gc.disable()
hf = tiny_model(sys.argv[1])
ids = tiny_inputs(hf, 2, 5)["input_ids"]
model = moelens.wrap(hf) if sys.argv[2] == "moelens" else nnsight.NNsight(hf)
with torch.no_grad(), model.trace(ids):
    if sys.argv[2] == "moelens":
        moe = model.moes[-1]
        moelens.steer(moe, 0, 1.0)
        for name in ("router_logits", "router_probs", "expert_weights", "expert_indices", "routed_output",
                     "mlp_output"):
            getattr(moe, name).save()
    else:
        model.model.layers[-1].mlp.gate.source.F_linear_0.output.save()
        model.model.layers[-1].mlp.output.save()
weights = weakref.WeakValueDictionary(dict(hf.named_parameters()))
del model, hf
print(len(weights))
"""


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_model_deleted_after_routing_reads_frees_its_weights_without_the_cycle_collector(family, tmp_path):
    """A block keeps the bindings of its values, whose functions held the component: a reference cycle, so a model
    deleted after a trace that read its routing kept the read blocks' weights (router, experts) until Python's cycle
    collector ran, where plain nnsight reading the same router op frees them as the last reference goes. Run as a
    notebook cell runs (module level). (A drill into the experts implementation, for the per-slot values, is a cycle
    of nnsight's own: raw nnsight keeps the model then too.)"""
    import subprocess
    import sys

    script = tmp_path / "cell.py"
    script.write_text(_DELETED_AFTER_A_TRACE)

    def weights_left(wrapper: str) -> str:
        run = subprocess.run([sys.executable, str(script), family, wrapper], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()[-1]

    assert weights_left("nnsight") == "0"  # the ground truth: plain nnsight frees them at once
    assert weights_left("moelens") == "0"
