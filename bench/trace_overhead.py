"""Trace overhead: reading every Moe value on every MoE layer vs the plain forward.

A Mixtral-shaped model (hidden 256, 8 layers, 8 experts, top-2, grouped_mm, float32,
random weights) is run in the same process, interleaved, for each configuration:

* ``plain``: the model's own forward (no nnsight), under ``torch.no_grad``;
* ``nnsight-module``: a plain nnsight trace reading each block's router and experts
  module outputs (the anchor for nnsight's own cost);
* ``nnsight-source``: a plain nnsight trace reading the same values moelens reads, by
  raw op names (router logits op, experts call arguments, the sort permutation, the
  activations and the per-slot outputs inside the implementation, experts output,
  block output): what a user writes without moelens, minus the un-sorting of the
  activations into token-slot order and the token views;
* ``nnsight-floor``: ``nnsight-source`` plus, by hand, the work the served values need
  (``router_probs``' softmax, the un-sorting of the activations, the ``[b, s, ...]`` views):
  what moelens cannot do without, so ``moelens`` minus it is moelens' own cost;
* ``moelens``: ``moe.save_all(MEASURED_VALUES)`` on every MoE block (every value but the later
  ``expert_pre_activations``, token views, checks);
* ``moelens-routing``: the same without the per-slot values, which need nnsight to
  instrument the experts implementation's own source (where most of the cost sits).

Prints the median wall time and the median CPU time of the process (what it costs even when
the shared machine deschedules it) of each (repeats interleaved in a shuffled order) and their
ratios to ``plain`` at batch 4 x 256 tokens and 1 x 8 tokens. Targets: moelens at most 1.05x plain at 4 x 256 and 1.5x
at 1 x 8. Run: ``python bench/trace_overhead.py [--repeats 30] [--threads 2] [--steady-malloc] [--device cuda]``
(``--steady-malloc``: freed memory is reused instead of returned to the system, see `steady_malloc`;
``--device``: run the model there; on an accelerator each run ends with a synchronize, and the wall
time is the measure, since the CPU time then counts the host waiting for the device).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import nnsight
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

import moelens
from arguments import at_least
from moelens.permutations import inverse_permutation


#: Every value but the two read inside the experts implementation (per-slot activations and outputs).
ROUTING_VALUES = ("router_logits", "router_probs", "expert_weights", "expert_indices", "routed_output", "mlp_output")

#: The values the issue's target is measured on (every value a Mixtral block served then), so that runs compare
#: across stops; ``expert_pre_activations``, served since, is left out (the raw anchor reads no such op either).
MEASURED_VALUES = ROUTING_VALUES[:4] + ("expert_activations", "expert_outputs") + ROUTING_VALUES[4:]


def build(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    return AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm").eval()


def measure(batch: int, seq: int, repeats: int, device: torch.device) -> dict[str, float]:
    hf = build().to(device)
    untouched = copy.deepcopy(hf)  # the plain baseline never sees nnsight
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    finish = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wrapped = moelens.wrap(hf)  # instruments the MoE blocks' sources, as a user of moelens gets
    raw = nnsight.NNsight(hf)  # a second, plain nnsight wrap of the same modules
    blocks = [f"model.layers.{i}.mlp" for i in range(8)]

    def plain() -> None:
        with torch.no_grad():
            untouched(ids)

    def nnsight_module() -> None:
        with torch.no_grad(), raw.trace(ids):
            for name in blocks:
                block = raw.get(name)
                block.gate.output[0].save()
                block.experts.output.save()

    def nnsight_source() -> None:
        with torch.no_grad(), raw.trace(ids):
            for name in blocks:
                block = raw.get(name)
                block.gate.source.F_linear_0.output.save()
                (_, index, weights), _ = block.experts.inputs
                index.save(), weights.save()
                inner = block.experts.source.experts_forward_1.source
                inner.torch_sort_0.output[1].save()  # the expert-sorted row order
                inner.self__apply_gate_0.output.save()  # activations, in that order
                inner.weighted_out_view_0.output.save()
                block.experts.output.save()
                block.output.save()

    def nnsight_floor() -> None:  # nnsight_source plus the work the served values need, by hand
        with torch.no_grad(), raw.trace(ids):
            for name in blocks:
                block = raw.get(name)
                logits = block.gate.source.F_linear_0.output
                logits.view(batch, seq, -1).save()
                logits.float().softmax(-1).view(batch, seq, -1).save()  # router_probs
                (_, index, weights), _ = block.experts.inputs
                index.view(batch, seq, -1).save(), weights.view(batch, seq, -1).save()
                inner = block.experts.source.experts_forward_1.source
                order = inner.torch_sort_0.output[1]
                activations = inner.self__apply_gate_0.output  # un-sorted into token-slot order
                activations.index_select(0, inverse_permutation(order)).view(batch, seq, index.shape[-1], -1).save()
                inner.weighted_out_view_0.output.view(batch, seq, index.shape[-1], -1).save()
                block.experts.output.view(batch, seq, -1).save()
                block.output.view(batch, seq, -1).save()

    def with_moelens() -> None:
        with torch.no_grad(), wrapped.trace(ids):
            for moe in wrapped.moes:
                moe.save_all(MEASURED_VALUES)

    def moelens_routing() -> None:
        with torch.no_grad(), wrapped.trace(ids):
            for moe in wrapped.moes:
                moe.save_all(ROUTING_VALUES)

    runs = {
        "plain": plain,
        "nnsight-module": nnsight_module,
        "nnsight-source": nnsight_source,
        "nnsight-floor": nnsight_floor,
        "moelens": with_moelens,
        "moelens-routing": moelens_routing,
    }
    for run in runs.values():  # warm up every path (source instrumentation, caches)
        for _ in range(3):
            run()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    order = random.Random(0)
    for _ in range(repeats):  # interleave, in a fresh order each time, so drift hits every configuration alike
        for name, run in order.sample(list(runs.items()), len(runs)):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            finish()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in runs}


def steady_malloc() -> None:
    """Fix glibc's mmap threshold at 256 MB and never trim the heap (``mallopt``).

    By default glibc serves each large tensor from fresh pages (``mmap``, or a heap it trims back),
    so a forward pays page faults that depend on which tensors earlier runs kept alive: the plain
    forward's time then moves by more than the overhead measured here. With this, freed memory
    is reused and the ratios measure the work each configuration adds.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    if not (libc.mallopt(M_MMAP_THRESHOLD, 256 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise SystemExit("mallopt failed: --steady-malloc needs glibc")


def device(text: str) -> torch.device:
    """An ``argparse`` type: a torch device that is there."""
    try:
        value = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA device here")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=at_least(1), default=30,
                        help="timed runs of each configuration per shape, after 3 warm-up runs (default 30)")
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch threads (default 2)")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="keep freed memory in the process (glibc mallopt): no page faults from fresh allocations")
    parser.add_argument("--device", type=device, default=torch.device("cpu"),
                        help="where the model runs (cpu, cuda)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steady_malloc:
        steady_malloc()
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} interleaved repeats"
          f"{', steady malloc' if args.steady_malloc else ''}, on {args.device}")
    print(f"{'shape':>9} | {'configuration':>15} | {'wall ms':>9} | {'x plain':>7} | {'CPU ms':>9} | {'x plain':>7}")
    for batch, seq in ((4, 256), (1, 8)):
        results = measure(batch, seq, args.repeats, args.device)
        plain_wall, plain_cpu = results["plain"]
        for name, (wall, cpu) in results.items():
            print(f"{batch:>3} x {seq:<3} | {name:>15} | {wall * 1e3:9.2f} | {wall / plain_wall:7.3f} | "
                  f"{cpu * 1e3:9.2f} | {cpu / plain_cpu:7.3f}")


if __name__ == "__main__":
    main()
