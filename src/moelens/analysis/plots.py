"""Matplotlib figures of the routing analyses (each function returns a `Figure`).

Figures are made with pyplot, so they show inline in a notebook
(``%matplotlib inline``) and with ``plt.show()`` in a script. Without a display
(a server, CI, the ``moelens`` command) the Agg backend is chosen before pyplot
is first imported. `save` writes a figure (PNG unless the path's suffix names another format) and closes it.
"""

from __future__ import annotations

__all__ = ["has_display", "pyplot", "save", "plot_usage", "plot_load_balance", "plot_entropy", "plot_coactivation",
           "plot_transitions", "plot_token_routing", "plot_top_tokens", "plot_logit_lens", "plot_specialisation",
           "plot_risk_difference", "plot_agreement"]

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import MoelensError
from ..paths import blocked_above, user_path
from ..scalars import as_real
from .agreement import Agreement
from .cache import SKIPPED, _counted, layer_row
from .checks import check_count, check_results, check_type
from .coactivation import Coactivation, Transitions
from .entropy import Entropy
from .logit_lens import ExpertLens
from .specialisation import Specialisation
from .token_view import TokenRouting
from .top_tokens import ExpertTokens
from .usage import LoadBalance, Usage

if TYPE_CHECKING:  # matplotlib is imported when a figure is first made (`pyplot`), not with moelens.analysis
    import matplotlib.figure


#: The ``value`` choices of `plot_coactivation` (with their titles), `plot_top_tokens` and `plot_specialisation`.
COACTIVATION_VALUES = {"conditional": "P(j chosen | i chosen)", "lift": "lift P(i,j)/(P(i)P(j))",
                       "counts": "tokens routed to i and j"}
TOP_TOKEN_VALUES = ("counts", "share")
SPECIALISATION_VALUES = {"lift": "P(class|expert) / P(class)", "share": "P(class|expert)",
                         "rate": "P(expert among a token's experts | class)"}


