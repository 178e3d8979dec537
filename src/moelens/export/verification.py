"""`verify`: run an archive in tract and the model in torch on the same inputs, and compare.

The torch side is the model in float32 (the archive computes in float32), in eval mode, with the
archive's edits made by moelens' interventions in a trace, so an edited export is
checked against the intervened torch run. For a block archive with edits the torch
side is the edited block in tract's maths (`ExportBlock`), which the export has checked
against the real block unedited. The result names the tightest of tract's tolerance
levels the archive meets (``"approximate"``: ``|a - b| <= 1e-4 + 5e-4 |b|``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..families.registry import get as get_family
from ..families.tomoe import EXPORTABLE
from ..modules import device_of, evaluating
from ..paths import user_path
from .edits import Edits, as_edits
from .errors import ExportError, ExportRefused
from .runner import output_scale, properties, run_isolated, tolerance_met
from .target import Target, resolve


@dataclass
class Verification:
    """How an archive's tract output compares with torch.

    Attributes:
        max_abs_error: Max |tract - torch| over the values both compute as numbers (``details["tract_nan"]``
            counts the values tract computes NaN where torch does not; then no level is met).
        tolerance: The tightest of tract's levels (`moelens.export.TOLERANCES`) met by both outputs
            divided by ``scale``, so a level's absolute part counts relative to the output's size; or None.
        reference: What the torch side was.
        details: Further comparisons (with ``q4_0``: against the export's own dequantized
            weights, ``"export_max_abs_error"`` and ``"export_tolerance"``).
        scale: The largest magnitude in torch's output (1.0 where it is all zeros).
    """

    max_abs_error: float
    tolerance: str | None
    reference: str
    details: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0

    def meets(self, level: str) -> bool:
        """Whether the archive met tract's ``level`` (or a tighter one)."""
        from .runner import TOLERANCES

        order = list(TOLERANCES)
        return self.tolerance is not None and order.index(self.tolerance) <= order.index(level)


def run(path: str | Path, inputs: torch.Tensor | np.ndarray) -> np.ndarray:
    """The archive's output for ``inputs`` (token ids or hidden states), run in tract (in a child process).

    ``inputs`` (a tensor or a numpy array) are cast as `to_nnef` casts them (token ids to int64, hidden
    states to float32) and checked against the archive's input shape and vocabulary first.
    """
    return run_isolated(path, [archive_inputs(path, inputs).numpy()])[0]


def archive_inputs(path: str | Path, inputs: Any, vocab: int | None = None) -> torch.Tensor:
    """``inputs`` cast and checked for the archive at ``path`` (`checked_inputs`): its kind and input shape
    (fixed axes must match, a symbolic one is free) and token ids within ``vocab`` (default: the
    vocabulary the archive records)."""
    from .exporter import checked_inputs

    recorded = properties(path)
    vocab = vocab if vocab is not None else int(recorded.get("moelens_vocab_size", 0)) or None
    return checked_inputs(inputs, recorded.get("moelens_kind"), dims=archive_input_shape(path), vocab=vocab,
                          what="inputs", source=f"the archive {path}",
                          hint=" A fixed axis is the size the export traced; only a symbolic token axis (S, from "
                               "dynamic_tokens=True) takes any length.")


def archive_input_shape(path: str | Path) -> list[int | str] | None:
    """The archive's input shape as its graph declares it: an int per fixed axis, the symbol's name
    for a symbolic one (``S``); None when the graph declares none."""
    import re

    from .archive import graph_text

    found = re.search(r"tract_core_external\(shape = \[([^\]]*)\]", graph_text(path))
    if not found:
        return None
    return [int(dim) if dim.isdigit() else dim for dim in (d.strip() for d in found.group(1).split(","))]


