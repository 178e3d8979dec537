"""`LayerList`: the envoy of a model's decoder layer list (``model.layers``), indexed by layer number."""

from __future__ import annotations

from typing import Any

from nnsight import Envoy

from ..errors import LayerIndexError
from ..families.entry import VALUE_NAMES
from ..scalars import as_lone_int
from .base import StandardNames


class LayerList(Envoy):
    """``model.layers``: nnsight's envoy of the decoder layers' ``ModuleList``.

    ``model.layers[i]`` takes an integer layer (a numpy integer or a 0-d tensor too; negative
    counts from the end) or a slice; any other key, or a layer the model lacks, raises
    `LayerIndexError` saying how many layers there are (nnsight's own envoy looks the key up as
    an attribute name and reports an attribute such as ``'99'`` missing).
    """

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice) or not hasattr(self._module, "__len__"):
            return super().__getitem__(check_slice(key, "model.layers", "decoder layers", self._module))
        count = len(self._module)
        layer = as_lone_int(key)
        if layer is None or not -count <= layer < count:
            raise LayerIndexError(
                f"model.layers[{key!r}]: expected an integer layer in 0..{count - 1} (or -{count}..-1 from the end), "
                f"the model has {count} decoder layers; its MoE blocks are model.moes (model.moes[i].layer says where)."
            )
        return super().__getitem__(layer)


def check_slice(key: Any, name: str, counted: str, items: Any) -> Any:
    """``key``, after refusing a slice whose bounds are not integers (a list's bare TypeError named neither)."""
    if isinstance(key, slice) and not all(bound is None or as_lone_int(bound) is not None
                                          for bound in (key.start, key.stop, key.step)):
        raise LayerIndexError(f"{name}[{key!r}]: a slice takes integer bounds (or None), as a list's does; there are "
                              f"{len(items)} {counted}.")
    return key


class BlocklessLayer(Envoy):
    """``model.layers[i]`` of a layer that holds no MLP block (a hybrid model's attention or mamba layer, such as
    nemotron_h's): asking it for ``mlp`` says so, where nnsight's envoy reports a bare missing attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "mlp":
                raise
            raise AttributeError(
                f"{self.path} ({type(self._module).__name__}) has no 'mlp': moelens sees no MLP block it serves in "
                "this layer (a hybrid model's attention or mamba layer, or an MLP of a kind it does not recognise, "
                "such as BERT's intermediate / output pair); the MoE blocks are model.moes, each saying its layer "
                "(.layer)."
            ) from None


class RenamedBlockLayer(StandardNames, Envoy):
    """``model.layers[i]`` of a layer whose block moelens serves as ``mlp`` under the model's own name (granitemoe's
    ``block_sparse_moe``): a module given to ``mlp`` is refused (`StandardNames`)."""


#: What a `Moe` answers that the module holding several blocks (`BlockHolder`) does not.
BLOCK_NAMES = (*VALUE_NAMES, "router", "experts", "shared_experts", "num_experts", "top_k", "params", "family",
               "SCORING", "layer")


class BlockHolder(Envoy):
    """``model.layers[i].mlp`` where the layer's MLP module holds MoE blocks of its own (ernie4_5_vl_moe's
    ``text_moe`` and ``vision_moe``): asking it for what a block serves names them, where nnsight's envoy reports a
    bare missing attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in BLOCK_NAMES:
                raise
            raise AttributeError(
                f"{self.path} ({type(self._module).__name__}) is no MoE block itself: it holds the MoE blocks "
                f"{', '.join(held_blocks(self))}; read {name} on one of them."
            ) from None


def held_blocks(envoy: Envoy) -> list[str]:
    """The MoE blocks below ``envoy`` in its model, each named by its path and its place in ``model.moes``."""
    return [f"{moe.path} (model.moes[{index}])" for index, moe in enumerate(getattr(envoy.root, "moes", []))
            if moe.path.startswith(f"{envoy.path}.")]


class MoeList(list):
    """``model.moes``: the MoE blocks in layer order, a list indexed by block (not by layer).

    ``model.moes[i]`` takes what a list takes (an integer, negative from the end, or a slice; a numpy integer or a
    0-d tensor too); any other key, or an index past the blocks, raises `LayerIndexError` saying how many blocks
    there are and where layer ``i``'s block is (a Python list's bare IndexError or TypeError named neither).
    """

    @staticmethod
    def why_empty() -> str:
        """For an empty list: why, where a family registered since the wrap describes the model's blocks ("" else;
        `model.moes` sets it)."""
        return ""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return MoeList(super().__getitem__(check_slice(key, "model.moes", "MoE blocks", self)))
        count = len(self)
        index = as_lone_int(key)
        if index is None or not -count <= index < count:
            if not count:
                raise LayerIndexError(f"model.moes[{key!r}]: this model has no MoE block (model.moes is empty)"
                                      f"{self.why_empty()}.")
            layers = [moe.layer for moe in self]
            structure = getattr(self[0].root, "_structure", None)
            decoder = getattr(structure, "layers", None)
            by_layer = (decoder is not None and len(set(layers)) == count
                        and all(moe.path.partition(".")[2].startswith(f"{decoder}.") for moe in self))
            raise LayerIndexError(
                f"model.moes[{key!r}]: expected an integer block index in 0..{count - 1} (or -{count}..-1 from the "
                f"end): model.moes counts the {count} MoE blocks, not the layers (they sit on layers {layers}); "
                + ("layer i's block is model.layers[i].mlp." if by_layer else
                   "each block's .path and .layer say where it is.")
            )
        return super().__getitem__(index)

    def __repr__(self) -> str:
        """One line per block (its path, family, E, k, experts implementation): the blocks' own trees, one per
        block, ran to 100 KB on a real model. ``model.moes[i]`` shows block i's tree."""
        lines = [f"  [{index}] {moe.path}: {_block_line(moe)}" for index, moe in enumerate(self)]
        if not self:
            return "MoeList of 0 MoE blocks (moelens serves no MoE block of this model)"
        return "\n".join([f"MoeList of {len(self)} MoE block{'s' * (len(self) != 1)} (model.moes[i] shows one):",
                          *lines])


def _block_line(block: Any) -> str:
    """`MoeList.__repr__`'s line of ``block``: its family, E, k and experts implementation, or what replaced it after
    wrapping (moelens serves the block as wrapped, so its values are refused until the model is wrapped again)."""
    from .base import replaced_since_wrap  # which imports this module's package
    from .moe import Moe

    if not isinstance(block, Moe):  # another module given to the block's envoy
        return (f"replaced through its envoy by {type(block._module).__name__}, no MoE block (wrap the model again: "
                "moelens.wrap(model._module))")
    try:
        root = block.root
        if root is not block:  # (the wrapped model is gone: nothing to compare with)
            try:
                root._module.get_submodule(block.path.partition(".")[2])  # the root envoy's path is "model"
            except AttributeError:
                return f"{block.family.name}; removed after wrapping (wrap the model again)"
        replaced = replaced_since_wrap(block)
        if replaced:
            return f"{block.family.name}; {', '.join(replaced)} replaced after wrapping (wrap the model again)"
        return f"{block.family.name}, E={block.num_experts}, k={block.top_k}, {block.experts_implementation}"
    except Exception:  # noqa: BLE001 - a repr never raises
        return f"{block.family.name} (its counts cannot be read)"
