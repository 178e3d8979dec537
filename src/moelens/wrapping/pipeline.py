"""nnsight's transformers pipeline, through which a model wrapped with a tokenizer has its text tokenized.

The device map it reads while it is built, its task complaint silenced, the task `wrap` gives a model that cannot
generate, and the keywords its pipelines and the tokenizer take (read by `moelens.model`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Iterator

import torch


#: accelerate device-map entries that name no torch device to run on.
NO_TORCH_DEVICE = ("disk", "meta")


@contextlib.contextmanager
def _real_device_first(model: torch.nn.Module) -> Iterator[None]:
    """While nnsight builds its transformers pipeline: the model's accelerate ``hf_device_map`` listing a real device
    first (the pipeline takes its first entry for a torch device, and ``"disk"`` is none; a model all on disk gets the
    CPU, where accelerate runs it); the map is restored after (an attribute set to None stays None; one that was
    not there is taken off again).
    A model with no map gets one meanwhile that names where its first weight is: the pipeline moves a model without
    a map to the first accelerator it finds (a CPU model onto ``cuda:0`` on a machine with a GPU), and a weight on
    meta (every weight, built under ``init_empty_weights``; or behind accelerate's offload hooks, ``cpu_offload``,
    which sets no map) cannot be moved at all ("Cannot copy out of meta tensor"): those get the CPU."""
    had_map = "hf_device_map" in model.__dict__
    device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        first = next(model.parameters(), None)
        meanwhile = None if first is None else {"": "cpu" if first.is_meta else str(first.device)}
    elif isinstance(device_map, dict) and next(iter(device_map.values()), None) in NO_TORCH_DEVICE:
        meanwhile = dict(sorted(device_map.items(), key=lambda item: item[1] in NO_TORCH_DEVICE))
        if all(device in NO_TORCH_DEVICE for device in meanwhile.values()):  # all on disk: accelerate runs it on CPU
            meanwhile = {"": "cpu"}
    else:
        meanwhile = None
    if meanwhile is None:
        yield
        return
    model.hf_device_map = meanwhile
    try:
        yield
    finally:
        if had_map:
            model.hf_device_map = device_map
        else:
            del model.hf_device_map


class _PipelineTaskComplaint(logging.Filter):
    """Drops transformers' "The model 'X' is not supported for text-generation" error record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is not supported for" not in record.getMessage()


@contextlib.contextmanager
def _no_pipeline_task_complaint() -> Iterator[None]:
    """While nnsight builds its transformers pipeline: transformers logs an error, with ~250 class names, for a model
    that generates but is no causal LM (a vision-language model), though tracing needs no pipeline task of it."""
    logger, complaint = logging.getLogger("transformers.pipelines.base"), _PipelineTaskComplaint()
    logger.addFilter(complaint)
    try:
        yield
    finally:
        logger.removeFilter(complaint)


#: What transformers' pipeline, through which nnsight tokenizes a wrapped model's text, reads of the model (the config
#: only where the model can generate): a plain torch module without them failed deep inside it.
PIPELINE_ATTRIBUTES = ("config", "device", "can_generate")


#: The pipeline task `wrap` gives nnsight for a model that cannot generate: the tokenizing alone.
FEATURE_TASK = "feature-extraction"


#: The keywords `FEATURE_TASK`'s pipeline takes itself (`MoeTransformersModel._forward_keywords`).
FEATURE_SETTINGS = ("truncation", "tokenize_kwargs", "return_tensors")


#: The tokenizer settings transformers' text-generation pipeline hands the tokenizer (the rest go to the forward).
GENERATION_SETTINGS = ("add_special_tokens", "padding", "truncation", "max_length")


#: The inputs a tokenizer makes of a text (given beside it, one would replace its own), and the second texts it
#: pairs with it (a pipeline tokenizing one prompt at a time takes none).
TOKENIZED = ("input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "text_pair", "text_target",
             "text_pair_target")


#: Settings a tokenizer's call takes through ``**kwargs``, which no signature names (transformers documents them
#: among its settings): ``split_special_tokens``, whether a special token's string in the text (``<|endoftext|>``) is
#: split as text or taken as the token.
HIDDEN_SETTINGS = ("split_special_tokens",)


@functools.cache
def tokenizer_settings(tokenizer_class: type) -> frozenset[str]:
    """The settings a tokenizer class's call takes by name (``max_length``, ``padding`` ...), and those of
    transformers' tokenizers (a call of ``(*args, **kwargs)`` names none), not the texts (`TOKENIZED`)."""
    from transformers import PreTrainedTokenizerBase

    names = {name for call in (tokenizer_class.__call__, PreTrainedTokenizerBase.__call__)
             for name, parameter in inspect.signature(call).parameters.items()
             if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)}
    return frozenset(names.union(HIDDEN_SETTINGS) - {"self", "text", *TOKENIZED})
