"""Calibration: the inputs each layer to convert sees when the model runs on real data.

``calibration`` is what the model is called with: a token-id tensor ``[batch, seq]``,
a dict of keyword arguments (a tokenizer's ``BatchEncoding``: ``input_ids``,
``attention_mask`` ...), a tuple of positional arguments (``(features,)`` calls
``model(features)``, as a sentence-transformers model takes the tokenizer's dict), or a
list / iterable of those (one forward each; a DataLoader's ``[ids, mask]`` list is a tuple). Positional
tensors are bound to ``model.forward``'s parameters and passed by name (`bind_positional`), so a positional
``attention_mask`` is the mask. Forward pre-hooks record each target
module's input; padding tokens (``attention_mask == 0``, also inside a positional dict;
``decoder_attention_mask`` in an encoder-decoder model's decoder) are left out, and each
layer keeps at most ``max_tokens`` tokens (a seeded random sample). Each token row keeps the
index of the sequence it came from (its batch row, counted over all calls), so that the error
can be measured on whole sequences held out of the fit (`fit.split`).

The pass runs in eval mode; every module's own ``training`` flag is restored after it.
On the deep copy a conversion works on, `without_hooks` keeps the user's forward hooks
(copied along with the model, so they are the user's functions) from running.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..errors import warn
from ..modules import device_of, evaluating, padding_position_id, takes_keyword, text_config, vocab_size
from .errors import CompressionError


def batches(calibration: Any, model: nn.Module | None = None) -> list[tuple[tuple, dict]]:
    """``calibration`` as a list of ``(args, kwargs)`` forward calls; raises on an empty or unusable set.

    A tensor, dict or tuple is one item (one call: a tuple is the call's positional arguments, so ``(ids, mask)``
    is ``[(ids, mask)]``); a list or other iterable holds items. A tensor item is token ids (keyword ``input_ids``;
    a float tensor is the positional input), a dict item is keyword arguments, a tuple item (or a list of tensors,
    as a DataLoader over a ``TensorDataset`` yields) is positional arguments (a dict among them is checked for
    tokens like a dict item); with ``model``, positional tensors are passed by the names ``model.forward`` gives
    them (`bind_positional`). An item without a real token (padding aside) is left out.
    """
    if calibration is None:
        return []
    if isinstance(calibration, (Tensor, Mapping, tuple)):  # one call (a tuple: its positional arguments)
        items = [calibration]
    elif isinstance(calibration, (str, bytes)):
        raise CompressionError(
            "calibration must be token ids or model inputs, not text; tokenize it first "
            "(calibration=tokenizer(texts, return_tensors='pt', padding=True))."
        )
    elif isinstance(calibration, Iterable):
        items = list(calibration)
        _refuse_mask_as_batch(items)
    else:
        raise CompressionError(
            f"calibration must be a tensor of token ids, a dict of model inputs, or a list of those; "
            f"got {type(calibration).__name__}."
        )
    calls: list[tuple[tuple, dict]] = []
    for number, item in enumerate(items):
        _refuse_meta(item)
        if isinstance(item, Tensor):
            if item.dim() == 0:
                raise CompressionError(
                    f"calibration tensor {item!r} is a single number (0-d); pass token ids [batch, seq] "
                    "(or [seq] for one sequence), e.g. tokenizer(texts, return_tensors='pt', padding=True)."
                )
            if item.numel() == 0:
                continue
            ids = item if item.dim() > 1 or item.is_floating_point() else item[None]
            calls.append(((), {"input_ids": ids}) if not ids.is_floating_point() else ((ids,), {}))
        elif isinstance(item, Mapping):
            kwargs = dict(item)
            if _has_tokens(kwargs):
                calls.append(((), kwargs))
        elif (isinstance(item, tuple) and item) or (isinstance(item, list) and item and isinstance(item[0], Tensor)):
            args, kwargs = bind_positional(model, tuple(item), number)  # the model's positional arguments
            features = _features(args, kwargs)
            if features is None or _has_tokens(dict(features)):
                calls.append((args, kwargs))
        elif isinstance(item, (str, bytes)):
            raise CompressionError(
                f"calibration items must be token ids or model inputs, not text (item {number} is "
                f"{item[:40]!r}); tokenize the texts first (calibration=tokenizer(texts, return_tensors='pt', "
                "padding=True))."
            )
        else:
            got = "an empty tuple" if isinstance(item, tuple) else type(item).__name__
            raise CompressionError(
                f"calibration items must be token-id tensors, dicts of model inputs (keyword arguments) or tuples of "
                f"the model's positional arguments; got {got}. A model that takes the tokenizer's dict as one "
                "positional argument (a sentence-transformers model) is calibrated with [(features,)]."
            )
    if not calls:
        raise CompressionError(
            "the calibration set is empty (no batch with any real token, padding aside); pass token ids such as "
            "tokenizer(texts, return_tensors='pt', padding=True), or calibration=None to convert from weights only."
        )
    return calls


def _refuse_mask_as_batch(items: list) -> None:
    """Raise `CompressionError` when a top-level list of tensors looks like one call's ``[ids, mask]`` (a DataLoader
    batch over ``TensorDataset(ids, mask)`` passed as is): a later integer tensor shaped like the first that holds
    only 0 and 1 would otherwise be run as a batch of token ids, and the first one's padding fitted on."""
    if len(items) < 2 or not all(isinstance(item, Tensor) for item in items):
        return
    ids = items[0]
    if ids.is_floating_point() or ids.dim() < 2:
        return
    for position, item in enumerate(items[1:], start=1):
        if (not item.is_floating_point() and item.shape == ids.shape and item.numel()
                and bool(((item == 0) | (item == 1)).all())):
            raise CompressionError(
                f"calibration is a list of tensors whose item {position} is shaped like item 0 {list(ids.shape)} and "
                "holds only 0 and 1: an attention mask, as one DataLoader batch over TensorDataset(ids, mask) gives. "
                "A list holds calls, so it would be run as token ids; pass the batch as one call, a tuple "
                "(calibration=tuple(batch)) or a dict ({'input_ids': ids, 'attention_mask': mask}), or the DataLoader "
                "itself."
            )


