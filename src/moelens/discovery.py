"""Where a model's Mixture-of-Experts blocks are: `discover` finds them from the model itself.

A MoE block is a module whose class is a registered family's block and that holds an experts
module; the dense MLPs of the same decoder stacks and the decoder layer lists come with them
(`Structure`). `moelens.wrap` makes envoys of what this finds; export, the compressor and
expert parallelism read it too. Nothing here changes the model.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .call_order import in_run_order
from .components.implementations import is_dispatching
from .components.mlp import DOWN_PROJECTIONS, UP_PROJECTIONS
from .errors import FamilyError, sentence, warn
from .families import Family, registry
from .families.entry import beneath_adapters, find_path, get_path
from .families.unserved import unserved_block
from .modules import enclosing, is_adapter_layer, is_modules_to_save


@dataclass
class Structure:
    """Where a model's MoE blocks and dense MLPs are (module names, no envoys).

    Attributes:
        family: The family of its MoE blocks, or the family its config names, or None.
        moe_blocks: Module names of the MoE blocks, in the order the forward reaches them (`call_order`).
        dense_blocks: Module names of the dense MLPs of the same decoder stacks.
        shared_mlps: Module names of the MoE blocks' shared experts that are dense MLPs (`Mlp` components too).
        layer_lists: Module names of the decoder layer lists holding the blocks.
        layers: The one of them ``model.layers`` names (`_decoder_layers`), or None.
        block_attr: The attribute of a decoder layer that holds its block (dense or MoE; ``""``: the
            layer is the block): the family's ``block_attr``, or where its blocks are found when it
            keeps the default ``"mlp"`` and they sit elsewhere (`_block_attribute`).
    """

    family: Family | None = None
    moe_blocks: list[str] = field(default_factory=list)
    dense_blocks: list[str] = field(default_factory=list)
    shared_mlps: list[str] = field(default_factory=list)
    layer_lists: list[str] = field(default_factory=list)
    layers: str | None = None
    block_attr: str = "mlp"


#: Modules that hold experts without being called as one experts module.
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _is_experts(module: Any) -> bool:
    """Whether ``module`` is an experts module (transformers-decorated, or undecorated with weights)."""
    return isinstance(module, torch.nn.Module) and (is_dispatching(module) or type(module).__name__.endswith("Experts"))


def _holds_mixture(module: torch.nn.Module, family: Family) -> bool:
    """Whether the block holds its experts where its family says: for moelens' own entries an experts module (a
    block class can hold a dense MLP instead in some checkpoints), for a registered entry any module there that is
    no container (the user named the path)."""
    experts = find_path(module, beneath_adapters(module, family.experts))
    if registry.is_built_in(family):
        return _is_experts(experts)
    return (isinstance(experts, torch.nn.Module) and not isinstance(experts, CONTAINERS)
            and (not family.experts_call or family.routing_from_router is not None or _takes_experts_call(experts)))


def _takes_experts_call(experts: torch.nn.Module) -> bool:
    """Whether the forward of ``experts`` (its class's: nnsight replaces the instance's) can be called as
    ``experts(hidden, top_k_index, top_k_weights)``, by position or by those keywords: a registered entry's experts
    path naming another module (the shared MLP, ``forward(x)``) would serve its output as the routed output."""
    signature = inspect.signature(type(experts).forward)
    for arguments in (((None, None, None, None), {}), ((None, None), {"top_k_index": None, "top_k_weights": None})):
        try:
            signature.bind_partial(*arguments[0], **arguments[1])  # other parameters of its own may follow
        except TypeError:
            continue
        return True
    return False


def _children(module: torch.nn.Module) -> list[str]:
    return [child for child, _ in module.named_children()]


def _refuse_adapter_layers(name: str, module: torch.nn.Module, family: Family) -> None:
    """Raise a `FamilyError` when a PEFT adapter layer other than parameter adapters stands for the block's router or
    experts (a LoRA ``Linear`` on a router that is one).

    moelens reads the ops of the family's own router and experts forward. Parameter adapters (`beneath_adapters`)
    call that forward, on the adapted parameters, so moelens serves it beneath them; another adapter layer adds its
    own part to the output (its ``base_layer`` the original), which the family's ops do not see.
    """
    for part, path in (("router", family.router), ("experts", family.experts)):
        target = find_path(module, beneath_adapters(module, path))
        if target is not None and is_adapter_layer(target):
            raise FamilyError(
                f"{name}.{path}, the {part} of this {family.name} block, is wrapped by a PEFT adapter layer "
                f"({type(target).__name__}), which adds its part outside the {part}'s own operations that moelens "
                "reads: merge the adapters into the weights first (model = peft_model.merge_and_unload()) and wrap "
                f"the result. (LoRA on the {part}'s parameters, LoraConfig(target_parameters=[...]), is served as "
                "it is.)"
            )


#: What to do about a PEFT ``modules_to_save`` wrapper on or around a MoE block (`_refuse_modules_to_save`).
MODULES_TO_SAVE_FIX = (
    "Merge the trainable copies in first (model = peft_model.merge_and_unload()) and wrap that, or leave the MoE "
    "blocks, their decoder layers, routers and experts out of modules_to_save."
)


def _refuse_modules_to_save(model: torch.nn.Module) -> None:
    """Raise a `FamilyError` when a PEFT ``modules_to_save`` wrapper (`is_modules_to_save`) holds a MoE block (of a
    registered family) or stands in one for its router or experts (`_reads_inside`).

    Around a block, the block is there twice: the frozen ``original_module`` (which no longer runs) and the
    trainable copy (which does), and moelens would serve both; inside one, the block's forward calls the wrapper,
    whose operations and children are not the wrapped module's.
    """
    blocks = [name for name, module in model.named_modules() if registry.for_block(module) is not None]
    for name, module in model.named_modules():
        if not is_modules_to_save(module):
            continue
        where = f"{name} ({type(module).__name__}, PEFT's modules_to_save wrapper)"
        original = f"{name}.original_module"
        held = next((block for block in blocks if block == original or block.startswith(f"{original}.")), None)
        if held is not None:
            family = registry.for_block(model.get_submodule(held))
            raise FamilyError(
                f"{where} holds the {family.name} MoE block {name + held[len(original):]} twice: the frozen "
                f"original under {original}, which no longer runs, and the trainable copy under "
                f"{name}.modules_to_save, which does, so moelens cannot serve that block. {MODULES_TO_SAVE_FIX}"
            )
        block = enclosing(name, blocks)
        family = registry.for_block(model.get_submodule(block)) if block is not None else None
        if family is not None and _reads_inside(name[len(block) + 1:], family):
            raise FamilyError(
                f"{where} stands in the {family.name} MoE block {block} for its "
                f"{_part_name(name[len(block) + 1:], family)}: the block calls the wrapper, whose operations and "
                f"children are not the wrapped module's, so moelens cannot read that block. {MODULES_TO_SAVE_FIX}"
            )


def _reads_inside(path: str, family: Family) -> bool:
    """Whether moelens reads ops inside the module at ``path`` of a block of ``family``, or inside one it holds or
    is held in: its router or its experts. A wrapper there breaks those reads; one on another part (a shared expert,
    its gate), whose output moelens reads at the module, serves the trainable copy's as the block uses it."""
    return any(path == part or path.startswith(f"{part}.") or part.startswith(f"{path}.")
               for part in (family.router, family.experts) if part)


