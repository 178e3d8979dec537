"""Contracts of `Moe.params`, the write checks, the token views and the bindings that the other tests leave
unpinned (each test here fails on a plausible one-line bug in moelens.components.params / write_checks /
tokens / binding).

Ground truths are independent of the code under test: the parameters the model registers (their
memory and slices, transformers' own documented layout defaults), logits written out by hand from the
router's weights, hand-built routing tensors whose outcome is counted by hand, and torch's own
checkpointing behaviour.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import moelens
from moelens.errors import ValueUnavailable
from moelens.testing import tiny_model


# --- params -------------------------------------------------------------------------------------------


def test_params_of_a_zero_compute_expert_is_refused_and_the_last_expert_with_weights_is_served():
    """longcat_flash: the config's zero_expert_num last experts have no weights; asking for the first of them
    must say so (an off-by-one let it through to an IndexError on the weight views)."""
    hf = tiny_model("longcat_flash")
    moe = moelens.wrap(hf).moes[0]
    routed, zero = hf.config.n_routed_experts, hf.config.zero_expert_num
    assert zero > 0 and moe.num_experts == routed + zero
    experts = moe._module.get_submodule(moe.family.experts)
    last = moe.params(routed - 1)
    assert last.down.data_ptr() == experts.down_proj[routed - 1].data_ptr()
    for expert in range(routed, routed + zero):
        with pytest.raises(ValueUnavailable, match=rf"expert {expert} is one of this block's {zero} zero-compute"):
            moe.params(expert)


class KeywordRouter(torch.nn.Module):
    """A router calling ``F.linear`` with its weight and bias passed by keyword."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.bias = torch.nn.Parameter(torch.randn(experts))
        self.top_k = k

    def forward(self, x):
        logits = torch.nn.functional.linear(x, weight=self.weight, bias=self.bias)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top, index


def test_a_router_passing_its_weight_and_bias_by_keyword_serves_them():
    from custom_models import custom_family, custom_model

    model = custom_model()
    config = model.config
    for layer in model.layers:
        layer["ffn"].chooser = KeywordRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
    moelens.families.register(custom_family())
    try:
        wrapped = moelens.wrap(model)
        moe = wrapped.moes[1]
        router = moe.router._module
        params = moe.params()
        assert params.router is not None and params.router_bias is not None
        assert params.router.data_ptr() == router.weight.data_ptr()
        assert params.router_bias.data_ptr() == router.bias.data_ptr()
        with torch.no_grad():
            params.router[2].mul_(-3.0)  # an edit through the view reaches the logits
            params.router_bias[0] += 1.0
        ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), wrapped.trace(ids):
            hidden = moe.router.input.save()
            logits = moe.router_logits.save()
        by_hand = hidden.reshape(-1, hidden.shape[-1]) @ router.weight.detach().T + router.bias.detach()
        torch.testing.assert_close(logits.reshape(-1, logits.shape[-1]), by_hand)
    finally:
        moelens.families.unregister("custom")


