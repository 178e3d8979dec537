"""Writes and interventions moelens must refuse, and nearby ones it must accept.

Ground truth: the documented refusals (a `WriteError` or `FamilyError` naming what was wrong), and, for
the writes that must be accepted, the plain transformers model (an unwrapped copy, no moelens, no
nnsight) with the same edit made by a torch forward hook.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from unittest import mock

import nnsight
import pytest
import torch

import moelens
from custom_models import custom_family, custom_model
from groundtruth import built
from moelens import FamilyError, WriteError, families
from moelens.testing import FAMILIES, tiny_inputs, tiny_model


@pytest.fixture(scope="module")
def mixtral():
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    return wrapped, inputs, reference


def refused(wrapped, inputs, edit, match, block=0):
    with pytest.raises(WriteError, match=match):
        with wrapped.trace(**inputs):
            edit(wrapped.moes[block])


def with_hook(model, module_name, hook, inputs):
    """``model``'s logits with ``hook`` as a forward hook on ``module_name`` (its return value replaces the output)."""
    handle = model.get_submodule(module_name).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        handle.remove()


def test_a_transposed_write_of_the_same_number_of_elements_is_refused(mixtral):
    """Guards the shape check: a [5, 2, 2] tensor for a [2, 5, 2] value (same element count) would scramble tokens."""
    wrapped, inputs, _ = mixtral
    refused(wrapped, inputs, lambda moe: setattr(moe, "expert_weights", moe.expert_weights.transpose(0, 1)),
            r"expert_weights: wrote a tensor of shape \(5, 2, 2\), expected \(2, 5, 2\)")


def test_bool_expert_indices_are_refused(mixtral):
    """Guards against a bool mask written as expert_indices being taken as expert ids 0 and 1."""
    wrapped, inputs, _ = mixtral
    refused(wrapped, inputs, lambda moe: setattr(moe, "expert_indices", moe.expert_indices == 3),
            r"expert_indices: wrote torch.bool indices, expected integer expert indices")


def test_reroute_with_bool_expert_ids_is_refused(mixtral):
    """Guards against reroute(..., [True, False]) sending the tokens to experts 1 and 0."""
    wrapped, inputs, _ = mixtral
    refused(wrapped, inputs, lambda moe: moelens.reroute(moe, (..., 0), [True, False]),
            r"reroute: experts=\[True, False\] holds the bool (True|False); expert ids are integers")
    refused(wrapped, inputs, lambda moe: moelens.reroute(moe, (..., 0), torch.tensor([True, False])),
            r"reroute: expert ids must be integers, got torch.bool")


def test_ablate_zero_with_a_swap_target_is_refused(mixtral):
    """Guards against ablate(moe, 2, mode="zero", to=5) ignoring to= and zeroing expert 2 when a swap was meant."""
    wrapped, inputs, _ = mixtral
    refused(wrapped, inputs, lambda moe: moelens.ablate(moe, 2, mode="zero", to=5),
            r"to=5\) only applies to mode='swap', not 'zero'")


def test_an_int_scalar_written_to_a_float_value_zeroes_it(mixtral):
    """A Python int written to a float value is that number, not an int64 tensor to refuse."""
    wrapped, inputs, reference = mixtral
    with torch.no_grad(), wrapped.trace(**inputs):
        wrapped.moes[0].routed_output = 0
        logits = wrapped.output.logits.save()
    # mixtral's routed output is its experts module's output: zero that in the plain model
    expected = with_hook(reference, "model.layers.0.mlp.experts", lambda m, a, out: torch.zeros_like(out), inputs)
    untouched = with_hook(reference, "model.layers.0.mlp.experts", lambda m, a, out: None, inputs)
    assert not torch.allclose(expected, untouched)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


