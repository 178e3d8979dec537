"""`register_torch_a2a`: make ``torch_a2a`` known to transformers and to moelens.

Idempotent and lazy: nothing is registered until it is called (importing moelens
or ``moelens.parallel`` registers nothing). It registers

* ``torch_a2a`` in transformers' ``ExpertsInterface`` (``ALL_EXPERTS_FUNCTIONS``), so
  ``model.set_experts_implementation("torch_a2a")`` works on a model whose experts
  were sharded by `shard_experts`;
* `TorchA2AEP` in transformers' ``EPImplementationInterface``, so
  ``DistributedConfig(..., ep_implementation="torch_a2a")`` runs transformers' own
  expert parallelism (``from_pretrained``) through the same exchanges;
* the op names inside it with `moelens.components.register_implementation`, so
  the per-slot values (`Moe.expert_pre_activations`, `Moe.expert_activations`, `Moe.expert_outputs`) are
  served under it.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..components import register_implementation
from ..errors import MoelensError
from .experts import NAME, OPS, torch_a2a_experts_forward
from .runs import forward_enters, forward_leaves, layer_tag, runs_of

_registered = False
#: The attribute of transformers' EP mesh (one per model ``from_pretrained`` builds) counting the experts modules built
#: on it: their positions in their model, in plan order (the same on every rank).
_POSITIONS = "_moelens_experts_built"


def _torch_a2a_ep_class() -> type:
    """`TorchA2AEP`, built on transformers' `EPImplementation` (imported only here)."""
    from transformers.distributed.expert_parallel import EPImplementation

    class TorchA2AEP(EPImplementation):
        """transformers EP implementation running moelens' ``torch_a2a`` exchanges.

        transformers shards the expert weights (``grouped_gemm``), makes them local
        around the call and hands each rank's batch here with global expert ids;
        this runs `torch_a2a_experts_forward` over the EP mesh's group. The ranks of
        the EP group must hold different batches (``DistributedConfig(fsdp_size=N,
        ep_size=N)``): with ``tp_size > 1`` they share one, which ``all_to_all`` /
        ``auto`` handle. Each forward of the model is a run (`moelens.parallel.runs`),
        counted at its first experts call (a trace's first forward is in the trace's run);
        with FSDP, a trace raising on some ranks only leaves the others waiting in FSDP's
        parameter gather until the group's timeout (docs/parallel.md, hazards).
        """

        def __init__(self, experts: Any, ep_mesh: Any, tp_mesh: Any) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                raise ValueError(
                    'ep_implementation="torch_a2a" needs the ranks of an expert group to hold different batches '
                    f"(tp_size=1, e.g. DistributedConfig(fsdp_size=N, ep_size=N)); got tp_size={tp_mesh.size()}. "
                    'Use ep_implementation="all_to_all" or "auto" with tensor parallelism.'
                )
            self.experts = experts
            self.group = ep_mesh.get_group()
            # Built in plan order on every rank, one mesh per model: the same module gets the same tag everywhere,
            # whatever models a rank loaded before (a process-wide count gave other tags after other loads).
            positions = ep_mesh.__dict__.setdefault(_POSITIONS, itertools.count())
            #: This module's position among its model's experts modules (0: the first, which counts the runs).
            self.position = next(positions)
            experts.__dict__.setdefault("_ep_tag", layer_tag(0, self.position))
            experts.__dict__.setdefault("_ep_runs", runs_of(self.group))

        def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            runs = self.experts.__dict__["_ep_runs"]
            if self.position == 0:  # a forward of the model begins (no forward hooks here, unlike shard_experts')
                forward_enters(runs, self.experts, ())
                forward_leaves(runs, self.experts, (), None)
            return torch_a2a_experts_forward(
                self.experts, hidden_states, top_k_index, top_k_weights, process_group=self.group
            )

    return TorchA2AEP


def register_torch_a2a() -> None:
    """Register ``torch_a2a`` with transformers (experts and EP registries) and moelens. Idempotent."""
    global _registered
    if _registered:
        return
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:  # pragma: no cover - transformers is pinned
        raise MoelensError(f"torch_a2a needs transformers' ExpertsInterface ({error}).") from error
    ExpertsInterface.register(NAME, torch_a2a_experts_forward)
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError:  # torch without distributed support: only manual sharding is available
        pass
    else:
        EPImplementationInterface.register(NAME, _torch_a2a_ep_class())
    register_implementation(NAME, OPS)
    _registered = True


def is_registered() -> bool:
    """Whether `register_torch_a2a` ran in this process."""
    return _registered
