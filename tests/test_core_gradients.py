"""Gradients at served values: ``value.grad`` inside nnsight's ``with loss.backward():`` block.

Ground truth, independent of moelens: the same loss on an unwrapped copy where plain
nnsight adds a zero leaf tensor at the raw location (the router's logits op, the experts
call's weights argument, the experts and block outputs) and torch autograd gives the
leaf's gradient; per-slot gradients follow from the routed sum and the expert weights.
"""

from __future__ import annotations

import warnings

import nnsight
import pytest
import torch

import moelens
from groundtruth import built, first_tensor

GRADIENT_CASES = [(family, impl) for family in ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")
                  for impl in ("grouped_mm", "batched_mm")]


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
        out = block.output
        hidden_out = out[0] if isinstance(out, tuple) else out  # gpt_oss's block returns (hidden, router scores)
        leaves["mlp_output"] = torch.zeros_like(hidden_out, requires_grad=True)
        hidden_out = hidden_out + leaves["mlp_output"]
        block.output = (hidden_out, *out[1:]) if isinstance(out, tuple) else hidden_out
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
        served_pre = values["expert_pre_activations"].save()
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
    experts = moe.experts._module
    down = experts.down_proj.detach()[truth["indices"]]  # [b, s, k, D, I], or [b, s, k, I, D] where transposed
    pattern = "bsd,bskid->bski" if getattr(experts, "is_transposed", False) else "bsd,bskdi->bski"
    by_hand = truth["weights"][..., None] * torch.einsum(pattern, truth["routed_output"], down)
    close(grads["expert_activations"], by_hand)
    # ... and the activations are the experts' own gate of the pre-activations: its vector-Jacobian product
    pre = served_pre.detach().requires_grad_(True)
    (through_gate,) = torch.autograd.grad(experts._apply_gate(pre), pre, by_hand)
    close(grads["expert_pre_activations"], through_gate)


def test_a_value_first_asked_for_inside_the_backward_block_says_to_bind_it_before():
    """nnsight runs a `with loss.backward():` block under an interleaver of its own: a value or an intervention
    first asked for there was refused as belonging to "another wrapped model than the one this trace runs" (so was
    one asked for in a backward block after the trace)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    refused = (r"layers\.0\.mlp.*: asked for inside a `with loss\.backward\(\):` block, which serves only gradients: "
               r"bind the value before the block, in a trace of its model")
    for use in (lambda: wrapped.moes[0].router_logits.grad.save(), lambda: moelens.ablate(wrapped.moes[0], 1)):
        with pytest.raises(moelens.ValueUnavailable, match=refused):
            with wrapped.trace(**inputs):
                loss = loss_of(wrapped.output)
                with loss.backward():
                    use()
        with wrapped.trace(**inputs):
            loss = loss_of(wrapped.output).save()
        with pytest.raises(moelens.ValueUnavailable, match=refused):
            with loss.backward():
                use()
    with wrapped.trace(**inputs):  # as the message says
        logits = wrapped.moes[0].router_logits
        loss = loss_of(wrapped.output)
        with loss.backward():
            grad = logits.grad.save()
    assert grad.abs().max() > 0


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


def test_a_value_read_before_one_replaced_after_it_has_a_zero_gradient():
    """The router logits no longer reach the loss once the routed output is replaced: their .grad in the backward
    block is zero (it came as a silent None while a replaced value handed back no gradient)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        logits = moe.router_logits
        moe.routed_output = torch.zeros(*inputs["input_ids"].shape, hf.config.hidden_size)
        loss = loss_of(wrapped.output)
        with loss.backward():
            grad = logits.grad.save()
    assert grad.shape == (*inputs["input_ids"].shape, moe.num_experts) and not grad.any()


