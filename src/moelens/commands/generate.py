"""``moelens generate``: its parser (the body: `moelens.analysis.generate_command`)."""

from __future__ import annotations

from typing import Any

from ..edit_options import add_edit_options
from . import add_model_argument, runs

#: Tokens generated when ``--max-new-tokens`` is not given.
DEFAULT_NEW_TOKENS = 24


def register(subparsers: Any) -> None:
    """Add ``generate`` to the ``moelens`` command."""
    parser = subparsers.add_parser(
        "generate",
        help="generate from a prompt and show which experts every token went to",
        description="Load MODEL, generate from --prompt (greedy unless --sample) and print the generated text and, "
        "for the prompt's tokens and every generated token the model read, its experts and their weights in every "
        "MoE layer, as the model routed them while generating.",
    )
    add_model_argument(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text (tokenized without special tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help=f"tokens to generate at most (default {DEFAULT_NEW_TOKENS})")
    parser.add_argument("--sample", action="store_true", help="sample (do_sample=True) instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed when sampling (default 0)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="LAYER",
                        help="decoder-layer indices of the MoE layers to show (default: all)")
    add_edit_options(parser)
    parser.add_argument("--json", action="store_true", help="print the generation and its routing as JSON")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: one thread is fastest on a busy machine for a small model)")
    parser.set_defaults(func=runs("moelens.analysis.generate_command", "run_generate"))
