"""Activation patching against plain torch hooks on an unwrapped copy: a value read in a clean invoke written into a
corrupted one (one trace), a value saved in one trace written in another, a value read at a step of one generate
written at that step of another, and the gradients of the corrupted invoke's metric (attribution patching)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import moelens
from groundtruth import ascii_tokenizer
from moelens.testing import tiny_model

FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3"]  # softmax top-k; a gated shared expert; sigmoid + groups + bias
CLEAN = torch.tensor([[5, 9, 14, 3, 30, 77]])
CORRUPT = torch.tensor([[7, 9, 21, 3, 40, 12]])
S = CLEAN.shape[1]
NAMES = {"routing": ("expert_weights", "expert_indices")}


def built(family):
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    return hf, reference, moelens.wrap(hf)


@contextlib.contextmanager
def hooks(*pairs):
    handles = []
    try:
        for module, kind, fn in pairs:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(fn, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def block(reference, layer):
    return reference.model.layers[layer].mlp


def patch_hook(reference, layer, value, rows):
    """A torch hook that writes, for each (destination, source) flat token pair of ``rows``, the source token's
    ``value`` into the destination token (router logits: through the router's input, which gives them)."""
    moe = block(reference, layer)
    if value == "router_logits":
        def fn(module, args, kwargs):
            x = args[0].clone()
            flat = x.view(-1, x.shape[-1])
            for dst, src in rows:
                flat[dst] = flat[src]
            return (x,) + args[1:], kwargs
        return moe.gate, "pre", fn
    if value == "routing":
        def fn(module, args, kwargs):
            indices, weights = args[1].clone(), args[2].clone()
            for dst, src in rows:
                indices[dst], weights[dst] = indices[src], weights[src]
            return (args[0], indices, weights) + args[3:], kwargs
        return moe.experts, "pre", fn

    def fn(module, args, kwargs, output):
        output = output.clone()
        flat = output.view(-1, output.shape[-1])
        for dst, src in rows:
            flat[dst] = flat[src]
        return output
    return (moe.experts if value == "routed_output" else moe), "fwd", fn


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", ["router_logits", "routing", "routed_output", "mlp_output"])
@pytest.mark.parametrize("positions", [None, [S - 1]], ids=["every-token", "last-token"])
def test_a_clean_invokes_value_patched_into_a_corrupted_invoke(family, value, positions):
    hf, reference, wrapped = built(family)
    moe = wrapped.moes[0]
    names = NAMES.get(value, (value,))
    box = []
    with torch.no_grad(), wrapped.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CLEAN):
            for name in names:
                box.append(getattr(moe, name))
            barrier()
            clean_logits = wrapped.output.logits.save()
        with tracer.invoke(CORRUPT):
            own = [getattr(moe, name) for name in names]
            barrier()
            for name, mine, theirs in zip(names, own, box):
                if positions is None:
                    setattr(moe, name, theirs)
                else:
                    mine[:, positions] = theirs[:, positions]
            patched = wrapped.output.logits.save()
    rows = [(S + p, p) for p in (range(S) if positions is None else positions)]
    with torch.no_grad():
        plain = reference(torch.cat([CLEAN, CORRUPT])).logits
        with hooks(patch_hook(reference, moe.layer, value, rows)):
            expected = reference(torch.cat([CLEAN, CORRUPT])).logits
    assert not torch.allclose(expected[1], plain[1])
    torch.testing.assert_close(clean_logits[0], plain[0])
    torch.testing.assert_close(patched[0], expected[1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", ["routing", "mlp_output"])
def test_a_value_saved_in_one_trace_patched_into_the_next(family, value):
    hf, reference, wrapped = built(family)
    moe = wrapped.moes[0]
    names = NAMES.get(value, (value,))
    saved = []
    with torch.no_grad(), wrapped.trace(CLEAN):
        for name in names:
            saved.append(getattr(moe, name))
    with torch.no_grad(), wrapped.trace(CORRUPT):
        for name, theirs in zip(names, saved):
            getattr(moe, name)[:, -1] = theirs[:, -1]
        patched = wrapped.output.logits.save()
    with torch.no_grad(), hooks(patch_hook(reference, moe.layer, value, [(2 * S - 1, S - 1)])):
        expected = reference(torch.cat([CLEAN, CORRUPT])).logits
    torch.testing.assert_close(patched[0], expected[1])
    with pytest.raises(moelens.WriteError, match=r"expected \(2, 6.*to write this one row into each of the 2 "
                                                 r"rows, write value\.expand\(2, -1, -1\)\.$"):  # refused by shape
        with torch.no_grad(), wrapped.trace(torch.cat([CORRUPT, CORRUPT])):
            setattr(moe, names[0], saved[0])
    with torch.no_grad(), wrapped.trace(torch.cat([CORRUPT, CORRUPT])):  # the way the refusal names
        for name, theirs in zip(names, saved):
            setattr(moe, name, theirs.expand(2, *theirs.shape[1:]))
        both = wrapped.output.logits.save()
    with torch.no_grad(), hooks(patch_hook(reference, moe.layer, value, [(S + p, p) for p in range(S)])):
        expected = reference(torch.cat([CLEAN, CORRUPT])).logits
    torch.testing.assert_close(both, expected[1:].expand(2, -1, -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_read_at_a_step_of_one_generate_patched_at_that_step_of_another(family):
    hf, reference, _ = built(family)
    tokenizer = ascii_tokenizer()
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    moe, step_patched, steps = wrapped.moes[0], 2, 4
    settings = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    box = []
    with wrapped.generate("hello wor", **settings) as tracer:
        for _ in tracer.iter[step_patched]:
            box += [moe.expert_weights, moe.expert_indices]
    logits = []
    with wrapped.generate("jelly bea", **settings) as tracer:
        for step in tracer.iter[:steps]:
            if step == step_patched:
                moe.expert_weights[:] = box[0] * 30
                moe.expert_indices[:] = box[1]
            logits.append(wrapped.lm_head.output[:, -1])
    kept, calls = {}, [0]

    def keep(module, args, kwargs):
        if calls[0] == step_patched:
            kept["routing"] = (args[1].clone(), args[2].clone())
        calls[0] += 1

    def patch(module, args, kwargs):
        calls[0] += 1
        if calls[0] - 1 == step_patched:
            return (args[0], kept["routing"][0], kept["routing"][1] * 30) + args[3:], kwargs

    experts = block(reference, moe.layer).experts
    with hooks((experts, "pre", keep)):
        reference.generate(**tokenizer("hello wor", return_tensors="pt"), **settings)
    calls[0] = 0
    with hooks((experts, "pre", patch)):
        expected = reference.generate(**tokenizer("jelly bea", return_tensors="pt"), **settings,
                                      output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(expected.logits, 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_attribution_gradients_in_the_corrupted_invoke(family):
    hf, reference, wrapped = built(family)
    moe = wrapped.moes[0]
    names = ("router_logits", "expert_weights", "routed_output", "mlp_output")
    grads, own = {}, {}
    with wrapped.trace() as tracer:
        with tracer.invoke(CLEAN):
            moe.mlp_output.save()
        with tracer.invoke(CORRUPT):
            for name in names:
                own[name] = getattr(moe, name)
            metric = wrapped.output.logits[0, -1].log_softmax(-1)[42]
            with metric.backward():
                for name in reversed(names):
                    grads[name] = own[name].grad.save()
    kept = {}
    moe_ref = block(reference, moe.layer)

    def keep(name, index=None):
        def fn(module, args, kwargs, output=None):
            tensor = args[index] if output is None else (output[0] if name == "router_logits" else output)
            tensor.retain_grad()
            kept[name] = tensor
        return fn

    with hooks((moe_ref.gate, "fwd", keep("router_logits")), (moe_ref.experts, "pre", keep("expert_weights", 2)),
               (moe_ref.experts, "fwd", keep("routed_output")), (moe_ref, "fwd", keep("mlp_output"))):
        reference(torch.cat([CLEAN, CORRUPT])).logits[1, -1].log_softmax(-1)[42].backward()
    for name in names:
        expected = kept[name].grad.reshape(2, S, -1)[1:]
        torch.testing.assert_close(grads[name], expected.reshape(grads[name].shape))


@pytest.mark.parametrize("family", FAMILIES)
def test_docs_expert_share_patch_runs_as_written_and_matches_hooks(family, tmp_path):
    """docs/values.md's recipe patching one expert's output (its share of routed_output), run as written: the logits
    equal an unwrapped copy whose experts module adds expert 7's clean share minus its corrupted one, each share
    recomputed by hand from the fused weights (a forward hook; routing patched instead would move no expert's
    output)."""
    import re
    import runpy
    from pathlib import Path

    hf, reference, model = built(family)
    model = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    experts = reference.get_submodule(model.moes[1].experts.path.removeprefix("model."))

    def share(hidden, indices, weights):
        gate, up = torch.nn.functional.linear(hidden, experts.gate_up_proj[7]).chunk(2, -1)
        output = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[7])
        return output * (weights * (indices == 7)).sum(-1, keepdim=True)

    shares = []
    with torch.no_grad(), hooks((experts, "pre", lambda module, args, kwargs: shares.append(share(*args[:3])))):
        plain = reference(CORRUPT).logits
        reference(CLEAN)
    corrupted_share, clean_share = shares
    with torch.no_grad(), hooks((experts, "post", lambda module, args, kwargs, output:
                                 output - corrupted_share + clean_share)):
        expected = reference(CORRUPT).logits
    assert not torch.allclose(expected, plain), "expert 7 is routed nowhere: the patch would change nothing"
    text = (Path(__file__).parents[1] / "docs" / "values.md").read_text()
    script = tmp_path / "recipe.py"  # nnsight reads a trace's body from its source file
    script.write_text(next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                           if "def expert_share" in block))
    with torch.no_grad():
        names = runpy.run_path(str(script), init_globals={"model": model, "clean": CLEAN, "corrupted": CORRUPT})
    torch.testing.assert_close(names["logits"], expected, atol=1e-6, rtol=1e-6)
