"""Expert parallelism for moelens: experts sharded over ranks, tokens exchanged all-to-all.

Importing this package registers nothing; `register_torch_a2a` (called by
`shard_experts`) registers the ``torch_a2a`` experts implementation with
transformers and moelens. Typical use, one process per rank (``torchrun``)::

    import torch.distributed as dist
    from moelens.parallel import choose_ep_dp_degrees, ep_groups, num_experts_from_config, shard_experts

    dist.init_process_group("gloo")                       # "nccl" on GPUs
    ep, edp = choose_ep_dp_degrees(dist.get_world_size(), num_experts_from_config(model.config))
    ep_group, edp_group = ep_groups(ep)
    shard_experts(model, ep_group)                        # keeps this rank's experts, torch_a2a
    lm = moelens.wrap(model)                              # Moe values for this rank's tokens

See docs/parallel.md.
"""

from .a2a import Plan, RankDivergence, a2a_moe, plan_dispatch
from .comm import Record, Traffic, exchange, traffic
from .degrees import choose_ep_dp_degrees, ep_groups, expert_owner, num_experts_from_config
from .experts import NAME, OPS, torch_a2a_experts_forward
from .register import is_registered, register_torch_a2a
from .shard import ShardedExpertsError, local_expert, shard_experts

__all__ = [
    "NAME", "OPS", "Plan", "RankDivergence", "Record", "ShardedExpertsError", "Traffic", "a2a_moe",
    "choose_ep_dp_degrees", "ep_groups", "exchange", "expert_owner", "is_registered", "local_expert",
    "num_experts_from_config", "plan_dispatch", "register_torch_a2a", "shard_experts",
    "torch_a2a_experts_forward", "traffic",
]
