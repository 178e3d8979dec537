#!/usr/bin/env python
"""Benchmark: collecting a routing cache vs the plain forward, and its memory as the corpus grows.

1. Throughput. The same batches (windows of stdlib Python sources, tokenized
   with the model's tokenizer) go through (a) the plain transformers forward of
   the unwrapped model under ``torch.no_grad`` (a second load of the same weights
   that moelens never wraps: wrapping instruments the wrapped model's own modules,
   so its ``_module`` runs nnsight's forward) and (b) `collect_routing` (one nnsight
   trace per batch reading router logits, weights and indices of every MoE layer,
   padding dropped, stored in shards). Passes alternate and repeat; the best pass
   of each counts. Reported: tokens/s of each and their ratio (target >= 0.9),
   with the default early stop after the last MoE layer and with the full forward.
2. Memory. Fresh processes stream a 1x and a 4x corpus (texts tokenized on the
   fly) into a routing cache on disk, and into memory; each reports its peak
   resident memory during the collection (the kernel's peak mark is reset after
   the model is loaded) and its resident memory before. Target: the peak is flat
   (within a few %) as the corpus grows 4x. The 1x corpus is large enough (32
   batches) to be past the allocator's warm-up: resident memory rises over the
   first ~20-30 batches of any loop of varied tensor sizes, then stays flat.

Run:  python bench/routing_stats.py            (moelens-tiny; ~5 minutes on 1 thread)
      python bench/routing_stats.py --model random   (a random model of the same shape)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from arguments import at_least  # noqa: E402


def load(name: str, plain: bool = True):
    """(wrapped model, plain model) for ``tiny`` / a folder / ``random`` (moelens-tiny's shape, random weights).

    The plain model is a fresh load of the same weights that is never wrapped (as bench/trace_overhead.py and
    bench/export_tract.py keep theirs): ``moelens.wrap`` instruments the modules of the model it wraps, so the
    wrapped model's own ``_module`` runs nnsight's forward, not the plain one. None with ``plain=False``.
    """
    import moelens

    if name != "random":
        model = moelens.load(None if name == "tiny" else name)
        if not plain:
            return model, None
        from moelens.data import TINY_MODEL_PATH

        fresh = type(model._module).from_pretrained(TINY_MODEL_PATH if name == "tiny" else name).eval()
        return model, fresh
    from moelens.testing import tiny_model

    def build():  # seeded: the same weights every time
        return tiny_model(
            "qwen2_moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, shared_expert_intermediate_size=256,
            vocab_size=4096, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        ).eval()

    return moelens.wrap(build()), build() if plain else None


def stdlib_texts():
    """The stdlib's Python sources, sorted, lazily (an offline corpus on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def token_stream(model, window: int):
    """Windows of ``window`` token ids from the stdlib sources (random ids without a tokenizer)."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        vocab = model._module.config.vocab_size
        while True:
            yield torch.randint(0, vocab, (window,), generator=generator)
    buffer: list[int] = []
    for text in stdlib_texts():
        buffer += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        while len(buffer) >= window:
            yield torch.tensor(buffer[:window])
            buffer = buffer[window:]


def windows(model, count: int, window: int) -> torch.Tensor:
    stream = token_stream(model, window)
    return torch.stack([next(stream) for _ in range(count)])


def throughput(args) -> dict:
    from moelens.analysis import collect_routing
    from moelens.analysis.corpus import batches

    model, hf = load(args.model)  # hf: never wrapped
    ids = windows(model, args.windows, args.window)
    batch_list = list(batches(ids, None, batch_size=args.batch_size, max_length=args.window, pad=0))
    tokens = ids.numel()

    def plain() -> None:
        with torch.no_grad():
            for batch in batch_list:
                hf(**batch.kwargs())

    def collect(stop_early: bool) -> None:
        collect_routing(model, ids, batch_size=args.batch_size, max_length=args.window, logits=True,
                        stop_early=stop_early, progress=False)

    runs = {"plain forward": plain, "collect (stop after last MoE layer)": lambda: collect(True),
            "collect (full forward)": lambda: collect(False)}
    best = {name: float("inf") for name in runs}
    plain()  # warm up
    collect(True)
    for _ in range(args.repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    rates = {name: tokens / seconds for name, seconds in best.items()}
    base = rates["plain forward"]
    return {"tokens": tokens, "batch_size": args.batch_size, "window": args.window,
            "tokens_per_s": rates, "ratio_vs_plain": {name: rate / base for name, rate in rates.items()}}


def _status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux: ``clear_refs`` 5), so the peak is the run's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_mib(resettable: bool) -> float:
    if resettable:
        value = _status_mib("VmHWM")
        if value is not None:
            return value
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_run(args) -> None:
    """In a fresh process: stream ``args.memory_run`` windows into a cache; print peak RSS (MiB) as JSON."""
    from moelens.analysis import collect_routing

    model, _ = load(args.model, plain=False)
    stream = token_stream(model, args.window)
    first = next(stream)
    corpus = (first if i == 0 else next(stream) for i in range(args.memory_run))
    import gc

    gc.collect()
    baseline = _status_mib("VmRSS") or 0.0
    resettable = reset_peak()
    with tempfile.TemporaryDirectory() as folder:
        cache = collect_routing(model, corpus, batch_size=args.batch_size, max_length=args.window, logits=True,
                                folder=folder if args.where == "disk" else None, shard_tokens=args.shard_tokens,
                                progress=False)
        peak = peak_mib(resettable)
        print(json.dumps({"tokens": cache.num_tokens, "baseline_mib": baseline, "peak_mib": peak,
                          "shards": cache.num_shards, "peak_is_the_run_s_own": resettable}))


def memory(args) -> dict:
    results = {}
    for where in ("disk", "memory"):
        for scale in (1, 4):
            command = [sys.executable, __file__, "--model", args.model, "--memory-run", str(args.memory_windows * scale),
                       "--where", where, "--window", str(args.window), "--batch-size", str(args.batch_size),
                       "--shard-tokens", str(args.shard_tokens), "--threads", str(args.threads)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[f"{where} {scale}x"] = json.loads(output.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (default), a checkpoint folder, or random")
    parser.add_argument("--windows", type=at_least(1), default=128, help="windows of the throughput corpus (default 128)")
    parser.add_argument("--memory-windows", type=at_least(1), default=512,
                        help="windows of the 1x memory corpus (default 512: past the allocator's warm-up)")
    parser.add_argument("--window", type=at_least(1), default=256, help="tokens per window (default 256)")
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="windows per batch (default 16)")
    parser.add_argument("--repeats", type=at_least(1), default=3,
                        help="alternating throughput passes; the best of each counts (default 3)")
    parser.add_argument("--shard-tokens", type=at_least(1), default=8192, help="tokens per cache shard (default 8192)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads (default 1)")
    parser.add_argument("--memory-run", type=at_least(1), help=argparse.SUPPRESS)
    parser.add_argument("--where", default="disk", help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true", help="throughput only (no memory subprocesses)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_run is not None:
        memory_run(args)
        return
    print(f"model {args.model}, {args.threads} torch thread(s), torch {torch.__version__}")
    speed = throughput(args)
    print(f"\nThroughput over {speed['tokens']} tokens (batches of {args.batch_size} x {args.window}), best of "
          f"{args.repeats} alternating passes:")
    for name, rate in speed["tokens_per_s"].items():
        print(f"  {name:<38} {rate:10.0f} tok/s   {speed['ratio_vs_plain'][name]:.2f}x plain")
    if not args.skip_memory:
        results = memory(args)
        print(f"\nPeak resident memory streaming a routing cache (fresh process each; 1x = {args.memory_windows * args.window} tokens):")
        for name, row in results.items():
            print(f"  {name:<10} {row['tokens']:>8} tokens  peak {row['peak_mib']:7.1f} MiB  "
                  f"(before collecting {row['baseline_mib']:7.1f} MiB; +{row['peak_mib'] - row['baseline_mib']:.1f})"
                  f"  {row['shards']} shards")
        for where in ("disk", "memory"):
            growth = results[f"{where} 4x"]["peak_mib"] / results[f"{where} 1x"]["peak_mib"]
            print(f"  {where}: peak 4x / 1x = {growth:.3f}")


if __name__ == "__main__":
    main()
