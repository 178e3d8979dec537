"""`wrap` and `load`: an nnsight model whose MoE blocks are `Moe` components.

`wrap` finds the MoE blocks of a transformers model from the model itself (a
module whose class is a registered family's block and that holds an experts
module), makes them `Moe` envoys and the dense MLPs of the same decoder stack
`Mlp` envoys, and binds the standard names: ``model.layers`` is the decoder layer
list, ``model.layers[i].mlp`` the block whatever the family calls it, and
``model.moes`` the MoE components in layer order. Native module paths keep working.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import nnsight
import torch
from nnsight import NNsight, TransformersModel
from safetensors import SafetensorError
from nnsight.intervention.envoy import traceable
from nnsight.intervention.source import SourceNotAvailable
from nnsight.modeling import processing

from .components import Mlp, Moe, served
from .components.base import envoy_at
from .components.implementations import check_known, is_dispatching, known
from .components.mlp import DOWN_PROJECTIONS, UP_PROJECTIONS
from .components.params import op_names
from .errors import FamilyError, MoelensError
from .families import Family, registry
from .families.entry import get_path
from .families.unserved import unserved_block
from .modules import enclosing, is_adapter_layer, takes_keyword


@dataclass
class Structure:
    """Where a model's MoE blocks and dense MLPs are (module names, no envoys).

    Attributes:
        family: The family of its MoE blocks, or the family its config names, or None.
        moe_blocks: Module names of the MoE blocks, in module order.
        dense_blocks: Module names of the dense MLPs of the same decoder stacks.
        layer_lists: Module names of the decoder layer lists holding the blocks.
        layers: The one of them ``model.layers`` names (`_decoder_layers`), or None.
        block_attr: The attribute of a decoder layer that holds its block (dense or MoE; ``""``: the
            layer is the block): the family's ``block_attr``, or where its blocks are found when it
            keeps the default ``"mlp"`` and they sit elsewhere (`_block_attribute`).
    """

    family: Family | None = None
    moe_blocks: list[str] = field(default_factory=list)
    dense_blocks: list[str] = field(default_factory=list)
    layer_lists: list[str] = field(default_factory=list)
    layers: str | None = None
    block_attr: str = "mlp"


def _is_experts(module: Any) -> bool:
    """Whether ``module`` is an experts module (transformers-decorated, or undecorated with weights)."""
    return isinstance(module, torch.nn.Module) and (is_dispatching(module) or type(module).__name__.endswith("Experts"))


def _holds_mixture(module: torch.nn.Module, family: Family) -> bool:
    try:
        return _is_experts(get_path(module, family.experts))
    except AttributeError:
        return False


def _children(module: torch.nn.Module) -> list[str]:
    return [child for child, _ in module.named_children()]


def _refuse_adapter_layers(name: str, module: torch.nn.Module, family: Family) -> None:
    """Raise a `FamilyError` when PEFT wraps the block's router or experts (``target_parameters``).

    moelens reads the ops of the family's own router and experts forward; a PEFT layer
    standing in their place (its ``base_layer`` the original) has other ops.
    """
    for part, path in (("router", family.router), ("experts", family.experts)):
        try:
            target = get_path(module, path)
        except AttributeError:
            continue
        if is_adapter_layer(target):
            raise FamilyError(
                f"{name}.{path}, the {part} of this {family.name} block, is wrapped by a PEFT adapter layer "
                f"({type(target).__name__}), so moelens cannot read the {part}'s own operations: merge the "
                "adapters into the weights first (model = peft_model.merge_and_unload()) and wrap the result."
            )


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


def _has_path(module: torch.nn.Module, path: str) -> bool:
    try:
        return get_path(module, path) is not None
    except AttributeError:
        return False


def _check_selection_bias(name: str, module: torch.nn.Module, family: Family) -> None:
    """Warn when a registered family's ``selection_bias`` names nothing on its block (a typo there
    would leave routing ranked by the logits, and route_around / force writing the wrong value).

    moelens' own entries are not checked: their routers leave the bias out when the config does.
    """
    scoring = family.scoring_of(module)
    if not (scoring.selection_op and scoring.selection_bias) or registry.is_built_in(family):
        return
    try:
        family.resolve(scoring.selection_bias, module)
    except FamilyError as error:
        warnings.warn(
            f"family {family.name!r}: selection_bias {scoring.selection_bias!r} names nothing on block {name} "
            f"({_sentence(error)}). Its routing is served as ranked by router_logits, so route_around and force write the "
            "logits, not what the router ranks. Fix the family's selection_bias (None when the router adds no bias).",
            stacklevel=4,
        )


def _has_child(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return any(isinstance(getattr(module, name, None), torch.nn.Module) for name in names)


def _is_dense_mlp(module: Any) -> bool:
    """Whether ``module`` is a dense MLP: it has an up (or gate) projection and a down projection, and
    neither holds a weight per expert (a 3-D ``[E, out, in]`` weight: an MoE block of no registered family)."""
    if not isinstance(module, torch.nn.Module) or unserved_block(module) is not None:
        return False
    weights = [getattr(getattr(module, name, None), "weight", None) for name in (*UP_PROJECTIONS, *DOWN_PROJECTIONS)]
    per_expert = any(isinstance(weight, torch.Tensor) and weight.dim() > 2 for weight in weights)
    return _has_child(module, UP_PROJECTIONS) and _has_child(module, DOWN_PROJECTIONS) and not per_expert


def _layer_path(name: str) -> str | None:
    """The decoder layer a block sits in: ``model.layers.3`` for ``model.layers.3.mlp``."""
    parts = name.split(".")
    indices = [position for position, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: indices[-1] + 1]) if indices else None


def _layer_list(name: str) -> str | None:
    """The module list a block sits in: ``model.layers`` for ``model.layers.3.mlp``."""
    layer = _layer_path(name)
    return layer.rpartition(".")[0] if layer is not None else None


def _check_block_attr(model: torch.nn.Module, name: str, family: Family) -> None:
    """Raise a `FamilyError` when a block's decoder layer has no ``block_attr`` (aliased as ``mlp`` there).

    Blocks are found by class anywhere (a converted ``self_attn.o_proj`` too), so only a
    ``block_attr`` the layer lacks is wrong; ``"mlp"`` needs no alias and ``""`` is the layer.
    """
    layer = _layer_path(name)
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
    places = {name.rpartition(".")[2] for name in blocks if _layer_path(name) == name.rpartition(".")[0]}
    return places.pop() if len(places) == 1 else "mlp"


def _dense_layer_lists(model: torch.nn.Module, attribute: str) -> list[str]:
    """The module lists (decoder layer lists) whose layers hold a dense MLP at ``attribute``."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and any(_is_dense_mlp(getattr(layer, attribute, None)) for layer in module)
    ]