def _part_name(path: str, family: Family) -> str:
    """What the module at ``path`` inside a block of ``family`` is, in words: its router, experts or shared expert
    (where the family names that path), or the module at ``path``."""
    parts = {family.router: "router", family.experts: "experts"}
    if family.shared is not None and not family.shared.on_layer:
        parts[family.shared.module] = "shared expert"
    return f"{parts[path]} ({path!r})" if path in parts else f"module {path!r}"


def _check_paths(name: str, module: torch.nn.Module, family: Family) -> None:
    """Raise a `FamilyError` when a block holding a mixture lacks a module its family names: the router,
    and (for a registered family, where a typo would surface only at export) the shared expert's gate
    (when the block has the shared expert) and the combination's post modules."""
    paths = {"router": family.router}
    if not registry.is_built_in(family):
        shared = family.shared
        if shared is not None and shared.gate and not shared.on_layer and _has_path(module, shared.module):
            paths["SharedExpert.gate"] = shared.gate
        paths |= {"Combine.routed_post": family.combine.routed_post, "Combine.block_post": family.combine.block_post}
    for field_name, path in paths.items():
        if path and not _has_path(module, path):
            raise FamilyError(
                f"family {family.name!r}: block {name} ({type(module).__name__}) has no {field_name.rpartition('.')[2]} "
                f"at {path!r}; its children are {_children(module)}. Fix the family's {field_name} path."
            )


