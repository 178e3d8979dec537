"""`shard_experts`: keep only this rank's experts in every MoE block and switch to ``torch_a2a``.

Generic over families: the MoE blocks and their experts modules are found the
way `moelens.wrap` finds them (`moelens.discovery.discover`, the family table), and
every parameter of an experts module whose leading dim is the block's E is
sliced to this rank's ``[rank*L, (rank+1)*L)``. Routers, shared experts, dense
layers, attention and embeddings are left whole (data parallel).

The experts module keeps its ``num_experts`` (E, what the router's ids and
`Moe.num_experts` mean) and gains ``_ep_group`` (the group, in a `SharedGroup`: a
deep copy of the model shares it), ``_ep_rank``, ``_ep_size``,
``_ep_first`` (its first global expert), ``_ep_tag`` (`runs.layer_tag`: its position in the model and the model's
index among those sharded over the group), ``_ep_runs`` (the group's run ids,
`moelens.parallel.runs`) and ``_is_expert_parallel = True``. A forward pre-hook refuses any experts
implementation but ``torch_a2a`` on it: ``grouped_mm`` / ``batched_mm`` would treat
the ids of remote experts as out of range and drop them silently. The model, every module on the
way down to the blocks and the blocks gain a forward pre-hook and an always-called forward hook
that start a run for each outermost forward outside a moelens trace (`moelens.parallel.runs`).
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..adapters import refuse_parameter_adapters
from ..components.implementations import is_dispatching
from ..errors import MoelensError
from ..families.entry import get_path
from ..modules import has_lora_adapters
from .comm import SharedGroup, group_rank, group_size, stored_group
from .degrees import _whole, expert_owner
from .experts import NAME
from .register import register_torch_a2a
from .runs import forward_enters, forward_leaves, layer_tag, runs_of


class ShardedExpertsError(MoelensError):
    """A sharded experts module was asked to run an implementation that cannot see remote experts."""


def _experts_of(model: torch.nn.Module) -> list[tuple[str, Any, torch.nn.Module, torch.nn.Module]]:
    """``(block name, family, block, experts module)`` of every MoE block, in module order."""
    from ..families import registry
    from ..discovery import discover

    found = []
    for name in discover(model).moe_blocks:
        block = get_path(model, name)
        family = registry.for_block(block)
        found.append((name, family, block, get_path(block, family.experts)))
    return found


def _layout(blocks: list[tuple[str, Any, torch.nn.Module, torch.nn.Module]]) -> str:
    """What every rank's experts must agree on: the blocks, and each experts parameter's shape and dtype (rows of
    another dtype are another number of bytes: gloo aborts the process that receives them)."""
    return "; ".join(
        f"{name}: " + ", ".join(f"{key} {tuple(param.shape)} {str(param.dtype).removeprefix('torch.')}"
                                for key, param in experts.named_parameters(recurse=False))
        for name, _, _, experts in blocks
    )


def _check_every_rank(blocks: list[tuple[str, Any, torch.nn.Module, torch.nn.Module]], group: Any, rank: int,
                      refusal: str) -> None:
    """Raise on every rank of ``group`` when one of them refuses to shard (``refusal``: this rank's reason,
    ``""`` for none) or when the ranks hold models whose experts differ in layout.

    A rank raising alone would leave the others waiting in the exchange (a gloo abort or a hang),
    and ranks with other expert counts, widths or layers would exchange rows of other sizes: one
    small all-gather before sharding turns both into this error on every rank.
    """
    layout = _layout(blocks)
    mine = torch.tensor([zlib.crc32(layout.encode()), int(bool(refusal))], dtype=torch.long)
    everyone = [torch.zeros_like(mine) for _ in range(group_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if refusal:
        raise MoelensError(refusal)
    refusing = [index for index, other in enumerate(everyone) if int(other[1])]
    if refusing:
        raise MoelensError(
            f"shard_experts: ranks {refusing} of the group refused to shard their model (their errors say why), so "
            "no rank shards; every rank must call it on the same model."
        )
    differing = [index for index, other in enumerate(everyone) if int(other[0]) != int(mine[0])]
    if differing:  # on every rank alike (each sees another sum): each gathers the layouts, to name what differs
        layouts: list[Any] = [None] * len(everyone)
        dist.all_gather_object(layouts, layout, group=group)
        raise MoelensError(
            f"shard_experts: the ranks of the group hold different models: the experts of ranks {differing} differ "
            f"from rank {rank}'s; {_first_difference(layout, layouts[differing[0]], rank, differing[0])}. Every rank "
            "must load the same model (same family, layers, number and size of experts) in the same dtype."
        )


def _first_difference(mine: str, theirs: str, rank: int, other: int) -> str:
    """Where the experts layouts (`_layout`) of this rank (``rank``, ``mine``) and another (``other``, ``theirs``)
    first part, in words: the block and what each rank holds there."""
    ours, others = mine.split("; "), theirs.split("; ")
    at = next((index for index, (a, b) in enumerate(zip(ours, others)) if a != b), min(len(ours), len(others)))
    held = [f"({blocks[at]})" if at < len(blocks) else f"missing (it has {len(blocks)} MoE blocks)"
            for blocks in (ours, others)]
    return f"they first differ at MoE block {at + 1}: rank {rank}'s is {held[0]}, rank {other}'s {held[1]}"


def _guard(experts: torch.nn.Module, args: Any) -> None:
    if not _alive(stored_group(experts)):
        raise ShardedExpertsError(
            f"{type(experts).__name__} holds only experts {experts._ep_first}..{experts._ep_first + experts._ep_num_local - 1} "
            f"of {experts.num_experts}, sharded over a process group that no longer exists "
            "(torch.distributed.destroy_process_group ended it), so the other experts cannot be reached. Build or load "
            "the model again and shard it over the current group (moelens.parallel.shard_experts(model, group))."
        )
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation != NAME:
        raise ShardedExpertsError(
            f"{type(experts).__name__} holds only experts {experts._ep_first}..{experts._ep_first + experts._ep_num_local - 1} "
            f"of {experts.num_experts} (sharded over {experts._ep_size} ranks by moelens.parallel.shard_experts), but "
            f"the model runs the experts implementation {implementation!r}, which would silently drop the experts "
            f'of other ranks. Switch back with model.set_experts_implementation("{NAME}") (blocks built by '
            f'moelens.compress: moelens.compress.set_experts_implementation(model, "{NAME}")).'
        )


def _alive(group: Any) -> bool:
    """Whether ``group`` (None: the default one) is a process group torch.distributed still holds."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):  # "Group ... is not registered" after destroy_process_group and a new init
        return False
    return True


