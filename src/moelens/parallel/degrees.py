"""How many ranks share the experts, and which rank owns which expert.

Expert parallelism (EP) splits a layer's E routed experts over the ``ep`` ranks
of one EP group: rank ``r`` of the group owns the contiguous range
``[r * E/ep, (r + 1) * E/ep)``. With more ranks than that, the world is ``ep x edp``:
``edp`` EP groups (consecutive ranks) each hold a full copy of the experts, and
the ranks owning the same experts across groups form an expert-data-parallel
(EDP) group (strided ranks) over which expert gradients are summed.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import MoelensError, warn
from ..scalars import as_lone_int

#: Config fields that hold the number of routed experts, in the order they are tried.
NUM_EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
#: Sub-configs a multimodal or composite config keeps its language model's config in (dbrx: its FFN's).
SUB_CONFIGS = ("text_config", "llm_config", "language_config", "thinker_config", "ffn_config")


def _whole(call: str, **numbers: Any) -> list[int]:
    """``numbers`` as ints, in order; a float, a bool or text is refused naming its argument (never rounded)."""
    ints = [as_lone_int(value) for value in numbers.values()]
    for (name, value), whole in zip(numbers.items(), ints):
        if whole is None:
            raise MoelensError(f"{call}: {name} must be an integer, got {value!r} ({type(value).__name__}).")
    return ints


def choose_ep_dp_degrees(world_size: int, num_experts: int) -> tuple[int, int]:
    """``(ep, edp)`` for ``world_size`` ranks and ``num_experts`` experts.

    ``ep`` is the largest degree dividing both (their gcd), so every rank of an EP
    group owns the same number of experts and the world is ``ep * edp`` ranks. When
    nothing larger than 1 divides both (or the model is dense) it falls back to
    ``(1, world_size)`` (every rank keeps every expert) with a warning.
    """
    world_size, num_experts = _whole("choose_ep_dp_degrees", world_size=world_size, num_experts=num_experts)
    if world_size < 1:
        raise MoelensError(f"choose_ep_dp_degrees: world_size must be >= 1, got {world_size}.")
    if num_experts < 0:
        raise MoelensError(f"choose_ep_dp_degrees: num_experts must be >= 0, got {num_experts}.")
    if not num_experts and world_size > 1:  # every degree divides 0: no gcd to take
        warn(
            f"expert parallelism: num_experts is 0, a dense model (no routed experts), so there is nothing to shard; "
            f"falling back to EP=1 x EDP={world_size} (every rank holds the whole model, data parallel). For an "
            "MoE model, pass its number of routed experts: num_experts_from_config(model.config).",
        )
        return 1, world_size
    ep = math.gcd(world_size, num_experts)
    if ep == 1 and world_size > 1:
        warn(
            f"expert parallelism: no degree > 1 divides both the world size {world_size} and the "
            f"{num_experts} experts; falling back to EP=1 x EDP={world_size} (every rank holds every expert). "
            "Use a world size sharing a factor with the number of experts to shard them.",
        )
        return 1, world_size
    return ep, world_size // ep


def num_experts_from_config(config: Any) -> int:
    """The number of routed experts a model config declares (0 for a dense model).

    Reads the first of `NUM_EXPERTS_FIELDS` the config has with a positive value,
    else recurses into `SUB_CONFIGS` (``text_config``, ``llm_config``, ...).

    Raises:
        MoelensError: ``config`` is None, a number, text or a dict (which has no fields to read), not a config.
    """
    if config is None or isinstance(config, (str, bytes, int, float, Mapping)):
        raise MoelensError(
            f"num_experts_from_config takes a model's config (model.config), got {type(config).__name__} "
            f"{config!r:.60}" + ("; load a dict with transformers.AutoConfig.for_model(**d)." if isinstance(config, Mapping)
                                 else ".")
        )
    for name in NUM_EXPERTS_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for name in SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            found = num_experts_from_config(sub)
            if found:
                return found
    return 0


def expert_owner(expert: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """``(rank in the EP group, local index)`` of global expert ``expert``.

    Edit expert ``e``'s weights on the rank that owns it, at its local index::

        rank, local = expert_owner(e, moe.num_experts, ep_size)
        if ep_group_rank == rank:
            moe.experts._module.down_proj.data[local] = 0
    """
    expert, num_experts, ep_size = _whole("expert_owner", expert=expert, num_experts=num_experts, ep_size=ep_size)
    if num_experts < 1:
        raise MoelensError(f"expert_owner: num_experts must be >= 1 (the block's routed experts, moe.num_experts), "
                           f"got {num_experts}; a dense model has no experts to own.")
    if ep_size < 1 or num_experts % ep_size:
        small = [size for size in range(1, math.isqrt(num_experts) + 1) if num_experts % size == 0]
        divisors = sorted({*small, *(num_experts // size for size in small)})
        raise MoelensError(f"expert_owner: {num_experts} experts cannot be split over {ep_size} ranks: each rank owns "
                           f"the same number of experts, so ep_size must divide num_experts (one of {divisors}).")
    if not 0 <= expert < num_experts:
        raise MoelensError(f"expert_owner: expert {expert} is out of range [0, {num_experts}).")
    per_rank = num_experts // ep_size
    return expert // per_rank, expert % per_rank


#: The groups `ep_groups` made, per default group (held weakly: gone with ``destroy_process_group``) and
#: ``(ep, timeout)``: a second call returns the same ones, so models sharded over "the EP group" share its run ids.
_MADE: weakref.WeakKeyDictionary[Any, dict[tuple[int, timedelta | None], tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def world_timeout() -> timedelta | None:
    """The timeout the default process group was made with (``init_process_group(timeout=...)``), or None when
    torch does not say (torch's private API: its backend's options)."""
    world = dist.group.WORLD
    for device in getattr(world, "_device_types", []):
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def ep_groups(ep: int, timeout: timedelta | None = None) -> tuple[Any, Any]:
    """This rank's ``(EP group, EDP group)`` for EP degree ``ep`` over the whole world.

    EP groups are consecutive ranks ``[g*ep, (g+1)*ep)``, EDP groups strided ranks
    ``{r, r+ep, r+2ep, ...}``. Every rank must call this (it creates every group, in
    the same order everywhere, as ``torch.distributed.new_group`` requires). A group of every
    rank is the default group itself (unless ``timeout`` differs from its own), and a second call
    with the same arguments returns the same groups: every model sharded over "the EP group" is
    then on one group object, whose run ids catch a run that failed on some ranks only
    (`moelens.parallel.runs`; two group objects of the same ranks would wait on each other).

    Args:
        ep: The EP degree, a divisor of the world size (`choose_ep_dp_degrees`).
        timeout: How long a collective of the groups may wait; default: the one ``init_process_group`` was given
            (torch's own default for a new group is 30 minutes on gloo, whatever the world's is).
    """
    (ep,) = _whole("ep_groups", ep=ep)
    if not dist.is_initialized():
        raise MoelensError("ep_groups: torch.distributed is not initialised; call init_process_group first.")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise MoelensError(f"ep_groups: timeout must be a datetime.timedelta (as init_process_group takes), got "
                           f"{type(timeout).__name__} {timeout!r:.60}.")
    own = world_timeout()
    timeout = own if timeout is None else timeout
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise MoelensError(f"ep_groups: EP degree {ep} is not a divisor of the world size {world}; choose one of "
                           f"{[d for d in range(1, world + 1) if world % d == 0]} (choose_ep_dp_degrees picks one).")
    made = _MADE.setdefault(dist.group.WORLD, {})  # the world itself is kept there as None, or it would never go
    if (ep, timeout) in made:
        return tuple(dist.group.WORLD if group is None else group for group in made[(ep, timeout)])

    def group_of(ranks: list[int]) -> Any:
        if len(ranks) == world and timeout == own:
            return dist.group.WORLD
        return dist.new_group(ranks, timeout=timeout)

    mine_ep = mine_edp = None
    for start in range(0, world, ep):
        group = group_of(list(range(start, start + ep)))
        if start <= rank < start + ep:
            mine_ep = group
    for offset in range(ep):
        group = group_of(list(range(offset, world, ep)))
        if rank % ep == offset:
            mine_edp = group
    made[(ep, timeout)] = tuple(None if group is dist.group.WORLD else group for group in (mine_ep, mine_edp))
    return mine_ep, mine_edp
