"""The conversion of one dense layer: partition, router, compensation, refit, error.

Given a `DenseLayer` and the inputs captured at it on calibration data (``X [T, D]``):

1. **Shared neurons** (optional): the ``S`` neurons with the largest mean output
   contribution ``|h_i| * ||down_i||`` stay always active.
2. **Partition**: the other neurons are clustered into E equal experts
   (`partition.balanced_kmeans`) by their activation patterns over the calibration
   tokens (co-activation: neurons active on the same tokens share an expert; the
   magnitude of the signed activations of gated FFNs);
   without calibration data, by their normalised weights.
3. **Router**: each expert's importance for a token is the norm of its centred
   contribution ``||down_e (h_e(x) - mean h_e)||``; a ridge regression from the input
   predicts which k experts are the most important (a least-squares fit of the top-k
   indicator), and the top-k predicted experts run. Without data, each expert's
   router row is the centroid of its neurons' input weights.
4. **Compensation**: a token's skipped expert contributes its mean on the
   calibration tokens that skip it (the expert's down bias is minus that mean, the
   shared constant holds their sum), so skipping costs only the deviation.
5. **Refit** (FFN blocks, on by default): the experts' down projections, their
   biases and the constant are refitted by ridge regression (pulled towards the dense
   weights) so that the *routed* output matches the dense output on calibration
   tokens: the selected experts learn to carry what the skipped ones would have
   added. With ``top_k == num_experts`` nothing is skipped and the dense weights are
   kept as they are.
6. **Error**: ``||y_moe - y_dense||_F / ||y_dense||_F`` on calibration tokens held
   out of every step above (from 1024 tokens): whole sequences, about one token in
   eight (`split`), so that no held-out token shares its text with the fit; random
   tokens (noted in the plan) where the rows do not say their sequence or there are
   too few sequences. Measured, steps 1 to 5 run again on a seeded random 7 in 8 of
   all the calibration tokens: the layer built is that second fit, and the error is the
   estimate of its error on new text that the held-out sequences give. (On tiny-dense
   a fit on 7 in 8 random tokens did better on held-out documents than one on every
   token, see docs/compress.md.)

The result is a `Plan`: plain tensors that `build` turns into modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import partition
from .dense import DenseLayer
from .errors import CompressionError
from .router import MIN_SELECTED_LOGIT

#: Ridge strength of the router fit, relative to the mean diagonal of X^T X.
ROUTER_RIDGE = 1e-2
#: Ridge strength of the refit (towards the dense weights), relative to the mean diagonal of Z^T Z.
REFIT_RIDGE = 1e-3
#: Router offset without calibration data (the inputs' scale is unknown): logits stay far above 16.7.
WEIGHTS_ONLY_OFFSET = 1024.0
#: Tokens sampled per layer to describe neurons for the clustering.
CLUSTER_TOKENS = 4096
#: Fewest calibration tokens from which the error is measured on tokens held out of the fit.
MIN_HELD_OUT_TOKENS = 1024
#: One calibration token in this many is held out.
HELD_OUT_EVERY = 8
#: Whole sequences are held out unless that takes more than this share of the tokens (a few long sequences).
MAX_HELD_OUT_SHARE = 0.25


@dataclass
class Plan:
    """A converted layer as tensors (see the module docstring for how each is made).

    Attributes:
        num_experts, top_k: E and k.
        labels: ``[N]`` expert of each dense neuron (-1: shared neuron).
        shared: ``[S]`` the shared neurons.
        router_weight: ``[E, D]``; router_bias ``[E]`` (without the offset).
        offset: Added to every logit so the selected ones saturate the sigmoid.
        down: ``[D_out, N]`` the (refitted) down projection (None for a Linear layer).
        expert_bias: ``[E, D_out]`` each expert's down bias (minus its compensation).
        constant: ``[D_out]`` the always-added output (dense bias + compensations).
        error: Relative reconstruction error on held-out calibration tokens of a fit without them (the plan
            itself is then fitted on 7 in 8 of all the tokens), or None without data.
        error_tokens: How many tokens the error was measured on.
        held_out: Whether they were held out of the fits (False below 1024 calibration tokens:
            the error is then measured on the fit tokens, which the refit nearly interpolates).
            They are whole sequences unless ``notes`` says otherwise.
        notes: What is worth knowing about the conversion (no calibration data ...).
    """

    num_experts: int
    top_k: int
    labels: Int[Tensor, " n"]
    shared: Int[Tensor, " s"]
    router_weight: Float[Tensor, "e d"]
    router_bias: Float[Tensor, " e"]
    offset: float
    expert_bias: Float[Tensor, "e o"]
    constant: Float[Tensor, " o"]
    down: Float[Tensor, "o n"] | None = None
    error: float | None = None
    error_tokens: int = 0
    held_out: bool = True
    notes: list[str] = field(default_factory=list)

    def members(self, expert: int) -> Int[Tensor, " m"]:
        """The dense neurons of expert ``expert``."""
        return torch.nonzero(self.labels == expert).flatten()

    def expert_sizes(self) -> list[int]:
        return [int((self.labels == expert).sum()) for expert in range(self.num_experts)]


# -- the steps --------------------------------------------------------------------------------


def _ridge(inputs: Float[Tensor, "t f"], targets: Float[Tensor, "t o"], strength: float,
           start: Float[Tensor, "f o"] | None = None, free_last: bool = True) -> Float[Tensor, "f o"]:
    """``argmin ||inputs W - targets||^2 + lam ||W - start||^2`` (float64), lam relative to the Gram diagonal.

    The last input column (the constant) is not penalised when ``free_last``.
    """
    gram = (inputs.T @ inputs).double()  # float32 products, float64 solve
    lam = strength * float(gram.diagonal().mean().clamp_min(1e-12))
    penalty = torch.full((gram.shape[0],), lam, dtype=gram.dtype)
    if free_last:
        penalty[-1] = 0.0
    residual = targets if start is None else targets - inputs @ start
    delta = torch.linalg.solve(gram + torch.diag(penalty), (inputs.T @ residual).double())
    return (delta if start is None else start.double() + delta).float()


def choose_shared(layer: DenseLayer, hidden: Tensor | None, count: int) -> Int[Tensor, " s"]:
    """The ``count`` neurons with the largest mean output contribution (weight norms without data)."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    if hidden is not None:
        score = hidden.abs().mean(0) * layer.down_norms()
    else:
        score = layer.up.norm(dim=1) * layer.down_norms()
    return torch.topk(score, count).indices.sort().values