#: Ends of the ``forward`` parameter names that take an integer tensor shaped like the token ids.
ID_SHAPED = ("_ids", "mask", "labels")


def bind_positional(model: nn.Module | None, args: tuple, index: int = 0) -> tuple[tuple, dict]:
    """A positional calibration call ``args`` (the ``index``-th) as ``(args, kwargs)``: its arguments passed by the
    names ``model.forward`` binds them to (``(ids, mask)`` -> ``input_ids=ids, attention_mask=mask``), so that a
    positional attention mask leaves the padding out. A call holding a dict (a sentence-transformers model's
    features) or binding into ``*args``, and any call without ``model``, stays positional.

    Raises:
        CompressionError: an integer tensor after the first, shaped like the token ids (an attention mask, as a
            DataLoader over ``TensorDataset(ids, mask)`` gives), would be a parameter that takes no such tensor
            (GPT-2's second parameter is ``past_key_values``), or cannot be matched to a parameter at all.
    """
    if model is None or any(isinstance(arg, Mapping) for arg in args):
        return args, {}
    names: list[str | None] = [None] * len(args)  # the parameter each argument binds to (None: unknown)
    keywords: dict[str, Any] | None = None
    try:
        signature = inspect.signature(model.forward)
        parameters, bound = signature.parameters, signature.bind_partial(*args).arguments
    except (TypeError, ValueError):  # no signature to read, or more arguments than it takes
        bound = None
    if bound is not None:
        position = 0
        for name, value in bound.items():
            if parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
                position += len(value)
                continue
            names[position] = name
            position += 1
        if None not in names and all(parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                                     for name in names):
            keywords = dict(bound)
    _refuse_unbound_mask(model, args, names, index)
    return ((), keywords) if keywords is not None else (args, {})