def _check_shared_path(name: str, module: torch.nn.Module, family: Family) -> None:
    """Warn when a registered family's shared expert names nothing on a block that has a child called like one
    (a typo there leaves the shared expert running but never served). A block without any is a config without
    a shared expert, which families may allow. moelens' own entries are not checked."""
    shared = family.shared
    if shared is None or shared.on_layer or registry.is_built_in(family) or _has_path(module, shared.module):
        return
    lookalikes = [child for child in _children(module) if "shared" in child.lower()]
    if lookalikes:
        warn(
            f"family {family.name!r}: SharedExpert.module {shared.module!r} names nothing on block {name} "
            f"({type(module).__name__}), which has {', '.join(map(repr, lookalikes))}: its shared expert runs but is "
            "not served (shared_expert_output unavailable, mlp_output not routed + shared). Fix the family's "
            "SharedExpert.module path.",
        )


def block_parts(block: torch.nn.Module, family: Family, layer: torch.nn.Module | None = None
                ) -> dict[str, tuple[str, torch.nn.Module]]:
    """The modules of a MoE block of ``family`` that moelens serves values from, by what they are, with their path
    from the block (or from its decoder layer ``layer``): the block itself (path ""), its router and experts, its shared
    expert (one the family keeps on the decoder layer only with ``layer``) and that expert's gate. A part the block
    lacks (a config without a shared expert) is left out."""
    shared = family.shared
    hosts = {"block": (block, ""), "router": (block, beneath_adapters(block, family.router)),
             "experts": (block, beneath_adapters(block, family.experts))}
    if shared is not None:
        if not shared.on_layer or layer is not None:
            hosts["shared expert"] = (layer if shared.on_layer else block, shared.module)
        if shared.gate:
            hosts["shared expert gate"] = (block, shared.gate)
    return {part: (path, found) for part, (host, path) in hosts.items()
            if isinstance(found := find_path(host, path), torch.nn.Module)}


def _refuse_shared_parts(model: torch.nn.Module, blocks: list[str]) -> None:
    """Raise a `FamilyError` when a MoE block, or its router, experts or shared expert, is one module that two
    layers call: moelens serves values by module, in call order, so the second layer's would be the first's."""
    block_ids = {id(model.get_submodule(name)) for name in blocks}
    owners: dict[int, str] = {}
    for name, block in model.named_modules(remove_duplicate=False):  # a block shared by two layers: under both names
        if id(block) not in block_ids:
            continue
        for part, (path, part_module) in block_parts(block, registry.for_block(block)).items():
            if part == "shared expert gate":
                continue
            owner = owners.setdefault(id(part_module), name)
            if owner != name:
                where = f"{name}.{path}" if path else name
                raise FamilyError(
                    f"{where} is the same {part} module as {owner}{'.' + path if path else ''}: moelens serves a "
                    "block's values by module, in call order, so the later layer's values and interventions would be "
                    "the earlier one's. Give each layer its own module before wrapping (assign a copy.deepcopy of it)."
                )