def verify(path: str | Path, model: Any, inputs: torch.Tensor | np.ndarray | None = None, *,
           edits: Edits | dict | None = None) -> Verification:
    """Run the archive in tract and ``model`` in torch on ``inputs``; return the error and tolerance met.

    The archive is the eval-mode model (no dropout, no router jitter), so torch runs ``model`` in
    eval mode whatever mode it is in (its modules' modes are restored afterwards).

    Args:
        path: An archive written by `moelens.export.to_nnef`.
        model: What was exported: the wrapped / transformers model, or the block (``model.moes[i]``).
        inputs: Token ids ``[batch, seq]`` (model) or hidden states ``[batch, seq, D]`` (block), a tensor
            or a numpy array, cast as `to_nnef` casts them; the archive's traced shape unless it was
            exported with ``dynamic_tokens``. Default: seeded inputs of the archive's shape.
        edits: The edits to make in torch (default: the ones the archive records).

    Raises:
        ExportError: ``model`` is not what the archive was exported from (another kind, family, layers,
            vocabulary, block, or output: a causal LM for its base model's archive, or the reverse), or a
            converted block whose experts are not in gated form, given for a block archive with edits (verify
            against the `moelens.compress.exportable` copy that was exported).
    """
    from .exporter import vocab_size

    path = user_path(path, "verify's path", ExportError, " (verify takes the archive first: verify(path, model))")
    recorded = properties(path)
    target = resolve(model)
    _check_exported_from(path, recorded, target)
    edits = Edits.from_text(recorded.get("moelens_edits", "")) if edits is None else as_edits(edits)
    inputs = _default_inputs(path, target) if inputs is None else archive_inputs(path, inputs, vocab_size(target))
    try:
        expected, reference, computed = _torch_output(target, inputs, edits, None)
    except ExportRefused as refusal:
        if EXPORTABLE not in str(refusal):  # the one refusal exportable's copy lifts (a force edit stays refused)
            raise
        raise ExportError(  # to_nnef was given the exportable copy: only it has the block in tract's maths
            f"{path} has edits, which verify makes on the block in tract's maths, and this block cannot be written in "
            f"them: it is moelens.compress' output with experts not in gated form. Verify against the copy that was "
            f"exported, as to_nnef was given it: verify(path, moelens.wrap(moelens.compress.exportable(model)).moes[i])."
        ) from None
    _check_output(path, recorded, computed)
    _refuse_nan(expected, reference, inputs)
    actual = run_isolated(path, [inputs.numpy()])[0]
    return _compare(actual, expected, reference)


#: What to verify an archive against, by the output it computes (its ``moelens_output`` property).
_EXPORTED_FROM = {
    "last_hidden_state": "the base model it was exported from (moelens.wrap(causal_lm.model), or causal_lm.model)",
    "logits": "the model with the head it was exported from (the causal LM: moelens.wrap(causal_lm), or causal_lm), "
              "not its base model",
}


def _check_output(path: str | Path, recorded: dict[str, str], computed: str) -> None:
    """Refuse a model that computes another output (``computed``: ``logits`` or a base model's
    ``last_hidden_state``) than the archive at ``path`` records: a causal LM for an archive of its base model,
    or the other way round, which agree on everything else the archive records. An archive written before
    outputs were recorded is not checked."""
    from .exporter import OUTPUT_PROPERTY

    archived = recorded.get(OUTPUT_PROPERTY)
    if archived is None or archived == computed:
        return
    raise ExportError(
        f"{path} computes {archived} but the model given computes {computed}, so their outputs cannot be compared; "
        f"verify the archive against {_EXPORTED_FROM.get(archived, 'the model it was exported from')}."
    )


def _check_exported_from(path: str | Path, recorded: dict[str, str], target: Target) -> None:
    """Refuse a model that the archive at ``path`` cannot have been exported from: another kind (model or
    block), family, MoE layers, vocabulary or hidden size than the archive records or takes."""
    from .exporter import hidden_size, vocab_size

    kind = recorded.get("moelens_kind", target.kind)
    if kind != target.kind:
        remedy = {"block": "the block it was exported from (model.moes[i], or the bare MoE module)",
                  "model": "the whole model it was exported from (the wrapped model or its transformers model)"}
        raise ExportError(f"{path} is a {kind} export but a {target.kind} was given to compare it with; give "
                          f"{remedy.get(kind, f'a {kind}')}.")
    layers = ",".join(str(block.layer) for block in target.blocks)
    known = "None" not in layers and "None" not in recorded.get("moelens_layers", "None")  # a block outside a model
    found = {"family": (recorded.get("moelens_family"), target.family.name),
             "MoE layer(s)": (recorded.get("moelens_layers"), layers) if known else (None, None)}
    if kind == "model":
        found["vocabulary size"] = (recorded.get("moelens_vocab_size"), vocab_size(target))
    else:
        width = (archive_input_shape(path) or [None])[-1]
        found["hidden size"] = (width if isinstance(width, int) else None, hidden_size(target))
    for what, (archived, given) in found.items():
        if archived is not None and given is not None and str(archived) != str(given):
            raise ExportError(
                f"{path} was exported from a {kind} of {what} {archived}, but the {kind} given has {what} {given}; "
                "verify an archive against the model it was exported from."
            )
    if kind == "block":
        _check_block_path(path, recorded.get("moelens_block"), target.blocks[0].path)
    _check_top_k(path, recorded.get("moelens_top_k"), target)