def _refuse_unbound_mask(model: nn.Module, args: tuple, names: list[str | None], index: int) -> None:
    """Raise `CompressionError` when an integer tensor of ``args`` after the first has the first's shape (the token
    ids': an attention mask, most likely) and binds to no parameter named like one taking such a tensor
    (`ID_SHAPED`); ``names`` holds the parameter each argument binds to (None: unknown)."""
    ids = args[0]
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dim() < 2:
        return
    for position, (arg, name) in enumerate(zip(args, names)):
        if (position == 0 or not isinstance(arg, Tensor) or arg.is_floating_point() or arg.shape != ids.shape
                or (name is not None and name.endswith(ID_SHAPED))):
            continue
        where = (f"{type(model).__name__}.forward's {name!r}" if name is not None
                 else f"no named parameter of {type(model).__name__}.forward")
        raise CompressionError(
            f"calibration item {index} holds, as positional argument {position}, an integer tensor shaped like the "
            f"token ids {list(ids.shape)} (an attention mask, as a DataLoader over TensorDataset(ids, mask) yields), "
            f"which would be {where}, so the padding could not be left out. Pass each batch as a dict: "
            "calibration=[{'input_ids': ids, 'attention_mask': mask}, ...] (a tokenizer's output, or a DataLoader "
            "whose dataset yields such dicts)."
        )


def _refuse_meta(item: Any) -> None:
    """Raise `CompressionError` when a calibration item (a tensor, or a dict / tuple / list holding tensors, one
    level down) holds a tensor on the meta device: it has a shape but no data to run the model on."""
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, (tuple, list)) else (item,)
    for value in values:
        for tensor in (value.values() if isinstance(value, Mapping) else (value,)):
            if isinstance(tensor, Tensor) and tensor.is_meta:
                raise CompressionError(
                    f"calibration holds a tensor on the meta device (shape {tuple(tensor.shape)}), which has a shape "
                    "but no data to run the model on: pass real token ids or inputs (on the CPU or the model's "
                    "device), such as tokenizer(texts, return_tensors='pt', padding=True)."
                )


def _has_tokens(inputs: dict) -> bool:
    """Whether the dict of model inputs ``inputs`` holds a real token (padding aside); raises when it holds
    no tensor."""
    if not any(isinstance(value, Tensor) for value in inputs.values()) and inputs:
        raise CompressionError(
            f"calibration dict holds no tensor (its {', '.join(map(str, inputs))} are "
            f"{type(next(iter(inputs.values()))).__name__}s); tokenize with return_tensors='pt'."
        )
    _check_shapes(inputs)
    main = next((v for v in inputs.values() if isinstance(v, Tensor)), None)
    mask = _mask(inputs)
    return not (main is None or main.numel() == 0 or (mask is not None and not mask.any()))  # no token, or only padding


def _features(args: tuple, kwargs: dict) -> Mapping | None:
    """The dict of model inputs of one call: its keyword arguments, else the first dict among its positional
    arguments (a sentence-transformers model's ``features``), else None."""
    if kwargs:
        return kwargs
    return next((arg for arg in args if isinstance(arg, Mapping)), None)


