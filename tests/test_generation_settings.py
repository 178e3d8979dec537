"""Generation settings moelens passes on to transformers' ``generate``.

Ground truth: the plain transformers model (an unwrapped copy) generating with the same settings, its
experts' inputs recorded by a torch forward hook; and the keyword arguments transformers' ``generate``
itself receives (a spy on the model's ``generate``).
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

import moelens
from groundtruth import ascii_tokenizer
from moelens.testing import tiny_model

PROMPT = torch.tensor([[110, 57, 95, 45, 28]])  # a prompt whose 3-beam continuation is not the greedy one


def test_a_given_generation_config_overrides_the_models_own_beam_count():
    """The given config's num_beams=3 wins over the model's own num_beams=1 (read the other way round,
    generation would run greedy, one row per prompt, ignoring the user's beams)."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    hf.generation_config.num_beams = 1  # as many checkpoints' generation_config.json set it
    reference = copy.deepcopy(hf)
    given = GenerationConfig(num_beams=3, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    greedy = GenerationConfig(num_beams=1, do_sample=False, max_new_tokens=4, min_new_tokens=4)

    seen = []
    experts = reference.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda module, args, output: seen.append(args[1].clone()))
    try:
        with torch.no_grad():
            expected = reference.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), generation_config=given)
    finally:
        hook.remove()
    first_step = seen[0].view(3, PROMPT.shape[1], -1)  # the plain model ran three beams of the prompt
    with torch.no_grad():
        assert not torch.equal(expected, reference.generate(PROMPT, attention_mask=torch.ones_like(PROMPT),
                                                            generation_config=greedy))

    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    with torch.no_grad(), wrapped.generate(PROMPT, generation_config=given) as tracer:
        indices = wrapped.moes[0].expert_indices.save()
        result = tracer.result.save()
    assert torch.equal(indices, first_step)
    assert torch.equal(result.cpu(), expected)  # generate returns the sequences where the prompt is (the CPU)
    assert given.num_beams == 3 and given.disable_compile is not True  # the user's config is left as it was


def test_a_trace_after_a_beam_generation_serves_its_own_rows():
    """After generate(num_beams=2) the next plain trace must read one row per prompt again (two rows per prompt
    made an odd token count raise, and an even one a [2, s / 2] view of the wrong tokens)."""
    hf = tiny_model("mixtral")
    seen = []
    hook = hf.model.layers[0].mlp.experts.register_forward_hook(lambda module, args, output: seen.append(args[1]))
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    with torch.no_grad(), wrapped.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, num_beams=2):
        pass
    seen.clear()
    with torch.no_grad(), wrapped.trace(PROMPT):
        indices = wrapped.moes[0].expert_indices.save()
    hook.remove()
    assert torch.equal(indices, seen[0].view(1, PROMPT.shape[1], -1))


def spied(hf):
    """Record the keyword arguments of every call of ``hf.generate`` (then run it)."""
    calls = []
    original = hf.generate

    def generate(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    hf.generate = generate
    return calls


def compile_disabled(kwargs) -> bool | None:
    """disable_compile as transformers' generate gets it: the keyword, else the generation_config's."""
    if "disable_compile" in kwargs:
        return kwargs["disable_compile"]
    return getattr(kwargs.get("generation_config"), "disable_compile", None)


def test_generate_tells_transformers_not_to_compile_the_forward():
    """Without disable_compile=True transformers torch.compiles the forward for a static cache on a GPU, and
    the trace would fail inside dynamo on nnsight's rewritten experts forward."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    calls = spied(hf)
    with torch.no_grad(), wrapped.generate(PROMPT, max_new_tokens=2, do_sample=False):
        wrapped.moes[0].router_logits.save()
    given = GenerationConfig(max_new_tokens=2, do_sample=False)
    with torch.no_grad(), wrapped.generate(PROMPT, generation_config=given):
        wrapped.moes[0].router_logits.save()
    assert len(calls) == 2
    assert [compile_disabled(kwargs) for kwargs in calls] == [True, True]