def _refuse_shared_dense(model: torch.nn.Module, blocks: list[str]) -> None:
    """Raise a `FamilyError` when two layers call one dense MLP module (tied layers): its `Mlp` would serve the
    first call's values to both (`_refuse_shared_parts`, for dense blocks)."""
    owners: dict[int, str] = {}
    for name in blocks:
        owner = owners.setdefault(id(model.get_submodule(name)), name)
        if owner != name:
            raise FamilyError(
                f"{name} is the same dense MLP module as {owner}: moelens serves a block's values by module, in call "
                "order, so the later layer's values and edits would be the earlier one's. Give each layer its own "
                "module before wrapping (assign a copy.deepcopy of it)."
            )


def _has_path(module: torch.nn.Module, path: str) -> bool:
    return find_path(module, path) is not None


def _check_selection_bias(name: str, module: torch.nn.Module, family: Family) -> None:
    """Warn when a registered family's ``selection_bias`` names nothing on its block (`registry.unread_selection_bias`:
    a typo there would leave routing ranked by the logits, and route_around / force writing the wrong value), with or
    without a ``selection_op``."""
    error = registry.unread_selection_bias(family, module)
    if error is not None:
        warn(
            f"family {family.name!r}: selection_bias {family.scoring_of(module).selection_bias!r} names nothing on "
            f"block {name} ({sentence(error)}). Its routing is served as ranked by router_logits, so route_around and "
            "force write the logits, not what the router ranks (route_around refuses). Fix the family's selection_bias "
            "(None when the router adds no bias), register it again and wrap the model again.",
        )


def _has_child(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return any(isinstance(getattr(module, name, None), torch.nn.Module) for name in names)


def _is_dense_mlp(module: Any) -> bool:
    """Whether ``module`` is a dense MLP: it has an up (or gate) projection and a down projection, and
    neither holds a weight per expert (a 3-D ``[E, out, in]`` weight: an MoE block of no registered family)."""
    if not isinstance(module, torch.nn.Module) or unserved_block(module) is not None:
        return False
    # the parameters themselves: a weight rebuilt on reading (moelens.compress' ToMoELinear) is not read
    weights = [getattr(getattr(module, name, None), "_parameters", {}).get("weight")
               for name in (*UP_PROJECTIONS, *DOWN_PROJECTIONS)]
    per_expert = any(isinstance(weight, torch.Tensor) and weight.dim() > 2 for weight in weights)
    return _has_child(module, UP_PROJECTIONS) and _has_child(module, DOWN_PROJECTIONS) and not per_expert


def _shared_mlp(model: torch.nn.Module, block: str) -> tuple[str, torch.nn.Module] | None:
    """The module name and module of the MoE block ``block``'s shared expert where it is a dense MLP (up and down
    projections), else None (no shared expert, or one that is no such MLP: inkling's stacked weights)."""
    family = registry.for_block(model.get_submodule(block))
    shared = family.shared if family is not None else None
    if shared is None:
        return None
    host = layer_path(block) if shared.on_layer else block
    if host is None:
        return None
    name = f"{host}.{shared.module}" if host else shared.module
    module = find_path(model, name)
    return (name, module) if isinstance(module, torch.nn.Module) and _is_dense_mlp(module) else None


def paths_above(paths: list[str]) -> set[str]:
    """The module paths on the way down to each of ``paths``: the model's own (``""``) and every enclosing one."""
    return {""} | {".".join(path.split(".")[:depth]) for path in paths for depth in range(1, path.count(".") + 1)}


def layer_path(name: str) -> str | None:
    """The decoder layer a block sits in: ``model.layers.3`` for ``model.layers.3.mlp``."""
    parts = name.split(".")
    indices = [position for position, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: indices[-1] + 1]) if indices else None


def _layer_list(name: str) -> str | None:
    """The module list a block sits in: ``model.layers`` for ``model.layers.3.mlp``."""
    layer = layer_path(name)
    return layer.rpartition(".")[0] if layer is not None else None