def _check_value(value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise MoelensError(f"value={value!r} is not one of {tuple(choices)}.")


def has_display() -> bool:
    """Whether figures can be shown: a notebook kernel, a desktop, or an X / Wayland display."""
    if "ipykernel" in sys.modules or sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def pyplot() -> Any:
    """``matplotlib.pyplot``, with the Agg backend selected first when there is no display and no backend was chosen
    (``matplotlib.use``, ``rcParams["backend"]``, a matplotlibrc or ``MPLBACKEND``)."""
    if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND") and not has_display():
        import matplotlib

        if matplotlib.rcParams._get_backend_or_none() is None:  # matplotlib would pick one itself
            matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure: Any, path: str | Path, dpi: float = 110) -> Path:
    """Write ``figure`` to ``path`` (folders created) and close it, written or not; returns the file written.

    The format follows the suffix (``.png``, ``.pdf``, ``.svg``, ``.jpg``, ... as matplotlib writes them); a path
    without one gets ``.png``. A path naming a folder (with or without that ``.png``, or ending in a slash) is
    refused, and so is a symbolic link (moelens writes through no link: the file it points to is not the path named).
    A file at ``path`` this user may not write, one that is no regular file, and a hard link (a file with another
    name too, which writing would change) are refused; any other file there is written over in place (a save stopped
    half-way leaves it partly written).

    ``dpi``: the dots per inch of a raster format (PNG, JPEG: the pixels per inch of the figure's size), from 10 to
    2000; a vector format (PDF, SVG) keeps it only for the images inside it.
    """
    from matplotlib.figure import Figure

    if not isinstance(figure, Figure):
        raise MoelensError(f"save: figure must be a matplotlib Figure (what the plot_* functions return), got "
                           f"{type(figure).__name__}.")
    try:
        typed = path
        path = user_path(path)
        named = path
        if not path.suffix and not path.is_dir():  # the current folder ("", ".") has no name to add .png to
            path = path.with_name(path.name + ".png")
        for folder in (named, path):  # a folder named: refused, not written beside it (over a file of the user's)
            if folder.is_dir():
                raise MoelensError(f"cannot save a plot to {named}: {folder} is a folder; name a file "
                                   f"(such as {folder / 'plot.png'}).")
        spelled = os.fspath(typed) if isinstance(typed, (str, os.PathLike)) else ""
        # Path drops what says "a folder" at the end of the path as typed
        if spelled.endswith(("/", os.sep)) or os.path.basename(spelled) in (".", ".."):
            raise MoelensError(f"cannot save a plot to {spelled!r}: a path ending in '/', '/.' or '/..' names a "
                               f"folder; name a file (such as {str(named / 'plot.png')!r}).")
        if path.is_symlink():
            raise MoelensError(f"cannot save a plot to {path}: it is a symbolic link (to {os.readlink(path)!r}); "
                               "moelens writes through no link. Name the link's target, or a new path.")
        if path.exists() and not path.is_file():
            raise MoelensError(f"cannot save a plot to {path}: it is no regular file (a pipe or a device); name a "
                               "file.")
        if path.is_file() and path.stat().st_nlink > 1:
            raise MoelensError(f"cannot save a plot to {path}: it is a hard link of a file with another name too, which "
                               "writing it would change; name another path (or remove the link first).")
        if path.exists() and not os.access(path, os.W_OK):
            raise MoelensError(f"cannot save a plot to {path}: it is a file this user may not write; make it writable "
                               "(chmod u+w) or name another path.")
        dots = as_real(dpi)  # a numpy number or a 0-d tensor too, as matplotlib takes them; never a bool
        if dots is None or not 10 <= dots <= 2000:
            raise MoelensError(f"save: dpi must be a number of dots per inch from 10 to 2000, got {dpi!r}.")
        formats = figure.canvas.get_supported_filetypes()
        if path.suffix[1:].lower() not in formats:
            raise MoelensError(f"cannot save a plot as {path.name!r}: matplotlib writes {', '.join(sorted(formats))}; "
                               "end the name with one of them (or give none for .png).")
        blocked = None if path.is_file() else blocked_above(path)  # a file there is written in place
        if blocked is not None:
            raise MoelensError(f"cannot save a plot to {path}: it lies under {blocked}; name a path elsewhere.")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            figure.savefig(path, dpi=dots, bbox_inches="tight")
        except OSError as error:
            raise MoelensError(f"cannot save a plot to {path}: {error.strerror or error}.") from error
    finally:
        pyplot().close(figure)
    return path


def _categorical(count: int) -> Any:
    plt = pyplot()
    name = "tab10" if count <= 10 else "tab20" if count <= 20 else "turbo"
    return plt.get_cmap(name, count)


#: Heatmaps label each cell only up to this many rows and columns.
ANNOTATED_CELLS = 16


def _annotate(axes: Any, values: torch.Tensor, fmt: str, limit: int = ANNOTATED_CELLS, dark_low: bool = True) -> None:
    """Write each cell's value on a heatmap (white on dark cells when low values are dark)."""
    rows, columns = values.shape
    if rows > limit or columns > limit:
        return
    top = float(values.nan_to_num(0.0).max()) if values.numel() else 0.0
    for i in range(rows):
        for j in range(columns):
            value = float(values[i, j])
            if value != value:  # NaN: a cell with nothing in it (an expert the layer does not have)
                continue
            axes.text(j, i, format(value, fmt), ha="center", va="center", fontsize=7,
                      color="white" if dark_low and value < 0.6 * top else "black")


def _pixels(values: Tensor) -> np.ndarray:
    """A heatmap's cells as the float32 numpy array matplotlib takes (a tensor handed to it directly goes
    through numpy's deprecated ``__array__`` path, a warning in a notebook)."""
    return values.detach().cpu().float().numpy()


