"""The ``moelens demo``, ``moelens inspect`` and ``moelens stats`` commands.

``MODEL`` is a local folder holding a transformers checkpoint (config, weights,
tokenizer) or ``tiny`` for the embedded moelens-tiny. Errors moelens raises on
purpose (a missing path, a model without MoE layers, an empty text file) are
printed as one line by ``moelens.cli`` (exit status 2).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..cli import load_checkpoint
from ..errors import MoelensError, ValueUnavailable
from .cache import check_cache_folder, check_folder
from .report import STATS_FILES

if TYPE_CHECKING:
    import torch

#: The plots `write_corpus_plots` writes (``{prefix}{name}.png``).
CORPUS_PLOTS = ("usage", "load_balance", "entropy", "coactivation", "trajectories")

#: The files ``moelens demo`` writes to its ``--out``.
DEMO_FILES = ("token_routing.png", *(f"{prefix}{name}.png" for prefix in ("text_", "heldout_") for name in CORPUS_PLOTS),
              "heldout_specialisation.png", "logit_lens.png")

#: The files ``moelens stats`` writes to its ``--out``, and its routing cache folder there.
STATS_OUTPUTS = (*STATS_FILES, *(f"{name}.png" for name in CORPUS_PLOTS))
STATS_CACHE = "cache"

#: The tokens the demo's table shows (the token plot shows as many): a long --text prints the first ones.
DEMO_TABLE_TOKENS = 64
#: The demo's sample text: a little Python and the prose that explains it.
DEMO_TEXT = '''def mean(values):
    """Return the arithmetic mean of a sequence of numbers."""
    total = sum(values)
    return total / len(values)

The mean function adds the numbers and divides the sum by how many there are.
It raises ZeroDivisionError when the sequence is empty.
'''


# -- shared ----------------------------------------------------------------------------------


def load_model(source: str | None, needs_tokenizer: bool = False) -> Any:
    """Load ``source`` (``tiny`` or a local folder; None: moelens-tiny, even beside a folder named ``tiny``) and
    wrap it; clear errors for a bad path or a non-MoE model, and with ``needs_tokenizer`` (a command that routes
    text) for a model without a tokenizer (none saved, or one that does not load)."""
    from .describe import require_moe

    model, name = load_checkpoint(source, needs_tokenizer=needs_tokenizer)
    require_moe(model, name)
    return model


def set_threads(threads: int | None) -> None:
    """Use ``threads`` torch threads (None: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise MoelensError(f"--threads must be at least 1, got {threads}.")
    cores = os.cpu_count() or 1
    if threads > cores:  # torch starts them all: 100000 exhausted the memory
        raise MoelensError(f"--threads must be at most this machine's {cores} cores, got {threads}.")
    import torch

    torch.set_num_threads(threads)


def check_output_folder(path: Path, files: Sequence[str] = (), cache: str | None = None,
                        text: Path | None = None) -> None:
    """Refuse an ``--out`` moelens cannot write to, before any work (the folder is made when written).

    ``--out`` must not be a file, lie under one or be a symbolic link to a missing path; none of the
    ``files`` it writes there may be a folder, a symbolic link or a hard link (a file with another name too,
    which writing it would change), a file this user may not write, or, for a ``.png``, a file that is no PNG (one
    of the user's own: moelens replaces or removes its outputs); nor its routing cache folder
    ``cache`` a file or a symbolic link (and a cache there is one moelens wrote: `check_cache_folder`).
    The ``--text`` file read, ``text``, may be none of those files nor lie in that cache (compared after
    resolving symbolic links, and as the same file on disk): writing the results would overwrite it.
    """
    check_folder(path, "--out")
    if text is not None:
        check_not_written(text, path, files, cache)
    for name in (*files, *([cache] if cache else [])):
        target = path / name
        linked = target.is_file() and not target.is_symlink() and name != cache and target.stat().st_nlink > 1
        if target.is_symlink() or linked or (target.exists() and target.is_dir() != (name == cache)):
            kind = ("a symbolic link" if target.is_symlink() else "a folder" if target.is_dir()
                    else "a hard link of a file with another name (writing it would change that file)" if linked
                    else "a file")
            what = "its routing cache folder" if name == cache else "a file"
            raise MoelensError(f"--out {str(path)!r} already holds {name!r} as {kind}, where moelens writes {what}; "
                               "move it or name another folder.")
        if name != cache and target.is_file():
            kind = ("a file this user may not write" if not os.access(target, os.W_OK) else
                    "a file that is no PNG (not one moelens wrote)" if name.endswith(".png") and not _is_png(target)
                    else None)  # an empty one: a plot whose writing an older moelens was stopped in
            if kind is not None:
                raise MoelensError(f"--out {str(path)!r} already holds {name!r} as {kind}, which this run would "
                                   "replace or remove; move it or name another folder.")
    if cache:
        check_cache_folder(path / cache)


#: How every PNG file begins.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    """Whether ``path`` holds a PNG, or nothing (what writing a plot in place left where it was stopped)."""
    with path.open("rb") as file:
        return file.read(len(PNG_SIGNATURE)) in (PNG_SIGNATURE, b"")


def check_not_written(text: Path, path: Path, files: Sequence[str], cache: str | None) -> None:
    """Refuse a ``--text`` file ``text`` that the command writes over in ``--out`` ``path``: one of its
    ``files``, or anything in its routing cache folder ``cache``."""
    read = text.resolve()
    folder = path.resolve()
    for name in files:
        target = folder / name
        if read == target or (read.is_file() and target.is_file() and os.path.samefile(read, target)):
            raise MoelensError(f"--text {str(text)!r} is the file {name!r} that moelens writes to --out {str(path)!r}, "
                               "so the results would overwrite it; name another --out, or copy the text elsewhere.")
    if cache and read.is_relative_to(folder / cache):
        raise MoelensError(f"--text {str(text)!r} lies in the routing cache folder {cache!r} that moelens writes to "
                           f"--out {str(path)!r}; name another --out, or copy the text elsewhere.")


def read_text(path: Path) -> str:
    """The text of ``path`` (a file, or a pipe such as ``/dev/stdin``); clear errors for a missing, unreadable
    or empty one."""
    if path.is_dir():
        raise MoelensError(f"text file {str(path)!r} is a folder; give a text file.")
    if not path.exists():
        raise MoelensError(f"text file {str(path)!r} does not exist.")
    try:
        data = path.read_bytes()  # read once: a pipe cannot be read again
    except OSError as error:
        raise MoelensError(f"text file {str(path)!r} cannot be read: {error.strerror or error}.") from None
    mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # what Notepad writes first: no text
    try:  # line endings stay the file's own (\r\n too)
        text = data[mark:].decode("utf-8")
    except UnicodeDecodeError as error:  # its offset counted in the file, the mark included
        raise MoelensError(f"text file {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start + mark}); "
                           "convert it to UTF-8 and give that file (e.g. iconv -f ENCODING -t utf-8 FILE > "
                           "converted.txt, with ENCODING the file's own, such as latin1 or cp1252).") from None
    if not text:  # whitespace is text the model routes (moelens-tiny has experts for it)
        raise MoelensError(f"text file {str(path)!r} is empty; give it some text to route.")
    return text


def write_corpus_plots(cache: Any, folder: Path, prefix: str = "", stats: Any = None) -> list[Path]:
    """Usage, load balance, entropy, co-activation and trajectory plots of ``cache``.

    ``stats``: the cache's `layer_stats`, when the caller has them (else usage,
    load balance and entropy are computed here).
    """
    from . import plots
    from .coactivation import coactivation, transitions
    from .entropy import routing_entropy
    from .usage import expert_usage

    if stats is not None:
        usage, balance, entropy = stats.usage, stats.balance, stats.entropy
    else:
        usage = expert_usage(cache)
        balance, entropy = usage.balance(), routing_entropy(cache)
    pairs = list(zip(cache.layers, cache.layers[1:]))
    figures = {
        "usage": lambda: plots.plot_usage(usage),
        "load_balance": lambda: plots.plot_load_balance(balance),
        "entropy": lambda: plots.plot_entropy(entropy),
        "coactivation": lambda: plots.plot_coactivation([coactivation(cache, layer) for layer in cache.layers]),
        "trajectories": lambda: plots.plot_transitions([transitions(cache, a, b) for a, b in pairs]),
    }
    names = CORPUS_PLOTS if pairs else CORPUS_PLOTS[:-1]  # trajectories need two layers
    return [plots.save(figures[name](), folder / f"{prefix}{name}.png") for name in names]


def missing_corpus_plots(cache: Any, prefix: str = "") -> dict[str, str]:
    """The plots `write_corpus_plots` does not draw for ``cache``: file name (``{prefix}{name}.png``) -> why."""
    if len(cache.layers) > 1:
        return {}
    return {f"{prefix}trajectories.png": f"this run routed one MoE layer ({cache.layers[0]}); trajectories need two"}


def clear_earlier(folder: Path, names: Sequence[str]) -> set[str]:
    """Remove from ``folder`` each file of moelens' own output ``names`` an earlier run left, before this run writes
    its first one: stopped partway (Ctrl-C), the folder then holds this run's files and none of an earlier run's that
    would pass for this run's. Returns the names removed, for `remove_stale`'s lines on what this run did not make.

    `check_output_folder` refused those names as links or folders before any work; only a plain file is removed.
    """
    removed = set()
    for name in names:
        target = folder / name
        if not target.is_symlink() and target.is_file():
            target.unlink()
            removed.add(name)
    return removed


def remove_stale(folder: Path, names: Sequence[str], written: Sequence[Path],
                 reasons: dict[str, str] | None = None, earlier: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Remove from ``folder`` each file of moelens' own output ``names`` that this run did not write (``written``):
    an earlier run's plot left there would pass for this run's. Returns one line per file removed, with its
    reason from ``reasons`` (file name -> why this run made none).

    `check_output_folder` refused those names as links or folders before any work; only a plain file is removed.
    """
    made = {path.name for path in written}
    reasons = reasons or {}
    removed = []
    for name in names:
        target = folder / name
        if name in made or ((target.is_symlink() or not target.is_file()) and name not in earlier):
            continue
        target.unlink(missing_ok=True)  # gone already where `clear_earlier` removed it
        removed.append(f"removed {name} of an earlier run: {reasons.get(name, 'this run did not write it')}")
    return removed


# -- demo --------------------------------------------------------------------------------------


def spread(total: int, count: int) -> torch.Tensor:
    """``count`` window indices spread evenly over ``range(total)``: moelens-tiny's held-out set holds
    the code stream's windows, then the prose stream's, so a prefix would be code-stream windows only."""
    import torch

    return torch.linspace(0, total - 1, min(count, total)).round().long()


def run_demo(args: argparse.Namespace) -> int:
    """``moelens demo``."""
    from safetensors.torch import load_file

    from moelens.data import HELDOUT_PATH, TOKEN_CLASSES

    from . import plots
    from .collect import collect_routing
    from .logit_lens import expert_logit_lens
    from .report import layer_stats, table
    from .specialisation import specialisation
    from .token_view import token_routing

    started = time.perf_counter()
    check_output_folder(args.out, DEMO_FILES, text=args.text)
    if args.windows < 0:
        raise MoelensError(f"--windows must be 0 (none) or more, got {args.windows}.")
    text = read_text(args.text) if args.text is not None else DEMO_TEXT
    set_threads(args.threads)
    print("Loading moelens-tiny (offline) ...", flush=True)
    model = load_model(None)
    moes = model.moes
    first = moes[0]
    print(f"{type(model._module).__name__}: {len(moes)} MoE layers, {first.num_experts} experts, top-{first.top_k}, "
          f"family {model.family.name}, {first.experts_implementation} experts\n")

    view = token_routing(model, text)
    print(f"Routing of the {'text' if args.text else 'sample text'} ({len(view.tokens)} tokens): "
          "expert:weight for each of the k slots, per layer\n")
    print(view.table(max_tokens=DEMO_TABLE_TOKENS))

    cache = collect_routing(model, [text], logits=True, progress=False)
    stats = layer_stats(cache)
    columns = ["layer", "tokens", "cv", "max_over_mean", "unused_experts", "router_entropy", "busiest_experts"]
    print("\nPer layer over this text: load balance (cv: 0 = balanced) and routing entropy (0..1)\n")
    print(table(stats.rows(), columns))

    out: Path = args.out
    earlier = clear_earlier(out, DEMO_FILES)
    written = [plots.save(plots.plot_token_routing(view, max_tokens=DEMO_TABLE_TOKENS), out / "token_routing.png")]
    written += write_corpus_plots(cache, out, prefix="text_", stats=stats)

    corpus = text
    skipped = missing_corpus_plots(cache, prefix="text_")
    if args.windows == 0 or not HELDOUT_PATH.is_file():
        why = "--windows 0 routes no held-out windows" if args.windows == 0 else f"no held-out set at {HELDOUT_PATH}"
        skipped.update({name: why for name in DEMO_FILES if name.startswith("heldout_")})
    else:
        held = load_file(str(HELDOUT_PATH))
        picked = spread(held["input_ids"].shape[0], args.windows)
        ids, classes = held["input_ids"][picked].long(), held["token_class"][picked].long()
        every = f", all the held-out set has; --windows asked for {args.windows}" if args.windows > ids.shape[0] else ""
        print(f"\nRouting {ids.numel()} held-out tokens ({ids.shape[0]} windows of code and prose{every}) ...", flush=True)
        windows = collect_routing(model, ids, batch_size=16, progress=not args.no_progress)
        written += write_corpus_plots(windows, out, prefix="heldout_")
        skipped.update(missing_corpus_plots(windows, prefix="heldout_"))
        spec = specialisation(windows, classes.flatten(), list(TOKEN_CLASSES))
        written.append(plots.save(plots.plot_specialisation(spec), out / "heldout_specialisation.png"))
        corpus = ids
    try:
        lens = expert_logit_lens(model, corpus, top=8, batch_size=16, progress=False)
        written.append(plots.save(plots.plot_logit_lens(lens, lens.layers[-1]), out / "logit_lens.png"))
    except ValueUnavailable as error:
        print(f"(no logit lens plot: {error})")
        skipped["logit_lens.png"] = f"no logit lens ({error})"
    print(f"\nPlots written to {out.resolve()}:")
    for path in written:
        print(f"  {path.name}")
    for line in remove_stale(out, DEMO_FILES, written, skipped, earlier):
        print(line)
    print(f"\nDone in {time.perf_counter() - started:.1f} s. Next: moelens inspect tiny; moelens stats tiny --text FILE")
    return 0


# -- inspect -------------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    """``moelens inspect MODEL``."""
    from .describe import describe

    model = load_model(args.model)
    report = describe(model)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0


# -- stats ---------------------------------------------------------------------------------------


def run_stats(args: argparse.Namespace) -> int:
    """``moelens stats MODEL --text FILE``."""
    from .collect import collect_routing, moes_of
    from .report import layer_stats, table, to_csv, write_stats

    if args.out is not None:  # before the text is read: --text may be a file the results would overwrite
        check_output_folder(args.out, STATS_OUTPUTS, STATS_CACHE, text=args.text)
    text = read_text(args.text)
    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
        if value is not None and value < 1:
            raise MoelensError(f"{flag} must be at least 1, got {value}.")
    set_threads(args.threads)
    model = load_model(args.model, needs_tokenizer=True)
    folder = args.out / STATS_CACHE if args.out is not None else None
    earlier: frozenset[str] | set[str] = frozenset()
    if args.out is not None:  # before the cache, this run's first file there (once --blocks is known to name blocks,
        # collect_routing's refusal before it writes): stopped from here on, no earlier run's stats or plots are left
        # beside this run's cache
        moes_of(model, None, args.blocks)
        earlier = clear_earlier(args.out, STATS_OUTPUTS)
    cache = collect_routing(model, [text], batch_size=args.batch_size, max_length=args.max_length, logits=True,
                            blocks=args.blocks, folder=str(folder) if folder is not None else None,
                            progress=not args.no_progress)
    if cache.num_tokens == 0:
        raise MoelensError(f"text file {str(args.text)!r} produced no tokens (the tokenizer made none of it); "
                           "give a file with text in it.")
    stats = layer_stats(cache)
    rows = stats.rows()
    if args.format == "json":
        print(json.dumps({"model": args.model, "text": str(args.text), "layers": rows}, indent=1))
    elif args.format == "csv":
        print(to_csv(rows), end="")
    else:
        print(f"{cache.num_tokens} tokens of {args.text} through {args.model} ({model.family.name}, "
              f"{len(cache.layers)} MoE layers)\n")
        print(table(rows))
    if args.out is not None:
        meta = {"model": args.model, "text": str(args.text), "family": cache.family}
        written = write_stats(stats, args.out, meta, rows)
        written += write_corpus_plots(cache, args.out, stats=stats)
        removed = remove_stale(args.out, STATS_OUTPUTS, written, missing_corpus_plots(cache), earlier)
        if args.format == "table":
            print(f"\nWrote to {args.out.resolve()}: " + ", ".join(path.name for path in written) + f", {STATS_CACHE}/")
        for line in removed:  # beside JSON or CSV on stdout: on stderr, so that output stays one document
            print(line, file=sys.stdout if args.format == "table" else sys.stderr)
    return 0
