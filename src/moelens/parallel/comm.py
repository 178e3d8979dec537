"""Moving (token, expert) rows between the ranks of an EP group, and counting the bytes.

`exchange` is ``torch.distributed.all_to_all_single`` with uneven split sizes,
differentiable (its backward is the reverse exchange), backend-agnostic (gloo on
CPU, NCCL on GPU). With no group, or a group of one rank, it is the identity.

`traffic` records what every exchange sends, so the bytes each rank moves per
MoE layer are counted where they are moved (``bench/ep_comm.py``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import MoelensError


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 for None: no exchange)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's index in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


class SharedGroup:
    """Holds a process group so that `copy.deepcopy` shares it instead of failing.

    A ``ProcessGroup`` cannot be copied or pickled; an experts module sharded by
    `shard_experts` keeps its group in one of these (``_ep_group``), so a deep copy of
    the model (or of its moelens wrap) is a second model on the same group.
    """

    __slots__ = ("group",)

    def __init__(self, group: Any) -> None:
        self.group = group

    def __copy__(self) -> "SharedGroup":
        return self

    def __deepcopy__(self, memo: dict) -> "SharedGroup":
        return self

    def __repr__(self) -> str:
        return f"SharedGroup({self.group!r})"


def stored_group(module: Any) -> Any:
    """The EP group `shard_experts` stored on an experts module (None when it stored none)."""
    holder = getattr(module, "__dict__", {}).get("_ep_group")
    return None if holder is None else holder.group


@dataclass
class Record:
    """One exchange: what it moved from this rank.

    Attributes:
        kind: ``"counts"`` (the per-expert count exchange), ``"dispatch"`` (token
            rows to the experts' owners), ``"combine"`` (expert outputs back),
            ``"pre_activations_back"`` / ``"activations_out"`` (the activation round trip
            made when a trace reads per-slot values), or ``"*_grad"`` in backward.
        tag: Which experts module made it (its layer tag; 0 when unknown).
        sent_bytes: Bytes sent to the other ranks of the group.
        kept_bytes: Bytes that stayed on this rank (rows for its own experts).
        rows: Rows sent to the other ranks.
        received: Rows received (from every rank of the group, this one included).
    """

    kind: str
    tag: int
    sent_bytes: int
    kept_bytes: int
    rows: int
    received: int = 0


@dataclass(eq=False)  # a log is removed from _LOGS as itself: two logs with equal records are not one
class Traffic:
    """The exchanges made while `traffic` was open, in order."""

    records: list[Record] = field(default_factory=list)

    def sent(self, kind: str | None = None) -> int:
        """Bytes sent to other ranks, over every record (of ``kind``, if given)."""
        return sum(r.sent_bytes for r in self.records if kind is None or r.kind == kind)


_LOGS: list[Traffic] = []


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Record every exchange this process makes inside the block::

        with traffic() as log:
            model(input_ids)
        log.sent("dispatch") + log.sent("combine")   # payload bytes this rank sent
    """
    log = Traffic()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(kind: str, tag: int, rows: Tensor, send_sizes: list[int], recv_sizes: list[int], rank: int) -> None:
    if not _LOGS:
        return
    row_bytes = rows.element_size() * math.prod(rows.shape[1:])
    kept = send_sizes[rank]
    sent_rows = sum(send_sizes) - kept
    record = Record(kind, tag, sent_rows * row_bytes, kept * row_bytes, sent_rows, sum(recv_sizes))
    for log in _LOGS:
        log.records.append(record)


def _all_to_all(rows: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any) -> Tensor:
    out = rows.new_empty((sum(recv_sizes), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any, kind: str, tag: int) -> Tensor:
        ctx.sizes, ctx.group, ctx.kind, ctx.tag = (recv_sizes, send_sizes), group, kind, tag
        _record(kind, tag, rows, send_sizes, recv_sizes, group_rank(group))
        return _all_to_all(rows, recv_sizes, send_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        recv_sizes, send_sizes = ctx.sizes
        _record(f"{ctx.kind}_grad", ctx.tag, grad, recv_sizes, send_sizes, group_rank(ctx.group))
        return _all_to_all(grad, send_sizes, recv_sizes, ctx.group), None, None, None, None, None


def exchange(rows: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any, kind: str = "rows", tag: int = 0) -> Tensor:
    """Send ``rows[sum(send_sizes[:j]) : ...]`` to rank ``j``; receive ``recv_sizes[j]`` rows from each.

    Differentiable in ``rows``. With no group (or one rank) the rows are returned as they are.

    ``kind`` and ``tag`` only label the exchange for `traffic`: its `Record`'s ``kind`` (``"dispatch"``,
    ``"combine"``, ...; the backward's is ``kind + "_grad"``) and ``tag`` (which experts module made it, its
    `moelens.parallel.runs.layer_tag`; 0 when unknown). What is sent does not depend on them.

    Raises:
        MoelensError: the sizes are not one per rank of ``group``, ``send_sizes`` do not add up to the rows, or, on
            one rank, ``recv_sizes`` differ from ``send_sizes`` (the rows come back as they are).
    """
    ranks, send_sizes, recv_sizes = group_size(group), list(send_sizes), list(recv_sizes)
    if len(send_sizes) != ranks or len(recv_sizes) != ranks or sum(send_sizes) != rows.shape[0] or \
            (ranks == 1 and recv_sizes != send_sizes):
        raise MoelensError(
            f"exchange: send_sizes {send_sizes} and recv_sizes {recv_sizes} must give one row count per rank of the "
            f"group ({ranks}), the send sizes adding up to the {rows.shape[0]} rows sent"
            + (" and, on one rank, the receive sizes equal to them." if ranks == 1 else ".")
        )
    if ranks == 1:
        return rows
    return _Exchange.apply(rows, recv_sizes, send_sizes, group, kind, tag)


def exchange_counts(counts: Tensor, group: Any, tag: int = 0) -> Tensor:
    """Each rank's row ``j`` of ``counts [ep, n]`` goes to rank ``j``; returns the rows received (int64)."""
    if group_size(group) == 1:
        return counts
    rows = counts.shape[0]
    _record("counts", tag, counts, [1] * rows, [1] * rows, group_rank(group))
    return _all_to_all(counts, [1] * rows, [1] * rows, group)
