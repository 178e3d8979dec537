"""Expert parallelism (moelens.parallel) on real multi-process gloo runs.

Each multi-process test starts 1, 2 or 4 ranks of ``tests/parallel_worker.py``
(subprocesses with torchrun-style ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and a
file rendezvous, one torch thread each, a 60 s collective timeout, the whole run
killed after `RUN_TIMEOUT`) and checks what every rank measured against the
single-process ground truth: the same tiny model (same seed) in one process on
grouped_mm, run on that rank's tokens (the ranks hold different numbers of
tokens). One test per run, so pytest-xdist never starts a run twice.

Tolerances: logits, Moe values and intervention results 1e-5 (fp32), values and
logits also 1e-5 relative to their largest magnitude; gradients 1e-5 (dense
gradients summed over the world, expert gradients over the EDP group, against the
single-process gradient of every rank's loss summed). Both absolute tolerances
scale with the magnitude where it exceeds 1 (the trained moelens-tiny). Every
intervention must also move the single-process logits by more than ten times the
tolerance, so a no-op could not pass.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from moelens.data import TINY_MODEL_PATH

from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("parallel_worker.py")
#: Seconds a whole multi-process run may take before it is killed.
RUN_TIMEOUT = 600
TOL = 1e-5
#: Relative tolerance of values (against the largest magnitude of the value): the tiny models'
#: expert outputs are ~1e-3, where an absolute 1e-5 alone would hide a 1% error.
RTOL = 1e-5
#: What an intervention must change, at least, for its check to mean anything.
EFFECT = 10 * TOL

#: Every Moe value a torch_a2a model serves for these families (per family: + the shared expert).
ROUTED_VALUES = [
    "expert_activations", "expert_indices", "expert_outputs", "expert_weights", "mlp_output",
    "routed_output", "router_logits", "router_probs",
]
SHARED = {"qwen2_moe", "deepseek_v3", "moelens-tiny"}



def spawn(world: int, suites: dict[str, dict]) -> list[dict[str, dict[str, Any]]]:
    """Run ``suites`` (name -> arguments) in one run of ``world`` ranks; every rank's results
    (suite -> case -> measurements or error)."""
    with tempfile.TemporaryDirectory(prefix="moelens-ep-") as folder:
        env = dict(os.environ, MOELENS_TEST_STORE=f"{folder}/store", MOELENS_TEST_OUT=folder,
                   MOELENS_TEST_ARGS=json.dumps(suites), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        problems = run_ranks(world, [sys.executable, str(WORKER), *suites], env, folder, RUN_TIMEOUT)
        if problems:
            pytest.fail(f"{list(suites)} on {world} ranks: " + "\n".join(problems))
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world)]


def failures(results: list[dict[str, Any]], suite: str, check: Any) -> list[str]:
    """Run ``check(case, measured)`` (yielding problems) for every rank's every case of ``suite``."""
    found = []
    for rank, by_suite in enumerate(results):
        cases = by_suite.get(suite)
        if not cases:
            found.append(f"rank {rank}: no results for {suite}")
            continue
        for case, measured in cases.items():
            if "error" in measured and isinstance(measured["error"], str) and measured["error"].startswith("Traceback"):
                found.append(f"rank {rank} {case}: {measured['error']}")
                continue
            found.extend(f"rank {rank} {case}: {problem}" for problem in check(case, measured))
    return found


def close(name: str, value: float, tol: float = TOL) -> list[str]:
    return [] if value <= tol else [f"{name} differs by {value:.3g} (> {tol:g})"]