def discover(model: torch.nn.Module) -> Structure:
    """Find the MoE blocks, the dense MLPs beside them and the decoder layer lists."""
    structure = Structure()
    unknown: list[str] = []
    idle: dict[str, str] = {}  # family -> a block of it that holds no experts module where it says
    checked_bias: set[str] = set()  # families whose selection_bias was looked for (on their first block)
    unserved: dict[str, list[str]] = {}  # model type -> its blocks moelens knows and does not serve
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
            idle.setdefault(family.name, f"{name} ({type(module).__name__}; children {_children(module)})")
            continue
        _check_paths(name, module, family)
        _check_block_attr(model, name, family)
        if family.name not in checked_bias:
            checked_bias.add(family.name)
            _check_selection_bias(name, module, family)
        structure.family = structure.family or family
        structure.moe_blocks.append(name)
        layers = _layer_list(name)
        if layers is not None and layers not in structure.layer_lists:
            structure.layer_lists.append(layers)
    for model_type, blocks in unserved.items():
        warnings.warn(
            f"moelens does not serve these MoE blocks of {model_type}: {', '.join(blocks)}; "
            f"{unserved_block(model.get_submodule(blocks[0])).reason}. model.moes leaves them out and they are "
            "plain envoys: read them with plain nnsight (their .output, .inputs and their children's).",
            stacklevel=3,
        )
    if unknown:
        warnings.warn(
            f"moelens found MoE blocks of no registered family: {', '.join(unknown)}. They are plain "
            "envoys; describe them with moelens.families.register(Family(...)) to serve their routing.",
            stacklevel=3,
        )
    for family_name, block in idle.items():
        if structure.family is None or structure.family.name != family_name:
            family = registry.get(family_name)
            warnings.warn(
                f"moelens: blocks of family {family_name!r} hold no experts module at {family.experts!r} "
                f"(e.g. {block}), so none is served as a Moe: a checkpoint without a mixture, or a family whose "
                "experts path is wrong (an experts module is decorated with transformers' use_experts_implementation "
                "or has a class name ending in 'Experts').",
                stacklevel=3,
            )
    if structure.family is None:
        config = getattr(model, "config", None)
        for model_type in registry.model_types(config) if config is not None else []:
            structure.family = registry.for_model_type(model_type)
            if structure.family is not None:
                break
    structure.block_attr = _block_attribute(structure.family, structure.moe_blocks)
    # a layer that is the block keeps its dense MLP as `mlp`; a model of no family has its MLPs there
    attribute = structure.block_attr or "mlp"
    if not structure.moe_blocks:  # a dense model: its decoder layers are the lists that hold dense MLPs
        structure.layer_lists = _dense_layer_lists(model, attribute)
    moes = set(structure.moe_blocks)
    for layers in structure.layer_lists:
        for index, layer in enumerate(get_path(model, layers)):
            name = f"{layers}.{index}.{attribute}"
            if name not in moes and _is_dense_mlp(getattr(layer, attribute, None)):
                structure.dense_blocks.append(name)
    structure.layers = layers = _decoder_layers(model, structure.layer_lists, dense=not structure.moe_blocks)
    if not structure.moe_blocks and not unknown and not idle and not unserved:
        where = (f"at layers[i].{attribute}" if layers is not None and structure.layer_lists == [layers] else
                 f"in {', '.join(structure.layer_lists)}; " + (f"layers is {layers}" if layers else
                                                              "no list of them is the text decoder's layers"))
        found = (f"its {len(structure.dense_blocks)} dense MLPs ({where}) are Mlp components serving mlp_output and "
                 "mlp_activation" if structure.dense_blocks else
                 f"no dense MLP was found either (a module at layers[i].{attribute} with up and down projections)")
        warnings.warn(
            "moelens found no MoE block in this model (no module of a registered family's block class holding "
            f"an experts module): model.moes is [], and {found}.",
            stacklevel=3,
        )
    return structure


