"""moelens-tiny exported to NNEF: tract vs torch latency, export time, archive size.

Exports moelens-tiny (whole model, ``input_ids -> logits``) at 1 and 64 tokens, runs each
archive in tract (in this process; tract may use worker threads of its own, RAYON_NUM_THREADS=1 stops that) and the same weights as a plain transformers
model in torch (one thread, no grad, eager and grouped_mm experts), timed in alternating
chunks of runs, and
prints the median latencies (CPU time of the process, robust on a shared machine, and
wall clock) and the ratio against the faster torch, the latency of one archive exported with
``dynamic_tokens=True`` at both lengths, the export times, and the archive sizes with float32
and with Q4_0 experts (both layouts).

Target: tract at most 0.5x torch at 64 tokens.

Run: ``python bench/export_tract.py [--repeats 50] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import moelens  # noqa: E402
from moelens.export import to_nnef  # noqa: E402
from moelens.export.runner import load  # noqa: E402
from arguments import at_least, output_file  # noqa: E402


def median_ms(function, repeats: int, warmup: int = 5) -> float:
    """Median CPU milliseconds of ``function`` (see `paired_ms`)."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        function()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def paired_ms(first, second, repeats: int, chunk: int = 10, warmup: int = 5) -> dict[str, tuple[float, float]]:
    """Median ms of two functions, ``repeats`` runs each, timed in alternating chunks of ``chunk`` consecutive runs.

    Returns ``{"cpu": (first, second), "wall": (first, second)}``. CPU time is this
    process's (every thread: tract hands some work to its own worker threads), so it is
    what each costs even when the shared machine deschedules us; wall time is beside it.
    Alternating spreads machine noise over both; runs within a chunk keep each one's
    weights warm in the caches, as when it runs alone.
    """
    cpu: tuple[list, list] = ([], [])
    wall: tuple[list, list] = ([], [])
    chunks = [chunk] * (repeats // chunk) + ([repeats % chunk] if repeats % chunk else [])  # `repeats` runs in all
    for size in chunks:
        for index, function in enumerate((first, second)):
            for _ in range(warmup):
                function()
            for _ in range(size):
                start, start_cpu = time.perf_counter(), time.process_time()
                function()
                cpu[index].append((time.process_time() - start_cpu) * 1e3)
                wall[index].append((time.perf_counter() - start) * 1e3)
    return {
        "cpu": (statistics.median(cpu[0]), statistics.median(cpu[1])),
        "wall": (statistics.median(wall[0]), statistics.median(wall[1])),
    }


def plain_models() -> dict:
    """moelens-tiny as plain transformers models (no nnsight wrapping), per experts implementation."""
    from transformers import AutoModelForCausalLM

    from moelens.data import TINY_MODEL_PATH

    return {
        implementation: AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, experts_implementation=implementation).eval()
        for implementation in ("eager", "grouped_mm")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=at_least(1), default=50, help="timed runs per measurement (default 50)")
    parser.add_argument("--json", type=output_file, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, name = moelens.load(), "moelens-tiny"
    hf = model._module
    vocab = hf.config.vocab_size
    print(f"model: {name} ({sum(p.numel() for p in hf.parameters()) / 1e6:.2f} M parameters, "
          f"{len(model.moes)} MoE layers, experts implementation {model.moes[0].experts_implementation})")
    results: dict = {"model": name, "latency": {}, "export_seconds": {}, "bytes": {}}
    plains = plain_models()
    with tempfile.TemporaryDirectory() as folder:
        for tokens in (1, 64):
            ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
            report = to_nnef(model, Path(folder) / f"tiny-{tokens}.nnef.tgz", example_inputs=ids)
            results["export_seconds"][f"f32_{tokens}"] = report.seconds
            results["bytes"][f"f32_{tokens}"] = report.bytes
            check = report.verification
            print(f"\nT={tokens}: exported in {report.seconds:.2f} s ({report.bytes / 1e6:.2f} MB); tract vs torch "
                  f"max abs error {check.max_abs_error:.2g} (tract tolerance {check.tolerance})")

            runnable = load(report.path).runnable
            array = ids.numpy()
            mask = torch.ones_like(ids)

            def tract_forward():
                runnable.run([array])

            timings = {}
            for implementation, plain in plains.items():
                def torch_forward(plain=plain):
                    with torch.no_grad():
                        plain(input_ids=ids, attention_mask=mask, use_cache=False)

                timings[implementation] = paired_ms(torch_forward, tract_forward, args.repeats)
            best = min(timings, key=lambda impl: timings[impl]["cpu"][0])
            entry = {"torch_best": best}
            for clock in ("cpu", "wall"):
                torch_median, tract_median = timings[best][clock]
                entry[clock] = {"torch_ms": {impl: t[clock][0] for impl, t in timings.items()},
                                "tract_ms": tract_median, "ratio": tract_median / torch_median}
            results["latency"][str(tokens)] = entry
            for clock in ("cpu", "wall"):
                each = ", ".join(f"{impl} {t[clock][0]:.3f} ms (tract {t[clock][1]:.3f})" for impl, t in timings.items())
                print(f"T={tokens} {clock:4s}: torch {each}; tract/torch (fastest torch, {best}) "
                      f"{entry[clock]['ratio']:.2f}x")

        ids = torch.randint(3, vocab, (1, 64), generator=torch.Generator().manual_seed(64))
        report = to_nnef(model, Path(folder) / "tiny-dynamic.nnef.tgz", example_inputs=ids[:, :8], dynamic_tokens=True)
        runnable = load(report.path).runnable
        for tokens in (1, 64):
            window = ids[:, :tokens].numpy()
            dynamic_ms = median_ms(lambda: runnable.run([window]), args.repeats)  # CPU time
            results["latency"][f"dynamic_{tokens}"] = {"tract_ms": dynamic_ms}
            print(f"\ndynamic tokens (one archive, traced at 8), T={tokens}: tract {dynamic_ms:.3f} ms (CPU; the archive "
                  f"traced at {tokens}: {results['latency'][str(tokens)]['cpu']['tract_ms']:.3f} ms in its pairing above)")
        for layout in ("canonical", "linear"):
            report = to_nnef(model, Path(folder) / f"tiny-q40-{layout}.nnef.tgz", example_inputs=ids,
                             quantize_experts="q4_0", layout=layout)
            runnable = load(report.path).runnable
            q40_ms = median_ms(lambda: runnable.run([ids.numpy()]), args.repeats)  # CPU time
            check = report.verification
            results["bytes"][f"q4_0_{layout}_64"] = report.bytes
            results["export_seconds"][f"q4_0_{layout}_64"] = report.seconds
            results["latency"][f"q4_0_{layout}_64"] = {"tract_ms": q40_ms}
            print(f"\nQ4_0 experts ({layout}), T=64: exported in {report.seconds:.2f} s, {report.bytes / 1e6:.2f} MB "
                  f"({report.bytes / results['bytes']['f32_64']:.2f}x the float32 archive); tract {q40_ms:.3f} ms (CPU); "
                  f"vs the float32 model max abs error {check.max_abs_error:.2g}, vs torch with the same Q4_0 weights "
                  f"{check.details['export_max_abs_error']:.2g} ({check.details['export_tolerance']})")

    ratio1, ratio64 = (results["latency"][t]["cpu"]["ratio"] for t in ("1", "64"))
    wall1, wall64 = (results["latency"][t]["wall"]["ratio"] for t in ("1", "64"))
    verdict = "meets" if ratio64 <= 0.5 else "misses"
    print(f"\nsummary: tract/torch {ratio1:.2f}x at 1 token, {ratio64:.2f}x at 64 tokens in CPU time ({verdict} the "
          f"0.5x target; wall clock {wall1:.2f}x and {wall64:.2f}x); export {results['export_seconds']['f32_64']:.2f} s; "
          f"archive {results['bytes']['f32_64'] / 1e6:.2f} MB float32, {results['bytes']['q4_0_linear_64'] / 1e6:.2f} MB Q4_0")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