def shard_experts(model: torch.nn.Module, group: Any = None) -> torch.nn.Module:
    """Shard every MoE block's experts over ``group`` and switch the model to ``torch_a2a``.

    Every rank of the group must call it on the same model (same weights, e.g.
    built from the same seed or checkpoint). In place; returns the model.

    Args:
        model: A transformers MoE model of a family moelens knows, whose experts
            module is decorated by transformers' ``use_experts_implementation``, or
            that model wrapped (``moelens.wrap`` / ``moelens.load``: its model is sharded).
        group: The EP process group (default: the whole world). With EP x EDP,
            pass this rank's EP group (`ep_groups`).

    Raises:
        MoelensError: torch.distributed is not initialised, the model has no MoE
            block, a block's experts cannot run ``torch_a2a``, or a block's E is not
            a multiple of the group size; on every rank of the group when one rank's
            model is refused or differs. Every block is checked before any is
            sharded: a refused model is left as it was.
    """
    module = getattr(model, "_module", model)  # a wrapped model (moelens.wrap / load): its transformers model
    if not isinstance(module, torch.nn.Module):
        raise MoelensError(f"shard_experts takes a transformers MoE model (or one wrapped by moelens), got "
                           f"{type(model).__name__} {model!r:.60}.")
    if not dist.is_initialized():
        raise MoelensError("shard_experts: torch.distributed is not initialised; call init_process_group first.")
    non_member = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives the ranks outside the group
    if group is not None and not isinstance(group, dist.ProcessGroup) and not (type(group) is int and group == non_member):
        raise MoelensError(f"shard_experts: group must be a torch.distributed process group (this rank's EP group from "
                           f"moelens.parallel.ep_groups; None: the whole world), got {type(group).__name__} {group!r:.60}.")
    group = dist.group.WORLD if group is None else group
    size, rank = group_size(group), group_rank(group)
    if rank < 0:
        raise MoelensError("shard_experts: this rank is not a member of the given group; pass its own EP group.")
    blocks = _experts_of(module)
    counts, refusal = [], ""
    try:  # refuses before anything is changed, on every rank at once
        if not blocks:
            raise MoelensError(
                f"shard_experts: {type(module).__name__} has no MoE block moelens knows (moelens.wrap(model).moes lists "
                "them); pass a model of a family moelens.families.supported() lists, or describe its blocks with "
                "moelens.families.register(...)."
            )
        counts = _expert_counts(blocks, size)
    except MoelensError as error:
        refusal = str(error)
    _check_every_rank(blocks, group, rank, refusal)
    register_torch_a2a()
    if hasattr(module, "set_experts_implementation"):  # a transformers model (a user's torch model has none)
        module.set_experts_implementation(NAME)
    holder, runs = SharedGroup(group), runs_of(group)
    model_index, runs.models = runs.models, runs.models + 1  # every rank of the group is here (the check above)
    for position, ((_, _, _, experts), num_experts) in enumerate(zip(blocks, counts)):
        experts.config._experts_implementation = NAME  # experts reading their own settings (moelens.compress output)
        per_rank = num_experts // size
        first = rank * per_rank
        _slice(experts, num_experts, first, per_rank)
        experts.__dict__.update(
            _ep_group=holder, _ep_rank=rank, _ep_size=size, _ep_first=first, _ep_num_local=per_rank,
            _ep_tag=layer_tag(model_index, position), _ep_runs=runs,
        )
        if size > 1:
            experts._is_expert_parallel = True
            experts.register_forward_pre_hook(_guard)
    if size > 1:
        for reaching in _holding_experts(module, [name for name, *_ in blocks]):
            for call in ("save_pretrained", "push_to_hub"):  # instance attributes (push_to_hub makes the repo first)
                if reaching is module or hasattr(reaching, call):  # the model, and a base model inside it (lm.model)
                    setattr(reaching, call, functools.partial(_refuse_save, reaching, call))
            reaching.register_forward_pre_hook(functools.partial(forward_enters, runs), prepend=True)
            reaching.register_forward_hook(functools.partial(forward_leaves, runs), always_call=True)
    return model