def neuron_features(layer: DenseLayer, hidden: Tensor | None, routed: Tensor, seed: int) -> Tensor:
    """What the clustering sees of each routed neuron (see the module docstring, step 2)."""
    if hidden is None:
        parts = [layer.up[routed]]
        if layer.gate is not None:
            parts.append(layer.gate[routed])
        if layer.down is not None:
            parts.append(layer.down[:, routed].T)
        return torch.cat([torch.nn.functional.normalize(p, dim=1) for p in parts], dim=1)
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randperm(hidden.shape[0], generator=generator)[:CLUSTER_TOKENS]
    picked = hidden[sample][:, routed]
    # Gated (GLU) activations are signed, so co-activation is about magnitude; plain ones (GELU, ReLU) are
    # one-signed where they matter. Rows are normalised before clustering: a neuron's scale does not matter.
    return (picked.abs() if layer.gated else picked).T


def importance(layer: DenseLayer, hidden: Tensor, labels: Tensor, num_experts: int) -> Float[Tensor, "t e"]:
    """Each expert's importance for each token: the norm of its centred output contribution."""
    centred = hidden - hidden.mean(0)
    columns = []
    for expert in range(num_experts):
        members = torch.nonzero(labels == expert).flatten()
        if layer.linear:  # the neurons are the outputs
            columns.append(centred[:, members].norm(dim=1))
        else:
            columns.append((centred[:, members] @ layer.down[:, members].T).norm(dim=1))
    return torch.stack(columns, dim=1)