class MoeModelMixin:
    """What moelens adds to an nnsight model: the MoE components and the family."""

    _structure: Structure
    #: The nnsight keyword arguments `wrap` was given (a deep copy is wrapped with them again).
    _wrap_options: dict[str, Any]
    #: nnsight's batcher, landing moelens' swaps on what the model holds then (`served.Rebase`).
    _batcher_class = served.MoeBatcher

    @property
    def moes(self) -> list[Moe]:
        """The MoE components, in layer order."""
        return [envoy_at(self, name) for name in self._structure.moe_blocks]

    @property
    def family(self) -> Family | None:
        """The family of this model's MoE blocks (None for a model moelens does not know)."""
        return self._structure.family

    def set_experts_implementation(self, implementation: str | dict[str, str]) -> None:
        """Run every MoE block's experts with ``implementation`` (``"grouped_mm"``, ``"batched_mm"``,
        ``"eager"``, or another transformers knows; a dict of sub-config names, ``""`` for the
        model's own config, gives one per sub-model, as transformers' switch takes it).

        transformers' own switch first; then the config of each decorated experts module it left on
        another implementation is set directly: transformers switches a class only when the file
        defining it contains ``@use_experts_implementation`` (not a subclass defined in a notebook or a
        script of one's own), and has no switch for a plain torch model or the blocks `moelens.compress`
        made.
        """
        module = self._module
        config = getattr(module, "config", None)
        wanted = implementation if isinstance(implementation, dict) else {"": implementation}
        for name in wanted.values():
            check_known(name)
        if hasattr(module, "set_experts_implementation"):
            try:
                module.set_experts_implementation(implementation)
            except ValueError as error:  # transformers' refusal of a class its source check does not pass
                if "does not support setting experts implementation" not in str(error):
                    raise
        for moe in self.moes:
            experts = moe.experts._module
            if not is_dispatching(experts):
                continue
            if isinstance(implementation, str):
                name = implementation
            else:  # the entry of the (sub-)config these experts were built with
                keys = [key for key in wanted if (getattr(config, key, None) if key else config) is experts.config]
                name = wanted[keys[0]] if keys else None
            if name is not None and moe.experts_implementation != name:
                if name not in known(fp8=False):
                    raise MoelensError(
                        f"{moe.path}'s experts cannot be switched to {name!r}: it is transformers' implementation for "
                        "FP8 weights, which transformers picks when it loads them; these experts hold float weights."
                    )
                experts.config._experts_implementation = name

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's run of the model with the trace's interventions; then a check that no value moelens
        served was edited in place after the model had used it (`served.HandedBack`)."""
        handed_back, interleaver = served.HandedBack(), self.interleaver
        outer = served.RUNS.get(interleaver)
        served.RUNS[interleaver] = handed_back
        try:
            result = super().interleave(fn, *args, **kwargs)
        finally:
            if outer is None:
                del served.RUNS[interleaver]
            else:
                served.RUNS[interleaver] = outer
        handed_back.check()
        return result

    def save_all(
        self, values: list[str] | None = None, *, strict: bool = False, moes: list[Moe] | None = None
    ) -> dict[int | str, dict[str, torch.Tensor]]:
        """Inside a trace: save every value of every MoE block (or of ``moes``), in the right order.

        Blocks that run only on some tokens (ernie4_5_vl_moe's ``vision_moe``: image
        tokens; see `Moe.runs_only_on`) are left out unless ``moes`` names them.

        Returns layer index -> (value name -> saved tensor); keyed by block path
        instead when a layer holds several MoE blocks. See `Moe.save_all`.
        """
        blocks = [moe for moe in self.moes if not moe.runs_only_on] if moes is None else moes
        layers = [moe.layer for moe in blocks]
        keys = layers if len(set(layers)) == len(layers) else [moe.path for moe in blocks]
        return nnsight.save({key: moe.save_all(values, strict=strict) for key, moe in zip(keys, blocks)})

    def __deepcopy__(self, memo: dict) -> "MoeTransformersModel | MoeNNsight":
        """A fresh wrap of a deep copy of the model, with the same tokenizer and wrap options.

        nnsight's own deep copy of a wrapped model would still hand its values to this
        model's tracer (its instrumented sources point back here): a copy could not serve
        a value. Persistent edits (``model.edit(inplace=True)``) are not copied.
        """
        return wrap(copy.deepcopy(self._module, memo), tokenizer=getattr(self, "tokenizer", None), **self._wrap_options)


class MoeTransformersModel(MoeModelMixin, TransformersModel):
    """A transformers model with a tokenizer (string prompts, padding, generation), with moelens components."""

    #: Rows the model runs per prompt row while it generates: transformers repeats each row for
    #: beams / returned sequences (read by the token views, `moelens.components.tokens.current_rows`).
    _rows_per_prompt: int = 1

    @traceable
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's ``generate``, telling the token views how many rows each prompt becomes."""
        self._rows_per_prompt = rows_per_prompt(self._module, kwargs)
        try:
            return super().generate(*inputs, **kwargs)
        finally:
            self._rows_per_prompt = 1


