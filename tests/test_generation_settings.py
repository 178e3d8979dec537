"""Generation settings moelens passes on to transformers' ``generate``.

Ground truth: the plain transformers model (an unwrapped copy) generating with the same settings, its
experts' inputs recorded by a torch forward hook; and the keyword arguments transformers' ``generate``
itself receives (a spy on the model's ``generate``).
"""

from __future__ import annotations

import copy

import pytest
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


def test_a_generation_config_given_positionally_is_refused():
    """model.generate(ids, GenerationConfig(num_beams=3, ...)) generated greedily with the model's own settings
    (nnsight took the config for a part of the prompt), ignoring it silently."""
    wrapped = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    config = GenerationConfig(num_beams=3, do_sample=False, max_new_tokens=3, min_new_tokens=3)
    with pytest.raises(moelens.MoelensError, match=r"pass it by name, model\.generate\(prompt, generation_config=config\)"):
        with torch.no_grad(), wrapped.generate(PROMPT, config):
            pass
    with torch.no_grad(), wrapped.generate(PROMPT, generation_config=config) as tracer:
        result = tracer.result.save()
    assert result.shape == (1, PROMPT.shape[1] + 3)


def _converted_t5(top_k: int = 2) -> torch.nn.Module:
    """A T5 whose FFN linears compress converted (2 encoder, 2 decoder layers; 4 experts, ``top_k``)."""
    from transformers import T5Config, T5ForConditionalGeneration

    from moelens.compress import tomoe

    def ids(batch: int, length: int, seed: int) -> torch.Tensor:
        return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, decoder_start_token_id=0)
    return tomoe(T5ForConditionalGeneration(config).eval(), num_experts=4, top_k=top_k, max_error=None, progress=False,
                 calibration={"input_ids": ids(8, 16, 0), "decoder_input_ids": ids(8, 8, 1)}, target_modules=["wi"])


