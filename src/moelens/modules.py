"""Helpers over torch module trees that several parts of moelens share."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def evaluating(*models: nn.Module) -> Iterator[None]:
    """``models`` in eval mode (no dropout, no router jitter) inside the block; each module's own
    ``training`` flag is restored after (``model.train(mode)`` would set every submodule alike)."""
    modes = [(module, module.training) for model in models for module in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def takes_keyword(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward accepts the keyword ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # no signature to read: assume it does, as transformers models do
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def names_keyword(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names the keyword ``name`` itself (not only through ``**kwargs``)."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # no signature to read: assume it does
        return True


def enclosing(name: str, blocks: Iterable[str]) -> str | None:
    """The module name among ``blocks`` that module ``name`` sits inside (strictly below it), or None."""
    return next((block for block in blocks if name.startswith(block + ".")), None)


#: The child holding a module's moelens.compress LoRA adapters (`moelens.compress.lora.LoRAHost`).
LORA_ADAPTERS = "lora"


def first_parameter(module: nn.Module) -> str | None:
    """The name of the first parameter of ``module``'s forward (``input_ids`` for a transformers model), or None.

    Read off the class's forward: a wrapped module's instance forward is nnsight's, which takes ``self`` too."""
    names = _parameter_names(type(module).forward)
    return names[1] if len(names) > 1 else None


def instance_name(module: nn.Module) -> str:
    """What ``module``'s forward calls its instance: its first parameter, ``self`` as a rule."""
    names = _parameter_names(type(module).forward)
    return names[0] if names else "self"


def _parameter_names(forward: Any) -> tuple[str, ...]:
    """The parameter names of a class forward, instance first (``()`` where it has no signature to read)."""
    try:
        return _read_parameter_names(forward)
    except TypeError:  # a forward that cannot be a cache key
        return _read_parameter_names.__wrapped__(forward)


