"""Run a model's routers at another top-k: `set_top_k`.

Each MoE family keeps the number of experts a token is routed to somewhere else (`Family.top_k`: the router's
``top_k`` on most, dbrx's block's own, gemma4's ``config.top_k_experts`` that every layer shares, phimoe's fixed 2 in
its router's code). Setting an attribute the router does not read adds a new one and changes nothing; `set_top_k`
sets the one each block's router reads, checked, and puts the old values back.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Iterable

from nnsight import Envoy

from .components import Moe
from .components.layer_list import held_blocks
from .components.served import trace_running
from .errors import ArgumentError, FamilyError, MoelensError, described, warn
from .families.scoring import kept_experts


class set_top_k:
    """Route every token of the given MoE blocks to ``k`` experts: each block's router picks its ``k`` best experts
    (scored, renormalised and scaled as the family does at that ``k``), until `restore` or the end of a ``with``
    block. Like ``torch.set_grad_enabled``, it works both ways::

        with moelens.set_top_k(model, 1):          # top-1 routing in every MoE block, for these traces only
            with model.trace(prompt):
                top1 = model.output.logits.save()

        setting = moelens.set_top_k(model.moes[2], 4)   # from now on; setting.restore() puts the old k back

    Args:
        target: A wrapped model (its MoE blocks, `model.moes`), one block (``model.moes[i]``) or several blocks of
            one model.
        k: Experts per token, 1 to each block's number of experts (to drop every routed expert, use
            ``moelens.keep_top(moe, 0)`` in the trace).

    Set outside a trace (the model's routers read it as they run). Each block's value is written where its family
    keeps it (`Family.top_k`); where that is shared by other blocks (gemma4's config), every block sharing it must be
    in ``target``. Refused for a family whose k is fixed in its router's code (phimoe). deepseek_v4's hash-routed
    layers, which take each token's experts from a token-id table of fixed width, keep theirs. A block's values
    (`Moe.top_k`, ``expert_indices``, ``expert_weights``: ``[..., k]``) follow. So does what else a forward reads k
    from: a block that scales its output back by it (openai_privacy_filter), and, where every block is set, the
    model's ``num_experts_per_tok`` at which transformers counts the router aux loss. A deep copy of the wrapped model
    made while a setting is held routes at the k from before it, with a warning (`undo_in_copy`); one of the
    transformers model itself (``copy.deepcopy(model._module)``) is the model as it runs, at the k set.
    """

    def __init__(self, target: Any, k: int) -> None:
        if trace_running("set_top_k"):
            raise MoelensError("set_top_k: call it before the trace (with moelens.set_top_k(model, k): with "
                               "model.trace(...)): the routers read their k as the model runs.")
        blocks = _blocks(target)
        k = _checked_k(k, blocks)
        _warn_beyond_groups(blocks, k)
        self._saved: list[tuple[Any, str, Any]] = []
        places = {}
        for block in blocks:
            owner, name = _place(block)
            places.setdefault((id(owner), name), (owner, name, block))
        _refuse_shared_beyond(blocks, places)
        # what else the forward reads k from: a block scaling its output back by it, the model's aux loss
        for owner, name in [*(place for block in blocks for place in _companions(block)), *_model_k(blocks)]:
            places.setdefault((id(owner), name), (owner, name, None))
        for owner, name, _ in places.values():
            _ACTIVE.setdefault((id(owner), name), []).append(weakref.ref(self))
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, k)
        self.k = k

    def restore(self) -> None:
        """Put every block's old k back (again: nothing more). Settings of the same blocks may be restored in any
        order: one restored while a later one is active leaves the later k in place, and the later one's restore
        then puts back the k from before both."""
        for owner, name, old in reversed(self._saved):
            key = (id(owner), name)
            stack = [ref for ref in _ACTIVE.get(key, []) if ref() is not None]  # a dropped one restores nothing
            mine = next((i for i, ref in enumerate(stack) if ref() is self), None)
            later = stack[mine + 1]() if mine is not None and mine + 1 < len(stack) else None
            if later is not None:  # a later setting is active here: it puts back what this one found
                later._saved = [(o, n, old if (id(o), n) == key else value) for o, n, value in later._saved]
            else:
                setattr(owner, name, old)
            stack = [ref for ref in stack if ref() is not self]
            if stack:
                _ACTIVE[key] = stack
            else:
                _ACTIVE.pop(key, None)
        self._saved = []

    def __enter__(self) -> set_top_k:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.restore()


def undo_in_copy(memo: dict[int, Any]) -> list[int]:
    """Put the k from before each setting still held back in a deep copy (``memo``: `copy.deepcopy`'s, id of an
    original object -> its copy) of what it wrote (any wrap's: a PEFT model and the model in it are wrapped apart): a
    copy made inside ``with set_top_k(...)`` routes as the model did before the setting, which no setting's `restore`
    reaches in the copy. Returns the ks undone (the settings')."""
    undone = []
    for (owner, name), refs in _ACTIVE.items():
        held = [setting for ref in refs if (setting := ref()) is not None]
        if held and owner in memo:
            setattr(memo[owner], name, next(old for o, n, old in held[0]._saved if (id(o), n) == (owner, name)))
            undone.append(held[-1].k)
    return sorted(set(undone))


#: (id(owner), attribute) -> weak references to the settings that wrote it and are not restored yet, oldest first
#: (`set_top_k.restore`); weak, so that a setting kept "from now on" and dropped keeps no model alive.
_ACTIVE: dict[tuple[int, str], list[weakref.ref]] = {}


def _companions(block: Moe) -> list[tuple[Any, str]]:
    """Other places of ``block`` that hold its k and that its forward reads: where the family's scoring divides the
    weights by k (``Scoring.scale = "1/<top_k>"``) and its ``Combine.routed_scale`` names an attribute holding the same
    k, the block multiplies the output back by it (openai_privacy_filter's ``block.num_experts``, set from
    ``config.num_experts_per_tok``)."""
    family = block.family
    scale, routed = block.SCORING.scale, family.combine.routed_scale
    if scale != f"1/{family.top_k}" or not isinstance(routed, str):
        return []
    try:
        owner, name = family.owner(routed, block._module)
        value = getattr(owner, name)
    except AttributeError:
        return []
    return [(owner, name)] if value == block.top_k else []


def _model_k(blocks: list[Moe]) -> list[tuple[Any, str]]:
    """The model's own ``num_experts_per_tok`` (transformers' causal-LM models copy it from the config to compute the
    router aux loss at that k), where ``blocks`` are every block of the model and none is hash-routed (no one k for
    the aux loss then): otherwise the aux loss (and a loss with labels and ``output_router_logits=True``) would count
    each token's old k experts."""
    root = blocks[0].root
    moes = getattr(root, "moes", None) or []
    if {id(block) for block in blocks} != {id(moe) for moe in moes} or any(moe.SCORING.select == "hash" for moe in moes):
        return []
    model = root._module
    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: it reads through to the model, not writes
        model = model.get_base_model()
    value = getattr(model, "num_experts_per_tok", None)
    return [(model, "num_experts_per_tok")] if isinstance(value, int) and not isinstance(value, bool) else []


def _blocks(target: Any) -> list[Moe]:
    """The MoE blocks of ``target`` (a wrapped model, a block, or blocks of one model) that route by their k: not
    hash-routed ones (deepseek_v4's first layers); an `ArgumentError` where there are none."""
    if isinstance(target, Moe):
        given = [target]
    elif hasattr(target, "moes"):
        given = list(target.moes)
    elif isinstance(target, Iterable) and not isinstance(target, (str, bytes, Envoy)):  # an envoy lists its children
        given = list(target)
    else:
        given = [target]
    for block in given:
        if not isinstance(block, Moe):
            raise ArgumentError(f"set_top_k takes a wrapped model, an MoE block (model.moes[i]) or a list of them, "
                                f"got {_what(block)}.")
    if len({id(block.root) for block in given}) > 1:
        raise ArgumentError("set_top_k: the blocks given belong to different wrapped models; set each model's on "
                            "its own.")
    blocks = [block for block in given if block.SCORING.select != "hash"]
    if not blocks:
        raise ArgumentError("set_top_k: no block given routes by a top-k" + (
            f" ({', '.join(block.path for block in given)} take their experts from a token-id table, whatever their "
            "top_k)" if given else " (the model has no MoE block)" if hasattr(target, "moes") else
            " (an empty list: give a wrapped model, a block or a list of blocks)") + ".")
    return blocks


def _what(value: Any) -> str:
    """``value`` in words for an error: an envoy by its path, and the MoE blocks it holds."""
    if not isinstance(value, Envoy):
        return described(value)
    held = held_blocks(value)
    return f"{value.path} ({type(value._module).__name__}), which is no MoE block" + (
        f" (it holds {', '.join(held)}: pass {'that' if len(held) == 1 else 'those'})" if held else "")


def _checked_k(k: Any, blocks: list[Moe]) -> int:
    """``k`` as an int from 1 to every block's number of experts, else an `ArgumentError`."""
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)
    except TypeError:
        raise ArgumentError(f"set_top_k: k must be a whole number of experts per token, got {described(k)}.") from None
    if k < 1:
        raise ArgumentError(f"set_top_k: k={k} routes no expert; give 1 or more (to drop every routed expert's output, "
                            "call moelens.keep_top(moe, 0) in the trace).")
    fewest = min(blocks, key=lambda block: block.num_experts)
    if k > fewest.num_experts:
        raise ArgumentError(f"set_top_k: k={k} is more than the {fewest.num_experts} experts of {fewest.path}; give "
                            f"at most {fewest.num_experts}.")
    return k


def _warn_beyond_groups(blocks: list[Moe], k: int) -> None:
    """Warn where ``k`` is more than the experts a group-limited router picks from (the ``topk_group`` best of its
    ``n_group`` groups): it fills the other slots with experts outside them, as the model built at that k would, in
    torch's order among their masked scores, not the best of them."""
    beyond = []
    for block in blocks:
        groups = block.family.groups_of(block._module)
        if groups is not None and k > (eligible := kept_experts(groups, block.num_experts)):
            beyond.append(f"{block.path} ({groups[1]} of {groups[0]} groups: {eligible} experts)")
    if beyond:
        warn(f"set_top_k: k={k} is more than the experts of the best groups that {', '.join(beyond[:3])}"
             f"{f' and {len(beyond) - 3} more' if len(beyond) > 3 else ''} pick from: the other slots get experts "
             "outside those groups, in torch's order among their masked scores, not the best of them (as the model "
             "built at that k would). Give at most that many, or raise the router's topk_group.")


def _place(block: Moe) -> tuple[Any, str]:
    """The object and attribute name holding ``block``'s k, where its router reads it (`Family.top_k`)."""
    reference = block.family.top_k
    if not isinstance(reference, str):
        raise FamilyError(f"set_top_k: {block.path} ({block.family.name}) picks {reference} experts per token in its "
                          "router's code; there is no setting to change.")
    block._refuse_replaced(f"set_top_k({block.path})", "its k cannot be set")
    try:
        owner, name = block.family.owner(reference, block._module)
        getattr(owner, name)
    except AttributeError as error:
        raise FamilyError(f"set_top_k: {block.path} has no {reference} ({error}), where family "
                          f"{block.family.name!r} keeps its k; the entry does not match this model.") from None
    return owner, name


def _refuse_shared_beyond(blocks: list[Moe], places: dict[tuple[int, str], tuple[Any, str, Moe]]) -> None:
    """Refuse where a place that holds the k of a block in ``blocks`` holds that of a block outside them too (gemma4's
    config, shared by every layer): setting it would change that block as well."""
    given = {id(block) for block in blocks}
    for other in getattr(blocks[0].root, "moes", None) or []:
        if id(other) in given or not isinstance(other, Moe) or not isinstance(other.family.top_k, str):
            continue
        try:
            owner, name = other.family.owner(other.family.top_k, other._module)
        except AttributeError:
            continue
        if (id(owner), name) in places:
            first = places[(id(owner), name)][2]
            raise ArgumentError(
                f"set_top_k: {first.path} keeps its k in {first.family.top_k} ({type(owner).__name__}.{name}), which "
                f"{other.path} reads too (not given): setting it would change both. Give both blocks, or the whole "
                "model (moelens.set_top_k(model, k)).")
