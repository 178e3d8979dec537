"""`Component`: the nnsight Envoy that moelens' MLP and MoE blocks are built on.

A component knows its family entry (what the block is), its layer index, and the
model it sits in. Each served value has a `Binding` (where it lives in the run);
the component builds them once and reads and writes values through
`served.read` / `served.write`, after checking the value can be served at all.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from functools import cached_property
from typing import Any, Iterable, Iterator

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from ..errors import MoelensError, OrderError, ValueUnavailable
from ..families import Family, registry
from ..families.entry import VALUE_NAMES, find_path
from ..modules import is_adapter_layer, is_modules_to_save, is_parameter_adapter, on_accelerator
from . import served as serving


def layer_of(path: str, root: torch.nn.Module | None = None) -> int | None:
    """The decoder layer index in a module path (relative to ``root``), or None when it has no integer component.

    With ``root``: the first index into a ``ModuleList`` on the way down (T5's ``encoder.block.3.layer.1`` is layer
    3, its block's sub-layer list aside; a sentence-transformers model's leading ``nn.Sequential`` index aside),
    else the last integer component (a model whose layers are an ``nn.Sequential``)."""
    found = _first_list_index(path, root) if root is not None else None
    if found is not None:
        return found[2]
    numbers = [part for part in path.split(".") if part.isdigit()]
    return int(numbers[-1]) if numbers else None


def layer_list_of(path: str, root: torch.nn.Module) -> tuple[str, int] | None:
    """The ``ModuleList`` whose index `layer_of` reads in ``path`` (relative to ``root``): its path and length
    (``("encoder.block", 6)`` for T5's ``encoder.block.3.layer.1``), or None where no list index is on the path."""
    found = _first_list_index(path, root)
    return found[:2] if found is not None else None


def _first_list_index(path: str, root: torch.nn.Module) -> tuple[str, int, int] | None:
    """The first index into a ``ModuleList`` on the way down ``path`` from ``root``: (the list's path, its length,
    the index), or None where there is none."""
    parent, walked = root, []
    for part in path.split("."):
        if parent is None:
            return None
        if part.isdigit() and isinstance(parent, torch.nn.ModuleList):
            return ".".join(walked), len(parent), int(part)
        walked.append(part)
        parent = parent._modules.get(part)
    return None


def replaced_modules(envoy: Envoy) -> list[str]:
    """The paths, on the way down to ``envoy`` and below it, whose module in the torch model is no longer the one
    their envoy wraps (``block.experts = new_module`` after wrapping; one set to None is not counted), or no longer
    the one moelens instrumented at wrap (`INSTRUMENTED`: ``block.router = new`` through the envoy, which follows)."""
    chain = [envoy]
    while chain[-1].parent is not None:
        chain.append(chain[-1].parent)
    root = chain[-1]
    wrapped = {checked.path: checked._module for checked in [*reversed(chain[1:]), *reversed(envoy.modules())]}
    wrapped.update(instrumented_record(envoy) or {})
    found = []
    for path, module in sorted(wrapped.items()):  # each module before those under it
        try:
            live = root._module.get_submodule(path.partition(".")[2])  # the root envoy's path is "model"
        except AttributeError:
            continue
        if live is not module and not any(path.startswith(f"{above}.") for above in found):
            found.append(path)  # the modules below a replaced one are named by it
    return found


def refuse_replaced(envoy: Envoy, replaced: list[str], where: str, consequence: str, error: type[Exception]) -> None:
    """Raise ``error`` saying ``where`` meets the modules at the paths ``replaced`` (none: nothing) of the model
    ``envoy`` belongs to, which are no longer the ones moelens wrapped, with ``consequence`` and `rewrap_advice`.
    Where each is a PEFT parameter adapter put on after wrapping (the module wrapped runs beneath it, so
    ``consequence`` does not hold), says so and to wrap again."""
    live = [_live(envoy, path) for path in replaced]
    if live and all(map(is_parameter_adapter, live)):
        raise error(f"{where}: PEFT put adapters on the parameters of {', '.join(replaced)} after moelens.wrap "
                    f"(LoRA: {', '.join(sorted({type(module).__name__ for module in live}))} standing "
                    "there now), which the model as wrapped does not know of. Wrap the model again, "
                    "moelens.wrap(model._module), to serve the block's adapted values (reading or editing the weights "
                    "themselves then needs the adapters merged: merge_and_unload()).")
    if replaced:
        raise error(f"{where}: {', '.join(replaced)} {'is' if len(replaced) == 1 else 'are'} no longer the module this "
                    "model was wrapped with (replaced or removed after moelens.wrap, as moelens.compress.tomoe("
                    f"model._module, inplace=True) replaces the layers it converts): {consequence}. "
                    f"{rewrap_advice(envoy, replaced)}")


def rewrap_advice(envoy: Envoy, replaced: list[str]) -> str:
    """What to do about the modules at the paths ``replaced`` of ``envoy``'s model: wrap the model again, or, where a
    PEFT module stands there that wrapping again would refuse too (`_adapter_layers_at`), merge the adapters first."""
    adapted = _adapter_layers_at(envoy, replaced)
    if not adapted:
        return "Wrap the model again: moelens.wrap(model._module)."
    lora = any("adapter layer" in what for what in adapted.values())
    return (f"{', '.join(f'{path} is now {what}' for path, what in adapted.items())}, which moelens cannot read and "
            "wrap refuses too" + (" (LoRA on a router that is a Linear itself, as llama4's and phimoe's are)"
                                  if lora else "") + ": merge the adapters into the weights and wrap the result, "
            "moelens.wrap(peft_model.merge_and_unload()).")


def _adapter_layers_at(envoy: Envoy, paths: list[str]) -> dict[str, str]:
    """Those of ``paths`` (envoy paths, "model.<module path>") where the torch model of ``envoy``'s wrapped model now
    holds what wrapping again would refuse (`discovery`): a PEFT adapter layer standing for an MoE block's router or
    experts other than parameter adapters (LoRA's ``Linear`` on a router that is one), or a PEFT modules_to_save
    wrapper. Parameter adapters (LoRA on their own parameters), and an adapter layer elsewhere (on a shared expert's
    or its gate's Linear), wrap again as they are, so they are not counted."""
    from .moe import Moe  # which imports this module

    root = envoy
    while root.parent is not None:
        root = root.parent
    parts = {f"{moe.path}.{getattr(moe.family, part)}": part for moe in getattr(root, "moes", None) or []
             if isinstance(moe, Moe) for part in ("router", "experts")}
    adapted = {}
    for path in paths:
        live = _live(root, path)
        if live is None:  # removed
            continue
        if is_modules_to_save(live):
            adapted[path] = f"a PEFT modules_to_save wrapper ({type(live).__name__})"
        elif is_adapter_layer(live) and not is_parameter_adapter(live) and path in parts:
            adapted[path] = f"a PEFT adapter layer ({type(live).__name__}) on its block's {parts[path]}"
    return adapted


def _live(envoy: Envoy, path: str) -> torch.nn.Module | None:
    """The module at envoy path ``path`` ("model.<module path>") in the torch model of ``envoy``'s wrapped model now,
    or None where there is none (removed)."""
    root = envoy
    while root.parent is not None:
        root = root.parent
    try:
        return root._module.get_submodule(path.partition(".")[2])  # the root envoy's path is "model"
    except AttributeError:
        return None


def replaced_blocks(envoy: Envoy) -> list[str]:
    """`replaced_modules` of ``envoy`` (the wrapped model, or a block) that are a block moelens serves (a `Moe` or
    `Mlp` component) or hold one, or lie under an MoE block outside its shared expert (its router, its experts): not
    the others (a PEFT adapter on an attention or MLP projection, an lm_head resized), which no block's routing
    depends on."""
    from .mlp import Mlp  # which imports this module
    from .moe import Moe

    blocks = [module for module in envoy.modules() if isinstance(module, Mlp)]
    moes = [block.path for block in blocks if isinstance(block, Moe)]
    inner = [block.path for block in blocks if not isinstance(block, Moe)]  # dense MLPs, shared experts

    def routing(path: str) -> bool:
        return (any(path == block.path or block.path.startswith(f"{path}.") for block in blocks)
                or any(path.startswith(f"{moe}.") for moe in moes) and not any(path.startswith(f"{mlp}.") for mlp in inner))

    # a block given to an MoE block's envoy after wrapping (``model.layers[1].mlp = nn.Identity()``): its envoy wraps
    # the live module, so `replaced_modules` finds nothing, but model.moes still lists the path as an MoE block
    swapped = [block.path for block in getattr(envoy, "moes", None) or [] if not isinstance(block, Moe)]
    return [*swapped, *(path for path in replaced_modules(envoy) if routing(path) and path not in swapped)]


def put_in_after_wrap(block: Envoy) -> bool:
    """Whether ``block``, a `Moe`, was given to its envoy after wrapping (moelens never instrumented it, so its
    router's values are never produced: `Component._never_produced`)."""
    return bool(getattr(block, "INSTRUMENTED_AT_WRAP", False)) and instrumented_record(block) is None


def replaced_since_wrap(block: Envoy) -> list[str]:
    """`replaced_modules` of ``block``, or the block itself where it was given to its envoy after wrapping
    (`put_in_after_wrap`): what a block's repr names as replaced."""
    return replaced_modules(block) or ([block.path] if put_in_after_wrap(block) else [])


def instrumented_record(envoy: Envoy) -> dict[str, Any] | None:
    """``envoy``'s `INSTRUMENTED` record: its own, or, for an envoy nnsight made anew after wrapping (a block's envoy
    given a module), the one kept at wrap for its path where its module is the very one instrumented there (the
    original block given back: its forward is still instrumented, and its values are served); None for a module
    moelens never instrumented."""
    own = envoy.__dict__.get(INSTRUMENTED)
    if own is not None:
        return own
    root = envoy
    while root.parent is not None:
        root = root.parent
    record = root.__dict__.get(INSTRUMENTED_BLOCKS, {}).get(envoy.path)
    if record is None or record.get(envoy.path) is not envoy._module:
        return None
    object.__setattr__(envoy, INSTRUMENTED, record)  # adopted: this envoy wraps the instrumented block
    return record


#: The attribute of a component holding ``{path: module}``: the modules moelens instrumented at wrap
#: (`replaced_modules`).
INSTRUMENTED = "_instrumented_modules"
#: The attribute of the wrapped model's root envoy holding ``{block path: the block's INSTRUMENTED record}``
INSTRUMENTED_BLOCKS = "_instrumented_blocks"


def envoy_at(envoy: Envoy, path: str) -> Envoy:
    """The envoy of the module at dotted module ``path`` below ``envoy``.

    Walks the modules' own names, so a child named like an nnsight attribute (BERT's
    ``attention.output``, which nnsight serves under another name) is found too; ``envoy.get``
    would read the attribute instead.
    """
    for part in path.split(".") if path else ():
        children = envoy._child_map
        envoy = children[part] if part in children else getattr(envoy, part)
    return envoy


def bind_alias(host: Envoy, alias: str, native: str, target: Envoy) -> None:
    """Serve ``target``, the envoy at ``native`` below ``host``, as ``host.<alias>`` too (a standard name, noted in
    `STANDARD_NAMES`: nnsight's own ``_aliases`` also hold its renames and shared modules' paths)."""
    object.__setattr__(host, alias, target)  # as a plain attribute: no check or hook of a setattr applies
    host._aliases[alias] = native
    if STANDARD_NAMES not in host.__dict__:
        object.__setattr__(host, STANDARD_NAMES, {})
    host.__dict__[STANDARD_NAMES][alias] = native


#: The attribute of an envoy holding ``{standard name: the family's own name}`` (`bind_alias`).
STANDARD_NAMES = "_standard_names"


class StandardNames:
    """What a host of standard names (`bind_alias`: a `Component`, a decoder layer, the wrapped model) does on a
    setattr: refuse a module given to one (``moe.router = new``, ``model.layers = new``), which nnsight would add
    beside the child the name serves, never called by the model; and any other value, which would only hide it."""

    def __setattr__(self, name: str, value: Any) -> None:
        native = None if name.startswith("_") else self._standard_native(name)
        if native is not None and isinstance(value, torch.nn.Module):
            raise MoelensError(
                f"{self.path}.{name} is moelens' name for {native!r}; a module given to it would be added beside "
                f"{native!r}, which the model goes on calling. Replace {native!r} itself, where the model keeps it, "
                "and wrap the model again (moelens.wrap)."
            )
        if native is not None:
            raise MoelensError(
                f"{self.path}.{name} is moelens' name for {native!r} and is read only: setting it would hide that "
                f"module from the name and change nothing in the model. Set what you meant on the module itself "
                f"({self.path}.{name}._module.<attribute>)."
            )
        super().__setattr__(name, value)

    def _standard_native(self, name: str) -> str | None:
        """The model's own name of the child moelens serves as ``name`` (a standard name, `bind_alias`), or None."""
        return self.__dict__.get(STANDARD_NAMES, {}).get(name)

    def __repr__(self) -> str:
        """nnsight's tree, with each standard name that serves a module deeper down (``model.layers`` for
        ``model.model.layers``) as one line naming it: nnsight prints such a name's whole tree again."""
        deeper = {alias: native for alias, native in self.__dict__.get(STANDARD_NAMES, {}).items() if "." in native}
        aliases = self._aliases
        shown = {alias: native for alias, native in aliases.items() if alias not in deeper}
        object.__setattr__(self, "_aliases", shown)
        try:
            tree = super().__repr__()
        finally:
            object.__setattr__(self, "_aliases", aliases)
        if not deeper or not tree.endswith("\n)"):
            return tree
        lines = "".join(f"\n  ({alias}): the same as {self.path}.{native}" for alias, native in deeper.items())
        return tree[:-2] + lines + "\n)"


def refuse_lost_setting(envoy: Envoy, name: str, value: Any) -> bool:
    """Refuse ``envoy.<name> = value`` where the user meant the module's attribute: nnsight keeps a value that is no
    module on the envoy, which reads it back while the model goes on with its own. Refused: a name the module has
    (``moe.router.top_k = 1``), or one close to a name the module or the envoy has (a typo: ``moe.router.topk``). A
    name of the envoy's own (a value written in a trace, ``.output``), a private one and a module given (nnsight adds
    it to the model) pass; so do settings while nnsight builds the envoy. True where ``value`` is the module's own
    attribute already (an augmented assignment that edited it in place, ``moe.router.weight *= 0.5``): the model has
    it, and nothing is to be set."""
    if name.startswith("_") or isinstance(value, torch.nn.Module) or "_child_map" not in envoy.__dict__ \
            or name in envoy.__dict__ or inspect.getattr_static(type(envoy), name, None) is not None:
        return False
    module = envoy._module
    if hasattr(module, name):
        if isinstance(value, torch.Tensor) and getattr(module, name) is value:
            return True
        raise MoelensError(
            f"{envoy.path}.{name} = ... would set an attribute of moelens' envoy, not of the model's "
            f"{type(module).__name__}, which goes on with its own {name}: set it on the module "
            f"({envoy.path}._module.{name} = ...); for weights, edit moe.params() or write a value in a trace."
        )
    names = {attribute for attribute in (*dir(type(envoy)), *dir(module)) if not attribute.startswith("_")}
    near = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.85)
    if near:
        raise MoelensError(
            f"{envoy.path} has no attribute {name!r} (did you mean {near[0]!r}?): setting it would only add an "
            "attribute to moelens' envoy and change nothing in the model."
        )
    return False


