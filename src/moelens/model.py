"""`wrap`: an nnsight model whose MoE blocks are `Moe` components.

`wrap` makes the MoE blocks `discover` finds `Moe` envoys and the dense MLPs of the same
decoder stack `Mlp` envoys, and binds the standard names: ``model.layers`` is the decoder layer
list, ``model.layers[i].mlp`` the block whatever the family calls it, and ``model.moes`` the MoE
components in layer order. Native module paths keep working. `moelens.load` (in `loading`) loads
a checkpoint and wraps it.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import inspect
import itertools
import logging
import os
import re
import sys
import traceback
import types
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, NoReturn

import nnsight
import torch
from jaxtyping import Int
from nnsight import NNsight, TransformersModel
from nnsight.intervention.envoy import Envoy, traceable
from nnsight.intervention.interleaver import OutOfOrderError
from nnsight.intervention.source import STATE as NNSIGHT_STATE, SourceNotAvailable
from nnsight.modeling import processing
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, is_fake
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from transformers import GenerationConfig, PreTrainedModel

from .components import Mlp, Moe, served
from .components.base import (INSTRUMENTED, INSTRUMENTED_BLOCKS, StandardNames, bind_alias, envoy_at, refuse_replaced,
                              with_suggestion)
from .components.gathered import drop_gathered_notes
from .components.implementations import (IMPLEMENTATION_CALL, check_known, is_dispatching, known, runs_torch_a2a,
                                         unsupported_dtypes)
from .components.layer_list import BlockHolder, BlocklessLayer, LayerList, MoeList, RenamedBlockLayer
from .components.moe import value_names
from .components.params import op_names
from .components.run_owner import MoeInterleaver
from .discovery import Structure, discover, layer_path, paths_above
from .errors import ArgumentError, FamilyError, MoelensError, OrderError, ValueUnavailable, described, warn
from .families import Family, registry
from .modules import (disk_offloaded, first_parameter, names_keyword, on_accelerator, padding_position_id,
                      takes_keyword, vocab_size)
from .scalars import as_int, check_flag


class MoeModelMixin(StandardNames):
    """What moelens adds to an nnsight model: the MoE components and the family."""

    _structure: Structure
    #: The nnsight keyword arguments `wrap` was given (a deep copy is wrapped with them again).
    _wrap_options: dict[str, Any]
    #: The module paths each trace checks hold nothing compiled since wrapping (`_around_blocks`), as `_present`
    #: walks them (`_walk_steps`).
    _watched: tuple[tuple[str, int, str], ...]
    #: ``(path, length)`` of each module list holding MoE blocks (or dense MLPs), as wrapped
    #: (`_refuse_changed_layers`), and how `_present` walks to them.
    _layer_lists: tuple[tuple[str, int], ...]
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
        (``model.edit(inplace=True)``), which live in the wrapper, not in the weights, and are not saved."""
        edits = getattr(self, "_edits", None)
        if edits:
            warn(
                f"save_pretrained: the model carries {len(edits)} nnsight edit(s) (model.edit()), which are not in its "
                "weights and are not saved: the checkpoint computes the unedited model. Make lasting changes through "
                "moe.params() (weight edits), or call model.clear_edits() to silence this.",
            )
        return self._module.save_pretrained(*args, **kwargs)

    @property
    def moes(self) -> MoeList:
        """The MoE components, in layer order (indexed by block: `MoeList`)."""
        return MoeList(envoy_at(self, name) for name in self._structure.moe_blocks)

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
        handed_back, interleaver = served.HandedBack(generating=_generating(fn)), self.interleaver
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
        """Refuse a run of a model whose layer lists gained or lost layers since wrapping (``live``: path -> module,
        `_present`): `moes` and `layers` name the blocks as they were, so a block's values would come from another
        layer's (an inserted one shifts them) or the new layers' blocks be left out, silently."""
        for path, length in self._layer_lists:
            layers = live.get(path)
            if layers is not None and len(layers) != length:
                raise MoelensError(
                    f"the model's {path} holds {len(layers)} layers, and moelens wrapped it with {length} (layers "
                    "added or removed since moelens.wrap): model.moes and model.layers name the blocks as they were, "
                    "so their values would be another layer's. Wrap the model again: moelens.wrap(model._module, ...)."
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
        refuse_replaced([block.path for block in self.moes if not isinstance(block, Moe)], "model.save_all",
                        "it is no MoE block to read", MoelensError)  # (a module given to a block's envoy)
        blocks = [moe for moe in self.moes if not moe.runs_only_on] if moes is None else self._given_blocks(moes)
        if values is not None and not isinstance(values, str):
            values = value_names(values)  # once: each block reads the same names (a generator would serve the first)
        layers = [moe.layer for moe in blocks]
        keys = layers if len(set(layers)) == len(layers) else [moe.path for moe in blocks]
        saved = {}
        for key, moe in zip(keys, blocks):
            try:
                saved[key] = moe.save_all(values, strict=strict)
            except OrderError as error:  # `Moe._run_past`'s, whose advice is the block's own save_all
                name = getattr(error, "unreached", None)
                if name is None:
                    raise
                raise moe._order_error(name, by="model.save_all", step_passed=getattr(error, "step_passed", False)) \
                    from None
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
        from_text = any(_is_text(value) for inputs, kwargs in invokes for value in (*inputs, *kwargs.values()))
        given = set(extra).union(*(kwargs for inputs, kwargs in invokes))
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
        a value. Persistent edits (``model.edit(inplace=True)``) are not copied.
        """
        module = copy.deepcopy(self._module, memo)
        drop_gathered_notes(module)  # this model's hooks, copied with the modules: the copy's wrap adds its own
        return wrap(module, tokenizer=getattr(self, "tokenizer", None), **self._wrap_options)


class MoeTransformersModel(MoeModelMixin, TransformersModel):
    """A transformers model with a tokenizer (string prompts, padding, generation), with moelens components."""

    #: Rows the model runs per prompt row while it generates: transformers repeats each row for
    #: beams / returned sequences (read by the token views, `moelens.components.tokens.current_rows`).
    _rows_per_prompt: int = 1

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's batching of the invokes' inputs, after refusing inputs of other modalities than text (images,
        audio) in one of several invokes (nnsight batches invokes from text and token ids alone, and refused them with
        "Can't batch these inputs; pass text or token ids", advice that drops the images), and, on a model with a
        tokenizer alone (no processor, feature extractor or image processor, which may take raw audio or image data),
        an input that is no prompt, token ids or tensor (a number, bytes, a list of numbers that are not ids:
        transformers' text pipeline failed on it with "can only concatenate str")."""
        text_only = not any(getattr(self, name, None) is not None
                            for name in ("processor", "feature_extractor", "image_processor"))
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
            if text_only and inputs and _not_an_input(inputs[0]):
                given = inputs[0]
                what = described(given) if not isinstance(given, (list, tuple)) else \
                    f"a {type(given).__name__} holding {described(next(i for i in given if _not_an_input(i)))}"
                raise MoelensError(
                    f"a trace's input was {what}: a model wrapped with a tokenizer takes text (a str "
                    "or a list of them), token ids (a list of ints or an input_ids tensor), or the tokenizer's "
                    "output as keywords (model.trace(**inputs))."
                )
        invokes, forward = self._forward_keywords(invokes) if text_only else (invokes, {})
        if forward:  # laid over the batch as the trace's own keywords are, where the batch's checks see them
            self.interleaver.batcher.extra_kwargs.update(forward)
        return super()._batch(invokes, fn)

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
        take (``pad_to_multiple_of``, ``padding_side`` ...). They were dropped without a word."""
        if not any(kwargs for inputs, kwargs in invokes):
            return
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


def generation_setting(model: torch.nn.Module, kwargs: dict[str, Any], name: str) -> Any:
    """The generation setting ``name`` ``generate`` runs with: the keyword, else the ``generation_config`` given,
    else the model's own (transformers fills a given config's unset settings from the model's)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return None


def rows_per_prompt(model: torch.nn.Module, kwargs: dict[str, Any]) -> int:
    """How many rows transformers' ``generate`` runs for each prompt row with these arguments.

    It repeats every row ``max(num_beams, num_return_sequences)`` times, in place (row i
    becomes rows ``i * n`` to ``i * n + n - 1``), from the arguments over the
    ``generation_config`` given over the model's own.
    """
    return max(int(generation_setting(model, kwargs, name) or 1) for name in ("num_beams", "num_return_sequences"))


#: The dtypes torch's embedding looks token ids up by (int16 ids, bool ones, fail inside the model).
EMBEDDED_ID_DTYPES = (torch.long, torch.int32)

#: Where torch's own Python lies (its frames are passed over to find the code a scan's guard failed in).
TORCH_SOURCE = os.path.dirname(torch.__file__) + os.sep


def _refuse_unusable_ids(module: torch.nn.Module, batched: tuple[tuple, dict], from_text: bool = False,
                         generating: bool = False, trace_kwargs: Mapping[str, Any] | None = None,
                         mask_built: bool = False) -> tuple[tuple, dict]:
    """``batched`` (the model's inputs, as nnsight's batching built them), after refusing input_ids the model could
    not embed: a tensor of a dtype torch's embedding does not take (float, int16, bool ...) or a prompt with no tokens (an empty ids
    tensor; ``from_text``: an empty string, a row of padding alone beside longer prompts; the model's attention
    fails on a zero-length sequence), and an attention mask that does not fit them (``trace_kwargs``: the trace's own
    keywords, ``model.trace(past_key_values=...)``, which the model gets beside the invokes' and over them;
    ``mask_built``: the mask was built for the invokes' own tokens, not given)."""
    ids = _input_ids(module, batched)
    if not isinstance(ids, torch.Tensor):
        return batched
    if ids.dtype not in EMBEDDED_ID_DTYPES:
        raise unembeddable_ids(ids, "the trace's input_ids")
    mask = batched[1].get("attention_mask")
    given = {**batched[1], **(trace_kwargs or {})}
    _refuse_misfit_mask(module, ids, given.get("attention_mask"), _given_cache(module, given), generating,
                       mask_built)
    masked = from_text and isinstance(mask, torch.Tensor) and mask.dim() == 2 and not is_fake(mask)  # scan: no values
    if ids.numel() == 0 or (masked and not mask.any(-1).all()):
        row = "" if ids.numel() == 0 else f" (row {int((~mask.any(-1)).nonzero()[0])} of the batch)"
        raise MoelensError(
            f"a prompt of the trace has no tokens{row}: an empty string or an empty ids tensor gives the model a "
            "zero-length sequence, on which its attention fails. Give every prompt at least one token."
        )
    return batched


def _generating(fn: Any) -> bool:
    """Whether a run's ``fn`` is the model's ``generate`` (not its forward)."""
    return getattr(fn, "__name__", fn) == "generate"


def _refuse_misfit_mask(module: torch.nn.Module, ids: Any, mask: Any, cache: Any, generating: bool,
                        mask_built: bool = False) -> None:
    """Refuse a ``[batch, width]`` attention_mask that does not fit the ``[batch, seq]`` ids: transformers takes it as
    it is, and the model silently attends to the wrong positions. It has one entry per token; over a key-value cache
    (``cache``) in a step of a trace, one per cached token before them too (generate's ids hold the cached tokens; an
    encoder-decoder's are the encoder's), and wider is let through there (a static cache's length)."""
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == mask.dim() == 2):
        return
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        cache = None
    rows, length = ids.shape
    counted = getattr(cache, "get_seq_length", None)
    cached = int(counted()) if cache is not None and not generating and callable(counted) else 0
    least = length + cached
    if mask.shape[0] == rows and (mask.shape[1] == least or cache is not None and mask.shape[1] > least):
        return
    before = f" and {cached} more for the tokens the cache holds before them" if cached else ""
    expected = f"{rows} row{'s' * (rows != 1)} of at least {least}" if cache is not None else f"shape ({rows}, {length})"
    built = (" (built for the invokes' own tokens, not the cached ones: over a cache pass attention_mask=, covering "
             "the cached and the new tokens, to model.trace(...))") if mask_built and cached else ""
    raise MoelensError(
        f"the attention_mask of shape {tuple(mask.shape)}{built} does not fit the input_ids of shape "
        f"{tuple(ids.shape)}: give one entry per token (1 to attend to it, 0 for padding){before}, {expected}."
    )