def select(logits: Float[Tensor, "t e"], k: int) -> Bool[Tensor, "t e"]:
    """The top-k experts of each token, as a mask."""
    mask = torch.zeros_like(logits, dtype=torch.bool)
    return mask.scatter_(1, torch.topk(logits, k, dim=1).indices, True)


def conditional_means(layer: DenseLayer, hidden: Tensor, labels: Tensor, selected: Tensor,
                      num_experts: int) -> Float[Tensor, "e o"]:
    """Each expert's mean output contribution over the tokens that skip it (0 where none does)."""
    means = hidden.new_zeros(num_experts, layer.output_size)
    for expert in range(num_experts):
        skipped = ~selected[:, expert]
        if skipped.any():
            members = torch.nonzero(labels == expert).flatten()
            mean = hidden[skipped][:, members].mean(0)
            if layer.linear:  # the neurons are the outputs
                means[expert, members] = mean
            else:
                means[expert] = mean @ layer.down[:, members].T
    return means


def neuron_mask(selected: Bool[Tensor, "t e"], labels: Int[Tensor, " n"]) -> Float[Tensor, "t n"]:
    """1 where a neuron belongs to a selected expert or is shared (label -1), else 0."""
    routed = labels >= 0
    mask = torch.ones(selected.shape[0], labels.shape[0], dtype=torch.float32)
    mask[:, routed] = selected[:, labels[routed]].float()
    return mask


def routed_output(layer: DenseLayer, plan: Plan, x: Float[Tensor, "t d"],
                  hidden: Tensor | None = None) -> Float[Tensor, "t o"]:
    """What the converted layer outputs on ``x`` (the maths of the built block, as one dense pass)."""
    hidden = layer.hidden(x) if hidden is None else hidden
    logits = x @ plan.router_weight.T + plan.router_bias
    selected = select(logits, plan.top_k)
    routed = hidden * neuron_mask(selected, plan.labels)
    if plan.down is not None:  # a Linear layer's neurons are its outputs
        routed = routed @ plan.down.T
    return routed + selected.float() @ plan.expert_bias + plan.constant


def relative_error(predicted: Tensor, target: Tensor) -> float:
    """``||predicted - target||_F / ||target||_F``."""
    return float((predicted - target).norm() / target.norm().clamp_min(1e-12))


# -- the whole plan ------------------------------------------------------------------------------


def plan_layer(layer: DenseLayer, x: Float[Tensor, "t d"] | None, num_experts: int, top_k: int, *,
               shared_neurons: int = 0, refit: bool = True, seed: int = 0,
               sequences: Int[Tensor, " t"] | None = None) -> Plan:
    """Convert one dense layer (see the module docstring).

    ``x`` are its calibration inputs (or None) and ``sequences`` the sequence each row of ``x`` is from
    (`calibration.capture_sequences`); without them the error is held out on random tokens (noted).
    """
    count = layer.neurons
    if x is None:
        shared = choose_shared(layer, None, shared_neurons)
        return _plan_from_weights(layer, num_experts, top_k, shared, _routed(count, shared), seed)

    fit_rows, check_rows, split_note = split(x.shape[0], seed, sequences)
    hidden = layer.hidden(x)
    target = layer.project(hidden)
    plan = _fitted(layer, x, hidden, target, fit_rows, num_experts, top_k, shared_neurons, refit, seed)
    rows = check_rows if check_rows is not None else fit_rows
    error = relative_error(routed_output(layer, plan, x[rows], hidden[rows]), target[rows])
    built_rows = _split(x.shape[0], seed)[0]  # the layer itself is fitted on 7 in 8 random tokens of them all
    if check_rows is not None and not torch.equal(built_rows, fit_rows):  # (a random-token split fitted on them)
        plan = _fitted(layer, x, hidden, target, built_rows, num_experts, top_k, shared_neurons, refit, seed)
    plan.error, plan.error_tokens, plan.held_out = error, int(rows.numel()), check_rows is not None
    if split_note:
        plan.notes.append(split_note)
    return plan


