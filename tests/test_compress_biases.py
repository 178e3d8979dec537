"""moelens.compress: dense biases, routing weights, balanced groups and the held-out split.

Ground truth: the dense model's own forward (with ``top_k == num_experts`` a converted
model must reproduce it, here with every bias of the dense model set to seeded non-zero
values: the tiny models are built with zero biases, so a dropped or doubled bias would go
unseen), each expert's output recomputed by hand from its weights and weighted by its
routing weight, group sizes from ``divmod``, and the split's rows compared as sets.
"""

from __future__ import annotations

import pytest
import torch

from moelens.compress import ExpertsSettings, ToMoEExperts, ToMoEGatedExperts, set_experts_implementation
from moelens.compress import CompressionError, fit, partition
from moelens.compress.dense import DenseLayer
from test_compress_helpers import bert, convert, gpt2, ids, llama, randomised, run

BIASED = {"gpt2": gpt2, "bert": bert, "llama": lambda: llama(mlp_bias=True)}
#: The dense FFN biases of each tiny model (what the conversion has to carry over).
FFN_BIASES = {"gpt2": ("mlp.c_fc.bias", "mlp.c_proj.bias"),
              "bert": ("intermediate.dense.bias", "output.dense.bias"),
              "llama": ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")}


def with_random_biases(name: str):
    """The tiny dense model ``name`` with every bias drawn (seeded) from N(0, 0.5^2)."""
    return randomised(BIASED[name](), "bias", 0.5, seed=0)


@pytest.mark.parametrize("name", list(BIASED))
@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "weights-only"])
@pytest.mark.parametrize("shared_neurons", [0, 8])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_every_expert_selected_reproduces_a_dense_model_with_biases(name, calibrated, shared_neurons, implementation):
    """The converted FFNs keep the dense up (and gate) biases on their neurons and add the dense down bias once.

    Guards against the shared constant dropping the dense down bias, and against the plain
    experts' up biases being left at zero (both invisible with the zero biases of a fresh model).
    """
    dense = with_random_biases(name)
    ffn_biases = [p for n, p in dense.named_parameters() if n.endswith(FFN_BIASES[name])]
    assert ffn_biases and all(float(p.detach().abs().min()) > 0 for p in ffn_biases)
    tokens = ids()
    converted, stats = convert(dense, num_experts=4, top_k=4, calibration=tokens if calibrated else None,
                               shared_neurons=shared_neurons)
    assert len(stats.converted) == 2  # both layers' FFNs
    set_experts_implementation(converted, implementation)
    expected = run(dense, tokens)
    torch.testing.assert_close(run(converted, tokens), expected, atol=1e-5, rtol=1e-5)


# -- the experts' routing weights --------------------------------------------------------------------


def random_experts(gated: bool, implementation: str, seed: int = 0):
    cls = ToMoEGatedExperts if gated else ToMoEExperts
    experts = cls(ExpertsSettings(implementation), 4, 8, 8, 8, torch.nn.SiLU())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return experts