def unembeddable_ids(ids: torch.Tensor, named: str) -> MoelensError:
    """The refusal of token ids ``ids`` (called ``named``) of a dtype torch's embedding does not take."""
    kind = "token ids are integers" if not _token_ids(ids) else "a model's embedding takes torch.long or torch.int32 ids"
    return MoelensError(f"{named} are a {ids.dtype} tensor of shape {tuple(ids.shape)}: {kind}; pass the ids a "
                        "tokenizer gives (torch.long), or convert them with .long().")


def _refuse_shapeless_ids(ids: Any) -> None:
    """Refuse an invoke's input ids that are one 0-d tensor (nnsight's batching fails on it with a bare IndexError)."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 0:
        raise MoelensError(f"a trace's input was a 0-d tensor ({ids!r:.40}), one id without a batch and a sequence "
                           "axis: pass token ids [batch, seq], e.g. ids.reshape(1, 1).")


def _model_inputs(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs a failed run gave the model: a trace's, assembled again from its batcher (the tokenized, padded
    batch), or the call's own; ``((), {})`` when they cannot be built again."""
    batcher = kwargs.get("batcher")
    if batcher is None:
        return args, kwargs
    try:
        return batcher.assemble(fn)
    except Exception:  # noqa: BLE001 - only to explain an error already raised
        return (), {}


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