class PartEnvoy(Envoy):
    """The envoy of a block's router, experts or shared expert (``moe.router``, ``moe.experts`` ...): a setting meant
    for its module (``moe.router.top_k = 1``) is refused (`refuse_lost_setting`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not refuse_lost_setting(self, name, value):
            super().__setattr__(name, value)


def guard_part(envoy: Envoy) -> None:
    """Make ``envoy``, nnsight's plain envoy of a block's part, a `PartEnvoy` (which adds only the setattr check).
    Set on the built envoy, not through nnsight's ``envoys=`` map: that map is matched against every module's path,
    key by key, and a key per part made wrapping a 48-layer model 70% slower. An envoy of the user's class is kept."""
    if type(envoy) is Envoy:
        envoy.__class__ = PartEnvoy


def _declared_by_moelens(component_class: type, name: str) -> bool:
    """Whether the first class in ``component_class``'s MRO that declares ``name`` is one of moelens'."""
    owner = next((cls for cls in component_class.__mro__ if name in vars(cls)), None)
    return owner is not None and owner.__module__.startswith("moelens.")


def with_suggestion(error: AttributeError, name: str, names: Iterable[str]) -> AttributeError:
    """``error`` (a missing attribute ``name``), saying which of ``names`` was probably meant, if one is close
    (Jupyter shows no "did you mean" of its own)."""
    near = [] if name.startswith("_") else difflib.get_close_matches(name, sorted(set(names) - {name}), n=1, cutoff=0.8)
    return AttributeError(f"{error} (did you mean {near[0]!r}?)") if near else error