def _refuse_save(model: torch.nn.Module, call: str, *args: Any, **kwargs: Any) -> NoReturn:
    """A sharded model's ``save_pretrained`` / ``push_to_hub`` (``call``): refused before anything is written, since
    each rank holds only its experts and the checkpoint would keep a fraction of every MoE block's experts under a
    config that names them all."""
    experts = next(module for module in model.modules() if "_ep_group" in module.__dict__)
    first, last = experts._ep_first, experts._ep_first + experts._ep_num_local - 1
    raise ShardedExpertsError(
        f"{call}: {type(model).__name__}'s experts are sharded over {experts._ep_size} ranks by "
        f"moelens.parallel.shard_experts, and this rank ({experts._ep_rank}) holds experts {first}..{last} of "
        f"{experts.num_experts}: a checkpoint saved from it would hold only those under a config naming all "
        f"{experts.num_experts}. Save the model before sharding it (every rank builds it from the same checkpoint "
        "anyway); for this rank's own training state, save model.state_dict()."
    )


def _holding_experts(model: torch.nn.Module, blocks: list[str]) -> list[torch.nn.Module]:
    """The modules whose forward reaches the MoE blocks ``blocks`` (paths in ``model``): the model, every module on
    the way down, the blocks."""
    from ..discovery import paths_above

    return [model.get_submodule(path) for path in sorted(paths_above(blocks) | set(blocks))]