class RouterWithoutTopK(torch.nn.Module):
    """A router keeping its k under a name the family entry's default ``"router.top_k"`` does not find."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.k = k

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.k, dim=-1)
        return logits, top, index


def test_router_logits_are_read_without_the_top_k_the_entry_cannot_read():
    """Checking router_logits' width worked out k as well (every width at once), so reading the logits of a router
    whose k the entry cannot read raised the FamilyError that only expert_weights / expert_indices should."""
    from custom_models import custom_family, custom_model

    from moelens.errors import FamilyError

    model = custom_model()
    config = model.config
    for layer in model.layers:
        k = config.num_experts_per_tok
        layer["ffn"].chooser = RouterWithoutTopK(config.hidden_size, config.num_local_experts, k)
    moelens.families.register(custom_family())
    try:
        wrapped = moelens.wrap(model)
        moe = wrapped.moes[0]
        ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), wrapped.trace(ids):
            hidden = moe.router.input.save()
            logits = moe.router_logits.save()
        by_hand = hidden.reshape(-1, hidden.shape[-1]) @ moe.router._module.weight.detach().T
        torch.testing.assert_close(logits.reshape(-1, logits.shape[-1]), by_hand)
        with pytest.raises(FamilyError, match=r"cannot read 'router\.top_k'.*it is the entry's top_k"):
            with torch.no_grad(), wrapped.trace(ids):
                moe.expert_weights.save()
    finally:
        moelens.families.unregister("custom")


def test_experts_flagged_by_an_older_transformers_without_is_concatenated_read_gate_then_up():
    """transformers' decorator defaults is_concatenated to True ([gate; up] along the output rows); experts
    carrying has_gate but no is_concatenated flag have that layout."""
    hf = tiny_model("mixtral")
    moe = moelens.wrap(hf).moes[0]
    experts = moe._module.get_submodule(moe.family.experts)
    del experts.is_concatenated
    assert experts.has_gate and not hasattr(experts, "is_concatenated")
    fused = experts.gate_up_proj.detach()  # [E, 2H, D]
    hidden = fused.shape[1] // 2
    params = moe.params(3)
    assert torch.equal(params.gate, fused[3, :hidden]) and torch.equal(params.up, fused[3, hidden:])
    assert params.gate.data_ptr() == fused[3].data_ptr()


# --- write checks: what a group-limited router could pick --------------------------------------------------


def _could_pick_excluded(row: list[float], n_group: int, topk_group: int, fill: float, k: int) -> bool:
    """Brute force over what a group-limited router (deepseek_v3's ``group_topk``) may do with ``row``: for every set
    of ``topk_group`` groups its ranking allows (a group's score: the sum of its top two; a NaN sum ranks first,
    above +inf, as torch's top-k ranks it; tied groups either way), the row with the other groups' entries replaced by ``fill``, then its top ``k`` (ties
    either way). True when an entry written -inf can be among the picks."""
    size = len(row) // n_group
    sums = []
    for group in range(n_group):
        total = sum(sorted(row[group * size:(group + 1) * size], reverse=True)[:2])
        sums.append((1, 0.0) if math.isnan(total) else (0, total))  # (NaN first, then the sum)
    for kept in itertools.combinations(range(n_group), topk_group):
        if any(sums[other] > sums[group] for group in kept for other in range(n_group) if other not in kept):
            continue  # the router's ranking never keeps these
        masked = [value if index // size in kept else fill for index, value in enumerate(row)]
        kth = sorted(masked, reverse=True)[k - 1]
        if any(row[index] == -math.inf and masked[index] >= kth for index in range(len(row))):
            return True
    return False


#: (n_group, topk_group, fill, k) over 8 experts: deepseek_v3-like routers (dropped groups -inf) and axk2-like
#: ones (dropped groups 0.0).
GROUP_SETTINGS = [(4, 2, -math.inf, 2), (4, 2, -math.inf, 4), (2, 1, -math.inf, 3), (2, 1, -math.inf, 4),
                  (4, 1, -math.inf, 2), (4, 2, 0.0, 2), (2, 1, 0.0, 3), (2, 1, 0.0, 4)]


@pytest.mark.parametrize("setting", GROUP_SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_a_group_limited_router_is_never_let_pick_an_entry_written_minus_inf(setting):
    """`_picks_excluded` against the brute force above on rows full of ties and infinities: it must flag every row
    where the router could pick an entry written -inf. With -inf in place of the dropped groups (and with finite
    fill in groups of two, where a group's two entries are its whole score) it flags no other row."""
    from moelens.components.write_checks import _picks_excluded

    n_group, topk_group, fill, k = setting
    generator = random.Random(GROUP_SETTINGS.index(setting))
    values = [-math.inf, -0.5, 0.0, 0.5, 1.0, math.inf]
    rows = [[generator.choice(values) for _ in range(8)] for _ in range(1500)]
    flagged = _picks_excluded(torch.tensor(rows), n_group, topk_group, fill, k).tolist()
    exact = fill == -math.inf or 8 // n_group == 2
    for row, got in zip(rows, flagged):
        expected = _could_pick_excluded(row, n_group, topk_group, fill, k)
        assert got or not expected, f"{row}: the router could pick an excluded entry, not flagged"
        assert not exact or got == expected, f"{row}: flagged, but no ranking lets the router pick an excluded entry"


@pytest.mark.parametrize(("row", "setting", "expected"), [
    # the kept group is surely kept (its sum 2 beats 0) and holds 2 finite entries for k = 3
    ([1.0, 1.0, -math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0], (2, 1, -math.inf, 3), True),
    # a NaN group sum (inf + -inf) ranks first: that group is kept, with one entry above -inf for k = 4 over 2 groups
    ([math.inf, -math.inf, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0], (4, 2, -math.inf, 4), True),
    # the same with k = 3: inf, 0.5, 0.5 fill the slots
    ([math.inf, -math.inf, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0], (4, 2, -math.inf, 3), False),
    # dropped groups scored 0.0: an expert written -inf in a dropped group comes back at 0.0 when the kept ones
    # hold fewer than k above it
    ([-0.5, -0.5, 1.0, -math.inf, -0.5, -math.inf, 0.5, -0.5], (4, 2, 0.0, 2), True),
    ([0.5, 0.5, 1.0, -math.inf, -0.5, -math.inf, 0.5, -0.5], (4, 2, 0.0, 2), False),
    # the one kept group beats the dropped one (-0.1 against -1.8): its -inf entry stays -inf, and the router's
    # second slot takes a dropped group's 0.0 (axk2 with a negative selection bias; this was refused)
    ([0.5, -0.6, -math.inf, -0.6, -0.9, -0.9, -0.9, -0.9], (2, 1, 0.0, 2), False),
    # the same where the two groups' sums tie: either may be dropped, and a dropped -inf entry comes back at 0.0
    ([0.5, -0.6, -math.inf, -0.6, 0.5, -0.6, -0.9, -0.9], (2, 1, 0.0, 2), True),
    # every group kept: only fewer than k entries above -inf lets the router pick one
    ([0.5, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf], (2, 2, 0.0, 2), True),
    ([0.5, -0.6, -math.inf, -0.6, -0.9, -0.9, -0.9, -0.9], (2, 2, 0.0, 2), False),
])
def test_group_limited_picks_by_hand(row, setting, expected):
    from moelens.components.write_checks import _picks_excluded

    assert _could_pick_excluded(row, *setting) is expected  # the brute force agrees with the hand count
    assert bool(_picks_excluded(torch.tensor([row]), *setting)[0]) is expected


# --- write checks: activation checkpointing ----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_checkpointing_enabled_without_use_reentrant_counts_as_reentrant():
    """``activation_checkpointing_enable({})`` hands torch's checkpoint no use_reentrant, and torch then runs the
    reentrant variant (the layer's forward with autograd off, whatever the caller's mode): an edit must be refused
    even under torch.no_grad(), as for an explicit use_reentrant=True."""
    from torch.utils.checkpoint import checkpoint

    from moelens.errors import WriteError
    from moelens.testing import tiny_inputs

    seen = []
    checkpoint(lambda x: seen.append(torch.is_grad_enabled()) or x * 2, torch.ones(2, requires_grad=True))
    assert seen == [False]  # torch's default with no use_reentrant: the reentrant variant

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    hf.activation_checkpointing_enable({})
    hf.train()
    model = moelens.wrap(hf)
    with pytest.raises(WriteError, match=r"layers.0.mlp.router_logits is edited inside MixtralDecoderLayer, which "
                                         r"runs under reentrant activation checkpointing"):
        with torch.no_grad(), model.trace(**tiny_inputs(hf)):
            model.moes[0].router_logits[..., 0] += 5


# --- token views ---------------------------------------------------------------------------------------------


def _flat(total: int, seq: int, experts: int = 3) -> torch.Tensor:
    """A flat ``[total * seq, experts]`` routing tensor whose entry says its row, position and expert."""
    row, position, expert = torch.meshgrid(torch.arange(total), torch.arange(seq), torch.arange(experts), indexing="ij")
    return (100 * row + 10 * position + expert).float().reshape(total * seq, experts)


def test_an_invokes_view_of_a_flat_value_is_its_own_rows_and_the_models_memory():
    from moelens.components.tokens import Rows, view

    flat = _flat(total=5, seq=4)
    mine = view(flat, 1, Rows(total=5, start=2, size=2, batching=True), "router_logits")
    assert mine.shape == (2, 4, 3)
    assert torch.equal(mine[:, :, 0], torch.tensor([[200.0, 210, 220, 230], [300, 310, 320, 330]]))
    mine[1, 2, 1] = -1.0  # a view: an in-place edit lands in the model's tensor, at row 3, position 2
    assert flat[3 * 4 + 2, 1] == -1.0
    whole = view(flat, 1, Rows(total=5, start=0, size=5, batching=False), "router_logits")
    assert torch.equal(whole, flat.view(5, 4, 3))


def test_a_splice_into_a_flat_value_replaces_only_the_invokes_rows_in_the_models_dtype():
    from moelens.components.tokens import Rows, splice

    current = _flat(total=5, seq=4).to(torch.bfloat16)
    new = torch.full((2, 4, 3), -7.0, dtype=torch.float32)
    spliced = splice(current, new, 1, Rows(total=5, start=1, size=2, batching=True), "router_logits")
    assert spliced.dtype == torch.bfloat16 and spliced.shape == current.shape
    by_hand = current.clone()
    by_hand[4:12] = -7.0  # rows 1 and 2, 4 positions each
    assert torch.equal(spliced, by_hand)


def test_a_splice_of_a_value_nnsight_narrowed_to_the_invoke_is_the_new_tensor():
    """A decode step (one token per row): nnsight served the invoke's rows alone, and takes back as many."""
    from moelens.components.tokens import Rows, splice, view

    rows = Rows(total=4, start=2, size=2, batching=True)
    narrowed = _flat(total=4, seq=1)[2:]
    assert torch.equal(view(narrowed, 1, rows, "router_logits"), narrowed.view(2, 1, 3))
    new = torch.zeros(2, 1, 3)
    assert torch.equal(splice(narrowed, new, 1, rows, "router_logits"), new.view(2, 3))


def test_a_batched_value_holding_every_prompts_expanded_rows_is_cut_and_spliced_per_invoke():
    """[B, S, ...] values with beams: nnsight's batch counts prompts, the tensor each prompt's rows."""
    from moelens.components.tokens import Rows, splice, view

    batched = _flat(total=6, seq=2).view(6, 2, 3)
    rows = Rows(total=6, start=2, size=4, batching=True)
    assert torch.equal(view(batched, 1, rows, "mlp_output"), batched[2:6])
    new = torch.full((4, 2, 3), 9.0)
    spliced = splice(batched, new, 1, rows, "mlp_output")
    assert torch.equal(spliced[:2], batched[:2]) and torch.equal(spliced[2:], new)


def test_a_flat_value_of_no_whole_number_of_sequences_is_refused():
    from moelens.components.tokens import Rows, UnevenTokens, splice, view

    rows = Rows(total=3, start=1, size=1, batching=True)
    with pytest.raises(UnevenTokens, match=r"router_logits: the block saw 10 tokens, which is not a whole number"):
        view(torch.zeros(10, 3), 1, rows, "router_logits")
    with pytest.raises(UnevenTokens, match="10 tokens"):
        splice(torch.zeros(10, 3), torch.zeros(1, 3, 3), 1, rows, "router_logits")


# --- bindings ------------------------------------------------------------------------------------------------


def test_an_output_element_binding_takes_and_puts_one_element_and_keeps_the_container():
    from moelens.components.binding import output_of
    from moelens.errors import FamilyError

    pick, put = output_of(1)
    hidden, logits, new = torch.zeros(2, 3), torch.ones(2, 4), torch.full((2, 4), 5.0)
    for container in (tuple, list):
        raw = container([hidden, logits, "aux"])
        assert pick(raw) is logits
        replaced = put(raw, new)
        assert type(replaced) is container and replaced[0] is hidden and replaced[1] is new and replaced[2] == "aux"
        assert raw[1] is logits  # the served output itself is left as it was
    with pytest.raises(FamilyError, match=r"returned a Tensor, not a tuple.*Combine\(output_index=None\)"):
        pick(torch.zeros(3, 2))  # element 1 of a tensor would be its second row


def test_a_call_argument_binding_reads_and_writes_it_positionally_or_by_keyword():
    from moelens.components.binding import argument

    pick, put = argument(2, "top_k_weights")
    hidden, index, weights, new = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), torch.zeros(3, 2)
    positional = ((hidden, index, weights), {})
    assert pick(positional) is weights
    args, kwargs = put(positional, new)
    assert args[0] is hidden and args[1] is index and args[2] is new and kwargs == {}
    keywords = ((hidden, index), {"top_k_weights": weights, "other": 1})
    assert pick(keywords) is weights
    args, kwargs = put(keywords, new)
    assert args == (hidden, index) and kwargs["top_k_weights"] is new and kwargs["other"] == 1
    with pytest.raises(ValueUnavailable, match=r"passed 2 positional arguments and \['other'\].*argument 2 \(top_k_weights\)"):
        pick(((hidden, index), {"other": 1}))


def test_a_copied_value_shares_no_memory_with_the_models():
    from moelens.components.binding import copied

    tensor = torch.arange(6.0)
    copy = copied(tensor, None)
    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()


def test_what_moelens_own_ops_save_for_backward_frees_with_their_output():
    """An op saving its output (exp) under `kept_for_backward` keeps the output's data, detached: the output itself
    would hold its own grad_fn, a reference cycle through autograd's C++ graph that Python's garbage collector
    cannot see (a dropped value, and its whole forward graph, never freed). Gradients stay those of the op."""
    import gc
    import weakref

    from moelens.components.binding import Binding, kept_for_backward

    x = torch.randn(4, requires_grad=True)
    with kept_for_backward():
        kept = x.exp()
    kept.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().exp())
    binding = Binding("somewhere.output", 1, to_view=lambda t, _: t.exp(), from_view=lambda t, _: t.exp())
    made = [kept, binding.token_major(x * 1, None), binding.model_layout(x * 1, None)]
    assert all(tensor.grad_fn is not None for tensor in made)
    references = [weakref.ref(tensor) for tensor in made]
    del kept, made
    gc.collect()
    assert [reference() for reference in references] == [None, None, None]


@pytest.mark.parametrize("way", ["token_major", "model_layout"])
def test_a_binding_layout_op_run_only_in_the_first_forward_of_a_checkpointed_region_keeps_the_backward(way):
    """Under activation checkpointing the recomputation runs the model alone, without moelens' re-sorts: what they
    save for backward must not count among the region's tensors (torch's CheckpointError), and the gradient is the
    one of the first forward's ops, written out by hand."""
    from torch.utils.checkpoint import checkpoint

    from moelens.components.binding import Binding

    binding = Binding("somewhere.output", 1, to_view=lambda t, _: t.exp(), from_view=lambda t, _: t.exp())
    runs = []

    def region(x):
        y = x * 2
        if not runs:  # a value read in the first forward only, as nnsight's hooks run moelens' ops
            runs.append(getattr(binding, way)(y, None))
        return y.sin()

    x = torch.randn(5, requires_grad=True)
    (checkpoint(region, x, use_reentrant=False).sum() + runs[0].sum()).backward()
    twice = 2 * x.detach()
    torch.testing.assert_close(x.grad, 2 * twice.cos() + 2 * twice.exp())