@functools.cache
def value_names(component_class: type) -> tuple[str, ...]:
    """The values a component class serves (its `served` descriptors)."""
    return tuple(name for name in dir(component_class)
                 if isinstance(inspect.getattr_static(component_class, name), serving.served))


def router_on_accelerator(component: Any) -> bool:
    """Whether ``component``'s router holds its weights on an accelerator, where a router may compute its logits with
    a kernel of its own instead of the op moelens reads (`Family.logits_skipped`: kolibri1's CUDA ``torch.mm``)."""
    router = find_path(component._module, component.family.router) if component.family else None
    return isinstance(router, torch.nn.Module) and on_accelerator(router)


#: What to do instead of setting a block's read-only attribute, where it is not the general `READ_ONLY_REMEDY`.
READ_ONLY_REMEDIES = {
    "top_k": "set the model's own (moe.router._module.top_k = 1 in most families; moe.family.top_k names where "
             "the family keeps it), or edit the routing in a trace (moelens.keep_top)",
    "experts_implementation": "switch the model's with model.set_experts_implementation(\"grouped_mm\") (or "
                              "\"batched_mm\", \"eager\")",
    "num_experts": "edit the experts' weights (moe.params()) or the routing in a trace (moelens.ablate): the "
                   "number of experts is the model's",
}
READ_ONLY_REMEDY = ("set the model's own attribute on its module (moe.router._module.top_k = 1), edit its values in a "
                    "trace or its weights (moe.params())")


