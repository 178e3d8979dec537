"""Turning a corpus into padded batches of token windows, lazily.

A corpus is any iterable of texts (strings, tokenized with the model's
tokenizer), of token-id sequences (lists or 1-D tensors), one text (a string,
a 1-D tensor or a flat list of token ids), a 2-D ``[N, S]``
tensor of token ids (every row a full window, e.g. the held-out windows of
moelens-tiny), or a tokenizer's output (``input_ids`` with an ``attention_mask``:
each row's real tokens, its padding dropped). Each item is cut into windows of
at most ``max_length`` tokens; windows are grouped ``batch_size`` at a time and
right-padded, so the real tokens of a row sit at positions ``0..n-1`` exactly as
in an unpadded run and a causal model's real tokens never see the padding.
Nothing is read ahead beyond the batch being built: a corpus streamed from disk
stays streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..errors import MoelensError
from ..modules import config_of, text_config, vocab_size
from ..wrapping.inputs import MODALITY_INPUTS, _modality_inputs
from .checks import check_count

#: Longest window used when neither the caller nor the model's config says.
DEFAULT_MAX_LENGTH = 512


@dataclass
class Batch:
    """One right-padded batch of windows.

    Attributes:
        input_ids: Token ids ``[b, s]`` (padding filled with the pad id).
        attention_mask: ``[b, s]`` 1 on real tokens, 0 on padding.
        text_index: ``[b]`` which corpus item each row comes from.
        offset: ``[b]`` the position in its corpus item of each row's first token.
    """

    input_ids: Int[Tensor, "b s"]
    attention_mask: Int[Tensor, "b s"]
    text_index: Int[Tensor, " b"]
    offset: Int[Tensor, " b"]

    @property
    def mask(self) -> Bool[Tensor, "b s"]:
        """The real tokens, as a bool mask."""
        return self.attention_mask.bool()

    @property
    def num_tokens(self) -> int:
        """How many real (non-padding) tokens the batch holds."""
        return int(self.attention_mask.sum())

    def kwargs(self) -> dict[str, Tensor]:
        """The model inputs: ``input_ids`` and ``attention_mask``."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def tokenizer_of(model: Any) -> Any:
    """The tokenizer a wrapped model carries, or None (a model wrapped without one)."""
    return getattr(model, "tokenizer", None)


def pad_id(model: Any) -> int:
    """The id used to pad: the tokenizer's pad (or eos) token, else the config's, else 0.

    Only an id the model embeds (inside its vocabulary) will do: a pad token added to a tokenizer
    after training can lie past it. Padding is masked, so which real id pads does not matter.
    """
    tokenizer, vocab = tokenizer_of(model), vocab_size(model)
    for owner, names in ((tokenizer, ("pad_token_id", "eos_token_id")), (config_of(model), ("pad_token_id",))):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value and (vocab is None or value < vocab):
                return value
    return 0


