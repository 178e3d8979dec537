"""`to_nnef`: export a wrapped model (or one block) to NNEF with one tract_moe_ffn per MoE block.

The export works on a float32 deep copy of the model: each MoE block of the copy is
replaced by an `ExportBlock` whose routed part is a `TractMoeFfn` (read from the block
through its family entry, self-checked against the real block, edits baked in), and
torch-to-nnef traces the rest (attention, norms, shared experts, the family's
combination) into standard NNEF. The user's model is never changed.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from .. import __version__
from ..modules import cpu_float_copy, embedding_rows, takes_keyword, text_config, unloaded_weights
from ..modules import vocab_size as model_vocab_size
from ..paths import user_path
from ..scalars import check_flag
from .archive import check_archive_name, check_destination, size, write
from .block import ExportBlock, TractMoeFfn, check_block
from .edits import Edits, as_edits
from .errors import ExportError, ExportRefused, TractRunFailed
from .masks import attention_masks, layer_kinds, positions
from .spec import MoeSpec, read_spec, refuse_ties
from .target import Block, Target, resolve

#: Expert weight storage: None (float32) or "q4_0".
QUANTIZATIONS = (None, "q4_0")
#: Expert weight layouts of tract_moe_ffn.
LAYOUTS = ("canonical", "linear")


@dataclass
class BlockReport:
    """What one exported block became."""

    layer: int | None
    family: str
    gate: str
    activation: str
    k: int
    num_experts: int
    edits: str = ""


@dataclass
class ExportReport:
    """The result of `to_nnef`.

    Attributes:
        path: The archive (or folder) written.
        kind: ``"model"`` or ``"block"``.
        blocks: One `BlockReport` per tract_moe_ffn call, in layer order.
        input_name, output_name: The archive's input and output.
        bytes: Size on disk.
        seconds: Export time (copy, checks, tracing, writing; not the verification).
        verification: The `Verification` (None with ``verify=False``).
    """

    path: Path
    kind: str
    blocks: list[BlockReport] = field(default_factory=list)
    input_name: str = ""
    output_name: str = ""
    bytes: int = 0
    seconds: float = 0.0
    verification: Any = None


def to_nnef(
    model: Any,
    path: str | Path,
    *,
    example_inputs: torch.Tensor | np.ndarray | Mapping[str, Any] | None = None,
    dynamic_tokens: bool = False,
    quantize_experts: str | None = None,
    layout: str = "canonical",
    verify: bool = True,
    edits: Edits | dict | None = None,
) -> ExportReport:
    """Export ``model`` to NNEF for tract: one tract_moe_ffn call per MoE block.

    Args:
        model: A wrapped model (``moelens.wrap`` / ``moelens.load``) or a transformers
            model (exported as ``input_ids -> logits``, or ``-> last_hidden_state`` for a
            base model), or one block ``model.moes[i]`` (``hidden_states -> mlp_output``).
        path: Where to write: ``*.nnef.tgz`` (default form), ``*.tar``, or a folder (new, empty, or
            an earlier NNEF export, which is replaced; a folder with other files is refused).
        example_inputs: What the export traces: token ids ``[batch, seq]`` for a model,
            hidden states ``[batch, seq, D]`` for a block (default: seeded ``[1, 8]``), a tensor or
            a numpy array; or a mapping holding them (``input_ids`` / ``hidden_states``) and for a model
            an ``attention_mask`` of all ones (the archive attends every token: a padding mask is refused).
            The archive's shapes are these shapes unless ``dynamic_tokens``.
        dynamic_tokens: Make the token axis symbolic (``S``): one archive for every length. For a
            whole model the causal (and sliding-window) masks and positions are rebuilt with tensor
            ops (`moelens.export.masks`); other layer types (chunked or linear attention, state-space
            layers) are refused. Verified at the example length and at a second, longer one.
        quantize_experts: None (float32) or ``"q4_0"`` (expert w1/w2/w3 as tract Q4_0).
        layout: Expert weight layout, ``"canonical"`` or ``"linear"`` (often faster with q4_0).
        verify: Run the archive in tract on ``example_inputs`` and check it against torch
            (see `moelens.export.verify`); raises `ExportError` when it does not match.
        edits: `Edits` to bake in (ablations, route-around, steering, swaps).

    Returns:
        An `ExportReport`.

    Raises:
        ExportRefused: A family, block or edit tract_moe_ffn cannot express (the message
            says which part), or something the export would drop (hooks, nnsight edits).
        ExportError: Bad arguments, a missing ``export`` extra, a failed verification.
    """
    if quantize_experts not in QUANTIZATIONS:
        raise ExportError(f"quantize_experts must be one of {QUANTIZATIONS}, got {quantize_experts!r}.")
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    dynamic_tokens = check_flag("dynamic_tokens", dynamic_tokens, ExportError)
    verify = check_flag("verify", verify, ExportError)
    edits = as_edits(edits)
    named = path
    path = user_path(path, "to_nnef's path", ExportError, " (to_nnef takes the model first: to_nnef(model, path))")
    check_archive_name(named)
    check_destination(path)
    require_export_extra()  # before the model is copied and edited: a missing extra costs nothing
    started = time.perf_counter()
    target = resolve(model)
    inputs = _check_inputs(target, example_inputs) if example_inputs is not None else default_inputs(target)
    prepared = prepare(target, quantize_experts=quantize_experts, layout=layout, edits=edits, dynamic_tokens=dynamic_tokens)
    with tempfile.TemporaryDirectory(prefix="moelens-nnef-") as folder:
        exported = Path(folder) / "model.nnef"
        _trace(prepared.root, inputs, exported, target, dynamic_tokens, _properties(target, prepared, quantize_experts, layout, edits))
        write(exported, path)
    report = ExportReport(
        path=path, kind=target.kind, blocks=prepared.reports, input_name=input_name(target),
        output_name=output_name(target, prepared.root), bytes=size(path), seconds=time.perf_counter() - started,
    )
    if verify:
        from .verification import check_export

        try:
            report.verification = check_export(path, target, prepared, inputs, edits, quantize_experts, dynamic_tokens)
        except TractRunFailed as error:
            raise ExportError(_unrunnable(path, target, error.detail)) from error
    return report


def _unrunnable(path: Path, target: Target, detail: str) -> str:
    """Why an archive torch-to-nnef wrote does not run in tract, and what to do: for a whole model whose
    failing node is none of its MoE blocks' (``tract_moe_ffn``), export the blocks."""
    written = f"{path}: torch-to-nnef wrote this archive, but tract cannot load or run it ({detail})"
    if target.kind == "model" and "moe_ffn" not in detail.lower():
        return (f"{written}. The MoE blocks were accepted; the failing part is elsewhere in the model (an attention "
                "or layer type tract does not take): export its MoE blocks (model.moes[i]) instead.")
    return f"{written}. Please report this model."