class Component(StandardNames, Envoy):
    """Base of moelens' block envoys: family, layer, and checked value access."""

    #: Whether wrap instruments this kind of block (`INSTRUMENTED`): one without the record was put in after it.
    INSTRUMENTED_AT_WRAP = False

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_family", registry.for_block(module))  # before nnsight's setattrs of the children
        super().__init__(module, *args, **kwargs)

    @property
    def family(self) -> Family | None:
        """The family entry describing this block (None for a dense MLP of an unknown family)."""
        return self._family

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            raise with_suggestion(error, name, (*VALUE_NAMES, *value_names(type(self)), "selection_scores")) from None

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse a new attribute named like a value (``moe.router_logit = ...``): it would write nothing; and a module
        given to a standard name (``moe.router = new``, `StandardNames`), which would add a module the block never
        calls); and a setting of a read-only one (``moe.layer = 2``), which would leave the model as it is and make
        moelens misplace the block."""
        declared = inspect.getattr_static(type(self), name, None)
        if (isinstance(declared, cached_property) or (type(declared) is property and declared.fset is None)) \
                and _declared_by_moelens(type(self), name):  # nnsight's own (source, device) raise as Python does
            raise MoelensError(
                f"{self.path}.{name} is read only: moelens reads it from the model. To change what the block does, "
                f"{READ_ONLY_REMEDIES.get(name, READ_ONLY_REMEDY)}; for another block, take that block (model.moes[i], "
                "model.layers[i].mlp)."
            )
        if not name.startswith("_") and name not in self.__dict__ and declared is None:
            near = difflib.get_close_matches(name, value_names(type(self)), n=1, cutoff=0.85)
            if near:
                raise MoelensError(
                    f"{self.path} serves no value {name!r} (did you mean {near[0]!r}?): setting it would only add an "
                    f"attribute to the envoy and change nothing in the model."
                )
        if not refuse_lost_setting(self, name, value):
            super().__setattr__(name, value)

    def modules_down(self) -> Iterator[torch.nn.Module]:
        """The wrapped model's module, then each module on the path down to this block's (the block's last); only the
        block's once the wrapped model is gone (its envoys hold their parents weakly)."""
        root = self.root
        module = root._module
        yield module
        for part in filter(None, self.path[len(root.path):].split(".")):
            module = getattr(module, part)
            yield module

    @cached_property
    def layer(self) -> int | None:
        """Index of the decoder layer this block belongs to (`layer_of`: its index in the first module list of its
        path, else the last integer in its path)."""
        return layer_of(self.path.partition(".")[2], self.root._module)

    @cached_property
    def runs_before_expansion(self) -> bool:
        """Whether the block sits outside the model's decoder (``get_decoder()``): in an encoder-decoder model's
        encoder or a vision-language model's vision tower, which ``generate`` runs on the prompts before it repeats
        each prompt's row for beams or several returned sequences (the decoder runs on those)."""
        model = self.root._module
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            return False
        if not isinstance(decoder, torch.nn.Module) or decoder is model:
            return False
        return not any(module is self._module for module in decoder.modules())

    @property
    def model(self) -> Envoy:
        """The wrapped model this component sits in (the root envoy)."""
        return self.root

    # -- value access ------------------------------------------------------------

    def _binding(self, name: str) -> serving.Binding:
        """Where ``name`` lives in the run; raises `ValueUnavailable` when it cannot be served."""
        raise NotImplementedError

    def _read(self, descriptor: serving.served, keep_open: bool = True, binding: serving.Binding | None = None) -> Any:
        """``descriptor``'s value in this run (``keep_open``: see `serving.read`; ``binding``: its binding, where the
        caller resolved it in this trace already)."""
        return serving.read(self, descriptor, binding or self._bound(descriptor.name), keep_open)

    def _write(self, descriptor: serving.served, value: Any) -> None:
        serving.write(self, descriptor, self._bound(descriptor.name), value)

    def _check_call(self, name: str) -> None:
        """Raise `ValueUnavailable` when the running call of this component cannot serve ``name`` (asked as the
        model reaches it, before a read is cut or a write is placed); every call can, unless a component says."""

    def _bound(self, name: str) -> serving.Binding:
        """``name``'s binding, in a trace (a value this block cannot serve says why, in a trace or not)."""
        binding = self._binding(name)
        self._require_trace(name)
        return binding

    def _require_trace(self, name: str, asked: str | None = None) -> None:
        """Raise `ValueUnavailable` when ``name`` is asked for outside a trace (values exist only in a run);
        ``asked`` says what asked for it in the error (default ``<path>.<name>``, built only for an error)."""
        try:
            mediator = Mediator.current(name)
        except ValueError:
            raise ValueUnavailable(
                f"{asked or f'{self.path}.{name}'}: a block's values exist only while the model runs; use them inside "
                "a trace that runs it on an input (with model.trace(inputs): ..., or model.generate / model.scan; "
                "in a model.session(), inside one of its traces). A trace given no input runs the model only for its "
                "invokes: read the values inside a tracer.invoke(inputs) block." + (f" What it means: help(type(block).{name})." if asked is None else "")
            ) from None
        if mediator.interleaver is not None and mediator.interleaver is not self.interleaver:
            if serving.in_backward_block():
                raise ValueUnavailable(
                    f"{asked or f'{self.path}.{name}'}: asked for inside a `with loss.backward():` block, which "
                    "serves only gradients: bind the value before the block, in a trace of its model (logits = "
                    "moe.router_logits), read its gradient inside it (logits.grad), and intervene before it."
                )
            if self.interleaver.interleaving:
                raise ValueUnavailable(
                    f"{asked or f'{self.path}.{name}'}: asked for inside the trace of another model, nested in this "
                    "model's trace, whose body serves that model's values only: bind this model's values before the "
                    "nested trace (logits = moe.router_logits) and intervene there, or run the two traces one after "
                    "the other."
                )
            raise ValueUnavailable(  # nnsight would serve the running model's module of the same path instead
                f"{asked or f'{self.path}.{name}'}: this block belongs to another wrapped model than the one this "
                "trace runs; read and edit a model's blocks inside a trace of that model (two models: one trace each)."
            )

    def _order(self) -> tuple[str, ...]:
        """The values this component serves, in the order the model produces them."""
        return ()

    def _never_produced(self, name: str) -> OrderError | None:
        """The error of a read nnsight could not serve because the model never reaches where ``name`` is read:
        modules replaced after wrapping, or a router that skipped the op of its logits (`Family.logits_skipped`, a
        branch only an accelerator under no_grad takes); None where it does reach it."""
        location = self._location_of(name)
        replaced = [path for path in replaced_modules(self) if location is None or location.startswith(f"{path}.")]
        if not replaced and self.INSTRUMENTED_AT_WRAP and instrumented_record(self) is None:
            replaced = [self.path]  # a block put in through its envoy after wrapping: moelens never instrumented it
        if replaced:  # nnsight's envoys watch the modules they wrapped: the model runs the new ones unseen
            return OrderError(
                f"{self.path}.{name} was never produced: {', '.join(replaced)} "
                f"{'is no longer the module' if len(replaced) == 1 else 'are no longer the modules'} this model was "
                "wrapped with (replaced after moelens.wrap, in the torch model or through its envoy), so nnsight does "
                f"not see it run. {rewrap_advice(self, replaced)}"
            )
        skipped = getattr(self.family, "logits_skipped", "")
        if (skipped and location is not None and f".source.{self.family.logits_op}." in location
                and not torch.is_grad_enabled() and router_on_accelerator(self)):  # else a plain order mistake
            return OrderError(f"{self.path}.{name} was never produced: {self.family.name}'s router skips "
                              f"{self.family.logits_op}, where moelens reads its logits, {skipped}.")
        return None

    def _skipped_error(self, name: str, location: str) -> OrderError:
        """The error of a read of ``name`` at ``location`` pinned to a ``tracer.iter`` step (or outside one, the
        first) that the op's visits no longer line up with (`serving.request_step`, `serving.served_late`): the module
        running it was skipped with ``.skip()`` at an earlier step, or a module holding it (the block, its decoder
        layer) was, or did not reach it at each (unless `_never_produced` finds the model never reaches it)."""
        never = self._never_produced(name)
        if never is not None:
            return never
        module = serving.module_of(location)
        mediator, holders = Mediator.current(location), serving.holders_of(location, self.path)
        if mediator.occurrence(holders[-1]) < mediator.occurrence(holders[0]):  # its layer ran calls it missed
            return _steps_apart(OrderError(
                f"{self.path}.{name} cannot be served at this step: {module} did not run at an earlier step of this "
                "generation (it or a module holding it, such as the block or its decoder layer, was skipped with "
                ".skip() there, or it does not run at every step), so nnsight's count of its runs no longer lines up "
                "with the steps and a read pinned to this step would get a later step's value. Skip by writing the "
                "value instead of calling .skip() (layer.output = ..., moe.mlp_output = ...): the modules then run "
                "and keep counting."
            ))
        return _steps_apart(OrderError(
            f"{self.path}.{name} cannot be served at this tracer.iter step: {module} was skipped with .skip() at an "
            f"earlier step of this generation (or at this one, by another invoke: a skip is the whole batch's), which "
            f"bypasses its forward, so {location.rpartition('.')[0]}, where "
            f"moelens reads {name}, ran fewer times than {module}: nnsight counts each op's runs, so the op's steps no "
            "longer line up and a read pinned to this step would get a later step's value. Read the module's own "
            "input or output at such steps instead (moe.router.output, or routed_output for the experts), or skip by "
            "writing the value instead of calling .skip() (moe.router_logits = ..., moe.routed_output = ..., or "
            "module.output = ...): the module then runs and its ops keep counting."
        ))

    def _order_error(self, name: str, by: str = "", step_passed: bool = False) -> OrderError:
        """The error of a read nnsight could not serve: the model never reaches where it is read
        (`_never_produced`), else the order. ``by``: the call that asked for the value, the block's ``save_all`` or
        ``model.save_all``, whose advice replaces a single read's; "" for a read of the value itself.
        ``step_passed``: the read asked for a generation step the model had already run (`serving.fetch`)."""
        never = self._never_produced(name)
        if never is not None:
            return never
        never_ran = self._never_ran()
        if never_ran is not None:
            return OrderError(f"{self.path}.{name} was not served: {never_ran}")
        order = " -> ".join(self._order())
        runs_only_on = self.runs_only_on
        maybe_idle = (  # either cause may hold: whether the block ran in this trace is not known here
            f"{self.path}.{name} was not served: either the block did not run (it runs only on {runs_only_on}, so "
            "an input without them does not run it: read it in a trace whose input has them), or: "
            if runs_only_on else ""
        )
        registered = (
            f" Family {self.family.name!r} is a registered entry: when save_all() or this order fails, the order "
            "the entry gives (shared.when) is not the one the block's forward runs; fix the entry."
            if self.family is not None and self.family.shared is not None and not registry.is_built_in(self.family)
            else ""
        )
        if by:
            whole = by == "model.save_all"
            asked = f"model.save_all() could not read {self.path}.{name}" if whole else \
                f"{self.path}.save_all() could not read {name}"
            after = ("pass moes= with only the blocks after the one that read or intervention is on, and read that "
                     "block with its own save_all, passing values= with only the values after it" if whole else
                     "pass values= with only the values after it")
            what = (f"{asked}: the model had already run past it when {by}() asked for it, moved on by a read or an "
                    "intervention earlier in this trace (moelens.ablate / steer / force write values). Call "
                    f"{by}() before that read or intervention, or {after} (in the order the model produces them: "
                    f"{order}).")
        else:
            save_all = "; or save everything at once with save_all()" if hasattr(self, "save_all") else ""
            what = (f"{self.path}.{name} was requested after the model had already run past it. Within a block, read "
                    f"values in the order the model produces them ({order}), and blocks in layer order{save_all}. An "
                    "intervention moves the model on as a read does (moelens.steer, force, ablate write values of "
                    "their block): call it after the reads of earlier values and blocks.")
        error = OrderError(f"{maybe_idle}{what}{self._steps_hint(step_passed)} A module skipped with .skip() never "
                           f"produces its values.{registered}")
        error.step_passed = step_passed  # for the errors made of it (save_all's, router_probs')
        return error

    def _never_ran(self) -> str | None:
        """Why this block never ran in a run that is over, read by `_order_error`: the run was stopped before it
        (``tracer.stop()``, in any invoke), or the model's forward returned without calling it (a module holding it
        skipped); None where it ran, or may still run, or runs only on some inputs (its own error says so)."""
        try:
            mediator = Mediator.current(self.path)
        except ValueError:
            return None
        if mediator.occurrence(f"{self.path}.input") or self.runs_only_on:
            return None
        # the forwards of the outermost module that ran (the root's; a whole Qwen3-Omni model's generate runs its
        # thinker, never the root's own forward): none ended, the run was stopped before this block
        if not serving.forwards_ended(mediator, f"{self.path}.input"):
            return (f"the run was stopped (tracer.stop()) before the model reached {self.path}. A stop ends the run "
                    "of every invoke of the trace, not only its own: stop after the last module any invoke reads, "
                    "or read this block in a trace without the stop.")
        return (f"{self.path} did not run in this trace: a module holding it (its decoder layer) was skipped with "
                ".skip(), which bypasses its forward. Read the skipped module's output instead, or skip by writing "
                "its output (layer.output = ...), which runs it.")

    @staticmethod
    def _steps_hint(step_passed: bool) -> str:
        """For `_order_error` of a read that asked for a generation step the model had run (``step_passed``): how
        reads pick their step; "" for others."""
        if not step_passed:
            return ""
        return (" In a run of several steps (generate), a read outside a tracer.iter loop asks for step 0 and one in "
                "tracer.iter[i] for step i: a read after a loop over later steps, or a loop over a step an earlier "
                "loop has passed, asks for a step the model has already run; make it in its step's loop (or before "
                "the loops).")

    def _location_of(self, name: str) -> str | None:
        """Where ``name`` is read in the run (`Binding.location`), None where that cannot be told."""
        try:
            return self._binding(name).location
        except (MoelensError, KeyError):
            return None

    @property
    def runs_only_on(self) -> str | None:
        """The tokens this block runs on when it does not run on every input (the family's ``runs_only_on``), else None."""
        return self.family.runs_only_on.get(self.path.rsplit(".", 1)[-1]) if self.family is not None else None

    def unavailable(self, name: str, reason: str, remedy: str = "") -> ValueUnavailable:
        """The error for a value this block cannot serve: what, why, and what to do."""
        why = f"{reason}. {remedy[:1].upper()}{remedy[1:]}" if remedy else reason + "."
        return ValueUnavailable(f"{self.path}.{name} cannot be served: {why}", why=why)


def _steps_apart(error: OrderError) -> OrderError:
    """``error``, marked as refusing a read whose op's visits no longer line up with the generation's steps (a module
    skipped at an earlier step), not one the model had run past: `Moe.save_all` keeps it, with no advice of its own."""
    error.steps_apart = True
    return error
