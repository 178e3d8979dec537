"""What a write to a served value may hold: refusals of writes the model would compute something wrong from.

`check_write` checks a written tensor against its `Binding` (shape, dtype, expert indices in
range, no NaN or infinities the model cannot take, enough experts left to route to);
`check_not_recomputed` refuses edits that activation checkpointing would silently drop from the
backward. Both raise `WriteError`, naming the value, what was expected and what to do.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from einops import rearrange
from jaxtyping import Bool, Float
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

try:  # torch's activation-checkpointing wrapper (what FSDP, accelerate and torchtitan put around layers)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper
except ImportError:  # a torch built without torch.distributed
    CheckpointWrapper = None

from ..errors import MoelensError, WriteError
from ..families.scoring import kept_experts, score
from .binding import ANY_INF, FINITE, INDEX, Binding

if TYPE_CHECKING:
    from .base import Component

#: What the router would do with fewer entries above -inf than a value's `Binding.min_finite` (`router_logits`: the
#: block says, `Moe._finite_logits_needed`).
WHY_FINITE = {"selection_scores": "the router would fill its slots with excluded experts, at their full weight"}


def refuse_under_vmap(what: str, error: type[MoelensError] = WriteError) -> None:
    """Raise ``error`` where ``what`` (a read, a write or an intervention) runs inside ``torch.func.vmap``: its values
    are batched tensors, without the storage the token views and write checks read, and vmap hides an in-place edit
    from the version counter that tells moelens to put it back (with autograd on, or of a copy, it would be lost)."""
    stack = torch._C._functorch.get_interpreter_stack()
    if stack and any(interpreter.key() == torch._C._functorch.TransformType.Vmap for interpreter in stack):
        raise error(
            f"{what}: this trace runs inside torch.func.vmap (or jacfwd, which runs it), where moelens cannot serve "
            "values, place writes or run interventions (vmap's batched tensors hold no storage for them, and an "
            "in-place edit would be lost). Batch the inputs in one trace instead (the values are [batch, seq, ...]), "
            "or run a trace per input in a loop."
        )


def check_not_recomputed(component: "Component", name: str) -> None:
    """Refuse an edit inside a layer under activation checkpointing whose backward will recompute it:
    the recomputation runs the model's forward alone, without the edit, so the gradients would be those
    of the unedited layer (or torch's CheckpointError). That is with autograd on, or always under
    reentrant checkpointing, which runs the layer's forward with autograd off; never where the model's run began under
    ``torch.inference_mode``, where no backward can run (an inference_mode block in the trace's body is not enough:
    the layer's forward, begun with autograd on, is recomputed all the same).

    Checkpointing is transformers' (``gradient_checkpointing`` in training mode; the innermost flag on the path
    decides, a decoder layer's over its model's) or torch's ``checkpoint_wrapper`` around a module on the path
    (in any mode)."""
    flagged, wrapper = None, None
    for module in component.modules_down():
        if isinstance(getattr(module, "gradient_checkpointing", None), bool):
            flagged = module
        if CheckpointWrapper is not None and isinstance(module, CheckpointWrapper):
            wrapper = module
    if wrapper is not None:
        reentrant = wrapper.checkpoint_impl == CheckpointImpl.REENTRANT
        how = "torch's checkpoint_wrapper"
        undo = "trace a model without the checkpoint wrapper for edits with gradients"
    elif flagged is not None and flagged.gradient_checkpointing and flagged.training:
        function = getattr(flagged, "_gradient_checkpointing_func", None)
        # torch's checkpoint is reentrant unless told use_reentrant=False; a function it cannot read counts as one
        reentrant = not (isinstance(function, functools.partial) and function.keywords.get("use_reentrant") is False)
        how = "gradient_checkpointing in training mode"
        undo = "turn it off for traces that edit (model.activation_checkpointing_disable()), or trace in eval mode"
    else:
        return
    from .served import RUNS  # (served imports this module)

    if getattr(RUNS.get(component.interleaver), "inference", False):  # the run began under inference_mode
        return
    if torch.is_grad_enabled() or reentrant:
        raise WriteError(
            f"{component.path}.{name} is edited inside {type(wrapper or flagged).__name__}, which runs under "
            f"{'reentrant ' if reentrant else ''}activation checkpointing ({how}): the backward recomputes it "
            f"without the edit, so the gradients would be those of the unedited model. {undo[0].upper()}{undo[1:]}"
            + ("." if reentrant else ", or trace under torch.no_grad() when no gradient is needed.")
        )


#: The model's own values of served views an intervention edits in place where they hold NaN or infinities (kept only
#: then, by `remember_before_edit`): where the view is the model's tensor, its values from before are gone otherwise.
BEFORE_EDITS = WeakIdKeyDictionary()

#: The attribute of a served view holding its version when it was read (`served.read`): a view whose version moved
#: since was edited in place, and no longer holds the model's own values.
READ_VERSION = "_moelens_read_version"


def model_values(view: torch.Tensor) -> torch.Tensor | None:
    """The model's own values where ``view`` (a served value, or the model's tensor it views) was: itself while no
    edit in place changed it since it was read, else what an intervention kept of it before editing (None: gone)."""
    read = getattr(view, READ_VERSION, None)  # none on a tensor never served (a copy an intervention edits), which
    # under torch.inference_mode may keep no version counter to ask
    return view if read is None or read == view._version else BEFORE_EDITS.get(view)


def remember_before_edit(view: torch.Tensor) -> None:
    """Keep ``view``'s values before an intervention edits it in place, where some are NaN or infinite (a NaN the
    model computed itself, an fp16 overflow): `check_write` then refuses only what the edits made non-finite. Not
    where the user edited it in place since it was read: those values are not the model's."""
    if view not in BEFORE_EDITS and model_values(view) is view and view.is_floating_point() and not is_fake(view) \
            and not bool(torch.isfinite(view).all()):
        BEFORE_EDITS[view] = view.detach().clone()


