"""The moelens error for a run that failed with torch's or nnsight's bare error (read by `moelens.model`'s run).

Each function takes the error (or the model and its inputs) and returns the `MoelensError` / `ValueUnavailable`
saying which value or input was at fault and what to do, or None where the failure was another.
"""

from __future__ import annotations

import functools
import os
import re
import traceback
import types
from typing import TYPE_CHECKING

import nnsight
import torch
from nnsight.intervention.interleaver import OutOfOrderError

from ..components import served
from ..errors import MoelensError, ValueUnavailable
from ..modules import on_accelerator
from .inputs import _input_ids, _token_ids

if TYPE_CHECKING:
    from ..model import MoeModelMixin


def _meta_inputs_refusal(batched: tuple[tuple, dict]) -> MoelensError | None:
    """The error for a run of the model's inputs ``batched`` that failed on inputs on the meta device (torch's "Cannot
    copy out of meta tensor" names none), else None."""
    args, kwargs = batched
    named = [*((f"argument {index}", value) for index, value in enumerate(args)), *kwargs.items()]
    meta = [name for name, value in named if isinstance(value, torch.Tensor) and value.is_meta]
    if not meta:
        return None
    return MoelensError(
        f"the trace's input {', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device, which holds "
        "shapes but no values, so the model cannot run on it: pass inputs with values on the model's device "
        "(model.scan(...) infers shapes from meta inputs)."
    )


def _embeddings_on_accelerator(module: torch.nn.Module) -> bool:
    """Whether the model's input embeddings sit on a device other than the CPU (and off meta), where an embedding
    lookup of an id out of range fails a device-side assert instead of raising torch's IndexError."""
    try:
        embeddings = module.get_input_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return isinstance(embeddings, torch.nn.Module) and on_accelerator(embeddings)


def _ids_past_vocabulary(model: "MoeModelMixin", batched: tuple[tuple, dict]) -> MoelensError | None:
    """The error for a run of ``model`` that failed on token ids outside the model's input embeddings (torch's bare
    "index out of range in self"), or None when the input_ids of ``batched`` are all in range (the failure was
    another)."""
    module = model._module
    ids = _input_ids(module, batched)
    embeddings = "the model's input embeddings"
    try:
        rows = module.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError, TypeError):  # no transformers model: a plain one's only nn.Embedding
        found = [child for child in module.modules() if isinstance(child, torch.nn.Embedding)]
        if len(found) != 1:  # none, or several (positions too): which embeds the ids is not known
            return None
        rows, embeddings = found[0].num_embeddings, "the model's one nn.Embedding (taken for its token embedding)"
    if not _token_ids(ids):
        return None
    past = (ids < 0) | (ids >= rows)
    outside = ids[past]
    if not outside.numel():
        return None
    mask = batched[1].get("attention_mask")
    pad_id = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if (pad_id is not None and bool((outside == pad_id).all()) and isinstance(mask, torch.Tensor)
            and mask.shape == ids.shape and not (past & mask.bool()).any()):
        return MoelensError(  # the padding alone: nnsight pads with the tokenizer's pad token
            f"the padding's token id {int(outside[0])} is outside the model's input embeddings ({rows} rows: ids 0 "
            f"to {rows - 1}); every real token is in range. The batch is padded with the tokenizer's pad token: give "
            "it one the model embeds (model.tokenizer.pad_token = model.tokenizer.eos_token), or resize the "
            "embeddings (model._module.resize_token_embeddings(len(model.tokenizer)))."
        )
    return MoelensError(
        f"token id {int(outside[0])} is outside {embeddings} ({rows} rows: ids 0 to {rows - 1}; "
        f"{outside.numel()} of the {ids.numel()} ids of the batch are outside): the ids, and a text's tokens, must "
        "come from this model's own tokenizer (the one saved with it)."
    )


def _in_reentrant_checkpoint_backward(error: BaseException) -> bool:
    """Whether ``error`` was raised in the backward of torch's reentrant checkpoint (``CheckpointFunction``)."""
    from torch.utils.checkpoint import CheckpointFunction

    backward = CheckpointFunction.backward.__code__
    return any(frame.f_code is backward for frame, _ in traceback.walk_tb(error.__traceback__))


def _derived_gradient_refusal(error: OutOfOrderError, handed_back: served.HandedBack) -> ValueUnavailable | None:
    """The error for the ``.grad`` of a value moelens derived that no output depends on (`router_probs`), read in a
    ``with loss.backward():`` block: its hook never fires, and nnsight says the model ran past a tensor id
    ("'139...512.grad.i0' was requested ..."). None for another tensor."""
    requested = re.match(r"'(\d+)\.grad\b", str(error))
    derived = handed_back.gradientless.get(int(requested.group(1))) if requested else None
    return None if derived is None or derived[0]() is None else ValueUnavailable(derived[1])