@dataclass
class Prepared:
    """The float32 copy ready to trace, and what each block became."""

    root: torch.nn.Module
    reports: list[BlockReport]


#: Flags turned off for the export: no KV cache (its concatenations are not part of one forward), no
#: auxiliary loss over router logits (the exported blocks do not produce them).
OFF_FLAGS = ("use_cache", "output_router_logits")


def attended_output(model: torch.nn.Module, input_ids: torch.Tensor) -> Any:
    """``model``'s output for ``input_ids``, every token attended, no cache.

    An explicit all-ones mask keeps transformers off its packed-sequence detection (torch.diff
    with prepend), which torch-to-nnef cannot trace.
    """
    keywords = {name: False for name in OFF_FLAGS} | {"attention_mask": torch.ones_like(input_ids)}
    taken = {name: value for name, value in keywords.items() if takes_keyword(model, name)}
    return model(input_ids=input_ids, **taken)


def named_output(output: Any) -> tuple[str, torch.Tensor]:
    """The logits of a model's output (a transformers output's ``logits`` or ``last_hidden_state``, a tuple's first
    item, or the tensor a plain module returns) with the archive's name for it: the transformers output's field it is,
    else ``logits``."""
    if isinstance(output, torch.Tensor):
        return "logits", output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return name, value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return "logits", output[0]
    raise ExportError(
        f"the model returned {type(output).__name__}, which holds no logits to export: export a model whose forward "
        "returns a tensor, a tuple starting with one, or a transformers output with logits / last_hidden_state."
    )


