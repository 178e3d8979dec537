"""Token strings for tables and plots: one printable string per token id."""

from __future__ import annotations

import unicodedata
from typing import Any, Iterable

from ..errors import MoelensError
from .checks import described

#: SentencePiece's mark of a piece that starts a word (it stands for the space before it).
WORD_MARKER = "\u2581"

#: What stands for characters that do not print well in a table cell or a plot label.
REPLACEMENTS = {"\n": "\\n", "\t": "\\t", "\r": "\\r", " ": "\u00b7"}


def display(piece: str) -> str:
    """A token's text made visible: spaces as middle dots, newlines and tabs escaped, other control characters
    as ``\\x..`` (they print as nothing, or move a terminal's cursor, and fonts have no glyph for them)."""
    return "".join(REPLACEMENTS.get(char, _escaped(char)) for char in piece) or "\u2205"


def _escaped(char: str) -> str:
    """``char``, or its escape when it is a control character (Unicode category Cc)."""
    return char.encode("unicode_escape").decode("ascii") if unicodedata.category(char) == "Cc" else char


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a ``tokenizer`` argument that cannot decode ids (a wrapped model instead of its tokenizer, say)."""
    if tokenizer is None or callable(getattr(tokenizer, "decode", None)):
        return
    remedy = ("pass its tokenizer: tokenizer=model.tokenizer" if getattr(tokenizer, "tokenizer", None) is not None
              else "pass the model's tokenizer (model.tokenizer), or None for ids shown as #<id>")
    raise MoelensError(f"tokenizer must be a tokenizer with a decode method, got {described(tokenizer)}; {remedy}.")


def token_strings(tokenizer: Any, ids: Iterable[int]) -> list[str]:
    """Each id decoded on its own and made printable (``#<id>`` without a tokenizer).

    A SentencePiece tokenizer (Llama, Mixtral) drops the leading space of what it decodes: decoded alone a word
    start (``▁the``) and a piece inside a word (``the``) would both read ``the``, so a piece that starts with its
    word marker gets its space back (``·the``).
    """
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
    strings = []
    for i in ids:
        text = tokenizer.decode([i])
        piece = pieces(i) if callable(pieces) else None
        if isinstance(piece, str) and piece.startswith(WORD_MARKER) and not text.startswith(" "):
            text = " " + text
        strings.append(display(text))
    return strings
