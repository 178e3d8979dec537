"""moelens.compress.tomoe: converted blocks compute what they should.

Ground truth: the dense model's own forward (top_k == num_experts must reproduce it), the
converted block recomputed by hand from its weights and the dense model's neurons (expert
by expert, no transformers experts implementation involved), and conditional means and
expert importances recomputed from the dense weights on the inputs captured with plain
torch hooks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelens.compress import ToMoEBlock, ToMoEIntermediateBlock, set_experts_implementation
from test_compress_helpers import MODELS, activation_by_hand, convert, ids, inputs_of, llama, run

IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]
BLOCKS = {"llama": ToMoEBlock, "bert": ToMoEIntermediateBlock, "gpt2": ToMoEBlock}


def blocks(model) -> list[tuple[str, ToMoEBlock]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ToMoEBlock)]


@torch.no_grad()
def dense_activations(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The intermediate neurons' activations ``[T, N]`` of a dense FFN (SwiGLU mlp, BERT intermediate, GPT-2 mlp)."""
    if hasattr(module, "gate_proj"):
        return module.act_fn(module.gate_proj(x)) * module.up_proj(x)
    if hasattr(module, "c_fc"):
        return module.act(module.c_fc(x))
    return module(x)  # BERT's intermediate: act(dense(x))


def by_hand(block: ToMoEBlock, dense: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's output recomputed from its weights: top-k logits, each selected expert by hand, + shared.

    The shared expert: the activations of the dense FFN's neurons ``block.shared_index`` (``dense`` is the
    FFN the block replaced) through the shared expert's down projection (refitted: the block's own), plus
    its constant.
    """
    x = x.reshape(-1, x.shape[-1]).float()
    router, experts, shared = block.router, block.experts, block.shared_experts
    logits = x @ router.weight.T + router.bias
    chosen = torch.topk(logits, router.top_k, dim=-1).indices
    padded = F.pad(x, (0, block.input_pad))
    out = torch.zeros(x.shape[0], experts.down_proj.shape[1])
    for token in range(x.shape[0]):
        for expert in chosen[token].tolist():
            h = activation_by_hand(experts, expert, padded[token])
            out[token] += experts.down_proj[expert] @ h + experts.down_proj_bias[expert]
    out = out[:, : block.output_size]
    if shared.num_neurons:
        out = out + dense_activations(dense, x)[:, block.shared_index] @ shared.down_proj.weight.T
    return out + shared.constant


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "weights-only"])
def test_all_experts_reproduce_the_dense_model(family, calibrated):
    dense = MODELS[family]()
    tokens = ids()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens if calibrated else None)
    assert len(stats.converted) == 2 and not stats.skipped
    assert all(type(block) is BLOCKS[family] for _, block in blocks(converted))
    expected = run(dense, tokens)
    for implementation in IMPLEMENTATIONS:
        set_experts_implementation(converted, implementation)
        torch.testing.assert_close(run(converted, tokens), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_block_output_is_its_routing_recomputed_by_hand(family):
    dense = MODELS[family]()
    converted, _ = convert(dense, num_experts=4, top_k=2, calibration=ids(), shared_neurons=4)
    name, block = blocks(converted)[0]
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    tokens = ids(2, 8, seed=1)
    for implementation in IMPLEMENTATIONS:
        set_experts_implementation(converted, implementation)
        run(converted, tokens)
        expected = by_hand(block, dense.get_submodule(name), seen["x"]).view_as(seen["y"])
        torch.testing.assert_close(seen["y"], expected, atol=1e-5, rtol=1e-5)
    handle.remove()
    weights = block.router(seen["x"].reshape(-1, seen["x"].shape[-1]))[1]
    assert torch.equal(weights, torch.ones_like(weights)), "every selected expert must weigh exactly 1"


def test_the_users_model_is_not_changed_unless_inplace():
    dense = llama()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    converted, _ = convert(dense, num_experts=4, top_k=2, calibration=ids())
    assert converted is not dense and not blocks(dense)
    assert all(torch.equal(before[k], v) for k, v in dense.state_dict().items())
    same, _ = convert(dense, num_experts=4, top_k=2, calibration=ids(), inplace=True)
    assert same is dense and len(blocks(dense)) == 2


def test_skipped_experts_contribute_their_mean_on_the_tokens_that_skip_them():
    """Compensation (refit off): each expert's down bias is minus its mean contribution where it was skipped."""
    dense = llama()
    tokens = ids(4, 16)  # 64 tokens: all used for the fit
    mlp = dense.model.layers[0].mlp
    inputs = inputs_of(dense, mlp, tokens)
    converted, _ = convert(dense, num_experts=4, top_k=2, calibration=tokens, refit=False)
    block = converted.model.layers[0].mlp
    with torch.no_grad():
        chosen = torch.topk(block.router(inputs)[0], 2, dim=-1).indices
        activations = F.silu(mlp.gate_proj(inputs)) * mlp.up_proj(inputs)
        total = torch.zeros(32)
        for expert in range(4):
            neurons = block.neuron_index[expert]
            skipped = ~(chosen == expert).any(-1)
            assert skipped.any()
            mean = activations[skipped][:, neurons].mean(0) @ mlp.down_proj.weight[:, neurons].T
            torch.testing.assert_close(block.experts.down_proj_bias[expert], -mean, atol=1e-5, rtol=1e-4)
            total += mean
        torch.testing.assert_close(block.shared_experts.bias, total, atol=1e-5, rtol=1e-4)