def _check_top_k(path: str | Path, archived: str | None, target: Target) -> None:
    """Refuse a model whose blocks route another k now than the archive's did (`moelens.set_top_k` in force at the
    export and not now, or the reverse): compared, the outputs would differ for that alone. An archive written
    before k was recorded is not checked."""
    given = ",".join(str(int(block.family.resolve(block.family.top_k, target.module.get_submodule(block.name))))
                     for block in target.blocks)
    if archived is None or archived == given:
        return
    raise ExportError(
        f"{path} routes {archived} experts per token (the k of its MoE layers), but the {target.kind} given routes "
        f"{given} now; verify it at the k it was exported at (inside `with moelens.set_top_k(model, k):` where the "
        "export ran under one, or after such a setting was restored)."
    )


def _check_block_path(path: str | Path, archived: str | None, given: str | None) -> None:
    """Refuse another block of the archive's layer (a layer may hold several: attention projections converted
    by moelens.compress, ernie4_5_vl_moe's text_moe and vision_moe; an encoder's and a decoder's layer i).

    ``archived`` / ``given``: the blocks' `Moe.path` in the wrapped model each came from (None for a bare block).
    Where a path starts depends on what was wrapped (the causal LM, or its base model ``causal_lm.model``), so
    the paths match when one, seen from inside its model, is where the other sits seen from a model holding it.
    """
    if archived is None or given is None or _same_block_path(archived, given):
        return
    raise ExportError(
        f"{path} was exported from a block of path {archived}, but the block given has path {given}, another block "
        "(the paths differ below the models' roots, not only in the model wrapped around them); verify an archive "
        "against the block it was exported from."
    )


def _same_block_path(first: str, second: str) -> bool:
    """Whether two `Moe.path` values name one block: below the root envoy's name, equal, or one ends with the
    other (``model.layers.2.mlp`` of a wrapped causal LM and ``layers.2.mlp`` of its wrapped base model)."""
    first, second = first.partition(".")[2], second.partition(".")[2]
    return first == second or first.endswith(f".{second}") or second.endswith(f".{first}")


def _compare(actual: np.ndarray, expected: np.ndarray, reference: str, **details: Any) -> Verification:
    if actual.shape != expected.shape:
        raise ExportError(f"tract's output has shape {actual.shape}, torch's {expected.shape}.")
    with np.errstate(invalid="ignore"):  # inf - inf
        difference = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    difference[actual == expected] = 0.0  # the same infinity
    difference[np.isnan(actual) & np.isnan(expected)] = 0.0  # NaN where torch has NaN: equal, as tract compares
    stray_nan = np.isnan(difference)  # NaN on one side: counted, so that it hides no finite error
    tract_nan = int((stray_nan & np.isnan(actual)).sum())
    if tract_nan:
        details = {**details, "tract_nan": tract_nan}
    error = float(difference[~stray_nan].max()) if (~stray_nan).any() else 0.0
    scale = output_scale(expected)
    return Verification(error, tolerance_met(actual, expected, scale), reference, details, scale)


def _default_inputs(path: str | Path, target: Target) -> torch.Tensor:
    """Seeded inputs of the archive's input shape (its batch and tokens; 8 tokens on a symbolic axis)."""
    from .exporter import default_inputs

    dims = archive_input_shape(path) or []
    leading = dims[:-1] if target.kind == "block" else dims  # [batch,] tokens (a block's last axis is D)
    *batch, tokens = leading or [8]
    return default_inputs(target, tokens=_size(tokens, 8), batch=_size(batch[-1], 1) if batch else 1)


def _size(dim: int | str, symbolic: int) -> int:
    return dim if isinstance(dim, int) else symbolic