def _check_shapes(inputs: Mapping) -> None:
    """Raise `CompressionError` when ``inputs``' ``attention_mask`` has as many dimensions as its token ids but
    another shape (its padding could not be placed). Ids of more than two dimensions (a multiple-choice head's
    ``[batch, choices, seq]``, which the model flattens itself) are taken with a mask shaped like them: the padding
    is left out over ``[-1, seq]`` (`_token_mask`)."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if isinstance(ids, Tensor) and ids.dim() >= 2 and isinstance(mask, Tensor) and mask.dim() in (2, ids.dim()) \
            and tuple(mask.shape) != tuple(ids.shape):
        raise CompressionError(
            f"calibration attention_mask of shape {list(mask.shape)} does not match input_ids {list(ids.shape)}: "
            "give one mask entry per token (a tokenizer's output for the same texts), so the padding can be left out."
        )


def _token_mask(features: Mapping | None, key: str = "attention_mask") -> Tensor | None:
    """`_mask`, with a mask shaped like token ids of more than two dimensions flattened to ``[-1, seq]`` (how a
    model taking such ids, a multiple-choice head or GPT-2, runs them)."""
    mask = features.get(key) if features is not None else None
    ids = features.get("decoder_input_ids" if key.startswith("decoder") else "input_ids") if features is not None \
        else None
    if isinstance(mask, Tensor) and mask.dim() > 2 and isinstance(ids, Tensor) and mask.shape == ids.shape:
        return mask.reshape(-1, mask.shape[-1]).bool()
    return _mask(features, key)


def _mask(kwargs: Mapping | None, key: str = "attention_mask") -> Tensor | None:
    mask = kwargs.get(key) if kwargs is not None else None
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def _token_rows(hidden: Tensor, mask: Tensor | None, name: str = "the module",
                layout: tuple[int, int] | None = None) -> tuple[Tensor, Tensor | None]:
    """The input's token rows ``[n, D]`` without padding, and the batch row (sequence) of each ``[n]``.

    ``layout`` is the batch's ``(batch, seq)`` shape (the mask's, else the model input's); the sequences are
    None where the input's shape does not show them (rows of unknown origin).

    Raises:
        CompressionError: the batch holds padding and the input's shape does not fit the mask (a module run on
            chunks of the sequence, as BERT's chunked feed-forward), so its padding rows cannot be told apart.
    """
    layout = tuple(mask.shape) if mask is not None else layout
    flat = hidden.reshape(-1, hidden.shape[-1])
    if layout is None:
        return flat, None
    batch, seq = layout
    grid = torch.arange(batch)[:, None].expand(batch, seq)  # the batch row of each position
    keep = mask.cpu() if mask is not None else torch.ones(batch, seq, dtype=torch.bool)
    if hidden.dim() == 3 and tuple(hidden.shape[:2]) == (batch, seq):
        return hidden[keep.to(hidden.device)], grid[keep]
    if hidden.dim() == 2 and hidden.shape[0] == batch * seq:
        return hidden[keep.reshape(-1).to(hidden.device)], grid[keep]
    if hidden.dim() == 3 and tuple(hidden.shape[:2]) == (seq, batch):  # square: taken as batch first
        return hidden.transpose(0, 1)[keep.to(hidden.device)], grid[keep]  # sequence first ([S, B, D])
    if not bool(keep.all()):
        raise CompressionError(
            f"{name}'s input of shape {tuple(hidden.shape)} does not fit the batch's attention_mask "
            f"{tuple(mask.shape)} (the module runs on parts of the sequence), so its padding cannot be left out "
            "of the calibration: calibrate with batches of one length (no padding), or one sequence a batch."
        )
    if hidden.dim() == 3 and hidden.shape[0] == batch:  # batch first, other positions (chunks, a decoder)
        return flat, torch.arange(batch).repeat_interleave(hidden.shape[1])
    return flat, None


def _layout(features: Mapping | None, args: tuple) -> tuple[int, int] | None:
    """``(batch, seq)`` of a call's main input (token ids, else its first tensor of two or more dimensions), or
    None: which sequence a token row is from, where a layer's input shows no mask."""
    values = list((features or {}).values()) + list(args)
    main = (features or {}).get("input_ids")
    if isinstance(main, Tensor) and main.dim() > 2:
        return (main.numel() // main.shape[-1], main.shape[-1])  # flattened by the model: [-1, seq]
    if not isinstance(main, Tensor):
        main = next((v for v in values if isinstance(v, Tensor) and v.dim() >= 2), None)
    return (main.shape[0], main.shape[1]) if isinstance(main, Tensor) and main.dim() >= 2 else None


@dataclass
class Captured:
    """A module's calibration input: token rows ``[T, D]`` (float32, on CPU) and the sequence of each ``[T]``
    (distinct over the whole calibration; None when the module's input did not show them)."""

    rows: Float[Tensor, "t d"]
    sequences: Int[Tensor, " t"] | None


def capture(model: nn.Module, calls: list[tuple[tuple, dict]], modules: Mapping[str, nn.Module], *,
            max_tokens: int = 32768, seed: int = 0) -> dict[str, Float[Tensor, "t d"]]:
    """Run ``model`` on every call and return each module's input tokens ``[T, D]`` (float32, on CPU)."""
    return {name: found.rows for name, found in
            capture_sequences(model, calls, modules, max_tokens=max_tokens, seed=seed).items()}


@torch.no_grad()
def capture_sequences(model: nn.Module, calls: list[tuple[tuple, dict]], modules: Mapping[str, nn.Module], *,
                      max_tokens: int = 32768, seed: int = 0) -> dict[str, Captured]:
    """Run ``model`` on every call and return each module's input tokens with the sequence of each token."""
    found: dict[str, list[tuple[Tensor, Tensor | None]]] = {name: [] for name in modules}
    current: dict[str, Any] = {"features": None, "layout": None, "first": 0}
    handles = []
    decoder = _decoder_modules(model)

    def recorder(name: str, mask_key: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else next(iter(kwargs.values()))
            rows, sequences = _token_rows(hidden.detach(), _token_mask(current["features"], mask_key), name,
                                          current["layout"])
            found[name].append((rows.float().cpu(), None if sequences is None else sequences + current["first"]))
        return hook

    for name, module in modules.items():
        mask_key = "decoder_attention_mask" if id(module) in decoder else "attention_mask"
        handles.append(module.register_forward_pre_hook(recorder(name, mask_key), with_kwargs=True))
    device = device_of(model)
    try:
        with evaluating(model):
            for index, (args, kwargs) in enumerate(calls):
                kwargs = _to(kwargs, device)
                args = tuple(_to(a, device) for a in args)
                current["features"] = _features(args, kwargs)
                current["layout"] = _layout(current["features"], args)
                kwargs = _left_padding_positions(model, args, kwargs)
                try:
                    model(*args, **kwargs)
                except CompressionError:  # the recorder's own, which names the module
                    raise
                except Exception as error:  # the model refused the data: say which batch and why
                    raise CompressionError(_failed(model, index, args, kwargs, error)) from error
                current["first"] += current["layout"][0] if current["layout"] else 1  # the next call's sequences
    finally:
        for handle in handles:
            handle.remove()
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, pieces in found.items():
        if not pieces:
            continue
        rows = torch.cat([piece for piece, _ in pieces])
        known = all(sequences is not None for _, sequences in pieces)
        sequences = torch.cat([sequences for _, sequences in pieces]) if known else None
        if rows.shape[0] > max_tokens:
            keep = torch.randperm(rows.shape[0], generator=generator)[:max_tokens]
            rows, sequences = rows[keep], None if sequences is None else sequences[keep]
        inputs[name] = Captured(rows, sequences)
    return inputs


def _decoder_modules(model: nn.Module) -> set[int]:
    """The ids of an encoder-decoder model's decoder modules, whose tokens ``decoder_attention_mask`` marks (the
    encoder's are ``attention_mask``'s; a decoder without a mask runs every token): empty for other models."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return set()
    return {id(module) for module in model.get_decoder().modules()}


def _left_padding_positions(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``position_ids`` counted from each row's first real token where rows are left-padded and the
    forward takes positions it is not given (as `generate` and moelens' traces give them): a model with learned
    position embeddings (GPT-2, BERT) would otherwise put the real tokens at the padding's positions. Not for a
    model that counts them past the padding itself (`padding_position_id`: RoBERTa's start at its padding id + 1)."""
    mask = _mask(kwargs)
    if args or mask is None or "position_ids" in kwargs or not takes_keyword(model, "position_ids") or \
            not bool((~mask[:, 0] & mask.any(-1)).any()) or padding_position_id(model) is not None:
        return kwargs
    return {**kwargs, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


def _to(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``: a tensor, or a dict of model inputs (as a plain dict) with its tensors moved."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in value.items()}
    return value


def _positional(model: nn.Module, kwargs: dict) -> str | None:
    """The first required positional parameter of ``model.forward`` that ``kwargs`` does not give, or None."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return None
    return next((p.name for p in parameters if p.default is p.empty and p.name not in kwargs
                 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)


#: Config attributes that bound the sequence length of models with learned position embeddings.
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx")


def _failed(model: nn.Module, index: int, args: tuple, kwargs: dict, error: Exception) -> str:
    """Why calibration batch ``index`` failed, with a hint when the data explains it."""
    tensors = dict(kwargs)
    for i, arg in enumerate(args):  # a positional dict of model inputs shows its tensors
        tensors.update({f"arg {i} {k}": v for k, v in arg.items()} if isinstance(arg, Mapping) else {f"arg {i}": arg})
    shapes = ", ".join(f"{key} {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
                       for key, value in tensors.items() if isinstance(value, Tensor))
    main = (_features(args, kwargs) or {}).get("input_ids", args[0] if args else None)
    hint = ""
    wanted = _positional(model, kwargs) if kwargs and not args else None
    if wanted:
        hint = (f" {type(model).__name__}.forward wants the positional argument {wanted!r}, and a tensor or dict item "
                "is passed as keyword arguments (token ids as input_ids=...): give a call's positional arguments as a "
                "tuple item, e.g. calibration=[(features,)] for a model that takes the tokenizer's dict as one "
                "argument (a sentence-transformers model).")
    if isinstance(main, Tensor) and main.is_floating_point() and hasattr(model, "get_input_embeddings"):
        hint = (f" The calibration tensor is {str(main.dtype).removeprefix('torch.')}, but "
                f"{type(model).__name__} takes integer token ids: tokenize the text (or pass "
                "{'inputs_embeds': ...} to calibrate on embeddings).")
    if isinstance(main, Tensor) and not main.is_floating_point() and main.numel():
        hint += _vocabulary_hint(model, main) + _length_hint(model, main)
    return (f"the calibration forward of {type(model).__name__} failed on batch {index} ({shapes}): "
            f"{type(error).__name__}: {error}.{hint} calibration must be what the model is called with: token ids "
            "[batch, seq], a dict of its keyword inputs (a tokenizer's output), a tuple of its positional "
            "arguments, or a list of those.")


def _vocabulary_hint(model: nn.Module, ids: Tensor) -> str:
    """Says which token ids lie outside the model's vocabulary (`moelens.modules.vocab_size`), or ``""``."""
    vocabulary = vocab_size(model)
    low, high = int(ids.min()), int(ids.max())
    if vocabulary is None or (low >= 0 and high < vocabulary):
        return ""
    outside = int(((ids < 0) | (ids >= vocabulary)).sum())
    return (f" Token ids outside the model's vocabulary of {vocabulary}: {outside} of {ids.numel()} (ids from {low} to "
            f"{high}; the model takes 0 to {vocabulary - 1}): tokenize with this model's own tokenizer.")


def _length_hint(model: nn.Module, ids: Tensor) -> str:
    """Says that the sequences are longer than the model's learned position embeddings, or ``""`` (also for models
    without such a table, as rotary ones, whose ``max_position_embeddings`` is no hard limit)."""
    named = _position_limit(model)
    if ids.dim() < 2 or named is None or not _learned_positions(model) or ids.shape[1] <= named[1]:
        return ""
    attribute, limit = named
    return (f" Its sequences are {ids.shape[1]} tokens long, longer than the model's {limit} positions "
            f"(config.{attribute}): split them into sequences of at most {limit} tokens.")


def _position_limit(model: nn.Module) -> tuple[str, int] | None:
    """``(attribute, positions)``: the first of `POSITION_LIMITS` the model's (text) config sets, or None."""
    config = text_config(model) if hasattr(model, "config") else None
    return next(((name, value) for name in POSITION_LIMITS if isinstance(value := getattr(config, name, None), int)),
                None)


#: Names of learned position-embedding tables (BERT's position_embeddings, GPT-2's wpe, OPT's embed_positions).
POSITION_TABLES = ("position", "wpe")


def warn_past_positions(model: nn.Module, calls: list[tuple[tuple, dict]]) -> None:
    """Warn where calibration sequences run past the positions the model was trained on (``max_position_embeddings``
    of a rotary model, which still runs there: its activations past them are not the ones the conversion should
    fit; a learned position table fails instead, with `_length_hint`)."""
    named = _position_limit(model)
    if named is None or _learned_positions(model):
        return
    attribute, limit = named
    lengths = [ids.shape[1] if (mask := _mask(kwargs)) is None else int(mask.sum(-1).max())  # padding aside
               for args, kwargs in calls
               if isinstance(ids := kwargs.get("input_ids", args[0] if args else None), Tensor) and ids.dim() > 1]
    if lengths and max(lengths) > limit:
        warn(
            f"tomoe: calibration sequences of up to {max(lengths)} tokens run past the model's {limit} positions "
            f"(config.{attribute}): it was not trained there, so the layers would be fitted to activations "
            f"it does not have on text it takes; split the sequences into ones of at most {limit} tokens.",
        )


def _learned_positions(model: nn.Module) -> bool:
    """Whether the model's text holds a learned position-embedding table: an ``nn.Embedding`` named like one beside
    its input embeddings or a module sharing their weight (BERT's ``embeddings.position_embeddings``, GPT-2's
    ``wpe``, OPT's and BART's ``embed_positions``; a vision tower's table is not the text's), or anywhere in a model
    that names no input embeddings."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a sentence-transformers model, a module of the user's
        embeddings = None
    if embeddings is None:
        named = model.named_modules()
    else:  # BART's encoder and decoder hold embeddings sharing the weight of `shared`, the input embeddings
        weight = getattr(embeddings, "weight", None)
        named = [pair for module in model.modules()
                 if any(child is embeddings or weight is not None and getattr(child, "weight", None) is weight
                        for child in module.children())
                 for pair in module.named_children()]
    return any(isinstance(module, nn.Embedding) and any(part in name.rpartition(".")[2] for part in POSITION_TABLES)
               for name, module in named)


#: The forward hook dictionaries of an ``nn.Module`` (hook id -> function; the ``*_with_kwargs`` and
#: ``always_called`` flags are looked up by the ids these hold, so a suspended hook's flags can stay).
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def _library_hook(hook: Any) -> bool:
    """A hook transformers installed itself (its output capturing, which router-logit losses read)."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("transformers.")


def hooked_part(module: nn.Module) -> str | None:
    """The name (within ``module``, ``""`` for itself) of the first module that carries a hook of the
    user's (forward, pre-forward or backward; transformers' own aside), or None."""
    for name, part in module.named_modules():
        for hooks in (*HOOK_DICTS, "_backward_hooks", "_backward_pre_hooks"):
            if any(not _library_hook(hook) for hook in (getattr(part, hooks, None) or {}).values()):
                return name
    return None


@contextmanager
def without_hooks(*modules: nn.Module) -> Iterator[None]:
    """The forward hooks already on ``modules`` (and their submodules) do not run inside the block,
    except transformers' own; they are put back after, in their order, beside hooks added inside."""
    suspended: list[tuple[dict, dict]] = []
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        for name in HOOK_DICTS:
            hooks = getattr(module, name, None)
            users = {key: hook for key, hook in hooks.items() if not _library_hook(hook)} if hooks else {}
            for key in users:
                del hooks[key]  # in place: the user's handles keep pointing at this dict
            if users:
                suspended.append((hooks, users))
    try:
        yield
    finally:
        for hooks, users in suspended:
            merged = sorted({**users, **hooks}.items())  # hook ids grow with registration order
            hooks.clear()
            hooks.update(merged)