def context_length(model: Any) -> int | None:
    """The (text) config's ``max_position_embeddings``: the positions the model has, None where it says none."""
    limit = getattr(text_config(model), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def default_max_length(model: Any) -> int:
    """The window length: the model's `context_length` capped at `DEFAULT_MAX_LENGTH`."""
    limit = context_length(model)
    return min(limit, DEFAULT_MAX_LENGTH) if limit is not None else DEFAULT_MAX_LENGTH


def window_length(model: Any, max_length: Any) -> int:
    """The window length asked for (`default_max_length` when None), refused when it is no count or longer than the
    model's context (``max_position_embeddings``: positions past it have no embedding or were never trained on)."""
    if max_length is None:
        return default_max_length(model)
    max_length = check_count("max_length", max_length)
    limit = context_length(model)
    if limit is not None and limit < max_length:
        raise MoelensError(
            f"max_length={max_length} is longer than the model's context (max_position_embeddings={limit}): its "
            f"windows would run positions the model has no embedding for or was never trained on; use a max_length "
            f"of at most {limit} (longer texts are cut into windows of that length)."
        )
    return max_length


def refuse_bytes(value: Any, what: str) -> None:
    """Refuse bytes where text or token ids are expected (their values are not token ids)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise MoelensError(
            f"{what} is {type(value).__name__}, not text or token ids; decode it to a string first "
            "(e.g. data.decode('utf-8')), or pass token ids from the model's tokenizer."
        )


def encode(item: Any, tokenizer: Any, what: str) -> list[int]:
    """One corpus item as a list of token ids (text is tokenized without special tokens: no BOS)."""
    refuse_bytes(item, what)
    if isinstance(item, str):
        if tokenizer is None:
            raise MoelensError(
                f"{what} is text but the model has no tokenizer; wrap it with "
                "moelens.wrap(model, tokenizer=...) or pass token ids (lists or 1-D tensors)."
            )
        return list(tokenizer(item, add_special_tokens=False, verbose=False)["input_ids"])
    if isinstance(item, np.ndarray):
        if not _numeric(item):  # texts (pandas' .to_numpy() of a text column): torch takes numbers only
            return encode(item.tolist(), tokenizer, what)
        item = torch.from_numpy(item)
    if isinstance(item, Tensor):
        if item.dim() == 1 and not item.numel():  # np.array([]) and torch.tensor([]) are float: no ids to check
            return []
        if item.dim() != 1 or item.is_floating_point() or item.is_complex() or item.dtype == torch.bool:
            one_row = item.dim() == 2 and item.shape[0] == 1  # a tokenizer's return_tensors="pt" ids of one text
            raise MoelensError(f"{what} must be a 1-D tensor of integer token ids, got {item.dtype} of shape "
                               f"{tuple(item.shape)}" + ("; take its one row, ids[0] (or ids.squeeze(0))." if one_row
                                                         else "."))
        return item.tolist()
    if isinstance(item, Sequence) and all(isinstance(token, Integral) and not isinstance(token, bool) for token in item):
        return [int(token) for token in item]  # numpy integers too
    if isinstance(item, Sequence):
        position, token = next((position, token) for position, token in enumerate(item)
                               if not isinstance(token, Integral) or isinstance(token, bool))
        raise MoelensError(f"{what} must be a string or a sequence of token ids (ints, not bools), got a "
                           f"{type(item).__name__} whose element {position} is {token!r} ({type(token).__name__}).")
    if _token_id(item):  # an iterator of ids (a list of them is one text, `items`): each would be a text of its own
        raise MoelensError(f"{what} is the token id {item!r} ({type(item).__name__}), not a text: a corpus is a sequence "
                           "of texts, each a string or a sequence of token ids; pass the ids of one text as a list or "
                           "a 1-D tensor (e.g. [5, 6, 7] or torch.tensor([5, 6, 7])), or a list of such texts "
                           "([[5, 6, 7], [8, 9]]).")
    raise MoelensError(f"{what} must be a string or a sequence of token ids (ints, not bools), got {type(item).__name__}"
                       f"{tokenizer_output_hint(item)}.")


def tokenizer_output_hint(item: Any) -> str:
    """For a tokenizer's output given where one text belongs (``apply_chat_template`` returns a ``BatchEncoding``
    in transformers 5), how to pass its ids; else ""."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        return ""
    modality = _modality_inputs(item)
    if modality:  # a processor's output: its ids alone would route the image or audio placeholders as text
        return (f", a processor's output with inputs of other modalities ({', '.join(modality)}), which routing "
                "analysis does not pass to the model: its placeholder tokens would be routed as text. Read the routing "
                "of a processor batch in a trace (with model.trace(**inputs): model.save_all())")
    return (", a tokenizer's output (apply_chat_template returns one): pass its token ids, output['input_ids'] "
            "(output['input_ids'][0] where it holds one row as a tensor)")


