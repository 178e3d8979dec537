"""What a family entry says: a small, frozen description of one MoE family.

A family entry is data. It names where the block, the router, the experts and the
shared expert live, which operation inside the router's forward produces the
logits, how the family scores them, how the block combines the routed and the
shared output, and which values it cannot serve (with the reason). The `Moe`
component reads it; nothing else in moelens knows families.

Attribute references (``"router.top_k"``, ``"config.norm_topk_prob"``) are
resolved against the live block module by `resolve`, so one entry serves every
checkpoint of the family whatever its sizes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Mapping

from torch.nn.utils.parametrize import type_before_parametrizations

from ..errors import FamilyError
from ..modules import is_parameter_adapter
from .scoring import SCORE_FUNCTIONS

#: Every value a `Moe` component serves, in the order a standard family produces them.
VALUE_NAMES = (
    "router_logits",
    "router_probs",
    "expert_weights",
    "expert_indices",
    "expert_pre_activations",
    "expert_activations",
    "expert_outputs",
    "routed_output",
    "shared_expert_output",
    "mlp_output",
)

#: The values read per slot inside the experts implementation (grouped_mm / batched_mm only).
PER_SLOT_VALUES = ("expert_pre_activations", "expert_activations", "expert_outputs")

#: When a served shared-expert value is produced, relative to the routed path.
SHARED_TIMES = ("before_router", "before_experts", "after_experts", "after_block")

#: How a router may choose its k experts (`Scoring.select`).
SELECTIONS = ("score_topk", "logit_topk", "group_topk", "sparsemixer", "hash", "skip_topk")

#: How a group-limited router scores a group of experts to keep the best ones (`Scoring.group_score`).
GROUP_SCORES = ("top2_sum", "max")

#: How a block may combine routed and shared output (`Combine.mode`; an attribute reference may name one).
COMBINE_MODES = ("sum", "average")

#: What gated experts may compute from their gate and up projections (`ExpertGate.kind`).
EXPERT_GATES = ("glu", "clamped_swiglu", "clamped_glu", "glu_clamped", "softcapped_glu")


#: The op of score + selection bias in the routers that bind it to ``scores_for_choice`` (DS3, SGB copies).
SCORES_FOR_CHOICE = "scores_for_choice_0"

#: The router's first top-k call, whose first argument is score + bias where no op binds the sum
#: (``torch.topk(scores + bias, k)``: ``selection_op=TOPK, selection_arg=0``).
TOPK = "torch_topk_0"

#: The least normalisation floor (`Scoring.normalize_min`) a description names: a smaller one acts only on a token
#: whose k chosen scores hold less than a millionth of its probability mass (a guard against dividing by zero, as
#: ernie4_5's default ``moe_norm_min=1e-12``), so its weights read as plainly renormalised. The weights moelens
#: recomputes (`moelens.families.check`) apply the floor whatever its size.
NEGLIGIBLE_FLOOR = 1e-6


def _plain_numbers(entry: Any, names: tuple[str, ...]) -> None:
    """Set the numpy numbers among the fields ``names`` of the frozen dataclass ``entry`` as Python's (``register``'s
    checks, as every count moelens takes, accept a numpy integer or float)."""
    for name in names:
        value = getattr(entry, name)
        if isinstance(value, numbers.Number) and type(value) not in (int, float, bool) and hasattr(value, "item"):
            object.__setattr__(entry, name, value.item())


@dataclass(frozen=True)
class Scoring:
    """How the router turns logits into the experts' weights and indices.

    Attributes:
        score: The elementwise score of each expert, what `router_probs` serves:
            ``"softmax"`` (over the E logits), ``"sigmoid"``, ``"sqrtsoftplus"``, or an
            attribute reference naming one of those (deepseek_v4's ``config.scoring_func``).
        select: How the k experts are chosen. ``"score_topk"``: top-k of the scores
            (plus `selection_bias`); ``"logit_topk"``: top-k of the logits, then a
            softmax over those k; ``"group_topk"``: top-k inside the best groups;
            ``"sparsemixer"`` (phimoe); ``"hash"`` (a token-id table, the logits only
            weight); ``"skip_topk"`` (zaya: an extra "skip" class).
        normalize: Whether the k weights are renormalised to sum to one: a bool or
            an attribute reference (``"router.norm_topk_prob"``); a reference to a number p
            divides them by their p-norm instead (dbrx's ``moe_normalize_expert_weights``).
        normalize_min: A floor the router clamps that divisor at (the k weights' sum, or their p-norm): the weights
            are ``w / clamp(sum(w), min=normalize_min)``, so they sum to less than one where the chosen scores sum
            below it (ernie4_5: ``"router.norm_min"``, the config's ``moe_norm_min``). A number >= 0, an attribute
            reference, or None (no floor). Described only from `NEGLIGIBLE_FLOOR` up.
        normalize_eps: What the router adds to that divisor (``w / (sum(w) + 1e-20)``: DeepSeek-V3 and most routers
            that renormalise sigmoid scores), 0.0 where it divides by the plain sum. Too small to change a weight, it
            keeps a token whose k chosen scores are all 0 (every logit -inf under a sigmoid) at weights 0 instead of
            0/0: a write of router_logits all -inf for a token is let through only where the router has it (or a
            `normalize_min` floor, or no renormalisation). A number >= 0.
        scale: A multiplier on the weights applied inside the router: a number, an
            attribute reference, or None.
        selection_bias: Attribute reference of a bias added to the scores for
            selection only (DeepSeek-V3's ``e_score_correction_bias``), or None.
        groups: Attribute references ``(n_group, topk_group)`` of group-limited
            selection, or None.
        group_fill: What the router puts in place of the scores of the groups it drops before its top-k:
            -inf (DeepSeek-V3), or 0.0 (axk2, mistral4 and DeepSeek-V2, as their code does: a dropped expert can
            still be picked when the kept ones score below 0).
        group_score: How a group's score is made of its experts' ranked scores, to keep the best groups:
            ``"top2_sum"``, the sum of its best two (DeepSeek-V3, mistral4), or ``"max"`` (DeepSeek-V2's
            group-limited greedy).
        groups_if: ``(attribute reference, value)``: the groups apply only when the
            attribute has that value (DeepSeek-V2: ``router.topk_method`` is
            ``"group_limited_greedy"``); None: whenever `groups` is set.
        softcap: Attribute reference of a logit softcap ``c`` the router applies
            before scoring (``tanh(logits / c) * c`` when ``c > 0``: laguna), or None.
        expert_scale: Attribute reference of a learned multiplier per expert (a tensor ``[E]``) the router puts on
            each chosen weight after renormalising and scaling them (gemma4's ``router.per_expert_scale``), or None.
        selection_op: Op in the router's forward whose output is the score plus the
            selection bias that the router ranks (DS3: ``scores_for_choice_0``), served as
            `Moe.selection_scores`; `route_around` and `force` act there. None elsewhere.
        selection_arg: Where the router adds the bias inside the call that ranks
            (``torch.topk(scores + bias, k)``): the position of that sum among the
            ``selection_op`` call's arguments, served instead of the op's output.
        selection_in: The call in the router's forward whose own source holds
            `selection_op`, when the router ranks inside a method of its own
            (longcat_flash: ``self_get_topk_indices_0``); None when the op is in the forward.
        code: The short code the reference table uses (``"SM+"``, ``"DS3"`` ...).
    """

    score: str = "softmax"
    select: str = "score_topk"
    normalize: bool | str = False
    normalize_min: float | str | None = None
    normalize_eps: float = 0.0
    scale: float | str | None = None
    selection_bias: str | None = None
    groups: tuple[str, str] | None = None
    group_fill: float = float("-inf")
    group_score: str = "top2_sum"
    groups_if: tuple[str, str] | None = None
    softcap: str | None = None
    expert_scale: str | None = None
    selection_op: str | None = None
    selection_arg: int | None = None
    selection_in: str | None = None
    code: str = ""

    def __post_init__(self) -> None:
        _plain_numbers(self, ("normalize_min", "normalize_eps", "scale", "selection_arg"))

    def describe(self) -> str:
        """One line saying what the logits mean and how experts are picked."""
        parts = [f"{self.score} scores", self.select.replace("_", " ")]
        if self.softcap:  # a reference in the table, its value read off a block (described_on)
            parts.insert(0, f"logits softcapped at {self.softcap:g}" if isinstance(self.softcap, float)
                         else f"logits softcapped by {self.softcap}")
        if self.selection_bias:
            parts.append("selection bias")
        if self.groups:
            kept = f" (best {self.groups[1]} of {self.groups[0]} groups)" if all(
                isinstance(count, int) for count in self.groups) else ""  # read off a block (describe)
            parts.append("group-limited" + kept
                         + (f" if {self.groups_if[0]} == {self.groups_if[1]!r}" if self.groups_if else ""))
        if self.normalize is True or type(self.normalize) in (int, float) and self.normalize == 1:
            parts.append("renormalised" + self._floor("sum"))
        elif isinstance(self.normalize, str):
            parts.append(f"renormalised if {self.normalize}" + self._floor("sum"))
        elif type(self.normalize) in (int, float) and self.normalize:  # dbrx's p, read off a block
            parts.append(f"divided by their {self.normalize:g}-norm" + self._floor("norm"))
        if self.scale is not None:
            parts.append(f"x {self.scale}")
        if self.expert_scale:
            parts.append(f"x {self.expert_scale}[expert]")
        return ", ".join(parts) + (f" ({self.code})" if self.code else "")

    def _floor(self, divisor: str) -> str:
        """The words for `normalize_min` after the normalisation (``divisor``: what is clamped, "sum" or "norm"):
        the reference where it is one, the number where it reaches `NEGLIGIBLE_FLOOR`, else ""."""
        floor = self.normalize_min
        if isinstance(floor, str):
            return f" ({divisor} clamped at >= {floor})"
        if type(floor) in (int, float) and floor >= NEGLIGIBLE_FLOOR:
            return f" ({divisor} clamped at >= {floor:g})"
        return ""


@dataclass(frozen=True)
class SharedExpert:
    """Where a family's shared expert lives and which of its values `Moe` serves.

    Attributes:
        module: Path of the shared-expert module, from the block (or from the
            decoder layer when `on_layer`).
        on_layer: The shared expert is a sibling of the block on the decoder layer
            (granite), applied after the block.
        gated_op: Name of the op in the block's forward whose output is the shared
            contribution after its gate (qwen2_moe's ``shared_expert_output_1``);
            None when the module's own output is the contribution.
        gate: Path of the gate module from the block (``"shared_expert_gate"``), or None.
        when: When the served value is produced, one of `SHARED_TIMES`.
        edited_later: The block edits the module's output in place after it is
            served (llama4's ``out.add_``), so it is served as a copy; writing it
            still replaces what the block uses.
    """

    module: str
    on_layer: bool = False
    gated_op: str | None = None
    gate: str | None = None
    when: str = "after_experts"
    edited_later: bool = False


@dataclass(frozen=True)
class Combine:
    """How the block output (`mlp_output`) is made of the routed and shared outputs.

    ``mlp_output = block_post(routed_post(routed * routed_scale) + shared)``, or
    with ``mode == "average"`` the mean of the two; each step is skipped when
    unset. A shared expert on the decoder layer (granite) is not part of the block
    output.

    Attributes:
        routed_scale: Multiplier the block applies to the experts output (beam,
            laguna: ``"config.routed_scaling_factor"``; openai_privacy_filter:
            ``"experts.num_experts"``), or None.
        routed_post: Path of a module the block applies to the (scaled) experts
            output (nemotron_h ``fc2_latent_proj``), or None.
        mode: ``"sum"`` or ``"average"`` of routed and shared output, or an
            attribute reference naming one (cohere2_moe's combination strategy).
        block_post: Path of a module applied to the sum (axk1's
            ``post_mlp_layernorm``), or None.
        output_index: Index of the hidden states in a tuple block output, or None
            when the block returns a tensor.
    """

    routed_scale: float | str | None = None
    routed_post: str | None = None
    mode: str = "sum"
    block_post: str | None = None
    output_index: int | None = None

    def __post_init__(self) -> None:
        _plain_numbers(self, ("routed_scale",))


@dataclass(frozen=True)
class ExpertGate:
    """What a family's gated experts compute from their gate and up projections, when the
    experts class overrides transformers' default ``act_fn(gate) * up`` (its ``_apply_gate``).

    Attributes:
        kind: One of `EXPERT_GATES`. ``"glu"``: ``act_fn(gate) * up``, the default's maths
            (computed in float32, say); ``"clamped_swiglu"`` (gpt-oss): ``g = min(gate, limit)``,
            ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``;
            ``"clamped_glu"``: ``act_fn(min(gate, limit)) * clamp(up, -limit, limit)`` (silu when
            the experts have no act_fn); ``"glu_clamped"`` (step3p7): ``min(act_fn(gate), limit) *
            clamp(up, -limit, limit)``, the activation clamped after it is applied;
            ``"softcapped_glu"``: a softcapped SwiGLU (inkling2).
        alpha: The sigmoid's slope of ``clamped_swiglu``: attribute reference or number.
        limit: The clamp limit: attribute reference or number.
    """

    kind: str = "glu"
    alpha: float | str | None = None
    limit: float | str | None = None

    def __post_init__(self) -> None:
        _plain_numbers(self, ("alpha", "limit"))


@dataclass(frozen=True)
class ExpertLayout:
    """Where an experts module keeps its projection weights, for experts that do not say it themselves.

    Experts decorated by transformers' ``use_experts_implementation`` carry their layout
    (``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``) and need no entry;
    a family whose experts do not (llama4, dbrx) describes them here. Read by `Moe.params`.

    Attributes:
        gate_up: The fused gate and up parameter, ``[E, 2H, D]`` (``[E, D, 2H]`` when
            ``transposed``), gate rows first; or None.
        gate: A separate gate parameter ``[E, H, D]`` (``[E*H, D]`` when ``stacked``), or None.
        up: A separate up parameter, as ``gate``; None when it is fused in ``gate_up``.
        down: The down parameter ``[E, D, H]`` (``[E, H, D]`` when ``down_transposed``;
            ``[E*H, D]`` when ``stacked`` and ``down_transposed``).
        transposed: gate and up are stored ``[in, out]`` (used as ``x @ W``).
        down_transposed: down is stored ``[in, out]``.
        concatenated: ``gate_up`` holds the gate rows then the up rows; False: interleaved
            (``gate, up, gate, up, ...``, gpt-oss).
        stacked: 2-D parameters holding every expert's rows one after the other.

    A parameter named ``<name>_bias`` beside one of these is its bias.
    """

    gate_up: str | None = None
    gate: str | None = None
    up: str | None = None
    down: str = "down_proj"
    transposed: bool = False
    down_transposed: bool = False
    concatenated: bool = True
    stacked: bool = False


class ReadOnlyMapping(dict):
    """A dict that refuses changes in place: a family entry's mappings, shared by every model of the family
    (an edit of one handed out, or of the dict given to `Family`, would have changed them all)."""

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a family entry is read-only: make a changed copy with "
                        "dataclasses.replace(entry, field={...}) and register that.")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self) -> tuple[type, tuple[dict]]:  # pickle and deepcopy rebuild it whole
        return ReadOnlyMapping, (dict(self),)

    def __hash__(self) -> int:  # read-only, so a family entry holding it hashes (a set of entries, a dict key)
        return hash(frozenset(self.items()))


@dataclass(frozen=True)
class Family:
    """One MoE family: where its parts live and what its values mean.

    Attributes:
        name: The family name (the transformers model folder, ``"mixtral"``).
        model_types: ``config.model_type`` values that belong to it.
        block_classes: Class names of its MoE block module (how blocks are detected): a bare name
            (``"MyMoeBlock"``) matches a class of that name from any module, a qualified one
            (``"mylab.model.MyMoeBlock"``, the class's ``__module__`` and ``__qualname__``) that class alone,
            and is matched first.
        block_attr: Attribute of the block on the decoder layer (``"mlp"``,
            ``"block_sparse_moe"``), or ``""`` when the decoder layer itself holds the
            router and experts (gemma4). Left at ``"mlp"`` while the blocks sit at one
            other attribute of their layers, that attribute is used (``layers[i].mlp``
            names it, and dense MLPs are looked for there).
        router: Path of the router from the block.
        experts: Path of the experts module from the block, called as ``experts(hidden, top_k_index,
            top_k_weights)`` (a registered entry's may be any module there but a ModuleList or ModuleDict).
        logits_op: Op in the router's forward whose output is the logits (the router's linear layer where it has
            one: `Moe.params` and the NNEF export take the router's weights from it).
        logits_cast_op: Op casting ``logits_op``'s output to the dtype the router ranks the logits in, or "" for
            none: granitemoe's ``F.linear(x, W).float()`` (``"float_0"``). `router_logits` are read and written
            there, so in a bfloat16 model they are the float32 logits the router uses, and a write is not
            rounded to bfloat16.
        scoring: How the logits are scored and experts picked.
        scoring_by_router: Scorings of blocks whose router is another class (router
            class name -> Scoring): deepseek_v4's hash layers. See `scoring_of`.
        shared: The shared expert, or None.
        combine: How the block output is made.
        top_k: Attribute reference of k, or an int.
        num_experts: Attribute reference of E, or an int.
        experts_call: The experts module is called as ``experts(hidden, top_k_index,
            top_k_weights)`` and decorated by ``use_experts_implementation``.
        refused: Values this family cannot serve, each with the reason.
        derived_routing: Weights and indices are recomputed from the logits with the
            family's scoring (read-only), for families with no experts call (llama4).
        notes: Quirks worth knowing, shown in docs and ``moelens inspect``.
        runs_only_on: Blocks that do not run on every input, by their attribute name
            (the last part of the block's path) -> the tokens they run on
            (ernie4_5_vl_moe: ``{"vision_moe": "image tokens"}``). Such a block is left
            out of ``model.save_all()`` unless named, and its order error says it may not have run.
        expert_gate: What the gated experts compute when their class overrides
            transformers' default gate, or None (``act_fn(gate) * up``; ``act_fn(up)`` for
            ungated experts). Read by the NNEF export.
        final_norm: The base model's final norm where it has none of the usual names
            (lfm2_moe: ``embedding_norm``), else "". Read by the expert logit lens.
        expert_layout: Where undecorated experts keep their weights (`ExpertLayout`), or
            None: decorated experts describe their own. Read by `Moe.params`.
        identity_experts: Attribute reference (or int) of how many of the E experts the router
            picks from are zero-compute experts that return their input unchanged, times
            their weight (longcat_flash's ``zero_expert_num``): the last ones, ``[E - Z, E)``,
            with no weights of their own. None for none.
        scan_without_cache: The model's forward deep-copies its key-value cache, which ``model.scan``'s
            fake tensors cannot survive (inkling2_loop): a scan is refused unless ``use_cache=False``.
        extra_logits: Attribute reference (or int) of how many router logits follow the E experts' own: inkling's
            shared experts' gates (``router.n_shared_experts``), zaya's skip class (1). `router_logits` must hold
            exactly E plus these per token.
        routing_from_router: The positions of ``(weights, indices)`` in the router's output tuple, where the block
            changes them before its experts call (longcat_flash from transformers 5.25 hands its zero-compute slots
            to other experts with weight 0): `expert_weights` and `expert_indices` are read and written there, as
            the router chose them. None: they are the experts call's arguments.
        routed_from_block: `routed_output` is the block's output, not the experts module's, where the block adds
            to what its experts return (longcat_flash from transformers 5.25 adds its zero-compute experts' share).
            Only for blocks with no shared expert.
        logits_skipped: When the router's forward computes its logits without running ``logits_op`` (the
            words that finish "the router skips logits_op ..."), else "": the logits and what is scored from
            them cannot be read in such a run, and the error of a read says so (where the router's weights are on an
            accelerator and grad is off, the branch kolibri1 takes; elsewhere it is an order mistake).
    """

    name: str
    model_types: tuple[str, ...]
    block_classes: tuple[str, ...]
    block_attr: str = "mlp"
    router: str = "gate"
    experts: str = "experts"
    logits_op: str = "F_linear_0"
    logits_cast_op: str = ""
    scoring: Scoring = field(default_factory=Scoring)
    scoring_by_router: Mapping[str, Scoring] = field(default_factory=dict)
    shared: SharedExpert | None = None
    combine: Combine = field(default_factory=Combine)
    top_k: str | int = "router.top_k"
    num_experts: str | int = "experts.num_experts"
    experts_call: bool = True
    refused: Mapping[str, str] = field(default_factory=dict)
    derived_routing: bool = False
    notes: str = ""
    runs_only_on: Mapping[str, str] = field(default_factory=dict)
    expert_gate: ExpertGate | None = None
    final_norm: str = ""
    expert_layout: ExpertLayout | None = None
    identity_experts: str | int | None = None
    scan_without_cache: bool = False
    logits_skipped: str = ""
    extra_logits: str | int = 0
    routing_from_router: tuple[int, int] | None = None
    routed_from_block: bool = False

    def __post_init__(self) -> None:
        """Keep the entry's own copies, read-only: names listed as tuples, mappings as `ReadOnlyMapping`, numpy
        numbers as Python's (anything else is left for `register` to refuse with the field's name)."""
        _plain_numbers(self, ("top_k", "num_experts", "identity_experts", "extra_logits"))
        for name in ("model_types", "block_classes"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("scoring_by_router", "refused", "runs_only_on"):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, ReadOnlyMapping(getattr(self, name)))

    def resolve(self, reference: Any, block: Any) -> Any:
        """The value an attribute reference names, read from the live block module.

        A reference is a dotted string, optionally prefixed ``1/`` for its
        reciprocal (``"1/router.top_k"``); its first component may be ``router``,
        ``experts`` or ``shared`` (this family's paths for them, whatever the model
        calls them), ``block`` (the block itself), ``config`` (the model config the
        block's parts carry) or any child of the block. Anything else (a number, a bool, None, a plain word
        such as ``"softmax"``) is a literal and returned as is.
        """
        if not isinstance(reference, str) or "." not in reference:
            return reference
        if reference.startswith("1/"):  # a reciprocal: "1/router.top_k"
            return 1 / self.resolve(reference[2:], block)
        try:
            return getattr(*self.owner(reference, block))
        except AttributeError as error:
            raise FamilyError(
                f"family {self.name!r}: cannot read {reference!r} from {type(block).__name__} ({error}); "
                + self._fix(reference)
            ) from None

    def owner(self, reference: str, block: Any) -> tuple[Any, str]:
        """The object of the live block module that holds the attribute a dotted ``reference`` names (as `resolve`
        reads it, without ``1/``), and the attribute's name: ``(the router module, "top_k")`` for ``"router.top_k"``.
        An `AttributeError` where a part on the way is missing."""
        head, _, rest = reference.partition(".")
        roots = {"router": self.router, "experts": self.experts, "block": ""}
        if self.shared is not None and not self.shared.on_layer:
            roots["shared"] = self.shared.module
        parent, _, name = rest.rpartition(".")
        root = find_config(block) if head == "config" else get_path(block, beneath_adapters(block, roots.get(head, head)))
        return get_path(root, parent), name

    def _fix(self, reference: str) -> str:
        """What to change for `resolve`'s error: the settings of this entry that hold ``reference``."""
        settings = [(f"scoring.{item.name}" if owner is self.scoring else item.name, item.default)
                    for owner in (self, self.scoring) for item in fields(owner) if getattr(owner, item.name) == reference]
        if not settings:  # a reference made elsewhere (a shared expert's, a layout's)
            return "the family entry does not match this model."
        named = " and ".join(name + (" (left at its default)" if default == reference else "") for name, default in settings)
        return f"it is the entry's {named}; set that to a value, or to a reference to what this model has."

    def holds(self, reference: str | None, block: Any) -> bool:
        """Whether the live ``block`` has what the attribute reference names (a config can leave it out)."""
        if reference is None:
            return False
        try:
            return self.resolve(reference, block) is not None
        except FamilyError:
            return False

    def normalize_of(self, block: Any) -> bool | float:
        """How the live ``block``'s router renormalises its k weights (`Scoring.normalize`, read): True (to sum to
        one) or False, or the number p of a p-norm it divides them by (dbrx's ``moe_normalize_expert_weights``)."""
        normalize = self.resolve(self.scoring_of(block).normalize, block)
        if isinstance(normalize, (int, float)) and not isinstance(normalize, bool) and normalize == 0:  # dbrx's p = 0
            raise FamilyError(
                f"family {self.name!r}: this block's router divides its k weights by their 0-norm (p = 0, the count "
                "of non-zero weights, as dbrx's moe_normalize_expert_weights=0.0 gives), which moelens does not "
                "describe, check, export or write logits under; set it to None (no renormalisation) or a p > 0."
            )
        return normalize if isinstance(normalize, (int, float)) else bool(normalize)  # None: not renormalised

    def normalize_min_of(self, block: Any) -> float:
        """The floor the live ``block``'s router clamps the divisor of its k weights at (`Scoring.normalize_min`,
        read: ernie4_5's ``moe_norm_min``), 0.0 for none."""
        reference = self.scoring_of(block).normalize_min
        value = self.resolve(reference, block)
        if hasattr(value, "numel") and value.numel() == 1:  # a 0-d tensor or buffer
            value = value.item()
        if value is None:
            return 0.0
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
        word = isinstance(reference, str) and "." not in reference
        hint = f'; a plain word is no reference: write "router.{reference}" or "config.{reference}"' if word else ""
        shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
        raise FamilyError(
            f"family {self.name!r}: Scoring.normalize_min={reference!r} gives {type(value).__name__} {value!r:.60}"
            f"{shape} on {type(block).__name__}, not a floor: expected a finite number >= 0 (the least the k weights' "
            f"sum is divided by), an attribute reference to one (\"router.norm_min\"), or None for none{hint}."
        )

    def described_on(self, block: Any) -> str:
        """`Scoring.describe` of the live ``block``'s scoring, with what it reads off the block resolved there: the
        score function, its logit softcap, whether it adds a selection bias and picks inside groups (and how many),
        its normalisation (with its floor, from `NEGLIGIBLE_FLOOR` up) and its scale."""
        scoring = self.scoring_of(block)
        groups, scale, softcap = self.groups_of(block), self.scale_of(block), self.softcap_of(block)
        if groups is not None and groups[1] >= groups[0]:  # every group kept: plain top-k, as a route reads it
            groups = None
        return replace(scoring, score=self.score_of(block), groups=groups, groups_if=None,
                       select="score_topk" if scoring.select == "group_topk" and groups is None else scoring.select,
                       selection_bias=scoring.selection_bias if self.holds(scoring.selection_bias, block) else None,
                       softcap=softcap or None, normalize=self.normalize_of(block),
                       normalize_min=self.normalize_min_of(block), scale=None if scale == 1.0 else scale).describe()

    def score_of(self, block: Any) -> str:
        """The score function the live ``block``'s router applies (`Scoring.score`, an attribute reference read)."""
        reference = self.scoring_of(block).score
        name = self.resolve(reference, block)
        if not isinstance(name, str) or name not in SCORE_FUNCTIONS:
            raise FamilyError(
                f"family {self.name!r}: Scoring.score={reference!r} gives {name!r:.60} on {type(block).__name__}, not a "
                f"score function: expected one of {sorted(SCORE_FUNCTIONS)}, or an attribute reference to one."
            )
        return name

    def scale_of(self, block: Any) -> float | None:
        """The multiplier the live ``block``'s router puts on every weight (`Scoring.scale`, read), None for none."""
        return self._multiplier(block, "Scoring.scale", self.scoring_of(block).scale,
                                "the scale is one multiplier on every expert weight; name a number (or an attribute "
                                "holding one), or leave it None (a per-expert scale is the experts' own)")

    def selection_bias_of(self, block: Any, experts: int) -> Any:
        """The bias the live ``block``'s router adds to its ``experts`` scores for picking only
        (`Scoring.selection_bias`, read): a tensor ``[experts]`` (or ``[1, experts]``), or None where the entry names
        none or the block has none (a config can leave it out)."""
        reference = self.scoring_of(block).selection_bias
        value = self.resolve(reference, block)
        if value is None or (hasattr(value, "shape") and tuple(value.shape[-1:]) == (experts,)
                             and value.numel() == experts):
            return value  # [E], or [1, E] (ernie4_5's moe_statics)
        given = (f"a {type(value).__name__} of shape {tuple(value.shape)}" if hasattr(value, "shape")
                 else f"{type(value).__name__} {value!r:.40}")
        raise FamilyError(
            f"family {self.name!r}: Scoring.selection_bias={reference!r} gives {given} on "
            f"{type(block).__name__}, not a bias per expert: expected a tensor of shape ({experts},) (or (1, "
            f"{experts})), one number added to each expert's score for picking only "
            "(\"router.e_score_correction_bias\"), or None for none."
        )

    def routed_scale_of(self, block: Any) -> float | None:
        """The multiplier the live ``block`` puts on its experts' output (`Combine.routed_scale`, read), None for
        none."""
        return self._multiplier(block, "Combine.routed_scale", self.combine.routed_scale,
                                "the block multiplies its whole experts output by it; name a number (or an attribute "
                                "holding one), or leave it None")

    def _multiplier(self, block: Any, field: str, reference: Any, what: str) -> float | None:
        """The entry's setting ``field`` (``reference``) read on the live ``block`` as one number, None for none;
        a FamilyError saying ``what`` it is where it gives something else (a per-expert tensor)."""
        value = self.resolve(reference, block)
        if hasattr(value, "numel") and value.numel() == 1:  # a 0-d tensor or buffer
            value = value.item()
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return None if value is None else float(value)
        shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
        raise FamilyError(f"family {self.name!r}: {field}={reference!r} gives a {type(value).__name__}{shape} on "
                          f"{type(block).__name__}, not a number: {what}.")

    def expert_scale_of(self, block: Any) -> Any:
        """The multiplier per expert the live ``block``'s router puts on each chosen weight (`Scoring.expert_scale`,
        read: a tensor ``[E]``), or None for none."""
        reference = self.scoring_of(block).expert_scale
        value = self.resolve(reference, block) if reference else None
        if value is None or getattr(value, "ndim", None) == 1 and value.is_floating_point():
            return value
        shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
        raise FamilyError(f"family {self.name!r}: Scoring.expert_scale={reference!r} gives a {type(value).__name__}"
                          f"{shape} on {type(block).__name__}, not a floating-point tensor [E] of one multiplier per "
                          "expert.")

    def softcap_of(self, block: Any) -> float:
        """The logit softcap the live ``block``'s router applies before scoring (laguna), 0.0 for none."""
        reference = self.scoring_of(block).softcap
        return float(self.resolve(reference, block) or 0.0) if reference else 0.0

    def groups_of(self, block: Any) -> tuple[int, int] | None:
        """``(n_group, topk_group)`` where the live ``block`` picks experts inside the best groups, else None."""
        scoring = self.scoring_of(block)
        if not scoring.groups:
            return None
        if scoring.groups_if is not None:
            reference, wanted = scoring.groups_if
            if self.resolve(reference, block) != wanted:
                return None
        n_group, topk_group = (self.resolve(reference, block) for reference in scoring.groups)
        if n_group is None or topk_group is None:  # a config without groups (axk2's default): the router skips them
            return None
        groups, kept = _whole(n_group), _whole(topk_group)
        try:
            experts = self.resolve(self.num_experts, block)
        except FamilyError:  # a block that does not say E where the entry looks: the groups are checked without it
            experts = None
        if groups is not None and kept is not None and 1 <= kept <= groups and not (
                isinstance(experts, int) and experts % groups):
            return groups, kept
        raise FamilyError(
            f"family {self.name!r}: Scoring.groups={scoring.groups!r} reads n_group={n_group!r:.40}, "
            f"topk_group={topk_group!r:.40} on {type(block).__name__} (E={experts!r:.40} experts), which no router "
            "groups by: expected whole numbers with 1 <= topk_group <= n_group and n_group dividing E. Name the "
            "attributes that hold (n_group, topk_group), in that order."
        )

    def identity_count(self, block: Any) -> int:
        """How many of the live ``block``'s experts are zero-compute identity experts (the last ones), 0 for none."""
        value = self.resolve(self.identity_experts, block) or 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FamilyError(
                f"family {self.name!r}: identity_experts={self.identity_experts!r} gives {value!r} on "
                f"{type(block).__name__}, not a count of experts; name the attribute that holds it "
                "(\"experts.zero_expert_num\") or give an int >= 0."
            )
        return value

    def scoring_of(self, block: Any) -> Scoring:
        """The scoring of one live block: `scoring`, unless its router's class has its own."""
        if not self.scoring_by_router:
            return self.scoring
        router = get_path(block, beneath_adapters(block, self.router))
        # the router's own class while a PEFT parameter adapter runs it (its parametrization subclasses it)
        return self.scoring_by_router.get(type_before_parametrizations(router).__name__, self.scoring)

    def combined(self, block: Any, routed: Any, shared: Any = None) -> Any:
        """The block output this family makes of ``routed`` and ``shared`` (see `Combine`).

        ``block`` is the live block module (its scaling factors and post modules
        are read from it); tensors may be ``[T, D]`` or ``[b, s, D]``.
        """
        combine = self.combine
        scale = self.routed_scale_of(block)
        output = routed * scale if scale is not None else routed
        if combine.routed_post:
            output = get_path(block, combine.routed_post)(output)
        if shared is not None and not (self.shared is not None and self.shared.on_layer):
            output = output + shared
            if self.mode_of(block) == "average":
                output = output / 2
        if combine.block_post:
            output = get_path(block, combine.block_post)(output)
        return output

    def mode_of(self, block: Any) -> str:
        """How the live ``block`` combines routed and shared output: `Combine.mode`, read from the block where it is
        an attribute reference; one of `COMBINE_MODES`."""
        mode = self.resolve(self.combine.mode, block)
        if mode not in COMBINE_MODES:
            raise FamilyError(
                f"family {self.name!r}: Combine.mode={self.combine.mode!r} reads {mode!r} from "
                f"{type(block).__name__}, which is not one of {COMBINE_MODES}: name the attribute that holds one of "
                "them, or give the mode itself (Combine(mode=\"sum\"))."
            )
        return mode

    def order(self) -> tuple[str, ...]:
        """The served values in the order the model produces them for this family."""
        return self._order

    @cached_property
    def _order(self) -> tuple[str, ...]:  # an entry is frozen: worked out once (save_all asks at every block)
        routed = [name for name in VALUE_NAMES if name not in ("shared_expert_output", "mlp_output")]
        order = list(routed)
        if self.shared is not None:
            position = {
                "before_router": 0,
                "before_experts": routed.index("expert_weights"),
                "after_experts": len(routed),
            }.get(self.shared.when)
            if position is not None:
                order.insert(position, "shared_expert_output")
        order.append("mlp_output")
        if self.shared is not None and self.shared.when == "after_block":
            order.append("shared_expert_output")
        return tuple(name for name in order if name not in self.refused)


def _whole(value: Any) -> int | None:
    """``value`` as an int where it is a whole number (``4``, ``4.0``), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def get_path(root: Any, path: str) -> Any:
    """``root.a.b`` for ``path == "a.b"`` (an empty path is ``root`` itself)."""
    value = root
    for part in filter(None, path.split(".")):
        value = getattr(value, part)
    return value


def find_path(root: Any, path: str) -> Any:
    """`get_path`, or None where a part of ``path`` is missing."""
    try:
        return get_path(root, path)
    except AttributeError:
        return None


def adapter_chain(root: Any, path: str) -> list[Any]:
    """The module at ``path`` below ``root`` and, where PEFT parameter adapters stand there (`is_parameter_adapter`,
    nested where several of a module's parameters are adapted), each one's ``base_layer`` down to the family's own
    module: ``[the module at path]`` where none stands, ``[]`` where ``path`` names nothing."""
    chain = [find_path(root, path)] if path else []
    while chain and is_parameter_adapter(chain[-1]):
        chain.append(chain[-1].base_layer)
    return [module for module in chain if module is not None]


def beneath_adapters(root: Any, path: str) -> str:
    """``path`` below ``root`` continued through the PEFT parameter adapters standing there (`adapter_chain`,
    ``.base_layer`` for each): the path of the family's own module, whose forward runs inside theirs on the adapted
    parameters. ``path`` itself where none stands."""
    return path + ".base_layer" * max(len(adapter_chain(root, path)) - 1, 0)


def find_config(module: Any) -> Any:
    """The model config a block or one of its parts carries (blocks rarely keep one)."""
    for candidate in module.modules():
        config = getattr(candidate, "config", None)
        if config is not None:
            return config
    raise AttributeError(f"{type(module).__name__} and its parts carry no config")