@pytest.mark.parametrize("before", ["nothing", "a read", "an ablation"])
def test_parameters_behind_a_replaced_value_get_no_gradient_as_in_plain_torch(before):
    """They got a zero gradient (the replaced value was kept in the graph), which AdamW's weight decay and momentum
    moved them by where plain torch leaves them alone; also behind an earlier write (an ablation's), whose backward
    torch gave a zero gradient for none. Ground truth: plain nnsight replacing the experts' output on the copy (their
    parameters' .grad stays None)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    hf.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)  # the models are shared between tests
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        if before == "an ablation":
            moelens.ablate(moe, 1)
        shape = (*inputs["input_ids"].shape, hf.config.hidden_size)
        moe.routed_output = torch.zeros_like(moe.routed_output) if before == "a read" else torch.zeros(shape)
        output = wrapped.output.save()
    loss_of(output).backward()
    raw = nnsight.NNsight(reference)
    with raw.trace(**inputs):
        experts = raw.get(moe.path.removeprefix("model.") + ".experts")
        experts.output = torch.zeros_like(experts.output)
        expected = raw.output.save()
    loss_of(expected).backward()
    experts = dict(moe.experts._module.named_parameters())
    assert experts and all(param.grad is None for param in experts.values())
    assert_matches_plain(output, expected, hf, reference)


def assert_matches_plain(output, expected, hf, reference) -> None:
    """The traced output and every parameter's gradient after its backward equal plain nnsight's on the copy."""
    torch.testing.assert_close(first_tensor(output), first_tensor(expected))
    for (param_name, param), reference_param in zip(hf.named_parameters(), reference.parameters()):
        if param.grad is not None or reference_param.grad is not None:
            torch.testing.assert_close(param.grad, reference_param.grad, atol=1e-6, rtol=1e-5, msg=param_name)


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
    assert_matches_plain(output, expected, hf, reference)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_expert_activations_edited_in_time_or_late_with_autograd_on(impl):
    """An in-place edit of expert_activations before the next read lands with the gradients of plain nnsight making
    it; one after the next read is an OrderError under both implementations. Under batched_mm (activations already
    in token-slot order) the model went on from a view of the served value, so the late edit reached what the down
    projection keeps for its backward: torch's bare "modified by an inplace operation" at the backward."""
    hf, wrapped, inputs, plain, reference = built("mixtral", impl)
    hf.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)  # the models are shared between tests
    moe = wrapped.moes[0]
    with wrapped.trace(**inputs):
        moe.expert_activations.mul_(2.0)
        output = wrapped.output.save()
    loss_of(output).backward()
    raw = nnsight.NNsight(reference)
    with raw.trace(**inputs):
        inner = raw.get(moe.path.removeprefix("model.")).experts.source.experts_forward_1.source
        inner.self__apply_gate_0.output.mul_(2.0)
        expected = raw.output.save()
    loss_of(expected).backward()
    assert_matches_plain(output, expected, hf, reference)
    hf.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
    with pytest.raises(moelens.OrderError, match=r"layers\.0\.mlp\.expert_activations was edited in place after "
                                                 r"moelens had handed it back"):
        with wrapped.trace(**inputs):
            activations = moe.expert_activations
            moe.expert_outputs
            activations.mul_(0.5)
            loss = loss_of(wrapped.output)
            with loss.backward():
                pass
    hf.zero_grad(set_to_none=True)


def checkpointed(family: str, implementation: str, on: bool, every_n_layers: int = 1, reentrant: bool = False):
    """A tiny model in training mode (dropout off), its decoder layers under activation checkpointing if ``on``."""
    from moelens.testing import tiny_inputs, tiny_model

    if implementation == "torch_a2a":  # moelens' expert-parallel implementation, here on one process
        from moelens.parallel import register_torch_a2a

        register_torch_a2a()
    hf = tiny_model(family, experts_implementation="grouped_mm" if implementation == "torch_a2a" else implementation)
    if implementation == "torch_a2a":
        hf.set_experts_implementation(implementation)
    if on:
        hf.activation_checkpointing_enable({"use_reentrant": reentrant}, every_n_layers=every_n_layers)
    hf.train()
    for module in hf.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return hf, tiny_inputs(hf)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "torch_a2a"])
def test_reading_every_value_under_activation_checkpointing_keeps_the_backward(implementation):
    """router_probs (a score moelens computes), grouped_mm's activations (re-sorted by moelens) and torch_a2a's
    round trip of the activations saved tensors for backward that checkpointing's recomputation does not make:
    backward raised CheckpointError."""
    truth = gradients_of(*checkpointed("mixtral", implementation, False), traced=False)  # no checkpointing, no nnsight
    assert_same_gradients(gradients_of(*checkpointed("mixtral", implementation, True), traced=True), truth)