def tokenized(encoding: Mapping) -> Iterator[Tensor]:
    """A tokenizer's output (``input_ids``, optional ``attention_mask``; lists, torch tensors or numpy
    arrays) as each row's real tokens.

    An empty text is an empty row (``tokenizer("")`` is one empty row, as ``tokenizer([""])`` is: a
    tokenizer refuses an empty batch)."""
    if "input_ids" not in encoding:
        raise MoelensError(
            f"a corpus given as a mapping must be a tokenizer's output with input_ids (and attention_mask); "
            f"got the keys {list(encoding)}."
        )
    modality = [key for key in encoding if any(part in str(key) for part in MODALITY_INPUTS)]
    if modality:  # a processor's output: its images would be left out, their placeholder tokens routed as text
        raise MoelensError(
            f"the corpus holds inputs of other modalities ({', '.join(map(str, modality))}), which routing analysis "
            "does not pass to the model: it routes token ids only, so the image or audio placeholder tokens would be "
            "routed as text. Pass text (or its token ids), or read the routing of one processor batch in a trace "
            "(with model.trace(**inputs): model.save_all())."
        )
    rows = encoding["input_ids"]
    masks = encoding.get("attention_mask")
    rows, masks = (torch.from_numpy(value) if isinstance(value, np.ndarray) else value for value in (rows, masks))
    one_row = rows.dim() == 1 if isinstance(rows, Tensor) else not rows or _token_id(rows[0])
    if one_row:
        rows, masks = [rows], None if masks is None else [masks]
    if masks is not None and len(masks) != len(rows):
        raise MoelensError(f"the corpus' attention_mask has {len(masks)} rows but its input_ids {len(rows)}; give "
                           "one mask row per row of ids (a tokenizer's output as it comes).")
    for index, row in enumerate(rows):
        try:
            row = torch.as_tensor(row)
        except (TypeError, ValueError, RuntimeError) as error:  # texts, ragged rows, objects
            raise MoelensError(f"the corpus' input_ids row {index} ({_shown(row)}) is no row of token ids ({error}); "
                               "give a tokenizer's output: lists, tensors or numpy arrays of ints.") from None
        if row.numel() == 0:  # torch.as_tensor([]) is float32: an empty row holds no token ids to check
            row = row.long()
        if masks is None:
            yield row
            continue
        mask = torch.as_tensor(masks[index]).bool()
        if mask.shape != row.shape:
            raise MoelensError(f"the corpus' attention_mask row {index} has shape {tuple(mask.shape)} but its input_ids "
                               f"row {tuple(row.shape)}; give one mask entry per token id.")
        kept = torch.nonzero(mask).flatten()
        if kept.numel() and int(kept[-1] - kept[0]) + 1 != kept.numel():  # a hole: the rest would be routed as adjacent
            raise MoelensError(
                f"the corpus' attention_mask row {index} masks tokens between real ones (positions "
                f"{torch.nonzero(~mask[int(kept[0]):int(kept[-1])]).flatten().add(int(kept[0])).tolist()[:8]}): each "
                "item is routed as one run of tokens, so the tokens around a hole would be routed as neighbours. Mask "
                "only padding at the start or the end of a row, or pass the pieces as items of their own."
            )
        yield row[mask]


def _token_id(value: Any) -> bool:
    """Whether ``value`` is one token id (a Python or numpy int, not a bool): then a list of them is one row."""
    return isinstance(value, Integral) and not isinstance(value, (bool, np.bool_))