def plot_usage(usage: Usage, title: str = "Expert usage (share of each layer's slots)") -> matplotlib.figure.Figure:
    """Heatmap layers x experts of each expert's share of its layer's slots (1/E is balanced); returns the matplotlib
    Figure. ``title``: its first line (a second gives the tokens counted)."""
    check_type(usage, Usage, "usage", "a Usage", "make one with analysis.expert_usage(cache)")
    share = usage.fraction.float().clone()
    for row, experts in enumerate(usage.num_experts):
        share[row, experts:] = float("nan")  # a layer of fewer experts (a converted model): no cell, not a 0
    return _layers_by_experts(share, usage.layers, f"{title}\n{usage.tokens} tokens", "share of slots",
                              written=share * 100, fmt=".0f", unit="%", cmap="viridis", vmin=0)


def _layers_by_experts(values: Float[Tensor, "l e"], layers: Sequence[int], title: str, label: str, *,
                       written: Float[Tensor, "l e"], fmt: str, unit: str = "", dark_low: bool = True,
                       **image: Any) -> Any:
    """A heatmap layers x experts of ``values`` (NaN: no cell), each cell labelled with ``written`` up to
    `ANNOTATED_CELLS` experts and layers (larger ones stay at most 14 x 12 inches, unlabelled); ``image`` goes to
    ``imshow`` (cmap, vmin, vmax)."""
    annotated = max(values.shape) <= ANNOTATED_CELLS
    if annotated:  # room for each cell's label
        size = (max(4.0, 0.55 * values.shape[1] + 2), max(2.2, 0.5 * values.shape[0] + 1.2))
    else:  # no labels: a heatmap of 256 experts x 58 layers need not be 140 inches wide
        size = (min(max(4.0, 0.1 * values.shape[1] + 4), 14.0), min(max(2.2, 0.2 * values.shape[0] + 1.2), 12.0))
    figure, axes = pyplot().subplots(figsize=size)
    drawn = axes.imshow(_pixels(values), aspect="auto", **image)
    _annotate(axes, written, fmt, dark_low=dark_low)
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    axes.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    if annotated:  # a tick per expert; past that, as many whole numbers as fit
        axes.set_xticks(range(values.shape[1]))
    else:
        _whole_numbers(axes.xaxis, bins=10)  # a wider axis (up to 14 inches): matplotlib's default count
    axes.set_title(title + (f"; annotations in {unit}" if annotated and unit else ""), parse_math=False)
    figure.colorbar(drawn, ax=axes).set_label(label, parse_math=False)  # class names are text, "$HOME" too
    return figure


#: `plot_load_balance` names at most this many layers under each panel's bars (58 labels ran into one another).
BAR_LABELS = 16


def plot_load_balance(balance: LoadBalance) -> matplotlib.figure.Figure:
    """Bars per layer: coefficient of variation and max / mean of the expert counts; returns the matplotlib Figure."""
    check_type(balance, LoadBalance, "balance", "a LoadBalance", "make one with analysis.load_balance(usage)")
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(min(max(8.0, 0.2 * len(balance.layers) + 2), 14.0), 3))
    positions = range(len(balance.layers))
    left.bar(positions, balance.cv.tolist(), color="tab:blue")
    left.set_title("coefficient of variation (0 = balanced)")
    right.bar(positions, balance.max_over_mean.tolist(), color="tab:orange")
    right.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    right.set_title("max / mean count (1 = balanced)")
    step = -(-len(balance.layers) // BAR_LABELS)  # every layer named up to BAR_LABELS, past that every step-th
    for axes in (left, right):
        axes.set_xticks(positions[::step], [str(layer) for layer in balance.layers[::step]])
        axes.set_xlabel("layer")
    figure.tight_layout()
    return figure


#: Up to this many layers `plot_entropy` names each in a legend; beyond, lines take a colour scale by layer
#: and a second panel plots each layer's mean (a legend of 32 or 58 layers covered the plot).
LEGEND_LAYERS = 8


def plot_entropy(entropy: Entropy) -> matplotlib.figure.Figure:
    """Histogram of the tokens' normalised routing entropy, one line per layer (with its mean in the legend,
    or for more than `LEGEND_LAYERS` layers coloured by layer, beside a panel of the means); returns the matplotlib
    Figure."""
    check_type(entropy, Entropy, "entropy", "an Entropy", "make one with analysis.routing_entropy(cache)")
    plt = pyplot()
    many = len(entropy.layers) > LEGEND_LAYERS
    if many:
        figure, (axes, means) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
        scale = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(min(entropy.layers), max(entropy.layers)))
    else:
        figure, axes = plt.subplots(figsize=(6, 3.4))
    for row, layer in enumerate(entropy.layers):
        density = (entropy.histogram[row].double() / max(int(entropy.histogram[row].sum()), 1)).tolist()
        style = {"color": scale.to_rgba(layer)} if many else {"label": f"layer {layer} (mean {float(entropy.mean[row]):.2f})"}
        # each bin's share drawn across the whole bin, from edge to edge (the last value once more to end the last)
        axes.plot(entropy.edges.tolist(), density + density[-1:], drawstyle="steps-post", **style)
    what = "router distribution over all experts" if entropy.source == "router" else "top-k weights"
    axes.set_xlabel(f"normalised entropy of the {what}")
    axes.set_ylabel("share of tokens")
    axes.set_xlim(0, 1)
    axes.set_title(f"Routing entropy ({entropy.tokens} tokens)")
    if many:
        figure.colorbar(scale, ax=axes, label="layer")
        means.plot(entropy.layers, entropy.mean.tolist(), marker=".")
        means.set_xlabel("layer")
        means.set_ylabel("mean normalised entropy")
        means.set_title("Mean per layer")
    else:
        axes.legend(fontsize=7)
    figure.tight_layout()
    return figure