def test_a_backward_in_the_trace_through_reentrant_checkpointing_says_to_call_it_after():
    """torch's reentrant checkpoint reads the .grad of the inputs it recomputes, which nnsight takes for a late
    request: the backward failed with nnsight's OutOfOrderError naming a tensor id only. Called after the trace, it
    gives the gradients of the model run plainly."""
    import moelens

    hf, inputs = checkpointed("mixtral", "grouped_mm", True, reentrant=True)
    model = moelens.wrap(hf)
    with pytest.raises(moelens.MoelensError, match=r"reentrant activation checkpointing \(use_reentrant=True.*call "
                                                   r"backward\(\) after the trace, or checkpoint with use_reentrant=False"):
        with model.trace(**inputs):
            output = model.output.save()
            with loss_of(output).backward():
                pass
    hf.zero_grad(set_to_none=True)
    truth = gradients_of(*checkpointed("mixtral", "grouped_mm", False), traced=False)
    assert_same_gradients(gradients_of(hf, inputs, traced=True), truth)


def gradients_of(hf, inputs, traced: bool) -> dict[str, torch.Tensor]:
    """The parameter gradients of `loss_of` ``hf`` on ``inputs``, run plainly or traced by moelens reading every
    value (``save_all``); named as in the plain model (torch's checkpoint wrappers left out)."""
    import moelens

    if traced:
        model = moelens.wrap(hf)
        with model.trace(**inputs):
            model.save_all()
            output = model.output.save()
    else:
        output = hf(**inputs)
    loss_of(output).backward()
    return {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in hf.named_parameters()
            if p.grad is not None}


def assert_same_gradients(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 10
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, msg=name)


def test_an_edit_in_a_checkpointed_layer_is_refused_with_autograd_on():
    """The backward recomputes the layer without the trace's edit: the gradients were those of the
    unedited model (an expert-weight write) or torch's CheckpointError (ablate, steer)."""
    import moelens

    hf, inputs = checkpointed("mixtral", "grouped_mm", True)
    model = moelens.wrap(hf)
    edits = (lambda moe: moelens.steer(moe, 2, 3.0), lambda moe: moe.expert_weights.__setitem__((..., 1), 0),
             lambda moe: setattr(moe, "expert_weights", torch.zeros_like(moe.expert_weights)))  # an assignment too
    for edit in edits:
        with pytest.raises(moelens.WriteError, match=r"model.model.layers.0.mlp.\w+ is edited inside "
                                                     r"MixtralDecoderLayer, which runs under activation checkpointing"):
            with model.trace(**inputs):
                edit(model.moes[0])
    # reentrant checkpointing runs the layer with autograd off, and its backward recomputes it all the same
    bare = checkpointed("mixtral", "grouped_mm", False)[0]
    bare._set_gradient_checkpointing(True)  # torch's checkpoint itself, reentrant unless told otherwise (it warns)
    unsaid = checkpointed("mixtral", "grouped_mm", False)[0]  # a partial of it that says nothing about reentrancy
    unsaid.activation_checkpointing_enable(activation_checkpointing_kwargs={"preserve_rng_state": True})
    warnings.filterwarnings("ignore", message="torch.utils.checkpoint: the use_reentrant parameter")
    for hf in (checkpointed("mixtral", "grouped_mm", True, reentrant=True)[0], bare, unsaid):
        reentrant = moelens.wrap(hf)
        with pytest.raises(moelens.WriteError, match=r"runs under reentrant activation checkpointing"):
            with reentrant.trace(**inputs):
                reentrant.moes[0].router_logits[..., 0] += 5  # an in-place edit, checked at its write-back
        with torch.inference_mode(), reentrant.trace(**inputs):  # no backward can run there: the edit lands
            moelens.steer(reentrant.moes[0], 2, 30.0)
            indices = reentrant.moes[0].expert_indices.save()
        assert (indices == 2).any(-1).all()
        with pytest.raises(moelens.WriteError, match=r"runs under reentrant activation checkpointing"):
            with reentrant.trace(**inputs):  # the layer's forward began with autograd on: its backward recomputes it
                reentrant.moes[0].router_logits.save()
                with torch.inference_mode():  # in the body only
                    reentrant.moes[0].routed_output = torch.zeros_like(reentrant.moes[0].routed_output)
    every_other = moelens.wrap(checkpointed("mixtral", "grouped_mm", True, every_n_layers=2)[0])
    for layer, grad in ((0, False), (1, True)):  # no backward; layer 1 is not checkpointed
        with torch.set_grad_enabled(grad), every_other.trace(**inputs):
            moelens.steer(every_other.moes[layer], 2, 30.0)
            indices = every_other.moes[layer].expert_indices.save()
        assert (indices == 2).any(-1).all()


