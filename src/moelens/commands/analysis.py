"""``moelens demo``, ``inspect`` and ``stats``: their parsers (the bodies: `moelens.analysis.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..paths import argument_path
from . import add_model_argument, runs

#: Where ``moelens demo`` writes its plots unless told otherwise.
DEMO_OUT = Path("moelens-out") / "demo"


def register(subparsers: Any) -> None:
    """Add ``demo``, ``inspect`` and ``stats`` to the ``moelens`` command."""
    demo = subparsers.add_parser(
        "demo",
        help="route a sample text through moelens-tiny: routing table per layer and plots",
        description="Load moelens-tiny (offline), run a sample text, print which experts every token goes to "
        "in every layer, usage / load balance / entropy per layer, and write plots (PNG) to a folder.",
    )
    demo.add_argument("--out", type=argument_path, default=DEMO_OUT, metavar="DIR",
                      help=f"folder for the plots (default: {DEMO_OUT})")
    demo.add_argument("--text", type=argument_path, metavar="FILE",
                      help="route this text file instead of the sample text")
    demo.add_argument("--windows", type=int, default=64, metavar="N",
                      help="held-out code/prose windows of moelens-tiny for the corpus plots (default 64, 0: none)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch threads (default 1: the model is tiny, one thread is fastest on a busy machine)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=runs("moelens.analysis.cli", "run_demo"))

    inspect = subparsers.add_parser(
        "inspect",
        help="what moelens sees in a model: family, MoE layers, E, k, scoring, values",
        description="Load MODEL and print its family, MoE layers, experts E, top-k, scoring, shared expert, "
        "experts implementation, and which values each MoE block serves (with shapes) or why not.",
    )
    add_model_argument(inspect)
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=runs("moelens.analysis.cli", "run_inspect"))

    stats = subparsers.add_parser(
        "stats",
        help="expert usage, load balance and routing entropy per layer over a text file",
        description="Route the text of FILE through MODEL (in windows, batched) and report per MoE layer: "
        "expert usage, load balance (coefficient of variation, max/mean, min/mean, usage entropy, unused "
        "experts) and routing entropy. With --out: stats.json, stats.csv, experts.csv, plots and the routing cache.",
    )
    add_model_argument(stats)
    stats.add_argument("--text", type=argument_path, required=True, metavar="FILE", help="a UTF-8 text file to route")
    stats.add_argument("--out", type=argument_path, metavar="DIR",
                       help="write stats.json, stats.csv, experts.csv, plots and cache/ here")
    stats.add_argument("--format", choices=("table", "json", "csv"), default="table", help="what to print (default table)")
    stats.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    stats.add_argument("--max-length", type=int, help="window length in tokens (default: model context, at most 512)")
    stats.add_argument("--blocks", metavar="TEXT",
                       help="only MoE blocks whose module path contains TEXT (models with several per layer)")
    stats.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    stats.add_argument("--no-progress", action="store_true", help="no progress bar")
    stats.set_defaults(func=runs("moelens.analysis.cli", "run_stats"))