def _fitted(layer: DenseLayer, x: Float[Tensor, "t d"], hidden: Float[Tensor, "t n"], target: Float[Tensor, "t o"],
            rows: Int[Tensor, " f"], num_experts: int, top_k: int, shared_neurons: int, refit: bool, seed: int) -> Plan:
    """Steps 1 to 5 on the calibration ``rows`` of ``x`` (``hidden``: the layer's neurons there, ``target``: its
    output); the plan's error is left to the caller."""
    fit_x, fit_hidden, fit_target = x[rows], hidden[rows], target[rows]
    count = layer.neurons
    shared = choose_shared(layer, fit_hidden, shared_neurons)
    routed_index = _routed(count, shared)
    labels = torch.full((count,), -1, dtype=torch.long)
    labels[routed_index] = partition.balanced_kmeans(neuron_features(layer, fit_hidden, routed_index, seed),
                                                     num_experts, seed=seed)

    ones = torch.ones(fit_x.shape[0], 1)
    wanted = select(importance(layer, fit_hidden, labels, num_experts), top_k).float()
    router = _ridge(torch.cat([fit_x, ones], 1), wanted, ROUTER_RIDGE)
    router_weight, router_bias = router[:-1].T.contiguous(), router[-1].contiguous()
    predicted = fit_x @ router_weight.T + router_bias
    selected = select(predicted, top_k)

    down = _dense_down(layer)
    if top_k >= num_experts:
        expert_bias = fit_x.new_zeros(num_experts, layer.output_size)
        constant = layer.down_bias.clone()
    else:
        means = conditional_means(layer, fit_hidden, labels, selected, num_experts)
        expert_bias, constant = -means, layer.down_bias + means.sum(0)
        if refit and not layer.linear:
            down, expert_bias, constant = _refit(fit_hidden, fit_target, labels, selected, down, expert_bias, constant)

    lowest = float(predicted[selected].min())  # the smallest selected logit
    offset = max(MIN_SELECTED_LOGIT, MIN_SELECTED_LOGIT - lowest)
    return Plan(num_experts, top_k, labels, shared, router_weight, router_bias, offset, expert_bias, constant,
                down=down)


def _routed(count: int, shared: Tensor) -> Int[Tensor, " r"]:
    """The neurons (of ``count``) that are not ``shared``."""
    routed = torch.ones(count, dtype=torch.bool)
    routed[shared] = False
    return torch.nonzero(routed).flatten()


def _dense_down(layer: DenseLayer) -> Tensor | None:
    """A copy of the dense down projection for the plan (None for a Linear layer)."""
    return None if layer.linear else layer.down.clone()


