"""Bindings: where a served value lives in the run, and what a write to it must look like.

A `Binding` says where a value lives in the run (an nnsight location such as
``model.layers.0.mlp.gate.source.F_linear_0.output``), how to take the tensor out of what is
served there (``args[2]`` of the experts call, with `argument`; an element of a module's output
tuple, with `output_of`) and put one back, how many trailing feature dims it has, and how a
write is checked (`write_checks`). Components build one per value; `served` reads and writes
through them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..errors import FamilyError, ValueUnavailable

#: What a write must look like.
FLOAT, INDEX = "float", "index"

#: Which infinities a float write may hold (`Binding.infinities`): none, -inf only (a logit the
#: router then never picks), or both (what a router ranks; logits its sigmoid scores saturate).
FINITE, MINUS_INF, ANY_INF = "finite", "-inf", "any"


@dataclass(frozen=True)
class Binding:
    """Where one value lives in the run and how to read and write it there.

    Attributes:
        location: The nnsight location served at (``"<path>.output"``, an op's
            ``".source.<op>.output"``, a module's ``".input"``).
        features: Number of trailing feature dims of the value (1 for ``[T, E]``).
        pick: Takes the value's tensor out of what the location serves.
        put: Returns what the location serves with the value's tensor replaced.
        kind: `FLOAT` or `INDEX`: what a write is checked against.
        upper: For `INDEX` values, returns the exclusive upper bound of a valid index, asked at each
            write (a block whose experts were pruned after wrapping has fewer).
        infinities: For `FLOAT` values, the infinities a write may hold (`FINITE`,
            `MINUS_INF`, `ANY_INF`), or a function that returns them, asked at each write (a router whose score
            function can be switched after wrapping); anything else would make the model compute NaN or inf.
        min_finite: The fewest entries per token a write may leave above -inf (what a
            router ranks must leave it enough experts to pick).
        prepare: Called (inside the trace) before the location is requested, e.g.
            to drill into the experts implementation so its ops are served; what it
            returns is handed to `to_view` / `from_view`.
        summed_into: For per-slot values the model adds up over a token's slots and casts (``[..., k, D]``),
            returns the dtype of that sum (the block's hidden states), asked at each write: a write whose sum
            overflows it is refused. None where nothing is summed.
        to_view / from_view: Turn the picked tensor into the token-major layout
            that is served, and a token-major tensor back into the model's layout
            (activations the model keeps sorted by expert). None when the picked
            tensor is token-major already.
        named_by: The family entry's settings that name the location, for the error when what is served there
            is no tensor of values per token (None: the settings that name most locations, logits_op and Combine).
    """

    location: str
    features: int
    pick: Callable[[Any], torch.Tensor] = lambda raw: raw
    put: Callable[[Any, torch.Tensor], Any] = lambda raw, tensor: tensor
    kind: str = FLOAT
    upper: Callable[[], int] | None = None
    infinities: str | Callable[[], str] = FINITE
    min_finite: int = 0
    prepare: Callable[[], Any] | None = None
    summed_into: Callable[[], torch.dtype | None] | None = None
    to_view: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    from_view: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    named_by: str | None = None

    def allowed_infinities(self) -> str:
        """The infinities a write may hold now (`infinities`, asked where it is a function)."""
        return self.infinities() if callable(self.infinities) else self.infinities

    def token_major(self, picked: torch.Tensor, context: Any) -> torch.Tensor:
        """The picked tensor in token-major ``[T, ...]`` order."""
        if self.to_view is None:
            return picked
        with kept_for_backward():
            return self.to_view(picked, context)

    def model_layout(self, token_major: torch.Tensor, context: Any) -> torch.Tensor:
        """A token-major tensor in the layout the model keeps at the location."""
        if self.from_view is None:
            return token_major
        with kept_for_backward():
            return self.from_view(token_major, context)


def copied(tensor: torch.Tensor, context: Any) -> torch.Tensor:
    """`Binding.to_view` / `from_view` for a value the model edits in place after it is read: the reader keeps a
    copy, and the model gets its own (so neither sees the other's edits)."""
    return tensor.clone()


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """What autograd keeps of a saved tensor: its data, without its own graph. The tensor itself would hold its
    own grad_fn, a cycle through torch's C++ graph that Python's garbage collector cannot see (an op that saves
    its output, a softmax, kept its whole forward graph alive)."""
    return tensor.detach()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def kept_for_backward() -> contextlib.AbstractContextManager:
    """Autograd keeps what moelens' own ops (a re-sort, a score) save for backward as it is.

    Inside a layer under activation checkpointing torch would count those among the layer's
    tensors to recompute, and its recomputation (the model's forward alone) does not make them:
    the backward would fail with a CheckpointError. What is kept is the data (`_kept`); autograd
    links it to its graph again when the backward unpacks it, so gradients, second ones included,
    are those of the plain ops.
    """
    if not torch.is_grad_enabled():  # nothing is saved for backward
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_kept, _same)


def normal_tensors() -> contextlib.AbstractContextManager:
    """Out of ``torch.inference_mode`` where a trace runs under it, else nothing to enter.

    What moelens computes from values read there (a score, derived routing) is then a normal tensor, as
    the values served there are: one the user may edit (and autograd use) after the trace.
    """
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def output_of(index: int | None, setting: str | None = None, fix: str | None = None) -> tuple[Callable, Callable]:
    """``pick`` / ``put`` for a module output that may be a tuple (hidden first). ``setting``: the family entry's
    setting that names ``index`` (default: ``Combine(output_index=...)``), and ``fix``: what to do when the
    module's output has no such element (default: name the block's hidden states)."""
    if index is None:
        return (lambda raw: raw), (lambda raw, tensor: tensor)
    setting = setting or f"Combine(output_index={index})"

    def pick(raw: Any) -> Any:
        if isinstance(raw, Mapping):
            raise FamilyError(dict_output(raw))
        if not isinstance(raw, (tuple, list)):  # raw[index] of a tensor would be its first row
            raise FamilyError(
                f"the module returned a {type(raw).__name__}, not a tuple, but its family entry reads element "
                f"{index} of its output ({setting}); "
                + (fix or "describe a block that returns one tensor with Combine(output_index=None).")
            )
        if not -len(raw) <= index < len(raw):
            raise FamilyError(
                f"the module returned a tuple of {len(raw)} elements, but its family entry reads element {index} of "
                f"its output ({setting}); " + (fix or "name the element that holds the block's hidden states.")
            )
        return raw[index]

    def put(raw: Any, tensor: Any) -> Any:
        elements = (*raw[:index], tensor, *raw[index + 1 :])
        return type(raw)(*elements) if hasattr(raw, "_fields") else type(raw)(elements)  # a NamedTuple takes fields

    return pick, put


def dict_output(raw: Mapping) -> str:
    """The refusal of a module output that is a dict (or a ModelOutput): moelens reads a tensor, or one element
    of a tuple (`output_of`), never a key."""
    return (f"the module returned a {type(raw).__name__} (keys {list(raw)[:6]}), and moelens reads a block's output "
            "as a tensor or as one element of a tuple (Combine(output_index=...)), not by key: make the block's "
            "forward return its hidden states alone or in a tuple (a subclass whose forward returns "
            "tuple(output.values()) will do).")


#: What to do where the experts call lacks the argument moelens reads (`argument`).
EXPERTS_SIGNATURE = ("call it with that argument (experts: experts(hidden_states, top_k_index, top_k_weights), "
                     "transformers' signature).")


def argument(position: int, keyword: str | None = None, *, error: type[Exception] = ValueUnavailable,
             advice: str = EXPERTS_SIGNATURE) -> tuple[Callable, Callable]:
    """``pick`` / ``put`` for one argument of a call's ``(args, kwargs)``: at ``position``, or passed as ``keyword``.
    ``error`` and ``advice``: what is raised, saying what to do, where the call passes no such argument."""

    def pick(raw: Any) -> torch.Tensor:
        args, kwargs = raw
        if len(args) > position:
            return args[position]
        if keyword in kwargs:
            return kwargs[keyword]
        named = (f" (passed under a keyword of its own? moelens reads it at position {position} or as {keyword}=)"
                 if keyword and kwargs else "")
        raise error(
            f"the call passed {len(args)} positional arguments and {sorted(kwargs) or 'no keywords'}, but moelens "
            f"reads its argument {position}" + (f" ({keyword})" if keyword else "") + f"{named}: {advice}"
        )

    def put(raw: Any, tensor: torch.Tensor) -> Any:
        args, kwargs = raw
        if len(args) <= position and keyword in kwargs:
            return args, {**kwargs, keyword: tensor}
        return (*args[:position], tensor, *args[position + 1 :]), kwargs

    return pick, put
