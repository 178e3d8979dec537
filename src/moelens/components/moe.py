"""`Moe`: one Mixture-of-Experts block, whatever its family, as readable and writable values.

Every decorated MoE in transformers computes ``logits, w, idx = router(x);
routed = experts(x, idx, w); out = routed (+ shared(x))``. `Moe` serves those
values where the model consumes them, as this invoke's ``[batch, seq, ...]``:

==========================  ================  =================================================
value                       shape             read at
==========================  ================  =================================================
``router_logits``           [b, s, E]         the op in the router's forward producing them
``router_probs``            [b, s, E]         derived: the family's score of the logits
``expert_weights``          [b, s, k]         the experts call's ``top_k_weights`` argument
``expert_indices``          [b, s, k] int64   the experts call's ``top_k_index`` argument
``expert_pre_activations``  [b, s, k, P]      each slot's up projection, the activation's input
``expert_activations``      [b, s, k, I]      each slot's activations inside grouped/batched_mm
``expert_outputs``          [b, s, k, D]      each slot's weighted output inside grouped/batched_mm
``routed_output``           [b, s, D]         the experts module's output (= expert_outputs.sum(2))
``shared_expert_output``    [b, s, M]         the shared expert's contribution, after its gate
``mlp_output``              [b, s, M]         the block's output
==========================  ================  =================================================

D is the experts' width and M the model's hidden size. They differ only where the experts run
between two projections of the block (nemotron_h's ``moe_latent_size``, muse_spark's
``moe_hidden_size``).

Writing `router_logits` changes the routing (weights and indices follow);
writing weights, indices, per-slot values or outputs changes only what flows on.
Values are served in the order the model produces them (`order`); `save_all`
reads every value of the block in that order.
"""

from __future__ import annotations

import operator
import weakref
from functools import cached_property
from typing import Any, Iterable, Mapping

import nnsight
import torch
from jaxtyping import Float, Int
from nnsight.intervention.interleaver import Mediator
from torch import Tensor

from ..errors import (ArgumentError, FamilyError, MoelensError, OrderError, ValueUnavailable, WriteError, described,
                      sentence, warn)
from ..families import Scoring
from ..families.entry import PER_SLOT_VALUES, VALUE_NAMES, adapter_chain, beneath_adapters
from ..families.scoring import derived_routing, score
from ..modules import foreign_hooks, hook_name
from ..permutations import inverse_permutation
from ..scalars import check_flag
from . import tokens
from . import base
from .base import bind_alias, envoy_at
from .binding import ANY_INF, INDEX, MINUS_INF, Binding, argument, copied, kept_for_backward, normal_tensors, output_of
from .gathered import STALE_NOTE, gathered_call, note_gathered_calls
from .implementations import (IMPLEMENTATION_CALL, is_dispatching, is_transformers_own, ops_for, serving,
                              unreadable_ops)
from .mlp import Mlp
from .params import MoeParams, block_params, gate_and_up, refuse_fully_sharded
from .served import (RUNS, forwards_ended, generating, order_errors, request, request_step, run_fact, served,
                     skipped_visits)


class _SharedAlias:
    """``moe.shared_experts``: the shared-expert envoy, found lazily, or the reason there is none.

    A non-data descriptor, so an alias bound on the instance (or a native child
    named ``shared_experts``) shadows it. Lazy because a shared expert on the
    decoder layer (granite) is wrapped after the block.
    """

    def __get__(self, obj: "Moe | None", owner: Any = None) -> Any:
        if obj is None:
            return self
        envoy = obj._shared_envoy()
        if envoy is None:
            raise obj.no_shared_expert("shared_experts")
        return envoy


class _SharedGateAlias:
    """``moe.shared_gate`` where the block has no gate of a shared expert to bind it to (`Moe._bind_standard_names`
    binds it on the instance otherwise): the reason, as for ``shared_experts``."""

    def __get__(self, obj: "Moe | None", owner: Any = None) -> Any:
        if obj is None:
            return self
        if obj._shared_envoy() is None:
            raise obj.no_shared_expert("shared_gate")
        raise obj.unavailable("shared_gate", f"this {obj.family.name} block's shared expert has no gate of its own",
                              "its contribution is shared_expert_output.")


def _has_submodule(module: torch.nn.Module | None, path: str) -> bool:
    """Whether ``module`` has the child module at dotted ``path`` (looked up on the torch module, so an
    envoy's fallbacks, such as `_SharedAlias`, are never asked)."""
    try:
        return module is not None and isinstance(module.get_submodule(path), torch.nn.Module)
    except AttributeError:
        return False


#: The routing values moelens recomputes from router_logits for a family with ``derived_routing`` (llama4: no experts
#: call to read them at), served read-only.
DERIVED_ROUTING = ("expert_weights", "expert_indices")

#: The values whose entries per token `Moe._check_width` checks against the family entry.
_WIDTH_CHECKED = frozenset({"router_logits", "expert_weights", "expert_indices"})

#: What an earlier moelens pickled a wrapped ernie4_5_vl_moe block's hook as (see `gathered.STALE_NOTE`).
_note_gathered = STALE_NOTE


def _weakly(component: "Moe") -> "Moe":
    """``component``, held weakly, for the functions of the bindings it keeps (`Moe._static_bindings`,
    `Moe._slot_bindings`, `Moe._plan`): holding it strongly, they made a reference cycle, and a model deleted after a
    read kept its MoE blocks' weights until Python's cycle collector ran (the memory of every expert, on a GPU too)."""
    return weakref.proxy(component)


def value_names(values: Any) -> list[str]:
    """``values`` of `Moe.save_all` as a list of names (a str, or an iterable of them), else `ArgumentError`."""
    # (a tuple or list first: typing's checks are slow)
    names = list(values) if isinstance(values, (tuple, list)) or isinstance(values, Iterable) and not isinstance(
        values, (torch.Tensor, Mapping, bytes, bytearray)) else None
    odd = [name for name in names if not isinstance(name, str)] if names is not None else [values]
    if odd:
        given = type(values).__name__ if names is None else f"a {type(values).__name__} holding {odd[0]!r:.40}"
        raise ArgumentError(f"save_all: values must be a value name or a list of them (from {VALUE_NAMES}), got "
                            f"{given}.")
    return names


def _listed_value(line: str) -> str | None:
    """The value a line of nnsight's envoy tree lists for the block itself (``"  (router_logits) -> ..."``, one level
    in: a child's own values are deeper), or None for another line."""
    name, arrow, _ = line.partition(") -> ")
    return name[3:] if arrow and name.startswith("  (") and not name.startswith("   ") else None


