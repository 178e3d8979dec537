"""What moelens' expert parallelism (``torch_a2a``) moves between ranks, and what it costs on CPU.

Run: ``python bench/ep_comm.py`` (2 and 4 ranks on gloo, one torch thread per rank;
``--help`` for sizes; ``--family`` for another family's tiny model than mixtral's). It checks
the model first (what would fail on the ranks is refused, naming the option), then starts the
ranks itself (subprocesses with torchrun-style ``RANK`` / ``WORLD_SIZE`` and a file rendezvous)
and prints, per world size:

* **bytes each rank sends per MoE layer**, counted inside the implementation
  (`moelens.parallel.traffic`: every exchange records what it hands to
  ``all_to_all_single``): dispatch (token rows to the experts' owners), combine
  (expert outputs back), the count exchange, and, in a trace that reads per-slot
  values, the activation round trip;
* against **the minimum** ``T*k*D*bytes*(EP-1)/EP`` per direction (what one row per
  (token, slot) pair moves when routing is uniform), against the rows this
  routing actually sends to other ranks, and against the deduplicated minimum
  (a token sent once per remote rank however many of its k experts live there);
* against **transformers' own EP for the same batch**: ``AllReduceEP`` (every rank
  of the EP group holds the whole batch of ``EP*T`` tokens, runs its experts on
  all of it and all-reduces ``[EP*T, D]``; bytes counted by wrapping
  ``torch.distributed.all_reduce``, the ring algorithm sends ``2*(EP-1)/EP`` times
  the payload) and ``AllToAllEP`` (counted the same way; it should equal ours);
* **wall time** of a forward: ``EP`` ranks with ``T`` tokens each vs one process
  with all ``EP*T`` tokens (one thread each), for reference only (CPU, gloo on
  localhost: the collectives' latency dominates at these sizes).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from arguments import at_least, output_file

torch.set_num_threads(1)


# -- one rank ----------------------------------------------------------------------------


class SizeError(ValueError):
    """The family's tiny model cannot be built, or sharded, at the sizes the options ask for (names the option)."""


