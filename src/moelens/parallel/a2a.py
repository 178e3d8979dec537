"""All-to-all dispatch and combine of (token, expert) pairs over an EP group.

Every rank holds its own tokens (data parallel) and ``L = E / ep`` of the E
experts (rank ``r``: ``[r*L, (r+1)*L)``). For one MoE layer:

1. each rank sorts its ``T*k`` (token, slot) pairs by global expert id, which groups
   them by owner rank, and the ranks exchange a fixed-width header (a layer tag, a run id and
   the local expert count, to catch ranks that diverged, see `moelens.parallel.runs`), then
   the per-expert counts (two small int64 all-to-alls);
2. the token rows go to the owners (`Plan.dispatch`, an uneven all-to-all);
3. the owner runs its experts on what it received, grouped by local expert;
4. the outputs go back the same way (`Plan.to_sender`, the reverse all-to-all)
   into token-slot order, and the sender applies the routing weights once.

The header and the split sizes are read back to the host: two syncs per layer. Both exchanges are
differentiable (their backward is the reverse exchange), so gradients reach the
tokens, the routing weights and the experts on every rank. A rank may send or
receive no rows at all; ids outside ``[0, E)`` (e.g. -1) are dropped (those slots
contribute zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..errors import MoelensError
from ..permutations import inverse_permutation
from .comm import exchange, exchange_counts, group_rank, group_size
from .runs import FOLDERS_TAG, Runs, describe_tag, describe_tags


class RankDivergence(MoelensError):
    """The ranks of an EP group reached different experts calls (an intervention ran on some ranks only)."""


@dataclass
class Plan:
    """Where this rank's (token, slot) pairs go and where the rows it receives came from.

    Attributes:
        group: The EP process group (None: one rank).
        num_slots: ``T * k``, this rank's (token, slot) pairs.
        top_k: k.
        send_order: Slot indices (into the flattened ``[T*k]``) of the valid pairs,
            sorted by global expert id: the order rows are sent in.
        send_sizes: Rows sent to each rank of the group.
        recv_sizes: Rows received from each rank.
        by_expert: Permutation putting the received rows in local-expert order.
        from_expert: Its inverse.
        local_ids: Local expert id of each row, in local-expert order.
        tokens_per_expert: Rows each local expert runs on ``[L]``.
        offsets: Cumulative ``tokens_per_expert`` (int32), for grouped GEMMs.
        serve: Whether the activations make a round trip to the senders (a trace
            reads per-slot values on some rank of the group).
        tag: The layer tag the exchanges are recorded under.
    """

    group: Any
    num_slots: int
    top_k: int
    send_order: Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    by_expert: Tensor
    from_expert: Tensor
    local_ids: Tensor
    tokens_per_expert: Tensor
    offsets: Tensor
    serve: bool
    tag: int

    def dispatch(self, hidden_states: Float[Tensor, "t d"]) -> Float[Tensor, "r d"]:
        """The token rows each of this rank's experts runs on, grouped by local expert."""
        return self._to_owner(hidden_states[self.send_order // self.top_k], "dispatch")

    def to_owner(self, slot_rows: Float[Tensor, "tk f"], kind: str = "activations_out") -> Float[Tensor, "r f"]:
        """Token-slot rows ``[T*k, F]`` to the experts' owners (grouped by local expert there); ``kind`` names the
        exchange in `moelens.parallel.traffic`'s records (the activation round trip's ``"activations_out"`` by
        default) and changes nothing else."""
        return self._to_owner(slot_rows[self.send_order], kind)

    def _to_owner(self, rows: Tensor, kind: str) -> Tensor:
        received = exchange(rows, self.recv_sizes, self.send_sizes, self.group, kind, self.tag)
        return received[self.by_expert]

    def to_sender(self, rows: Float[Tensor, "r f"], kind: str = "combine") -> Float[Tensor, "tk f"]:
        """Rows computed by this rank's experts back to their tokens: ``[T*k, F]`` in
        token-slot order on the rank that sent them, zeros for dropped slots. ``kind`` names the exchange in
        `moelens.parallel.traffic`'s records (``"combine"``, the experts' outputs, by default;
        ``"pre_activations_back"`` for the activation round trip) and changes nothing else."""
        back = exchange(rows[self.from_expert], self.send_sizes, self.recv_sizes, self.group, kind, self.tag)
        return back.new_zeros((self.num_slots, *back.shape[1:])).index_copy(0, self.send_order, back)


def meet_in_run(group: Any, run: int, tag: int, device: Any, *, flag: int = 0,
                width: int = 0) -> tuple[list[int], list[int], list[int]]:
    """Meet every rank of ``group`` in run ``run``: exchange a fixed-width header ``[flag, tag, run, width]`` (an
    experts call's: whether it wants the activation round trip, and its local expert count) until every rank sends
    this run, and return every rank's flags, tags and widths. A rank in an older run than another ends it with `RankDivergence`; the ranks in the newest run ask again
    until every rank is in it (a rank several runs behind ends each of them). The header is fixed-width: the counts'
    width (L) may differ between the blocks of a model (or two models on the group), and ranks at different exchanges
    must meet at rows of one size to find out (gloo aborts otherwise)."""
    ep = group_size(group)
    header = torch.tensor([[flag, int(tag), run, width]], dtype=torch.long, device=device)
    while True:
        # A host sync: the flags, tags, run ids and widths of every rank.
        flags, tags, run_ids, widths = exchange_counts(header.expand(ep, 4), group, tag).T.tolist()
        newest = max(run_ids)
        if run < newest:
            ahead = [index for index, other in enumerate(run_ids) if other == newest]
            raise RankDivergence(
                f"expert parallelism: ranks {ahead} of the EP group ended the run this rank is in ("
                + ("its collect_routing call" if tag == FOLDERS_TAG else "a trace, or a forward outside one")
                + f") before this exchange ({describe_tag(tag)}) and started their next one, "
                "which waits for this rank: a run raised an error on those ranks only (an intervention refused for "
                "their tokens, ...), or the ranks counted runs differently (one rank ran forwards of the model that "
                "the others did not). This run is given up here, as each run of this rank the others gave up is, "
                "until this rank comes to theirs; make the failing run work on every rank (see docs/parallel.md)."
            )
        if min(run_ids) == newest:
            return flags, tags, widths
        # Some ranks are still in a run this rank's group left: they give it up (above) and come back in this one.


def plan_dispatch(
    group: Any,
    topk_idx: Int[Tensor, "t k"],
    num_global_experts: int,
    num_local_experts: int,
    *,
    serve: bool = False,
    tag: int = 0,
    runs: Runs | None = None,
) -> Plan:
    """Exchange per-expert counts over ``group`` and work out every row's way there and back.

    Args:
        group: The EP process group (None: a single rank owning every expert).
        topk_idx: Global expert id of each (token, slot) ``[T, k]``.
        num_global_experts: E.
        num_local_experts: L; ``L * group size`` must be E.
        serve: This rank wants the activation round trip (the group does it if any rank does).
        tag: This call's layer tag; every rank of the group must send the same one,
            else `RankDivergence` is raised (rank-divergent experts calls).
        runs: The group's run ids (`moelens.parallel.runs`): a rank in an older run than another ends it
            with `RankDivergence`, and the ranks in the newest run ask again until every rank is in it
            (a rank several runs behind ends each of them).
            None: no run ids (every rank sends 0).
    """
    ep, rank = group_size(group), group_rank(group)
    if num_local_experts * ep != num_global_experts:
        raise MoelensError(
            f"expert parallelism: {num_global_experts} experts over {ep} ranks is not {num_local_experts} per rank; "
            "shard the experts with moelens.parallel.shard_experts over the same group."
        )
    device = topk_idx.device
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_global_experts)
    keyed = torch.where(valid, flat, torch.full_like(flat, num_global_experts)).long()
    order = torch.argsort(keyed, stable=True)
    # scatter_add_, not bincount: bincount reads its input's max back to the host.
    counts = keyed.new_zeros(num_global_experts + 1).scatter_add_(0, keyed, torch.ones_like(keyed))
    send_counts = counts[:num_global_experts].view(ep, num_local_experts)
    run = runs.current if runs is not None else 0
    flags, tags, widths = meet_in_run(group, run, tag, device, flag=int(serve), width=num_local_experts)
    if any(other != tag for other in tags):
        raise RankDivergence(
            f"expert parallelism: rank {rank} of the EP group ran the experts call of {describe_tag(tag)} while "
            f"the group's ranks were at other exchanges ({describe_tags(tags)}): "
            + ("some ranks called analysis.collect_routing (or token_routing) while the others ran a forward of the "
               "model (a trace, an analysis of another kind, generation, or a batch more of a corpus), or "
               if FOLDERS_TAG in tags else "")
            + "an experts call was skipped or added on some ranks only (a .skip() "
            "of an experts module, an extra experts call, a forward on some ranks only, or a block that runs only "
            "on some inputs, such as ernie4_5_vl_moe's vision experts when only some ranks have image tokens), or "
            "the ranks ran different models sharded over the group (another order of models on each rank). "
            "Every rank must run the same control flow; see docs/parallel.md."
        )
    if any(other != num_local_experts for other in widths):
        raise RankDivergence(
            f"expert parallelism: rank {rank} of the EP group ran the experts call of {describe_tag(tag)} with "
            f"{num_local_experts} local experts ({num_global_experts} in all) while the group's ranks hold {widths}: "
            "every rank must run the same block, its experts sharded over the group with "
            "moelens.parallel.shard_experts."
        )
    recv_counts = exchange_counts(send_counts, group, tag)
    # The layer's second host sync: the split sizes.
    send_sizes, recv_sizes = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    local_ids = torch.arange(num_local_experts, device=device).repeat(ep).repeat_interleave(
        recv_counts.reshape(-1), output_size=sum(recv_sizes)
    )
    by_expert = torch.argsort(local_ids, stable=True)
    tokens_per_expert = recv_counts.sum(0)
    return Plan(
        group=group,
        num_slots=flat.shape[0],
        top_k=topk_idx.shape[-1],
        send_order=order[: sum(send_sizes)],
        send_sizes=send_sizes,
        recv_sizes=recv_sizes,
        by_expert=by_expert,
        from_expert=inverse_permutation(by_expert),
        local_ids=local_ids[by_expert],
        tokens_per_expert=tokens_per_expert,
        offsets=torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32),
        serve=any(flags),
        tag=tag,
    )


