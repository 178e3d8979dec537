"""moelens on transformers' own expert parallelism (``DistributedConfig(ep_size=...)``).

``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=N, ep_size=N))``
shards the expert weights (DTensors, ``Shard(0)`` on the EP mesh), sets each
experts module's ``num_experts`` to its local count and replaces its instance
``forward`` with a dispatch wrapper (``install_forward.<locals>.ep_forward``) that
makes the weights local and exchanges tokens (``AllToAllEP``, ``AllReduceEP`` or
``TorchA2AEP`` for ``ep_implementation="torch_a2a"``).

`moelens.wrap` (``wrapping/envoys.py``) calls `keep_dispatch_forwards` when it sees such a
wrapper (and only then imports this module):

* every wrapped module is flagged with nnsight's ``BODY_FORWARD``, so nnsight runs
  the wrapper as the controller's body instead of putting it back around the
  controller and running the class forward (which drops the dispatch:
  ``got mixed torch.Tensor and DTensor``); the experts call's inputs (global ids)
  and output stay this rank's tokens, as in one process;
* MoE blocks are served by `ExpertParallelMoe`: ``num_experts`` is the global E
  (the DTensor's global shape, not the local count transformers writes on the
  module), and the per-slot values raise `ValueUnavailable`: transformers calls
  the exchange from its wrapper around the experts' forward (and its own
  implementations run the experts on exchanged rows, top-1 with unit weights, so
  no ``[T, k, ...]`` tensor of this rank's tokens exists there). Shard with
  `shard_experts` (moelens' ``torch_a2a``) to read them.
"""

from __future__ import annotations

import torch
from nnsight.intervention.source import BODY_FORWARD

from ..components import Moe
from ..families.entry import PER_SLOT_VALUES
from ..wrapping.envoys import EP_FORWARD, has_dispatch_forward


class ExpertParallelMoe(Moe):
    """`Moe` of a block whose experts transformers' own EP shards (see the module docstring)."""

    @property
    def num_experts(self) -> int:
        """E: the global number of routed experts (the sharded weights' global leading dim)."""
        experts = self.experts._module
        weight = getattr(experts, "gate_up_proj", None)
        if weight is None:
            weight = getattr(experts, "up_proj", None)
        if weight is not None and hasattr(weight, "device_mesh"):  # a DTensor: its shape is the global one
            return int(weight.shape[0])
        return super().num_experts

    def _check_available(self, name: str, implementation: str | None = None) -> None:
        if name in PER_SLOT_VALUES:
            raise self.unavailable(
                name,
                "transformers' own expert parallelism (DistributedConfig(ep_size=...)) runs the experts from a "
                "wrapper around the experts module's forward, where moelens does not reach (its all_to_all and "
                "all_reduce implementations run them on exchanged rows, top-1 with unit weights: no [tokens, k, "
                "...] tensor of this rank's tokens exists there at all)",
                "shard the experts with moelens.parallel.shard_experts (torch_a2a) to read per-slot values; "
                "routing values, routed_output and mlp_output are served here.",
            )
        super()._check_available(name, implementation)


def keep_dispatch_forwards(model: torch.nn.Module) -> type[Moe]:
    """Flag transformers' EP wrappers as nnsight controller bodies; return the `Moe` class to serve blocks with."""
    for module in model.modules():
        if has_dispatch_forward(module):
            module.__dict__[BODY_FORWARD] = True
    return ExpertParallelMoe


__all__ = ["EP_FORWARD", "ExpertParallelMoe", "has_dispatch_forward", "keep_dispatch_forwards"]