def _sizes(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """``(option, tiny_config overrides)`` for each size option, under the names the family's tiny config gives them.

    As `moelens.testing.tiny_config` builds the family: ``hidden_size`` and ``num_hidden_layers`` are
    `COMMON_SIZES` keys; the experts' intermediate size is the key the tiny config holds the experts' size in
    (``COMMON_SIZES["moe_intermediate_size"]``: ``moe_intermediate_size`` where the config has it, else the
    family's ``intermediate_size``, a per-modality list of them too); the expert count is the first of
    moelens' `NUM_EXPERTS_FIELDS` that the family's `TINY_OVERRIDES` entry sets, in one of `SUB_CONFIGS` (dbrx's
    ``ffn_config``) where it is there. ``--layers`` left out keeps the family's tiny layout.
    """
    from moelens.parallel.degrees import NUM_EXPERTS_FIELDS, SUB_CONFIGS
    from moelens.testing import COMMON_SIZES, TINY_OVERRIDES, tiny_config

    family = args.family
    sizes: list[tuple[str, dict[str, Any]]] = [("--hidden", {"hidden_size": args.hidden})]
    tiny_size = COMMON_SIZES["moe_intermediate_size"]
    default = tiny_config(family)
    intermediate = {}
    for key in ("moe_intermediate_size", "intermediate_size"):
        value = getattr(default, key, None)
        if value == tiny_size:
            intermediate[key] = args.intermediate
        elif isinstance(value, (list, tuple)) and value and all(item == tiny_size for item in value):
            intermediate[key] = [args.intermediate] * len(value)  # one per modality (ernie4_5_vl_moe)
    if not intermediate:
        raise SizeError(f"--intermediate: moelens.testing's tiny {family} holds its experts' intermediate size in no "
                        "moe_intermediate_size or intermediate_size field, so it cannot be set here.")
    sizes.append(("--intermediate", intermediate))
    entry = TINY_OVERRIDES[family]
    experts = next(({key: args.experts} for key in NUM_EXPERTS_FIELDS if key in entry), None)
    for sub in SUB_CONFIGS:
        if experts is None and isinstance(entry.get(sub), dict):
            experts = next(({sub: {**entry[sub], key: args.experts}}
                            for key in NUM_EXPERTS_FIELDS if key in entry[sub]), None)
    if experts is None:
        raise SizeError(f"--experts: moelens.testing's tiny {family} sets its expert count in none of "
                        f"{', '.join(NUM_EXPERTS_FIELDS)}, so it cannot be set here.")
    sizes.append(("--experts", experts))
    if args.layers is not None:
        sizes.append(("--layers", {"num_hidden_layers": args.layers}))
    return sizes


def _reason(error: BaseException) -> str:
    """An error's last line (a config validator's own ValueError comes after its wrapper's line), cut to 300
    characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _build(args: argparse.Namespace, **overrides: Any) -> torch.nn.Module:
    from moelens.testing import NOT_DECORATED, tiny_model

    implementation = None if args.family in NOT_DECORATED else "grouped_mm"  # those take no implementation
    return tiny_model(args.family, experts_implementation=implementation, **overrides)


def _forward(model: torch.nn.Module, tokens: int) -> None:
    """What a rank runs first: a forward of ``tokens`` tokens."""
    ids = _inputs(0, tokens, model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids)


def _culprits(args: argparse.Namespace, sizes: list[tuple[str, dict[str, Any]]], forward: bool) -> str:
    """The options among ``sizes`` whose overrides alone fail to build the model (or, with ``forward``, to run its
    forward), as ``--hidden 256``; all of them where none fails alone."""
    failing = []
    for option, overrides in sizes:
        try:
            model = _build(args, **overrides)
            if forward:
                _forward(model, args.tokens)
        except Exception:  # noqa: BLE001 - whatever the build or the forward raises
            failing.append(option)
    return " / ".join(f"{option} {getattr(args, option[2:])}" for option in failing or [option for option, _ in sizes])


def _model(args: argparse.Namespace) -> torch.nn.Module:
    """The family's tiny model (`moelens.testing.tiny_model`) at the options' sizes, on ``grouped_mm`` where its
    experts take an implementation. Raises `SizeError` naming the option its tiny config refuses."""
    from moelens.testing import tiny_config

    sizes = _sizes(args)
    given: dict[str, Any] = {}
    for option, overrides in sizes:  # one option at a time, so a refusal names the option that caused it
        given.update(overrides)
        try:
            tiny_config(args.family, **given)
        except Exception as error:  # noqa: BLE001 - transformers' configs refuse sizes with several error types
            fields = ", ".join(f"{key}={value!r}" for key, value in overrides.items())
            layout = (" (leave --layers out for the family's tiny layout)" if option == "--layers" else "")
            raise SizeError(f"{option}: the tiny {args.family} config does not take {fields}{layout}: "
                            f"{_reason(error)}") from None
    try:
        return _build(args, **given)
    except Exception as error:  # noqa: BLE001
        raise SizeError(f"{_culprits(args, sizes, forward=False)}: the tiny {args.family} model cannot be built at "
                        f"these sizes: {_reason(error)}") from None


def _expert_counts(model: torch.nn.Module, world: int) -> list[int]:
    """Every MoE block's number of experts (with weights), once moelens' `shard_experts` would shard them over
    ``world`` ranks (its own check, which raises `MoelensError` saying why not)."""
    from moelens.parallel.shard import _expert_counts, _experts_of

    return _expert_counts(_experts_of(model), world)


def _moe_layers(blocks: list[str]) -> tuple[int, int]:
    """``(decoder layers holding MoE blocks, MoE blocks)`` for the MoE blocks ``blocks`` (a layer may hold several:
    ernie4_5_vl_moe's text and vision experts)."""
    from moelens.discovery import layer_path

    return len({layer_path(block) or block for block in blocks}), len(blocks)


def _moe_words(layers: int, blocks: int, exchanging: int | None = None) -> str:
    """``"3 MoE layers"``, with the blocks where a layer holds several, and those that exchanged tokens where fewer."""
    extras = [f"{blocks} MoE blocks"] * (blocks != layers)
    extras += [f"{exchanging} of them exchanging tokens"] * (exchanging not in (None, blocks))
    return f"{layers} MoE layer{'s' * (layers != 1)}" + (f" ({', '.join(extras)})" if extras else "")


def check(args: argparse.Namespace) -> str:
    """Build the model as every rank will, and refuse (`SizeError`, naming the option) what would fail on the
    ranks or measure another size than asked. Returns a line describing the model."""
    import moelens
    from moelens import MoelensError
    from moelens.discovery import discover
    from moelens.testing import FAMILIES, UNBUILDABLE, tiny_model

    if args.family not in FAMILIES:
        known = ", ".join(FAMILIES)
        why = f": {UNBUILDABLE[args.family]}" if args.family in UNBUILDABLE else ""
        near = difflib.get_close_matches(args.family, FAMILIES, n=1)
        raise SizeError(f"--family: {args.family!r} is no family moelens.testing builds tiny{why}"
                        + (f" (did you mean {near[0]!r}?)" if near else "") + f"; known: {known}.")
    try:  # first at the family's own tiny sizes: whether moelens can shard its experts at all
        _expert_counts(tiny_model(args.family), 1)
    except MoelensError as error:
        raise SizeError(f"--family {args.family}: moelens cannot shard its experts: {error}") from None
    model = _model(args)
    structure = discover(model)
    if not structure.moe_blocks:
        raise SizeError(f"--layers {args.layers}: the tiny {args.family} model has no MoE layer at {args.layers} "
                        "decoder layers (its first layers are dense); give more.")
    try:
        counts = _expert_counts(model, 1)
    except MoelensError as error:
        raise SizeError(f"--family {args.family}: moelens cannot shard its experts at these sizes: {error}") from None
    for world in args.worlds:
        try:
            _expert_counts(model, world)
        except MoelensError as error:
            raise SizeError(f"--experts {args.experts} / --worlds {world}: {error}") from None
    if set(counts) != {args.experts}:
        raise SizeError(f"--experts {args.experts}: the tiny {args.family} model's MoE blocks hold "
                        f"{sorted(set(counts))} experts.")
    if getattr(model.config, "hidden_size", None) != args.hidden:
        raise SizeError(f"--hidden {args.hidden}: the tiny {args.family} model's hidden size is "
                        f"{getattr(model.config, 'hidden_size', None)}.")
    decoder = len(model.get_submodule(structure.layers)) if structure.layers else None
    if args.layers is not None and decoder != args.layers:
        raise SizeError(f"--layers {args.layers}: the tiny {args.family} model has {decoder} decoder layers.")
    try:  # what a rank runs first (torch's grouped_mm wants rows of a multiple of 16 bytes: D and I multiples of 4)
        _forward(model, args.tokens)
    except Exception as error:  # noqa: BLE001
        raise SizeError(f"{_culprits(args, _sizes(args), forward=True)}: a forward of the tiny {args.family} model "
                        f"fails at these sizes: {_reason(error)}") from None
    moes = moelens.wrap(model).moes
    widths = {tuple(moe.params().down.shape[1:]) for moe in moes}  # [E, D, I]
    if {width[1] for width in widths} != {args.intermediate}:
        raise SizeError(f"--intermediate {args.intermediate}: the tiny {args.family} model's experts have intermediate "
                        f"size {sorted({width[1] for width in widths})}.")
    return (f"tiny {args.family}: {decoder} decoder layer{'s' * (decoder != 1)}, "
            f"{_moe_words(*_moe_layers(structure.moe_blocks))}, E={args.experts}, k={moes[0].top_k}, "
            f"experts D={sorted({width[0] for width in widths})} I={args.intermediate}, hidden {args.hidden}")


def _inputs(rank: int, tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(10 + rank))


class _Counter:
    """Wrap a collective, adding up the bytes it sends to other ranks.

    ``all_reduce(tensor, ...)``: the payload (the tensor). ``all_to_all_single_autograd(input,
    output_split_sizes, input_split_sizes, group)``: the rows of ``input`` not addressed to this rank.
    """

    def __init__(self, owner: Any, name: str, rank: int) -> None:
        self.owner, self.name, self.rank = owner, name, rank
        self.original = getattr(owner, name)
        self.payload: list[int] = []

    def __enter__(self) -> "_Counter":
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0]
            sent = tensor.numel() * tensor.element_size()
            if len(args) > 2 and isinstance(args[2], (list, tuple)) and tensor.dim() > 1:
                row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
                sent = (sum(args[2]) - args[2][self.rank]) * row
            self.payload.append(sent)
            return self.original(*args, **kwargs)

        setattr(self.owner, self.name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(self.owner, self.name, self.original)


def _hf_bytes(model: torch.nn.Module, path: str, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
              mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor], world: int) -> dict[str, float]:
    """Bytes transformers' AllReduceEP / AllToAllEP move for one MoE layer of the same batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import expert_parallel as hf_ep

    from moelens.families import registry

    block = model.get_submodule(path)  # the first MoE block (layer 0 may be dense)
    experts = copy.deepcopy(block.get_submodule(registry.for_block(block).experts))
    E, rank = experts.num_experts, dist.get_rank()
    L = E // world
    for name, param in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, torch.nn.Parameter(param.data[rank * L : (rank + 1) * L].clone()))
    experts.num_experts, experts._is_expert_parallel = L, True
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    with torch.no_grad():
        # AllReduceEP: the EP group shares the whole batch (every rank's tokens).
        with _Counter(dist, "all_reduce", rank) as counter:
            hf_ep.AllReduceEP(experts, mesh, mesh)(hidden, idx, w)
        result["all_reduce_payload"] = sum(counter.payload)
        result["all_reduce_ring"] = sum(counter.payload) * 2 * (world - 1) / world
        # AllToAllEP: each rank its own tokens (a tp mesh of one rank per group).
        single = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
        with _Counter(hf_ep, "all_to_all_single_autograd", rank) as counter:
            hf_ep.AllToAllEP(experts, single["ep"], single["tp"])(*mine)
        result["hf_all_to_all_sent"] = counter.payload  # [dispatch, combine]
    return result


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import moelens
    from moelens.parallel import shard_experts, traffic
    from moelens.discovery import discover
    from moelens.parallel.runs import layer_tag

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    ref = _model(args).eval()
    lm_ref = moelens.wrap(ref)
    vocab, E = ref.config.vocab_size, _expert_counts(ref, world)[0]
    # The MoE blocks these text tokens run (not ernie4_5_vl_moe's vision experts, Family.runs_only_on), and the first.
    running = [index for index, moe in enumerate(lm_ref.moes)
               if moe.path.rsplit(".", 1)[-1] not in moe.family.runs_only_on]
    first = lm_ref.moes[running[0]]
    k, D = first.top_k, first.params().down.shape[1]  # the width of the rows sent: the experts'
    ep = shard_experts(copy.deepcopy(ref)).eval()
    ids = _inputs(rank, args.tokens, vocab)
    out: dict[str, Any] = {"rank": rank, "world": world, "T": args.tokens, "k": k, "D": D, "E": E,
                           "bytes_per_value": 4}
    blocks = discover(ref).moe_blocks  # lm_ref.moes' modules, in the same order
    out["moe_layers"], out["moe_blocks"] = _moe_layers(blocks)

    # Bytes, counted in the implementation: a plain forward, then a trace reading per-slot values.
    with torch.no_grad(), traffic() as log:
        ep(input_ids=ids)
    layers = max(1, len({r.tag for r in log.records}))  # the MoE layers that exchanged (ran on these tokens)
    out["exchanging_layers"] = layers
    for kind in ("counts", "dispatch", "combine"):
        out[f"{kind}_sent"] = log.sent(kind) / layers
        out[f"{kind}_sent_layer0"] = sum(r.sent_bytes for r in log.records
                                         if r.kind == kind and r.tag == layer_tag(0, running[0]))
    out["remote_rows"] = sum(r.rows for r in log.records if r.kind == "dispatch") / layers
    lm = moelens.wrap(ep)
    with traffic() as log:
        with torch.no_grad(), lm.trace(ids):
            for index in running:
                lm.moes[index].expert_outputs.save()
    for kind in ("pre_activations_back", "activations_out"):
        out[f"{kind}_sent"] = log.sent(kind) / layers

    # The routing of the first MoE block, for the deduplicated minimum and transformers' EP on the same batch.
    per_rank_inputs = [_inputs(r, args.tokens, vocab) for r in range(world)]
    routed = []
    for r_ids in per_rank_inputs:
        with torch.no_grad(), lm_ref.trace(r_ids):
            call = first.experts.inputs.save()
        routed.append(tuple(call[0][:3]))
    owners = routed[rank][1] // (E // world)
    remote = [(owners == dest).any(dim=1) for dest in range(world) if dest != rank]
    out["dedup_remote_rows_layer0"] = int(sum(mask.sum() for mask in remote))
    out["remote_rows_layer0"] = int((owners != rank).sum())
    whole = [torch.cat(parts) for parts in zip(*routed)]
    out.update(_hf_bytes(ref, blocks[running[0]], *whole, routed[rank], world))

    # Wall time: EP ranks with T tokens each vs one process with all EP*T tokens.
    def timed(fn: Any, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.no_grad():
        ep(input_ids=ids)
        out["ep_forward_s"] = timed(lambda: ep(input_ids=ids), args.repeats)
        if rank == 0:
            everything = torch.cat(per_rank_inputs, dim=0)
            ref(input_ids=everything)
            start_times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                ref(input_ids=everything)
                start_times.append(time.perf_counter() - start)
            out["single_forward_s"] = statistics.median(start_times)
    dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# -- the launcher -------------------------------------------------------------------------


def launch(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ep-comm-") as folder:
        argv = [sys.executable, __file__, "--rank-mode", "--store", f"{folder}/store", "--out", folder,
                *sum(([f"--{n}", str(getattr(args, n))] for n in ("family", "hidden", "intermediate", "experts",
                                                              "layers", "tokens", "repeats")
                      if getattr(args, n) is not None), [])]
        procs = [
            subprocess.Popen(argv, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                            OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
            for r in range(world)
        ]
        for proc in procs:
            proc.wait(timeout=1200)
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"a rank failed: {[proc.returncode for proc in procs]}")
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def report(results: list[dict[str, Any]]) -> list[str]:
    first = results[0]
    world, T, k, D, b = first["world"], first["T"], first["k"], first["D"], first["bytes_per_value"]
    minimum = T * k * D * b * (world - 1) / world
    kb = 1024
    lines = [
        f"\n## EP={world} x EDP=1, T={T} tokens/rank, k={k}, D={D}, E={first['E']}, fp32, "
        f"{_moe_words(first['moe_layers'], first['moe_blocks'], first['exchanging_layers'])} "
        "(bytes per rank per MoE layer, KiB)",
        "| rank | dispatch | combine | counts | min T*k*D*b*(EP-1)/EP | dispatch/min | rows to others "
        "(dedup, first MoE block) | first MoE block both ways: torch_a2a vs HF AllToAllEP | HF AllReduceEP payload / ring | a2a (both ways) vs ring | "
        "+ activation round trip (trace) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        both = r["dispatch_sent"] + r["combine_sent"]
        hf = r["hf_all_to_all_sent"]
        lines.append(
            f"| {r['rank']} | {r['dispatch_sent'] / kb:.1f} | {r['combine_sent'] / kb:.1f} | {r['counts_sent']} B | "
            f"{minimum / kb:.1f} | {r['dispatch_sent'] / minimum:.2f} | {r['remote_rows_layer0']} "
            f"({r['dedup_remote_rows_layer0']}) | "
            f"{(r['dispatch_sent_layer0'] + r['combine_sent_layer0']) / kb:.1f} vs {(hf[0] + hf[1]) / kb:.1f} | "
            f"{r['all_reduce_payload'] / kb:.1f} / {r['all_reduce_ring'] / kb:.1f} | "
            f"{both / r['all_reduce_ring']:.2f} | "
            f"{(r['pre_activations_back_sent'] + r['activations_out_sent']) / kb:.1f} |"
        )
    single = first.get("single_forward_s")
    ep_time = max(r["ep_forward_s"] for r in results)
    lines.append(
        f"\nwall time of a forward (median, 1 thread/process, CPU, gloo): one process with all {world * T} tokens "
        f"{single * 1e3:.1f} ms; {world} ranks x {T} tokens (torch_a2a) {ep_time * 1e3:.1f} ms "
        f"(ratio {ep_time / single:.2f})"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=at_least(2), nargs="+", default=[2, 4],
                        help="EP group sizes to measure (each at least 2: one rank exchanges nothing)")
    parser.add_argument("--family", default="mixtral",
                        help="the MoE family whose tiny model (moelens.testing.tiny_model) is measured, by its "
                             "transformers model_type: one of moelens.testing.FAMILIES (mixtral, qwen2_moe, qwen3_moe, "
                             "deepseek_v3, gpt_oss, ...) whose experts moelens' shard_experts can shard: those "
                             "transformers decorates with use_experts_implementation (moelens.testing.NOT_DECORATED "
                             "lists the others: dbrx, llama4, and before transformers 5.25 longcat_flash and step3p7, "
                             "refused). Built at the sizes below (default mixtral); a family whose tiny model cannot "
                             "take a size is refused before any rank starts, naming the option")
    parser.add_argument("--hidden", type=at_least(1), default=256,
                        help="hidden size D (default 256; grouped_mm wants a multiple of 4 in fp32)")
    parser.add_argument("--intermediate", type=at_least(1), default=512,
                        help="the experts' intermediate size I (moe_intermediate_size where the family has one; "
                             "default 512)")
    parser.add_argument("--experts", type=at_least(1), default=8,
                        help="routed experts E per MoE layer, a multiple of every --worlds (default 8)")
    parser.add_argument("--layers", type=at_least(1),
                        help="decoder layers (num_hidden_layers; default: the family's tiny layout, 4 layers, of which "
                             "the first is dense in most families); the header counts the MoE layers")
    parser.add_argument("--tokens", type=at_least(1), default=256, help="tokens per rank (default 256)")
    parser.add_argument("--repeats", type=at_least(1), default=10,
                        help="timed forwards for the wall-time medians (default 10)")
    parser.add_argument("--json", type=output_file, help="also write the raw per-rank numbers here")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args)
        return
    try:  # what would fail on every rank, or measure other sizes than asked, is refused here
        print(check(args), flush=True)
    except SizeError as error:
        parser.error(str(error))
    everything = {}
    for world in args.worlds:
        results = launch(world, args)
        everything[world] = results
        print("\n".join(report(results)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
