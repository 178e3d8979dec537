"""The errors for a model moelens cannot run as it is (read by `moelens.model` as it wraps and before each run).

Compiled modules, weights not loaded (on meta), weights of a dtype the experts implementation cannot run, a top_k
past the block's experts; and whether accelerate places or offloads the model.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch

from ..components import Moe
from ..components.implementations import unsupported_dtypes
from ..errors import FamilyError, MoelensError
from ..modules import disk_offloaded
from ..scalars import as_int


def _offloaded_by_accelerate(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model: a ``device_map``, or an offload hook (``_hf_hook``) on one of its modules."""
    return bool(getattr(model, "hf_device_map", None)) or any(
        getattr(module, "_hf_hook", None) is not None for module in model.modules())


#: The class name of what ``torch.compile(module)`` returns (the module it compiled is its ``_orig_mod``).
OPTIMIZED = "OptimizedModule"


#: Why a compiled model is refused.
COMPILED = ("moelens reads values inside the MoE blocks' forwards, rewritten by nnsight, which torch's compiler "
            "(dynamo) cannot trace: the traces would fail inside torch.")


def compile_refusal(envoy: str) -> str:
    """The refusal of ``envoy.compile()`` (``"model"``, a block's path): torch's ``module.compile()``, in place, of a
    module holding MoE blocks leaves a model neither traces nor plain calls can run."""
    return (f"{envoy}.compile() would compile the transformers module in place, after which neither the model's traces "
            f"nor its plain calls run. {COMPILED} Compile a model moelens never wrapped: wrap a copy, "
            "moelens.wrap(copy.deepcopy(hf_model)), to keep the original compilable.")


def _impossible_top_k(moe: Moe, changed: bool = False) -> MoelensError | None:
    """The refusal of a block that routes each token to more experts than it has (or to a negative number), else None:
    its router's ``topk`` fails in every forward with torch's "selected index k out of range", which names neither.
    ``changed``: found after a forward failed, so set on the module since wrapping (wrap refuses such a config)."""
    family = moe.family
    try:
        experts, k = (as_int(family.resolve(reference, moe._module)) for reference in (family.num_experts, family.top_k))
    except FamilyError:  # an entry that cannot read them: its error comes where they are read
        return None
    if experts is None or k is None or 0 <= k <= experts:
        return None
    fix = f"top_k at most {experts}" if experts > 0 else "at least one expert, and top_k at most that number"
    fix = (f"Set the block's {family.top_k} back to at most {experts}." if changed else
           f"Fix the model's config ({fix}) before building the model.")
    return MoelensError(
        f"the {family.name} block {moe.path.removeprefix('model.')} routes each token to its top_k={k} experts, but "
        f"it has {experts} (num_experts): its router cannot pick them, and every forward would fail. {fix}"
    )


#: The way out of `_dtype_refusal` for a model that runs already (a trace).
SWITCH_IMPLEMENTATION = 'switch with model.set_experts_implementation("batched_mm") (or "eager")'


def _dtype_refusal(path: str, experts: torch.nn.Module, implementation: str,
                   switch: str = 'pass "batched_mm" or "eager"') -> MoelensError | None:
    """The error for ``experts`` holding weights ``implementation`` cannot run (float64 under grouped_mm: its first
    forward fails with torch's own error), or None; ``switch`` says how to choose another implementation."""
    bad = unsupported_dtypes(implementation, (parameter.dtype for parameter in experts.parameters(recurse=False)))
    if not bad:
        return None
    return MoelensError(
        f"{path}'s experts hold {', '.join(bad)} weights, which torch's {implementation} does not run (float32, "
        f"bfloat16 and float16 only): {switch}, or cast the model to float32 (model.float())."
    )


def _refuse_compiled(modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Raise a `MoelensError` for a module compiled in place (``module.compile()``), by ``torch.compile`` (a
    compiled module put in the model), or whose forward was (``module.forward = torch.compile(module.forward)``, as
    transformers' docs show: the trace failed inside torch's compiler on nnsight's instrumented ops) among
    ``modules``."""
    for name, module in modules:
        forward = module.__dict__.get("forward")
        how = ("compiled (module.compile())" if getattr(module, "_compiled_call_impl", None) is not None else
               "compiled by torch.compile" if type(module).__name__ == OPTIMIZED else
               "run by a compiled forward (module.forward = torch.compile(...))"
               if getattr(forward, "_torchdynamo_orig_callable", None) is not None
               and not getattr(forward, "_torchdynamo_disable", False) else None)  # torch.compiler.disable's: runs
        if how is not None:
            fix = (f"put back the module it compiled (model.{name} = model.{name}._orig_mod)" if how.endswith(
                "torch.compile") and name else "load or copy the model again")
            raise MoelensError(f"{name or 'the model'} ({type(module).__name__}) is {how}: {fix} and wrap it "
                               f"uncompiled. {COMPILED}")


def _disk_offloaded(model: torch.nn.Module) -> bool:
    """Whether accelerate loads some of ``model``'s weights from disk as the modules holding them run: a
    ``device_map`` placing modules on ``"disk"``, or `disk_offloaded` hooks (weights offloaded to the CPU scan)."""
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and "disk" in device_map.values() or disk_offloaded(model.modules())


def _unloaded_refusal(model: torch.nn.Module) -> MoelensError | None:
    """The `MoelensError` for a run (not a ``model.scan``, whose fake tensors need no weights) of a model with
    weights or buffers that are not loaded: on the meta device, with no accelerate hooks to bring them in. Such a run
    computes nothing, or fails inside torch ("Cannot copy out of meta tensor", "Tensor.item() cannot be called on meta
    tensors", a device mismatch): a model built on meta, one loaded only in part, or one whose state dict was loaded
    with ``assign=True`` but whose non-persistent buffers (a rotary embedding's ``inv_freq``) stayed on meta.

    A walk over every tensor of the model (about 250 us for 77 of them): called before a run only where the first
    weight is on meta, else after a run failed."""
    unloaded = [name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
                if tensor.is_meta]
    if not unloaded or torch._guards.detect_fake_mode() is not None or _offloaded_by_accelerate(model):
        return None
    return MoelensError(
        f"{len(unloaded)} of the model's weights and buffers are not loaded (on the meta device: "
        f"{', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''}), so a run computes nothing; load the model "
        "with from_pretrained, or build it under accelerate's init_empty_weights (which keeps buffers real) before "
        "load_state_dict(..., assign=True), and wrap that model; or use model.scan(...) for shapes alone."
    )