def _input_ids(module: torch.nn.Module, batched: tuple[tuple, dict]) -> Any:
    """The input_ids among the model's inputs ``batched``: the keyword, or the first argument of a forward whose
    first parameter they are."""
    args, kwargs = batched
    ids = kwargs.get("input_ids")
    if ids is None and args and first_parameter(module) == "input_ids":
        ids = args[0]
    return ids


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


def _invoke_ids(inputs: tuple, kwargs: dict) -> Any:
    """An invoke's input_ids: its first positional input, or the keyword (None where it has neither)."""
    return inputs[0] if inputs else kwargs.get("input_ids")


def _modality_inputs(names: Iterable[Any]) -> list[str]:
    """Which of ``names`` (an invoke's input names) are inputs of another modality than text (an image's
    pixel_values and image_grid_thw, a processor's images=, audio input_features), sorted."""
    return sorted(str(name) for name in names if any(part in str(name) for part in MODALITY_INPUTS))


def _invoke_input_names(inputs: tuple, kwargs: dict) -> list[Any]:
    """The names of the inputs an invoke gives data in: its keywords, and the keys of an encoding given as its first
    input (``tracer.invoke(processor(...))``), but for those set to None or a flag (``pixel_values=None``,
    Qwen3-Omni's ``use_audio_in_video=False``), which nnsight passes on to the model for the whole batch."""
    return [name for name, value in _invoke_inputs(inputs, kwargs).items()
            if value is not None and not isinstance(value, bool)]