def _shown(value: Any) -> str:
    """``value`` as an error shows it, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _numeric(array: np.ndarray) -> bool:
    """Whether a numpy array holds numbers (torch takes those), not texts or other objects (dtype str, bytes, object:
    pandas' ``.to_numpy()`` of a text column)."""
    return array.dtype.kind not in "OUSV"


def _one_text_of_ids(corpus: Any) -> bool:
    """Whether ``corpus`` is a flat sequence of token ids (a list or tuple whose first element is a Python or numpy
    int, not a bool): one text, as a 1-D tensor is (`encode` then checks every element is a token id). No other
    corpus holds a token id as an item, so it can be read no other way."""
    return isinstance(corpus, Sequence) and not isinstance(corpus, str) and len(corpus) > 0 and _token_id(corpus[0])


def item_count(corpus: Any) -> int | None:
    """How many items `items` yields from ``corpus``, where that is plain without reading it: a list or tuple of texts
    or id rows, a 2-D tensor, another sized collection (``dataset["text"]``); None for one text, a tokenizer's output
    or a numpy array (read row by row as `items` reads them), and for an iterator or a stream."""
    if isinstance(corpus, Tensor):
        return len(corpus) if corpus.dim() == 2 else None
    if isinstance(corpus, (str, bytes, Mapping, np.ndarray)) or _one_text_of_ids(corpus):
        return None
    try:
        return len(corpus) if hasattr(corpus, "__len__") else None
    except TypeError:  # a __len__ that refuses: read as a stream
        return None


def items(corpus: Any, what: str = "the corpus") -> Iterator[Any]:
    """The corpus as an iterator of items (a 2-D tensor or numpy array yields its rows; a numpy array of texts, its
    texts; a string, a 1-D tensor or a flat sequence of token ids is one item). ``what``: its name in errors."""
    refuse_bytes(corpus, what)
    if isinstance(corpus, np.ndarray):
        corpus = torch.from_numpy(corpus) if _numeric(corpus) else corpus.tolist()
    if isinstance(corpus, str) or _one_text_of_ids(corpus):
        yield corpus
    elif isinstance(corpus, Tensor):
        if corpus.dim() == 1:
            yield corpus
        elif corpus.dim() == 2:
            yield from corpus
        else:
            raise MoelensError(f"{what} as a tensor of token ids must be 1-D or 2-D, got shape {tuple(corpus.shape)}.")
    elif isinstance(corpus, Mapping):
        yield from tokenized(corpus)
    elif isinstance(corpus, Iterable):
        yield from corpus
    else:
        raise MoelensError(f"{what} must be texts, token-id sequences or a token-id tensor, got {type(corpus).__name__}.")


@dataclass
class Tally:
    """How many corpus items a pass over the corpus has read, empty ones included."""

    items: int = 0


def windows(corpus: Any, tokenizer: Any, max_length: int, tally: Tally | None = None) -> Iterator[tuple[int, int, list[int]]]:
    """``(text index, offset, ids)`` windows of at most ``max_length`` tokens, in corpus order (counted in ``tally``).

    A bad ``max_length`` is refused here, before anything is read."""
    return _windows(corpus, tokenizer, check_count("max_length", max_length), tally)


def _windows(corpus: Any, tokenizer: Any, max_length: int, tally: Tally | None) -> Iterator[tuple[int, int, list[int]]]:
    for index, item in enumerate(items(corpus)):
        if tally is not None:
            tally.items = index + 1
        ids = encode(item, tokenizer, f"corpus item {index}")
        for start in range(0, len(ids), max_length):
            yield index, start, ids[start : start + max_length]


def batches(
    corpus: Any, tokenizer: Any, *, batch_size: int, max_length: int, pad: int, dtype: torch.dtype = torch.long,
    tally: Tally | None = None, vocab: int | None = None,
) -> Iterator[Batch]:
    """Right-padded batches of ``batch_size`` windows (empty items are skipped, but counted in ``tally``).

    ``vocab``: the model's vocabulary size; a token id outside ``[0, vocab)`` is refused, naming its item.
    A bad ``batch_size`` or ``max_length`` is refused here, before anything is read.
    """
    batch_size = check_count("batch_size", batch_size)
    return _batches(windows(corpus, tokenizer, max_length, tally), batch_size, pad, dtype, vocab)


def _batches(stream: Iterator[tuple[int, int, list[int]]], batch_size: int, pad: int, dtype: torch.dtype,
             vocab: int | None) -> Iterator[Batch]:
    pending: list[tuple[int, int, list[int]]] = []
    for window in stream:
        if vocab is not None and window[2] and not 0 <= min(window[2]) <= max(window[2]) < vocab:
            bad = next(token for token in window[2] if not 0 <= token < vocab)
            raise MoelensError(
                f"corpus item {window[0]} holds token id {bad}, outside the model's vocabulary [0, {vocab}); "
                "pass ids from the model's own tokenizer (a token added to it after training, such as a new special "
                "token, needs rows of its own: model._module.resize_token_embeddings(len(model.tokenizer)))."
            )
        pending.append(window)
        if len(pending) == batch_size:
            yield _pad(pending, pad, dtype)
            pending = []
    if pending:
        yield _pad(pending, pad, dtype)


def _pad(rows: list[tuple[int, int, list[int]]], pad: int, dtype: torch.dtype) -> Batch:
    width = max(len(ids) for _, _, ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=dtype)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (_, _, ids) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=dtype)
        attention_mask[row, : len(ids)] = 1
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        text_index=torch.tensor([index for index, _, _ in rows], dtype=torch.long),
        offset=torch.tensor([start for _, start, _ in rows], dtype=torch.long),
    )
