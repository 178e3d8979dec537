"""The ``moelens export`` command: a model (or one block) to an NNEF archive for tract.

``moelens export MODEL OUT.nnef.tgz`` loads ``MODEL`` (a local checkpoint folder, or
``tiny`` for moelens-tiny), exports it with one tract_moe_ffn per MoE block, checks it
in tract and prints what each block became. Edits are given as ``LAYER:EXPERTS``
(``--ablate 1:3,5``) or ``LAYER:EXPERT=VALUE`` (``--steer 2:4=1.5``, ``--swap 1:3=0``).
``moelens export --support`` prints which families export. The command's body: its parser is
`moelens.commands.export`, which imports this module (and with it torch, transformers and nnsight) when the command
runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..cli import load_checkpoint
from ..edit_options import EDIT_OPTIONS, parse_edit_options
from ..errors import MoelensError
from ..paths import user_path
from .tract_cli import TOLERANCES


def parse_edits(args: argparse.Namespace) -> Any:
    """`Edits` from the command's ``--ablate/--route-around/--steer/--swap`` options."""
    from .edits import Edits

    return Edits(**parse_edit_options(args))


def run_export(args: argparse.Namespace) -> int:
    """Run ``moelens export``."""
    user_path(args.out, "OUT")  # a ~user with no home folder is refused by its name
    edits = parse_edits(args)
    if args.block is not None:
        _refuse_edits_elsewhere(edits, args.block)
    from .archive import check_archive_name, check_destination

    check_archive_name(args.out, "OUT")  # before the model loads: a refused OUT costs nothing
    check_destination(args.out)
    import torch

    from .exporter import default_inputs, require_export_extra, to_nnef

    require_export_extra()  # before the model loads, as OUT is checked
    from .target import resolve

    model = load_checkpoint(args.model)[0]
    target: Any = model
    if args.block is not None:
        target = _block_of_layer(model, args.block)
    inputs = default_inputs(resolve(target), tokens=args.tokens)
    with torch.no_grad():
        report = to_nnef(target, args.out, example_inputs=inputs, dynamic_tokens=args.dynamic_tokens,
                         quantize_experts=args.quantize_experts, layout=args.layout, verify=not args.no_verify,
                         edits=edits)
    print(f"wrote {report.path} ({report.bytes / 1e6:.2f} MB, {report.kind}: {report.input_name} -> "
          f"{report.output_name}) in {report.seconds:.1f} s")
    for block in report.blocks:
        extra = f"; {block.edits}" if block.edits else ""
        print(f"  layer {block.layer}: {block.family} -> tract_moe_ffn(E={block.num_experts}, k={block.k}, "
              f"gate={block.gate}, activation={block.activation}){extra}")
    check = report.verification
    if check is not None:
        line = (f"tract vs {check.reference}: max abs error {check.max_abs_error:.3g} on outputs up to "
                f"{check.scale:.3g} (tract tolerance: {_level(check.tolerance)}){_quantized(check.details)}")
        if "second_length" in check.details:
            second = check.details["second_length"]
            line += (f"; at {second['tokens']} tokens: {second['max_abs_error']:.3g} ({_level(second['tolerance'])})"
                     f"{_quantized(second)}")
        print(line)
    return 0


def _block_of_layer(model: Any, layer: int) -> Any:
    """The one MoE block of ``model`` in ``layer`` (``--block``).

    Raises:
        MoelensError: ``layer`` holds no MoE block, or several (ernie4_5_vl_moe's text and vision experts), which
            the message lists with their paths.
    """
    blocks = [(index, moe) for index, moe in enumerate(model.moes) if moe.layer == layer]
    if not blocks:
        raise MoelensError(f"--block {layer}: no MoE block there; MoE layers are {[m.layer for m in model.moes]}.")
    if len(blocks) > 1:
        listed = ", ".join(f"model.moes[{index}] is {moe.path}" for index, moe in blocks)
        raise MoelensError(
            f"--block {layer}: layer {layer} holds {len(blocks)} MoE blocks ({listed}) and --block exports one; "
            "export the one you mean from Python (moelens.export.to_nnef(model.moes[i], path)), or the whole model "
            "(without --block)."
        )
    return blocks[0][1]


def _refuse_edits_elsewhere(edits: Any, block: int) -> None:
    """Raise `MoelensError` when an edit option names a layer other than ``--block``'s, the only one exported."""
    elsewhere = [f"--{option.replace('_', '-')} of layer {layer}" for option in EDIT_OPTIONS
                 for layer in getattr(edits, option) if layer != block]
    if elsewhere:
        raise MoelensError(
            f"{', '.join(elsewhere)}: --block {block} exports layer {block}'s MoE block alone, so it takes edits of "
            f"layer {block} only; edit that layer, or export the whole model (without --block)."
        )


def _quantized(details: dict[str, Any]) -> str:
    """The check against the archive's own Q4_0 expert weights in torch, as printed ("" without one)."""
    if "export_max_abs_error" not in details:
        return ""
    return (f"; vs the archive's Q4_0 weights in torch: {details['export_max_abs_error']:.3g} "
            f"({_level(details['export_tolerance'])})")


def _level(tolerance: str | None) -> str:
    """A tolerance level as printed: its name and rank among tract's levels, tightest first ("ultra" reads as the
    best, and is the loosest), or "none met" when the archive met none of them."""
    if tolerance not in TOLERANCES:
        return "none met"
    return f"{tolerance}, {list(TOLERANCES).index(tolerance) + 1} of {len(TOLERANCES)} from the tightest"
