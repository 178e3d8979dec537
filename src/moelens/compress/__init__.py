"""Dense -> MoE conversion (``tomoe``) whose output moelens recognises as MoE blocks.

``moelens.compress.tomoe(model, num_experts=8, top_k=4, calibration=ids)`` turns a
trained model's FFN blocks (SwiGLU, BERT, GPT-2) into `ToMoEBlock` modules: a linear
router, decorated experts (``experts(hidden, top_k_index, top_k_weights)``) and a
shared expert, so ``moelens.wrap`` serves their routing, ``moelens.export`` exports
them and expert parallelism shards them. Single Linear / Conv1D layers become
`ToMoELinear` (``target_attention_only``, ``target_modules``). See ``docs/compress.md``
for the method and the measured quality. (Not the TMLR 2026 "ToMoE" method: the name is
moelens' API.)
"""

from __future__ import annotations

from .blocks import ToMoEBlock, ToMoEIntermediateBlock, ToMoESharedExpert
from .compressor import ToMoECompressor, inject_tomoe, set_experts_implementation, tomoe
from .errors import CompressionError, NothingToConvert
from .experts import ExpertsSettings, ToMoEExperts, ToMoEGatedExperts
from .exportable import exportable
from .linear import ToMoELinear
from .lora import merge_lora
from .options import ToMoEOptions
from .registry import compressors, get_compressor, register_compressor
from .router import ToMoERouter
from .stats import CompressionStats, LayerStats, SkippedLayer

register_compressor(ToMoECompressor, "tomoe", "tomoe_compressor", "tomoe_factory", "tomoe_compressor_factory")

__all__ = [
    "CompressionError", "CompressionStats", "ExpertsSettings", "LayerStats", "NothingToConvert", "SkippedLayer",
    "ToMoEBlock", "ToMoECompressor", "ToMoEExperts", "ToMoEGatedExperts", "ToMoEIntermediateBlock", "ToMoELinear",
    "ToMoEOptions", "ToMoERouter", "ToMoESharedExpert", "compressors", "exportable", "get_compressor",
    "inject_tomoe", "merge_lora", "register_compressor", "set_experts_implementation", "tomoe",
]