def test_router_is_fitted_not_random():
    """The router picks the experts that matter: the top-k of each expert's importance on the calibration tokens.

    An expert's importance for a token: the norm of its neurons' centred contribution to the dense output,
    ``||down_e (h_e(x) - mean h_e)||``.
    """
    dense = llama(hidden_size=64, intermediate_size=256)
    tokens = ids(16, 32)
    mlp = dense.model.layers[0].mlp
    inputs = inputs_of(dense, mlp, tokens)
    converted, stats = convert(dense, num_experts=8, top_k=2, calibration=tokens, refit=False)
    block = converted.model.layers[0].mlp
    with torch.no_grad():
        activations = F.silu(mlp.gate_proj(inputs)) * mlp.up_proj(inputs)
        centred = activations - activations.mean(0)
        importance = []
        for neurons in block.neuron_index:
            neurons = neurons[neurons >= 0]
            importance.append((centred[:, neurons] @ mlp.down_proj.weight[:, neurons].T).norm(dim=1))
        truth = torch.stack(importance, dim=1)
        chosen = block.router(inputs)[2]
        best = torch.topk(truth, 2, dim=-1).indices
        agreement = (chosen[:, :, None] == best[:, None, :]).any(-1).float().mean()
        print(f"router agrees with the importance top-2 on {agreement:.0%} of slots (random: 25%)")
        assert agreement > 0.5
        target = mlp(inputs)
        fitted = block(inputs)
        block.router.weight.copy_(torch.randn_like(block.router.weight))
        random = block(inputs)
    error = lambda y: float((y - target).norm() / target.norm())  # noqa: E731
    assert error(fitted) < error(random)
    assert stats.converted[0].error == pytest.approx(error(fitted), rel=1e-3)  # measured on all 512 tokens


def test_shared_neurons_are_always_active_and_the_most_active():
    dense = llama()
    tokens = ids()
    converted, stats = convert(dense, num_experts=4, top_k=1, calibration=tokens, shared_neurons=8)
    block = converted.model.layers[0].mlp
    assert block.shared_experts.num_neurons == 8 and stats.converted[0].shared_neurons == 8
    assert sorted(stats.converted[0].expert_sizes) == [14, 14, 14, 14]
    mlp = dense.model.layers[0].mlp
    inputs = inputs_of(dense, mlp, tokens)
    with torch.no_grad():
        activity = (F.silu(mlp.gate_proj(inputs)) * mlp.up_proj(inputs)).abs().mean(0) * mlp.down_proj.weight.norm(dim=0)
    assert set(block.shared_index.tolist()) == set(torch.topk(activity, 8).indices.tolist())
    used = torch.cat([block.shared_index, block.neuron_index.flatten()])
    assert sorted(used[used >= 0].tolist()) == list(range(64))


def test_on_the_trained_tiny_dense_model():
    """moelens' own trained dense LM: at 75 % active, the next-token loss stays close to dense and far from naive."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moelens.data import HELDOUT_PATH, TINY_DENSE_PATH

    if not (TINY_DENSE_PATH / "model.safetensors").is_file():
        pytest.skip("tiny-dense is not in this checkout")
    dense = AutoModelForCausalLM.from_pretrained(TINY_DENSE_PATH).eval()
    windows = load_file(str(HELDOUT_PATH))["input_ids"].long()
    calibration, evaluation = windows[0:64:2], windows[1:16:2]  # disjoint held-out windows: 8192 / 2048 tokens

    def loss(model) -> float:
        with torch.no_grad():
            logits = model(input_ids=evaluation).logits[:, :-1]
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), evaluation[:, 1:].reshape(-1)))

    converted, stats = convert(dense, num_experts=8, top_k=6, calibration=calibration)
    assert len(stats.converted) == 4 and all(layer.error < 0.3 for layer in stats.converted)  # 0.10-0.21
    naive, _ = convert(dense, num_experts=8, top_k=6, calibration=calibration, refit=False)
    for _, block in blocks(naive):  # a random router and no compensation
        with torch.no_grad():
            block.router.weight.normal_()
            block.experts.down_proj_bias.zero_()
            block.shared_experts.bias.zero_()
    base = loss(dense)
    print(f"loss increase: tomoe {loss(converted) - base:.3f}, naive {loss(naive) - base:.3f}; "
          f"layer errors {[round(layer.error, 3) for layer in stats.converted]}")
    assert loss(converted) - base < 0.1 and loss(naive) - base > 2 * (loss(converted) - base)
