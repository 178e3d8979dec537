"""What moelens' expert parallelism (``torch_a2a``) moves between ranks, and what it costs on CPU.

Run: ``python bench/ep_comm.py`` (2 and 4 ranks on gloo, one torch thread per rank;
``--help`` for sizes). It starts the ranks itself (subprocesses with torchrun-style
``RANK`` / ``WORLD_SIZE`` and a file rendezvous) and prints, per world size:

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


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from moelens.testing import tiny_model

    return tiny_model(
        args.family,
        experts_implementation="grouped_mm",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_local_experts=args.experts,
        num_hidden_layers=args.layers,
    )


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


def _hf_bytes(model: torch.nn.Module, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
              mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor], world: int) -> dict[str, float]:
    """Bytes transformers' AllReduceEP / AllToAllEP move for one MoE layer of the same batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import expert_parallel as hf_ep

    from moelens.families import registry
    from moelens.discovery import discover

    block = model.get_submodule(discover(model).moe_blocks[0])  # the first MoE block (layer 0 may be dense)
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

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    ref = _model(args).eval()
    vocab, E = ref.config.vocab_size, ref.config.num_local_experts
    k, D = ref.config.num_experts_per_tok, ref.config.hidden_size
    ep = shard_experts(copy.deepcopy(ref)).eval()
    ids = _inputs(rank, args.tokens, vocab)
    out: dict[str, Any] = {"rank": rank, "world": world, "T": args.tokens, "k": k, "D": D, "E": E,
                           "bytes_per_value": 4, "layers": args.layers}

    # Bytes, counted in the implementation: a plain forward, then a trace reading per-slot values.
    with torch.no_grad(), traffic() as log:
        ep(input_ids=ids)
    layers = max(1, len({r.tag for r in log.records}))
    for kind in ("counts", "dispatch", "combine"):
        out[f"{kind}_sent"] = log.sent(kind) / layers
        out[f"{kind}_sent_layer0"] = sum(r.sent_bytes for r in log.records if r.kind == kind and r.tag == 1)
    out["remote_rows"] = sum(r.rows for r in log.records if r.kind == "dispatch") / layers
    lm = moelens.wrap(ep)
    with traffic() as log:
        with torch.no_grad(), lm.trace(ids):
            for moe in lm.moes:
                moe.expert_outputs.save()
    for kind in ("activations_back", "activations_out"):
        out[f"{kind}_sent"] = log.sent(kind) / layers

    # The routing of layer 0, for the deduplicated minimum and transformers' EP on the same batch.
    lm_ref = moelens.wrap(ref)
    per_rank_inputs = [_inputs(r, args.tokens, vocab) for r in range(world)]
    routed = []
    for r_ids in per_rank_inputs:
        with torch.no_grad(), lm_ref.trace(r_ids):
            call = lm_ref.moes[0].experts.inputs.save()
        routed.append(tuple(call[0][:3]))
    owners = routed[rank][1] // (E // world)
    remote = [(owners == dest).any(dim=1) for dest in range(world) if dest != rank]
    out["dedup_remote_rows_layer0"] = int(sum(mask.sum() for mask in remote))
    out["remote_rows_layer0"] = int((owners != rank).sum())
    whole = [torch.cat(parts) for parts in zip(*routed)]
    out.update(_hf_bytes(ref, *whole, routed[rank], world))

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
                                                              "layers", "tokens", "repeats")), [])]
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
        f"{first['layers']} MoE layers (bytes per rank per MoE layer, KiB)",
        "| rank | dispatch | combine | counts | min T*k*D*b*(EP-1)/EP | dispatch/min | rows to others "
        "(dedup, layer 0) | layer 0 both ways: torch_a2a vs HF AllToAllEP | HF AllReduceEP payload / ring | a2a (both ways) vs ring | "
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
            f"{(r['activations_back_sent'] + r['activations_out_sent']) / kb:.1f} |"
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
    parser.add_argument("--family", default="mixtral")
    parser.add_argument("--hidden", type=at_least(1), default=256)
    parser.add_argument("--intermediate", type=at_least(1), default=512)
    parser.add_argument("--experts", type=at_least(1), default=8)
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--tokens", type=at_least(1), default=256, help="tokens per rank")
    parser.add_argument("--repeats", type=at_least(1), default=10)
    parser.add_argument("--json", type=output_file, help="also write the raw per-rank numbers here")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args)
        return
    everything = {}
    for world in args.worlds:
        results = launch(world, args)
        everything[world] = results
        print("\n".join(report(results)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
