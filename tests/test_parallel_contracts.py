"""Contracts of moelens.parallel that the end-to-end runs of test_parallel.py do not pin down.

Small, hand-computed cases: the dispatch plan's split sizes and the serve flag agreed over the
group, the bytes `traffic` counts for every exchange (forward and backward), ids outside
``[0, E)``, the EP / EDP groups, what `shard_experts` leaves on the experts modules, and the
refusals. In-process where no process group is needed; otherwise a short gloo run of 1 or 2
ranks (no model larger than the tiny ones, a 30 s collective timeout).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch

from gloo_ranks import run_ranks
from moelens import MoelensError

TESTS = Path(__file__).parent

#: What every rank runs before a case: a gloo group over a file rendezvous, `emit` for its results.
PRELUDE = """
import json, os, sys, traceback
from datetime import timedelta
import torch
torch.set_num_threads(1)
import torch.distributed as dist
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=RANK, world_size=WORLD,
                        timeout=timedelta(seconds=float(os.environ["COLLECTIVE_TIMEOUT"])))
RESULT = {}
def emit():
    with open(os.path.join(os.environ["OUT"], f"rank{RANK}.json"), "w") as f:
        json.dump(RESULT, f)
def error_of(call):
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""
"""

EPILOGUE = """
emit()
dist.barrier()
dist.destroy_process_group()
"""


def ranks(world: int, body: str, timeout: float = 120, collective_timeout: float = 30) -> list[dict[str, Any]]:
    """Run ``body`` on ``world`` gloo ranks (``collective_timeout``: the process group's, in seconds); every rank's
    ``RESULT``."""
    with tempfile.TemporaryDirectory(prefix="moelens-ep-contracts-") as folder:
        script = Path(folder) / "case.py"
        script.write_text(PRELUDE + textwrap.dedent(body) + EPILOGUE)
        env = dict(os.environ, STORE=f"{folder}/store", OUT=folder, OMP_NUM_THREADS="1",
                   COLLECTIVE_TIMEOUT=str(collective_timeout),
                   PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
        problems = run_ranks(world, [sys.executable, str(script)], env, folder, timeout)
        assert not problems, "\n".join(problems)
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world)]


# -- in-process ---------------------------------------------------------------------------------


def scaled_experts(rank: int, per_rank: int):
    """``expert_fn`` whose global expert ``e`` multiplies its row by ``e + 1``."""

    def expert_fn(rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        local = torch.arange(per_rank).repeat_interleave(tokens_per_expert)
        return rows * (rank * per_rank + local + 1).to(rows.dtype)[:, None]

    return expert_fn


def test_ids_outside_the_experts_are_dropped_with_no_group() -> None:
    """-1 and ids >= E contribute nothing (the module docstring: ids outside [0, E) are dropped)."""
    from moelens.parallel import a2a_moe

    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    idx = torch.tensor([[0, 3], [4, 1], [-1, 7]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 1.0]])
    out = a2a_moe(None, x, idx, w, 4, 4, scaled_experts(0, 4))
    # token 0: 0.25 * 1 * x + 0.75 * 4 * x; token 1: only expert 1 (0.5 * 2 * x); token 2: nothing
    expected = torch.stack([(0.25 + 3.0) * x[0], 1.0 * x[1], torch.zeros(2)])
    assert torch.allclose(out, expected)


def test_plan_refuses_a_local_count_that_does_not_make_the_experts() -> None:
    from moelens.parallel import a2a_moe, plan_dispatch

    idx = torch.tensor([[0, 1]])
    with pytest.raises(MoelensError, match="8 experts over 1 ranks is not 4 per rank"):
        plan_dispatch(None, idx, 8, 4)
    with pytest.raises(MoelensError, match="shard_experts"):
        a2a_moe(None, torch.ones(1, 2), idx, torch.ones(1, 2), 8, 4, scaled_experts(0, 4))


def test_degree_and_owner_edge_cases() -> None:
    from moelens.parallel import choose_ep_dp_degrees, expert_owner, num_experts_from_config

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one rank: nothing to fall back from
        assert choose_ep_dp_degrees(1, 8) == (1, 1)
        assert choose_ep_dp_degrees(1, 0) == (1, 1)
    for ranks_ in (0, -2, 3):
        with pytest.raises(MoelensError, match=r"cannot be split over .* ranks: .*ep_size must divide num_experts "
                                               r"\(one of \[1, 2, 4, 8\]\)"):
            expert_owner(0, 8, ranks_)
    # a flag is no count of experts
    assert num_experts_from_config(SimpleNamespace(num_local_experts=True, n_routed_experts=8)) == 8
    # what is no config was read as a dense model's (0 experts), and choose_ep_dp_degrees then fell back to EP=1
    for given in (None, "mixtral", 8, {"num_local_experts": 8}):
        with pytest.raises(MoelensError, match=r"num_experts_from_config takes a model's config \(model.config\), got"):
            num_experts_from_config(given)
    # ids and counts are integers (numpy's and 0-d tensors' too); a float, a bool or text is refused, never rounded
    assert expert_owner(numpy.int64(5), 8, torch.tensor(2)) == (1, 1)
    for args, named in [((1.5, 8, 2), r"expert must be an integer, got 1\.5 \(float\)"),
                        ((5, 8, 2.0), r"ep_size must be an integer, got 2\.0"),
                        ((True, 8, 2), r"expert must be an integer, got True \(bool\)"),
                        (("1", 8, 2), r"expert must be an integer, got '1' \(str\)")]:
        with pytest.raises(MoelensError, match=rf"^expert_owner: {named}"):
            expert_owner(*args)
    for args, named in [((True, 8), r"world_size must be an integer, got True"),
                        ((2.0, 8), r"world_size must be an integer, got 2\.0"),
                        ((2, "8"), r"num_experts must be an integer, got '8'")]:
        with pytest.raises(MoelensError, match=rf"^choose_ep_dp_degrees: {named}"):
            choose_ep_dp_degrees(*args)


def test_a2a_moe_refuses_inputs_that_are_not_tokens_ids_and_weights_of_one_routing() -> None:
    """Fewer token rows than topk_idx routes raised torch's IndexError, weights [T, 1] beside ids [T, 2] a
    RuntimeError, 1-D ids "not enough values to unpack", and float ids were truncated (2.7 ran expert 2)."""
    from moelens.parallel import a2a_moe

    x, idx, w = torch.ones(3, 2), torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.ones(3, 2)
    for args, refusal in [
        ((x[:2], idx, w), r"hidden_states must be the 3 tokens topk_idx routes, \[T, D\] = \[3, D\], got shape \(2, 2\)"),
        ((x[0], idx, w), r"hidden_states must be the 3 tokens .* got shape \(2,\)"),
        ((x, idx, w[:, :1]), r"topk_weights must hold one weight per slot of topk_idx, \[T, k\] = \[3, 2\], got shape \(3, 1\)"),
        ((x, idx[:, 0], w), r"topk_idx must hold each token's k expert ids \[T, k\], got shape \(3,\); .*topk_idx\[:, None\]"),
        ((x, idx + 0.7, w), r"topk_idx must hold integer expert ids, got torch.float32 \(float ids would be truncated"),
        ((x, idx > 0, w), r"topk_idx must hold integer expert ids, got torch.bool"),
        ((x.tolist(), idx, w), r"hidden_states must be a tensor, got list"),
    ]:
        with pytest.raises(MoelensError, match=rf"^a2a_moe: {refusal}"):
            a2a_moe(None, *args, 4, 4, scaled_experts(0, 4))


def test_dense_counts_and_ids_out_of_range_name_the_call_and_the_way_out() -> None:
    """choose_ep_dp_degrees(8, 0) said no degree divides 0 experts (every one does); expert_owner(0, -8, 2) called
    expert 0 out of range [0, -8); local_expert(moe, 8) named expert_owner, which the user did not call."""
    from moelens.parallel import choose_ep_dp_degrees, expert_owner, local_expert
    from moelens.parallel.comm import SharedGroup

    with pytest.warns(UserWarning, match=r"num_experts is 0, a dense model \(no routed experts\), so there is nothing "
                                         r"to shard; falling back to EP=1 x EDP=8") as caught:
        assert choose_ep_dp_degrees(8, 0) == (1, 8)
    assert not any("divides" in str(warning.message) for warning in caught)
    for count in (-8, 0):
        with pytest.raises(MoelensError, match=rf"^expert_owner: num_experts must be >= 1 .*got {count}"):
            expert_owner(0, count, 2)
    experts = torch.nn.Module()
    experts.num_experts = 8
    experts.__dict__.update(_ep_group=SharedGroup(None), _ep_rank=0, _ep_size=2, _ep_first=0, _ep_num_local=4)
    for expert in (8, -1):
        with pytest.raises(MoelensError, match=rf"^local_expert: expert {expert} is out of range \[0, 8\): pass a "
                                               "global expert id"):
            local_expert(experts, expert)
    with pytest.raises(MoelensError, match=r"^local_expert: expert must be an integer, got 1\.5"):
        local_expert(experts, 1.5)


def test_exchange_refuses_sizes_that_do_not_describe_its_rows() -> None:
    """With one rank, exchange returned the rows as they were whatever the sizes said."""
    from moelens.parallel.comm import exchange

    rows = torch.ones(2, 3)
    assert exchange(rows, [2], [2], None) is rows
    for recv, send in (([5], [5]), ([2], [5]), ([5], [2]), ([1, 1], [1, 1])):
        with pytest.raises(MoelensError, match=r"exchange: send_sizes .* must give one row count per rank of the group "
                                               r"\(1\), the send sizes adding up to the 2 rows sent"):
            exchange(rows, recv, send, None)


def test_slices_are_copies_that_keep_requires_grad() -> None:
    """Each rank keeps a copy of its experts (the whole tensor is freed, an edit of one does not reach the
    other), trainable or frozen as before."""
    from moelens.parallel.shard import _slice

    experts = torch.nn.Module()
    whole = torch.arange(4 * 3.0).view(4, 3)
    experts.weight = torch.nn.Parameter(whole.clone())
    experts.frozen = torch.nn.Parameter(whole.clone(), requires_grad=False)
    original = experts.weight
    _slice(experts, num_experts=4, first=0, per_rank=2)
    assert experts.weight.requires_grad and not experts.frozen.requires_grad
    assert experts.weight.untyped_storage().nbytes() == 2 * 3 * 4  # two experts of 3 floats, not four
    with torch.no_grad():
        original.zero_()
    assert torch.equal(experts.weight, whole[:2])


def test_local_expert_names_the_owner_only() -> None:
    """Rank r of n owns experts [r*L, (r+1)*L) of 8 (L = 8 / n), at local index e - r*L; other ranks get None."""
    from moelens.parallel import local_expert
    from moelens.parallel.comm import SharedGroup

    for size in (2, 4):
        per_rank = 8 // size
        for rank in range(size):
            experts = torch.nn.Module()
            experts.num_experts = 8
            experts.__dict__.update(_ep_group=SharedGroup(None), _ep_rank=rank, _ep_size=size,
                                    _ep_first=per_rank * rank, _ep_num_local=per_rank)
            wrapper = SimpleNamespace(_module=SimpleNamespace(), experts=experts)  # a Moe-like holder
            for expert in range(8):
                first = per_rank * rank
                expected = expert - first if first <= expert < first + per_rank else None
                assert local_expert(experts, expert) == expected, (size, rank, expert)
                assert local_expert(wrapper, expert) == expected, (size, rank, expert)


def test_uneven_blocks_hint_at_a_degree_dividing_every_block() -> None:
    """Blocks of 6 and 8 experts over 4 ranks: the hint names gcd(6, 8) = 2, a degree dividing both (not 6)."""
    from moelens.parallel.shard import _experts_of, _expert_counts
    from moelens.testing import tiny_model

    blocks = _experts_of(tiny_model("mixtral", num_local_experts=6)) + _experts_of(tiny_model("mixtral"))
    blocks = [blocks[0], blocks[-1]]  # 6 and 8 experts
    blocks[1] = (blocks[1][0] + "'", *blocks[1][1:])
    with pytest.raises(MoelensError, match=r"hold 6, 8 experts.*choose_ep_dp_degrees\(world_size, 2\)"):
        _expert_counts(blocks, 4)


def test_experts_without_a_parameter_of_e_experts_are_refused() -> None:
    from moelens.parallel.shard import _experts_of, _expert_counts
    from moelens.testing import tiny_model

    blocks = _experts_of(tiny_model("mixtral"))
    experts = blocks[0][3]
    for name, param in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, torch.nn.Parameter(param.data[:4].clone()))  # 4 of the 8 experts
    with pytest.raises(MoelensError, match="has no parameter with 8 experts"):
        _expert_counts(blocks, 2)


def test_traffic_counts_bytes_per_record_and_closes() -> None:
    """`_record` on hand-made split sizes: rank 1 of 3 sends [2, 3, 1] rows of 4 float32 (16 bytes),
    keeps its own 3 and receives 5; a closed log records nothing more."""
    from moelens.parallel import traffic
    from moelens.parallel.comm import _LOGS, _record

    rows = torch.zeros(6, 4)
    with traffic() as log:
        _record("dispatch", 7, rows, [2, 3, 1], [1, 2, 2], 1)
        _record("combine", 7, rows.double(), [2, 3, 1], [1, 2, 2], 1)
    _record("dispatch", 7, rows, [2, 3, 1], [1, 2, 2], 1)
    assert not _LOGS
    first, second = log.records
    assert (first.kind, first.tag, first.sent_bytes, first.kept_bytes, first.rows, first.received) == (
        "dispatch", 7, 3 * 16, 3 * 16, 3, 5)
    assert (second.sent_bytes, second.kept_bytes) == (3 * 32, 3 * 32)
    assert log.sent() == 3 * 16 + 3 * 32 and log.sent("combine") == 3 * 32 and log.sent("counts") == 0


def test_nested_traffic_logs_each_keep_their_own_records() -> None:
    """An inner block opened and closed (its log equal to the outer one's: both empty) leaves the outer
    one recording; each log holds the exchanges made while it was open."""
    from moelens.parallel import traffic
    from moelens.parallel.comm import _LOGS, _record

    rows = torch.zeros(4, 2)
    with traffic() as outer:
        with traffic() as inner:
            pass
        _record("dispatch", 1, rows, [2, 2], [2, 2], 0)
        with traffic() as last:
            _record("combine", 1, rows, [2, 2], [2, 2], 0)
    assert not _LOGS
    assert [r.kind for r in outer.records] == ["dispatch", "combine"]
    assert inner.records == [] and [r.kind for r in last.records] == ["combine"]


def test_plain_traces_make_no_activation_round_trip() -> None:
    """torch_a2a serves per-slot values (the round trip through `Plan.to_owner`) only when a trace reads them."""
    import moelens
    from moelens.parallel import register_torch_a2a
    from moelens.parallel.a2a import Plan
    from moelens.testing import tiny_model

    register_torch_a2a()
    lm = moelens.wrap(tiny_model("mixtral", experts_implementation="torch_a2a"))
    calls = []
    original = Plan.to_owner

    def counted(self, *args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("kind"))
        return original(self, *args, **kwargs)

    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        Plan.to_owner = counted
        with lm.trace(ids):
            lm.output.logits.save()
        plain = list(calls)
        with lm.trace(ids):
            lm.moes[0].expert_outputs.save()
    finally:
        Plan.to_owner = original
    assert plain == [] and calls == ["activations_out"]


def test_a_rank_receiving_no_rows_returns_zeros_and_reaches_its_experts() -> None:
    """Every id dropped: no row reaches the experts, the output is zero, and backward still gives the
    expert weights a (zero) gradient."""
    from moelens.parallel import plan_dispatch, register_torch_a2a, torch_a2a_experts_forward
    from moelens.parallel.experts import experts_down, experts_up
    from moelens.testing import tiny_model

    register_torch_a2a()
    model = tiny_model("mixtral", experts_implementation="torch_a2a")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, model.config.hidden_size, requires_grad=True)
    out = torch_a2a_experts_forward(experts, x, torch.full((3, 2), -1), torch.ones(3, 2))
    assert out.shape == x.shape and not out.any()
    out.sum().backward()
    grads = [p.grad for p in experts.parameters()]
    assert grads and all(g is not None and not g.any() for g in grads)
    # the owner's halves: no row in, no row out (a stand-in row sent on would not match the split sizes)
    plan = plan_dispatch(None, torch.full((3, 2), -1), 8, 8)
    rows = plan.dispatch(x.detach())
    activations = experts_up(experts, rows, plan)
    assert rows.shape[0] == 0 and activations.shape[0] == 0
    assert experts_down(experts, activations, plan).shape == (0, model.config.hidden_size)


def test_post_expert_norm_runs_under_torch_a2a() -> None:
    """muse_spark normalises each expert's output: torch_a2a (no group) gives grouped_mm's logits."""
    from moelens.parallel import register_torch_a2a
    from moelens.testing import tiny_inputs, tiny_model

    register_torch_a2a()
    ref = tiny_model("muse_spark", experts_implementation="grouped_mm")
    assert any(getattr(m, "has_post_expert_norm", False) for m in ref.modules())
    model = tiny_model("muse_spark", experts_implementation="torch_a2a")
    inputs = tiny_inputs(ref)
    with torch.no_grad():
        expected, got = ref(**inputs)[0], model(**inputs)[0]
    assert (got - expected).abs().max() <= 1e-5


# -- gloo runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One gloo run of 2 ranks for every two-rank case below (each rank's ``RESULT``)."""
    return ranks(2, """
        from moelens.parallel import RankDivergence, a2a_moe, plan_dispatch, traffic
        idx = [torch.tensor([[0, 3], [1, 2], [3, -1]]), torch.tensor([[2, 2], [0, 5]])][RANK]
        plan = plan_dispatch(dist.group.WORLD, idx, 4, 2, serve=RANK == 0, tag=3)
        RESULT["plan"] = [plan.send_sizes, plan.recv_sizes, plan.tokens_per_expert.tolist(), plan.serve]
        gen = torch.Generator().manual_seed(RANK)
        x = torch.randn(idx.shape[0], 3, generator=gen, requires_grad=True)
        w = torch.rand(idx.shape, generator=gen)

        def expert_fn(rows, tokens_per_expert):
            local = torch.arange(2).repeat_interleave(tokens_per_expert)
            return rows * (RANK * 2 + local + 1).to(rows.dtype)[:, None]

        with traffic() as log:
            out = a2a_moe(dist.group.WORLD, x, idx, w, 4, 2, expert_fn)
            out.sum().backward()
        valid = (idx >= 0) & (idx < 4)
        scale = (torch.where(valid, w * (idx + 1), torch.zeros_like(w))).sum(1, keepdim=True)
        RESULT["out"] = float((out - scale * x.detach()).abs().max())
        RESULT["grad_x"] = float((x.grad - scale.expand_as(x)).abs().max())
        RESULT["records"] = [[r.kind, r.tag, r.sent_bytes, r.kept_bytes, r.rows, r.received] for r in log.records]
        RESULT["sent"] = log.sent()
        RESULT["divergent"] = error_of(lambda: plan_dispatch(dist.group.WORLD, idx, 4, 2, tag=1 + RANK))

        from moelens.parallel import ep_groups, shard_experts
        from moelens.testing import tiny_model
        ranks_of = dist.get_process_group_ranks
        RESULT["groups"] = {ep: [ranks_of(g) for g in ep_groups(ep)] for ep in (1, 2)}
        RESULT["same_groups"] = ep_groups(1) == ep_groups(1) and ep_groups(2)[0] is dist.group.WORLD
        RESULT["three"] = error_of(lambda: ep_groups(3))
        RESULT["zero"] = error_of(lambda: ep_groups(0))
        only_zero = dist.new_group([0])
        RESULT["non_member"] = error_of(lambda: shard_experts(tiny_model("mixtral"), only_zero))
    """)


def test_plan_split_sizes_serve_flag_and_traffic_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """E = 4 over 2 ranks (L = 2), rows of 3 float32 (12 bytes). Rank 0 routes [[0, 3], [1, 2], [3, -1]],
    rank 1 [[2, 2], [0, 5]] (-1 and 5 dropped). By hand: rank 0 sends [2, 3] rows and receives [2, 1],
    its experts 0, 1 run on [2, 1] rows; rank 1 sends [1, 2], receives [3, 2], experts 2, 3 on [3, 2].
    Only rank 0 asks for the activation round trip: both make it. The output is
    ``sum_j w * (e_j + 1) * x`` (expert e scales by e + 1); backward sends each row's gradient back."""
    results = two_ranks
    plans = [r["plan"] for r in results]
    assert plans == [[[2, 3], [2, 1], [2, 1], True], [[1, 2], [3, 2], [3, 2], True]], plans
    for rank, r in enumerate(results):
        assert r["out"] < 1e-6 and r["grad_x"] < 1e-6, (rank, r)
        assert r["divergent"].startswith("RankDivergence"), (rank, r["divergent"])
    # kind, tag, sent bytes, kept bytes, rows sent, rows received (of this rank's sizes; 0: the layer tag)
    # one row of [serve, tag, run id, local experts] int64 to the other rank, then one of its 2 counts
    header, counts = ["counts", 0, 32, 32, 1, 2], ["counts", 0, 16, 16, 1, 2]
    assert results[0]["records"] == [
        header, counts, ["dispatch", 0, 36, 24, 3, 3], ["combine", 0, 12, 24, 1, 5],
        ["combine_grad", 0, 36, 24, 3, 3], ["dispatch_grad", 0, 12, 24, 1, 5]], results[0]["records"]
    assert results[1]["records"] == [
        header, counts, ["dispatch", 0, 12, 24, 1, 5], ["combine", 0, 36, 24, 3, 3],
        ["combine_grad", 0, 12, 24, 1, 5], ["dispatch_grad", 0, 36, 24, 3, 3]], results[1]["records"]
    assert results[0]["sent"] == 32 + 16 + 36 + 12 + 36 + 12 and results[1]["sent"] == 32 + 16 + 12 + 36 + 12 + 36


def test_ep_groups_and_non_members_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """ep_groups over 2 ranks: EP 1 gives EP {r}, EDP {0, 1}; EP 2 gives EP {0, 1}, EDP {r}; 3 and 0 are no divisors of 2.
    shard_experts on a group this rank is not in is refused (rank 1, group {0}); rank 0 shards over {0}."""
    results = two_ranks
    for rank, r in enumerate(results):
        assert r["groups"] == {"1": [[rank], [0, 1]], "2": [[0, 1], [rank]]}, (rank, r["groups"])
        assert r["same_groups"], "a second ep_groups call made other groups (or EP 2 of 2 ranks is not the world)"
        for degree in ("three", "zero"):  # 0 was "does not divide the world size" too
            assert r[degree].startswith("MoelensError") and "is not a divisor of the world size 2; choose one of " \
                "[1, 2]" in r[degree], r
    assert results[0]["non_member"] == ""
    assert "not a member of the given group" in results[1]["non_member"], results[1]


def test_shard_experts_on_one_rank() -> None:
    """A one-rank group: every expert stays local, so the model may switch back to grouped_mm; the experts
    modules get distinct non-zero layer tags (0 means unknown); sharding again is refused; a model built by
    moelens.compress (experts reading their own settings) is switched to torch_a2a too."""
    results = ranks(1, """
        import moelens
        from moelens.parallel import shard_experts
        from moelens.testing import tiny_model
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        model = shard_experts(tiny_model("mixtral", experts_implementation="grouped_mm"))
        RESULT["tags"] = [m._ep_tag for m in model.modules() if "_ep_group" in m.__dict__]
        RESULT["again"] = error_of(lambda: shard_experts(model))
        RESULT["bad_group"] = error_of(lambda: shard_experts(tiny_model("mixtral"), "world"))
        RESULT["no_model"] = error_of(lambda: shard_experts("tiny"))
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        model.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            RESULT["grouped_mm"] = error_of(lambda: model(input_ids=ids))
            RESULT["logits"] = float((model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())

        from moelens.compress import tomoe
        from test_compress_helpers import ids as make_ids, llama
        converted = tomoe(llama(), num_experts=4, top_k=2, calibration=make_ids(8, 16, 1), max_error=10.0,
                          progress=False)
        shard_experts(converted)
        RESULT["converted"] = moelens.wrap(converted).moes[0].experts_implementation
    """)
    r = results[0]
    assert len(r["tags"]) == 4 and 0 not in r["tags"] and len(set(r["tags"])) == 4, r["tags"]  # 4 MoE layers
    assert "is sharded already" in r["again"], r["again"]
    assert "group must be a torch.distributed process group (this rank's EP group" in r["bad_group"], r["bad_group"]
    assert "shard_experts takes a transformers MoE model (or one wrapped by moelens), got str 'tiny'" in r["no_model"]
    assert r["grouped_mm"] == "" and r["logits"] <= 1e-5, r
    assert r["converted"] == "torch_a2a", r["converted"]


def test_shard_experts_refuses_peft_adapters_on_the_experts_it_would_not_slice() -> None:
    """LoRA on the experts' own parameters (a PEFT ParamWrapper) adds its product to the whole expert stack: slicing
    the weights would leave it whole, on or off, merged or not. The refused model runs as before."""
    pytest.importorskip("peft")
    results = ranks(1, """
        import peft
        from moelens.parallel import shard_experts
        from moelens.testing import tiny_model
        hf = tiny_model("mixtral", experts_implementation="grouped_mm")
        config = peft.LoraConfig(r=2, init_lora_weights=False, target_parameters=["mlp.experts.down_proj"])
        tuned = peft.get_peft_model(hf, config)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            before = tuned(input_ids=ids).logits
            RESULT["error"] = error_of(lambda: shard_experts(tuned))
            RESULT["logits"] = float((tuned(input_ids=ids).logits - before).abs().max())
            tuned.merge_adapter()
            RESULT["merged"] = error_of(lambda: shard_experts(tuned))
            tuned.unmerge_adapter()
            with tuned.disable_adapter():
                RESULT["off"] = error_of(lambda: shard_experts(tuned))
        RESULT["marked"] = [name for name, module in hf.named_modules() if "_ep_group" in module.__dict__]
    """)
    r = results[0]
    for state in ("error", "merged", "off"):
        assert r[state] == ("MoelensError: shard_experts (base_model.model.model.layers.0.mlp): PEFT adapters stand "
                            "for the block's experts 'experts' (LoRA on down_proj), kept beside its weights (on or off, "
                            "merged or not): sharding would slice the weights and leave the adapters whole. Merge the "
                            "adapters into the weights and shard the result: "
                            "shard_experts(peft_model.merge_and_unload())."), (state, r[state])
    assert r["logits"] == 0.0 and r["marked"] == [], r


def test_a_trace_counts_its_run_as_it_begins_even_if_its_body_fails_before_the_model_runs():
    """A rank whose trace of an empty batch raised in its body (before the model ran) counted no run: the other
    ranks' trace paired with its next one, silently wrong (parallel.runs). One run per trace, however it ends."""
    import moelens
    from moelens.parallel.runs import Runs
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral")
    inputs, wrapped = tiny_inputs(hf), moelens.wrap(hf)
    runs = Runs()
    for moe in wrapped.moes:  # as shard_experts marks the experts it shards
        moe.experts._module.__dict__["_ep_runs"] = runs
    with pytest.raises(ValueError, match="outside of interleaving"):
        with wrapped.trace():  # no input: the body runs before, and here instead of, the model
            wrapped.output.save()
    assert (runs.current, runs.tracing) == (1, 0)
    with wrapped.trace(**inputs):
        wrapped.output.save()
    assert (runs.current, runs.tracing) == (2, 0)


def test_a_refused_scan_of_torch_a2a_experts_counts_no_run() -> None:
    """A model.scan of a model whose experts run torch_a2a made its batcher (counting a run of the EP group) before
    torch_a2a refused scan's shape-only tensors: a scan tried on one rank put that rank a run ahead of the others,
    and the ranks' later traces raised RankDivergence or hung. The scan is refused before it counts one, with the
    text torch_a2a gives on those tensors itself; the next trace counts the next run and matches grouped_mm."""
    import moelens
    from torch._subclasses.fake_tensor import FakeTensorMode
    from groundtruth import ascii_tokenizer
    from moelens.parallel import register_torch_a2a, torch_a2a_experts_forward
    from moelens.parallel.runs import Runs
    from moelens.testing import tiny_inputs, tiny_model

    register_torch_a2a()
    reference = tiny_model("mixtral", experts_implementation="grouped_mm")
    hf = tiny_model("mixtral")
    hf.set_experts_implementation("torch_a2a")  # no group: one rank, every expert local
    wrapped, ids = moelens.wrap(hf, tokenizer=ascii_tokenizer()), tiny_inputs(hf)["input_ids"]
    runs = Runs()
    for moe in wrapped.moes:  # as shard_experts marks the experts it shards
        moe.experts._module.__dict__["_ep_runs"] = runs
    with FakeTensorMode(), pytest.raises(MoelensError) as bare:  # the implementation's own refusal
        fake = torch.empty(2, hf.config.hidden_size)
        torch_a2a_experts_forward(wrapped.moes[0].experts._module, fake, torch.zeros(2, 2, dtype=torch.long),
                                  torch.ones(2, 2))
    with pytest.raises(MoelensError) as refused:
        with wrapped.scan("def f(x):"):
            wrapped.moes[0].router_logits.save()
    assert str(refused.value) == str(bare.value), (str(refused.value), str(bare.value))
    assert (runs.current, runs.tracing) == (0, 0)  # old: (1, 0)
    with torch.no_grad(), wrapped.trace(ids):
        logits = wrapped.output.logits.save()
    assert (runs.current, runs.tracing) == (1, 0)
    assert torch.allclose(logits, reference(input_ids=ids).logits, atol=1e-5)


# -- defects of the review of 2026-12 (each a real two-rank run) ---------------------------------


def test_a_destroyed_group_is_freed_with_its_sockets() -> None:
    """`parallel.runs` kept every group it met (and its gloo sockets) alive after destroy_process_group: a process
    re-initialising the group held one more group, and more sockets, each time (`ep_groups`' groups must not
    either)."""
    results = ranks(2, """
        import gc, weakref
        from moelens.parallel import ep_groups, shard_experts
        from moelens.parallel import runs as runs_module
        from moelens.testing import tiny_model
        def sockets():
            found = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
                except OSError:
                    pass
            return found
        ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(RANK))
        counts, alive = [], []
        for cycle in range(3):
            sub = dist.new_group([0, 1])
            model = shard_experts(tiny_model("mixtral"), sub)
            with torch.no_grad():
                model(input_ids=ids)
            shard_experts(tiny_model("mixtral"), ep_groups(1)[1])
            refs = [weakref.ref(sub), weakref.ref(dist.group.WORLD)]
            del model, sub
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
            gc.collect()
            alive.append([ref() is not None for ref in refs])
            counts.append(sockets())
            dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE']}.{cycle}", rank=RANK,
                                    world_size=WORLD, timeout=timedelta(seconds=30))
        RESULT.update(sockets=counts, alive=alive, runs=len(runs_module._BY_GROUP))
    """)
    for r in results:  # the first world group stays: importing moelens.parallel while it is up keeps it (torch)
        assert r["alive"][0][0] is False and r["alive"][1:] == [[False, False]] * 2, r
        assert len(set(r["sockets"])) == 1 and r["runs"] <= 1, r  # old: sockets 3, 6, 9 and 3 groups held


def test_two_models_run_in_another_order_on_each_rank_raise_rank_divergence() -> None:
    """Two models of one layout sharded over one group, run A then B on rank 0 and B then A on rank 1: each layer
    of A paired with B's on the other rank (both tagged by position only), silently wrong by up to 0.02. Each
    model's tags carry its index among the models sharded over the group, so every forward raises RankDivergence
    (on every rank); run in the same order they match one process."""
    results = ranks(2, """
        import copy
        from moelens.parallel import shard_experts
        from moelens.testing import tiny_model
        refs = [tiny_model("mixtral", experts_implementation="grouped_mm"),
                tiny_model("mixtral", seed=1, experts_implementation="grouped_mm")]
        models = [shard_experts(copy.deepcopy(ref), None) for ref in refs]
        ids = torch.randint(3, 128, (1 + (RANK == 0), 7), generator=torch.Generator().manual_seed(RANK))
        def difference(index):
            return float((models[index](input_ids=ids).logits - refs[index](input_ids=ids).logits).abs().max())
        with torch.no_grad():
            RESULT["crossed"] = [error_of(lambda: difference(index)) for index in ([0, 1] if RANK == 0 else [1, 0])]
            RESULT["in_step"] = [difference(0), difference(1)]
        RESULT["tags"] = [[m._ep_tag for m in model.modules() if "_ep_tag" in m.__dict__] for model in models]
    """)
    for r in results:
        assert all(error.startswith("RankDivergence") and "another order of models" in error
                   for error in r["crossed"]), r["crossed"]
        assert max(r["in_step"]) <= 1e-5, r["in_step"]
        assert r["tags"] == [[1, 2, 3, 4], [65537, 65538, 65539, 65540]], r["tags"]


def test_models_sharded_over_each_their_ep_groups_call_recover_from_an_error_on_one_rank() -> None:
    """Models A and B each sharded over their own `ep_groups(2)[0]`: a trace of A refused on rank 1 only, then
    every rank traces B. Each call made a new group (its own run ids and gloo communicator): rank 0 waited in A's
    exchange while rank 1 ran B's, until the timeout. ep_groups returns one group for the ranks (here the world),
    so rank 0 raises RankDivergence and B's trace matches one process on every rank."""
    results = ranks(2, """
        import copy
        import moelens
        from moelens.parallel import ep_groups, shard_experts
        from moelens.testing import tiny_model
        ref_a = tiny_model("mixtral", experts_implementation="grouped_mm")
        ref_b = tiny_model("mixtral", seed=1, experts_implementation="grouped_mm")
        a = moelens.wrap(shard_experts(copy.deepcopy(ref_a), ep_groups(WORLD)[0]))
        b = moelens.wrap(shard_experts(copy.deepcopy(ref_b), ep_groups(WORLD)[0]))
        ids = torch.randint(3, 128, (1 + (RANK == 0), 7), generator=torch.Generator().manual_seed(RANK))
        def refused():  # expert 0 is rank 0's: rank 1 raises before the forward
            with a.trace(ids):
                a.moes[0].params(expert=0)
                a.output.logits.save()
        RESULT["refused"] = error_of(refused)
        with torch.no_grad():
            with b.trace(ids):
                logits = b.output.logits.save()
            RESULT["b"] = float((logits - ref_b(input_ids=ids).logits).abs().max())
    """, collective_timeout=15)
    assert results[0]["refused"].startswith("RankDivergence"), results[0]["refused"]
    assert results[1]["refused"].startswith("ValueUnavailable"), results[1]["refused"]
    assert all(r["b"] <= 1e-5 for r in results), results


def test_a_scan_refused_on_one_rank_leaves_the_next_traces_paired() -> None:
    """Rank 0 alone tries model.scan of a sharded model (refused), then both ranks trace twice. The refused scan
    used up a run id on rank 0: rank 1's first trace raised RankDivergence and rank 0's second waited for a peer
    that had left. Now every trace matches one process on both ranks."""
    results = ranks(2, """
        import moelens
        from moelens.parallel import shard_experts
        from moelens.testing import tiny_model
        from groundtruth import ascii_tokenizer
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        lm = moelens.wrap(shard_experts(tiny_model("mixtral", experts_implementation="grouped_mm")),
                          tokenizer=ascii_tokenizer())
        ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(RANK))
        def scan():
            with lm.scan("def f(x):"):
                lm.moes[0].router_logits.save()
        RESULT["scan"] = error_of(scan) if RANK == 0 else ""
        def trace():
            with torch.no_grad(), lm.trace(ids):
                logits = lm.output.logits.save()
            return float((logits - ref(input_ids=ids).logits).abs().max())
        RESULT["traces"] = []  # each trace's max |difference| from one process, or its error
        for _ in range(2):
            try:
                RESULT["traces"].append(trace())
            except Exception as error:
                RESULT["traces"].append(f"{type(error).__name__}: {error}")
    """, collective_timeout=15)
    assert results[0]["scan"].startswith("MoelensError: torch_a2a cannot run on nnsight's shape-only tensors")
    for r in results:
        assert all(isinstance(t, float) and t <= 1e-5 for t in r["traces"]) and len(r["traces"]) == 2, r["traces"]


def test_ep_groups_wait_as_long_as_the_world_group() -> None:
    """ep_groups made its groups with torch's default timeout (30 minutes on gloo), not the one given to
    init_process_group (3 s here): a collective of rank 0 alone on them waited until rank 1 exited. Now it
    times out after the world's timeout, or the one given to ep_groups (2 s)."""
    results = ranks(2, """
        import time
        from moelens.parallel import ep_groups
        def timeout_of(group):  # torch's private API: the backend's options
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        ep_group, edp_group = ep_groups(1)  # {rank} and {0, 1}
        made = {}  # {0, 1} with its own timeout
        RESULT["explicit_refused"] = error_of(lambda: made.update(explicit=ep_groups(2, timeout=timedelta(seconds=2))[0]))
        RESULT["world_timeout"], RESULT["ep_timeout"] = timeout_of(dist.group.WORLD), timeout_of(ep_group)
        RESULT["refused"] = error_of(lambda: ep_groups(1, timeout=5))
        if RANK == 0:  # alone in a collective of both ranks: it must time out, not wait for rank 1 to exit
            for name, group in [("edp", edp_group)] + list(made.items()):
                start = time.monotonic()
                RESULT[name] = error_of(lambda: dist.all_reduce(torch.ones(1), group=group))
                RESULT[name + "_seconds"] = time.monotonic() - start
        else:
            time.sleep(8)
        emit()
        os._exit(0)  # the timed-out group cannot be destroyed cleanly
    """, collective_timeout=3)
    first = results[0]
    assert "Timed out" in first["edp"] and 2.5 <= first["edp_seconds"] <= 7, first
    assert first["explicit_refused"] == "" and "Timed out" in first["explicit"] and first["explicit_seconds"] <= 5, first
    for r in results:
        assert r["world_timeout"] == 3.0 and r["ep_timeout"] == 3.0, r
        assert "ep_groups: timeout must be a datetime.timedelta" in r["refused"], r["refused"]


@pytest.fixture(scope="module")
def saved_ep_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoints of tiny mixtral and qwen2_moe, for transformers' own expert parallelism (DistributedConfig)."""
    pytest.importorskip("accelerate")
    from moelens.testing import tiny_model

    folder = tmp_path_factory.mktemp("dc-ep")
    for family in ("mixtral", "qwen2_moe"):
        tiny_model(family).save_pretrained(folder / family)
    return {family: str(folder / family) for family in ("mixtral", "qwen2_moe")}


#: Loads a checkpoint with transformers' own EP over moelens' torch_a2a (`load(path)`), and its unsharded twin.
DISTRIBUTED_CONFIG = """
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from moelens.parallel import register_torch_a2a
register_torch_a2a()
def load(path):
    config = DistributedConfig(fsdp_size=WORLD, ep_size=WORLD, ep_implementation="torch_a2a")
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config).eval()
ids = torch.randint(3, 128, (1 + (RANK == 0), 7), generator=torch.Generator().manual_seed(RANK))
def difference(model, path):
    with torch.no_grad():
        return float((model(input_ids=ids).logits - AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits)
                     .abs().max())
"""


def test_distributed_config_tags_do_not_depend_on_what_a_rank_loaded_before(saved_ep_models: dict[str, str]) -> None:
    """DistributedConfig(ep_implementation="torch_a2a") tagged experts modules with a process-wide count: ranks that
    loaded their models in another order gave one model other tags, and every forward raised a false
    RankDivergence. Tags are positions in the model: both models match one process on every rank."""
    paths = json.dumps(saved_ep_models)
    results = ranks(2, DISTRIBUTED_CONFIG + textwrap.dedent(f"""
        paths = {paths}
        order = ["mixtral", "qwen2_moe"] if RANK == 0 else ["qwen2_moe", "mixtral"]
        models = {{family: load(paths[family]) for family in order}}
        RESULT["tags"] = {{family: [m._ep_tag for m in model.modules() if "_ep_tag" in m.__dict__]
                          for family, model in models.items()}}
        def measure(family):
            RESULT[family] = difference(models[family], paths[family])
        RESULT["differences"] = [error_of(lambda: measure(family)) for family in ("mixtral", "qwen2_moe")]
    """))
    for r in results:
        assert r["differences"] == ["", ""], r["differences"]
        assert r["mixtral"] <= 1e-5 and r["qwen2_moe"] <= 1e-5, r
        assert r["tags"] == {"mixtral": [1, 2, 3, 4], "qwen2_moe": [1, 2, 3]}, r["tags"]


def test_distributed_config_rank_tracing_while_another_runs_plain_forwards(saved_ep_models: dict[str, str]) -> None:
    """Under DistributedConfig only traces counted runs: rank 0 tracing while rank 1 ran plain forwards raised a
    false RankDivergence ("a run raised an error on those ranks only"), then the group timed out. Each forward is a
    run now (counted at the model's first experts call): three steps match one process on both ranks."""
    path = saved_ep_models["mixtral"]
    results = ranks(2, DISTRIBUTED_CONFIG + textwrap.dedent(f"""
        import moelens
        path = {path!r}
        model = load(path)
        wrapped = moelens.wrap(model)
        expected = AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits.detach()
        def step():
            with torch.no_grad():
                if RANK == 0:
                    with wrapped.trace(ids):
                        logits = wrapped.output.logits.save()
                else:
                    logits = model(input_ids=ids).logits
            return float((logits - expected).abs().max())
        def measure(index):
            RESULT[f"step{{index}}"] = step()
        RESULT["steps"] = [error_of(lambda: measure(index)) for index in range(3)]
    """), collective_timeout=15)
    for r in results:
        assert r["steps"] == ["", "", ""], r["steps"]
        assert max(r[f"step{index}"] for index in range(3)) <= 1e-5, r
