"""The family registry: every known family, user registration, and detection.

Detection looks at the model itself: a module is an MoE block when its class is
some registered family's block class; the model's ``config.model_type`` (or that
of a sub-config) names the family otherwise. `supported()` is what the docs'
family table is generated from.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from nnsight.intervention.envoy import Envoy

from ..errors import FamilyError
from ..scalars import check_flag
from .entry import (COMBINE_MODES, EXPERT_GATES, GROUP_SCORES, SELECTIONS, SHARED_TIMES, VALUE_NAMES, Combine,
                    ExpertGate, ExpertLayout, Family, Scoring, SharedExpert)
from .scoring import SCORE_FUNCTIONS

_FAMILIES: dict[str, Family] = {}
_BY_BLOCK_CLASS: dict[str, Family] = {}
#: Every registration in force, oldest first. A later entry under a name shadows the earlier ones
#: until it is unregistered; a block class belongs to the newest unshadowed entry naming it.
_REGISTERED: list[Family] = []
#: moelens' own entries (`register_all`).
_BUILT_IN: list[Family] = []


def register(family: Family, *, replace: bool = False) -> Family:
    """Add a family so `moelens.wrap` recognises its blocks, without editing moelens.

    Args:
        family: The description. Its ``block_classes`` are how blocks are found.
        replace: Allow replacing a family (or a block class) registered earlier; `unregister`
            gives back what it replaced.

    Returns:
        The family, so ``MY_FAMILY = register(Family(...))`` reads naturally.
    """
    if not isinstance(family, Family):
        raise FamilyError(
            f"register() takes a moelens.families.Family, got {type(family).__name__}; "
            "build one with Family(name=..., model_types=..., block_classes=...)."
        )
    _check_description(family)
    replace = check_flag("replace", replace, FamilyError)
    if not family.block_classes:
        raise FamilyError(f"family {family.name!r} names no block_classes: moelens finds blocks by their class name.")
    if not replace:
        if family.name in _FAMILIES:
            raise FamilyError(f"a family named {family.name!r} is already registered; "
                              f"{_replace_advice(_FAMILIES[family.name], 'replace it', family)}")
        taken = [name for name in family.block_classes if name in _BY_BLOCK_CLASS]
        if taken:
            owner = _BY_BLOCK_CLASS[taken[0]]
            raise FamilyError(f"block class {taken[0]!r} already belongs to family {owner.name!r}; "
                              f"{_replace_advice(owner, 'take it over', family)}")
        owners = [(model_type, for_model_type(model_type)) for model_type in family.model_types]
        taken = [(model_type, owner) for model_type, owner in owners if owner is not None]
        if taken:
            advice = _replace_advice(taken[0][1], "take it over (models of that type are then described by this "
                                     "entry)", family, served=f"every {taken[0][0]} model")
            raise FamilyError(f"model type {taken[0][0]!r} already belongs to family {taken[0][1].name!r}; {advice}")
    _REGISTERED.append(family)
    _rebuild()
    return family


def _replace_advice(owner: Family, what: str, family: Family, served: str | None = None) -> str:
    """What to do about ``family``'s registration that clashes with ``owner``: ``replace=True`` to ``what``, and
    where ``owner`` is one of moelens' own entries, what that would change (how ``served`` is served: every model
    of that family by default)."""
    if not is_built_in(owner):
        return f"pass replace=True to {what}."
    return (f"{owner.name!r} is one of moelens' own families: give your entry a name, block classes and model types of "
            f"its own, or pass replace=True to {what}, which changes how {served or f'every {owner.name} model'} is "
            "served until "
            f"moelens.families.unregister({family.name!r}) gives moelens' entry back.")


#: The entry classes a family's fields hold (a plain string or tuple there fails later, far from the cause).
FIELD_KINDS = {
    "scoring": Scoring,
    "combine": Combine,
    "shared": (SharedExpert, type(None)), "expert_gate": (ExpertGate, type(None)),
    "expert_layout": (ExpertLayout, type(None)),
}

#: The plain kinds an entry field's type hint may be made of, and what a value of each is (a bool is no number:
#: ``derived_routing="yes"`` or ``top_k=True`` would be read by truthiness or as 1).
PLAIN_KINDS: dict[type, tuple[str, Callable[[object], bool]]] = {
    bool: ("a bool", lambda value: isinstance(value, bool)),
    int: ("an int", lambda value: isinstance(value, int) and not isinstance(value, bool)),
    float: ("a number", lambda value: _number(value)),  # (defined below)
    str: ("a string", lambda value: isinstance(value, str)),
    type(None): ("None", lambda value: value is None),
}


def _plain_field_problem(part: object, label: str) -> str:
    """The first field of the entry part ``part`` (a `Family`, `Scoring`, ...) whose hint is made of plain kinds
    (`PLAIN_KINDS`: ``bool``, ``str | None``, ``str | int``) and whose value is of none of them, or ""."""
    hints = typing.get_type_hints(type(part))
    for field in dataclasses.fields(part):
        hint = hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        value = getattr(part, field.name)
        if all(kind in PLAIN_KINDS for kind in kinds) and not any(PLAIN_KINDS[kind][1](value) for kind in kinds):
            return f"{label}{field.name} must be {' or '.join(PLAIN_KINDS[kind][0] for kind in kinds)}, got {value!r}"
    return ""


#: The selections that pick the top-k of the logits (of their scores, a monotone function of them): what
#: ``derived_routing`` recomputes.
TOP_K_OF_LOGITS = ("logit_topk", "score_topk")


def _check_description(family: Family) -> None:
    """Raise a `FamilyError` for fields of the wrong kind (a string where names are listed) or an unknown word."""
    if not isinstance(family.name, str) or not family.name:
        raise FamilyError(f"a family's name must be a non-empty string, got {family.name!r}.")
    for field_name in ("model_types", "block_classes"):
        value = getattr(family, field_name)
        if not isinstance(value, (tuple, list)) or not all(isinstance(item, str) for item in value):
            raise FamilyError(
                f"family {family.name!r}: {field_name} must be a tuple of names, got {value!r}"
                + (f"; write ({value!r},)." if isinstance(value, str) else ".")
            )
    for field_name, kind in FIELD_KINDS.items():
        value = getattr(family, field_name)
        if not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise FamilyError(f"family {family.name!r}: {field_name} must be a {expected}, got {value!r}.")
    for field_name in ("scoring_by_router", "refused", "runs_only_on"):
        value = getattr(family, field_name)
        if not isinstance(value, Mapping):
            raise FamilyError(f"family {family.name!r}: {field_name} must be a mapping (a dict), got {value!r}.")
    if not all(isinstance(scoring, Scoring) for scoring in family.scoring_by_router.values()):
        raise FamilyError(f"family {family.name!r}: scoring_by_router must map router classes to Scoring entries, "
                          f"got {dict(family.scoring_by_router)!r}.")
    if family.shared is not None and family.shared.when not in SHARED_TIMES:
        raise FamilyError(
            f"family {family.name!r}: shared expert time {family.shared.when!r} is not one of {SHARED_TIMES}."
        )
    if not family.experts and family.experts_call:
        raise FamilyError(
            f"family {family.name!r}: experts='' names the block itself, which calls its experts inside its forward: "
            "give the path of the experts module from the block (\"experts\"), the one it calls as "
            "experts(hidden, top_k_index, top_k_weights); for a block that computes its experts itself, with no such "
            "call, set experts_call=False."
        )
    if not family.experts and not family.derived_routing and family.routing_from_router is None:
        raise FamilyError(
            f"family {family.name!r}: experts='' with experts_call=False is a block that computes its experts inline, "
            "with no experts call to read the weights and indices at: set derived_routing=True (moelens recomputes "
            "them from the router logits with the entry's Scoring) or routing_from_router=(weights position, indices "
            "position) where the router returns them."
        )
    ranks_more = [f"{name}={value!r}" for scoring in (family.scoring, *family.scoring_by_router.values())
                  for name, value in (("select", None if scoring.select in TOP_K_OF_LOGITS else scoring.select),
                                      ("selection_bias", scoring.selection_bias), ("groups", scoring.groups))
                  if value is not None]
    if family.derived_routing and ranks_more:
        raise FamilyError(
            f"family {family.name!r}: derived_routing=True recomputes the weights and indices as the top-k of the "
            f"logits, scored, renormalised and scaled as the Scoring says; it cannot follow a router that ranks more "
            f"than its logits ({', '.join(dict.fromkeys(ranks_more))}). Describe the block's experts call instead "
            "(experts_call=True, or routing_from_router naming where the router returns its weights and indices)."
        )
    if family.shared is not None and isinstance(family.shared.module, str) and not family.shared.module:
        raise FamilyError(
            f"family {family.name!r}: SharedExpert(module='') names no module: give the path of the shared-expert "
            "module from the block (\"shared_expert\"), or leave shared=None for a block without one."
        )
    if family.expert_gate is not None and family.expert_gate.kind not in EXPERT_GATES:
        raise FamilyError(
            f"family {family.name!r}: ExpertGate kind {family.expert_gate.kind!r} is not one of {EXPERT_GATES} "
            "(\"glu\" is act_fn(gate) * up, SwiGLU with a silu act_fn); leave expert_gate None for transformers' "
            "default."
        )
    if family.shared is not None and (family.shared.gate is None) != (family.shared.gated_op is None):
        raise FamilyError(
            f"family {family.name!r}: SharedExpert gate={family.shared.gate!r} and gated_op={family.shared.gated_op!r} "
            "go together: a gated shared expert names its gate module (gate, which the export applies) and the op "
            "where the block has applied it (gated_op, where shared_expert_output is read); an ungated one, neither."
        )
    for scoring in (family.scoring, *family.scoring_by_router.values()):
        if scoring.select not in SELECTIONS:
            raise FamilyError(f"family {family.name!r}: Scoring.select {scoring.select!r} is not one of {SELECTIONS}.")
        if scoring.group_score not in GROUP_SCORES:
            raise FamilyError(f"family {family.name!r}: Scoring.group_score {scoring.group_score!r} is not one of "
                              f"{GROUP_SCORES}.")
        if scoring.selection_arg is not None and not (scoring.selection_op and isinstance(scoring.selection_arg, int)
                                                      and scoring.selection_arg >= 0):
            raise FamilyError(
                f"family {family.name!r}: selection_arg={scoring.selection_arg!r} needs selection_op naming the "
                "router call (e.g. torch_topk_0) and the position (an int >= 0) of the ranked argument."
            )
        if not (_number(scoring.normalize_eps) and math.isfinite(scoring.normalize_eps) and scoring.normalize_eps >= 0):
            raise FamilyError(
                f"family {family.name!r}: Scoring.normalize_eps must be a number >= 0 (what the router adds to the sum "
                "it divides the weights by: 1e-20 in DeepSeek-V3's, 0.0 for the plain sum), got "
                f"{scoring.normalize_eps!r}."
            )
        if scoring.selection_in is not None and not scoring.selection_op:
            raise FamilyError(
                f"family {family.name!r}: selection_in={scoring.selection_in!r} needs selection_op naming the op "
                "inside that call whose output (or argument, with selection_arg) the router ranks."
            )
    for field_name, value, literal, allowed in _settings(family):
        if not (_is_reference(value) or literal(value)):
            expected = f"{allowed} or an attribute reference" if allowed else "an attribute reference"
            word = isinstance(value, str) and field_name != "Scoring.score"  # whose literals are words themselves
            hint = (f'; a plain word is no reference: write "router.{value}", "block.{value}" or "config.{value}"'
                    if word else "")
            if word and _numeral(value):
                hint = f"; a number is written without quotes ({value.strip()})"
            elif word and value.strip() in ("True", "False", "None"):
                hint = f"; {value.strip()} is written without quotes"
            example = REFERENCE_EXAMPLES.get(field_name, "router.top_k")
            raise FamilyError(
                f"family {family.name!r}: {field_name} must be {expected} (\"{example}\", a dotted path "
                f"from the block), got {value!r}{hint}."
            )
    mode = family.combine.mode
    if not isinstance(mode, str) or not (mode in COMBINE_MODES or "." in mode):
        raise FamilyError(
            f"family {family.name!r}: Combine.mode {mode!r} is not one of {COMBINE_MODES} "
            "nor an attribute reference naming one (\"block.combination_strategy\")."
        )
    positions = family.routing_from_router
    if positions is not None and not (isinstance(positions, tuple) and len(positions) == 2
                                      and all(_count(0)(position) for position in positions)
                                      and positions[0] != positions[1]):
        raise FamilyError(
            f"family {family.name!r}: routing_from_router must be None or the two positions (weights, indices) of the "
            f"router's output tuple, ints >= 0, got {positions!r}."
        )
    if not isinstance(family.routed_from_block, bool) or family.routed_from_block and family.shared is not None:
        raise FamilyError(
            f"family {family.name!r}: routed_from_block must be True or False, and True only for a block with no "
            f"shared expert (its output is then the routed output), got {family.routed_from_block!r} with "
            f"shared={family.shared!r}."
        )
    layout = family.expert_layout
    if layout is not None and not (layout.gate_up is not None and layout.gate is None and layout.up is None
                                   or layout.gate_up is None and layout.up is not None):
        raise FamilyError(
            f"family {family.name!r}: {layout!r} must name either the fused gate_up parameter alone or a separate "
            "up parameter (with gate for gated experts)."
        )
    unknown = [name for name in family.refused if name not in VALUE_NAMES]
    if unknown:
        raise FamilyError(f"family {family.name!r}: refused names {unknown[0]!r}, which is not one of {VALUE_NAMES}.")
    parts = [("", family), ("SharedExpert.", family.shared), ("Combine.", family.combine),  # the fields left
             ("ExpertGate.", family.expert_gate), ("ExpertLayout.", family.expert_layout),
             *(("Scoring.", scoring) for scoring in (family.scoring, *family.scoring_by_router.values()))]
    for label, part in parts:
        problem = part is not None and _plain_field_problem(part, label)
        if problem:
            raise FamilyError(f"family {family.name!r}: {problem}.")


def _is_reference(value: object) -> bool:
    """An attribute reference: a dotted path of names (``"router.top_k"``, ``"1/router.top_k"``); not a number
    written as a string (``"2.0"``)."""
    if not isinstance(value, str):
        return False
    parts = value.removeprefix("1/").split(".")
    return len(parts) > 1 and all(part.isidentifier() for part in parts)


def _numeral(text: str) -> bool:
    """Whether ``text`` is a number written as a string (``"2.0"``, ``"1e-3"``)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: An attribute reference of the kind each field takes, for its refusal (`_settings`' field names).
REFERENCE_EXAMPLES = {
    "top_k": "router.top_k", "num_experts": "experts.num_experts", "identity_experts": "config.zero_expert_num",
    "extra_logits": "router.n_shared_experts", "Combine.routed_scale": "block.routed_scaling_factor",
    "Scoring.score": "config.scoring_func", "Scoring.normalize": "router.norm_topk_prob",
    "Scoring.normalize_min": "router.norm_min", "Scoring.scale": "router.routed_scaling_factor",
    "Scoring.selection_bias": "router.e_score_correction_bias", "Scoring.softcap": "router.router_logit_softcapping",
    "Scoring.expert_scale": "router.per_expert_scale",
    "Scoring.groups": "router.num_group", "Scoring.groups_if": "router.topk_method",
    "ExpertGate.alpha": "experts.alpha", "ExpertGate.limit": "experts.limit",
}


def _count(at_least: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= at_least


def _settings(family: Family) -> Iterator[tuple[str, object, Callable[[object], bool], str]]:
    """Each field that holds an attribute reference (or a literal): its name, value, the literals it
    takes and how they read in an error ("" for none). A plain word there would be taken as a literal."""
    optional_positive = lambda value: value is None or _number(value) and math.isfinite(value) and value > 0  # noqa: E731
    only_none = lambda value: value is None  # noqa: E731
    # a bool passes here to be refused by its kind (_plain_field_problem): "must be a number or a string or None"
    optional_floor = lambda value: (value is None or isinstance(value, bool)  # noqa: E731
                                    or _number(value) and math.isfinite(value) and value >= 0)
    yield "top_k", family.top_k, _count(1), "an int >= 1"
    yield "num_experts", family.num_experts, _count(1), "an int >= 1"
    yield "identity_experts", family.identity_experts, lambda value: value is None or _count(0)(value), \
        "None, an int >= 0"
    yield "extra_logits", family.extra_logits, _count(0), "an int >= 0"
    yield "Combine.routed_scale", family.combine.routed_scale, optional_positive, "None, a positive number"
    for scoring in (family.scoring, *family.scoring_by_router.values()):
        yield "Scoring.score", scoring.score, SCORE_FUNCTIONS.__contains__, f"one of {sorted(SCORE_FUNCTIONS)}"
        yield "Scoring.normalize", scoring.normalize, lambda value: isinstance(value, bool), "True, False"
        yield "Scoring.normalize_min", scoring.normalize_min, optional_floor, "None, a finite number >= 0"
        yield "Scoring.scale", scoring.scale, optional_positive, "None, a positive number"
        yield "Scoring.selection_bias", scoring.selection_bias, only_none, "None"
        yield "Scoring.softcap", scoring.softcap, only_none, "None"
        yield "Scoring.expert_scale", scoring.expert_scale, only_none, "None"
        pairs = {"groups": scoring.groups, "groups_if": scoring.groups_if}
        for name, pair in pairs.items():
            if pair is not None and not (isinstance(pair, tuple) and len(pair) == 2):
                raise FamilyError(f"family {family.name!r}: Scoring.{name} must be None or a pair, got {pair!r}.")
        for reference in scoring.groups or ():
            yield "Scoring.groups", reference, lambda value: False, ""
        if scoring.groups_if is not None:
            yield "Scoring.groups_if", scoring.groups_if[0], lambda value: False, ""
    if family.expert_gate is not None:
        for name in ("alpha", "limit"):
            yield f"ExpertGate.{name}", getattr(family.expert_gate, name), optional_positive, "None, a positive number"


def register_all(families: Iterable[Family]) -> None:
    """Register the built-in entries of one family module."""
    for family in families:
        _BUILT_IN.append(register(family))


def is_built_in(family: Family) -> bool:
    """Whether ``family`` is one of moelens' own entries (not one a user registered)."""
    return any(family is entry for entry in _BUILT_IN)


def unread_selection_bias(family: Family, block: Any) -> FamilyError | None:
    """The error reading a registered ``family``'s `Scoring.selection_bias` on ``block`` raises (a typo: it names
    nothing there), None where it reads or names none. moelens' own entries are not checked: their routers leave the
    bias out when the config does."""
    reference = family.scoring_of(block).selection_bias
    if not reference or is_built_in(family):
        return None
    try:
        family.resolve(reference, block)
    except FamilyError as error:
        return error
    return None


def unregister(name: str) -> None:
    """Undo the newest `register` of ``name``.

    The entry it replaced under that name (a built-in, say) is in force again, and each block
    class goes back to the newest family still registered that names it.
    """
    _refuse_unnamed(name, "unregister")
    for position in range(len(_REGISTERED) - 1, -1, -1):
        if _REGISTERED[position].name == name:
            entry = _REGISTERED[position]
            if is_built_in(entry) and not any(earlier is entry for earlier in _REGISTERED[:position]):
                # moelens' own registration of it: a re-run notebook cell would take the built-in entry away
                raise FamilyError(
                    f"cannot unregister {name!r}: the entry in force is moelens' own, and unregister undoes only your "
                    "own register calls (none is left under that name)."
                )
            del _REGISTERED[position]
            _rebuild()
            return
    raise FamilyError(f"cannot unregister {name!r}: no family of that name is registered; known families: {_known()}.")


def _rebuild() -> None:
    """Derive the entry in force per name and the owner of each block class from `_REGISTERED`."""
    newest = {family.name: family for family in _REGISTERED}  # a name keeps its first place, its newest entry
    _FAMILIES.clear()
    _FAMILIES.update(newest)
    _BY_BLOCK_CLASS.clear()
    for family in _REGISTERED:  # oldest first: the newest entry in force naming a class ends up owning it
        if newest[family.name] is family:
            _BY_BLOCK_CLASS.update(dict.fromkeys(family.block_classes, family))


def _known() -> str:
    """The registered family names, for error messages."""
    return ", ".join(sorted(_FAMILIES))


class FamilyList(list):
    """A list of family entries that prints as their names (each entry's own repr is a page of settings)."""

    def __getitem__(self, key: Any) -> Any:
        """An entry by position, a slice of them, or the entry of a name (``supported()["mixtral"]``, as it prints)."""
        if isinstance(key, str):
            named = next((family for family in self if family.name == key), None)
            if named is None:
                raise FamilyError(f"no family named {key!r} in this list of {len(self)}; print the list for its names "
                                  "(moelens.families.get(name) looks a name up among every registered family).")
            return named
        picked = super().__getitem__(key)
        return FamilyList(picked) if isinstance(key, slice) else picked  # a slice prints as names too

    def __repr__(self) -> str:
        return f"[{len(self)} families: {', '.join(family.name for family in self)}]"

    def __contains__(self, item: Any) -> bool:
        """Whether a family of that name (``"mixtral" in supported()``, as it prints) or that entry is listed."""
        return any(family.name == item for family in self) if isinstance(item, str) else super().__contains__(item)


def supported() -> FamilyList:
    """Every registered family, sorted by name (a list of `Family` entries; it prints as their names)."""
    return FamilyList(_FAMILIES[name] for name in sorted(_FAMILIES))


def _refuse_unnamed(name: Any, function: str) -> None:
    """Refuse anything but a family's name given to ``function`` (`get`, `unregister`), saying what to give."""
    if not isinstance(name, str):
        what = (f"a Family entry ({name.name!r}): give its name, {function}({name.name!r})" if isinstance(name, Family)
                else f"{type(name).__name__} {name!r}")
        raise FamilyError(f"{function} takes a family's name, got {what}.")


def get(name: str) -> Family:
    """The family registered under ``name``."""
    _refuse_unnamed(name, "get")
    try:
        return _FAMILIES[name]
    except KeyError:
        raise FamilyError(f"no moelens family named {name!r}; known families: {_known()}.") from None


def for_block(module: torch.nn.Module | Envoy | type | str) -> Family | None:
    """The family whose MoE block ``module`` (a module, its envoy: ``model.moes[0]``, its class or class name) is, or
    None when it is no known block."""
    if isinstance(module, Envoy):
        module = module._module
    if isinstance(module, torch.nn.Module):
        module = type(module)
    if isinstance(module, type) and issubclass(module, torch.nn.Module):  # its qualified name first, then its name
        return _BY_BLOCK_CLASS.get(f"{module.__module__}.{module.__qualname__}") or _BY_BLOCK_CLASS.get(module.__name__)
    if isinstance(module, str):
        return _BY_BLOCK_CLASS.get(module)
    raise FamilyError(f"for_block takes an MoE block (a torch module, its envoy, its class or class name), got "
                      f"{type(module).__name__} {module!r:.60}.")


def for_model_type(model_type: str) -> Family | None:
    """The family a ``config.model_type`` belongs to (the newest entry in force that names it), or None."""
    if not isinstance(model_type, str):
        raise FamilyError(f"for_model_type takes a config's model_type (a str such as 'mixtral'), got a "
                          f"{type(model_type).__name__}; pass config.model_type.")
    for family in reversed(_REGISTERED):
        if model_type in family.model_types and _FAMILIES[family.name] is family:
            return family
    return None


def model_types(config) -> list[str]:
    """The model_type of a config and of each of its sub-configs (text_config ...)."""
    found = [getattr(config, "model_type", None)]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found.extend(model_types(sub))
    return [name for name in found if name]
