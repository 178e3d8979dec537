"""One rank of the multi-process expert-parallel tests (tests/test_parallel.py).

Started as ``python tests/parallel_worker.py SUITE...`` with torchrun-style
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and ``MOELENS_TEST_STORE`` (a file
rendezvous), ``MOELENS_TEST_OUT`` (where ``rank<r>.json`` goes) and
``MOELENS_TEST_ARGS`` (JSON: suite -> arguments). It joins a gloo process group with a short timeout
(a bug fails instead of hanging), runs the suite's cases, and writes per case
either the measured differences against the single-process ground truth or the
error. Every rank builds the same tiny models from one seed; the single-process
reference runs on every rank, on that rank's tokens.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import sys
import traceback
import weakref
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import moelens  # noqa: E402
from moelens import ablate, force, keep_top, reroute, steer  # noqa: E402
from moelens.testing import tiny_model  # noqa: E402


#: Seconds a collective may wait before failing.
TIMEOUT = float(os.environ.get("MOELENS_TEST_TIMEOUT", "60"))

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def tokens_of(rank: int, vocab: int = 128, seed: int = 1234) -> torch.Tensor:
    """Rank ``rank``'s input ids: a different number of tokens on every rank (rank 0: two rows)."""
    gen = torch.Generator().manual_seed(seed + rank)
    rows = 2 if rank == 0 else 1
    return torch.randint(3, vocab, (rows, 9 - 2 * (rank % 4)), generator=gen)


