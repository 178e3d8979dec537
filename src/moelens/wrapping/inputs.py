"""A trace's inputs as the wrapped model's batching sees them (read by `moelens.model`).

An invoke's token ids, masks, key-value cache, modality inputs and padding, and the refusals of ids and masks the
model could not take (before it runs: torch fails on them inside the model, or silently attends wrongly).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any, Iterable

import numpy as np
import torch
from jaxtyping import Int
from nnsight.modeling import processing
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pipelines.feature_extraction import FeatureExtractionPipeline
from transformers.pipelines.text_generation import TextGenerationPipeline
from transformers.utils.generic import TransformersKwargs
from torch._subclasses.fake_tensor import is_fake

from ..errors import MoelensError, described, warn
from ..modules import first_parameter, names_keyword, vocab_size
from .pipeline import tokenizer_settings


#: The dtypes torch's embedding looks token ids up by (int16 ids, bool ones, fail inside the model).
EMBEDDED_ID_DTYPES = (torch.long, torch.int32)


def _refuse_unusable_ids(module: torch.nn.Module, batched: tuple[tuple, dict], from_text: bool = False,
                         generating: bool = False, trace_kwargs: Mapping[str, Any] | None = None,
                         mask_built: bool = False) -> tuple[tuple, dict]:
    """``batched`` (the model's inputs, as nnsight's batching built them), after refusing input_ids the model could
    not embed: a tensor of a dtype torch's embedding does not take (float, int16, bool ...) or a prompt with no tokens (an empty ids
    tensor; ``from_text``: an empty string, a row of padding alone beside longer prompts; the model's attention
    fails on a zero-length sequence), and an attention mask that does not fit them (``trace_kwargs``: the trace's own
    keywords, ``model.trace(past_key_values=...)``, which the model gets beside the invokes' and over them;
    ``mask_built``: the mask was built for the invokes' own tokens, not given)."""
    ids = _input_ids(module, batched)
    if not isinstance(ids, torch.Tensor):
        embeds = batched[1].get("inputs_embeds")
        if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and embeds.shape[1] == 0:
            raise MoelensError(_NO_TOKENS.format(row="", what="an empty inputs_embeds ([batch, 0, hidden])"))
        return batched
    if ids.dtype not in EMBEDDED_ID_DTYPES:
        raise unembeddable_ids(ids, "the trace's input_ids")
    mask = batched[1].get("attention_mask")
    given = {**batched[1], **(trace_kwargs or {})}
    _refuse_misfit_mask(module, ids, given.get("attention_mask"), _given_cache(module, given), generating,
                       mask_built)
    masked = from_text and isinstance(mask, torch.Tensor) and mask.dim() == 2 and not is_fake(mask)  # scan: no values
    if ids.numel() == 0 or (masked and not mask.any(-1).all()):
        row = "" if ids.numel() == 0 else f" (row {int((~mask.any(-1)).nonzero()[0])} of the batch)"
        raise MoelensError(_NO_TOKENS.format(row=row, what="an empty string or an empty ids tensor"))
    return batched


#: The refusal of a prompt with no tokens (``row``: which row of the batch, ``what``: what gave it).
_NO_TOKENS = ("a prompt of the trace has no tokens{row}: {what} gives the model a zero-length sequence, on which its "
              "attention fails. Give every prompt at least one token.")


def _refuse_misfit_mask(module: torch.nn.Module, ids: Any, mask: Any, cache: Any, generating: bool,
                        mask_built: bool = False) -> None:
    """Refuse a ``[batch, width]`` attention_mask that does not fit the ``[batch, seq]`` ids: transformers takes it as
    it is, and the model silently attends to the wrong positions. It has one entry per token; over a key-value cache
    (``cache``) in a step of a trace, one per cached token before them too (generate's ids hold the cached tokens; an
    encoder-decoder's are the encoder's), and wider is let through there (a static cache's length)."""
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == mask.dim() == 2):
        return
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        cache = None
    rows, length = ids.shape
    counted = getattr(cache, "get_seq_length", None)
    cached = int(counted()) if cache is not None and not generating and callable(counted) else 0
    least = length + cached
    if mask.shape[0] == rows and (mask.shape[1] == least or cache is not None and mask.shape[1] > least):
        return
    before = f" and {cached} more for the tokens the cache holds before them" if cached else ""
    expected = f"{rows} row{'s' * (rows != 1)} of at least {least}" if cache is not None else f"shape ({rows}, {length})"
    built = (" (built for the invokes' own tokens, not the cached ones: over a cache pass attention_mask=, covering "
             "the cached and the new tokens, to model.trace(...))") if mask_built and cached else ""
    raise MoelensError(
        f"the attention_mask of shape {tuple(mask.shape)}{built} does not fit the input_ids of shape "
        f"{tuple(ids.shape)}: give one entry per token (1 to attend to it, 0 for padding){before}, {expected}."
    )


