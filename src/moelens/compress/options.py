"""`ToMoEOptions`: the settings of one conversion, from keyword arguments and ``comp_config``.

``comp_config`` may be a dict or any object with the same names as attributes; it
also accepts the spellings other configs use (`ALIASES`: ``tomoe_num_experts``,
``tomoe_top_k``, ``max_reconstruction_error``, ``tomoe_lora_r``, ...). Explicit
keyword arguments that differ from their defaults win over ``comp_config``. A setting named
twice (its own name and an alias, or two aliases) with different values is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..errors import MoelensError, described
from ..scalars import as_lone_int, as_real, check_flag
from .errors import CompressionError

#: Other spellings accepted in ``comp_config``, mapped to `ToMoEOptions` fields.
ALIASES = {
    "tomoe_num_experts": "num_experts",
    "tomoe_experts": "num_experts",
    "tomoe_top_k": "top_k",
    "max_reconstruction_error": "max_error",
    "tomoe_max_error": "max_error",
    "tomoe_lora_r": "lora_r",
    "tomoe_lora_alpha": "lora_alpha",
    "tomoe_shared_neurons": "shared_neurons",
    "tomoe_freeze_experts": "freeze_experts",
    "tomoe_target_attention_only": "target_attention_only",
    "tomoe_target_modules": "target_modules",
}


@dataclass(frozen=True)
class ToMoEOptions:
    """How to convert (see `moelens.compress.tomoe` for each setting).

    Attributes:
        num_experts: E, experts per converted layer.
        top_k: k, experts each token runs.
        max_error: Largest relative reconstruction error on calibration tokens for a layer
            to be converted (None: no gate).
        shared_neurons: Always-active neurons per FFN block (taken from the experts' budget
            only in the sense that they always run; experts split the rest).
        lora_r, lora_alpha: LoRA rank (0: none) and alpha on experts and router.
        freeze_experts: Expert weights do not train (LoRA adapters and the router do).
        target_attention_only: Convert the Linear layers inside attention modules instead of FFNs.
        target_modules: Module names / suffixes, or a regex, to convert (FFN blocks or Linear layers).
        refit: Refit the experts' down projections on calibration data (FFN blocks).
        max_tokens: Calibration tokens kept per layer.
        experts_implementation: transformers experts implementation the converted blocks run.
        inplace: Convert the given model itself instead of a copy.
        seed: Seed of the clustering, the token sampling and the LoRA adapters' start, in ``[0, 2**32)`` (scikit-learn's range).
        progress: Show a progress bar over layers.
    """

    num_experts: int = 4
    top_k: int = 2
    max_error: float | None = 0.2
    shared_neurons: int = 0
    lora_r: int = 0
    lora_alpha: float = 16.0
    freeze_experts: bool = True
    target_attention_only: bool = False
    target_modules: Any = None
    refit: bool = True
    max_tokens: int = 32768
    experts_implementation: str = "grouped_mm"
    inplace: bool = False
    seed: int = 0
    progress: bool = True

    def validate(self) -> "ToMoEOptions":
        """Check the settings; raises `CompressionError` naming the bad one.

        Returns these options with numbers as Python ints and floats (a numpy integer or a 0-d tensor is one).
        """
        parsed: dict[str, Any] = {}
        for name in ("num_experts", "top_k", "shared_neurons", "lora_r", "max_tokens", "seed"):
            value = getattr(self, name)
            parsed[name] = as_lone_int(value)
            if parsed[name] is None:
                raise CompressionError(f"{name} must be an int, got {value!r}.")
        for name in ("lora_alpha", "max_error"):
            value = getattr(self, name)
            parsed[name] = None if value is None else as_real(value)
            if value is not None and (parsed[name] is None or getattr(value, "ndim", 0) != 0):
                raise CompressionError(f"{name} must be a number, got {value!r}.")
        for name in ("freeze_experts", "target_attention_only", "refit", "inplace", "progress"):
            parsed[name] = check_flag(name, getattr(self, name), CompressionError)  # inplace="False" is truthy
        return replace(self, **parsed)._check_ranges()

    def _check_ranges(self) -> "ToMoEOptions":
        if self.lora_alpha is None or not math.isfinite(self.lora_alpha):  # the adapters' scale is alpha / r
            raise CompressionError(f"lora_alpha must be a finite number, got {self.lora_alpha!r}.")
        if self.num_experts < 1:
            raise CompressionError(f"num_experts must be at least 1, got {self.num_experts}.")
        if self.top_k < 1:
            raise CompressionError(f"top_k must be at least 1, got {self.top_k}.")
        if self.top_k > self.num_experts:
            raise CompressionError(
                f"top_k={self.top_k} is larger than num_experts={self.num_experts}: a token cannot run more experts "
                f"than there are; use top_k <= {self.num_experts} (top_k == num_experts reproduces the dense model)."
            )
        for name in ("shared_neurons", "lora_r"):
            if getattr(self, name) < 0:
                raise CompressionError(f"{name} must be 0 or more, got {getattr(self, name)!r}.")
        if self.lora_r and self.lora_alpha == 0:
            raise CompressionError(
                f"lora_alpha=0 scales the rank-{self.lora_r} adapters (by lora_alpha / lora_r) to nothing, so training "
                "them could never change the model; pass a positive lora_alpha (default 16.0), or lora_r=0 for no adapters."
            )
        if self.max_error is not None and not self.max_error > 0:
            raise CompressionError(f"max_error must be positive or None (no gate), got {self.max_error!r}.")
        if not 0 <= self.seed < 2**32:
            raise CompressionError(
                f"seed must be in [0, 2**32) (scikit-learn's k-means takes seeds in that range), got {self.seed}."
            )
        if self.max_tokens < 1:
            raise CompressionError(f"max_tokens must be positive, got {self.max_tokens}.")
        check_implementation(self.experts_implementation)
        if self.target_modules is not None and not isinstance(self.target_modules, (str, list, tuple)):
            raise CompressionError(
                f"target_modules must be a list of module names (or a regex string), got {type(self.target_modules).__name__}."
            )
        if isinstance(self.target_modules, (list, tuple)):
            wrong = [name for name in self.target_modules if not isinstance(name, str)]
            if wrong:
                raise CompressionError(
                    f"target_modules entries must be module names or name suffixes (str, such as 'mlp' or "
                    f"'layers.3.mlp'), got {described(wrong[0])} among {list(self.target_modules)!r:.120}: name a "
                    "layer's block by its path (model.layers.3.mlp), not by its index."
                )
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as error:
                raise CompressionError(
                    f"target_modules={self.target_modules!r} is not a valid regex ({error}); a string is matched "
                    "against whole module names (PEFT's rule), a list names modules or name suffixes."
                ) from None
        return self


def check_implementation(implementation: str) -> None:
    """Raise `CompressionError` unless transformers knows the experts implementation ``implementation``."""
    from ..components.implementations import check_known

    try:
        check_known(implementation, fp8=False)  # converted experts hold float weights
    except MoelensError as error:
        raise CompressionError(str(error)) from None


def check_dtype(implementation: str, dtypes: Iterable[torch.dtype], whose: str) -> None:
    """Raise `CompressionError` when experts implementation ``implementation`` cannot run ``whose`` weights of
    ``dtypes`` (a float64 model with ``grouped_mm``, which would fail only at its first forward)."""
    from ..components.implementations import unsupported_dtypes

    bad = unsupported_dtypes(implementation, dtypes)
    if bad:
        raise CompressionError(
            f"experts_implementation={implementation!r} cannot run {whose} {', '.join(bad)} weights (torch's "
            f"{implementation} takes float32, bfloat16 and float16; converted experts keep the model's dtype): pass "
            "experts_implementation='batched_mm' or 'eager', or convert a float32 copy (model.float())."
        )


def _read(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, bytes, list, tuple, set, int, float)):  # text or pairs would set nothing
        raise CompressionError(
            f"comp_config must be a dict or an object with tomoe settings as attributes (num_experts, top_k, "
            f"max_error, tomoe_num_experts, ...), got {type(config).__name__} {config!r:.80}; pass a dict such as "
            "comp_config={'num_experts': 8}."
        )
    if isinstance(config, dict):
        items = dict(config)
    else:  # an object's other attributes are ignored (a model's config, a script's arguments)
        names = {f.name for f in fields(ToMoEOptions)} | set(ALIASES)
        items = {name: getattr(config, name) for name in names if hasattr(config, name)}
    known = {f.name for f in fields(ToMoEOptions)}
    if isinstance(config, dict):  # a dict says what it sets: a key that sets nothing is a typo
        unknown = sorted(key for key in items if ALIASES.get(key, key) not in known)
        if unknown:
            raise CompressionError(
                f"comp_config has unknown key(s) {unknown}; known: {sorted(known | set(ALIASES))}."
            )
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}  # field -> the key that set it
    for key in sorted(items, key=lambda key: (ALIASES.get(key, key), key in ALIASES, key)):  # own name first
        field_name = ALIASES.get(key, key)
        if field_name not in known:
            continue
        if field_name in values and not _same(values[field_name], items[key]):
            raise CompressionError(
                f"comp_config sets {field_name} under two names with different values: "
                f"{keys[field_name]}={values[field_name]!r} and {key}={items[key]!r}; keep one of the two keys "
                "(they name the same setting)."
            )
        values.setdefault(field_name, items[key])
        keys.setdefault(field_name, key)
    return values


def _same(first: Any, second: Any) -> bool:
    """``first`` and ``second`` are the same setting (equal values under two names of one setting may coexist)."""
    if first is second or (isinstance(first, float) and isinstance(second, float) and math.isnan(first)
                           and math.isnan(second)):  # one NaN under two names: refused as a value, not as two
        return True
    try:
        return bool(first == second)
    except Exception:  # noqa: BLE001 - an array of several values has no single truth value: not the same
        return False


def resolve(comp_config: Any = None, **explicit: Any) -> ToMoEOptions:
    """Options from ``comp_config`` overridden by the keyword arguments that differ from the defaults."""
    defaults = ToMoEOptions()
    unknown = set(explicit) - {f.name for f in fields(ToMoEOptions)}
    if unknown:
        raise CompressionError(f"unknown tomoe setting(s) {sorted(unknown)}; known: {[f.name for f in fields(ToMoEOptions)]}.")
    values = _read(comp_config)
    for name, value in explicit.items():
        if name not in values or not _same(value, getattr(defaults, name)):
            values[name] = value
    return replace(defaults, **values).validate()
