"""`Edits`: moelens interventions baked into an exported model's weights.

An intervention made in a trace lasts one run; an exported model has no trace. The
ones that are the same for every token can be written into the op's inputs instead:

===================  ====================================  ==================================
edit                 moelens intervention (in a trace)     baked into the archive
===================  ====================================  ==================================
``ablate``           ``ablate(moe, e)`` (zero)             expert e's down projection (and its
                                                           bias) set to zero: its slots stay,
                                                           contributing nothing
``route_around``     ``ablate(moe, e, "route_around")``    router bias ``wg_bias[e] = -inf``:
                                                           the router picks the best others
``steer``            ``steer(moe, e, bias)``               ``wg_bias[e] += bias``
``swap``             ``ablate(moe, e, "swap", to=j)``      expert e's weights replaced by j's
                     (a layer's swaps at once)             (from the unedited weights)
===================  ====================================  ==================================

``force`` (raise experts above every other logit by a per-token amount) and ``reroute``
(per-token) cannot be written into constant weights: an `Edits` asking for ``force`` is
refused, not dropped. Expert weights edited in place on the torch module need no `Edits`:
the export copies the module's current weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..edit_options import check_layer_edits
from ..scalars import as_int, as_real
from .errors import ExportError, ExportRefused
from .spec import MoeSpec

#: The edit kinds, in the order they are applied (routing before outputs).
KINDS = ("steer", "route_around", "swap", "ablate", "force")

#: What each kind maps, as the messages of a wrong value say it.
_FORMS = {
    "ablate": "a layer to expert ids: {layer: [expert, ...]}",
    "route_around": "a layer to expert ids: {layer: [expert, ...]}",
    "force": "a layer to expert ids: {layer: [expert, ...]}",
    "steer": "a layer to expert biases: {layer: {expert: bias}}",
    "swap": "a layer to swaps: {layer: {expert: to}}",
}
_EXPERT_ID = "an int expert id (a Python or numpy integer, or a one-element integer tensor)"
_LAYER = "an int decoder layer index (moe.layer: a Python or numpy integer, or a one-element integer tensor)"


def _wrong(kind: str, subject: str, expected: str, value: Any) -> ExportError:
    """The error for ``value`` at ``subject`` of ``Edits.<kind>``, which should have been ``expected``."""
    shown = " ".join(repr(value).split())
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ExportError(f"{subject} must be {expected}, got {shown}; {kind} maps {_FORMS[kind]}.")


def _id(kind: str, subject: str, value: Any, expected: str = _EXPERT_ID) -> int:
    """``value`` as an int id (what moelens' interventions take as one), else `_wrong`."""
    index = as_int(value)
    if index is None:
        raise _wrong(kind, subject, expected, value)
    return index


def _keyed(kind: str, subject: str, mapping: Any, what: str, expected: str) -> dict[int, Any]:
    """The dict ``mapping`` (at ``subject``) with its keys (``what``: layers or experts) as int ids, each named once."""
    if not isinstance(mapping, Mapping):
        raise _wrong(kind, subject, "a dict", mapping)
    keyed: dict[int, Any] = {}
    given: dict[int, Any] = {}
    for key, value in mapping.items():
        index = _id(kind, f"{subject}: {what}", key, expected)
        if index in keyed:
            raise ExportError(f"{subject} names {what} {index} twice (as {given[index]!r} and {key!r}); "
                              "give each once.")
        keyed[index], given[index] = value, key
    return keyed


def _experts(kind: str, layer: int, values: Any) -> tuple[int, ...]:
    """``Edits.<kind>[layer]``: one expert id or an iterable of them, as a tuple of ints, each expert named once."""
    subject = f"Edits.{kind}[{layer}]"
    if isinstance(values, Mapping):
        raise _wrong(kind, subject, "expert ids (one, or a list of them)", values)
    lone = isinstance(values, (str, bytes)) or getattr(values, "ndim", None) == 0 or not isinstance(values, Iterable)
    experts: dict[int, Any] = {}
    for value in [values] if lone else values:
        expert = _id(kind, f"{subject}: expert", value)
        if expert in experts:
            raise ExportError(f"{subject} names expert {expert} twice (as {experts[expert]!r} and {value!r}); "
                              "give each expert once.")
        experts[expert] = value
    return tuple(experts)


@dataclass(frozen=True)
class Edits:
    """Interventions to bake into the export, by decoder layer index (``moe.layer``).

    Attributes:
        ablate: ``{layer: [experts]}``: zero ablation (the expert's slots contribute nothing).
        route_around: ``{layer: [experts]}``: the router never picks them (route-around ablation).
        steer: ``{layer: {expert: bias}}``: ``bias`` added to the expert's router logit.
        swap: ``{layer: {expert: to}}``: the expert's slots run expert ``to`` instead; a layer's
            swaps act at once (``{1: 2, 2: 1}`` exchanges experts 1 and 2; they do not chain).
        force: ``{layer: [experts]}``: not expressible in constant weights; always refused.

    Example::

        edits = Edits(route_around={1: [3]}, steer={2: {5: 2.0}})
        moelens.export.to_nnef(model, "steered.nnef.tgz", edits=edits)
        with model.trace(ids):          # the same run in torch
            edits.intervene(model)
            logits = model.output.logits.save()
    """

    ablate: Mapping[int, Sequence[int]] = field(default_factory=dict)
    route_around: Mapping[int, Sequence[int]] = field(default_factory=dict)
    steer: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    swap: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    force: Mapping[int, Sequence[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Normalise: int layers, tuples of int experts, float biases; layers with nothing to do dropped.
        # Ids and biases are checked as moelens' interventions check them (moelens.scalars):
        # a float, a bool or a str is refused, never truncated.
        for kind in ("ablate", "route_around", "force"):
            layers = _keyed(kind, f"Edits.{kind}", getattr(self, kind), "layer", _LAYER)
            listed = {layer: _experts(kind, layer, experts) for layer, experts in layers.items()}
            object.__setattr__(self, kind, {layer: experts for layer, experts in listed.items() if experts})
        for kind in ("steer", "swap"):
            mapped = {}
            for layer, values in _keyed(kind, f"Edits.{kind}", getattr(self, kind), "layer", _LAYER).items():
                experts = _keyed(kind, f"Edits.{kind}[{layer}]", values, "expert", _EXPERT_ID)
                mapped[layer] = {expert: self._value(kind, layer, expert, value) for expert, value in experts.items()}
            object.__setattr__(self, kind, {layer: values for layer, values in mapped.items() if values})
        for layer, biases in self.steer.items():
            bad = {e: b for e, b in biases.items() if not math.isfinite(b)}
            if bad:
                raise ExportError(f"Edits.steer[{layer}]: the biases of experts {list(bad)} are not finite "
                                  f"({list(bad.values())}); give finite biases (a few tens already decide the "
                                  "routing), or use route_around to remove an expert.")

    @staticmethod
    def _value(kind: str, layer: int, expert: int, value: Any) -> float | int:
        """A steer bias (a float) or a swap's replacement (an int expert id), checked."""
        if kind == "swap":
            return _id(kind, f"Edits.swap[{layer}]: the replacement of expert {expert}", value)
        bias = as_real(value)
        if bias is None:
            raise _wrong(kind, f"Edits.steer[{layer}]: the bias of expert {expert}",
                         "a number (a Python or numpy number, or a one-element tensor)", value)
        return bias

    def __hash__(self) -> int:
        """Equal edits hash alike, so edits can key a dict of results or fill a set (the dataclass' own hash would
        hash the dicts, which cannot be hashed)."""
        return hash(tuple(
            frozenset((layer, experts if isinstance(experts, tuple) else frozenset(experts.items()))
                      for layer, experts in getattr(self, kind).items())
            for kind in KINDS
        ))

    def __bool__(self) -> bool:
        return any((self.ablate, self.route_around, self.steer, self.swap, self.force))

    def layers(self) -> list[int]:
        """The layers with an edit."""
        return sorted({layer for kind in KINDS for layer in getattr(self, kind)})

    # -- checking and baking -------------------------------------------------------

    def check(self, blocks: Mapping[int | None, tuple[int, str | None]], *, block_export: bool = False) -> None:
        """Check the edits against the model's MoE layers (layer -> (num_experts, tract gate mode, None in a trace);
        None: a block with no layer).

        ``block_export``: the edits are for one block exported on its own (``to_nnef(model.moes[i])``), not a
        whole model (an export of one, or a trace of one in `intervene`), even one with a single MoE layer.

        Raises `ExportRefused` for an edit tract cannot express, `ExportError` for a wrong one.
        """
        unknown = [f"Edits.{kind}[{layer}]" for kind in KINDS for layer in sorted(getattr(self, kind))
                   if layer not in blocks]
        numbered = sorted(layer for layer in blocks if layer is not None)
        edits = f"{', '.join(unknown)} {'names a layer' if len(unknown) == 1 else 'name layers'}"
        if unknown and not numbered:
            raise ExportError(
                f"{edits}, but the exported block has no layer number (a transformers block exported on its own), so "
                "Edits keyed by layer cannot name it; export moelens.wrap(model).moes[i] instead, whose layer they name."
            )
        if unknown:
            raise ExportError(
                f"{edits} with no MoE block here; the MoE layers are {numbered}"
                + (" (a block exported on its own takes edits of its layer only)." if block_export else ".")
            )
        for layer in self.layers():
            self._check_layer(layer, *blocks[layer])

    def _check_layer(self, layer: int, num_experts: int, gate: str | None) -> None:
        """`check` for one layer's edits, on a block of ``num_experts`` experts exported with tract's ``gate`` (None:
        the edits made in a trace, where the interventions refuse what the router cannot compute)."""
        if layer in self.force:
            raise ExportRefused(
                f"Edits.force[{layer}] cannot be baked into the export: moelens.force raises the forced experts' "
                "logits above every other expert's by a per-token amount (the token's logit range + 30), which no "
                "constant router bias reproduces. Steer the experts with a large bias instead "
                f"(Edits(steer={{{layer}: {dict.fromkeys(sorted(self.force[layer]), 30.0)}}})), or export without it."
            )
        check_layer_edits(layer, num_experts, ExportError, ablate=self.ablate.get(layer), swap=self.swap.get(layer),
                          route_around=self.route_around.get(layer), steer=self.steer.get(layer))
        # Fewer than k left is taken: the router fills its k slots with removed experts at weight 0 (a -inf logit's
        # under every tract gate), as the intervention does where it ranks the logits. None left is NaN under a
        # softmax; a sigmoid weighs them all 0 (the routed output is 0), as the intervention takes it.
        if gate is not None and gate.startswith("softmax") and len(set(self.route_around.get(layer, ()))) == num_experts:
            raise ExportRefused(
                f"Edits.route_around[{layer}] names every one of the layer's {num_experts} experts: the router would "
                f"have no expert left to pick, and its {gate} gate weighs -inf logits alone as NaN; zero-ablate them "
                f"instead (Edits.ablate[{layer}]: their slots stay, contributing nothing)."
            )

    def bake(self, spec: MoeSpec) -> MoeSpec:
        """A copy of ``spec`` with this layer's edits written into its weights."""
        layer = spec.layer
        if layer not in self.layers():
            return spec
        source, spec = spec, spec.clone()
        biases = self.steer.get(layer, {})
        removed = self.route_around.get(layer, ())
        if (biases or removed) and spec.w3 is None:
            raise ExportRefused(
                f"Edits at layer {layer}: steer and route_around are baked as a router bias, which ungated experts "
                "cannot take (tract_moe_ffn binds its bias inputs after w3, which they do not have); export this "
                "layer without them (ablate and swap edit the experts' weights)."
            )
        if biases or removed:
            wg_bias = spec.wg_bias if spec.wg_bias is not None else spec.wg.new_zeros(spec.num_experts)
            for expert, bias in biases.items():
                wg_bias[expert] += bias
                if not wg_bias[expert].isfinite():
                    raise ExportError(
                        f"Edits.steer[{layer}]: the bias {bias:g} of expert {expert} takes its router bias beyond "
                        f"what the archive's {str(wg_bias.dtype).removeprefix('torch.')} router bias holds "
                        f"({torch.finfo(wg_bias.dtype).max:.4g}, which would be inf); use a bias well inside that "
                        "range (a few tens already decide the routing).")
            for expert in removed:
                wg_bias[expert] = -math.inf
            spec.wg_bias = wg_bias
        for expert, to in self.swap.get(layer, {}).items():  # from the unedited source: swaps do not chain
            for name in ("w1", "w2", "w3", "w1_bias", "w3_bias", "w2_bias"):
                if getattr(source, name) is not None:
                    getattr(spec, name)[expert] = getattr(source, name)[to]
        for expert in self.ablate.get(layer, ()):
            spec.w2[expert] = 0.0
            if spec.w2_bias is not None:
                spec.w2_bias[expert] = 0.0
        spec.notes.append(f"edits: {self.describe(layer)}")
        return spec

    def describe(self, layer: int) -> str:
        """The edits of one layer, in words."""
        parts = []
        if self.steer.get(layer):
            parts.append("steer " + ", ".join(f"{e}{b:+g}" for e, b in self.steer[layer].items()))
        if self.route_around.get(layer):
            parts.append(f"route around {list(self.route_around[layer])}")
        if self.swap.get(layer):
            parts.append("swap " + ", ".join(f"{e}->{t}" for e, t in self.swap[layer].items()))
        if self.ablate.get(layer):
            parts.append(f"ablate {list(self.ablate[layer])}")
        return "; ".join(parts)

    # -- the same edits in a trace -----------------------------------------------------

    def apply(self, moe: Any) -> None:
        """Inside a trace: make the same edits on one `Moe` with moelens' interventions (checked as `check` does)."""
        from ..edit_options import make_edits

        layer = moe.layer
        if layer in self.layers():
            self._check_layer(layer, moe.num_experts, None)
        make_edits(moe, ablate=self.ablate.get(layer), route_around=self.route_around.get(layer),
                   steer=self.steer.get(layer), swap=self.swap.get(layer))

    def intervene(self, model: Any) -> None:
        """Inside a trace of a wrapped model: make every edit, block by block in layer order.

        Checked first as the export checks them: an edit of a layer with no MoE block, of an expert
        out of range, or one no export can bake (``force``) raises instead of being dropped.
        """
        from ..model import check_wrapped

        check_wrapped(model)
        moes = list(model.moes)
        layers = [moe.layer for moe in moes]
        shared = sorted({layer for layer in layers if layers.count(layer) > 1} & set(self.layers()), key=str)
        if shared:
            listed = ", ".join(f"model.moes[{index}] is {moe.path}" for index, moe in enumerate(moes)
                               if moe.layer == shared[0])
            raise ExportError(f"layer {shared[0]} holds several MoE blocks ({listed}), so Edits keyed by layer are "
                              "ambiguous: make the edits on the block you mean with moelens' interventions "
                              "(moelens.ablate(model.moes[i], ...), moelens.steer), or Edits(...).apply(model.moes[i]).")
        self.check({moe.layer: (moe.num_experts, None) for moe in moes})
        wanted = set(self.layers())
        for moe in moes:
            if moe.layer in wanted:
                self.apply(moe)

    # -- serialisation ---------------------------------------------------------------------

    def to_text(self) -> str:
        """A compact text form, ``kind:layer:items`` joined by ``;`` (``steer:1:2=3.0,5=-1.0;ablate:1:6``).

        It has no quotes or braces, so it can be stored as an NNEF property (the archive's ``moelens_edits``).
        """
        parts = []
        for kind in KINDS:
            for layer, value in sorted(getattr(self, kind).items()):
                items = (",".join(str(e) for e in value) if isinstance(value, tuple)
                         else ",".join(f"{e}={v!r}" for e, v in value.items()))
                parts.append(f"{kind}:{layer}:{items}")
        return ";".join(parts)

    @classmethod
    def from_text(cls, text: str) -> "Edits":
        """The edits a `to_text` text describes (``""``: none)."""
        if text is not None and not isinstance(text, str):
            raise ExportError(f"Edits.from_text takes the text Edits.to_text gives (a str), got "
                              f"{type(text).__name__} {text!r:.60}.")
        fields: dict[str, dict] = {kind: {} for kind in KINDS}
        for part in filter(None, (text or "").split(";")):
            try:
                kind, layer, items = part.split(":")
                if kind in ("steer", "swap"):
                    cast = float if kind == "steer" else int
                    pairs = [(int(e), cast(v)) for e, v in (item.split("=") for item in items.split(","))]
                    edit: Any = dict(pairs)
                    repeated = len(edit) < len(pairs)
                else:
                    edit = [int(e) for e in items.split(",")]
                    repeated = False  # Edits names an expert listed twice
                layer = int(layer)
                taken = layer in fields[kind]
                fields[kind][layer] = edit
            except (KeyError, ValueError):
                raise ExportError(f"cannot read edits from {text!r} (at {part!r}): each part is kind:layer:items, "
                                  f"kind one of {', '.join(KINDS)}, items expert ids (ablate:1:6,7) or expert=value "
                                  "pairs for steer and swap (steer:1:2=3.0,5=-1.0), parts joined by ';'.") from None
            if taken or repeated:  # one would silently replace the other
                twice = f"layer {layer} in two {kind} parts" if taken else f"an expert twice in {part!r}"
                raise ExportError(f"cannot read edits from {text!r}: it names {twice}, which Edits.to_text never "
                                  f"writes; name each layer once per kind and each expert once in it.")
        return cls(**fields)


def as_edits(edits: Edits | Mapping[str, Any] | None) -> Edits:
    """`Edits` from an `Edits`, a dict of its fields, or None."""
    if edits is None:
        return Edits()
    if isinstance(edits, Edits):
        return edits
    if isinstance(edits, Mapping):
        unknown = set(edits) - set(KINDS)
        if unknown:
            raise ExportError(f"unknown edit kinds {sorted(unknown)}; Edits takes {list(KINDS)}.")
        return Edits(**edits)
    raise ExportError(f"edits must be a moelens.export.Edits (or a dict of its fields), got {type(edits).__name__}.")
