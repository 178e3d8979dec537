"""MoE blocks of transformers that moelens knows and does not serve, and why.

These families run their experts some other way than ``experts(hidden, top_k_index,
top_k_weights)`` over a decorated experts module, so no family entry can describe them.
`moelens.wrap` names their blocks in a warning with the reason, keeps them out of
``model.moes``, and never serves them as a dense `Mlp` (their hidden activations are no
dense MLP's). The docs' family table lists them (`moelens.families.table`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unserved:
    """A transformers model type whose MoE blocks moelens does not serve.

    Attributes:
        name: The model type (``config.model_type``).
        block_classes: Class names of its MoE blocks.
        reason: How its blocks run their experts, which no family entry describes.
    """

    name: str
    block_classes: tuple[str, ...]
    reason: str


UNSERVED: tuple[Unserved, ...] = (
    Unserved("jetmoe", ("JetMoeMoE", "JetMoeMoA"),
             "its MLP and its attention (a mixture of attention heads) run JetMoeParallelExperts over expert-sorted "
             "rows with a gating module of their own, not a transformers experts call"),
    Unserved("switch_transformers", ("SwitchTransformersSparseMLP",),
             "a ModuleDict of dense experts looped over with capacity-limited top-1 routing, not a transformers "
             "experts call"),
    Unserved("nllb-moe", ("NllbMoeSparseMLP",),
             "a ModuleDict of dense experts with capacity-limited top-2 routing (tokens over capacity are dropped), "
             "not a transformers experts call"),
    Unserved("doge", ("DogeCDMoE",),
             "product-key retrieval over many tiny embedding experts beside a dense MLP, not a router's top-k over "
             "an experts module"),
    Unserved("dots3_note", ("Dots3NoteVisionMoE",),
             "its vision tower's MoE blocks run over the image patches of every image at once, with no "
             "[batch, seq] layout to serve values in (its language model's blocks are served)"),
    Unserved("vitpose_backbone", ("VitPoseBackboneMoeMLP",),
             "each input's expert is picked by its dataset index, not by a router"),
)

_BY_CLASS = {cls: entry for entry in UNSERVED for cls in entry.block_classes}


def unserved_block(module: object) -> Unserved | None:
    """The `Unserved` entry of ``module``'s class, or None when it is no MoE block moelens knows it does not serve."""
    return _BY_CLASS.get(type(module).__name__)


def why_no_moe(model: object) -> str:
    """Why the torch module ``model`` has no MoE block moelens serves, in words: the first MoE block it holds
    that moelens does not serve, and why ("has no MoE block" when it holds none)."""
    entry = next((entry for module in model.modules() if (entry := unserved_block(module)) is not None), None)
    if entry is None:
        return "has no MoE block"
    return f"has MoE blocks moelens does not serve ({', '.join(entry.block_classes)}: {entry.reason})"