def _check_block_attr(model: torch.nn.Module, name: str, family: Family) -> None:
    """Raise a `FamilyError` when a block's decoder layer has no ``block_attr`` (aliased as ``mlp`` there).

    Blocks are found by class anywhere (a converted ``self_attn.o_proj`` too), so only a
    ``block_attr`` the layer lacks is wrong; ``"mlp"`` needs no alias and ``""`` is the layer.
    """
    layer = layer_path(name)
    if family.block_attr in ("", "mlp") or layer is None or layer == name:
        return
    try:
        get_path(model.get_submodule(layer), family.block_attr)
    except AttributeError:
        raise FamilyError(
            f"family {family.name!r}: block_attr={family.block_attr!r}, but the decoder layer {layer} of its block "
            f"{name} ({type(model.get_submodule(name)).__name__}) has no {family.block_attr!r}; its children are "
            f"{_children(model.get_submodule(layer))}. Fix the family's block_attr."
        ) from None


def _block_attribute(family: Family | None, blocks: list[str]) -> str:
    """Where ``family``'s blocks sit in their decoder layers: its ``block_attr``; for the default ``"mlp"``,
    the one attribute its blocks sit at directly under their layers, when that is another (a family
    registered without ``block_attr``, a moelens.compress block at ``feed_forward``)."""
    if family is None or family.block_attr != "mlp":
        return family.block_attr if family is not None else "mlp"
    places = {name.rpartition(".")[2] for name in blocks if layer_path(name) == name.rpartition(".")[0]}
    return places.pop() if len(places) == 1 else "mlp"