def test_an_encoders_values_under_beams_are_the_prompts():
    """generate runs an encoder once on the prompts, before it repeats each prompt for beams: an encoder block's
    mlp_output [2, 5, H] was refused as sequence-first (a 4-row batch expected), and its flat router logits
    (10 tokens) were cut as 4 rows of 2 tokens. Ground truth: forward hooks on an unwrapped copy."""
    converted = _converted_t5()
    prompts = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(converted)
    block = reference.get_submodule("encoder.block.0.layer.1.DenseReluDense.wi")
    seen = {}

    def record(name: str, index: int | None = None):
        def hook(module, args, output) -> None:  # returns None: the output is the model's
            seen.setdefault(name, (output if index is None else output[index]).clone())
        return hook

    hooks = [block.register_forward_hook(record("output")), block.router.register_forward_hook(record("logits", 0))]
    try:
        with torch.no_grad():
            expected = reference.generate(prompts, max_new_tokens=2, num_beams=2, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    wrapped = moelens.wrap(converted, tokenizer=ascii_tokenizer())
    encoder = wrapped.moes[0]
    assert encoder.path.endswith("encoder.block.0.layer.1.DenseReluDense.wi") and encoder.runs_before_expansion
    assert not wrapped.moes[-1].runs_before_expansion  # a decoder block
    with torch.no_grad(), wrapped.generate(prompts, max_new_tokens=2, num_beams=2, do_sample=False) as tracer:
        logits = encoder.router_logits.save()
        output = encoder.mlp_output.save()
        generated = tracer.result.save()
    torch.testing.assert_close(output, seen["output"], rtol=0, atol=0)
    torch.testing.assert_close(logits, seen["logits"].view(2, 5, -1), rtol=0, atol=0)
    assert torch.equal(generated, expected)


def _tiny_llava(image_size: int) -> torch.nn.Module:
    """A seeded tiny Llava (CLIP tower of 8-pixel patches, image token 99), in eval mode."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       image_size=image_size, patch_size=8),
        text_config=LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        image_token_index=99, vision_feature_layer=-1, vision_feature_select_strategy="full")
    return LlavaForConditionalGeneration(config).eval()


def test_a_vision_towers_mlp_under_beams_is_served_per_image():
    """Llava's vision tower runs on the prompts' images before generate repeats them for beams: its dense MLP's
    [2, patches, H] output was refused as not batch-major (a 4-row batch expected). Ground truth: a forward hook
    on an unwrapped copy; zeroing it changes the generation as the same edit by a hook does."""
    hf = _tiny_llava(image_size=16)
    inputs = dict(input_ids=torch.tensor([[5] + [99] * 5 + [6, 7, 8]] * 2),
                  pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2)))
    settings = dict(max_new_tokens=3, num_beams=2, do_sample=False)
    reference = copy.deepcopy(hf)
    mlp = reference.model.vision_tower.encoder.layers[0].mlp
    seen = []
    hook = mlp.register_forward_hook(lambda module, args, output: seen.append(output.clone()) and None)
    try:
        with torch.no_grad():
            reference.generate(**inputs, **settings)
    finally:
        hook.remove()
    hook = mlp.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    try:
        with torch.no_grad():
            zeroed = reference.generate(**inputs, **settings)
    finally:
        hook.remove()
    with pytest.warns(UserWarning, match="found no MoE block"):
        wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    vision = wrapped.model.vision_tower.encoder.layers[0].mlp
    with torch.no_grad(), wrapped.generate(**inputs, **settings):
        output = vision.mlp_output.save()
    assert output.shape[0] == 2 and len(seen) == 1
    torch.testing.assert_close(output, seen[0], rtol=0, atol=0)
    with torch.no_grad(), wrapped.generate(**inputs, **settings) as tracer:
        vision.mlp_output = torch.zeros_like(vision.mlp_output)
        generated = tracer.result.save()
    assert torch.equal(generated, zeroed)


def test_an_encoders_top_1_single_token_activations_under_beams_are_refused_as_without():
    """Two invokes of one-token prompts, top-1 routing, grouped_mm: nnsight cuts the expert-sorted rows by invoke,
    which moelens refuses with a ValueUnavailable; under beams an encoder's rows were counted as prompt x beam rows,
    the refusal was skipped and the cut permutation inverted (a raw RuntimeError: index 2 is out of bounds)."""
    wrapped = moelens.wrap(_converted_t5(top_k=1), tokenizer=ascii_tokenizer())
    encoder = wrapped.moes[0]
    for beams in (1, 2):
        with pytest.raises(moelens.ValueUnavailable, match=r"expert_activations cannot be served: in a batched "
                                                           r"single-token step with top-1 routing"):
            with torch.no_grad(), wrapped.generate(max_new_tokens=2, num_beams=beams, do_sample=False) as tracer:
                with tracer.invoke(torch.tensor([[5], [9]])):
                    encoder.expert_activations.save()
                with tracer.invoke(torch.tensor([[17]])):
                    encoder.expert_activations.save()


def test_a_vision_towers_moe_block_under_beams_is_served_per_image():
    """A Llava whose vision tower's first fc1 compress converted: under num_beams=2 its flat router logits (1 image
    of 10 patch tokens) were cut as 2 beam rows of 5 tokens, while its mlp_output was [1, 10, H]. Ground truth:
    forward hooks on an unwrapped copy."""
    from moelens.compress import tomoe

    converted = tomoe(_tiny_llava(image_size=24), num_experts=4, top_k=2, max_error=None,
                      progress=False, target_modules=r".*vision_tower.*layers\.0\.mlp\.fc1")
    inputs = dict(input_ids=torch.tensor([[5] + [99] * 10 + [6, 7, 8]]),
                  pixel_values=torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(2)))
    reference = copy.deepcopy(converted)
    block = reference.model.vision_tower.encoder.layers[0].mlp.fc1
    seen = {}
    hook = block.router.register_forward_hook(lambda module, args, output: [seen.setdefault("logits", output[0]), None][1])
    try:
        with torch.no_grad():
            reference(**inputs)
    finally:
        hook.remove()
    wrapped = moelens.wrap(converted, tokenizer=ascii_tokenizer())
    vision = wrapped.moes[0]
    assert vision.path.endswith("vision_tower.encoder.layers.0.mlp.fc1") and vision.runs_before_expansion
    assert not any(moe.runs_before_expansion for moe in wrapped.moes[1:])
    with torch.no_grad(), wrapped.generate(**inputs, max_new_tokens=2, num_beams=2, do_sample=False):
        logits = vision.router_logits.save()
    torch.testing.assert_close(logits, seen["logits"].view(1, 10, 4), rtol=0, atol=0)


def test_a_sequence_first_decoder_under_beams_is_still_refused():
    """XLNet runs its layers [seq, batch, hidden]: under num_beams=2 a one-token prompt's block output [1, 2, H] (2
    beam rows) was taken for one prompt's [batch 1, seq 2] and served, where the batch-major check refuses it."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    from moelens.compress import tomoe

    torch.manual_seed(0)
    model = XLNetLMHeadModel(XLNetConfig(vocab_size=128, d_model=32, n_layer=2, n_head=4, d_inner=48, pad_token_id=0,
                                         eos_token_id=2, bos_token_id=1)).eval()
    wrapped = moelens.wrap(tomoe(model, num_experts=4, top_k=2, max_error=None, progress=False,
                                 target_modules=["layer_1"]), tokenizer=ascii_tokenizer())
    prompt = torch.tensor([[40]])
    with pytest.raises(moelens.FamilyError, match=r"first dim is not the batch of 2 \(they are sequence-first"):
        with torch.no_grad(), wrapped.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                                               num_beams=2, do_sample=False):
            wrapped.moes[0].mlp_output.save()