def maxdiff(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (the training loss), summed over tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")


# -- models --------------------------------------------------------------------------


def expert_params(model: torch.nn.Module) -> set[str]:
    """Names of the sharded expert parameters (of experts modules sharded by shard_experts)."""
    names = set()
    for module_name, module in model.named_modules():
        if "_ep_group" in module.__dict__:
            for param_name, param in module.named_parameters(recurse=False):
                if param.shape[0] == module._ep_num_local:
                    names.add(f"{module_name}.{param_name}")
    return names


def compare_grads(ep: torch.nn.Module, ref: torch.nn.Module, edp_group: Any) -> tuple[float, float]:
    """Largest difference between the EP gradients (dense summed over the world, experts over
    EDP) and the single-process gradients of the sum of every rank's loss, and the largest
    single-process gradient."""
    experts = expert_params(ep)
    firsts = {name: module._ep_first for name, module in ep.named_modules() if "_ep_group" in module.__dict__}
    ref_params = dict(ref.named_parameters())
    worst = scale = 0.0
    for name, param in ep.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grad = grad.clone()
        expected = ref_params[name].grad
        expected = expected if expected is not None else torch.zeros_like(ref_params[name])
        if name in experts:
            if edp_group is not None:
                dist.all_reduce(grad, group=edp_group)
            first = firsts[name.rpartition(".")[0]]
            expected = expected[first : first + grad.shape[0]]
        else:
            dist.all_reduce(grad)
        worst = max(worst, maxdiff(grad, expected))
        scale = max(scale, float(expected.abs().max()) if expected.numel() else 0.0)
    return worst, scale


#: The case name of a dense model turned into MoE blocks by moelens.compress.
COMPRESSED = "tomoe-llama"


def compressed_llama() -> torch.nn.Module:
    """The compress tests' tiny Llama with its FFNs turned into 4-expert top-2 blocks (trainable
    experts), on grouped_mm, with rank 0's weights on every rank."""
    from moelens.compress import tomoe
    from test_compress_helpers import ids, llama

    model = tomoe(llama(), num_experts=4, top_k=2, calibration=ids(8, 16, 1), max_error=1.0, freeze_experts=False)
    for param in model.parameters():
        dist.broadcast(param.data, 0)
    return model.eval()


def build(family: str, ep_group: Any, overrides: dict | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(single-process reference on grouped_mm, EP model sharded over ep_group): a tiny model
    from one seed, a checkpoint when ``family`` is a folder (moelens-tiny), or `compressed_llama`."""
    from moelens.parallel import shard_experts

    if Path(family).is_dir():
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(family, experts_implementation="grouped_mm").eval()
    elif family == COMPRESSED:
        ref = compressed_llama()
    else:
        ref = tiny_model(family, experts_implementation="grouped_mm", **(overrides or {}))
    ep = shard_experts(copy.deepcopy(ref), ep_group)
    return ref, ep


# -- interventions ----------------------------------------------------------------------

def _interventions(far: int, near: int) -> dict[str, Callable[[Any], None]]:
    """Each intervention, on expert ``far`` (owned by another rank) and ``near`` (this rank's)."""

    def write_outputs(lm: Any) -> None:
        for moe in lm.moes:
            moe.expert_outputs[:, :, 0] *= 0.5

    def write_activations(lm: Any) -> None:
        for moe in lm.moes:
            moe.expert_activations[:, :, 1] = 0.0

    def write_gate(lm: Any) -> None:  # the up projections, back on the senders, edited through gate_and_up's views
        for moe in lm.moes:
            pre = moe.expert_pre_activations
            if getattr(moe.experts._module, "has_gate", True):
                gate, _ = moe.gate_and_up(pre)
                gate[:, :, 0] *= -1.0
            else:
                pre[:, :, 0] *= -1.0

    return {
        "ablate_zero": lambda lm: [ablate(m, far) for m in lm.moes],
        "ablate_route_around": lambda lm: [ablate(m, far, "route_around") for m in lm.moes],
        "ablate_swap": lambda lm: [ablate(m, far, "swap", to=near) for m in lm.moes],
        "reroute": lambda lm: [reroute(m, (slice(None), [0, 1]), [far, near]) for m in lm.moes],
        "steer": lambda lm: [steer(m, far, 4.0) for m in lm.moes],
        "force": lambda lm: [force(m, [far]) for m in lm.moes],
        "keep_top": lambda lm: [keep_top(m, 1, renormalize=True) for m in lm.moes],
        "write_expert_outputs": write_outputs,
        "write_expert_activations": write_activations,
        "write_expert_pre_activations": write_gate,
    }


def busiest(values: dict, E: int, ep_size: int, offset: int) -> int:
    """The expert this rank's tokens use most among those of EP-group rank (own rank + offset)."""
    rank = RANK % ep_size
    owner = (rank + offset) % ep_size
    per_rank = E // ep_size
    counts = sum(torch.bincount(v["expert_indices"].reshape(-1), minlength=E) for v in values.values())
    return owner * per_rank + int(counts[owner * per_rank : (owner + 1) * per_rank].argmax())


def traced_logits(lm: Any, ids: torch.Tensor, intervene: Callable[[Any], None] | None = None) -> torch.Tensor:
    with lm.trace(ids):
        if intervene is not None:
            intervene(lm)
        logits = lm.output.logits.save()
    return logits


#: The interventions a quick case runs (4 ranks on 2 cores: fewer traces).
QUICK = ("ablate_zero", "ablate_route_around", "reroute", "write_expert_activations")


def family_checks(
    family: str, ep_group: Any, edp_group: Any, overrides: dict | None = None, quick: bool = False
) -> dict[str, Any]:
    """Everything checked for one family on one rank: logits, grads, Moe values, interventions."""
    from moelens.parallel import local_expert, traffic

    ref, ep = build(family, ep_group, overrides)
    ids_of = functools.partial(tokens_of, vocab=ref.config.get_text_config().vocab_size)
    ids = ids_of(RANK)
    result: dict[str, Any] = {}

    # Logits and gradients (plain forward / backward, no tracer).
    ep.train(False)
    logits_ep = logits_of(ep(input_ids=ids))
    result["logits"] = maxdiff(logits_ep, logits_of(ref(input_ids=ids)))
    result["logits_scale"] = float(logits_ep.abs().max())
    loss_of(logits_ep, ids).backward()
    total = sum(loss_of(logits_of(ref(input_ids=ids_of(r))), ids_of(r)) for r in range(WORLD))
    total.backward()
    result["grads"], result["grad_scale"] = compare_grads(ep, ref, edp_group)
    ep.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    # Every Moe value, this rank's tokens.
    lm_ep, lm_ref = moelens.wrap(ep), moelens.wrap(ref)
    E = lm_ref.moes[0].num_experts
    result["num_experts"] = [lm_ep.moes[0].num_experts, E]
    result["implementation"] = lm_ep.moes[0].experts_implementation
    with traffic() as log:
        with lm_ep.trace(ids):
            values_ep = lm_ep.save_all()
    with lm_ref.trace(ids):
        values_ref = lm_ref.save_all()
    result["served"] = sorted(values_ep[next(iter(values_ep))])
    result["values"] = {
        name: max(maxdiff(values_ep[layer][name], values_ref[layer][name]) for layer in values_ref)
        for name in values_ref[next(iter(values_ref))]
    }
    result["scales"] = {
        name: max(float(values_ref[layer][name].abs().max()) for layer in values_ref)
        for name in values_ref[next(iter(values_ref))]
    }
    result["missing_values"] = sorted(set(values_ref[next(iter(values_ref))]) - set(result["served"]))
    result["round_trip"] = any(r.kind == "pre_activations_back" for r in log.records)
    with traffic() as log:
        traced_logits(lm_ep, ids)
    result["plain_trace_round_trip"] = any(r.kind == "pre_activations_back" for r in log.records)

    # Interventions: the EP run against the same intervention in one process, on the expert of
    # the next rank of the EP group this rank's tokens use most (and its own most used one).
    size = dist.get_world_size(ep_group) if ep_group is not None else WORLD
    far, near = busiest(values_ref, E, size, 1), busiest(values_ref, E, size, 0)
    result["experts"] = [far, near]
    plain_ref = traced_logits(lm_ref, ids)
    result["interventions"] = {}
    result["effects"] = {}
    for name, intervene in _interventions(far, near).items():
        if quick and name not in QUICK:
            continue
        edited = traced_logits(lm_ref, ids, intervene)
        result["interventions"][name] = maxdiff(traced_logits(lm_ep, ids, intervene), edited)
        result["effects"][name] = maxdiff(edited, plain_ref)

    # Expert weight edits through the id mapping: every rank names the same experts (those of the
    # last rank of its EP group, the same set on every rank), each edit lands on its owner only.
    last = range(E - E // size, E)

    def negate_last_rank_experts() -> None:
        for moe_ep, moe_ref in zip(lm_ep.moes, lm_ref.moes):
            for expert in last:
                local = local_expert(moe_ep, expert)
                if local is not None:
                    moe_ep.experts._module.down_proj.data[local] *= -1.0
                moe_ref.experts._module.down_proj.data[expert] *= -1.0

    negate_last_rank_experts()
    edited = traced_logits(lm_ref, ids)
    result["interventions"]["weight_edit"] = maxdiff(traced_logits(lm_ep, ids), edited)
    result["effects"]["weight_edit"] = maxdiff(edited, plain_ref)
    negate_last_rank_experts()
    result["restored"] = maxdiff(traced_logits(lm_ep, ids), plain_ref)

    # No token routed to the last rank of the EP group: route around all its experts; fwd + bwd.

    def starve(lm: Any) -> None:
        for moe in lm.moes:
            for expert in last:
                ablate(moe, expert, "route_around")
            moe.expert_outputs.save()  # the activation round trip runs (and is differentiated) too

    with traffic() as log:
        with lm_ep.trace(ids):
            starve(lm_ep)
            starved = lm_ep.output.logits.save()
        loss_of(starved, ids).backward()
    result["starved_received"] = sum(r.received for r in log.records if r.kind == "dispatch")
    result["starved_round_trip_grads"] = any(r.kind == "activations_out_grad" for r in log.records)
    with lm_ref.trace(ids):
        starve(lm_ref)
        expected = lm_ref.output.logits.save()
    result["starved_logits"] = maxdiff(starved, expected)
    for r in range(WORLD):
        with lm_ref.trace(ids_of(r)):
            starve(lm_ref)
            other = lm_ref.output.logits.save()
        loss_of(other, ids_of(r)).backward()
    result["starved_grads"], result["starved_grad_scale"] = compare_grads(ep, ref, edp_group)
    return result


# -- suites -------------------------------------------------------------------------------


def suite_families(args: dict) -> dict[str, Callable[[], Any]]:
    from moelens.parallel import choose_ep_dp_degrees, ep_groups, num_experts_from_config
    from moelens.testing import tiny_config

    cases = {}
    for name, family, overrides, ep in args["cases"]:
        def run(family: str = family, overrides: dict = overrides, ep: int | None = ep) -> Any:
            if ep is None:
                if Path(family).is_dir():
                    from transformers import AutoConfig

                    config = AutoConfig.from_pretrained(family)
                else:
                    config = tiny_config(family, **overrides)
                ep = choose_ep_dp_degrees(WORLD, num_experts_from_config(config))[0]
            ep_group, edp_group = ep_groups(ep)
            result = family_checks(family, ep_group, edp_group, overrides, quick=args.get("quick", False))
            result["degrees"] = [ep, WORLD // ep]
            return result

        cases[name] = run
    return cases


def suite_a2a(args: dict) -> dict[str, Callable[[], Any]]:
    """`a2a_moe` alone against a dense computation of the same experts, forward and backward."""
    from transformers.integrations.moe import _grouped_linear

    from moelens.parallel import a2a_moe, traffic

    D, K, per_rank = 8, 2, 2  # rows of 32 bytes: CPU grouped_mm wants 16-byte strides
    E = per_rank * WORLD
    lo = RANK * per_rank
    weights = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7))

    def routing(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + rank)
        T = 0 if case == "empty_rank" and rank == WORLD - 1 else 5 + 3 * rank
        x = torch.randn(T, D, generator=gen)
        idx = torch.randint(0, E, (T, K), generator=gen)
        if case == "all_to_rank0":  # the other ranks receive no rows
            idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long) % per_rank], 1)
        if case == "dropped_ids":  # -1 slots contribute nothing
            idx[::2, 1] = -1
        w = torch.rand(T, K, generator=gen)
        return x, idx, w

    def dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for slot in range(idx.shape[1]):
            ok = idx[:, slot] >= 0
            rows = torch.tanh(torch.einsum("td,tod->to", x, W[idx[:, slot].clamp(min=0)]))
            out = out + torch.where(ok[:, None], rows * w[:, slot : slot + 1], 0.0)
        return out

    def run(case: str) -> dict[str, Any]:
        local = weights[lo : lo + per_rank].clone().requires_grad_(True)

        def expert_fn(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            if rows.shape[0] == 0:
                return rows @ local[0] * 0.0  # keep the empty rows in the graph
            return torch.tanh(_grouped_linear(rows, local, offsets))

        x, idx, w = routing(RANK, case)
        x.requires_grad_(True)
        w.requires_grad_(True)
        with traffic() as log:
            out = a2a_moe(dist.group.WORLD, x, idx, w, E, per_rank, expert_fn)
            (out * torch.arange(1.0, D + 1)).sum().backward()
        ref_x, ref_w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        W = weights.clone().requires_grad_(True)
        expected = dense(ref_x, idx, ref_w, W)
        (expected * torch.arange(1.0, D + 1)).sum().backward()
        W_all = weights.clone().requires_grad_(True)
        total = sum((dense(*routing(r, case)[:1], *routing(r, case)[1:], W_all) * torch.arange(1.0, D + 1)).sum()
                    for r in range(WORLD))
        total.backward()
        return {
            "out": maxdiff(out, expected),
            "grad_x": maxdiff(x.grad, ref_x.grad),
            "grad_w": maxdiff(w.grad, ref_w.grad),
            "grad_experts": maxdiff(local.grad, W_all.grad[lo : lo + per_rank]),
            "grad_scale": float(W_all.grad.abs().max()),
            "received": sum(r.received for r in log.records if r.kind == "dispatch"),
            "tokens": int(x.shape[0]),
        }

    return {case: functools.partial(run, case) for case in ("random", "all_to_rank0", "dropped_ids", "empty_rank")}


def _error_text(call: Callable[[], Any]) -> str:
    try:
        call()
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - a Ctrl-C a test raises on purpose too
        return f"{type(error).__name__}: {error}"
    return ""


def suite_hazards(args: dict) -> dict[str, Callable[[], Any]]:
    """What goes wrong on purpose: a switch back to grouped_mm, rank-divergent interventions."""
    from moelens.parallel import shard_experts

    def guard() -> dict[str, Any]:
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        ep = shard_experts(copy.deepcopy(ref), None)
        ids = tokens_of(RANK)
        result = {}
        for implementation in ("grouped_mm", "batched_mm"):
            ep.set_experts_implementation(implementation)
            result[implementation] = _error_text(lambda: ep(input_ids=ids))
        ep.set_experts_implementation("torch_a2a")
        result["back"] = maxdiff(logits_of(ep(input_ids=ids)), logits_of(ref(input_ids=ids)))
        wrapped = moelens.wrap(copy.deepcopy(ref))  # a wrapped model is sharded through to its transformers model
        result["wrapped_is_returned"] = shard_experts(wrapped, None) is wrapped
        with wrapped.trace(ids):
            logits = wrapped.output.logits.save()
        result["wrapped"] = maxdiff(logits, logits_of(ref(input_ids=ids)))
        # A checkpoint of a sharded model would hold this rank's experts under a config naming all of them.
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            result["save"] = [_error_text(lambda: model.save_pretrained(Path(folder) / "saved")) for model in (ep, wrapped)]
            result["base_save"] = [_error_text(lambda: model.model.save_pretrained(Path(folder) / "base"))
                                   for model in (ep, wrapped)]  # the base model inside: refused too
            result["push"] = _error_text(lambda: ep.push_to_hub("someone/sharded"))  # before it makes the repo
            result["saved_files"] = sorted(path.name for path in Path(folder).rglob("*"))
        result["unsharded_saves"] = _error_text(lambda: ref.save_pretrained(Path(tempfile.mkdtemp()) / "ref"))
        return result

    def divergent_skip() -> dict[str, Any]:
        ep = moelens.wrap(shard_experts(tiny_model("mixtral"), None))
        ids = tokens_of(RANK)

        def trace() -> None:
            with ep.trace(ids):
                if RANK == WORLD - 1:  # the last rank skips layer 0's experts call
                    ep.moes[0].experts.skip(torch.zeros(ids.numel(), 32))
                ep.output.logits.save()

        error = _error_text(trace)
        # The ranks are in step again: a plain forward still works everywhere.
        with ep.trace(ids):
            after = ep.output.logits.save()
        return {"error": error, "after_ok": bool(torch.isfinite(after).all())}

    def divergent_last_layer() -> dict[str, Any]:
        # A skip at the last MoE layer leaves the other ranks waiting: the group's timeout ends it.
        group = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=float(args.get("short_timeout", 5))))
        ep = moelens.wrap(shard_experts(tiny_model("mixtral"), group))
        ids = tokens_of(RANK)

        def trace() -> None:
            with ep.trace(ids):
                if RANK == WORLD - 1:
                    ep.moes[-1].experts.skip(torch.zeros(ids.numel(), 32))
                ep.output.logits.save()

        return {"error": _error_text(trace)}

    def error_on_some_ranks() -> dict[str, Any]:
        """A trace that raises on some ranks only, then traces that differ (the last rank's experts negated for
        the first): each must pair with the same trace on every rank, not the other ranks' next one."""
        from moelens.parallel import local_expert

        ref = tiny_model("mixtral")
        refusing = {"on": None}

        def refuse(module: Any, args: Any) -> None:  # a user's check failing on the last rank only (or a Ctrl-C)
            if refusing["on"] is not None and RANK == WORLD - 1:
                raise refusing["on"]("refused on this rank")

        unsharded = copy.deepcopy(ref)
        unsharded.register_forward_pre_hook(refuse)  # registered before shard_experts' own hooks
        unsharded.model.layers[1].register_forward_pre_hook(refuse)
        sharded = shard_experts(unsharded, None)
        lm = moelens.wrap(sharded)
        ids = tokens_of(RANK)  # rank 0 has two rows, the others one: token (1, 0) exists on rank 0 only
        E = ref.config.num_local_experts
        last = range(E - E // WORLD, E)

        def negate_last_rank_experts() -> None:
            for moe in lm.moes:
                for expert in last:
                    local = local_expert(moe, expert)
                    if local is not None:
                        moe.experts._module.down_proj.data[local] *= -1.0
            for layer in ref.model.layers:
                layer.mlp.experts.down_proj.data[list(last)] *= -1.0

        def reroute_second_row(layer: int) -> Callable[[], None]:
            def trace() -> None:
                with lm.trace(ids):
                    reroute(lm.moes[layer], (1, 0), [1, E - 1])
                    lm.output.logits.save()
            return trace

        def params_of(expert: int) -> Callable[[], None]:  # experts of rank 0: the others raise before the forward
            def trace() -> None:
                with lm.trace(ids):
                    lm.moes[0].params(expert=expert)
                    lm.output.logits.save()
            return trace

        def refused(call: Callable[[], Any], error: type[BaseException] = RuntimeError) -> Callable[[], None]:
            def run() -> None:
                refusing["on"] = error
                try:
                    with torch.no_grad():
                        call()
                finally:
                    refusing["on"] = None
            return run

        def empty_batch_on_the_last_rank() -> None:  # its body raises before the model runs: still its run
            with lm.trace(ids[:0] if RANK == WORLD - 1 else ids):
                lm.output.logits.save()

        result = {}
        for name, failing in (("layer 0", [reroute_second_row(0)]), ("layer 1", [reroute_second_row(1)]),
                              ("an empty batch, before the model runs", [empty_batch_on_the_last_rank]),
                              ("before the forward, twice", [params_of(0), params_of(1)]),
                              ("a forward, by an earlier hook", [refused(lambda: sharded(input_ids=ids))]),
                              ("a base model forward, at layer 1", [refused(lambda: sharded.model(input_ids=ids))]),
                              # torch calls no always-call hook for a BaseException: the forward stayed entered
                              ("a Ctrl-C in a forward, at layer 1", [refused(lambda: sharded(input_ids=ids),
                                                                             KeyboardInterrupt)])):
            case = {"errors": [_error_text(trace) for trace in failing]}
            negate_last_rank_experts()
            with torch.no_grad():
                case["negated"] = maxdiff(traced_logits(lm, ids), logits_of(ref(input_ids=ids)))
            negate_last_rank_experts()
            with torch.no_grad():
                case["restored"] = maxdiff(traced_logits(lm, ids), logits_of(ref(input_ids=ids)))
                case["forward"] = maxdiff(logits_of(sharded(input_ids=ids)), logits_of(ref(input_ids=ids)))
            result[name] = case
        return result

    def plain_torch_model() -> dict[str, Any]:
        # A user's own torch model (no set_experts_implementation) with decorated experts and a registered family:
        # shard_experts failed on every rank with AttributeError before changing anything.
        from custom_models import custom_family, custom_model

        moelens.families.register(custom_family(), replace=True)
        try:
            ref, ids = custom_model(), tokens_of(RANK, vocab=64)
            lm_ref, lm_ep = moelens.wrap(ref), moelens.wrap(shard_experts(custom_model(), None))
            values = {}
            for name, lm in (("ref", lm_ref), ("ep", lm_ep)):
                with torch.no_grad(), lm.trace(ids):
                    moelens.steer(lm.moes[0], 3, 20.0)
                    indices = lm.moes[1].expert_indices.save()
                    out = lm.output.save()
                values[name] = (indices, out)
            held = [tuple(module.pool.gate_up_proj.shape) for module in lm_ep._module.modules()
                    if type(module).__name__ == "CustomBlock"]
        finally:
            moelens.families.unregister("custom")
        return {"indices_equal": torch.equal(values["ref"][0], values["ep"][0]),
                "out": maxdiff(values["ref"][1], values["ep"][1]), "held": held}

    def different_models() -> dict[str, Any]:
        # The last rank loads experts of another width, or dtype: refused on every rank before any exchange (rows
        # of another size made gloo abort a process).
        width = 24 if RANK == WORLD - 1 else 16
        dtype = torch.bfloat16 if RANK == WORLD - 1 else torch.float32
        return {"error": _error_text(lambda: shard_experts(tiny_model("mixtral", intermediate_size=width), None)),
                "dtype": _error_text(lambda: shard_experts(tiny_model("mixtral", dtype=dtype), None))}

    def traced_and_plain_generate() -> dict[str, Any]:
        """Rank 0 looks at its generation in a trace, the others generate without one: the same forwards on every
        rank (a traced generation counted as one run, each untraced step as its own, ended in RankDivergence)."""
        from groundtruth import ascii_tokenizer

        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        ep = shard_experts(copy.deepcopy(ref), None)
        wrapped, ids = moelens.wrap(ep, tokenizer=ascii_tokenizer()), tokens_of(RANK)
        settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        if RANK == 0:
            with wrapped.generate(ids, **settings):
                out = wrapped.generator.output.save()
        else:
            out = ep.generate(ids, **settings)
        return {"equal": bool(torch.equal(out, ref.generate(ids, **settings)))}

    def other_width_after_an_error() -> dict[str, Any]:
        """Two models sharded over the group, of 8 and 4 experts (4 and 2 per rank): a trace of the first raises on
        the last rank only, then every rank traces the second. The first's waiting rank met the second's count
        rows, of another width, and gloo aborted both processes; it must raise RankDivergence, and the second
        trace pair on every rank."""
        ref_wide, ref_narrow = tiny_model("mixtral"), tiny_model("mixtral", num_local_experts=4)
        wide = moelens.wrap(shard_experts(copy.deepcopy(ref_wide), None))
        narrow = moelens.wrap(shard_experts(copy.deepcopy(ref_narrow), None))
        ids = tokens_of(RANK)

        def params_of_an_expert_of_rank_0() -> None:  # the other ranks raise before the forward
            with wide.trace(ids):
                wide.moes[0].params(expert=0)
                wide.output.logits.save()

        refused = _error_text(params_of_an_expert_of_rank_0)
        with torch.no_grad():
            return {"refused": refused, "narrow": maxdiff(traced_logits(narrow, ids), logits_of(ref_narrow(input_ids=ids)))}

    def ctrl_c_then_a_block() -> dict[str, Any]:
        """A Ctrl-C in a forward on the last rank, then every rank calls an MoE block alone: the interrupted rank
        still counted itself inside the model's forward, and its block calls raised RankDivergence (review 1)."""
        ref = tiny_model("mixtral")
        sharded = shard_experts(copy.deepcopy(ref), None)

        def interrupt(module: Any, args: Any) -> None:
            if RANK == WORLD - 1:
                raise KeyboardInterrupt("Ctrl-C on this rank")

        handle = sharded.model.layers[1].register_forward_pre_hook(interrupt)
        with torch.no_grad():
            error = _error_text(lambda: sharded(input_ids=tokens_of(RANK)))
            handle.remove()
            hidden = torch.randn(1, 3, ref.config.hidden_size, generator=torch.Generator().manual_seed(RANK))
            block, plain = sharded.model.layers[0].mlp, ref.model.layers[0].mlp
            blocks = [maxdiff(block(hidden), plain(hidden)) for _ in range(2)]
            # a Ctrl-C in lm_head, past every exchange, then the base model called alone: a module inside the
            # interrupted one (the base model inside the causal LM) was taken for a nested call, so the stale run
            # never ended (RankDivergence there, a timeout on the other rank); and the stale run held the model
            sharded = shard_experts(copy.deepcopy(ref), None)
            handle = sharded.lm_head.register_forward_pre_hook(interrupt)
            tokens = tokens_of(RANK)
            _error_text(lambda: sharded(input_ids=tokens))
            handle.remove()
            base = [maxdiff(sharded.model(input_ids=tokens).last_hidden_state,
                            ref.model(input_ids=tokens).last_hidden_state) for _ in range(2)]
            whole = maxdiff(logits_of(sharded(input_ids=tokens)), logits_of(ref(input_ids=tokens)))
        held = weakref.ref(sharded)
        del sharded, handle
        gc.collect()
        return {"interrupted": error, "block": blocks, "base": base, "whole": whole, "freed": held() is None}

    def converted_projection_sharded_then_wrapped() -> dict[str, Any]:
        """An FFN's down_proj converted to a ToMoELinear, sharded, then wrapped (docs/parallel.md's order): wrap read
        the layer's rebuilt dense weight, which needs every expert (IndexError on each rank); the truth is the same
        model in one process."""
        from moelens.compress import tomoe
        from test_compress_helpers import ids, llama

        converted = tomoe(llama(), num_experts=4, top_k=2, calibration=ids(8, 16, 1), max_error=None,
                          target_modules=["down_proj"], progress=False).eval()
        for param in converted.parameters():
            dist.broadcast(param.data, 0)
        tokens = tokens_of(RANK, vocab=converted.config.vocab_size)
        with torch.no_grad():
            expected = logits_of(converted(input_ids=tokens))
            wrapped = moelens.wrap(shard_experts(copy.deepcopy(converted), None))
            with wrapped.trace(tokens):
                logits = wrapped.output.logits.save()
            layer = wrapped._module.model.layers[0].mlp.down_proj
        return {"logits": maxdiff(logits, expected), "weight": _error_text(lambda: layer.weight)}

    def one_folder_for_every_rank() -> dict[str, Any]:
        """collect_routing(..., folder=F) on every rank (as the docs ask every rank to call it) streamed both ranks'
        shards into F: one rank's cache lost, or a FileNotFoundError at the rename of routing.json."""
        import tempfile

        from groundtruth import ascii_tokenizer

        wrapped = moelens.wrap(shard_experts(tiny_model("mixtral"), None), tokenizer=ascii_tokenizer())
        texts = ["ab cd", "efg"] if RANK == 0 else ["hij", "kl mn"]
        shared = Path(tempfile.gettempdir()) / f"moelens-one-folder-{os.getppid()}"
        refused = _error_text(lambda: moelens.analysis.collect_routing(wrapped, texts, folder=shared, progress=False))
        own = shared / f"rank{RANK}"
        moelens.analysis.collect_routing(wrapped, texts, folder=own, progress=False)
        loaded = moelens.analysis.RoutingCache.load(own)
        memory = moelens.analysis.collect_routing(wrapped, texts, progress=False)
        same = torch.equal(loaded.indices(0), memory.indices(0))
        # a folder on rank 0 only (review 2: the folder check, a collective, ran on rank 0 alone and hung)
        moelens.analysis.collect_routing(wrapped, texts, folder=shared / "rank0-only" if RANK == 0 else None,
                                         progress=False)
        if RANK == 0:
            same = same and torch.equal(moelens.analysis.RoutingCache.load(shared / "rank0-only").indices(0),
                                        memory.indices(0))
        # a folder refused on rank 0 alone (a stray shard in it): rank 1 waited in the folder collective until the
        # group timed out, and the group was dead after (review, stop 58); every rank refuses, the next run pairs
        stray = shared / "stray"
        if RANK == 0:
            stray.mkdir(parents=True, exist_ok=True)
            (stray / "shard-00000.safetensors").write_bytes(b"not a shard of moelens")
        dist.barrier()
        refused_alone = _error_text(lambda: moelens.analysis.collect_routing(
            wrapped, texts, folder=stray if RANK == 0 else shared / "rank1-own", progress=False))
        same = same and torch.equal(moelens.analysis.collect_routing(wrapped, texts, progress=False).indices(0),
                                    memory.indices(0))
        del loaded
        dist.barrier()
        written = sorted(path.name for path in shared.iterdir())
        dist.barrier()
        if RANK == 0:
            import shutil

            shutil.rmtree(shared)
        return {"refused": refused, "refused_alone": refused_alone, "written": written, "same": same}

    def destroyed_group() -> dict[str, Any]:
        """A model sharded over a group destroyed since: torch's "Group ... is not registered" deep in the
        exchange named neither the model nor the way out."""
        group = dist.new_group(list(range(WORLD)))
        ep = shard_experts(tiny_model("mixtral"), group)
        dist.destroy_process_group(group)
        return {"error": _error_text(lambda: ep(input_ids=tokens_of(RANK)))}

    return {"guard": guard, "divergent_skip": divergent_skip, "divergent_last_layer": divergent_last_layer,
            "destroyed_group": destroyed_group, "ctrl_c_then_a_block": ctrl_c_then_a_block,
            "one_folder_for_every_rank": one_folder_for_every_rank,
            "converted_projection_sharded_then_wrapped": converted_projection_sharded_then_wrapped,
            "other_width_after_an_error": other_width_after_an_error,
            "error_on_some_ranks": error_on_some_ranks, "different_models": different_models,
            "plain_torch_model": plain_torch_model, "traced_and_plain_generate": traced_and_plain_generate}


def suite_transformers_ep(args: dict) -> dict[str, Callable[[], Any]]:
    """transformers' own EP (from_pretrained + DistributedConfig) wrapped by moelens."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from moelens.parallel import register_torch_a2a, traffic

    register_torch_a2a()

    def run(path: str, implementation: str) -> dict[str, Any]:
        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        config = DistributedConfig(fsdp_size=WORLD, ep_size=WORLD, ep_implementation=implementation)
        ep = AutoModelForCausalLM.from_pretrained(path, distributed_config=config).eval()
        ids = tokens_of(RANK)
        result: dict[str, Any] = {"logits": maxdiff(logits_of(ep(input_ids=ids)), logits_of(ref(input_ids=ids)))}
        lm_ep, lm_ref = moelens.wrap(ep), moelens.wrap(ref)
        E = lm_ref.moes[0].num_experts
        result["num_experts"] = [lm_ep.moes[0].num_experts, E]
        with traffic() as log:
            with lm_ep.trace(ids):
                values_ep = lm_ep.save_all()
                logits_ep = lm_ep.output.logits.save()
        result["a2a_exchanges"] = sum(r.kind == "dispatch" for r in log.records)
        with lm_ref.trace(ids):
            values_ref = lm_ref.save_all()
        result["traced_logits"] = maxdiff(logits_ep, logits_of(ref(input_ids=ids)))
        names = sorted(values_ep[next(iter(values_ep))])
        result["served"] = names
        result["values"] = {
            name: max(maxdiff(values_ep[layer][name], values_ref[layer][name]) for layer in values_ref) for name in names
        }

        def per_slot() -> None:
            with lm_ep.trace(ids):
                lm_ep.moes[0].expert_outputs.save()

        result["per_slot_error"] = _error_text(per_slot)
        result["params_error"] = _error_text(lambda: lm_ep.moes[0].params(0).down.zero_())  # an edit would be lost
        plain_ref = traced_logits(lm_ref, ids)
        result["interventions"], result["effects"] = {}, {}
        far, near = busiest(values_ref, E, WORLD, 1), busiest(values_ref, E, WORLD, 0)
        for name, intervene in _interventions(far, near).items():
            if name.startswith("write_"):
                continue
            edited = traced_logits(lm_ref, ids, intervene)
            result["interventions"][name] = maxdiff(traced_logits(lm_ep, ids, intervene), edited)
            result["effects"][name] = maxdiff(edited, plain_ref)
        # one folder given by every rank: the ranks' shards would overwrite each other's (there was no exchange of
        # folders without shard_experts' group: one rank's cache came back holding another's routing)
        from moelens import analysis

        shared = Path(os.environ["MOELENS_TEST_OUT"], f"one-folder-{Path(path).name}-{implementation}")
        result["one_folder"] = _error_text(lambda: analysis.collect_routing(lm_ep, [[5, 6, 7]], folder=str(shared),
                                                                            progress=False))
        return result

    return {
        f"{Path(path).name}-{implementation}": functools.partial(run, path, implementation)
        for path in args["paths"]
        for implementation in args["implementations"]
    }


def suite_single(args: dict) -> dict[str, Callable[[], Any]]:
    """torch_a2a in one process (no group: every expert local) against grouped_mm, and
    shard_experts over a one-rank group."""
    from moelens.parallel import register_torch_a2a, shard_experts

    def run(family: str, sharded: bool) -> dict[str, Any]:
        register_torch_a2a()
        ref = tiny_model(family, experts_implementation="grouped_mm")
        model = copy.deepcopy(ref)
        if sharded:
            shard_experts(model)
        else:
            model.set_experts_implementation("torch_a2a")
        ids = tokens_of(0)
        lm, lm_ref = moelens.wrap(model), moelens.wrap(ref)
        with lm.trace(ids):
            values = lm.save_all()
        with lm_ref.trace(ids):
            expected = lm_ref.save_all()
        names = expected[next(iter(expected))]

        def params() -> float:  # a group of one rank holds every expert: all of them are served
            mine, theirs = lm.moes[0].params().items(), lm_ref.moes[0].params().items()
            assert [name for name, _ in mine] == [name for name, _ in theirs]
            return max(maxdiff(a, b) for (_, a), (_, b) in zip(mine, theirs))

        return {
            "params": _error_text(params) or params(),
            "logits": maxdiff(logits_of(model(input_ids=ids)), logits_of(ref(input_ids=ids))),
            "implementation": lm.moes[0].experts_implementation,
            "missing_values": sorted(set(names) - set(values[next(iter(values))])),
            "values": {name: max(maxdiff(values[l][name], expected[l][name]) for l in expected) for name in names},
        }

    return {
        f"{family}-{'sharded' if sharded else 'nogroup'}": functools.partial(run, family, sharded)
        for family in args["families"]
        for sharded in (False, True)
    }


def suite_all_families(args: dict) -> dict[str, Callable[[], Any]]:
    """Every tiny family: shard_experts over the world and compare the logits (no tracer), or the
    refusal for a family whose experts module has no pluggable implementations."""
    from moelens import MoelensError
    from moelens.families import registry
    from moelens.families.entry import get_path
    from moelens.discovery import discover
    from moelens.parallel import shard_experts
    from moelens.testing import FAMILIES, tiny_inputs

    def run(family: str) -> dict[str, Any]:
        try:
            ref = tiny_model(family, experts_implementation="grouped_mm")
        except ValueError:  # "does not support setting experts implementation" (dbrx, llama4)
            ref = tiny_model(family)
        blocks = [get_path(ref, name) for name in discover(ref).moe_blocks]
        pluggable = all(hasattr(get_path(b, registry.for_block(b).experts), "has_gate") for b in blocks)
        try:
            ep = shard_experts(copy.deepcopy(ref))
        except MoelensError as error:
            return {"pluggable": pluggable, "refused": str(error)}
        inputs = tiny_inputs(ref, batch=1, seq=4 + 2 * RANK, seed=RANK)
        with torch.no_grad():
            return {"pluggable": pluggable, "logits": maxdiff(logits_of(ep(**inputs)), logits_of(ref(**inputs)))}

    return {family: functools.partial(run, family) for family in args.get("families", FAMILIES)}


def suite_copies(args: dict) -> dict[str, Callable[[], Any]]:
    """What shard_experts leaves behind: a deep copy of a sharded model (plain and wrapped) that
    runs on the same group; a refused model left exactly as it was."""
    from moelens.parallel import shard_experts

    def deepcopy() -> dict[str, Any]:
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        ep = shard_experts(copy.deepcopy(ref), None)
        hf_copy = copy.deepcopy(ep)
        lm_ep = moelens.wrap(ep)
        lm_copy, lm_ref = copy.deepcopy(lm_ep), moelens.wrap(ref)
        ids = tokens_of(RANK)
        expected = logits_of(ref(input_ids=ids))
        result: dict[str, Any] = {
            "hf_copy_logits": maxdiff(logits_of(hf_copy(input_ids=ids)), expected),
            "wrapped_copy_logits": maxdiff(traced_logits(lm_copy, ids), expected),
            "original_logits": maxdiff(logits_of(ep(input_ids=ids)), expected),
        }
        pairs = [(m, c) for m, c in zip(ep.modules(), hf_copy.modules()) if "_ep_group" in m.__dict__]
        result["shares_group"] = bool(pairs) and all(c._ep_group is m._ep_group for m, c in pairs)
        result["own_weights"] = all(
            c.down_proj.data_ptr() != m.down_proj.data_ptr() and c._ep_first == m._ep_first for m, c in pairs
        )
        with lm_copy.trace(ids):
            values = lm_copy.save_all()
        with lm_ref.trace(ids):
            values_ref = lm_ref.save_all()
        result["values"] = max(maxdiff(values[l][n], values_ref[l][n]) for l in values_ref for n in values_ref[l])
        # Training the copy: its gradients are those of one process (the copy exchanges on the same group).
        loss_of(logits_of(hf_copy(input_ids=ids)), ids).backward()
        sum(loss_of(logits_of(ref(input_ids=tokens_of(r))), tokens_of(r)) for r in range(WORLD)).backward()
        result["grads"], result["grad_scale"] = compare_grads(hf_copy, ref, None)
        return result

    def refused() -> dict[str, Any]:
        # moelens.compress on attention only: q/o get 6 experts, the GQA k/v projections 3; 3 does
        # not split over 2 ranks, and k_proj comes after q_proj (which could be sharded).
        from moelens.compress import tomoe
        from test_compress_helpers import ids as make_ids, llama

        model = tomoe(llama(), num_experts=6, top_k=2, calibration=make_ids(8, 16, 1), max_error=10.0,
                      target_attention_only=True).eval()
        for param in model.parameters():
            dist.broadcast(param.data, 0)
        ids = make_ids(1, 6, 10 + RANK)
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        with torch.no_grad():
            logits = logits_of(model(input_ids=ids))
        error = _error_text(lambda: shard_experts(model))
        after = dict(model.named_parameters())
        with torch.no_grad():
            ran = _error_text(lambda: model(input_ids=ids)) or "ok"
            logits_after = logits_of(model(input_ids=ids)) if ran == "ok" else None
        return {
            "error": error,
            "runs": ran,
            "logits": maxdiff(logits_after, logits) if logits_after is not None else float("inf"),
            "params": max(maxdiff(after[name], value) for name, value in before.items()) if set(after) == set(before)
            else float("inf"),
            "marked": sorted(name for name, module in model.named_modules() if "_ep_group" in module.__dict__),
        }

    def lora_refused() -> dict[str, Any]:
        # moelens.compress with LoRA adapters on the experts: sharding them would leave the adapters whole.
        from moelens.compress import tomoe
        from test_compress_helpers import ids as make_ids, llama

        model = tomoe(llama(), num_experts=4, top_k=2, calibration=make_ids(8, 16, 1), max_error=10.0, lora_r=2).eval()
        for param in model.parameters():
            dist.broadcast(param.data, 0)
        ids = make_ids(1, 6, 10 + RANK)
        with torch.no_grad():
            logits = logits_of(model(input_ids=ids))
        error = _error_text(lambda: shard_experts(model))
        with torch.no_grad():
            ran = _error_text(lambda: model(input_ids=ids)) or "ok"
            logits_after = logits_of(model(input_ids=ids)) if ran == "ok" else None
        return {"error": error, "runs": ran,
                "logits": maxdiff(logits_after, logits) if logits_after is not None else float("inf")}

    def params() -> dict[str, Any]:
        # Moe.params on sharded experts: this rank's experts as views of its slice, the others refused.
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        sharded, whole = moelens.wrap(shard_experts(copy.deepcopy(ref), None)).moes[0], moelens.wrap(ref).moes[0]
        local = sharded.experts._module.__dict__["_ep_num_local"]
        mine = range(RANK * local, (RANK + 1) * local)
        result: dict[str, Any] = {"local": max(
            maxdiff(view, getattr(whole.params(expert), name)) for expert in mine
            for name, view in sharded.params(expert).items())}
        # every rank routes its own tokens with its own copy of the router: an edit of the owner's copy alone
        # routed the other ranks' tokens apart (the router is left out, with a warning)
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            served = sharded.params(mine[0])
        result["router"] = served.router is None and served.router_bias is None and any(
            "every rank holds a copy of the router" in str(warning.message) for warning in told)
        result["other"] = _error_text(lambda: sharded.params((mine[-1] + 1) % whole.num_experts))
        result["every"] = _error_text(lambda: sharded.params())
        with torch.no_grad():
            sharded.params(mine[-1]).down.zero_()
        result["edited"] = float(sharded.experts._module.down_proj[local - 1].abs().max())
        result["untouched"] = float(sharded.experts._module.down_proj[: local - 1].abs().min())
        return result

    def one_rank_refused() -> dict[str, Any]:
        # rank 1 alone brings a model shard_experts refuses: every rank raises (the others waited in the
        # exchange for rank 1, a gloo abort), whether rank 1's model is dense or carries LoRA adapters.
        from moelens.compress import tomoe
        from test_compress_helpers import ids as make_ids, llama

        errors = {}
        for odd in ("dense", "lora"):
            if odd == "dense":
                model = tiny_model("mixtral", experts_implementation="grouped_mm") if RANK == 0 else llama()
            else:  # the same converted model, with LoRA adapters on rank 1 only (the experts' layout agrees)
                model = tomoe(llama(), num_experts=4, top_k=2, calibration=make_ids(8, 16, 1), max_error=10.0,
                              lora_r=2 if RANK == 1 else 0, progress=False)
            errors[odd] = _error_text(lambda: shard_experts(model))
        return errors

    def export_refused() -> str:
        # an archive of a sharded model would miss the other ranks' experts; the refusal said "remove the hook"
        import tempfile

        from moelens.export import to_nnef

        sharded = moelens.wrap(shard_experts(tiny_model("mixtral", experts_implementation="grouped_mm"), None))
        with tempfile.TemporaryDirectory() as folder:
            return _error_text(lambda: to_nnef(sharded, Path(folder) / "sharded.nnef.tgz", verify=False))

    def scan_refused() -> str:
        # nnsight's scan runs fake tensors, whose routing is unknown: torch_a2a raised a raw symbolic-shape error
        from groundtruth import ascii_tokenizer

        sharded = moelens.wrap(shard_experts(tiny_model("mixtral", experts_implementation="grouped_mm"), None),
                               tokenizer=ascii_tokenizer())

        def scan() -> None:
            with sharded.scan("def f(x):"):
                sharded.moes[0].router_logits.save()

        return _error_text(scan)

    def corpus_refused_on_one_rank() -> dict[str, Any]:
        # rank 0's corpus holds an id past the vocabulary in its second batch, refused as that batch is built,
        # between traces: the other rank's trace of that batch paired with rank 0's next trace (and so on, the
        # ranks a trace apart until the group's timeout)
        from moelens import analysis

        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        sharded = moelens.wrap(shard_experts(copy.deepcopy(ref), None))
        vocab = ref.config.vocab_size
        corpus = [[5, 6, 7], [8, 9, 10], [11, vocab + 5 if RANK == 0 else 12]]
        result = {"collect": _error_text(lambda: analysis.collect_routing(sharded, corpus, batch_size=2,
                                                                           progress=False))}
        ids = tokens_of(RANK)
        result["after"] = [maxdiff(traced_logits(sharded, ids), logits_of(ref(input_ids=ids))) for _ in range(2)]
        return result

    def refused_then_collected_again(corpus: Callable[[int], Any]) -> dict[str, Any]:
        # collect_routing of ``corpus(vocab)``, refused on rank 0 only, then every rank collects again (the user's loop
        # over corpora going on after an error), against the unsharded model
        from moelens import analysis

        ref = tiny_model("mixtral", experts_implementation="grouped_mm")
        sharded = moelens.wrap(shard_experts(copy.deepcopy(ref), None))
        result = {"collect": _error_text(lambda: analysis.collect_routing(sharded, corpus(ref.config.vocab_size),
                                                                           batch_size=2, progress=False))}
        again = [tokens_of(RANK)[0].tolist(), [20, 21, 22, 23]]
        got = analysis.collect_routing(sharded, again, batch_size=2, progress=False, dtype=torch.float32)
        want = analysis.collect_routing(moelens.wrap(ref), again, batch_size=2, progress=False, dtype=torch.float32)
        result["indices"] = max(maxdiff(got.indices(layer), want.indices(layer)) for layer in want.layers)
        result["weights"] = max(maxdiff(got.weights(layer), want.weights(layer)) for layer in want.layers)
        return result

    def corpus_refused_then_collected_again() -> dict[str, Any]:
        # an id past the vocabulary in rank 0's second batch: rank 0's exchange of folders in the next call met rank
        # 1's trace of the refused batch, and both waited until the group's timeout
        return refused_then_collected_again(lambda vocab: [[5, 6, 7], [8, 9, 10], [11, vocab + 5 if RANK == 0 else 12]])

    def set_corpus_refused_on_one_rank() -> dict[str, Any]:
        # rank 0 gives its corpus as a set, refused before any exchange: rank 1's call paired with rank 0's next one
        corpus = [(5, 6, 7), (8, 9, 10)]
        return refused_then_collected_again(lambda vocab: set(corpus) if RANK == 0 else corpus)

    cases = {"deepcopy": deepcopy, "refused": refused, "lora_refused": lora_refused, "params": params,
             "one_rank_refused": one_rank_refused, "export_refused": export_refused, "scan_refused": scan_refused,
             "corpus_refused_on_one_rank": corpus_refused_on_one_rank,
             "corpus_refused_then_collected_again": corpus_refused_then_collected_again,
             "set_corpus_refused_on_one_rank": set_corpus_refused_on_one_rank}
    return {name: cases[name] for name in args.get("cases", cases)}


def suite_replace_one_rank(args: dict) -> dict[str, Callable[[], Any]]:
    """A value replaced on one rank only (rank 0 zeroes layer 1's routed_output), then backward on
    every rank: the ranks' graphs must still pair their backward exchanges."""
    from moelens.parallel import shard_experts

    def against_one_process(ref: Any, ep: Any, intervene: Callable[[Any, int, torch.Tensor], None]) -> dict[str, Any]:
        """Each rank's traced loss (``intervene(lm, rank, ids)`` in its trace) and backward on ``ep``, against one
        process running every rank's loss on ``ref``."""
        lm_ep, lm_ref = moelens.wrap(ep), moelens.wrap(ref)

        def traced_loss(lm: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids = tokens_of(rank)
            with lm.trace(ids):
                intervene(lm, rank, ids)
                logits = lm.output.logits.save()
            return logits, loss_of(logits, ids)

        logits, loss = traced_loss(lm_ep, RANK)
        loss.backward()
        expected, _ = traced_loss(lm_ref, RANK)
        ref.zero_grad(set_to_none=True)
        for rank in range(WORLD):
            traced_loss(lm_ref, rank)[1].backward()
        grads, scale = compare_grads(ep, ref, None)
        finite = all(torch.isfinite(p.grad).all() for p in ep.parameters() if p.grad is not None)
        return {"logits": maxdiff(logits, expected), "grads": grads, "grad_scale": scale, "finite": bool(finite)}

    def run() -> dict[str, Any]:
        ref = tiny_model("mixtral", experts_implementation="grouped_mm")

        def zero_on_rank0(lm: Any, rank: int, ids: torch.Tensor) -> None:
            if rank == 0:
                lm.moes[1].routed_output = torch.zeros(*ids.shape, ref.config.hidden_size)

        return against_one_process(ref, shard_experts(copy.deepcopy(ref), None), zero_on_rank0)

    def checkpointed() -> dict[str, Any]:
        """Activation checkpointing (non-reentrant) with a trace reading the up projections (edits there are refused:
        the recomputation would run without them): the recomputation, outside the trace, makes no round trip, and
        must save what the traced forward saved (it raised torch's CheckpointError once the owners stopped at the up
        projections)."""
        ref = tiny_model("mixtral", experts_implementation="grouped_mm").train()
        ep = shard_experts(copy.deepcopy(ref), None)
        ep.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return against_one_process(ref, ep, lambda lm, rank, ids: lm.moes[0].expert_pre_activations.save())

    return {"replace_routed_output_on_rank0": run, "checkpointed_per_slot_read": checkpointed}


def suite_generation(args: dict) -> dict[str, Callable[[], Any]]:
    """`analysis.collect_generation` on a sharded model, each rank its own prompts, against the same call on the
    unsharded model in one process (itself checked against hooks on transformers' generate in
    tests/test_generation_routing.py)."""
    from groundtruth import ascii_tokenizer
    from moelens import analysis
    from moelens.parallel import shard_experts

    def models() -> tuple[Any, Any]:
        ref = tiny_model("mixtral")
        sharded = moelens.wrap(shard_experts(copy.deepcopy(ref), None), tokenizer=ascii_tokenizer())
        return sharded, moelens.wrap(ref, tokenizer=ascii_tokenizer())

    def compared(sharded: Any, one: Any, prompts: list[list[int]], **settings: Any) -> dict[str, Any]:
        got = analysis.collect_generation(sharded, prompts, **settings)
        settings.pop("synced_gpus", None)
        want = analysis.collect_generation(one, prompts, **settings)
        return {"ids": torch.equal(got.ids, want.ids), "lengths": [got.lengths.tolist(), want.lengths.tolist()],
                "tokens": torch.equal(got.cache.token_ids(), want.cache.token_ids()),
                "indices": max(maxdiff(got.cache.indices(l), want.cache.indices(l)) for l in want.cache.layers),
                "weights": max(maxdiff(got.cache.weights(l), want.cache.weights(l)) for l in want.cache.layers)}

    def rows_end_apart() -> dict[str, Any]:
        # rank 0's row ends at its second token (chosen as eos), the others' rows run on: synced_gpus keeps rank 0
        # running unread forwards until every rank's rows have ended
        sharded, one = models()
        prompts = [tokens_of(RANK)[0].tolist()]
        first = analysis.collect_generation(one, [tokens_of(0)[0].tolist()], max_new_tokens=6, do_sample=False)
        eos = int(first.generated(0)[1])
        result = {"synced": compared(sharded, one, prompts, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                                     synced_gpus=True)}
        result["next"] = compared(sharded, one, prompts, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        return result

    def refused_on_one_rank() -> dict[str, Any]:
        # rank 1's prompt holds an id past the vocabulary: refused before its generate, which rank 0's must not
        # pair with its next call
        sharded, one = models()
        prompt = tokens_of(RANK)[0].tolist()
        bad = prompt + ([one._module.config.vocab_size + 5] if RANK == 1 else [])
        result = {"refused": _error_text(lambda: analysis.collect_generation(sharded, [bad], max_new_tokens=3,
                                                                             min_new_tokens=3, do_sample=False))}
        result["next"] = compared(sharded, one, [prompt], max_new_tokens=3, min_new_tokens=3, do_sample=False)
        return result

    def chunked_prefill_refused() -> dict[str, Any]:
        # one forward per chunk of each rank's own prompts: ranks of different prompt lengths would part at once
        sharded, one = models()
        return {"refused": _error_text(lambda: analysis.collect_generation(
            sharded, [tokens_of(RANK)[0].tolist()], max_new_tokens=3, prefill_chunk_size=2, synced_gpus=True))}

    return {"rows_end_apart": rows_end_apart, "refused_on_one_rank": refused_on_one_rank,
            "chunked_prefill_refused": chunked_prefill_refused}


SUITES = {
    "copies": suite_copies,
    "replace_one_rank": suite_replace_one_rank,
    "all_families": suite_all_families,
    "single": suite_single,
    "families": suite_families,
    "a2a": suite_a2a,
    "hazards": suite_hazards,
    "transformers_ep": suite_transformers_ep,
    "generation": suite_generation,
}


def main() -> None:
    """Run the suites named on the command line (``MOELENS_TEST_ARGS``: suite -> its arguments)."""
    arguments = json.loads(os.environ.get("MOELENS_TEST_ARGS", "{}"))
    out = Path(os.environ["MOELENS_TEST_OUT"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['MOELENS_TEST_STORE']}",
        rank=RANK,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT),
    )
    results: dict[str, dict[str, Any]] = {}
    for suite in sys.argv[1:]:
        results[suite] = {}
        for name, case in SUITES[suite](arguments.get(suite, {})).items():
            try:
                results[suite][name] = case()
            except Exception:  # noqa: BLE001 - recorded for the test to report
                results[suite][name] = {"error": traceback.format_exc()}
            (out / f"rank{RANK}.json").write_text(json.dumps(results, indent=1))
    # Free the suites' models (envoys hold reference cycles) while the group is alive: a sharded copy's
    # experts hold the group, and one left for the interpreter's exit sometimes aborted the process there
    # ("terminate called without an active exception") after its results were written.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