def _whole_numbers(*axes: Any, bins: int = 8) -> None:
    """Ticks at whole numbers only on these axes (expert ids): matplotlib's own put a heatmap of two experts'
    rows at -0.5, 0.0, 0.5 ... (one expert: a single tick at 0), at most ``bins`` + 1 of them (matplotlib's 10 ran
    a 3.2-inch panel's 256 experts' labels into one another)."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(nbins=bins, integer=True, min_n_ticks=1))


#: A grid of panels is at most this many inches wide (fewer panels a row where each is wide), 4 panels at most.
GRID_WIDTH = 16.0


def _grid(count: int, size: float = 3.2, width: float | None = None) -> tuple[Any, list[Any]]:
    """A figure of ``count`` panels, each ``size`` inches high and ``width`` (default ``size``) wide."""
    if count < 1:
        raise MoelensError("nothing to plot: pass at least one layer's (or expert's) result.")
    plt = pyplot()
    width = size if width is None else width
    columns = min(count, 4, max(1, int(GRID_WIDTH // width)))
    rows = (count + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns + 0.6, size * rows), squeeze=False)
    flat = list(axes.flat)
    for extra in flat[count:]:
        extra.axis("off")
    return figure, flat[:count]


def plot_coactivation(coactivations: Coactivation | Sequence[Coactivation],
                      value: str = "conditional") -> matplotlib.figure.Figure:
    """Heatmaps of within-layer co-activation, one per layer.

    Args:
        coactivations: One `Coactivation` or several (one panel each).
        value: ``"conditional"`` (P(column | row)), ``"lift"`` or ``"counts"``.

    Returns:
        The matplotlib Figure.
    """
    _check_value(value, COACTIVATION_VALUES)
    items = check_results(coactivations, Coactivation, "coactivations", "analysis.coactivation(cache, layer)")
    figure, panels = _grid(len(items))
    for axes, item in zip(panels, items):
        matrix = {"conditional": item.conditional, "lift": item.lift, "counts": item.counts.double}[value]()
        matrix = matrix.clone().float()
        matrix.fill_diagonal_(float("nan"))
        top = float(matrix.nan_to_num(0.0).max())  # 0 where no two experts share a token (k = 1)
        image = axes.imshow(_pixels(matrix), cmap="magma", vmin=0, vmax=top if top > 0 else 1.0)
        _whole_numbers(axes.xaxis, axes.yaxis)
        axes.set_title(f"layer {item.layer}", fontsize=9)
        axes.set_xlabel("expert j")
        axes.set_ylabel("expert i")
        figure.colorbar(image, ax=axes, fraction=0.046)
    figure.suptitle(f"Co-activation within a layer: {COACTIVATION_VALUES[value]}")
    figure.tight_layout()
    return figure


def plot_transitions(transitions: Transitions | Sequence[Transitions]) -> matplotlib.figure.Figure:
    """Heatmaps P(expert j in the later layer | expert i in the earlier one), one per layer pair; returns the
    matplotlib Figure."""
    items = check_results(transitions, Transitions, "transitions", "analysis.transitions(cache, source, target)")
    figure, panels = _grid(len(items))
    mixed = len({item.slots for item in items}) > 1  # top1 and all slots side by side: each panel says which
    for axes, item in zip(panels, items):
        image = axes.imshow(_pixels(item.conditional()), cmap="Blues", vmin=0, vmax=1)
        _whole_numbers(axes.xaxis, axes.yaxis)
        axes.set_title(f"layer {item.source} -> {item.target}" + (f" ({item.slots})" if mixed else ""), fontsize=9)
        axes.set_xlabel(f"expert in layer {item.target}")
        axes.set_ylabel(f"expert in layer {item.source}")
        figure.colorbar(image, ax=axes, fraction=0.046)
    figure.suptitle("Expert trajectories across layers" + ("" if mixed else f" ({items[0].slots})"))
    figure.tight_layout()
    return figure


def _expert_label(expert: int) -> str:
    return "skip" if expert == SKIPPED else str(expert)


def plot_token_routing(view: TokenRouting, max_tokens: int | None = 64) -> matplotlib.figure.Figure:
    """Grid layers x tokens coloured by each token's top expert, annotated with its k experts (the first
    ``max_tokens``; None: all, as `TokenRouting.table` takes it); returns the matplotlib Figure."""
    check_type(view, TokenRouting, "view", "a TokenRouting", "make one with analysis.token_routing(model, text)")
    count = len(view.tokens) if max_tokens is None else min(len(view.tokens), check_count("max_tokens", max_tokens))
    plt = pyplot()
    top = view.top1()[:, :count].float()
    width = max(int(view.indices.max()) + 1, 1) if view.indices.numel() else 1
    # every expert of the model, so an expert's colour does not depend on the text (the router's score columns
    # for a view built by hand without num_experts)
    known = view.num_experts or ([view.probs.shape[-1]] if view.probs is not None else [])
    width = max([width, *known])
    colours = _categorical(width).with_extremes(under="white")  # a skipped slot (-1) is white, no expert's colour
    figure, axes = plt.subplots(figsize=(max(6.0, 0.32 * count + 1.5), 0.55 * len(view.layers) + 1.6))
    image = axes.imshow(_pixels(top), aspect="auto", cmap=colours, vmin=-0.5, vmax=width - 0.5, interpolation="nearest")
    k = view.indices.shape[-1]
    for row in range(len(view.layers)):
        for column in range(count):
            label = "\n".join(_expert_label(int(view.indices[row, column, slot])) for slot in range(min(k, 2)))
            axes.text(column, row, label, ha="center", va="center", fontsize=6)
    axes.set_xticks(range(count), view.tokens[:count], rotation=90, fontsize=7, family="monospace", parse_math=False)
    axes.set_yticks(range(len(view.layers)), [f"layer {layer}" for layer in view.layers])
    axes.set_title("Per-token routing: colour = top expert, text = top experts"
                   + (f" (first {count} of {len(view.tokens)} tokens)" if count < len(view.tokens) else ""))
    figure.colorbar(image, ax=axes, label="top expert", ticks=range(width) if width <= 20 else None)
    figure.tight_layout()
    return figure


def plot_top_tokens(experts: Sequence[ExpertTokens], value: str = "counts") -> matplotlib.figure.Figure:
    """One horizontal bar chart per expert: its top tokens' counts (or ``value="share"``), the other annotated;
    returns the matplotlib Figure."""
    experts = check_results(experts, ExpertTokens, "experts", "analysis.top_tokens(cache, layer)")
    _check_value(value, TOP_TOKEN_VALUES)
    figure, panels = _grid(len(experts), size=2.8)
    for axes, item in zip(panels, experts):
        values = (item.share if value == "share" else item.counts).tolist()
        notes = [f"{count}" for count in item.counts.tolist()] if value == "share" else [
            f"{share:.0%}" for share in item.share.tolist()]
        axes.barh(range(len(values)), values, color="tab:green")
        for position, (bar, note) in enumerate(zip(values, notes)):
            axes.text(bar, position, f" {note}", va="center", fontsize=6)
        axes.set_yticks(range(len(values)), item.tokens, fontsize=7, family="monospace", parse_math=False)
        axes.invert_yaxis()
        axes.set_xlim(0, (max(values) if values else 1) * 1.25)
        axes.set_title(f"layer {item.layer} expert {item.expert}", fontsize=9)
        axes.tick_params(axis="x", labelsize=7)
    other = "count" if value == "share" else "share of the token's occurrences"
    figure.suptitle(f"Tokens each expert serves most: bars {value}, labels {other}")
    figure.tight_layout()
    return figure


def plot_logit_lens(lens: ExpertLens, layer: int | None = None, top: int = 8) -> matplotlib.figure.Figure:
    """Table of the tokens each expert of ``layer`` promotes, coloured by logit (rows: experts, those no token
    reached left out); returns the matplotlib Figure.

    Args:
        lens: An `ExpertLens` (`moelens.analysis.expert_logit_lens`).
        layer: A decoder-layer index of the lens (default: its last layer).
        top: How many of each expert's promoted tokens to show (columns, best first; at least 1), at most the
            ``top`` the lens was made with.
    """
    check_type(lens, ExpertLens, "lens", "an ExpertLens", "make one with analysis.expert_logit_lens(model, texts)")
    top = check_count("top", top)
    plt = pyplot()
    row = len(lens.layers) - 1 if layer is None else layer_row(lens.layers, layer, "expert lens")
    layer = lens.layers[row]
    used = [e for e in range(lens.counts.shape[1]) if int(lens.counts[row, e]) > 0]
    logits = lens.top_logits[row, used, :top].float()
    figure, axes = plt.subplots(figsize=(1.05 * logits.shape[1] + 1.5, 0.42 * len(used) + 1.2))
    centred = logits - logits.mean(-1, keepdim=True)
    axes.imshow(_pixels(centred), aspect="auto", cmap="Oranges")
    for i, expert in enumerate(used):
        for j in range(logits.shape[1]):
            axes.text(j, i, lens.tokens[row][expert][j][:10], ha="center", va="center", fontsize=7, family="monospace",
                      parse_math=False)
    axes.set_yticks(range(len(used)), [f"e{e} ({int(lens.counts[row, e])})" for e in used], fontsize=7)
    axes.set_xticks(range(logits.shape[1]), [f"#{j + 1}" for j in range(logits.shape[1])], fontsize=7)
    kind = "relative to the layer mean" if lens.relative else "mean output"
    axes.set_title(f"Logit lens, layer {layer}: tokens each expert promotes ({kind})", fontsize=9)
    figure.tight_layout()
    return figure


def plot_specialisation(spec: Specialisation, value: str = "lift") -> matplotlib.figure.Figure:
    """Heatmaps experts x classes per layer: ``"lift"`` (P(class|expert)/P(class)), ``"share"`` (P(class|expert))
    or ``"rate"`` (`Specialisation.activation_rate`: P(expert among a token's experts | class)); returns the
    matplotlib Figure."""
    check_type(spec, Specialisation, "spec", "a Specialisation", "make one with analysis.specialisation(cache, labels)")
    _check_value(value, SPECIALISATION_VALUES)
    # a cell's number needs about 0.32 inch: panels widen with the classes (10 classes' numbers ran together)
    figure, panels = _grid(len(spec.layers), size=2.6, width=max(2.6, 0.32 * len(spec.classes) + 1.0))
    matrix = {"lift": spec.lift, "share": spec.share, "rate": spec.activation_rate}[value]()
    for row, (axes, layer) in enumerate(zip(panels, spec.layers)):
        data = matrix[row].float()
        if value != "rate":  # an expert no token chose has no share; its rate is 0 (a class with no tokens: NaN)
            data[spec.counts[row].sum(-1) == 0] = float("nan")
        if value == "lift":
            image = axes.imshow(_pixels(data), aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
        else:
            image = axes.imshow(_pixels(data), aspect="auto", cmap="viridis", vmin=0, vmax=1)
        axes.set_xticks(range(len(spec.classes)), spec.classes, rotation=45, fontsize=7, parse_math=False)
        _whole_numbers(axes.yaxis)
        axes.set_ylabel("expert")
        axes.set_title(f"layer {layer}", fontsize=9)
        _annotate(axes, data, ".1f" if value == "lift" else ".2f", dark_low=value != "lift")  # blank cells: no number
        figure.colorbar(image, ax=axes, fraction=0.05)
    figure.suptitle("Expert specialisation: " + SPECIALISATION_VALUES[value])
    figure.tight_layout()
    return figure


def plot_agreement(agreement: Agreement) -> matplotlib.figure.Figure:
    """How a second routing agrees with a first (`routing_agreement`): per layer, the shares of tokens with the same
    top-1 expert and the same experts and the mean Jaccard overlap (left), and per expert the share of the first's
    tokens the second routes there too (right; blank: no token to keep); returns the matplotlib Figure."""
    check_type(agreement, Agreement, "agreement", "an Agreement",
               "make one with analysis.routing_agreement(first_cache, second_cache)")
    plt = pyplot()
    layers = len(agreement.layers)
    figure, (left, right) = plt.subplots(1, 2, figsize=(min(max(9.0, 0.12 * agreement.kept.shape[1] + 6), 14.0),
                                                        max(3.0, min(0.3 * layers + 1.5, 10.0))))
    positions = range(layers)
    step = -(-layers // BAR_LABELS)  # every layer named up to BAR_LABELS, past that every step-th
    for values, label, marker in ((agreement.top1, "same top-1 expert", "o"), (agreement.jaccard, "mean Jaccard", "s"),
                                  (agreement.same_set, "same experts", "^")):
        left.plot(positions, values.tolist(), marker=marker, label=label)
    left.set_xticks(positions[::step], [str(layer) for layer in agreement.layers[::step]])
    left.set_xlabel("layer")
    left.set_ylim(-0.02, 1.02)
    left.set_ylabel("share of tokens")
    left.legend(fontsize=8)
    image = right.imshow(_pixels(agreement.kept), aspect="auto", cmap="viridis", vmin=0, vmax=1)
    right.set_yticks(positions[::step], [str(layer) for layer in agreement.layers[::step]])
    right.set_xlabel("expert")
    right.set_ylabel("layer")
    right.set_title("tokens kept by each expert", fontsize=10)
    _whole_numbers(right.xaxis, bins=10)
    figure.colorbar(image, ax=right).set_label("share of the first's tokens")
    figure.suptitle(f"Routing agreement over {_counted(agreement.tokens, 'token')}")
    figure.tight_layout()
    return figure


def plot_risk_difference(spec: Specialisation, a: int | str, b: int | str) -> matplotlib.figure.Figure:
    """Heatmap layers x experts of `Specialisation.risk_difference` (``a``'s activation rate minus ``b``'s, -1 to
    1): red where class ``a``'s tokens reach the expert more often, blue where ``b``'s do (SteerMoE's detection);
    returns the matplotlib Figure."""
    check_type(spec, Specialisation, "spec", "a Specialisation", "make one with analysis.specialisation(cache, labels)")
    difference = spec.risk_difference(a, b).float()
    names = [spec.classes[spec._class(name)] for name in (a, b)]
    return _layers_by_experts(difference, spec.layers, f"Risk difference: {names[0]} minus {names[1]}",
                              f"P(expert | {names[0]}) - P(expert | {names[1]})", written=difference, fmt=".2f",
                              dark_low=False, cmap="coolwarm", vmin=-1, vmax=1)