def test_an_eval_mode_model_with_gradient_checkpointing_on_takes_edits():
    """transformers checkpoints only in training mode: an eval-mode model with checkpointing enabled runs plain
    forwards, where an edit is safe and must not be refused by the flag alone."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    hf.activation_checkpointing_enable({"use_reentrant": False})
    hf.eval()
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    with wrapped.trace(**inputs):  # autograd on, as in training code
        moe = wrapped.moes[0]
        moe.expert_weights = moe.expert_weights * 0.5
        logits = wrapped.output.logits.save()
    # mixtral's block output is linear in the routing weights: halving them halves the block's output
    expected = with_hook(reference, "model.layers.0.mlp", lambda m, a, out: out * 0.5, inputs)
    untouched = with_hook(reference, "model.layers.0.mlp", lambda m, a, out: None, inputs)
    assert not torch.allclose(expected, untouched)
    torch.testing.assert_close(logits.detach(), expected, atol=1e-5, rtol=1e-4)


def test_identity_experts_naming_a_bool_attribute_is_refused():
    """Guards against a reference to a bool flag (True) counting as one identity expert, leaving an expert out."""
    model = custom_model()
    for layer in model.layers:
        layer["ffn"].pool.is_routed = True  # a flag a user's reference may name by mistake
    families.register(custom_family(identity_experts="pool.is_routed"))
    try:
        with pytest.raises(FamilyError, match=r"identity_experts='pool.is_routed' gives True on CustomBlock, "
                                              r"not a count of experts"):
            moelens.wrap(model).moes[0].params()
    finally:
        families.unregister("custom")


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_per_slot_outputs_whose_sum_overflows_the_hidden_dtype_are_refused(impl):
    """float16 mixtral weights its slots in float32, so expert_outputs is float32 and 1e6 was finite there; the model
    adds a token's slots and casts the sum to float16, which is inf, and the logits came out NaN. A sum that fits is
    written, and the block's output is its float16 cast (ground truth: the slots summed by hand)."""
    hf = tiny_model("mixtral", dtype=torch.float16, experts_implementation=impl)
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    moe = wrapped.moes[0]
    for value in (1e6, 4e4):  # 4e4 fits float16 alone, two slots of it do not
        with pytest.raises(WriteError, match=r"expert_outputs: the written slots of a token add up to .*, which is inf "
                                             r"in torch.float16"):
            with torch.no_grad(), wrapped.trace(**inputs):
                slots = moe.expert_outputs
                moe.expert_outputs = torch.full_like(slots, value)
    with torch.no_grad(), wrapped.trace(**inputs):
        slots = moe.expert_outputs
        assert slots.dtype == torch.float32
        moe.expert_outputs = torch.full_like(slots, 3e4)
        routed = moe.routed_output.save()
        logits = wrapped.output.logits.save()
    assert routed.dtype == torch.float16 and torch.equal(routed, torch.full_like(routed, 6e4))
    assert torch.isfinite(logits).all()


def test_float64_per_slot_outputs_whose_sum_overflows_are_refused():
    """The slot sum was checked in float32, where float64 slots of 1e308 sum to inf and float64's largest number
    rounds to inf too, so the write was taken and routed_output held inf (ground truth: torch adds the two slots to
    inf in float64; one slot of 1e308 alone fits, and half of it in each slot is written)."""
    hf = tiny_model("mixtral", dtype=torch.float64, experts_implementation="batched_mm")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[1]
    assert torch.isinf(torch.tensor([1e308, 1e308], dtype=torch.float64).sum())
    with pytest.raises(WriteError, match=r"expert_outputs: the written slots of a token add up to more than float64 "
                                         r"holds, which is inf in torch.float64"):
        with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
            moe.expert_outputs = torch.full(moe.expert_outputs.shape, 1e308, dtype=torch.float64)
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
        moe.expert_outputs = torch.full(moe.expert_outputs.shape, 5e307, dtype=torch.float64)
        routed = moe.routed_output.save()
    assert torch.equal(routed, torch.full_like(routed, 1e308))


