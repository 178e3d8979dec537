"""Per-layer routing statistics as rows, and their text table, JSON and CSV forms."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .cache import RoutingCache
from .entropy import Entropy, routing_entropy
from .usage import LoadBalance, Usage, expert_usage, load_balance

#: The files `write_stats` writes.
STATS_FILES = ("stats.json", "stats.csv", "experts.csv")


@dataclass
class LayerStats:
    """Usage, load balance and entropy of every MoE layer of a routing cache."""

    usage: Usage
    balance: LoadBalance
    entropy: Entropy
    weight_entropy: Entropy

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per layer."""
        rows = []
        fraction = self.usage.fraction
        for row, (layer, balance) in enumerate(zip(self.usage.layers, self.balance.as_rows())):
            width = self.usage.num_experts[row]
            share = fraction[row, :width]
            busiest = [expert for expert in share.argsort(descending=True)[:3].tolist() if share[expert] > 0]
            rows.append({
                "layer": layer,
                "tokens": self.usage.tokens,
                "experts": width,
                "top_k": self.usage.top_k[row],
                **{key: value for key, value in balance.items() if key != "layer"},
                # the router's entropy needs cached logits; without them `entropy` is the weights' own
                "router_entropy": float(self.entropy.mean[row]) if self.entropy.source == "router" else None,
                "weight_entropy": float(self.weight_entropy.mean[row]),
                "busiest_experts": busiest,
                "busiest_shares": [round(float(share[e]), 4) for e in busiest],
            })
        return rows

    def expert_rows(self) -> list[dict[str, Any]]:
        """One dict per (layer, expert): count, share of slots, mean weight."""
        rows = []
        fraction = self.usage.fraction
        for row, layer in enumerate(self.usage.layers):
            for expert in range(self.usage.num_experts[row]):
                count = int(self.usage.counts[row, expert])
                rows.append({
                    "layer": layer, "expert": expert, "count": count,
                    "share": float(fraction[row, expert]),
                    "mean_weight": float(self.usage.weight[row, expert]) / count if count else 0.0,
                })
        return rows


def layer_stats(cache: RoutingCache) -> LayerStats:
    """Usage, load balance and entropy (router entropy when logits are cached) of every layer."""
    usage = expert_usage(cache)
    return LayerStats(
        usage=usage,
        balance=load_balance(usage),
        entropy=routing_entropy(cache),
        weight_entropy=routing_entropy(cache, "weights"),
    )


def _cell(value: Any) -> str:
    if value is None:  # a measure of nothing (a layer whose experts took no token)
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ",".join(_cell(item) for item in value)
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A fixed-width text table of ``rows`` (dicts sharing their keys)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    header = "  ".join(column.rjust(width) for column, width in zip(columns, widths))
    lines = [header, "-" * len(header)]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """CSV text of ``rows`` (lists joined with spaces)."""
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0].keys()), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()})
    return buffer.getvalue()


def write_stats(
    stats: LayerStats, folder: Path, meta: dict[str, Any], rows: list[dict[str, Any]] | None = None
) -> list[Path]:
    """Write ``stats.json`` (layers + experts + meta), ``stats.csv`` (layers) and ``experts.csv``.

    ``rows``: ``stats.rows()`` when the caller already has them.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in STATS_FILES]
    layers = stats.rows() if rows is None else rows
    experts = stats.expert_rows()
    document = {**meta, "layers": layers, "experts": experts}
    paths[0].write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(to_csv(layers), encoding="utf-8")
    paths[2].write_text(to_csv(experts), encoding="utf-8")
    return paths