@torch.no_grad()
def expert_by_hand(experts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s unweighted output on one token, from its weights."""
    if isinstance(experts, ToMoEGatedExperts):
        size = experts.gate_up_proj.shape[1] // 2
        pre = experts.gate_up_proj[expert] @ x + experts.gate_up_proj_bias[expert]
        hidden = experts.act_fn(pre[:size]) * pre[size:]
    else:
        hidden = experts.act_fn(experts.up_proj[expert] @ x + experts.up_proj_bias[expert])
    return experts.down_proj[expert] @ hidden + experts.down_proj_bias[expert]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_experts_scale_each_slot_by_its_routing_weight(gated, implementation):
    """out[t] = sum_slot w[t, slot] * expert_{index[t, slot]}(x[t]), in every experts implementation.

    Guards against the eager loop adding the experts' outputs unweighted (which the dense-equality
    tests cannot see: with every expert selected the routing weights are all about 1).
    """
    experts = random_experts(gated, implementation)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=generator)
    index = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0], [1, 2]])
    weights = torch.rand(6, 2, generator=generator) + 0.1
    expected = torch.stack([sum(weights[t, s] * expert_by_hand(experts, int(index[t, s]), x[t]) for s in range(2))
                            for t in range(6)])
    with torch.no_grad():
        actual = experts(x, index, weights)
        halved = experts(x, index, weights / 2)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(halved, expected / 2, atol=1e-4, rtol=1e-4)


def test_eager_experts_match_grouped_mm_on_uneven_weights():
    """The eager loop and grouped_mm agree on the same experts, inputs and (non-uniform) weights."""
    eager, grouped = random_experts(True, "eager"), random_experts(True, "grouped_mm")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(10, 8, generator=generator)
    index = torch.randint(0, 4, (10, 2), generator=generator)
    weights = torch.rand(10, 2, generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(eager(x, index, weights), grouped(x, index, weights), atol=1e-4, rtol=1e-4)


# -- balanced groups above the exact assignment's limit ------------------------------------------------


def test_greedy_assignment_gives_equal_groups():
    """Above EXACT_LIMIT neurons the greedy assignment still fills every group to its size.

    Guards against the greedy branch forgetting to count down a group's room, which gives
    every neuron its nearest centroid (here most neurons prefer one cluster).
    """
    count = 5000
    assert count > partition.EXACT_LIMIT
    features = torch.randn(count, 16, generator=torch.Generator().manual_seed(0))
    features[:3000] += 5.0  # one big cluster: most neurons would choose the same centroid
    labels = partition.balanced_kmeans(features, 8)
    assert labels.shape == (count,)
    assert torch.bincount(labels, minlength=8).tolist() == [625] * 8


def test_greedy_assignment_of_uneven_sizes_when_every_row_prefers_one_group():
    """Every row's cheapest group is group 0: the greedy branch still gives each group exactly its size."""
    count, groups = partition.EXACT_LIMIT + 3, 4
    cost = torch.rand(count, groups, generator=torch.Generator().manual_seed(0)).double().numpy() + 1.0
    cost[:, 0] = 0.0
    labels = partition._assign(cost, partition.group_sizes(count, groups))
    base, extra = divmod(count, groups)
    assert torch.bincount(torch.from_numpy(labels), minlength=groups).tolist() == [
        base + (1 if group < extra else 0) for group in range(groups)]


# -- the held-out split ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1024, 2000, 4096])
def test_held_out_tokens_are_not_fitted(tokens):
    """From 1024 calibration tokens one in eight is held out: disjoint from the fit rows, together all rows.

    Guards against the fit rows including the held-out ones (an optimistic error on tokens the refit saw).
    """
    fit_rows, held_rows = fit._split(tokens, seed=0)
    fitted, held = set(fit_rows.tolist()), set(held_rows.tolist())
    assert len(held) == len(held_rows) == tokens // 8
    assert len(fitted) == len(fit_rows) == tokens - tokens // 8
    assert not fitted & held
    assert fitted | held == set(range(tokens))


def test_below_1024_tokens_nothing_is_held_out():
    fit_rows, held_rows = fit._split(1023, seed=0)
    assert held_rows is None and sorted(fit_rows.tolist()) == list(range(1023))


def _sequences(lengths: list[int]) -> torch.Tensor:
    """The sequence of each row when sequences of these lengths are captured one after the other."""
    return torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))


@pytest.mark.parametrize("lengths", [[16] * 64, [5, 40, 7, 100, 12] * 25, [300, 300, 300, 300, 300]],
                         ids=["64 equal", "125 unequal", "5 long"])
def test_whole_sequences_are_held_out(lengths):
    """Held-out rows are whole sequences, about one token in eight (at least that many, at least one sequence),
    disjoint from the fit rows, which hold every other row; shuffled rows (max_tokens samples) change nothing.

    Guards against held-out tokens sharing their sentence or window with the fit (an optimistic error)."""
    sequences = _sequences(lengths)
    shuffled = torch.randperm(sequences.numel(), generator=torch.Generator().manual_seed(3))
    for rows in (sequences, sequences[shuffled]):
        fit_rows, held_rows, note = fit.split(rows.numel(), 0, rows)
        fitted, held = set(fit_rows.tolist()), set(held_rows.tolist())
        assert note == "" and not fitted & held and fitted | held == set(range(rows.numel()))
        held_sequences = set(rows[held_rows].tolist())
        assert held_sequences and not held_sequences & set(rows[fit_rows].tolist())  # whole sequences
        assert rows.numel() // 8 <= len(held) <= rows.numel() // 4


