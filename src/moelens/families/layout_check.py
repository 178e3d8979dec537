"""Check an entry's `ExpertLayout` against what its experts compute: part of `moelens.families.check`.

For experts that carry no transformers layout flags, `Moe.params` reads the weights where the family entry's
`ExpertLayout` says. A wrong flag that keeps the shapes (interleaved gate and up read as concatenated, a square down
projection read transposed) would serve other numbers as the weights, and edits through them would land on other
rows. This check calls the experts module on random tokens, each sent to one expert with weight 1 (its other slots
to other experts with weight 0), and recomputes that expert's output from the weights the layout names.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..errors import LayoutMismatch, ValueUnavailable
from .entry import ExpertLayout, Family

#: Activations tried where the experts have no ``act_fn`` that fits: transformers' usual ones.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu (tanh)": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

#: An expert's weights by name (``gate``, ``up``, ``down``, ``<name>_bias``), ``[E, out, in]``, as `Moe.params` serves.
Views = dict[str, Tensor | None]

#: How many random tokens each probed expert gets.
PROBE_TOKENS = 8


def checked(family: Family, experts: torch.nn.Module) -> bool:
    """Whether `layout_problem` applies: the layout comes from the entry (no transformers flags), the block calls
    its experts as transformers does and they apply no gate of the entry's own (`ExpertGate`)."""
    return (family.expert_layout is not None and not hasattr(experts, "has_gate") and family.experts_call
            and not family.derived_routing and family.expert_gate is None
            and "_ep_size" not in experts.__dict__)  # sharded by moelens.parallel: a probe would need every rank


def layout_problem(layout: ExpertLayout, views_of: Callable[[ExpertLayout], Views], experts: torch.nn.Module,
                   top_k: int) -> tuple[str, str]:
    """What is wrong with the entry's expert ``layout`` for ``experts``, and a warning where it cannot be told.

    ``views_of``: the ``[E, out, in]`` views `Moe.params` serves of the experts with weights under a layout
    (`moelens.components.params.expert_views`), raising `ValueUnavailable` where their shapes do not chain.

    Returns:
        ``(problem, warning)``: ``problem`` names the layout flags (or swapped gate and up names) under which the
        weights recompute the experts' outputs where the entry's do not, or says a fused gate_up holds the up rows
        first, which no flag expresses, or that params() cannot read the weights where the entry's layout says;
        ``warning`` says why the layout was not checked (the experts cannot be called on the probe, or no layout
        and activation tried recomputes them). Both "" where the entry's layout recomputes the experts' outputs.
    """
    candidates = {}  # (layout, up rows first) -> the views, for the layouts whose weights chain, the entry's first
    refusal = ""
    for variant in (layout, *_variants(layout)):
        try:
            candidates[variant, False] = views_of(variant)
        except ValueUnavailable as error:  # shapes that do not chain under it, or weights params() does not serve
            if variant == layout:
                refusal = str(error)
                if not isinstance(error, LayoutMismatch):  # quantized or computed weights: no fault of the layout
                    return "", f"its expert_layout is not checked: params() serves no weights ({refusal})"
    unreadable = (f"params() cannot read the experts' weights with the entry's expert_layout ({layout}): {refusal}"
                  if refusal else "")
    if not candidates:
        return unreadable, ""
    if layout.gate_up is not None:  # a fused parameter holding the up rows first: no ExpertLayout field says so
        candidates |= {(variant, True): _swapped(views) for (variant, _), views in candidates.items()}
    probes, error = None, None
    for views in _one_per_width(candidates.values()):  # the entry's width first: a wrong layout can swap D and H
        try:
            probes = _probes(experts, views, top_k)
            break
        except Exception as raised:  # noqa: BLE001 - whatever the user's module raises on the probe
            error = error or raised
    if probes is None:
        return unreadable, (f"its expert_layout is not checked: the experts module raised {type(error).__name__} when "
                            f"called on random tokens as experts(hidden, top_k_index, top_k_weights) ({error})")
    activations = _activations(experts)
    fitting = next((key for key, views in candidates.items() if _recomputes(views, probes, activations)), None)
    if fitting == (layout, False):
        return "", ""
    if fitting is not None:
        return _misread(layout, *fitting, unreadable), ""
    if unreadable:
        return unreadable, ""
    return "", ("its expert_layout is not checked: no expert output is recomputed from the weights it names with the "
                f"experts' act_fn or {', '.join(ACTIVATIONS)} (experts that compute otherwise, or a layout wrong in a "
                "way no flag fixes)")


