"""Routing analysis: cache a corpus' routing, then measure and plot it.

Collect once, analyse many times::

    import moelens
    from moelens import analysis

    model = moelens.load()                                   # moelens-tiny
    cache = analysis.collect_routing(model, texts, logits=True)
    usage = analysis.expert_usage(cache)                     # Usage: .counts [L, E], .fraction, ...
    analysis.plots.plot_usage(usage)

Every function works for every family moelens serves, returns a small dataclass of
tensors (lists of records for ``expert_paths`` and ``top_tokens``), and streams over the
cache's shards (bounded memory). See ``docs/analysis.md``.
"""

from . import plots
from .agreement import Agreement, routing_agreement
from .cache import RoutingCache, Shard
from .coactivation import Coactivation, Transitions, coactivation, expert_paths, token_paths, transitions
from .collect import collect_routing
from .describe import LayerReport, ModelReport, describe
from .generation import GeneratedRouting, collect_generation
from .entropy import Entropy, routing_entropy, token_entropy
from .logit_lens import ExpertLens, expert_logit_lens, readout
from .losses import token_losses
from .specialisation import Specialisation, specialisation
from .token_view import TokenRouting, token_routing
from .top_tokens import ExpertTokens, top_tokens
from .usage import LoadBalance, Usage, expert_usage, load_balance

__all__ = [
    "Agreement", "Coactivation", "Entropy", "ExpertLens", "ExpertTokens", "GeneratedRouting", "LayerReport", "LoadBalance", "ModelReport",
    "RoutingCache", "Shard", "Specialisation", "TokenRouting", "Transitions", "Usage", "coactivation",
    "collect_generation", "collect_routing", "describe", "expert_logit_lens", "expert_paths", "expert_usage", "load_balance",
    "plots", "readout", "routing_agreement", "routing_entropy", "specialisation", "token_entropy", "token_losses", "token_paths", "token_routing",
    "top_tokens", "transitions",
]
