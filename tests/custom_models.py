"""A plain torch model whose MoE blocks no built-in family describes: what a user registers a
`moelens.Family` for (`custom_family`)."""

from __future__ import annotations

import torch
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeForCausalLM

import moelens
from moelens import Family


class LinearRouter(torch.nn.Module):
    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.top_k = k

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top, index


class CustomBlock(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.chooser = LinearRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.pool = MixtralExperts(config)

    def forward(self, hidden):
        b, s, d = hidden.shape
        flat = hidden.reshape(-1, d)
        _, weights, index = self.chooser(flat)
        return self.pool(flat, index, weights).reshape(b, s, d)


class CustomModel(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, config.hidden_size)
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"ffn": CustomBlock(config)}) for _ in range(2)])
        self.config = config

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer["ffn"](hidden)
        return hidden


def custom_model() -> CustomModel:
    """A seeded `CustomModel` (2 layers of 4 experts, top-2, grouped_mm), its weights drawn (the experts' start empty)."""
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    model = CustomModel(config).eval()
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model


def custom_family(**fields) -> Family:
    """The family entry of `CustomModel`'s blocks (``fields`` replace its defaults)."""
    return Family("custom", ("custom",), ("CustomBlock",), **({
        "block_attr": "ffn", "router": "chooser", "experts": "pool", "logits_op": "torch_nn_functional_linear_0",
        "scoring": moelens.Scoring("softmax", "score_topk"),
    } | fields))


class BiasedRouter(torch.nn.Module):
    """Ranks sigmoid scores plus a selection bias in a method of its own, its instance named ``s``, not ``self``."""

    def __init__(s, hidden: int, experts: int, k: int) -> None:  # noqa: N805 - the point of the model
        super().__init__()
        s.gate = torch.nn.Linear(hidden, experts, bias=False)
        s.register_buffer("bias", torch.linspace(-0.5, 1.0, experts))
        s.top_k = k

    def forward(s, x):  # noqa: N805
        return s.route(s.gate(x))

    def route(s, logits):  # noqa: N805
        scores = logits.sigmoid()
        ranked = scores + s.bias
        index = torch.topk(ranked, s.top_k, dim=-1).indices
        weights = scores.gather(-1, index)
        return weights / weights.sum(-1, keepdim=True), index


class BiasedBlock(CustomBlock):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.chooser = BiasedRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)

    def forward(self, hidden):
        b, s, d = hidden.shape
        flat = hidden.reshape(-1, d)
        weights, index = self.chooser(flat)
        return self.pool(flat, index, weights).reshape(b, s, d)


class UsersQwen2Moe(Qwen2MoeForCausalLM):
    """A subclass of a transformers model in a file of the user's own (transformers' set_experts_implementation
    switches a class only when its file contains the decorator's name, which this one does not)."""

    _can_set_experts_implementation_cached_value = None  # look at this file, as in a fresh process