def rows_per_prompt(model: torch.nn.Module, kwargs: dict[str, Any]) -> int:
    """How many rows transformers' ``generate`` runs for each prompt row with these arguments.

    It repeats every row ``max(num_beams, num_return_sequences)`` times, in place (row i
    becomes rows ``i * n`` to ``i * n + n - 1``), from the arguments over the
    ``generation_config`` given or the model's own.
    """
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str) -> int:
        return int(kwargs.get(name) or getattr(config, name, None) or 1)

    return max(setting("num_beams"), setting("num_return_sequences"))


class MoeNNsight(MoeModelMixin, NNsight):
    """A transformers model without a tokenizer: token-id inputs only, with moelens components.

    Several invokes are batched by left-padding their ``input_ids`` with the
    config's pad token (0 when it has none) and masking the padding (a forward
    that takes no ``attention_mask`` batches invokes of one length only).
    """

    def generate(self, *inputs: Any, **kwargs: Any) -> NoReturn:
        """Refused: nnsight traces generation only with a tokenizer (without this, the model's own
        ``generate`` would run untraced and the ``with`` statement fail on the tensor it returns)."""
        raise MoelensError(
            "model.generate: tracing a generation needs a tokenizer, and this model was wrapped without one: "
            "moelens.wrap(model, tokenizer=...), or save the tokenizer files beside the weights for moelens.load. "
            "To generate without tracing, call model._module.generate(...)."
        )

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        return processing.batch_size(inputs, kwargs)

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        for inputs, kwargs in invokes:
            if any(_is_text(value) for value in (*inputs, *kwargs.values())):
                raise MoelensError(
                    "this model was wrapped without a tokenizer, so it takes token ids, not text: pass an input_ids "
                    "tensor, or give it a tokenizer (moelens.wrap(model, tokenizer=...), or save the tokenizer "
                    "files beside the weights for moelens.load)."
                )
        if len(invokes) <= 1:
            return super()._batch([self._mask_taken(inputs, kwargs) for inputs, kwargs in invokes], fn)
        rows: list[torch.Tensor] = []
        for inputs, kwargs in invokes:
            ids = inputs[0] if inputs else kwargs.get("input_ids")
            if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or set(kwargs) - {"input_ids"}:
                raise MoelensError(
                    "a model wrapped without a tokenizer batches several invokes only from plain "
                    "token-id tensors; pass input_ids tensors, or wrap(model, tokenizer=...) for text, "
                    "padding and masks."
                )
            rows.extend(ids.reshape(-1, ids.shape[-1]))
        pad = getattr(getattr(self._module, "config", None), "pad_token_id", None) or 0
        width = max(row.shape[0] for row in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=rows[0].dtype)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, width - row.shape[0] :] = row
            attention_mask[index, width - row.shape[0] :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        taken = {name: value for name, value in batch.items() if name == "input_ids" or takes_keyword(self._module, name)}
        return self._mask_taken((), taken | {"attention_mask": attention_mask})

    def _mask_taken(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """An invoke's inputs for a forward that may take no ``attention_mask``: an all-ones mask
        (nothing to mask) is left out; a mask with padding is refused, since it could not be applied."""
        mask = kwargs.get("attention_mask")
        if mask is None or takes_keyword(self._module, "attention_mask"):
            return inputs, kwargs
        if not torch.as_tensor(mask).bool().all():
            raise MoelensError(
                f"{type(self._module).__name__}.forward takes no attention_mask, so padding (the zeros of the "
                "attention_mask: rows or invokes of different lengths) cannot be masked: give every row the same "
                "number of tokens, or run them one at a time (separate traces; collect_routing(batch_size=1))."
            )
        return inputs, {name: value for name, value in kwargs.items() if name != "attention_mask"}


def _is_text(value: Any) -> bool:
    """A prompt string or a list of them."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], str))


def wrap(model: torch.nn.Module, tokenizer: Any = None, **nnsight_kwargs: Any) -> MoeTransformersModel | MoeNNsight:
    """Wrap a transformers model so its MoE blocks serve their values by name.

    Args:
        model: A transformers model instance (any family moelens knows; a model it
            does not know is wrapped as plain nnsight, with a warning for MoE blocks).
        tokenizer: Its tokenizer, so string prompts, padding and ``generate`` work;
            without one the model takes token-id tensors. The wrapped model keeps a copy
            (``model.tokenizer``, left-padded for a model that generates, as nnsight sets it): yours is not changed.
        **nnsight_kwargs: Passed to the nnsight model (``envoys``, ``rename``, ...).

    Returns:
        An nnsight model: ``.moes``, ``.layers[i].mlp`` (``Moe`` / ``Mlp``), ``.family``.
    """
    if isinstance(model, MoeModelMixin):
        raise MoelensError(
            "wrap() got a model moelens has wrapped already: use it as it is (or wrap its transformers "
            "model again: moelens.wrap(model._module, tokenizer=getattr(model, 'tokenizer', None)))."
        )
    if isinstance(model, NNsight):
        raise MoelensError(
            f"wrap() got an nnsight model ({type(model).__name__}); wrap the transformers model inside it: "
            "moelens.wrap(model._module, tokenizer=getattr(model, 'tokenizer', None))."
        )
    if not isinstance(model, torch.nn.Module):
        raise MoelensError(
            f"wrap() takes a transformers model instance (torch.nn.Module), got {type(model).__name__}; "
            "to load from a path or repo id use moelens.load()."
        )
    structure = discover(model)
    options = dict(nnsight_kwargs)
    moe_envoy = _expert_parallel_envoy(model)
    envoys = dict(nnsight_kwargs.pop("envoys", None) or {})
    envoys.update({name: moe_envoy for name in structure.moe_blocks})
    envoys.update({name: Mlp for name in structure.dense_blocks})
    if tokenizer is not None:  # a copy: nnsight sets padding_side on the tokenizer it is given
        if not _has_head(model):  # nnsight infers its pipeline task from the head; a base model has none
            nnsight_kwargs.setdefault("task", "feature-extraction")
        wrapped = MoeTransformersModel(model, tokenizer=copy.deepcopy(tokenizer), envoys=envoys, **nnsight_kwargs)
    else:
        wrapped = MoeNNsight(model, envoys=envoys, **nnsight_kwargs)
    object.__setattr__(wrapped, "_structure", structure)
    object.__setattr__(wrapped, "_wrap_options", options)
    _bind_standard_names(wrapped, structure)
    for moe in wrapped.moes:
        _instrument(moe)
        if moe.family.runs_only_on:
            moe.mark_gathered_calls()
    return wrapped


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
    from .parallel.transformers_ep import keep_dispatch_forwards

    return keep_dispatch_forwards(model)


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


def _bind(host: Any, alias: str, native: str) -> None:
    """Alias ``host.<native>`` as ``host.<alias>`` unless the name is taken."""
    if alias in host.__dict__ or hasattr(host._module, alias):
        return
    object.__setattr__(host, alias, envoy_at(host, native))
    host._aliases[alias] = native


def _bind_standard_names(wrapped: Any, structure: Structure) -> None:
    """``model.layers`` and ``model.layers[i].mlp``, whatever the model calls them."""
    if structure.layers is not None and structure.layers != "layers":
        _bind(wrapped, "layers", structure.layers)
    if structure.block_attr in ("", "mlp"):
        return
    for name in structure.moe_blocks + structure.dense_blocks:
        layer = _layer_path(name)
        if layer is not None and layer != name:
            _bind(envoy_at(wrapped, layer), "mlp", structure.block_attr)


def _instrument(moe: Moe) -> None:
    """Source-instrument what a Moe's values are read from, before any trace runs.

    A module's forward must be instrumented before it starts running for its
    ops to be served; doing it here means a trace can ask for any value at any
    time. Outside a trace the instrumented forwards run as the originals.
    """
    family = moe.family
    _require_op(moe.router, family.logits_op, family, "logits_op")
    scoring = moe.SCORING
    if scoring.selection_in:  # its own ops are instrumented in the trace (nnsight drills only there)
        _require_op(moe.router, scoring.selection_in, family, "scoring.selection_in")
        _require_method_op(moe.router._module, scoring.selection_in, scoring.selection_op, family)
    elif scoring.selection_op:
        _require_op(moe.router, scoring.selection_op, family, "scoring.selection_op")
    if family.experts_call and is_dispatching(moe.experts._module):
        moe.experts.source  # noqa: B018 - installs the experts' op handoffs
    if family.shared is not None and family.shared.gated_op:
        _require_op(moe, family.shared.gated_op, family, "shared.gated_op")


def _require_op(envoy: Any, op: str, family: Family, field: str) -> None:
    """Source-instrument ``envoy`` and check its forward has the op the family names."""
    names = envoy.source.names
    if op not in names:
        raise FamilyError(
            f"family {family.name!r}: {field}={op!r} is not an operation of "
            f"{type(envoy._module).__name__}.forward; its operations are {', '.join(names)}."
        )


def _require_method_op(router: torch.nn.Module, call: str, op: str, family: Family) -> None:
    """Check that ``call`` (``self_get_topk_indices_0``) calls a method of the router with Python source
    whose ops include ``op`` (numbered as nnsight numbers them)."""
    named = re.fullmatch(r"self_(\w+?)_\d+", call)
    method = getattr(type(router), named.group(1), None) if named else None
    try:
        names = op_names(method) if callable(method) else None
    except SourceNotAvailable:
        names = None
    if names is None:
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_in={call!r} is not a call of a method of "
            f"{type(router).__name__} with Python source (self.<method>(...)), where moelens reads selection_op."
        )
    if op not in names:
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_op={op!r} is not an operation of "
            f"{type(router).__name__}.{named.group(1)}; its operations are {', '.join(names)}."
        )


#: ``from_pretrained`` settings that say where and how to read a checkpoint: moelens passes them to the
#: config and tokenizer loaders too, not only to the model's.
SOURCE_SETTINGS = ("trust_remote_code", "subfolder", "revision", "token", "cache_dir", "local_files_only")


def _check_local_folder(source: str, subfolder: str) -> None:
    """Refuse a local path that holds no checkpoint: missing, or a folder without config.json. A name that
    may be a hub id (``name`` or ``namespace/name``, no local folder of that name) is left to transformers."""
    path = Path(source).expanduser()
    looks_local = path.is_absolute() or source.startswith((".", "~")) or len(Path(source).parts) > 2
    if not path.exists():
        if looks_local:
            raise MoelensError(f"no model at {source!r}: the path does not exist. Pass a local checkpoint folder "
                               "(holding config.json and the weights), or 'tiny'.")
        return
    folder = path / subfolder
    if path.is_dir() and not (folder / "config.json").is_file():
        where = f"{str(folder)!r} (subfolder {subfolder!r})" if subfolder else repr(source)
        raise MoelensError(f"{where} is not a transformers checkpoint folder (no config.json in it); pass one, "
                           "or 'tiny'.")


def load(path_or_repo_id: str | Path | None = None, **from_pretrained_kwargs: Any) -> MoeTransformersModel | MoeNNsight:
    """Load a model (and its tokenizer) and wrap it; with no argument, moelens-tiny.

    The model class is the one the checkpoint was saved from (``config.architectures``), so a
    causal LM or a vision-language model keeps its head; a local folder without tokenizer
    files loads without a tokenizer (the model takes token ids only).

    Args:
        path_or_repo_id: A local folder (or a hub id, when the hub is reachable);
            None or ``"tiny"`` loads the embedded default model, offline.
        **from_pretrained_kwargs: Passed to ``from_pretrained`` (``dtype``,
            ``experts_implementation``, ...); the settings in `SOURCE_SETTINGS`
            (``trust_remote_code``, ``subfolder``, ...) also to the config and tokenizer.

    Raises:
        MoelensError: ``path_or_repo_id`` is a file, has no readable config.json, holds no
            weights, or weights that do not fit its config (saved weights left unused while
            the model's own are missing, or of another shape).

    Warns:
        UserWarning: some saved weights have no place in the model, or some of the model's
            weights are not saved (they stay as initialised), or tokenizer files that do not load.
    """
    if path_or_repo_id is None or str(path_or_repo_id) == "tiny":
        from .data import TINY_MODEL_PATH

        path_or_repo_id = TINY_MODEL_PATH
    source = str(path_or_repo_id)
    if Path(source).is_file():
        raise MoelensError(
            f"{source!r} is a file; moelens.load takes the checkpoint folder holding config.json and the "
            f"weights: pass {str(Path(source).parent)!r}."
        )
    settings = {name: from_pretrained_kwargs[name] for name in SOURCE_SETTINGS if name in from_pretrained_kwargs}
    _check_local_folder(source, settings.get("subfolder") or "")
    config = _load_config(source, settings)
    from_pretrained_kwargs.pop("output_loading_info", None)  # moelens reads it (and returns the model only)
    model_class = _model_class(config)
    try:
        model, info = model_class.from_pretrained(source, output_loading_info=True, **from_pretrained_kwargs)
    except SafetensorError as error:
        raise MoelensError(
            f"the weights file of {source!r} cannot be read ({_sentence(error)}): it is damaged or truncated; "
            "save the model again with save_pretrained, or copy it again."
        ) from error
    except ValueError as error:
        advice = (" Load it with the transformers class that fits and pass it to moelens.wrap(model, tokenizer=...)."
                  if "Unrecognized configuration class" in str(error) else "")  # a sub-config saved alone
        raise MoelensError(f"cannot load a model from {source!r}: {_sentence(error)}.{advice}") from error
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error) and "size mismatch" not in str(error):
            raise  # out of memory, a device map, the checkpoint's own code: not moelens' to reword
        listed = _size_mismatches(model_class, source, from_pretrained_kwargs) or _sentence(error)
        raise MoelensError(  # weights of another shape than the config's modules
            f"the weights saved at {source!r} do not fit the model its config describes: {listed}. Load them with "
            "the config they were saved with."
        ) from error
    except OSError as error:  # above all a folder with config.json but no weights
        folder = Path(source, settings.get("subfolder", ""))
        if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise MoelensError(
                f"the folder {str(folder)!r} holds config.json but no weights file (model.safetensors or "
                "pytorch_model.bin); save the model into it with model.save_pretrained(folder), or pass "
                "the folder that holds its weights."
            ) from error
        raise MoelensError(
            f"cannot load the weights of {source!r}: {_sentence(error)}. Pass a folder holding config.json and "
            "weights saved with save_pretrained."
        ) from error
    _check_weights_fit(source, info)
    model.eval()
    return wrap(model, tokenizer=_load_tokenizer(source, settings))


def _load_config(source: str, settings: dict[str, Any]) -> Any:
    """The checkpoint's config, or a `MoelensError` saying why there is none."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, **settings)
    except (OSError, ValueError, StrictDataclassError) as error:  # StrictDataclassError: a config that contradicts itself
        raise MoelensError(
            f"cannot load a model from {source!r}: {_sentence(error)}. Pass a local folder holding config.json "
            "and weights (or 'tiny' for the embedded default model)."
        ) from error


def _model_class(config: Any) -> Any:
    """The class to load ``config``'s checkpoint with: the transformers class it was saved from (when built
    for this config class), else the causal-LM, image-text-to-text or base auto class (custom code: the
    auto classes read its auto_map)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    for name in getattr(config, "architectures", None) or ():
        saved = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        # the class must be built for this config: not custom code's own config class (trust_remote_code: the
        # auto classes read its auto_map) nor another model type (an architectures entry left from a conversion)
        if isinstance(saved, type) and issubclass(saved, transformers.PreTrainedModel) and (
                getattr(saved, "config_class", None) is type(config)):
            return saved
    custom = getattr(config, "auto_map", None) or {}  # a checkpoint with its own code (trust_remote_code)
    model_type = getattr(config, "model_type", None)
    for auto, names in ((transformers.AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        (transformers.AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        # transformers' own model types, and config classes the user registered with the auto class
        if model_type in names or type(config) in auto._model_mapping or auto.__name__ in custom:
            return auto
    return _own_class(config) or transformers.AutoModel


def _own_class(config: Any) -> Any:
    """For a config no auto class maps (a multimodal model's text decoder: step3p7's ``step3p5``), the
    class of its own transformers modeling module built for it (a causal LM first), else None."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    package = type(config).__module__.rpartition(".")[0]
    if getattr(config, "model_type", None) in MODEL_MAPPING_NAMES or not package.startswith("transformers.models."):
        return None
    try:
        module = importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        return None
    fits = [value for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, transformers.PreTrainedModel)
            and value.__module__ == module.__name__ and getattr(value, "config_class", None) is type(config)
            and not value.__name__.endswith("PreTrainedModel")]
    fits.sort(key=lambda cls: "ForCausalLM" not in cls.__name__)
    return fits[0] if fits else None


#: How the files of a saved tokenizer are named (tokenizer.json, tokenizer_config.json,
#: vocab.json, vocab.txt, merges.txt, tokenizer.model, spiece.model, tekken.json ...).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "tekken")


def _load_tokenizer(source: str, settings: dict[str, Any]) -> Any:
    """The tokenizer saved at ``source``, or None when there is none.

    A local folder without tokenizer files has none: transformers 5 would otherwise build
    a placeholder from the config's model type (one token), which cannot tokenize text.
    Tokenizer files that fail to load give None and a warning naming the cause.
    """
    from transformers import AutoTokenizer

    folder = Path(source, settings.get("subfolder", ""))
    if folder.is_dir() and not any(
        file.is_file() and file.name.startswith(TOKENIZER_FILE_PREFIXES) for file in folder.iterdir()
    ):
        return None
    try:
        return AutoTokenizer.from_pretrained(source, **settings)
    except (OSError, ValueError, TypeError) as error:
        warnings.warn(
            f"moelens.load: the tokenizer saved at {source!r} does not load ({type(error).__name__}: "
            f"{_sentence(error)}), so the model takes token ids only; fix or re-save the tokenizer files, or "
            "pass one with moelens.wrap(model, tokenizer=...).",
            stacklevel=3,
        )
        return None


def _size_mismatches(model_class: Any, source: str, kwargs: dict[str, Any], shown: int = 3) -> str:
    """The saved weights whose shape is not the model's, in words (``""`` when they cannot be listed).

    transformers names them only in a logged report; this loads the checkpoint once more, letting
    the mismatches through, to name them.
    """
    loading_logger = logging.getLogger("transformers.modeling_utils")
    level = loading_logger.level
    loading_logger.setLevel(logging.ERROR)  # the report again: once was enough
    try:
        _, info = model_class.from_pretrained(source, **{**kwargs, "ignore_mismatched_sizes": True,
                                                         "output_loading_info": True})
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return ""
    finally:
        loading_logger.setLevel(level)
    mismatched = sorted(info.get("mismatched_keys") or ())
    listed = "; ".join(f"{key} is saved as {list(saved)}, the model has {list(made)}" for key, saved, made in mismatched[:shown])
    more = f" (and {len(mismatched) - shown} more)" if len(mismatched) > shown else ""
    return f"{len(mismatched)} weights have another shape: {listed}{more}" if mismatched else ""


def _sentence(error: Exception) -> str:
    """``error``'s message without its final full stop, to go inside a sentence."""
    return str(error).rstrip().rstrip(".")


def _check_weights_fit(source: str, info: dict[str, Any]) -> None:
    """Raise when the checkpoint's weights and its config's model do not match; warn when part of them do not.

    Weights of the checkpoint the model has no place for, while weights of the model got
    none, mean the config does not describe the saved modules (a model converted with
    `moelens.compress.tomoe` and saved with ``save_pretrained``: its config is still the
    dense model's): transformers would leave those weights random.
    """
    unexpected, missing = sorted(info.get("unexpected_keys") or []), sorted(info.get("missing_keys") or [])
    if unexpected and missing:
        raise MoelensError(
            f"the checkpoint at {source!r} does not match the model its config describes: {len(unexpected)} saved "
            f"weights have no place in it (e.g. {unexpected[0]!r}) and {len(missing)} of its weights are not "
            f"saved (e.g. {missing[0]!r}), so they would be random. A model converted with "
            "moelens.compress.tomoe keeps its dense config: save it with torch.save(model) and load it with "
            "torch.load(path, weights_only=False), then moelens.wrap it."
        )
    if missing:
        warnings.warn(
            f"moelens.load: {len(missing)} weights of the model are not saved at {source!r} (e.g. {missing[0]!r}): "
            "they keep their initial (random) values; check that the config matches the checkpoint.",
            stacklevel=3,
        )
    if unexpected:
        warnings.warn(
            f"moelens.load: {len(unexpected)} weights saved at {source!r} have no place in the model (e.g. "
            f"{unexpected[0]!r}) and are left out; check that the config matches the checkpoint.",
            stacklevel=3,
        )


def _has_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a task model (``*ForCausalLM``, ``*ForMaskedLM`` ...), not a bare base model."""
    if getattr(model, "can_generate", lambda: False)():
        return True
    name = type(model).__name__  # not config.architectures: a base model loaded from a task checkpoint keeps them
    return "For" in name or "LMHead" in name
