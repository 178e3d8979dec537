"""`MoeSpec`: one MoE block as the inputs and attributes of a tract_moe_ffn call.

The spec is read from the live block through its family entry (router path and
logits op, experts path, scoring, `Family.expert_gate`) and the layout flags
transformers stamps on every decorated experts module (``has_gate``,
``is_transposed``, ``is_concatenated``, ``has_bias``). Its weights are copies in
tract's canonical layout (``w1``/``w3`` ``[E, D, H]``, ``w2`` ``[E, H, D]``), so
edits and quantisation never touch the user's model. `MoeSpec.routed` computes,
in torch, exactly what tract computes from the spec: the reference that the
export is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..components.params import expert_views, router_linear
from ..errors import ValueUnavailable
from ..families import Family
from ..families.entry import beneath_adapters, get_path
from ..families.tomoe import EXPORTABLE, converted
from .errors import ExportRefused
from .gate import expert_gate_refusal, routing

@dataclass
class MoeSpec:
    """Everything one tract_moe_ffn call needs, in tract's canonical layout.

    Attributes:
        family: The family name.
        layer: The decoder layer index (None for a block outside a layer list).
        k: Experts per token.
        gate: tract gate mode (`moelens.export.gate.GATE_MODES`).
        scale: Multiplier on the routed output (the router's weight scale), 1.0 for none.
        activation: tract activation: ``"swiglu"`` (gated silu) or, with ``w3``, the
            gated ``"gelu"`` / ``"relu"``; without ``w3``, ``"silu"`` / ``"gelu"`` / ``"relu"``.
        act_alpha: Sigmoid slope of gpt-oss's clamped SwiGLU, or None.
        act_limit: Clamp limit of gpt-oss's clamped SwiGLU, or None.
        wg: Router weight [E, D]; ``wg_bias`` [E] or None (a router bias, steering, route-around).
        w1: Gate (or up, when ungated) projection [E, D, H]; ``w3`` up projection [E, D, H] or None.
        w2: Down projection [E, H, D].
        w1_bias, w3_bias: [E, H] or None; ``w2_bias`` [E, D] or None.
    """

    family: str
    layer: int | None
    k: int
    gate: str
    scale: float
    activation: str
    act_alpha: float | None
    act_limit: float | None
    wg: Float[Tensor, "e d"]
    w1: Float[Tensor, "e d h"]
    w2: Float[Tensor, "e h d"]
    w3: Float[Tensor, "e d h"] | None = None
    wg_bias: Float[Tensor, " e"] | None = None
    w1_bias: Float[Tensor, "e h"] | None = None
    w3_bias: Float[Tensor, "e h"] | None = None
    w2_bias: Float[Tensor, "e d"] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.wg.shape[0])

    @property
    def activation_label(self) -> str:
        """The experts' activation as reports print it: gpt-oss's clamp with its alpha and limit spelt out."""
        if self.act_limit is None:
            return self.activation
        return f"clamped swiglu (alpha {self.act_alpha:g}, limit {self.act_limit:g})"

    @property
    def has_expert_biases(self) -> bool:
        """Whether any of the experts' projections has a bias."""
        return any(b is not None for b in (self.w1_bias, self.w3_bias, self.w2_bias))

    def tied_experts(self, rtol: float = 1e-5) -> list[tuple[int, int]]:
        """Pairs of selectable experts whose router rows and biases agree to ``rtol`` of the router's scale: their
        logits tie (or nearly) on every token, and tract's top-k may break such ties otherwise than torch's."""
        rows = self.wg.float()
        bias = self.wg_bias.float() if self.wg_bias is not None else rows.new_zeros(rows.shape[0])
        bound = rtol * float(rows.abs().max().clamp_min(1e-30))
        close = torch.cdist(rows, rows, p=float("inf")) <= bound
        close &= (bias[:, None] - bias[None, :]).abs() <= bound
        close &= torch.isfinite(bias)[:, None] & torch.isfinite(bias)[None, :]  # routed around: never chosen
        return [(int(a), int(b)) for a, b in torch.triu(close, diagonal=1).nonzero().tolist()]

    @property
    def selectable(self) -> int:
        """How many experts the router can choose: those not routed around (a finite router bias, or none)."""
        if self.wg_bias is None:
            return self.num_experts
        return int(torch.isfinite(self.wg_bias).sum())

    def same_expert(self, a: int, b: int) -> bool:
        """Whether experts ``a`` and ``b`` compute the same output on every token: equal w1/w2/w3 and biases, or both
        zero out (a zero w2 and w2 bias: ablated)."""
        return all(value is None or torch.equal(value[a], value[b])
                   for name, value in self.tensors().items() if name not in ("wg", "wg_bias")) or all(
            self._outputs_zero(expert) for expert in (a, b))

    def _outputs_zero(self, expert: int) -> bool:
        """Whether ``expert``'s output is zero on every token: a zero down projection, and no or a zero bias."""
        return not self.w2[expert].any() and (self.w2_bias is None or not self.w2_bias[expert].any())

    def ties_that_matter(self) -> list[tuple[int, int]]:
        """The `tied_experts` pairs whose tie can change the output: the two experts' weights differ, and top-k
        leaves some selectable expert out (so the pair can straddle its boundary). Empty when there are none."""
        if self.k >= self.selectable:
            return []
        return [(a, b) for a, b in self.tied_experts() if not self.same_expert(a, b)]

    def with_weights(self, **weights: Tensor | None) -> "MoeSpec":
        """A copy with some tensors replaced (the others are shared)."""
        return replace(self, notes=list(self.notes), **weights)

    def clone(self) -> "MoeSpec":
        """A copy whose tensors can be edited without touching this one."""
        tensors = {name: (value.clone() if isinstance(value, Tensor) else value) for name, value in self.tensors().items()}
        return self.with_weights(**tensors)

    def tensors(self) -> dict[str, Tensor | None]:
        """The op's tensor inputs by name (``wg``, ``w1``, ``w2``, ``w3`` and the biases)."""
        return {
            "wg": self.wg, "w1": self.w1, "w2": self.w2, "w3": self.w3,
            "wg_bias": self.wg_bias, "w1_bias": self.w1_bias, "w3_bias": self.w3_bias, "w2_bias": self.w2_bias,
        }

    # -- the reference ----------------------------------------------------------------

    def routing_weights(self, x: Float[Tensor, "*tokens d"]) -> Float[Tensor, "*tokens e"]:
        """Each token's weight on every expert [..., E] (zero off its k experts), as tract gates."""
        logits = x @ self.wg.T
        if self.wg_bias is not None:
            logits = logits + self.wg_bias
        values, indices = torch.topk(logits, self.k, dim=-1)
        if self.gate == "softmax_topk":
            weights = torch.softmax(values, dim=-1)
        elif self.gate == "softmax_all":
            weights = torch.softmax(logits, dim=-1).gather(-1, indices)
        elif self.gate == "sigmoid":
            weights = torch.sigmoid(values)
        else:
            weights = values
        return torch.zeros_like(logits).scatter(-1, indices, weights)

    def expert_outputs(self, x: Float[Tensor, "*tokens d"]) -> Float[Tensor, "*tokens e d"]:
        """Every expert's output on every token [..., E, D] (dense: a reference, not fast)."""
        gate = torch.einsum("...d,edh->...eh", x, self.w1)
        if self.w1_bias is not None:
            gate = gate + self.w1_bias
        up = None
        if self.w3 is not None:
            up = torch.einsum("...d,edh->...eh", x, self.w3)
            if self.w3_bias is not None:
                up = up + self.w3_bias
        if self.act_limit is not None:  # gpt-oss's clamped SwiGLU (always gated)
            gate = gate.clamp(max=self.act_limit)
            up = up.clamp(min=-self.act_limit, max=self.act_limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * self.act_alpha)
        else:
            act = {"swiglu": F.silu, "silu": F.silu, "relu": F.relu,
                   "gelu": lambda t: F.gelu(t, approximate="tanh")}[self.activation]
            hidden = act(gate) if up is None else act(gate) * up
        out = torch.einsum("...eh,ehd->...ed", hidden, self.w2)
        if self.w2_bias is not None:
            out = out + self.w2_bias
        return out

    def routed(self, x: Float[Tensor, "*tokens d"]) -> Float[Tensor, "*tokens d"]:
        """What tract_moe_ffn outputs for ``x`` (``[T, D]`` or ``[B, S, D]``), before `scale`."""
        weights = self.routing_weights(x)
        return torch.einsum("...e,...ed->...d", weights, self.expert_outputs(x))


def refuse_ties(specs: Iterable[MoeSpec]) -> None:
    """Raise `ExportRefused` where a block's router gives two experts with different weights the same row (a row
    copied with ``moe.params()``, or two rows zeroed): their logits tie on every token, and tract's top-k breaks such
    ties otherwise than torch's, so the archive would compute the other expert for some tokens
    (`MoeSpec.ties_that_matter`)."""
    tied, zeroed = [], []
    for spec in specs:
        pairs = spec.ties_that_matter()
        if not pairs:
            continue
        where = "the block" if spec.layer is None else f"layer {spec.layer}"
        tied.append(f"{where}: experts {', '.join(f'{a} and {b}' for a, b in pairs)}")
        experts = sorted({expert for pair in pairs for expert in pair if not spec.wg[expert].any()})
        zeroed += [f"{where}'s experts {', '.join(map(str, experts))}"] if experts else []
    if not tied:
        return
    if zeroed:  # scaling a zero row keeps it zero: say what removes an expert instead
        advice = (f"The router rows of {'; '.join(zeroed[:3])}{' ...' if len(zeroed) > 3 else ''} are all "
                  "zero: a zero row does not remove an expert (its logit is 0, tied with the other zero rows). Route "
                  "around those experts instead (ablate(moe, e, \"route_around\"), Edits(route_around=...)), or zero "
                  "their down projections too (moe.params(e).down.zero_(), so that either pick adds nothing), and "
                  "export again.")
    else:
        advice = ("Make the rows differ (e.g. scale a copied row by 1.01) or route around one of the experts "
                  "(ablate(moe, e, \"route_around\"), Edits(route_around=...)), and export again (an expert copied "
                  "whole, router row and weights, exports).")
    raise ExportRefused(
        f"a router gives two experts the same row but not the same weights, so their logits tie on every token "
        f"({'; '.join(tied[:3])}{' ...' if len(tied) > 3 else ''}), and tract's top-k breaks ties otherwise than "
        f"torch's: the archive would compute the other expert for some tokens. {advice}"
    )


# -- reading a live block ------------------------------------------------------------------


def read_spec(family: Family, block: torch.nn.Module, layer: int | None = None) -> MoeSpec:
    """The tract_moe_ffn spec of a live MoE block (copies of its weights, float32).

    Raises `ExportRefused` naming the part of the block tract cannot express.
    """
    route = routing(family, block)
    wg, wg_bias = _router_weights(family, block, route.num_experts)
    experts = _experts_weights(family, block)
    spec = MoeSpec(
        family=family.name, layer=layer, k=route.k, gate=route.gate, scale=route.scale,
        wg=wg, wg_bias=wg_bias, **experts,
    )
    if spec.w1.shape[0] != route.num_experts or spec.w1.shape[1] != wg.shape[1]:
        why = ("the block is a converted Linear whose output is wider than its input (its experts' inputs are padded "
               "to that width), and tract_moe_ffn's output has its input's width (a residual-stream FFN); convert "
               "only layers whose outputs are as wide as their inputs (target_modules=[...], e.g. q_proj and o_proj), "
               "or the FFN blocks" if converted(family) else "the block is not one router over one experts module")
        raise ExportRefused(
            f"{family.name}: the experts' weights {tuple(spec.w1.shape)} do not match the router's "
            f"{tuple(wg.shape)} ([E, D]); {why}."
        )
    if spec.w3 is None and (spec.has_expert_biases or spec.wg_bias is not None):
        raise ExportRefused(
            f"{family.name}: ungated experts with biases cannot be expressed: tract_moe_ffn binds its bias "
            f"inputs after w3, which ungated experts do not have."
            + (f" This block is moelens.compress' output: {EXPORTABLE}." if converted(family) else "")
        )
    return spec


def _float(tensor: Tensor) -> Tensor:
    return tensor.detach().to(torch.float32).clone()


def _router_weights(family: Family, block: torch.nn.Module, num_experts: int) -> tuple[Tensor, Tensor | None]:
    """Router weight [E, D] and bias [E] (or None) behind the family's logits op."""
    try:
        linear = router_linear(family, block, num_experts)
    except ValueUnavailable as error:  # a quantized or PEFT-adapted router Linear
        raise ExportRefused(str(error)) from None
    if linear is None:
        router = get_path(block, beneath_adapters(block, family.router))
        raise ExportRefused(
            f"{family.name}: the router's logits come from {family.logits_op!r} in {type(router).__name__}.forward, "
            f"which is not one linear layer with an [E={num_experts}, D] weight; tract_moe_ffn computes the logits "
            "as x @ wg.T."
        )
    weight, bias = linear
    return _float(weight), (_float(bias) if bias is not None else None)


def _experts_weights(family: Family, block: torch.nn.Module) -> dict[str, Any]:
    """w1/w2/w3, biases and activation of the family's experts module, in the canonical layout."""
    experts = get_path(block, beneath_adapters(block, family.experts))
    name = family.name
    if not hasattr(experts, "has_gate") or not isinstance(getattr(experts, "down_proj", None), Tensor):
        raise ExportRefused(
            f"{name}: {type(experts).__name__} is not a transformers experts module (no has_gate/down_proj "
            "layout), so its weights cannot be read as tract_moe_ffn's w1/w2/w3."
        )
    if getattr(experts, "has_post_expert_norm", False) or hasattr(experts, "post_expert_norm"):  # ergo: its own
        raise ExportRefused(f"{name}: a norm after each expert (post_expert_norm) cannot be expressed in tract_moe_ffn.")
    gated = bool(experts.has_gate)
    try:
        views = expert_views(family, experts, int(experts.down_proj.shape[0]))
    except ValueUnavailable as error:
        raise ExportRefused(str(error)) from None
    canonical = {"w1": "gate" if gated else "up", "w3": "up" if gated else None, "w2": "down"}  # tract's names
    weights: dict[str, Any] = {}
    for tract_name, view in canonical.items():
        if view is not None:
            weights[tract_name] = _float(views[view]).transpose(1, 2).contiguous()  # [E, out, in] -> [E, in, out]
            if views[f"{view}_bias"] is not None:
                weights[f"{tract_name}_bias"] = _float(views[f"{view}_bias"]).contiguous()
    weights.update(_activation(family, experts, gated, block))
    return weights


def _activation(family: Family, experts: torch.nn.Module, gated: bool, block: torch.nn.Module) -> dict[str, Any]:
    """tract activation (and clamped-SwiGLU alpha/limit) of the experts."""
    described = family.expert_gate
    if described is None and gated and _overrides_gate(experts):
        raise ExportRefused(
            f"{family.name}: {type(experts).__name__} overrides transformers' gate (_apply_gate) and the family "
            "entry does not say what it computes (Family.expert_gate), so it cannot be mapped to a tract activation."
        )
    kind = described.kind if described is not None else "glu"
    if kind == "clamped_swiglu":
        return {
            "activation": "swiglu",
            "act_alpha": float(family.resolve(described.alpha, block)),
            "act_limit": float(family.resolve(described.limit, block)),
        }
    if kind != "glu":
        raise ExportRefused(f"{family.name}: {expert_gate_refusal(kind)}.")
    act_fn = getattr(experts, "act_fn", None)
    try:
        act = _identify(act_fn, family)
    except ExportRefused as error:
        if converted(family) and not gated and isinstance(act_fn, torch.nn.Identity):  # a converted Linear's experts
            raise ExportRefused(f"{error} This block is moelens.compress' output: {EXPORTABLE}.") from None
        raise
    return {"activation": "swiglu" if (gated and act == "silu") else act, "act_alpha": None, "act_limit": None}


def _overrides_gate(experts: torch.nn.Module) -> bool:
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers without the experts decorator
        return False
    return getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate


def _identify(act_fn: Any, family: Family) -> str:
    """Which tract activation a torch activation is (checked on values, not class names)."""
    if not callable(act_fn):
        raise ExportRefused(f"{family.name}: the experts have no act_fn to map to a tract activation.")
    # large values too: an activation clamped or bent beyond [-8, 8] (a capped SiLU) would agree on that range alone
    spread = torch.logspace(1.0, 4.0, 31)
    probe = torch.cat([torch.linspace(-8.0, 8.0, 257), spread, -spread])
    with torch.no_grad():
        values = act_fn(probe)
    candidates = {
        "silu": F.silu(probe),
        "gelu": F.gelu(probe, approximate="tanh"),
        "relu": F.relu(probe),
    }
    for name, expected in candidates.items():
        if torch.allclose(values, expected, atol=1e-6, rtol=1e-5):
            return name
    if torch.allclose(values, F.gelu(probe), atol=1e-6):
        raise ExportRefused(
            f"{family.name}: the experts use exact (erf) GELU; tract_moe_ffn's gelu is the tanh approximation "
            "(up to 5e-4 apart), which would not match to tract's tolerance."
        )
    raise ExportRefused(
        f"{family.name}: the experts' activation {type(act_fn).__name__} is none of tract_moe_ffn's "
        f"silu, gelu (tanh) or relu."
    )