def check_write(component: "Component", name: str, binding: Binding, value: torch.Tensor, shape: torch.Size,
                before: torch.Tensor | None = None) -> None:
    """Raise `WriteError` for a write the model would compute something wrong from.

    ``before`` is the model's own value at the written place where moelens holds it (an assignment, an in-place edit
    of a copy): a NaN or an infinity already there is the model's, not refused. In ``model.scan`` a fake value is
    checked for shape and dtype only; a real tensor written there (one saved from an earlier trace) is checked in
    full, outside the fake mode (whose results could not be asked for truth).
    """
    with unset_fake_temporarily():
        _check_write(component, name, binding, value, shape, before)


def check_before_edit(component: "Component", name: str, view: torch.Tensor, edited: torch.Tensor) -> None:
    """Raise the `WriteError` an in-place edit of the served ``view`` of ``name`` into ``edited`` (a copy holding the
    edit) would get when it is checked, at the block's next read, before it is made: a refused edit then never
    reaches the model's tensor (an intervention's own edit, which the caller makes after)."""
    check_write(component, name, component._binding(name), edited, view.shape, model_values(view))


def _introduced(value: torch.Tensor, before: torch.Tensor | None, test: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
    """Where ``test`` (NaN, +inf, -inf) holds for the written ``value`` but not for the model's own value ``before``."""
    found = test(value)
    if before is not None and before.shape == value.shape and bool(found.any()):
        found &= ~test(before.to(value.device))
    return found


def _check_write(component: "Component", name: str, binding: Binding, value: torch.Tensor, shape: torch.Size,
                 before: torch.Tensor | None = None) -> None:
    where = f"{component.path}.{name}"
    if tuple(value.shape) != tuple(shape):
        one_row = value.dim() == len(shape) > 0 and value.shape[0] == 1 and value.shape[1:] == shape[1:]
        raise WriteError(
            f"{where}: wrote a tensor of shape {tuple(value.shape)}, expected {tuple(shape)} "
            f"(this invoke's [batch, seq, ...] view); read the value first to see its shape"
            + (f"; to write this one row into each of the {shape[0]} rows, write "
               f"value.expand({shape[0]}, {', '.join(['-1'] * (len(shape) - 1))})." if one_row else ".")
        )
    if value.is_meta and not is_fake(value):
        raise WriteError(f"{where}: wrote a tensor on the meta device, which holds no values; write a tensor with "
                         "data (on the model's device, or on the CPU: moelens moves it).")
    if binding.kind == INDEX:
        if value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
            raise WriteError(
                f"{where}: wrote {value.dtype} indices, expected integer expert indices "
                f"(torch.int64) of shape {tuple(shape)}; convert with .long()."
            )
        if value.numel() and not is_fake(value):  # model.scan's fake tensors have no values to check
            low, high = int(value.min()), int(value.max())
            upper = binding.upper() if binding.upper is not None else None
            if low < 0 or (upper is not None and high >= upper):
                bad = low if low < 0 else high
                raise WriteError(
                    f"{where}: wrote expert index {bad}, expected indices in [0, {upper}) "
                    f"for this block's {upper} experts."
                )
        return
    if not value.is_floating_point():  # a complex one too: the model's values are real
        raise WriteError(
            f"{where}: wrote a {value.dtype} tensor, expected a floating-point tensor of shape "
            f"{tuple(shape)}; convert with .float() or .to(the value's dtype)" + (
                " (of the real part: .real)" if value.is_complex() else "") + "."
        )
    if is_fake(value):  # model.scan: shapes and dtypes only, no values to check
        return
    unknown = "" if before is not None else (
        " (moelens cannot tell the model's own NaN or inf from an edit in place: of the model's tensor under "
        "torch.no_grad, or of a value served in another layout, such as the activations in token-slot order; where "
        f"the model computed them, edit a copy and assign it: edited = {component.path}.{name}.clone(), then "
        f"{component.path}.{name} = edited)")
    nans = _introduced(value, before, torch.isnan)
    if nans.any():
        first = tuple(int(i) for i in nans.nonzero()[0])
        raise WriteError(f"{where}: the written tensor holds NaN ({int(nans.sum())} of {nans.numel()}, the first at "
                         f"{first}); the model would propagate it. Write finite values (torch.nan_to_num, ...)"
                         f"{unknown}.")
    allowed = binding.allowed_infinities()
    if allowed != ANY_INF:
        plus = bool(_introduced(value, before, torch.isposinf).any())
        if plus or (allowed == FINITE and _introduced(value, before, torch.isneginf).any()):
            which = "+inf" if plus else "-inf"
            if name == "router_logits":
                scores = component.family.score_of(component._module)
                why = (f"a {which} logit makes this router's {scores} scores NaN; raise it by a large finite "
                       "amount instead (moelens.steer, moelens.force)")
            else:
                why = "the model would compute inf or NaN from it; write finite values"
            if value.dtype in (torch.float16, torch.bfloat16):  # an in-place edit of a finite number beyond the range
                why += f" (in {value.dtype} a number beyond {torch.finfo(value.dtype).max:.3g} is {which})"
            raise WriteError(f"{where}: the written tensor holds {which}; {why}{unknown}.")
    cast_to = binding.summed_into() if binding.summed_into is not None else None
    if cast_to is not None and value.numel():  # the model adds up a token's slots and casts the sum to ``cast_to``
        summed_in = _slot_sum_dtype(value)
        narrowest = min((summed_in, cast_to), key=lambda dtype: torch.finfo(dtype).max)
        # summed in float64 (a float32 sum of float64 slots is inf already), then rounded as the model's sum is
        total = value.sum(-2, dtype=torch.float64).abs().max()
        if torch.isinf(total.to(narrowest)):
            how = ("the dtype the model adds them up in" if narrowest == summed_in else
                   "the dtype the block's output is cast to from their sum")
            reached = f"{float(total):.4g}" if torch.isfinite(total) else "more than float64 holds"
            raise WriteError(
                f"{where}: the written slots of a token add up to {reached}, which is inf in {narrowest} (at "
                f"most {torch.finfo(narrowest).max:.4g}), {how}; write smaller values."
            )
    if name == "router_logits" and binding.min_finite and value.numel():
        _check_groups_of_scored_logits(component, where, value)
    needed, why = (component._finite_logits_needed(value.dtype) if name == "router_logits" and binding.min_finite
                   else (binding.min_finite, WHY_FINITE.get(name, "the router could not pick")))
    if not needed or not value.numel():
        return
    groups = _kept_groups(component, name)
    if groups:  # a k above the kept groups' experts (moelens.set_top_k warns of it): the model's own routing fills
        needed = min(needed, kept_experts(groups, value.shape[-1]))  # the other slots, edited or not
    fill = component.SCORING.group_fill if groups else float("-inf")
    short = (~torch.isneginf(value)).sum(-1) < needed if groups is None else _picks_excluded(value, *groups, fill, needed)
    if short.any():
        above, reach = "-inf", ""
        if groups:
            reach = f" inside the best {groups[1]} of its {groups[0]} expert groups (the router's reach)"
            if fill != float("-inf"):
                above, reach = f"{fill}", f"{reach}, and it scores the experts of the groups it drops {fill}"
        raise WriteError(
            f"{where}: fewer than {needed} entr{'ies' if needed > 1 else 'y'} of some token are above {above}{reach}, "
            f"so {why}; leave at least {needed} expert{'s' * (needed > 1)} "
            f"above {above} per token{' in those groups' if groups else ''} (route_around fewer experts"
            f"{'; a group that force or steer keeps for a token needs them too' if groups else ''})."
        )


def _slot_sum_dtype(slots: torch.Tensor) -> torch.dtype:
    """The dtype the model adds up a token's per-slot values in (``.sum`` over the slot dim): torch's result dtype
    for a sum of ``slots``' dtype (the slots' as served, which autocast may have lowered below the hidden states')
    under the autocast in force at the write, on their device. CPU autocast keeps float16 there, CUDA's sums in
    float32; a written tensor still on the CPU for a CUDA model reads as the former (a stricter check)."""
    return torch.zeros((1, 1), dtype=slots.dtype, device=slots.device).sum(-2).dtype


def _check_groups_of_scored_logits(component: "Component", where: str, logits: Float[torch.Tensor, "*tokens e"]) -> None:
    """Raise `WriteError` where a group-limited router that ranks the scores of its logits (no selection bias:
    mistral4's softmax) and fills its dropped groups with a finite score (0.0) keeps groups holding fewer than k
    experts scored above that fill for some token (``route_around`` of an expert whose group is still kept): its
    top-k then takes a tie among the filled scores, an expert of a dropped group, weighted by its own score."""
    scoring = component.SCORING
    if scoring.select != "group_topk" or scoring.group_fill == float("-inf") or component.ranks_selection_scores:
        return
    groups = component.family.groups_of(component._module)
    if groups is None or groups[1] >= groups[0]:  # no group dropped: nothing filled
        return
    # scored in float32, then rounded as the router's scores are: mistral4 scores in the logits' own dtype, where a
    # score of about exp(-92) or less is 0 in bfloat16 but not in float32 (mistral_large4's logits are float32)
    scores = score(component.family.score_of(component._module), logits.detach().float(),
                   component.softcap).to(logits.dtype)
    k = component.top_k
    if kept_experts(groups, scores.shape[-1]) < k:  # the kept groups never hold k: the model's own routing
        return
    short = _picks_excluded(scores, *groups, scoring.group_fill, k, weighed_unmasked=True)
    if short.any():
        fill = scoring.group_fill
        raise WriteError(
            f"{where}: for some token the best {groups[1]} of its {groups[0]} expert groups (the router's reach) "
            f"hold fewer than {k} experts scoring above {fill} (an expert routed around, steered far down, or whose "
            f"{logits.dtype} score underflows scores 0), while a group the router drops (scoring its experts {fill}) "
            f"holds one above it: its top-k would fill the slot with an expert of a dropped group, weighted by that "
            f"expert's own score. Leave at least {k} experts scoring above 0 per token in the groups the router keeps "
            "(route around or steer down fewer experts there, or steer by less)."
        )


def _kept_groups(component: "Component", name: str) -> tuple[int, int] | None:
    """``(n_group, topk_group)`` where the router ranks ``name`` (its selection scores) to keep its best groups
    (group score: the sum of a group's top two, ``"group_topk"``), else None."""
    if name != "selection_scores" or component.SCORING.select != "group_topk":
        return None
    return component.family.groups_of(component._module)


def _picks_excluded(
    value: Float[torch.Tensor, "*tokens e"], n_group: int, topk_group: int, fill: float, k: int,
    weighed_unmasked: bool = False,
) -> Bool[torch.Tensor, " *tokens"]:
    """Whether a group-limited router could pick an entry written -inf for each token: it keeps the
    ``topk_group`` groups of the best sum of their top two (torch's top-k ranks a NaN sum first), puts ``fill``
    in place of the others' entries, and takes its top ``k``. Groups whose sums tie may go either way: the ones
    holding the fewest entries above ``fill`` are taken as kept. With ``fill`` -inf an entry of a dropped group
    is never picked, so too few finite entries in the kept groups is the danger; with a finite ``fill`` (axk2's
    0.0) an expert written -inf in a dropped group comes back at ``fill``, picked once the kept groups hold
    fewer than ``k`` entries above it. ``weighed_unmasked``: the router weighs its picks by their scores before the
    fill (mistral4), so a shortfall in the kept groups matters where a dropped group holds an entry above ``fill``,
    which the tie at ``fill`` may pick at that entry's weight (not where every other entry is at ``fill`` itself:
    a large steer's softmax leaves the others 0, picked at weight 0)."""
    grouped = rearrange(value, "... (g e) -> ... g e", g=n_group)
    sums = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1).nan_to_num(nan=float("inf"))
    # a NaN entry (the model's own: one a write introduced is refused before) is a pick, as torch's top-k ranks it
    # first: counted as NaN > fill (False), the model's NaN row read as short of experts, while a NaN only in the
    # ranked scores (a NaN selection bias) leaves finite weights, so that row's shortfall is still checked
    counts = ((grouped > fill) | grouped.isnan()).sum(-1)
    by_count = counts.argsort(dim=-1, stable=True)  # then by sum, best first: ties keep the fewest entries first
    ranked = by_count.gather(-1, sums.gather(-1, by_count).argsort(dim=-1, descending=True, stable=True))
    short = counts.gather(-1, ranked[..., :topk_group]).sum(-1) < k
    if fill == float("-inf"):
        return short
    if weighed_unmasked:  # a pick at fill weighs its own score: only a dropped group's expert above fill does harm
        return short & (counts.gather(-1, ranked[..., topk_group:]).sum(-1) > 0)
    if topk_group >= n_group:  # no group is dropped, so none comes back at fill: only -inf entries are never picked
        return (~torch.isneginf(value)).sum(-1) < k
    # a group whose sum beats the best dropped one's is kept whatever the ties: its -inf entries stay -inf
    surely_kept = sums > sums.gather(-1, ranked[..., topk_group : topk_group + 1])
    return short & (torch.isneginf(grouped).any(-1) & ~surely_kept).any(-1)
