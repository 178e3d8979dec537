"""Check a family entry against what its model computes: `check(model, inputs)`.

A registered entry can be wrong in ways no read refuses, since the values it describes are derived, not read:
a score function or normalisation that does not give the weights the experts get (`router_probs`, the routing
analysis and the export's gate then follow other numbers), or a `Combine` / shared expert that does not make the
block's output of its routed and shared outputs. `check` runs the model once and recomputes both from the values
served in that run.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from ..errors import FamilyError
from .scoring import score

#: Routers whose weights are no function of the chosen experts' scores alone, so the check cannot recompute them.
UNCHECKED_SELECTIONS = {
    "sparsemixer": "phimoe's sparse mixer weighs each slot by a masked softmax of its own",
    "skip_topk": "a slot that chose the skip class is served as expert 0 with weight 0",
}

#: Values `check` reads from every block.
CHECKED_VALUES = ("router_logits", "expert_weights", "expert_indices", "routed_output", "shared_expert_output",
                  "mlp_output")


def check(model: Any, *args: Any, **kwargs: Any) -> list[str]:
    """Run ``model`` once on the inputs (``model.trace(*args, **kwargs)``) and check its MoE blocks' family entries.

    For each block that runs: the entry's `Scoring` (score function, normalisation, scale; `select` picks which
    scores) applied to the served logits at the served expert indices gives the weights the experts got; and the
    entry's `Combine` of the served routed and shared outputs gives the block's output. Meant for an entry of your
    own (`register`) on a model you trust: moelens' own entries pass on every family's tiny model.

    Returns:
        The paths of the blocks checked.

    Raises:
        FamilyError: what does not match, block by block, with the settings to fix (for the weights: which of
            score, select, normalize and scale to change so that the scoring gives them, where one does).
    """
    from ..analysis.collect import check_wrapped  # analysis imports the components, which import the families

    check_wrapped(model)
    moes = [moe for moe in model.moes if not moe.runs_only_on]
    if not moes:
        raise FamilyError("check: the model has no MoE block that runs on every input; nothing to check.")
    with torch.no_grad(), model.trace(*args, **kwargs):
        saved = model.save_all(list(CHECKED_VALUES), moes=moes)
    problems = []
    for moe, values in zip(moes, saved.values()):
        problems += [f"{moe.path}: {problem}" for problem in (_weights_problem(moe, values), _output_problem(moe, values))
                     if problem]
    if problems:
        raise FamilyError(f"the family entry does not describe what the model computes:\n- " + "\n- ".join(problems))
    return [moe.path for moe in moes]


def _tolerance(*tensors: torch.Tensor | None) -> dict[str, float]:
    """How far a recomputation may be from ``tensors`` (what it was made of and what it is compared with): the
    rounding of the least precise of them."""
    full = all(tensor is None or tensor.dtype in (torch.float32, torch.float64, torch.int64, torch.int32)
               for tensor in tensors)
    return {"atol": 1e-5, "rtol": 1e-4} if full else {"atol": 1e-2, "rtol": 1e-2}


def chosen_weights(logits: torch.Tensor, indices: torch.Tensor, score_name: str, select: str, normalize: bool,
                   scale: float | None, softcap: float = 0.0) -> torch.Tensor:
    """The weights ``[..., k]`` a router gives the experts at ``indices``: the scores of the chosen logits
    (``logit_topk``) or the chosen scores of every logit (any other selection), renormalised over the k if asked,
    times ``scale``."""
    logits = logits.float()
    if select == "logit_topk":
        chosen = score(score_name, logits.gather(-1, indices), softcap)
    else:
        chosen = score(score_name, logits, softcap).gather(-1, indices)
    if normalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    return chosen * scale if scale is not None else chosen


def _weights_problem(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """What is wrong with the entry's scoring on this block's run, or ""."""
    family, block, scoring = moe.family, moe._module, moe.SCORING
    if family.derived_routing or scoring.select in UNCHECKED_SELECTIONS or family.resolve(family.extra_logits, block):
        return ""  # derived from the logits by moelens itself, or not from the chosen scores alone
    logits, indices, weights = values["router_logits"], values["expert_indices"], values["expert_weights"]
    score_name = family.resolve(scoring.score, block)
    normalize = bool(family.resolve(scoring.normalize, block))
    scale = family.resolve(scoring.scale, block)
    scale = None if scale is None else float(scale)
    softcap = family.softcap_of(block)
    entry = chosen_weights(logits, indices, score_name, scoring.select, normalize, scale, softcap)
    tolerance = _tolerance(logits, weights)
    if torch.allclose(weights.float(), entry, **tolerance):
        return ""
    difference = float((weights.float() - entry).abs().max())
    return (f"the weights its experts got are not what the scoring of family {family.name!r} gives "
            f"({_described(scoring)}; largest difference {difference:.3g}): "
            f"{_fitting(weights.float(), logits, indices, (score_name, scoring.select, normalize), scale, softcap, tolerance)}. "
            "router_probs, the routing analysis and the export follow the entry: fix it and register it again.")


def _fitting(weights: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, own: tuple[str, str, bool],
             scale: float | None, softcap: float, tolerance: dict[str, float]) -> str:
    """Which settings to change so the scoring gives ``weights``: the entry's own score, selection and
    normalisation up to a factor (the scale), else the softmax / sigmoid, normalised or not, that fits (named by
    what differs from the entry)."""
    score_name, select, normalize = own
    ranks_logits = select == "logit_topk"
    for name, by_logits, renormalised in itertools.product(
            dict.fromkeys((score_name, "softmax", "sigmoid")), (ranks_logits, not ranks_logits), (normalize, not normalize)):
        candidate = chosen_weights(logits, indices, name, "logit_topk" if by_logits else "score_topk", renormalised,
                                   None, softcap)
        ratio = _factor(weights, candidate, tolerance)
        if ratio is None:
            continue
        changes = [f"score={name!r}"] * (name != score_name) + [
            "select='logit_topk'" if by_logits else "select='score_topk'"] * (by_logits != ranks_logits) + [
            f"normalize={renormalised}"] * (renormalised != normalize)
        if not math.isclose(ratio, scale if scale is not None else 1.0, rel_tol=1e-3):
            changes.append(f"scale={ratio:.4g}")
        return f"with {', '.join(changes)} (the entry's other settings as they are) it gives them"
    return "no softmax / sigmoid scoring of the logits or of the chosen ones, normalised or not, gives them"


def _factor(weights: torch.Tensor, candidate: torch.Tensor, tolerance: dict[str, float]) -> float | None:
    """The constant ``weights`` are ``candidate`` times (a router's scale), or None when they are not."""
    ratio = weights.sum() / candidate.sum()
    if not torch.isfinite(ratio) or not torch.allclose(weights, candidate * ratio, **tolerance):
        return None
    return float(ratio)


def _described(scoring: Any) -> str:
    return (f"score={scoring.score!r}, select={scoring.select!r}, normalize={scoring.normalize!r}, "
            f"scale={scoring.scale!r}")


def _output_problem(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """What is wrong with the entry's recombination on this block's run, or ""."""
    if "mlp_output" not in values or "routed_output" not in values:
        return ""
    family, block = moe.family, moe._module
    with torch.no_grad():
        combined = family.combined(block, values["routed_output"], values.get("shared_expert_output"))
    output = values["mlp_output"]
    if torch.allclose(combined.float(), output.float(),
                      **_tolerance(output, values["routed_output"], values.get("shared_expert_output"))):
        return ""
    shared = ("with the shared expert's output" if "shared_expert_output" in values
              else "without a shared expert (the entry names none, or the block has none)")
    return (f"the Combine of family {family.name!r} ({family.combine}) of routed_output, {shared}, is not the block's output "
            f"(largest difference {float((combined.float() - output.float()).abs().max()):.3g}): check Combine "
            "(routed_scale, mode, routed_post, block_post) and SharedExpert (the module, its gate).")