def test_a_generate_output_read_in_one_of_several_invokes_is_that_invokes_rows():
    """With return_dict_in_generate, tracer.result read in one of several invokes failed with transformers'
    "missing 1 required positional argument: 'sequences'" (nnsight narrows a dict by copying it, and generate's
    outputs take their sequences by name). The truth: the plain model generating the same left-padded batch."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    short = torch.tensor([[40, 41, 42]])
    settings = {"max_new_tokens": 2, "do_sample": False, "return_dict_in_generate": True, "output_scores": True,
                "pad_token_id": 0}
    with torch.no_grad(), wrapped.generate(**settings) as tracer:
        with tracer.invoke(short):
            first = tracer.result.save()
        with tracer.invoke(PROMPT):
            second = tracer.result.save()
    padded = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1), PROMPT])
    with torch.no_grad():
        expected = reference.generate(padded, attention_mask=(padded != 0).long(), **settings)
    assert type(first) is type(expected)
    for row, output in enumerate((first, second)):
        assert torch.equal(output.sequences, expected.sequences[row:row + 1])
        for step, scores in enumerate(output.scores):
            torch.testing.assert_close(scores, expected.scores[step][row:row + 1])


def test_a_beam_generate_output_read_in_one_of_several_invokes_is_refused():
    """Under beams (or returned sequences) generate's fields hold several rows per prompt: cut by nnsight's rule, a
    result read in an invoke had its one-row-per-prompt fields cut and the others whole, silently mixed. Refused;
    read in an empty invoke it holds every prompt's rows (the truth: the plain model's generation)."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    short = torch.tensor([[40, 41, 42]])
    settings = {"max_new_tokens": 2, "do_sample": False, "num_beams": 3, "return_dict_in_generate": True,
                "output_scores": True, "pad_token_id": 0}
    with pytest.raises(moelens.MoelensError, match=r"tracer.result of a generation with several rows per prompt .* "
                                                   r"read it in an empty tracer.invoke\(\)"):
        with torch.no_grad(), wrapped.generate(**settings) as tracer:
            with tracer.invoke(short):
                tracer.result.save()
            with tracer.invoke(PROMPT):
                pass
    with torch.no_grad(), wrapped.generate(**settings) as tracer:
        with tracer.invoke(short):
            pass
        with tracer.invoke(PROMPT):
            pass
        with tracer.invoke():  # every prompt's rows
            result = tracer.result.save()
    padded = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1), PROMPT])
    with torch.no_grad():
        expected = reference.generate(padded, attention_mask=(padded != 0).long(), **settings)
    assert torch.equal(result.sequences, expected.sequences)