def test_float32_per_slot_outputs_whose_sum_rounds_to_the_largest_float_are_written():
    """Checked in float64 against float32's largest number, a sum that torch rounds to that largest number (finite)
    was refused as inf (ground truth: torch's own float32 sum of the two slots)."""
    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[1]
    largest = torch.finfo(torch.float32).max
    assert torch.isfinite(torch.tensor([largest, 1e30]).sum())
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf)):
        slots = torch.zeros(moe.expert_outputs.shape)
        slots[..., 0, :], slots[..., 1, :] = largest, 1e30
        moe.expert_outputs = slots
        routed = moe.routed_output.save()
    assert torch.equal(routed, torch.full_like(routed, largest))


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_per_slot_outputs_whose_sum_overflows_the_autocast_slot_dtype_are_refused(impl):
    """Under torch.autocast("cpu", float16) a float32 qwen3_moe's batched_mm keeps its slots in float16 and adds a
    token's slots up in float16 before casting to float32: the check took the sum's dtype from the weights (float32),
    so 4e4 in each of its two slots was written and the logits came out inf. grouped_mm keeps the slots in float32
    there, so the same write is fine, as is 3e4 (a sum of 6e4) in either. Ground truth: the same write made with plain
    nnsight at the implementation's op on an unwrapped copy: refused exactly where it makes the logits non-finite, and
    where accepted, the same logits."""
    hf = tiny_model("qwen3_moe", experts_implementation=impl)
    raw = nnsight.NNsight(copy.deepcopy(hf))
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    moe = wrapped.moes[1]
    overflowed = []
    for value in (4e4, 3e4):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), raw.trace(**inputs):
            inner = raw.get(moe.path.removeprefix("model.")).experts.source.experts_forward_1.source
            inner.weighted_out_view_0.output = torch.full_like(inner.weighted_out_view_0.output, value)
            expected = raw.output.logits.save()
        overflowed.append(not bool(torch.isfinite(expected).all()))
        refusal = pytest.raises(WriteError, match=r"expert_outputs: the written slots of a token add up to .*, which "
                                                  r"is inf in torch.float16 .*the dtype the model adds them up in")
        with refusal if overflowed[-1] else contextlib.nullcontext():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), wrapped.trace(**inputs):
                moe.expert_outputs = torch.full(moe.expert_outputs.shape, value)
                logits = wrapped.output.logits.save()
        if not overflowed[-1]:
            torch.testing.assert_close(logits, expected)
    assert overflowed == [impl == "batched_mm", False]  # the overflow this test is about happens, only there


def test_force_whose_lift_overflows_the_logits_dtype_is_refused_naming_force():
    """float16: steer by 4e4, then force the same expert: its lift (the logits' span + 30) overflowed to +inf, and the
    write check blamed a '+inf logit' write, advising moelens.force."""
    hf = tiny_model("mixtral", dtype=torch.float16)
    wrapped = moelens.wrap(hf)
    for grad in (False, True):  # with autograd on, the refusal's number made torch warn of a scalar taken from a
        with pytest.raises(WriteError, match=r"force: .* router logits span .*overflows torch.float16 .* steer by less"):
            with warnings.catch_warnings():  # tensor that requires grad
                warnings.simplefilter("error")
                with torch.set_grad_enabled(grad), wrapped.trace(**tiny_inputs(hf)):
                    moe = wrapped.moes[0]
                    moelens.steer(moe, 0, 4e4)
                    moelens.force(moe, [0])


@contextlib.contextmanager
def router_logits_all_minus_inf(model, router_name):
    """``model`` (plain transformers) with the logits of its router ``router_name`` all -inf: the ``F.linear`` of
    that router's own weight (how each router here computes its logits) returns -inf. Yields the list of those
    calls, one per forward."""
    weight = next(weight for name, weight in model.get_submodule(router_name).named_parameters()
                  if name.endswith("weight"))  # its own, or its linear's (ergo's router.linear)
    linear = torch.nn.functional.linear
    calls = []

    def forced(x, w, b=None):
        out = linear(x, w, b)
        if w.data_ptr() != weight.data_ptr():
            return out
        calls.append(w)
        return torch.full_like(out, float("-inf"))

    with mock.patch.object(torch.nn.functional, "linear", forced):
        yield calls


def _route_around_every_expert(moe):
    for expert in range(moe.num_experts):
        moelens.ablate(moe, expert, "route_around")


def _write_minus_inf_logits(moe):
    moe.router_logits = torch.full_like(moe.router_logits, float("-inf"))


