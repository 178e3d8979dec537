"""The family table of the docs, generated from the registry (``docs/families.md``).

``python -m moelens.families.table > docs/families.md`` regenerates it; a test
checks the committed file is current.
"""

from __future__ import annotations

from .entry import Family
from .registry import supported
from .unserved import UNSERVED

HEADER = """# Supported families

Generated from `moelens.families.supported()` by `python -m moelens.families.table`; do not edit by hand.
Every family is tested on a tiny seeded model built from its transformers config, under each experts
implementation it supports (see `tests/test_core_*.py`). moelens runs on transformers 5.23 to 5.25;
hy_v4_vl, lara_mini and inkling2_loop exist from 5.24 on (sarvam_mla and sarvam_moe, also new in 5.24,
run the deepseek_v3 and glm4_moe blocks), ergo, kolibri1_1 and minicpm5_moe from 5.25 on (param2moe, also new
in 5.25, runs the glm4_moe block). inkling2_loop's loop layers call their block several times in one
forward: each call's values are served under `tracer.iter[i]` (docs/values.md; `tests/test_looped_blocks.py`).

Columns: the block (its attribute on the decoder layer and its class), the router and experts children,
the router op whose output moelens serves as `router_logits` (`linear → cast`: the router's linear layer and the
upcast after it, where the logits are read), the scoring (see `docs/values.md`; "sum clamped at >= x": the
weights are divided by `clamp(sum, min=x)`, `Scoring.normalize_min`, so they sum to less than one where the chosen
scores sum below x), the
shared expert (its module and when its served value is produced), and what the family cannot serve whatever
the model's settings (dbrx's and llama4's per-slot values: their experts are not decorated by transformers, so they
run only their own forward, dbrx's a loop over its experts, llama4's one batched matmul). Values
that depend on how the experts run are in the notes: per-slot values need experts decorated by transformers' experts
implementations and running `grouped_mm` or `batched_mm` (up to transformers 5.24 step3p7's and longcat_flash's
experts are not decorated, so they have none: `moe.order()` lists them, and reading one raises the reason;
longcat_flash has none on 5.25 either, for its zero-compute experts).

| family | block | router / experts | logits op | scoring | shared expert | not served | notes |
|---|---|---|---|---|---|---|---|
"""


def _shared(family: Family) -> str:
    shared = family.shared
    if shared is None:
        return "–"
    where = "layer." if shared.on_layer else ""
    gate = f", gated by `{shared.gate}`" if shared.gate else ""
    return f"`{where}{shared.module}`{gate} ({shared.when.replace('_', ' ')})"


def _row(family: Family) -> str:
    block = f"`{family.block_attr or '(the decoder layer)'}` {', '.join(family.block_classes)}"
    refused = ", ".join(f"`{name}`" for name in family.refused) or "–"
    routing = f"`{family.router}` / `{family.experts}`" + ("" if family.experts_call else " (no experts call)")
    logits = f"`{family.logits_op}`" + (f" → `{family.logits_cast_op}`" if family.logits_cast_op else "")
    cells = [family.name, block, routing, logits, family.scoring.describe(), _shared(family),
             refused, family.notes]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


UNSERVED_HEADER = """
## Not served

MoE blocks of these model types run their experts some other way than a transformers experts call, so no
family entry describes them: `moelens.wrap` names them in a warning with the reason, leaves them out of
`model.moes` and keeps them plain envoys (never a dense `Mlp`). Read them with plain nnsight.

| model type | blocks | why |
|---|---|---|
"""


def markdown(families: list[Family] | None = None) -> str:
    """The docs' family table for ``families`` (default: every registered family), and the blocks not served."""
    rows = [_row(family) for family in (families if families is not None else supported())]
    unserved = [f"| {entry.name} | {', '.join(entry.block_classes)} | {entry.reason} |" for entry in UNSERVED]
    return HEADER + "\n".join(rows) + "\n" + UNSERVED_HEADER + "\n".join(unserved) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
