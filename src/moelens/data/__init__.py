"""Models shipped inside moelens.

``moelens-tiny`` is a small trained Mixture-of-Experts language model
(``Qwen2MoeForCausalLM``: 4 layers, 8 routed experts, top-2, a sigmoid-gated
shared expert) and ``tiny-dense`` a dense model of similar active size
(``Qwen2ForCausalLM``) trained on the same tokens.  Both were trained by
``scripts/train_tiny.py`` on the Python standard library sources and its
documentation; see ``docs/default-model.md``.  They load offline::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from moelens.data import TINY_MODEL_PATH

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)

``TINY_MODEL_PATH / "heldout.safetensors"`` holds the held-out evaluation windows
(``input_ids`` int16 ``[256, 256]``, ``token_class`` uint8: 0 code, 1 prose,
2 digits/punctuation, 3 whitespace, 255 special).

This module imports nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATA_DIR", "TINY_MODEL_PATH", "TINY_NAMES", "TINY_DENSE_PATH", "HELDOUT_PATH", "TOKEN_CLASSES",
           "training_record"]

DATA_DIR: Path = Path(__file__).resolve().parent
TINY_MODEL_PATH: Path = DATA_DIR / "moelens-tiny"
TINY_DENSE_PATH: Path = DATA_DIR / "tiny-dense"
HELDOUT_PATH: Path = TINY_MODEL_PATH / "heldout.safetensors"
TOKEN_CLASSES: tuple[str, ...] = ("code", "prose", "digits_punct", "whitespace")
#: The names ``moelens.load`` and the commands take for moelens-tiny (a local folder of that name wins).
TINY_NAMES: tuple[str, ...] = ("tiny", "moelens-tiny")

_NAMES = {"moelens-tiny": TINY_MODEL_PATH, "tiny-dense": TINY_DENSE_PATH}


def training_record(name: str = "moelens-tiny") -> dict:
    """The ``training.json`` of a shipped model: hyper-parameters, corpus, timings and measured numbers.

    ``name`` is ``"moelens-tiny"`` (also ``"moe"``/``"tiny"``) or ``"tiny-dense"`` (also ``"dense"``),
    or a path to a folder holding a ``training.json``.
    """
    aliases = {"moe": "moelens-tiny", "tiny": "moelens-tiny", "dense": "tiny-dense"}
    key = aliases.get(str(name), str(name))
    folder = _NAMES.get(key)
    if folder is None:
        folder = Path(name) if isinstance(name, (str, Path)) else None
        if folder is None or not (folder / "training.json").is_file():
            from ..errors import MoelensError

            raise MoelensError(f"training_record takes a shipped model's name, one of {sorted(_NAMES)}, or a folder "
                               f"holding a training.json; got {name!r}.")
    with open(folder / "training.json", encoding="utf-8") as f:
        return json.load(f)