def _dense_layer_lists(model: torch.nn.Module, attributes: tuple[str, ...]) -> list[str]:
    """The module lists (decoder layer lists) whose layers hold a dense MLP at one of ``attributes``."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and any(_is_dense_mlp(getattr(layer, attribute, None)) for layer in module for attribute in attributes)
    ]


def discover(model: torch.nn.Module) -> Structure:
    """Find the MoE blocks, the dense MLPs beside them and the decoder layer lists."""
    structure = Structure()
    unknown: list[str] = []
    idle: dict[str, str] = {}  # family -> a block of it that holds no experts module where it says
    checked: set[str] = set()  # families whose selection_bias and shared expert were looked for (on their first block)
    unserved: dict[str, list[str]] = {}  # model type -> its blocks moelens knows and does not serve
    _refuse_modules_to_save(model)
    for name, module in model.named_modules():
        family = registry.for_block(module)
        if family is None:
            known = unserved_block(module)
            if known is not None:
                unserved.setdefault(known.name, []).append(name)
            elif any(is_dispatching(child) for child in module.children()) and enclosing(name, structure.moe_blocks) is None:
                unknown.append(f"{name} ({type(module).__name__})")
            continue
        _refuse_adapter_layers(name, module, family)
        if not _holds_mixture(module, family):
            held = find_path(module, family.experts)
            idle.setdefault(family.name, (f"{name} ({type(module).__name__}; children {_children(module)})", held))
            continue
        _check_paths(name, module, family)
        _check_block_attr(model, name, family)
        if family.name not in checked:
            checked.add(family.name)
            _check_selection_bias(name, module, family)
            _check_shared_path(name, module, family)
        structure.family = structure.family or family
        structure.moe_blocks.append(name)
        layers = _layer_list(name)
        if layers is not None and layers not in structure.layer_lists:
            structure.layer_lists.append(layers)
    for model_type, blocks in unserved.items():
        warn(
            f"moelens does not serve these MoE blocks of {model_type}: {', '.join(blocks)}; "
            f"{unserved_block(model.get_submodule(blocks[0])).reason}. model.moes leaves them out and they are "
            "plain envoys: read them with plain nnsight (their .output, .inputs and their children's).",
        )
    if unknown:
        warn(
            f"moelens found MoE blocks of no registered family: {', '.join(unknown)}. They are plain "
            "envoys; describe them with moelens.families.register(Family(...)), then wrap the model again "
            f"(moelens.wrap(model._module)), to serve their routing{_unmatched_registrations(model)}.",
        )
    for family_name, (block, held) in idle.items():
        if structure.family is None or structure.family.name != family_name:
            family = registry.get(family_name)
            own = isinstance(held, torch.nn.Module) and not registry.is_built_in(family)  # a module the user named
            if own and not isinstance(held, CONTAINERS):  # `_takes_experts_call` said no
                warn(
                    f"moelens: blocks of family {family_name!r} hold a {type(held).__name__} at {family.experts!r} "
                    f"(e.g. {block}), whose forward{inspect.signature(type(held).forward)} cannot be called as "
                    "experts(hidden_states, top_k_index, top_k_weights), so none is served as a Moe: experts names "
                    "another module than the experts the block calls with its routing. Name that module in the "
                    "entry's experts.",
                )
                continue
            if own:
                warn(
                    f"moelens: blocks of family {family_name!r} hold a {type(held).__name__} at {family.experts!r} (e.g. "
                    f"{block}), whose experts the block calls one by one, so none is served as a Moe: moelens reads "
                    "an experts module called once as experts(hidden_states, top_k_index, top_k_weights). Move the "
                    "block's loop over its experts into such a module's forward and name it in the entry's experts.",
                )
                continue
            warn(
                f"moelens: blocks of family {family_name!r} hold no experts module at {family.experts!r} "
                f"(e.g. {block}), so none is served as a Moe: a checkpoint without a mixture, or a family whose "
                "experts path is wrong (there, moelens takes a module decorated with transformers' use_experts_implementation "
                "or with a class name ending in 'Experts'; for a registered family, any module but a ModuleList or ModuleDict).",
            )
    if structure.family is None:
        config = getattr(model, "config", None)
        for model_type in registry.model_types(config) if config is not None else []:
            structure.family = registry.for_model_type(model_type)
            if structure.family is not None:
                break
    _refuse_shared_parts(model, structure.moe_blocks)
    structure.moe_blocks = in_run_order(model, structure.moe_blocks)
    structure.block_attr = _block_attribute(structure.family, structure.moe_blocks)
    # a layer that is the block keeps its dense MLP as `mlp`; a model of no family has its MLPs there
    attribute = structure.block_attr or "mlp"
    elsewhere = _dense_elsewhere(structure.family, attribute)
    if not structure.moe_blocks:  # a dense model: its decoder layers are the lists that hold dense MLPs
        structure.layer_lists = _dense_layer_lists(model, (attribute, *elsewhere))
    moes = set(structure.moe_blocks)
    holding = {layer_path(name) for name in moes}
    for layers in structure.layer_lists:
        for index, layer in enumerate(get_path(model, layers)):
            name = f"{layers}.{index}.{attribute}"
            if name not in moes and _is_dense_mlp(getattr(layer, attribute, None)):
                structure.dense_blocks.append(name)
            elif f"{layers}.{index}" not in holding:
                found = next((other for other in elsewhere if _is_dense_mlp(getattr(layer, other, None))), None)
                if found is not None:
                    structure.dense_blocks.append(f"{layers}.{index}.{found}")
    _refuse_shared_dense(model, structure.dense_blocks)
    shared = dict(found for block in structure.moe_blocks if (found := _shared_mlp(model, block)) is not None)
    calls = Counter(map(id, shared.values()))  # one module the blocks share: no one block's Mlp
    structure.shared_mlps = [name for name, module in shared.items() if calls[id(module)] == 1
                             and name not in structure.dense_blocks]
    structure.layers = layers = _decoder_layers(model, structure.layer_lists, dense=not structure.moe_blocks)
    if not structure.moe_blocks and not unknown and not idle and not unserved:
        places = "/".join(dict.fromkeys(name[len(layer_path(name)) + 1:] for name in structure.dense_blocks)) or attribute
        where = (f"at layers[i].{places}" if layers is not None and structure.layer_lists == [layers] else
                 f"in {', '.join(structure.layer_lists)}; " + (f"layers is {layers}" if layers else
                                                              "no list of them is the text decoder's layers"))
        found = (f"its {len(structure.dense_blocks)} dense MLPs ({where}) are Mlp components serving mlp_output and "
                 "mlp_activation" if structure.dense_blocks else
                 f"no dense MLP was found either (a module at layers[i].{attribute} with up and down projections)")
        if layers is None:
            found += ", so there is no model.layers (reach modules by their native paths)"
        found += _unmatched_registrations(model)
        warn(
            "moelens found no MoE block in this model (no module of a registered family's block class holding "
            f"an experts module): model.moes is [], and {found}.",
        )
    return structure


def _own_families() -> list[Family]:
    """The families the user registered (not moelens' own entries)."""
    return [family for family in registry.supported() if not registry.is_built_in(family)]


def registered_since(model: torch.nn.Module) -> str:
    """For a wrapped model with no MoE block: the advice to wrap it again where a family the user registered (after
    the wrap, or it would have been found) names a block class of it; "" where none does."""
    own = {cls: family for family in _own_families() for cls in family.block_classes}
    found = next(((module, name) for module in model.modules() for name in _class_names(module) if name in own), None)
    if found is None:
        return ""
    (found, name), family = found, own[found[1]]
    if not _holds_mixture(found, family):
        return (f"; the family {family.name!r} you registered describes its {name} blocks, but they hold no experts "
                f"module moelens serves at its experts {family.experts!r}: fix the entry, register it again "
                "(replace=True) and wrap the model again")
    return (f"; the family {family.name!r}, registered after this model was wrapped, describes its {name} blocks: "
            "wrap it again (moelens.wrap(model._module))")


def _class_names(module: torch.nn.Module) -> tuple[str, str]:
    """The names a family's ``block_classes`` may give ``module``'s class by: bare, and qualified by its module."""
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _unmatched_registrations(model: torch.nn.Module) -> str:
    """For the warnings of blocks moelens does not serve: the block classes of the user's own registered families
    that name no module of ``model``, beside the module classes the model has, so a misspelt class name shows; ""
    without any."""
    present = {name for module in model.modules() for name in _class_names(module)}
    own = [family for family in _own_families() if not present.intersection(family.block_classes)]
    if not own:
        return ""
    classes = dict.fromkeys(type(module).__name__ for module in model.modules()
                            if not type(module).__module__.startswith("torch."))
    named = "; ".join(f"{family.name!r}: {', '.join(family.block_classes)}" for family in own)
    return (f". The block classes of the families you registered ({named}) name no module of this model, whose "
            f"classes are {', '.join(list(classes)[:12])}{' ...' if len(classes) > 12 else ''}")


def _dense_elsewhere(family: Family | None, attribute: str) -> tuple[str, ...]:
    """Where a layer with no MoE block may keep a dense MLP other than at the blocks' ``attribute``: ``mlp`` (a
    custom model whose MoE blocks sit at ``moe``), and the family's shared MLP on the layer (a granitemoehybrid
    checkpoint with no experts keeps only its ``shared_mlp``)."""
    shared = family.shared.module if family is not None and family.shared is not None and family.shared.on_layer else None
    return tuple(name for name in dict.fromkeys(("mlp", shared)) if name and name != attribute)


def _decoder_layers(model: torch.nn.Module, layer_lists: list[str], dense: bool = False) -> str | None:
    """The layer list ``model.layers`` names: the list of the MoE blocks (when one holds them all); of a
    ``dense`` model's lists (a vision tower's and a language model's MLPs), the one inside its text decoder
    (``get_decoder()``), where it has one that is not the model itself; None otherwise."""
    try:
        decoder = model.get_decoder() if dense else None
    except (AttributeError, NotImplementedError, ValueError):
        decoder = None
    where = next((name for name, module in model.named_modules() if module is decoder), None) if decoder else None
    if not where:
        return layer_lists[0] if len(layer_lists) == 1 else None
    inside = [name for name in layer_lists if name.startswith(f"{where}.")]
    return inside[0] if len(inside) == 1 else None