def _refuse_dropped_keywords(module: torch.nn.Module, given: Iterable[tuple[Any, Any, str]], generating: bool,
                             text_only: bool) -> None:
    """Refuse a keyword given to a trace that the transformers model's forward would drop: it takes any keyword
    through ``**kwargs`` and drops one it does not know, so the run would go on without it. ``given``: each keyword's
    name, value and what it was given beside: ``"text"`` (an invoke's text, which the tokenizer takes it with),
    ``"ids"`` (an invoke's token ids or embeddings, which go to the forward as they are) or ``"trace"`` (the trace's
    own, beside its invokes: nnsight hands those to the forward). Refused are a near miss of a keyword a forward of
    the model names (``atention_mask``; another unknown keyword, ``attn_mask``, is warned of: a module may read it
    from ``**kwargs`` unnamed) and a setting of the tokenizer or the text pipelines (``max_length``,
    `_text_settings`) given where no tokenizer takes it, unless it asks for nothing (`_asks_nothing`). ``generate``
    checks its own; a model with a processor (``text_only`` False) hands it keywords of its own, and a plain torch
    model may read its own from ``**kwargs``: those are left alone. A PEFT model is checked as the model it wraps."""
    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    if generating or not text_only or not isinstance(base, PreTrainedModel):
        return
    named = _named_keywords((type(module),))  # the model's own forward first: a walk of its modules only for a miss
    if named is None:
        return
    unknown = [(name, value, beside) for name, value, beside in given if isinstance(name, str) and name not in named]
    if not unknown:
        return
    named = _named_keywords(tuple(dict.fromkeys(type(sub) for sub in module.modules()))) | _loss_keywords(base)
    model = type(module).__name__
    for name, value, beside in unknown:
        if name in named or name in _text_settings() and (beside == "text" or _asks_nothing(value)):
            continue
        if name in _text_settings():
            where = ("beside token ids (or embeddings), which go to the forward as they are" if beside == "ids" else
                     "to model.trace(...) beside its invokes, and nnsight hands such keywords to the forward")
            remedy = (f"tokenize text with it (tokenizer(texts, {name}=...)), or shape the ids yourself (ids[:, :n] "
                      "keeps the first n tokens)" if beside == "ids" else
                      f"give it to each invoke with text, tracer.invoke(text, {name}=...)")
            raise MoelensError(
                f"{name}= is a setting of the tokenizer (or of the text pipeline), and it was given {where}: "
                f"{model}.forward takes any keyword and drops one it does not know, so {name}= would change "
                f"nothing. Instead, {remedy}."
            )
        meant = difflib.get_close_matches(name, named | _text_settings(), n=1, cutoff=0.8)
        dropped = (f"the keyword {name!r} given to the trace is no argument of {model}.forward (nor of its "
                   "modules'), which takes any keyword and drops one it does not know, so the model ")
        if meant:
            raise MoelensError(f"{dropped}would run without it: did you mean {meant[0]!r}?")
        warn(f"{dropped}runs without it. Check its name against {model}.forward's arguments (attention_mask=, "
             "position_ids=, ...); where a module of yours reads it from **kwargs unnamed, it gets it: ignore this.")


def _asks_nothing(value: Any) -> bool:
    """Whether a tokenizer setting's ``value`` asks for nothing ids already lack (None, False, ``"do_not_pad"``,
    ``"do_not_truncate"``, an empty dict of settings): given beside ids it is let through."""
    return (value is None or value is False or isinstance(value, str) and value in ("do_not_pad", "do_not_truncate")
            or isinstance(value, Mapping) and not value)


#: What a tokenizer call gives beside the ids (``model.trace(**tokenizer(...))`` passes them on; the forward drops
#: those it does not read, as transformers' own pipelines do).
TOKENIZER_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids", "special_tokens_mask", "offset_mapping", "length",
                     "overflow_to_sample_mapping", "num_truncated_tokens")


