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
import re
from dataclasses import replace
from typing import Any

import nnsight
import torch

from ..errors import FamilyError, OrderError, ValueUnavailable, warn
from ..modules import loaded_tensor
from . import layout_check, registry
from .entry import SHARED_TIMES, beneath_adapters, find_path
from .scoring import SCORE_FUNCTIONS, chosen_weights, kept_groups, score
from .tomoe import converted

#: Routers whose weights are no function of the chosen experts' scores alone, so the check cannot recompute them.
UNCHECKED_SELECTIONS = {
    "sparsemixer": "phimoe's sparse mixer weighs each slot by a masked softmax of its own",
    "skip_topk": "a slot that chose the skip class is served as expert 0 with weight 0",
}

#: What to do about an entry `check` finds wrong: a wrapped model keeps the entry it was wrapped with.
REREGISTER = ("Fix the entry, register it again (moelens.families.register(Family(...), replace=True)) and wrap the "
              "model again (moelens.wrap(model._module)): a wrapped model keeps the entry it was wrapped with.")

#: Values `check` reads from every block.
CHECKED_VALUES = ("router_logits", "expert_weights", "expert_indices", "routed_output", "shared_expert_output",
                  "mlp_output")

#: The values the checks of the entry's selection and scoring are made of: a block must serve them.
ROUTING_VALUES = CHECKED_VALUES[:3]