def _expert_counts(blocks: list[tuple[str, Any, torch.nn.Module, torch.nn.Module]], size: int) -> list[int]:
    """Every block's E, once each block is known to be shardable over ``size`` ranks.

    Checks every block before `shard_experts` changes any, so a refused model is left
    as it was.
    """
    counts = []
    for name, family, block, experts in blocks:
        refuse_parameter_adapters(block, family, f"shard_experts ({name})", "sharding would slice the weights and "
                                  "leave the adapters whole", MoelensError, ("experts",),
                                  "Merge the adapters into the weights and shard the result: "
                                  "shard_experts(peft_model.merge_and_unload())", forcing=False)
        if "_ep_group" in experts.__dict__:
            raise MoelensError(f"shard_experts: {name} is sharded already.")
        if not family.experts_call or not is_dispatching(experts):
            raise MoelensError(
                f"shard_experts: {name}.{family.experts} ({type(experts).__name__}, family {family.name!r}) is not "
                "a transformers experts module with pluggable implementations (use_experts_implementation), so "
                "it cannot run torch_a2a: moelens cannot shard this family's experts. Run it data parallel instead "
                "(every rank holds the whole model; do not call shard_experts)."
            )
        if has_lora_adapters(experts):  # slicing the experts would leave their adapters whole
            raise MoelensError(
                f"shard_experts: {name}.{family.experts} carries LoRA adapters (moelens.compress with lora_r), which "
                "sharding would not slice with its experts; fold them in first: moelens.compress.merge_lora(model)."
            )
        # the experts with weights: zero-compute ones (longcat_flash) are the block's, not the experts module's
        num_experts = int(family.resolve(family.num_experts, block)) - family.identity_count(block)
        if not any(param.dim() and param.shape[0] == num_experts for param in experts.parameters(recurse=False)):
            raise MoelensError(f"shard_experts: {name}.{family.experts} has no parameter with {num_experts} experts.")
        counts.append(num_experts)
    uneven = [(name, count) for (name, *_), count in zip(blocks, counts) if count % size]
    if uneven:
        name, count = uneven[0]
        kinds = sorted(set(counts))
        held = f" (the MoE blocks hold {', '.join(map(str, kinds))} experts)" if len(kinds) > 1 else ""
        raise MoelensError(
            f"shard_experts: {name} has {count} experts, not a multiple of the {size} ranks of the group{held}; "
            f"the EP degree must divide every block's expert count: pick it with "
            f"choose_ep_dp_degrees(world_size, {math.gcd(*counts)})."
        )
    return counts


def _slice(experts: torch.nn.Module, num_experts: int, first: int, per_rank: int) -> None:
    """Keep experts ``[first, first + per_rank)`` of every parameter and buffer whose leading dim is E."""
    for param_name, param in list(experts.named_parameters(recurse=False)):
        if param.dim() and param.shape[0] == num_experts:
            new = torch.nn.Parameter(param.data[first : first + per_rank].clone(), requires_grad=param.requires_grad)
            setattr(experts, param_name, new)
    for buffer_name, buffer in list(experts.named_buffers(recurse=False)):
        if buffer.dim() and buffer.shape[0] == num_experts:
            persistent = buffer_name not in experts._non_persistent_buffers_set
            experts.register_buffer(buffer_name, buffer[first : first + per_rank].clone(), persistent=persistent)


def _experts_module(moe_or_experts: Any) -> torch.nn.Module:
    module = getattr(moe_or_experts, "_module", moe_or_experts)
    if "_ep_group" in getattr(module, "__dict__", {}):
        return module
    experts = getattr(moe_or_experts, "experts", None)
    experts = getattr(experts, "_module", experts)
    if experts is not None and "_ep_group" in experts.__dict__:
        return experts
    raise MoelensError(
        f"{type(module).__name__} is not (and holds no) experts module sharded by moelens.parallel.shard_experts."
    )


def local_expert(moe_or_experts: Any, expert: int) -> int | None:
    """This rank's local index of global expert ``expert``, or None when another rank owns it.

    Takes a `Moe` (``model.moes[i]``), its experts envoy, or the sharded experts
    module. Use it to edit an expert's weights under EP::

        local = local_expert(moe, 5)
        if local is not None:
            moe.experts._module.down_proj.data[local] *= 0   # on the owner only
    """
    experts = _experts_module(moe_or_experts)
    num_experts = int(experts.num_experts)
    (whole,) = _whole("local_expert", expert=expert)
    if not 0 <= whole < num_experts:  # checked here: expert_owner's error would name a call the user did not make
        raise MoelensError(
            f"local_expert: expert {whole} is out of range [0, {num_experts}): pass a global expert id of the block "
            f"(as the router gives them, 0..{num_experts - 1}), not a local index."
        )
    rank, local = expert_owner(whole, num_experts, int(experts._ep_size))
    return local if rank == experts._ep_rank else None