@pytest.mark.parametrize("lengths, reason", [([1024], "1 sequence"), ([700, 700], "2 sequences"),
                                             ([500, 500, 100], "3 sequences")])
def test_too_few_sequences_hold_out_random_tokens_and_say_so(lengths, reason):
    """One sequence, or so few that the one to hold out is over a quarter of the tokens: one token in eight at
    random, as without sequence ids, and the note says the error is optimistic."""
    sequences = _sequences(lengths)
    fit_rows, held_rows, note = fit.split(sequences.numel(), 0, sequences)
    assert torch.equal(held_rows, fit._split(sequences.numel(), 0)[1])
    assert note.startswith(f"error held out on {sequences.numel() // 8} random tokens, not whole sequences "
                           f"({reason}, too few to hold whole ones out)") and "optimistic" in note


def test_rows_without_sequences_hold_out_random_tokens_and_say_so():
    """plan_layer on bare rows (no sequence ids: a tensor of tokens) still works; its plan notes the token split."""
    generator = torch.Generator().manual_seed(0)
    layer = DenseLayer(up=torch.randn(32, 8, generator=generator), up_bias=torch.zeros(32),
                       down_bias=torch.zeros(8), act=torch.nn.ReLU(), down=torch.randn(8, 32, generator=generator))
    plan = fit.plan_layer(layer, torch.randn(1024, 8, generator=generator), num_experts=4, top_k=2)
    assert plan.held_out and plan.error_tokens == 128
    assert plan.notes == ["error held out on 128 random tokens, not whole sequences (the layer's inputs do not "
                          "show which sequence each token is from): they share their texts with the fit tokens, so "
                          "it is optimistic"]
    with pytest.raises(CompressionError, match=r"sequences has shape \(1000,\), expected one sequence id per calibration "
                                         r"row \(1024,\)"):
        fit.plan_layer(layer, torch.randn(1024, 8), num_experts=4, top_k=2, sequences=torch.zeros(1000))


def test_the_error_is_measured_by_a_fit_that_never_saw_the_held_out_rows():
    """The shared neurons were chosen on every row, held-out ones too: held-out tokens that drive a weak neuron
    (and those aligned with it) hard changed three of the four shared neurons, so the error was measured on a
    plan partly fitted to them. Ground truth: the same layer planned on the fit rows alone (896 rows, none held
    out), its error measured by hand on the held-out rows."""
    generator = torch.Generator().manual_seed(0)
    layer = DenseLayer(up=torch.randn(32, 8, generator=generator), up_bias=torch.zeros(32),
                       down_bias=torch.zeros(8), act=torch.nn.ReLU(), down=torch.randn(8, 32, generator=generator))
    x, sequences = torch.randn(1024, 8, generator=generator), _sequences([16] * 64)
    fit_rows, held_rows, _ = fit.split(1024, 0, sequences)
    weak = int((layer.hidden(x).abs().mean(0) * layer.down_norms()).argmin())  # the neuron least often shared
    x[held_rows] = 50 * layer.up[weak] / layer.up[weak].norm()  # held-out tokens that drive it hard
    planned = fit.plan_layer(layer, x, num_experts=4, top_k=2, shared_neurons=4, sequences=sequences)
    blind = fit.plan_layer(layer, x[fit_rows.sort().values], num_experts=4, top_k=2, shared_neurons=4)
    held = x[held_rows]
    target = layer.project(layer.hidden(held))
    expected = fit.relative_error(fit.routed_output(layer, blind, held, layer.hidden(held)), target)
    assert planned.error == pytest.approx(expected, rel=1e-4)
    assert not torch.equal(planned.shared, blind.shared)  # the plan built saw them: they move its shared neurons