def check_family(case: str, m: dict[str, Any]) -> list[str]:
    """Logits, gradients, every Moe value, every intervention, a starved rank.

    Absolute tolerances scale with the magnitude once it exceeds 1 (a trained checkpoint's
    logits and gradients are ~10: there 1e-5 absolute is below fp32's rounding of a sum)."""
    logits_tol = TOL * max(1.0, m["logits_scale"])
    problems = close("logits", m["logits"], logits_tol)
    problems += close("grads", m["grads"], TOL * max(1.0, m["grad_scale"]))
    problems += [] if m["implementation"] == "torch_a2a" else [f"runs {m['implementation']}"]
    problems += [] if m["num_experts"][0] == m["num_experts"][1] else [f"num_experts {m['num_experts']}"]
    expected = set(ROUTED_VALUES) | ({"shared_expert_output"} if any(f in case for f in SHARED) else set())
    problems += [] if expected <= set(m["served"]) else [f"not served: {sorted(expected - set(m['served']))}"]
    problems += [] if not m["missing_values"] else [f"missing values {m['missing_values']}"]
    for name, value in m["values"].items():
        problems += close(f"value {name}", value) + close(f"value {name} (relative)", value, RTOL * m["scales"][name])
    problems += close("logits (relative)", m["logits"], RTOL * m["logits_scale"])
    problems += [] if m["round_trip"] else ["reading per-slot values made no activation round trip"]
    problems += [] if not m["plain_trace_round_trip"] else ["a trace without per-slot reads made the round trip"]
    for name, value in m["interventions"].items():
        problems += close(f"intervention {name}", value, logits_tol)
        if m["effects"][name] <= 10 * logits_tol:
            problems.append(f"intervention {name} changes nothing ({m['effects'][name]:.3g})")
    problems += close("logits after undoing the weight edit", m["restored"], logits_tol)
    problems += close("starved logits", m["starved_logits"], logits_tol)
    problems += close("starved grads", m["starved_grads"], TOL * max(1.0, m["starved_grad_scale"]))
    problems += [] if m["starved_round_trip_grads"] else ["no backward through the activation round trip"]
    return problems


def check_starved(results: list[dict[str, Any]]) -> list[str]:
    """The last rank of every EP group received no rows when its experts were routed around."""
    found = []
    for rank, by_suite in enumerate(results):
        for case, m in by_suite["families"].items():
            ep = m.get("degrees", [0])[0]
            last_of_group = ep and rank % ep == ep - 1
            if last_of_group and m.get("starved_received") != 0:
                found.append(f"rank {rank} {case}: received {m.get('starved_received')} rows while starved")
            if not last_of_group and not m.get("starved_received"):
                found.append(f"rank {rank} {case}: received nothing while its experts were routed to")
    return found


# -- in-process checks (no process group) ------------------------------------------------


def test_importing_moelens_registers_nothing() -> None:
    code = (
        "import sys, moelens\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
        "from moelens.components.implementations import serving\n"
        "assert 'moelens.parallel' not in sys.modules\n"
        "assert {'analysis', 'compress', 'export', 'parallel', 'testing', 'wrap'} <= set(dir(moelens))\n"  # tab completion
        "assert not [name for name in sys.modules if name.startswith(('moelens.parallel', 'moelens.export'))]\n"
        "import moelens.parallel as p\n"
        "assert 'torch_a2a' not in ALL_EXPERTS_FUNCTIONS and 'torch_a2a' not in serving() and not p.is_registered()\n"
        "p.register_torch_a2a(); p.register_torch_a2a()\n"
        "from transformers.distributed.expert_parallel import EPImplementationInterface\n"
        "assert ALL_EXPERTS_FUNCTIONS['torch_a2a'] is p.torch_a2a_experts_forward\n"
        "assert 'torch_a2a' in EPImplementationInterface() and 'torch_a2a' in serving()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_degrees() -> None:
    from moelens import MoelensError
    from moelens.parallel import choose_ep_dp_degrees, expert_owner

    assert choose_ep_dp_degrees(2, 8) == (2, 1)
    assert choose_ep_dp_degrees(4, 8) == (4, 1)
    assert choose_ep_dp_degrees(4, 6) == (2, 2)
    assert choose_ep_dp_degrees(8, 60) == (4, 2)
    assert choose_ep_dp_degrees(1, 8) == (1, 1)
    with pytest.warns(UserWarning, match="falling back"):
        assert choose_ep_dp_degrees(3, 8) == (1, 3)
    with pytest.warns(UserWarning, match="falling back"):
        assert choose_ep_dp_degrees(4, 0) == (1, 4)
    assert [expert_owner(e, 8, 4) for e in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]
    assert expert_owner(5, 6, 2) == (1, 2)
    for expert in (8, -1):  # no rank holds them (8 gave rank 4 of 4)
        with pytest.raises(MoelensError, match=rf"expert_owner: expert {expert} is out of range \[0, 8\)"):
            expert_owner(expert, 8, 4)


def test_num_experts_from_config() -> None:
    from types import SimpleNamespace

    from transformers import AutoConfig, Qwen2Config

    from moelens.parallel import num_experts_from_config
    from moelens.testing import tiny_config

    for family in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe", "llama4", "dbrx",
                   "step3p7", "longcat_flash"):  # longcat_flash: its experts with weights
        assert num_experts_from_config(tiny_config(family)) == 8, family
    # composite configs keep their experts in the language model's config
    composite = AutoConfig.for_model("qwen3_vl_moe", text_config={"num_experts": 12})
    assert num_experts_from_config(composite) == 12
    assert num_experts_from_config(Qwen2Config()) == 0
    # a field holding 0 is no count: the next field the config has is read
    assert num_experts_from_config(SimpleNamespace(num_local_experts=0, n_routed_experts=8)) == 8