@pytest.mark.parametrize(("family", "block", "edit"), [
    ("deepseek_v4", 0, _route_around_every_expert),  # a hash layer: sqrtsoftplus, renormalised by sum + 1e-20
    ("deepseek_v4", 1, _write_minus_inf_logits),  # top-k of score + bias (route_around acts on selection_scores)
    ("deepseek_v3", 0, _write_minus_inf_logits),  # sigmoid, group-limited, renormalised by sum + 1e-20
    ("llama4", 0, _route_around_every_expert),  # sigmoid of the top-k logits, not renormalised
    *([("ergo", 0, _write_minus_inf_logits)] if "ergo" in FAMILIES else []),  # sum + 1e-20 (transformers 5.25)
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_router_logits_all_minus_inf_are_taken_where_the_scores_are_bounded(family, block, edit):
    """A sigmoid or sqrtsoftplus score is 0 at -inf, and these routers divide by their k weights' sum + 1e-20 or not at
    all, so every weight is 0, not NaN: the write was refused, saying the routing scores would be NaN. Ground truth:
    the plain transformers model with that router's logits forced to -inf."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    moe = wrapped.moes[block]
    with torch.no_grad(), wrapped.trace(**inputs):
        edit(moe)
        logits = wrapped.output.logits.save()
    with torch.no_grad():
        untouched = reference(**inputs).logits
        with router_logits_all_minus_inf(reference, moe.router.path.removeprefix("model.")) as calls:
            expected = reference(**inputs).logits
    assert len(calls) == 1 and torch.isfinite(expected).all()
    assert not torch.allclose(expected, untouched)  # the experts' share is gone
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "edit", "why"), [
    ("mixtral", _route_around_every_expert, r"its routing scores would be NaN \(a softmax over -inf alone\)"),
    # sigmoid scores renormalised by their plain sum: 0/0
    ("minimax_m2", _write_minus_inf_logits, r"its routing weights would be NaN: every sigmoid score would be 0, and "
                                            r"the router divides its k weights by their sum \(0/0\)"),
], ids=["mixtral", "minimax_m2"])
def test_router_logits_all_minus_inf_are_refused_where_the_weights_would_be_nan(family, edit, why):
    """Where the plain model does compute NaN from a router's logits all -inf (a softmax; sigmoid scores divided by
    their plain sum), the write is refused, saying why."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    moe = wrapped.moes[0]
    with torch.no_grad(), router_logits_all_minus_inf(reference, moe.router.path.removeprefix("model.")) as calls:
        expected = reference(**inputs).logits
    assert len(calls) == 1 and expected.isnan().all()
    refused(wrapped, inputs, edit, rf"{moe.path}\.router_logits: fewer than 1 entry of some token are above -inf, "
                                   rf"so {why}; leave at least 1 expert above -inf per token")


@pytest.mark.parametrize(("family", "block", "prepare", "why"), [
    # its routers score in the model's dtype, where their epsilon 1e-20 is 0
    ("deepseek_v4", 1, lambda hf, router: hf.to(torch.float16),
     r"by their sum plus 1e-20, which is 0 in torch\.float16 \(0/0\)"),
    # a softcap takes -inf to -c, whose sigmoid is 0 in float32 from c of about 104
    ("laguna", 0, lambda hf, router: setattr(router, "router_logit_softcapping", 200.0), r"by their sum \(0/0\)"),
], ids=["deepseek_v4-float16", "laguna-softcap-200"])
def test_router_logits_all_minus_inf_are_refused_where_an_epsilon_or_softcap_is_lost_in_the_dtype(family, block,
                                                                                                prepare, why):
    """The write was taken wherever the router adds an epsilon to the sum it divides by, or softcaps its logits, and
    the model's output was NaN: 1e-20 is 0 in float16, and sigmoid(-200) is 0 in float32. Ground truth: the plain
    model with that router's logits forced to -inf computes NaN too."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[block]
    router_name = moe.router.path.removeprefix("model.")
    prepare(hf, hf.get_submodule(router_name))
    reference = copy.deepcopy(hf)
    inputs = tiny_inputs(hf)
    with torch.no_grad(), router_logits_all_minus_inf(reference, router_name) as calls:
        expected = reference(**inputs).logits
    assert len(calls) == 1 and expected.isnan().all()
    refused(wrapped, inputs, _write_minus_inf_logits, rf"{moe.path}\.router_logits: .* its routing weights would be "
                                                      rf"NaN: every \w+ score would be 0, and the router divides its k "
                                                      rf"weights {why}", block)


def test_softcapped_router_logits_all_minus_inf_are_taken():
    """laguna divides its sigmoid weights by their plain sum, but with router_logit_softcapping = c > 0 a -inf logit
    is scored as tanh(-inf) * c = -c: the weights stay finite, so the write is taken. Ground truth: the plain model
    with the same softcap and that router's logits forced to -inf."""
    hf = tiny_model("laguna")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    router_name = moe.router.path.removeprefix("model.")
    hf.get_submodule(router_name).router_logit_softcapping = 5.0
    reference = copy.deepcopy(hf)
    inputs = tiny_inputs(hf)
    with torch.no_grad(), wrapped.trace(**inputs):
        _write_minus_inf_logits(moe)
        logits = wrapped.output.logits.save()
    with torch.no_grad(), router_logits_all_minus_inf(reference, router_name) as calls:
        expected = reference(**inputs).logits
    assert len(calls) == 1 and torch.isfinite(expected).all()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    hf.get_submodule(router_name).router_logit_softcapping = 0.0  # without it, the plain sum is 0: refused
    refused(wrapped, inputs, _write_minus_inf_logits, r"router_logits: .* its routing weights would be NaN")


@pytest.mark.parametrize("use", ["read", "save_all", "steer", "route_around", "assigned", "in_place"])
def test_moelens_values_inside_vmap_are_refused_naming_it(use):
    """Under torch.func.vmap the values are batched tensors: steer failed on torch's data-dependent control flow,
    ablate and a second read at one visit on a tensor without storage, naming neither moelens nor vmap, and an
    in-place edit with autograd on was lost (the logits those of the unedited model). The model's own output, read
    by plain nnsight, is each row's; the next trace runs as before."""
    hf = tiny_model("qwen2_moe")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf)["input_ids"]
    moe = wrapped.moes[0]

    def traced(row):
        with wrapped.trace(row[None]):
            if use == "read":
                moe.expert_weights.save()
            elif use == "save_all":
                moe.save_all()
            elif use == "steer":
                moelens.steer(moe, 1, 2.0)
            elif use == "route_around":
                moelens.ablate(moe, 1, "route_around")
            elif use == "assigned":
                moe.mlp_output = 0.0
            else:
                moe.mlp_output.mul_(0.5)
            output = wrapped.output.logits.save()
        return output[0]

    def plain(row):
        with wrapped.trace(row[None]):
            output = wrapped.output.logits.save()
        return output[0]

    refused = WriteError if use in ("steer", "route_around", "assigned") else moelens.MoelensError
    with pytest.raises(refused, match=r"this trace runs inside torch.func.vmap \(or jacfwd, which runs it\), where "
                                      r"moelens cannot serve values, place writes or run interventions"):
        torch.func.vmap(traced)(ids)
    torch.testing.assert_close(torch.func.vmap(plain)(ids), hf(input_ids=ids).logits, rtol=0, atol=1e-6)
    with torch.no_grad(), wrapped.trace(ids):
        routed = moe.routed_output.save()
        after = wrapped.output.logits.save()
    assert torch.equal(after, hf(input_ids=ids).logits) and routed.shape[:2] == ids.shape