class TokensToLogits(torch.nn.Module):
    """``input_ids -> logits`` (or the last hidden state) of the exported copy of a transformers model.

    With ``dynamic``, the attention masks and position ids are built from ``input_ids`` with
    tensor ops (`moelens.export.masks`), so the traced archive keeps its token axis symbolic; a
    plain torch model gets ``input_ids`` (and an all-ones ``attention_mask`` if its forward takes one).
    """

    #: The archive's name for what the forward returns (`named_output`), recorded by each run.
    returned: str = "logits"
    #: The attention implementation the model ran before the export switched it to eager (None: it ran eager).
    attention_before: str | None = None

    def __init__(self, model: torch.nn.Module, dynamic: bool = False) -> None:
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        for flag in OFF_FLAGS:  # the copy's config, so submodules that read it agree
            if config is not None and hasattr(config, flag):
                setattr(config, flag, False)
        # a plain torch model builds what masks it has itself (from what its forward takes, as attended_output gives)
        self.masks = dynamic and isinstance(model, PreTrainedModel)
        if self.masks:
            layer_kinds(text_config(model))  # refuses layer types whose masks are not rebuilt

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.masks:
            position = positions(input_ids)
            masks = attention_masks(text_config(self.model), position)  # a composite model's decoder settings
            output = self.model(input_ids=input_ids, attention_mask=masks, position_ids=position, use_cache=False)
        else:
            output = attended_output(self.model, input_ids)
        self.returned, logits = named_output(output)
        return logits


def _refuse_unloaded_weights(target: Target) -> None:
    """Raise `ExportError` when weights of the target are not loaded (on the meta device: accelerate's disk or
    cpu offload, ``init_empty_weights``): the archive holds every weight, so every weight must be there."""
    shown = unloaded_weights(target.module)
    if shown:
        raise ExportError(
            f"the {target.kind} to export has weights that are not loaded ({shown} on the meta device: offloaded by "
            "a device_map, or made under init_empty_weights), and the archive holds every weight; load the model "
            "without offloading (no device_map, or one that keeps every weight on a device) to export it."
        )


def prepare(target: Target, *, quantize_experts: str | None = None, layout: str = "canonical",
            edits: Edits | None = None, dynamic_tokens: bool = False) -> Prepared:
    """A float32 deep copy of the target with every MoE block replaced by an `ExportBlock`.

    Each block's spec is read through its family entry, checked against the real block
    on random inputs (`check_block`), and then edited (`Edits.bake`). Blocks whose router ties two
    experts that compute differently are refused (`refuse_ties`): tract would break the ties otherwise than torch.
    """
    edits = edits or Edits()
    _refuse_unloaded_weights(target)
    module = cpu_float_copy(target.module).eval()  # tract runs on the CPU: so does the copy it is traced from
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    read: list[tuple[Block, torch.nn.Module, MoeSpec]] = []
    reports: list[BlockReport] = []
    replacements: list[tuple[str, ExportBlock]] = []
    for block in target.blocks:
        live = module.get_submodule(block.name) if block.name else module
        spec = read_spec(block.family, live, block.layer)
        check_block(block.family, live, spec)
        read.append((block, live, spec))
    if edits:
        layers = [block.layer for block, _, _ in read]
        shared = sorted({layer for layer in layers if layers.count(layer) > 1} & set(edits.layers()), key=str)
        if shared:
            paths = [block.name for block, _, _ in read if block.layer == shared[0]]
            raise ExportRefused(f"layer {shared[0]} holds several MoE blocks ({', '.join(paths)}), so Edits keyed by "
                                "layer are ambiguous: export each block on its own with its edits, "
                                "to_nnef(model.moes[i], path, edits=Edits(...)), or the model without edits.")
        edits.check({block.layer: (spec.num_experts, spec.gate) for block, _, spec in read},
                    block_export=target.kind == "block")
    if quantize_experts == "q4_0":
        for _, _, spec in read:
            hidden, inner = spec.wg.shape[1], spec.w1.shape[2]
            if hidden % 32 or inner % 32:
                raise ExportRefused(
                    f"layer {spec.layer}: Q4_0 experts need the hidden size and the expert size to be multiples of "
                    f"32 (tract quantizes each expert matrix row in groups of 32), here D={hidden} and H={inner}; "
                    "export the experts in float32."
                )
    baked = [(block, live, edits.bake(spec)) for block, live, spec in read]
    refuse_ties(spec for _, _, spec in baked)  # edits may make ties (steer) or undo them (route_around, swap)
    for block, live, spec in baked:
        moe = TractMoeFfn(spec, quantize=quantize_experts, layout=layout)
        replacements.append((block.name, ExportBlock(block.family, live, moe, root=not block.name)))
        reports.append(BlockReport(block.layer, block.family.name, spec.gate, spec.activation_label, spec.k,
                                   spec.num_experts, edits.describe(block.layer) if block.layer is not None else ""))
    if target.kind == "block":
        return Prepared(replacements[0][1], reports)
    for name, replacement in replacements:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, replacement)
    before = _attention(module)
    _set_attention(module, "eager")
    root = TokensToLogits(module, dynamic=dynamic_tokens)
    root.attention_before = before if before not in (None, "eager") and _attention(module) == "eager" else None
    return Prepared(root, reports)


