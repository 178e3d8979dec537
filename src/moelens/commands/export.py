"""``moelens export``: its parser (the body: `moelens.export.cli`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..edit_options import add_edit_options
from ..paths import argument_text
from . import add_model_argument, runs


def register(subparsers: Any) -> None:
    """Add ``export`` to the ``moelens`` command."""
    parser = subparsers.add_parser(
        "export",
        help="export a model (or one MoE block) to NNEF for tract: one tract_moe_ffn per MoE block",
        description="Export MODEL (a checkpoint folder, or 'tiny') to OUT (.nnef.tgz, .tar or a folder) with one "
        "tract_moe_ffn per MoE block, edits baked in, and check the archive in tract against torch. "
        "Needs the export extra: pip install 'moelens[export]'.",
    )
    add_model_argument(parser)
    parser.add_argument("out", metavar="OUT", type=argument_text, help="the archive to write (.nnef.tgz, .tar, or a folder)")
    parser.add_argument("--support", action=SupportAction, help="print which families export (and why not) and exit")
    parser.add_argument("--block", type=int, metavar="LAYER", help="export only the MoE block of this layer (hidden states -> mlp_output)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens of the traced example input (default 8)")
    parser.add_argument("--dynamic-tokens", action="store_true", help="symbolic token axis S: one archive for every prompt length")
    parser.add_argument("--quantize-experts", choices=("q4_0",), help="store expert weights as tract Q4_0")
    parser.add_argument("--layout", choices=("canonical", "linear"), default="canonical", help="expert weight layout")
    parser.add_argument("--no-verify", action="store_true", help="do not run the archive in tract to check it")
    add_edit_options(parser)
    parser.set_defaults(func=runs("moelens.export.cli", "run_export"))


class SupportAction(argparse.Action):
    """``--support``: print the family support table and exit, as ``--version`` does (no MODEL or OUT needed)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from ..export.table import support_table

        print(support_table(), end="")
        parser.exit()
