"""Run ids: which run of a sharded model each rank of its EP group is in.

Every MoE layer's count exchange (`a2a.plan_dispatch`) carries the id of the run the rank is in.
A run is a forward of a module holding the experts (the model, its base model, a decoder layer, a block:
`shard_experts` hooks each, `forward_enters` / `forward_leaves`; the outermost call is the run), so that
a rank generating in a trace and one generating without keep in step, a run per step. A trace of the
wrapped model (`MoeNNsight.interleave` finds the experts modules' ``_ep_runs``, set by `shard_experts`
and by transformers' expert parallelism through ``torch_a2a``) starts its first run as it begins,
whether its model runs or not (a body that fails first on some ranks), and its first forward is in it.

A run that raises on some ranks only, before one of its exchanges (an intervention refused for
this rank's tokens), leaves the other ranks waiting in that exchange while the ranks that raised
move on to their next run. The exchanges of two runs look alike (same layer, same sizes), so
without ids the waiting ranks would go on paired with those ranks' next run: their results
silently wrong, and one run left waiting at the end. With ids, a rank that meets a newer run
ends its own with `RankDivergence` (so does each run of its that the others gave up), while the
ranks in the newest run ask again until every rank is in it: from there, runs pair on every rank.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch


class Runs:
    """The runs this process started on the models sharded over one EP group (`runs_of`).

    Attributes:
        current: The id of the run this rank is in (0 before the first): how many it started.
        tracing: How many moelens traces of such a model are running (their first forward starts no run).
        entered: The hooked modules whose calls are running, outermost first (only the outermost starts a run), held
            weakly: a call that never left (a Ctrl-C) keeps no model alive.
        traced_forwards: How many outermost forwards the running trace made.
        models: How many models `shard_experts` sharded over the group so far: the index of the next one, the same
            on every rank of the group (sharding is collective), which its layer tags carry (`layer_tag`).
    """

    __slots__ = ("current", "tracing", "entered", "traced_forwards", "models")

    def __init__(self) -> None:
        self.current, self.tracing, self.traced_forwards, self.models = 0, 0, 0, 0
        self.entered: list[weakref.ref[torch.nn.Module]] = []

    def __copy__(self) -> "Runs":
        return self

    def __deepcopy__(self, memo: dict) -> "Runs":  # a deep copy of a sharded model is on the same group
        return self

    def start(self) -> None:
        """A run begins (the next id)."""
        self.current += 1

    def meet_for_folders(self, group: Any, device: Any) -> None:
        """Start a run of the group's own for `analysis.collect_routing`'s exchange of each rank's folder, and meet
        every rank of ``group`` in it (`a2a.meet_in_run`, `FOLDERS_TAG`): a rank still in a run this rank gave up (its
        trace of a batch this rank refused before its trace, in an earlier call) ends it with `RankDivergence` instead
        of pairing that trace's exchange with the exchange of folders, and this rank waits for it in this run."""
        from .a2a import RankDivergence, meet_in_run

        self.start()
        _, tags, _ = meet_in_run(group, self.current, FOLDERS_TAG, device)
        if any(tag != FOLDERS_TAG for tag in tags):
            raise RankDivergence(
                f"collect_routing: the ranks of the expert-parallel group met at other exchanges in one run "
                f"({describe_tags(tags)}): those ranks ran a forward of the model (a trace, another analysis, "
                "generation, or a batch more of a corpus) where this rank called collect_routing. Every rank must "
                "call the same analyses and traces in the same order, on corpora that give the same number of "
                "batches; see docs/parallel.md."
            )

    def trace_begins(self, counted: bool = False) -> None:
        """A moelens trace of a sharded model runs the model: a run, which its first forward is in (``counted``: its
        id was taken as the trace began, `MoeModelMixin._begin_runs`)."""
        if not counted:
            self.start()
        self.tracing += 1
        self.traced_forwards = 0

    def trace_ends(self) -> None:
        self.tracing -= 1

    def __repr__(self) -> str:
        return f"Runs(current={self.current}, tracing={self.tracing})"


#: One `Runs` per EP group this process exchanges over, held weakly: a group destroyed (and no longer held by a
#: sharded model) is freed with its sockets, as without moelens.
_BY_GROUP: weakref.WeakKeyDictionary[Any, Runs] = weakref.WeakKeyDictionary()

#: How many bits of a layer tag hold the experts call's position in its model (`layer_tag`).
POSITION_BITS = 16


def runs_of(group: Any) -> Runs:
    """The `Runs` of ``group`` (a ``ProcessGroup``; every model sharded over it shares them)."""
    return _BY_GROUP.setdefault(group, Runs())


def layer_tag(model: int, position: int) -> int:
    """The tag the count exchange of an experts module carries: ``position`` (0-based) among the experts modules
    of its model, and ``model``, the index of that model among those sharded over the group (`Runs.models`), so
    that two models of one layout run in different orders on different ranks meet with `RankDivergence`."""
    if not 0 <= position < (1 << POSITION_BITS) - 1:
        raise ValueError(f"layer_tag: position {position} must be in [0, {(1 << POSITION_BITS) - 1}).")
    return (model << POSITION_BITS) | (position + 1)


#: The tag of `analysis.collect_routing`'s exchange of each rank's folder, a run of its own (a layer's tags are 1 and up).
FOLDERS_TAG = -1


def describe_tag(tag: int) -> str:
    """``tag`` (`layer_tag`, `FOLDERS_TAG`) in words, for error messages."""
    if tag == FOLDERS_TAG:
        return f"tag {tag}, collect_routing's exchange of each rank's folder"
    if tag <= 0:
        return f"tag {tag} (no layer tag)"
    model, position = tag >> POSITION_BITS, (tag & ((1 << POSITION_BITS) - 1)) - 1
    return f"tag {tag} (MoE block {position} of model {model} sharded over the group)"


def describe_tags(tags: list[int]) -> str:
    """Each rank's tag (``tags``, one per rank of a group) in words, ranks at one exchange together."""
    ranks: dict[int, list[int]] = {}
    for rank, tag in enumerate(tags):
        ranks.setdefault(tag, []).append(rank)
    return "; ".join(f"ranks {at} at {describe_tag(tag)}" for tag, at in ranks.items())


#: The code of the torch call that runs a module's hooks and forward: a frame of it holds the module as ``self``.
_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _running(module: torch.nn.Module | None) -> bool:
    """Whether a call of ``module`` is on this thread's stack (its ``_call_impl`` frame), the caller's excepted."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def forward_enters(runs: Runs, module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook (put first) of a module holding sharded experts: its outermost call is a run (in a moelens
    trace, the first is the trace's own)."""
    entered = runs.entered
    if entered and (any(running() is module for running in entered) or not _running(entered[-1]())):
        # A module runs neither inside itself nor inside a call that is no longer on the stack (a block called alone
        # after its model's call): an earlier call ended without `forward_leaves`, which torch skips for a
        # BaseException (a KeyboardInterrupt) where it calls it for an Exception. That run is over.
        entered.clear()
    if not entered:
        if not runs.tracing or runs.traced_forwards:
            runs.start()
        runs.traced_forwards += bool(runs.tracing)
    entered.append(weakref.ref(module))


def forward_leaves(runs: Runs, module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook (always called, also when the forward raised an Exception) matching `forward_enters`."""
    if runs.entered and runs.entered[-1]() is module:  # a pre-hook put before it may have raised before it counted
        runs.entered.pop()