def _attention(module: torch.nn.Module) -> str | None:
    """The attention implementation ``module`` runs (None where its config names none)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _set_attention(module: torch.nn.Module, implementation: str) -> None:
    """Switch ``module`` to ``implementation``: plain (eager) attention is what torch-to-nnef traces on every
    transformers version."""
    setter = getattr(module, "set_attn_implementation", None)
    try:
        if callable(setter):
            setter(implementation)
        elif getattr(module, "config", None) is not None:
            module.config._attn_implementation = implementation
    except (ValueError, AttributeError):  # a model without eager attention keeps its own
        pass


def input_name(target: Target) -> str:
    return "hidden_states" if target.kind == "block" else "input_ids"


def output_name(target: Target, root: torch.nn.Module) -> str:
    """The archive's output: a block's ``mlp_output``, else what the prepared model's run in torch returned."""
    return "mlp_output" if target.kind == "block" else root.returned


#: The token axis of an archive's input: ``seq`` of token ids ``[batch, seq]`` and of hidden states ``[batch, seq, D]``.
TOKEN_AXIS = 1


def vocab_size(target: Target) -> int | None:
    """The vocabulary size of a model target (its text config's; None for a block, or when the config has none)."""
    return model_vocab_size(target.module) if target.kind == "model" else None


def hidden_size(target: Target) -> int:
    """A block target's hidden size D: the input width of its router's weight."""
    from ..families.entry import beneath_adapters, get_path

    router = get_path(target.module, beneath_adapters(target.module, target.family.router))
    return next(p.shape[-1] for p in router.parameters() if p.dim() == 2)