def torch_checkpointed(family: str, reentrant: bool):
    """A tiny model in training mode whose decoder layers torch's checkpoint_wrapper wraps (FSDP's, accelerate's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    hf, inputs = checkpointed(family, "grouped_mm", False)
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    layer = type(hf.model.layers[0])
    apply_activation_checkpointing(hf, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, layer))
    return hf, inputs


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_an_edit_under_torchs_checkpoint_wrapper_is_refused_and_reads_keep_the_backward():
    """torch's checkpoint_wrapper around decoder layers was not looked at: an expert-weight write gave the unedited
    model's gradients silently, steer torch's CheckpointError. Reading is fine: the gradients are the plain
    model's (no nnsight, no checkpointing); under no_grad a non-reentrant wrapper recomputes nothing."""
    import moelens

    hf, inputs = torch_checkpointed("mixtral", reentrant=False)
    model = moelens.wrap(hf)
    for edit in (lambda moe: moelens.steer(moe, 2, 3.0), lambda moe: moe.expert_weights.__setitem__((..., 1), 0)):
        with pytest.raises(moelens.WriteError, match=r"layers.0._checkpoint_wrapped_module.mlp.\w+ is edited inside "
                                                     r"CheckpointWrapper, which runs under activation checkpointing "
                                                     r"\(torch's checkpoint_wrapper\)"):
            with model.trace(**inputs):
                edit(model.moes[0])
    with torch.no_grad(), model.trace(**inputs):
        moelens.steer(model.moes[0], 2, 30.0)
        indices = model.moes[0].expert_indices.save()
    assert (indices == 2).any(-1).all()
    reentrant = moelens.wrap(torch_checkpointed("mixtral", reentrant=True)[0])
    with pytest.raises(moelens.WriteError, match=r"runs under reentrant activation checkpointing"):
        with torch.no_grad(), reentrant.trace(**inputs):
            moelens.steer(reentrant.moes[0], 2, 3.0)
    truth = gradients_of(*checkpointed("mixtral", "grouped_mm", False), traced=False)
    assert_same_gradients(gradients_of(*torch_checkpointed("mixtral", reentrant=False), traced=True), truth)


def test_an_edit_in_a_plain_model_that_checkpoints_its_own_layers_is_refused():
    """The flag on the wrapped model itself was not looked at: CheckpointError, or with a reentrant checkpoint
    gradients of neither the edited nor the unedited model."""
    import moelens
    from custom_models import CustomModel, custom_family, custom_model

    class Checkpointing(CustomModel):
        gradient_checkpointing = True

        def forward(self, input_ids):
            hidden = self.embed(input_ids)
            for layer in self.layers:
                hidden = hidden + torch.utils.checkpoint.checkpoint(layer["ffn"], hidden, use_reentrant=True)
            return hidden

    model = custom_model().train()
    model.__class__ = Checkpointing
    moelens.families.register(custom_family())
    try:
        wrapped = moelens.wrap(model)
        with pytest.raises(moelens.WriteError, match=r"layers.1.ffn.expert_weights is edited inside Checkpointing, "
                                                     r"which runs under reentrant activation checkpointing"):
            with wrapped.trace(torch.tensor([[1, 2, 3]])):
                wrapped.moes[1].expert_weights[..., 0] = 1.0
    finally:
        moelens.families.unregister("custom")


