"""One run of a wrapped model at a time: a run belongs to the thread that began it.

nnsight keeps one interleaver per model, which holds the workers of the run going on. A trace begun in a
second thread while the first runs adds its workers to the first's, and its end clears them all: the first
trace could end with its body unfinished and no error (a ``.save()``d variable keeping an older value). A
wrapped model's interleaver (`MoeInterleaver`) therefore refuses a run begun while another thread's is going
on, before that run touches anything. Two wrappers of one model (``moelens.wrap(hf)`` twice, or of ``hf`` and
``hf.model``) share its MoE blocks, whose calls nnsight hands to whichever run began first: as the model starts
running for one, a run of the other that holds those blocks is refused (in another thread, or around it: a trace
inside the other's trace).
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import greenlet
import torch
from nnsight.intervention.interleaver import Interleaver

from ..errors import MoelensError

#: Guards the look-and-claim of `MoeInterleaver.claim` and `cancel` (one for all: a lock is no attribute a model's
#: deep copy can copy). Reentrant: a Ctrl-C landing between a ``with`` block's end and its ``__exit__`` leaves it held,
#: and the thread that was interrupted (a notebook's) takes it again rather than waiting for itself forever.
_CLAIMING = threading.RLock()

#: How long a thread waits for `_CLAIMING` (held for microseconds at a time) before taking it as left held by an
#: interrupt in another thread.
CLAIM_WAIT_S = 10.0


@contextmanager
def _claiming() -> Iterator[None]:
    """Hold `_CLAIMING`; raise `MoelensError` when another thread has held it for `CLAIM_WAIT_S` (an interrupt there
    left it held) instead of hanging."""
    if not _CLAIMING.acquire(timeout=CLAIM_WAIT_S):
        raise MoelensError(
            f"moelens' run registry has been held by another thread for {CLAIM_WAIT_S:g} s, where it is held for "
            "microseconds: an interrupt (Ctrl-C) in that thread left it held. Run traces in the thread that was "
            "interrupted, or restart the Python process."
        )
    try:
        yield
    finally:
        _CLAIMING.release()

#: Why a model (or another wrapper of its blocks) cannot run in a process forked while it ran.
FORKED_DURING_RUN = (
    "this model was running a trace in another thread when this process was forked from its parent: the fork copied "
    "the run but not the thread running it, so the run never ends here. Trace a copy in this process "
    "(moelens.wrap(copy.deepcopy(model._module))), or fork while no trace runs (or start processes with 'spawn')."
)

#: The interleaver whose model is running, by each MoE block module it runs (shared by every wrapper of the model).
_RUNNING: "weakref.WeakKeyDictionary[torch.nn.Module, MoeInterleaver]" = weakref.WeakKeyDictionary()


class MoeInterleaver(Interleaver):
    """nnsight's interleaver for a wrapped model, owned by the thread whose run is going on (`claim`)."""

    #: The thread whose run is going on (`threading.get_ident`), None between runs.
    owner: int | None = None
    #: The process `owner` is a thread of: a process forked during the run has a copy of the run, not of its thread.
    _owner_pid: int | None = None
    #: moelens' runs of the model in progress in the owner's thread (`MoeModelMixin.interleave`): the run ends as
    #: the outermost returns, after its own clean-up, not at nnsight's clean-up inside it.
    running: int = 0
    #: The MoE block modules this interleaver runs, with their router, experts and shared expert (`runs`), weakly:
    #: other wrappers of them, or of a model holding one of them, wait for its run.
    _blocks: "tuple[weakref.ref[torch.nn.Module], ...]" = ()
    #: The blocks this interleaver's run holds (`hold_blocks`) until it is over (`release`).
    _held: "list[torch.nn.Module] | tuple[()]" = ()

    def runs(self, blocks: list[torch.nn.Module]) -> None:
        """Note the MoE block modules (with those values are served from) this interleaver runs (at wrap)."""
        self._blocks = tuple(weakref.ref(block) for block in blocks)

    def claim(self, own_workers: bool = False) -> None:
        """Begin a run in this thread (as its inputs are first batched, before the run adds its workers; again as the
        model starts running, moelens' ``interleave``).

        Args:
            own_workers: the run is the one the queued workers were added for (``interleave`` of a trace, given its
                batcher), not one begun while a trace's invokes are queued (`collecting`).

        Raises:
            MoelensError: a run another thread began is going on, or this thread's (a trace begun in a trace's body,
                or in an invoke-mode trace's body after an invoke).
        """
        with _claiming():
            self.refuse_other_threads()
            self.refuse_nested("a trace", own_workers)
            self.owner, self._owner_pid = threading.get_ident(), os.getpid()

    def hold_blocks(self) -> None:
        """As the model starts running (moelens' ``interleave``): hold its MoE blocks for this run.

        Raises:
            MoelensError: another wrapper's run holds them.
        """
        blocks = [block for block in (ref() for ref in self._blocks) if block is not None]
        with _claiming():
            other = next((held for block in blocks if (held := _RUNNING.get(block)) not in (None, self)), None)
            if other is not None and other._owner_pid != os.getpid():
                raise MoelensError(FORKED_DURING_RUN)
            if other is not None:
                where = "in this thread (a trace inside its trace)" if other.owner == threading.get_ident() else \
                    "in another thread"
                shared = next(block for block in blocks if _RUNNING.get(block) is other)
                raise MoelensError(
                    f"another wrapper of this model's MoE blocks (moelens.wrap of the same model, or of a part of it, or "
                    f"of another model holding one of its modules: {type(shared).__name__} at {id(shared):#x}) is "
                    f"running it {where}; nnsight hands the modules' calls to the run that began first, so this run's "
                    "values could not be served. Trace one wrapper at a time, or wrap a copy for the second "
                    "(moelens.wrap(copy.deepcopy(model._module)); a model holding another's module: give it a copy)."
                )
            self._held = blocks  # first: an interrupt while they are marked leaves `release` all it must clear
            for block in blocks:
                _RUNNING[block] = self

    def refuse_other_threads(self) -> None:
        """Raise `MoelensError` while a run another thread began is going on (what `claim` refuses), or one a thread
        of the process this one was forked from began (a new thread here may get that thread's id)."""
        if self.owner is None:
            return
        if self._owner_pid != os.getpid():  # forked during the run: the owner thread was not copied
            raise MoelensError(FORKED_DURING_RUN)
        if self.owner != threading.get_ident():
            raise MoelensError(
                "this model is running a trace (or a forward) another thread began; a wrapped model runs one at a "
                "time, and nnsight would mix the two runs' interventions up. Trace it from one thread at a time "
                "(a lock around the trace), or give each thread a model of its own (copy.deepcopy(model))."
            )

    def collecting(self) -> bool:
        """Whether a trace's invokes are queued and the model has not run yet: an invoke-mode trace's body (``with
        model.trace() as tracer:``) runs in the caller's frame before the model, queuing a worker at each
        ``tracer.invoke``. A run begun there would take those workers for its own (a ``.save()`` in an earlier invoke
        held that run's value) and drop them at its end; one begun before the first invoke finds none and runs."""
        return not self.running and bool(self.mediators)

    def refuse_nested(self, what: str, own_workers: bool = False) -> None:
        """Raise `MoelensError` when ``what`` of this model begins inside this thread's run of it (a trace's body
        runs while the model runs: nnsight failed with greenlet's "cyclic parent chain", and a ``generate`` there
        ran transformers' own on the raw prompt), or while a trace's invokes are queued (`collecting`; but for the
        run they were queued for, ``own_workers``). nnsight's own calls as the model runs come from the model's side."""
        mediator = getattr(greenlet.getcurrent(), "mediator", None)  # set in a trace body's greenlet (nnsight)
        in_body = self.interleaving and self.owner == threading.get_ident() and mediator is not None and \
            mediator().interleaver is self
        if in_body or (not own_workers and self.collecting()):
            raise MoelensError(
                f"{what} of this model was begun inside a trace of the same model: a trace's body runs while the "
                "model runs, and a model cannot run inside its own run. Give one trace several inputs with "
                "tracer.invoke(...), or begin the next trace after this one has ended (model.session() groups them)."
            )

    def release(self) -> None:
        """End this thread's run (a call from another thread leaves its run alone), and its hold on the blocks."""
        with _claiming():
            if self.owner != threading.get_ident():
                return
            self.owner = None
            for block in self._held:
                if _RUNNING.get(block) is self:
                    del _RUNNING[block]
            self._held = ()

    def cancel(self) -> None:
        """nnsight's clean-up after a run, failed or not; outside a run of moelens' (a trace whose body failed
        before the model ran), the run is over then.

        A trace cleans up twice (at the end of the run, then of the trace): by the second, another thread may have
        begun a run, which that clean-up leaves alone.
        """
        with _claiming():  # not held through the clean-up: it runs the workers' finally blocks, which may wait on threads
            if self.owner is not None and self.owner != threading.get_ident():
                return
            # the clean-up is still this thread's run: another thread's is refused
            self.owner, self._owner_pid = threading.get_ident(), os.getpid()
        try:
            super().cancel()
        finally:
            if not self.running:
                self.release()