def _invoke_inputs(inputs: tuple, kwargs: dict) -> dict[Any, Any]:
    """An invoke's inputs by name: its keywords, and the keys of an encoding given as its first input."""
    return {**(inputs[0] if inputs and isinstance(inputs[0], Mapping) else {}), **kwargs}


def _unbatched_inputs(inputs: tuple, kwargs: dict) -> list[str]:
    """The tensors an invoke of token ids or an encoding gives (keywords, or keys of the encoding) that nnsight does
    not split into rows to batch invokes: any outside its ``ROW_FIELDS`` (a processor's ``mm_token_type_ids``), sorted.
    None for an invoke of text, whose keywords nnsight hands the forward as settings of the whole batch."""
    if any(_is_text(value) for value in inputs):
        return []
    return sorted(str(name) for name, value in _invoke_inputs(inputs, kwargs).items()
                  if isinstance(value, torch.Tensor) and name not in processing.ROW_FIELDS)


#: What to do with inputs nnsight cannot split between invokes (`_unbatched_inputs`).
_UNBATCHED_REMEDY = ("Give the whole batch to one invoke, or to model.trace(...) with no invokes; or leave them out "
                     "where the model does without (a processor's token-type ids of text alone).")


def _unsplittable(modality: list[str]) -> str:
    """The sentence saying that the inputs named ``modality`` (images, audio) cannot be split between invokes, and how
    to batch them instead."""
    return (f"Inputs of other modalities ({', '.join(modality)}) cannot be split between invokes: give the processor's "
            "whole batch to one invoke, or to model.trace(...) with no invokes.")


def _rows_of(inputs: tuple, kwargs: dict, rows: int) -> int:
    """``rows``, the batch rows nnsight counts in an input; refused where it is 0 for an input that is there (an empty
    list of prompts, ids of 0 rows): nnsight takes such a trace for one without input, runs its body without the model
    and fails at its first read ("Cannot access model.output outside of interleaving")."""
    ids, name = _invoke_ids(inputs, kwargs), "ids"
    if isinstance(ids, Mapping):
        ids = ids.get("input_ids")
    if ids is None:
        ids, name = kwargs.get("inputs_embeds"), "inputs_embeds"
    if not rows and ((isinstance(ids, (list, tuple)) and not ids) or (isinstance(ids, torch.Tensor) and ids.ndim > 1)):
        shape = f"{name} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else f"an empty {type(ids).__name__}"
        raise MoelensError(f"the input holds no prompts ({shape}), so the model would not run: give at least one "
                           "prompt.")
    return rows


def _token_ids(value: Any) -> bool:
    """Whether ``value`` can be a model's input_ids: an integer tensor (a float one, a number or a list is not)."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


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
            if any(_is_text(value) for value in (*inputs, *kwargs.values())):
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


def _without_remote(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An invoke's keywords without ``remote``: plain nnsight has no remote path, so a true one is refused (it would
    reach the forward as an input) and a false one (a ``remote=REMOTE`` switch, off) dropped."""
    if kwargs.get("remote"):
        raise MoelensError(
            f"remote={kwargs['remote']!r} runs nnsight's remote path, which comes with a model wrapped with its "
            "tokenizer (nnsight's LanguageModel): moelens.wrap(model, tokenizer=...)."
        )
    return {name: value for name, value in kwargs.items() if name != "remote"}


#: The keywords a forward takes its key-value cache by: transformers 5.25 renamed ``past_key_values`` to ``cache``
#: (the old name still works there, deprecated).
CACHE_KEYWORDS = ("past_key_values", "cache")


def _given_cache(module: torch.nn.Module, params: Mapping[str, Any]) -> Any:
    """The key-value cache among ``params`` under either name (`CACHE_KEYWORDS`), None where none is given; a
    `MoelensError` for ``cache=`` to a forward that does not name it (before transformers 5.25 its ``**kwargs``
    take it in silence, and the model runs without the cache)."""
    if params.get("cache") is not None and not names_keyword(module, "cache"):
        raise MoelensError(
            f"cache= is not a keyword of {type(module).__name__}.forward: transformers before 5.25 takes the "
            "key-value cache as past_key_values, and would run the model without it. Pass past_key_values=."
        )
    return next((params[name] for name in CACHE_KEYWORDS if params.get(name) is not None), None)