@pytest.mark.parametrize("name", ["expert_weights", "routed_output", "router_logits"])
def test_gradients_flow_through_a_written_value_to_what_it_was_made_from(name):
    """``moe.<value> = value * scale`` passes d loss / d scale on (learned steering, attribution patching). Ground
    truth: the plain model with the same scaling done by a torch hook on the module that consumes or makes it."""
    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    scale = torch.tensor(1.5, requires_grad=True)
    with wrapped.trace(**inputs):
        setattr(moe, name, getattr(moe, name) * scale)
        loss = loss_of(wrapped.output).save()
    loss.backward()

    truth = torch.tensor(1.5, requires_grad=True)
    block = hf.get_submodule(moe.path.removeprefix("model."))
    if name == "expert_weights":
        hook = block.experts.register_forward_pre_hook(lambda module, args: (args[0], args[1], args[2] * truth))
    elif name == "routed_output":
        hook = block.experts.register_forward_hook(lambda module, args, output: output * truth)
    else:  # the router's logits, before it scores and ranks them: its linear layer's output
        original = block.gate.forward

        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, block.gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, block.gate.weight) * truth
            probs = logits.softmax(dim=-1, dtype=torch.float)
            weights, indices = torch.topk(probs, block.gate.top_k, dim=-1)
            return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), indices

        block.gate.forward = forward
        hook = type("Restore", (), {"remove": lambda self: setattr(block.gate, "forward", original)})()
    try:
        expected = loss_of(hf(**inputs))
    finally:
        hook.remove()
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    assert truth.grad.abs() > 0
    torch.testing.assert_close(scale.grad, truth.grad)


def test_steer_with_a_bias_that_requires_grad_passes_its_gradient_on():
    """steer(moe, e, bias) took a one-element tensor bias as a Python float: a learned steering bias got no gradient
    (bias.grad None) and nothing said so. Ground truth: the plain model whose router adds the same tensor to expert
    e's linear logit, backpropagated."""
    import moelens
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral")
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moe, expert = wrapped.moes[0], 2
    bias = torch.tensor(2.0, requires_grad=True)
    with wrapped.trace(**inputs):
        moelens.steer(moe, expert, bias)
        loss = loss_of(wrapped.output).save()
    loss.backward()

    truth = torch.tensor(2.0, requires_grad=True)
    gate = hf.get_submodule(moe.router.path.removeprefix("model."))
    original = gate.forward

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, gate.weight)
        logits = logits + truth * (torch.arange(logits.shape[-1], device=logits.device) == expert)
        probs = logits.softmax(dim=-1, dtype=torch.float)
        weights, indices = torch.topk(probs, gate.top_k, dim=-1)
        return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), indices

    gate.forward = forward
    try:
        expected = loss_of(hf(**inputs))
    finally:
        gate.forward = original
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    assert truth.grad.abs() > 0 and bias.grad is not None
    torch.testing.assert_close(bias.grad, truth.grad)


def test_values_read_with_autograd_on_free_their_graph_once_dropped():
    """router_probs (a softmax moelens computes, saving its output for backward) kept its own grad_fn alive
    through a cycle in torch's C++ graph that Python's gc cannot see: each trace reading it with autograd
    on leaked the whole forward graph behind it (hundreds of tensors, megabytes per trace)."""
    import gc
    import weakref

    hf, wrapped, inputs, plain, reference = built("qwen2_moe", "grouped_mm")
    for name in ("router_probs", "router_logits"):
        with wrapped.trace(**inputs):
            value = getattr(wrapped.moes[1], name).save()
        assert value.requires_grad, name
        freed = weakref.ref(value)
        del value
        locals()  # refreshes this frame's locals snapshot, which nnsight read in the trace (Python 3.11 keeps it)
        gc.collect()
        assert freed() is None, name