def torch_reference(target: Target, inputs: torch.Tensor, edits: Edits, prepared: Any = None) -> tuple[np.ndarray, str]:
    """The torch output an archive of ``target`` should match, and what it is.

    ``prepared``: the export's own `Prepared` copy (`to_nnef`), which for a block with ``edits`` is
    the reference (else it is built here).

    Raises:
        ExportError: torch computes NaN at ``inputs`` (a comparison there would count tract's NaN as a match).
    """
    expected, reference, _ = _torch_output(target, inputs, edits, prepared)
    _refuse_nan(expected, reference, inputs)
    return expected, reference


def _refuse_nan(expected: np.ndarray, reference: str, inputs: torch.Tensor) -> None:
    """Raise `ExportError` where torch's output ``expected`` (what ``reference`` computed at ``inputs``) holds NaN."""
    if np.isnan(expected).any():
        raise ExportError(
            f"{reference} computes NaN at {int(np.isnan(expected).sum())} of its {expected.size} output values for "
            f"the inputs of shape {tuple(inputs.shape)}, so tract cannot be checked there (NaN against NaN counts as "
            "a match). Check with inputs the model computes numbers from: token ids of real text, or hidden states "
            "of the scale a trace of the model gives the block."
        )


def _torch_output(target: Target, inputs: torch.Tensor, edits: Edits, prepared: Any) -> tuple[np.ndarray, str, str]:
    """torch's output for ``inputs``, what computed it, and the archive's name for it (`output_name`: a block's
    ``mlp_output``; a model's ``logits``, or a base model's ``last_hidden_state``)."""
    on_model = inputs.to(device_of(target.module))  # the user's model runs where it is
    with torch.no_grad(), evaluating(target.module):
        if target.kind == "block":
            if edits:
                if prepared is None:
                    from .exporter import prepare

                    prepared = prepare(target, edits=edits)
                return prepared.root(inputs.float()).numpy(), "the edited block in tract's maths (torch)", "mlp_output"
            block = _float_module(target.module)
            from .block import block_output

            return (block_output(target.family, block(on_model.float())).float().cpu().numpy(),
                    "the block (torch, float32)", "mlp_output")
        if not edits:
            from .exporter import attended_output, named_output

            name, output = named_output(attended_output(_float_module(target.module), on_model))
            return output.float().cpu().numpy(), "the model (torch, float32)", name
        name, output = _intervened(target, inputs, edits)
        return output, "the model with the edits made by moelens in a trace", name


def _is_float32(module: torch.nn.Module) -> bool:
    return {p.dtype for p in module.parameters() if p.is_floating_point()} <= {torch.float32}


def _float_module(module: torch.nn.Module) -> torch.nn.Module:
    return module if _is_float32(module) else copy.deepcopy(module).float()


def _intervened(target: Target, inputs: torch.Tensor, edits: Edits) -> tuple[str, np.ndarray]:
    """The logits (or a base model's last hidden state) of the model run in a moelens trace with ``edits`` made by its
    interventions, with the archive's name for them (`named_output`)."""
    from ..model import wrap
    from .exporter import named_output

    wrapped = target.wrapped
    if wrapped is None or not _is_float32(target.module):
        wrapped = wrap(copy.deepcopy(target.module).float().eval())  # never instrument the user's module
    with wrapped.trace(input_ids=inputs, attention_mask=torch.ones_like(inputs)):
        edits.intervene(wrapped)
        output = wrapped.output.save()
    name, tensor = named_output(output)
    return name, tensor.float().cpu().numpy()


def check_export(path: Path, target: Target, prepared: Any, inputs: torch.Tensor, edits: Edits,
                 quantize: str | None, dynamic: bool = False) -> Verification:
    """The check `to_nnef(verify=True)` runs on the archive it wrote from ``prepared``.

    With ``dynamic`` (a symbolic token axis), the archive is checked again at a second, longer
    length (`second_length`), recorded in ``details["second_length"]``.
    Raises `ExportError` when tract misses ``approximate``.
    """
    result = _check_once(path, target, prepared, inputs, edits, quantize)
    if dynamic:
        from .exporter import TOKEN_AXIS, default_inputs

        tokens = second_length(target, inputs.shape[TOKEN_AXIS])
        longer = default_inputs(target, tokens=tokens, seed=1, batch=inputs.shape[0])
        again = _check_once(path, target, prepared, longer, edits, quantize)
        result.details["second_length"] = {"tokens": tokens, "max_abs_error": again.max_abs_error,
                                           "tolerance": again.tolerance, **again.details}
    return result


