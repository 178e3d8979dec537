"""Gradients at served values: ``value.grad`` inside nnsight's ``with loss.backward():`` block.

Ground truth, independent of moelens: the same loss on an unwrapped copy where plain
nnsight adds a zero leaf tensor at the raw location (the router's logits op, the experts
call's weights argument, the experts and block outputs) and torch autograd gives the
leaf's gradient; per-slot gradients follow from the routed sum and the expert weights.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from groundtruth import built, first_tensor

GRADIENT_CASES = [(family, impl) for family in ("mixtral", "qwen2_moe") for impl in ("grouped_mm", "batched_mm")]


def loss_of(output) -> torch.Tensor:
    logits = first_tensor(output)
    return logits[:, -1].log_softmax(-1)[:, 5].sum() + logits[:, 1, 7].sum()


def plain_gradients(reference, inputs, moe) -> dict[str, torch.Tensor]:
    """Gradients of the loss at the block's raw tensors, by zero leaves added with plain nnsight."""
    family = moe.family
    plain = nnsight.NNsight(reference)
    leaves = {}
    with plain.trace(**inputs):
        block = plain.get(moe.path.removeprefix("model."))
        logits = block.get(family.router).source.__getattr__(family.logits_op)
        leaves["router_logits"] = torch.zeros_like(logits.output, requires_grad=True)
        logits.output = logits.output + leaves["router_logits"]
        experts = block.get(family.experts)
        (hidden, indices, weights, *rest), kwargs = experts.inputs
        leaves["expert_weights"] = torch.zeros_like(weights, requires_grad=True)
        experts.inputs = ((hidden, indices, weights + leaves["expert_weights"], *rest), kwargs)
        leaves["routed_output"] = torch.zeros_like(experts.output, requires_grad=True)
        experts.output = experts.output + leaves["routed_output"]
        leaves["mlp_output"] = torch.zeros_like(block.output, requires_grad=True)
        block.output = block.output + leaves["mlp_output"]
        slots = nnsight.save((indices, weights))
        output = plain.output.save()
    loss_of(output).backward()
    shape = inputs["input_ids"].shape
    grads = {name: leaf.grad.reshape(*shape, -1) for name, leaf in leaves.items()}
    grads["indices"], grads["weights"] = (tensor.reshape(*shape, -1) for tensor in slots)
    return grads


@pytest.mark.parametrize(("family", "impl"), GRADIENT_CASES, ids=[f"{f}-{i}" for f, i in GRADIENT_CASES])
def test_gradients_at_served_values(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    moe = wrapped.moes[-1]
    names = [name for name in moe.order() if name not in ("expert_indices", "router_probs")]  # probs: derived, off the graph
    with wrapped.trace(**inputs):
        values = {name: getattr(moe, name) for name in names}
        loss = loss_of(wrapped.output)
        with loss.backward():
            grads = nnsight.save({name: values[name].grad.save() for name in reversed(names)})
    truth = plain_gradients(reference, inputs, moe)
    close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # noqa: E731
    for name in ("router_logits", "expert_weights", "routed_output", "mlp_output"):
        assert grads[name].abs().max() > 0, name
        close(grads[name], truth[name])
    if "shared_expert_output" in grads:  # qwen2_moe: block output = routed + shared
        close(grads["shared_expert_output"], truth["mlp_output"])
    # each slot's weighted output is summed into the routed output ...
    close(grads["expert_outputs"], truth["routed_output"][:, :, None].expand_as(grads["expert_outputs"]))
    # ... as weight * down_proj(activations), so d/d activations = weight * g_routed @ down_proj[expert]
    down = moe.experts._module.down_proj.detach()[truth["indices"]]  # [b, s, k, D, I]
    by_hand = truth["weights"][..., None] * torch.einsum("bsd,bskdi->bski", truth["routed_output"], down)
    close(grads["expert_activations"], by_hand)


@pytest.mark.parametrize("name", ["router_logits", "expert_weights", "routed_output", "mlp_output"])
def test_a_value_read_then_replaced_has_a_zero_gradient(name):
    """The replaced value stays in the graph (for expert parallelism's collectives); the view the
    user read is that value, so its gradient arrives, and is zero: nothing depends on it any more."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        read = getattr(moe, name)
        setattr(moe, name, torch.full(read.shape, 0.3))
        loss = loss_of(wrapped.output)
        with loss.backward():
            grad = read.grad.save()
    assert grad.shape[:2] == inputs["input_ids"].shape and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize(("family", "name"), [("mixtral", "expert_indices"), ("gpt_oss", "expert_weights")])
def test_in_place_edits_with_autograd_on_keep_the_backward_working(family, name):
    """Autograd keeps the router's top-k indices (and gpt_oss's softmax weights) for its backward: an
    in-place edit of the served value must not break it, and the gradients are those of plain
    nnsight making the same edit on a copy."""
    hf, wrapped, inputs, plain, reference = built(family, "grouped_mm")
    hf.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)  # the models are shared between tests
    moe = wrapped.moes[0]
    num_experts = moe.num_experts

    def edit(tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            tensor[..., 0] *= 0.5
        else:
            tensor[..., 0] = (tensor[..., 0] + 1) % num_experts

    with wrapped.trace(**inputs):
        edit(getattr(moe, name))
        output = wrapped.output.save()
    loss_of(output).backward()

    raw = nnsight.NNsight(reference)
    with raw.trace(**inputs):
        experts = raw.get(moe.path.removeprefix("model.")).get(moe.family.experts)
        (hidden, indices, weights, *rest), kwargs = experts.inputs
        indices, weights = indices.clone(), weights.clone()
        edit(indices if name == "expert_indices" else weights)
        experts.inputs = ((hidden, indices, weights, *rest), kwargs)
        expected = raw.output.save()
    loss_of(expected).backward()
    torch.testing.assert_close(first_tensor(output), first_tensor(expected))
    for (param_name, param), reference_param in zip(hf.named_parameters(), reference.parameters()):
        if param.grad is not None or reference_param.grad is not None:
            torch.testing.assert_close(param.grad, reference_param.grad, atol=1e-6, rtol=1e-5, msg=param_name)