def default_inputs(target: Target, tokens: int = 8, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Seeded example inputs: ``[batch, tokens]`` token ids (never 0..2) or ``[batch, tokens, D]`` hidden states."""
    if tokens < 1:  # named as the argument: the export command's user reads --tokens (moelens.cli respells it)
        raise ExportError(f"tokens={tokens}: example inputs need at least one token; give tokens=1 or more.")
    if batch < 1:
        raise ExportError(f"batch={batch}: example inputs need at least one row; give batch=1 or more.")
    check_context(target, tokens, f"tokens={tokens}")
    generator = torch.Generator().manual_seed(seed)
    if target.kind == "block":
        return torch.randn(batch, tokens, hidden_size(target), generator=generator)
    high = vocab_size(target) or embedding_rows(target.module) or 128
    return torch.randint(3 if high > 3 else 0, high, (batch, tokens), generator=generator)


def check_context(target: Target, tokens: int, what: str) -> None:
    """Refuse a whole model's inputs longer than its context (``max_position_embeddings``): positions past it have no
    embedding or were never trained on, and the archive would bake them in. A block takes no positions."""
    limit = target.context_length
    if target.kind == "model" and limit is not None and limit < tokens:
        raise ExportError(
            f"{what}: {tokens} tokens is longer than the model's context (max_position_embeddings={limit}); export at "
            f"a length of at most {limit} (an archive with dynamic_tokens=True takes other lengths at run time)."
        )


def checked_inputs(inputs: Any, kind: str | None, *, dims: Sequence[int | str] | None = None,
                   vocab: int | None = None, what: str = "example_inputs", source: str = "the export",
                   hint: str = "") -> torch.Tensor:
    """``inputs`` as an archive takes them: int64 token ids ``[batch, seq]`` (``kind="model"``) or float32
    hidden states ``[batch, seq, D]`` (``"block"``), from a tensor or a numpy array.

    ``dims``: the input shape ``source`` takes, an int for a fixed axis and a name for a free one
    (default: any batch and length, and for a block any D); ``hint`` follows the message of a shape that
    does not fit. ``vocab``: token ids must lie in ``[0, vocab)``. ``kind=None`` (an archive that does not
    record its kind) only casts.

    Raises:
        ExportError: naming the value, what was expected and what to do.
    """
    if isinstance(inputs, np.ndarray):
        try:
            inputs = torch.from_numpy(np.ascontiguousarray(inputs))
        except TypeError:
            raise ExportError(f"{what} is a numpy array of {inputs.dtype}, not numbers; pass integer token ids or "
                              "float hidden states.") from None
    if not isinstance(inputs, torch.Tensor):
        raise ExportError(f"{what} must be a tensor or a numpy array (token ids or hidden states), "
                          f"got {type(inputs).__name__}.")
    shape = tuple(inputs.shape)
    if kind == "model" and (inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool
                            or inputs.dim() != 2):
        raise ExportError(f"a model archive takes token ids [batch, seq] (integers), but {what} is {inputs.dtype} "
                          f"of shape {shape}.")
    if kind == "block" and (not inputs.is_floating_point() or inputs.dim() != 3):
        if inputs.is_floating_point():
            advice = "; add the batch axis to unbatched [seq, D] states (x[None])." if inputs.dim() == 2 else "."
        elif inputs.dim() == 2:
            advice = ": pass the float hidden states that reach the block (not token ids)."
        else:
            advice = "; pass them as floats (.float())."
        raise ExportError(f"a block archive takes hidden states [batch, seq, D] (floats), but {what} is {inputs.dtype} "
                          f"of shape {shape}{advice}")
    if 0 in shape:
        raise ExportError(f"{what} of shape {shape} hold no token; give at least one.")
    if dims is not None:
        fixed = [(axis, dim) for axis, dim in enumerate(dims) if isinstance(dim, int)]
        wrong = next((axis for axis, dim in fixed if axis < len(shape) and shape[axis] != dim), None)
        if len(dims) != len(shape) or wrong is not None:
            axis = "" if wrong is None else f" (axis {wrong} must be {dims[wrong]})"
            raise ExportError(
                f"{what} of shape {shape} do not fit {source}, which takes the shape [{', '.join(map(str, dims))}]"
                f"{axis}: give inputs of that shape.{hint}"
            )
    inputs = inputs.detach().cpu()
    if inputs.is_floating_point():
        inputs = inputs.float()
        if not bool(torch.isfinite(inputs).all()):
            raise ExportError(f"{what} hold {int((~torch.isfinite(inputs)).sum())} NaN or infinite values (as float32): "
                              "tract and torch would be compared where neither computes a number. Pass finite hidden "
                              "states.")
        return inputs
    inputs = inputs.long()
    if vocab is not None and (int(inputs.min()) < 0 or int(inputs.max()) >= vocab):
        bad = int(inputs.min()) if int(inputs.min()) < 0 else int(inputs.max())
        raise ExportError(f"{what} hold token id {bad}, outside the model's vocabulary [0, {vocab}).")
    return inputs


def _check_inputs(target: Target, inputs: Any) -> torch.Tensor:
    """``example_inputs`` checked and cast (`checked_inputs`); a mapping may hold the input and, for a model,
    an all-ones ``attention_mask`` (the archive attends every token)."""
    name = input_name(target)
    mask = None
    if isinstance(inputs, Mapping):
        allowed = [name, "attention_mask"] if target.kind == "model" else [name]
        unknown = sorted(set(inputs) - set(allowed), key=str)
        if unknown or name not in inputs:
            problem = f"holds {unknown}" if unknown else f"has no {name!r}"
            raise ExportError(f"example_inputs {problem}, but the archive of this {target.kind} takes {name} only "
                              f"(keys allowed: {allowed}); pass {name} alone.")
        inputs, mask = inputs[name], inputs.get("attention_mask")
    dims = ["batch", "seq", hidden_size(target)] if target.kind == "block" else None
    inputs = checked_inputs(inputs, target.kind, dims=dims, vocab=vocab_size(target),
                            source="the block (D: its hidden size)")
    check_context(target, inputs.shape[-1], f"example_inputs of shape {tuple(inputs.shape)}")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != tuple(inputs.shape) or not bool((mask == 1).all()):
            raise ExportError(
                f"example_inputs' attention_mask (shape {tuple(mask.shape)}) is not all ones in input_ids' shape "
                f"{tuple(inputs.shape)}: the archive takes input_ids only and attends every token, so it cannot "
                "compute what torch does with padding. Export unpadded rows (prompts of one length, or one prompt "
                "at a time, with dynamic_tokens=True for any length) and drop the mask."
            )
    return inputs


#: The property naming the archive's output (`output_name`: ``logits``, a base model's ``last_hidden_state``, a
#: block's ``mlp_output``), which `_trace` adds to `_properties` once the prepared copy's run has returned it.
OUTPUT_PROPERTY = "moelens_output"


def _properties(target: Target, prepared: Prepared, quantize: str | None, layout: str, edits: Edits) -> dict[str, str]:
    """What the archive records about itself (read back by `verify`), but for its output (`OUTPUT_PROPERTY`)."""
    return {
        "moelens_version": __version__,
        "moelens_kind": target.kind,
        "moelens_family": target.family.name,
        "moelens_layers": ",".join(str(r.layer) for r in prepared.reports),
        "moelens_top_k": ",".join(str(r.k) for r in prepared.reports),
        **({"moelens_block": target.blocks[0].path} if target.kind == "block" and target.blocks[0].path else {}),
        "moelens_quantize_experts": quantize or "none",
        "moelens_layout": layout,
        "moelens_edits": edits.to_text(),
        **({"moelens_vocab_size": str(vocab_size(target))} if vocab_size(target) is not None else {}),
    }


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """The logger ``name`` shows errors only inside the block; its own level is put back after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were, after the block: torch-to-nnef's tracer logs through
    ``logging.debug(...)``, which runs ``logging.basicConfig()`` where the root logger has no handler yet, and that
    stderr handler would stay (the user's own ``basicConfig`` afterwards would then do nothing)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [handler for handler in root.handlers if handler not in handlers]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


def _run_once(root: torch.nn.Module, inputs: torch.Tensor, target: Target) -> None:
    """Run the prepared copy on ``inputs`` in torch, so a forward that fails on them is named as such,
    not blamed on torch-to-nnef's tracing."""
    try:
        with torch.no_grad():
            root(inputs)
    except ExportError:  # moelens' own refusal of what the forward returned: as it says
        raise
    except Exception as error:
        before = getattr(root, "attention_before", None)
        if before is not None and _runs_with_attention(root, inputs, before):
            raise ExportError(
                f"this model's eager attention, which the export runs (torch-to-nnef traces no other), fails in torch "
                f"({type(error).__name__}: {error}) where its own {before} attention runs on these inputs: transformers' "
                "eager attention of this family does not run. Export its MoE blocks instead (to_nnef(model.moes[i], "
                "...))."
            ) from error
        raise ExportError(
            f"this {target.kind}'s forward failed in torch on the example inputs of shape {tuple(inputs.shape)} "
            f"({type(error).__name__}: {error}), before any tracing: pass example_inputs it runs on."
        ) from error


def _runs_with_attention(root: torch.nn.Module, inputs: torch.Tensor, implementation: str) -> bool:
    """Whether the prepared copy ``root`` runs on ``inputs`` with its attention switched to ``implementation``."""
    _set_attention(root.model, implementation)
    try:
        with torch.no_grad():
            root(inputs)
    except Exception:  # noqa: BLE001 - fails either way: the inputs are the cause
        return False
    finally:
        _set_attention(root.model, "eager")
    return True


#: The export extra's import names and their distributions.
EXPORT_PACKAGES = {"torch_to_nnef": "torch-to-nnef", "tract": "tract"}


def require_export_extra() -> None:
    """Raise `ExportError` naming the export extra when torch-to-nnef or tract is not installed."""
    import importlib.util

    missing = [dist for name, dist in EXPORT_PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"NNEF export needs the export extra ({' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed): pip install 'moelens[export]'.")


def _trace(root: torch.nn.Module, inputs: torch.Tensor, folder: Path, target: Target, dynamic: bool,
           properties: dict[str, str]) -> None:
    """torch-to-nnef: trace ``root`` on ``inputs`` and write the NNEF folder."""
    try:
        with warnings.catch_warnings():  # torch-to-nnef's import uses APIs torch deprecates: not the user's concern
            warnings.simplefilter("ignore")
            import torch_to_nnef  # noqa: F401
        from torch_to_nnef import export_model_to_nnef
        from torch_to_nnef.inference_target import TractNNEF

        from . import extractor  # noqa: F401 - registers the TractMoeFfn extractor
        from .runner import tract_module
        from .t2n_fixes import fixed_emitters
        from .tract_cli import standin_path
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name in EXPORT_PACKAGES:  # (a missing
            # submodule, torch_to_nnef.x, is another version's layout: the message below)
            raise ExportError(
                f"NNEF export needs the export extra ({error.name} is missing): pip install 'moelens[export]'."
            ) from error
        import importlib.metadata

        try:
            installed = f"torch-to-nnef {importlib.metadata.version('torch-to-nnef')}"
        except importlib.metadata.PackageNotFoundError:
            installed = "torch-to-nnef"
        raise ExportError(
            f"NNEF export could not import what it needs ({type(error).__name__}: {error}); the installed {installed} "
            "may not be the version the export extra pins: pip install 'moelens[export]'."
        ) from error

    class MoelensTract(TractNNEF):
        """tract target whose properties record versions and moelens' settings, nothing of the machine."""

        def specific_fragments(self, model: torch.nn.Module) -> dict[str, str]:
            fragments = super().specific_fragments(model)
            text = fragments["tract_core_properties"]
            text = re.sub(r'    \("(export_cmd|export_date|os|hostname|user)", "[^"\n]*"\),?\n', "", text)
            text = re.sub(r",(\s*\];)", r"\1", text)  # the last item may have gone
            # the interpreter's version alone, not how and when this machine's Python was built
            text = re.sub(r'\("py_version", "[^"\n]*"\)', f'("py_version", "{platform.python_version()}")', text)
            fragments["tract_core_properties"] = text
            return fragments

    # torch_to_nnef's INFO lines, and transformers' loss_type notice that the tracer's walk over the model's
    # attributes triggers (its loss_function property); the user's levels and root handlers come back after
    with quiet_logger("torch_to_nnef"), quiet_logger("transformers.modeling_utils"), root_logger_kept():
        name_in = input_name(target)
        with warnings.catch_warnings(), fixed_emitters():
            warnings.simplefilter("ignore")
            _run_once(root, inputs, target)
            name_out = output_name(target, root)  # what that run returned
            tract_target = MoelensTract(
                tract_module().version(),
                check_io=False,
                dynamic_axes={name_in: {TOKEN_AXIS: "S"}} if dynamic else None,
                specific_tract_binary_path=standin_path(),
                dump_identity_properties=False,
                specific_properties={**properties, OUTPUT_PROPERTY: name_out},
            )
            try:
                export_model_to_nnef(
                    model=root,
                    args=(inputs,),
                    file_path_export=folder,
                    inference_target=tract_target,
                    input_names=[name_in],
                    output_names=[name_out],
                    compression_level=None,
                    log_level=logging.ERROR,
                )
            except ExportRefused:
                raise
            except Exception as error:
                raise ExportError(
                    f"torch-to-nnef could not export this {target.kind} ({type(error).__name__}: "
                    f"{_first_line(error)}). The MoE "
                    "blocks were accepted; the failing part is elsewhere in the model (an attention or layer type "
                    "torch-to-nnef does not trace): export its MoE blocks (model.moes[i]) instead."
                ) from error
            finally:
                _forget_traces()


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of ``error``'s message, cut to ``limit`` characters (`` ...`` where anything was left out):
    torch-to-nnef's errors can print whole tensors; the full error stays chained to the one moelens raises."""
    lines = str(error).strip().splitlines() or [""]
    cut = lines[0][:limit]
    return cut + " ..." if len(lines) > 1 or len(lines[0]) > limit else cut


def _forget_traces() -> None:
    """Empty torch-to-nnef's cache of traced graphs. It is keyed on the export's tracers and keeps up to 128 of them
    alive, each with a traced copy of a module and its weights: about twice the model's size after an export."""
    from torch_to_nnef.torch_graph.ir_module_tracer import TorchModuleTracer

    TorchModuleTracer.torch_graph.fget.cache_clear()