@functools.cache
def _read_parameter_names(forward: Any) -> tuple[str, ...]:
    """`_parameter_names`, read once a forward: a trace asks them of its model every time, and reading a signature
    through transformers' decorators takes some 16 us."""
    try:
        return tuple(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # no signature to read
        return ()


def called_attribute(module: nn.Module, op: str) -> str | None:
    """The attribute of ``module`` that the op ``op`` of its forward calls, as nnsight names such a call after the
    instance the forward calls it on (``self.gate(x)``: ``self_gate_0``; ``s.gate(x)`` in a forward that calls its
    instance ``s``: ``s_gate_0``), or None where ``op`` is no such call."""
    named = re.fullmatch(rf"{re.escape(instance_name(module))}_(\w+?)_\d+", op)
    return named.group(1) if named else None


def has_lora_adapters(module: nn.Module) -> bool:
    """Whether ``module`` carries moelens.compress LoRA adapters: its weights then read as the
    parameters plus the adapters' product, not as the parameters alone."""
    return LORA_ADAPTERS in module._modules


def is_adapter_layer(module: Any) -> bool:
    """A PEFT tuner layer (LoRA, ...): it stands where a module was and wraps it as its ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def is_parameter_adapter(module: Any) -> bool:
    """A PEFT adapter layer on one parameter of the module it wraps (LoRA's ``ParamWrapper``: ``target_parameters``,
    or from peft 0.22 a ``target_modules`` naming fused experts' or a router's projections): its forward calls its
    ``base_layer``'s own forward, with the parameter read as the base weight plus the adapters' product."""
    return is_adapter_layer(module) and isinstance(getattr(module, "parameter_name", None), str)


def padding_position_id(model: nn.Module) -> int | None:
    """The padding id a model counts its tokens' positions past, where it counts them itself from the padding in
    its input ids (RoBERTa and its kin, Kosmos-2's text model, I-BERT ...: real tokens from ``padding_idx + 1``),
    else None. Positions counted from 0 and given to such a model would move every token. Told by the module doing
    it: one with a ``padding_idx`` whose forward calls transformers' ``create_position_ids_from_input_ids``."""
    padded = (module for module in model.modules() if isinstance(getattr(module, "padding_idx", None), int))
    return next((module.padding_idx for module in padded if _counts_positions_from_padding(type(module))), None)


@functools.cache
def _counts_positions_from_padding(module_class: type) -> bool:
    code = getattr(inspect.unwrap(module_class.forward), "__code__", None)
    return code is not None and "create_position_ids_from_input_ids" in code.co_names


def _offload_hooks(modules: Iterable[nn.Module]) -> Iterator[Any]:
    """accelerate's hooks on ``modules`` that offload their weights (load them into the module for each forward)."""
    for module in modules:
        hook = getattr(module, "_hf_hook", None)
        for each in getattr(hook, "hooks", (hook,)):  # accelerate's SequentialHook holds several
            if getattr(each, "offload", False) and getattr(each, "weights_map", None) is not None:
                yield each


def disk_offloaded(modules: Iterable[nn.Module]) -> bool:
    """Whether accelerate loads the weights of one of ``modules`` from disk each time it runs (``device_map`` with
    ``"disk"``, ``disk_offload``): the offload folder's index lists the keys under the hook's prefix. (Weights
    offloaded to the CPU, ``cpu_offload``, stay in the process.)"""
    for hook in _offload_hooks(modules):
        weights = hook.weights_map  # a PrefixedDataset over an OffloadedWeightsLoader (or a plain dict)
        loader, prefix = getattr(weights, "dataset", weights), getattr(weights, "prefix", "")
        if any(key.startswith(prefix) for key in getattr(loader, "index", None) or ()):
            return True
    return False


def loaded_tensor(root: nn.Module, value: Any) -> Any:
    """``value``, a parameter or buffer of a module in ``root``; where it is on the meta device because accelerate
    offloads it (a ``device_map`` with CPU or disk offload, ``cpu_offload``, ``offload_buffers=True``: it is loaded
    only while its module runs), the tensor accelerate's hook loads for that module's forward."""
    if not isinstance(value, torch.Tensor) or not value.is_meta:
        return value
    for module in root.modules():
        for name, tensor in itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if tensor is value:
                for hook in _offload_hooks([module]):
                    try:
                        return hook.weights_map[name]
                    except KeyError:
                        continue
                return value
    return value


def offloaded_to(modules: Iterable[nn.Module]) -> torch.device | None:
    """The device accelerate moves the offloaded weights of one of ``modules`` to for each forward, where that is
    not the CPU keeping them (a forward then runs on a copy), else None."""
    for hook in _offload_hooks(modules):
        device = hook.execution_device
        if device is not None and torch.device(device).type != "cpu":
            return torch.device(device)
    return None


def is_modules_to_save(module: Any) -> bool:
    """A PEFT ``modules_to_save`` wrapper (``ModulesToSaveWrapper``): it stands where a module was and holds the
    frozen original as ``original_module`` (which no longer runs) beside the trainable copies, one per adapter, in
    its ``modules_to_save`` (the active one runs). Duck-typed: peft is optional."""
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.Module
    )


#: Packages whose own hooks change nothing a module computes: transformers' output capturing, nnsight's, and
#: moelens' (a block's note of gathered calls, the recorders of compress's calibration, shard_experts' guard and
#: run counting).
OWN_HOOKS = ("transformers.", "nnsight.", "moelens.")


#: accelerate's hooks that only move tensors between devices (what ``device_map`` dispatch adds to every module).
DEVICE_HOOKS = ("AlignDevicesHook",)


def foreign_hooks(module: nn.Module, pre: bool = True) -> list[Any]:
    """The forward hooks (and, with ``pre``, forward pre-hooks) on ``module`` that none of transformers, nnsight
    and moelens put there (`OWN_HOOKS`): the user's (or another library's), which may change what the module
    computes; and an accelerate ``ModelHook`` other than its device moves (``module._hf_hook``, which wraps the
    forward)."""
    foreign = _not_own([*module._forward_hooks.values(), *(module._forward_pre_hooks.values() if pre else ())])
    accelerate_hook = getattr(module, "_hf_hook", None)
    parts = getattr(accelerate_hook, "hooks", (accelerate_hook,))  # a SequentialHook holds several
    if accelerate_hook is not None and any(type(part).__name__ not in DEVICE_HOOKS for part in parts):
        foreign.append(accelerate_hook)
    return foreign


def foreign_global_hooks() -> list[Any]:
    """The forward (pre-)hooks registered for every module (``torch.nn.modules.module.register_module_forward_hook``)
    that none of transformers, nnsight and moelens put there."""
    from torch.nn.modules import module as torch_module

    return _not_own([*torch_module._global_forward_hooks.values(), *torch_module._global_forward_pre_hooks.values()])


def _not_own(hooks: list[Any]) -> list[Any]:
    """``hooks`` less those of the packages of `OWN_HOOKS`: a function, a callable object (its class's module) or a
    ``functools.partial`` of one of theirs."""
    def module_of(hook: Any) -> str:
        while isinstance(hook, functools.partial):
            hook = hook.func
        return str(getattr(hook, "__module__", "") or "")

    return [hook for hook in hooks if not module_of(hook).startswith(OWN_HOOKS)]


def hook_name(hook: Any) -> str:
    """A hook in words for an error: its function's name, or its class's (an accelerate ModelHook)."""
    return getattr(hook, "__name__", None) or f"a {type(hook).__name__}"


def device_of(module: nn.Module) -> torch.device:
    """Where ``module`` runs: the device of its first parameter or buffer (the CPU for a module with neither)."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def on_accelerator(module: nn.Module) -> bool:
    """Whether ``module``'s weights sit on an accelerator (not the CPU, not meta): where its ops run a device's
    kernels, which fail otherwise than torch's CPU ones (a device-side assert) or take branches of their own."""
    return device_of(module).type not in ("cpu", "meta")


def cpu_float_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` on the CPU, its floating-point parameters and buffers in float32 (what
    ``copy.deepcopy(module).float().cpu()`` gives), each tensor copied straight to the CPU: a model on an
    accelerator never needs room there for a second copy of itself."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        copied = tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else tensor.dtype, copy=True)
        memo[id(tensor)] = nn.Parameter(copied, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copied
    return copy.deepcopy(module, memo).cpu()  # .cpu(): a tensor registered by no module's parameters() / buffers()


def unloaded_weights(module: nn.Module) -> str | None:
    """``module``'s weights on the meta device (offloaded by a device_map, or made under ``init_empty_weights``),
    named for an error ("a.weight, b.bias and 4 more"); None when every weight is loaded."""
    unloaded = [name for name, tensor in (*module.named_parameters(), *module.named_buffers()) if tensor.is_meta]
    if not unloaded:
        return None
    return ", ".join(unloaded[:3]) + (f" and {len(unloaded) - 3} more" if len(unloaded) > 3 else "")


def config_of(model: Any) -> Any:
    """The config of a transformers model (or of a wrapped one's model), or None."""
    module = getattr(model, "_module", model)
    return getattr(module, "config", None)


def text_config(model: Any) -> Any:
    """The config of the model's text decoder (a composite model's ``text_config``), or None."""
    config = config_of(model)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size(model: Any) -> int | None:
    """The number of token ids the model embeds: its text config's ``vocab_size`` (``unpadded_vocab_size`` where
    it keeps one, as inkling does: the rows past it pad the embedding, and its forward cuts its logits there),
    capped by the rows of a transformers model's input embedding; None for a model with neither (see
    `embedding_rows`)."""
    config = text_config(model)
    sizes = [size for size in (getattr(config, "vocab_size", None), getattr(config, "unpadded_vocab_size", None))
             if isinstance(size, int) and size > 0]
    module = getattr(model, "_module", model)
    try:
        embedding = module.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # no transformers model
        embedding = None
    if isinstance(embedding, nn.Embedding):
        sizes.append(embedding.num_embeddings)
    return min(sizes) if sizes else None


def embedding_rows(model: Any) -> int | None:
    """The rows of a model's first ``nn.Embedding`` (a plain torch model's token embedding, most
    likely), or None: the token ids to draw from when `vocab_size` knows nothing."""
    module = getattr(model, "_module", model)
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None
