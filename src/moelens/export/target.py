"""What is being exported: a whole model or one block, found through moelens' components.

`resolve` accepts a wrapped model (``moelens.wrap`` / ``moelens.load``: its `Moe`
components, ``model.moes``), a plain transformers model (its blocks found as
``moelens.wrap`` finds them), or one `Moe` component (``model.moes[i]``), and returns
its MoE blocks as (module name, family, layer). It refuses a model that carries what an
export would silently drop (nnsight edits, ``model.edit()``, or torch hooks on an MoE
block), and a call from inside a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..adapters import refuse_parameter_adapters
from ..components import Moe
from ..components.base import layer_of, refuse_replaced, replaced_blocks
from ..components.served import trace_running
from ..families import Family, registry
from ..families.entry import beneath_adapters, get_path
from ..families.unserved import why_no_moe
from ..modules import foreign_global_hooks, foreign_hooks, hook_name, text_config
from ..discovery import discover
from .errors import ExportError, ExportRefused


@dataclass
class Block:
    """One MoE block of the target: its module name (relative to `Target.module`), family and layer, and for a block
    exported on its own from a wrapped model, its path there (`Moe.path`, or None)."""

    name: str
    family: Family
    layer: int | None
    path: str | None = None


@dataclass
class Target:
    """The torch module to export and its MoE blocks.

    Attributes:
        kind: ``"model"`` (token ids -> logits or hidden states) or ``"block"`` (hidden -> mlp_output).
        module: The transformers model, or the block module.
        blocks: The MoE blocks (for a block export: the block itself, name ``""``).
        wrapped: The moelens-wrapped model, when there is one (used to replay edits in a trace).
    """

    kind: str
    module: torch.nn.Module
    blocks: list[Block] = field(default_factory=list)
    wrapped: Any = None

    @property
    def family(self) -> Family:
        return self.blocks[0].family

    @property
    def context_length(self) -> int | None:
        """The positions the module's config gives it (``max_position_embeddings``, a composite model's text
        config's), None where it names none."""
        limit = getattr(text_config(self.module), "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None


def resolve(model: Any) -> Target:
    """The `Target` for a wrapped model, a transformers model or a `Moe` component."""
    _refuse_inside_a_trace()
    if isinstance(model, Moe):
        _refuse_edits(getattr(model, "root", None))
        refuse_replaced(model, replaced_blocks(model), "the export", "the archive would hold the old block",
                        ExportError)
        target = Target("block", model._module, [Block("", model.family, model.layer, model.path)], wrapped=None)
    elif hasattr(model, "moes") and isinstance(getattr(model, "_module", None), torch.nn.Module):
        _refuse_edits(model)
        refuse_replaced(model, replaced_blocks(model), "the export", "model.moes lists the blocks as wrapped",
                        ExportError)
        module = model._module
        names = {id(child): name for name, child in module.named_modules()}
        blocks = [Block(names[id(moe._module)], moe.family, moe.layer) for moe in model.moes]
        target = Target("model", module, blocks, wrapped=model)
    elif isinstance(model, torch.nn.Module):
        family = registry.for_block(model)
        if family is not None:
            target = Target("block", model, [Block("", family, None)])
        else:
            structure = discover(model)
            blocks = [Block(name, registry.for_block(model.get_submodule(name)) or structure.family, layer_of(name, model))
                      for name in structure.moe_blocks]
            target = Target("model", model, blocks)
    else:
        raise ExportError(
            f"to_nnef exports a wrapped model (moelens.wrap/load), a transformers model or one Moe block "
            f"(model.moes[i]); got {type(model).__name__}."
        )
    if not target.blocks:
        raise ExportError(
            f"{type(target.module).__name__} {why_no_moe(target.module)}, so there is no tract_moe_ffn to export; "
            "use torch-to-nnef directly for dense models."
        )
    _refuse_sharded(target)
    for block in target.blocks:
        refuse_parameter_adapters(target.module.get_submodule(block.name), block.family,
                                  f"the export of {block.name or type(target.module).__name__}",
                                  "the archive would hold the base weights alone", ExportRefused,
                                  remedy="Merge the adapters into the weights and export the result "
                                         "(peft_model.merge_and_unload(), wrapped or not, or peft_model.merge_adapter() "
                                         "in place), or export under peft_model.disable_adapter() for the base model")
    _refuse_hooks(target)
    return target


def _refuse_inside_a_trace() -> None:
    if not trace_running("to_nnef"):
        return
    raise ExportError(
        "moelens.export runs the model itself (tracing it for the archive, and in torch to verify it), which it "
        "cannot do from inside a trace while that trace runs the model. Call it after the with-block; make the "
        "trace's interventions part of the export with moelens.export.Edits(...) (to_nnef(..., edits=...))."
    )


def _refuse_sharded(target: Target) -> None:
    for block in target.blocks:
        root = target.module.get_submodule(block.name) if block.name else target.module
        experts = get_path(root, beneath_adapters(root, block.family.experts))
        if "_ep_group" in experts.__dict__ and experts._ep_num_local < experts.num_experts:
            first = experts._ep_first
            raise ExportRefused(
                f"{block.name or type(root).__name__}: the experts are sharded over ranks (moelens.parallel."
                f"shard_experts) and this rank holds only experts {first} to {first + experts._ep_num_local - 1}, so "
                "an archive would miss the others. Export the model loaded whole, before shard_experts."
            )


def _refuse_edits(wrapped: Any) -> None:
    if wrapped is not None and getattr(wrapped, "_edits", None):
        raise ExportRefused(
            f"the model carries {len(wrapped._edits)} nnsight edit(s) (model.edit()): arbitrary interventions cannot "
            "be baked into the export, and dropping them would export a different model. Pass the edits tract can "
            "express as moelens.export.Edits(...) and call model.clear_edits() first."
        )


def _refuse_hooks(target: Target) -> None:
    hooks = foreign_global_hooks()
    if hooks:
        raise ExportRefused(
            f"a forward hook registered for every module ({hook_name(hooks[0])}, torch.nn.modules.module."
            "register_module_forward_hook) is in force: the export replaces the MoE blocks' computation with "
            "tract_moe_ffn, so what the hook does there would be dropped. Remove it (handle.remove()) before exporting."
        )
    for block in target.blocks:
        root = target.module.get_submodule(block.name) if block.name else target.module
        for name, module in root.named_modules():
            hooks = foreign_hooks(module)
            if hooks:
                where = ".".join(filter(None, (block.name, name))) or type(root).__name__
                raise ExportRefused(
                    f"{where} has a forward hook ({hook_name(hooks[0])}): the export replaces the MoE block's computation with "
                    "tract_moe_ffn, so the hook would be dropped. Remove it (or express it as "
                    "moelens.export.Edits) before exporting."
                )
