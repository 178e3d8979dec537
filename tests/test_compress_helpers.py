"""Tiny dense models for the compressor tests (a helper module: it holds no test). Seeded, built from configs, nothing downloaded."""

from __future__ import annotations

import warnings

import torch
from transformers import (BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM)

from moelens.compress import ToMoEGatedExperts, tomoe

VOCAB = 128


def _quiet(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build().eval()


def llama(kv_heads: int = 2, **overrides) -> LlamaForCausalLM:
    """SwiGLU FFNs (gate/up/down), GQA attention (4 query heads, ``kv_heads`` key/value heads)."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=64, pad_token_id=0)
    config.update(overrides)
    return _quiet(lambda: LlamaForCausalLM(LlamaConfig(**config)))


def bert(classifier: bool = False) -> BertModel:
    """BERT FFNs (intermediate.dense / output.dense, erf GELU)."""
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, num_labels=3)
    return _quiet(lambda: (BertForSequenceClassification if classifier else BertModel)(config))


def gpt2() -> GPT2LMHeadModel:
    """GPT-2 FFNs (Conv1D c_fc / c_proj, tanh GELU), fused c_attn, tied lm_head."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                        eos_token_id=2)
    return _quiet(lambda: GPT2LMHeadModel(config))


MODELS = {"llama": llama, "bert": bert, "gpt2": gpt2}


def ids(batch: int = 8, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hidden(output) -> torch.Tensor:
    """Logits or last hidden state of a transformers output."""
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@torch.no_grad()
def run(model, input_ids: torch.Tensor) -> torch.Tensor:
    return hidden(model(input_ids=input_ids))


def convert(model, **settings):
    """``tomoe`` keeping every layer (no error gate), without a progress bar; returns ``(converted, stats)``."""
    settings.setdefault("max_error", None)
    settings.setdefault("progress", False)
    return tomoe(model, return_stats=True, **settings)


def inputs_of(model, module, input_ids: torch.Tensor) -> torch.Tensor:
    """The tokens ``[T, D]`` that ``module`` receives when ``model`` runs on ``input_ids`` (a plain forward pre-hook)."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        run(model, input_ids)
    finally:
        handle.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])


def pre_activation_by_hand(experts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s up projection (gate and up, where gated) on one (padded) token ``x``, from its weights."""
    if isinstance(experts, ToMoEGatedExperts):
        return experts.gate_up_proj[expert] @ x + experts.gate_up_proj_bias[expert]
    return experts.up_proj[expert] @ x + experts.up_proj_bias[expert]


def activation_by_hand(experts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s hidden activations on one (padded) token ``x``, recomputed from its weights."""
    pre = pre_activation_by_hand(experts, expert, x)
    if isinstance(experts, ToMoEGatedExperts):
        size = experts.gate_up_proj.shape[1] // 2
        return experts.act_fn(pre[:size]) * pre[size:]
    return experts.act_fn(pre)


def randomised(model, suffix: str, scale: float, seed: int):
    """``model`` with every parameter whose name ends in ``suffix`` drawn (seeded) from N(0, scale^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(suffix):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return model