def _loss_keywords(model: Any) -> frozenset[str]:
    """The keywords the model's loss function names (``shift_labels``, ``ignore_index`` of the causal-LM loss): a
    transformers forward hands its ``**kwargs`` on to it. Resolved as ``PreTrainedModel.loss_function`` does, without
    its notice of a missing ``loss_type``."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    try:  # a forward without labels computes no loss (a base model): it drops these as any other keyword
        if "labels" not in inspect.signature(type(model).forward).parameters:
            return frozenset()
    except (TypeError, ValueError):
        return frozenset()
    loss = model.__dict__.get("_loss_function") or LOSS_MAPPING.get(getattr(model, "loss_type", None) or "",
                                                                      LOSS_MAPPING["ForCausalLM"])
    try:
        parameters = inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return frozenset()
    # the forward passes the logits, labels and vocabulary size itself (one given again is a TypeError with labels,
    # dropped without): only the keyword-only settings it hands on from **kwargs are the user's to give
    given_by_forward = {"logits", "labels", "vocab_size"}
    return frozenset(name for name, parameter in parameters.items()
                     if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name not in given_by_forward)


@functools.cache
def _named_keywords(classes: tuple[type, ...]) -> frozenset[str] | None:
    """The keywords the forwards of ``classes`` name (the first, the model's own, taking ``**kwargs``, which a
    transformers forward hands on to its inner model's: qwen4_exp's ``ple_input_ids``), with transformers' documented
    ones (and ``return_dict``, which its decorators take) and what a tokenizer gives (`TOKENIZER_OUTPUTS`); None
    where the model's forward takes no ``**kwargs`` (Python refuses an unknown keyword there) or cannot be read."""
    try:
        parameters = inspect.signature(classes[0].forward).parameters
    except (TypeError, ValueError):
        return None
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return None
    named = []
    for cls in classes:
        try:
            named.append(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            continue
    return frozenset({"return_dict"}).union(TransformersKwargs.__annotations__, TOKENIZER_OUTPUTS, READ_FROM_KWARGS,
                                            *named)


#: Keywords a transformers model reads from its forward's ``**kwargs`` without naming them (a scan of every family's
#: modeling file): gemma4's text model returns its shared key-value states where ``return_shared_kv_states`` is set.
READ_FROM_KWARGS = ("return_shared_kv_states",)


@functools.cache
def _text_settings() -> frozenset[str]:
    """The settings a tokenizer and the text pipelines nnsight tokenizes text with take by name (``max_length``,
    ``padding``, ``tokenizer_encode_kwargs`` ...): they act on text alone."""
    pipelines = (TextGenerationPipeline._sanitize_parameters, FeatureExtractionPipeline._sanitize_parameters)
    named = {name for setting in pipelines for name, parameter in inspect.signature(setting).parameters.items()
             if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name != "self"}
    return tokenizer_settings(PreTrainedTokenizerBase) | named


def unembeddable_ids(ids: torch.Tensor, named: str) -> MoelensError:
    """The refusal of token ids ``ids`` (called ``named``) of a dtype torch's embedding does not take."""
    kind = "token ids are integers" if not _token_ids(ids) else "a model's embedding takes torch.long or torch.int32 ids"
    return MoelensError(f"{named} are a {ids.dtype} tensor of shape {tuple(ids.shape)}: {kind}; pass the ids a "
                        "tokenizer gives (torch.long), or convert them with .long().")


def _refuse_shapeless_ids(ids: Any) -> None:
    """Refuse an invoke's input ids that are one 0-d tensor (nnsight's batching fails on it with a bare IndexError)."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 0:
        raise MoelensError(f"a trace's input was a 0-d tensor ({ids!r:.40}), one id without a batch and a sequence "
                           "axis: pass token ids [batch, seq], e.g. ids.reshape(1, 1).")


def _model_inputs(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs a failed run gave the model: a trace's, assembled again from its batcher (the tokenized, padded
    batch), or the call's own; ``((), {})`` when they cannot be built again."""
    batcher = kwargs.get("batcher")
    if batcher is None:
        return args, kwargs
    try:
        return batcher.assemble(fn)
    except Exception:  # noqa: BLE001 - only to explain an error already raised
        return (), {}


def _input_ids(module: torch.nn.Module, batched: tuple[tuple, dict]) -> Any:
    """The input_ids among the model's inputs ``batched``: the keyword, or the first argument of a forward whose
    first parameter they are."""
    args, kwargs = batched
    ids = kwargs.get("input_ids")
    if ids is None and args and first_parameter(module) == "input_ids":
        ids = args[0]
    return ids


def _invoke_ids(inputs: tuple, kwargs: dict) -> Any:
    """An invoke's input_ids: its first positional input, or the keyword (None where it has neither)."""
    return inputs[0] if inputs else kwargs.get("input_ids")


def _modality_inputs(names: Iterable[Any]) -> list[str]:
    """Which of ``names`` (an invoke's input names) are inputs of another modality than text (an image's
    pixel_values and image_grid_thw, a processor's images=, audio input_features), sorted."""
    return sorted(str(name) for name in names if any(part in str(name) for part in MODALITY_INPUTS))


def _invoke_input_names(inputs: tuple, kwargs: dict) -> list[Any]:
    """The names of the inputs an invoke gives data in: its keywords, and the keys of an encoding given as its first
    input (``tracer.invoke(processor(...))``), but for those set to None or a flag (``pixel_values=None``,
    Qwen3-Omni's ``use_audio_in_video=False``), which nnsight passes on to the model for the whole batch."""
    return [name for name, value in _invoke_inputs(inputs, kwargs).items()
            if value is not None and not isinstance(value, bool)]


def _invoke_inputs(inputs: tuple, kwargs: dict) -> dict[Any, Any]:
    """An invoke's inputs by name: its keywords, and the keys of an encoding given as its first input."""
    return {**(inputs[0] if inputs and isinstance(inputs[0], Mapping) else {}), **kwargs}


def _unbatched_inputs(inputs: tuple, kwargs: dict) -> list[str]:
    """The tensors an invoke of token ids or an encoding gives (keywords, or keys of the encoding) that nnsight does
    not split into rows to batch invokes: any outside its ``ROW_FIELDS`` (a processor's ``mm_token_type_ids``), sorted.
    None for an invoke of text, whose keywords nnsight hands the forward as settings of the whole batch."""
    if any(_is_text(value) for value in inputs):
        return []
    return sorted(str(name) for name, value in _invoke_inputs(inputs, kwargs).items()
                  if isinstance(value, torch.Tensor) and name not in processing.ROW_FIELDS)


#: What to do with inputs nnsight cannot split between invokes (`_unbatched_inputs`).
_UNBATCHED_REMEDY = ("Give the whole batch to one invoke, or to model.trace(...) with no invokes; or leave them out "
                     "where the model does without (a processor's token-type ids of text alone).")


def _unsplittable(modality: list[str]) -> str:
    """The sentence saying that the inputs named ``modality`` (images, audio) cannot be split between invokes, and how
    to batch them instead."""
    return (f"Inputs of other modalities ({', '.join(modality)}) cannot be split between invokes: give the processor's "
            "whole batch to one invoke, or to model.trace(...) with no invokes.")


def _rows_of(inputs: tuple, kwargs: dict, rows: int) -> int:
    """``rows``, the batch rows nnsight counts in an input; refused where it is 0 for an input that is there (an empty
    list of prompts, ids of 0 rows): nnsight takes such a trace for one without input, runs its body without the model
    and fails at its first read ("Cannot access model.output outside of interleaving")."""
    ids, name = _invoke_ids(inputs, kwargs), "ids"
    if isinstance(ids, Mapping):
        ids = ids.get("input_ids")
    if ids is None:
        ids, name = kwargs.get("inputs_embeds"), "inputs_embeds"
    if not rows and ((isinstance(ids, (list, tuple)) and not ids) or (isinstance(ids, torch.Tensor) and ids.ndim > 1)):
        shape = f"{name} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else f"an empty {type(ids).__name__}"
        raise MoelensError(f"the input holds no prompts ({shape}), so the model would not run: give at least one "
                           "prompt.")
    return rows


def _token_ids(value: Any) -> bool:
    """Whether ``value`` can be a model's input_ids: an integer tensor (a float one, a number or a list is not)."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


def _without_remote(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An invoke's keywords without ``remote``: plain nnsight has no remote path, so a true one is refused (it would
    reach the forward as an input) and a false one (a ``remote=REMOTE`` switch, off) dropped."""
    if kwargs.get("remote"):
        raise MoelensError(
            f"remote={kwargs['remote']!r} runs nnsight's remote path, which comes with a model wrapped with its "
            "tokenizer (nnsight's LanguageModel): moelens.wrap(model, tokenizer=...)."
        )
    return {name: value for name, value in kwargs.items() if name != "remote"}


#: The keywords a forward takes its key-value cache by: transformers 5.25 renamed ``past_key_values`` to ``cache``
#: (the old name still works there, deprecated).
CACHE_KEYWORDS = ("past_key_values", "cache")


def _given_cache(module: torch.nn.Module, params: Mapping[str, Any]) -> Any:
    """The key-value cache among ``params`` under either name (`CACHE_KEYWORDS`), None where none is given; a
    `MoelensError` for ``cache=`` to a forward that does not name it (before transformers 5.25 its ``**kwargs``
    take it in silence, and the model runs without the cache)."""
    if params.get("cache") is not None and not names_keyword(module, "cache"):
        raise MoelensError(
            f"cache= is not a keyword of {type(module).__name__}.forward: transformers before 5.25 takes the "
            "key-value cache as past_key_values, and would run the model without it. Pass past_key_values=."
        )
    return next((params[name] for name in CACHE_KEYWORDS if params.get(name) is not None), None)


def _cached_tokens(module: torch.nn.Module, params: dict[str, Any]) -> int:
    """How many tokens the key-value cache among a trace's ``params`` holds (0: none given)."""
    cache = _given_cache(module, params)
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 1  # a cache of another kind: assume it holds tokens


def _embedded_pad_id(model: torch.nn.Module) -> int:
    """The id the invokes of a model without a tokenizer are padded with (masked, so any id it embeds will do): the
    config's ``pad_token_id`` where the model embeds it, else 0 (``-1`` or an id past the vocabulary in a config)."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    vocab = vocab_size(model)
    return pad_id if isinstance(pad_id, int) and 0 <= pad_id and (vocab is None or pad_id < vocab) else 0


def _left_padded(rows: list[Int[torch.Tensor, " _"]], pad_id: int) -> tuple[Int[torch.Tensor, "b w"], Int[torch.Tensor, "b w"]]:
    """The rows (of any lengths) left-padded with ``pad_id`` to the longest one, ``w``, and their attention mask
    (1 on real tokens)."""
    width = max(row.shape[0] for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - row.shape[0] :] = row
        attention_mask[index, width - row.shape[0] :] = 1
    return input_ids, attention_mask


#: Parts of the names of a processor's image, video and audio inputs (pixel_values, image_grid_thw,
#: input_features, input_values).
MODALITY_INPUTS = ("pixel", "image", "video", "audio", "input_features", "input_values")


def _input_problem(value: Any) -> str | None:
    """What makes ``value`` (an invoke's first input, on a model with a tokenizer alone) no prompt, token ids, tensor,
    tokenizer output or chat, in words; None where it may be one. transformers' text pipeline failed on these with
    "can only concatenate str" (a number, bytes, None, a path, a dict of no ids, a list mixing prompts with other
    things) or numpy's casting error (an array of floats or of text)."""
    if isinstance(value, np.ndarray):
        return None if value.dtype.kind in "iu" else f"a numpy array of {value.dtype}"
    if isinstance(value, Mapping):
        return None if {"input_ids", "inputs_embeds"} & set(value) else \
            f"a {type(value).__name__} with keys {list(value)[:6]} (no input_ids)"
    if not isinstance(value, (list, tuple)):
        return described(value) if isinstance(value, int) or _no_input_item(value) else None
    odd = [item for item in value if _no_input_item(item)]
    if odd:
        return f"a {type(value).__name__} holding {described(odd[0])}"
    texts = [isinstance(item, str) for item in value]
    if any(texts) and not all(texts):
        return f"a {type(value).__name__} holding str and {described(value[texts.index(False)])}"
    nested = next((item for item in value if isinstance(item, (list, tuple)) and any(isinstance(x, str) for x in item)),
                  None)
    return None if nested is None else f"a {type(value).__name__} holding a {type(nested).__name__} of str"


def _no_input_item(value: Any) -> bool:
    """A number that is no token id, bytes, None or a path (of a list, or a trace's whole input)."""
    return value is None or isinstance(value, (float, bool, bytes, bytearray, os.PathLike))


def _is_text(value: Any) -> bool:
    """A prompt string or a list of them."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], str))
