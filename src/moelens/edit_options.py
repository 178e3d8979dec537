"""The command line's edit options, ``--ablate``, ``--route-around``, ``--steer`` and ``--swap``: their parsing, and
the interventions they stand for on a block in a trace (``moelens export`` bakes them into the archive as `Edits`,
``moelens generate`` makes them at every step of its generation)."""

from __future__ import annotations

import argparse
from typing import Any

from .errors import MoelensError

#: The edits the options give, by the names `moelens.export.Edits` gives them (``--route-around``: route_around).
EDIT_OPTIONS = ("ablate", "route_around", "steer", "swap")


def add_edit_options(parser: argparse.ArgumentParser) -> None:
    """Add the four edit options to ``parser`` (each may be given several times)."""
    parser.add_argument("--ablate", action="append", default=[], metavar="LAYER:E[,E]", help="zero-ablate experts")
    parser.add_argument("--route-around", action="append", default=[], metavar="LAYER:E[,E]",
                        help="route around experts (the router never picks them)")
    parser.add_argument("--steer", action="append", default=[], metavar="LAYER:E=BIAS[,E=BIAS]",
                        help="add BIAS to expert E's router logit")
    parser.add_argument("--swap", action="append", default=[], metavar="LAYER:E=TO[,E=TO]",
                        help="expert E's slots run expert TO")


def parse_edit_options(args: argparse.Namespace) -> dict[str, dict[int, Any]]:
    """The edits ``args``' options give: ``ablate`` and ``route_around`` as layer -> experts, ``steer`` as layer ->
    {expert: bias}, ``swap`` as layer -> {expert: the expert taking over its slots}; an option that does not parse,
    or names an expert of a layer twice, is refused naming it."""
    return {
        "ablate": _experts(args.ablate, "ablate"),
        "route_around": _experts(args.route_around, "route-around"),
        "steer": _valued(args.steer, "steer", float, "LAYER:EXPERT=BIAS, e.g. 2:4=1.5"),
        "swap": _valued(args.swap, "swap", int, "LAYER:EXPERT=TO with TO an expert id, e.g. 2:4=0"),
    }


def check_layer_edits(layer: int, num_experts: int, error: type[MoelensError] = MoelensError, *, ablate: Any = None,
                      route_around: Any = None, steer: Any = None, swap: Any = None) -> None:
    """Refuse one layer's edits (given as `make_edits` takes them) on a block of ``num_experts`` experts, as ``error``:
    an expert id out of range (a negative one too, which indexing would take from the end), a swap of an expert to
    itself, an expert both zero-ablated and swapped. Named as `moelens.export.Edits` spells them (``Edits.swap[1]``),
    which the command line spells as its options."""
    swap = swap or {}
    named = {
        ("ablate", "experts"): ablate or (),
        ("route_around", "experts"): route_around or (),
        ("steer", "experts"): tuple(steer or {}),
        ("swap", "experts"): tuple(swap),
        ("swap", "replacements (the experts taking over the slots)"): tuple(swap.values()),
    }
    for (kind, what), experts in named.items():
        bad = [e for e in experts if not 0 <= e < num_experts]
        if bad:
            raise error(f"Edits.{kind}[{layer}]: {what} {bad} out of range: layer {layer}'s MoE block has "
                        f"{num_experts} experts; give expert ids 0..{num_experts - 1}.")
    unchanged = [e for e, to in swap.items() if e == to]
    if unchanged:
        raise error(f"Edits.swap[{layer}]: experts {unchanged} are swapped to themselves, so nothing would change; give "
                    f"another expert to take over their slots (or zero-ablate them: Edits.ablate[{layer}]).")
    both = sorted(set(ablate or ()) & set(swap))
    if both:
        raise error(f"Edits.ablate[{layer}] and Edits.swap[{layer}] both name experts {both}: an expert's slots are "
                    "either zeroed or run another expert; pick one.")


def make_edits(moe: Any, *, ablate: Any = None, route_around: Any = None, steer: Any = None, swap: Any = None) -> None:
    """Inside a trace: make one block's edits with moelens' interventions, routing first (steer, then route_around),
    then the outputs (zero ablation, then every swap at once, as the export bakes them: ``{1: 2, 2: 1}`` exchanges
    two experts instead of chaining). Each edit is given as `parse_edit_options` gives one layer's (None: none)."""
    import torch

    from .interventions import ablate as ablated, steer as steered

    for expert, bias in (steer or {}).items():
        steered(moe, expert, bias)
    if route_around:  # in one call: a refusal names them all
        ablated(moe, list(route_around), "route_around")
    for expert in ablate or ():
        ablated(moe, expert, "zero")
    if swap:
        indices = moe.expert_indices
        replacement = torch.arange(moe.num_experts, device=indices.device)
        replacement[list(swap)] = torch.tensor(list(swap.values()), device=indices.device)
        moe.expert_indices = replacement[indices]


def _split(spec: str, option: str) -> tuple[int, str]:
    """``LAYER:REST`` of one option value ``spec`` of ``--option``, as (layer, rest)."""
    layer, sep, rest = spec.partition(":")
    try:  # int's own rule, as for the experts ("--1" and "²" are no layer)
        number = int(layer)
    except ValueError:
        number = None
    if not sep or number is None or not rest:
        raise MoelensError(f"--{option} {spec!r}: expected LAYER:..., e.g. --{option} 1:3")
    return number, rest


def _experts(values: list[str], option: str) -> dict[int, list[int]]:
    """Layer -> experts of the values of ``--option`` (``LAYER:E[,E]``, each expert of a layer once)."""
    found: dict[int, list[int]] = {}
    for spec in values:
        layer, rest = _split(spec, option)
        try:
            given = [int(e) for e in rest.split(",")]
        except ValueError:
            raise MoelensError(f"--{option} {spec!r}: experts must be integers, e.g. 1:3,5") from None
        listed = found.setdefault(layer, [])
        for expert_id in given:
            if expert_id in listed:
                raise MoelensError(f"--{option} {spec!r}: expert {expert_id} of layer {layer} is given twice; "
                                   "give each expert of a layer once.")
            listed.append(expert_id)
    return found


def _valued(values: list[str], option: str, kind: type, example: str) -> dict[int, dict[int, Any]]:
    """Layer -> {expert: value} of the values of ``--option`` (``LAYER:E=VALUE[,E=VALUE]``, values of ``kind``)."""
    found: dict[int, dict[int, Any]] = {}
    for spec in values:
        layer, rest = _split(spec, option)
        for item in rest.split(","):
            expert, sep, value = item.partition("=")
            try:
                expert_id, parsed = int(expert), kind(value)
            except ValueError:
                raise MoelensError(f"--{option} {spec!r}: expected {example}") from None
            if not sep:
                raise MoelensError(f"--{option} {spec!r}: expected {example}")
            edits = found.setdefault(layer, {})
            if expert_id in edits:
                raise MoelensError(
                    f"--{option} {spec!r}: expert {expert_id} of layer {layer} is given twice "
                    f"(={edits[expert_id]} and ={parsed}); give each expert of a layer one value."
                )
            edits[expert_id] = parsed
    return found