def test_sharding_keeps_each_ranks_experts_of_every_expert_leading_parameter_and_buffer() -> None:
    """Parameters and buffers whose leading dim is E keep this rank's experts (buffers too, as persistent or not
    as they were); anything else is left whole."""
    import torch

    from moelens.parallel.shard import _slice

    experts = torch.nn.Module()
    experts.weight = torch.nn.Parameter(torch.arange(4 * 3.0).view(4, 3))
    experts.register_buffer("scale", torch.arange(4.0))
    experts.register_buffer("counts", torch.arange(4.0) + 10, persistent=False)
    experts.register_buffer("other", torch.arange(3.0))
    _slice(experts, num_experts=4, first=2, per_rank=2)
    assert torch.equal(experts.weight, torch.arange(4 * 3.0).view(4, 3)[2:]) and experts.weight.requires_grad
    assert torch.equal(experts.scale, torch.tensor([2.0, 3.0])) and torch.equal(experts.counts, torch.tensor([12.0, 13.0]))
    assert torch.equal(experts.other, torch.arange(3.0))
    assert set(experts.state_dict()) == {"weight", "scale", "other"}  # the non-persistent buffer stays out


def test_shard_experts_needs_a_process_group() -> None:
    from moelens import MoelensError
    from moelens.parallel import shard_experts
    from moelens.testing import tiny_model

    with pytest.raises(MoelensError, match="init_process_group"):
        shard_experts(tiny_model("mixtral"))


# -- one process: torch_a2a with no group / a one-rank group -------------------------------


