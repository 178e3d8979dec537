"""`describe`: what a wrapped model is, as moelens sees it, and what each value can serve.

The facts come from the model's `Moe` components (family, E, k, scoring, shared
expert, experts implementation); which values each block serves, and their
shapes, from one short trace that reads every value in the model's order and
records the reason of each value it cannot serve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import nnsight
import torch

from ..adapters import parameter_adapters
from ..components.base import layer_list_of, layer_of
from ..errors import MoelensError, OrderError, ValueUnavailable
from ..families.entry import VALUE_NAMES
from ..families.unserved import why_no_moe
from ..modules import evaluating
from ..scalars import check_flag
from . import corpus as corpora
from .collect import can_stop_early, check_wrapped, moes_of

#: Tokens of the probe input.
PROBE_TOKENS = 4


@dataclass
class LayerReport:
    """One MoE block.

    Attributes:
        layer: Its layer's index in the list of layers holding it.
        path: The block's module path.
        num_experts: E.
        top_k: k.
        experts_implementation: The transformers experts implementation it runs.
        shared_expert: Whether the block has a shared expert.
        values: Value name -> its shape on a ``[1, 4]`` probe input (served values).
        unavailable: Value name -> why this block cannot serve it.
        read_only: The served values a write to is refused for (`Moe.read_only`).
        stack: The list of layers holding the block (``"encoder.block"``) where the model's blocks sit in several
            such lists (an encoder-decoder model), else ``""`` (see `label`).
        adapters: The block's router and experts that PEFT LoRA adapts on their own parameters, in words
            (`moelens.adapters.parameter_adapters`): its values are the adapted model's, and what reads the weights
            themselves (``params()``, the export) refuses.
    """

    layer: int
    path: str
    num_experts: int
    top_k: int
    experts_implementation: str | None
    shared_expert: bool
    values: dict[str, list[int]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    read_only: list[str] = field(default_factory=list)
    stack: str = ""
    adapters: list[str] = field(default_factory=list)

    @property
    def label(self) -> str | int:
        """The layer as the report names it: its index, or ``"encoder.block 3"`` where ``stack`` is set."""
        return f"{self.stack} {self.layer}" if self.stack else self.layer


@dataclass
class ModelReport:
    """A model as moelens sees it.

    Attributes:
        name: The model's path or name.
        architecture: Its transformers class.
        model_type: Its config's model_type.
        family: The moelens family.
        num_layers: Layers (an encoder-decoder model's: its encoder's and its decoder's).
        scoring: What the router logits mean and how experts are picked (per group of
            layers when blocks differ, e.g. deepseek_v4's hash-routed first layers).
        score: The score function name (what ``router_probs`` applies), likewise.
        shared: How the shared expert is wired (or ``"none"``).
        dense_layers: Layers with a dense MLP (an `Mlp` component), whatever else they hold: indices, or
            ``"decoder.block 1"`` where the blocks sit in several lists of layers.
        moe_layers: One `LayerReport` per MoE block (``stack`` set where they sit in several lists of layers).
        notes: The family entry's notes.
        tokenizer: Whether the model takes text (its tokenizer) or token ids only.
        layer_stacks: An encoder-decoder model's lists of layers holding blocks (its encoder's and its
            decoder's): each list's path and its number of layers; empty otherwise.
    """

    name: str
    architecture: str
    model_type: str | None
    family: str
    num_layers: int
    scoring: str
    score: str
    shared: str
    dense_layers: list[int | str]
    moe_layers: list[LayerReport]
    notes: str = ""
    tokenizer: str = ""
    layer_stacks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Every attribute as plain data (JSON-ready; each `LayerReport` a dict of its own): what
        ``moelens inspect --json`` prints."""
        return asdict(self)

    def __str__(self) -> str:
        """What ``moelens inspect`` prints: the model, then the values each block serves (or why not)."""
        layers = self.moe_layers
        stack_rank = {stack: rank for rank, stack in enumerate(self.layer_stacks)}
        in_order = sorted(layers, key=lambda one: (stack_rank.get(one.stack, 0), one.layer))
        moe_layers = list(dict.fromkeys(layer.label for layer in in_order))
        stacks = ", ".join(f"{stack} {count}" for stack, count in self.layer_stacks.items())
        implementations = sorted({layer.experts_implementation or "eager" for layer in layers})
        lines = [
            f"model                  {self.name}",
            f"architecture           {self.architecture} (model_type {self.model_type})",
            f"family                 {self.family}",
            f"tokenizer              {self.tokenizer}",
            f"layers                 {self.num_layers}" + (f" ({stacks})" if stacks else ""),
            f"MoE layers             {', '.join(map(str, moe_layers))}"
            + (f" ({len(moe_layers)} of {self.num_layers})" if len(moe_layers) <= self.num_layers else "")
            + (f", {len(layers)} MoE blocks" if len(layers) > len(moe_layers) else ""),
            f"dense layers           {', '.join(map(str, self.dense_layers)) or 'none'}",
            "experts E, top-k       " + by_layers([(layer.label, f"E={layer.num_experts}, k={layer.top_k}")
                                                   for layer in layers]),
            f"scoring                {self.scoring}",
            f"router_probs           {self.score} of router_logits",
            f"shared expert          {self.shared}",
            f"experts implementation {', '.join(implementations)}",
        ]
        if any(layer.adapters for layer in layers):
            adapted = [(layer.label, ", ".join(layer.adapters) or "none") for layer in layers]
            lines.append("PEFT adapters          " + by_layers(adapted) + " (trace values are the adapted model's; "
                         "params() and the export need them merged, merge_adapter(), or off, disable_adapter(); "
                         "shard_experts needs merge_and_unload())")
        if self.notes:
            lines.append(f"notes                  {self.notes}")
        first = layers[0]
        same = all(layer.values == first.values and layer.unavailable.keys() == first.unavailable.keys() for layer in layers)
        groups = [(f"every MoE block ({first.path} shown)", [first])] if same else [
            (layer.path, [layer]) for layer in layers
        ]
        for title, (layer, *_) in groups:
            lines.append(f"\nvalues served, {title}, shapes for a [1, 4] input:")
            for name, shape in layer.values.items():
                access = "read-only (derived)" if name in layer.read_only else "read/write"
                lines.append(f"  {name:<22} [{', '.join(map(str, shape))}]".ljust(48) + access)
            for name, reason in layer.unavailable.items():
                lines.append(f"  {name:<22} unavailable: {reason}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython / Jupyter show the text form (``repr`` stays the dataclass's)."""
        printer.text(str(self))


def _probe_ids(model: Any) -> dict[str, torch.Tensor]:
    config = getattr(model._module, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 128
    ids = torch.arange(1, PROBE_TOKENS + 1).remainder(vocab)[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):  # T5, BART ...: the decoder needs its own tokens
        start = getattr(config, "decoder_start_token_id", None)
        start = start if isinstance(start, int) else getattr(config, "pad_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.full_like(ids, start)
    return inputs


def _read_all(moes: list[Any], shapes: dict, reasons: dict) -> None:
    """Inside a trace: read every value of ``moes`` in order, noting shapes and reasons."""
    for moe in moes:
        shapes[moe.path], reasons[moe.path] = {}, {}
        order = moe.order()
        for name in VALUE_NAMES:
            if name not in order:
                error = moe.no_shared_expert(name) if name == "shared_expert_output" else moe.no_mixture(name)
                reasons[moe.path][name] = error.why
        for name in order:
            try:
                shapes[moe.path][name] = list(getattr(moe, name).shape)
            except ValueUnavailable as error:
                reasons[moe.path][name] = error.why


def probe_values(model: Any, moes: list[Any]) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, str]]]:
    """Read every value of every block once, in order: (served shapes, unavailable reasons) per block path.

    One trace reads every block; when a block does not run on the probe input
    (ernie4_5_vl_moe's vision experts on text), each block is probed in a trace of
    its own and the silent ones are reported as such.
    """
    inputs = _probe_ids(model)
    try:
        with torch.no_grad(), evaluating(model._module), model.trace(**inputs):
            shapes: dict = {}
            reasons: dict = {}
            _read_all(moes, shapes, reasons)
            shapes, reasons = nnsight.save(shapes), nnsight.save(reasons)
        return shapes, reasons
    except OrderError:
        pass
    except MoelensError:
        raise
    except Exception as error:  # noqa: BLE001 - the model's own, on an input it does not take
        raise MoelensError(
            f"describe's probe runs the model on {PROBE_TOKENS} token ids ({', '.join(inputs)}), and its forward "
            f"raised {type(error).__name__}: {error}; describe it without the probe, describe(model, probe=False)."
        ) from error
    shapes, reasons = {}, {}
    for moe in moes:
        try:
            with torch.no_grad(), evaluating(model._module), model.trace(**inputs) as tracer:
                one_shapes: dict = {}
                one_reasons: dict = {}
                _read_all([moe], one_shapes, one_reasons)
                one_shapes, one_reasons = nnsight.save(one_shapes), nnsight.save(one_reasons)
                if can_stop_early(model):
                    tracer.stop()
            shapes.update(one_shapes)
            reasons.update(one_reasons)
        except OrderError:
            shapes[moe.path] = {}
            reasons[moe.path] = {name: "this block did not run on a text-only probe input" for name in moe.order()}
    return shapes, reasons


def by_layers(texts: list[tuple[int | str, str]]) -> str:
    """``(layer, text)`` pairs as one text, or ``"layer 0: a; layers 1, 2: b"`` when the texts differ."""
    groups: dict[str, list[int | str]] = {}
    for layer, text in texts:
        layers = groups.setdefault(text, [])
        if layer not in layers:
            layers.append(layer)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(
        f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}: {text}" for text, layers in groups.items()
    )


def scoring_of(moe: Any) -> tuple[str, str]:
    """(scoring description, score name) of one block, read off the block (`Family.described_on`)."""
    return moe.family.described_on(moe._module), moe.family.score_of(moe._module)


def describe(model: Any, *, probe: bool = True) -> ModelReport:
    """Describe a wrapped MoE model: family, layers, E, k, scoring, shared expert, implementation, values.

    Args:
        model: A model from `moelens.wrap` / `moelens.load`.
        probe: Run a 4-token trace to find which values each block serves (and their shapes).
    """
    check_wrapped(model)
    probe = check_flag("probe", probe)
    module = model._module
    config = getattr(module, "config", None)
    moes = list(getattr(model, "moes", None) or [])
    if not moes:
        moes_of(model)  # raises the no-MoE error
    shapes, reasons = probe_values(model, moes) if probe else ({}, {})
    structure = getattr(model, "_structure", None)
    dense_blocks = structure.dense_blocks if structure is not None else []
    paths = [moe.path.partition(".")[2] for moe in moes]  # relative to the torch model
    stacks = dict(found for path in [*paths, *dense_blocks] if (found := layer_list_of(path, module)) is not None)
    # an encoder's and a decoder's lists: layer indices alone would collide (not lists one loop runs together, XLM's)
    several = len(stacks) > 1 and bool(getattr(config, "is_encoder_decoder", False))

    def stack_of(path: str) -> str:
        return found[0] if several and (found := layer_list_of(path, module)) is not None else ""

    layers = [
        LayerReport(
            layer=moe.layer, path=path, num_experts=moe.num_experts, top_k=moe.top_k,
            experts_implementation=moe.experts_implementation, shared_expert=moe._shared_envoy() is not None,
            values=shapes.get(moe.path, {}), unavailable=reasons.get(moe.path, {}),
            read_only=list(moe.read_only), stack=stack_of(path), adapters=parameter_adapters(moe._module, moe.family),
        )
        for moe, path in zip(moes, paths)
    ]
    families = {moe.family.name: moe.family for moe in moes}  # several in a model moelens.compress converted
    shared = {name: _shared_text(family, [layer for layer, moe in zip(layers, moes) if moe.family.name == name])
              for name, family in families.items()}
    if several:
        num_layers = sum(stacks.values())
    else:
        decoder_layers = getattr(model, "layers", None)
        num_layers = len(decoder_layers) if decoder_layers is not None else int(getattr(config, "num_hidden_layers", 0) or 0)
    dense_found = {(stack_of(name), layer) for name in dense_blocks if (layer := layer_of(name, module)) is not None}
    stack_rank = {stack: rank for rank, stack in enumerate(stacks)}
    dense = [f"{stack} {layer}" if stack else layer
             for stack, layer in sorted(dense_found, key=lambda one: (stack_rank.get(one[0], 0), one[1]))]
    scorings = [(layer.label, *scoring_of(moe)) for layer, moe in zip(layers, moes)]
    return ModelReport(
        name=str(getattr(module, "name_or_path", "") or type(module).__name__),
        architecture=type(module).__name__,
        model_type=getattr(config, "model_type", None),
        family=next(iter(families)) if len(families) == 1 else "; ".join(
            f"{name} ({', '.join(dict.fromkeys(moe.path.rpartition('.')[2] for moe in moes if moe.family.name == name))})"
            for name in families),
        num_layers=num_layers,
        scoring=by_layers([(layer, text) for layer, text, _ in scorings]),
        score=by_layers([(layer, score) for layer, _, score in scorings]),
        shared=by_layers([(layer.label, shared[moe.family.name]) for layer, moe in zip(layers, moes)]),
        dense_layers=dense,
        moe_layers=layers,
        notes=(moes[0].family.notes or "") if len(families) == 1 else
        " ".join(f"{name}: {family.notes}" for name, family in families.items() if family.notes),
        tokenizer=tokenizer_note(model),
        layer_stacks=stacks if several else {},
    )


def _shared_text(family: Any, layers: list[LayerReport]) -> str:
    """The shared expert ``family``'s entry names, where it sits, and whether the blocks of ``layers`` hold one."""
    shared = family.shared
    if shared is None:
        return "none"
    where = "on the decoder layer" if shared.on_layer else "in the block"
    gate = f", gated by {shared.gate}" if shared.gate else ""
    absent = "" if any(layer.shared_expert for layer in layers) else " - absent in this checkpoint"
    return f"{shared.module} ({where}{gate}){absent}"


def tokenizer_note(model: Any) -> str:
    """Whether the model takes text (has a tokenizer) or token ids only."""
    tokenizer = corpora.tokenizer_of(model)
    if tokenizer is None:
        return "none (token ids only)"
    return f"{type(tokenizer).__name__} ({len(tokenizer)} tokens)"


def require_moe(model: Any, source: str) -> None:
    """A clear error when ``model`` (loaded from ``source``) has no MoE layer."""
    if not getattr(model, "moes", None):
        config = getattr(model._module, "config", None)
        raise MoelensError(
            f"{source!r} is not a Mixture-of-Experts model moelens knows: {type(model._module).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r}) {why_no_moe(model._module)}. "
            "Pass an MoE checkpoint (see docs/families.md for the supported families)."
        )