ExpertFn = Callable[[Float[Tensor, "r d"], Int[Tensor, " l"]], Float[Tensor, "r d"]]


def _check_moe_inputs(hidden_states: Any, topk_idx: Any, topk_weights: Any) -> None:
    """Refuse `a2a_moe` inputs that are not tokens ``[T, D]``, integer expert ids ``[T, k]`` and weights ``[T, k]``
    (torch failed on them deep in the exchange, or truncated float ids to experts silently)."""
    given = {"hidden_states": hidden_states, "topk_idx": topk_idx, "topk_weights": topk_weights}
    for name, value in given.items():
        if not isinstance(value, Tensor):
            raise MoelensError(f"a2a_moe: {name} must be a tensor, got {type(value).__name__} {value!r:.60}.")
    if topk_idx.dim() != 2:
        raise MoelensError(
            f"a2a_moe: topk_idx must hold each token's k expert ids [T, k], got shape {tuple(topk_idx.shape)}; "
            "for one expert per token pass topk_idx[:, None] (and topk_weights[:, None])."
        )
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise MoelensError(
            f"a2a_moe: topk_idx must hold integer expert ids, got {topk_idx.dtype} (float ids would be truncated to "
            "other experts, bools read as experts 0 and 1); pass the router's indices (torch.topk(...).indices), "
            "or .long() of ids known to be whole."
        )
    num_tokens, top_k = topk_idx.shape
    if hidden_states.dim() != 2 or hidden_states.shape[0] != num_tokens:
        raise MoelensError(
            f"a2a_moe: hidden_states must be the {num_tokens} tokens topk_idx routes, [T, D] = [{num_tokens}, D], got "
            f"shape {tuple(hidden_states.shape)}; flatten a batch with hidden_states.reshape(-1, D) and route its rows."
        )
    if tuple(topk_weights.shape) != (num_tokens, top_k):
        raise MoelensError(
            f"a2a_moe: topk_weights must hold one weight per slot of topk_idx, [T, k] = [{num_tokens}, {top_k}], got "
            f"shape {tuple(topk_weights.shape)}."
        )


