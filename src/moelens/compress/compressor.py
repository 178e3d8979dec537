"""`ToMoECompressor` and `tomoe`: convert a trained dense model's layers into MoE blocks moelens recognises.

The steps (each in its own module):

1. **Targets** (`targets`): the FFN blocks (default), or the Linear layers inside
   attention (``target_attention_only``), or the modules named in ``target_modules``;
   candidates that must stay dense are recorded with the reason.
2. **Calibration** (`calibration`): one forward pass over the calibration data records
   each target's inputs (padding left out).
3. **Per layer** (`fit`, `build`): a layer whose own forward is not what its weights'
   reading computes (a norm or multipliers inside an FFN that looks like SwiGLU) stays
   dense with the reason; then partition, router, compensation, refit, error; a
   layer whose relative error on held-out calibration sequences exceeds ``max_error`` stays
   dense (with the reason); otherwise its `ToMoEBlock` / `ToMoELinear` is installed
   (inside the PEFT wrapper when there is one), with LoRA adapters and frozen experts
   when asked.
4. **Stats** (`stats`): converted and skipped layers, parameter counts, errors.

The user's model is not changed unless ``inplace=True``: the conversion works on a copy.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import warn
from ..modules import enclosing, evaluating, unloaded_weights
from ..scalars import check_flag
from . import calibration as calib
from . import targets as tg
from .blocks import ToMoEBlock
from .build import build_block, build_linear, padded_size
from .errors import CompressionError, NothingToConvert, torch_model
from .dense import DenseLayer
from .experts import ExpertsSettings, is_tomoe_experts
from .fit import plan_layer, relative_error
from .linear import ToMoELinear
from .lora import add_lora, freeze_experts
from .options import ToMoEOptions, check_dtype, check_implementation, resolve
from .stats import CompressionStats, LayerStats, SkippedLayer, block_counts, parameter_count

logger = logging.getLogger("moelens.compress")

#: Input rows on which a layer's own forward is compared with what its weights' reading computes.
PROBE_TOKENS = 256
#: Largest relative difference accepted there: float32 rounding, or a half-precision model's.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
#: Accepted for other dtypes (bfloat16, float16).
PROBE_TOLERANCE_LOW_PRECISION = 0.05
#: What each kind of site is converted as.
FORMULAS = {"swiglu": "down(act(gate(x)) * up(x))", "bert": "down(act(up(x)))", "gpt2": "down(act(up(x)))",
            "linear": "a Linear layer"}


class ToMoECompressor:
    """Converts a dense model's layers into MoE blocks (see `tomoe` for every setting).

    ``compress()`` returns ``(model, stats)``; ``get_compression_stats()`` and
    ``summary()`` describe the last conversion.
    """

    def __init__(self, model: nn.Module, num_experts: int = 4, top_k: int = 2, *, max_error: float | None = 0.2,
                 calibration: Any = None, shared_neurons: int = 0, lora_r: int = 0, lora_alpha: float = 16.0,
                 freeze_experts: bool = True, target_attention_only: bool = False, target_modules: Any = None,
                 comp_config: Any = None, **settings: Any) -> None:
        self.model = torch_model(model, "tomoe")
        self.calibration = calibration
        self.options: ToMoEOptions = resolve(
            comp_config, num_experts=num_experts, top_k=top_k, max_error=max_error, shared_neurons=shared_neurons,
            lora_r=lora_r, lora_alpha=lora_alpha, freeze_experts=freeze_experts,
            target_attention_only=target_attention_only, target_modules=target_modules, **settings,
        )
        self._stats: CompressionStats | None = None
        self._gate_warned = False  # the unheld max_error gate's warning, once a conversion
        #: The converted model of the last `compress` call.
        self.result: nn.Module | None = None

    # -- public ---------------------------------------------------------------------------------

    def compress(self) -> tuple[nn.Module, CompressionStats]:
        """Convert the model; returns the converted model (a copy unless ``inplace``) and its stats."""
        options = self.options
        started = time.perf_counter()
        check_dtype(options.experts_implementation, _float_dtypes(self.model), "the model's")  # before any work
        _check_weights_loaded(self.model)
        calls = calib.batches(self.calibration, self.model)
        calib.warn_past_positions(self.model, calls)
        original = parameter_count(self.model)
        model = self.model if options.inplace else copy.deepcopy(self.model)
        sites, skips = self.find_targets(model)
        _check_lora_rank(options.lora_r, sites)
        inputs = {}
        if calls:
            hooks = {site.name: site.hook for site in sites}
            # On the copy, forward hooks are the user's functions (deepcopy keeps them): they do not run here.
            with calib.without_hooks(model) if not options.inplace else contextlib.nullcontext():
                inputs = calib.capture_sequences(model, calls, hooks, max_tokens=options.max_tokens,
                                                 seed=options.seed)
        settings = ExpertsSettings(options.experts_implementation)
        stats = CompressionStats(skipped=[SkippedLayer(s.name, s.reason) for s in skips],
                                 original_parameters=original, settings=asdict(options))
        stats.settings["target_modules"] = repr(options.target_modules)
        stats.calibration_tokens = max((found.rows.shape[0] for found in inputs.values()), default=0)
        lora_init = torch.Generator().manual_seed(options.seed)  # the adapters' start, from the seed alone
        self._gate_warned = False
        fitted = False  # whether a layer got as far as a fit (the error gate may keep it dense)
        for site in tqdm(sites, desc="tomoe", unit="layer", disable=not options.progress):
            try:
                fitted |= self._convert(site, inputs, calls, settings, stats, lora_init)
            except BaseException as stopped:  # an error or Ctrl-C: say what the user's own model now holds
                done = [layer.name for layer in stats.converted]
                if options.inplace and done:
                    stopped.add_note(f"tomoe(inplace=True) stopped at {site.name}: the model given is partly converted"
                                     f" ({len(done)} layer(s) before it are MoE blocks now: {done}; the rest is as it "
                                     "was).")
                raise
        stats.new_parameters = parameter_count(model)
        stats.active_parameters = stats.new_parameters - sum(l.new_parameters - l.active_parameters
                                                             for l in stats.converted)
        stats.seconds = time.perf_counter() - started
        if not stats.converted:
            detail = "; ".join(f"{s.name}: {s.reason}" for s in stats.skipped)
            if not fitted:  # every candidate was left out before a fit: none of them is a layer tomoe converts
                raise NothingToConvert(f"nothing to convert in {type(model).__name__}: every candidate layer was "
                                       f"skipped ({detail}).")
            logger.warning("tomoe converted no layer: %s", detail)
        self._stats = stats
        self.result = model
        return model, stats

    def get_compression_stats(self) -> CompressionStats:
        """The stats of the last `compress` call."""
        if self._stats is None:
            raise CompressionError("no conversion has run yet: call compress() first.")
        return self._stats

    def summary(self) -> str:
        """A text report of the last conversion (or of the settings, before `compress`)."""
        if self._stats is None:
            return f"ToMoECompressor (not run yet): {self.options}"
        return self._stats.summary()

    # -- targets -----------------------------------------------------------------------------------

    def find_targets(self, model: nn.Module) -> tuple[list[tg.Site], list[tg.Skip]]:
        """The sites to convert and the candidates skipped (with reasons) in ``model``."""
        options = self.options
        targeted = options.target_modules
        linear_mode = options.target_attention_only or targeted is not None
        sites: list[tg.Site] = []
        skips: list[tg.Skip] = []
        covered: list[str] = []  # module names inside an FFN site (their Linear layers are not candidates)
        moe_blocks: list[str] = []  # MoE blocks (converted or the model's own): their parts stay as they are
        owners = tg.parameter_owners(model)
        for name, module in model.named_modules():
            if not name or ".base_layer" in name or "lora_" in name:
                continue
            block = enclosing(name, moe_blocks)
            if block is None and tg.is_moe_block(module):  # named_modules lists a block before its parts
                moe_blocks.append(name)
                if isinstance(module, ToMoEBlock) and self._wanted_again(name, module):
                    skips.append(tg.Skip(name, f"a block converted by an earlier tomoe pass ({type(module).__name__}): "
                                               "it stays as it is"))
                continue
            found = tg.ffn_site(model, name, module)
            if found is None:
                continue
            container = name
            wanted = (not linear_mode) or (targeted is not None and (tg.matches(found.name, targeted)
                                                                     or tg.matches(container, targeted)))
            if not wanted:
                continue
            covered.append(found.name)
            if container != found.name:  # a BERT layer: the FFN is intermediate + output.dense
                covered.append(f"{container}.output.dense")
            if block is not None:
                skips.append(tg.Skip(found.name, _inside_reason(model, block)))
                continue
            if isinstance(found, tg.Skip):
                skips.append(found)
                continue
            roots = [found.name] + ([f"{container}.output.dense"] if container != found.name else [])
            reason = (tg.tied_reason(found.parts, roots, owners) or _hooks_reason(found)
                      or self._ffn_skip_reason(found))
            if reason:
                skips.append(tg.Skip(found.name, reason))
            else:
                sites.append(found)
        if linear_mode:
            self._linear_targets(model, covered, moe_blocks, sites, skips)
        if not sites:
            where = ("attention Linear layers" if options.target_attention_only
                     else f"modules matching target_modules={targeted!r}" if targeted is not None
                     else "FFN blocks (SwiGLU gate/up/down, BERT intermediate/output, GPT-2 c_fc/c_proj)")
            detail = "; ".join(f"{s.name}: {s.reason}" for s in skips)
            regex = ""
            if isinstance(targeted, str):  # PEFT's rule: a string is a regex the whole module name must match
                ending = [name for name, _ in model.named_modules() if name.endswith("." + targeted)]
                regex = (" A string is a regular expression that must match a whole module name (as in PEFT)"
                         + (f", and {targeted!r} is only the end of names such as {ending[0]!r}: give "
                            f"target_modules=[{targeted!r}] or {'.*' + targeted!r}" if ending else "") + ".")
            names = _linear_names(model)
            advice = (_unrecognised_targets(model, targeted) if targeted is not None else "") or (
                " Name the layers with target_modules=[...] (Linear / Conv1D layers or FFN blocks)"
                + (f"; this model's Linear / Conv1D layers are named {', '.join(names)}" if names else "") + ".")
            raise NothingToConvert(
                f"nothing to convert in {type(model).__name__}: no {where} that can be converted"
                + (f" (skipped: {detail})" if detail else "") + "." + advice + regex
            )
        return sites, skips

    def _wanted_again(self, name: str, block: ToMoEBlock) -> bool:
        """Whether this conversion would target ``block`` (named ``name``, converted by an earlier pass) were it
        still dense: an FFN block by default, a `ToMoELinear` inside attention with ``target_attention_only``,
        anything ``target_modules`` names."""
        options = self.options
        if options.target_modules is not None and tg.matches(name, options.target_modules):
            return True
        if options.target_attention_only:
            return isinstance(block, ToMoELinear) and tg.in_attention(name)
        return options.target_modules is None and not isinstance(block, ToMoELinear)

    def _ffn_skip_reason(self, site: tg.Site) -> str:
        options = self.options
        if site.neurons < tg.MIN_PER_EXPERT * options.num_experts:
            return (f"too small: {site.neurons} intermediate neurons for {options.num_experts} experts of at least "
                    f"{tg.MIN_PER_EXPERT}")
        largest = site.neurons - tg.MIN_PER_EXPERT * options.num_experts  # the most shared neurons this layer takes
        if options.shared_neurons > largest:
            return (f"shared_neurons={options.shared_neurons} leaves {site.neurons - options.shared_neurons} of its "
                    f"{site.neurons} intermediate neurons for {options.num_experts} experts, fewer than "
                    f"{tg.MIN_PER_EXPERT} per expert: pass shared_neurons={largest} or fewer (or fewer experts) to "
                    "convert it")
        site.num_experts, site.top_k = options.num_experts, options.top_k
        return ""

    def _linear_targets(self, model: nn.Module, covered: list[str], moe_blocks: list[str], sites: list[tg.Site],
                        skips: list[tg.Skip]) -> None:
        options = self.options
        tied = tg.shared_weights(model)
        candidates: list[tuple[str, nn.Module, int]] = []  # name, module, outputs
        for name, module in model.named_modules():
            if not name or not tg.is_linear(module) or ".base_layer" in name or "lora_" in name:
                continue
            if any(name == c or name.startswith(c + ".") for c in covered):
                continue
            wanted = (options.target_attention_only and tg.in_attention(name)) or (
                options.target_modules is not None and tg.matches(name, options.target_modules))
            block = enclosing(name, moe_blocks)
            if wanted and block is not None:
                skips.append(tg.Skip(name, _inside_reason(model, block)))
            elif wanted:
                candidates.append((name, module, tg.linear_shape(module)[0]))
        widest: dict[str, int] = {}
        for name, _, out in candidates:
            parent = name.rpartition(".")[0]
            if tg.in_attention(name) and not tg.protected_reason(name) and name.rpartition(".")[2] not in tg.FUSED_QKV:
                widest[parent] = max(widest.get(parent, 0), out)
        for name, module, out in candidates:
            parent = name.rpartition(".")[0]
            experts, k = tg.narrow_experts(out, widest.get(parent, out), options.num_experts, options.top_k)
            reason = tg.linear_skip_reason(name, module, tied, experts)
            if reason:
                skips.append(tg.Skip(name, reason))
                continue
            site = tg.linear_site(model, name, module)
            hooked = _hooks_reason(site)
            if hooked:
                skips.append(tg.Skip(name, hooked))
                continue
            site.num_experts, site.top_k = experts, k
            if experts != options.num_experts:
                site.notes.append(f"narrow projection ({out} outputs vs {widest[parent]}): {experts} experts, top-{k}")
            if site.peft is not None:
                site.notes.append("PEFT wrapper kept around the converted layer")
            sites.append(site)

    # -- one layer -----------------------------------------------------------------------------------

    def _convert(self, site: tg.Site, inputs: dict, calls: list, settings: ExpertsSettings,
                 stats: CompressionStats, lora_init: torch.Generator) -> bool:
        """Convert one layer, or record why it stays dense; whether it was fitted (False: skipped before a fit)."""
        options = self.options
        found = inputs.get(site.name)
        x = found.rows if found is not None else None
        if calls and x is None:
            stats.skipped.append(SkippedLayer(site.name, "not reached by the calibration data (its input was never seen)"))
            return False
        layer = site.read()
        reason = self._mismatch_reason(site, layer, x)
        if reason:
            stats.skipped.append(SkippedLayer(site.name, reason))
            return False
        shared = options.shared_neurons if site.kind != "linear" else 0
        if site.kind == "linear" and options.shared_neurons:
            site.notes.append(f"no shared neurons (shared_neurons={options.shared_neurons} applies to FFN blocks; "
                              "a Linear layer's outputs are all split into experts)")
        plan = plan_layer(layer, x, site.num_experts, site.top_k, shared_neurons=shared, refit=options.refit,
                          seed=options.seed, sequences=found.sequences if found is not None else None)
        if plan.error is not None and not plan.held_out and options.max_error is not None and not self._gate_warned:
            self._gate_warned = True  # a property of the calibration set: said once a call, not once a layer
            capped = x.shape[0] >= options.max_tokens  # the cap cut the tokens, not the data
            warn(
                f"tomoe: fewer than 1024 calibration tokens{f' (max_tokens={options.max_tokens})' if capped else ''}, "
                "so the max_error gate measures each layer's error on the tokens it was fitted on (none held out), "
                "which the refit nearly interpolates: layers far above max_error on new text can pass. "
                + ("Raise max_tokens to at least 1024" if capped else "Give at least 1024 calibration tokens")
                + " to gate on held-out ones.",
            )
        if plan.error is not None and options.max_error is not None and plan.error > options.max_error:
            stats.skipped.append(SkippedLayer(
                site.name, f"relative reconstruction error {plan.error:.4f} on {plan.error_tokens} calibration tokens "
                           f"is above max_error={options.max_error}: kept dense"))
            return True
        reference = next(site.reference.parameters())
        original = site.original_parameters
        if site.kind == "linear":  # the layer's up projection is the Linear's weight [out, in]
            block = build_linear(layer, plan, settings, in_features=layer.hidden_size, out_features=layer.neurons,
                                 transposed=tg.is_transposed(site.parts[0]), dtype=reference.dtype,
                                 device=reference.device)
        else:
            block = build_block(layer, plan, settings, block_class=site.block_class, dropout=site.dropout,
                                dtype=reference.dtype, device=reference.device)
        block.train(site.reference.training)
        if options.lora_r:
            add_lora(block, options.lora_r, options.lora_alpha, lora_init)
        if options.freeze_experts:
            freeze_experts(block)
        total, active = block_counts(block)
        converted = LayerStats(
            name=site.name, kind=site.kind, num_experts=plan.num_experts, top_k=plan.top_k,
            expert_sizes=plan.expert_sizes(), shared_neurons=int(plan.shared.numel()), error=plan.error,
            error_tokens=plan.error_tokens, original_parameters=original, new_parameters=total,
            active_parameters=active, padded_expert_size=padded_size(plan.expert_sizes()),
            lora=bool(options.lora_r), notes=list(site.notes) + list(plan.notes),
        )
        site.install(block)  # the last step: a layer is converted and counted, or left as it was
        stats.converted.append(converted)
        return True

    def _mismatch_reason(self, site: tg.Site, layer: DenseLayer, x: torch.Tensor | None) -> str:
        """Why the site stays dense because its own forward is not what ``layer`` (its weights' reading) computes,
        or ``""``: checked on calibration inputs, or on seeded random rows without calibration data."""
        if x is not None:
            rows, source = x[:PROBE_TOKENS], "calibration"
        else:
            generator = torch.Generator().manual_seed(self.options.seed)
            rows, source = torch.randn(PROBE_TOKENS, layer.hidden_size, generator=generator), "random"
        reference = next(site.reference.parameters())
        rows = rows.to(reference.dtype)  # both sides see the same (model-precision) inputs
        try:
            with torch.no_grad(), evaluating(*site.parts), calib.without_hooks(*site.parts):
                real = site.run(rows[None].to(reference.device))
            real = real.reshape(-1, real.shape[-1]).float().cpu()
        except Exception as error:  # noqa: BLE001 - a forward that needs more than the hidden states is no plain FFN
            return f"its forward could not run on hidden states alone ({type(error).__name__}: {error}): kept dense"
        expected = layer.project(layer.hidden(rows.float()))
        difference = relative_error(expected, real) if expected.shape == real.shape else float("inf")
        tolerance = PROBE_TOLERANCE.get(reference.dtype, PROBE_TOLERANCE_LOW_PRECISION)
        if difference <= tolerance:
            return ""
        return (f"its forward does more than {FORMULAS[site.kind]} (its output differs from that by {difference:.3g}, "
                f"relative, on {rows.shape[0]} {source} inputs: a norm or multipliers inside?): kept dense")


def _hooks_reason(site: tg.Site) -> str:
    """Why ``site`` stays as it is because a module the conversion replaces carries a hook of the user's, or ``""``."""
    for part in site.parts:
        inner = calib.hooked_part(part)
        if inner is not None:
            where = f"{type(part).__name__}{'.' + inner if inner else ''}"
            return (f"a hook of yours on {where} (a module the conversion replaces) would be dropped: remove it "
                    "(handle.remove()) to convert this layer")
    return ""


def _check_weights_loaded(model: nn.Module) -> None:
    """Refuse a model whose weights are on the meta device (offloaded by a device_map, or built empty under
    ``init_empty_weights``): tomoe splits the weights it reads (a layer's forward failed as "needing more than
    hidden states")."""
    shown = unloaded_weights(model)
    if shown:
        raise CompressionError(
            f"the model has weights that are not loaded ({shown} on the meta device: offloaded by a device_map, or "
            "made under init_empty_weights), and tomoe reads the weights it splits into experts; load the model "
            "without offloading (no device_map, or one that keeps every weight on a device) to convert it."
        )


def _float_dtypes(model: nn.Module) -> set[torch.dtype]:
    """The floating-point dtypes of ``model``'s parameters (what its converted blocks' weights will be)."""
    return {parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()}


def _unrecognised_targets(model: nn.Module, targeted: str | list[str] | tuple[str, ...]) -> str:
    """Says which modules ``targeted`` (``target_modules``) matches that are neither Linear / Conv1D layers nor FFN
    blocks moelens recognises (GPT-NeoX's ``mlp``), and the Linear layers inside them to name instead; or ``""``."""
    matched = [(name, module) for name, module in model.named_modules()
               if name and tg.matches(name, targeted) and not tg.is_linear(module)
               and tg.ffn_site(model, name, module) is None and not tg.is_moe_block(module)]
    if not matched:
        return ""
    inner = list(dict.fromkeys(name for _, module in matched for name in _linear_names(module)))
    shown = ", ".join(f"{name} ({type(module).__name__})" for name, module in matched[:3])
    more = f" and {len(matched) - 3} more" if len(matched) > 3 else ""
    found = (f"; the Linear / Conv1D layers inside are {', '.join(inner)}: name those, target_modules={inner!r}"
             if inner else "; they hold no Linear / Conv1D layer")
    return (f" target_modules={targeted!r} matches {shown}{more}, which are neither Linear / Conv1D layers nor FFN "
            "blocks moelens recognises (SwiGLU gate_proj/up_proj/down_proj, BERT intermediate/output, GPT-2 "
            f"c_fc/c_proj){found}.")


def _linear_names(module: nn.Module) -> list[str]:
    """The distinct last names of the Linear / Conv1D layers below ``module`` (``fc1``, ``q_proj`` ...), in module
    order, leaving out PEFT's (``base_layer``, ``lora_A`` ...) and protected ones (``lm_head``:
    `tg.protected_reason`)."""
    return list(dict.fromkeys(path.rpartition(".")[2] for path, layer in module.named_modules()
                              if path and tg.is_linear(layer) and ".base_layer" not in path and "lora_" not in path
                              and not tg.protected_reason(path)))


def _inside_reason(model: nn.Module, block: str) -> str:
    module = model.get_submodule(block)
    what = "converted block" if isinstance(module, ToMoEBlock) else "MoE block"
    return f"inside the {what} {block} ({type(module).__name__}): the parts of an MoE block stay as they are"


def _check_lora_rank(rank: int, sites: list[tg.Site]) -> None:
    """Raise `CompressionError` when LoRA adapters of ``rank`` would be wider than full rank on a site to convert.

    Every weight a converted block has (experts ``[E, out, in]``, router ``[E, D]``) has the dense layer's input
    width as one side, so its rank is at most that width: a larger adapter adds memory (it can be gigabytes), not
    expressiveness. Checked before calibration, so a typo is refused before any work.
    """
    narrowest = min(sites, key=lambda site: site.width)
    if rank > narrowest.width:
        raise CompressionError(
            f"lora_r={rank} is above the input width of {narrowest.name} ({narrowest.width}), one side of every "
            f"weight its converted block has, so an adapter of rank {narrowest.width} is already a full-rank update "
            f"and a larger one only costs memory; use lora_r <= {narrowest.width} (LoRA ranks are usually 4 to 64)."
        )


def tomoe(model: nn.Module, num_experts: int = 4, top_k: int = 2, *, max_error: float | None = 0.2,
          calibration: Any = None, shared_neurons: int = 0, lora_r: int = 0, lora_alpha: float = 16.0,
          freeze_experts: bool = True, target_attention_only: bool = False, target_modules: Any = None,
          comp_config: Any = None, return_stats: bool = False, **settings: Any) -> Any:
    """Convert a dense model's FFN blocks (or Linear layers) into MoE blocks moelens serves, exports and shards.

    Args:
        model: A trained torch / transformers model. It is not changed (the conversion works
            on a copy) unless ``inplace=True``.
        num_experts: E, experts per converted layer.
        top_k: k, experts each token runs (``top_k == num_experts`` reproduces the dense model).
        max_error: A layer whose relative reconstruction error on held-out calibration sequences
            (about one token in eight) is above this stays dense (the reason is in the stats); None
            converts every layer.
        calibration: Model inputs to calibrate on: token ids ``[batch, seq]``, a dict of model
            inputs (keyword arguments: a tokenizer's output), a tuple of positional arguments
            (``[(features,)]`` for a sentence-transformers model, which takes the tokenizer's dict as
            one), or a list of those. None converts from weights only (weight clustering, centroid
            router, no compensation, no error gate).
        shared_neurons: Always-active neurons per FFN block (the most active ones).
        lora_r, lora_alpha: LoRA adapters of this rank on experts and router (0: none).
        freeze_experts: The experts' weights do not train (adapters and router do).
        target_attention_only: Convert the Linear layers inside attention modules
            (`ToMoELinear`) instead of the FFN blocks.
        target_modules: Module names (``"q_proj"``, ``"model.layers.0.mlp"``) or a regex to convert.
        comp_config: A dict or object with these settings (also ``tomoe_num_experts``,
            ``tomoe_top_k``, ``max_reconstruction_error``, ``tomoe_lora_r`` ...). A keyword
            argument wins over it where it differs from its default (one equal to its default
            cannot be told from an unset one: ``comp_config`` decides then).
        return_stats: Return ``(model, stats)`` instead of the model.
        **settings: ``refit`` (default True), ``max_tokens`` (32768), ``experts_implementation``
            (``"grouped_mm"``), ``inplace`` (False), ``seed`` (0), ``progress`` (True).

    Returns:
        The converted model, or ``(model, CompressionStats)`` with ``return_stats``.

    Raises:
        CompressionError: ``top_k > num_experts`` and other bad settings (a setting named twice in
            ``comp_config`` with different values; ``experts_implementation="grouped_mm"``, the default, for
            a float64 model: pass ``"batched_mm"`` or ``"eager"``), an empty calibration set, calibration
            data the model refuses (the message names the batch and why).
        NothingToConvert: The model has no layer to convert, or every candidate was skipped before a fit.
    """
    check_flag("return_stats", return_stats, CompressionError)
    compressor = ToMoECompressor(
        model, num_experts, top_k, max_error=max_error, calibration=calibration, shared_neurons=shared_neurons,
        lora_r=lora_r, lora_alpha=lora_alpha, freeze_experts=freeze_experts,
        target_attention_only=target_attention_only, target_modules=target_modules, comp_config=comp_config,
        **settings,
    )
    converted, stats = compressor.compress()
    return (converted, stats) if return_stats else converted


def inject_tomoe(model: nn.Module | None = None, **kwargs: Any) -> nn.Module | None:
    """`tomoe` that never raises: returns the converted model, or None (the error is logged)."""
    if model is None:
        logger.error("inject_tomoe: no model given")
        return None
    try:
        return tomoe(model, **kwargs)
    except Exception as error:  # noqa: BLE001 - the point of this entry is not to raise
        logger.exception("inject_tomoe failed: %s: %s", type(error).__name__, error)
        return None


def set_experts_implementation(model: nn.Module, implementation: str) -> nn.Module:
    """Run every converted block of ``model`` with ``implementation`` (``"eager"``, ``"batched_mm"``, ``"grouped_mm"`` ...).

    Raises `CompressionError` for an unknown implementation, one that cannot run the experts' dtype
    (``grouped_mm`` with float64 experts), or a model with no converted block.
    """
    check_implementation(implementation)
    root = torch_model(model, "set_experts_implementation")
    experts = [module for module in root.modules() if is_tomoe_experts(module)]
    if not experts:
        raise CompressionError(
            f"{type(root).__name__} holds no block converted by moelens.compress, so set_experts_implementation has "
            "nothing to switch: convert it first "
            "(moelens.compress.tomoe), or switch a transformers MoE model's experts with "
            "moelens.wrap(model).set_experts_implementation(...)."
        )
    dtypes = {dtype for module in experts for dtype in _float_dtypes(module)}
    check_dtype(implementation, dtypes, "the converted experts'")
    for module in experts:
        module.config._experts_implementation = implementation
    return model