def _misread(layout: ExpertLayout, fitting: ExpertLayout, up_first: bool, unreadable: str) -> str:
    """The error for the entry's ``layout`` where ``fitting`` recomputes the experts (with ``gate_up``'s halves the
    other way round, up rows first, where ``up_first``): what to change, or that no field expresses it.
    ``unreadable``: that params() cannot read the weights with ``layout`` at all, and why, or ""."""
    changed = ", ".join(f"{flag.name}={getattr(fitting, flag.name)!r}" for flag in dataclasses.fields(fitting)
                        if getattr(fitting, flag.name) != getattr(layout, flag.name))
    misread = (f"{unreadable.rstrip('.')}; " if unreadable else f"params() reads the experts' weights with the "
               f"entry's expert_layout ({layout}), which recomputes none of the experts' outputs; ")
    if not up_first:
        serves = ("" if unreadable else
                  ", so params() would serve other numbers as the weights, and edits through it land on other rows")
        return misread + f"with {changed} (the rest as it is) they are recomputed{serves}: fix the ExpertLayout"
    also = f", and with {changed}" if changed else ""
    return (misread + f"with the up rows of {layout.gate_up!r} taken before its gate rows{also}, they are recomputed, "
            "so params() would serve the up weights as the gate and the gate weights as the up. No ExpertLayout field "
            "says that a fused gate_up holds the up rows first (gate_up is read gate rows first): store the gate rows "
            "first, or leave expert_layout out of the entry (params() then refuses to serve the weights)")


def _one_per_width(candidates: Any) -> list[Views]:
    """The first of ``candidates`` (views of the experts' weights under some layout) for each hidden width they
    read (the last side of ``up``), in order."""
    widths: dict[int, Views] = {}
    for views in candidates:
        widths.setdefault(views["up"].shape[-1], views)
    return list(widths.values())


def _swapped(views: Views) -> Views:
    """``views`` with gate and up (and their biases) the other way round."""
    return views | {"gate": views["up"], "up": views["gate"],
                    "gate_bias": views.get("up_bias"), "up_bias": views.get("gate_bias")}


def _probes(experts: torch.nn.Module, views: Views, top_k: int) -> list[tuple[int, Tensor, Tensor]]:
    """``(expert, tokens, output)`` for a few experts: each run alone on random tokens by the experts module."""
    generator = torch.Generator().manual_seed(0)
    up = views["up"]
    num_experts = up.shape[0]
    width = up.shape[-1]
    chosen = sorted({0, num_experts // 2, num_experts - 1})
    probes = []
    with torch.no_grad():
        for expert in chosen:
            tokens = torch.randn(PROBE_TOKENS, width, generator=generator).to(device=up.device, dtype=up.dtype)
            slots = (expert + torch.arange(top_k)) % num_experts  # other experts in the other slots, weighed 0
            indices = slots.expand(PROBE_TOKENS, top_k).contiguous().to(up.device)
            weights = torch.zeros(PROBE_TOKENS, top_k, dtype=up.dtype, device=up.device)
            weights[:, 0] = 1
            # the class's forward: no hook of the user's (or nnsight's) on the module sees the probe
            probes.append((expert, tokens, type(experts).forward(experts, tokens, indices, weights)))
    return probes


def _activations(experts: torch.nn.Module) -> list[Callable[[Tensor], Tensor]]:
    act_fn = getattr(experts, "act_fn", None)
    return ([act_fn] if callable(act_fn) else []) + list(ACTIVATIONS.values())


def _recomputes(views: Views, probes: list[tuple[int, Tensor, Tensor]],
                activations: list[Callable[[Tensor], Tensor]]) -> bool:
    """Whether one of ``activations`` recomputes every probe's output from ``views``."""
    for act in activations:
        try:
            if all(_close(_expert_output(views, expert, tokens, act), output) for expert, tokens, output in probes):
                return True
        except RuntimeError:  # weights whose sides do not fit the tokens under this layout
            return False
    return False


def _expert_output(views: Views, expert: int, tokens: Float[Tensor, "t d"],
                   act: Callable[[Tensor], Tensor]) -> Float[Tensor, "t d"]:
    """Expert ``expert``'s output on ``tokens`` from the ``[out, in]`` weights ``views``."""
    def linear(name: str, x: Tensor) -> Tensor:
        bias = views[f"{name}_bias"]
        return F.linear(x, views[name][expert], None if bias is None else bias[expert])

    with torch.no_grad():
        hidden = act(linear("up", tokens)) if views["gate"] is None else act(linear("gate", tokens)) * linear("up", tokens)
        return linear("down", hidden)


def _close(mine: Tensor, theirs: Any) -> bool:
    if not isinstance(theirs, Tensor) or theirs.numel() != mine.numel():
        return False
    theirs = theirs.reshape(mine.shape)  # experts that give the tokens back as [T, 1, D] (dbrx's)
    full = theirs.dtype in (torch.float32, torch.float64)
    scale = float(theirs.float().abs().max())
    tolerance = (1e-4 if full else 2e-2) * max(scale, 1e-30)
    return bool((mine.float() - theirs.float()).abs().max() <= tolerance)


def _variants(layout: ExpertLayout) -> list[ExpertLayout]:
    """Every other setting of the layout's flags (concatenated only where gate and up are fused), each also with
    the separate gate and up parameters' names swapped where it names both."""
    flags = ["transposed", "down_transposed", "stacked"] + (["concatenated"] if layout.gate_up is not None else [])
    swaps = (False, True) if layout.gate is not None and layout.up is not None else (False,)
    variants = []
    for swap, values in itertools.product(swaps, itertools.product((False, True), repeat=len(flags))):
        variant = dataclasses.replace(layout, **dict(zip(flags, values)))
        if swap:
            variant = dataclasses.replace(variant, gate=layout.up, up=layout.gate)
        if variant != layout:
            variants.append(variant)
    return variants