def _cached_tokens(module: torch.nn.Module, params: dict[str, Any]) -> int:
    """How many tokens the key-value cache among a trace's ``params`` holds (0: none given)."""
    cache = _given_cache(module, params)
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 1  # a cache of another kind: assume it holds tokens


def _embedded_pad_id(model: torch.nn.Module) -> int:
    """The id the invokes of a model without a tokenizer are padded with (masked, so any id it embeds will do): the
    config's ``pad_token_id`` where the model embeds it, else 0 (``-1`` or an id past the vocabulary in a config)."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    vocab = vocab_size(model)
    return pad_id if isinstance(pad_id, int) and 0 <= pad_id and (vocab is None or pad_id < vocab) else 0


def _left_padded(rows: list[Int[torch.Tensor, " _"]], pad_id: int) -> tuple[Int[torch.Tensor, "b w"], Int[torch.Tensor, "b w"]]:
    """The rows (of any lengths) left-padded with ``pad_id`` to the longest one, ``w``, and their attention mask
    (1 on real tokens)."""
    width = max(row.shape[0] for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - row.shape[0] :] = row
        attention_mask[index, width - row.shape[0] :] = 1
    return input_ids, attention_mask


#: Parts of the names of a processor's image, video and audio inputs (pixel_values, image_grid_thw,
#: input_features, input_values).
MODALITY_INPUTS = ("pixel", "image", "video", "audio", "input_features", "input_values")

#: accelerate device-map entries that name no torch device to run on.
NO_TORCH_DEVICE = ("disk", "meta")


def _refuse_block_classes(envoys: dict, model: torch.nn.Module, blocks: list[str]) -> None:
    """Refuse an ``envoys=`` key that is the class of a block moelens serves: nnsight gives a module the envoy of
    its class before any path's, so the block would be no `Moe` / `Mlp`."""
    for key, envoy in envoys.items():
        claimed = next((name for name in blocks if isinstance(key, type) and isinstance(model.get_submodule(name), key)),
                       None)
        if claimed is not None:
            raise MoelensError(
                f"wrap(envoys=...) maps {key.__name__} to {getattr(envoy, '__name__', envoy)}, but {claimed} is one, "
                "and moelens makes that block its own envoy (Moe or Mlp); key the envoy by the paths of the other "
                "modules you want it on instead."
            )


def _from_root(name: str) -> str:
    """nnsight's path of the module named ``name`` in the model, as an ``envoys`` key: nnsight matches a key against
    the end of each module's path, so a bare name (``"0"``, a block of an ``nn.Sequential``) would also pick every
    module deeper down whose path ends in it (``0.experts.mlps.0``)."""
    return f"model.{name}"


def _offloaded_by_accelerate(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model: a ``device_map``, or an offload hook (``_hf_hook``) on one of its modules."""
    return bool(getattr(model, "hf_device_map", None)) or any(
        getattr(module, "_hf_hook", None) is not None for module in model.modules())


@contextlib.contextmanager
def _real_device_first(model: torch.nn.Module) -> Iterator[None]:
    """While nnsight builds its transformers pipeline: the model's accelerate ``hf_device_map`` listing a real device
    first (the pipeline takes its first entry for a torch device, and ``"disk"`` is none; a model all on disk gets the
    CPU, where accelerate runs it); the map is restored after (an attribute set to None stays None; one that was
    not there is taken off again).
    A model with no map gets one meanwhile that names where its first weight is: the pipeline moves a model without
    a map to the first accelerator it finds (a CPU model onto ``cuda:0`` on a machine with a GPU), and a weight on
    meta (every weight, built under ``init_empty_weights``; or behind accelerate's offload hooks, ``cpu_offload``,
    which sets no map) cannot be moved at all ("Cannot copy out of meta tensor"): those get the CPU."""
    had_map = "hf_device_map" in model.__dict__
    device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        first = next(model.parameters(), None)
        meanwhile = None if first is None else {"": "cpu" if first.is_meta else str(first.device)}
    elif isinstance(device_map, dict) and next(iter(device_map.values()), None) in NO_TORCH_DEVICE:
        meanwhile = dict(sorted(device_map.items(), key=lambda item: item[1] in NO_TORCH_DEVICE))
        if all(device in NO_TORCH_DEVICE for device in meanwhile.values()):  # all on disk: accelerate runs it on CPU
            meanwhile = {"": "cpu"}
    else:
        meanwhile = None
    if meanwhile is None:
        yield
        return
    model.hf_device_map = meanwhile
    try:
        yield
    finally:
        if had_map:
            model.hf_device_map = device_map
        else:
            del model.hf_device_map


class _PipelineTaskComplaint(logging.Filter):
    """Drops transformers' "The model 'X' is not supported for text-generation" error record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is not supported for" not in record.getMessage()


@contextlib.contextmanager
def _no_pipeline_task_complaint() -> Iterator[None]:
    """While nnsight builds its transformers pipeline: transformers logs an error, with ~250 class names, for a model
    that generates but is no causal LM (a vision-language model), though tracing needs no pipeline task of it."""
    logger, complaint = logging.getLogger("transformers.pipelines.base"), _PipelineTaskComplaint()
    logger.addFilter(complaint)
    try:
        yield
    finally:
        logger.removeFilter(complaint)


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


def _not_an_input(value: Any) -> bool:
    """A number, bytes, or a list holding a float or bytes (no prompt, token ids or tensor)."""
    scalar = (int, float, bytes, bytearray)
    if isinstance(value, scalar):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(item, (float, bytes, bytearray)) for item in value)