def split(tokens: int, seed: int, sequences: Int[Tensor, " t"] | None = None
          ) -> tuple[Int[Tensor, " f"], Int[Tensor, " h"] | None, str]:
    """Rows to fit on, rows held out to measure the error (None below 1024 tokens), and a note ("" if none).

    Whole sequences are held out (in a seeded random order, until one token in eight, at least one sequence),
    so that no held-out token shares its sentence or window with the fit: tokens of one text are alike, and
    an error on random tokens of texts the fit saw is optimistic. Random tokens are held out (`_split`, noted)
    where the rows do not say their sequence (``sequences`` None), or where whole sequences would hold out more
    than a quarter of the tokens (one sequence, or a few long ones).
    """
    if tokens < MIN_HELD_OUT_TOKENS:
        return _split(tokens, seed)[0], None, (
            f"error measured on the {tokens} fit tokens (fewer than {MIN_HELD_OUT_TOKENS} tokens to fit on, after "
            "max_tokens; none held out): optimistic")
    if sequences is not None:
        if sequences.shape != (tokens,):
            raise CompressionError(f"sequences has shape {tuple(sequences.shape)}, expected one sequence id per "
                                   f"calibration row ({tokens},): pass the ids capture_sequences gives with the rows.")
        held = _held_sequences(sequences, seed)
        if held is not None:
            return torch.nonzero(~held).flatten(), torch.nonzero(held).flatten(), ""
        count = int(sequences.unique().numel())
        reason = f"{count} sequence{'s' if count > 1 else ''}, too few to hold whole ones out"
    else:
        reason = "the layer's inputs do not show which sequence each token is from"
    fit_rows, check_rows = _split(tokens, seed)
    return fit_rows, check_rows, (
        f"error held out on {check_rows.numel()} random tokens, not whole sequences ({reason}): they share their "
        "texts with the fit tokens, so it is optimistic")


def _held_sequences(sequences: Int[Tensor, " t"], seed: int) -> Bool[Tensor, " t"] | None:
    """Rows of the sequences held out (about one token in eight), or None when that is over a quarter of them."""
    ids, counts = sequences.unique(return_counts=True)
    order = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed + 1))
    enough = sequences.numel() // HELD_OUT_EVERY
    taken = int(torch.searchsorted(counts[order].cumsum(0), enough)) + 1  # the first prefix with enough tokens
    if counts[order[:taken]].sum() > MAX_HELD_OUT_SHARE * sequences.numel():
        return None
    return torch.isin(sequences, ids[order[:taken]])


def _split(tokens: int, seed: int) -> tuple[Int[Tensor, " f"], Int[Tensor, " h"] | None]:
    """Random rows to fit on and held out to measure the error (every eighth token, from 1024 tokens)."""
    order = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed + 1))
    if tokens < MIN_HELD_OUT_TOKENS:
        return order, None
    held = tokens // HELD_OUT_EVERY
    return order[held:], order[:held]


def _refit(hidden: Tensor, target: Tensor, labels: Tensor, selected: Tensor, down: Tensor, expert_bias: Tensor,
           constant: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Ridge refit of down projection, expert biases and constant on the routed activations (step 5)."""
    count, experts = labels.shape[0], selected.shape[1]
    features = torch.cat([hidden * neuron_mask(selected, labels), selected.float(),
                          torch.ones(hidden.shape[0], 1)], dim=1)
    start = torch.cat([down.T, expert_bias, constant[None]], dim=0)
    fitted = _ridge(features, target, REFIT_RIDGE, start=start)
    return fitted[:count].T.contiguous(), fitted[count:count + experts].contiguous(), fitted[-1].contiguous()


def _plan_from_weights(layer: DenseLayer, num_experts: int, top_k: int, shared: Tensor, routed_index: Tensor,
                       seed: int) -> Plan:
    """No calibration data: weight clustering, centroid router, no compensation (its mean is unknown)."""
    labels = torch.full((layer.neurons,), -1, dtype=torch.long)
    labels[routed_index] = partition.balanced_kmeans(neuron_features(layer, None, routed_index, seed), num_experts,
                                                     seed=seed)
    rows = layer.gate if layer.gate is not None else layer.up
    centroids = torch.stack([torch.nn.functional.normalize(rows[labels == expert], dim=1).mean(0)
                             for expert in range(num_experts)])
    return Plan(
        num_experts, top_k, labels, shared, router_weight=centroids, router_bias=torch.zeros(num_experts),
        offset=WEIGHTS_ONLY_OFFSET,
        expert_bias=torch.zeros(num_experts, layer.output_size), constant=layer.down_bias.clone(),
        down=_dense_down(layer),
        notes=["no calibration data: weight clustering, centroid router, no compensation, error not measured"],
    )