def check(model: Any, *args: Any, **kwargs: Any) -> list[str]:
    """Run ``model`` on the inputs (``model.trace(*args, **kwargs)``) and check its MoE blocks' family entries.

    For each block that runs: under top-k selection the served experts are the top k of what the entry ranks
    (`_selection_problem`); where the router ranks selection scores, the op the entry reads them at holds the
    scores plus the selection bias (`_selection_scores_problem`, read in a second run); the entry's `Scoring`
    (score function, normalisation and its floor, scale; `select` picks which scores) applied to the served logits
    at the served expert indices gives the weights the experts got; and the entry's `Combine` of the served routed and shared
    outputs gives the block's output. Meant for an entry of your own (`register`) on a model you trust: moelens'
    own entries pass on every family's tiny model.

    Returns:
        The paths of the blocks checked (a block whose weights are no function of its logits and indices alone,
        `UNCHECKED_SELECTIONS` or extra logit columns, has its output checked, and a warning says so).

    Raises:
        FamilyError: what does not match, block by block, with the settings to fix where some fit (for the
            weights: score, select, normalize, scale; for the output: Combine's mode and routed_scale); also when
            called inside a trace or without inputs the model runs on.
    """
    from ..model import check_wrapped  # the model imports the families
    from ..components.served import trace_running

    check_wrapped(model)
    if trace_running("check"):
        raise FamilyError("check runs the model itself, which it cannot do from inside a trace while that trace runs "
                          "the model: call it after the with-block.")
    if not args and not kwargs:
        raise FamilyError(f"check runs the model once on inputs: {USAGE}.")
    if not model.moes:
        raise FamilyError(
            "check: no block of this model is served as a Moe (model.moes is []), so there is no family entry to "
            "check. A model keeps what it was wrapped with: if its family was registered after wrapping, wrap it "
            "again (moelens.wrap(model._module)) and check that."
        )
    from ..components.base import put_in_after_wrap, refuse_replaced, replaced_blocks

    refuse_replaced(model, replaced_blocks(model) + [moe.path for moe in model.moes if put_in_after_wrap(moe)], "check",
                    "its values would not be the entry's to check", FamilyError)
    moes = [moe for moe in model.moes if not moe.runs_only_on]
    if not moes:
        raise FamilyError("check: the model has no MoE block that runs on every input; nothing to check.")
    try:
        saved = _read_values(model, moes, args, kwargs)
    except OrderError:  # the model may run its blocks in another order than model.moes lists: one block a run
        saved = []
        for moe in moes:
            try:
                saved += _read_values(model, [moe], args, kwargs)
            except OrderError as error:  # nothing else is read in this run: the entry's order is not the forward's
                raise FamilyError(f"the family entry does not describe what the model computes: "
                                  f"{_order_problem(moe, error)}\n{REREGISTER}") from None
    computed_nan = [problem for problem in (_computed_nan(moe, values) for moe, values in zip(moes, saved)) if problem]
    if computed_nan:
        later = f" (and in {len(computed_nan) - 1} later blocks)" if len(computed_nan) > 1 else ""
        raise FamilyError(
            f"check: the model computes NaN on these inputs, first at {computed_nan[0]}{later}, so what it computes "
            "cannot be compared with the family entry (the entry may well be right). Find where the NaN comes from (the "
            "weights: [name for name, p in model.named_parameters() if p.isnan().any()]; or the inputs) and check the "
            "entry on a model and inputs that compute finite values."
        )
    unchecked = {moe.path: unrecomputable_weights(moe) for moe in moes}
    selections, unread = _read_selection_scores(model, [moe for moe in moes if not unchecked[moe.path]], args, kwargs)
    problems, unscored, unchecked_layouts = [], {}, {}
    if unread:
        problems.append(f"its selection_scores cannot be read ({unread.rstrip('.')}). {SELECTION_FIX}")
    dropping = {moe.path for moe in moes if _drops_out(moe._module)}
    gates = _shared_gate_problems(model, [moe for moe in moes if moe.path not in dropping], args, kwargs)
    for moe, values in zip(moes, saved):
        layout, unchecked_layouts[moe.path] = _layout_problem(moe)
        unread = "" if unchecked[moe.path] else _unread_routing(model, moe, values, args, kwargs)
        routing = not unchecked[moe.path] and not unread
        found = (unread, _selection_problem(moe, values) if routing else "",
                 _selection_scores_problem(moe, *selections[moe.path]) if moe.path in selections else "",
                 _weights_problem(moe, values) if routing else "",
                 "" if moe.path in dropping else _output_problem(moe, values), gates.get(moe.path, ""), layout)
        problems += [f"{moe.path}: {problem}" for problem in found if problem]
        if routing:
            unscored[moe.path] = _score_unchecked(moe, values)
    if problems:
        raise FamilyError("the family entry does not describe what the model computes:\n- " + "\n- ".join(problems)
                          + f"\n{REREGISTER}")
    notes: dict[str, list[str]] = {}  # what was left unchecked -> the blocks it was left unchecked in
    for moe, values in zip(moes, saved):
        reason, output_checked = unchecked[moe.path], "mlp_output" in values and "routed_output" in values
        if reason and output_checked:
            notes.setdefault(f"its block output is checked, its expert weights are not ({reason})", []).append(moe.path)
        elif reason or not output_checked:
            served = "routed_output" if "routed_output" not in values else "mlp_output"
            notes.setdefault(
                f"its block output is not checked (the block serves no {served}), "
                + (f"nor are its expert weights ({reason}): the entry's scoring, Combine and shared expert are taken "
                   "as they are" if reason else "so the entry's Combine and shared expert are taken as they are"),
                []).append(moe.path)
    for path, reason in unscored.items():
        if reason:
            notes.setdefault(f"its expert weights and output are checked, its score function is not ({reason})",
                             []).append(path)
    for path, reason in unchecked_layouts.items():
        if reason:
            notes.setdefault(reason, []).append(path)
    for moe in moes:
        if moe.SCORING.selection_bias and not moe.ranks_selection_scores and not registry.is_built_in(moe.family):
            notes.setdefault(
                "its entry names a selection bias but no op where the router ranks scores plus that bias "
                "(Scoring.selection_op, with selection_arg where the bias is added inside the top-k call), so it serves "
                "no selection_scores, and route_around can only lower the logit (refused where the bias still picks "
                f"the expert). {_router_ops(moe, moe.family.logits_op)} Name the op there to rank experts out where "
                "the router ranks them", []).append(moe.path)
    for path in sorted(dropping):
        notes.setdefault("its block output is not checked: the block is in training mode with dropout on, so its "
                         "output is no function of its routed and shared outputs; call model.eval() first to check it",
                         []).append(path)
    for note, paths in notes.items():  # one warning each, not one a block (a 48-layer model printed 48)
        blocks = ", ".join(paths) if len(paths) <= 3 else f"{len(paths)} blocks ({paths[0]}, ..., {paths[-1]})"
        warn(f"moelens.families.check: {blocks}: {note}.")
    return [moe.path for moe in moes]