def _is_text(value: Any) -> bool:
    """A prompt string or a list of them."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], str))


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


#: What transformers' pipeline, through which nnsight tokenizes a wrapped model's text, reads of the model (the config
#: only where the model can generate): a plain torch module without them failed deep inside it.
PIPELINE_ATTRIBUTES = ("config", "device", "can_generate")


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
    if isinstance(wrapped.interleaver, MoeInterleaver):
        wrapped.interleaver.runs([model.get_submodule(path) for path in structure.moe_blocks])
    object.__setattr__(wrapped, "_structure", structure)
    object.__setattr__(wrapped, "_watched", watched)
    object.__setattr__(wrapped, "_wrap_options", options)
    object.__setattr__(wrapped, "_layer_lists", tuple((path, len(model.get_submodule(path)))
                                                      for path in structure.layer_lists))
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


def _nnsight_model(model: torch.nn.Module, tokenizer: Any, envoys: dict[str, type],
                   nnsight_kwargs: dict[str, Any]) -> MoeTransformersModel | MoeNNsight:
    """nnsight's model of ``model`` (a language model where there is a tokenizer), built with ``nnsight_kwargs``."""
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


#: The pipeline task `wrap` gives nnsight for a model that cannot generate: the tokenizing alone.
FEATURE_TASK = "feature-extraction"
#: The keywords `FEATURE_TASK`'s pipeline takes itself (`MoeTransformersModel._forward_keywords`).
FEATURE_SETTINGS = ("truncation", "tokenize_kwargs", "return_tensors")
#: The tokenizer settings transformers' text-generation pipeline hands the tokenizer (the rest go to the forward).
GENERATION_SETTINGS = ("add_special_tokens", "padding", "truncation", "max_length")
#: The inputs a tokenizer makes of a text (given beside it, one would replace its own), and the second texts it
#: pairs with it (a pipeline tokenizing one prompt at a time takes none).
TOKENIZED = ("input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "text_pair", "text_target",
             "text_pair_target")


@functools.cache
def tokenizer_settings(tokenizer_class: type) -> frozenset[str]:
    """The settings a tokenizer class's call takes by name (``max_length``, ``padding`` ...), and those of
    transformers' tokenizers (a call of ``(*args, **kwargs)`` names none), not the texts (`TOKENIZED`)."""
    from transformers import PreTrainedTokenizerBase

    names = {name for call in (tokenizer_class.__call__, PreTrainedTokenizerBase.__call__)
             for name, parameter in inspect.signature(call).parameters.items()
             if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)}
    return frozenset(names - {"self", "text", *TOKENIZED})


#: The class name of what ``torch.compile(module)`` returns (the module it compiled is its ``_orig_mod``).
OPTIMIZED = "OptimizedModule"

#: Why a compiled model is refused.
COMPILED = ("moelens reads values inside the MoE blocks' forwards, rewritten by nnsight, which torch's compiler "
            "(dynamo) cannot trace: the traces would fail inside torch.")


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


def _disk_offloaded(model: torch.nn.Module) -> bool:
    """Whether accelerate loads some of ``model``'s weights from disk as the modules holding them run: a
    ``device_map`` placing modules on ``"disk"``, or `disk_offloaded` hooks (weights offloaded to the CPU scan)."""
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and "disk" in device_map.values() or disk_offloaded(model.modules())


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


def _around_blocks(model: torch.nn.Module, blocks: list[str]) -> list[str]:
    """The paths of the model, every module on the way down to its MoE blocks, the blocks and their children
    (router, experts, shared expert): where a compilation made after wrapping would reach the forwards moelens reads."""
    above = paths_above(blocks)
    inside = [f"{block}.{name}".rstrip(".") for block in blocks
              for name in ["", *(child for child, _ in model.get_submodule(block).named_children())]]
    return sorted(above) + inside


