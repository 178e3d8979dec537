"""Token views: flat routing tensors served as this invoke's ``[batch, seq, ...]``.

MoE blocks flatten tokens: router logits, expert weights and indices, per-slot
outputs are ``[T, ...]`` with ``T = batch * seq`` over the *whole* batched forward
(every invoke of the trace, padded to one length). nnsight narrows a served value
to an invoke's rows only where its leading dim equals the batch size, which a flat
``[T, ...]`` tensor has only when ``seq == 1``. So:

* `view` turns what nnsight served into this invoke's ``[b, s, ...]``: a view of
  the model's tensor (in-place edits land) cut to the invoke's rows;
* `splice` turns an assigned ``[b, s, ...]`` back into the tensor the model holds,
  the other invokes' rows untouched.

A tensor that already has its batch and sequence dims (a shared expert that sees
the unflattened residual) comes narrowed by nnsight, or is narrowed here when its
batch counts rows nnsight does not (beams).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Shaped
from nnsight.intervention.interleaver import Mediator

from ..errors import FamilyError, ValueUnavailable


class Rows(NamedTuple):  # a tuple, not a dataclass: one is made per value read
    """Which rows of the batched forward the running invoke owns.

    Attributes:
        total: Batch size of the whole forward (every invoke's rows).
        start: First row of this invoke.
        size: Number of rows of this invoke.
        batching: Whether nnsight narrows values for this invoke (two or more
            invokes with rows); otherwise this invoke sees the whole batch.
        per_prompt: Rows the model runs per prompt (beams, returned sequences; 1 outside generate).
    """

    total: int
    start: int
    size: int
    batching: bool
    per_prompt: int = 1

    def prompts(self) -> "Rows":
        """The same invoke counted in prompts: the rows of what runs before generate expands each prompt."""
        per = self.per_prompt
        return Rows(self.total // per, self.start // per, self.size // per, self.batching)


def current_rows(location: str) -> Rows:
    """The rows the running worker owns, read from its mediator and batcher.

    While the model generates with beams or several returned sequences, transformers runs
    each prompt row as that many consecutive rows (the model's ``_rows_per_prompt``): an
    invoke owns all of its prompts' rows.
    """
    mediator = Mediator.current(location)
    batcher = mediator.interleaver.batcher if mediator.interleaver is not None else None
    # set on the model only while it generates (an envoy's getattr of a missing name is slow: not used)
    per_prompt = vars(batcher.envoy).get("_rows_per_prompt", 1) if batcher is not None else 1
    total = (batcher.total if batcher is not None and batcher.total else 1) * per_prompt
    group = mediator.batch_group
    if batcher is None or not batcher.batching or group is None:
        return Rows(total=total, start=0, size=total, batching=False, per_prompt=per_prompt)
    start, size = group
    return Rows(total=total, start=start * per_prompt, size=size * per_prompt, batching=True, per_prompt=per_prompt)


def rows_counted(served: torch.Tensor, feature_dims: int, rows: Rows, before_expansion: bool) -> Rows:
    """The rows ``served`` counts while generate runs several rows per prompt (``rows.per_prompt > 1``): the
    prompts' for a block that runs before transformers repeats them (``before_expansion``: an encoder's, a vision
    tower's), unless its ``[batch, seq, ...]`` value shows it ran on the repeated rows after all; else ``rows``."""
    if not before_expansion:
        return rows
    prompts = rows.prompts()
    if served.dim() == feature_dims + 2 and served.shape[0] not in (prompts.total, prompts.size):
        return rows
    return prompts


class UnevenTokens(ValueUnavailable):
    """A flat value's token count is no whole number of the batch's sequences."""


def _seq_len(flat_rows: int, rows: Rows, name: str) -> int:
    if flat_rows % rows.total:
        raise UnevenTokens(
            f"{name}: the block saw {flat_rows} tokens, which is not a whole number of "
            f"sequences of a batch of {rows.total}; moelens serves flat routing tensors "
            "per [batch, seq] only when every row has the same padded length."
        )
    return flat_rows // rows.total


def _whole_batch(served: torch.Tensor, rows: Rows) -> bool:
    """Whether an unflattened ``[B, S, ...]`` value holds every invoke's rows (nnsight did not narrow it)."""
    return rows.batching and rows.size < rows.total and served.shape[0] == rows.total


def _not_batch_major(served: torch.Tensor, rows: Rows, name: str) -> FamilyError:
    """The refusal of a ``[batch, seq, ...]`` value whose first dim is not the batch (a block that runs its tokens
    sequence-first, ``[seq, batch, ...]``)."""
    sequence_first = served.shape[1] in (rows.total, rows.size)
    return FamilyError(  # not one value left out (`save_all`, `families.check`): every value of the block is misplaced
        f"{name}: the block's tensors are {list(served.shape)}, whose first dim is not the batch of {rows.total}"
        + (" (they are sequence-first, [seq, batch, ...])" if sequence_first else " (a count of its own, such as "
           "images)")
        + ": moelens serves values per [batch, seq] and reads a block's flat tokens as batch-major, so it cannot serve "
        "this block's values. A model that runs its layers sequence-first must run them batch-first ([batch, seq, "
        "hidden], transposing once around the layers); a block whose tokens have no [batch, seq] layout (a vision "
        "tower's) is read with plain nnsight (its .output and .inputs)."
    )


def view(served: torch.Tensor, feature_dims: int, rows: Rows, name: str) -> Shaped[torch.Tensor, "b s *f"]:
    """This invoke's ``[b, s, *features]`` view of a served routing tensor.

    Args:
        served: The value nnsight served: flat ``[T, *features]`` (narrowed by nnsight
            to this invoke's rows when ``seq == 1``), or already ``[B, S, *features]``.
        feature_dims: How many trailing dims are features (1 for ``[T, E]``).
        rows: The running invoke's rows (`current_rows`).
        name: The value's name, for errors.
    """
    if served.dim() == feature_dims + 2:
        # nnsight narrows [B, S, ...] itself, except with beams / several returned sequences, where B
        # counts each prompt's rows (`current_rows`) and nnsight's batch size only the prompts.
        if served.shape[0] not in (rows.total, rows.size):
            raise _not_batch_major(served, rows, name)
        return served.narrow(0, rows.start, rows.size) if _whole_batch(served, rows) else served
    features = served.shape[1:]
    if rows.batching and served.shape[0] == rows.size and rows.size < rows.total:
        # nnsight already narrowed it: one token per row (a decode step).
        return served.view(rows.size, 1, *features)
    seq = _seq_len(served.shape[0], rows, name)
    mine = served.narrow(0, rows.start * seq, rows.size * seq) if rows.batching else served
    return mine.view(rows.size, seq, *features)


def splice(
    current: torch.Tensor, new: Shaped[torch.Tensor, "b s *f"], feature_dims: int, rows: Rows, name: str
) -> torch.Tensor:
    """The tensor to hand the model: ``current`` with this invoke's rows set to ``new``.

    Args:
        current: The value as nnsight serves it now (see `view`).
        new: This invoke's ``[b, s, *features]`` replacement.
        feature_dims: How many trailing dims are features.
        rows: The running invoke's rows.
        name: The value's name, for errors.
    """
    new = new.to(dtype=current.dtype, device=current.device)
    if current.dim() == feature_dims + 2:
        if _whole_batch(current, rows):
            return torch.cat([current[: rows.start], new, current[rows.start + rows.size:]], dim=0)
        return new
    flat = new.reshape(-1, *new.shape[2:])
    if not rows.batching or (current.shape[0] == rows.size and rows.size < rows.total):
        return flat
    seq = _seq_len(current.shape[0], rows, name)
    start, stop = rows.start * seq, (rows.start + rows.size) * seq
    return torch.cat([current[:start], flat, current[stop:]], dim=0)