def a2a_moe(
    group: Any,
    hidden_states: Float[Tensor, "t d"],
    topk_idx: Int[Tensor, "t k"],
    topk_weights: Float[Tensor, "t k"],
    num_global_experts: int,
    num_local_experts: int,
    expert_fn: ExpertFn,
) -> Float[Tensor, "t d"]:
    """The routed output of this rank's tokens, its experts sharded over ``group``.

    Args:
        group: The EP process group (None: one rank, every expert local).
        hidden_states: This rank's tokens ``[T, D]`` (T may differ between ranks).
        topk_idx: Global expert id of each slot ``[T, k]``.
        topk_weights: Routing weight of each slot ``[T, k]``, applied once, on this rank.
        num_global_experts: E.
        num_local_experts: L, the experts this rank owns (``[rank*L, (rank+1)*L)``).
        expert_fn: ``expert_fn(rows, tokens_per_expert)``: this rank's experts on
            ``rows [R, D]`` grouped by local expert, ``tokens_per_expert[l]`` rows each;
            returns ``[R, D]`` (unweighted). It is called with ``R == 0`` too.

    Returns:
        ``sum_j topk_weights[t, j] * expert_{topk_idx[t, j]}(hidden_states[t])`` ``[T, D]``.

    Raises:
        MoelensError: the inputs are not tokens ``[T, D]``, integer ids ``[T, k]`` and weights ``[T, k]``
            (checked before anything is exchanged), or E is not L times the group size.
    """
    _check_moe_inputs(hidden_states, topk_idx, topk_weights)
    num_tokens, top_k = topk_idx.shape
    plan = plan_dispatch(group, topk_idx, num_global_experts, num_local_experts)
    rows = plan.dispatch(hidden_states)
    out = expert_fn(rows, plan.tokens_per_expert)
    pair = plan.to_sender(out)
    weighted = pair * topk_weights.reshape(-1, 1).to(pair.dtype)
    return weighted.view(num_tokens, top_k, pair.shape[-1]).sum(dim=1).to(hidden_states.dtype)
