"""Token strings for tables and plots: one printable string per token id."""

from __future__ import annotations

import functools
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
              else "pass the model's tokenizer (model.tokenizer), or leave it out")
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
    strings = []
    for i in ids:
        text, piece = _decoded(tokenizer, i)
        if REPLACEMENT_CHARACTER in text:  # part of a character's UTF-8 bytes: show the bytes
            text = _partial_character(piece) or f"{text}#{i}"
        strings.append(display(text))
    return strings


def token_text(tokenizer: Any, token: int) -> str:
    """Token id ``token`` decoded on its own, with the leading space a SentencePiece word start (``▁the``) has in
    running text (``" the"``; decoded alone it would read ``"the"``, as the piece inside a word does). A token that
    holds part of a character's UTF-8 bytes decodes to ``"\ufffd"``."""
    return _decoded(tokenizer, int(token))[0]


def _decoded(tokenizer: Any, token: int) -> tuple[str, Any]:
    """`token_text` of ``token``, and its piece (``convert_ids_to_tokens``; None where the tokenizer has none)."""
    text = tokenizer.decode([token])
    pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = pieces(token) if callable(pieces) else None
    if isinstance(piece, str) and piece.startswith(WORD_MARKER) and not text.startswith(" "):
        text = " " + text
    return text, piece


#: What a tokenizer decodes part of a character's UTF-8 bytes to.
REPLACEMENT_CHARACTER = "\ufffd"


def _partial_character(piece: Any) -> str | None:
    """The text of a token holding part of a character's UTF-8 bytes, with those bytes escaped (``\\xe4\\xb8``; a
    whole character before them stays itself), or None where ``piece`` is no byte-level BPE piece (GPT-2's byte
    alphabet) or SentencePiece byte piece (``<0xE4>``)."""
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)]).decode("utf-8", errors="backslashreplace")
        except ValueError:
            return None
    alphabet = _byte_alphabet()
    if not piece or any(char not in alphabet for char in piece):
        return None
    return bytes(alphabet[char] for char in piece).decode("utf-8", errors="backslashreplace")


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """The byte each character of GPT-2's byte-level BPE alphabet stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