def test_router_probs_is_differentiable_twice():
    """Second derivatives through router_probs (create_graph=True) equal those of the family's softmax on the same
    logits: moelens' score keeps its saved tensors as autograd does, outside activation checkpointing."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    with wrapped.trace(**inputs):
        logits = wrapped.moes[0].router_logits.save()
        probs = wrapped.moes[0].router_probs.save()

    def second(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        first = torch.autograd.grad((probs ** 3).sum(), logits, create_graph=True)[0]
        return torch.autograd.grad((first ** 2).sum(), logits)[0]

    leaf = logits.detach().requires_grad_()
    torch.testing.assert_close(second(logits, probs), second(leaf, leaf.float().softmax(-1)))


def test_router_probs_read_first_under_activation_checkpointing_keeps_the_backward():
    """router_probs read before anything else of its block made the backward fail with CheckpointError, whether
    the loss used it or not: its request of the logits let the model run on inside moelens' saved-tensor hooks,
    where the checkpointed layer pushed its own. The gradients are those of the plain model (no nnsight, no
    checkpointing), its router's softmax computed from the router's own input and weight."""
    import torch.nn.functional as F

    import moelens

    gradients = []
    for on in (False, True):
        model = moelens.load()
        hf = model._module
        hf.train()
        ids = model.tokenizer("def add(a, b):\n    return a + b", return_tensors="pt")["input_ids"].to(hf.device)
        if on:
            hf.gradient_checkpointing_enable()
            with model.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
                probs = model.moes[0].router_probs.save()
                output = model.output.save()
        else:
            router = hf.model.layers[0].mlp.gate
            seen = []
            hook = router.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
            output = hf(input_ids=ids, attention_mask=torch.ones_like(ids))
            hook.remove()
            probs = F.linear(seen[0], router.weight).float().softmax(-1).view(1, ids.shape[1], -1)
        loss = output.logits[:, -1].log_softmax(-1)[:, 5].sum() + (probs.mean((0, 1)) ** 2).sum()
        loss.backward()
        gradients.append({name: p.grad for name, p in hf.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, msg=name)


@pytest.mark.parametrize("name", ["expert_weights", "expert_indices"])
def test_derived_routing_under_activation_checkpointing_keeps_the_backward(name):
    """llama4 has no experts call: moelens derives its weights and indices from the logits, saving tensors for
    backward that checkpointing's recomputation does not make (CheckpointError: a different number of tensors)."""
    import moelens

    gradients = []
    for on in (False, True):  # the truth: the plain model, no checkpointing, no nnsight
        hf, inputs = checkpointed("llama4", "eager", on)
        if on:
            model = moelens.wrap(hf)
            with model.trace(**inputs):
                getattr(model.moes[0], name).save()
                output = model.output.save()
        else:
            output = hf(**inputs)
        loss_of(output).backward()
        gradients.append({key: p.grad for key, p in hf.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    for key, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][key], gradient, msg=key)


