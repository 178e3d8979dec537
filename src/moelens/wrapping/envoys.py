"""Which envoy `wrap` gives each module of the model, and the standard names it binds over the native ones.

``model.layers`` (the decoder layer list, whatever the model calls it), ``model.layers[i].mlp`` (the block, whatever
the family calls it), the layers holding no block, the modules holding blocks, and the MoE blocks' envoy under
transformers' own expert parallelism.
"""

from __future__ import annotations

from typing import Any

import torch

from ..components import Moe
from ..components.base import bind_alias, envoy_at
from ..discovery import Structure, layer_path
from ..errors import MoelensError


def _refuse_block_classes(envoys: dict, model: torch.nn.Module, blocks: list[str]) -> None:
    """Refuse an ``envoys=`` key that is the class of a block moelens serves: nnsight gives a module the envoy of
    its class before any path's, so the block would be no `Moe` / `Mlp`."""
    for key, envoy in envoys.items():
        claimed = next((name for name in blocks if isinstance(key, type) and isinstance(model.get_submodule(name), key)),
                       None)
        if claimed is not None:
            raise MoelensError(
                f"wrap(envoys=...) maps {key.__name__} to {getattr(envoy, '__name__', envoy)}, but {claimed} is one, "
                "and moelens makes that block its own envoy (Moe or Mlp); key the envoy by the paths of the other "
                "modules you want it on instead."
            )


def _from_root(name: str) -> str:
    """nnsight's path of the module named ``name`` in the model, as an ``envoys`` key: nnsight matches a key against
    the end of each module's path, so a bare name (``"0"``, a block of an ``nn.Sequential``) would also pick every
    module deeper down whose path ends in it (``0.experts.mlps.0``)."""
    return f"model.{name}"


#: What the qualified name of transformers' expert-parallel dispatch wrapper contains.
EP_FORWARD = ".install_forward.<locals>.ep_forward"


def has_dispatch_forward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s instance forward is transformers' expert-parallel dispatch wrapper."""
    return EP_FORWARD in getattr(module.__dict__.get("forward"), "__qualname__", "")


def _expert_parallel_envoy(model: torch.nn.Module) -> type[Moe]:
    """The envoy class for MoE blocks: `Moe`, or for a model distributed with transformers'
    own expert parallelism (``DistributedConfig(ep_size=...)``, whose experts' forward is a
    dispatch wrapper) the one `moelens.parallel.transformers_ep` provides, after keeping
    those wrappers as nnsight's controller bodies. See docs/parallel.md.
    """
    if not any(has_dispatch_forward(module) for module in model.modules()):
        return Moe
    from ..parallel.transformers_ep import keep_dispatch_forwards

    return keep_dispatch_forwards(model)


def _block_holders(structure: Structure) -> list[str]:
    """The paths of the layers' MLP modules that are no block themselves but hold MoE blocks (ernie4_5_vl_moe's)."""
    blocks = {*structure.moe_blocks, *structure.dense_blocks}
    parents = dict.fromkeys(name.rpartition(".")[0] for name in structure.moe_blocks)
    return [parent for parent in parents
            if parent not in blocks and layer_path(parent) == parent.rpartition(".")[0]]


def _blockless_layers(model: torch.nn.Module, structure: Structure) -> list[str]:
    """The paths of the decoder layers (of ``model.layers``) that hold no MoE block or dense MLP."""
    holding = {layer_path(name) for name in structure.moe_blocks + structure.dense_blocks}
    layers = model.get_submodule(structure.layers)
    count = len(layers) if hasattr(layers, "__len__") else 0
    return [path for path in (f"{structure.layers}.{i}" for i in range(count)) if path not in holding]


def _bind(host: Any, alias: str, native: str) -> None:
    """Alias ``host.<native>`` as ``host.<alias>`` unless the name is taken."""
    if alias in host.__dict__ or hasattr(host._module, alias):
        return
    bind_alias(host, alias, native, envoy_at(host, native))


def _renamed_blocks(structure: Structure) -> dict[str, str]:
    """``{layer path: the block's name in it}`` of the layers whose MoE block or dense MLP is not called ``mlp``."""
    layers = {name: layer_path(name) for name in structure.moe_blocks + structure.dense_blocks}
    return {layer: name[len(layer) + 1:] for name, layer in layers.items()
            if layer is not None and layer != name and name[len(layer) + 1:] != "mlp"}


def _bind_standard_names(wrapped: Any, structure: Structure) -> None:
    """``model.layers`` and ``model.layers[i].mlp``, whatever the model calls them."""
    if structure.layers is not None and structure.layers != "layers":
        _bind(wrapped, "layers", structure.layers)
    for layer, name in _renamed_blocks(structure).items():
        _bind(envoy_at(wrapped, layer), "mlp", name)