def _shared_gate_problems(model: Any, moes: list[Any], args: tuple, kwargs: dict) -> dict[str, str]:
    """Block path -> what is wrong, for the blocks of ``moes`` whose entry names a gate of the shared expert
    (`SharedExpert` gate and gated_op) where the shared output served at gated_op is not ``sigmoid(gate(x)) *
    shared(x)`` of what the two modules return in one run on the inputs (what the export computes; a gate path naming
    the router passed check, and ``moe.shared_gate`` served the router's output)."""
    gated = [moe for moe in moes if moe.family.shared is not None and moe.family.shared.gate
             and moe.family.shared.gated_op]
    if not gated:
        return {}
    returned, handles = {}, []
    for moe in gated:
        for part in ("gate", "module"):
            module = find_path(moe._module, getattr(moe.family.shared, part))
            if isinstance(module, torch.nn.Module):
                handles.append(module.register_forward_hook(
                    lambda _, __, output, key=(moe.path, part): returned.setdefault(key, output)))
    try:
        with torch.no_grad(), model.trace(*args, **kwargs):
            served = model.save_all(["shared_expert_output"], moes=gated)
    finally:
        for handle in handles:
            handle.remove()
    problems = {}
    for moe, values in zip(gated, served.values()):  # in the order of moes, keyed by layer
        shared, value = moe.family.shared, values.get("shared_expert_output")
        gate, raw = returned.get((moe.path, "gate")), returned.get((moe.path, "module"))
        if value is None or not isinstance(raw, torch.Tensor):
            continue
        value, raw = value.reshape(-1, value.shape[-1]).float(), raw.reshape(-1, raw.shape[-1]).float()
        fits = (isinstance(gate, torch.Tensor) and gate.numel() == len(value) == len(raw)
                and torch.allclose(torch.sigmoid(gate.reshape(-1, 1).float()) * raw, value, **_tolerance(gate, value)))
        if not fits:
            got = (f"returns {list(gate.shape)}" if isinstance(gate, torch.Tensor) else
                   f"returns a {type(gate).__name__}" if gate is not None else "did not run")
            problems[moe.path] = (
                f"SharedExpert gate={shared.gate!r} {got}, and the sigmoid of it times the output of "
                f"{shared.module!r} is not the gated shared output read at gated_op={shared.gated_op!r}: name the "
                "module whose one output per token gates the shared expert (the block's children: "
                f"{', '.join(name for name, _ in moe._module.named_children())})")
    return problems


def _read_values(model: Any, moes: list[Any], args: tuple, kwargs: dict) -> list[dict[str, torch.Tensor]]:
    """`CHECKED_VALUES` of each of ``moes`` (those each serves), read in one run of ``model`` on the inputs."""
    from ..components.served import trace_running

    with torch.no_grad(), model.trace(*args, **kwargs):
        if not trace_running("check"):  # nnsight takes keywords it does not know for no input at all
            raise FamilyError(f"check: the model did not run on the inputs given (keywords {sorted(kwargs)}): {USAGE}.")
        saved = model.save_all(list(CHECKED_VALUES), moes=moes)
    return list(saved.values())