def _walk_steps(paths: list[str]) -> tuple[tuple[str, int, str], ...]:
    """How `_present` walks ``paths`` (each one's parent among them, ``""`` the model): ``(path, the position of its
    parent's step, -1 for the model itself, its own name)``, each parent before its children."""
    ordered = sorted(set(paths))  # a path sorts before the paths that extend it
    position = {path: index for index, path in enumerate(ordered)}
    return tuple((path, position[path.rpartition(".")[0]] if path else -1, path.rpartition(".")[2]) for path in ordered)


def _present(model: torch.nn.Module, steps: tuple[tuple[str, int, str], ...]) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(path, module)`` for each path of ``steps`` (`_walk_steps`) that still names a module of ``model`` (one may
    have been swapped). Walked through the registered children, each module once: run before every trace, where
    ``get_submodule`` costs 0.2 ms."""
    found: list[torch.nn.Module | None] = []
    for path, parent, name in steps:
        holder = found[parent] if parent >= 0 else None
        module = model if parent < 0 else holder._modules.get(name) if holder is not None else None
        found.append(module)
        if module is not None:
            yield path, module


#: The module of `parallel.runs.Runs`, the runs of an EP group (`MoeModelMixin._ep_runs`).
_RUNS_MODULE = "moelens.parallel.runs"

#: What the qualified name of transformers' expert-parallel dispatch wrapper contains.
EP_FORWARD = ".install_forward.<locals>.ep_forward"


def has_dispatch_forward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s instance forward is transformers' expert-parallel dispatch wrapper."""
    return EP_FORWARD in getattr(module.__dict__.get("forward"), "__qualname__", "")


def _expert_parallel_envoy(model: torch.nn.Module) -> type[Moe]:
    """The envoy class for MoE blocks: `Moe`, or for a model distributed with transformers'
    own expert parallelism (``DistributedConfig(ep_size=...)``, whose experts' forward is a
    dispatch wrapper) the one `moelens.parallel.transformers_ep` provides, after keeping
    those wrappers as nnsight's controller bodies. See docs/parallel.md.
    """
    if not any(has_dispatch_forward(module) for module in model.modules()):
        return Moe
    from .parallel.transformers_ep import keep_dispatch_forwards

    return keep_dispatch_forwards(model)


def _block_holders(structure: Structure) -> list[str]:
    """The paths of the layers' MLP modules that are no block themselves but hold MoE blocks (ernie4_5_vl_moe's)."""
    blocks = {*structure.moe_blocks, *structure.dense_blocks}
    parents = dict.fromkeys(name.rpartition(".")[0] for name in structure.moe_blocks)
    return [parent for parent in parents
            if parent not in blocks and layer_path(parent) == parent.rpartition(".")[0]]


def _blockless_layers(model: torch.nn.Module, structure: Structure) -> list[str]:
    """The paths of the decoder layers (of ``model.layers``) that hold no MoE block or dense MLP."""
    holding = {layer_path(name) for name in structure.moe_blocks + structure.dense_blocks}
    layers = model.get_submodule(structure.layers)
    count = len(layers) if hasattr(layers, "__len__") else 0
    return [path for path in (f"{structure.layers}.{i}" for i in range(count)) if path not in holding]


_MISSING = object()


def _instance_state(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any, Any]]:
    """Each module's own ``forward`` and nnsight state (``__nnsight__``) as they are before `wrap` (`_MISSING` where
    the module has none), so a wrap refused after nnsight put its forwards on the modules can take them off again."""
    return [(module, module.__dict__.get("forward", _MISSING), module.__dict__.get(NNSIGHT_STATE, _MISSING))
            for module in model.modules()]


def _restore_instance_state(state: list[tuple[torch.nn.Module, Any, Any]]) -> None:
    """Put back what `_instance_state` noted: a refused wrap leaves no nnsight forward, which a patch of the module's
    class would no longer reach, on a model no wrapper holds."""
    for module, forward, nnsight_state in state:
        for key, value in (("forward", forward), (NNSIGHT_STATE, nnsight_state)):
            if value is _MISSING:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = value


def _drop_stale_nnsight_state(model: torch.nn.Module) -> None:
    """Forget the nnsight state of a module whose wrapping stopped half-way (Ctrl-C in `wrap`, between nnsight storing
    the state and installing the forward that hands the module's calls to a trace): nnsight would keep the state,
    warn that ``forward`` was replaced and never serve the module again, in every later wrap and deep copy. A module
    whose ``forward`` something else replaced keeps it (nnsight's warning is right there)."""
    for module in model.modules():
        if NNSIGHT_STATE in module.__dict__ and "forward" not in module.__dict__:
            del module.__dict__[NNSIGHT_STATE]