def test_torch_a2a_in_one_process() -> None:
    from moelens.testing import NOT_DECORATED

    families = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss"]
    families += [family for family in ("longcat_flash",) if family not in NOT_DECORATED]  # transformers 5.25
    results = spawn(1, {"single": {"families": families}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("logits", m["logits"]) + [f"missing {m['missing_values']}"] * bool(m["missing_values"])
        problems += [] if m["implementation"] == "torch_a2a" else [f"runs {m['implementation']}"]
        problems += [f"params: {m['params']}"] if isinstance(m["params"], str) else close("params", m["params"])
        for name, value in m["values"].items():
            problems += close(f"value {name}", value)
        return problems

    assert len(results[0]["single"]) == 2 * len(families)
    assert not failures(results, "single", check)


# -- a2a_moe alone -------------------------------------------------------------------------


def check_a2a(results: list[dict[str, Any]]) -> list[str]:
    """`a2a_moe` against a dense computation: forward and every gradient, with random routing,
    everything sent to rank 0 (the others receive nothing), dropped (-1) ids, and a rank
    holding no tokens."""

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("output", m["out"])
        for name in ("grad_x", "grad_w", "grad_experts"):
            problems += close(name, m[name])
        if m["grad_scale"] < 1.0:
            problems.append(f"expert gradients too small to test ({m['grad_scale']:.3g})")
        return problems

    found = failures(results, "a2a", check)
    if found:
        return found
    world = len(results)
    a2a = [by_suite["a2a"] for by_suite in results]
    if any(len(cases) != 4 for cases in a2a):
        found.append("a2a: not every case ran")
    if any(a2a[rank]["all_to_rank0"]["received"] != 0 for rank in range(1, world)) or not a2a[0]["all_to_rank0"]["received"]:
        found.append(f"a2a: rows received with everything routed to rank 0: {[c['all_to_rank0']['received'] for c in a2a]}")
    if a2a[-1]["empty_rank"]["tokens"] != 0:
        found.append("a2a: the last rank held tokens in the empty_rank case")
    return found


# -- whole models ----------------------------------------------------------------------------


def test_families_on_two_ranks() -> None:
    """EP 2 x EDP 1 for mixtral, qwen2_moe (shared expert), olmoe, deepseek_v3, gpt_oss (expert
    biases), moelens-tiny and a dense Llama converted by moelens.compress: logits, gradients, every
    Moe value, every intervention, and a rank that receives no token. Then every tiny family:
    sharded logits match, or shard_experts refuses a family whose experts module has no pluggable
    implementations."""
    cases = [[family, family, {}, None] for family in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")]
    tiny = ["moelens-tiny", str(TINY_MODEL_PATH), {}, None]
    compressed = ["tomoe-llama", "tomoe-llama", {}, 2]  # 4 experts: EP 2
    results = spawn(2, {"families": {"cases": cases + [tiny, compressed]}, "all_families": {}})
    assert not failures(results, "families", check_family)
    assert not check_starved(results)
    assert all(m["degrees"] == [2, 1] for m in results[0]["families"].values())
    assert len(results[0]["families"]) == 7

    def check(family: str, m: dict[str, Any]) -> list[str]:
        if not m["pluggable"]:
            said = m.get("refused", "")  # why, and what to do instead
            return [] if "pluggable implementations" in said and "Run it data parallel instead" in said else \
                [f"not refused as expected: {m}"]
        return [f"refused: {m['refused']}"] if "refused" in m else close("logits", m["logits"])

    from moelens.testing import FAMILIES

    assert not failures(results, "all_families", check)
    assert set(results[0]["all_families"]) == set(FAMILIES)
    assert sum(m["pluggable"] for m in results[0]["all_families"].values()) >= 60


def test_four_ranks() -> None:
    """`a2a_moe` on 4 ranks, and whole models at EP 4 x 1 (8 experts), EP 2 x EDP 2 chosen for 6
    experts, and EP 2 x EDP 2 by choice (fewer interventions: 4 ranks share 2 cores)."""
    cases = [
        ["mixtral-4x1", "mixtral", {}, None],
        ["mixtral-6experts-2x2", "mixtral", {"num_local_experts": 6}, None],
        ["qwen2_moe-2x2", "qwen2_moe", {}, 2],
    ]
    results = spawn(4, {"a2a": {}, "families": {"cases": cases, "quick": True}})
    assert not check_a2a(results)
    assert not failures(results, "families", check_family)
    assert not check_starved(results)
    assert [m["degrees"] for m in results[0]["families"].values()] == [[4, 1], [2, 2], [2, 2]]


# -- hazards ----------------------------------------------------------------------------------


def test_a2a_and_hazards_on_two_ranks() -> None:
    """`a2a_moe` on 2 ranks; then what goes wrong on purpose: a sharded model switched to
    grouped_mm / batched_mm raises, and so do its save_pretrained and push_to_hub (plain or wrapped; nothing
    written), and a forward over a group destroyed since; an experts call skipped on one rank raises RankDivergence on every rank (and the ranks stay in step); a skip at the last MoE layer, which no later
    exchange can detect, ends with the group's timeout, not a hang; a trace raising on one rank only
    (an intervention refused for its tokens, at layer 0, at layer 1, or before the forward in two traces
    in a row), or a forward outside a trace raising on one rank only (a user's hook registered before
    shard_experts' own; a forward of the base model; a Ctrl-C in a forward, for which torch skips the hooks it
    calls after an Exception), raises RankDivergence on the others in that trace
    or forward (each of the two), and the next traces (one with the last rank's experts
    negated, ground truth: the single-process model edited alike) and forwards pair on every rank; a user's plain
    torch model of a registered family shards and matches one process;
    ranks holding models with other experts are refused by shard_experts on every rank; a rank left waiting by an
    error elsewhere meets the next trace's model of other expert counts with RankDivergence, not a gloo abort."""
    results = spawn(2, {"a2a": {}, "hazards": {"short_timeout": 5}})
    assert not check_a2a(results)
    for rank, by_suite in enumerate(results):
        cases = by_suite["hazards"]
        guard = cases["guard"]
        for implementation in ("grouped_mm", "batched_mm"):
            assert guard[implementation].startswith("ShardedExpertsError"), (rank, guard)
            assert "silently drop" in guard[implementation]
        assert guard["back"] <= TOL
        assert guard["wrapped_is_returned"] and guard["wrapped"] <= TOL, guard
        for error in guard["save"]:  # the sharded model, and it wrapped: refused, and nothing written
            assert error.startswith("ShardedExpertsError: save_pretrained: MixtralForCausalLM's experts are sharded "
                                    "over 2 ranks"), (rank, error)
            assert f"this rank ({rank}) holds experts {rank * 4}..{rank * 4 + 3} of 8" in error, error
        for error in guard["base_save"]:  # its base model (ep.model) wrote rank 0's experts under a config of all 8
            assert error.startswith("ShardedExpertsError: save_pretrained: MixtralModel's experts are sharded over 2 "
                                    "ranks"), (rank, error)
        assert guard["push"].startswith("ShardedExpertsError: push_to_hub: MixtralForCausalLM's experts are sharded"), guard
        assert guard["saved_files"] == [] and guard["unsharded_saves"] == "", guard
        assert cases["destroyed_group"]["error"].startswith(
            f"ShardedExpertsError: MixtralExperts holds only experts {rank * 4}..{rank * 4 + 3} of 8, sharded over a "
            "process group that no longer exists"), (rank, cases["destroyed_group"])
        converted = cases["converted_projection_sharded_then_wrapped"]
        assert "error" not in converted and converted["logits"] <= TOL, (rank, converted)
        assert converted["weight"].startswith("CompressionError: ToMoELinear's dense weight is rebuilt from all 4 "
                                              f"experts, and this rank holds experts {2 * rank}..{2 * rank + 1} only")
        folder = cases["one_folder_for_every_rank"]
        assert "error" not in folder, (rank, folder.get("error", "")[-2000:])
        assert "under expert parallelism every rank collects, and ranks [0, 1] gave one folder" in \
            folder["refused"] and folder["written"] == ["rank0", "rank0-only", "rank1", "stray"] and folder["same"], \
            (rank, folder)
        assert ("shard-00000.safetensors" if rank == 0 else "rank 0 of the expert-parallel group refused its folder") \
            in folder["refused_alone"], (rank, folder)
        ctrl_c = cases["ctrl_c_then_a_block"]
        assert "error" not in ctrl_c and max(ctrl_c["block"] + ctrl_c["base"] + [ctrl_c["whole"]]) <= TOL, (rank, ctrl_c)
        assert ctrl_c["freed"], (rank, ctrl_c)
        assert ctrl_c["interrupted"].startswith("KeyboardInterrupt" if rank == 1 else "RankDivergence"), (rank, ctrl_c)
        assert cases["divergent_skip"]["error"].startswith("RankDivergence"), (rank, cases["divergent_skip"])
        assert cases["divergent_skip"]["after_ok"]
        other_width = cases["other_width_after_an_error"]  # a waiting rank meets a model of other expert counts
        assert "error" not in other_width, (rank, other_width.get("error", "")[-2000:])
        assert other_width["refused"].startswith("RankDivergence" if rank == 0 else "ValueUnavailable"), (rank, other_width)
        assert other_width["narrow"] <= TOL, (rank, other_width)
        assert "hold different models: the experts of ranks" in cases["different_models"]["error"], cases
        widths = {rank: 2 * (24 if rank == 1 else 16), 1 - rank: 2 * (24 if rank == 0 else 16)}  # gate and up rows
        assert re.search(  # what each rank holds where they first differ (each saw only its own layout)
            rf"they first differ at MoE block 1: rank {rank}'s is \(model\.layers\.0\.mlp: gate_up_proj "
            rf"\(\d+, {widths[rank]}, \d+\) float32.*\), rank {1 - rank}'s \(model\.layers\.0\.mlp: "
            rf"gate_up_proj \(\d+, {widths[1 - rank]}, \d+\) float32", cases["different_models"]["error"]), cases
        plain = cases["plain_torch_model"]  # a registered plain torch model: sharded, and the same as one process
        assert "error" not in plain, plain.get("error", "")[-2000:]
        assert plain["indices_equal"] and plain["out"] <= TOL and plain["held"] == [[2, 16, 16]] * 2, plain  # (JSON)
        assert "hold different models" in cases["different_models"]["dtype"] and "in the same dtype" in cases["different_models"]["dtype"]
        assert "error" not in cases["error_on_some_ranks"], (rank, cases["error_on_some_ranks"]["error"][-2000:])
        mixed = cases["traced_and_plain_generate"]  # rank 0 traces its generation, rank 1 does not
        assert mixed.get("equal"), (rank, mixed.get("error", "")[-2000:])
        for name, case in cases["error_on_some_ranks"].items():
            expected = ("RankDivergence" if rank == 0 else "ValueUnavailable" if name.startswith("before the forward")
                        else "MoelensError: the input holds no prompts" if name.startswith("an empty batch")
                        else "KeyboardInterrupt" if "Ctrl-C" in name
                        else "RuntimeError: refused on this rank" if name.startswith("a ") else "WriteError")
            assert case["errors"] and all(error.startswith(expected) for error in case["errors"]), (rank, name, case)
            assert max(case["negated"], case["restored"], case["forward"]) <= TOL, (rank, name, case)
    last_layer = [by_suite["hazards"]["divergent_last_layer"]["error"] for by_suite in results]
    assert "Timed out" in last_layer[0] and last_layer[1] == "", last_layer


# -- transformers' own expert parallelism -------------------------------------------------------


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from moelens.testing import tiny_model

    folder = tmp_path_factory.mktemp("hf-ep")
    paths = []
    for family in ("mixtral", "qwen2_moe"):
        tiny_model(family).save_pretrained(folder / family)
        paths.append(str(folder / family))
    return paths


def test_transformers_expert_parallelism(saved_models: list[str]) -> None:
    """from_pretrained(..., DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation=auto |
    torch_a2a)) wrapped by moelens: values, global num_experts, interventions; per-slot values
    refused with a clear error."""
    pytest.importorskip("accelerate")
    results = spawn(2, {"transformers_ep": {"paths": saved_models, "implementations": ["auto", "torch_a2a"]}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("logits", m["logits"]) + close("traced logits", m["traced_logits"])
        problems += [] if m["num_experts"][0] == m["num_experts"][1] else [f"num_experts {m['num_experts']}"]
        expected = {"expert_indices", "expert_weights", "mlp_output", "routed_output", "router_logits", "router_probs"}
        problems += [] if expected <= set(m["served"]) else [f"not served: {sorted(expected - set(m['served']))}"]
        for name, value in m["values"].items():
            problems += close(f"value {name}", value)
        if not m["per_slot_error"].startswith("ValueUnavailable") or "shard_experts" not in m["per_slot_error"]:
            problems.append(f"per-slot read: {m['per_slot_error']!r}")
        if not m["params_error"].startswith("ValueUnavailable") or "is a DTensor" not in m["params_error"]:
            problems.append(f"params of DTensor experts: {m['params_error']!r}")
        for name, value in m["interventions"].items():
            problems += close(f"intervention {name}", value)
            if m["effects"][name] <= EFFECT:
                problems.append(f"intervention {name} changes nothing")
        uses_a2a = case.endswith("torch_a2a")
        if uses_a2a != bool(m["a2a_exchanges"]):
            problems.append(f"{m['a2a_exchanges']} torch_a2a exchanges")
        if "every rank collects, and ranks [0, 1] gave one folder" not in m["one_folder"]:
            problems.append(f"one folder for every rank: {m['one_folder']!r}")
        return problems

    assert not failures(results, "transformers_ep", check)
    assert len(results[0]["transformers_ep"]) == 4
    assert "shared_expert_output" in results[0]["transformers_ep"]["qwen2_moe-auto"]["served"]


# -- copies, refusals, one-rank replacements --------------------------------------------------


def test_deepcopy_of_a_sharded_model() -> None:
    """copy.deepcopy of a sharded model, plain and wrapped, runs on the same group (shared, not
    copied) with its own weights: logits, every Moe value and gradients match one process."""
    results = spawn(2, {"copies": {"cases": ["deepcopy"]}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("hf copy logits", m["hf_copy_logits"]) + close("wrapped copy logits", m["wrapped_copy_logits"])
        problems += close("original logits", m["original_logits"]) + close("wrapped copy values", m["values"])
        problems += close("copy grads", m["grads"], TOL * max(1.0, m["grad_scale"]))
        problems += [] if m["shares_group"] else ["the copy does not share the original's group"]
        problems += [] if m["own_weights"] else ["the copy shares the original's expert weights"]
        return problems

    assert not failures(results, "copies", check)


def test_refused_shard_experts_changes_nothing() -> None:
    """A model whose blocks hold 6 and 3 experts (moelens.compress on GQA attention) on 2 ranks:
    shard_experts refuses before sharding any block (outputs and parameters as before), and its
    hint names the blocks' expert counts and a degree dividing all of them."""
    results = spawn(2, {"copies": {"cases": ["refused"]}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = [] if m["error"].startswith("MoelensError") else [f"not refused: {m['error']!r}"]
        for hint in ("k_proj has 3 experts", "hold 3, 6 experts", "choose_ep_dp_degrees(world_size, 3)"):
            problems += [] if hint in m["error"] else [f"no {hint!r} in {m['error']!r}"]
        problems += [] if m["runs"] == "ok" else [f"the refused model no longer runs: {m['runs']}"]
        problems += close("logits after the refusal", m["logits"], 0.0) + close("parameters", m["params"], 0.0)
        problems += [] if not m["marked"] else [f"marked as sharded: {m['marked']}"]
        return problems

    assert not failures(results, "copies", check)


def test_shard_experts_refuses_lora_adapters_it_would_not_slice() -> None:
    results = spawn(2, {"copies": {"cases": ["lora_refused"]}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = [] if "carries LoRA adapters" in m["error"] and "merge_lora" in m["error"] else [
            f"not refused clearly: {m['error']!r}"]
        problems += [] if m["runs"] == "ok" else [f"the refused model no longer runs: {m['runs']}"]
        return problems + close("logits after the refusal", m["logits"], 0.0)

    assert not failures(results, "copies", check)


def test_a_model_refused_on_one_rank_is_refused_on_every_rank() -> None:
    results = spawn(2, {"copies": {"cases": ["one_rank_refused"]}})
    found = []
    for rank, by_suite in enumerate(results):
        for odd, error in by_suite["copies"]["one_rank_refused"].items():
            expected = ("ranks [1] of the group refused to shard their model" if rank == 0
                        else "has no MoE block" if odd == "dense" else "carries LoRA adapters")
            if not error.startswith("MoelensError") or expected not in error:
                found.append(f"rank {rank}, rank 1 {odd}: {error!r}")
    assert not found


def test_export_of_a_sharded_model_is_refused_as_such() -> None:
    results = spawn(2, {"copies": {"cases": ["export_refused"]}})
    errors = [by_suite["copies"]["export_refused"] for by_suite in results]
    assert all(error.startswith("ExportRefused: model.layers.0.mlp: the experts are sharded over ranks") for error in errors)
    assert "holds only experts 0 to 3" in errors[0] and "holds only experts 4 to 7" in errors[1], errors


def test_scan_of_a_sharded_model_says_why_it_cannot_run() -> None:
    results = spawn(2, {"copies": {"cases": ["scan_refused"]}})
    errors = [by_suite["copies"]["scan_refused"] for by_suite in results]
    assert all("torch_a2a cannot run on nnsight's shape-only tensors (model.scan)" in error
               and "Scan the model before shard_experts" in error for error in errors), errors


def test_params_of_sharded_experts() -> None:
    """Moe.params on a model sharded over 2 ranks: each rank serves its own experts (equal to the
    unsharded model's, as views of its slice) and names the rank that holds any other."""
    results = spawn(2, {"copies": {"cases": ["params"]}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("local experts' weights", m["local"], 0.0)
        problems += [] if "params(" in m["other"] and "on rank" in m["other"] else [f"other rank: {m['other']!r}"]
        problems += [] if "this rank holds experts" in m["every"] else [f"every expert: {m['every']!r}"]
        problems += [] if m["edited"] == 0.0 and m["untouched"] > 0.0 else ["the edit did not land in the slice"]
        return problems + ([] if m["router"] else ["the router was served for an edit of this rank's copy alone"])

    assert not failures(results, "copies", check)


def test_an_analysis_corpus_refused_on_one_rank_raises_on_every_rank_and_the_next_traces_pair() -> None:
    """collect_routing whose corpus rank 0 refuses between traces (an id past the vocabulary in its second batch):
    rank 1's collection went on, its trace of that batch paired with rank 0's next trace, and the ranks stayed a
    trace apart until the group's timeout. Now rank 1's collection raises RankDivergence and the traces after pair,
    each equal to the unsharded model's logits."""
    results = spawn(2, {"copies": {"cases": ["corpus_refused_on_one_rank"]}})
    collected = [by_suite["copies"]["corpus_refused_on_one_rank"]["collect"] for by_suite in results]
    assert "outside the model's vocabulary" in collected[0] and collected[1].startswith("RankDivergence"), collected

    def check(case: str, m: dict[str, Any]) -> list[str]:
        return close("logits after", max(m["after"]))

    assert not failures(results, "copies", check)


def collected_as_unsharded(case: str, m: dict[str, Any]) -> list[str]:
    """A collection's routing against the unsharded model's: the same experts, weights within `TOL`."""
    return ([] if m["indices"] == 0 else [f"indices {m['indices']}"]) + close("weights", m["weights"])


def test_an_analysis_call_after_a_corpus_refused_on_one_rank_pairs() -> None:
    """The user's next collect_routing after one refused on rank 0 only (not a plain trace): rank 0's exchange of
    folders met rank 1's trace of the refused batch, and both ranks waited until the group's timeout. Now rank 1's
    trace raises RankDivergence, and the next call's collection on both ranks equals the unsharded model's."""
    results = spawn(2, {"copies": {"cases": ["corpus_refused_then_collected_again"]}})
    collected = [by_suite["copies"]["corpus_refused_then_collected_again"]["collect"] for by_suite in results]
    assert "outside the model's vocabulary" in collected[0] and collected[1].startswith("RankDivergence"), collected

    assert not failures(results, "copies", collected_as_unsharded)


def test_a_corpus_refused_before_any_exchange_on_one_rank_counts_a_run() -> None:
    """A corpus given as a set on rank 0 only is refused before collect_routing's first exchange: rank 1's call paired
    with rank 0's next one (the ranks a call apart from there). Now rank 1's call raises RankDivergence and the next
    calls pair, each equal to the unsharded model's."""
    results = spawn(2, {"copies": {"cases": ["set_corpus_refused_on_one_rank"]}})
    collected = [by_suite["copies"]["set_corpus_refused_on_one_rank"]["collect"] for by_suite in results]
    assert "is a set" in collected[0] and collected[1].startswith("RankDivergence"), collected

    assert not failures(results, "copies", collected_as_unsharded)


def test_replace_on_one_rank_then_backward() -> None:
    """Rank 0 replaces layer 1's routed_output with zeros (a tensor that needs no grad), rank 1 does
    not, both run backward: it completes, and the gradients equal one process running every rank's
    loss with the same per-rank edits. Also: a read of the up projections under activation checkpointing, then
    backward, against one process without checkpointing."""
    results = spawn(2, {"replace_one_rank": {}})

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = close("logits", m["logits"]) + close("grads", m["grads"], TOL * max(1.0, m["grad_scale"]))
        return problems + ([] if m["finite"] else ["non-finite gradients"])

    assert not failures(results, "replace_one_rank", check)


def test_scan_on_torch_a2a_without_a_group_says_why_it_cannot_run() -> None:
    """A single process on torch_a2a (no group, or a group of one rank) gave a raw symbolic-shape error."""
    import moelens
    from moelens import MoelensError
    from moelens.parallel import register_torch_a2a

    model = moelens.load()
    register_torch_a2a()
    model.set_experts_implementation("torch_a2a")
    with model.trace("def f(x):"):
        routed = model.moes[0].routed_output.save()
    assert routed.shape[-1] == model.config.hidden_size  # it runs; only the shape-only pass cannot
    with pytest.raises(MoelensError, match=r"torch_a2a cannot run on nnsight's shape-only tensors \(model.scan\)"):
        with model.scan("def f(x):"):
            model.moes[0].routed_output.save()


def test_the_routing_of_a_generation_under_expert_parallelism() -> None:
    """collect_generation on a sharded model equals the one-process call on every rank: with rows ending at different
    steps on different ranks under synced_gpus (without it, a rank whose rows ended went on to its next forward while
    the others still exchanged rows), and after a prompt refused on one rank only (the other rank's generation paired
    with its next call; now it raises RankDivergence, and the next calls pair)."""
    results = spawn(2, {"generation": {}})
    refused = [by_suite["generation"]["refused_on_one_rank"]["refused"] for by_suite in results]
    assert refused[0].startswith("RankDivergence") and "outside the model's vocabulary" in refused[1], refused
    chunked = [by_suite["generation"]["chunked_prefill_refused"]["refused"] for by_suite in results]
    assert all("cannot take prefill_chunk_size on a model whose experts are sharded" in text for text in chunked), chunked

    def check(case: str, m: dict[str, Any]) -> list[str]:
        problems = []
        for name, c in m.items():
            if not isinstance(c, dict):
                continue
            same = c["ids"] and c["tokens"] and c["lengths"][0] == c["lengths"][1] and c["indices"] == 0
            problems += [] if same and c["weights"] < TOL else [f"{name}: {c}"]
        return problems

    assert not failures(results, "generation", check)
    lengths = [by_suite["generation"]["rows_end_apart"]["synced"]["lengths"][0] for by_suite in results]
    assert lengths[0] == [2] and lengths[1] != [2], lengths  # the rows did end apart
