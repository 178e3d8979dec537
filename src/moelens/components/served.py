"""Served values: how a component reads and writes one value inside a trace.

A `Binding` (`binding`) says where a value lives in the run and how a write to it is checked
(`write_checks`). `served` is the descriptor a component class declares per value; reading it
runs `read`, writing it runs `write`.

Reads are token views (see `tokens`): this invoke's ``[batch, seq, ...]``, a view
of the model's tensor where one exists, so in-place edits land. Every read also
leaves a write-back with nnsight (`Mediator.transform`) that runs when the
intervention moves on: it checks in-place edits (an index out of range, a NaN)
before the model consumes them, and copies an edited non-view back; one with
nothing edited is dropped when the next value is read (`settle_open_reads`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, Mapping, NamedTuple, TypeVar, overload

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from nnsight.intervention.batching import Batcher
from nnsight.intervention.eproperty import WriteBack, eproperty
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from transformers.generation.utils import (GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput,
                                         GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput)

from ..errors import FamilyError, MoelensError, OrderError, ValueUnavailable, WriteError
from ..scalars import bool_in
from . import tokens
from .binding import ANY_INF, FLOAT, Binding, dict_output
from .implementations import runs_torch_a2a
from .run_owner import MoeInterleaver
from .write_checks import READ_VERSION, check_not_recomputed, check_write, model_values, refuse_under_vmap

if TYPE_CHECKING:
    from .base import Component


if TYPE_CHECKING:  # what a type checker sees: a value of the stub's return type, read and written by name
    _Value = TypeVar("_Value")

    class served(Generic[_Value]):
        def __init__(self, stub: Callable[[Any, Any], _Value]) -> None: ...
        @overload
        def __get__(self, obj: None, owner: Any = None) -> "served[_Value]": ...
        @overload
        def __get__(self, obj: object, owner: Any = None) -> _Value: ...
        def __get__(self, obj: Any, owner: Any = None) -> Any: ...
        def __set__(self, obj: object, value: Any) -> None: ...
else:
    class served(eproperty):
        """A value a component serves; declare one per value on the component class.

        The docstring of the decorated stub is the value's documentation (what it
        means, where it is read, what a write does); the stub's body is not run.
        """

        def __init__(self, stub: Callable) -> None:
            super().__init__(key=stub.__name__, description=(stub.__doc__ or "").strip().split("\n")[0])
            self(stub)

        def __get__(self, obj: "Component | None", owner: Any = None) -> Any:
            if obj is None:
                return self
            return obj._read(self)

        def __set__(self, obj: "Component", value: Any) -> None:
            obj._write(self, value)


@contextmanager
def order_errors(pinned: int | None, on_order_error: Callable[[], Exception]) -> Iterator[None]:
    """Re-raise nnsight's out-of-order error for a request as ``on_order_error()``.

    nnsight reports a request the model had already run past only when the run
    ends; the moelens error names the right order. A request from inside a
    ``tracer.iter`` loop for a step the run did not make is how an open loop
    ends, so nnsight's own error goes through untouched (it turns it into a
    warning); see `_reraise`. ``pinned``: the mediator's ``iteration`` as the
    request was made.
    """
    try:
        yield
    except OutOfOrderError as error:
        _reraise(error, pinned, on_order_error)


def _reraise(error: OutOfOrderError, pinned: int | None, on_order_error: Callable[[], Exception]) -> None:
    """`order_errors`' rule: nnsight's error for a request pinned to a ``tracer.iter`` step after the first (a step
    the run did not make: how an open loop ends), else ``on_order_error()``. A request nnsight no longer pins
    (``iteration`` None: later in a step, after its first value was served) that the run ended without serving was
    made after the model had run past it in the last step the run made.

    ``pinned``: the mediator's ``iteration`` as the request was made, not as it failed: the request first lands the
    write-back an in-place edit at the step before left waiting (nnsight's ``Mediator.flush``), and serving that
    relaxes the pin (``iteration`` None), though the request still asks for the pinned step."""
    if pinned not in (0, None):
        raise error
    raise on_order_error() from None  # says it all: nnsight's error (an internal op path) would head the traceback


def trace_running(asker: str) -> bool:
    """Whether the intervention code of a running trace is calling (nnsight's mediator is set); ``asker`` names the
    caller to nnsight."""
    try:
        Mediator.current(asker)
    except ValueError:
        return False
    return True


def request(location: str, on_order_error: Callable[[], Exception]) -> Any:
    """Park until the model reaches ``location`` and return what is served there (see `order_errors`)."""
    return _request(Mediator.current(location), location, on_order_error)


def _request(mediator: Mediator, location: str, on_order_error: Callable[[], Exception]) -> Any:
    """`request` for the worker of ``mediator`` (a caller that holds it already)."""
    pinned = mediator.iteration  # as asked (see `_reraise`)
    if pinned and visit_passed(mediator, location, pinned):
        raise on_order_error()
    try:  # not `with order_errors(...)`: a request per value read, and a context manager costs more
        return Mediator.value(location)
    except OutOfOrderError as error:
        _reraise(error, pinned, on_order_error)


def visit_passed(mediator: Mediator, location: str, pinned: int) -> bool:
    """Whether a request pinned to a ``tracer.iter`` step (``pinned`` > 0) asks for a visit of ``location`` the model
    has already made, in a step the run has reached: nnsight serves a pinned request only at that visit, so it would
    wait for the run's end and end the loop with the warning of a step the run did not make (its value never set,
    the code after the loop not run). (A loop at a step the run did not reach is an open loop's end.)"""
    return mediator.occurrence(location) > pinned and forwards_ended(mediator, location) >= pinned


def _module_running(location: str) -> str | None:
    """The module whose forward runs the op at ``location`` (``<module>.source.<op>...``), None for a location on a
    module itself."""
    module, drilled, _ = location.partition(".source.")
    return module if drilled else None


def module_of(location: str) -> str:
    """The module whose forward runs the op at ``location``, or whose input or output ``location`` is."""
    return _module_running(location) or location.rpartition(".")[0]


def skipped_visits(mediator: Mediator, location: str) -> int:
    """How many finished calls of the module whose forward runs the op at ``location`` never reached that op, counted
    for ``mediator``'s run: the module's finished calls less the op's visits. Above 0 where the module was skipped
    (nnsight's ``.skip()`` bypasses its forward, so its ops go uncounted, while its ``.input`` and ``.output`` count
    as any call's); 0 or less where they line up, and for a location on a module itself."""
    module = _module_running(location)
    return 0 if module is None else mediator.occurrence(f"{module}.output") - mediator.occurrence(location)


def generating(mediator: Mediator) -> bool:
    """Whether ``mediator``'s run is a ``generate`` (several forwards: the steps of ``tracer.iter``)."""
    run = RUNS.get(mediator.interleaver)
    return run is not None and run.generating


def forwards_ended(mediator: Mediator, location: str) -> int:
    """How many forwards of the whole model (generation steps) have ended in ``mediator``'s run so far: the visits of
    the ``.output`` of the outermost module on ``location``'s path that was called, the root's (a whole Qwen3-Omni
    model's generate calls its thinker, never its own forward). A visit is counted after every worker waiting there
    has been served, so a request served inside a forward (at its very end too) sees the forwards ended before it.
    `served_late` compares it as a read is asked and as it is served."""
    parts = location.split(".")
    for end in range(1, len(parts)):
        module = ".".join(parts[:end])
        if mediator.occurrence(f"{module}.input"):
            return mediator.occurrence(f"{module}.output")
    return 0


@functools.lru_cache(maxsize=4096)
def holders_of(location: str, block: str) -> tuple[str, ...]:
    """The ``.input`` locations of the modules holding the op (or module) at ``location`` of ``block`` (a component's
    path) inside its decoder layer: the layer (the first numbered module on the path, or the block's parent where it
    comes first: a model whose layers are no numbered list), the block, the router or experts, down to the module
    itself. A skipped module's ``.input`` still counts each call, so each is called once per visit of what it holds,
    unless something was skipped: modules outside the layer (the root) may run without it (an early-exit draft runs
    the first layers only)."""
    parts = module_of(location).split(".")
    layer = next((index + 1 for index, part in enumerate(parts) if part.isdigit()), len(parts))
    start = max(1, min(layer, block.count(".")))
    return tuple(".".join(parts[:end]) + ".input" for end in range(start, len(parts) + 1))


def served_late(mediator: Mediator, location: str, block: str, pinned: int | None, asked: int) -> bool:
    """Whether a read of ``location`` was served at another generation step (or looped block's pass) than it was
    asked for, which nnsight does not notice.

    ``pinned``: the mediator's ``iteration`` as the read was asked. None (relaxed: after a ``tracer.iter`` step's
    first value was served) asks for the next visit: served in a later forward than ``asked`` (`forwards_ended` when
    it was asked), the model had run past it at that step, and the next step's value came. An int asks for that visit
    of the op (0 outside ``tracer.iter``): served where a module holding it inside its layer (`holders_of`) had been
    called more often, the op missed a call before (it, or that module, the block or its decoder layer, was skipped
    with ``.skip()``), so its visits no longer line up with the steps (or passes). A read of a looped block's next
    pass in the same ``tracer.iter`` body is in the model's order."""
    if pinned is None:
        return forwards_ended(mediator, location) != asked
    for holder in holders_of(location, block):  # (its call counted); a loop: any() over a generator costs more
        if mediator.occurrence(holder) > pinned + 1:
            return True
    return False


def request_step(mediator: Mediator, location: str, on_order_error: Callable[[], Exception],
                 on_skipped: Callable[[], Exception]) -> Any:
    """`request`, refused with ``on_skipped()`` where it is pinned to a ``tracer.iter`` step after the first and the
    module running the op at ``location`` was skipped at an earlier step (`skipped_visits`).

    nnsight counts the visits of each op apart, and a skipped module's ops miss the step it was skipped at, so a
    request pinned to step s would be served at a later step. Checked as it is asked (skipped at a step the module
    finished), as it is served (skipped at the step still running when it was asked, or since), and where the run
    ended without serving it after the module ran step s. (`fetch` checks the modules holding it, the block and its
    decoder layer, as it is served: `served_late`; a read the run ends without serving after one of those was skipped
    ends the loop with nnsight's warning, as a block that runs only on some steps, an image prompt's, does.)
    """
    step = mediator.iteration
    if not step:  # the first step, or relaxed: the next visit, whichever step that is
        return _request(mediator, location, on_order_error)
    if skipped_visits(mediator, location) > 0:
        raise on_skipped()
    if visit_passed(mediator, location, step):
        raise on_order_error()
    try:
        served_value = Mediator.value(location)
    except OutOfOrderError as error:
        if skipped_visits(mediator, location) > 0 and mediator.occurrence(f"{_module_running(location)}.output") > step:
            raise on_skipped() from None
        _reraise(error, step, on_order_error)
    if skipped_visits(mediator, location) > 0:
        raise on_skipped()
    return served_value


class Fetched(NamedTuple):  # a tuple, not a dataclass: one is made per value read
    """One value as served at its location, and this invoke's token view of it.

    Attributes:
        raw: What the location serves (a tensor, a tuple, an ``(args, kwargs)`` call).
        picked: The value's tensor taken out of ``raw``.
        token_major: ``picked`` in token-major ``[T, ...]`` order.
        view: This invoke's ``[b, s, ...]`` view of ``token_major``.
        rows: The invoke's rows.
        context: What the binding's ``prepare`` returned.
    """

    raw: Any
    picked: torch.Tensor
    token_major: torch.Tensor
    view: torch.Tensor
    rows: tokens.Rows
    context: Any


def _what(served_value: Any) -> str:
    """What a location served, for `fetch`'s error when it holds no tensor of values per token."""
    if isinstance(served_value, torch.Tensor):  # not its value: under model.scan it is a fake tensor
        return "a 0-d tensor (one number, such as an auxiliary loss)"
    kind = type(served_value).__name__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def fetch(component: "Component", name: str, binding: Binding, prepared: Fetched | None = None,
          mediator: Mediator | None = None) -> Fetched:
    """Request ``binding``'s location and cut this invoke's view out of what is served.

    ``prepared``: an earlier fetch of the same value at the same visit, whose ``prepare``
    result is reused (``prepare`` may request a location the model has run past since).
    """
    if torch._C._functorch.get_interpreter_stack():  # a functorch transform runs (the name built only then)
        refuse_under_vmap(f"{component.path}.{name}", MoelensError)  # not ValueUnavailable, which save_all leaves out
    if mediator is None:  # (`read` passes the one it found)
        mediator = Mediator.current(binding.location)
    settle_open_reads(mediator)
    pinned = mediator.iteration  # as asked, before `prepare`'s own requests
    asked = forwards_ended(mediator, binding.location) if pinned is None or pinned == 0 and generating(mediator) else 0
    # asked for a step the model has run (a loop's step it passed; step 0, outside a loop, after a loop's later steps)
    step_passed = bool(pinned) or pinned == 0 and asked > 0
    if prepared is not None:
        context = prepared.context
    else:
        context = binding.prepare() if binding.prepare is not None else None
    raw = request_step(mediator, binding.location, lambda: component._order_error(name, step_passed=step_passed),
                       lambda: component._skipped_error(name, binding.location))
    if served_late(mediator, binding.location, component.path, pinned, asked):  # another step's value
        raise component._order_error(name) if pinned is None else component._skipped_error(name, binding.location)
    component._check_call(name)
    rows = run_fact(component.interleaver, mediator, "rows", lambda: tokens.current_rows(binding.location))
    try:
        picked = binding.pick(raw)
    except (FamilyError, ValueUnavailable) as error:  # what the location serves does not fit the entry: say where
        error.args = (f"{component.path}.{name}: {error}",)  # (a ValueUnavailable's `why` stays without the path)
        raise
    if not isinstance(picked, torch.Tensor) or picked.dim() == 0:  # (a tensor first: typing's Mapping check is slow)
        if isinstance(picked, Mapping):
            raise FamilyError(f"{component.path}.{name}: {dict_output(picked)}")
        fix = (f"fix {binding.named_by}" if binding.named_by else
               "a block that returns a tuple needs Combine(output_index=<the hidden state's index>), and logits_op an "
               "op whose output is the logits tensor")
        raise FamilyError(
            f"{component.path}.{name}: {binding.location} serves {_what(picked)}, not values per token, so the "
            f"family entry of {type(component._module).__name__} names the wrong op or output there: {fix} (see "
            "moelens.families.register)."
        )
    token_major = binding.token_major(picked, context)
    if rows.per_prompt > 1:  # generating with beams / several returned sequences
        rows = tokens.rows_counted(token_major, binding.features, rows, component.runs_before_expansion)
    view = tokens.view(token_major, binding.features, rows, f"{component.path}.{name}")
    return Fetched(raw, picked, token_major, view, rows, context)


def replaced(binding: Binding, fetched: Fetched, new: torch.Tensor, name: str, raw: Any = None) -> Any:
    """What to hand the model: ``raw`` (default ``fetched.raw``) with this invoke's rows of the value set to ``new``.

    ``raw`` may hold what another invoke wrote at this visit since the fetch: the other rows are
    taken from it, not from the fetch.
    """
    raw = fetched.raw if raw is None else raw
    picked = binding.pick(raw)
    current = fetched.token_major if _same_tensor(picked, fetched.picked) else binding.token_major(picked, fetched.context)
    whole = tokens.splice(current, new, binding.features, fetched.rows, name)
    return binding.put(raw, binding.model_layout(whole, fetched.context))


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same tensor: the same object, or the same memory seen alike (nnsight
    hands each request of a batched value a fresh slice of it when a trace has several invokes). model.scan's
    fake tensors have no memory to compare (torch warns on their data_ptr): only the same object is the same."""
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not is_fake(a)
                      and not is_fake(b) and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


class Rebase(NamedTuple):
    """A swap built when it lands, on what the model holds then (`MoeBatcher.widen`): ``onto(current)``;
    none at all where it ``changes`` nothing (a write-back of views neither edited nor on the graph).

    Every invoke is served the whole flat ``[T, ...]`` tensors of a visit (nnsight cannot cut them by
    invoke), so a swap hands back the whole tensor. Built on what its invoke read, it would undo a
    write another invoke made since (invokes lined up with tracer.barrier); built on what the model
    holds when it lands, it changes this invoke's rows alone.
    """

    onto: Callable[[Any], Any]
    changes: bool = True


#: What ``model.generate`` returns with ``return_dict_in_generate=True``.
GENERATE_OUTPUTS = (GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput, GenerateBeamDecoderOnlyOutput,
                    GenerateBeamEncoderDecoderOutput)


def _tensors_of(items: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``items`` (an output's fields), and in the tuples they hold (generate's per-step
    ``scores``)."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors_of(item)


class MoeBatcher(Batcher):
    """nnsight's batcher for a wrapped model: lands moelens' `Rebase` swaps on the current value. Made as a run
    begins, it claims the model for this thread (`run_owner`)."""

    def __init__(self, envoy: Any, kwargs: dict | None = None) -> None:
        claimed = isinstance(envoy.interleaver, MoeInterleaver)
        if claimed:
            envoy.interleaver.claim()
        try:  # nnsight makes the batcher before the clean-up that would release the claim is in place
            super().__init__(envoy, kwargs)
            #: The EP groups' runs this trace counted as it began (`MoeModelMixin._begin_runs`); a forward outside a
            #: trace makes its batcher inside the run, which counts itself.
            self.runs_begun = () if envoy.interleaver in RUNS else envoy._begin_runs()
        except BaseException:  # an error, or Ctrl-C, as the run begins: other threads would be refused until the next
            if claimed:
                envoy.interleaver.release()
            raise

    def narrow(self, value: Any, group: Any) -> Any:
        """nnsight's narrowing to an invoke's rows, field by field for generate's output (``return_dict_in_generate``):
        nnsight copies a dict with ``.copy()``, which builds ``type(value)(value)``, and those classes take their
        required ``sequences`` by name, so ``tracer.result`` read in one of several invokes failed with transformers'
        "missing 1 required positional argument: 'sequences'". Refused where a field holds several rows per prompt
        (beams, returned sequences): nnsight would cut the fields of one row per prompt and hand the others whole."""
        if group is not None and isinstance(value, GENERATE_OUTPUTS) and self.batching:
            if any(tensor.dim() and tensor.shape[0] != self.total for tensor in _tensors_of(value.values())):
                raise MoelensError(
                    "tracer.result of a generation with several rows per prompt (num_beams or num_return_sequences "
                    "above 1) was read in one of several invokes, where its fields cannot all be cut to the invoke's "
                    "rows: read it in an empty tracer.invoke(), which sees every prompt's rows (prompt i's are i * n "
                    "to i * n + n - 1), or generate with one invoke."
                )
            return type(value)(**{key: super(MoeBatcher, self).narrow(item, group) for key, item in value.items()})
        return super().narrow(value, group)

    def _narrow_tensor(self, tensor: torch.Tensor, group: list) -> torch.Tensor:
        """nnsight's, but a 0-d tensor (a forward's ``aux_loss`` with ``output_router_logits=True``) is no batch: served
        whole (nnsight read its first dimension and failed with an IndexError)."""
        return tensor if tensor.dim() == 0 else super()._narrow_tensor(tensor, group)

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        """nnsight's, but a 0-d tensor served whole is replaced by the invoke's edit of it (see `_narrow_tensor`)."""
        return edited if full.dim() == 0 else super()._widen_tensor(full, group, edited)

    def widen(self, full: Any, group: Any, edited: Any) -> Any:
        if isinstance(edited, Rebase):
            if not edited.changes:
                return full
            edited = edited.onto(self.narrow(full, group))  # this invoke's part of the value as it is now
        return super().widen(full, group, edited)


def swap_value(interleaver: Any, onto: Callable[[Any], Any], raw: Any, changes: bool = True) -> Any:
    """What to swap in: a `Rebase` where the run's batcher lands one, else ``onto(raw)``."""
    if isinstance(getattr(interleaver, "batcher", None), MoeBatcher):
        return Rebase(onto, changes)
    return onto(raw)


class OpenView(NamedTuple):
    """A value read at a visit and still open (`OpenReads`)."""

    view: torch.Tensor
    fetched: Fetched
    binding: Binding
    #: The view's version counter when it was read (an in-place edit moves it).
    version: int
    #: Whether the view was edited (in place), the edit checked.
    check: Callable[[], bool]
    #: ``apply(raw, edited)``: ``raw`` with the view's edits.
    apply: Callable[[Any, bool], Any]
    #: The model must go on from the view itself (autograd), edited or not.
    on_graph: bool
    #: A copy only the user holds (`HandedBack`), as long as the model goes on with what it holds.
    private: bool
    #: ``model.layers.0.mlp.expert_weights``, for `HandedBack`.
    where: str


class OpenReads:
    """The values read at one visit of a location, whose views the worker may still edit in place.

    nnsight holds one write-back per worker; a second value read at the same visit (the experts
    call's weights, then its indices) joins this one instead of running the first's write-back
    early, so every view read there is checked and handed back when the worker moves on.

    Attributes:
        raw: What the model held when these values were read.
        interleaver: The run's interleaver.
        views: Descriptor -> its `OpenView`.
    """

    def __init__(self, raw: Any, interleaver: Any) -> None:
        self.raw = raw
        self.interleaver = interleaver
        self.views: dict[served, OpenView] = {}

    def of_tensor(self, fetched: Fetched, binding: Binding) -> list[served]:
        """The values open here that are views of the very tensor ``fetched`` is (another name for it: an
        alias such as ``mlp_neurons``, or two values a family serves from one tensor): one view serves them all,
        or a second copy would hand back the first one's edits undone."""
        return [
            descriptor for descriptor, opened in self.views.items()
            if _same_tensor(opened.fetched.picked, fetched.picked) and opened.binding.to_view is None
            and binding.to_view is None and opened.view.shape == fetched.view.shape
        ]

    def _unique(self) -> list[OpenView]:
        return list({id(opened): opened for opened in self.views.values()}.values())  # an alias shares its view

    def settled(self) -> bool:
        """Whether the model goes on as it is (no view edited, none on the graph): then the copies only the user
        holds are noted as handed back, and there is nothing to swap in."""
        unique = self._unique()
        if any(opened.on_graph or opened.view._version != opened.version for opened in unique):
            return False
        handed_back = RUNS.get(self.interleaver)
        for opened in unique if handed_back is not None else ():
            if opened.private:
                handed_back.note(opened.view, opened.where, private=True)
        return True

    def __call__(self) -> Any:
        """The write-back, as the worker moves on: the views' edits checked now, spliced in when it lands."""
        if self.settled():
            return swap_value(self.interleaver, lambda current: current, self.raw, changes=False)
        edited = [(opened, opened.check()) for opened in self._unique()]

        def onto(current: Any) -> Any:
            for opened, changed in edited:
                current = opened.apply(current, changed)
            return current

        return swap_value(self.interleaver, onto, self.raw)

    def hold(self, mediator: Mediator, descriptor: served, location: str) -> None:
        """Leave these reads as the worker's write-back, listed under ``descriptor``'s view."""
        view = self.views[descriptor].view
        mediator.transform = WriteBack(self, view, descriptor, location, mediator.wanted(location))


def settle_open_reads(mediator: Mediator) -> None:
    """Drop the worker's waiting write-back of moelens reads when the model goes on as it is (`OpenReads.settled`).

    nnsight would swap it in as the worker moves on: a round trip to the model that changes nothing, at every
    location a trace reads.
    """
    waiting = mediator.transform
    if waiting is not None and isinstance(waiting.fn, OpenReads) and waiting.fn.settled():
        mediator.transform = None


def _open_reads(mediator: Mediator, location: str) -> OpenReads | None:
    """The reads this worker made at this visit of ``location``, if it still holds them."""
    waiting = mediator.transform
    if waiting is None or not isinstance(waiting.fn, OpenReads):
        return None
    return waiting.fn if (waiting.location, waiting.occurrence) == (location, mediator.wanted(location)) else None


def read(component: "Component", descriptor: served, binding: Binding, keep_open: bool = True) -> torch.Tensor:
    """Serve ``binding`` as this invoke's token view and leave its write-back.

    ``keep_open=False``: the caller reads its next value at once, so nothing can edit this one before the model
    moves on (`Moe.save_all`); without autograd the read then leaves no write-back, as one found unedited would
    be dropped (`OpenReads.settled`): a copy only the user holds is watched from the start (`HandedBack`).
    """
    name = descriptor.name
    location = binding.location
    mediator = Mediator.current(location)
    reads = _open_reads(mediator, location)
    if reads is not None:
        if descriptor in reads.views:  # read again: the same view, so an edit to either goes back
            return reads.views[descriptor].view
        mediator.transform = None  # keep them open past this read's request
    try:
        fetched = fetch(component, name, binding, mediator=mediator)
    except BaseException:
        if reads is not None:  # nothing read: the values read here stay open, their edits still to land
            reads.hold(mediator, next(reversed(reads.views)), location)
        raise
    shared = reads.of_tensor(fetched, binding) if reads is not None else []
    if shared:  # another name for a value read here: its view
        reads.views[descriptor] = reads.views[shared[0]]
        reads.hold(mediator, descriptor, location)
        return reads.views[descriptor].view
    view = fetched.view
    grad = torch.is_grad_enabled()
    if grad and binding.to_view is None:
        # Autograd may keep the model's tensor for its backward (top-k indices, softmax weights):
        # an in-place edit of it would fail there, so edits go to a copy and back through the write-back.
        view = view.clone()
    elif view.is_inference():
        # Under torch.inference_mode the model's tensors keep no version counter, so an in-place
        # edit could not be told from a read: the view is a normal tensor (one copy) that counts them.
        with torch.inference_mode(False):
            view = view.clone()
    if not keep_open and reads is None and not grad:
        handed_back = RUNS.get(component.interleaver)
        # the token view itself (no to_view, not copied above) is a view of the model's tensor: nothing to ask
        if handed_back is not None and (view is not fetched.view or binding.to_view is not None) \
                and not _aliases(view, fetched.picked):
            handed_back.note(view, f"{component.path}.{name}", private=True)
        return view
    where = f"{component.path}.{name}"
    served_in = RUNS.get(component.interleaver) if grad else None
    if served_in is not None:  # (its .grad may be asked for)
        served_in.name(view, where)
    version = view._version
    setattr(view, READ_VERSION, version)  # an in-place edit moves it (`model_values`)
    # With autograd on, the model goes on from the view itself, so that a hook on it (nnsight's
    # `.grad` in a `with loss.backward():` block) sees the gradient: a view alone is off the graph.
    on_graph = view.requires_grad and view is not fetched.picked

    def check() -> bool:
        """Whether the view was edited (in place), the edit checked."""
        edited = view._version != version
        if edited:  # the model's values from before: of a copy, the view it was made from; else as an intervention kept
            before = model_values(view) if _aliases(view, fetched.view) else fetched.view
            check_write(component, name, binding, view, view.shape, before)
            check_not_recomputed(component, name)
        return edited

    def apply(raw: Any, edited: bool) -> Any:
        """``raw`` with this view's edits; a later edit of a view the model does not hold is lost (`HandedBack`)."""
        held = _same_tensor(binding.pick(raw), fetched.picked)  # no other invoke's write landed here since the read
        if not on_graph and (not edited or binding.to_view is None and held and _aliases(view, fetched.picked)):
            result = raw
        else:
            result = replaced(binding, fetched, view, name, raw)
        handed_back = RUNS.get(component.interleaver)
        if handed_back is not None:
            handed_back.note(view, where, private=not _aliases(view, binding.pick(result)))
        return result

    reads = reads or OpenReads(fetched.raw, component.interleaver)
    reads.views[descriptor] = OpenView(view, fetched, binding, version, check, apply, on_graph, not _aliases(view, fetched.picked),
                                       where)
    reads.hold(mediator, descriptor, location)
    return view


#: The `HandedBack` views of the run a wrapped model is in, by its interleaver (shared by all its envoys); an entry
#: lives as long as its run (a plain dict: asked at every read, where a weak one makes a weak reference each time).
RUNS: dict[Any, HandedBack] = {}


def run_fact(interleaver: Any, owner: object, what: str, compute: Callable[[], Any], per_step: bool = False) -> Any:
    """``compute()``, read once per run of the model for ``owner`` (outside a run: each time).

    For what does not change while the model runs but a read asks for several times: a block's counts (its
    router's ``num_experts``, read through the family entry), an invoke's rows (``owner`` its mediator). What the
    intervention code may change between generation steps is ``per_step``: read each time in a ``generate`` (the
    router's ``top_k``); not cached at all, the experts implementation (transformers' own switch changes it too).
    At 1 x 8 tokens moelens' own Python is a visible part of a trace.
    """
    run = RUNS.get(interleaver)
    if run is None or per_step and run.generating:
        return compute()
    key = (id(owner), what)
    facts = run.facts
    if key not in facts:
        facts[key] = compute()
    return facts[key]


#: The entries `HandedBack` holds before it first lets go of those of dropped views.
PRUNE_AT = 64


class HandedBack:
    """The views of one run whose write-back ran and that are copies only the user holds (the activations
    put in token-slot order, the copies served with autograd on or under inference_mode, where the model
    went on from its own tensors): an in-place edit of one after that is lost (`check`).

    A late edit of a view of the model's own tensor is not told apart from an in-place change the model,
    a torch hook or a plain nnsight edit makes to that tensor, so it is not checked (as in plain nnsight).
    """

    def __init__(self, generating: bool = False, inference: bool = False) -> None:
        #: Whether the run is a ``generate`` (several forwards, between which the intervention code may change a
        #: router's ``top_k``: `run_fact`'s ``per_step``).
        self.generating = generating
        #: Whether the run began under ``torch.inference_mode``: no backward can follow it (`check_not_recomputed`).
        self.inference = inference
        #: id(view) -> (the view, its version when last handed back, its value's name, the error an edit of it
        #: raises where it is not the default's). A write of another value at the same visit hands the open views
        #: back early; the write-back hands them back again.
        self.views: dict[int, tuple[weakref.ref, int, str, str | None]] = {}
        #: The values moelens derives, kept to the run's end: one edited in place as it is read
        #: (``moe.expert_weights[..., 0] = 0``) is dropped by the user at once, and must still be checked.
        self.derived: list[torch.Tensor] = []
        #: (id of a component or mediator, what) -> what the live modules say of it, read once in the run
        #: (`run_fact`): a block's counts, an invoke's rows.
        self.facts: dict[tuple[int, str], Any] = {}
        #: id(value) -> (the value, the error its ``.grad`` raises): values moelens derives that no output depends on,
        #: served where nothing upstream requires grad, whose ``.grad`` torch refuses naming none (`without_gradient`).
        self.gradientless: dict[int, tuple[weakref.ref, str]] = {}
        #: id(view) -> (the view, its value's name): every view served with autograd on, a copy or a view of the
        #: model's own tensor, so that torch's bare refusal to hook one without a gradient can name it
        #: (``moelens.wrapping.run_errors._no_gradient_refusal``; batched_mm's activations of a frozen model are views).
        self.named: dict[int, tuple[weakref.ref, str]] = {}
        #: How many entries `views` and `gradientless` may hold before those of values the user dropped are let go.
        self._prune_at = PRUNE_AT

    def _let_go(self) -> None:
        """Drop the entries of views the user no longer holds, once the two maps reach `_prune_at` entries (twice
        what stays, so each entry is looked at a bounded number of times): a long generation reading a value
        each step kept one entry a step to the run's end."""
        if len(self.views) + len(self.gradientless) + len(self.named) < self._prune_at:
            return
        for entries in (self.views, self.gradientless, self.named):
            for key in [key for key, (reference, *_) in entries.items() if reference() is None]:
                del entries[key]
        self._prune_at = max(PRUNE_AT, 2 * (len(self.views) + len(self.gradientless) + len(self.named)))

    def name(self, view: torch.Tensor, where: str) -> None:
        """``view`` was served as ``where`` (read by ``moelens.wrapping.run_errors._no_gradient_refusal``)."""
        self._let_go()
        self.named[id(view)] = (weakref.ref(view), where)

    def without_gradient(self, value: torch.Tensor, error: str) -> None:
        """``value``, derived by moelens, has no gradient: reading its ``.grad`` raises ``error`` (read by
        ``moelens.wrapping.run_errors._no_gradient_refusal``)."""
        self._let_go()
        self.gradientless[id(value)] = (weakref.ref(value), error)

    def note(self, view: torch.Tensor, where: str, private: bool, edit_error: str | None = None) -> None:
        """``view`` was handed back: watched if it is a copy only the user holds, else no more. ``edit_error``: the
        error an edit of it raises where the model never reads the value at all (one moelens derives)."""
        if edit_error is not None:
            self.derived.append(view)
        if private:
            self._let_go()
            self.views[id(view)] = (weakref.ref(view), view._version, where, edit_error)
        else:
            self.views.pop(id(view), None)

    def check(self) -> None:
        """Raise `OrderError` for a view edited in place after its write-back (after a later value was read), or
        for a value the model never reads: the model went on without it, so the edit was lost, unchecked."""
        for reference, version, where, edit_error in self.views.values():
            view = reference()
            if view is None or view._version == version:
                continue
            if edit_error is not None:
                raise OrderError(edit_error)
            raise OrderError(
                f"{where} was edited in place after moelens had handed it back to the model (once a later value "
                "of the run was asked for: read, or refused only once the model had run on to it, as save_all leaves "
                "out a value the run cannot serve), on a copy the model does not hold: the edit did not reach the "
                "model. Edit a value before reading the values after it (the block's order()), or edit a .clone() "
                "for your own analysis."
            )


def _as_tensor(component: "Component", name: str, binding: Binding, value: Any, current: torch.Tensor) -> torch.Tensor:
    """A written number, array or nested list as a tensor on the value's device (a Python number in its dtype for
    a float value; a bool stays a bool, which the checks refuse, and a list holding one is refused here, where
    torch would turn it into 0 or 1 among numbers); anything else raises `WriteError`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    found = bool_in(value)
    if found is not None:  # torch.as_tensor([3, True]) is [3, 1]
        raise WriteError(f"{component.path}.{name}: the written list holds the bool {found!r} among its numbers; write "
                         f"numbers only (a tensor of shape {tuple(current.shape)} and dtype {current.dtype}).")
    try:
        return torch.as_tensor(value, dtype=current.dtype if binding.kind == FLOAT and number else None,
                               device=current.device)
    except (TypeError, RuntimeError, ValueError):
        raise WriteError(
            f"{component.path}.{name}: wrote {type(value).__name__} {value!r:.60}, expected a tensor of shape "
            f"{tuple(current.shape)} and dtype {current.dtype} (or a number to fill it with)."
        ) from None


def _cast(component: "Component", name: str, binding: Binding, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in the value's ``dtype``; a `WriteError` where finite values written overflow it (1e6 is inf in
    float16) and the value may not hold that infinity, which the checks after the cast would report as written."""
    cast = value.to(dtype)
    if cast.dtype == value.dtype or is_fake(value) or binding.allowed_infinities() == ANY_INF:
        return cast
    overflowed = torch.isinf(cast) & torch.isfinite(value)
    if overflowed.any():
        advice = (" (a few tens already decide the routing; moelens.steer and moelens.force keep within it)"
                  if name == "router_logits" else "")
        raise WriteError(
            f"{component.path}.{name}: the written values reach {float(value[overflowed].abs().max()):.4g}, beyond "
            f"what the model's {dtype} holds (at most {torch.finfo(dtype).max:.4g}); write values within it{advice}."
        )
    return cast


def write(component: "Component", descriptor: served, binding: Binding, value: Any) -> None:
    """Replace this invoke's rows of ``binding`` with ``value`` (checked)."""
    refuse_under_vmap(f"{component.path}.{descriptor.name} = ...")
    location = binding.location
    mediator = Mediator.current(location)
    reads = _open_reads(mediator, location)
    if reads is None:
        _write(component, descriptor, binding, value, None)
        return
    mediator.transform = None  # open past this write's request
    try:
        _write(component, descriptor, binding, value, reads)
    finally:  # the other values read here stay open, the write refused or not: their edits land as the worker moves on
        if reads.views:
            reads.hold(mediator, next(reversed(reads.views)), location)


def _write(component: "Component", descriptor: served, binding: Binding, value: Any, reads: OpenReads | None) -> None:
    """`write`, ``reads`` being the values read at this visit: the write supersedes a view of this value (or of
    another name for its tensor), dropped from them once the write passed its checks."""
    name = descriptor.name
    location = binding.location
    own = reads.views.get(descriptor) if reads is not None else None
    fetched = fetch(component, name, binding, prepared=own.fetched if own is not None else None)
    superseded = dict.fromkeys([descriptor, *reads.of_tensor(fetched, binding)]) if reads is not None else {}
    current = fetched.view
    # in model.scan a value with values (a number, an array, a tensor saved from a trace) stays real through the
    # conversions, so that the checks see its values
    with nullcontext() if isinstance(value, torch.Tensor) and is_fake(value) else unset_fake_temporarily():
        if not isinstance(value, torch.Tensor):
            value = _as_tensor(component, name, binding, value, current)
        if value.dim() == 0:  # a scalar fills the whole view
            value = value.expand(current.shape)
        if value.is_floating_point() and current.is_floating_point():
            value = _cast(component, name, binding, value, current.dtype)  # checked as the model gets it
    before = current  # the model's values where the write lands, unless a view of them was edited in place since read
    for other in superseded:
        opened = reads.views.get(other)
        if opened is not None and opened.view._version != opened.version and _aliases(opened.view, current):
            before = model_values(opened.view)
    check_write(component, name, binding, value, current.shape, before=before)
    check_not_recomputed(component, name)
    earlier = None
    for other in superseded:
        earlier = reads.views.pop(other, None) or earlier
    if current.requires_grad:  # keep the view the user read, if any, so a .grad asked of it arrives (zero)
        old = earlier.view if earlier is not None and earlier.view.requires_grad else current
        value = _KeepInGraph.apply(value, old, runs_torch_a2a(component.root.moes))
    else:  # the model, and any later in-place edit of the value (an intervention's), works on a copy, not the
        value = value.clone(memory_format=torch.contiguous_format)  # user's tensor, array or expanded scalar
    Mediator.swap(location, swap_value(component.interleaver, lambda raw: replaced(binding, fetched, value, name, raw),
                                       fetched.raw))


def in_backward_block() -> bool:
    """Whether nnsight is running a ``with loss.backward():`` block: it serves ``.grad`` through a property it puts
    on ``torch.Tensor`` for the block, where torch has a plain descriptor."""
    return isinstance(inspect.getattr_static(torch.Tensor, "grad"), property)


class _KeepInGraph(torch.autograd.Function):
    """``new`` in the forward; in the backward, a zero gradient for ``old`` where one is wanted, else none.

    A write keeps the value it replaces in the autograd graph. Under expert parallelism (``exchanged``) its backward
    gets a zero gradient, so the backward runs every operation that produced it whatever was written: the experts'
    exchanges are collectives every rank must run, even a rank whose value was replaced. In nnsight's ``with
    loss.backward():`` block it gets one too, so a ``.grad`` asked of a value read before it (the replaced view, the
    router logits) arrives, zero. Elsewhere (a plain ``loss.backward()``, as a training step runs) it gets none: as
    in plain torch, the parameters that reached the output only through the replaced value get no gradient, not a
    zero one, which an optimizer's weight decay and momentum would move them by.
    """

    @staticmethod
    def forward(ctx: Any, new: torch.Tensor, old: torch.Tensor, exchanged: bool) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # no gradient from downstream (a later write's): none passed on either
        ctx.old = (old.shape, old.dtype, old.device)
        ctx.exchanged = exchanged
        return new.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        shape, dtype, device = ctx.old
        wanted = ctx.exchanged or in_backward_block()
        return grad, torch.zeros(shape, dtype=dtype, device=device) if wanted else None, None


def _aliases(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` shares storage with ``base`` (so in-place edits already landed); also for fake tensors."""
    return torch._C._is_alias_of(view, base)