def _no_gradient_refusal(error: RuntimeError, handed_back: served.HandedBack,
                         model: torch.nn.Module) -> ValueUnavailable | None:
    """The error for torch's refusal to hook a value moelens served that has no gradient, read as ``.grad`` in a
    ``with loss.backward():`` block ("cannot register a hook on a tensor that doesn't require gradient", naming no
    value): which value, why it has none, what to do. None for another error, or a tensor moelens did not serve in
    this run (``handed_back`` lists the values it served)."""
    if str(error) != "cannot register a hook on a tensor that doesn't require gradient":
        return None
    hook = torch.Tensor.register_hook.__code__
    hooked = next((frame.f_locals.get("self") for frame, _ in traceback.walk_tb(error.__traceback__)
                   if frame.f_code is hook), None)
    if hooked is None:
        return None
    derived = handed_back.gradientless.get(id(hooked))
    if derived is not None and derived[0]() is hooked:
        return ValueUnavailable(derived[1])
    noted = handed_back.views.get(id(hooked))
    if noted is not None and noted[0]() is hooked:
        where = noted[2]
    else:  # a view of the model's own tensor (batched_mm's activations), named when served
        named = handed_back.named.get(id(hooked))
        if named is None or named[0]() is not hooked:
            return None
        where = named[1]
    if not hooked.is_floating_point():
        return ValueUnavailable(
            f"{where}.grad: {where} holds {hooked.dtype} values, and integers have no gradient; read the gradient of a "
            "float value before it instead (router_logits.grad for the routing)."
        )
    checkpointed = _reentrant_checkpointing(model)
    reentrant = (", or it was computed in a layer under reentrant activation checkpointing (use_reentrant=True, "
                 "torch's default when it is not given), which runs the forward with autograd off") if checkpointed else ""
    return ValueUnavailable(
        f"{where}.grad: {where} has no gradient: no parameter or input upstream of it requires grad (a model frozen "
        f"with requires_grad_(False)){reentrant}, so autograd computes none for it, as in plain torch. Before the "
        "trace, unfreeze parameters it is computed from (for the routing values, the router's: "
        "moe.router._module.requires_grad_(True)), or make the input embeddings' output require grad "
        "(hf_model.enable_input_require_grads())" + ("; or checkpoint with use_reentrant=False" if checkpointed else "")
        + "."
    )


def _failing_frame(error: BaseException, model: torch.nn.Module) -> types.FrameType | None:
    """The frame of the code of a module of ``model`` that raised ``error``: the innermost frame of its traceback
    whose ``self`` is one of ``model``'s modules, where only torch's and nnsight's code (the op, its dispatch,
    nnsight's hooks on it) ran below it. None where other code ran there: the body of a trace or scan, run from a hook
    inside a module's forward (a tensor it builds is no fault of the module's), moelens' own, or a plain function."""
    modules = {id(module) for module in model.modules()}
    machinery = tuple(os.path.join(package.__path__[0], "") for package in (torch, nnsight))
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in modules:
            found = frame
        elif not frame.f_code.co_filename.startswith(machinery):
            found = None
    return found


def _real_buffers_refusal(model: torch.nn.Module, failing: types.FrameType | None) -> MoelensError | None:
    """The error for a ``model.scan`` whose fake tensors met two devices (torch's FakeTensorDeviceMismatchError,
    naming neither tensor) in the code of a module (``failing``, its frame: `_failing_frame`) that computes with a
    real buffer, its own (a router's ``e_score_correction_bias``) or one it was handed (hy_v3's block hands its router
    its bias), where the model's weights are on the meta device: built under accelerate's ``init_empty_weights()``,
    which keeps buffers where they are made. Names those and the other real buffers the model keeps in its state (a
    rotary embedding's non-persistent ``inv_freq`` is moved to its input's device, and scans). None where no weight is
    on meta, or the failing code computes with no real buffer (the scan body's own tensor, a real weight): torch's
    error, naming neither tensor either, tells of the mismatch then."""
    if failing is None or not any(parameter.is_meta for parameter in model.parameters()):
        return None
    kept = model.state_dict().keys()
    real = {id(buffer): name for name, buffer in model.named_buffers() if not buffer.is_meta}
    module = failing.f_locals["self"]
    used = {id(buffer) for buffer in module.buffers(recurse=False)} | {id(value) for value in failing.f_locals.values()}
    if not used & real.keys():
        return None
    named = [name for key, name in real.items() if name in kept or key in used]
    devices = ", ".join(sorted({str(model.get_buffer(name).device) for name in named}))
    return MoelensError(
        f"model.scan: the model's weights are on the meta device, but {len(named)} of its buffers are real tensors on "
        f"{devices} ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''}), which scan's fake tensors cannot "
        "compute with beside the meta weights (torch: \"found at least two devices\"). Build the model under "
        "accelerate's init_empty_weights(include_buffers=True), which puts buffers on meta too, or move them there "
        "(hf_model.to('meta'))."
    )


def _reentrant_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` runs under reentrant activation checkpointing, which runs its forward with
    autograd off: transformers' ``gradient_checkpointing`` in training mode with torch's checkpoint not told
    ``use_reentrant=False``, or torch's ``checkpoint_wrapper`` with ``CheckpointImpl.REENTRANT``."""
    for module in model.modules():
        if type(module).__name__ == "CheckpointWrapper":
            if getattr(getattr(module, "checkpoint_impl", None), "name", None) == "REENTRANT":
                return True
        elif getattr(module, "gradient_checkpointing", None) is True and module.training:
            function = getattr(module, "_gradient_checkpointing_func", None)
            if not (isinstance(function, functools.partial) and function.keywords.get("use_reentrant") is False):
                return True
    return False
