"""Calibration: the inputs each layer to convert sees when the model runs on real data.

``calibration`` is what the model is called with: a token-id tensor ``[batch, seq]``,
a dict of keyword arguments (a tokenizer's ``BatchEncoding``: ``input_ids``,
``attention_mask`` ...), or a list / iterable of those (one forward each). Forward
pre-hooks record each target module's input; padding tokens (``attention_mask == 0``)
are left out, and each layer keeps at most ``max_tokens`` tokens (a seeded random
sample).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from .errors import CompressionError


def batches(calibration: Any) -> list[tuple[tuple, dict]]:
    """``calibration`` as a list of ``(args, kwargs)`` forward calls; raises on an empty or unusable set."""
    if calibration is None:
        return []
    if isinstance(calibration, (Tensor, Mapping)):
        items = [calibration]
    elif isinstance(calibration, (str, bytes)):
        raise CompressionError(
            "calibration must be token ids or model inputs, not text; tokenize it first "
            "(calibration=tokenizer(texts, return_tensors='pt', padding=True))."
        )
    elif isinstance(calibration, Iterable):
        items = list(calibration)
    else:
        raise CompressionError(
            f"calibration must be a tensor of token ids, a dict of model inputs, or a list of those; "
            f"got {type(calibration).__name__}."
        )
    calls: list[tuple[tuple, dict]] = []
    for item in items:
        if isinstance(item, Tensor):
            if item.numel() == 0:
                continue
            ids = item if item.dim() > 1 or item.is_floating_point() else item[None]
            calls.append(((), {"input_ids": ids}) if not ids.is_floating_point() else ((ids,), {}))
        elif isinstance(item, Mapping):
            kwargs = dict(item)
            if not any(isinstance(value, Tensor) for value in kwargs.values()) and kwargs:
                raise CompressionError(
                    f"calibration dict holds no tensor (its {', '.join(map(str, kwargs))} are "
                    f"{type(next(iter(kwargs.values()))).__name__}s); tokenize with return_tensors='pt'."
                )
            main = next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
            mask = _mask(kwargs)
            if main is None or main.numel() == 0 or (mask is not None and not mask.any()):
                continue  # no token, or only padding
            calls.append(((), kwargs))
        elif isinstance(item, (tuple, list)) and item and isinstance(item[0], Tensor):
            calls.append((tuple(item), {}))
        else:
            raise CompressionError(
                f"calibration items must be token-id tensors or dicts of model inputs; got {type(item).__name__}."
            )
    if not calls:
        raise CompressionError(
            "the calibration set is empty (no batch with any real token, padding aside); pass token ids such as "
            "tokenizer(texts, return_tensors='pt', padding=True), or calibration=None to convert from weights only."
        )
    return calls


def _mask(kwargs: dict) -> Tensor | None:
    mask = kwargs.get("attention_mask")
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def _valid_rows(hidden: Tensor, mask: Tensor | None) -> Tensor:
    """The input's token rows ``[n, D]``, without padding when the mask fits its shape."""
    if mask is not None:
        if hidden.dim() == 3 and tuple(hidden.shape[:2]) == tuple(mask.shape):
            return hidden[mask.to(hidden.device)]
        if hidden.dim() == 2 and hidden.shape[0] == mask.numel():
            return hidden[mask.reshape(-1).to(hidden.device)]
    return hidden.reshape(-1, hidden.shape[-1])


@torch.no_grad()
def capture(model: nn.Module, calls: list[tuple[tuple, dict]], modules: Mapping[str, nn.Module], *,
            max_tokens: int = 32768, seed: int = 0) -> dict[str, Float[Tensor, "t d"]]:
    """Run ``model`` on every call and return each module's input tokens ``[T, D]`` (float32, on CPU)."""
    found: dict[str, list[Tensor]] = {name: [] for name in modules}
    current: dict[str, Tensor | None] = {"mask": None}
    handles = []

    def recorder(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else next(iter(kwargs.values()))
            found[name].append(_valid_rows(hidden.detach(), current["mask"]).float().cpu())
        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(recorder(name), with_kwargs=True))
    training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        for args, kwargs in calls:
            kwargs = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in kwargs.items()}
            args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
            current["mask"] = _mask(kwargs)
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, pieces in found.items():
        if not pieces:
            continue
        rows = torch.cat(pieces)
        if rows.shape[0] > max_tokens:
            rows = rows[torch.randperm(rows.shape[0], generator=generator)[:max_tokens]]
        inputs[name] = rows
    return inputs