def _computed_nan(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """Which of ``moe``'s served ``values`` hold NaN and on how many tokens, or "" (the model's own NaN, which no entry
    could match)."""
    held = {name: value.isnan().flatten(2).any(-1) if value.dim() > 2 else value.isnan()
            for name, value in values.items() if value.is_floating_point() and bool(value.isnan().any())}
    if not held:
        return ""
    first = next(iter(held.values()))
    return (f"{moe.path}: {', '.join(held)} hold{'s' * (len(held) == 1)} NaN (at {int(first.sum())} of "
            f"{first.numel()} tokens in {next(iter(held))})")


def _drops_out(block: torch.nn.Module) -> bool:
    """Whether ``block`` drops out part of what it computes in this run (a dropout with p > 0, in training mode)."""
    return any(isinstance(module, torch.nn.Dropout) and module.p > 0 and module.training for module in block.modules())


def _layout_problem(moe: Any) -> tuple[str, str]:
    """What is wrong with the entry's `ExpertLayout` for ``moe``'s experts, and why it is not checked (`layout_check`);
    ("", "") where the layout comes from transformers' flags or the entry has none."""
    family, block = moe.family, moe._module
    experts = find_path(block, beneath_adapters(block, family.experts))  # the family's own module: its base weights
    # and its own forward on them, which keep the layout the adapted ones run in
    if not isinstance(experts, torch.nn.Module) or not layout_check.checked(family, experts):
        return "", ""
    from ..components.params import expert_views

    identity = family.identity_count(block)
    return layout_check.layout_problem(
        family.expert_layout,
        lambda layout: expert_views(replace(family, expert_layout=layout), experts, moe.num_experts - identity, identity),
        experts, moe.top_k)


#: How `check` is called, for its errors.
USAGE = "check(model, \"some text\") or check(model, input_ids=..., attention_mask=...), as model.trace takes them"


def unrecomputable_weights(moe: Any) -> str:
    """Why ``moe``'s expert weights cannot be recomputed from its logits and indices, or ""."""
    family, block = moe.family, moe._module
    select = moe.SCORING.select
    if family.derived_routing:
        return ("moelens derives them from the logits with the entry's scoring itself, so a wrong Scoring or top_k "
                "goes unseen here: compare moe.expert_weights and moe.expert_indices with your block's own once")
    if select in UNCHECKED_SELECTIONS:
        return UNCHECKED_SELECTIONS[select]
    if family.resolve(family.extra_logits, block):
        return "the router normalises them together with its extra logit columns"
    return ""


def _tolerance(*tensors: torch.Tensor | None) -> dict[str, float]:
    """How far a recomputation may be from ``tensors`` (what it was made of and what it is compared with): the
    rounding of the least precise of them."""
    full = all(tensor is None or tensor.dtype in (torch.float32, torch.float64, torch.int64, torch.int32)
               for tensor in tensors)
    return {"atol": 1e-5, "rtol": 1e-4} if full else {"atol": 1e-2, "rtol": 1e-2}


def _ranking_tolerance(logits: torch.Tensor) -> dict[str, float]:
    """How far below the k-th best of what the entry ranks a chosen expert may lie: float32's rounding, or two steps
    of the logits' dtype where the router ranks in float16 / bfloat16 (a fixed 1e-2 was some 10% of softmax scores
    near 1/E, and let a wrong groups entry pass)."""
    tolerance = _tolerance(logits)
    if logits.dtype in (torch.float32, torch.float64):
        return tolerance
    return {"atol": 1e-6, "rtol": 2 * torch.finfo(logits.dtype).eps}


def _weights_tolerance(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far the entry's recomputed weights may be from the block's: the rounding of its logits and weights, plus
    half a relative step of its output's dtype where the weights lie on that coarser dtype's grid (a router that
    rounds its float32 weights to the hidden states' dtype and back, as ergo's does: there a scale off by less than
    that half step, 0.4% in bfloat16, cannot be seen). Not for every float32 router of a bfloat16 model, or a scale
    0.5% off would pass, and sigmoid would not be told from sqrtsoftplus."""
    tolerance = _tolerance(values["router_logits"], values["expert_weights"])
    output, weights = values.get("mlp_output"), values["expert_weights"]
    if output is not None and output.is_floating_point() and weights.is_floating_point() and \
            torch.finfo(output.dtype).eps > torch.finfo(weights.dtype).eps and \
            torch.equal(weights, weights.to(output.dtype).to(weights.dtype)):
        tolerance["rtol"] += torch.finfo(output.dtype).eps / 2
    return tolerance


def _selection_problem(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """What is wrong with the experts the entry says the router picks, or "": under top-k selection (`score_topk`,
    `logit_topk`, `group_topk`) the experts served are the top k of what the entry ranks (the logits, or the scores
    plus the entry's selection bias), inside the best groups where the entry names groups (`kept_groups`; tokens
    whose kept groups are a close call are left out). A router that ranks something else (a bias it adds for
    selection only, or groups, left out of the entry or read wrong) picks others, and `route_around` / `force`
    would act on the wrong ranking."""
    family, block, scoring = moe.family, moe._module, moe.SCORING
    if scoring.select not in ("score_topk", "logit_topk", "group_topk"):
        return ""
    indices = values["expert_indices"]
    ranked, what = _entry_ranking(moe, values["router_logits"])
    groups = family.groups_of(block)
    close = torch.zeros(ranked.shape[:-1], dtype=torch.bool, device=ranked.device)
    if groups is not None:
        # a router scoring in the logits' own dtype (mistral4) rounds its group scores by a step or two
        ranked, close = kept_groups(ranked, *groups, scoring.group_score, scoring.group_fill,
                                    max(1e-5, 2 * torch.finfo(values["router_logits"].dtype).eps))
        what += (f", inside the best {groups[1]} of {groups[0]} groups (a group scored by "
                 f"{'the sum of its best two' if scoring.group_score == 'top2_sum' else 'its best expert'}, "
                 f"the others' experts set to {scoring.group_fill})")
    tolerance = _ranking_tolerance(values["router_logits"])
    kth = ranked.topk(indices.shape[-1], dim=-1).values[..., -1:]
    below = (ranked.gather(-1, indices.long()) < kth - tolerance["atol"] - tolerance["rtol"] * kth.abs()).any(-1)
    below &= ~close
    if not below.any():
        return ""
    remedy = ("check selection_bias and select" if scoring.selection_bias else
              "if the router adds a bias to the scores for picking only, name it (Scoring.selection_bias) and the op "
              "whose output it ranks (Scoring.selection_op)")
    remedy += ("; check groups (what n_group and topk_group are read from), group_score and group_fill"
               if groups is not None else "; if it picks inside groups, Scoring.groups")
    return (f"the experts chosen for {int(below.sum())} of {below.numel()} tokens are not the top {indices.shape[-1]} "
            f"of what the scoring of family {family.name!r} ranks ({what}; {_described(scoring)}): the router ranks "
            f"something else; {remedy}. route_around and force act on the entry's ranking.")


def _entry_ranking(moe: Any, logits: torch.Tensor) -> tuple[torch.Tensor, str]:
    """What the entry says ``moe``'s router ranks before any group is dropped ``[..., E]`` (the ``logits`` under
    ``logit_topk``, else their scores; plus the selection bias where the block has one), and that in words."""
    family, block, scoring = moe.family, moe._module, moe.SCORING
    ranked, what = logits.float(), "its logits"
    if scoring.select != "logit_topk":
        score_name = family.score_of(block)
        ranked, what = score(score_name, ranked, family.softcap_of(block)), f"its {score_name} scores"
    if family.holds(scoring.selection_bias, block):
        bias = loaded_tensor(block, family.selection_bias_of(block, ranked.shape[-1]))  # offloaded: on meta here
        ranked = ranked + bias.detach().float().to(ranked.device)
        what += f" plus {scoring.selection_bias}"
    return ranked, what


def _unread_routing(model: Any, moe: Any, values: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> str:
    """Why ``moe`` serves not every one of `ROUTING_VALUES` (the reason its strict read gives, in one more run on
    the inputs: experts called otherwise than ``experts(hidden, top_k_index, top_k_weights)``, say), or ""."""
    missing = [name for name in ROUTING_VALUES if name not in values]
    if not missing:
        return ""
    try:
        with torch.no_grad(), model.trace(*args, **kwargs):
            moe.save_all(missing, strict=True)
    except (ValueUnavailable, OrderError) as error:
        return f"its {missing[0]} cannot be read, so the entry's selection and scoring cannot be checked: {error}"
    return f"its {', '.join(missing)} could not be read in the first run on these inputs; check the entry's names"


def _read_selection_scores(model: Any, moes: list[Any], args: tuple, kwargs: dict
                           ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str]:
    """``(router_logits, selection_scores)`` of each of ``moes`` whose router ranks selection scores
    (`Moe.ranks_selection_scores`), read in one more run on the inputs (one a block where the model runs its blocks
    in another order than model.moes lists); with the error that stopped the run, or "" (a read at an op that holds
    no scores per token)."""
    ranking = [moe for moe in moes if moe.ranks_selection_scores]
    if not ranking:
        return {}, ""
    read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for blocks in (ranking, *([moe] for moe in ranking)):
        try:
            with torch.no_grad(), model.trace(*args, **kwargs):
                got = nnsight.save({moe.path: (moe.router_logits.save(), moe.selection_scores.save())
                                    for moe in blocks})
        except (FamilyError, ValueUnavailable) as error:
            return {}, str(error)
        except OrderError:  # the op the entry names runs before the logits op (in a run of one block)
            if len(blocks) == 1:
                return {}, (f"the op {_selection_named(blocks[0])} names runs before logits_op="
                            f"{blocks[0].family.logits_op!r} in the router's forward, so it holds no score of those "
                            "logits")
            continue
        read.update(got)
        if blocks is ranking:  # every block read in one run
            break
    return read, ""


def _selection_scores_problem(moe: Any, logits: torch.Tensor, selection: torch.Tensor) -> str:
    """What is wrong with the op the entry reads ``moe``'s `selection_scores` at, or "": they are what the router
    ranks, the scores plus the selection bias (`_entry_ranking`). Read elsewhere (the scores without the bias),
    ``force`` and ``route_around`` write at the wrong op: the router ranks other numbers, or weighs its experts by
    the +inf written there."""
    ranked, what = _entry_ranking(moe, logits)
    tolerance = _tolerance(logits, selection)
    if selection.shape == ranked.shape and torch.allclose(selection.float(), ranked, **tolerance):
        return ""
    difference = (f"largest difference {float((selection.float() - ranked).abs().max()):.3g}"
                  if selection.shape == ranked.shape else f"shape {list(selection.shape)}, not {list(ranked.shape)}")
    return (f"its selection_scores, read where {_selection_named(moe)} names, are not what the router ranks by the "
            f"entry ({what}; {difference}): force and route_around write there, so the router would rank other "
            f"numbers or weigh its experts by what is written. {SELECTION_FIX}"
            + ("" if moe.SCORING.selection_in else f" {_router_ops(moe)}"))


#: What to do about a `Scoring.selection_op` / `selection_arg` that reads no selection scores.
SELECTION_FIX = ("Name in Scoring.selection_op the router op whose output is the scores plus the selection bias "
                 "(choice = scores + bias), or the top-k call that ranks them with Scoring.selection_arg the position "
                 "of its argument that holds them (0 for torch.topk(scores + bias, k)).")


def _selection_named(moe: Any) -> str:
    """The entry's settings that say where ``moe``'s `selection_scores` are read, as written in a `Scoring`."""
    scoring = moe.SCORING
    return f"Scoring(selection_op={scoring.selection_op!r}, selection_arg={scoring.selection_arg!r})"


def _order_problem(moe: Any, error: OrderError) -> str:
    """Why ``moe``'s values could not be read in the order its entry gives (``error``, raised by its `save_all`)."""
    late = re.search(r"could not read (\S+?):", str(error))
    shared = moe.family.shared
    if late is None or shared is None:
        return (f"check reads the values of {moe.path} once, in the order the entry gives (its shared expert's "
                "SharedExpert.when, the router before the experts), and the model had run past one of them, so the "
                f"block's forward runs them in another order: {error}")
    return (f"check reads the values of {moe.path} once, in the order the entry gives ({' -> '.join(moe.order())}: "
            f"SharedExpert(when={shared.when!r})), and the model had already run past {late.group(1)} when check "
            "asked for it, so the block's forward calls its shared expert elsewhere: set SharedExpert.when to where "
            f"the block calls it, one of {SHARED_TIMES} (before its router, between the router and the experts, after "
            "the experts, or on the block's output).")


def _router_ops(moe: Any, after: str | None = None, marked: str | None = None) -> str:
    """The ops nnsight knows in ``moe``'s router's forward (those after the op ``after`` where it names one; the op
    ``marked`` marked as the entry's logits_op), as a sentence for an error; "" where there are none to list."""
    try:
        names = list(moe.router.source.names)
    except Exception:  # noqa: BLE001 - a router without readable source: its ops cannot be listed
        return ""
    where = "in its forward"
    if after in names:
        names, where = names[names.index(after) + 1:], f"after {after}"
    names = [f"{name} (logits_op now)" if name == marked else name for name in names]
    return f"The router's ops {where}: {', '.join(names)}." if names else ""


def _look_like_scores(logits: torch.Tensor) -> str:
    """A sentence where the served ``logits`` [..., E] lie in [0, 1] (scores: a logits_op naming the score function's
    output, or an op after it), else ""."""
    logits = logits.float()
    if logits.numel() == 0 or logits.min() < 0 or logits.max() > 1:
        return ""
    if torch.allclose(logits.sum(-1), torch.ones(())):
        return (" The values served as router_logits all lie in [0, 1], summing to 1 in each token: a softmax's "
                "scores, not logits; name the op before the score function as logits_op.")
    return (" The values served as router_logits all lie in [0, 1]: if they are scores (a sigmoid's), name the op "
            "before the score function as logits_op.")


def _weights_problem(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """What is wrong with the entry's scoring on this block's run (one whose weights it can recompute), or ""."""
    family, scoring = moe.family, moe.SCORING
    logits, indices, weights = values["router_logits"], values["expert_indices"], values["expert_weights"]
    score_name, normalize, scale, softcap, floor, per_expert = scoring_settings(moe)
    entry = chosen_weights(logits, indices, score_name, scoring.select, normalize, scale, softcap, floor, per_expert)
    tolerance = _weights_tolerance(values)
    if torch.allclose(weights.float(), entry, **tolerance):
        return ""
    difference = float((weights.float() - entry).abs().max())
    fitting = _fitting(weights.float(), logits, indices, (score_name, scoring.select, normalize), scale, softcap,
                       tolerance, floor, per_expert)
    if fitting.startswith(NOTHING_FITS):
        fitting += (f"; or the Scoring is right and logits_op is wrong: logits_op={family.logits_op!r} may name "
                    "another tensor than the one the router scores (such as the logits before the router divides them "
                    f"by a temperature): name the op whose output it scores.{_look_like_scores(logits)} "
                    f"{_router_ops(moe, marked=family.logits_op)}")
        if family.routing_from_router is None:
            fitting += (" Or the block changes the router's weights before its experts call (drops tokens past an "
                        "expert's capacity, say): where the router returns its weights and indices, name their "
                        "positions in its output with routing_from_router=(weights, indices), read there as the router "
                        "chose them")
    return (f"the weights its experts got are not what the scoring of family {family.name!r} gives "
            f"({_described(scoring)}; largest difference {difference:.3g}): {fitting.rstrip('.')}. "
            "router_probs, the routing analysis and the export follow the entry.")


def scoring_settings(moe: Any) -> tuple[str, bool | float, float | None, float, float, torch.Tensor | None]:
    """The entry's score function, normalisation (`chosen_weights`), scale, softcap, normalisation floor and
    multiplier per expert for ``moe``'s block."""
    family, block = moe.family, moe._module
    return (family.score_of(block), family.normalize_of(block), family.scale_of(block), family.softcap_of(block),
            family.normalize_min_of(block), loaded_tensor(block, family.expert_scale_of(block)))


def _score_unchecked(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """Why this run's weights cannot tell the entry's score function from the others, or "": where another score
    function gives the same weights (one expert per token, renormalised, weighs 1 under any), a wrong one passes,
    and `router_probs` would follow it."""
    score_name, normalize, scale, softcap, floor, per_expert = scoring_settings(moe)
    logits, indices, weights = values["router_logits"], values["expert_indices"], values["expert_weights"]
    tolerance = _weights_tolerance(values)
    alike = [other for other in SCORE_FUNCTIONS if other != score_name and torch.allclose(
        weights.float(), chosen_weights(logits, indices, other, moe.SCORING.select, normalize, scale, softcap, floor,
                                        per_expert), **tolerance)]
    if not alike:
        return ""
    return (f"the weights its experts got are what {' or '.join(map(repr, alike))} scoring gives too "
            f"({indices.shape[-1]} expert(s) per token, select={moe.SCORING.select!r}, normalize="
            f"{moe.SCORING.normalize!r}); router_probs follows the entry's {score_name!r}: make sure the router "
            "scores that way")


def _fitting(weights: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, own: tuple[str, str, bool],
             scale: float | None, softcap: float, tolerance: dict[str, float], floor: float = 0.0,
             per_expert: torch.Tensor | None = None) -> str:
    """Which settings to change so the scoring gives ``weights``: the entry's own score, selection and
    normalisation (with its floor ``floor``) up to a factor (the scale), else the softmax / sigmoid, normalised or
    not, that fits (named by what differs from the entry); where the entry has a floor, each of those without it
    too (``normalize_min=None``). ``per_expert``: the entry's multiplier per expert, on every candidate."""
    score_name, select, normalize = own
    ranks_logits = select == "logit_topk"
    fits = []
    for floored, name, by_logits, renormalised in itertools.product(
            dict.fromkeys((floor, 0.0)), dict.fromkeys((score_name, "softmax", "sigmoid")),
            (ranks_logits, not ranks_logits), (normalize, not normalize)):
        candidate = chosen_weights(logits, indices, name, "logit_topk" if by_logits else "score_topk", renormalised,
                                   None, softcap, floored, per_expert)
        ratio = _factor(weights, candidate, tolerance)
        if ratio is None:
            continue
        changes = [f"score={name!r}"] * (name != score_name) + [
            "select='logit_topk'" if by_logits else "select='score_topk'"] * (by_logits != ranks_logits) + [
            f"normalize={renormalised}"] * (renormalised != normalize) + ["normalize_min=None"] * (floored != floor)
        if not math.isclose(ratio, scale if scale is not None else 1.0, rel_tol=1e-3):
            changes.append("scale=None" if math.isclose(ratio, 1.0, rel_tol=1e-3) else f"scale={ratio:.4g}")
        fits.append(changes)
    if fits:  # the fewest changes (a floor dropped, not another selection scaled by it)
        return f"with {', '.join(min(fits, key=len))} (the entry's other settings as they are) it gives them"
    return NOTHING_FITS + ("; check normalize_min too (the floor the entry clamps the divisor at)" if floor else "")


#: `_fitting`'s answer where no scoring gives the weights.
NOTHING_FITS = "no softmax / sigmoid scoring of the logits or of the chosen ones, normalised or not, gives them"


def _factor(weights: torch.Tensor, candidate: torch.Tensor, tolerance: dict[str, float]) -> float | None:
    """The constant ``weights`` are ``candidate`` times (a router's scale), or None when they are not."""
    ratio = weights.sum() / candidate.sum()
    if not torch.isfinite(ratio) or not torch.allclose(weights, candidate * ratio, **tolerance):
        return None
    return float(ratio)


def _described(scoring: Any) -> str:
    floor = f", normalize_min={scoring.normalize_min!r}" if scoring.normalize_min is not None else ""
    return (f"score={scoring.score!r}, select={scoring.select!r}, normalize={scoring.normalize!r}{floor}, "
            f"scale={scoring.scale!r}")


def _output_problem(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """What is wrong with the entry's recombination on this block's run, or ""."""
    if "mlp_output" not in values or "routed_output" not in values:
        return ""
    family, block = moe.family, moe._module
    routed, shared, output = values["routed_output"], values.get("shared_expert_output"), values["mlp_output"]
    if converted(family) and routed.shape[-1] > output.shape[-1]:
        routed = routed[..., : output.shape[-1]]  # a converted Linear pads its experts square, then cuts (ToMoEBlock)
    with torch.no_grad():
        combined = family.combined(block, routed, shared)
    if combined.shape != output.shape:
        return (f"mlp_output, as the entry of family {family.name!r} picks it (Combine(output_index="
                f"{family.combine.output_index!r})), is {list(output.shape)}, where the entry's combination of "
                f"routed_output is {list(combined.shape)}: name the element of the block's output that holds its "
                "hidden states (or fix the Combine).")
    tolerance = _tolerance(output, routed, shared)
    if torch.allclose(combined.float(), output.float(), **tolerance):
        return ""
    with_shared = ("with the shared expert's output" if shared is not None
                   else "without a shared expert (the entry names none, or the block has none)")
    fitting = _combine_fitting(family, block, routed, shared, output, tolerance)
    unnamed = (" The block may add a module the entry names no shared expert for (SharedExpert(module=...), the "
               f"block's children: {', '.join(name for name, _ in block.named_children())})."
               if family.shared is None and fitting.startswith("check") else "")
    return (f"the Combine of family {family.name!r} ({family.combine}) of routed_output, {with_shared}, is not the "
            f"block's output (largest difference {float((combined.float() - output.float()).abs().max()):.3g}): "
            f"{fitting}.{_shared_gate_hint(moe, values)}{unnamed}")


def _shared_gate_hint(moe: Any, values: dict[str, torch.Tensor]) -> str:
    """Where the block's output is the routed output plus the served shared output times a factor of each token's
    own (a gate the entry leaves out, or reads the shared output before), a sentence saying so with the block's ops
    to name `SharedExpert.gated_op` from; else ""."""
    family, block, shared = moe.family, moe._module, values.get("shared_expert_output")
    if shared is None or family.combine.routed_post or family.combine.block_post:
        return ""
    scale = family.routed_scale_of(block)  # the routed part as the entry's Combine gives it: the hint is about the rest
    routed = values["routed_output"].float() * (1.0 if scale is None else float(scale))
    output = values["mlp_output"].float()
    rest = (output * 2 if family.mode_of(block) == "average" else output) - routed
    shared = shared.float()
    factor = (rest * shared).sum(-1, keepdim=True) / (shared * shared).sum(-1, keepdim=True)
    tolerance = _tolerance(*values.values())
    if not torch.isfinite(factor).all() or not torch.allclose(shared * factor, rest, **tolerance) or torch.allclose(
            factor, torch.ones_like(factor), **tolerance):  # a factor of 1: the shared part fits, the rest does not
        return ""
    if torch.allclose(rest, torch.zeros_like(rest), **tolerance):
        return (f" The block's output is routed_output alone: it does not add the shared expert the entry names "
                f"(SharedExpert {family.shared.module!r}); set shared=None, or name the module the block adds.")
    try:
        ops = f" The block's ops: {', '.join(moe.source.names)}."
    except Exception:  # noqa: BLE001 - a block without readable source: its ops cannot be listed
        ops = ""
    gated_op = family.shared.gated_op
    read_at = f"gated_op={gated_op!r} reads it before that factor" if gated_op else "the entry names no gate"
    return (f" The block's output is routed_output plus shared_expert_output times a factor per token (from "
            f"{float(factor.min()):.3g} to {float(factor.max()):.3g}: a gate), and {read_at}: name the gate module "
            f"(SharedExpert gate=...) and the op whose output is the gated shared output (gated_op=...).{ops}")


def _combine_fitting(family: Any, block: Any, routed: torch.Tensor, shared: torch.Tensor | None, output: torch.Tensor,
                     tolerance: dict[str, float]) -> str:
    """The routed_scale and mode that make ``output`` of ``routed`` and ``shared`` (for an entry with no post
    modules), named by what differs from the entry; else which settings to look at."""
    combine = family.combine
    generic = "check Combine (routed_scale, mode, routed_post, block_post) and SharedExpert (the module, gate, gated_op)"
    if combine.routed_post or combine.block_post:
        return generic
    routed, output = routed.float(), output.float()
    rest = torch.zeros_like(output) if shared is None else shared.float()
    own_mode, own_scale = family.mode_of(block), family.routed_scale_of(block)
    for mode in dict.fromkeys((own_mode, "sum", "average")):
        target = output * 2 - rest if mode == "average" else output - rest  # what the scaled routed output must be
        scale = float((target * routed).sum() / (routed * routed).sum())
        if math.isfinite(scale) and torch.allclose(routed * scale, target, **tolerance):
            changes = [f"mode={mode!r}"] * (mode != own_mode)
            if not math.isclose(scale, 1.0 if own_scale is None else float(own_scale), rel_tol=1e-3):
                changes.append("routed_scale=None" if math.isclose(scale, 1.0, rel_tol=1e-3)
                               else f"routed_scale={scale:.4g}")
            return f"with Combine {', '.join(changes)} (the rest as it is) it is"
    return generic