class Moe(Mlp):
    """A Mixture-of-Experts block (``model.moes[i]``, ``model.layers[i].mlp``), whatever its family.

    In a trace it serves by name: ``router_logits``, ``router_probs`` (derived, read-only), ``selection_scores``
    (where the router ranks experts by a biased score), ``expert_weights``, ``expert_indices``, the per-slot
    ``expert_pre_activations``, ``expert_activations`` and ``expert_outputs`` (under grouped_mm / batched_mm),
    ``routed_output``, ``shared_expert_output`` and ``mlp_output``; a value the block cannot serve raises why
    (``repr(moe)`` lists them). Read them in the order ``moe.order()`` gives, the model's (``selection_scores``
    aside: after the logits, before the experts call), or all at once with ``moe.save_all()``. ``moe.params()``
    gives the router's and experts' weights as views of the model's; ``num_experts`` and ``top_k`` are E and k.
    Shapes, and what a write to each value does: docs/values.md.
    """

    INSTRUMENTED_AT_WRAP = True
    shared_experts = _SharedAlias()
    shared_gate = _SharedGateAlias()

    def __new__(cls, module: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> "Moe | Mlp":
        """A `Moe` for a block of a registered family; for another module at a block's path (one a user gave a
        block's envoy, ``model.layers[1].mlp = nn.Identity()``), the `Mlp` a dense block gets, as plain nnsight gives
        such a module an envoy of its own. (No module: unpickling, which fills the instance in itself.)"""
        if module is not None and base.registry.for_block(module) is None:
            dense = Mlp.__new__(Mlp)
            dense.__init__(module, *args, **kwargs)
            return dense
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        if self.family is None:
            raise ValueUnavailable(
                f"{type(module).__name__} is not the block of any registered moelens family; "
                "describe it with moelens.families.register(Family(...))."
            )
        self._bind_standard_names()

    # -- structure -------------------------------------------------------------------

    def _bind_standard_names(self) -> None:
        """Alias the router, experts and shared expert under their standard names."""
        family = self.family
        block = self._module  # the router and experts beneath the PEFT parameter adapters standing there, if any
        standard = {"router": beneath_adapters(block, family.router), "experts": beneath_adapters(block, family.experts)}
        if family.shared is not None and not family.shared.on_layer:
            standard["shared_experts"] = family.shared.module
            if family.shared.gate is not None:
                standard["shared_gate"] = family.shared.gate
        for alias, native in standard.items():
            if alias == native:
                continue
            try:
                target = envoy_at(self, native)
            except AttributeError:
                continue
            if target is not None:
                bind_alias(self, alias, native, target)

    def _standard_native(self, name: str) -> str | None:
        """As `Component._standard_native`, and ``shared_experts`` for the family's shared expert (on the block or,
        granite's, on the decoder layer: served by `_SharedAlias`)."""
        shared = self.family.shared
        if name == "shared_experts" and shared is not None and shared.module != name:
            return shared.module
        return super()._standard_native(name)

    @property
    def _output_holds_shared(self) -> bool:
        """Whether the block's own output holds a shared expert's part (one it calls; granite's, on the decoder
        layer, is added after it)."""
        return self._shared_envoy() is not None and not self.family.shared.on_layer

    def _shared_envoy(self) -> Any:
        """The shared-expert envoy (on the block or its decoder layer), or None."""
        shared = self.family.shared
        if shared is None:
            return None
        host = self.parent if shared.on_layer else self
        if host is None or not _has_submodule(host._module, shared.module):  # a config can turn it off
            return None
        envoy = envoy_at(host, shared.module)
        return envoy if envoy is not None and envoy._module is not None else None

    @property
    def num_experts(self) -> int:
        """E: the number of routed experts of this block."""
        return run_fact(self.interleaver, self, "num_experts",
                        lambda: self._count("num_experts"))

    @property
    def top_k(self) -> int:
        """k: how many experts each token is routed to."""
        return run_fact(self.interleaver, self, "top_k", lambda: self._count("top_k"), per_step=True)

    def _count(self, setting: str) -> int:
        """The family entry's count ``setting`` (``num_experts``, ``top_k``, ``extra_logits``) read from this block;
        a `FamilyError` where the reference names no whole number there."""
        reference = getattr(self.family, setting)
        try:
            value = self.family.resolve(reference, self._module)
        except FamilyError:  # the entry's fault, unless the module it reads was removed after wrapping
            self._refuse_replaced(f"{self.path}.{setting}", f"its {setting} cannot be read")
            raise
        try:
            return operator.index(0 if value is None and setting == "extra_logits" else value)
        except TypeError:
            if isinstance(value, float) and value.is_integer():  # a count a config keeps as a float
                return int(value)
            raise FamilyError(
                f"{self.path}: family {self.family.name!r} reads {setting} from {reference!r}, which holds "
                f"a {described(value)} on this block, not a whole number; name the attribute that holds the count "
                "and register the entry again (moelens.families.register(Family(...), replace=True))."
            ) from None

    @property
    def SCORING(self) -> Scoring:
        """What the logits mean: how this block's family scores them and picks experts."""
        return self.family.scoring_of(self._module)

    @property
    def experts_implementation(self) -> str:
        """The transformers experts implementation the experts module runs now.

        ``"eager"`` for experts transformers does not dispatch (undecorated: dbrx's loop over its experts,
        llama4's one batched matmul over all of them), and where the experts module's config names none (a
        config object of one's own without ``_experts_implementation``: transformers then runs the experts' own
        forward). A transformers model built as ``MyModel(config)`` names one: ``PreTrainedModel.__init__`` sets
        transformers' default (``"grouped_mm"``, or ``"eager"`` where grouped_mm cannot run).
        """
        experts = self.experts._module
        if not self.family.experts_call or not is_dispatching(experts):
            return "eager"
        # None (a config of one's own; PreTrainedModel.__init__ always sets one): transformers runs the eager forward
        return getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"

    def order(self) -> tuple[str, ...]:
        """The values this block serves, in the order the model produces them."""
        return self.family.order()

    def _order(self) -> tuple[str, ...]:
        """`order`, with `selection_scores` after the logits where the router ranks them (what an order error lists;
        ``ablate(..., "route_around")`` reads them there)."""
        order = list(self.order())
        if self.ranks_selection_scores:
            order.insert(order.index("router_probs") + 1, "selection_scores")
        return tuple(order)

    # -- availability ------------------------------------------------------------------

    def no_mixture(self, name: str = "router_logits") -> ValueUnavailable:
        """The error for a value this family's block does not compute (with the reason)."""
        return self.unavailable(name, self.family.refused.get(name, "this block runs no mixture for it"))

    def needs_grouped_experts(self, name: str = "expert_outputs") -> ValueUnavailable:
        """The error for a per-slot value under an experts implementation that has none."""
        identity = self.family.identity_count(self._module)
        if identity:
            return self.unavailable(
                name,
                f"this block's last {identity} experts are zero-compute (they pass their input through), which "
                "transformers' experts implementations do not run (an eager loop of the experts' own runs them, or "
                "the block adds their share itself), so no [tokens, k, ...] tensor holds their slots",
                "read routed_output (the slots' sum), or expert_indices and expert_weights.",
            )
        if not self.family.experts:
            return self.unavailable(
                name,
                "the block computes its experts inline (its family's experts=''): per-slot values exist only inside "
                f"transformers' {', '.join(serving())} experts implementations, which run in an experts module",
                ("read mlp_output and shared_expert_output" if self._output_holds_shared
                 else "read routed_output or mlp_output")
                + "; or have the block call its experts as a module, "
                "experts(hidden, top_k_index, top_k_weights), decorated with transformers.integrations.moe."
                "use_experts_implementation.",
            )
        if not is_dispatching(self.experts._module):
            return self.unavailable(
                name,
                f"per-slot values exist only inside transformers' {', '.join(serving())} experts implementations, "
                f"and this block's experts ({type(self.experts._module).__name__}) run a forward of their own "
                "(not decorated with transformers' use_experts_implementation)",
                "read routed_output, or decorate the experts class with "
                "transformers.integrations.moe.use_experts_implementation so it can run grouped_mm.",
            )
        implementation = self.experts_implementation
        own = is_transformers_own(implementation)
        what = "a loop over experts or a kernel, with no [tokens, k, ...] tensor" if own else \
            "an implementation registered with transformers, whose op names moelens does not know"
        register = "" if own else (f"; or tell moelens which of its ops hold them: moelens.components."
                                   f"register_implementation({implementation!r}, ExpertsOps(...))")
        return self.unavailable(
            name,
            f"per-slot values exist only inside the {', '.join(serving())} experts implementations, "
            f"and this block runs {implementation!r} ({what})",
            'switch with model.set_experts_implementation("grouped_mm") (or load with '
            f'experts_implementation="grouped_mm"){register}.',
        )

    def no_shared_expert(self, name: str = "shared_expert_output") -> ValueUnavailable:
        """The error for a shared-expert value on a block that has none."""
        shared = self.family.shared
        if shared is None:
            reason = f"the {self.family.name} family has no shared expert"
        else:
            reason = (
                f"this checkpoint's {self.family.name} block has no shared expert "
                f"(its {shared.module!r} is absent: the config turns it off, or the family entry names the wrong path)"
            )
        instead = [value for value in ("routed_output", "mlp_output") if value not in self.family.refused]
        return self.unavailable(name, reason, f"read {' or '.join(instead)} instead." if instead else "")

    def _check_available(self, name: str, implementation: str | None = None) -> None:
        """Raise the reason ``name`` cannot be served here (``implementation``: the experts', if read already)."""
        if name in ("mlp_activation", "mlp_neurons"):
            raise self._routed_activation(name)
        if name == "selection_scores":
            self._selection_binding()  # raises why this block ranks no selection score
            return
        if name in self.family.refused:
            raise self.no_mixture(name)
        if name in PER_SLOT_VALUES:
            implementation = implementation or self.experts_implementation
            ops = ops_for(implementation)
            if ops is None or self.family.identity_experts is not None and self.family.identity_count(self._module):
                raise self.needs_grouped_experts(name)
            if name == "expert_pre_activations" and not ops.pre_activations:
                raise self.unavailable(
                    name, f"the {implementation} experts implementation was registered "
                          "with ExpertsOps(pre_activations=False): the input of its activation op is no slot's up "
                          "projection (it computes the activations elsewhere)",
                    "read expert_activations, or recompute the projection from moe.params().")
        if name == "shared_expert_output" and self._shared_envoy() is None:
            raise self.no_shared_expert(name)
        if name == "routed_output" and not self.family.experts and self._output_holds_shared:
            raise self.unavailable(
                name,
                "the block computes its experts inline (its family's experts=''), so moelens reads the routed output "
                "at the block's own output, which holds its shared expert's contribution too",
                "read mlp_output and shared_expert_output (the routed part is their difference); write "
                "shared_expert_output or the routing (router_logits) to change the block.",
            )

    # -- served values -------------------------------------------------------------------

    @served
    def router_logits(self, value: Any) -> Float[Tensor, "b s e"]:
        """Router logits [b, s, E], read at the op in the router's forward that produces them (before scoring and selection bias). Writing them changes the routing: weights and indices follow."""

    @served
    def expert_weights(self, value: Any) -> Float[Tensor, "b s k"]:
        """Each slot's routing weight [b, s, k], the experts call's top_k_weights. Zeroing [..., j] removes slot j; a write changes the output only."""

    @served
    def expert_indices(self, value: Any) -> Int[Tensor, "b s k"]:
        """Each slot's expert [b, s, k] (int64), the experts call's top_k_index. Writing reroutes the slot; its weight stays."""

    @served
    def expert_pre_activations(self, value: Any) -> Float[Tensor, "b s k p"]:
        """Each slot's up projection [b, s, k, P] inside grouped_mm / batched_mm, in token-slot order: the input of its gate / activation (gated experts: gate and up, P = 2I, in the family's layout; [gate | up] halves in most, interleaved in gpt_oss; otherwise P = I). Writing changes what the slot's activation sees."""

    @served
    def expert_activations(self, value: Any) -> Float[Tensor, "b s k i"]:
        """Each slot's intermediate activations [b, s, k, I] (after the gate / activation) inside grouped_mm / batched_mm, in token-slot order. Writing changes what that slot's down projection sees."""

    @served
    def expert_outputs(self, value: Any) -> Float[Tensor, "b s k d"]:
        """Each slot's weighted output [b, s, k, D] inside grouped_mm / batched_mm. Writing changes that slot's contribution."""

    @served
    def routed_output(self, value: Any) -> Float[Tensor, "b s d"]:
        """The experts module's output [b, s, D]; equals expert_outputs.sum(2). Writing replaces the routed sum."""

    @served
    def shared_expert_output(self, value: Any) -> Float[Tensor, "b s m"]:
        """The shared expert's contribution [b, s, M] (after its gate, if gated). Writing replaces it."""

    @served
    def mlp_output(self, value: Any) -> Float[Tensor, "b s m"]:
        """What the block outputs [b, s, M]: the family's combination of routed and shared output. Writing replaces it."""

    @served
    def selection_scores(self, value: Any) -> Float[Tensor, "b s e"]:
        """What the router ranks to pick experts [b, s, E] where it adds a selection bias to the scores (DS3: sigmoid(logits) + e_score_correction_bias), read at the family's ``selection_op`` (its output, or the argument ``selection_arg`` of that top-k call). Writing changes which experts are picked; their weights stay the scores of the logits."""

    @served
    def mlp_activation(self, value: Any) -> None:
        """Not served on an MoE block (each token runs k routed experts): read expert_activations [b, s, k, I]."""

    @served
    def mlp_neurons(self, value: Any) -> None:
        """Not served on an MoE block (each token runs k routed experts): read expert_activations [b, s, k, I]."""

    @property
    def router_probs(self) -> Float[Tensor, "b s e"]:
        """The family's score of each expert [b, s, E] (float32), derived from router_logits. Read-only."""
        self._check_available("router_probs")
        self._require_trace("router_probs")
        mediator = Mediator.current("router_probs")
        try:
            logits = self.router_logits  # requested first: a request lets the model run on, and its hooks must not nest in ours
        except OrderError as error:
            location = self._static_bindings["router_logits"].location
            skipped = mediator.iteration and skipped_visits(mediator, location) > 0  # a router skipped at an earlier step
            raise (self._skipped_error("router_probs", location) if skipped else
                   self._order_error("router_probs", step_passed=getattr(error, "step_passed", False))) from None
        return self._scored(logits)

    def _scored(self, logits: Tensor) -> Float[Tensor, "b s e"]:
        """`router_probs` of the router logits read in this run (a normal tensor under inference_mode, as the logits
        read there are: `normal_tensors`)."""
        with kept_for_backward(), normal_tensors():
            probs = score(self.family.score_of(self._module), logits, self.softcap)
        handed_back = RUNS.get(self.interleaver)
        if handed_back is not None and torch.is_grad_enabled():
            derived = (f"{self.path}.router_probs.grad: router_probs is derived (moelens scores router_logits; the "
                       "model goes on from its own scores), so no output of the model depends on it")
            if probs.requires_grad:  # its hook never fires unless a loss of the user's is computed from it
                reason = (f"{derived}: it has a gradient only where the loss was computed from it, and then it is read "
                          "in the order the backward reaches the blocks, last layer first. Read router_logits.grad "
                          "for the model's own loss.")
            else:  # no hook can be put on it (`_no_gradient_refusal`)
                reason = (f"{derived}, and it has no gradient. Read router_logits.grad instead, with the router's "
                          "weights unfrozen before the trace (moe.router._module.requires_grad_(True)) or the input "
                          "embeddings' output requiring grad (hf_model.enable_input_require_grads()).")
            handed_back.without_gradient(probs, reason)  # read at `_derived_gradient_refusal`, `_no_gradient_refusal`
        return probs

    @router_probs.setter
    def router_probs(self, value: Any) -> None:
        raise WriteError(
            f"{self.path}.router_probs is derived from router_logits and cannot be written; "
            "write router_logits (or use moelens.steer) to change the routing."
        )

    @property
    def read_only(self) -> tuple[str, ...]:
        """The served values a write to is refused for: `router_probs` (derived), and `DERIVED_ROUTING` where the
        family has no experts call."""
        return ("router_probs", *(DERIVED_ROUTING if self.family.derived_routing else ()))

    @property
    def has_shared_expert(self) -> bool:
        """Whether this block has a shared expert (``shared_experts`` and ``shared_expert_output`` raise the reason otherwise)."""
        return self._shared_envoy() is not None

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as the wrapped model's (`moelens.wrapping.refusals.compile_refusal`)."""
        from ..wrapping.refusals import compile_refusal  # (it reads this module)

        raise MoelensError(compile_refusal(self.path))

    def params(self, expert: int | None = None) -> MoeParams:
        """This block's router and expert weights, as views of the model's parameters.

        Every tensor is in ``nn.Linear``'s ``[out, in]`` convention whatever the family
        stores (fused, transposed, interleaved or stacked experts); editing a view in
        place edits the model (see `moelens.components.params`). Works outside a trace.

        Args:
            expert: One expert's weights (``[H, D]``, ...), or None for every expert's
                (``[E, H, D]``, ...). With experts sharded by `moelens.parallel.shard_experts`,
                only this rank's experts can be asked for, one at a time.

        Raises:
            ArgumentError: ``expert`` is not an int in ``[0, E)``.
            ValueUnavailable: the expert lives on another rank, the experts carry moelens.compress
                LoRA adapters (fold them in first with `moelens.compress.merge_lora`) or store no
                plain weight tensors, accelerate offloads the block's weights (to disk or onto another
                device: in a trace too, where they are a copy), or the block (or its router or experts)
                was replaced or removed after wrapping (its views would be the old module's).

        ``router`` is None where the logits are no one linear layer's ``[E, D]`` weight (a warning
        says so where that layer carries a PEFT adapter).
        """
        self._refuse_replaced(f"{self.path}.params", "the views would be the old module's, and editing them would "
                              "not change the model")
        params = block_params(self.family, self._module, self.num_experts, f"{self.path}.params", expert)
        refuse_fully_sharded(self.modules_down(), f"{self.path}.params")  # after DTensors' refusal, which says more
        return params

    def gate_and_up(self, pre_activations: Float[Tensor, "*slots p"]
                    ) -> tuple[Float[Tensor, "*slots i"], Float[Tensor, "*slots i"]]:
        """The gate and up projections in ``expert_pre_activations`` of gated experts, as two views ``[..., I]``.

        ``gate, up = moe.gate_and_up(moe.expert_pre_activations)`` splits ``[b, s, k, 2I]`` the way the
        experts' fused weight is stored (``[gate | up]`` halves, interleaved in gpt_oss): ``gate[..., i]`` is
        the slot's projection by row ``i`` of ``params().gate``, ``up[..., i]`` by row ``i`` of ``params().up``
        (biases included). They are views: in a trace, an in-place edit of either
        (``gate[..., i] = 0``) edits the pre-activations the model goes on with, as an edit of the value does.
        Works outside a trace too (on a saved value).

        Raises:
            ArgumentError: ``pre_activations`` is no floating-point tensor whose last dimension is this block's 2I.
            ValueUnavailable: the experts are not gated (the pre-activations are the up projection alone), or
                their weights' layout is unknown.
        """
        return gate_and_up(self.family, self.experts._module, pre_activations, f"{self.path}.gate_and_up")

    def _refuse_replaced(self, where: str, consequence: str) -> None:
        """Raise where this block, or a module under it moelens instrumented, is no longer in the model as wrapped
        (replaced or removed after wrapping): ``where`` would read the old module, with ``consequence``."""
        root = self.root
        if root is self:  # the wrapped model was let go (envoys hold their parent weakly): nothing to compare with
            return
        replaced = []
        for path in base.instrumented_record(self) or [self.path]:  # the block, then its router and experts
            try:
                root._module.get_submodule(path.partition(".")[2])  # the root envoy's path is "model"
            except AttributeError:  # deleted, or set to None
                replaced = [f"{path} (removed)"]
                break
        base.refuse_replaced(self, replaced or base.replaced_modules(self), where, consequence, ValueUnavailable)

    def __repr__(self) -> str:
        """What the block is (family, E, k, experts implementation), then nnsight's tree of its modules and values.
        Not its layer (the model's tree labels it): identical layers then fold into one entry there, as nnsight folds
        them (a 48-layer model's tree printed 48 copies)."""
        try:
            replaced = base.replaced_since_wrap(self)
            if replaced:
                head = (f"Moe[{self.family.name}; {', '.join(replaced)} replaced after wrapping: wrap the model "
                        "again] ")
            else:
                score_name = self.family.score_of(self._module)
                head = (f"Moe[{self.family.name}, E={self.num_experts}, k={self.top_k}, "
                        f"{self.experts_implementation}; router_probs = {score_name}(router_logits)] ")
        except Exception:  # noqa: BLE001 - a repr never raises; the tree alone then
            head = ""
        notes = {name: f"not served by this block: {why}" for name, why in self._unserved().items()}
        if self.family.derived_routing:
            for name in DERIVED_ROUTING:
                notes[name] = (f"read-only here: {self.family.name} calls no experts module, so moelens recomputes "
                               f"{name} from router_logits; write router_logits to change the routing.")
        lines = [
            f"{line.split(') -> ')[0]}) -> {notes[name]}" if name in notes else line
            for line in super().__repr__().split("\n") for name in [_listed_value(line)]
        ]
        return head + "\n".join(lines)

    def _unserved(self) -> dict[str, str]:
        """The values nnsight's tree lists that this block cannot serve, each with the reason (for `__repr__`)."""
        unserved = {}
        for name in VALUE_NAMES:
            try:
                self._check_available(name)
            except ValueUnavailable as error:
                unserved[name] = error.why
            except Exception:  # noqa: BLE001 - a repr never raises
                continue
        for name in ("mlp_activation", "mlp_neurons"):
            unserved[name] = self._routed_activation(name).why
        try:
            if not self.ranks_selection_scores:
                unserved["selection_scores"] = "its router ranks no score other than router_probs' (no selection bias)"
        except Exception:  # noqa: BLE001 - a repr never raises
            pass
        return unserved

    def _routed_activation(self, name: str) -> ValueUnavailable:
        return self.unavailable(
            name,
            "an MoE block has no single hidden activation: each token runs through k routed experts",
            "read each slot's activations with expert_activations ([b, s, k, I]).",
        )

    # -- reading and writing -------------------------------------------------------------

    def mark_gathered_calls(self) -> None:
        """Have the block note, as each call begins, whether it got a flat subset of the tokens (``[n * D]`` or
        ``[n, D]``, gathered by modality: ernie4_5_vl_moe with images) instead of the batch (``[B, S, D]``), which no
        ``[batch, seq]`` view can place. For families whose blocks may run on part of the input (`runs_only_on`).
        The hook goes with this component: it is removed when the wrapped model is collected (each wrapper of
        a model has its own).
        """
        note_gathered_calls(self, self._module)

    def _read(self, descriptor: served, keep_open: bool = True, binding: Binding | None = None) -> Any:
        if self.family.derived_routing and descriptor.name in DERIVED_ROUTING:
            # the router's own module, and the PEFT parameter adapters standing at its path above it (whose output
            # is the block's too: a hook at the router's native path lands on the outermost of them)
            hooks = [hook for module in adapter_chain(self._module, self.family.router)
                     for hook in foreign_hooks(module, pre=False)]
            if hooks:
                raise self.unavailable(
                    descriptor.name,
                    f"the {self.family.name} block calls no experts module, so moelens derives {descriptor.name} from "
                    f"router_logits, read inside the router's forward, and the router has a forward hook that is not "
                    f"moelens' ({hook_name(hooks[0])}), which may change the "
                    "scores the block goes on with",
                    "read router_logits and apply your hook's change to them, or remove the hook for this trace.",
                )
            logits = self._derived_logits(descriptor.name)  # before moelens' saved-tensor hooks are in force
            # a normal tensor under inference_mode (`normal_tensors`): an edit of it is told, as of a read
            with kept_for_backward(), normal_tensors():
                family, block = self.family, self._module
                weights, indices = derived_routing(
                    logits, self.top_k, family.score_of(block), self.SCORING.select, family.normalize_of(block),
                    family.scale_of(block), self.softcap, family.normalize_min_of(block))
            value = weights if descriptor.name == "expert_weights" else indices
            handed_back = RUNS.get(self.interleaver)
            if handed_back is not None:  # an in-place edit of it is lost: the trace says so as it ends
                handed_back.note(value, f"{self.path}.{descriptor.name}", private=True, edit_error=(
                    f"{self.path}.{descriptor.name} was edited in place, but it is moelens' recomputation from "
                    f"router_logits (the {self.family.name} block calls no experts module), which the model never "
                    "reads: the edit did not reach the model. Write router_logits to change the routing (steer, "
                    "force)."))
            return value
        value = super()._read(descriptor, keep_open, binding)
        self._check_width(descriptor.name, value)
        return value

    def _derived_logits(self, name: str) -> Tensor:
        """The router_logits ``name`` (one of `DERIVED_ROUTING`) is recomputed from, read now; an `OrderError` naming
        ``name`` where the model has run past the op they are read at (to the router's output, say)."""
        try:
            return self.router_logits
        except OrderError as error:
            raise OrderError(
                f"{self.path}.{name} could not be served: the {self.family.name} block calls no experts module, so "
                f"moelens recomputes {name} from router_logits, read inside the router's forward, and those could not "
                f"be read: {sentence(error)}. Read {name} before anything later in the router, such as "
                "moe.router.output (which may be written, and the block goes on with what it holds), and before the "
                "values after the router."
            ) from error

    def _check_call(self, name: str) -> None:
        """Refuse ``name``, read or written, when this call of the block got tokens gathered out of the batch: no
        ``[batch, seq]`` view places them (a write laid flat over them would land on other tokens)."""
        # gathered calls are noted on per-modality blocks and a tower's (`mark_gathered_calls`); checked on every read
        if not (self._family.runs_only_on or self.runs_before_expansion) or not gathered_call(self._module):
            return
        if not self.family.runs_only_on:  # a block outside the decoder (a vision tower's) on flat patches
            raise self.unavailable(
                name,
                "this block runs outside the text decoder (a vision tower's) on flat tokens (image patches, gathered "
                "over the images), which no [batch, seq] view places",
                f"read its tensors with plain nnsight ({self.path}.output, {self.path}.router.output, flat over "
                "its tokens).",
            )
        raise self.unavailable(
            name,
            "this call of the block ran on part of the tokens, gathered out of the batch (its layer sends the "
            "tokens of each modality to a block of their own, and this input holds more than one), so its values "
            "have no [batch, seq] layout",
            "read the layer's mlp.output (its router logits scattered back over every token, [batch * seq, E]), "
            "or this block's raw nnsight values (moe.router.output, flat over its tokens).",
        )

    def _check_width(self, name: str, value: Tensor) -> None:
        """Raise `FamilyError` when what the model computes does not fit the family entry: E router logits per token
        (plus the entry's `extra_logits`), k slots, integer expert indices and floating-point weights."""
        if name not in _WIDTH_CHECKED:
            return
        if name != "router_logits" and value.is_floating_point() != (name == "expert_weights"):
            positions = self.family.routing_from_router
            if positions is not None:
                raise FamilyError(
                    f"{self.path}.{name} is a {value.dtype} tensor: family {self.family.name!r} reads the weights and "
                    f"indices at positions {positions} of the router's output (routing_from_router), and "
                    f"{type(self.router._module).__name__} returns them elsewhere: fix the entry's positions."
                )
            raise FamilyError(
                f"{self.path}.{name} is a {value.dtype} tensor: moelens reads the experts call as "
                f"experts(hidden, top_k_index, top_k_weights), and {type(self.experts._module).__name__} gets its "
                "expert indices and weights in another order. Call the experts module in that order (transformers' "
                "own, which its implementations expect), or wrap it in a module that takes them so."
            )
        expected = self._width(name)
        if value.shape[-1] != expected:
            what = "router logits" if name == "router_logits" else "slots"
            extra = self.family.extra_logits if what == "router logits" and expected != self.num_experts else None
            setting = (f"top_k={self.family.top_k!r}" if what == "slots" else f"num_experts={self.family.num_experts!r}"
                       + (f" plus extra_logits={extra!r}" if extra else ""))
            if what == "slots" and self.family.routing_from_router is not None:  # or a position off the weights
                setting += f", read at the router's output with routing_from_router={self.family.routing_from_router}"
            columns = (" (a router with columns past its experts' own, a skip class or shared experts' gates, names "
                       "how many in extra_logits)" if what == "router logits" else "")
            if what == "router logits" and value.shape[-1] < min(expected, self.num_experts):  # not extra_logits'
                columns += f", or logits_op={self.family.logits_op!r} names {self._narrow_logits_op()}"
            run = RUNS.get(self.interleaver)
            if what == "slots" and isinstance(self.family.top_k, str) and run is not None and run.generating:
                raise FamilyError(  # read per step: the setting may have changed since the step's first read
                    f"{self.path}.{name} holds {value.shape[-1]} slots per token, but {self.family.top_k} reads "
                    f"{expected} now. Either it was changed between two reads of this block at one generation step, "
                    "which ran with the old value (change it before the step's reads of the block), or family "
                    f"{self.family.name!r} names the wrong setting ({setting}): fix it, register it again and wrap "
                    "the model again."
                )
            raise FamilyError(
                f"{self.path}.{name} holds {value.shape[-1]} entries per token, but family {self.family.name!r} sets "
                f"this block's {what} per token to {expected} ({setting}): the entry names the wrong setting{columns}; "
                "fix it, register it again (moelens.families.register(Family(...), replace=True)) and wrap "
                "the model again (moelens.wrap(model._module)): a wrapped model keeps the entry it was wrapped with."
            )

    def _narrow_logits_op(self) -> str:
        """What `_check_width` says of a logits op with fewer columns than E: an op after the logits, and the router's
        operations to choose from."""
        router = type(self.router._module).__name__
        try:
            listed = f"; {router}.forward's operations are {', '.join(self.router.source.names)}"
        except Exception:  # noqa: BLE001 - the advice without the list
            listed = ""
        return (f"an op of {router}.forward that holds fewer columns than the logits (the top-k weights, say): name "
                f"the op whose output holds one logit per expert{listed}")

    def _width(self, name: str) -> int:
        """How many entries per token `_check_width` expects of value ``name``: E plus the entry's `extra_logits` for
        router_logits, k for the weights and indices. Each count is read (once per run) only when a value needing it
        is checked, so a block whose k cannot be read still serves its router logits."""
        if name == "router_logits":
            return run_fact(self.interleaver, self, "logits width",
                            lambda: self.num_experts + self._count("extra_logits"))
        return self.top_k

    def _write(self, descriptor: served, value: Any) -> None:
        if self.family.derived_routing and descriptor.name in DERIVED_ROUTING:
            raise WriteError(
                f"{self.path}.{descriptor.name} is recomputed from router_logits in the "
                f"{self.family.name} family (it has no experts call to write into); write router_logits."
            )
        super()._write(descriptor, value)

    def _binding(self, name: str, implementation: str | None = None) -> Binding:
        """``implementation``: the experts implementation, where the caller read it already (`save_all`)."""
        if name == "selection_scores":
            return self._selection_binding()
        if name in PER_SLOT_VALUES:
            implementation = implementation or self.experts_implementation
            self._check_available(name, implementation)
            return self._slot_bindings(implementation, name)[name]
        self._check_available(name)
        return self._shared_binding if name == "shared_expert_output" else self._static_bindings[name]

    def _location_of(self, name: str) -> str | None:
        return super()._location_of("router_logits" if name == "router_probs" else name)  # scored from the logits

    def _slot_bindings(self, implementation: str, name: str) -> dict[str, Binding]:
        """The per-slot values' bindings under ``implementation``, built once per implementation (a read
        builds none: at 1 x 8 tokens moelens' own Python is a visible part of a trace); ``name``: the one read."""
        built = self.__dict__.setdefault("_slot_bindings_by_implementation", {})
        key = (implementation, ops_for(implementation))  # op names registered again (replace=True) are read anew
        if key not in built:
            if (why := unreadable_ops(*key)) is not None:  # else the read would wait for an op that never comes
                raise self.unavailable(name, f"this block runs the experts implementation {implementation!r}, and "
                                             f"{why}", "register it again with the op names it has "
                                                       "(moelens.components.register_implementation(..., replace=True)).")
            built[key] = {value: self._slot_binding(value, implementation) for value in PER_SLOT_VALUES}
        return built[key]

    @cached_property
    def _static_bindings(self) -> dict[str, Binding]:
        family, me = self.family, _weakly(self)
        experts = self.experts.path
        edited_later = copied if self._output_edited_later else None  # falcon adds attention to it in place
        bindings = {
            "router_logits": Binding(f"{self.router.path}.source.{family.logits_cast_op or family.logits_op}.output",
                                     features=1,
                                     infinities=lambda: ANY_INF if me._scores_saturate else MINUS_INF,
                                     # the most a write may need: `_finite_logits_needed` says what this block's
                                     # router needs at the write (its score function can be switched after wrapping)
                                     min_finite=2 if self.SCORING.select == "sparsemixer" else 1),
            "expert_weights": Binding(*self._routing_location(2, "top_k_weights", 0)),
            "expert_indices": Binding(*self._routing_location(1, "top_k_index", 1), kind=INDEX,
                                      upper=lambda: me.num_experts),
            "routed_output": (Binding(f"{self.path}.output", 1, *output_of(family.combine.output_index))
                              if family.routed_from_block else Binding(f"{experts}.output", 1, *output_of(None))),
            "mlp_output": Binding(f"{self.path}.output", 1, *output_of(family.combine.output_index),
                                  to_view=edited_later, from_view=edited_later),
        }
        return bindings

    def _routing_location(self, argument_position: int, keyword: str, router_output: int) -> tuple:
        """Where `expert_weights` / `expert_indices` live: the experts call's argument at ``argument_position``
        (or ``keyword``), or the router's output, at the position the entry's `routing_from_router` gives."""
        positions = self.family.routing_from_router
        if positions is None:
            return f"{self.experts.path}.input", 1, *argument(argument_position, keyword)
        fix = "name the positions of the router's (weights, indices) there."
        return f"{self.router.path}.output", 1, *output_of(positions[router_output],
                                                         f"routing_from_router={positions}", fix)

    @cached_property
    def _shared_binding(self) -> Binding:
        """`shared_expert_output`'s binding; built on its first read, after `_check_available` found the shared
        expert (a block may run without it for a while: ``block.shared_experts = None``)."""
        shared = self.family.shared
        location = (f"{self.path}.source.{shared.gated_op}.output" if shared.gated_op
                    else f"{self._shared_envoy().path}.output")
        # The block edits it in place later: the reader keeps a copy, and the model gets its own.
        copy = copied if shared.edited_later else None
        return Binding(location, 1, to_view=copy, from_view=copy)

    @property
    def softcap(self) -> float:
        """The logit softcap this block's router applies before scoring (laguna), 0.0 for none."""
        return self.family.softcap_of(self._module)

    @property
    def ranks_selection_scores(self) -> bool:
        """Whether this block's router picks experts by `selection_scores` (score + a selection bias it has)."""
        scoring = self.SCORING
        return bool(scoring.selection_op) and self.family.holds(scoring.selection_bias, self._module)

    def _selection_binding(self) -> Binding:
        scoring = self.SCORING
        if scoring.select == "hash":
            raise self.unavailable(
                "selection_scores",
                f"this {self.family.name} layer picks experts from a token-id table ({scoring.describe()}), ranking no "
                "score",
                "its router_logits only weight the experts the table picks: to change which experts run, write "
                "expert_indices (or use moelens.reroute).",
            )
        if not self.ranks_selection_scores:
            why = ("no selection op in its family entry" if not scoring.selection_op
                   else f"this checkpoint has no {scoring.selection_bias}")
            raise self.unavailable(
                "selection_scores",
                f"the {self.family.name} router ranks no separate selection score ({why})",
                "its choice follows router_logits: read or write those.",
            )
        ops, prepare = f"{self.router.path}.source", None
        if scoring.selection_in:  # the router ranks inside a method of its own (longcat_flash)
            ops = f"{ops}.{scoring.selection_in}.source"
            me = _weakly(self)
            prepare = lambda: me._drill("selection_scores", me.router, scoring.selection_in)  # noqa: E731
        op = f"{ops}.{scoring.selection_op}"
        named_by = f"Scoring(selection_op={scoring.selection_op!r}, selection_arg={scoring.selection_arg!r})"
        if scoring.selection_arg is None:
            return Binding(f"{op}.output", features=1, infinities=ANY_INF, min_finite=self.top_k, prepare=prepare,
                           named_by=named_by)
        advice = (f"the family entry names it ({named_by}): name the argument that holds the scores the router ranks "
                  "(0 for torch.topk(scores + bias, k)).")
        return Binding(f"{op}.input", 1, *argument(scoring.selection_arg, error=FamilyError, advice=advice),
                       infinities=ANY_INF, min_finite=self.top_k, prepare=prepare, named_by=named_by)

    @property
    def _scores_saturate(self) -> bool:
        """Whether a +inf logit gives a finite score here (sigmoid: 1), so a write may hold one."""
        return self.family.score_of(self._module) == "sigmoid"

    def _finite_logits_needed(self, dtype: torch.dtype) -> tuple[int, str]:
        """The fewest `router_logits` per token a write in ``dtype`` (the logits', which the router scores and
        renormalises in) may leave above -inf on this block now, and what its router would make of fewer (the end of
        a refusal's "so ..."). phimoe's sparse mixer needs 2 and a softmax 1: over -inf alone it is NaN (not under a
        softcap, which takes -inf to the finite ``-c``). A bounded score (sigmoid, sqrtsoftplus) is 0 at -inf, so the
        router still fills its k slots, at weight 0, and needs none, unless it renormalises those k weights by their
        plain sum (0/0, NaN): not where it pads that sum (`Scoring.normalize_eps`, DeepSeek-V3's ``+ 1e-20``) or
        floors it (`Scoring.normalize_min`) by an amount ``dtype`` holds (1e-20 is 0 in float16), nor where a softcap
        leaves the scores above 0 (sigmoid(-c) is 0 in float32 from c of about 104)."""
        family, block = self.family, self._module
        if self.SCORING.select == "sparsemixer":
            return 2, "its routing scores would be NaN (the sparse mixer's masked softmaxes)"
        function, cap = family.score_of(block), self.softcap
        if function == "softmax":
            return (0, "") if cap > 0 else (1, "its routing scores would be NaN (a softmax over -inf alone)")
        normalize = family.normalize_of(block)
        pad = max(self.SCORING.normalize_eps, family.normalize_min_of(block))
        if not normalize or torch.tensor(pad, dtype=dtype) > 0:
            return 0, ""
        if cap > 0 and score(function, torch.tensor(float("-inf"), dtype=dtype), cap) > 0:
            return 0, ""
        divisor = "sum" if normalize is True or normalize == 1 else f"{normalize:g}-norm"
        padded = f" plus {pad:g}, which is 0 in {dtype}" if pad > 0 else ""
        return 1, (f"its routing weights would be NaN: every {function} score would be 0, and the router divides its "
                   f"k weights by their {divisor}{padded} (0/0)")

    def _nested(self, op: str, end: str = "output") -> str:
        """The location of op ``op`` inside the experts implementation: its ``output``, or its ``input``."""
        return f"{self.experts.path}.source.{IMPLEMENTATION_CALL}.source.{op}.{end}"

    def _drill(self, name: str, owner: Any = None, call_op: str = IMPLEMENTATION_CALL) -> None:
        """Make the ops inside a call of ``owner``'s forward addressable in this run (for ``name``): by
        default the experts implementation's; the router's ranking method where it has one (longcat_flash).

        nnsight counts the visits of those ops from the first drill of the run on, while a
        request pinned to a ``tracer.iter`` step asks for that step's visit counted from the
        start. So a pinned request first reads the call's input (counted from the start): that
        visit is the step's, and the requests after it follow the model from there. One pinned to
        the first step (a read outside ``tracer.iter``) is refused once the call has run: nnsight
        would serve the next. Inside a loop's later passes (no pin) the next call is the one asked.
        """
        owner = self.experts if owner is None else owner
        call = f"{owner.path}.source.{call_op}"
        mediator = Mediator.current(call)
        pinned = mediator.iteration  # to a step after the first
        if not pinned and owner.interleaver.sourced.get(call) is not None:  # another value drilled it in this run
            return
        with order_errors(pinned, lambda: self._order_error(name)):
            if pinned:  # refused where the owner was skipped at an earlier step: its ops' steps no longer line up
                request_step(mediator, f"{call}.input", lambda: self._order_error(name),
                             lambda: self._skipped_error(name, f"{call}.input"))
            elif pinned == 0 and mediator.occurrence(f"{call}.input"):  # pinned to the first call, which ran: a
                # drill now would serve the next (generation step, looped block's pass)
                raise self._order_error(name, step_passed=generating(mediator)
                                        and forwards_ended(mediator, f"{call}.input") > 0)
            getattr(owner.source, call_op).source

    def _sort_permutation(self, location: str, value_location: str, passed: Any) -> Tensor:
        """The permutation the experts implementation sorted this call's rows by (the second output of its sort op at
        ``location``), for a sorted value read at ``value_location`` in the same call. Read once per call and invoke
        (mediator: the invokes of a trace read the same call in turn): the second of two sorted values of one call
        (``expert_pre_activations``, then ``expert_activations``) gets the one the first read, since the model has
        run past the op by then. nnsight counts both ops' visits from the same drill, one per call: the permutation
        read at visit ``v`` is this call's while the sort has run ``v + 1`` times and the value's op ``v`` times (the
        model is still before it in call ``v``), at the step asked (if pinned)."""
        mediator = Mediator.current(location)
        reads = self.__dict__.get("_sort_reads")
        if reads is None:
            reads = self.__dict__["_sort_reads"] = weakref.WeakKeyDictionary()
        kept = reads.get(mediator)
        if kept is not None:
            visit = kept[0]
            permutation = kept[1]()  # alive while the call runs (weakly held: a block keeps no tensor past it)
            if permutation is not None and mediator.occurrence(location) == visit + 1 and \
                    mediator.occurrence(value_location) == visit and mediator.iteration in (None, visit):
                return permutation
        visit = mediator.wanted(location)
        permutation = request(location, passed)[1]
        reads[mediator] = (visit, weakref.ref(permutation))
        return permutation

    def _hidden_dtype(self) -> torch.dtype | None:
        """The dtype the experts implementation casts the sum of a token's slots to: its hidden states', which are
        the experts' weights' (None where those are not floating point: quantized). It adds the slots up in their own
        dtype first, which autocast may make narrower: the write check takes the narrower of the two."""
        weights = next(iter(self.experts._module.parameters()), None)
        return weights.dtype if weights is not None and weights.is_floating_point() else None

    def _slot_binding(self, name: str, implementation: str) -> Binding:
        ops, me = ops_for(implementation), _weakly(self)
        if name == "expert_outputs":
            return Binding(self._nested(ops.slot_outputs), features=2, prepare=lambda: me._drill(name),
                           summed_into=lambda: me._hidden_dtype())

        gated = bool(getattr(self.experts._module, "has_gate", True))
        activation_op = ops.gated_activations if gated else ops.plain_activations
        # The up projections are the activation op's first argument; the activations its output.
        pre = name == "expert_pre_activations"
        location = self._nested(activation_op, "input" if pre else "output")
        taken = dict(zip(("pick", "put"), argument(0, advice="its activation takes the projection first."))) if pre \
            else {}

        if ops.sort is None:
            def from_slots(slots: Tensor, _: Any) -> Tensor:
                rows = slots.reshape(-1, slots.shape[-1])
                # With autograd on, the model goes on from a copy: the served value is then one only the user holds,
                # so the late-edit check (`HandedBack`) watches it. Going on from a view of it, a late in-place edit
                # reached what the down projection keeps for its backward (torch's "modified by an inplace operation").
                return rows.clone() if rows.requires_grad else rows

            return Binding(
                location,
                features=2,
                **taken,
                prepare=lambda: me._drill(name),
                to_view=lambda rows, _: rows.view(-1, me.top_k, rows.shape[-1]),
                from_view=from_slots,
            )

        sort_location = self._nested(ops.sort)

        def sort_passed() -> OrderError:
            return OrderError(
                f"{me.path}.{name} is put into token-slot order with the sort permutation of the "
                f"{implementation} experts implementation ({ops.sort}, which runs before the "
                f"activations), and the model had run past that op when {name} was asked for (after an op of the "
                f"implementation read directly, a later value of this block, or a tracer.barrier this invoke waited "
                f"at while another invoke's reads moved the model on): read {name} first (before the barrier)."
            )

        def prepare_sorted() -> Tensor:
            me._drill(name)
            permutation = me._sort_permutation(sort_location, location, sort_passed)
            rows = tokens.current_rows(sort_location)
            if rows.per_prompt > 1 and me.runs_before_expansion:  # an encoder's: one row per prompt
                rows = rows.prompts()
            if rows.batching and permutation.shape[0] == rows.size:
                raise me.unavailable(
                    name,
                    "in a batched single-token step with top-1 routing nnsight cuts the "
                    "expert-sorted rows by invoke, which mixes up tokens",
                    'use model.set_experts_implementation("batched_mm") or one invoke for this read.',
                )
            return permutation

        def to_view(sorted_rows: Tensor, permutation: Tensor) -> Tensor:
            # index_select by the inverse: on CPU three times faster than index_copy_ by the permutation at 2048 rows.
            token_slot_order = inverse_permutation(permutation)
            return sorted_rows.index_select(0, token_slot_order).view(-1, me.top_k, sorted_rows.shape[-1])

        def from_view(slots: Tensor, permutation: Tensor) -> Tensor:
            return slots.reshape(-1, slots.shape[-1]).index_select(0, permutation)

        return Binding(location, features=2, **taken, prepare=prepare_sorted, to_view=to_view, from_view=from_view)

    # -- all values at once -------------------------------------------------------------------

    def _plan(self, names: tuple[str, ...], strict: bool) -> dict[str, tuple[Binding | None, bool]]:
        """The bindings of those of ``names`` this block can serve in this run, as far as is known before the model
        reaches them: None for `router_probs`, scored from the logits; each with whether `save_all` keeps it open
        (a write-back for an edit after it returns): where no value after it is read at a later place in the run
        (the last, and those read where it is, such as expert_weights beside expert_indices). ``strict``: raise
        the reason for one it cannot serve instead of leaving it out.

        Worked out once per experts implementation (read once: nothing switches it while the block runs), the op
        names moelens knows for it and whether the block holds its shared expert (``block.shared_experts = None``
        turns it off in some families): what a block can serve does not change between runs otherwise.
        """
        implementation = self.experts_implementation
        plans = self.__dict__.setdefault("_plans", {})
        shared = self.family.shared is not None and self._shared_envoy() is not None
        key = (implementation, ops_for(implementation), shared, names, strict)
        if key not in plans:
            plans[key] = self._planned(names, implementation, strict)
        return plans[key]

    def _planned(self, names: tuple[str, ...], implementation: str, strict: bool
                 ) -> dict[str, tuple[Binding | None, bool]]:
        plan: dict[str, Binding | None] = {}
        for name in names:
            try:
                if name == "router_probs":
                    self._check_available(name)
                    plan[name] = None
                else:
                    plan[name] = self._binding(name, implementation)
            except ValueUnavailable:
                if strict:
                    raise
        places = [self._binding("router_logits", implementation).location if binding is None else binding.location
                  for binding in plan.values()]  # router_probs: where the logits are read
        return {name: (binding, all(later == places[index] for later in places[index + 1:]))
                for index, (name, binding) in enumerate(plan.items())}

    def _asked(self, values: str | Iterable[str], order: tuple[str, ...], strict: bool) -> tuple[str, ...]:
        """The names `save_all` is asked to read, in ``order``; raises the reason for a name it does not read (and
        with ``strict``, for one this block does not serve)."""
        wanted = set([values] if isinstance(values, str) else value_names(values))
        others = wanted.difference(VALUE_NAMES)
        served_apart = sorted(others.intersection(base.value_names(type(self)))) if others else []  # read on their own
        unknown = others.difference(served_apart)
        if unknown:
            raise ArgumentError(f"save_all: unknown value names {sorted(unknown)}; choose from {VALUE_NAMES}.")
        for name in served_apart:
            self._check_available(name)  # one this block serves at no time: its reason (mlp_activation on a Moe)
        if served_apart:
            raise ValueUnavailable(
                f"save_all: {served_apart} {'is' if len(served_apart) == 1 else 'are'} not among the values save_all "
                f"reads ({VALUE_NAMES}): read {' and '.join(f'moe.{name}' for name in served_apart)} on its own."
            )
        if strict and wanted.difference(order):
            missing = sorted(wanted.difference(order))[0]
            self._check_available(missing)  # the reason this block cannot serve it
            raise self.no_mixture(missing)
        return tuple(name for name in order if name in wanted)

    def _asked_once(self, values: str | Iterable[str], order: tuple[str, ...], strict: bool) -> tuple[str, ...]:
        """`_asked`, kept per (names, order, strict) where the names are a str or a tuple of them (hashable; a list is
        checked each time): the names it reads depend on nothing else, and a save_all per block per trace checks
        the same ones again."""
        if not isinstance(values, (str, tuple)):
            return self._asked(values, order, strict)
        asked = self.__dict__.setdefault("_asked_names", {})
        key = (values, order, strict)
        try:
            found = asked.get(key)
        except TypeError:  # an unhashable element: refused by `_asked`
            return self._asked(values, order, strict)
        if found is None:
            found = asked[key] = self._asked(values, order, strict)
        return found

    def save_all(self, values: str | Iterable[str] | None = None, *, strict: bool = False) -> dict[str, Tensor]:
        """Read and ``.save()`` every value of this block in the family's order.

        Use it inside a trace. Values this block or run cannot serve (per-slot
        values under ``eager``, a shared expert where there is none) are left out,
        unless ``strict`` (then their error is raised).

        Args:
            values: The name or names to read (default: every value in `order`).
            strict: Raise instead of leaving out a value that cannot be served.

        Returns:
            Name -> saved tensor, in the order read.
        """
        self._require_trace("save_all")
        check_flag("strict", strict, ArgumentError)
        saved, left_out = self._saved_values(values, strict)
        if left_out is not None and not saved:
            warn(f"{self.path}.save_all() read none of the values asked: {left_out} Pass strict=True to raise this "
                 "instead.")
        return nnsight.save(saved)

    def _saved_values(self, values: str | Iterable[str] | None, strict: bool
                      ) -> tuple[dict[str, Tensor], ValueUnavailable | None]:
        """`save_all`'s values (name -> saved tensor), and the first error of a value it left out (None where none
        was: `model.save_all` warns of blocks that served nothing)."""
        order = self.order()
        if values is not None and not isinstance(values, (str, tuple)):
            values = tuple(value_names(values))  # once: a generator is read here and again for the warning below
        names = order if values is None else self._asked_once(values, order, strict)
        plan = self._plan(names, strict)
        saved: dict[str, Tensor] = {}
        left_out = None
        if not plan:  # none servable before the run: the reason of the first asked, in or out of `order`
            asked = names or sorted((values,) if isinstance(values, str) else values or (), key=VALUE_NAMES.index)
            left_out = self._unavailable(asked[0]) if asked else None
        for name, (binding, keep_open) in plan.items():
            try:
                if binding is None:  # router_probs: scored from the logits just read (else it reads them itself)
                    value = self._scored(saved["router_logits"]) if "router_logits" in saved else self.router_probs
                else:  # settled as read where a value read later moves the model on at once
                    value = self._read(getattr(type(self), name), keep_open=keep_open, binding=binding)
            except ValueUnavailable as unavailable:
                if strict:
                    raise
                left_out = left_out or unavailable
                continue
            except OrderError as error:  # its advice is save_all itself
                past = self._run_past(name, error)
                if past is None:
                    raise
                raise past from None
            saved[name] = value.save()
        return saved, left_out

    def _unavailable(self, name: str) -> ValueUnavailable | None:
        """The error of ``name``, a value this block cannot serve in this run as far as is known before the model
        reaches it (`_plan` leaves it out; `_asked` one not in `order`, which it never makes)."""
        try:
            if name not in self.order():
                self._check_available(name)
                raise self.no_mixture(name)
            self._check_available(name) if name == "router_probs" else self._binding(name, self.experts_implementation)
        except ValueUnavailable as unavailable:
            return unavailable
        return None

    def _run_past(self, name: str, error: OrderError) -> OrderError | None:
        """The error for `save_all`'s read of ``name`` refused (``error``) because the model had already run past it
        (a read or an intervention made earlier in the trace, or in this ``tracer.iter`` step, ran it on), with
        save_all's advice. None where the refusal had another cause (a module replaced after wrapping, a router that
        skips the op, a module skipped at an earlier generation step, a step a loop asked for that the run did not
        make, a block that runs only on some tokens and did not run), whose error stands. The error's ``unreached``
        is ``name``, for the model's `save_all`."""
        mediator = Mediator.current(name)
        if (mediator.iteration not in (0, None) or getattr(error, "steps_apart", False)
                or self._never_produced(name) is not None):
            return None
        if self.runs_only_on and not mediator.occurrence(f"{self.path}.input"):  # it never ran: its own error says why
            return None
        past = self._order_error(name, by="save_all", step_passed=getattr(error, "step_passed", False))
        past.unreached = name
        return past