@pytest.mark.parametrize(("family", "ranked"), [("mixtral", "router_logits"), ("deepseek_v3", "selection_scores")])
def test_a_refused_route_around_never_reaches_the_model_s_tensor(family, ranked):
    """route_around edits the logits (or selection scores) in place, and its refusal (every expert routed around)
    came at the block's next read, with the edit already in the model's tensor: caught in the trace under no_grad,
    the model ran with it (NaN weights in mixtral, excluded experts picked in deepseek_v3). It is refused at the
    call now, before the edit, and a run that catches it goes on from the model's own values. Ground truth: the
    plain transformers forward of an unwrapped copy, and the experts' arguments seen by a forward pre-hook there."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    moe = wrapped.moes[0]
    seen = []
    handle = reference.get_submodule(moe.experts.path.removeprefix("model.")).register_forward_pre_hook(
        lambda module, args: seen.append(args[1:3]))
    try:
        with torch.no_grad():
            expected = reference(**inputs).logits
    finally:
        handle.remove()
    with torch.no_grad(), wrapped.trace(**inputs):
        refusal = None
        try:
            moelens.ablate(moe, range(moe.num_experts), "route_around")
        except WriteError as error:
            refusal = nnsight.save(str(error))
        indices = moe.expert_indices.save()
        weights = moe.expert_weights.save()
        logits = wrapped.output.logits.save()
    assert refusal.startswith(f"ablate(mode='route_around') of experts {list(range(moe.num_experts))}: "
                              f"{moe.path}.{ranked}: fewer than"), refusal
    assert torch.equal(logits, expected)
    assert torch.equal(indices.reshape(seen[0][0].shape), seen[0][0])
    assert torch.equal(weights.reshape(seen[0][1].shape), seen[0][1])