def _bind(host: Any, alias: str, native: str) -> None:
    """Alias ``host.<native>`` as ``host.<alias>`` unless the name is taken."""
    if alias in host.__dict__ or hasattr(host._module, alias):
        return
    bind_alias(host, alias, native, envoy_at(host, native))


def _renamed_blocks(structure: Structure) -> dict[str, str]:
    """``{layer path: the block's name in it}`` of the layers whose MoE block or dense MLP is not called ``mlp``."""
    layers = {name: layer_path(name) for name in structure.moe_blocks + structure.dense_blocks}
    return {layer: name[len(layer) + 1:] for name, layer in layers.items()
            if layer is not None and layer != name and name[len(layer) + 1:] != "mlp"}


def _bind_standard_names(wrapped: Any, structure: Structure) -> None:
    """``model.layers`` and ``model.layers[i].mlp``, whatever the model calls them."""
    if structure.layers is not None and structure.layers != "layers":
        _bind(wrapped, "layers", structure.layers)
    for layer, name in _renamed_blocks(structure).items():
        _bind(envoy_at(wrapped, layer), "mlp", name)


def _instrument(moe: Moe) -> None:
    """Source-instrument what a Moe's values are read from, before any trace runs.

    A module's forward must be instrumented before it starts running for its
    ops to be served; doing it here means a trace can ask for any value at any
    time. Outside a trace the instrumented forwards run as the originals.
    """
    family = moe.family
    object.__setattr__(moe, INSTRUMENTED, {envoy.path: envoy._module for envoy in (moe, moe.router, moe.experts)})
    _require_op(moe.router, family.logits_op, family, "logits_op")
    if family.logits_cast_op:
        _require_op(moe.router, family.logits_cast_op, family, "logits_cast_op")
    scoring = moe.SCORING
    if scoring.selection_in:  # its own ops are instrumented in the trace (nnsight drills only there)
        _require_op(moe.router, scoring.selection_in, family, "scoring.selection_in")
        _require_method_op(moe.router._module, scoring.selection_in, scoring.selection_op, family)
    elif scoring.selection_op:
        _require_op(moe.router, scoring.selection_op, family, "scoring.selection_op")
    if family.experts_call and is_dispatching(moe.experts._module):
        moe.experts.source  # noqa: B018 - installs the experts' op handoffs
    if family.shared is not None and family.shared.gated_op:
        _require_op(moe, family.shared.gated_op, family, "shared.gated_op")


def _require_op(envoy: Any, op: str, family: Family, field: str) -> None:
    """Source-instrument ``envoy`` and check its forward has the op the family names."""
    try:
        names = envoy.source.names
    except SourceNotAvailable:
        raise FamilyError(
            f"family {family.name!r}: {field}={op!r} names an operation of {type(envoy._module).__name__}.forward, "
            "whose Python source cannot be read (a class defined at the interactive prompt, by exec or python -c): "
            "moelens reads a block's values at the operations of its source, so define the class in a file or "
            "module (a notebook cell will do) and import it."
        ) from None
    if op not in names:
        raise FamilyError(
            f"family {family.name!r}: {field}={op!r} is not an operation of "
            f"{type(envoy._module).__name__}.forward; its operations are {', '.join(names)}."
        )


def _require_method_op(router: torch.nn.Module, call: str, op: str, family: Family) -> None:
    """Check that ``call`` (``self_get_topk_indices_0``) calls a method of the router with Python source
    whose ops include ``op`` (numbered as nnsight numbers them)."""
    named = re.fullmatch(r"self_(\w+?)_\d+", call)
    method = getattr(type(router), named.group(1), None) if named else None
    try:
        names = op_names(method) if callable(method) else None
    except SourceNotAvailable:
        names = None
    if names is None:
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_in={call!r} is not a call of a method of "
            f"{type(router).__name__} with Python source (self.<method>(...)), where moelens reads selection_op."
        )
    if op not in names:
        raise FamilyError(
            f"family {family.name!r}: scoring.selection_op={op!r} is not an operation of "
            f"{type(router).__name__}.{named.group(1)}; its operations are {', '.join(names)}."
        )


def _refuse_no_generate(model: torch.nn.Module) -> None:
    """Refuse ``model.generate`` on a model with no ``generate`` (a base model, a classifier), saying what can."""
    if callable(getattr(model, "generate", None)):
        return
    if not isinstance(model, PreTrainedModel):  # a model of the user's own, with a head or not
        raise MoelensError(
            f"model.generate: {type(model).__name__} is no transformers model (no generate method to drive), so "
            "model.generate cannot run it: trace it a token at a time (append the argmax of "
            "model.output's last position to the ids and trace again), or build it as a transformers model with "
            "a language-model head."
        )
    raise MoelensError(
        f"model.generate: {type(model).__name__} has no language-model head, so it cannot generate: load the "
        "checkpoint with its head (AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language "
        "model) and wrap that; trace this one instead."
    )
