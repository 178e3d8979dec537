"""`wrap`: an nnsight model whose MoE blocks are `Moe` components.

`wrap` makes the MoE blocks `discover` finds `Moe` envoys and the dense MLPs of the same
decoder stack `Mlp` envoys, and binds the standard names: ``model.layers`` is the decoder layer
list, ``model.layers[i].mlp`` the block whatever the family calls it, and ``model.moes`` the MoE
components in layer order. Native module paths keep working. `moelens.load` (in `loading`) loads
a checkpoint and wraps it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any, Iterable, NoReturn

import nnsight
import torch
from jaxtyping import Int
from nnsight import NNsight, TransformersModel
from nnsight.intervention.envoy import Envoy, traceable
from nnsight.intervention.interleaver import OutOfOrderError
from nnsight.modeling import processing
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, is_fake
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from transformers import GenerationConfig

from .components import Mlp, Moe, served
from .components.base import (INSTRUMENTED, INSTRUMENTED_BLOCKS, StandardNames, envoy_at, guard_part, refuse_replaced,
                              with_suggestion)
from .components.gathered import drop_gathered_notes
from .components.implementations import IMPLEMENTATION_CALL, check_known, is_dispatching, known, runs_torch_a2a
from .components.layer_list import BlockHolder, BlocklessLayer, LayerList, MoeList, RenamedBlockLayer
from .components.moe import value_names
from .components.run_owner import MoeInterleaver
from .discovery import Structure, block_parts, discover, paths_above, registered_since
from .errors import ArgumentError, MoelensError, OrderError, ValueUnavailable, described, warn
from .families import Family, registry
from .families.tomoe import converted as tomoe_converted
from .modules import first_parameter, is_adapter_layer, is_parameter_adapter, padding_position_id, takes_keyword
from .adapters import in_force
from .scalars import check_flag
from .top_k import undo_in_copy
from .wrapping.envoys import (_bind_standard_names, _block_holders, _blockless_layers, _expert_parallel_envoy,
                              _from_root, _refuse_block_classes, _renamed_blocks)
from .wrapping.generation import _generating, _refuse_no_generate, generation_setting, rows_per_prompt
from .wrapping.inputs import (EMBEDDED_ID_DTYPES, _UNBATCHED_REMEDY, _cached_tokens, _embedded_pad_id, _given_cache,
                              _input_problem, _invoke_ids, _invoke_input_names, _invoke_inputs, _is_text,
                              _left_padded, _modality_inputs, _model_inputs, _refuse_misfit_mask,
                              _refuse_dropped_keywords, _refuse_shapeless_ids, _refuse_unusable_ids, _rows_of,
                              _token_ids, _unbatched_inputs, _unsplittable, _without_remote, unembeddable_ids)
from .wrapping.instance_state import _drop_stale_nnsight_state, _instance_state, _restore_instance_state
from .wrapping.instrument import _instrument
from .wrapping.pipeline import (FEATURE_SETTINGS, FEATURE_TASK, GENERATION_SETTINGS, PIPELINE_ATTRIBUTES, TOKENIZED,
                                _no_pipeline_task_complaint, _real_device_first, tokenizer_settings)
from .wrapping.refusals import (COMPILED, OPTIMIZED, SWITCH_IMPLEMENTATION, _disk_offloaded, _dtype_refusal,
                                _impossible_top_k, _offloaded_by_accelerate, _refuse_compiled, _unloaded_refusal,
                                compile_refusal)
from .wrapping.run_errors import (_derived_gradient_refusal, _embeddings_on_accelerator, _failing_frame,
                                  _ids_past_vocabulary, _in_reentrant_checkpoint_backward, _meta_inputs_refusal,
                                  _no_gradient_refusal, _real_buffers_refusal)
from .wrapping.walk import _around_blocks, _present, _walk_steps


def _returning_wrapper(name: str) -> Any:
    """The wrapped model's ``name`` (``eval``, ``half``, ...): the transformers model's, in place, returning the
    wrapped model (torch's returns the module, so ``model = model.eval()`` would drop moelens), as nnsight's ``cpu``
    and ``cuda`` do."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        getattr(self._module, name)(*args, **kwargs)
        return self

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (f"``model._module.{name}(...)`` (torch's, in place), returning this wrapped model, so that "
                      f"``model = model.{name}()`` keeps moelens.")
    return method


class MoeModelMixin(StandardNames):
    """What moelens adds to an nnsight model: the MoE components and the family."""

    _structure: Structure
    #: The nnsight keyword arguments `wrap` was given (a deep copy is wrapped with them again).
    _wrap_options: dict[str, Any]
    #: The module paths each trace checks hold nothing compiled since wrapping (`_around_blocks`), as `_present`
    #: walks them (`_walk_steps`).
    _watched: tuple[tuple[str, int, str], ...]
    #: ``(path, length, {id(layer): position})`` of each module list holding MoE blocks (or dense MLPs), as wrapped
    #: (`_refuse_changed_layers`; the positions of a ModuleList's layers only), and how `_present` walks to them.
    _layer_lists: tuple[tuple[str, int, dict[int, int]], ...]
    _layer_walk: tuple[tuple[str, int, str], ...]
    #: nnsight's batcher, landing moelens' swaps on what the model holds then (`served.Rebase`).
    _batcher_class = served.MoeBatcher

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            if name == "layers" and self._structure.layers is None:
                raise AttributeError(
                    f"{type(self).__name__} has no 'layers': moelens found no list of decoder layers holding this "
                    "model's MoE blocks or dense MLPs, or several and none of them the text decoder's; reach modules "
                    "by their native paths (print(model) shows them)."
                ) from None
            raise with_suggestion(error, name, ("moes", "layers", "family", "save_all", "set_experts_implementation")) from None

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """The transformers model's ``save_pretrained``; warns where the model carries nnsight edits
        (``model.edit(inplace=True)``), which live in the wrapper, not in the weights, and are not saved, and where
        ``moelens.compress.tomoe`` converted blocks, which the dense model's config does not describe."""
        edits = getattr(self, "_edits", None)
        if edits:
            warn(
                f"save_pretrained: the model carries {len(edits)} nnsight edit(s) (model.edit()), which are not in its "
                "weights and are not saved: the checkpoint computes the unedited model. Make lasting changes through "
                "moe.params() (weight edits), or call model.clear_edits() to silence this.",
            )
        converted = [moe.path for moe in self.moes if moe.family is not None and tomoe_converted(moe.family)]
        if converted:
            warn(
                f"save_pretrained: {len(converted)} block{'s were' if len(converted) != 1 else ' was'} converted by "
                f"moelens.compress.tomoe ({converted[0]}{', ...' * (len(converted) > 1)}), and the model's config is "
                "still the dense model's: the checkpoint does not load back as this model (from_pretrained rebuilds "
                "the dense layers with random weights; moelens.load refuses it). Save the model whole with "
                "torch.save(model._module, path) and load it with torch.load(path, weights_only=False) "
                "(docs/compress.md).",
            )
        return self._module.save_pretrained(*args, **kwargs)

    eval, train, requires_grad_ = map(_returning_wrapper, ("eval", "train", "requires_grad_"))
    half, float, bfloat16, double = map(_returning_wrapper, ("half", "float", "bfloat16", "double"))
    to = _returning_wrapper("to")  # torch's forms: nnsight's Envoy.to takes one positional device alone

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused (`compile_refusal`)."""
        raise MoelensError(compile_refusal("model"))

    @property
    def moes(self) -> MoeList:
        """The MoE components, in layer order (indexed by block: `MoeList`)."""
        moes = MoeList(envoy_at(self, name) for name in self._structure.moe_blocks)
        if not moes:  # why, where a family registered since the wrap describes its blocks (asked on an error only)
            moes.why_empty = lambda: registered_since(self._module)
        return moes

    @property
    def family(self) -> Family | None:
        """The family of this model's MoE blocks (None for a model moelens does not know)."""
        return self._structure.family

    @property
    def device(self) -> torch.device | None:
        """Where nnsight moves a trace's inputs: its first parameter's device, or None (inputs left where they are)
        when that parameter is offloaded (on meta) by accelerate (a ``device_map``, or ``cpu_offload`` /
        ``disk_offload``, which set no map), whose hooks move each module's inputs to the device it runs on."""
        device = super().device
        if device is not None and device.type == "meta" and _offloaded_by_accelerate(self._module):
            return None
        return device

    def set_experts_implementation(self, implementation: str | dict[str, str]) -> None:
        """Run every MoE block's experts with ``implementation`` (``"grouped_mm"``, ``"batched_mm"``,
        ``"eager"``, or another transformers knows; a dict of sub-config names, ``""`` for the
        model's own config, gives one per sub-model, as transformers' switch takes it).

        transformers' own switch first; then the config of each decorated experts module it left on
        another implementation is set directly: transformers switches a class only when the file
        defining it contains ``@use_experts_implementation`` (not a subclass defined in a notebook or a
        script of one's own), and has no switch for a plain torch model or the blocks `moelens.compress`
        made. ``"grouped_mm"`` for experts holding float64 weights (which torch's grouped_mm cannot run) is
        refused before anything is switched.
        """
        module = self._module
        interleaver = self.interleaver
        if getattr(interleaver, "interleaving", False) and len(getattr(interleaver, "mediators", ())) > 1:
            raise MoelensError(
                f"set_experts_implementation({implementation!r}) in a run of {len(interleaver.mediators)} invokes: it "
                "takes effect where this invoke's code reaches it, while the other invokes wait on values of the "
                "implementation that ran (their per-slot reads would be served from another implementation's ops). "
                "Switch between traces, or in a trace or generate of one invoke (between generation steps)."
            )
        config = getattr(module, "config", None)
        wanted = implementation if isinstance(implementation, dict) else {"": implementation}
        for name in wanted.values():
            check_known(name)
        subs = {key: getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}}
        _check_sub_configs(subs, wanted)
        if not any(is_dispatching(moe.experts._module) for moe in self.moes):  # before anything is switched
            raise MoelensError(
                f"{type(module).__name__} has no MoE block whose experts run a pluggable implementation (their own "
                "loop, as llama4's and dbrx's, or no MoE block at all), so set_experts_implementation has nothing to "
                "switch; its experts run as they are."
            )
        for moe in self.moes:
            experts = moe.experts._module
            if is_dispatching(experts):
                refusal = _dtype_refusal(moe.path, experts, _wanted_for(experts, implementation, subs, wanted) or "")
                if refusal is not None:
                    raise refusal
        if hasattr(module, "set_experts_implementation"):
            try:
                module.set_experts_implementation(implementation)
            except ValueError as error:  # transformers' refusal of a class its source check does not pass
                if "does not support setting experts implementation" not in str(error):
                    raise
        for moe in self.moes:
            experts = moe.experts._module
            if not is_dispatching(experts):
                continue
            name = _wanted_for(experts, implementation, subs, wanted)
            if name is not None and moe.experts_implementation != name:
                if name not in known(fp8=False):
                    raise MoelensError(
                        f"{moe.path}'s experts cannot be switched to {name!r}: it is transformers' implementation for "
                        "FP8 weights, which transformers picks when it loads them; these experts hold float weights."
                    )
                experts.config._experts_implementation = name
        self._drop_instrumented_implementations()

    def _drop_instrumented_implementations(self) -> None:
        """Forget nnsight's instrumented copies of the experts implementation calls made in the running trace (a
        switch between generation steps). nnsight keeps the copy it built at a run's first drill into a call (for a
        per-slot value) and runs it in place of the live function for the rest of the run: the experts would go on
        running the implementation switched from, read as the one switched to. Without it they run the live one,
        which the next drill instruments."""
        sourced = getattr(self.interleaver, "sourced", None)
        if sourced:
            for moe in self.moes:
                sourced.pop(f"{moe.experts.path}.source.{IMPLEMENTATION_CALL}", None)

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's run of the model with the trace's interventions (one run of each EP group the experts are
        sharded over, `parallel.runs`); then a check that no value moelens served as a copy was edited in place
        after it was handed back to the model (`served.HandedBack`). The run belongs to this thread (`run_owner`)
        until it is over: another thread's run is refused before it touches anything."""
        interleaver = self.interleaver
        if not isinstance(interleaver, MoeInterleaver):  # one of the user's (wrap(interleaver=...))
            return self._run(fn, *args, **kwargs)
        interleaver.claim(own_workers=kwargs.get("batcher") is not None)  # a trace's run, its invokes queued
        interleaver.running += 1
        try:
            if interleaver.running == 1:  # the outermost run of this model: another wrapper's must not be going on
                interleaver.hold_blocks()
            return self._run(fn, *args, **kwargs)
        finally:
            interleaver.running -= 1
            if not interleaver.running:
                interleaver.release()

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`interleave`, in the thread that owns the run."""
        watched = list(_present(self._module, self._watched))
        _refuse_compiled(watched)  # compiled since wrapping, or a compiled one put in
        self._refuse_changed_layers(dict(_present(self._module, self._layer_walk)))
        first = next(self._module.parameters(), None)
        if first is not None and first.is_meta and (refusal := _unloaded_refusal(self._module)) is not None:
            raise refusal  # a model all on meta runs without an error, into meta values
        if _embeddings_on_accelerator(self._module):  # checked before the run: there an id out of range fails a
            refusal = _ids_past_vocabulary(self, _model_inputs(fn, args, kwargs))  # device-side assert, which
            if refusal is not None:  # leaves the device unusable for the rest of the process
                raise refusal
        handed_back = served.HandedBack(generating=_generating(fn), inference=torch.is_inference_mode_enabled())
        interleaver = self.interleaver
        outer = served.RUNS.get(interleaver)
        ep_runs = self._ep_runs(watched)
        begun = getattr(kwargs.get("batcher"), "runs_begun", ())  # a trace's run, counted as it began
        for runs in ep_runs:
            runs.trace_begins(counted=any(runs is other for other in begun))
        served.RUNS[interleaver] = handed_back
        try:
            result = super().interleave(fn, *args, **kwargs)
        except IndexError as error:  # torch's embedding names neither the id nor the vocabulary
            refusal = _ids_past_vocabulary(self, _model_inputs(fn, args, kwargs))
            if refusal is None:
                raise
            raise refusal from error
        except OutOfOrderError as error:  # nnsight's, naming a tensor id only
            derived = _derived_gradient_refusal(error, handed_back)
            if derived is not None:
                raise derived from error
            if not _in_reentrant_checkpoint_backward(error):
                raise
            raise MoelensError(
                "a backward inside the trace ran through reentrant activation checkpointing (use_reentrant=True, "
                "torch's default when it is not given), which nnsight cannot follow: torch's checkpoint reads the .grad "
                "of the layer inputs it recomputes, and nnsight takes that read for a request of the trace that came "
                "too late. Save the output and call backward() after the trace, or checkpoint with use_reentrant=False "
                "(model.activation_checkpointing_enable({'use_reentrant': False}))."
            ) from error
        except GuardOnDataDependentSymNode as error:  # model.scan through a forward whose shapes follow the values
            refusal = self._unscannable(error)
            if refusal is None:  # not in an experts loop (the scan body's own `if x.sum() > 0:`): torch names the line
                raise
            raise refusal from error
        except RuntimeError as error:  # torch's grouped_mm on float64 weights names neither the block nor the way out
            no_gradient = _no_gradient_refusal(error, handed_back, self._module)  # torch names no value
            if no_gradient is not None:
                raise no_gradient from error
            if isinstance(error, FakeTensorDeviceMismatchError) and (
                    real := _real_buffers_refusal(self._module, _failing_frame(error, self._module))):
                raise real from error  # model.scan of weights on meta beside real buffers: torch names neither
            moe = self._failing_experts(error)  # or a model loaded in part, or inputs, on meta: torch names neither
            refusal = _unloaded_refusal(self._module) or _meta_inputs_refusal(_model_inputs(fn, args, kwargs)) or (
                None if moe is None else _dtype_refusal(moe.path, moe.experts._module, moe.experts_implementation,
                                                        SWITCH_IMPLEMENTATION)
            ) or next(filter(None, (_impossible_top_k(block, changed=True) for block in self.moes)), None)
            if refusal is None:
                raise
            raise refusal from error
        finally:
            for runs in ep_runs:
                runs.trace_ends()
            if outer is None:
                del served.RUNS[interleaver]
            else:
                served.RUNS[interleaver] = outer
        handed_back.check()
        return result

    def _refuse_changed_layers(self, live: dict[str, torch.nn.Module]) -> None:
        """Refuse a run of a model whose layer lists gained or lost layers since wrapping, or hold them in another
        order (``live``: path -> module,
        `_present`): `moes` and `layers` name the blocks as they were, so a block's values would come from another
        layer's (an inserted one shifts them) or the new layers' blocks be left out, silently."""
        for path, length, wrapped in self._layer_lists:
            layers = live.get(path)
            if layers is not None and len(layers) != length:
                raise MoelensError(
                    f"the model's {path} holds {len(layers)} layers, and moelens wrapped it with {length} (layers "
                    "added or removed since moelens.wrap): model.moes and model.layers name the blocks as they were, "
                    "so their values would be another layer's. Wrap the model again: moelens.wrap(model._module, ...)."
                )
            if layers is None or not wrapped:
                continue
            # a layer moved to another position (layers reordered, or one put in twice): nnsight serves a module's
            # values by identity, so model.layers[i] would read the layer now running at another position. A new
            # module (a replaced layer, a checkpoint_wrapper around one) is left to the read's own refusal.
            moved = next(((i, wrapped[id(layer)]) for i, layer in enumerate(layers)
                          if wrapped.get(id(layer), i) != i), None)
            if moved is not None:
                raise MoelensError(
                    f"the model's {path} holds its layers in another order than moelens wrapped them in (position "
                    f"{moved[0]} now holds the layer wrapped at position {moved[1]}): "
                    "model.moes and model.layers name the blocks by where they were, so their values would be another "
                    "layer's. Wrap the model again: moelens.wrap(model._module, ...)."
                )

    def _failing_experts(self, error: BaseException, innermost: bool = False) -> Moe | None:
        """The block whose experts module's forward ``error`` was raised in (found in its traceback), or None. With
        ``innermost``, only where the code that raised it (the last frame outside torch) is that forward's: nnsight
        runs a trace body inside the call of the module whose value it reads, so a body's own failing line (an
        ``if`` on a fake tensor in model.scan) has the experts' frames above it."""
        experts = {id(moe.experts._module): moe for moe in self.moes}
        frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        if innermost:
            frames = [frame for frame in frames if not frame.f_code.co_filename.startswith(TORCH_SOURCE)][-1:]
        return next((experts[id(owner)] for frame in frames if id(owner := frame.f_locals.get("self")) in experts), None)

    def _unscannable(self, error: BaseException) -> MoelensError | None:
        """The error for a ``model.scan`` whose fake tensors met an experts loop that runs each expert on the tokens
        that picked it (transformers' eager implementation, dbrx's own), found in ``error``'s traceback; None where
        the guard failed elsewhere."""
        moe = self._failing_experts(error, innermost=True)
        if moe is None:
            return None
        way_out = ("scan under another implementation: model.set_experts_implementation('batched_mm')"
                   if is_dispatching(moe.experts._module) else "run a real trace on a short input instead")
        return MoelensError(
            f"model.scan: {moe.path}'s experts run a loop that depends on the values (each expert on the tokens that "
            f"picked it), which scan's fake tensors have none of; {way_out}."
        )

    def _ep_runs(self, watched: list[tuple[str, torch.nn.Module]] | None = None) -> list[Any]:
        """The `parallel.runs.Runs` of each EP group this model's experts are sharded over (none unsharded)."""
        if _RUNS_MODULE not in sys.modules:  # no `Runs` exists before its module is imported (by sharding, or by
            return []  # unpickling one): none to look for; the walk costs each trace twice (batcher and run)
        watched = _present(self._module, self._watched) if watched is None else watched
        found = {id(runs): runs for _, module in watched if (runs := module.__dict__.get("_ep_runs")) is not None}
        return list(found.values())

    def _begin_runs(self) -> tuple[Any, ...]:
        """Count a run of each EP group the experts are sharded over, as a trace begins (before its body runs:
        a body that raises on some ranks only, before the model runs, still counts its run there)."""
        begun = tuple(self._ep_runs())
        for runs in begun:
            runs.start()
        return begun

    def save_all(
        self, values: str | list[str] | None = None, *, strict: bool = False, moes: list[Moe] | None = None
    ) -> dict[int | str, dict[str, torch.Tensor]]:
        """Inside a trace: save every value of every MoE block (or of ``moes``), in the right order.

        Blocks that run only on some tokens (ernie4_5_vl_moe's ``vision_moe``: image
        tokens; see `Moe.runs_only_on`) are left out unless ``moes`` names them.

        ``moes``: any iterable of this model's blocks, each once (a lone block is refused); they are read, and
        keyed, in model order (the order of ``model.moes``), whatever order they come in.

        Returns layer index -> (value name -> saved tensor); keyed by block path
        instead when a layer holds several MoE blocks. See `Moe.save_all`.
        """
        if not served.trace_running("save_all"):
            raise ValueUnavailable(
                "model.save_all: a model's values exist only while it runs; call it inside a trace "
                "(with model.trace(inputs): ..., or model.generate)."
            )
        check_flag("strict", strict, ArgumentError)
        refuse_replaced(self, [block.path for block in self.moes if not isinstance(block, Moe)], "model.save_all",
                        "it is no MoE block to read", MoelensError)  # (a module given to a block's envoy)
        blocks = [moe for moe in self.moes if not moe.runs_only_on] if moes is None else self._given_blocks(moes)
        if values is not None and not isinstance(values, str):
            values = value_names(values)  # once: each block reads the same names (a generator would serve the first)
        layers = [moe.layer for moe in blocks]
        keys = layers if len(set(layers)) == len(layers) else [moe.path for moe in blocks]
        saved, empty = {}, {}
        for key, moe in zip(keys, blocks):
            try:
                block_values, left_out = moe._saved_values(values, strict)
                saved[key] = nnsight.save(block_values)  # each block's dict too, as moe.save_all returns it
            except OrderError as error:  # `Moe._run_past`'s, whose advice is the block's own save_all
                name = getattr(error, "unreached", None)
                if name is None:
                    raise
                raise moe._order_error(name, by="model.save_all", step_passed=getattr(error, "step_passed", False)) \
                    from None
            if left_out is not None and not saved[key]:
                empty[moe.path] = left_out
        if empty:
            first, reason = next(iter(empty.items()))
            others = f" (and {len(empty) - 1} more block{'s' * (len(empty) > 2)})" if len(empty) > 1 else ""
            warn(f"model.save_all() read none of the values asked of {first}{others}: {reason} Pass strict=True to "
                 "raise this instead.")
        return nnsight.save(saved)

    def _given_blocks(self, moes: Any) -> list[Moe]:
        """The MoE blocks of save_all's ``moes=`` (any iterable of this model's blocks, each once), in model order
        (the order of ``model.moes``, which is the order they run in): values are served in run order, so a block given
        before one that runs earlier would find the model already past it."""
        if isinstance(moes, Moe):  # iterable (over its children), but one block, not a collection of them
            listed = [index for index, moe in enumerate(self.moes) if moe.path == moes.path]
            spelled = f"model.moes[{listed[0]}]" if listed else "block"
            raise MoelensError(
                f"save_all(moes=...) takes a list of MoE blocks, got the one block {moes.path}: pass it in a list, "
                f"moes=[{spelled}], or call the block's own save_all, {spelled}.save_all()."
            )
        if not isinstance(moes, Iterable) or isinstance(moes, (torch.Tensor, str, bytes)):
            raise MoelensError(f"save_all(moes=...) takes a list of MoE blocks of this model (model.moes[1:3]); got "
                               f"{_described(moes)}.")
        blocks = list(moes)  # once: a generator would give its blocks to the first pass only
        for block in blocks:
            if not isinstance(block, Moe) or block.interleaver is not self.interleaver:
                raise MoelensError(
                    f"save_all(moes=...) takes MoE blocks of this model (model.moes[i], model.layers[i].mlp on an MoE "
                    f"layer); got {_described(block)}."
                )
        paths = [block.path for block in blocks]
        repeated = next((path for path in paths if paths.count(path) > 1), None)
        if repeated is not None:
            raise MoelensError(
                f"save_all(moes=...) got the block {repeated} more than once; a block's values are read once per "
                "trace: pass each block once."
            )
        position = {moe.path: index for index, moe in enumerate(self.moes)}
        return sorted(blocks, key=lambda block: position[block.path])

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        return _rows_of(inputs, kwargs, super()._batch_size(*inputs, **kwargs))

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's batching of the invokes' inputs into the model's, refusing a trace with no input at all and
        input ids the model could not embed (`_refuse_unusable_ids`)."""
        self._refuse_running_no_forward(fn)
        extra = getattr(self.interleaver.batcher, "extra_kwargs", {})  # keywords nnsight counts no rows of
        if not invokes and not any(isinstance(value, (torch.Tensor, Mapping, list, tuple)) for value in extra.values()):
            raise MoelensError(  # nnsight's batching fails on it with a bare IndexError
                "the trace has no input: its invokes are all empty (an empty tracer.invoke() sees the rows the other "
                "invokes give). Give the trace an input, model.trace(prompt), or an invoke one, tracer.invoke(prompt)."
            )
        for inputs, kwargs in invokes:
            _refuse_shapeless_ids(_invoke_ids(inputs, kwargs))
            if any(isinstance(given, GenerationConfig) for given in inputs):  # nnsight takes it for a prompt's part
                raise MoelensError(
                    "model.generate(prompt, GenerationConfig(...)): nnsight takes positional inputs for the prompt, "
                    "so the model would generate with its own settings, ignoring the config; pass it by name, "
                    "model.generate(prompt, generation_config=config)."
                )
        texts = [any(_is_text(value) for value in inputs) for inputs, kwargs in invokes]
        from_text = any(texts)
        given = set(extra).union(*(kwargs for inputs, kwargs in invokes))
        keywords = [*((name, value, "trace") for name, value in extra.items()),
                    *((name, value, "text" if text else "ids")
                      for (inputs, kwargs), text in zip(invokes, texts) for name, value in kwargs.items())]
        _refuse_dropped_keywords(self._module, keywords, _generating(fn), self._text_only())
        batched = super()._batch(invokes, fn)
        cached = bool(_cached_tokens(self._module, {**batched[1], **extra})) and not _generating(fn)
        mask = batched[1].get("attention_mask")
        unpadded = cached and isinstance(mask, torch.Tensor) and not is_fake(mask) and bool(mask.all())
        if cached and "attention_mask" not in given and unpadded:
            # built for the new tokens alone, with nothing to mask: run them as transformers runs ids over a cache
            # given no mask (the cached tokens attended); a mask of the new tokens alone would leave the cache out
            batched = (batched[0], {name: value for name, value in batched[1].items() if name != "attention_mask"})
        batched = _refuse_unusable_ids(self._module, batched, from_text, _generating(fn), extra,
                                       mask_built="attention_mask" not in given)
        if (cached and "position_ids" in batched[1] and "position_ids" not in given
                and isinstance(mask, torch.Tensor) and not unpadded):
            raise MoelensError(  # nnsight counted the padded rows' positions from their own mask: from 0
                "invokes of different lengths over a key-value cache (past_key_values, or cache): the new tokens are "
                "left-padded, and their position_ids are counted from 0 in each row, not after the cached tokens. "
                "Give invokes of one length, or pass position_ids (and attention_mask over the cache and the new "
                "tokens) to model.trace(...)."
            )
        return batched

    def _text_only(self) -> bool:
        """Whether the model takes no inputs but text and token ids (no processor: see `MoeTransformersModel`)."""
        return True

    def _refuse_running_no_forward(self, fn: Any) -> None:
        """Refuse a trace (``fn``: the model's call, not its ``generate``) of a model class with no forward of its
        own, such as Qwen3-Omni's whole model, which only generates through its thinker and talker: torch's
        placeholder forward would fail on the inputs with a bare TypeError."""
        model = self._module
        if type(model).forward is not torch.nn.Module.forward or _generating(fn):
            return
        holders = [name for name, child in model.named_children() if type(child).forward is not torch.nn.Module.forward
                   and any(path.startswith(f"{name}.") for path in self._structure.moe_blocks)]
        remedy = (f"wrap its {holders[0]}, which holds the MoE blocks and runs them: "
                  f"moelens.wrap(hf_model.{holders[0]}, tokenizer=...)" if holders else "wrap the part of it that runs")
        raise MoelensError(
            f"{type(model).__name__} has no forward of its own (it runs only through its parts' generate), so a trace "
            f"cannot run it: {remedy}."
        )

    def __deepcopy__(self, memo: dict) -> "MoeTransformersModel | MoeNNsight":
        """A fresh wrap of a deep copy of the model, with the same tokenizer and wrap options.

        nnsight's own deep copy of a wrapped model would still hand its values to this
        model's tracer (its instrumented sources point back here): a copy could not serve
        a value. nnsight edits (``model.edit()``'s, on this model or the copy it returned) are not copied: warned of.
        A copy made while a `moelens.set_top_k` setting of this model is held routes at the k from before it: warned of.
        """
        if edits := getattr(self, "_edits", None):
            warn(f"deepcopy: the model carries {len(edits)} nnsight edit(s) (model.edit()), which are not copied: the "
                 "copy traces the unedited model. Make them again on the copy (with copy.edit(inplace=True): ...).")
        module = copy.deepcopy(self._module, memo)
        if undone := undo_in_copy(memo):
            warn(f"deepcopy: moelens.set_top_k({', '.join(map(str, undone))}) is held on (part of) this model; the copy "
                 "routes at the k from before it (the setting's restore could not reach the copy): set it on the copy to "
                 "route it so.")
        drop_gathered_notes(module)  # this model's hooks, copied with the modules: the copy's wrap adds its own
        return wrap(module, tokenizer=getattr(self, "tokenizer", None), **self._wrap_options)


#: Keywords of a causal LM's forward that hold one row per row of the batch, which nnsight's text-generation pipeline
#: cannot batch beside the text of several invokes (`_refuse_ignored_text_keywords`).
ROW_KEYWORDS = ("labels",)


class MoeTransformersModel(MoeModelMixin, TransformersModel):
    """A transformers model with a tokenizer (string prompts, padding, generation), with moelens components."""

    #: Rows the model runs per prompt row while it generates: transformers repeats each row for
    #: beams / returned sequences (read by the token views, `moelens.components.tokens.current_rows`).
    _rows_per_prompt: int = 1

    def _text_only(self) -> bool:
        """Whether the model has a tokenizer alone: no processor, feature extractor or image processor, which may
        take raw audio or image data."""
        return not any(getattr(self, name, None) is not None
                       for name in ("processor", "feature_extractor", "image_processor"))

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """The rows of an invoke's inputs, after refusing, on a model with a tokenizer alone, an input that is no
        prompt, token ids, tensor or tokenizer output (`_input_problem`: transformers' text pipeline or numpy failed
        on it with "can only concatenate str" or a casting error)."""
        rows = super()._batch_size(*inputs, **kwargs) if inputs and inputs[0] is None else None
        if rows:  # trace(None, input_ids=...): the keywords hold the inputs (counted once)
            return rows
        problem = _input_problem(inputs[0]) if inputs and self._text_only() else None
        if problem is not None:
            raise MoelensError(
                f"a trace's input was {problem}: a model wrapped with a tokenizer takes text (a str or a list of "
                "them), token ids (a list of ints, rows of them, an input_ids tensor or an integer numpy array), or "
                "the tokenizer's output (model.trace(**inputs)). Read a file's text first (Path.read_text()); turn "
                "an array of text into a list (array.tolist())."
            )
        return super()._batch_size(*inputs, **kwargs) if rows is None else rows

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's batching of the invokes' inputs, after refusing inputs of other modalities than text (images,
        audio) in one of several invokes (nnsight batches invokes from text and token ids alone, and refused them with
        "Can't batch these inputs; pass text or token ids", advice that drops the images)."""
        text_only = self._text_only()
        for index, (inputs, kwargs) in enumerate(invokes):
            modality = _modality_inputs(_invoke_input_names(inputs, kwargs))
            if modality and len(invokes) > 1:
                raise MoelensError(
                    "a model wrapped with a tokenizer batches several invokes from text and token ids alone, and "
                    f"invoke {index} of {len(invokes)} got more. {_unsplittable(modality)}"
                )
            unbatched = _unbatched_inputs(inputs, kwargs)
            if unbatched and len(invokes) > 1:  # nnsight's bare "Can't batch these inputs; pass text or token ids"
                raise MoelensError(
                    "a model wrapped with a tokenizer batches several invokes from text, token ids and the per-row "
                    "inputs nnsight pads (attention_mask, token_type_ids, position_ids, labels and the like), and "
                    f"invoke {index} of {len(invokes)} got {', '.join(unbatched)}, which it cannot split into rows. "
                    f"{_UNBATCHED_REMEDY}"
                )
            ids = _invoke_ids(inputs, kwargs)
            if isinstance(ids, torch.Tensor) and ids.dtype not in EMBEDDED_ID_DTYPES and len(invokes) > 1:
                raise unembeddable_ids(ids, f"the input_ids of the trace's invoke {index}")  # nnsight cannot batch them
            if isinstance(ids, torch.Tensor) and ids.dim() > 2 or isinstance(ids, (list, tuple)) and any(
                    isinstance(row, (list, tuple)) and not row for row in ids):
                shape = (f"of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                         else f"a list holding an empty row {ids!r:.60}")
                raise MoelensError(
                    f"a trace's token ids were {shape}: a model wrapped with a tokenizer takes ids [batch, seq] (or one "
                    "row [seq]), every row holding at least one token."
                )
        invokes, forward = self._forward_keywords(invokes) if text_only else (invokes, {})
        if forward:  # laid over the batch as the trace's own keywords are, where the batch's checks see them
            self.interleaver.batcher.extra_kwargs.update(forward)
        batched = super()._batch(invokes, fn)
        if "position_ids" in batched[1] and self._positions_beside_modalities(invokes):
            # nnsight counts a left-padded text batch's positions from its mask, for a text-only batch alone (its
            # check sees the tokenizer's encoding, not the image keywords beside it): with images the model places
            # its tokens itself (Qwen-VL's and GLM-4V's M-RoPE positions over the image grid), as transformers does.
            batched = (batched[0], {name: value for name, value in batched[1].items() if name != "position_ids"})
        return batched

    def _positions_beside_modalities(self, invokes: list) -> bool:
        """Whether the batch's ``position_ids`` are nnsight's, not the user's, beside image or audio inputs (of an
        invoke or of the trace's own keywords)."""
        extra = getattr(self.interleaver.batcher, "extra_kwargs", {})
        given = {name for inputs, kwargs in invokes for name in _invoke_inputs(inputs, kwargs)} | set(extra)
        names = [name for inputs, kwargs in [*invokes, ((), extra)] for name in _invoke_input_names(inputs, kwargs)]
        return "position_ids" not in given and bool(_modality_inputs(names))

    def _forward_keywords(self, invokes: list) -> tuple[list, dict[str, Any]]:
        """The invokes with their keywords beside a text prompt sorted, and the ones that go to the forward, on a
        model wrapped with a tokenizer alone and nnsight's feature-extraction pipeline (one that cannot generate,
        `wrap`): that pipeline takes ``truncation`` and ``tokenize_kwargs`` alone and dropped any other keyword
        silently. The tokenizer's settings (``max_length``, ``padding`` ...) go to it, as ``tokenize_kwargs``; the
        rest (``labels``, ``output_hidden_states`` ...) to the forward, as a causal LM's pipeline passes them on.
        Token ids and encodings keep theirs (nnsight passes them); so does a model with a processor."""
        if self.task != FEATURE_TASK:
            self._refuse_ignored_text_keywords(invokes)
            return invokes, {}
        settings = tokenizer_settings(type(self.tokenizer))
        kept, forward = [], {}
        for inputs, kwargs in invokes:
            if not any(_is_text(value) for value in inputs):
                kept.append((inputs, kwargs))
                continue
            made = [name for name in TOKENIZED if name in kwargs]
            if made:
                raise MoelensError(
                    f"{', '.join(made)} beside a text prompt: the tokenizer makes the text's inputs (and pairs a second "
                    "text with it in one call), so what is given beside it would replace them or be dropped; pass the "
                    "tokenizer's output instead, model.trace(**tokenizer(texts, return_tensors='pt', padding=True)) "
                    "(tokenizer(questions, contexts, ...) for pairs), with your own inputs in it."
                )
            own = {name: value for name, value in kwargs.items() if name in FEATURE_SETTINGS}
            tokenizing = {name: value for name, value in kwargs.items() if name in settings and name not in own}
            if tokenizing:
                own["tokenize_kwargs"] = {**(own.get("tokenize_kwargs") or {}), **tokenizing}
            forward.update({name: value for name, value in kwargs.items()
                            if name not in own and name not in tokenizing})
            kept.append((inputs, own))
        if forward and len(invokes) > 1:
            raise MoelensError(
                f"keywords for the model's forward ({', '.join(sorted(forward))}) beside the text of one of several "
                "invokes: nnsight's batching keeps a keyword for every row, so pass them to model.trace(...) for the "
                "whole batch."
            )
        return kept, forward

    def _refuse_ignored_text_keywords(self, invokes: list) -> None:
        """Refuse, beside a text prompt of a model that generates, what nnsight's text-generation pipeline hands the
        forward, which ignores it: a second text (``text_pair`` ...) and the tokenizer settings the pipeline does not
        take (``pad_to_multiple_of``, ``padding_side`` ...). They were dropped without a word. A tensor with a row for
        each of the batch's (`ROW_KEYWORDS`: ``labels``) beside the text of one of several invokes reached the forward as it was,
        one invoke's rows for the whole batch: torch's shape error in the loss. (Other tensors, ``logits_to_keep``,
        are settings of the whole batch's forward and pass.)"""
        if not any(kwargs for inputs, kwargs in invokes):
            return
        if sum(1 for inputs, kwargs in invokes if _invoke_ids(inputs, kwargs) is not None) > 1:  # invokes with rows
            for inputs, kwargs in invokes:
                rows = sorted(name for name in ROW_KEYWORDS if isinstance(kwargs.get(name), torch.Tensor))
                if rows and any(_is_text(value) or processing.as_chats(value) is not None for value in inputs):
                    raise MoelensError(
                        f"{', '.join(rows)} beside the text of one of several invokes: nnsight's text-generation "
                        "pipeline hands the forward this invoke's tensor as it is, for the whole batch, whose other "
                        "invokes' rows and padding it does not cover (torch's shape error in the loss); give each "
                        f"invoke its token ids, tracer.invoke(model.tokenizer(text, return_tensors='pt')['input_ids'], "
                        f"{rows[0]}=...) (nnsight pads and batches them), or trace the whole batch at once: "
                        f"model.trace(**model.tokenizer(texts, return_tensors='pt', padding=True), {rows[0]}=...)."
                    )
        ignored = (tokenizer_settings(type(self.tokenizer)) - set(GENERATION_SETTINGS) - set(FEATURE_SETTINGS)
                   - set(inspect.signature(self._module.forward).parameters)) | {"text_pair", "text_target",
                                                                               "text_pair_target"}
        for inputs, kwargs in invokes:
            named = sorted(name for name in kwargs if name in ignored)
            if named and any(_is_text(value) for value in inputs):
                raise MoelensError(
                    f"{', '.join(named)} beside a text prompt: a model that generates has its text tokenized by "
                    f"nnsight's text-generation pipeline, which hands the tokenizer {', '.join(GENERATION_SETTINGS)} "
                    "as keywords (its other settings in tokenizer_encode_kwargs={...}), and the model's forward would "
                    "ignore the rest; tokenize the text yourself and pass its output: "
                    f"model.trace(**model.tokenizer(texts, {named[0]}=..., return_tensors='pt'))"
                    + ("" if named[0].startswith("text") else f", or pass tokenizer_encode_kwargs={{'{named[0]}': ...}}")
                    + "."
                )

    def _remote_backend(self, remote: bool | str, *args: Any, **kwargs: Any) -> Any:
        """nnsight's backend for ``remote=`` (a trace's or a session's), refused where nnsight would ship moelens
        itself by value: it does so with every package importable but not installed (a source tree on the path),
        and moelens' run state (a lock, weak references) cannot be pickled."""
        from importlib.metadata import packages_distributions

        if "moelens" not in packages_distributions():
            raise MoelensError(
                f"remote={remote!r}: nnsight's remote path ships the code of every package it finds importable but "
                "not installed, by value, and moelens is not installed here (a source tree on the path), which cannot "
                "be shipped so; install it (pip install -e <the moelens checkout>) and run the trace again."
            )
        return super()._remote_backend(remote, *args, **kwargs)

    def scan(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's ``scan``; refused with the way out for a family whose forward deep-copies its key-value cache
        (`Family.scan_without_cache`): under fake tensors that fails inside torch and can leave the process broken;
        and for experts running ``torch_a2a`` (`moelens.parallel.shard_experts`), before the scan counts a run of the
        EP group: one rank's refused scan used up a run id there alone, and the ranks' later traces paired wrongly."""
        if isinstance(self.interleaver, MoeInterleaver):
            self.interleaver.refuse_nested("model.scan")
        if runs_torch_a2a(self.moes):  # before the scan's batcher counts a run of the EP group (see the docstring)
            from .parallel.experts import SCAN_REFUSAL

            raise MoelensError(SCAN_REFUSAL)
        # merged, then off: any PEFT layer's forward (LoRA Linear as ParamWrapper) unmerges in place
        unmerging = next(((name, module) for name, module in self._module.named_modules() if is_adapter_layer(module)
                          and getattr(module, "disable_adapters", False) and getattr(module, "merged", False)), None)
        if unmerging is not None:
            name, adapted = unmerging
            what = f"{name}'s {adapted.parameter_name}" if is_parameter_adapter(adapted) else name
            raise MoelensError(
                f"model.scan: PEFT merged adapters into {what} (merge_adapter()), which are "
                "off now (disable_adapter()): the next forward takes them out of the weights in place, which under "
                "scan's fake tensors would leave the real weight on the meta device. Scan outside disable_adapter(), "
                "or unmerge the adapters first (peft_model.unmerge_adapter())."
            )
        adapted = next((module for module in self._module.modules() if is_parameter_adapter(module)
                        and in_force(module)), None)
        if adapted is not None:  # torch's fake mode refuses the parametrization's set_ on a real parameter
            name = next(name for name, module in self._module.named_modules() if module is adapted)
            raise MoelensError(
                f"model.scan: {name} is a PEFT parameter adapter ({type(adapted).__name__}: LoRA on "
                f"{adapted.parameter_name}), which puts a parametrization on the module it adapts in each forward; "
                "torch's fake tensors, which scan runs on, cannot take it (scan would fail inside torch). Run a real "
                "trace on a short input instead, or scan the model with the adapters merged: "
                "moelens.wrap(copy.deepcopy(peft_model).merge_and_unload())."
            )
        if _disk_offloaded(self._module):  # torch fails reading them, and logs its own traceback
            raise MoelensError(
                "model.scan: accelerate loads some of this model's weights from disk as each module runs (a device_map "
                "offloading to an offload_folder, or disk_offload), which scan's fake tensors cannot do (torch fails "
                "reading the offloaded storage). Run a real trace on a short input instead, or scan a copy built "
                "without weights: AutoModelForCausalLM.from_config(config) under accelerate's "
                "init_empty_weights(include_buffers=True), wrapped with the tokenizer."
            )
        family = self.family
        if family is not None and family.scan_without_cache and kwargs.get("use_cache") is not False:
            raise MoelensError(
                f"model.scan of this {family.name} model needs use_cache=False: its forward deep-copies the key-value "
                "cache, which scan's fake tensors cannot be (torch fails, and can leave the process unstable); "
                "pass model.scan(..., use_cache=False)."
            )
        for moe in self.moes:
            weight = next(moe.experts._module.parameters(), None)
            if moe.experts_implementation == "grouped_mm" and weight is not None and \
                    weight.device.type in ("cpu", "meta") and weight.dtype != torch.bfloat16:
                where = "CPU" if weight.device.type == "cpu" else "meta device"
                raise MoelensError(
                    f"model.scan: {moe.path}'s experts run grouped_mm, for which torch has no fake kernel in "
                    f"{weight.dtype} on the {where} (scan would fail inside torch); scan under another implementation: "
                    "model.set_experts_implementation('batched_mm')."
                )
        return super().scan(*inputs, **kwargs)

    @traceable
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's ``generate``, telling the token views how many rows each prompt becomes, without
        transformers' compilation of the forward (which a static cache on a GPU turns on by itself)."""
        _refuse_no_generate(self._module)  # torch's bare AttributeError, deep in nnsight
        if isinstance(self.interleaver, MoeInterleaver):  # called during a run, nnsight runs it in it
            self.interleaver.refuse_other_threads()
            self.interleaver.refuse_nested("model.generate")
        if generation_setting(self._module, kwargs, "compile_config") is not None or (
                generation_setting(self._module, kwargs, "disable_compile") is False):
            raise MoelensError(f"generate() with a compile_config or disable_compile=False compiles the forward. {COMPILED} "
                               "Generate without them (moelens passes disable_compile=True).")
        if kwargs.get("generation_config") is not None:  # set there: a keyword beside it is deprecated in transformers
            given = kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
            given.disable_compile = True
            for name in ("num_beams", "num_return_sequences"):  # as transformers fills them, where nnsight looks
                setattr(given, name, generation_setting(self._module, {"generation_config": given}, name))
        else:
            kwargs.setdefault("disable_compile", True)
        self._rows_per_prompt = rows_per_prompt(self._module, kwargs)
        try:
            return super().generate(*inputs, **kwargs)
        finally:
            self._rows_per_prompt = 1


#: Where torch's own Python lies (its frames are passed over to find the code a scan's guard failed in).
TORCH_SOURCE = os.path.dirname(torch.__file__) + os.sep


class MoeNNsight(MoeModelMixin, NNsight):
    """A transformers model without a tokenizer: token-id inputs only, with moelens components.

    Several invokes are batched by left-padding their ``input_ids`` with the
    config's pad token (0 when it has none or the model does not embed it) and masking the padding (a forward
    that takes no ``attention_mask`` batches invokes of one length only).
    """

    def generate(self, *inputs: Any, **kwargs: Any) -> NoReturn:
        """Refused: nnsight traces generation only with a tokenizer (without this, the model's own
        ``generate`` would run untraced and the ``with`` statement fail on the tensor it returns)."""
        _refuse_no_generate(self._module)  # first: with a tokenizer it could not generate either
        raise MoelensError(
            "model.generate: tracing a generation needs a tokenizer, and this model was wrapped without one: "
            "moelens.wrap(model, tokenizer=...), or save the tokenizer files beside the weights for moelens.load. "
            "To generate without tracing, call model._module.generate(...)."
        )

    def scan(self, *inputs: Any, **kwargs: Any) -> NoReturn:
        """Refused: nnsight's ``scan`` (shape inference on fake tensors) comes with a tokenizer's model class."""
        raise MoelensError(
            "model.scan: shape inference needs a model wrapped with a tokenizer, and this one was wrapped without one: "
            "moelens.wrap(model, tokenizer=...), or save the tokenizer files beside the weights for moelens.load; "
            "or run a real trace on a short input."
        )

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        # every invoke's inputs are counted here before `_batch` (and nnsight's count fails on bytes with torch's error)
        self._refuse_other_ids(inputs, kwargs)
        ids = _invoke_ids(inputs, kwargs)
        if _token_ids(ids) and ids.ndim > 2 and first_parameter(self._module) == "input_ids":
            raise MoelensError(f"a model wrapped without a tokenizer takes token ids [batch, seq], and got ids of shape "
                               f"{tuple(ids.shape)}: pass a [batch, seq] tensor (ids.reshape(-1, ids.shape[-1]) for "
                               "rows stacked on more axes).")
        return _rows_of(inputs, kwargs, processing.batch_size(inputs, kwargs))

    def _refuse_other_ids(self, inputs: tuple, kwargs: dict) -> None:
        """Raise a `MoelensError` when an invoke's input_ids (first positional input, or keyword) is no integer tensor:
        torch's embedding would fail on it with its own TypeError or RuntimeError (a dict and text are refused apart)."""
        ids = _invoke_ids(inputs, kwargs)
        if ids is None or isinstance(ids, Mapping) or _is_text(ids) or _token_ids(ids) or \
                first_parameter(self._module) != "input_ids":
            return
        given = f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else described(ids)
        raise MoelensError(
            f"a model wrapped without a tokenizer takes token ids as an integer tensor [batch, seq], and got {given} as "
            "its input_ids: pass torch.tensor([[...]]) (the ids a tokenizer gives), or give it a tokenizer "
            "(moelens.wrap(model, tokenizer=...))."
        )

    def _refuse_one_unbatched_row(self, ids: Any) -> None:
        """Raise a `MoelensError` for the lone invoke's 1-D ids (``ids[0]`` of a batch), which the model would take
        for a batch of one-token rows and fail on deep inside (several invokes batch such rows as rows)."""
        if _token_ids(ids) and ids.ndim == 1 and first_parameter(self._module) == "input_ids":
            raise MoelensError(
                f"a model wrapped without a tokenizer takes token ids [batch, seq], and got one row of {ids.shape[0]} "
                "ids without its batch axis: pass ids[None] (or ids.unsqueeze(0))."
            )

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        self._refuse_running_no_forward(fn)
        invokes = [(inputs, _without_remote(kwargs)) for inputs, kwargs in invokes]
        for inputs, kwargs in invokes:
            if any(_is_text(value) for value in (*inputs, kwargs.get("input_ids"), kwargs.get("text"))):
                raise MoelensError(
                    "this model was wrapped without a tokenizer, so it takes token ids, not text: pass an input_ids "
                    "tensor, or give it a tokenizer (moelens.wrap(model, tokenizer=...), or save the tokenizer "
                    "files beside the weights for moelens.load)."
                )
            if inputs and isinstance(inputs[0], Mapping) and first_parameter(self._module) == "input_ids":
                raise MoelensError(  # the model would take the dict as its input_ids
                    f"a model wrapped without a tokenizer takes its forward's own arguments, and got a "
                    f"{type(inputs[0]).__name__} of inputs (keys {sorted(map(str, inputs[0]))}) where its forward takes "
                    "input_ids: pass it as keywords, model.trace(**inputs) (or tracer.invoke(**inputs)), or wrap the "
                    "model with its tokenizer."
                )
        if len(invokes) <= 1:
            for inputs, kwargs in invokes:
                ids = _invoke_ids(inputs, kwargs)
                self._refuse_one_unbatched_row(ids)
                cache = _given_cache(self._module, kwargs)
                if cache is None:
                    cache = _given_cache(self._module, getattr(self.interleaver.batcher, "extra_kwargs", {}))
                _refuse_misfit_mask(self._module, ids, kwargs.get("attention_mask"), cache, _generating(fn))
            return super()._batch([self._mask_taken(inputs, kwargs) for inputs, kwargs in invokes], fn)
        rows: list[torch.Tensor] = []
        for inputs, kwargs in invokes:
            ids = _invoke_ids(inputs, kwargs)
            others = sorted(set(kwargs) - {"input_ids"})
            if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or len(inputs) > 1 or others:
                given = (f"keyword(s) {others} " + ("beside the ids" if isinstance(ids, torch.Tensor) else "and no ids")
                         if others
                         else f"{len(inputs)} inputs (ids and a {type(inputs[1]).__name__})" if len(inputs) > 1
                         else f"{type(ids).__name__} {ids!r:.60}")
                modality = _modality_inputs(others)
                remedy = (_unsplittable(modality) if modality else _UNBATCHED_REMEDY if _unbatched_inputs((), kwargs)
                          else "Pass settings that hold for the whole batch to model.trace(...) instead, or "
                          "wrap(model, tokenizer=...) for text, padding and masks.")
                raise MoelensError(
                    f"a model wrapped without a tokenizer batches several invokes only from token-id tensors, one "
                    f"per invoke (tracer.invoke(ids)); an invoke got {given}. {remedy}"
                )
            _refuse_shapeless_ids(ids)
            if ids.is_meta:  # one invoke's meta ids reach the model (model.scan runs on them); these are padded here
                raise MoelensError("an invoke's token ids are on the meta device, which holds shapes but no values: "
                                   "the invokes cannot be padded into one batch. Pass ids with values.")
            _refuse_unusable_ids(self._module, ((), {"input_ids": ids}))
            rows.extend(ids.reshape(-1, ids.shape[-1]))
        own_positions = padding_position_id(self._module)
        input_ids, attention_mask = _left_padded(rows, _embedded_pad_id(self._module) if own_positions is None
                                                 else own_positions)
        params = getattr(self.interleaver.batcher, "extra_kwargs", {})  # the trace's own (model.trace(...=...))
        if _cached_tokens(self._module, params):  # a mask and positions of the new tokens alone would leave it out
            missing = [name for name in ("attention_mask", "position_ids")
                       if name not in params and (name == "attention_mask" or takes_keyword(self._module, name))]
            if not attention_mask.all() and missing:
                raise MoelensError(
                    "invokes of different lengths over a key-value cache (past_key_values, or cache) on a model "
                    "wrapped without a tokenizer: moelens left-pads the new tokens, but it cannot know which cached "
                    "positions of each row are padding, so it cannot build their attention_mask and position_ids. "
                    "Give invokes of one length, or pass attention_mask (over the cache and the new tokens) and "
                    f"position_ids to model.trace(...) (not given: {', '.join(missing)})."
                )
            return self._ids_given(input_ids)  # the model's own mask and positions after the cache, or the trace's
        given = {"attention_mask": attention_mask}
        if own_positions is None:  # a model counting positions past its padding id counts them itself
            given["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        taken = {name: value for name, value in given.items() if takes_keyword(self._module, name)}
        inputs, kwargs = self._ids_given(input_ids)
        return self._mask_taken(inputs, kwargs | taken | {"attention_mask": attention_mask})

    def _ids_given(self, input_ids: Int[torch.Tensor, "b w"]) -> tuple[tuple, dict[str, Any]]:
        """The batched ids as the forward takes them: the ``input_ids`` keyword, or its first argument where it has
        another name (``forward(self, tokens)``)."""
        if first_parameter(self._module) in ("input_ids", None) or takes_keyword(self._module, "input_ids"):
            return (), {"input_ids": input_ids}
        return (input_ids,), {}

    def _mask_taken(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """An invoke's inputs for a forward that may take no ``attention_mask``: an all-ones mask
        (nothing to mask) is left out; a mask with padding is refused, since it could not be applied."""
        mask = kwargs.get("attention_mask")
        if mask is None or takes_keyword(self._module, "attention_mask"):
            return inputs, kwargs
        if not torch.as_tensor(mask).bool().all():
            raise MoelensError(
                f"{type(self._module).__name__}.forward takes no attention_mask, so padding (the zeros of the "
                "attention_mask: rows or invokes of different lengths) cannot be masked: give every row the same "
                "number of tokens, or run them one at a time (separate traces; collect_routing(batch_size=1))."
            )
        return inputs, {name: value for name, value in kwargs.items() if name != "attention_mask"}


def check_wrapped(model: Any) -> None:
    """Refuse a ``model`` argument that is not a model moelens wrapped (a transformers model, a name ...)."""
    if not isinstance(model, MoeModelMixin):
        raise MoelensError(f"model must be a model wrapped by moelens, got {described(model)}; wrap a transformers "
                           "model with moelens.wrap(model, tokenizer=tokenizer), or load one with moelens.load(path).")


def _described(value: Any) -> str:
    """``value`` in words for an error: an envoy by its path, else its type and repr."""
    if isinstance(value, Moe):
        return f"{value.path} of another wrapped model"
    if isinstance(value, nnsight.Envoy):
        return f"{value.path} ({type(value._module).__name__}), which is no MoE block"
    return f"{type(value).__name__} {value!r:.60}"


def _warn_on_vocabulary(model: torch.nn.Module, tokenizer: Any) -> None:
    """Warn when ``tokenizer`` gives token ids past the rows of the model's input embeddings (most often the
    tokenizer of another model): a trace of text holding one is refused (`_ids_past_vocabulary`)."""
    if tokenizer is None or not hasattr(model, "get_input_embeddings"):
        return
    try:
        rows, tokens = model.get_input_embeddings().num_embeddings, len(tokenizer)
    except (AttributeError, NotImplementedError, TypeError):  # no embedding layer of torch's kind, or no length
        return
    if tokens > rows:
        warn(
            f"wrap: the tokenizer ({type(tokenizer).__name__}) has {tokens} tokens, but the model's input embeddings "
            f"hold {rows} rows: a trace of text with a token id of {rows} or more will be refused (the model cannot embed "
            "it). Pass the tokenizer saved with this model.",
        )


def wrap(model: torch.nn.Module, tokenizer: Any = None, **nnsight_kwargs: Any) -> MoeTransformersModel | MoeNNsight:
    """Wrap a transformers model so its MoE blocks serve their values by name.

    Args:
        model: A transformers model instance (any family moelens knows; a model it
            does not know is wrapped as plain nnsight, with a warning for MoE blocks).
        tokenizer: Its tokenizer, so string prompts, padding and ``generate`` work;
            without one the model takes token-id tensors. The wrapped model keeps a copy
            (``model.tokenizer``, left-padded for a model that generates, as nnsight sets it): yours is not changed.
        **nnsight_kwargs: Passed to the nnsight model (``envoys``, ``rename``, ...).

    Returns:
        An nnsight model: ``.moes``, ``.layers[i].mlp`` (``Moe`` / ``Mlp``), ``.family``.
    """
    if isinstance(model, MoeModelMixin):
        raise MoelensError(
            "wrap() got a model moelens has wrapped already: use it as it is (or wrap its transformers "
            "model again: moelens.wrap(model._module, tokenizer=getattr(model, 'tokenizer', None)))."
        )
    if isinstance(model, Envoy) and model is not model.root:  # a block or module of a wrapped model
        raise MoelensError(
            f"wrap() got {model.path}, a {type(model).__name__} of a model wrapped already (by moelens or nnsight), "
            "not a model: read and edit it in a trace of that model, or wrap the whole transformers model (that "
            "model's ._module)."
        )
    if isinstance(model, Envoy):  # NNsight, and LanguageModel, which is no NNsight in nnsight 0.8
        raise MoelensError(
            f"wrap() got an nnsight model ({type(model).__name__}); wrap the transformers model inside it: "
            "moelens.wrap(model._module, tokenizer=getattr(model, 'tokenizer', None))."
        )
    if not isinstance(model, torch.nn.Module):
        raise MoelensError(
            f"wrap() takes a transformers model instance (torch.nn.Module), got {type(model).__name__}; "
            "to load from a path or repo id use moelens.load()."
        )
    family = registry.for_block(model)
    if family is not None:
        raise MoelensError(
            f"wrap() got one {family.name} MoE block ({type(model).__name__}), not a model: wrap the whole model that "
            "holds it and read the block as model.layers[i].mlp (or model.moes[i]) in a trace of that model."
        )
    if type(model).__name__ == OPTIMIZED and hasattr(model, "_orig_mod"):  # torch.compile(model)
        raise MoelensError(
            "wrap() got a model compiled with torch.compile: wrap the model it compiled, moelens.wrap(model._orig_mod). "
            + COMPILED
        )
    if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "pad_token_id")):
        raise MoelensError(
            f"wrap(tokenizer=...) takes the model's transformers tokenizer (AutoTokenizer.from_pretrained(...)), got "
            f"{type(tokenizer).__name__}; leave it out for a model that takes token ids."
        )
    missing = [name for name in PIPELINE_ATTRIBUTES[1:] if not hasattr(model, name)] if tokenizer is not None else []
    if tokenizer is not None and not missing and not hasattr(model, "config") and model.can_generate():
        missing = ["config"]  # read by the text-generation pipeline only, not by the feature-extraction one
    if missing:
        raise MoelensError(
            f"wrap(tokenizer=...) needs a transformers model (nnsight tokenizes text through transformers' pipeline of "
            f"it, which reads its {', '.join(PIPELINE_ATTRIBUTES)}), got {type(model).__name__}, which has no "
            f"{' or '.join(missing)}: wrap it without the tokenizer and trace token ids "
            "(model.trace(tokenizer(text, return_tensors='pt')['input_ids']))."
        )
    _warn_on_vocabulary(model, tokenizer)
    # torch.compile(module) put in anywhere hides the module it compiled (an MoE block's experts too) from discovery
    _refuse_compiled((name, module) for name, module in model.named_modules() if type(module).__name__ == OPTIMIZED)
    _drop_stale_nnsight_state(model)
    before = _instance_state(model)
    try:
        return _wrapped(model, tokenizer, nnsight_kwargs)
    except BaseException:  # a refusal (or Ctrl-C) after nnsight put its forwards on the modules: take them off again
        _restore_instance_state(before)
        raise


def _served_parts(model: torch.nn.Module, structure: Structure) -> dict[str, torch.nn.Module]:
    """Each MoE block with the modules moelens serves values from (`block_parts`: router, experts, shared expert on the
    block or its decoder layer, that expert's gate), by their paths in ``model``, found by the block's own family.
    Another model may hold one of them (a module object placed in two models), whose calls nnsight hands to whichever
    run began first, as for a whole block (`MoeInterleaver.runs`)."""
    parts = {}
    for path in structure.moe_blocks:
        block = model.get_submodule(path)
        family = registry.for_block(block) or structure.family  # a model may hold blocks of several families
        if family is None:
            parts[path] = block
            continue
        layer_path = path.rpartition(".")[0]
        on_layer = family.shared is not None and family.shared.on_layer
        for part, (part_path, module) in block_parts(block, family, model.get_submodule(layer_path)).items():
            host = layer_path if part == "shared expert" and on_layer else path
            parts[".".join(filter(None, (host, part_path)))] = module
    return parts


def _wrapped(model: torch.nn.Module, tokenizer: Any, nnsight_kwargs: dict[str, Any]
             ) -> MoeTransformersModel | MoeNNsight:
    """`wrap`'s nnsight model of ``model``, its blocks instrumented; ``model`` and ``tokenizer`` checked already."""
    structure = discover(model)
    watched = _walk_steps(_around_blocks(model, structure.moe_blocks))
    _refuse_compiled(_present(model, watched))  # where it would reach the forwards moelens reads, as at each trace
    options = dict(nnsight_kwargs)
    moe_envoy = _expert_parallel_envoy(model)
    # the blocks' envoys first: nnsight gives a module the first key that matches its path, and a key of the user's
    # that matches a block ("mlp", its module name) would make it no Moe
    envoys = {_from_root(name): moe_envoy for name in structure.moe_blocks}
    envoys.update({_from_root(name): Mlp for name in [*structure.dense_blocks, *structure.shared_mlps]})
    users = nnsight_kwargs.pop("envoys", None) or {}
    _refuse_block_classes(users, model, [*structure.moe_blocks, *structure.dense_blocks])
    for key, envoy in users.items():
        envoys.setdefault(key, envoy)
    if structure.layers is not None:
        envoys.setdefault(_from_root(structure.layers), LayerList)
        for name in _blockless_layers(model, structure):
            envoys.setdefault(_from_root(name), BlocklessLayer)
        for name in _renamed_blocks(structure):
            envoys.setdefault(_from_root(name), RenamedBlockLayer)
    for name in _block_holders(structure):
        envoys.setdefault(_from_root(name), BlockHolder)
    nnsight_kwargs.setdefault("interleaver", MoeInterleaver())  # one run at a time (`run_owner`)
    wrapped = _nnsight_model(model, tokenizer, envoys, nnsight_kwargs)
    served = _served_parts(model, structure)
    for name in served:  # the blocks' routers, experts and shared experts
        guard_part(envoy_at(wrapped, name))
    if isinstance(wrapped.interleaver, MoeInterleaver):
        wrapped.interleaver.runs(list(dict.fromkeys(served.values())))
    object.__setattr__(wrapped, "_structure", structure)
    object.__setattr__(wrapped, "_watched", watched)
    object.__setattr__(wrapped, "_wrap_options", options)
    object.__setattr__(wrapped, "_layer_lists", tuple(
        (path, len(layers), {id(layer): i for i, layer in enumerate(layers)} if isinstance(layers, torch.nn.ModuleList)
         else {})
        for path in structure.layer_lists for layers in (model.get_submodule(path),)))
    object.__setattr__(wrapped, "_layer_walk", _walk_steps([*paths_above(structure.layer_lists),
                                                            *structure.layer_lists]))
    _bind_standard_names(wrapped, structure)
    object.__setattr__(wrapped, INSTRUMENTED_BLOCKS, {})
    for moe in wrapped.moes:
        if (refusal := _impossible_top_k(moe)) is not None:
            raise refusal
        _instrument(moe)
        wrapped.__dict__[INSTRUMENTED_BLOCKS][moe.path] = moe.__dict__[INSTRUMENTED]
        if moe.family.runs_only_on or moe.runs_before_expansion:  # per modality, or a tower's flat patches
            moe.mark_gathered_calls()
    _warn_unknown_implementations(wrapped.moes)
    return wrapped


def _warn_unknown_implementations(moes: Iterable[Moe]) -> None:
    """Warn of experts implementations the model's config names that transformers does not know (not registered yet,
    or misspelt), whose forward fails with transformers' KeyError."""
    unknown = sorted({moe.experts_implementation for moe in moes} - set(known()))
    if unknown:
        warn(f"the model's experts run {', '.join(map(repr, unknown))}, which transformers does not know (known: "
             f"{', '.join(known())}): its forward fails. Switch with model.set_experts_implementation('grouped_mm'), "
             "or register the implementation with transformers before the first trace.")


#: nnsight's keywords for loading a model lazily (its weights on meta until the first trace): moelens loads them.
LAZY_LOADING = ("dispatch", "meta_buffers")


def refuse_lazy_loading(keywords: Iterable[str], call: str) -> None:
    """Refuse nnsight's lazy-loading keywords (`LAZY_LOADING`) given to ``call``, saying what serves their purpose."""
    lazy = [name for name in LAZY_LOADING if name in keywords]
    if lazy:
        raise MoelensError(
            f"{call} does not take {', '.join(f'{name}=' for name in lazy)}: nnsight's lazy loading (weights on the "
            "meta device until the first trace) is not offered, moelens works on a model whose weights are loaded. "
            "For a model too big for memory, load it with a device_map that offloads (moelens.load(path, "
            "device_map='auto', offload_folder=...): accelerate loads each block's weights as it runs); for its "
            "shapes alone, build it from its config under accelerate's init_empty_weights(include_buffers=True), "
            "wrap it and run model.scan(...)."
        )


def _nnsight_model(model: torch.nn.Module, tokenizer: Any, envoys: dict[str, type],
                   nnsight_kwargs: dict[str, Any]) -> MoeTransformersModel | MoeNNsight:
    """nnsight's model of ``model`` (a language model where there is a tokenizer), built with ``nnsight_kwargs``."""
    refuse_lazy_loading(nnsight_kwargs, "moelens.wrap")
    model_class = MoeNNsight if tokenizer is None else MoeTransformersModel
    taken = _keywords_taken(model_class)
    unknown = sorted(set(nnsight_kwargs) - taken)
    if unknown:  # nnsight's plain model raised naming Envoy.__init__; its language model dropped them without a word
        near = {name: difflib.get_close_matches(name, sorted(taken | {"tokenizer"}), n=1) for name in unknown}
        meant = "; ".join(f"{name!r}: did you mean {near[name][0]!r}?" for name in unknown if near[name])
        raise MoelensError(
            f"wrap() got keywords it does not take: {', '.join(map(repr, unknown))}. wrap takes the model, tokenizer= "
            f"and the nnsight model's own keywords (envoys=, rename=, ...); check the spelling"
            + (f" ({meant})." if meant else ".")
        )
    if tokenizer is None:
        return MoeNNsight(model, envoys=envoys, **nnsight_kwargs)
    if not getattr(model, "can_generate", lambda: False)():
        # nnsight infers a pipeline task from the head, or config.architectures (stale in a classifier loaded from
        # a causal LM's checkpoint: a text-generation pipeline failed), and knows none for a base model or
        # question answering; tracing needs only the tokenizing
        nnsight_kwargs.setdefault("task", FEATURE_TASK)
    with _real_device_first(model), _no_pipeline_task_complaint():  # a copy: nnsight sets its padding_side
        return MoeTransformersModel(model, tokenizer=copy.deepcopy(tokenizer), envoys=envoys, **nnsight_kwargs)


@functools.cache
def _keywords_taken(model_class: type) -> frozenset[str]:
    """The keywords nnsight's ``model_class`` reads when it is given a model it does not load: the named parameters of
    its constructors, and for a transformers model those of transformers' ``pipeline``, which it builds (a name of
    neither, nnsight takes as a loading setting and drops)."""
    from transformers import pipeline  # its module is loaded lazily

    constructors = [cls.__init__ for cls in model_class.__mro__ if "__init__" in vars(cls)]
    if issubclass(model_class, MoeTransformersModel):
        constructors.append(pipeline)
    return frozenset(name for constructor in constructors
                     for name, parameter in inspect.signature(constructor).parameters.items()
                     if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)) - {"self"}


def _check_sub_configs(subs: dict[str, Any], wanted: dict[str, str]) -> None:
    """Refuse a key of `set_experts_implementation`'s dict that names none of the model's sub-configs ``subs``
    (transformers' switch passes over it without a word, so a misspelt sub-config would switch nothing)."""
    for key in wanted:
        if key and key not in subs:
            raise MoelensError(
                f"set_experts_implementation: {key!r} names no sub-config of this model; its keys are \"\" (the "
                f"model's own config){''.join(f', {sub!r}' for sub in sorted(subs))}."
            )


def _wanted_for(experts: torch.nn.Module, implementation: str | dict[str, str], subs: dict[str, Any],
                wanted: dict[str, str]) -> str | None:
    """The implementation `set_experts_implementation` asks of ``experts``: ``implementation`` itself, or the entry of
    the (sub-)config they were built with; the model's own (``""``) for experts holding a config that is none of the
    model's sub-configs (the blocks `moelens.compress` made, transformers layers in a plain torch model)."""
    if isinstance(implementation, str):
        return implementation
    keys = [key for key, sub in subs.items() if sub is experts.config]
    return wanted.get(keys[0]) if keys else wanted.get("")


#: The module of `parallel.runs.Runs`, the runs of an EP group (`MoeModelMixin._ep_runs`).
_RUNS_MODULE = "moelens.parallel.runs"