def second_length(target: Target, tokens: int) -> int:
    """The second length a dynamic archive is checked at: ``2 * tokens + 3`` within the model's
    positions (``max_position_embeddings``), or half ``tokens`` when no longer length fits."""
    limit = target.context_length
    if limit is None:
        return 2 * tokens + 3
    return min(2 * tokens + 3, limit) if limit > tokens else max(1, tokens // 2)


def _check_once(path: Path, target: Target, prepared: Any, inputs: torch.Tensor, edits: Edits,
                quantize: str | None) -> Verification:
    """`check_export` at one input."""
    actual = run(path, inputs)
    expected, reference = torch_reference(target, inputs, edits, prepared)
    result = _compare(actual, expected, reference)
    if quantize:
        # Against torch with the archive's own (dequantized Q4_0) expert weights: must be tight.
        from .block import TractMoeFfn
        from .extractor import dequantized

        blocks = [module for module in prepared.root.modules() if isinstance(module, TractMoeFfn)]
        specs = [block.spec for block in blocks]
        if edits and target.kind == "model":
            # The Q4_0 check below runs the baked weights on both sides, so it cannot see an edit baked wrong: check the
            # float32 baked copy (tract's maths) against the edits made in a trace, as a float32 export's check does.
            with torch.no_grad():
                baked = prepared.root(inputs).float().numpy()
            edit_check = _compare(baked, expected, reference)
            result.details.update(edits_max_abs_error=edit_check.max_abs_error, edits_tolerance=edit_check.tolerance)
            if not edit_check.meets("approximate"):
                raise ExportError(
                    f"{path}: the export's float32 weights with the edits baked in differ from {reference} at input shape "
                    f"{tuple(inputs.shape)} by up to {edit_check.max_abs_error:.3g}, beyond tract's 'approximate' tolerance "
                    f"relative to the output's size {edit_check.scale:.3g}. The archive was written; "
                    + (cause if (cause := _likely_cause(prepared)) != "please report this model." else
                       "the edits were not baked as moelens makes them; please report this model.")
                )
        try:
            for block in blocks:
                block.spec = dequantized(block)
            with torch.no_grad():
                own = prepared.root(inputs).float().numpy()
        finally:  # the float32 specs again: a second check quantizes nothing twice
            for block, spec in zip(blocks, specs):
                block.spec = spec
        if np.isnan(own).any():  # NaN against NaN would count as a match
            raise ExportError(f"{path}: torch computes NaN with the archive's dequantized Q4_0 expert weights at input "
                              f"shape {tuple(inputs.shape)}, so the Q4_0 archive cannot be checked there; export the "
                              "experts in float32.")
        export_check = _compare(actual, own, "the export's dequantized Q4_0 weights in torch")
        result.details.update(export_max_abs_error=export_check.max_abs_error, export_tolerance=export_check.tolerance)
        checked = export_check
    else:
        checked = result
    if not checked.meets("approximate"):
        nan = checked.details.get("tract_nan")
        raise ExportError(
            f"{path}: tract's output differs from torch ({result.reference if not quantize else 'the Q4_0 weights'}) "
            f"at input shape {tuple(inputs.shape)} by up to {checked.max_abs_error:.3g}"
            + (f" (and tract computes NaN at {nan} values where torch has numbers)" if nan else "")
            + f", beyond tract's 'approximate' tolerance relative to the output's size {checked.scale:.3g} "
            f"(met: {checked.tolerance}). The archive was written; {_likely_cause(prepared)}"
        )
    return result


def _likely_cause(prepared: Any) -> str:
    """What a failed check most likely met: ties of saturated sigmoid scores where a router selects on them, which
    tract (ranking logits) breaks otherwise than torch.topk (by index); else a request for a report."""
    from .block import TractMoeFfn

    saturating = sorted({module.spec.family for module in prepared.root.modules() if isinstance(module, TractMoeFfn)
                         and module.spec.gate == "sigmoid" and get_family(module.spec.family).scoring.select ==
                         "score_topk"})
    if not saturating:
        return "please report this model."
    return (f"{', '.join(saturating)} select experts on sigmoid scores, which float32 rounds to exactly 1.0 above a "
            "logit of about 16.6: the experts tied there are taken by index in torch and by logit in tract (a steer "
            "bias of that size does it). Keep the router's logits below that, or steer by less.")
