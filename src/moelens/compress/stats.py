"""What a conversion did: converted and skipped layers, parameter counts, errors.

Parameter counts are read off the modules: ``original`` is the dense model's
parameter count, ``new`` the converted model's, and ``active`` what one token
touches (the converted model's parameters minus, in every converted block, the
experts the token does not run: ``(E - k) / E`` of the experts' parameters). Fixed
0/1 placement buffers of `ToMoELinear` are buffers, not parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn


@dataclass
class LayerStats:
    """One converted layer.

    Attributes:
        name: Module name of the converted block.
        kind: ``"swiglu"``, ``"bert"``, ``"gpt2"`` or ``"linear"``.
        num_experts, top_k: E and k.
        expert_sizes: Dense neurons (FFN) or outputs (Linear) per expert.
        shared_neurons: Always-active neurons.
        error: Relative reconstruction error ``||y_moe - y||_F / ||y||_F`` on calibration tokens
            held out of the fit, whole sequences unless ``notes`` says otherwise (None without
            calibration data).
        error_tokens: Tokens the error was measured on.
        original_parameters, new_parameters, active_parameters: Of this layer.
        padded_expert_size: Neurons (outputs) each expert computes: the largest expert's, zero-padded to a
            multiple of 8 for grouped_mm (`moelens.compress.build.SIZE_MULTIPLE`).
        lora: Whether LoRA adapters were added.
        notes: Anything worth knowing (fewer experts for a narrow projection, a PEFT wrapper kept ...).
    """

    name: str
    kind: str
    num_experts: int
    top_k: int
    expert_sizes: list[int]
    shared_neurons: int
    error: float | None
    error_tokens: int
    original_parameters: int
    new_parameters: int
    active_parameters: int
    padded_expert_size: int
    lora: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def active_fraction(self) -> float:
        """Share of this layer's dense neurons (or outputs) a token uses at most: its k largest experts' and the
        shared ones (padding aside, see `computed_fraction`)."""
        biggest = sorted(self.expert_sizes, reverse=True)[: self.top_k]
        return (sum(biggest) + self.shared_neurons) / self._dense_size

    @property
    def computed_fraction(self) -> float:
        """What a token computes, as a share of this layer's dense neurons (or outputs): k experts of
        `padded_expert_size`, zero padding included, and the shared neurons; above `active_fraction` where the
        experts are padded (E = 32 experts of 14 neurons compute 16 each)."""
        return (self.top_k * self.padded_expert_size + self.shared_neurons) / self._dense_size

    @property
    def _dense_size(self) -> int:
        return max(1, sum(self.expert_sizes) + self.shared_neurons)


@dataclass
class SkippedLayer:
    """A candidate left dense, and why."""

    name: str
    reason: str


@dataclass
class CompressionStats:
    """The result of one conversion (see the module docstring for the counts).

    Attributes:
        converted: One `LayerStats` per converted layer, in module order.
        skipped: Candidates left dense, each with its reason.
        original_parameters: Parameters of the dense model.
        new_parameters: Parameters of the converted model.
        active_parameters: Parameters one token uses in the converted model.
        calibration_tokens: Calibration tokens seen per layer (0: converted from weights only).
        seconds: Conversion time (calibration forward included).
        settings: The options used.
    """

    converted: list[LayerStats] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)
    original_parameters: int = 0
    new_parameters: int = 0
    active_parameters: int = 0
    calibration_tokens: int = 0
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def parameter_ratio(self) -> float:
        """new / original parameters."""
        return self.new_parameters / max(1, self.original_parameters)

    @property
    def active_ratio(self) -> float:
        """active-per-token / original parameters."""
        return self.active_parameters / max(1, self.original_parameters)

    @property
    def converted_layers(self) -> list[str]:
        """The module names of the converted layers (each `LayerStats.name`), in module order."""
        return [layer.name for layer in self.converted]

    @property
    def skipped_layers(self) -> dict[str, str]:
        """Module name -> why the candidate was left dense (each `SkippedLayer`)."""
        return {layer.name: layer.reason for layer in self.skipped}

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain data (JSON-ready)."""
        data = asdict(self)
        data.update(parameter_ratio=self.parameter_ratio, active_ratio=self.active_ratio)
        for layer, converted in zip(data["converted"], self.converted):
            layer.update(active_fraction=converted.active_fraction, computed_fraction=converted.computed_fraction)
        return data

    def summary(self) -> str:
        """A short text report: totals, then one line per converted and skipped layer."""
        lines = [
            f"tomoe: {len(self.converted)} layers converted, {len(self.skipped)} skipped, {self.seconds:.1f} s",
            f"parameters: {self.original_parameters:,} -> {self.new_parameters:,} ({self.parameter_ratio:.3f}x), "
            f"active per token {self.active_parameters:,} ({self.active_ratio:.3f}x)",
        ]
        for layer in self.converted:
            error = "n/a (no calibration)" if layer.error is None else f"{layer.error:.4f}"
            notes = f" ({'; '.join(layer.notes)})" if layer.notes else ""
            lines.append(
                f"  + {layer.name} [{layer.kind}] E={layer.num_experts} k={layer.top_k} "
                f"active {layer.active_fraction:.0%} (computed {layer.computed_fraction:.0%}) error {error}{notes}"
            )
        for layer in self.skipped:
            lines.append(f"  - {layer.name}: {layer.reason}")
        return "\n".join(lines)


def parameter_count(module: nn.Module) -> int:
    """Distinct parameters of a module (shared ones once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def block_counts(block: nn.Module) -> tuple[int, int]:
    """``(parameters, active parameters per token)`` of a converted block."""
    total = parameter_count(block)
    experts = parameter_count(block.experts)
    skipped = experts * (block.num_experts - block.top_k) // block.num_experts
    return total, total - skipped
