"""moelens-tiny exported to NNEF: tract vs torch latency, export time, archive size.

Exports moelens-tiny (whole model, ``input_ids -> logits``) at 1 and 64 tokens, runs each
archive in tract (in this process, one thread) and the same model in torch (one thread,
no grad), and prints the median latencies and their ratio measured in the same run, the
export times, and the archive sizes with float32 and with Q4_0 experts (both layouts).

Target: tract at most 0.5x torch at 64 tokens.

Run: ``python bench/export_tract.py [--repeats 50] [--json out.json]``. When moelens-tiny
is not installed yet, its architecture (scripts/train_tiny.py) is built untrained and the
output says so: latency and sizes do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import importlib.util
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import moelens  # noqa: E402
from moelens.export import to_nnef  # noqa: E402
from moelens.export.runner import load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tiny_model():
    """moelens-tiny, or its architecture untrained (while it is not shipped)."""
    from moelens.data import TINY_MODEL_PATH

    if (TINY_MODEL_PATH / "config.json").is_file():
        return moelens.load(), "moelens-tiny"
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**module.MOE_ARCH, vocab_size=4096)).eval()
    return moelens.wrap(model), "moelens-tiny architecture, untrained (src/moelens/data/moelens-tiny/ is not there yet)"


def median_ms(function, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per measurement (default 50)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, name = tiny_model()
    hf = model._module
    vocab = hf.config.vocab_size
    print(f"model: {name} ({sum(p.numel() for p in hf.parameters()) / 1e6:.2f} M parameters, "
          f"{len(model.moes)} MoE layers, experts implementation {model.moes[0].experts_implementation})")
    results: dict = {"model": name, "latency": {}, "export_seconds": {}, "bytes": {}}
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

            def torch_forward():
                with torch.no_grad():
                    hf(input_ids=ids, attention_mask=mask, use_cache=False)

            def tract_forward():
                runnable.run([array])

            # Interleave the two so machine noise hits both alike.
            torch_ms, tract_ms = [], []
            for _ in range(3):
                torch_ms.append(median_ms(torch_forward, args.repeats // 3 + 1))
                tract_ms.append(median_ms(tract_forward, args.repeats // 3 + 1))
            torch_median, tract_median = statistics.median(torch_ms), statistics.median(tract_ms)
            ratio = tract_median / torch_median
            results["latency"][str(tokens)] = {"torch_ms": torch_median, "tract_ms": tract_median, "ratio": ratio}
            print(f"T={tokens}: torch {torch_median:.3f} ms, tract {tract_median:.3f} ms -> tract/torch {ratio:.2f}x")

        ids = torch.randint(3, vocab, (1, 64), generator=torch.Generator().manual_seed(64))
        for layout in ("canonical", "linear"):
            report = to_nnef(model, Path(folder) / f"tiny-q40-{layout}.nnef.tgz", example_inputs=ids,
                             quantize_experts="q4_0", layout=layout)
            runnable = load(report.path).runnable
            q40_ms = median_ms(lambda: runnable.run([ids.numpy()]), args.repeats)
            check = report.verification
            results["bytes"][f"q4_0_{layout}_64"] = report.bytes
            results["export_seconds"][f"q4_0_{layout}_64"] = report.seconds
            results["latency"][f"q4_0_{layout}_64"] = {"tract_ms": q40_ms}
            print(f"\nQ4_0 experts ({layout}), T=64: exported in {report.seconds:.2f} s, {report.bytes / 1e6:.2f} MB "
                  f"({report.bytes / results['bytes']['f32_64']:.2f}x the float32 archive); tract {q40_ms:.3f} ms; "
                  f"vs the float32 model max abs error {check.max_abs_error:.2g}, vs torch with the same Q4_0 weights "
                  f"{check.details['export_max_abs_error']:.2g} ({check.details['export_tolerance']})")

    ratio64 = results["latency"]["64"]["ratio"]
    verdict = "meets" if ratio64 <= 0.5 else "misses"
    print(f"\nsummary: tract/torch {results['latency']['1']['ratio']:.2f}x at 1 token, {ratio64:.2f}x at 64 tokens "
          f"({verdict} the 0.5x target); export {results['export_seconds']['f32_64']:.2f} s; archive "
          f"{results['bytes']['f32_64'] / 1e6:.2f} MB float32, {results['bytes']['q4_0_linear_64'] / 1e6:.2f} MB Q4_0")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