def test_the_gradient_of_a_value_of_a_frozen_model_names_the_value_and_the_way_out():
    """On a model frozen with requires_grad_(False) (its lm_head alone trainable, so the loss has a gradient), a
    served value's .grad in the backward block raised torch's bare "cannot register a hook on a tensor that doesn't
    require gradient", naming no value. As in plain torch the value has no gradient (the truth: the router logits
    of an unwrapped frozen copy do not require grad); with the router unfrozen, as the error says, its gradient is
    plain nnsight's on that copy."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    for model in (hf, reference):
        model.requires_grad_(False)
        model.lm_head.requires_grad_(True)
    assert not reference(**inputs, output_router_logits=True).router_logits[1].requires_grad
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[1]

    def gradient() -> torch.Tensor:
        with wrapped.trace(**inputs):
            logits = moe.router_logits
            loss = loss_of(wrapped.output)
            with loss.backward():
                grad = logits.grad.save()
        return grad

    with pytest.raises(moelens.ValueUnavailable, match=r"layers\.1\.mlp\.router_logits\.grad: .* has no gradient: no "
                                                       r"parameter or input upstream of it requires grad.*unfreeze "
                                                       r"parameters .*enable_input_require_grads\(\)"):
        gradient()
    for model in (hf, reference):
        model.get_submodule(moe.router.path.removeprefix("model.")).requires_grad_(True)
    torch.testing.assert_close(gradient(), plain_gradients(reference, inputs, moe)["router_logits"])


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_the_gradient_of_router_probs_of_a_frozen_model_names_it_and_router_logits(family):
    """router_probs is moelens' score of the logits: no output depends on it. On a frozen model its .grad raised
    torch's bare "cannot register a hook on a tensor that doesn't require gradient", naming no value (the truth: the
    same score of the frozen router's logits, computed by hand, does not require grad either)."""
    from moelens.families.scoring import score
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model(family, experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    hf.requires_grad_(False)
    hf.lm_head.requires_grad_(True)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[-1]
    router = hf.get_submodule(moe.router.path.removeprefix("model."))
    with torch.enable_grad():
        assert not score("sigmoid", torch.nn.functional.linear(torch.randn(3, router.weight.shape[1]), router.weight)
                         ).requires_grad
    with pytest.raises(moelens.ValueUnavailable, match=r"layers\.\d+\.mlp\.router_probs\.grad: router_probs is derived "
                                                       r".*no gradient\. Read router_logits\.grad instead"):
        with wrapped.trace(**inputs):
            probs = moe.router_probs
            loss = loss_of(wrapped.output)
            with loss.backward():
                probs.grad.save()


def test_the_gradient_of_router_probs_of_a_trainable_model_names_it_and_router_logits():
    """With the router trainable, router_probs requires grad but no output depends on it (the truth: the model's
    output has no gradient path to moelens' own score of the logits), so its hook never fired and nnsight said the
    model ran past a tensor id ("'1398...504.grad.i0' was requested")."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    moe = wrapped.moes[0]
    with pytest.raises(moelens.ValueUnavailable, match=r"^model\.model\.layers\.0\.mlp\.router_probs\.grad: "
                                                       r"router_probs is derived .*last layer first\. Read "
                                                       r"router_logits\.grad for the model's own loss\.$"):
        with wrapped.trace(**inputs):
            probs = moe.router_probs
            assert probs.requires_grad
            loss = loss_of(wrapped.output)
            with loss.backward():
                probs.grad.save()


def test_the_gradient_of_router_probs_in_a_loss_of_them_read_out_of_order_names_the_order():
    """A loss computed from two layers' router_probs, their .grad read first layer first: the backward reaches layer
    1 first, and the refusal said no output depends on it. Read last layer first, both are the gradients autograd
    gives the same loss of the softmax of the router logits computed by hand."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    first, second = wrapped.moes[0], wrapped.moes[1]
    with pytest.raises(moelens.ValueUnavailable, match=r"layers\.1\.mlp\.router_probs\.grad: .*only where the loss "
                                                       r"was computed from it, and then it is read in the order the "
                                                       r"backward reaches the blocks, last layer first"):
        with wrapped.trace(**inputs):
            one, two = first.router_probs, second.router_probs
            loss = (one ** 2).sum() + (two ** 2).sum()
            with loss.backward():
                one.grad.save()
                two.grad.save()
    with wrapped.trace(**inputs):
        one, two = first.router_probs.save(), second.router_probs.save()
        loss = (one ** 2).sum() + (two ** 2).sum()
        with loss.backward():
            later = two.grad.save()
            earlier = one.grad.save()
    for probs, grad in ((one, earlier), (two, later)):  # d/dp sum(p ** 2) = 2 p, p the softmax of the logits
        torch.testing.assert_close(grad, 2 * probs.detach())


def test_the_gradient_of_the_expert_indices_says_integers_have_none():
    """expert_indices.grad raised torch's bare "cannot register a hook on a tensor that doesn't require gradient"
    (the indices are integers, which autograd gives no gradient: the truth is the experts call's int64 indices)."""
    hf, wrapped, inputs, plain, reference = built("mixtral", "grouped_mm")
    assert not plain_gradients(reference, inputs, wrapped.moes[0])["indices"].is_floating_point()
    with pytest.raises(moelens.ValueUnavailable, match=r"layers\.0\.mlp\.expert_indices\.grad: .* holds torch\.int64 "
                                                       r"values, and integers have no gradient"):
        with wrapped.trace(**inputs):
            indices = wrapped.moes[0].expert_indices
            loss = loss_of(wrapped.output)
            with loss.backward():
                indices.grad.save()


@pytest.mark.parametrize("name", ["expert_pre_activations", "expert_activations"])
def test_the_gradient_of_batched_mm_activations_of_a_frozen_model_names_the_value(name):
    """batched_mm serves the activations as views of the model's own tensors, which the run did not note: on a
    frozen model their .grad raised torch's bare "cannot register a hook on a tensor that doesn't require gradient".
    The truth: the experts' input of an unwrapped frozen copy does not require grad, nor do their weights."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="batched_mm")
    inputs = tiny_inputs(hf)
    hf.requires_grad_(False)
    hf.lm_head.requires_grad_(True)
    reference, seen = copy.deepcopy(hf), []
    hook = reference.model.layers[1].mlp.experts.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    reference(**inputs)
    hook.remove()
    assert not seen[0].requires_grad
    wrapped = moelens.wrap(hf)
    with pytest.raises(moelens.ValueUnavailable, match=rf"layers\.1\.mlp\.{name}\.grad: .* has no gradient"):
        with wrapped.trace(**inputs):
            value = getattr(wrapped.moes[1], name)
            loss = loss_of(wrapped.output)
            with loss.backward():
                value.grad.save()
